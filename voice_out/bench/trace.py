"""Reading torch profiler traces: what the tracing scripts (``scripts/trace_ttfa.py``,
``scripts/trace_rtf.py``) share. No torch import: a profile is passed in."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

Span = tuple[float, float]


def merged(spans: list[Span]) -> list[Span]:
    """The union of [start, end) spans, sorted and disjoint."""
    out: list[Span] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def chrome_trace(prof: Any) -> dict[str, Any]:
    """A finished ``torch.profiler.profile``'s Chrome trace as a dict (``traceEvents`` ...)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace: dict[str, Any] = json.load(f)
    return trace
