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

try:  # Triton comes with PyTorch's CUDA wheels; the CPU build has none (no kernel launches then)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


@dataclass(frozen=True)
class Launch:
    """One kernel launch: ``kernel[grid](*args, **kwargs)``."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


_recorded: list[Launch] | None = None
_pdl = False


def use_pdl(on: bool) -> None:
    """Launch every kernel with programmatic dependent launch (Hopper and later): a kernel's
    programs are scheduled while the one before it in the stream finishes, and wait for it
    (``gdc_enter``) before they touch memory, which hides most of the launch gap between two
    dependent kernels (also inside a CUDA graph). Set before the kernels are compiled and
    graphs captured (start-up, the thread that owns CUDA); a kernel's compiled form depends on
    it (``USE_GDC``)."""
    global _pdl
    _pdl = on


def pdl_enabled() -> bool:
    return _pdl


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """Launch ``kernel`` on ``grid`` (its last constexpr ``USE_GDC`` is set here, see
    :func:`use_pdl`); inside :func:`recording`, record the launch instead."""
    kwargs["USE_GDC"] = _pdl
    if _recorded is not None:
        _recorded.append(Launch(kernel, grid, args, kwargs))
        return
    if _pdl:
        kernel[grid](*args, launch_pdl=True, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


#: The first statement of every kernel :func:`launch` runs (a Triton function; None without Triton).
gdc_enter: Any = None

if triton is not None:

    @triton.jit
    def _gdc_enter(USE_GDC: tl.constexpr):  # type: ignore[no-untyped-def]
        """A kernel's first statement: with PDL, wait until the kernel before it in the stream
        has finished and its writes are visible (every read and write comes after this, so
        nothing races it), then let the next kernel's programs be scheduled."""
        if USE_GDC:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    gdc_enter = _gdc_enter


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
