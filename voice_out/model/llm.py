"""The CosyVoice2 speech-token LM: a Qwen2 backbone with speech embeddings and a speech head.

Pure torch. Everything follows cosyvoice2-spec sections 2.1-2.3:

* ``RMSNorm``: statistic in float32 (one fused kernel with the weight; in bf16 that rounds once
  where HF rounds twice, <= 1 ulp).
* RoPE in the rotate-half layout with cos/sin computed in float32 from the absolute positions.
* GQA attention: q/k/v projections with bias (fused into one ``wqkv``), ``wo`` without bias;
  query head ``h`` reads kv head ``h // (n_heads / n_kv_heads)``. Torch SDPA does the math: the
  query heads of one kv group are folded into the query-length axis, so K/V are never repeated.
* SwiGLU MLP with gate and up fused into one ``w13``.
* ``SpeechLM``: ``embed_tokens`` (text), ``speech_embedding`` (speech ids + 3 specials),
  ``llm_embedding`` (row 0 = SOS, row 1 = TASK_ID) and the ``llm_decoder`` head. The tied
  Qwen ``lm_head`` does not exist here.

The state lives outside the module in a preallocated :class:`KVCache` that the caller owns:

* ``prefill(cache, slot, embeds[L, H])`` appends L positions to ONE slot (a prompt, or more text
  later on: bistream feeds text between decode steps) and returns the last hidden state;
* ``decode_step(cache, slots[B], embeds[B, H])`` appends one position to each of B slots in one
  batched call, every row at its own position (with ``offsets``, a run of rows may append
  several positions to one slot: a text group rides along with the other streams' decode rows).
  Shapes are static, positions are tensors, the cache is written by index and nothing syncs
  with the host, so it can be CUDA-graphed.

Hidden states returned are after the final norm (the ``llm_decoder`` input). ``logprobs``
applies the head and a float32 log-softmax.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from voice_out.model.transfer import to_device

#: Input row kinds: which embedding table a ``(kind, id)`` row reads (``embed_rows``); the
#: callers' ``voice_out.text.rows.RowKind`` has these values.
KIND_LLM, KIND_TEXT, KIND_SPEECH = 0, 1, 2
#: Fixed by the model family (spec 2.1): 6561 FSQ codes, then EOS, a reserved stop id and FILL.
SPEECH_TOKEN_SIZE = 6561
N_SPEECH_SPECIALS = 3


@dataclass(frozen=True)
class LLMDims:
    """Every size of the LM, read from ``cosyvoice2.yaml`` (``llm``) and ``CosyVoice-BlankEN/config.json``."""

    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    text_vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    speech_token_size: int = SPEECH_TOKEN_SIZE

    @property
    def speech_vocab_size(self) -> int:
        """Rows of ``speech_embedding`` and outputs of ``llm_decoder`` (6564 for CosyVoice2)."""
        return self.speech_token_size + N_SPEECH_SPECIALS

    @property
    def eos_token(self) -> int:
        return self.speech_token_size

    @property
    def fill_token(self) -> int:
        return self.speech_token_size + 2

    @property
    def stop_tokens(self) -> frozenset[int]:
        return frozenset(range(self.speech_token_size, self.speech_vocab_size))

    @classmethod
    def from_configs(cls, llm: Mapping[str, Any], qwen: Mapping[str, Any]) -> LLMDims:
        """Build from the ``llm`` kwargs of ``cosyvoice2.yaml`` and the Qwen2 ``config.json``.

        Raises ``ValueError`` naming the field for a missing or inconsistent value.
        """

        def need(src: Mapping[str, Any], key: str, where: str) -> Any:
            if key not in src:
                raise ValueError(f"{where}: {key!r} is missing")
            return src[key]

        qj = "CosyVoice-BlankEN/config.json"
        hidden = int(need(qwen, "hidden_size", qj))
        heads = int(need(qwen, "num_attention_heads", qj))
        kv_heads = int(need(qwen, "num_key_value_heads", qj))
        head_dim = int(qwen.get("head_dim") or (hidden // heads if heads else 0))
        for key in ("llm_input_size", "llm_output_size"):
            size = int(need(llm, key, "cosyvoice2.yaml llm"))
            if size != hidden:
                raise ValueError(f"cosyvoice2.yaml llm.{key} = {size} but {qj} hidden_size = {hidden}")
        if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
            raise ValueError(f"{qj}: num_attention_heads {heads} must be a positive multiple of {kv_heads}")
        if head_dim <= 0 or head_dim % 2:
            raise ValueError(f"{qj}: head_dim {head_dim} must be a positive even number (RoPE rotates halves)")
        act = qwen.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{qj}: hidden_act {act!r} is not supported (only silu)")
        if qwen.get("use_sliding_window", False):
            raise ValueError(f"{qj}: use_sliding_window is not supported")
        rope_scaling = qwen.get("rope_scaling")
        if rope_scaling not in (None, {}):
            raise ValueError(f"{qj}: rope_scaling {rope_scaling!r} is not supported")
        return cls(
            hidden_size=hidden,
            n_layers=int(need(qwen, "num_hidden_layers", qj)),
            n_heads=heads,
            n_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int(need(qwen, "intermediate_size", qj)),
            text_vocab_size=int(need(qwen, "vocab_size", qj)),
            rms_norm_eps=float(need(qwen, "rms_norm_eps", qj)),
            rope_theta=float(need(qwen, "rope_theta", qj)),
            max_position_embeddings=int(qwen.get("max_position_embeddings", 32768)),
            speech_token_size=int(need(llm, "speech_token_size", "cosyvoice2.yaml llm")),
        )


@dataclass
class KVCache:
    """Preallocated static K/V for ``n_slots`` streams of up to ``max_len`` positions each.

    * ``k``, ``v``: ``[n_layers, n_slots, n_kv_heads, max_len, head_dim]`` in the model dtype.
      Position ``p`` of slot ``s`` in layer ``l`` is ``k[l, s, :, p]`` (RoPE already applied).
    * ``lengths``: ``[n_slots]`` int32, the number of valid positions per slot (= the position
      of the next row). Positions at or beyond it hold stale values and are masked out.

    Nothing is ever reallocated: :meth:`reset` zeroes lengths in place, so CUDA graphs captured
    over these tensors stay valid across streams and barge-ins. Writing past ``max_len`` is the
    caller's bug (the decode step cannot check without a host sync): track lengths on the host.
    """

    k: Tensor
    v: Tensor
    lengths: Tensor

    @classmethod
    def allocate(
        cls,
        dims: LLMDims,
        n_slots: int,
        max_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> KVCache:
        shape = (dims.n_layers, n_slots, dims.n_kv_heads, max_len, dims.head_dim)
        return cls(
            k=torch.zeros(shape, device=device, dtype=dtype),
            v=torch.zeros(shape, device=device, dtype=dtype),
            lengths=torch.zeros(n_slots, device=device, dtype=torch.int32),
        )

    @property
    def n_slots(self) -> int:
        return int(self.k.shape[1])

    def read_prefix(self, slot: int, n: int) -> tuple[Tensor, Tensor]:
        """Copies of positions ``0 .. n-1`` of ``slot``: k, v ``[n_layers, n_kv_heads, n, head_dim]``."""
        return self.k[:, slot, :, :n].clone(), self.v[:, slot, :, :n].clone()

    def write_prefix(self, slot: int, k: Tensor, v: Tensor) -> None:
        """Positions ``0 .. n-1`` of ``slot`` := ``k``, ``v`` (from :meth:`read_prefix`); the slot's
        length becomes n. In place, no host sync: what a prefill of the same rows would leave."""
        n = int(k.shape[2])
        self.k[:, slot, :, :n].copy_(k)
        self.v[:, slot, :, :n].copy_(v)
        self.lengths[slot] = n

    @property
    def max_len(self) -> int:
        return int(self.k.shape[3])

    def reset(self, slots: int | Sequence[int] | Tensor | None = None) -> None:
        """Forget the content of ``slots`` (all when None), in place."""
        if slots is None:
            self.lengths.zero_()
        elif isinstance(slots, int):
            self.lengths[slots] = 0
        else:
            idx = torch.as_tensor(slots, dtype=torch.long, device=self.lengths.device)
            self.lengths.index_fill_(0, idx, 0)


class StepPositions(NamedTuple):
    """Where a decode step's rows read and write (:meth:`SpeechLM.step_positions`), int64
    ``[B]`` each: the rows' ``slots`` and ``offsets``, their positions ``pos`` (the slot's
    length plus the offset), and the slot and position their K/V are written to."""

    slots: Tensor
    offsets: Tensor
    pos: Tensor
    write_slot: Tensor
    write_pos: Tensor


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # F.rms_norm with the weight is ONE fused kernel on CUDA: the statistic in float32,
        # x * rsqrt(mean(x^2) + eps) * weight. In float32 that is HF Qwen2's math; in bf16 it
        # rounds once where HF rounds twice (the normalized value, then the product): <= 1 ulp.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, device: torch.device) -> Tensor:
    """RoPE's inverse frequencies, float32 ``[head_dim / 2]``."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """float32 ``cos``, ``sin`` of shape ``positions.shape + (head_dim,)`` (angles repeated twice)."""
    inv_freq = rope_inv_freq(head_dim, theta, positions.device)
    freqs = positions.float()[..., None] * inv_freq  # [..., head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x ``[B, H, L, D]``; cos/sin ``[B, L, D]`` float32. Rotate-half layout, computed in float32."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    out = xf * cos[:, None] + rotated * sin[:, None]
    return out.to(x.dtype)


def rope_matrices(positions: Tensor, head_dim: int, theta: float) -> Tensor:
    """RoPE of one row per position as a matrix: float32 ``[B, D, D]`` for ``positions`` ``[B]``.

    ``x @ M[b]`` equals ``apply_rope`` of x at position ``positions[b]`` (rotate-half layout):
    ``M[k, k] = cos_k``, ``M[k + D/2, k] = -sin_k`` and ``M[k, k + D/2] = sin_{k + D/2}`` for
    k < D/2. The decode step rotates every q and k head of a row with ONE batched matmul
    instead of a chain of elementwise kernels per layer.
    """
    cos, sin = rope_cos_sin(positions, head_dim, theta)  # [B, D]
    half = head_dim // 2
    m = torch.diag_embed(cos)  # [B, D, D]
    k = torch.arange(half, device=positions.device)
    m[:, k + half, k] = -sin[:, :half]
    m[:, k, k + half] = sin[:, half:]
    return m


def group_mask(mask: Tensor, group: int, dtype: torch.dtype | None = None) -> Tensor:
    """bool ``[B, L, S]`` (True = may attend) -> ``[B, 1, group * L, S]`` for :func:`attend`.

    With ``dtype``: an additive mask of that dtype (0 where allowed, -inf elsewhere), which SDPA
    uses as is; a bool mask is converted by SDPA on every call (every layer).
    """
    b, seq_q, seq_k = mask.shape
    out = mask[:, None, None].expand(b, 1, group, seq_q, seq_k).reshape(b, 1, group * seq_q, seq_k)
    if dtype is None:
        return out
    return torch.zeros(out.shape, device=out.device, dtype=dtype).masked_fill_(~out, float("-inf"))


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """GQA attention through SDPA without repeating K/V.

    q ``[B, Hq, L, D]``, k/v ``[B, Hkv, S, D]``, mask from :func:`group_mask` ``[B, 1, G*L, S]``.
    Returns ``[B, Hq, L, D]``. The ``G = Hq / Hkv`` query heads of a kv group become ``G * L``
    query rows against that group's keys (query head h reads kv head h // G).
    """
    b, hq, seq_q, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, (hq // hkv) * seq_q, d)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
    return out.reshape(b, hq, seq_q, d)


class Attention(nn.Module):
    def __init__(self, dims: LLMDims) -> None:
        super().__init__()
        self.n_heads = dims.n_heads
        self.n_kv_heads = dims.n_kv_heads
        self.head_dim = dims.head_dim
        qkv_out = (dims.n_heads + 2 * dims.n_kv_heads) * dims.head_dim
        self.wqkv = nn.Linear(dims.hidden_size, qkv_out, bias=True)
        self.wo = nn.Linear(dims.n_heads * dims.head_dim, dims.hidden_size, bias=False)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x ``[B, L, H]`` -> q ``[B, Hq, L, D]``, k/v ``[B, Hkv, L, D]`` with RoPE on q and k."""
        b, seq, _ = x.shape
        d = self.head_dim
        q, k, v = self.wqkv(x).split([self.n_heads * d, self.n_kv_heads * d, self.n_kv_heads * d], dim=-1)
        # RoPE on q and k in one pass (half the kernels of two calls): [B, Hq + Hkv, L, D]
        qk = torch.cat([q, k], dim=-1).view(b, seq, self.n_heads + self.n_kv_heads, d).transpose(1, 2)
        qk = apply_rope(qk, cos, sin)
        v = v.view(b, seq, self.n_kv_heads, d).transpose(1, 2)
        return qk[:, : self.n_heads], qk[:, self.n_heads :], v

    def out(self, o: Tensor, residual: Tensor) -> Tensor:
        """``residual + wo(o)``: o ``[B, Hq, L, D]``, residual ``[B, L, H]`` -> ``[B, L, H]``.

        One GEMM with the residual as its C operand (``addmm``) instead of a GEMM and an add.
        """
        b, _, seq, _ = o.shape
        o2 = o.transpose(1, 2).reshape(b * seq, self.n_heads * self.head_dim)
        out = torch.addmm(residual.reshape(b * seq, -1), o2, self.wo.weight.t())
        return out.view(residual.shape)


class MLP(nn.Module):
    def __init__(self, dims: LLMDims) -> None:
        super().__init__()
        self.intermediate_size = dims.intermediate_size
        self.w13 = nn.Linear(dims.hidden_size, 2 * dims.intermediate_size, bias=False)  # [gate; up]
        self.w2 = nn.Linear(dims.intermediate_size, dims.hidden_size, bias=False)

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        """``residual + w2(silu(gate) * up)``, x and residual ``[..., H]``; the residual add is
        the C operand of the down projection's GEMM (``addmm``)."""
        gate, up = self.w13(x).split(self.intermediate_size, dim=-1)
        act = (F.silu(gate) * up).reshape(-1, self.intermediate_size)
        out = torch.addmm(residual.reshape(-1, residual.shape[-1]), act, self.w2.weight.t())
        return out.view(residual.shape)


class Block(nn.Module):
    def __init__(self, dims: LLMDims) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.attn = Attention(dims)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.mlp = MLP(dims)


class SpeechLM(nn.Module):
    """CosyVoice2 ``Qwen2LM`` for inference; the cache and the stream state live outside."""

    def __init__(self, dims: LLMDims) -> None:
        super().__init__()
        self.dims = dims
        self.embed_tokens = nn.Embedding(dims.text_vocab_size, dims.hidden_size)
        self.speech_embedding = nn.Embedding(dims.speech_vocab_size, dims.hidden_size)
        self.llm_embedding = nn.Embedding(2, dims.hidden_size)
        self.layers = nn.ModuleList(Block(dims) for _ in range(dims.n_layers))
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.llm_decoder = nn.Linear(dims.hidden_size, dims.speech_vocab_size, bias=True)

    # -- inputs -----------------------------------------------------------------------------

    def embed_rows(self, rows: Sequence[tuple[int, int]]) -> Tensor:
        """Embeddings ``[L, H]`` of ``(kind, id)`` rows (kind 0 llm_embedding, 1 text, 2 speech)."""
        if any(k not in (KIND_LLM, KIND_TEXT, KIND_SPEECH) for k, _ in rows):
            raise ValueError("row kind must be 0 (llm_embedding), 1 (text) or 2 (speech)")
        dev = self.llm_decoder.weight.device
        tables = (self.llm_embedding, self.embed_tokens, self.speech_embedding)
        out = torch.empty(len(rows), self.dims.hidden_size, device=dev, dtype=self.llm_decoder.weight.dtype)
        for kind, table in enumerate(tables):
            where = [i for i, (k, _) in enumerate(rows) if k == kind]
            if where:
                ids = to_device([rows[i][1] for i in where], dev, torch.long)
                out[to_device(where, dev, torch.long)] = table(ids)
        return out

    def embed_speech(self, ids: Tensor) -> Tensor:
        """``speech_embedding`` rows for device-side token ids ``[B]`` -> ``[B, H]`` (no sync)."""
        return self.speech_embedding(ids)

    def embed_kinds(self, kinds: Tensor, ids: Tensor) -> Tensor:
        """Embeddings ``[B, H]`` of device-side rows, as :meth:`embed_rows` (no sync): ``kinds``
        int64 ``[B]`` (0 llm_embedding, 1 text, 2 speech), ``ids`` int64 ``[B]``. Each table
        is read with the ids of other kinds replaced by 0, so a speech id never indexes past
        ``llm_embedding``."""
        out = self.speech_embedding(torch.where(kinds == KIND_SPEECH, ids, 0))
        for kind, table in ((KIND_TEXT, self.embed_tokens), (KIND_LLM, self.llm_embedding)):
            mine = kinds == kind
            out = torch.where(mine[:, None], table(torch.where(mine, ids, 0)), out)
        return out

    # -- backbone ---------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, cache: KVCache, slot: int, embeds: Tensor, start_pos: int | None = None) -> Tensor:
        """Append ``embeds`` ``[L, H]`` to ``slot`` at positions ``start..start+L-1``.

        ``start_pos`` is the slot's current length; when None it is read from ``cache.lengths``
        (one host sync). Returns the final-norm hidden state of the last row, ``[H]``.
        Not graph-safe (variable L); meant for prompts and bistream text feeds.
        """
        seq = int(embeds.shape[0])
        start = int(cache.lengths[slot].item()) if start_pos is None else start_pos
        end = start + seq
        if seq < 1 or end > cache.max_len:
            raise ValueError(f"prefill of {seq} rows at {start} does not fit a cache of {cache.max_len}")
        dev = embeds.device
        positions = torch.arange(start, end, device=dev)[None]  # [1, L]
        cos, sin = rope_cos_sin(positions, self.dims.head_dim, self.dims.rope_theta)
        key_pos = torch.arange(end, device=dev)
        causal = (key_pos[None, :] <= positions[0, :, None])[None]  # [1, L, end] causal with offset
        h = embeds[None].to(self.llm_decoder.weight.dtype)  # [1, L, H]
        mask = group_mask(causal, self.dims.n_heads // self.dims.n_kv_heads, h.dtype)
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, Block)
            q, k, v = layer.attn.qkv(layer.input_layernorm(h), cos, sin)
            cache.k[i, slot, :, start:end] = k[0]
            cache.v[i, slot, :, start:end] = v[0]
            keys = cache.k[i, slot : slot + 1, :, :end]
            values = cache.v[i, slot : slot + 1, :, :end]
            h = layer.attn.out(attend(q, keys, values, mask), h)
            h = layer.mlp(layer.post_attention_layernorm(h), h)
        cache.lengths[slot] = end
        return self.norm(h[0, -1])

    @torch.no_grad()
    def decode_step(
        self,
        cache: KVCache,
        slots: Tensor | None,
        embeds: Tensor,
        kv_len: int | None = None,
        active: Tensor | None = None,
        scratch_slot: int | None = None,
        offsets: Tensor | None = None,
    ) -> Tensor:
        """Append one row per row of ``embeds`` to its slot; return final-norm hidden states ``[B, H]``.

        * ``slots``: int64 ``[B]`` slot indices, or None for slots ``0..B-1`` (the step then
          takes views instead of gathering the K/V of a slot subset every layer).
        * ``embeds``: ``[B, H]``; row b goes to position ``cache.lengths[slots[b]] + offsets[b]``.
        * ``offsets``: int64 ``[B]`` or None (zeros). Several rows may feed one slot: a run of
          consecutive rows with offsets 0, 1, 2, .. appends that many positions to it in one
          step (a bistream text group beside other streams' decode rows), each row attending
          causally over the slot and the run's earlier rows, as a prefill of those rows would.
          Without offsets the slots must be distinct.
        * ``kv_len``: attend over the first ``kv_len`` positions only (a static bound, e.g. a
          bucket; must exceed every active row's position). None = ``cache.max_len``.
        * ``active``: bool ``[B]``, the rows that really append (with ``scratch_slot``). An
          inactive row is computed (static shapes) but appends nothing: its slot's length stays
          and its K/V go to position 0 of ``scratch_slot`` (a slot no stream owns), so a slot
          that is mid-utterance but not decoding this step is left exactly as it was.

        The fast path's step with Triton kernels (``voice_out.fast.fused_llm``) computes the
        same from the same cache. Static shapes, tensor positions, index writes, no host sync:
        CUDA-graph capturable.
        """
        window = cache.max_len if kv_len is None else kv_len
        h = embeds.to(self.llm_decoder.weight.dtype)  # [B, H]
        rows = self.step_positions(cache, slots, int(embeds.shape[0]), offsets, active, scratch_slot)
        h = self._layers(cache, slots, h, rows.pos, rows.write_slot, rows.write_pos, window)
        return self.advance(cache, h, rows.slots, active)

    def step_positions(
        self,
        cache: KVCache,
        slots: Tensor | None,
        b: int,
        offsets: Tensor | None = None,
        active: Tensor | None = None,
        scratch_slot: int | None = None,
    ) -> StepPositions:
        """Where each of a decode step's ``b`` rows reads and writes (see :meth:`decode_step`
        for the arguments): the slots, offsets and positions, and the slot and position each
        row's K/V go to (an inactive row's: position 0 of ``scratch_slot``). No host sync."""
        dev = cache.lengths.device
        if slots is None:
            slot_idx = torch.arange(b, device=dev)
            lengths = cache.lengths[:b]
        else:
            slot_idx = slots.contiguous()  # e.g. a column of the packed decode rows
            lengths = cache.lengths.index_select(0, slot_idx)
        pos = lengths.long()  # [B]
        offs = torch.zeros_like(pos) if offsets is None else offsets.contiguous()
        if offsets is not None:
            pos = pos + offs
        write_slot, write_pos = slot_idx, pos
        if active is not None:
            if scratch_slot is None:
                raise ValueError("decode_step: active rows need a scratch_slot")
            write_slot = torch.where(active, slot_idx, scratch_slot)
            write_pos = torch.where(active, pos, 0)
        return StepPositions(slot_idx, offs, pos, write_slot, write_pos)

    def advance(self, cache: KVCache, h: Tensor, slots: Tensor, active: Tensor | None) -> Tensor:
        """A decode step's end: count each active row's position into its slot's length
        (``slots`` int64 ``[B]``, ``active`` bool ``[B]`` or None for all); the final norm of
        the last layer's ``h`` ``[B, H]``."""
        step = torch.ones_like(slots, dtype=cache.lengths.dtype) if active is None else active.to(cache.lengths.dtype)
        cache.lengths.index_add_(0, slots, step)
        return self.norm(h)

    def _layers(
        self,
        cache: KVCache,
        slots: Tensor | None,
        h: Tensor,
        pos: Tensor,
        write_slot: Tensor,
        write_pos: Tensor,
        window: int,
    ) -> Tensor:
        """The decode step's layers (see :meth:`decode_step`); h ``[B, H]``."""
        b, dtype = h.shape[0], h.dtype
        dims = self.dims
        d, hq, hkv = dims.head_dim, dims.n_heads, dims.n_kv_heads
        # Per step, not per layer: the RoPE matrices and one additive mask [B, 1, 1, W] (0 or
        # -inf, broadcast by SDPA over heads and query rows). Per layer the step is then ~16
        # kernels: norm, qkv GEMM, RoPE (cast, batched matmul, cast), two cache writes, (two K/V
        # gathers unless slots is None), SDPA, wo GEMM with the residual, norm, w13 GEMM, silu,
        # mul, w2 GEMM with the residual.
        rope = rope_matrices(pos, d, dims.rope_theta)  # [B, D, D] float32
        valid = torch.arange(window, device=h.device)[None, :] <= pos[:, None]  # [B, W]
        mask = torch.zeros(b, 1, 1, window, device=h.device, dtype=dtype)
        mask.masked_fill_(~valid[:, None, None], float("-inf"))
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, Block)
            attn = layer.attn
            qkv = attn.wqkv(layer.input_layernorm(h))  # [B, (Hq + 2 Hkv) D]
            qk = qkv[:, : (hq + hkv) * d].view(b, hq + hkv, d)
            qk = torch.bmm(qk.float(), rope).to(dtype)  # [B, Hq + Hkv, D], rotated in float32
            k = qk[:, hq:]  # [B, Hkv, D]
            v = qkv[:, (hq + hkv) * d :].view(b, hkv, d)
            cache.k[i][write_slot, :, write_pos] = k
            cache.v[i][write_slot, :, write_pos] = v
            if slots is None:
                keys, values = cache.k[i, :b, :, :window], cache.v[i, :b, :, :window]
            else:
                keys = cache.k[i, :, :, :window].index_select(0, slots)
                values = cache.v[i, :, :, :window].index_select(0, slots)
            # the G query heads of a kv group are G query rows against that group's keys
            q = qk[:, :hq].reshape(b, hkv, hq // hkv, d)
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [B, Hkv, G, D]
            h = torch.addmm(h, o.reshape(b, hq * d), attn.wo.weight.t())
            h = layer.mlp(layer.post_attention_layernorm(h), h)
        return h

    # -- head -------------------------------------------------------------------------------

    @torch.no_grad()
    def logits(self, hidden: Tensor) -> Tensor:
        """``llm_decoder`` logits ``[..., V]`` in float32."""
        return self.llm_decoder(hidden).float()

    @torch.no_grad()
    def logprobs(self, hidden: Tensor) -> Tensor:
        """float32 log-softmax over the ``speech_vocab_size`` outputs, ``[..., V]``."""
        return torch.log_softmax(self.logits(hidden), dim=-1)


@torch.no_grad()
def init_random_(model: SpeechLM, seed: int = 0) -> SpeechLM:
    """Fill ``model`` with seeded random weights whose activations stay O(1).

    Embeddings ~ N(0, 1); projections ~ N(0, 1/fan_in), the residual outputs (``wo``, ``w2``)
    further divided by sqrt(2 * n_layers); norms 1; biases small. Draws in float32 from a
    generator on the model's device (so a full-size model is built on the GPU quickly); the
    values depend on the seed and the device type.
    """
    gen = torch.Generator(device=model.llm_decoder.weight.device).manual_seed(seed)
    residual_scale = 1.0 / math.sqrt(2 * model.dims.n_layers)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            p.fill_(1.0)
            continue
        if name.endswith("bias"):
            t = 0.02 * torch.randn(p.shape, generator=gen, device=p.device)
        elif isinstance(model.get_submodule(name.rsplit(".", 1)[0]), nn.Embedding):
            t = torch.randn(p.shape, generator=gen, device=p.device)
        else:
            t = torch.randn(p.shape, generator=gen, device=p.device) / math.sqrt(p.shape[1])
            if name.endswith(("wo.weight", "w2.weight")):
                t *= residual_scale
        p.copy_(t.to(p.dtype))
    return model
