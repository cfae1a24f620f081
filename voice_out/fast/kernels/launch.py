"""One way to launch the Triton kernels of ``flow_kernels`` and ``decode_kernels``, so that a
start-up can list the launches a model call would make without making them; and the
programmatic dependent launch of the decode step's kernels.

Triton compiles a kernel on its first launch with a new specialisation, one after another on
the thread that launches: on a machine whose kernel cache is empty, ~1.3 s each and a dozen of
them before the engine is ready. Inside :func:`recording`, :func:`launch` appends each launch
(kernel, grid, arguments) to a list instead of running it, and the wrappers' outputs stay
uninitialised: a model call made inside it (a "dry run") costs almost nothing and yields every
launch it would make, which the engine then compiles in parallel
(``voice_out.fast.kernels.precompile.compile_ahead``) before its real warm-up.

Programmatic dependent launch (PDL, Hopper and later): a kernel launched with ``pdl_options(True)``
is started while the kernel before it in the stream still runs, as soon as that one's programs
have passed their own :func:`await_previous`, and waits inside (:func:`await_previous`, before
it reads or writes any memory) for that kernel to finish and its writes to be visible. A chain
of such kernels then hides each launch's latency behind the kernel before it. Each kernel waits
for its predecessor, so every earlier kernel has finished by then too; a kernel launched without
it (a library kernel) waits as always.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

try:  # Triton comes with PyTorch's CUDA wheels; the CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None


@dataclass(frozen=True)
class Launch:
    """One kernel launch: ``kernel[grid](*args, **kwargs)``."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


#: The launches being recorded, in the current context: each thread has its own, so that two
#: engines of one process (one per GPU) may start at once, one recording its dry runs while
#: the other launches for real.
_recorded: ContextVar[list[Launch] | None] = ContextVar("voice_out_recorded_launches", default=None)
#: Stand-ins of the tensors a recording's launches take, by (dtype, device, byte misalignment)
#: (a cache: recordings of two threads may share it).
_stand_ins: dict[tuple[torch.dtype, torch.device, int], torch.Tensor] = {}


def _stand_in(a: Any) -> Any:
    """A recorded launch's argument: a tensor becomes a one-element stand-in of its dtype and
    device at the same misalignment to 16 bytes (all Triton specialises a pointer on), so
    the recording keeps no tensor of the dry run alive: each model call's intermediates are
    freed as it goes, and a dry run needs no more memory than one call."""
    if not isinstance(a, torch.Tensor):
        return a
    off = a.data_ptr() % 16
    key = (a.dtype, a.device, off)
    t = _stand_ins.get(key)
    if t is None:
        size = a.element_size()
        base = torch.empty(32 // size + 1, dtype=a.dtype, device=a.device)
        t = _stand_ins[key] = base[off // size :][:1] if off % size == 0 else base[:1]
    return t


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """Launch ``kernel`` on ``grid``; inside :func:`recording`, record the launch instead (its
    tensors as stand-ins: :func:`_stand_in`)."""
    recorded = _recorded.get()
    if recorded is not None:
        recorded.append(Launch(kernel, grid, tuple(_stand_in(a) for a in args), kwargs))
        return
    kernel[grid](*args, **kwargs)


@contextmanager
def recording() -> Iterator[list[Launch]]:
    """Record (not run) every :func:`launch` inside the block, made in the same context (the
    calling thread), into the list yielded. The kernels' outputs are left as allocated: results
    computed inside are garbage. Start-up only, on the thread that owns the engine's CUDA."""
    if _recorded.get() is not None:
        raise RuntimeError("kernel launches are already being recorded")
    recorded: list[Launch] = []
    token = _recorded.set(recorded)
    try:
        yield recorded
    finally:
        _recorded.reset(token)
        _stand_ins.clear()


def recording_active() -> bool:
    """Whether launches are being recorded (and not run) now: see :func:`recording`."""
    return _recorded.get() is not None


def dependent_launch_available(device: torch.device | str) -> bool:
    """True if Triton kernels can be launched programmatically dependent on ``device``
    (:func:`pdl_options`): a CUDA device of compute capability 9.0 or later (Hopper) and a
    Triton with grid dependency control."""
    dev = torch.device(device)
    if triton is None or dev.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        from triton.language.extra import cuda as tl_cuda
    except ImportError:  # pragma: no cover - depends on the install
        return False
    return hasattr(tl_cuda, "gdc_wait") and torch.cuda.get_device_capability(dev)[0] >= 9


def pdl_options(pdl: bool) -> dict[str, Any]:
    """A launch's ``PDL`` constexpr (the kernel's :func:`await_previous` argument), and with it
    Triton's launch option."""
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}


if triton is not None:

    @triton.jit
    def await_previous(PDL: tl.constexpr):  # type: ignore[no-untyped-def]
        """With PDL (the kernel launched programmatically dependent): wait for the kernel
        before it in the stream to finish and its writes to be visible, then let the next
        kernel be launched (it runs beside this one up to its own wait). A kernel calls it
        before its first memory access; without PDL it is nothing."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
