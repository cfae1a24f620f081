"""Where a capacity round's worker time goes: N streams as ``voice-out bench`` runs them, with
timers on the hot paths.

Loads the engine like ``voice-out bench`` (random full-size weights, forced tokens, CUDA graphs
as configured), wraps the runner's LLM step, the token2wav flow calls (eager single and
batched, graphed batched groups), the vocoder, and graph captures with timers, runs one
capacity round of ``--streams`` streams and prints, per kind of call, the count, the total and
the longest. ``--sync`` makes every timer synchronise the GPU (true per-call GPU cost, but it
serialises the token2wav side stream with the LLM step); without it the figures are host time
(launch cost, and any wait the call itself makes). ``--pipeline`` turns on pipelined token2wav
(``Runner.pipeline_vocode``).

    python scripts/profile_capacity.py --streams 32 --sync
    python scripts/profile_capacity.py --model random:tiny --device cpu --streams 2 --quick
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from voice_out.bench import engine_bench as eb  # noqa: E402
from voice_out.bench.timing import time_method  # noqa: E402
from voice_out.config import load_config, parse_overrides  # noqa: E402
from voice_out.engine.runner import Runner  # noqa: E402
from voice_out.model.cuda_graphs import GraphedFn  # noqa: E402
from voice_out.model.flow import Flow  # noqa: E402
from voice_out.model.token2wav import Token2Wav  # noqa: E402

TIMES: dict[str, list[float]] = {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:0.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--sync", action="store_true", help="timers synchronise the GPU")
    p.add_argument("--pipeline", action="store_true", help="pipelined token2wav (Runner.pipeline_vocode)")
    p.add_argument("--quick", action="store_true", help="short texts and a 25-token prompt (CPU smoke run)")
    args = p.parse_args()
    cfg = load_config(
        None, environ={}, overrides=parse_overrides([f"model.model={args.model}", f"model.device={args.device}"])
    )
    opts = (
        eb.EngineBenchOptions.quick(streams=(args.streams,))
        if args.quick
        else eb.EngineBenchOptions(streams=(args.streams,))
    )
    cfg = eb.bench_config(cfg, opts)
    engine = eb.load_engine(cfg, opts)
    engine.start(timeout=600)
    Runner.pipeline_vocode = args.pipeline
    timer = functools.partial(time_method, times=TIMES, sync=args.sync)
    timer(GraphedFn, "_capture", lambda self, key, a: f"graph capture {self.name}")
    timer(Flow, "inference", lambda self, *a, **k: f"eager flow (finalize={k.get('finalize')})")
    timer(Flow, "inference_batch", lambda self, items: f"eager flow batch of {len(items)}")
    timer(Token2Wav, "_batched_mels", lambda self, chunks, rows: f"batched chunk groups, {len(rows)} rows")
    timer(Token2Wav, "_vocoder", lambda self, mel, src, noise, final: f"vocoder (final={final})")
    timer(Runner, "_llm_step", lambda self, work, res: f"LLM step, {len(work) // 8 * 8}-{len(work) // 8 * 8 + 7} rows")
    try:
        r = asyncio.run(
            eb.capacity_round(engine, args.streams, eb.text_of(opts.capacity_chars), opts, torch.device(args.device))
        )
        summary = f"wall {r.wall_s:.1f} s, step mean {r.mean_step_ms:.1f} ms; {eb.round_summary(r)}"
    finally:
        engine.close()
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{args.streams} streams, {args.model} on {dev}, sync={args.sync}, pipeline={args.pipeline}: {summary}")
    rows = sorted(TIMES.items(), key=lambda kv: -sum(kv[1]))
    for label, v in rows:
        print(f"  {len(v):6d} calls {sum(v):9.1f} ms  max {max(v):8.1f} ms  {label}")
    out = os.environ.get("OUT")
    if out:
        path = Path(out, f"capacity_profile_{args.streams}.json")
        path.write_text(json.dumps({"summary": summary, "calls": {k: v for k, v in rows}}, indent=1))


if __name__ == "__main__":
    main()
