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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from voice_out.bench import engine_bench as eb  # noqa: E402
from voice_out.bench.listener import Listener, percentile  # noqa: E402
from voice_out.bench.timing import save_out  # noqa: E402
from voice_out.engine.engine import Engine  # noqa: E402
from voice_out.engine.request import Request  # noqa: E402
from voice_out.engine.runner import Runner  # noqa: E402
from voice_out.engine.scheduler import FirstAudioTrace, Scheduler, StepPlan, StepResult  # noqa: E402


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
class Log:
    steps: list[Step] = field(default_factory=list)
    audio_at: dict[str, float] = field(default_factory=dict)  # request -> its first audio (engine clock)
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
        step = Step(t0, time.monotonic(), len(plan.admit), len(plan.llm), chunks, plan.wait_vocode, len(res.inflight))
        log.steps.append(step)
        return res

    Runner.execute = timed_execute  # type: ignore[method-assign]
    trace = Scheduler._trace_first_audio

    def marked(self: Scheduler, req: Request, audio: float) -> None:
        log.audio_at[req.request_id] = audio
        trace(self, req, audio)

    Scheduler._trace_first_audio = marked  # type: ignore[method-assign]
    open_stream = engine.open_stream

    def recorded(*args: Any, **kw: Any) -> Any:
        stream = open_stream(*args, **kw)
        log.ids[int(kw.get("seed", 0))] = stream.id
        return stream

    engine.open_stream = recorded  # type: ignore[method-assign]


def describe(log: Log, trace: FirstAudioTrace | None, lis: Listener) -> dict[str, Any]:
    """One stream's TTFA split (ms) and the worker steps from its first text to its first audio."""
    assert lis.t_first is not None
    out: dict[str, Any] = {"ttfa_ms": round(1e3 * (lis.t_first - lis.t_text), 1)}
    if trace is not None:
        outbox = lis.t_first - log.audio_at[trace.request_id]
        inbox = lis.t_first - lis.t_text - outbox - trace.total_s
        parts = (inbox, trace.slot_s, trace.tokens_s, trace.queue_s, trace.vocode_s, outbox)
        names = ("inbox", "slot", "tokens", "queue", "vocode", "outbox")
        out.update({name: round(1e3 * sec, 1) for name, sec in zip(names, parts, strict=True)})
    out["steps"] = [
        f"{1e3 * (s.t0 - lis.t_text):7.1f} +{1e3 * (s.t1 - s.t0):5.1f} a{s.admits} r{s.rows:<2d} "
        f"[{' '.join(s.chunks)}]{' wait' if s.wait else ''} inflight {s.inflight}"
        for s in log.steps
        if s.t1 >= lis.t_text and s.t0 <= lis.t_first
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
    device = torch.device(args.device)
    log = Log()
    engine.start()
    rounds: list[dict[str, Any]] = []
    try:

        async def run() -> None:
            for _ in range(args.warm):
                await eb.capacity_round(engine, args.streams, text, opts, device)
            instrument(engine, log)
            for r in range(args.rounds):
                log.steps.clear()
                got = await eb.capacity_round(engine, args.streams, text, opts, device)
                ttfa = got.ttfa_ms
                if len(ttfa) != args.streams:
                    raise RuntimeError(f"round {r}: {args.streams - len(ttfa)} streams gave no audio")
                traces = {t.request_id: t for t in got.first_audio}
                # the listeners are in stream order (seed 1000 + i), as capacity_round starts them
                order = sorted(range(len(ttfa)), key=lambda i: -ttfa[i])[: args.worst]
                rounds.append(
                    {
                        "round": r,
                        "p50": round(percentile(ttfa, 0.5), 1),
                        "p95": round(percentile(ttfa, 0.95), 1),
                        "max": round(max(ttfa), 1),
                        "all": sorted(round(x, 1) for x in ttfa),
                        "worst": [
                            {"stream": i, **describe(log, traces.get(log.ids[1000 + i]), got.listeners[i])}
                            for i in order
                        ],
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
