"""Where the worker's host time goes: cProfile around every engine step.

Loads the engine like ``voice-out bench`` (random full-size weights, forced tokens, CUDA graphs
as configured), warms it up, then profiles the worker's steps over ``--reps`` single-stream
utterances with the whole text at once (the TTFA scenario) and prints the step count, the mean
step and the functions with the most time. ``.tolist()`` is the wait for the LLM graph's
sampled tokens, ``Event.synchronize`` the first-chunk wait. With ``--streams N`` it then
profiles one capacity round of N streams too. cProfile in Python 3.12 sees every thread, so
under load the event loop's functions show up as well. ``--set`` takes config overrides.

    python scripts/profile_host.py --model random:0.5b --device cuda
    python scripts/profile_host.py --model random:tiny --device cpu --reps 2 --streams 2
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from voice_out.bench import engine_bench as eb  # noqa: E402
from voice_out.config import load_config, parse_overrides  # noqa: E402
from voice_out.engine.build import resolve_device  # noqa: E402
from voice_out.engine.worker import Worker  # noqa: E402


class StepProfiler:
    """Wraps ``Worker._step``: its duration always, a cProfile of it while ``profile`` is set."""

    def __init__(self) -> None:
        self.profile: cProfile.Profile | None = None
        self.durations: list[float] = []
        inner = Worker._step

        def step(worker: Worker, runner: Any, plan: Any) -> Any:
            prof = self.profile
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            try:
                return inner(worker, runner, plan)
            finally:
                if prof is not None:
                    prof.disable()
                self.durations.append(time.perf_counter() - t0)

        Worker._step = step  # type: ignore[method-assign]

    def start(self) -> None:
        self.profile, self.durations = cProfile.Profile(), []

    def stop(self, title: str, top: int) -> None:
        prof, self.profile = self.profile, None
        assert prof is not None
        n = len(self.durations)
        print(f"== {title}: {n} steps, mean {sum(self.durations) / max(n, 1) * 1e3:.2f} ms")
        for order in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(order).print_stats(top)
            print(f"-- by {order}")
            print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:20000])


async def run(args: argparse.Namespace) -> None:
    sets = [f"model.model={args.model}", f"model.device={args.device}", *args.set]
    cfg = load_config(None, environ={}, overrides=parse_overrides(sets))
    opts = eb.EngineBenchOptions(streams=(max(1, args.streams),))
    cfg = eb.bench_config(cfg, opts)
    engine = eb.load_engine(cfg, opts)
    engine.start(timeout=600)
    profiler = StepProfiler()
    text = eb.text_of(opts.ttfa_chars)
    for i in range(2):  # warm-up
        await eb.first_chunk_s(engine, 100 + i, [text], 0.0, 60)
    profiler.start()
    ttfa = sorted([await eb.first_chunk_s(engine, 1 + i, [text], 0.0, 60) for i in range(args.reps)])
    print(f"TTFA while profiled: p50 {ttfa[len(ttfa) // 2] * 1e3:.1f} ms over {args.reps} utterances")
    profiler.stop("1 stream, whole text", args.top)
    if args.streams > 0:
        profiler.start()
        device = resolve_device(cfg.model.device)
        r = await eb.capacity_round(engine, args.streams, eb.text_of(opts.capacity_chars), opts, device)
        print(f"{args.streams} streams while profiled: {eb.round_summary(r)}")
        profiler.stop(f"{args.streams} streams", args.top)
    engine.close(timeout=60)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:0.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--reps", type=int, default=10, help="profiled single-stream utterances")
    p.add_argument("--streams", type=int, default=0, help="also profile a capacity round of N streams")
    p.add_argument("--top", type=int, default=35, help="functions listed per ordering")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    args = p.parse_args(argv)
    asyncio.run(run(args))
    sys.stdout.flush()
    os._exit(0)  # the engine's worker thread is a daemon; do not wait on interpreter teardown


if __name__ == "__main__":
    main()
