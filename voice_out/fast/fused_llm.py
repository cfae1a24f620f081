"""The LLM's decode step with the Triton kernels, applied to a built :class:`SpeechLM`.

:meth:`SpeechLM.decode_step` is the eager step; :func:`decode_step` here computes the same
hidden states from the same :class:`KVCache` with ``voice_out.fast.kernels.decode``: RoPE, the
K/V append and attention as one kernel per layer, and the MLP gate as one. Attention then runs
to each row's own length (no window). An inactive row attends over its slot's keys and its new
key (the eager step reads whatever is at its position instead); its output is unused either
way. :func:`decode_rows` is the same step for rows whose positions, embeddings and RoPE angles
``decode_kernels.decode_prologue`` made on the device (what the graphed step of
``voice_out.fast.llm_step`` replays).

Options of both:

* ``linear`` (at most ``decode_kernels.LINEAR_MAX_ROWS`` rows; more run the GEMMs in torch):
  the GEMMs as Triton kernels too, each norm inside the GEMM after it, the MLP gate inside the
  [gate; up] GEMM and the residual adds inside wo and w2: 5 kernels a layer; with
  ``split_workspace`` (``decode_kernels.SplitWorkspace`` of at least H outputs, used by this
  step alone) w2's reduction is split over more SMs;
* ``pdl``: the Triton kernels launched programmatically dependent (check
  ``launch.dependent_launch_available``): each is launched while the one before it still runs
  and waits for its results inside, hiding launch latency.

CUDA with Triton only (``decode_kernels.available``); ``tests/test_decode_kernels.py`` holds
them to the eager step. Static shapes, no host sync: CUDA-graph capturable. GPU worker thread.
"""

from __future__ import annotations

import torch
from torch import Tensor

from voice_out.fast.kernels import decode as decode_kernels
from voice_out.model.llm import Block, KVCache, SpeechLM, rope_cos_sin


@torch.no_grad()
def decode_step(
    lm: SpeechLM,
    cache: KVCache,
    slots: Tensor | None,
    embeds: Tensor,
    active: Tensor | None = None,
    scratch_slot: int | None = None,
    offsets: Tensor | None = None,
    linear: bool = False,
    split_workspace: decode_kernels.SplitWorkspace | None = None,
    pdl: bool = False,
) -> Tensor:
    """:meth:`SpeechLM.decode_step` of ``lm`` with the Triton kernels (the arguments as its
    own, the options as the module's): ``embeds`` ``[B, H]`` -> final-norm hidden states
    ``[B, H]``, appending each active row to its slot of ``cache``."""
    b = int(embeds.shape[0])
    h = embeds.to(lm.llm_decoder.weight.dtype)  # [B, H]
    rows = lm.step_positions(cache, slots, b, offsets, active, scratch_slot)
    linear = linear and b <= decode_kernels.LINEAR_MAX_ROWS
    h = layers(
        lm, cache, h, rows.pos, rows.slots, rows.offsets, rows.write_slot, rows.write_pos, linear, split_workspace, pdl
    )
    return lm.advance(cache, h, rows.slots, active)


@torch.no_grad()
def decode_rows(
    lm: SpeechLM,
    cache: KVCache,
    rows: decode_kernels.StepRows,
    linear: bool = False,
    split_workspace: decode_kernels.SplitWorkspace | None = None,
    pdl: bool = False,
    attention_workspace: decode_kernels.AttentionWorkspace | None = None,
) -> Tensor:
    """:func:`decode_step` for rows whose slots, positions, scratch writes, embeddings and RoPE
    angles ``decode_kernels.decode_prologue`` made on the device (one kernel where the torch
    form takes ~40): ``rows.embeds`` ``[B, H]`` -> final-norm hidden states ``[B, H]``.
    ``attention_workspace``: each row's cached keys split over ``decode_kernels.
    attention_splits`` programs (``rope_append_attend``). Graph-capturable, no host sync."""
    linear = linear and rows.embeds.shape[0] <= decode_kernels.LINEAR_MAX_ROWS
    h = layers(
        lm,
        cache,
        rows.embeds,
        rows.pos,
        rows.slots,
        rows.offsets,
        rows.write_slot,
        rows.write_pos,
        linear,
        split_workspace,
        pdl,
        rope=(rows.cos, rows.sin),
        attention_workspace=attention_workspace,
    )
    return lm.advance(cache, h, rows.slots, rows.active)


def layers(
    lm: SpeechLM,
    cache: KVCache,
    h: Tensor,
    pos: Tensor,
    slot: Tensor,
    offset: Tensor,
    write_slot: Tensor,
    write_pos: Tensor,
    linear: bool = False,
    split_workspace: decode_kernels.SplitWorkspace | None = None,
    pdl: bool = False,
    rope: tuple[Tensor, Tensor] | None = None,
    attention_workspace: decode_kernels.AttentionWorkspace | None = None,
) -> Tensor:
    """The decode step's layers of ``lm`` with the Triton kernels (row b of ``slot[b]``); h
    ``[B, H]``; ``rope``: the rows' float32 cos/sin ``[B, D]`` (None: made here from ``pos``);
    ``attention_workspace``: the attention's keys split (``rope_append_attend``).

    Per layer 7 kernels: norm, qkv GEMM, RoPE + K/V append + attention, wo GEMM with the
    residual, norm, w13 GEMM, silu * up, w2 GEMM with the residual. The residual GEMMs run
    in place (``addmm_``: C is the output): an out-of-place ``addmm`` first copies its C
    operand into a new tensor, a kernel of its own (48 a step, ~0.1 ms at batch 1). The
    first one is out of place, so ``h`` (the caller's embeddings) is never written.

    With ``linear``, 5 kernels a layer (``decode_kernels``): norm + qkv GEMM + bias; RoPE +
    K/V append + attention; wo GEMM + residual; norm + [gate; up] GEMM + silu * up; w2 GEMM
    + residual (its reduction split with ``split_workspace``). ``pdl``: the Triton kernels
    launched programmatically dependent.
    """
    dims = lm.dims
    cos, sin = rope if rope is not None else rope_cos_sin(pos, dims.head_dim, dims.rope_theta)  # [B, D], per step
    splits = decode_kernels.attention_splits(h.shape[0]) if attention_workspace is not None else 1
    for i, layer in enumerate(lm.layers):
        assert isinstance(layer, Block)
        attn, mlp = layer.attn, layer.mlp
        norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
        if linear:
            qkv = decode_kernels.norm_linear(h, attn.wqkv.weight, norm1.weight, norm1.eps, attn.wqkv.bias, pdl=pdl)
        else:
            qkv = attn.wqkv(norm1(h))  # [B, (Hq + 2 Hkv) D]
        o = decode_kernels.rope_append_attend(
            qkv,
            cache.k[i],
            cache.v[i],
            cos,
            sin,
            pos,
            slot,
            offset,
            write_slot,
            write_pos,
            dims.n_heads,
            dims.n_kv_heads,
            pdl=pdl,
            workspace=attention_workspace,
            splits=splits,
        )
        if linear:
            # in place but at layer 0, whose h is the caller's embeddings
            h = decode_kernels.linear_residual(o, attn.wo.weight, h, out=None if i == 0 else h, pdl=pdl)
            act = decode_kernels.norm_linear(h, mlp.w13.weight, norm2.weight, norm2.eps, gated=True, pdl=pdl)
            decode_kernels.linear_residual(act, mlp.w2.weight, h, out=h, workspace=split_workspace, pdl=pdl)
            continue
        h = torch.addmm(h, o, attn.wo.weight.t()) if i == 0 else h.addmm_(o, attn.wo.weight.t())
        act = decode_kernels.silu_mul(mlp.w13(norm2(h)))
        h.addmm_(act, mlp.w2.weight.t())
    return h
