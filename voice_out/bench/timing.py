"""Timers for the component scripts under ``scripts/`` (not used by the engine).

* :func:`time_ms`: milliseconds of each of ``iters`` calls of ``fn`` after ``warmup`` calls,
  with CUDA events on a GPU and ``perf_counter`` on the CPU;
* :func:`graph_us`: microseconds per call of ``fn`` replayed from one CUDA graph of many calls
  (host launch cost left out, as the engine's graphs leave it out);
* :func:`time_method`: wrap a method of a class so that every call records its duration under a
  label, and optionally its start on a timeline (optionally synchronising the GPU around it,
  so a call's own GPU work is in its time);
* :func:`save_out`: write a script's result as JSON under ``$OUT``, when set.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def time_ms(
    fn: Callable[[], Any], device: torch.device | str = "cuda", warmup: int = 3, iters: int = 20
) -> list[float]:
    """Milliseconds of each of ``iters`` calls of ``fn`` after ``warmup`` untimed calls."""
    dev = torch.device(device)
    for _ in range(warmup):
        fn()
    out: list[float] = []
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def graph_us(fn: Callable[[], Any], calls: int = 20, reps: int = 20) -> float:
    """Microseconds per call of ``fn``: one CUDA graph of ``calls`` back-to-back calls, replayed
    ``reps`` times; the median. CUDA only."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1000 / calls)
    return statistics.median(times)


def time_method(
    cls: object,
    name: str,
    label: str | Callable[..., str],
    times: dict[str, list[float]],
    *,
    sync: bool = True,
    timeline: list[tuple[float, float, str]] | None = None,
) -> None:
    """Replace ``cls.name`` (a class's or a module's function) by a wrapper that appends each
    call's milliseconds to ``times[label]`` (``label(*args, **kwargs)`` when callable), and
    with ``timeline`` (start, duration, label) in perf_counter seconds as well. With ``sync``
    (and CUDA) the GPU is synchronised before and after the call. A missing method is left
    alone."""
    fn = getattr(cls, name, None)
    if fn is None:
        return
    cuda = sync and torch.cuda.is_available()

    def timed(*args: Any, **kw: Any) -> Any:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        if cuda:
            torch.cuda.synchronize()
        dur = time.perf_counter() - t0
        key = label(*args, **kw) if callable(label) else label
        times.setdefault(key, []).append(dur * 1e3)
        if timeline is not None:
            timeline.append((t0, dur, key))
        return out

    setattr(cls, name, timed)


def save_out(name: str, doc: Any, *, indent: int = 2) -> Path | None:
    """Write ``doc`` as JSON to ``$OUT/name`` (the folder is created) and say so; None, and
    nothing written, when ``OUT`` is not set."""
    out = os.environ.get("OUT")
    if not out:
        return None
    path = Path(out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=indent) + "\n")
    print(f"wrote {path}")
    return path
