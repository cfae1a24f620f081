"""Where a long utterance's time goes on the GPU: one stream, read as fast as it comes, traced.

``voice-out bench --scenarios rtf`` gives one number (synthesis time / audio time). This script
loads the engine the same way (random full-size weights, forced tokens, CUDA graphs as
configured), runs the same long utterance untraced (``--reps`` times: its RTF), then once under
the torch profiler (CUDA activity, no synchronisation added) and prints:

* the utterance's wall time and, per CUDA stream, its kernel count, busy time (overlaps merged)
  and its largest kernels by name;
* the time the GPU spent with exactly one stream busy, with two or more at once, and idle:
  whether the LLM's steps and the token2wav chunks overlap, or take turns;
* the LLM stream's busy time inside and outside the other streams' busy spans, and its
  kernels' mean duration in each (how much a chunk beside it slows the steps down).

    python scripts/trace_rtf.py --model random:0.5b --device cuda [--chars 400] [--set SECTION.FIELD=VALUE]

Writes ``$OUT/rtf_trace.json`` (the summary) when ``$OUT`` is set.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from voice_out.bench import engine_bench as eb  # noqa: E402
from voice_out.bench.timing import save_out  # noqa: E402
from voice_out.bench.trace import Span, chrome_trace, merged  # noqa: E402
from voice_out.engine.engine import Engine  # noqa: E402

MARK = "rtf_utterance"


def total(spans: list[Span]) -> float:
    return sum(e - s for s, e in spans)


def intersect(a: list[Span], b: list[Span]) -> list[Span]:
    """Intersection of two sorted unions of spans."""
    out: list[Span] = []
    i = j = 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def coverage(kernels: list[Span], spans: list[Span]) -> tuple[float, int, float, int]:
    """(time, count) of ``kernels`` whose start lies inside ``spans`` and outside them."""
    starts = [s for s, _ in spans]
    t_in = t_out = 0.0
    n_in = n_out = 0
    for s, e in kernels:
        k = bisect.bisect_right(starts, s) - 1
        if k >= 0 and s < spans[k][1]:
            t_in, n_in = t_in + e - s, n_in + 1
        else:
            t_out, n_out = t_out + e - s, n_out + 1
    return t_in, n_in, t_out, n_out


def analyse(trace: dict[str, Any]) -> dict[str, Any]:
    """The summary of a chrome trace's GPU events inside the ``MARK`` range (times in us)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    mark = next(e for e in events if e.get("name") == MARK)
    t0, t1 = float(mark["ts"]), float(mark["ts"]) + float(mark["dur"])
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and t0 <= float(e["ts"]) < t1]
    by_stream: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for g in gpu:
        by_stream[int(g.get("args", {}).get("stream", -1))].append(g)
    streams: dict[int, list[Span]] = {}
    raw: dict[int, list[Span]] = {}
    per_stream: list[dict[str, Any]] = []
    for sid, evs in sorted(by_stream.items(), key=lambda kv: -len(kv[1])):
        spans = [(float(g["ts"]), float(g["ts"]) + float(g["dur"])) for g in evs]
        raw[sid] = sorted(spans)
        streams[sid] = merged(spans)
        names: dict[str, list[float]] = defaultdict(list)
        for g in evs:
            names[g["name"][:60]].append(float(g["dur"]))
        top = sorted(names.items(), key=lambda kv: -sum(kv[1]))[:8]
        per_stream.append(
            {
                "stream": sid,
                "kernels": len(evs),
                "busy_ms": round(total(streams[sid]) / 1e3, 3),
                "kernel_ms": round(sum(e - s for s, e in spans) / 1e3, 3),
                "top": [(n, len(d), round(sum(d) / 1e3, 3)) for n, d in top],
            }
        )
    # time with k streams busy: sweep over every span's edges
    edges: list[tuple[float, int]] = []
    for spans in streams.values():
        for s, e in spans:
            edges += [(s, 1), (e, -1)]
    edges.sort()
    by_depth: dict[int, float] = defaultdict(float)
    depth, last = 0, t0
    for t, d in edges:
        by_depth[depth] += t - last
        depth, last = depth + d, t
    by_depth[depth] += t1 - last
    out: dict[str, Any] = {
        "wall_ms": round((t1 - t0) / 1e3, 3),
        "idle_ms": round(by_depth.get(0, 0.0) / 1e3, 3),
        "one_stream_busy_ms": round(by_depth.get(1, 0.0) / 1e3, 3),
        "several_streams_busy_ms": round(sum(v for k, v in by_depth.items() if k >= 2) / 1e3, 3),
        "streams": per_stream,
    }
    if len(streams) >= 2:
        # the stream with the most kernels is the LLM's (~130 a step, thousands of steps)
        main = per_stream[0]["stream"]
        others = merged([s for sid, spans in streams.items() if sid != main for s in spans])
        t_in, n_in, t_out, n_out = coverage(raw[main], others)
        out["llm_stream"] = main
        out["llm_busy_beside_others_ms"] = round(total(intersect(streams[main], others)) / 1e3, 3)
        out["others_busy_ms"] = round(total(others) / 1e3, 3)
        out["llm_kernel_us_mean_beside_others"] = round(t_in / max(n_in, 1), 2)
        out["llm_kernel_us_mean_alone"] = round(t_out / max(n_out, 1), 2)
        out["llm_kernels_beside_others"] = n_in
    return out


async def utterance(engine: Engine, chars: int) -> tuple[float, float]:
    """One long utterance read as fast as it comes (``--scenarios rtf``'s) -> (RTF, seconds of audio)."""
    lis, _ = await eb.long_utterance(engine, chars, timeout_s=600.0)
    assert lis.rtf is not None
    return lis.rtf, lis.audio_s


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="random:0.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompt-tokens", type=int, default=150)
    p.add_argument("--chars", type=int, default=400)
    p.add_argument("--reps", type=int, default=3, help="untraced utterances (their RTF is printed)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="config override")
    args = p.parse_args()
    opts = eb.EngineBenchOptions(streams=(1,), prompt_tokens=args.prompt_tokens, long_chars=args.chars)
    engine = eb.engine_from_args(args.model, args.device, args.set, opts)
    engine.start()
    try:

        async def run() -> tuple[list[float], float, float, Any]:
            rtfs = [(await utterance(engine, args.chars))[0] for _ in range(args.reps)]
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            with profile(activities=acts) as prof:
                with record_function(MARK):
                    rtf, audio_s = await utterance(engine, args.chars)
            return rtfs, rtf, audio_s, prof

        rtfs, traced, audio_s, prof = asyncio.run(run())
    finally:
        engine.close()
    trace = chrome_trace(prof)
    res = {
        "rtf_untraced": [round(x, 4) for x in rtfs],
        "rtf_traced": round(traced, 4),
        "audio_s": round(audio_s, 2),
        **analyse(trace),
    }
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    extra = f", {' '.join(args.set)}" if args.set else ""
    print(f"RTF trace, {args.model} on {dev}, prompt {args.prompt_tokens} tokens, {args.chars} chars{extra}")
    print(json.dumps(res, indent=1))
    save_out("rtf_trace.json", {"device": dev, "settings": args.set, **res}, indent=1)


if __name__ == "__main__":
    main()
