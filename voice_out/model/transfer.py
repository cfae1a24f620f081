"""Host-to-device copies that never make the host wait.

``torch.tensor(values, device="cuda")`` and ``cpu_tensor.to("cuda")`` copy from pageable host
memory, and CUDA performs such a copy only after every kernel already queued on the stream has
run: the host blocks until the GPU catches up. On the engine's token2wav side stream that turned
each chunk's token list into a wait for the chunks launched before it, so launching a step's
chunk groups took as long as running them. :func:`to_device` stages the values in pinned memory
and copies them without blocking (PyTorch's pinned-memory cache keeps the staging buffer alive
until the copy has run). Any thread; the copy is queued on the current stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def to_device(values: Tensor | Sequence[Any], device: torch.device, dtype: torch.dtype | None = None) -> Tensor:
    """``values`` (a tensor, or a possibly nested list of numbers) as a tensor on ``device``, of
    ``dtype`` (None: the tensor's own, or what ``torch.tensor`` infers). Off CUDA, or for a tensor
    already on the device, a plain ``.to``."""
    t = values if isinstance(values, Tensor) else torch.tensor(values, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
