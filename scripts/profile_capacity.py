"""Where a capacity round's worker time goes: N streams as ``voice-out bench`` runs them, with
timers on the hot paths.

Loads the engine like ``voice-out bench`` (random full-size weights, forced tokens, CUDA graphs
as configured), wraps the runner's LLM step, the token2wav flow calls (eager single and
batched, graphed batched groups), the vocoder, and graph captures with timers, runs one
capacity round of ``--streams`` streams and prints, per kind of call, the count, the total and
the longest. ``--sync`` makes every timer synchronise the GPU (true per-call GPU cost, but it
serialises the token2wav side stream with the LLM step); without it the figures are host time
(launch cost, and any wait the call itself makes). ``--no-pipeline`` turns pipelined token2wav
off (the plan's ``pipeline_vocode``, pinned; on by default); ``--llm-priority`` sets the priority of the
runner's own CUDA stream (``Runner.llm_stream_priority``).

Diagnostics for a round that stalls: ``--stall S`` prints the state of both CUDA streams, of
the launches in flight and nvidia-smi whenever no step has finished for S seconds; ``--stacks S``
dumps every thread's Python stack every S seconds; ``--timeout S`` gives up on the round.
``--trace-slow MS`` runs torch's profiler over the 3 steps after the first step slower than MS
(checked on the CPU only: on CUDA the profiler, started on the worker thread, crashed the
process at exit when the round ended before those 3 steps).

    python scripts/profile_capacity.py --streams 32 --stall 2 --timeout 60
    python scripts/profile_capacity.py --streams 32 --sync
    python scripts/profile_capacity.py --streams 16 --warm-rounds 1
    python scripts/profile_capacity.py --model random:tiny --device cpu --streams 2 --quick
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import faulthandler
import functools
import gc
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from voice_out.bench import engine_bench as eb  # noqa: E402
from voice_out.bench.timing import save_out, time_method  # noqa: E402
from voice_out.config import load_config, parse_overrides  # noqa: E402
from voice_out.engine.runner import Runner  # noqa: E402
from voice_out.fast.flow_step import FastToken2Wav  # noqa: E402
from voice_out.fast.graphs import GraphedFn  # noqa: E402
from voice_out.model.flow import Flow  # noqa: E402

TIMES: dict[str, list[float]] = {}
RUNNER: dict[str, Any] = {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:0.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--sync", action="store_true", help="timers synchronise the GPU")
    p.add_argument(
        "--pipeline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pipelined token2wav (the plan's pipeline_vocode; default on)",
    )
    p.add_argument("--quick", action="store_true", help="short texts and a 25-token prompt (CPU smoke run)")
    p.add_argument(
        "--trace-slow",
        type=float,
        default=0.0,
        metavar="MS",
        help="profile (torch.profiler) the 3 steps after the first step slower than MS ms; table and trace to $OUT",
    )
    p.add_argument(
        "--warm-rounds", type=int, default=0, help="unprofiled rounds of the same streams first (first-use costs)"
    )
    p.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after the start (and warm-up rounds)")
    p.add_argument("--llm-priority", default="-1", help="Runner.llm_stream_priority: a CUDA priority, or 'none'")
    p.add_argument("--timeout", type=float, default=0.0, help="give up on the round after this many seconds")
    p.add_argument("--stall", type=float, default=0.0, metavar="S", help="report the GPU state after S s with no step")
    p.add_argument(
        "--stacks", type=float, default=0.0, metavar="S", help="print every thread's stack every S seconds of the round"
    )
    args = p.parse_args()
    sets = [f"model.model={args.model}", f"model.device={args.device}"]
    cfg = load_config(None, environ={}, overrides=parse_overrides(sets))
    opts = (
        eb.EngineBenchOptions.quick(streams=(args.streams,), pins=(("pipeline_vocode", args.pipeline),))
        if args.quick
        else eb.EngineBenchOptions(streams=(args.streams,), pins=(("pipeline_vocode", args.pipeline),))
    )
    cfg = eb.bench_config(cfg, opts)
    Runner.llm_stream_priority = None if args.llm_priority == "none" else int(args.llm_priority)
    engine = eb.load_engine(cfg, opts)
    engine.start(timeout=600)
    for k in range(args.warm_rounds):
        w = asyncio.run(
            eb.capacity_round(engine, args.streams, eb.text_of(opts.capacity_chars), opts, torch.device(args.device))
        )
        print(f"warm-up round {k + 1}: {eb.round_summary(w)}")
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    _time_gc()
    timer = functools.partial(time_method, times=TIMES, sync=args.sync)
    timer(GraphedFn, "__call__", lambda self, key, *a: f"graph call {self.name}")
    timer(Flow, "batch_inputs", lambda self, items: f"flow batch_inputs, {len(items)} rows")
    timer(FastToken2Wav, "_finish_chunk", lambda self, stream, plan, mel: "finish chunk (vocoder, cross-fade)")
    timer(GraphedFn, "_capture", lambda self, key, a: f"graph capture {self.name}")
    timer(Flow, "inference", lambda self, *a, **k: f"eager flow (finalize={k.get('finalize')})")
    timer(Flow, "inference_batch", lambda self, items: f"eager flow batch of {len(items)}")
    timer(FastToken2Wav, "_batched_mels", lambda self, chunks, rows: f"batched chunk groups, {len(rows)} rows")
    timer(FastToken2Wav, "_vocoder", lambda self, mel, src, noise, plan: f"vocoder (final={plan.finalize})")
    timer(Runner, "_llm_step", lambda self, work, res: f"LLM step, {len(work) // 8 * 8}-{len(work) // 8 * 8 + 7} rows")
    timer(Runner, "_launch_vocode", lambda self, vocode, res: f"pipelined launch, {len(vocode)} chunks")
    timer(Runner, "_collect_vocode", lambda self, res, block: f"pipelined collect (block={block})")
    step_ms: list[float] = []
    _watch_steps(step_ms, args.trace_slow)
    if args.stall:
        _watchdog(RUNNER, step_ms, args.stall)
    if args.timeout:
        opts = dataclasses.replace(opts, timeout_s=args.timeout)
    r = None
    if args.stacks:
        faulthandler.dump_traceback_later(args.stacks, repeat=True)
    try:
        r = asyncio.run(
            eb.capacity_round(engine, args.streams, eb.text_of(opts.capacity_chars), opts, torch.device(args.device))
        )
        summary = f"wall {r.wall_s:.1f} s, step mean {r.mean_step_ms:.1f} ms; {eb.round_summary(r)}"
    except TimeoutError:
        summary = f"timed out after {opts.timeout_s:.0f} s"
    finally:
        faulthandler.cancel_dump_traceback_later()
        engine.close()
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(
        f"{args.streams} streams, {args.model} on {dev}, sync={args.sync}, pipeline={args.pipeline}, "
        f"LLM stream priority {args.llm_priority}: {summary}"
    )
    if step_ms:
        q = sorted(step_ms)
        print(
            f"  {len(q)} steps: p50 {q[len(q) // 2]:.1f} ms, p95 {q[int(len(q) * 0.95)]:.1f} ms, "
            f"max {q[-1]:.1f} ms, {sum(1 for x in q if x > 100)} over 100 ms"
        )
    rows = sorted(TIMES.items(), key=lambda kv: -sum(kv[1]))
    for label, v in rows:
        print(f"  {len(v):6d} calls {sum(v):9.1f} ms  max {max(v):8.1f} ms  {label}")
    save_out(f"capacity_profile_{args.streams}.json", {"summary": summary, "calls": dict(rows)}, indent=1)


def _time_gc() -> None:
    """Time Python's garbage collections (any thread: a collection stops them all) per generation."""
    started: dict[str, float] = {}

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started["t"] = time.perf_counter()
        elif "t" in started:
            TIMES.setdefault(f"python gc, generation {info['generation']}", []).append(
                (time.perf_counter() - started.pop("t")) * 1e3
            )

    gc.callbacks.append(on_gc)


def _watch_steps(step_ms: list[float], slow_ms: float) -> None:
    """Time every ``Runner.execute`` (host time, no sync) into ``step_ms``; with ``slow_ms``,
    profile the 3 steps after the first one slower than that, with CPU and CUDA activity."""
    execute = Runner.execute
    state: dict[str, Any] = {"prof": None, "left": 0, "done": False}

    def timed(self: Runner, plan: Any) -> Any:
        RUNNER["runner"] = self
        prof = state["prof"]
        t0 = time.perf_counter()
        out = execute(self, plan)
        ms = (time.perf_counter() - t0) * 1e3
        step_ms.append(ms)
        if len(step_ms) % 100 == 0:
            print(f"{len(step_ms)} steps, {sum(step_ms) / 1e3:.1f} s in them", flush=True)
        if prof is not None:
            state["left"] -= 1
            if state["left"] == 0:
                prof.__exit__(None, None, None)
                _dump_profile(prof)
                state["prof"] = None
        elif slow_ms and not state["done"] and ms > slow_ms:
            print(f"step {len(step_ms)} took {ms:.0f} ms: profiling the next 3", flush=True)
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            state["prof"] = torch.profiler.profile(activities=acts, record_shapes=False)
            state["prof"].__enter__()
            state["left"] = 3
            state["done"] = True
        return out

    Runner.execute = timed  # type: ignore[method-assign]


def _watchdog(runner_box: dict[str, Any], step_ms: list[float], stall_s: float) -> None:
    """Background thread: when no step has finished for ``stall_s`` seconds, print what the
    GPU is doing (stream and in-flight event states, nvidia-smi), then again every 10 s."""

    def run() -> None:
        last_n, last_t, reported = -1, time.perf_counter(), 0.0
        while True:
            time.sleep(0.5)
            now = time.perf_counter()
            if len(step_ms) != last_n:
                last_n, last_t, reported = len(step_ms), now, 0.0
                continue
            if now - last_t < stall_s or now - reported < 10:
                continue
            reported = now
            runner = runner_box.get("runner")
            info = [f"STALL: no step for {now - last_t:.1f} s after step {last_n}"]
            if torch.cuda.is_available():
                info.append(f"  current stream done: {torch.cuda.current_stream().query()}")
            if runner is not None and runner._side_stream is not None:
                info.append(f"  side stream done: {runner._side_stream.query()}")
                info.append(f"  inflight launches: {[f.done.query() for f in runner._inflight]}")
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=utilization.gpu,clocks.sm,power.draw,memory.used", "--format=csv"],
                capture_output=True,
                text=True,
                check=False,
            )
            info.append("  " + smi.stdout.replace("\n", " | "))
            print("\n".join(info), flush=True)

    threading.Thread(target=run, daemon=True).start()


def _dump_profile(prof: Any) -> None:
    cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    print(cpu, flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, "slow_steps_table.txt").write_text(cpu)
        if torch.cuda.is_available():
            Path(out, "slow_steps_cuda.txt").write_text(
                prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40)
            )
        prof.export_chrome_trace(str(Path(out, "slow_steps_trace.json")))


if __name__ == "__main__":
    main()
