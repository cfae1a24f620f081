"""Fused CUDA kernels (Triton) for the speech LM's batched decode step.

A graphed decode step of the 0.5B backbone is bound by its number of kernels, not by its
bytes: per layer, RoPE (cast, batched matmul, cast), the two K/V cache writes and SDPA (with its
copies and memsets) were ~10 kernels and ~18 us of a ~52 us layer at batch 1 (H200).
:func:`rope_append_attend` does all of it in ONE kernel per layer, and :func:`silu_mul` is the
MLP's gate in one kernel instead of two.

* ``rope_append_attend``: for each row b (of KV slot ``slot[b]``) and kv head h, rotate the
  row's q heads of group h and its new k (rotate-half RoPE, float32, rounded to the cache dtype
  like the eager path), write k and v at ``(write_slot[b], write_pos[b])``, and attend the
  group's queries over the slot's keys ``0 .. pos[b] - 1`` plus the new key, kept in
  registers (so an inactive row, whose write goes to a scratch slot, still attends over its
  own keys). Several consecutive rows may feed one slot in one step (a text group appended
  beside other streams' decode rows): row b is then ``offset[b]`` rows after the group's
  first, and its keys ``pos[b] - offset[b] .. pos[b] - 1`` are those group rows' new keys,
  which this launch is still writing, so the program recomputes them from their q/k/v rows
  instead of reading the cache. The loops run to ``pos[b]``, not over a static window: one
  graph serves every length.
  In a step of few rows (:data:`ATTENTION_SPLITS`) each row's cached keys are split over
  several programs per kv head, the last merging their softmax states in a fixed order
  (:class:`AttentionWorkspace`).
* ``decode_prologue``: everything a fused step computes from its packed host rows before its
  first layer (unpacking, a fed row's id, the embedding of each row's kind, positions, scratch
  writes, RoPE's cos/sin) in one kernel, where the torch form is ~40 small kernels.
* ``silu_mul``: ``silu(gate) * up`` of the ``[gate; up]`` GEMM output.
* ``norm_linear`` and ``linear_residual`` (steps of at most :data:`LINEAR_MAX_ROWS` rows): the
  layer's four projections as skinny GEMMs with narrow column tiles, so every SM streams
  weights: RMSNorm + q/k/v GEMM + bias; RMSNorm + [gate; up] GEMM + ``silu(gate) * up``; wo
  GEMM + residual; w2 GEMM + residual with its long reduction split over several programs
  per tile, whose float32 products the last one to arrive sums in a fixed order
  (:class:`SplitWorkspace`). 5 kernels a layer with the attention kernel, instead of 10.
* ``ras_sample``: EOS masking, softmax and the whole repetition-aware sampling draw of
  ``voice_out.model.sampling.ras_sample_batch`` (stable top-k, top-p, inverse-CDF draw, the
  repetition check and its fallback draw) in one kernel per step: one program per row, the
  vocabulary in registers; a draw of few rows splits each row's ranking over several
  programs (:class:`SampleWorkspace`), the last of which ranks their candidates and draws.
  The eager form is ~60 kernels (a radix sort of the vocabulary, scans, searches), ~0.2 ms
  of a step. Ties keep id order, as the stable sort does: each probability
  is packed with its id into one int64 key, so the k largest keys are the sort's first k.

The step's wrappers (all but ``silu_mul`` and ``decode_prologue``, which runs first) take
``pdl``: launch the kernel programmatically dependent (``voice_out.fast.kernels.launch``, Hopper and
later), its launch hidden behind the kernel before it.

All of them need Triton (it ships with PyTorch's CUDA builds); :func:`available` and
:func:`sampler_available` say whether they can run for a given device, dtype, head layout,
vocabulary and top-k. The plain-torch paths (``model/llm.py``, ``model/sampling.py``) stay the reference:
``tests/test_decode_kernels.py`` checks each kernel against them on a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from voice_out.fast.kernels.launch import launch, pdl_options, recording_active
from voice_out.model.sampling import SamplingParams

try:  # Triton comes with PyTorch's CUDA wheels; the CPU build has none (then: the eager path)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

#: Keys per block of the attention loop.
BLOCK_KEYS = 64
#: Programs per row and kv head that share a row's cached keys (:func:`rope_append_attend`
#: with an :class:`AttentionWorkspace`), by the step's rows: (at most this many rows, splits);
#: past the last entry, one program. Measured on an H100 (``scripts/bench_llm_step.py``'s
#: chained step, the dependent launch on): at 900 cached positions 969 -> 824 us a step at 1
#: row with 8 splits; at 280 positions no change. At 16 rows 4 splits took 1027 -> 942 us at
#: 900 positions but 868 -> 883 us at 280 (a new stream's first audio): not split.
ATTENTION_SPLITS: tuple[tuple[int, int], ...] = ((4, 8),)
#: Widest group of query heads per kv head one program holds (rows padded to >= 16 for tl.dot).
MAX_GROUP = 64
#: ``ras_sample``: the vocabulary ids must fit the key's low bits, and top-k one register row.
ID_BITS = 13
MAX_VOCAB = 1 << ID_BITS
MAX_TOP_K = 64
#: ``ras_sample`` with a :class:`SampleWorkspace`: programs per row (each ranks one slice of
#: the vocabulary) and warps per program, for draws of at most ``SAMPLE_MAX_ROWS`` rows.
#: Measured on an H200 (``scripts/bench_sampler.py --head``: the head GEMM and the draw, graph
#: replays): at 1 row 28.6 -> 20.0 us, at 16 rows 29.1 -> 21.3 us; at 64 rows, without the
#: head, one program per row was the faster (19.0 against 29.1 us): taller steps keep it.
SAMPLE_SPLITS = 8
SAMPLE_WARPS = 4
SAMPLE_MAX_ROWS = 16


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


def sampler_available(device: torch.device | str, vocab: int, top_k: int) -> bool:
    """True if :func:`ras_sample` can run: Triton, CUDA, ``vocab`` <= :data:`MAX_VOCAB` and
    ``top_k`` <= :data:`MAX_TOP_K`."""
    return triton is not None and torch.device(device).type == "cuda" and vocab <= MAX_VOCAB and top_k <= MAX_TOP_K


if triton is not None:
    from voice_out.fast.kernels.launch import await_previous

    @triton.jit
    def _attend_block(q, keys, vals, n_ok, m, l_sum, acc, qk_scale):  # type: ignore[no-untyped-def]
        """One block of keys into the online softmax (base 2): the new (max, sum, accumulator)."""
        s = tl.dot(q, tl.trans(keys)) * qk_scale
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        return m_new, l_sum * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p.to(vals.dtype), vals)

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
        slot_ptr,
        off_ptr,
        wslot_ptr,
        wpos_ptr,
        out_ptr,
        stride_out,
        p_ptr,
        c_ptr,
        qk_scale,
        HQ: tl.constexpr,
        HKV: tl.constexpr,
        G: tl.constexpr,
        GP: tl.constexpr,
        D: tl.constexpr,
        BLOCK: tl.constexpr,
        SPLITS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Row ``pid(0)``, kv head ``pid(1)`` (see :func:`rope_append_attend`). SPLITS > 1:
        program ``pid(2)`` attends over its share of the cached keys only (the last share
        also over the new key and the run's earlier rows), stores its online-softmax state
        (max, sum, accumulator) at ``p`` and counts itself in at the row's and head's counter
        ``c``; the last to arrive merges the states in split order (the same result whichever
        program is last), writes the output and sets the counter back to 0."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        await_previous(PDL)
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
        # the last share takes the new key (and writes it; no other program reads it)
        last_share = sp == SPLITS - 1
        if last_share:
            tl.store(k_cache_ptr + w_at + d, k_new)
            tl.store(v_cache_ptr + w_at + d, v_new)

        # online softmax in base 2 (qk_scale holds log2(e) / sqrt(D)); the new key first
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * qk_scale
        m = tl.where(last_share, s_new, float("-inf"))
        l_sum = tl.where(last_share, tl.full([GP], 1.0, tl.float32), 0.0)
        acc = tl.where(last_share, tl.zeros([GP, D], tl.float32) + v_new.to(tl.float32)[None, :], 0.0)
        off = tl.load(off_ptr + b)
        cached = tl.load(pos_ptr + b) - off  # keys already in the cache; then the group's rows
        base = tl.load(slot_ptr + b) * stride_slot + h * stride_head
        # this program's share of the cached keys: whole blocks, the last share the rest
        share = tl.cdiv(tl.cdiv(cached, SPLITS), BLOCK) * BLOCK
        lo = sp * share
        hi = tl.minimum(lo + share, cached)
        off = tl.where(last_share, off, 0)
        for start in range(lo, hi, BLOCK):
            n = start + tl.arange(0, BLOCK)
            n_ok = n < hi
            at = base + n[:, None] * stride_pos + d[None, :]
            keys = tl.load(k_cache_ptr + at, mask=n_ok[:, None], other=0.0)
            vals = tl.load(v_cache_ptr + at, mask=n_ok[:, None], other=0.0)
            m, l_sum, acc = _attend_block(q, keys, vals, n_ok, m, l_sum, acc, qk_scale)
        # not software-pipelined (num_stages=1): staged copies of both loops' tiles do not fit
        # shared memory at D = 128, and a run is short
        for start in tl.range(0, off, BLOCK, num_stages=1):
            # the group's earlier rows b - off .. b - 1: their keys as their own programs
            # compute and write them (same float32 RoPE, same rounding)
            n = start + tl.arange(0, BLOCK)
            n_ok = n < off
            r = b - off + n
            r_row = qkv_ptr + r[:, None] * stride_qkv
            r_cos = tl.load(cos_ptr + r[:, None] * D + d[None, :], mask=n_ok[:, None], other=0.0)
            r_sin = tl.load(sin_ptr + r[:, None] * D + d[None, :], mask=n_ok[:, None], other=0.0) * sign[None, :]
            k_r = tl.load(r_row + k_col + d[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32)
            k_rp = tl.load(r_row + k_col + partner[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32)
            keys = (k_r * r_cos + k_rp * r_sin).to(k_cache_ptr.dtype.element_ty)
            vals = tl.load(r_row + (HQ + HKV + h) * D + d[None, :], mask=n_ok[:, None], other=0.0)
            m, l_sum, acc = _attend_block(q, keys, vals, n_ok, m, l_sum, acc, qk_scale)
        done = True
        if SPLITS > 1:
            state = p_ptr + (b * HKV + h) * SPLITS * GP * (D + 2)  # per share: acc [GP, D], max, sum
            mine = state + sp * GP * (D + 2)
            tl.store(mine + g[:, None] * D + d[None, :], acc)
            tl.store(mine + GP * D + g, m)
            tl.store(mine + GP * (D + 1) + g, l_sum)
            # every thread's store issued before the count (then released at GPU scope)
            tl.debug_barrier()
            counter = c_ptr + b * HKV + h
            done = tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1
            if done:
                # past L1: the states were written by other SMs
                m = tl.full([GP], float("-inf"), tl.float32)
                for i in tl.static_range(SPLITS):
                    m = tl.maximum(m, tl.load(state + i * GP * (D + 2) + GP * D + g, cache_modifier=".cg"))
                l_sum = tl.zeros([GP], tl.float32)
                acc = tl.zeros([GP, D], tl.float32)
                for i in tl.static_range(SPLITS):
                    at_i = state + i * GP * (D + 2)
                    scale = tl.exp2(tl.load(at_i + GP * D + g, cache_modifier=".cg") - m)
                    l_sum += tl.load(at_i + GP * (D + 1) + g, cache_modifier=".cg") * scale
                    acc += tl.load(at_i + g[:, None] * D + d[None, :], cache_modifier=".cg") * scale[:, None]
                tl.atomic_xchg(counter, 0)
        if done:
            o = acc / l_sum[:, None]
            tl.store(out_ptr + b * stride_out + q_cols + d[None, :], o.to(out_ptr.dtype.element_ty), mask=g_ok)

    @triton.jit
    def _decode_prologue_kernel(  # type: ignore[no-untyped-def]
        packed_ptr,
        stride_p,
        last_ptr,
        len_ptr,
        llm_ptr,
        text_ptr,
        speech_ptr,
        inv_freq_ptr,
        scratch_slot,
        emb_ptr,
        tok_ptr,
        slot_ptr,
        off_ptr,
        pos_ptr,
        wslot_ptr,
        wpos_ptr,
        active_ptr,
        masked_ptr,
        uni_ptr,
        hist_ptr,
        cos_ptr,
        sin_ptr,
        H: tl.constexpr,
        D: tl.constexpr,
        W: tl.constexpr,
        C_ACTIVE: tl.constexpr,
        C_TOKEN: tl.constexpr,
        C_KIND: tl.constexpr,
        C_SLOT: tl.constexpr,
        C_OFFSET: tl.constexpr,
        C_MASKED: tl.constexpr,
        C_UNIFORMS: tl.constexpr,
        C_FEED: tl.constexpr,
        C_HISTORY: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        """Row ``pid(0)`` of :func:`decode_prologue`."""
        b = tl.program_id(0)
        row = packed_ptr + b * stride_p
        active = tl.load(row + C_ACTIVE) != 0
        kind = tl.load(row + C_KIND)
        slot = tl.load(row + C_SLOT)
        off = tl.load(row + C_OFFSET)
        feed = tl.load(row + C_FEED) != 0
        # a fed row's id is its slot's latest draw (the host packed a placeholder)
        token = tl.where(feed, tl.load(last_ptr + slot), tl.load(row + C_TOKEN))
        pos = tl.load(len_ptr + slot).to(tl.int64) + off
        tl.store(tok_ptr + b, token)
        tl.store(slot_ptr + b, slot)
        tl.store(off_ptr + b, off)
        tl.store(pos_ptr + b, pos)
        tl.store(wslot_ptr + b, tl.where(active, slot, scratch_slot))
        tl.store(wpos_ptr + b, tl.where(active, pos, 0))
        tl.store(active_ptr + b, active)
        tl.store(masked_ptr + b, tl.load(row + C_MASKED) != 0)
        two = tl.arange(0, 2)
        bits = tl.load(row + C_UNIFORMS + two)
        tl.store(uni_ptr + b * 2 + two, bits.to(tl.float64, bitcast=True).to(tl.float32))
        w = tl.arange(0, BLOCK_W)
        hist = tl.load(row + C_HISTORY + w, mask=w < W, other=0)
        hist = tl.where(feed & (w == W - 1), token, hist)
        tl.store(hist_ptr + b * W + w, hist, mask=w < W)
        # the row's embedding from the table of its kind (each table read only by its kind)
        h = tl.arange(0, BLOCK_H)
        h_ok = h < H
        e_speech = tl.load(speech_ptr + token * H + h, mask=h_ok & (kind == 2), other=0.0)
        e_text = tl.load(text_ptr + token * H + h, mask=h_ok & (kind == 1), other=0.0)
        e_llm = tl.load(llm_ptr + token * H + h, mask=h_ok & (kind == 0), other=0.0)
        emb = tl.where(kind == 2, e_speech, tl.where(kind == 1, e_text, e_llm))
        tl.store(emb_ptr + b * H + h, emb, mask=h_ok)
        # RoPE angles as rope_cos_sin makes them: float32 position x inverse frequency, twice
        d = tl.arange(0, D)
        angle = pos.to(tl.float32) * tl.load(inv_freq_ptr + d % (D // 2))
        tl.store(cos_ptr + b * D + d, tl.cos(angle))
        tl.store(sin_ptr + b * D + d, tl.sin(angle))

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

    # M (rows) unspecialised: one compile serves every batch bucket
    @triton.jit(do_not_specialize=["M"])
    def _norm_linear_kernel(  # type: ignore[no-untyped-def]
        x_ptr,
        g_ptr,
        w_ptr,
        bias_ptr,
        out_ptr,
        M,
        stride_x,
        stride_w,
        stride_out,
        eps,
        K: tl.constexpr,
        N: tl.constexpr,
        NORM: tl.constexpr,
        BIAS: tl.constexpr,
        GATED: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Rows ``pid(1)``, output columns ``pid(0)`` of ``rmsnorm(x) @ W^T (+ bias)``; GATED:
        ``silu(gate) * up`` of the columns' gate rows of W and their up rows ``N`` further."""
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < M
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        await_previous(PDL)
        x_rows = x_ptr + rows[:, None] * stride_x
        if NORM:
            # every program recomputes its rows' statistic: K values a row, from L2
            ss = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                xs = tl.load(x_rows + k0 + ks[None, :], mask=row_ok[:, None] & (k0 + ks < K)[None, :], other=0.0)
                xs = xs.to(tl.float32)
                ss += tl.sum(xs * xs, axis=1)
            rstd = 1.0 / tl.sqrt(ss / K + eps)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        w_rows = w_ptr + cols[:, None] * stride_w
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + ks < K)[None, :]
            xs = tl.load(x_rows + k0 + ks[None, :], mask=row_ok[:, None] & k_ok, other=0.0)
            if NORM:
                g = tl.load(g_ptr + k0 + ks, mask=k0 + ks < K, other=0.0).to(tl.float32)
                # the statistic and the weight in float32, rounded once (as F.rms_norm)
                xs = (xs.to(tl.float32) * rstd[:, None] * g[None, :]).to(w_ptr.dtype.element_ty)
            w = tl.load(w_rows + k0 + ks[None, :], mask=col_ok[:, None] & k_ok, other=0.0)
            acc = tl.dot(xs, tl.trans(w), acc)
            if GATED:
                w_up = tl.load(w_rows + N * stride_w + k0 + ks[None, :], mask=col_ok[:, None] & k_ok, other=0.0)
                acc_up = tl.dot(xs, tl.trans(w_up), acc_up)
        if BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            # the GEMM's outputs rounded as the unfused path stores them, then silu * up in
            # float32, rounded once (as silu_mul)
            gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
            acc = gate / (1.0 + tl.exp(-gate)) * up
        out = out_ptr + rows[:, None] * stride_out + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _add_residual(acc, r_ptr, out_ptr, rows, cols, ok, stride_r, stride_out):  # type: ignore[no-untyped-def]
        """``out = residual + acc``: added in float32, rounded once (as ``addmm``)."""
        res = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=ok, other=0.0)
        acc += res.to(tl.float32)
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)

    # M (rows) unspecialised: one compile serves every batch bucket
    @triton.jit(do_not_specialize=["M"])
    def _linear_residual_kernel(  # type: ignore[no-untyped-def]
        a_ptr,
        w_ptr,
        r_ptr,
        out_ptr,
        p_ptr,
        c_ptr,
        M,
        stride_a,
        stride_w,
        stride_r,
        stride_out,
        K: tl.constexpr,
        N: tl.constexpr,
        K_SPLIT: tl.constexpr,
        SPLITS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Rows ``pid(1)``, columns ``pid(0)`` of ``residual + a @ W^T``, added in float32 and
        rounded once (as ``addmm``); ``out`` may be ``residual``: only the program that writes
        a tile reads it.

        SPLITS > 1: program ``pid(2)`` takes reduction columns ``pid(2) * K_SPLIT ..`` only,
        stores its float32 product at ``p[pid(2)]`` (``[SPLITS, M, N]``) and counts itself in
        at its tile's counter ``c``; the last to arrive sums the SPLITS products in split
        order (the same sum whichever program is last), adds the residual and sets the counter
        back to 0 for the next launch."""
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < M
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        start = tl.program_id(2) * K_SPLIT
        await_previous(PDL)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kk in range(0, K_SPLIT, BLOCK_K):
            k0 = start + kk
            k_ok = (k0 + ks < K)[None, :]
            a = tl.load(a_ptr + rows[:, None] * stride_a + k0 + ks[None, :], mask=row_ok[:, None] & k_ok, other=0.0)
            w = tl.load(w_ptr + cols[:, None] * stride_w + k0 + ks[None, :], mask=col_ok[:, None] & k_ok, other=0.0)
            acc = tl.dot(a, tl.trans(w), acc)
        ok = row_ok[:, None] & col_ok[None, :]
        if SPLITS > 1:
            tile_p = p_ptr + rows[:, None] * N + cols[None, :]
            tl.store(tile_p + tl.program_id(2) * M * N, acc, mask=ok)
            # every thread's store issued before the count (then released at GPU scope)
            tl.debug_barrier()
            counter = c_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == SPLITS - 1:
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for sp in tl.static_range(SPLITS):
                    # past L1: the products were written by other SMs
                    acc += tl.load(tile_p + sp * M * N, mask=ok, other=0.0, cache_modifier=".cg")
                _add_residual(acc, r_ptr, out_ptr, rows, cols, ok, stride_r, stride_out)
                tl.atomic_xchg(counter, 0)
        else:
            _add_residual(acc, r_ptr, out_ptr, rows, cols, ok, stride_r, stride_out)

    @triton.jit
    def _top_keys(keys, kk, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr):  # type: ignore[no-untyped-def]
        # the TOP_K largest keys in order (-1 past them), and each one's predecessor (an
        # exclusive scan: item i - 1 at i, -1 at 0)
        top = tl.full([BLOCK_K], -1, tl.int64)
        before = tl.full([BLOCK_K], -1, tl.int64)
        for i in tl.static_range(TOP_K):
            best = tl.max(keys, axis=0)
            top = tl.where(kk == i, best, top)
            before = tl.where(kk == i + 1, best, before)
            keys = tl.where(keys == best, -1, keys)
        return top, before

    @triton.jit
    def _ras_sample_kernel(  # type: ignore[no-untyped-def]
        logits_ptr,
        stride_logits,
        history_ptr,
        stride_history,
        uniforms_ptr,
        masked_ptr,
        out_ptr,
        cand_ptr,
        counter_ptr,
        eos,
        top_p,
        repeat_threshold,
        V: tl.constexpr,
        BLOCK_V: tl.constexpr,
        SPLITS: tl.constexpr,
        TOP_K: tl.constexpr,
        BLOCK_K: tl.constexpr,
        W: tl.constexpr,
        WIN: tl.constexpr,
        BLOCK_W: tl.constexpr,
        ID_BITS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Row ``pid(0)``. SPLITS > 1: program ``pid(1)`` ranks the vocabulary's ``pid(1)``-th
        slice alone (its TOP_K keys to ``cand[row, pid(1)]``) and counts itself in at the
        row's ``counter``; the last to arrive ranks the SPLITS x TOP_K candidates (in slice
        order: the same keys whichever program is last), draws, and sets the counter back to
        0 for the next launch. Every program computes the whole row's softmax maximum and sum
        the same way, so each slice's probabilities are those of one softmax."""
        r = tl.program_id(0)
        await_previous(PDL)
        col = tl.arange(0, BLOCK_V)
        in_vocab = col < V
        masked = tl.load(masked_ptr + r) != 0
        x = tl.load(logits_ptr + r * stride_logits + col, mask=in_vocab, other=float("-inf")).to(tl.float32)
        x = tl.where((col == eos) & masked, float("-inf"), x)
        x_max = tl.max(x, axis=0)
        total = tl.sum(tl.exp(x - x_max), axis=0)
        id_mask: tl.constexpr = (1 << ID_BITS) - 1
        kk = tl.arange(0, BLOCK_K)
        # stable top-k: probability bits (monotone for p >= 0) above, (MAX - id) below
        if SPLITS == 1:
            probs = tl.exp(x - x_max) / total  # 0 outside the vocabulary
            keys = (probs.to(tl.int32, bitcast=True).to(tl.int64) << ID_BITS) | (id_mask - col)
            top, before = _top_keys(tl.where(in_vocab, keys, -1), kk, TOP_K, BLOCK_K)
            last = True
        else:
            SLICE: tl.constexpr = BLOCK_V // SPLITS
            sc = tl.program_id(1) * SLICE + tl.arange(0, SLICE)
            s_ok = sc < V
            xs = tl.load(logits_ptr + r * stride_logits + sc, mask=s_ok, other=float("-inf")).to(tl.float32)
            xs = tl.where((sc == eos) & masked, float("-inf"), xs)
            ps = tl.exp(xs - x_max) / total  # the same float32 values as the whole row's
            keys = (ps.to(tl.int32, bitcast=True).to(tl.int64) << ID_BITS) | (id_mask - sc)
            mine, _ = _top_keys(tl.where(s_ok, keys, -1), kk, TOP_K, BLOCK_K)
            row_cand = cand_ptr + r * SPLITS * BLOCK_K
            tl.store(row_cand + tl.program_id(1) * BLOCK_K + kk, mine)
            # every thread's store issued before the count (then released at GPU scope)
            tl.debug_barrier()
            arrived = tl.atomic_add(counter_ptr + r, 1, sem="acq_rel")
            last = arrived == SPLITS - 1
            top = tl.full([BLOCK_K], -1, tl.int64)
            before = tl.full([BLOCK_K], -1, tl.int64)
            if last:
                # past L1: the other slices' keys were written by other SMs
                cand = tl.load(row_cand + tl.arange(0, SPLITS * BLOCK_K), cache_modifier=".cg")
                top, before = _top_keys(cand, kk, TOP_K, BLOCK_K)
                tl.atomic_xchg(counter_ptr + r, 0)
        if last:
            top_ok = kk < TOP_K
            top_id = tl.where(top_ok, id_mask - (top & id_mask), 0)
            top_prob = tl.where(top_ok, (top >> ID_BITS).to(tl.int32).to(tl.float32, bitcast=True), 0.0)
            prev_prob = tl.where(before >= 0, (before >> ID_BITS).to(tl.int32).to(tl.float32, bitcast=True), 0.0)
            # nucleus: item i is kept while the items before it sum to < top_p (float32, as eager)
            kept_before = tl.cumsum(prev_prob, axis=0)
            weights = tl.where(top_ok & (kept_before < top_p), top_prob, 0.0)
            first = _inverse_cdf_pick(weights, tl.load(uniforms_ptr + r * 2), kk, top_id)

            w = tl.arange(0, BLOCK_W)  # the last WIN columns of the history row
            hist = tl.load(history_ptr + r * stride_history + (W - WIN) + w, mask=w < WIN, other=-1)
            repeats = tl.sum(tl.where(hist == first, 1.0, 0.0), axis=0)
            picked = first.to(tl.int64)
            if repeats >= repeat_threshold:
                # fallback: the full distribution without the first draw, only when it is taken
                full = tl.where(col == first, 0.0, tl.exp(x - x_max) / total)
                picked = _inverse_cdf_pick(full, tl.load(uniforms_ptr + r * 2 + 1), col, col).to(tl.int64)
            tl.store(out_ptr + r, picked)

    @triton.jit
    def _inverse_cdf_pick(weights, u, index, ids):  # type: ignore[no-untyped-def]
        # sampling._inverse_cdf: the count of float64 cdf entries <= u * total, clamped to the
        # last positive weight; returns ids[that index]
        cdf = tl.cumsum(weights.to(tl.float64), axis=0)
        total = tl.sum(weights.to(tl.float64), axis=0)
        at = tl.sum(tl.where(cdf <= u.to(tl.float64) * total, 1, 0), axis=0)
        last_positive = tl.max(tl.where(weights > 0, index, 0), axis=0)
        at = tl.minimum(at, last_positive)
        return tl.sum(tl.where(index == at, ids, 0), axis=0)


def rope_append_attend(
    qkv: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cos: Tensor,
    sin: Tensor,
    pos: Tensor,
    slot: Tensor,
    offset: Tensor,
    write_slot: Tensor,
    write_pos: Tensor,
    n_heads: int,
    n_kv_heads: int,
    pdl: bool = False,
    workspace: AttentionWorkspace | None = None,
    splits: int = 1,
) -> Tensor:
    """RoPE, K/V append and decode attention of one layer, one kernel (see module docstring).

    * ``qkv`` ``[B, (Hq + 2 Hkv) D]``: the layer's q | k | v projections (bias added), row b
      for KV slot ``slot[b]``; ``k_cache``/``v_cache`` ``[S, Hkv, L, D]``, D contiguous.
    * ``cos``/``sin`` float32 ``[B, D]``: :func:`voice_out.model.llm.rope_cos_sin` of ``pos``.
    * ``pos`` int64 ``[B]``: keys ``0 .. pos[b] - 1`` of slot ``slot[b]`` (int64 ``[B]``) are
      attended, then the new key; ``offset`` int64 ``[B]``: row b is the ``offset[b]``-th row
      after the first of a run of consecutive rows feeding the same slot at consecutive
      positions (0 for a lone row): the last ``offset[b]`` of those keys are those rows' new
      keys, taken from ``qkv`` (the cache holds the rest);
      ``write_slot``/``write_pos`` int64 ``[B]``: where the new k/v go.
    * ``pdl``: launch it programmatically dependent (``voice_out.fast.kernels.launch``).
    * ``workspace``, ``splits``: each row's cached keys are split over ``splits`` programs per
      kv head, whose softmax states the last of them merges in a fixed order (more SMs for a
      step of few rows, :func:`attention_splits`); without a workspace, one program.

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
    if any(t.dim() != 1 or not t.is_contiguous() for t in (pos, slot, offset, write_slot, write_pos)):
        raise ValueError("rope_append_attend: pos, slot, offset, write_slot and write_pos must be contiguous [B]")
    out = torch.empty(b, n_heads * d, device=qkv.device, dtype=qkv.dtype)
    gp = padded_group(n_heads, n_kv_heads)
    states = counters = out
    if workspace is None:
        splits = 1
    elif splits > 1:
        need = b * n_kv_heads * splits * gp * (d + 2)
        if workspace.states.numel() < need or workspace.counters.numel() < b * n_kv_heads:
            raise ValueError(f"rope_append_attend: the workspace does not fit {b} rows x {splits} splits")
        states, counters = workspace.states, workspace.counters
    grid = (b, n_kv_heads, splits)
    kernel: Any = _rope_append_attend_kernel
    launch(
        kernel,
        grid,
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
        slot,
        offset,
        write_slot,
        write_pos,
        out,
        out.stride(0),
        states,
        counters,
        math.log2(math.e) / math.sqrt(d),
        HQ=n_heads,
        HKV=n_kv_heads,
        G=group,
        GP=gp,
        D=d,
        BLOCK=BLOCK_KEYS,
        SPLITS=splits,
        **pdl_options(pdl),
    )
    return out


@dataclass(frozen=True)
class AttentionWorkspace:
    """What :func:`rope_append_attend` with split keys needs between its programs: each
    program's float32 softmax state (accumulator, max and sum of its padded query group) and
    one int32 arrival counter per row and kv head, zero between launches (each launch leaves
    them so). One launch at a time may use a workspace: launches on one stream, or their own."""

    states: Tensor
    counters: Tensor

    @classmethod
    def allocate(
        cls, device: torch.device | str, rows: int, n_heads: int, n_kv_heads: int, head_dim: int, splits: int
    ) -> AttentionWorkspace:
        """For steps of up to ``rows`` rows of a model with these heads, ``splits`` programs each."""
        group = padded_group(n_heads, n_kv_heads)
        states = torch.empty(rows * n_kv_heads * splits * group * (head_dim + 2), device=device, dtype=torch.float32)
        return cls(states, torch.zeros(rows * n_kv_heads, device=device, dtype=torch.int32))

    @classmethod
    def for_steps(cls, device: torch.device | str, n_heads: int, n_kv_heads: int, head_dim: int) -> AttentionWorkspace:
        """For every step that :data:`ATTENTION_SPLITS` splits."""
        rows = max(most for most, _ in ATTENTION_SPLITS)
        splits = max(n for _, n in ATTENTION_SPLITS)
        return cls.allocate(device, rows, n_heads, n_kv_heads, head_dim, splits)


def padded_group(n_heads: int, n_kv_heads: int) -> int:
    """The query heads of a kv group as the attention kernel holds them: a power of two, at
    least 16 (``tl.dot``'s least)."""
    return max(16, 1 << (n_heads // n_kv_heads - 1).bit_length())


def attention_splits(rows: int) -> int:
    """Programs sharing each row's cached keys in a step of ``rows`` rows (:data:`ATTENTION_SPLITS`)."""
    return next((s for most, s in ATTENTION_SPLITS if rows <= most), 1)


@dataclass(frozen=True)
class StepRows:
    """One decode step's rows on the device, made from its packed host rows by
    :func:`decode_prologue`: int64 ``[B]`` ``tokens`` (a fed row's resolved), ``slots``,
    ``offsets``, ``pos`` (the slot's length plus the offset), ``write_slot`` and ``write_pos``
    (an inactive row's go to the scratch slot's position 0); bool ``[B]`` ``active``,
    ``masked``; float32 ``uniforms`` ``[B, 2]``; int64 ``history``
    ``[B, W]`` (a fed row's last id resolved); the embeddings ``embeds`` ``[B, H]``; float32
    ``cos``/``sin`` ``[B, D]`` of ``pos`` (:func:`voice_out.model.llm.rope_cos_sin`)."""

    tokens: Tensor
    slots: Tensor
    offsets: Tensor
    pos: Tensor
    write_slot: Tensor
    write_pos: Tensor
    active: Tensor
    masked: Tensor
    uniforms: Tensor
    history: Tensor
    embeds: Tensor
    cos: Tensor
    sin: Tensor


@dataclass(frozen=True)
class PackedColumns:
    """Where a packed decode row keeps each field (``voice_out.fast.llm_step``' layout):
    the column of each scalar, of the two uniforms' float64 bits, and of the first of the
    ``win`` history ids."""

    active: int
    token: int
    kind: int
    slot: int
    offset: int
    masked: int
    uniforms: int
    feed: int
    history: int
    win: int


def decode_prologue(
    packed: Tensor,
    columns: PackedColumns,
    last_ids: Tensor,
    lengths: Tensor,
    tables: tuple[Tensor, Tensor, Tensor],
    inv_freq: Tensor,
    scratch_slot: int,
) -> StepRows:
    """Everything a fused decode step computes from its packed rows before its first layer,
    in ONE kernel (one program per row; the torch form is ~40 small kernels): unpacking, a fed
    row's id from ``last_ids`` (int64 ``[S]``), positions from ``lengths`` (``[S]``), the
    scratch writes of inactive rows, the embedding of each row's kind from ``tables`` =
    (``llm_embedding``, ``embed_tokens``, ``speech_embedding``) weights (kind 0, 1, 2), and
    RoPE's cos/sin from ``inv_freq`` float32 ``[D / 2]``.

    ``packed`` int64 ``[B, columns.history + columns.win]``, rows contiguous. Reads nothing
    the step writes, so it runs first; launched as usual (not dependent). CUDA with Triton."""
    b, width = packed.shape
    if packed.dtype != torch.int64 or packed.stride(1) != 1 or width < columns.history + columns.win:
        raise ValueError(f"decode_prologue: packed rows must be int64 [B, >= {columns.history + columns.win}]")
    llm, text, speech = tables
    hidden = speech.shape[1]
    d = 2 * inv_freq.shape[0]
    dev = packed.device
    # one row per field, each 16-byte aligned whatever B is (Triton specialises a kernel on
    # its pointers' alignment: one compile then serves every batch bucket)
    width = -(-b // 16) * 16
    longs = torch.empty(6, width, dtype=torch.long, device=dev)[:, :b]
    flags = torch.empty(2, width, dtype=torch.bool, device=dev)[:, :b]
    rows = StepRows(
        tokens=longs[0],
        slots=longs[1],
        offsets=longs[2],
        pos=longs[3],
        write_slot=longs[4],
        write_pos=longs[5],
        active=flags[0],
        masked=flags[1],
        uniforms=torch.empty(b, 2, dtype=torch.float32, device=dev),
        history=torch.empty(b, columns.win, dtype=torch.long, device=dev),
        embeds=torch.empty(b, hidden, dtype=speech.dtype, device=dev),
        cos=torch.empty(b, d, dtype=torch.float32, device=dev),
        sin=torch.empty(b, d, dtype=torch.float32, device=dev),
    )
    if recording_active():
        # the kernel is recorded, not run: inactive rows of the scratch slot, so the torch ops
        # after it index nothing else (a start-up dry run, voice_out.fast.kernels.precompile)
        longs.zero_()
        flags.zero_()
        rows.slots.fill_(scratch_slot)
        rows.write_slot.fill_(scratch_slot)
    kernel: Any = _decode_prologue_kernel
    launch(
        kernel,
        (b,),
        packed,
        packed.stride(0),
        last_ids,
        lengths,
        llm,
        text,
        speech,
        inv_freq,
        scratch_slot,
        rows.embeds,
        rows.tokens,
        rows.slots,
        rows.offsets,
        rows.pos,
        rows.write_slot,
        rows.write_pos,
        rows.active,
        rows.masked,
        rows.uniforms,
        rows.history,
        rows.cos,
        rows.sin,
        H=hidden,
        D=d,
        W=columns.win,
        C_ACTIVE=columns.active,
        C_TOKEN=columns.token,
        C_KIND=columns.kind,
        C_SLOT=columns.slot,
        C_OFFSET=columns.offset,
        C_MASKED=columns.masked,
        C_UNIFORMS=columns.uniforms,
        C_FEED=columns.feed,
        C_HISTORY=columns.history,
        BLOCK_H=triton.next_power_of_2(hidden),
        BLOCK_W=max(16, triton.next_power_of_2(columns.win)),
    )
    return rows


def silu_mul(x: Tensor) -> Tensor:
    """``silu(x[:, :N]) * x[:, N:]`` for ``x`` ``[R, 2N]`` (rows contiguous) -> ``[R, N]``, one kernel."""
    rows, two_n = x.shape
    n = two_n // 2
    if x.stride(1) != 1 or two_n != 2 * n:
        raise ValueError(f"silu_mul: need [R, 2N] with contiguous rows, got {tuple(x.shape)}")
    out = torch.empty(rows, n, device=x.device, dtype=x.dtype)
    block = 1024
    kernel: Any = _silu_mul_kernel
    launch(kernel, (rows, triton.cdiv(n, block)), x, out, x.stride(0), out.stride(0), N=n, BLOCK=block)
    return out


#: Rows (decode rows of one step) up to which :func:`norm_linear` and :func:`linear_residual`
#: serve the step: one 16-row tile (``tl.dot``'s least). Past it the GEMMs are the library's.
LINEAR_MAX_ROWS = 16


@dataclass(frozen=True)
class LinearTiles:
    """Tiles of one fused-linear launch: ``block_n`` output columns and ``block_k`` of the
    reduction per loop turn for one program; its rows are one tile of :data:`LINEAR_MAX_ROWS`.
    ``splits``: :func:`linear_residual` with a :class:`SplitWorkspace` cuts the reduction into
    that many programs per tile."""

    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4
    splits: int = 1

    def launch_options(self) -> dict[str, int]:
        """The tile constexprs and Triton launch options of a fused-linear kernel."""
        return {
            "BLOCK_M": LINEAR_MAX_ROWS,
            "BLOCK_N": self.block_n,
            "BLOCK_K": self.block_k,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }


#: Tiles by kind of call: "norm" (norm + GEMM + bias: q/k/v), "gated" (norm + [gate; up] +
#: silu * up), "residual" (GEMM + residual: wo) and "split" (GEMM + residual with the
#: reduction split: w2). Chosen on an H100 at 1 and 16 rows (``scripts/bench_llm_step.py
#: --linear-sweep``): at these shapes a program's weight tile is the whole cost, so the tiles
#: that keep the most SMs streaming win.
LINEAR_TILES: dict[str, LinearTiles] = {
    "norm": LinearTiles(16, 256, 4, 3),
    "gated": LinearTiles(64, 128, 8, 4),
    "residual": LinearTiles(16, 128, 4, 5),
    "split": LinearTiles(32, 128, 4, 5, splits=8),
}


@dataclass(frozen=True)
class SplitWorkspace:
    """What :func:`linear_residual` with a split reduction needs between its programs: their
    float32 products ``[splits, LINEAR_MAX_ROWS, max_n]`` and one int32 arrival counter per
    output tile, zero between launches (each launch leaves them so). One launch at a time may
    use a workspace: launches on one stream, or their own workspaces."""

    partials: Tensor
    counters: Tensor

    @classmethod
    def allocate(cls, device: torch.device | str, max_n: int, splits: int | None = None) -> SplitWorkspace:
        """For outputs of up to ``max_n`` columns, ``splits`` (None: ``LINEAR_TILES["split"]``)."""
        splits = LINEAR_TILES["split"].splits if splits is None else splits
        partials = torch.empty(splits, LINEAR_MAX_ROWS, max_n, device=device, dtype=torch.float32)
        return cls(partials, torch.zeros(max_n, device=device, dtype=torch.int32))


@dataclass(frozen=True)
class SampleWorkspace:
    """What :func:`ras_sample` with split rows needs between a row's programs: their top-k
    keys ``[rows, splits, block_k]`` and one int32 arrival counter per row, zero between
    launches (each launch leaves them so). One launch at a time may use a workspace."""

    candidates: Tensor
    counters: Tensor

    @classmethod
    def allocate(cls, device: torch.device | str, max_rows: int, top_k: int, splits: int = 0) -> SampleWorkspace:
        """For up to ``max_rows`` rows, top-k ``top_k``, ``splits`` slices (0: :data:`SAMPLE_SPLITS`)."""
        splits = splits or SAMPLE_SPLITS
        candidates = torch.empty(max_rows * splits * _top_k_block(top_k), device=device, dtype=torch.int64)
        return cls(candidates, torch.zeros(max_rows, device=device, dtype=torch.int32))


def _top_k_block(top_k: int) -> int:
    """The sampler's top-k register row: a power of two of at least 16 (``tl.arange``)."""
    return max(16, 1 << max(0, top_k - 1).bit_length())


def _rows_fit(name: str, a: Tensor, weight: Tensor) -> None:
    if a.dim() != 2 or a.shape[0] > LINEAR_MAX_ROWS or weight.shape[1] != a.shape[1]:
        raise ValueError(f"{name}: rows {tuple(a.shape)} and weight {tuple(weight.shape)} do not fit")
    if a.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"{name}: rows must be contiguous")


def norm_linear(
    x: Tensor,
    weight: Tensor,
    norm_weight: Tensor | None,
    eps: float,
    bias: Tensor | None = None,
    gated: bool = False,
    pdl: bool = False,
) -> Tensor:
    """``rmsnorm(x) @ weight^T + bias`` in one kernel, for the decode step's few rows.

    * ``x`` ``[M, K]`` (rows contiguous), M <= :data:`LINEAR_MAX_ROWS`; ``norm_weight``
      ``[K]`` or None (no norm); the norm as ``F.rms_norm``: statistic and weight in float32,
      rounded once to x's dtype before the GEMM.
    * ``weight`` ``[N, K]`` (``nn.Linear`` layout, rows contiguous), ``bias`` ``[N]`` or None;
      accumulated in float32, bias added, rounded once.
    * ``gated``: ``weight`` is ``[gate; up]`` (``[2N, K]``) and the result ``silu(gate) * up``
      ``[M, N]``, gate and up rounded as a GEMM stores them, then as :func:`silu_mul`.
    * ``pdl``: launch it programmatically dependent (``voice_out.fast.kernels.launch``).

    Returns ``[M, N]`` in x's dtype. Graph-capturable; CUDA with Triton only.
    """
    _rows_fit("norm_linear", x, weight)
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    t = LINEAR_TILES["gated" if gated else "norm"]
    kernel: Any = _norm_linear_kernel
    launch(
        kernel,
        (triton.cdiv(n, t.block_n), triton.cdiv(m, LINEAR_MAX_ROWS)),
        x,
        x if norm_weight is None else norm_weight,
        weight,
        weight if bias is None else bias,
        out,
        m,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        eps,
        K=k,
        N=n,
        NORM=norm_weight is not None,
        BIAS=bias is not None,
        GATED=gated,
        **t.launch_options(),
        **pdl_options(pdl),
    )
    return out


def linear_residual(
    a: Tensor,
    weight: Tensor,
    residual: Tensor,
    out: Tensor | None = None,
    workspace: SplitWorkspace | None = None,
    pdl: bool = False,
) -> Tensor:
    """``residual + a @ weight^T`` in one kernel (``addmm``'s rounding), into ``out`` (may be
    ``residual`` itself: in place) or a new tensor.

    ``a`` ``[M, K]``, ``weight`` ``[N, K]``, ``residual``/``out`` ``[M, N]``, rows contiguous,
    M <= :data:`LINEAR_MAX_ROWS`. With ``workspace``, the reduction is split
    (``LINEAR_TILES["split"]``): a GEMM with few outputs and a long reduction (the MLP's down
    projection) then streams its weight from that many times the SMs; the last program of each
    tile sums the float32 products in a fixed order, so the result does not depend on which
    program finishes last. ``pdl``: as :func:`norm_linear`. Graph-capturable; CUDA with
    Triton only.
    """
    _rows_fit("linear_residual", a, weight)
    m, k = a.shape
    n = weight.shape[0]
    if tuple(residual.shape) != (m, n) or residual.stride(1) != 1:
        raise ValueError(f"linear_residual: residual {tuple(residual.shape)} does not fit {(m, n)}")
    if out is None:
        out = torch.empty_like(residual)
    t = LINEAR_TILES["split" if workspace is not None else "residual"]
    splits = 1
    partials = counters = out
    if workspace is not None:
        splits = t.splits
        tiles = triton.cdiv(n, t.block_n)
        if (
            workspace.partials.shape[0] != splits
            or workspace.partials.shape[2] < n
            or workspace.counters.numel() < tiles
        ):
            raise ValueError(f"linear_residual: the workspace does not fit {splits} splits of {n} outputs")
        partials, counters = workspace.partials, workspace.counters
    # a reduction slice per program, a whole number of block_k steps
    k_split = triton.cdiv(triton.cdiv(k, splits), t.block_k) * t.block_k
    kernel: Any = _linear_residual_kernel
    launch(
        kernel,
        (triton.cdiv(n, t.block_n), triton.cdiv(m, LINEAR_MAX_ROWS), splits),
        a,
        weight,
        residual,
        out,
        partials,
        counters,
        m,
        a.stride(0),
        weight.stride(0),
        residual.stride(0),
        out.stride(0),
        K=k,
        N=n,
        K_SPLIT=k_split,
        SPLITS=splits,
        **t.launch_options(),
        **pdl_options(pdl),
    )
    return out


def ras_sample(
    logits: Tensor,
    history: Tensor,
    uniforms: Tensor,
    eos_masked: Tensor,
    eos_token: int,
    params: SamplingParams,
    pdl: bool = False,
    workspace: SampleWorkspace | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
) -> Tensor:
    """One RAS draw per row, one kernel: ``voice_out.model.sampling.ras_sample_batch`` of
    ``mask_eos_(log_softmax(logits))`` with ``params``.

    ``logits`` ``[B, V]`` (any float dtype; rows may be strided, e.g. a view of a padded
    head's output), ``history`` int64 ``[B, W]`` (its last ``win_size`` columns are the
    window; rows may be strided, e.g. a view of the packed decode rows), ``uniforms`` float32
    ``[B, 2]`` contiguous, ``eos_masked`` bool ``[B]``; ``pdl``: launch it programmatically
    dependent (``voice_out.fast.kernels.launch``). Returns int64 ``[B]``. No host sync; CUDA with
    Triton (:func:`sampler_available`).

    With a ``workspace`` (:class:`SampleWorkspace`), each row's vocabulary is ranked in
    ``splits`` slices by as many programs (None: :data:`SAMPLE_SPLITS` for a draw of at most
    :data:`SAMPLE_MAX_ROWS` rows, else one program per row), the last of which ranks their
    candidates and draws: the same ids as one program per row, in a fraction of its time.
    ``num_warps``: per program (None: :data:`SAMPLE_WARPS` for the splits used).
    """
    rows, vocab = logits.shape
    width = history.shape[1]
    win = min(params.win_size, width)
    if logits.stride(1) != 1 or history.stride(1) != 1 or not uniforms.is_contiguous():
        raise ValueError("ras_sample: logits and history rows, and uniforms, must be contiguous")
    block_v = triton.next_power_of_2(vocab)
    block_k = _top_k_block(params.top_k)
    if workspace is None:
        splits = 1
    else:
        if splits is None:
            splits = SAMPLE_SPLITS if rows <= SAMPLE_MAX_ROWS else 1
        if splits < 1 or block_v % splits or block_v // splits < block_k:
            raise ValueError(f"ras_sample: {splits} splits do not divide a {block_v}-wide row into top-k slices")
        if splits > 1 and (workspace.candidates.numel() < rows * splits * block_k or workspace.counters.numel() < rows):
            raise ValueError(f"ras_sample: the workspace does not fit {rows} rows x {splits} splits")
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    kernel: Any = _ras_sample_kernel
    launch(
        kernel,
        (rows, splits),
        logits,
        logits.stride(0),
        history,
        history.stride(0),
        uniforms,
        eos_masked,
        out,
        workspace.candidates if splits > 1 and workspace is not None else out,
        workspace.counters if splits > 1 and workspace is not None else out,
        eos_token,
        params.top_p,
        params.repeat_threshold,
        V=vocab,
        BLOCK_V=block_v,
        SPLITS=splits,
        TOP_K=min(params.top_k, vocab),
        BLOCK_K=block_k,
        W=width,
        WIN=win,
        BLOCK_W=max(16, triton.next_power_of_2(win)),
        ID_BITS=ID_BITS,
        num_warps=(SAMPLE_WARPS if splits > 1 else 8) if num_warps is None else num_warps,
        **pdl_options(pdl),
    )
    return out
