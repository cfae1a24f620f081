"""Fused CUDA kernel (Triton) for the HiFT vocoder's Snake activation (``voice_out/model/vocoder.py``).

A vocoder call of the first streaming chunk (56 mel frames) is ~1050 kernels on a GPU, and
about half of them are its 72 Snake activations: ``x + sin(alpha x)^2 / (alpha + 1e-9)`` is
seven elementwise kernels in torch (the channel vector's add and reciprocal, the product,
the sine, the square, the product, the add). :func:`snake` is one kernel: each element reads
its channel's alpha and computes the same expression in float32, in the same order (the last
multiply-add may be contracted into one FMA: the results agree within float32 rounding).

Needs Triton (it ships with PyTorch's CUDA builds); :func:`available` says whether it runs for
a tensor. ``hift.Snake`` keeps the torch form, which stays the reference and runs everywhere
else (the CPU, the parity tests): ``tests/test_hift_kernels.py`` checks the two agree.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from voice_out.fast.kernels.launch import launch

try:  # Triton comes with PyTorch's CUDA wheels; the CPU build has none (then: the torch form)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

#: Elements per program.
BLOCK = 1024


def available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """True if :func:`snake` can run: Triton importable, a CUDA ``device``, float32 (the
    vocoder's only dtype)."""
    return triton is not None and torch.device(device).type == "cuda" and dtype == torch.float32


if triton is not None:
    # lengths change with every chunk: not specialised (one compile serves every length)
    @triton.jit(do_not_specialize=["n", "T"])
    def _snake_kernel(x_ptr, alpha_ptr, out_ptr, n, T, C: tl.constexpr, eps, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        x = tl.load(x_ptr + i, mask=ok, other=0.0)
        alpha = tl.load(alpha_ptr + (i // T) % C, mask=ok, other=1.0)
        s = tl.sin(x * alpha)
        # as torch evaluates it: x + (1 / (alpha + eps)) * sin(x alpha)^2, the division rounded
        # as IEEE (Triton's plain float32 division is approximate)
        inv = tl.math.div_rn(tl.full([BLOCK], 1.0, tl.float32), alpha + eps)
        tl.store(out_ptr + i, x + inv * (s * s), mask=ok)


def snake(x: Tensor, alpha: Tensor, eps: float) -> Tensor:
    """``x + sin(alpha x)^2 / (alpha + eps)`` for x float32 ``[B, C, T]`` (contiguous) and
    alpha ``[C]``, in one kernel -> a new ``[B, C, T]``. Graph-capturable; CUDA with Triton."""
    if x.dim() != 3 or not x.is_contiguous() or alpha.shape != (x.shape[1],):
        raise ValueError(
            f"snake: x must be contiguous [B, C, T] and alpha [C], got {tuple(x.shape)}, {tuple(alpha.shape)}"
        )
    out = torch.empty_like(x)
    n = x.numel()
    kernel: Any = _snake_kernel
    launch(kernel, (triton.cdiv(n, BLOCK),), x, alpha, out, n, x.shape[2], C=x.shape[1], eps=eps, BLOCK=BLOCK)
    return out
