"""Fused CUDA kernels (Triton) for the speech LM's batched decode step.

A graphed decode step of the 0.5B backbone is bound by its number of kernels, not by its
bytes: per layer, RoPE (cast, batched matmul, cast), the two K/V cache writes and SDPA (with its
copies and memsets) were ~10 kernels and ~18 us of a ~52 us layer at batch 1 (H200).
:func:`rope_append_attend` does all of it in ONE kernel per layer, and :func:`silu_mul` is the
MLP's gate in one kernel instead of two.

* ``rope_append_attend``: for each row b (row b = KV slot b, as the graphed step lays them out)
  and kv head h, rotate the row's q heads of group h and its new k (rotate-half RoPE, float32,
  rounded to the cache dtype like the eager path), write k and v at ``(write_slot[b],
  write_pos[b])``, and attend the group's queries over slot b's keys ``0 .. pos[b] - 1`` plus
  the new key, kept in registers (so an inactive row, whose write goes to a scratch slot, still
  attends over its own keys). The loop runs to ``pos[b]``, not over a static window: one graph
  serves every length.
* ``silu_mul``: ``silu(gate) * up`` of the ``[gate; up]`` GEMM output.

Both need Triton (it ships with PyTorch's CUDA builds); :func:`available` says whether they can
run for a given device, dtype and head layout. The eager path in ``qwen2.py`` stays the
reference: ``tests/test_decode_kernels.py`` checks both against it on a GPU.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

try:  # Triton comes with PyTorch's CUDA wheels; the CPU build has none (then: the eager path)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

#: Keys per block of the attention loop.
BLOCK_KEYS = 64
#: Widest group of query heads per kv head one program holds (rows padded to >= 16 for tl.dot).
MAX_GROUP = 64


def available(device: torch.device | str, dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """True if the fused kernels can run: Triton importable, a CUDA ``device``, ``dtype``
    bfloat16 or float16, ``head_dim`` a power of two in 16..256, ``group`` (query heads per kv
    head) at most :data:`MAX_GROUP`."""
    return (
        triton is not None
        and torch.device(device).type == "cuda"
        and dtype in (torch.bfloat16, torch.float16)
        and 16 <= head_dim <= 256
        and head_dim & (head_dim - 1) == 0
        and 1 <= group <= MAX_GROUP
    )


if triton is not None:

    @triton.jit
    def _rope_append_attend_kernel(  # type: ignore[no-untyped-def]
        qkv_ptr,
        stride_qkv,
        k_cache_ptr,
        v_cache_ptr,
        stride_slot,
        stride_head,
        stride_pos,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        wslot_ptr,
        wpos_ptr,
        out_ptr,
        stride_out,
        qk_scale,
        HQ: tl.constexpr,
        HKV: tl.constexpr,
        G: tl.constexpr,
        GP: tl.constexpr,
        D: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        half: tl.constexpr = D // 2
        d = tl.arange(0, D)
        g = tl.arange(0, GP)
        partner = (d + half) % D
        sign = tl.where(d < half, -1.0, 1.0)
        cos = tl.load(cos_ptr + b * D + d)
        sin = tl.load(sin_ptr + b * D + d) * sign
        row = qkv_ptr + b * stride_qkv
        g_ok = (g < G)[:, None]
        q_cols = (h * G + g)[:, None] * D
        q = tl.load(row + q_cols + d[None, :], mask=g_ok, other=0.0).to(tl.float32)
        q_p = tl.load(row + q_cols + partner[None, :], mask=g_ok, other=0.0).to(tl.float32)
        q = (q * cos[None, :] + q_p * sin[None, :]).to(k_cache_ptr.dtype.element_ty)
        k_col = (HQ + h) * D
        k_new = tl.load(row + k_col + d).to(tl.float32) * cos + tl.load(row + k_col + partner).to(tl.float32) * sin
        k_new = k_new.to(k_cache_ptr.dtype.element_ty)
        v_new = tl.load(row + (HQ + HKV + h) * D + d)
        w_at = tl.load(wslot_ptr + b) * stride_slot + h * stride_head + tl.load(wpos_ptr + b) * stride_pos
        tl.store(k_cache_ptr + w_at + d, k_new)
        tl.store(v_cache_ptr + w_at + d, v_new)

        # online softmax in base 2 (qk_scale holds log2(e) / sqrt(D)); the new key first
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * qk_scale
        m = s_new
        l_sum = tl.full([GP], 1.0, tl.float32)
        acc = tl.zeros([GP, D], tl.float32) + v_new.to(tl.float32)[None, :]
        pos = tl.load(pos_ptr + b)
        base = b * stride_slot + h * stride_head
        for start in range(0, pos, BLOCK):
            n = start + tl.arange(0, BLOCK)
            n_ok = n < pos
            at = base + n[:, None] * stride_pos + d[None, :]
            keys = tl.load(k_cache_ptr + at, mask=n_ok[:, None], other=0.0)
            vals = tl.load(v_cache_ptr + at, mask=n_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(keys)) * qk_scale
            s = tl.where(n_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(vals.dtype), vals)
            m = m_new
        o = acc / l_sum[:, None]
        tl.store(out_ptr + b * stride_out + q_cols + d[None, :], o.to(out_ptr.dtype.element_ty), mask=g_ok)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, N: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        r = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < N
        gate = tl.load(x_ptr + r * stride_x + c, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + r * stride_x + N + c, mask=ok, other=0.0).to(tl.float32)
        # silu in float32, rounded once (the eager path rounds silu(gate), then the product)
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + r * stride_out + c, act.to(out_ptr.dtype.element_ty), mask=ok)


def rope_append_attend(
    qkv: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cos: Tensor,
    sin: Tensor,
    pos: Tensor,
    write_slot: Tensor,
    write_pos: Tensor,
    n_heads: int,
    n_kv_heads: int,
) -> Tensor:
    """RoPE, K/V append and decode attention of one layer, one kernel (see module docstring).

    * ``qkv`` ``[B, (Hq + 2 Hkv) D]``: the layer's q | k | v projections (bias added), row b
      for KV slot b; ``k_cache``/``v_cache`` ``[S, Hkv, L, D]`` (S > B), D contiguous.
    * ``cos``/``sin`` float32 ``[B, D]``: :func:`voice_out.model.qwen2.rope_cos_sin` of ``pos``.
    * ``pos`` int64 ``[B]``: keys ``0 .. pos[b] - 1`` of slot b are attended, then the new key;
      ``write_slot``/``write_pos`` int64 ``[B]``: where the new k/v go.

    Returns the attention output ``[B, Hq * D]`` (head-major, as ``wo`` takes it), qkv's dtype.
    Graph-capturable: no host sync, shapes fixed by B. CUDA with Triton only (:func:`available`).
    """
    b = qkv.shape[0]
    d = k_cache.shape[-1]
    group = n_heads // n_kv_heads
    fits = qkv.shape[1] == (n_heads + 2 * n_kv_heads) * d and k_cache.stride(-1) == 1
    if not fits or v_cache.stride() != k_cache.stride():
        raise ValueError(f"rope_append_attend: qkv {tuple(qkv.shape)} does not match a cache of {tuple(k_cache.shape)}")
    if qkv.stride(1) != 1:
        raise ValueError("rope_append_attend: qkv rows must be contiguous")
    out = torch.empty(b, n_heads * d, device=qkv.device, dtype=qkv.dtype)
    grid = (b, n_kv_heads)
    kernel: Any = _rope_append_attend_kernel
    kernel[grid](
        qkv,
        qkv.stride(0),
        k_cache,
        v_cache,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        cos.contiguous(),
        sin.contiguous(),
        pos,
        write_slot,
        write_pos,
        out,
        out.stride(0),
        math.log2(math.e) / math.sqrt(d),
        HQ=n_heads,
        HKV=n_kv_heads,
        G=group,
        GP=max(16, triton.next_power_of_2(group)),
        D=d,
        BLOCK=BLOCK_KEYS,
    )
    return out


def silu_mul(x: Tensor) -> Tensor:
    """``silu(x[:, :N]) * x[:, N:]`` for ``x`` ``[R, 2N]`` (rows contiguous) -> ``[R, N]``, one kernel."""
    rows, two_n = x.shape
    n = two_n // 2
    if x.stride(1) != 1 or two_n != 2 * n:
        raise ValueError(f"silu_mul: need [R, 2N] with contiguous rows, got {tuple(x.shape)}")
    out = torch.empty(rows, n, device=x.device, dtype=x.dtype)
    block = 1024
    kernel: Any = _silu_mul_kernel
    kernel[(rows, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), N=n, BLOCK=block)
    return out
