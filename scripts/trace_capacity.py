"""Where a capacity round's slowest first audio went: every stream's TTFA as the listener saw
it, split at the engine's own marks, and the worker steps it waited through.

Loads the engine like ``voice-out bench`` (random full-size weights, forced tokens, CUDA graphs
as configured), runs ``--warm`` capacity rounds, then ``--rounds`` more of ``--streams``
streams (started over ``--ramp`` seconds, as ``--scenarios capacity`` runs them), and prints:

* per round, the listeners' TTFA p50/p95/max;
* for the ``--worst`` slowest streams of each round, the TTFA split into: ``inbox`` (the
  first text pushed -> the worker applied it), the engine's phases (``FirstAudioTrace``: slot,
  tokens, queue, vocode) and ``outbox`` (the worker had the audio -> the listener got it);
* for each of those, the worker's steps from its first text to its first audio: start (ms
  from the first text), duration, admissions, LLM rows, chunks (``s`` a first chunk, ``c<i>`` a
  later one, ``F`` a final one, with its tokens), and whether the step waited for token2wav.

No synchronisation is added: the figures are the host's. Every time is the engine's clock
(``time.monotonic``, the event loop's too).

    python scripts/trace_capacity.py --model random:0.5b --device cuda --streams 16 --rounds 6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from voice_out.bench import engine_bench as eb  # noqa: E402
from voice_out.bench.listener import percentile, run_stream  # noqa: E402
from voice_out.bench.timing import save_out  # noqa: E402
from voice_out.engine.engine import Engine  # noqa: E402
from voice_out.engine.request import Request  # noqa: E402
from voice_out.engine.runner import Runner  # noqa: E402
from voice_out.engine.scheduler import Scheduler, StepPlan, StepResult  # noqa: E402


@dataclass
class Step:
    t0: float
    t1: float
    admits: int
    rows: int
    chunks: list[str]
    wait: bool
    inflight: int


@dataclass
class Marks:
    """One request's engine times (monotonic seconds)."""

    text: float
    admit: float
    ready: float
    planned: float
    audio: float


@dataclass
class Log:
    steps: list[Step] = field(default_factory=list)
    marks: dict[str, Marks] = field(default_factory=dict)
    ids: dict[int, str] = field(default_factory=dict)  # seed -> stream id


def chunk_tag(index: int, finalize: bool, tokens: int) -> str:
    kind = "F" if finalize else ("s" if index == 0 else f"c{index}")
    return f"{kind}{tokens}"


def instrument(engine: Engine, log: Log) -> None:
    execute = Runner.execute

    def timed_execute(self: Runner, plan: StepPlan) -> StepResult:
        t0 = time.monotonic()
        res = execute(self, plan)
        chunks = [chunk_tag(w.chunk.index, w.chunk.finalize, w.chunk.token_len) for w in plan.vocode]
        rows = len(plan.llm)
        log.steps.append(Step(t0, time.monotonic(), len(plan.admit), rows, chunks, plan.wait_vocode, len(res.inflight)))
        return res

    Runner.execute = timed_execute  # type: ignore[method-assign]
    trace = Scheduler._trace_first_audio

    def marked(self: Scheduler, req: Request, audio: float) -> None:
        start = req.first_text_time if req.first_text_time is not None else req.arrival_time
        log.marks[req.request_id] = Marks(
            text=start,
            admit=req.admit_time or start,
            ready=req.first_chunk_ready_time or audio,
            planned=req.first_chunk_plan_time or audio,
            audio=audio,
        )
        trace(self, req, audio)

    Scheduler._trace_first_audio = marked  # type: ignore[method-assign]
    open_stream = engine.open_stream

    def recorded(*args: Any, **kw: Any) -> Any:
        stream = open_stream(*args, **kw)
        log.ids[int(kw.get("seed", 0))] = stream.id
        return stream

    engine.open_stream = recorded  # type: ignore[method-assign]


async def one_round(engine: Engine, n: int, text: str, ramp_s: float) -> list[tuple[int, float, float]]:
    """(stream index, t_text, t_first) per stream that spoke."""
    tasks = [run_stream(engine, i, text, 0.0, ramp_s * i / n) for i in range(n)]
    lis = await asyncio.gather(*tasks)
    await engine.await_idle()
    return [(i, x.t_text, x.t_first) for i, x in enumerate(lis) if x.t_first is not None]


def describe(log: Log, sid: str, t_text: float, t_first: float) -> dict[str, Any]:
    m = log.marks.get(sid)
    out: dict[str, Any] = {"ttfa_ms": round(1e3 * (t_first - t_text), 1)}
    if m is not None:
        out.update(
            inbox=round(1e3 * (m.text - t_text), 1),
            slot=round(1e3 * (m.admit - m.text), 1),
            tokens=round(1e3 * (min(max(m.ready, m.admit), m.planned) - m.admit), 1),
            queue=round(1e3 * (m.planned - min(max(m.ready, m.admit), m.planned)), 1),
            vocode=round(1e3 * (m.audio - m.planned), 1),
            outbox=round(1e3 * (t_first - m.audio), 1),
        )
    out["steps"] = [
        f"{1e3 * (s.t0 - t_text):7.1f} +{1e3 * (s.t1 - s.t0):5.1f} a{s.admits} r{s.rows:<2d} "
        f"[{' '.join(s.chunks)}]{' wait' if s.wait else ''} inflight {s.inflight}"
        for s in log.steps
        if s.t1 >= t_text and s.t0 <= t_first
    ]
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="random:0.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--warm", type=int, default=1)
    p.add_argument("--worst", type=int, default=2)
    p.add_argument("--ramp", type=float, default=1.0)
    p.add_argument("--chars", type=int, default=100)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="config override")
    args = p.parse_args()
    opts = eb.EngineBenchOptions(streams=(args.streams,), capacity_chars=args.chars, ramp_s=args.ramp)
    engine = eb.engine_from_args(args.model, args.device, args.set, opts)
    text = eb.text_of(args.chars)
    log = Log()
    engine.start()
    rounds: list[dict[str, Any]] = []
    try:

        async def run() -> None:
            for _ in range(args.warm):
                await one_round(engine, args.streams, text, args.ramp)
            instrument(engine, log)
            for r in range(args.rounds):
                log.steps.clear()
                got = await one_round(engine, args.streams, text, args.ramp)
                ttfa = [1e3 * (f - t) for _, t, f in got]
                worst = sorted(got, key=lambda g: g[1] - g[2])[: args.worst]
                rounds.append(
                    {
                        "round": r,
                        "p50": round(percentile(ttfa, 0.5), 1),
                        "p95": round(percentile(ttfa, 0.95), 1),
                        "max": round(max(ttfa), 1),
                        "all": sorted(round(x, 1) for x in ttfa),
                        "worst": [{"stream": i, **describe(log, log.ids[1000 + i], t, f)} for i, t, f in worst],
                    }
                )

        asyncio.run(run())
    finally:
        engine.close()
    for r in rounds:
        print(f"round {r['round']}: p50 {r['p50']} p95 {r['p95']} max {r['max']} ms; all {r['all']}")
        for w in r["worst"]:
            parts = {k: v for k, v in w.items() if k not in ("steps", "stream")}
            print(f"  stream {w['stream']}: {json.dumps(parts)}")
            for line in w["steps"]:
                print(f"    {line}")
    save_out("capacity_trace.json", {"args": vars(args), "rounds": rounds}, indent=1)


if __name__ == "__main__":
    main()
