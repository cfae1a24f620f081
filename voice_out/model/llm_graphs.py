"""The LLM's fast path: decode + head + sampling, and prompt prefill, as CUDA graphs.

An eager decode step of the 0.5B backbone launches several hundred small kernels: at batch 1
to 32 it costs the same ~10 ms on an H200 whatever the batch (launch-bound; the weights take
~0.3 ms to read). Replaying one captured graph per batch bucket removes the launch cost.

* :class:`GraphedLLM` ``.decode_sample(slots, embeds, history, uniforms, eos_masked, kv_len)``:
  one batched decode step, the ``llm_decoder`` head, EOS masking and repetition-aware sampling.
  Row r of the graph is KV slot r, so the step attends over views of the cache and never
  gathers K/V (a gather of every layer's K and V cost more than the attention itself); slots
  that do not decode this step are inactive rows: computed, but nothing is appended (their
  writes go to a scratch slot, the cache's extra last slot). The graph is the one of the
  smallest batch bucket above the highest slot used. Returns int64 token ids ``[B]`` on the
  device (no host sync inside).
* ``.prefill(slot, embeds, start)``: appends ``[L, H]`` rows to one slot, replayed from the
  graph of the smallest length bucket >= L (rows are padded; the padding's K/V land beyond the
  slot's new length, where they are masked and later overwritten). Returns the hidden state of
  the last real row ``[H]``.

With ``fused`` (the default, where ``voice_out.model.decode_kernels`` can run: CUDA with
Triton, bf16/fp16) the step is the fused one (``SpeechLM.decode_step(fused=True)``), the head
a GEMM over a padded copy of ``llm_decoder`` and the sampling one kernel
(``decode_kernels.ras_sample``); its attention runs to each row's length, so one window, the
whole cache, serves every step. Otherwise a decode graph is captured per (batch bucket,
attention window): a step attends over the
smallest window of ``decode_windows`` (256, 512, ... and the whole cache) that holds its longest
row, so short utterances do not pay for attending over the whole cache; the per-row validity
mask does the rest. Prefill graphs are per (length bucket, window) too. Capture all
buckets with :meth:`GraphedLLM.capture_all` at start-up, before any stream holds a slot:
capture runs the step on scratch inputs. GPU worker thread only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from voice_out.model import decode_kernels
from voice_out.model.cuda_graphs import GraphedFn
from voice_out.model.qwen2 import Block, KVCache, SpeechLM, attend, group_mask, rope_cos_sin
from voice_out.model.sampling import NO_TOKEN, SamplingParams, mask_eos_, ras_sample_batch
from voice_out.model.transfer import to_device

#: The ``GraphedFn`` family of the LLM graphs: they replay alongside token2wav's (family
#: "token2wav"), so they are captured on a stream of their own (``voice_out.model.cuda_graphs``).
GRAPH_FAMILY = "llm"
DEFAULT_DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64)
DEFAULT_PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)
#: Attention windows of the decode graphs (positions; the cache's own length is always added):
#: a step attends over the smallest window that holds every row, not over the whole cache.
DEFAULT_DECODE_WINDOWS = (256, 512, 1024, 2048)


def _bucket(n: int, buckets: Sequence[int]) -> int | None:
    for b in buckets:
        if n <= b:
            return b
    return None


@torch.no_grad()
def prefill_static(
    lm: SpeechLM,
    cache: KVCache,
    slot: Tensor,
    start: Tensor,
    n_valid: Tensor,
    embeds: Tensor,
    window: int | None = None,
) -> Tensor:
    """Graph-safe prefill of ``embeds`` ``[Lb, H]`` into ``slot`` (int64 ``[1]``) at ``start``
    (int64 ``[1]``); only the first ``n_valid`` (int64 ``[1]``) rows are real.

    Rows at or beyond ``n_valid`` are computed and written too (static shapes) but the slot's
    length becomes ``start + n_valid``, so they are masked out and overwritten later. Attention
    reads the first ``window`` positions of the slot (None: the whole cache); the caller
    guarantees ``start + Lb <= window``. Returns the final-norm hidden of row ``n_valid - 1``,
    ``[H]``.
    """
    dims = lm.dims
    seq = embeds.shape[0]
    dev = embeds.device
    positions = start + torch.arange(seq, device=dev)  # [Lb]
    cos, sin = rope_cos_sin(positions[None], dims.head_dim, dims.rope_theta)  # [1, Lb, D]
    win = cache.max_len if window is None else window
    key_pos = torch.arange(win, device=dev)
    causal = (key_pos[None, :] <= positions[:, None])[None]  # [1, Lb, W]
    h = embeds[None].to(lm.llm_decoder.weight.dtype)
    mask = group_mask(causal, dims.n_heads // dims.n_kv_heads, h.dtype)
    rows = slot.expand(seq)  # [Lb]: index tensors only, so nothing syncs with the host
    for i, layer in enumerate(lm.layers):
        assert isinstance(layer, Block)
        q, k, v = layer.attn.qkv(layer.input_layernorm(h), cos, sin)  # k, v [1, Hkv, Lb, D]
        cache.k[i][rows, :, positions] = k[0].transpose(0, 1)
        cache.v[i][rows, :, positions] = v[0].transpose(0, 1)
        keys = cache.k[i, :, :, :win].index_select(0, slot)  # [1, Hkv, W, D]
        values = cache.v[i, :, :, :win].index_select(0, slot)
        h = layer.attn.out(attend(q, keys, values, mask), h)
        h = layer.mlp(layer.post_attention_layernorm(h), h)
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
        decode_windows: Sequence[int] = DEFAULT_DECODE_WINDOWS,
        prefill_buckets: Sequence[int] = DEFAULT_PREFILL_BUCKETS,
        scratch_slot: int | None = None,
        enabled: bool = True,
        compile: bool = False,
        fused: bool = True,
    ) -> None:
        self.lm = lm
        self.cache = cache
        self.sampling = sampling
        self.scratch_slot = cache.n_slots - 1 if scratch_slot is None else scratch_slot
        self.decode_buckets = tuple(sorted(decode_buckets))
        self.prefill_buckets = tuple(b for b in sorted(prefill_buckets) if b <= cache.max_len)
        self.decode_windows = (*(w for w in sorted(set(decode_windows)) if w < cache.max_len), cache.max_len)
        self.device = lm.llm_decoder.weight.device
        self.enabled = enabled and self.device.type == "cuda"
        dims = lm.dims
        #: The decode step runs the Triton kernels (``voice_out.model.decode_kernels``): asked
        #: for and available. Their attention runs to each row's length, so one window serves.
        self.fused = fused and self.can_fuse(lm, sampling)
        if self.fused:
            # The head as a GEMM of a whole number of 64-row tiles (6564 outputs ran a slow
            # 2-aligned kernel: 12 us of a 1.5 ms step); the sampler reads the first V columns.
            vocab = dims.speech_vocab_size
            padded = vocab + (-vocab % 64)
            head = lm.llm_decoder
            self._head_weight = head.weight.new_zeros(padded, dims.hidden_size)
            self._head_weight[:vocab] = head.weight.detach()
            self._head_bias = head.weight.new_zeros(padded)
            if head.bias is not None:
                self._head_bias[:vocab] = head.bias.detach()
        self._decode_windows = (cache.max_len,) if self.fused else self.decode_windows
        decode_fn: Callable[..., Tensor] = self._decode_fn
        if compile and self.enabled:
            # Inductor fuses the norms, RoPE, residual adds and the MLP gate into a few kernels per
            # layer; the graphs below then remove the launch cost of what is left.
            # Experimental (scripts/bench_llm_step.py --compile): one compile per bucket shape,
            # ~30-60 s each on an H200, so the engine does not use it (docs/benchmarks.md).
            decode_fn = torch.compile(self._decode_fn, dynamic=False, fullgraph=False)
        pool = torch.cuda.graph_pool_handle() if self.enabled else None  # one pool for every graph
        self._decode = {
            w: GraphedFn(
                functools.partial(decode_fn, w),
                enabled=self.enabled,
                pool=pool,
                name=f"llm.decode_sample.w{w}",
                family=GRAPH_FAMILY,
            )
            for w in self._decode_windows
        }
        self._prefill = {
            w: GraphedFn(
                functools.partial(self._prefill_fn, w),
                enabled=self.enabled,
                pool=pool,
                name=f"llm.prefill.w{w}",
                family=GRAPH_FAMILY,
            )
            for w in self.decode_windows
        }

    @staticmethod
    def can_fuse(lm: SpeechLM, sampling: SamplingParams) -> bool:
        """Whether the fused decode step and sampler (``decode_kernels``) can run for ``lm``'s
        device, dtype and dims and ``sampling``'s top-k."""
        dims, weight = lm.dims, lm.llm_decoder.weight
        return decode_kernels.available(
            weight.device, weight.dtype, dims.head_dim, dims.n_heads // dims.n_kv_heads
        ) and decode_kernels.sampler_available(weight.device, dims.speech_vocab_size, sampling.top_k)

    # -- the captured functions -------------------------------------------------------------

    def _decode_fn(
        self, window: int, active: Tensor, embeds: Tensor, history: Tensor, uniforms: Tensor, masked: Tensor
    ) -> Tensor:
        # row r is slot r: K/V are views of the cache, never gathered; rows that do not decode
        # this step are inactive (nothing appended, their writes go to the scratch slot)
        cache, scratch = self.cache, self.scratch_slot
        hidden = self.lm.decode_step(
            cache, None, embeds, kv_len=window, active=active, scratch_slot=scratch, fused=self.fused
        )
        eos = self.lm.dims.eos_token
        if self.fused:
            logits = torch.addmm(self._head_bias, hidden, self._head_weight.t())[:, : self.lm.dims.speech_vocab_size]
            return decode_kernels.ras_sample(logits, history, uniforms, masked, eos, self.sampling)
        logp = mask_eos_(self.lm.logprobs(hidden), masked, eos)
        return ras_sample_batch(logp, history, uniforms, self.sampling)

    def _prefill_fn(self, window: int, slot: Tensor, start: Tensor, n_valid: Tensor, embeds: Tensor) -> Tensor:
        return prefill_static(self.lm, self.cache, slot, start, n_valid, embeds, window)

    # -- calls ------------------------------------------------------------------------------

    def decode_sample(
        self,
        slots: Sequence[int],
        embeds: Tensor,
        history: Tensor,
        uniforms: Tensor,
        eos_masked: Tensor,
        kv_len: int | None = None,
    ) -> Tensor:
        """One decode + sample for the B streams in ``slots`` (distinct, any order). ``embeds``
        ``[B, H]``, ``history`` int64 ``[B, W]``, ``uniforms`` float32 ``[B, 2]``, ``eos_masked``
        bool ``[B]``, row i for ``slots[i]``; ``kv_len``: positions every row needs after this
        step (the longest row's length + 1), None = the whole cache.

        The graph's row r is slot r: it runs the smallest batch bucket > ``max(slots)`` (so
        keeping streams in the lowest slots, as the scheduler does, keeps it small) with the
        slots not in ``slots`` inactive, and the smallest window >= ``kv_len``. Returns int64
        ``[B]`` (device), in the order of ``slots``: a new tensor, not the graph's output buffer.
        Eager above the largest bucket."""
        need = self.cache.max_len if kv_len is None else kv_len
        window = _bucket(need, self._decode_windows)
        if window is None:
            raise ValueError(f"decode needs {need} positions, the cache holds {self.cache.max_len}")
        if not slots or max(slots) >= self.scratch_slot or min(slots) < 0 or len(set(slots)) != len(slots):
            raise ValueError(f"decode slots must be distinct, in 0..{self.scratch_slot - 1}: {list(slots)}")
        top = max(slots) + 1
        bucket = _bucket(top, self.decode_buckets) if self.enabled else top
        if bucket is None:  # more rows than the largest bucket: eager, same code
            bucket = top
        rows = to_device(list(slots), self.device, torch.long)
        graph = self._decode[window] if self.enabled and bucket in self.decode_buckets else None
        # the rows are written straight into the captured graph's input buffers (a replay then
        # copies nothing); fresh buffers before the first capture and for the eager step
        bufs = graph.static_inputs(bucket) if graph is not None else None
        if bufs is None:
            bufs = (
                torch.empty(bucket, dtype=torch.bool, device=self.device),
                embeds.new_empty((bucket, embeds.shape[1]), dtype=self.lm.llm_decoder.weight.dtype),
                history.new_empty((bucket, history.shape[1])),
                uniforms.new_empty((bucket, 2)),
                eos_masked.new_empty(bucket),
            )
        active, full_embeds, full_history, full_uniforms, full_masked = bufs
        active.zero_()
        active[rows] = True
        full_embeds.zero_()
        full_embeds[rows] = embeds.to(full_embeds.dtype)
        full_history.fill_(NO_TOKEN)
        full_history[rows] = history
        full_uniforms.fill_(0.5)
        full_uniforms[rows] = uniforms
        full_masked.fill_(True)
        full_masked[rows] = eos_masked
        out: Tensor = graph(bucket, *bufs) if graph is not None else self._decode_fn(window, *bufs)
        return out[rows]

    def prefill(self, slot: int, embeds: Tensor, start: int) -> Tensor:
        """Append ``embeds`` ``[L, H]`` to ``slot`` from position ``start``; hidden ``[H]``."""
        seq = int(embeds.shape[0])
        bucket = _bucket(seq, self.prefill_buckets) if self.enabled else None
        window = _bucket(start + bucket, self.decode_windows) if bucket is not None else None
        if bucket is None or window is None:
            return self.lm.prefill(self.cache, slot, embeds, start_pos=start)
        padded = embeds.new_zeros(bucket, embeds.shape[1])
        padded[:seq] = embeds
        where = to_device([slot, start, seq], self.device, torch.long)
        args = (where[0:1], where[1:2], where[2:3], padded.to(self.lm.llm_decoder.weight.dtype))
        out: Tensor = self._prefill[window](bucket, *args)
        return out

    def capture_all(self) -> None:
        """Capture every decode and prefill bucket now, on the scratch slot; then reset it."""
        if not self.enabled:
            return
        hid = self.lm.dims.hidden_size
        dtype = self.lm.llm_decoder.weight.dtype
        win = self.sampling.win_size
        for w in self._decode_windows:
            for b in self.decode_buckets:
                self._decode[w].capture(
                    b,
                    torch.zeros(b, dtype=torch.bool, device=self.device),  # no row active: nothing appended
                    torch.zeros(b, hid, device=self.device, dtype=dtype),
                    torch.full((b, win), NO_TOKEN, dtype=torch.long, device=self.device),
                    torch.full((b, 2), 0.5, device=self.device),
                    torch.ones(b, dtype=torch.bool, device=self.device),
                )
        for w, n in ((w, n) for w in self.decode_windows for n in self.prefill_buckets if n <= w):
            self._prefill[w].capture(
                n,
                torch.tensor([self.scratch_slot], device=self.device),
                torch.zeros(1, dtype=torch.long, device=self.device),
                torch.ones(1, dtype=torch.long, device=self.device),
                torch.zeros(n, hid, device=self.device, dtype=dtype),
            )
        self.cache.reset(self.scratch_slot)
        torch.cuda.synchronize(self.device)
