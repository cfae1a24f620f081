"""The LLM's fast path: decode + head + sampling, and prompt prefill, as CUDA graphs.

An eager decode step of the 0.5B backbone launches several hundred small kernels: at batch 1
to 32 it costs the same ~10 ms on an H200 whatever the batch (launch-bound; the weights take
~0.3 ms to read). Replaying one captured graph per batch bucket removes the launch cost.

* :class:`GraphedLLM` ``.decode_sample(rows, kv_len)``: one batched decode step, the
  ``llm_decoder`` head, EOS masking and repetition-aware sampling. Each row names its KV slot
  and appends one position to it; a run of consecutive rows may feed one slot (offsets 0, 1,
  2, ..: a bistream text group, or the rest of a request's first input after its voice
  prefix), so a step's multi-row inputs ride along with the other streams' decode rows
  instead of taking a prefill of their own (one graph replay a step, not one per stream that
  takes text). Rows are padded to the smallest batch bucket with idle rows: computed, but
  nothing is appended (their writes go to a scratch slot, the cache's extra last slot). The
  step's whole input is ONE int64 tensor ``[bucket, DECODE_COLS]`` (:func:`pack_decode_rows`:
  active flag, input id and its kind, slot, offset, EOS mask, the two uniforms as float64
  bits, the repetition window), written on the host into a pinned buffer and copied in one
  transfer; the graph looks up the embeddings itself. Per step the host then launches one
  copy and one graph, not a dozen small kernels and copies. Returns the sampled ids as a
  host list (the one sync of the step). ``.decode_launch`` is the same without the wait: its
  :class:`PendingIds` arrive in pinned memory behind the step, and a row of the next step
  may be *fed* (``feed``) with the id its slot's latest row drew, on the device
  (``last_ids``), so the next step can be queued before the host has this one's ids.
* ``.prefill(slot, embeds, start)``: appends ``[L, H]`` rows to one slot, replayed from the
  graph of the smallest length bucket >= L (rows are padded; the padding's K/V land beyond the
  slot's new length, where they are masked and later overwritten). Returns the hidden state of
  the last real row ``[H]``.

With ``fused`` (the default, where ``voice_out.fast.kernels.decode`` can run: CUDA with
Triton, bf16/fp16) the step is the fused one: its rows made by one kernel
(``decode_kernels.decode_prologue``), its layers those of ``fused_llm.decode_step``
(``fused_llm.decode_rows``), the head a GEMM over a padded copy of ``llm_decoder`` and the
sampling one kernel
(``decode_kernels.ras_sample``); its attention runs to each row's length, so one window, the
whole cache, serves every step. Otherwise (plain torch) a decode graph is captured per (batch
bucket, attention window): each row gathers its slot's K/V over the smallest window of
``decode_windows`` (256, 512, ... and the whole cache) that holds the longest row, so short
utterances do not pay for attending over the whole cache; the per-row validity mask does the
rest. Prefill graphs are per (length bucket, window) too. Capture all
buckets with :meth:`GraphedLLM.capture_all` at start-up, before any stream holds a slot:
capture runs the step on scratch inputs. GPU worker thread only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from voice_out.fast import fused_llm
from voice_out.fast.graphs import GraphedFn
from voice_out.fast.kernels import decode as decode_kernels
from voice_out.fast.kernels.launch import dependent_launch_available
from voice_out.model.llm import KIND_SPEECH, Block, KVCache, SpeechLM, attend, group_mask, rope_cos_sin, rope_inv_freq
from voice_out.model.sampling import NO_TOKEN, SamplingParams, mask_eos_, ras_sample_batch
from voice_out.model.transfer import to_device

#: The ``GraphedFn`` family of the LLM graphs: they replay alongside token2wav's (family
#: "token2wav"), so they are captured on a stream of their own (``voice_out.fast.graphs``).
GRAPH_FAMILY = "llm"
#: Row counts of prefilled rows' draws (:meth:`GraphedLLM.draw`) captured at start-up: streams
#: that start in the same step, their first input a whole voice prefix.
DRAW_GRAPH_ROWS = 4
DEFAULT_DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64)
DEFAULT_PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)
#: Attention windows of the decode graphs (positions; the cache's own length is always added):
#: a step attends over the smallest window that holds every row, not over the whole cache.
DEFAULT_DECODE_WINDOWS = (256, 512, 1024, 2048)


#: Columns of a packed decode row (:func:`pack_decode_rows`); the repetition window follows.
COL_ACTIVE, COL_TOKEN, COL_KIND, COL_SLOT, COL_OFFSET, COL_MASKED, COL_UNIFORMS, COL_FEED = 0, 1, 2, 3, 4, 5, 6, 8
#: An even column (column 9 is padding, 0), so that the window's view of a packed tensor is
#: 16-byte aligned like the decode step's own window: Triton specialises the sampler on its
#: pointers' alignment, and an odd column made a prefilled row's draw (which samples straight
#: from the packed rows) a second compile of the sampler, first made in a fresh server's first
#: request (~1.6 s on an H200), and a second first launch (~70 ms).
COL_PAD, COL_HISTORY = 9, 10


def decode_cols(win_size: int) -> int:
    """Width of a packed decode row for a repetition window of ``win_size`` tokens."""
    return COL_HISTORY + win_size


def pack_decode_rows(
    slots: Sequence[int],
    tokens: Sequence[int],
    eos_masked: Sequence[bool],
    uniforms: np.ndarray,
    history: Sequence[Sequence[int]],
    win: int,
    *,
    offsets: Sequence[int] | None = None,
    kinds: Sequence[int] | None = None,
    feed: Sequence[bool] | None = None,
) -> np.ndarray:
    """The host side of one decode step: int64 ``[N, decode_cols(win)]``, row n = (active 1,
    input id ``tokens[n]``, its kind ``kinds[n]`` (default 2, speech; 0 llm_embedding, 1
    text), KV slot ``slots[n]``, ``offsets[n]`` (default 0; the row goes to the slot's length
    plus it, see :meth:`GraphedLLM.decode_sample`), ``eos_masked[n]``, ``uniforms[n]``
    (float64 ``[N, 2]``, stored as their bits), ``feed[n]`` (default False; True: the input
    id, and the last id of the window, are the slot's last sampled id on the device, see
    :meth:`GraphedLLM.decode_launch`), the last ``win`` ids of ``history[n]`` right-aligned
    after ``NO_TOKEN`` padding). Any thread; no torch."""
    n = len(tokens)
    rows = np.empty((n, decode_cols(win)), dtype=np.int64)
    rows[:, COL_ACTIVE] = 1
    rows[:, COL_TOKEN] = tokens
    rows[:, COL_KIND] = KIND_SPEECH if kinds is None else kinds
    rows[:, COL_SLOT] = slots
    rows[:, COL_OFFSET] = 0 if offsets is None else offsets
    rows[:, COL_MASKED] = eos_masked
    rows[:, COL_UNIFORMS : COL_UNIFORMS + 2] = np.ascontiguousarray(uniforms, dtype=np.float64).view(np.int64)
    rows[:, COL_FEED] = 0 if feed is None else feed
    rows[:, COL_PAD] = 0
    rows[:, COL_HISTORY:] = NO_TOKEN
    for i, recent in enumerate(history):
        tail = list(recent)[-win:]
        if tail:
            rows[i, decode_cols(win) - len(tail) :] = tail
    return rows


@dataclass(frozen=True)
class DecodeInputs:
    """The device side of :func:`pack_decode_rows`: views of the packed tensor, or small
    tensors computed from it (graph-safe, no sync). Shapes ``[B]`` unless noted."""

    active: Tensor  # bool
    tokens: Tensor  # int64
    kinds: Tensor  # int64
    slots: Tensor  # int64
    offsets: Tensor  # int64
    masked: Tensor  # bool
    uniforms: Tensor  # float32 [B, 2]
    history: Tensor  # int64 [B, W]
    feed: Tensor  # bool


def unpack_decode_rows(packed: Tensor) -> DecodeInputs:
    """Unpack int64 ``[B, decode_cols]`` rows of :func:`pack_decode_rows` on the device."""
    return DecodeInputs(
        active=packed[:, COL_ACTIVE] != 0,
        tokens=packed[:, COL_TOKEN],
        kinds=packed[:, COL_KIND],
        slots=packed[:, COL_SLOT],
        offsets=packed[:, COL_OFFSET],
        masked=packed[:, COL_MASKED] != 0,
        uniforms=packed[:, COL_UNIFORMS : COL_UNIFORMS + 2].view(torch.float64).float(),
        history=packed[:, COL_HISTORY:],
        feed=packed[:, COL_FEED] != 0,
    )


def check_runs(slots: np.ndarray, offsets: np.ndarray) -> str | None:
    """Why packed rows' ``slots`` / ``offsets`` (int64 ``[N]``) do not make a decode step, or
    None: each slot's rows must be ONE run of consecutive rows with offsets 0, 1, 2, ..."""
    starts = offsets == 0
    follows = np.zeros_like(starts)
    follows[1:] = (slots[1:] == slots[:-1]) & (offsets[1:] == offsets[:-1] + 1)
    if not np.all(starts | follows):
        return "a row with offset k > 0 must follow the row of offset k - 1 of the same slot"
    firsts = slots[starts].tolist()
    # a set, not np.unique: a few dozen ids, and np.unique's first call imports numpy.ma (~40
    # ms on an H200 machine, inside a server's first utterance)
    if len(set(firsts)) != len(firsts):
        return "a slot takes at most one run of rows a step"
    return None


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


class PendingIds:
    """Sampled ids on their way to the host: a copy into pinned memory queued on the current
    stream right after the step (a later replay of the same graph overwrites its output).
    GPU worker thread only."""

    def __init__(self, ids: Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        self._ids: list[int] | None = None
        if ids.device.type == "cuda":
            self._host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            self._host.copy_(ids, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = ids.clone()

    def ids(self) -> list[int]:
        """The ids (waits for the step that samples them)."""
        if self._ids is None:
            if self._event is not None:
                self._event.synchronize()
            self._ids = self._host.tolist()
        return self._ids


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
        fused_linear: bool = True,
        dependent_launch: bool = True,
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
        #: The decode step runs the Triton kernels (``voice_out.fast.kernels.decode``): asked
        #: for and available. Their attention runs to each row's length, so one window serves.
        self.fused = fused and self.can_fuse(lm, sampling)
        #: With :attr:`fused`: the step's Triton kernels launched programmatically dependent
        #: (``voice_out.fast.kernels.launch``: Hopper and later): each is launched
        #: while the kernel before it still runs, and waits for its results inside.
        self.pdl = self.fused and dependent_launch and dependent_launch_available(self.device)
        #: With the fused linears (:attr:`fused_linear`): the split w2 reduction's products and
        #: counters. Every decode graph runs on one stream, one at a time, so they share it.
        self._split_ws = (
            decode_kernels.SplitWorkspace.allocate(self.device, dims.hidden_size)
            if self.fused and fused_linear
            else None
        )
        #: With :attr:`fused`: the split attention's softmax states and counters (steps of the
        #: row counts ``decode_kernels.ATTENTION_SPLITS`` names), shared as the above.
        self._attn_ws = (
            decode_kernels.AttentionWorkspace.for_steps(self.device, dims.n_heads, dims.n_kv_heads, dims.head_dim)
            if self.fused
            else None
        )
        #: With :attr:`fused`: the sampler's candidates and counters for draws of at most
        #: ``decode_kernels.SAMPLE_MAX_ROWS`` rows (each row's vocabulary ranked in slices),
        #: shared as the above: the prefilled rows' draws run on the same stream.
        self._sample_ws = (
            decode_kernels.SampleWorkspace.allocate(self.device, decode_kernels.SAMPLE_MAX_ROWS, sampling.top_k)
            if self.fused
            else None
        )
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
        self._cols = decode_cols(sampling.win_size)
        # what the fused step's prologue kernel reads: the packed layout, RoPE's frequencies
        self._columns = decode_kernels.PackedColumns(
            COL_ACTIVE,
            COL_TOKEN,
            COL_KIND,
            COL_SLOT,
            COL_OFFSET,
            COL_MASKED,
            COL_UNIFORMS,
            COL_FEED,
            COL_HISTORY,
            sampling.win_size,
        )
        self._inv_freq = rope_inv_freq(dims.head_dim, dims.rope_theta, self.device)
        # an idle row: inactive, on the scratch slot, EOS masked, uniforms 0.5, empty window
        idle = pack_decode_rows([self.scratch_slot], [0], [True], np.full((1, 2), 0.5), [[]], sampling.win_size)
        idle[:, COL_ACTIVE] = 0
        self._idle = idle[0]
        #: Per slot: the id its latest sampled row drew (written by every decode step and
        #: :meth:`sample`; index ``scratch_slot`` takes the other rows' writes). A fed row
        #: (``COL_FEED``) reads its input id from here, so a step can be launched before the
        #: host has seen the previous step's ids.
        self.last_ids = torch.zeros(cache.n_slots, dtype=torch.long, device=self.device)
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
                warmup_each=False,  # its keys are lengths: the first capture's warm-up serves all
                pool=pool,
                name=f"llm.prefill.w{w}",
                family=GRAPH_FAMILY,
            )
            for w in self.decode_windows
        }
        #: Prefilled rows' draws (:meth:`draw`), one graph per row count up to
        #: :data:`DRAW_GRAPH_ROWS`: eager, the head, the sampler and the row unpacking are ~15
        #: launches, ~0.5 ms of host time on the way to a stream's first audio
        self._draw = GraphedFn(self._draw_fn, enabled=self.enabled, pool=pool, name="llm.draw", family=GRAPH_FAMILY)

    @property
    def fused_linear(self) -> bool:
        """With ``fused``: buckets of at most ``decode_kernels.LINEAR_MAX_ROWS`` rows run the
        step's GEMMs as Triton kernels too (norms, gate and residual adds inside them)."""
        return self._split_ws is not None

    @staticmethod
    def can_fuse(lm: SpeechLM, sampling: SamplingParams) -> bool:
        """Whether the fused decode step and sampler (``decode_kernels``) can run for ``lm``'s
        device, dtype and dims and ``sampling``'s top-k."""
        dims, weight = lm.dims, lm.llm_decoder.weight
        return decode_kernels.available(
            weight.device, weight.dtype, dims.head_dim, dims.n_heads // dims.n_kv_heads
        ) and decode_kernels.sampler_available(weight.device, dims.speech_vocab_size, sampling.top_k)

    # -- the captured functions -------------------------------------------------------------

    def _decode_fn(self, window: int, packed: Tensor) -> Tensor:
        # idle rows append nothing: their writes go to the scratch slot
        if self.fused:
            lm = self.lm
            tables = (lm.llm_embedding.weight, lm.embed_tokens.weight, lm.speech_embedding.weight)
            prepared = decode_kernels.decode_prologue(
                packed, self._columns, self.last_ids, self.cache.lengths, tables, self._inv_freq, self.scratch_slot
            )
            hidden = fused_llm.decode_rows(
                lm,
                self.cache,
                prepared,
                linear=self.fused_linear,
                split_workspace=self._split_ws,
                pdl=self.pdl,
                attention_workspace=self._attn_ws,
            )
            return self.sample(hidden, prepared)
        rows = self._resolve_fed(unpack_decode_rows(packed))
        embeds = self.lm.embed_kinds(rows.kinds, rows.tokens)
        hidden = self.lm.decode_step(
            self.cache,
            rows.slots,
            embeds,
            kv_len=window,
            active=rows.active,
            scratch_slot=self.scratch_slot,
            offsets=rows.offsets,
        )
        return self.sample(hidden, rows)

    def sample(self, hidden: Tensor, rows: DecodeInputs | decode_kernels.StepRows) -> Tensor:
        """The ``llm_decoder`` head, EOS masking and RAS for final-norm hidden states ``[N, H]``
        with the sampling inputs of ``rows`` (``[N]`` of each: slots, offsets, EOS masks,
        uniforms, windows): int64 ids ``[N]`` on the device, no sync. The decode step's own
        tail, and what a prefilled row is sampled with."""
        eos = self.lm.dims.eos_token
        ids: Tensor
        if self.fused:
            # the bias in the GEMM's epilogue (addmm would first copy it into the output)
            logits = F.linear(hidden, self._head_weight, self._head_bias)[:, : self.lm.dims.speech_vocab_size]
            ids = decode_kernels.ras_sample(
                logits,
                rows.history,
                rows.uniforms,
                rows.masked,
                eos,
                self.sampling,
                pdl=self.pdl,
                workspace=self._sample_ws,
            )
        else:
            logp = mask_eos_(self.lm.logprobs(hidden), rows.masked, eos)
            ids = ras_sample_batch(logp, rows.history, rows.uniforms, self.sampling)
        # a run's last row is its draw: keep it per slot for the rows fed from it
        last = torch.ones_like(rows.masked)
        last[:-1] = rows.offsets[1:] == 0
        self.last_ids.index_copy_(0, torch.where(last, rows.slots, self.scratch_slot), ids)
        return ids

    def _draw_fn(self, hidden: Tensor, packed: Tensor) -> Tensor:
        return self.sample(hidden, unpack_decode_rows(packed))

    def draw(self, hidden: Tensor, rows: np.ndarray) -> Tensor:
        """:meth:`sample` for prefilled rows: final-norm hidden states ``[N, H]`` and their
        sampling inputs as packed host rows (:func:`pack_decode_rows`, int64 ``[N, cols]``) ->
        int64 ids ``[N]`` on the device, no sync. Replays the graph of N rows where
        :meth:`capture_all` made one (the ids are then its static output: read them, or copy
        them, before the next draw of N rows); eager otherwise. GPU worker thread only."""
        n = len(rows)
        host = self._host_rows(rows, n)
        bufs = self._draw.static_inputs(n)
        if bufs is not None:
            bufs[1].copy_(host, non_blocking=True)
            ids: Tensor = self._draw(n, hidden, bufs[1])
            return ids
        return self._draw_fn(hidden, host.to(self.device, non_blocking=True))

    def _host_rows(self, rows: np.ndarray, n_rows: int) -> Tensor:
        """Packed ``rows`` in a host buffer of ``n_rows`` rows, the rest idle rows; pinned on
        CUDA, from torch's caching host allocator (one per launch: a block is reused only once
        the copies queued from it have run)."""
        host = torch.empty((n_rows, self._cols), dtype=torch.int64, pin_memory=self.device.type == "cuda")
        host_rows = host.numpy()
        host_rows[: len(rows)] = rows
        host_rows[len(rows) :] = self._idle
        return host

    def _resolve_fed(self, rows: DecodeInputs) -> DecodeInputs:
        """Fed rows (``rows.feed``) take their slot's last sampled id as their input id and
        as the last id of their repetition window (the host packed a placeholder there)."""
        fed = torch.where(rows.feed, self.last_ids.index_select(0, rows.slots), rows.tokens)
        window = torch.cat([rows.history[:, :-1], torch.where(rows.feed, fed, rows.history[:, -1])[:, None]], dim=1)
        return replace(rows, tokens=fed, history=window)

    def _prefill_fn(self, window: int, slot: Tensor, start: Tensor, n_valid: Tensor, embeds: Tensor) -> Tensor:
        return prefill_static(self.lm, self.cache, slot, start, n_valid, embeds, window)

    # -- calls ------------------------------------------------------------------------------

    @property
    def max_rows(self) -> int:
        """The most rows one :meth:`decode_sample` replays from a graph (the largest bucket)."""
        return self.decode_buckets[-1]

    def decode_sample(self, rows: np.ndarray, kv_len: int | None = None) -> list[int]:
        """:meth:`decode_launch`, then wait for its ids: the N sampled ids, row by row."""
        return self.decode_launch(rows, kv_len).ids()

    def decode_launch(self, rows: np.ndarray, kv_len: int | None = None) -> PendingIds:
        """Launch one decode + sample step; no wait. ``rows`` int64 ``[N, decode_cols]`` from
        :func:`pack_decode_rows`, each appending one position to its slot (in ``0 ..
        scratch_slot - 1``); a slot's rows form one run of consecutive rows with offsets 0, 1,
        2, .. (:func:`check_runs`), each attending causally over the slot and the run's earlier
        rows. ``kv_len``: positions every row needs after this step (the longest slot's length
        + its rows), None = the whole cache. Returns the N sampled ids on their way to the host
        (:class:`PendingIds`); only a run's last id means anything, the others are draws from
        its inner positions.

        A fed row (``feed``) takes the id its slot's latest sampled row drew, on the device:
        the step may be launched while the step that samples that id is still running (the
        GPU runs them in order), so the host plans ahead instead of waiting for each step.

        Runs the graph of the smallest batch bucket >= N, the rest idle rows, and the smallest
        window >= ``kv_len``. The rows go into a pinned host buffer (one per launch: an earlier
        launch's copy may still be queued) and reach the graph's input in one copy. Eager above
        the largest bucket, on the CPU, or with graphs off."""
        need = self.cache.max_len if kv_len is None else kv_len
        window = _bucket(need, self._decode_windows)
        if window is None:
            raise ValueError(f"decode needs {need} positions, the cache holds {self.cache.max_len}")
        n = len(rows)
        if rows.ndim != 2 or n == 0 or rows.shape[1] != self._cols or rows.dtype != np.int64:
            raise ValueError(f"decode rows must be int64 [N >= 1, {self._cols}], got {rows.dtype} {rows.shape}")
        slots = rows[:, COL_SLOT]
        if slots.max() >= self.scratch_slot or slots.min() < 0:
            raise ValueError(f"decode slots must be in 0..{self.scratch_slot - 1}: {slots.tolist()}")
        why = check_runs(slots, rows[:, COL_OFFSET])
        if why is not None:
            raise ValueError(f"decode rows: {why}")
        bucket = _bucket(n, self.decode_buckets) if self.enabled else n
        if bucket is None:  # more rows than the largest bucket: eager, same code
            bucket = n
        graph = self._decode[window] if self.enabled and bucket in self.decode_buckets else None
        bufs = graph.static_inputs(bucket) if graph is not None else None
        host = self._host_rows(rows, bucket)
        out: Tensor
        if graph is not None and bufs is not None:
            bufs[0].copy_(host, non_blocking=True)
            out = graph(bucket, *bufs)
        else:  # eager, or the first call of a bucket not captured at start-up (captures it)
            packed = host.to(self.device, copy=True)
            out = graph(bucket, packed) if graph is not None else self._decode_fn(window, packed)
        return PendingIds(out[:n])

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

    def decode_eagerly(self, batch: int = 1) -> Tensor:
        """Run the decode step once without a graph, every row idle (nothing is appended): for a
        start-up dry run of its kernels (``voice_out.fast.kernels.launch.recording``). Returns its output."""
        return self._decode[self._decode_windows[0]].fn(self._idle_rows(batch))

    def _idle_rows(self, batch: int) -> Tensor:
        """Packed rows of ``batch`` idle slots, on the device."""
        return torch.from_numpy(np.tile(self._idle, (batch, 1))).to(self.device)

    def capture_all(self) -> None:
        """Capture every decode and prefill bucket now, on the scratch slot; then reset it."""
        if not self.enabled:
            return
        hid = self.lm.dims.hidden_size
        dtype = self.lm.llm_decoder.weight.dtype
        for w in self._decode_windows:
            for b in self.decode_buckets:
                self._decode[w].capture(b, self._idle_rows(b))  # no row active: nothing is appended
        for w, n in ((w, n) for w in self.decode_windows for n in self.prefill_buckets if n <= w):
            self._prefill[w].capture(
                n,
                torch.tensor([self.scratch_slot], device=self.device),
                torch.zeros(1, dtype=torch.long, device=self.device),
                torch.ones(1, dtype=torch.long, device=self.device),
                torch.zeros(n, hid, device=self.device, dtype=dtype),
            )
        for n in range(1, DRAW_GRAPH_ROWS + 1):  # idle rows: their draws go to the scratch slot
            self._draw.capture(n, torch.zeros(n, hid, device=self.device, dtype=dtype), self._idle_rows(n))
        self.cache.reset(self.scratch_slot)
        torch.cuda.synchronize(self.device)
