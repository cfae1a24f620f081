"""Where the GPU sits idle on the way to first audio: one stream, whole text, traced unsynchronised.

``profile_ttfa.py`` times the runner's phases with synchronising timers, which hides the gaps
between them. This script loads the engine like ``voice-out bench`` (random full-size weights,
forced tokens, CUDA graphs as configured), warms it, then records ONE utterance to its first
chunk with the torch profiler (CPU and CUDA activity, no synchronisation added) and prints:

* the request's wall time, the GPU's busy time inside it (kernels and copies, overlaps merged)
  and the idle time, split into before the first kernel, between kernels, and after the last;
* the largest idle gaps, each with the kernels on either side and the worker thread's CUDA
  runtime calls inside it (what the host was doing while the GPU waited);
* kernel time by name (top 15).

    python scripts/trace_ttfa.py --model random:0.5b --device cuda [--gaps 25] [--set SECTION.FIELD=VALUE]

Writes ``$OUT/ttfa_trace.json`` (the summary) and ``$OUT/ttfa_trace.chrome.json.gz`` (the
trace, for chrome://tracing or Perfetto) when ``$OUT`` is set.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import importlib
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from voice_out.bench import engine_bench as eb  # noqa: E402
from voice_out.bench.timing import save_out, time_method  # noqa: E402
from voice_out.bench.trace import chrome_trace, merged  # noqa: E402
from voice_out.engine.runner import Runner  # noqa: E402
from voice_out.fast.flow_step import FastToken2Wav  # noqa: E402
from voice_out.fast.graphs import GraphedFn  # noqa: E402
from voice_out.fast.llm_step import PendingIds  # noqa: E402

MARK = "ttfa_request"
#: Host calls the untraced timeline records (``time_method``, no synchronisation: the GPU
#: keeps its own pace): (class, method, label). GraphedFn calls are labelled by the
#: wrapper's name (which graph was replayed).
HOST_CALLS: list[tuple[type, str, str]] = [
    (Runner, "execute", "step"),
    (Runner, "_admit", "admit"),
    (Runner, "_llm_step", "llm_step"),
    (Runner, "_launch_vocode", "launch_vocode"),
    (Runner, "_collect_vocode", "collect_vocode"),
    (PendingIds, "ids", "wait_ids"),
    (FastToken2Wav, "_flow_mel", "flow_mel"),
    (FastToken2Wav, "_vocoder", "vocoder"),
    (GraphedFn, "__call__", "graph"),
]
TIMELINE: list[tuple[float, float, str]] = []


def extra_calls(specs: list[str]) -> list[tuple[type, str, str]]:
    """``module:Class.method`` strings as ``HOST_CALLS`` entries (labelled ``Class.method``)."""
    out: list[tuple[type, str, str]] = []
    for spec in specs:
        module, _, qual = spec.partition(":")
        cls_name, _, method = qual.rpartition(".")
        out.append((getattr(importlib.import_module(module), cls_name), method, qual))
    return out


def host_timeline(t_start: float, t_end: float, min_s: float) -> list[str]:
    """``TIMELINE`` between two perf_counter times, as lines ``start_ms +dur_ms label``: calls
    of at least ``min_s`` seconds, and every step and admission."""
    return [
        f"{1e3 * (t0 - t_start):8.3f} +{1e3 * dur:7.3f} {tag}"
        for t0, dur, tag in sorted(TIMELINE)
        if t_start <= t0 <= t_end and (dur > min_s or tag in ("step", "admit"))
    ]


def analyse(trace: dict[str, Any], n_gaps: int) -> dict[str, Any]:
    """The summary of a chrome trace's events inside the ``MARK`` range (times in us)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    mark = next(e for e in events if e.get("name") == MARK)
    t0, t1 = float(mark["ts"]), float(mark["ts"]) + float(mark["dur"])
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and t0 <= float(e["ts"]) < t1]
    gpu.sort(key=lambda e: float(e["ts"]))
    busy = merged([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu])
    runtime = [e for e in events if e.get("cat") == "cuda_runtime" and t0 <= float(e["ts"]) < t1]
    gaps: list[dict[str, Any]] = []
    prev_end = t0
    prev_name = "(request start)"
    # the name of the kernel that ends each busy span / starts the next
    ends: list[str] = []
    starts: list[str] = []
    for s, e in busy:
        starts.append(next(g["name"] for g in gpu if float(g["ts"]) >= s))
        ends.append(max((g for g in gpu if float(g["ts"]) < e), key=lambda g: float(g["ts"]) + float(g["dur"]))["name"])
    for (s, e), first, last in zip(busy, starts, ends, strict=True):
        if s > prev_end:
            calls = [
                f"{r['name']} ({float(r['dur']):.0f} us)"
                for r in runtime
                if float(r["ts"]) < s and float(r["ts"]) + float(r["dur"]) > prev_end and float(r["dur"]) > 5
            ]
            gaps.append(
                {
                    "at_ms": round((prev_end - t0) / 1e3, 3),
                    "us": round(s - prev_end, 1),
                    "after": prev_name[:80],
                    "before": first[:80],
                    "host_calls": calls[:8],
                }
            )
        prev_end, prev_name = e, last
    busy_us = sum(e - s for s, e in busy)
    first_gpu = busy[0][0] - t0 if busy else 0.0
    last_idle = t1 - busy[-1][1] if busy else 0.0
    by_name: dict[str, list[float]] = defaultdict(list)
    for g in gpu:
        by_name[g["name"][:60]].append(float(g["dur"]))
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:15]
    return {
        "wall_ms": round((t1 - t0) / 1e3, 3),
        "gpu_busy_ms": round(busy_us / 1e3, 3),
        "idle_before_first_kernel_ms": round(first_gpu / 1e3, 3),
        "idle_between_kernels_ms": round((t1 - t0 - busy_us - first_gpu - last_idle) / 1e3, 3),
        "idle_after_last_kernel_ms": round(last_idle / 1e3, 3),
        "kernels": len(gpu),
        "largest_gaps": sorted(gaps, key=lambda g: -g["us"])[:n_gaps],
        "gaps_over_20us": sum(1 for g in gaps if g["us"] > 20),
        "gap_us_over_20us": round(sum(g["us"] for g in gaps if g["us"] > 20), 1),
        "kernel_ms_by_name": [(name, len(d), round(sum(d) / 1e3, 3)) for name, d in top],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="random:0.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompt-tokens", type=int, default=150)
    p.add_argument("--chars", type=int, default=100)
    p.add_argument("--min-us", type=float, default=50.0, help="host calls shorter than this are not listed")
    p.add_argument("--gaps", type=int, default=25, help="how many of the largest gaps to print")
    p.add_argument(
        "--wrap",
        action="append",
        default=[],
        metavar="MODULE:CLASS.METHOD",
        help="also put this method's calls on the host timeline",
    )
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="config override")
    args = p.parse_args()
    opts = eb.EngineBenchOptions(streams=(1,), prompt_tokens=args.prompt_tokens, ttfa_chars=args.chars)
    engine = eb.engine_from_args(args.model, args.device, args.set, opts)
    text = eb.text_of(args.chars)
    warm: list[float] = []
    engine.start()
    try:

        async def run() -> tuple[float, dict[str, Any]]:
            for _ in range(12):  # warm (the first captures this prompt length's graphs); printed
                warm.append(1e3 * await eb.first_chunk_s(engine, 0, [text], 0.0, timeout_s=120.0))
            for cls, name, label in HOST_CALLS + extra_calls(args.wrap):
                tag = (lambda g, *_a, **_k: f"graph:{g.name}") if cls is GraphedFn else label
                time_method(cls, name, tag, {}, sync=False, timeline=TIMELINE)
            t_start = time.perf_counter()
            host_ms = 1e3 * await eb.first_chunk_s(engine, 0, [text], 0.0, timeout_s=120.0)
            timeline = host_timeline(t_start, t_start + host_ms / 1e3, args.min_us * 1e-6)
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            with profile(activities=acts) as prof:
                with record_function(MARK):
                    ttfa = await eb.first_chunk_s(engine, 0, [text], 0.0, timeout_s=120.0)
            return 1e3 * ttfa, prof, host_ms, timeline

        ttfa_ms, prof, host_ms, timeline = asyncio.run(run())
    finally:
        engine.close()
    trace = chrome_trace(prof)
    out = os.environ.get("OUT")
    if out:
        with gzip.open(os.path.join(out, "ttfa_trace.chrome.json.gz"), "wt") as f:
            json.dump(trace, f)
    res = {
        "ttfa_ms_untraced": [round(x, 1) for x in warm[2:]],
        "ttfa_ms_host_timeline": round(host_ms, 2),
        "ttfa_ms_traced": round(ttfa_ms, 2),
        **analyse(trace, args.gaps),
        "host_timeline": timeline,
    }
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    extra = f", {' '.join(args.set)}" if args.set else ""
    print(f"TTFA trace, {args.model} on {dev}, prompt {args.prompt_tokens} tokens{extra}")
    print(json.dumps({k: v for k, v in res.items() if k != "host_timeline"}, indent=1))
    print(f"host timeline of the untraced utterance (ms from its first delta; calls over {args.min_us:g} us):")
    print("\n".join(timeline))
    save_out("ttfa_trace.json", {"device": dev, **res}, indent=1)


if __name__ == "__main__":
    main()
