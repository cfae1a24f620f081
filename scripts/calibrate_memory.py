"""Device memory of the engine's parts, for the memory plan's estimates (voice_out.fast.plan).

Starts the engine once (random full-size weights by default, as ``voice-out bench`` loads it)
with the engine overrides given, then prints one JSON line: torch's allocated and reserved
bytes after the weights, after start-up and at their peaks (start-up's, then one capacity
round's of ``--streams`` streams), the device memory in use as the driver reports it
(``cudaMemGetInfo``: the CUDA context and every library's allocations included) and the bytes
of each preallocated buffer the runner holds. Run it once per setting in separate processes
and compare: the differences are what each choice costs.

    python scripts/calibrate_memory.py --label base --max-streams 1 --pin capture_tokens=100 \
        --pin capture_batch_tokens=0 --pin first_chunk_prefix_voices=0 --pin flow_state_streams=0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from voice_out.bench import engine_bench as eb  # noqa: E402
from voice_out.bench import parse_pin  # noqa: E402
from voice_out.bench.listener import run_stream  # noqa: E402


def device_used(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free)


def mem(fn: Any, device: torch.device) -> int:
    return int(fn(device)) if device.type == "cuda" else 0


def tensor_bytes(obj: object, seen: set[int]) -> int:
    """Bytes of the distinct device tensors reachable from ``obj`` through attributes, lists,
    tuples and dicts (two levels deep: the buffers a cache object holds)."""
    total = 0
    stack: list[tuple[object, int]] = [(obj, 0)]
    while stack:
        o, depth = stack.pop()
        if isinstance(o, torch.Tensor):
            if o.untyped_storage().data_ptr() not in seen:
                seen.add(o.untyped_storage().data_ptr())
                total += o.untyped_storage().nbytes()
            continue
        if depth > 3:
            continue
        if isinstance(o, dict):
            stack.extend((v, depth + 1) for v in o.values())
        elif isinstance(o, list | tuple):
            stack.extend((v, depth + 1) for v in o)
        elif hasattr(o, "__dict__") and not isinstance(o, torch.nn.Module | type):
            stack.extend((v, depth + 1) for v in vars(o).values())
    return total


def measure(engine: Any, out: dict[str, object], device: torch.device, start_s: float) -> None:
    out["start_s"] = round(start_s, 1)
    out["start_peak_alloc"] = mem(torch.cuda.max_memory_allocated, device)
    out["start_peak_reserved"] = mem(torch.cuda.max_memory_reserved, device)
    out["after_start_alloc"] = mem(torch.cuda.memory_allocated, device)
    out["after_start_reserved"] = mem(torch.cuda.memory_reserved, device)
    out["after_start_used"] = device_used(device)
    out["plan"] = engine.plan.summary()
    runner = engine._worker.runner
    seen: set[int] = set()
    out["weights"] = sum(
        p.untyped_storage().nbytes()
        for m in (runner.llm, runner.t2w.flow, runner.t2w.hift)
        for p in [*m.parameters(), *m.buffers()]
    )
    out["kv_cache"] = tensor_bytes(runner.cache, seen)
    out["first_prefixes"] = tensor_bytes(getattr(runner, "_first_prefixes", {}), seen)
    out["t2w_state_slots"] = tensor_bytes(getattr(runner.t2w, "_state_slots", None), seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:0.5b")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--label", default="run")
    ap.add_argument("--set", action="append", default=[], help="SECTION.FIELD=VALUE")
    ap.add_argument("--pin", action="append", default=[], help="NAME=VALUE: a plan choice by hand")
    ap.add_argument("--streams", type=int, default=0, help="a capacity round of this many streams (0: none)")
    ap.add_argument("--max-streams", type=int, default=1)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)
    opts = eb.EngineBenchOptions(streams=(args.max_streams,), ramp_s=1.0, pins=tuple(parse_pin(p) for p in args.pin))
    out: dict[str, object] = {"label": args.label, "sets": args.set, "pins": args.pin}
    out["context_used"] = device_used(device)
    t0 = time.perf_counter()
    engine = eb.engine_from_args(args.model, args.device, args.set, opts)

    async def run() -> None:
        async with engine:
            measure(engine, out, device, time.perf_counter() - t0)
            if args.streams:
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                text = eb.text_of(100)
                tasks = [run_stream(engine, i, text, 0.0, i / args.streams) for i in range(args.streams)]
                res = await asyncio.gather(*tasks, return_exceptions=True)
                out["serve_failures"] = sum(1 for r in res if isinstance(r, BaseException))
                out["serve_peak_alloc"] = mem(torch.cuda.max_memory_allocated, device)
                out["serve_peak_reserved"] = mem(torch.cuda.max_memory_reserved, device)
                out["serve_used"] = device_used(device)

    asyncio.run(run())
    print("CALIB " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
