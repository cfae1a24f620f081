"""The LLM's fast path: decode + head + sampling, and prompt prefill, as CUDA graphs.

An eager decode step of the 0.5B backbone launches several hundred small kernels: at batch 1
to 32 it costs the same ~10 ms on an H200 whatever the batch (launch-bound; the weights take
~0.3 ms to read). Replaying one captured graph per batch bucket removes the launch cost.

* :class:`GraphedLLM` ``.decode_sample(slots, embeds, history, uniforms, eos_masked)``: one
  batched decode step for B rows, the ``llm_decoder`` head, EOS masking and repetition-aware
  sampling, replayed from the graph of the smallest bucket >= B. Padding rows write into a
  scratch slot (the cache is allocated with one extra slot for it), so real slots are never
  touched by padding. Returns int64 token ids ``[B]`` on the device (no host sync inside).
* ``.prefill(slot, embeds, start)``: appends ``[L, H]`` rows to one slot, replayed from the
  graph of the smallest length bucket >= L (rows are padded; the padding's K/V land beyond the
  slot's new length, where they are masked and later overwritten). Returns the hidden state of
  the last real row ``[H]``.

Every graph attends over the whole cache window (``cache.max_len`` positions) so that one graph
per bucket serves every stream length; the per-row validity mask does the rest. Capture all
buckets with :meth:`GraphedLLM.capture_all` at start-up, before any stream holds a slot:
capture runs the step on scratch inputs. GPU worker thread only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from voice_out.model.cuda_graphs import GraphedFn
from voice_out.model.qwen2 import Block, KVCache, SpeechLM, attend, group_mask, rope_cos_sin
from voice_out.model.sampling import NO_TOKEN, SamplingParams, mask_eos_, ras_sample_batch

DEFAULT_DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64)
DEFAULT_PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)


def _bucket(n: int, buckets: Sequence[int]) -> int | None:
    for b in buckets:
        if n <= b:
            return b
    return None


@torch.no_grad()
def prefill_static(
    lm: SpeechLM, cache: KVCache, slot: Tensor, start: Tensor, n_valid: Tensor, embeds: Tensor
) -> Tensor:
    """Graph-safe prefill of ``embeds`` ``[Lb, H]`` into ``slot`` (int64 ``[1]``) at ``start``
    (int64 ``[1]``); only the first ``n_valid`` (int64 ``[1]``) rows are real.

    Rows at or beyond ``n_valid`` are computed and written too (static shapes) but the slot's
    length becomes ``start + n_valid``, so they are masked out and overwritten later. The caller
    guarantees ``start + Lb <= cache.max_len``. Returns the final-norm hidden of row
    ``n_valid - 1``, ``[H]``.
    """
    dims = lm.dims
    seq = embeds.shape[0]
    dev = embeds.device
    positions = start + torch.arange(seq, device=dev)  # [Lb]
    cos, sin = rope_cos_sin(positions[None], dims.head_dim, dims.rope_theta)  # [1, Lb, D]
    key_pos = torch.arange(cache.max_len, device=dev)
    causal = (key_pos[None, :] <= positions[:, None])[None]  # [1, Lb, T]
    mask = group_mask(causal, dims.n_heads // dims.n_kv_heads)
    h = embeds[None].to(lm.llm_decoder.weight.dtype)
    rows = slot.expand(seq)  # [Lb]: index tensors only, so nothing syncs with the host
    for i, layer in enumerate(lm.layers):
        assert isinstance(layer, Block)
        q, k, v = layer.attn.qkv(layer.input_layernorm(h), cos, sin)  # k, v [1, Hkv, Lb, D]
        cache.k[i][rows, :, positions] = k[0].transpose(0, 1)
        cache.v[i][rows, :, positions] = v[0].transpose(0, 1)
        keys = cache.k[i].index_select(0, slot)  # [1, Hkv, T, D]
        values = cache.v[i].index_select(0, slot)
        h = h + layer.attn.out(attend(q, keys, values, mask))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    cache.lengths.index_copy_(0, slot, (start + n_valid).to(cache.lengths.dtype))
    last = h[0].index_select(0, n_valid - 1)  # [1, H]
    return lm.norm(last)[0]


class GraphedLLM:
    """CUDA-graphed decode+sample and prefill over one :class:`KVCache` (see module docstring).

    ``cache`` must have ``scratch_slot`` (default: its last slot) reserved for padding rows.
    On the CPU, or with ``enabled=False``, every call runs the same code eagerly.
    """

    def __init__(
        self,
        lm: SpeechLM,
        cache: KVCache,
        sampling: SamplingParams,
        *,
        decode_buckets: Sequence[int] = DEFAULT_DECODE_BUCKETS,
        prefill_buckets: Sequence[int] = DEFAULT_PREFILL_BUCKETS,
        scratch_slot: int | None = None,
        enabled: bool = True,
        compile: bool = False,
    ) -> None:
        self.lm = lm
        self.cache = cache
        self.sampling = sampling
        self.scratch_slot = cache.n_slots - 1 if scratch_slot is None else scratch_slot
        self.decode_buckets = tuple(sorted(decode_buckets))
        self.prefill_buckets = tuple(b for b in sorted(prefill_buckets) if b <= cache.max_len)
        self.device = lm.llm_decoder.weight.device
        self.enabled = enabled and self.device.type == "cuda"
        decode_fn = self._decode_fn
        if compile and self.enabled:
            # Inductor fuses the norms, RoPE, residual adds and the MLP gate into a few kernels per
            # layer; the graphs below then remove the launch cost of what is left.
            # Experimental (scripts/bench_llm_step.py --compile): one compile per bucket shape,
            # ~30-60 s each on an H200, so the engine does not use it (docs/benchmarks.md).
            decode_fn = torch.compile(self._decode_fn, dynamic=False, fullgraph=False)
        self._decode = GraphedFn(decode_fn, enabled=self.enabled, name="llm.decode_sample")
        self._prefill = GraphedFn(self._prefill_fn, enabled=self.enabled, name="llm.prefill")
        self._scratch = torch.tensor([self.scratch_slot], device=self.device)

    # -- the captured functions -------------------------------------------------------------

    def _decode_fn(self, slots: Tensor, embeds: Tensor, history: Tensor, uniforms: Tensor, masked: Tensor) -> Tensor:
        self.cache.lengths.index_fill_(0, self._scratch, 0)  # padding rows restart the scratch slot
        hidden = self.lm.decode_step(self.cache, slots, embeds)
        logp = mask_eos_(self.lm.logprobs(hidden), masked, self.lm.dims.eos_token)
        return ras_sample_batch(logp, history, uniforms, self.sampling)

    def _prefill_fn(self, slot: Tensor, start: Tensor, n_valid: Tensor, embeds: Tensor) -> Tensor:
        return prefill_static(self.lm, self.cache, slot, start, n_valid, embeds)

    # -- calls ------------------------------------------------------------------------------

    def decode_sample(
        self, slots: Sequence[int], embeds: Tensor, history: Tensor, uniforms: Tensor, eos_masked: Tensor
    ) -> Tensor:
        """One decode + sample for ``len(slots)`` rows. ``embeds`` ``[B, H]``, ``history``
        int64 ``[B, W]``, ``uniforms`` float32 ``[B, 2]``, ``eos_masked`` bool ``[B]``.
        Returns int64 ``[B]`` (device). Falls back to eager above the largest bucket."""
        b = len(slots)
        bucket = _bucket(b, self.decode_buckets) if self.enabled else None
        if bucket is None:
            slot_t = torch.tensor(list(slots), dtype=torch.long, device=self.device)
            return self._decode_fn(slot_t, embeds, history, uniforms, eos_masked)
        pad = bucket - b
        slot_t = torch.tensor(list(slots) + [self.scratch_slot] * pad, dtype=torch.long, device=self.device)
        if pad:
            embeds = torch.cat([embeds, embeds.new_zeros(pad, embeds.shape[1])])
            history = torch.cat([history, history.new_full((pad, history.shape[1]), NO_TOKEN)])
            uniforms = torch.cat([uniforms, uniforms.new_full((pad, 2), 0.5)])
            eos_masked = torch.cat([eos_masked, eos_masked.new_ones(pad)])
        out: Tensor = self._decode(
            bucket, slot_t, embeds.to(self.lm.llm_decoder.weight.dtype), history, uniforms, eos_masked
        )
        return out[:b]

    def prefill(self, slot: int, embeds: Tensor, start: int) -> Tensor:
        """Append ``embeds`` ``[L, H]`` to ``slot`` from position ``start``; hidden ``[H]``."""
        seq = int(embeds.shape[0])
        bucket = _bucket(seq, self.prefill_buckets) if self.enabled else None
        if bucket is None or start + bucket > self.cache.max_len:
            return self.lm.prefill(self.cache, slot, embeds, start_pos=start)
        padded = embeds.new_zeros(bucket, embeds.shape[1])
        padded[:seq] = embeds
        args = (
            torch.tensor([slot], device=self.device),
            torch.tensor([start], device=self.device),
            torch.tensor([seq], device=self.device),
            padded.to(self.lm.llm_decoder.weight.dtype),
        )
        out: Tensor = self._prefill(bucket, *args)
        return out

    def capture_all(self) -> None:
        """Capture every decode and prefill bucket now, on the scratch slot; then reset it."""
        if not self.enabled:
            return
        hid = self.lm.dims.hidden_size
        dtype = self.lm.llm_decoder.weight.dtype
        win = self.sampling.win_size
        for b in self.decode_buckets:
            self._decode.capture(
                b,
                torch.full((b,), self.scratch_slot, dtype=torch.long, device=self.device),
                torch.zeros(b, hid, device=self.device, dtype=dtype),
                torch.full((b, win), NO_TOKEN, dtype=torch.long, device=self.device),
                torch.full((b, 2), 0.5, device=self.device),
                torch.ones(b, dtype=torch.bool, device=self.device),
            )
        for n in self.prefill_buckets:
            self._prefill.capture(
                n,
                torch.tensor([self.scratch_slot], device=self.device),
                torch.zeros(1, dtype=torch.long, device=self.device),
                torch.ones(1, dtype=torch.long, device=self.device),
                torch.zeros(n, hid, device=self.device, dtype=dtype),
            )
        self.cache.reset(self.scratch_slot)
        torch.cuda.synchronize(self.device)
