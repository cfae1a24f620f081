"""One way to launch the Triton kernels of ``flow_kernels`` and ``decode_kernels``, so that a
start-up can list the launches a model call would make without making them.

Triton compiles a kernel on its first launch with a new specialisation, one after another on
the thread that launches: on a machine whose kernel cache is empty, ~1.3 s each and a dozen of
them before the engine is ready. Inside :func:`recording`, :func:`launch` appends each launch
(kernel, grid, arguments) to a list instead of running it, and the wrappers' outputs stay
uninitialised: a model call made inside it (a "dry run") costs almost nothing and yields every
launch it would make, which the engine then compiles in parallel
(``voice_out.engine.kernels.compile_ahead``) before its real warm-up.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Launch:
    """One kernel launch: ``kernel[grid](*args, **kwargs)``."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


_recorded: list[Launch] | None = None


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """Launch ``kernel`` on ``grid``; inside :func:`recording`, record the launch instead."""
    if _recorded is not None:
        _recorded.append(Launch(kernel, grid, args, kwargs))
        return
    kernel[grid](*args, **kwargs)


@contextmanager
def recording() -> Iterator[list[Launch]]:
    """Record (not run) every :func:`launch` inside the block, into the list yielded. The
    kernels' outputs are left as allocated: results computed inside are garbage. Start-up only,
    on the one thread that owns CUDA (the recording is global)."""
    global _recorded
    if _recorded is not None:
        raise RuntimeError("kernel launches are already being recorded")
    _recorded = []
    try:
        yield _recorded
    finally:
        _recorded = None
