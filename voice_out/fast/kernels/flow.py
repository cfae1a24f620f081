"""Fused CUDA kernels (Triton) for the flow's velocity estimator (``flow_estimator.py``).

A graphed first streaming chunk is 10 estimator calls of ~750 kernels each, and on an H100
the GPU is busy for almost all of its ~28 ms: the kernels are small but not free. About a third
of that time is LayerNorms, GELU, Mish, residual adds, attention memsets, concatenations and
the causal convs' window copies, each a kernel of its own around the GEMMs. Here each GEMM
carries what surrounds it:

* :func:`ln_linear`: LayerNorm of each row (the whole row in one tile) as the GEMM's prologue,
  bias and exact (erf) GELU as its epilogue: a transformer block's norm + q/k/v projection, and
  its norm + feed-forward input + GELU.
* :func:`linear`: GEMM + bias + residual add (in place when ``out`` is the residual): the
  attention output projection and the feed-forward output.
* :func:`attention`: chunk-causal / key-padded attention reading q, k and v straight from the
  stacked projection ``[B T, 3 H D]`` and writing ``[B T, H D]``; the mask is computed from
  ``chunk`` and ``key_frames`` in the kernel (no bias tensor) and key blocks every query of a
  block is masked from are skipped.
* :func:`conv`: a causal conv (stride 1, zero left context) as an implicit GEMM over the taps
  of the time-major input (no padded copy, no window copy), with LayerNorm + Mish, a per-row
  vector add (a ResBlock's time projection) and a 1x1 residual conv of the current frame (a
  second GEMM) in its epilogue. A ResBlock is two of these. Calls of few rows split the
  reduction over several programs per row tile (:func:`conv_workspace`).

A transformer block is then 5 kernels instead of 10, a ResBlock 2 instead of ~9. Every
intermediate is rounded once to the compute dtype, where the plain path rounds after each op:
the results agree within bf16 rounding (``tests/test_flow_kernels.py`` checks each kernel and
the whole first chunk against ``flow_estimator.py``, which stays the reference). The stateless
estimator call (the re-run and final-chunk paths the CUDA graphs replay) uses them, and so does
a first chunk from a voice's prompt prefix (``Flow.prefix_core``): its attention reads the
prefix's keys and values and its convs the prefix's left context, never writing them.

Needs Triton (it ships with PyTorch's CUDA builds); :func:`available` says whether they run for
a device, dtype and shape. Tile sizes are fixed per row count (no autotuning at start-up):
:data:`TILE_TIERS`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from voice_out.fast.kernels.launch import launch

try:  # Triton comes with PyTorch's CUDA wheels; the CPU build has none (then: the plain path)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

#: Widest row a LayerNorm prologue/epilogue holds in one tile (channels of the estimator).
MAX_ROW = 1024
#: A split attention (:func:`attention_workspace`) gives each program at least this many key
#: blocks: a first chunk from a 150-token prompt's prefix (4 prefix blocks, 2 of its own) was
#: slower split 4 ways than whole (``scripts/bench_flow_kernels.py --frames 106 --prefix 250``:
#: 11.0 us, 7.3 whole, H100), 1500 prefix frames faster (23.4 -> 18.6 us). Up to 8 splits
#: made a long utterance's later chunks slower than 4 (``scripts/token2wav_chunk_cost.py``).
ATTENTION_MIN_BLOCKS = 6
#: Tile sizes and warps per kernel, by the rows M of the call (batch x frames; CFG rows
#: included): each tier holds from its threshold up to the next. ln_linear and ln_linear_gelu
#: (rows, cols, warps); linear (rows, cols, depth, warps); attention (queries, keys, warps,
#: splits: a prefix's keys over that many programs per query block, where a call passes a
#: workspace, :func:`attention_workspace`);
#: conv (rows when Cout > 128, rows otherwise, depth, warps, splits; the columns are the whole
#: Cout, for the LayerNorm; splits > 1: the reduction over taps x channels in that many programs
#: per row tile, where a call passes a workspace, :func:`conv_workspace`). Measured on an H100
#: with ``python scripts/bench_flow_kernels.py --sweep --batch N`` at 356 frames: N = 1 (one
#: first chunk, M = 712) wants small tiles, many programs for a launch-bound call; N = 8 (a
#: batch of re-run chunks, M = 5696; a long utterance's chunks and final pass are that tall too)
#: taller ones, since every program re-reads its weight columns. A whole batched first chunk
#: (``Flow.batch_core``, T = 175 tokens) with the tiles of the tiers from 384, then 1024 rows: 25.7 /
#: 30.1 ms at N = 1, 33.9 / 33.3 at 2, 50.5 / 43.6 at 4, 89.0 / 62.5 at 8. Few tiers: each tile
#: set is a Triton compile of every kernel variant at a fresh start (the best tiles at N = 2 and
#: 4 were within a few percent of these). The first tier is for the short calls of a first chunk
#: from a prompt prefix (``Flow.prefix_core``: 2 x 106 frames for a 150-token prompt):
#: ``--frames 106 --prefix 250 --sweep`` on an H200 found narrower linear tiles 25% faster there
#: (the two linears of a transformer block 10.8 -> 8.0 us); the other kernels' best tiles were
#: within 0.3 us of the second tier's. It reaches 640 rows for the later chunks on a stream's
#: own state (``Flow.state_core``: 2 x 200 frames for a 100-token hop): ``--frames 200 --prefix
#: 1500 --sweep --only linear,conv`` on an H100 put these tiles within 0.2 us of the fastest
#: linears (8.8 against 10.6 us for the second tier's) and the split convs at 34.6 us against
#: 47.5 unsplit for the three conv kinds.
TILE_TIERS: tuple[tuple[int, dict[str, tuple[int, ...]]], ...] = (
    (
        0,
        {
            "ln_linear": (32, 64, 4),
            "ln_linear_gelu": (32, 64, 4),
            "linear": (16, 32, 64, 4),
            "attention": (64, 64, 4, 4),
            "conv": (16, 32, 64, 4, 4),
        },
    ),
    (
        640,
        {
            "ln_linear": (32, 64, 4),
            "ln_linear_gelu": (32, 64, 4),
            "linear": (32, 64, 64, 4),
            "attention": (64, 64, 4, 1),
            "conv": (16, 32, 64, 4, 1),
        },
    ),
    (
        1024,
        {
            "ln_linear": (64, 128, 4),
            "ln_linear_gelu": (64, 128, 4),
            "linear": (128, 128, 64, 8),
            "attention": (64, 64, 4, 1),
            "conv": (64, 32, 64, 8, 1),
        },
    ),
)


def tier(rows: int) -> dict[str, tuple[int, ...]]:
    """The tile table of the tier that a call of ``rows`` rows falls in (see :data:`TILE_TIERS`)."""
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    return next(tiles for start, tiles in reversed(TILE_TIERS) if rows >= start)


def available(device: torch.device | str, dtype: torch.dtype, channels: int, in_channels: int, head_dim: int) -> bool:
    """True if the fused estimator kernels can run: Triton importable, a CUDA ``device``,
    ``dtype`` bfloat16 or float16, ``channels`` and ``in_channels`` (whole LayerNorm rows) in
    16 .. :data:`MAX_ROW`, ``head_dim`` a power of two in 16 .. 128."""
    return (
        triton is not None
        and torch.device(device).type == "cuda"
        and dtype in (torch.bfloat16, torch.float16)
        and 16 <= channels <= MAX_ROW
        and 16 <= in_channels <= 4 * MAX_ROW
        and 16 <= head_dim <= 128
        and head_dim & (head_dim - 1) == 0
    )


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


# Frame and row counts (T, M) change with every chunk length, so they are not specialised:
# Triton would otherwise compile a kernel again whenever they switch between multiples of 16
# and other values (26 compiles of ~1.2 s each on a fresh machine's start, with them).
if triton is not None:

    @triton.jit
    def _gelu_erf(x):  # type: ignore[no-untyped-def]
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))

    @triton.jit
    def _mish(x):  # type: ignore[no-untyped-def]
        # x * tanh(softplus(x)); softplus >= 0, so tanh = 1 - 2 / (exp(2 sp) + 1) cannot overflow
        sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        return x * (1.0 - 2.0 / (tl.exp(2.0 * sp) + 1.0))

    @triton.jit(do_not_specialize=["M"])
    def _ln_linear_kernel(  # type: ignore[no-untyped-def]
        x_ptr,
        stride_x,
        lnw_ptr,
        lnb_ptr,
        w_ptr,
        stride_w,
        b_ptr,
        out_ptr,
        stride_out,
        M,
        N,
        eps,
        K: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        GELU: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        k_ok = ks < K
        r_ok = rows < M
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        x = x.to(tl.float32)
        mean = tl.sum(x, axis=1) / K
        xc = tl.where(k_ok[None, :], x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / K + eps)
        lw = tl.load(lnw_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        lb = tl.load(lnb_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        h = (xc * rstd[:, None] * lw[None, :] + lb[None, :]).to(w_ptr.dtype.element_ty)
        c_ok = cols < N
        w = tl.load(w_ptr + cols[None, :] * stride_w + ks[:, None], mask=c_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(h, w)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        if GELU:
            acc = _gelu_erf(acc)
        out = out_ptr + rows[:, None] * stride_out + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & c_ok[None, :])

    @triton.jit(do_not_specialize=["M"])
    def _linear_kernel(  # type: ignore[no-untyped-def]
        a_ptr,
        stride_a,
        w_ptr,
        stride_w,
        b_ptr,
        res_ptr,
        stride_res,
        out_ptr,
        stride_out,
        M,
        N,
        K,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_RES: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        r_ok = rows < M
        c_ok = cols < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(a_ptr + rows[:, None] * stride_a + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + cols[None, :] * stride_w + ks[:, None], mask=c_ok[None, :] & k_ok[:, None], other=0.0)
            acc = tl.dot(a, w, acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        ok = r_ok[:, None] & c_ok[None, :]
        if HAS_RES:
            acc += tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit(do_not_specialize=["T", "start"])
    def _attention_kernel(  # type: ignore[no-untyped-def]
        qkv_ptr,
        stride_qkv,
        out_ptr,
        stride_out,
        kf_ptr,
        pk_ptr,
        pv_ptr,
        stride_pb,
        stride_ph,
        stride_pt,
        at_ptr,
        ws_ptr,
        cnt_ptr,
        T,
        start,
        chunk,
        qk_scale,
        H: tl.constexpr,
        D: tl.constexpr,
        HAS_KF: tl.constexpr,
        HAS_PREFIX: tl.constexpr,
        START_AT: tl.constexpr,
        WRITE_KV: tl.constexpr,
        SPLITS: tl.constexpr,
        MIN_BLOCKS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        sid = tl.program_id(2)  # this program's share of the prefix's keys (SPLITS > 1)
        b = bh // H
        h = bh % H
        if START_AT:  # the frame of this call's first row, on the device (a graph replays any)
            start = tl.load(at_ptr).to(tl.int32)
        i = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, D)
        i_ok = i < T
        base = qkv_ptr + b * T * stride_qkv
        q = tl.load(base + i[:, None] * stride_qkv + h * D + d[None, :], mask=i_ok[:, None], other=0.0)
        if WRITE_KV:
            if sid == 0:
                # this block's own keys and values go into the state at frames start + i. No
                # program of this launch reads them there (the state is read before start only,
                # this call's keys from qkv), so the state extends in the launch that reads it.
                at = b * stride_pb + h * stride_ph + (start + i)[:, None] * stride_pt + d[None, :]
                own = base + i[:, None] * stride_qkv + d[None, :]
                k_own = tl.load(own + (H + h) * D, mask=i_ok[:, None], other=0.0)
                tl.store(pk_ptr + at, k_own, mask=i_ok[:, None])
                v_own = tl.load(own + (2 * H + h) * D, mask=i_ok[:, None], other=0.0)
                tl.store(pv_ptr + at, v_own, mask=i_ok[:, None])
        n_keys = T
        if HAS_KF:
            n_keys = tl.load(kf_ptr + b).to(tl.int32)
        # query i (absolute frame start + i) may see key j (absolute) < chunk ((start + i) //
        # chunk + 1); the block's last query bounds the loop. Limits are counted in this call's
        # own keys (absolute - start); the prefix's keys, all before start, are seen whole
        # whenever start is a chunk multiple (the callers' case), else as the mask says.
        limit = tl.full([BLOCK_M], 0, tl.int32) + n_keys
        hi = n_keys
        if chunk > 0:
            limit = tl.minimum(limit, ((start + i) // chunk + 1) * chunk - start)
            hi = tl.minimum(hi, ((start + pid_m * BLOCK_M + BLOCK_M - 1) // chunk + 1) * chunk - start)
        # The key blocks: the prefix's (frames 0 .. start - 1) then the call's own. With
        # SPLITS > 1 they are shared out in contiguous runs over up to SPLITS programs, at
        # least MIN_BLOCKS each (``splits``; a short prefix stays in one program: the merge
        # would cost more than it saves); programs past them do nothing.
        n_pb = 0
        if HAS_PREFIX:
            n_pb = tl.cdiv(start, BLOCK_N)
        n_blocks = n_pb + tl.cdiv(hi, BLOCK_N)
        splits = tl.minimum(tl.maximum(n_blocks // MIN_BLOCKS, 1), SPLITS)
        per = tl.cdiv(n_blocks, splits)
        lo_b = tl.minimum(sid * per, n_blocks)
        hi_b = tl.minimum(lo_b + per, n_blocks)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        if HAS_PREFIX:
            p_base = b * stride_pb + h * stride_ph
            for jb in range(lo_b, tl.minimum(hi_b, n_pb)):
                j = jb * BLOCK_N + tl.arange(0, BLOCK_N)
                j_ok = j < start
                at = p_base + j[:, None] * stride_pt + d[None, :]
                keys = tl.load(pk_ptr + at, mask=j_ok[:, None], other=0.0)
                vals = tl.load(pv_ptr + at, mask=j_ok[:, None], other=0.0)
                s = tl.dot(q, tl.trans(keys)) * qk_scale
                s = tl.where(j_ok[None, :] & ((j - start)[None, :] < limit[:, None]), s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m - m_safe)
                p = tl.exp2(s - m_safe[:, None])
                l_sum = l_sum * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.dot(p.to(vals.dtype), vals)
                m = m_new
        for jb in range(tl.maximum(lo_b, n_pb) - n_pb, hi_b - n_pb):
            j = jb * BLOCK_N + tl.arange(0, BLOCK_N)
            j_ok = j < n_keys
            keys = tl.load(base + j[:, None] * stride_qkv + (H + h) * D + d[None, :], mask=j_ok[:, None], other=0.0)
            vals = tl.load(base + j[:, None] * stride_qkv + (2 * H + h) * D + d[None, :], mask=j_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(keys)) * qk_scale
            s = tl.where(j[None, :] < limit[:, None], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
            alpha = tl.exp2(m - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(vals.dtype), vals)
            m = m_new
        done = sid == 0
        if SPLITS > 1:
            if splits > 1:
                # each split's running max, sum and float32 sums [SPLITS, B T H, 2 + D]; the
                # last of the block's programs to arrive merges them in split order (the same
                # result whichever is last)
                done = False
                row = (b * T + i) * H + h
                rows_all = T * tl.num_programs(1)  # B T H
                if sid < splits:
                    mine = ws_ptr + (sid * rows_all + row) * (D + 2)
                    tl.store(mine, m, mask=i_ok)
                    tl.store(mine + 1, l_sum, mask=i_ok)
                    tl.store(mine[:, None] + 2 + d[None, :], acc, mask=i_ok[:, None])
                    tl.debug_barrier()  # every thread's stores issued before the count (released at GPU scope)
                    slot = cnt_ptr + pid_m * tl.num_programs(1) + bh
                    done = tl.atomic_add(slot, 1, sem="acq_rel") == splits - 1
                    if done:
                        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
                        for sp in tl.static_range(SPLITS):
                            part = ws_ptr + (sp * rows_all + row) * (D + 2)
                            m_sp = tl.load(part, mask=i_ok & (sp < splits), other=float("-inf"), cache_modifier=".cg")
                            m = tl.maximum(m, m_sp)
                        m_safe = tl.where(m == float("-inf"), 0.0, m)
                        l_sum = tl.zeros([BLOCK_M], tl.float32)
                        acc = tl.zeros([BLOCK_M, D], tl.float32)
                        for sp in tl.static_range(SPLITS):
                            ok = i_ok & (sp < splits)
                            part = ws_ptr + (sp * rows_all + row) * (D + 2)
                            w = tl.exp2(tl.load(part, mask=ok, other=float("-inf"), cache_modifier=".cg") - m_safe)
                            l_sum += w * tl.load(part + 1, mask=ok, other=0.0, cache_modifier=".cg")
                            a_sp = tl.load(
                                part[:, None] + 2 + d[None, :], mask=ok[:, None], other=0.0, cache_modifier=".cg"
                            )
                            acc += w[:, None] * a_sp
                        tl.atomic_xchg(slot, 0)
        if done:
            o = acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
            out = out_ptr + (b * T + i)[:, None] * stride_out + h * D + d[None, :]
            tl.store(out, o.to(out_ptr.dtype.element_ty), mask=i_ok[:, None])

    @triton.jit(do_not_specialize=["T", "M"])
    def _conv_kernel(  # type: ignore[no-untyped-def]
        x_ptr,
        stride_xb,
        stride_xt,
        w_ptr,
        stride_w,
        b_ptr,
        lnw_ptr,
        lnb_ptr,
        add_ptr,
        stride_add,
        rx_ptr,
        stride_rxb,
        stride_rxt,
        C_RES,
        rw_ptr,
        stride_rw,
        rb_ptr,
        ctx_ptr,
        stride_cb,
        stride_cc,
        stride_ct,
        ws_ptr,
        cnt_ptr,
        out_ptr,
        stride_ob,
        stride_ot,
        T,
        M,
        C_IN,
        eps,
        N: tl.constexpr,
        TAPS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        NORM: tl.constexpr,
        HAS_ADD: tl.constexpr,
        HAS_RES: tl.constexpr,
        HAS_CTX: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        sid = tl.program_id(1)  # this program's share of the reduction (SPLITS > 1)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        r_ok = rows < M
        bi = rows // T
        ti = rows % T
        cols = tl.arange(0, BLOCK_N)
        c_ok = cols < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        n_kb = tl.cdiv(C_IN, BLOCK_K)
        # tap j reads frame t + j - (TAPS - 1); frames before 0 are the left context: zeros, or
        # (HAS_CTX) ctx [B, C_IN, TAPS - 1], the previous frames in time order. The reduction is
        # TAPS x n_kb steps (tap-major); a split takes a contiguous run of them.
        for it in range(sid * TAPS * n_kb // SPLITS, (sid + 1) * TAPS * n_kb // SPLITS):
            tap = it // n_kb
            ks = (it % n_kb) * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = ks < C_IN
            src = ti + tap - (TAPS - 1)
            s_ok = r_ok & (src >= 0)
            a = tl.load(
                x_ptr + (bi * stride_xb + src * stride_xt)[:, None] + ks[None, :],
                mask=s_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            if HAS_CTX:
                in_ctx = r_ok & (src < 0)
                c_row = ctx_ptr + bi * stride_cb + (src + TAPS - 1) * stride_ct
                c_ok_k = in_ctx[:, None] & k_ok[None, :]
                a_ctx = tl.load(c_row[:, None] + ks[None, :] * stride_cc, mask=c_ok_k, other=0.0)
                a = tl.where(in_ctx[:, None], a_ctx, a)
            w_at = w_ptr + cols[None, :] * stride_w + tap * C_IN + ks[:, None]
            w = tl.load(w_at, mask=c_ok[None, :] & k_ok[:, None], other=0.0)
            acc = tl.dot(a, w, acc)
        res = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if HAS_RES:
            # 1x1 conv of the residual input's same frame (its reduction split the same way)
            n_rb = tl.cdiv(C_RES, BLOCK_K)
            r_row = rx_ptr + bi * stride_rxb + ti * stride_rxt
            for rb in range(sid * n_rb // SPLITS, (sid + 1) * n_rb // SPLITS):
                ks = rb * BLOCK_K + tl.arange(0, BLOCK_K)
                k_ok = ks < C_RES
                a = tl.load(r_row[:, None] + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
                w_at = rw_ptr + cols[None, :] * stride_rw + ks[:, None]
                w = tl.load(w_at, mask=c_ok[None, :] & k_ok[:, None], other=0.0)
                res = tl.dot(a, w, res)
        ok = r_ok[:, None] & c_ok[None, :]
        last = True
        if SPLITS > 1:
            # float32 products [2, SPLITS, M, BLOCK_N] (conv, residual); the last program of the
            # row tile to arrive sums them in split order (the same result whichever is last)
            mine = ws_ptr + (sid * M + rows)[:, None] * BLOCK_N + cols[None, :]
            tl.store(mine, acc, mask=ok)
            if HAS_RES:
                tl.store(mine + SPLITS * M * BLOCK_N, res, mask=ok)
            # every thread's store issued before the count (then released at GPU scope)
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel")
            last = arrived == SPLITS - 1
            if last:
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                res = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for sp in tl.static_range(SPLITS):
                    # past L1: the products were written by other SMs
                    theirs = ws_ptr + (sp * M + rows)[:, None] * BLOCK_N + cols[None, :]
                    acc += tl.load(theirs, mask=ok, other=0.0, cache_modifier=".cg")
                    if HAS_RES:
                        res += tl.load(theirs + SPLITS * M * BLOCK_N, mask=ok, other=0.0, cache_modifier=".cg")
                tl.atomic_xchg(cnt_ptr + pid, 0)
        if last:
            acc += tl.load(b_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
            if NORM:
                mean = tl.sum(tl.where(c_ok[None, :], acc, 0.0), axis=1) / N
                xc = tl.where(c_ok[None, :], acc - mean[:, None], 0.0)
                rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
                lw = tl.load(lnw_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
                lb = tl.load(lnb_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
                acc = _mish(xc * rstd[:, None] * lw[None, :] + lb[None, :])
            if HAS_ADD:
                acc += tl.load(add_ptr + bi[:, None] * stride_add + cols[None, :], mask=c_ok[None, :], other=0.0).to(
                    tl.float32
                )
            if HAS_RES:
                acc += res + tl.load(rb_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
            out = out_ptr + (bi * stride_ob + ti * stride_ot)[:, None] + cols[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _rows(x: Tensor, name: str) -> Tensor:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{name}: need [M, K] with contiguous rows, got {tuple(x.shape)} strides {x.stride()}")
    return x


def ln_linear(
    x: Tensor,
    ln_weight: Tensor,
    ln_bias: Tensor,
    eps: float,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    gelu: bool = False,
) -> Tensor:
    """``act(LayerNorm(x) @ weight.T + bias)``, one kernel: x ``[M, K]`` (K <= :data:`MAX_ROW`),
    weight ``[N, K]``, bias ``[N]`` or None, act = exact GELU or identity -> ``[M, N]`` in x's
    dtype. The normalised rows are rounded to the weight's dtype before the GEMM, as
    ``nn.LayerNorm`` + ``F.linear`` round them."""
    _rows(x, "ln_linear")
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or k > MAX_ROW:
        raise ValueError(f"ln_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit")
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    block_m, block_n, warps = tier(m)["ln_linear_gelu" if gelu else "ln_linear"]
    kernel: Any = _ln_linear_kernel
    launch(
        kernel,
        (triton.cdiv(m, block_m), triton.cdiv(n, block_n)),
        x,
        x.stride(0),
        ln_weight,
        ln_bias,
        weight,
        weight.stride(0),
        bias if bias is not None else weight,
        out,
        out.stride(0),
        m,
        n,
        eps,
        K=k,
        BLOCK_K=_pow2(k),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HAS_BIAS=bias is not None,
        GELU=gelu,
        num_warps=warps,
    )
    return out


def linear(
    a: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None = None, out: Tensor | None = None
) -> Tensor:
    """``a @ weight.T + bias (+ residual)``, one kernel: a ``[M, K]``, weight ``[N, K]``,
    residual ``[M, N]``; ``out`` ``[M, N]`` may be ``residual`` itself (in place: each element is
    read, then written, by the same program). Returns ``out`` (new when None)."""
    _rows(a, "linear")
    m, k = a.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"linear: a {tuple(a.shape)} and weight {tuple(weight.shape)} do not fit")
    if out is None:
        out = torch.empty(m, n, device=a.device, dtype=a.dtype)
    for t, name in ((out, "out"), (residual, "residual")):
        if t is not None and (tuple(t.shape) != (m, n) or t.stride(1) != 1):
            raise ValueError(f"linear: {name} must be [{m}, {n}] with contiguous rows, got {tuple(t.shape)}")
    block_m, block_n, block_k, warps = tier(m)["linear"]
    kernel: Any = _linear_kernel
    launch(
        kernel,
        (triton.cdiv(m, block_m), triton.cdiv(n, block_n)),
        a,
        a.stride(0),
        weight,
        weight.stride(0),
        bias if bias is not None else weight,
        residual if residual is not None else out,
        residual.stride(0) if residual is not None else 0,
        out,
        out.stride(0),
        m,
        n,
        k,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        num_warps=warps,
    )
    return out


def attention(
    qkv: Tensor,
    batch: int,
    heads: int,
    head_dim: int,
    chunk: int,
    key_frames: Tensor | None,
    *,
    prefix: tuple[Tensor, Tensor] | None = None,
    start: int = 0,
    at: Tensor | None = None,
    write: bool = False,
    ws: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Multi-head attention of the stacked projection ``qkv`` ``[B T, 3 H D]`` (q | k | v, each
    head-major; rows batch-major) -> ``[B T, H D]``, one kernel, scale 1/sqrt(D).

    The T frames are absolute frames ``start ..``. Query i (frame start + i) attends key j
    (absolute) iff ``j < chunk ((start + i) // chunk + 1)`` (when ``chunk`` > 0: the
    estimator's chunk mask) and ``j - start < key_frames[b]`` (int ``[B]`` on the device, or
    None: all T keys): :func:`voice_out.model.flow_estimator.chunk_mask` and ``valid_keys``.
    Keys before ``start`` come from ``prefix`` = (k, v), each ``[B, H, >= start, D]`` (D
    contiguous; an estimator state's buffers), or there are none (``start`` then only
    offsets the chunk mask).

    ``at``: ``start`` read on the device instead (int32/int64 ``[1]``; ``start`` is then not
    read), so one CUDA graph serves every position of a stream. ``write`` (with ``prefix``):
    the call's keys and values are also stored into the prefix's buffers at frames ``start ..
    start + T`` (which must fit: the caller checks, the kernel cannot), extending a stream's
    state; without it the prefix is only read.

    ``ws``: :func:`attention_workspace` of at least this call's rows: with a prefix, its keys
    are then split as the tier of the rows says (several programs per query block, each a
    run of the prefix's key blocks, the last also the call's own; the last to arrive merges
    their softmax sums in a fixed order: the result does not depend on which is last). Calls
    sharing a workspace must not run at once (one stream); every launch leaves its counters
    at zero. Without it, one program per query block."""
    _rows(qkv, "attention")
    rows, width = qkv.shape
    t = rows // batch
    if rows != batch * t or width != 3 * heads * head_dim:
        raise ValueError(f"attention: qkv {tuple(qkv.shape)} is not [{batch} T, 3 x {heads} x {head_dim}]")
    if start < 0:
        raise ValueError(f"attention: start must be >= 0, got {start}")
    if (at is not None or write) and prefix is None:
        raise ValueError("attention: a device start or a write needs a prefix state")
    if at is not None and (at.numel() != 1 or at.dtype not in (torch.int32, torch.int64) or at.device != qkv.device):
        raise ValueError(f"attention: at must be one int32/int64 value on {qkv.device}")
    if prefix is not None:
        pk, pv = prefix
        for buf, name in ((pk, "keys"), (pv, "values")):
            if (
                buf.dim() != 4
                or tuple(buf.shape[:2]) != (batch, heads)
                or buf.shape[2] < (t if write else 0) + (start if at is None else 0)
                or buf.shape[3] != head_dim
                or buf.stride(3) != 1
                or buf.dtype != qkv.dtype
            ):
                need = (t if write else 0) + (start if at is None else 0)
                raise ValueError(
                    f"attention: prefix {name} must be [{batch}, {heads}, >= {need}, {head_dim}] "
                    f"({qkv.dtype}, last dim contiguous), got {tuple(buf.shape)} {buf.dtype}"
                )
        if pk.stride() != pv.stride():
            raise ValueError("attention: prefix keys and values must have the same strides")
    out = torch.empty(rows, heads * head_dim, device=qkv.device, dtype=qkv.dtype)
    block_m, block_n, warps, splits = tier(rows)["attention"]
    q_blocks = triton.cdiv(t, block_m)
    if ws is None or prefix is None or splits <= 1:
        splits, ws = 1, None  # an unsplit launch reads no workspace
    elif ws[0].numel() < splits * rows * heads * (head_dim + 2) or ws[1].numel() < q_blocks * batch * heads:
        raise ValueError(f"attention: workspace too small for {rows} rows x {heads} heads in {splits} splits")
    kernel: Any = _attention_kernel
    launch(
        kernel,
        (q_blocks, batch * heads, splits),
        qkv,
        qkv.stride(0),
        out,
        out.stride(0),
        key_frames if key_frames is not None else qkv,
        prefix[0] if prefix is not None else qkv,
        prefix[1] if prefix is not None else qkv,
        prefix[0].stride(0) if prefix is not None else 0,
        prefix[0].stride(1) if prefix is not None else 0,
        prefix[0].stride(2) if prefix is not None else 0,
        at if at is not None else qkv,
        ws[0] if ws is not None else qkv,
        ws[1] if ws is not None else qkv,
        t,
        start,
        chunk,
        math.log2(math.e) / math.sqrt(head_dim),
        H=heads,
        D=head_dim,
        HAS_KF=key_frames is not None,
        HAS_PREFIX=prefix is not None and (start > 0 or at is not None),
        START_AT=at is not None,
        WRITE_KV=write,
        SPLITS=splits,
        MIN_BLOCKS=ATTENTION_MIN_BLOCKS,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=warps,
    )
    return out


def conv(
    x: Tensor,
    weight2d: Tensor,
    bias: Tensor,
    taps: int,
    *,
    norm: tuple[Tensor, Tensor, float] | None = None,
    add: Tensor | None = None,
    res: tuple[Tensor, Tensor, Tensor] | None = None,
    ctx: Tensor | None = None,
    ws: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Causal conv, time-major, one kernel: x ``[B, T, Cin]`` (channels contiguous, any
    batch/time strides), ``weight2d`` ``[Cout, taps Cin]`` tap-major (column j Cin + c = tap j,
    channel c; ``CausalConv.weight2d``), bias ``[Cout]`` -> ``[B, T, Cout]``. The left context
    is zeros, or ``ctx`` ``[B, Cin, taps - 1]`` (any strides): the ``taps - 1`` frames before
    x's first, in time order (an estimator state's conv context, only read).

    ``ws``: :func:`conv_workspace` of at least this call's rows and Cout: the reduction is then
    split as the tier of its rows says (several programs per row tile, the last to arrive
    summing their float32 products in a fixed order: the result does not depend on which is
    last). Calls sharing a workspace must not run at once (one stream); every launch leaves
    its counters at zero. Without it, one program per row tile.

    Epilogue, in order: ``norm`` = (weight, bias, eps): LayerNorm over Cout, then Mish; ``add``
    ``[1 or B, Cout]``: added to every frame of its row; ``res`` = (weight ``[Cout, Cin]``, bias
    ``[Cout]``): plus the 1x1 conv of x's current frame (a ResBlock's residual)."""
    b, t, c_in = x.shape
    c_out = weight2d.shape[0]
    if x.stride(2) != 1 or weight2d.shape[1] != taps * c_in or weight2d.stride(1) != 1:
        raise ValueError(f"conv: x {tuple(x.shape)} and weight {tuple(weight2d.shape)} ({taps} taps) do not fit")
    if c_out > MAX_ROW:
        raise ValueError(f"conv: {c_out} output channels exceed {MAX_ROW}")
    out = torch.empty(b, t, c_out, device=x.device, dtype=x.dtype)
    if add is not None and (
        add.dim() != 2 or add.shape[1] != c_out or add.shape[0] not in (1, b) or add.stride(1) != 1
    ):
        raise ValueError(f"conv: add must be [1 or {b}, {c_out}], got {tuple(add.shape)}")
    if res is not None and (
        tuple(res[0].shape[:2]) != (b, t) or res[0].stride(2) != 1 or tuple(res[1].shape) != (c_out, res[0].shape[2])
    ):
        raise ValueError(f"conv: residual input {tuple(res[0].shape)} and weight {tuple(res[1].shape)} do not fit")
    if ctx is not None and (tuple(ctx.shape) != (b, c_in, taps - 1) or ctx.dtype != x.dtype):
        raise ValueError(f"conv: ctx must be [{b}, {c_in}, {taps - 1}] {x.dtype}, got {tuple(ctx.shape)} {ctx.dtype}")
    block_n = _pow2(c_out)
    wide_m, narrow_m, block_k, warps, splits = tier(b * t)["conv"]
    block_m = wide_m if block_n > 128 else narrow_m
    row_tiles = triton.cdiv(b * t, block_m)
    if ws is None or splits <= 1:
        splits, ws = 1, None  # an unsplit launch reads no workspace (one specialisation either way)
    elif ws[0].numel() < 2 * splits * b * t * block_n or ws[1].numel() < row_tiles:
        raise ValueError(f"conv: workspace too small for {b * t} rows x {c_out} channels in {splits} splits")
    kernel: Any = _conv_kernel
    launch(
        kernel,
        (row_tiles, splits),
        x,
        x.stride(0),
        x.stride(1),
        weight2d,
        weight2d.stride(0),
        bias,
        norm[0] if norm is not None else bias,
        norm[1] if norm is not None else bias,
        add if add is not None else bias,
        (add.stride(0) if add.shape[0] > 1 else 0) if add is not None else 0,
        res[0] if res is not None else x,
        res[0].stride(0) if res is not None else 0,
        res[0].stride(1) if res is not None else 0,
        res[0].shape[2] if res is not None else 0,
        res[1] if res is not None else weight2d,
        res[1].stride(0) if res is not None else 0,
        res[2] if res is not None else bias,
        ctx if ctx is not None else x,
        ctx.stride(0) if ctx is not None else 0,
        ctx.stride(1) if ctx is not None else 0,
        ctx.stride(2) if ctx is not None else 0,
        ws[0] if ws is not None else x,
        ws[1] if ws is not None else x,
        out,
        out.stride(0),
        out.stride(1),
        t,
        b * t,
        c_in,
        norm[2] if norm is not None else 0.0,
        N=c_out,
        TAPS=taps,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        NORM=norm is not None,
        HAS_ADD=add is not None,
        HAS_RES=res is not None,
        HAS_CTX=ctx is not None,
        SPLITS=splits,
        num_warps=warps,
    )
    return out


def conv_workspace(rows: int, channels: int, device: torch.device | str) -> tuple[Tensor, Tensor] | None:
    """What split :func:`conv` calls of up to ``rows`` rows (batch x frames) and ``channels``
    output channels need between their programs: float32 products and an int32 arrival counter
    per row tile (zeros; every launch leaves them so). None when the tier of ``rows`` does not
    split its convs. One per estimator solve: its calls run one after another."""
    wide_m, narrow_m, _, _, splits = tier(rows)["conv"]
    if splits <= 1 or triton is None:
        return None
    partials = torch.empty(2 * splits * rows * _pow2(channels), device=device, dtype=torch.float32)
    return partials, torch.zeros(triton.cdiv(rows, min(wide_m, narrow_m)), dtype=torch.int32, device=device)


def attention_workspace(
    rows: int, heads: int, head_dim: int, device: torch.device | str
) -> tuple[Tensor, Tensor] | None:
    """What split :func:`attention` calls of up to ``rows`` rows (batch x frames) need between
    their programs: float32 partial softmax sums and an int32 arrival counter per query block
    and head (zeros; every launch leaves them so). None when the tier of ``rows`` does not split.
    One per estimator solve: its calls run one after another."""
    block_m, _, _, splits = tier(rows)["attention"]
    if splits <= 1 or triton is None:
        return None
    partials = torch.empty(splits * rows * heads * (head_dim + 2), device=device, dtype=torch.float32)
    # a counter per (query block, batch row, head): at most cdiv(rows, block_m) + rows blocks
    return partials, torch.zeros((triton.cdiv(rows, block_m) + rows) * heads, dtype=torch.int32, device=device)
