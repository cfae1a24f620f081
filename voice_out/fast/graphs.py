"""One small CUDA-graph wrapper: capture a function once per shape bucket, replay it after.

``GraphedFn(fn)`` calls ``fn(*tensors)`` eagerly on the CPU, when graphs are disabled, or for
a key it has not captured yet while capture is not allowed. Otherwise, for each ``key`` (for
example the batch bucket), it copies the inputs into static buffers, warms up, captures one
CUDA graph in a memory pool shared by all keys, and replays it on later calls. Outputs are the
graph's static output tensors: callers must consume (or copy) them before the next call with
the same key.

Families: every graph records the cuBLAS workspace of the stream it was captured on (PyTorch
keeps one per (handle, stream)), so graphs captured on one stream share it. Replayed at once on
two streams, their GEMMs would race on it, and split-K GEMMs then wait on each other's
semaphores: the GPU spins at full power and the step hangs for a minute. Graphs that may run at
the same time (the LLM's on the worker's stream, token2wav's on its side stream) therefore
belong to different ``family`` names, and each family captures on a stream of its own
(:func:`family_stream`); the runner's side stream is one such stream too, so its eager GEMMs
have a workspace no graph records.

Switches: ``enabled=False``, the environment variable ``VOICE_OUT_CUDA_GRAPHS=0``, or the
``graphs_disabled()`` context manager (per thread). Capture and replay must happen on the one
thread that owns CUDA (the engine's GPU worker); graphs are not shared across threads.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

_local = threading.local()
_families: dict[tuple[str, int], torch.cuda.Stream] = {}
_families_lock = threading.Lock()


def family_stream(family: str, device: torch.device | int | None = None, *, priority: int = 0) -> torch.cuda.Stream:
    """The CUDA stream of ``family`` on ``device`` (created on first use with ``priority``,
    then the same one): a stream no other family and no default stream uses (see the module
    docstring for why). ``priority``: CUDA's, lower runs first (0 is the default; -1 high).

    PyTorch hands out streams round-robin from a small pool, so a new stream can be one already
    in use elsewhere: this draws until its handle differs from every other family's. Any thread."""
    if isinstance(device, int):
        index = device
    elif device is None or device.index is None:
        index = torch.cuda.current_device()
    else:
        index = device.index
    with _families_lock:
        stream = _families.get((family, index))
        if stream is None:
            taken = {s.cuda_stream for (_, i), s in _families.items() if i == index}
            taken.add(torch.cuda.default_stream(index).cuda_stream)
            for _ in range(256):  # the pool cycles through a few dozen streams per priority
                stream = torch.cuda.Stream(index, priority=priority)
                if stream.cuda_stream not in taken:
                    break
            else:
                raise RuntimeError(f"no free CUDA stream for graph family {family!r}")
            _families[(family, index)] = stream
        return stream


def graphs_globally_enabled() -> bool:
    """False when ``VOICE_OUT_CUDA_GRAPHS`` is set to 0/false/off."""
    return os.environ.get("VOICE_OUT_CUDA_GRAPHS", "1").strip().lower() not in ("0", "false", "off", "no")


@contextmanager
def graphs_disabled() -> Iterator[None]:
    """Run every ``GraphedFn`` of this thread eagerly inside the block."""
    prev = getattr(_local, "disabled", False)
    _local.disabled = True
    try:
        yield
    finally:
        _local.disabled = prev


class GraphShapeError(RuntimeError):
    """Inputs do not match the shapes a graph was captured with."""


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]
    output: Any


class GraphedFn:
    """Wrap ``fn(*tensors) -> tensor | tuple of tensors`` with per-key CUDA graphs.

    ``fn`` must be capturable: no host syncs, no allocation that depends on values, and all
    state it mutates (KV caches, ...) must live in tensors whose addresses never change.
    Capturing runs ``fn`` ``warmup + 1`` times on copies of the inputs, so any state it mutates
    is written then: capture every key at start-up (``capture``) before real work exists, or
    make sure the captured inputs point at scratch state. ``warmup_each=False`` warms up before
    the first capture only: for a ``fn`` whose keys differ in lengths alone, the first warm-up
    did every lazy initialisation (handles, workspaces, kernels loaded) the others need, and
    start-up then runs each key's ``fn`` once instead of ``warmup + 1`` times.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        enabled: bool = True,
        warmup: int = 2,
        warmup_each: bool = True,
        pool: Any | None = None,
        name: str = "fn",
        family: str = "default",
    ) -> None:
        self.fn = fn
        self.family = family
        self.enabled = enabled and graphs_globally_enabled()
        self.warmup = warmup
        self.warmup_each = warmup_each
        self.name = name
        self._graphs: dict[Hashable, _Captured] = {}
        self._pool = pool

    @property
    def captured_keys(self) -> list[Hashable]:
        return list(self._graphs)

    def has(self, key: Hashable) -> bool:
        """Whether ``key`` is captured (a call with it replays instead of capturing)."""
        return key in self._graphs

    def static_inputs(self, key: Hashable) -> tuple[torch.Tensor, ...] | None:
        """The input buffers ``key``'s graph was captured on, or None if it is not captured. A
        caller may write a call's inputs into them in place and pass them back: the call then
        copies nothing (it skips an input that already is its buffer)."""
        cap = self._graphs.get(key)
        return None if cap is None else cap.inputs

    def would_capture(self, key: Hashable, *args: torch.Tensor) -> bool:
        """Whether a call with ``key`` on tensors like ``args`` (same devices) would capture a
        graph now: graphs active for them and ``key`` not captured yet. False when it would
        replay, or run ``fn`` eagerly (CPU, graphs disabled)."""
        return self._active(args) and key not in self._graphs

    def _active(self, args: Sequence[torch.Tensor]) -> bool:
        if not self.enabled or getattr(_local, "disabled", False):
            return False
        return all(a.is_cuda for a in args)

    def __call__(self, key: Hashable, *args: torch.Tensor) -> Any:
        if not self._active(args):
            return self.fn(*args)
        cap = self._graphs.get(key)
        if cap is None:
            cap = self._capture(key, args)
        if len(args) != len(cap.inputs):
            raise GraphShapeError(
                f"{self.name}[{key!r}]: {len(args)} inputs, captured with {len(cap.inputs)}; "
                "set VOICE_OUT_CUDA_GRAPHS=0 to run eagerly"
            )
        for i, (dst, src) in enumerate(zip(cap.inputs, args, strict=True)):
            if dst.shape != src.shape or dst.dtype != src.dtype:
                raise GraphShapeError(
                    f"{self.name}[{key!r}] input {i}: got {tuple(src.shape)} {src.dtype}, captured "
                    f"{tuple(dst.shape)} {dst.dtype}; set VOICE_OUT_CUDA_GRAPHS=0 to run eagerly"
                )
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src, non_blocking=True)
        cap.graph.replay()
        return cap.output

    def capture(self, key: Hashable, *args: torch.Tensor, warmup: int | None = None) -> None:
        """Capture ``key`` now (start-up warm-up) without replaying it. ``warmup``: runs of
        ``fn`` before the capture (None: the wrapper's own rule); 0 only where an earlier key
        has run the same kernels (same code, other lengths)."""
        if self._active(args) and key not in self._graphs:
            self._capture(key, args, warmup)

    def _capture(self, key: Hashable, args: Sequence[torch.Tensor], warmup: int | None = None) -> _Captured:
        static = tuple(a.clone() for a in args)
        if warmup is None:
            warmup = self.warmup if self.warmup_each or not self._graphs else 0
        # A capture mid-run (a first use) may find another family's graphs still replaying on
        # another stream; the warm-up below runs on a stream from PyTorch's pool, which may be
        # that family's capture stream, and would share its cuBLAS workspace: let them finish.
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                self.fn(*static)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        stream = family_stream(self.family, static[0].device if static else None)
        # capture_begin/end directly: ``torch.cuda.graph`` first empties the device and pinned
        # host caches, so every capture's allocations (and the next pinned copies) went back
        # to cudaMalloc / cudaHostAlloc: ~7 s over the ~200 captures of a start-up
        with torch.cuda.stream(stream):
            graph.capture_begin(self._pool)
            try:
                output = self.fn(*static)
            finally:
                graph.capture_end()
        cap = _Captured(graph=graph, inputs=static, output=output)
        self._graphs[key] = cap
        return cap

    def reset(self) -> None:
        """Drop every captured graph (their memory returns to the pool)."""
        self._graphs.clear()
