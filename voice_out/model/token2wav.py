"""Streaming token2wav: speech tokens -> flow mel -> HiFT waveform, chunk by chunk.

cosyvoice2-spec.md sections 5.3-5.4. :class:`Token2Wav` holds the shared, stateless models (the
flow and the vocoder); :class:`Token2WavStream` is ALL the state of one request (its prompt, its
chunk schedule, its vocoder overlap cache, its flow cache) and is reset in place for the next
request. Nothing survives from one request to the next (upstream leaks its hop across requests).

How an engine drives one request (GPU worker thread only)::

    stream = t2w.open_stream(prompt_token, prompt_feat, embedding)       # or stream.reset(...)
    while True:
        plan = stream.ready_chunk(len(tokens), llm_finished)              # no tensor work
        if plan is None: wait for more tokens (or the request is done: stream.finished)
        pcm = stream.run_chunk(plan, tokens)                              # float32 (n,), 24 kHz
        if plan.finalize: break

Per chunk (non-final chunks hold back their last 160 ms)::

    mel = flow(tokens[:token_len])[:, :, 2*token_offset:]       # only the new frames
    if cache: mel = [cache.mel (8 frames), mel]; cache_source = cache.source (3840 samples)
    speech, source = hift(mel, cache_source)
    if cache: speech[:3840] = speech[:3840] * w[:3840] + cache.speech * w[3840:]   (float64)
    non-final: cache = (mel[-8:], source[-3840:], speech[-3840:]); emit speech[:-3840]
    final:     emit speech

``w`` is the symmetric Hamming window of 7680 points (its halves sum to ~1.08, as upstream).

Two flow paths, chosen per stream: ``"rerun"`` calls ``flow.inference`` over the prompt and
every token so far on each chunk (upstream's way); ``"cached"`` uses the flow's incremental API,
so each chunk costs only its new tokens. Both give the same waveform.

Fast path (CUDA, ``Token2Wav.use_cuda_graphs(True)``): a non-final re-run flow call of one
stream is ONE captured graph, keyed by (prompt length, tokens so far): the schedule makes only a
few lengths per prompt length (25 + pad, then 50 and 100 more each time), and one graph serves
every voice of that prompt length. First chunks, which decide time to first audio, replay it on
both flow paths (captured on first use); other lengths replay it once
:meth:`Token2Wav.capture_stream_shapes` has captured them at start-up, and run eagerly until then
(a capture mid-stream would stall every stream). Every non-final vocoder call replays a graph per
mel length. A cached-path stream whose first chunk came from the graph replays that chunk into
its flow cache at its second chunk (off the critical path: the listener already has 1 s of
audio). Graph outputs equal the eager ones (tests/test_token2wav_graphs.py).

Batched chunks (:meth:`Token2Wav.run_chunks`): an engine step with chunks of several streams
computes the flow of its non-final re-run-path chunks batched, then finishes each chunk as
:meth:`Token2Wav.run_chunk` does. Rows are exact because the real tokens of a non-final chunk
end on a flow chunk boundary, so right padding never reaches a real frame (see
``Flow.inference_batch``). Eager (no graphs; the default off CUDA): ONE ``flow.inference_batch``
call, rows right-padded to the longest. With graphs: the chunks are grouped by T = prompt + real
tokens (one pass per distinct T, no length padding); a group of n >= 2 is padded with copies of
its first row to the smallest of ``CHUNK_BATCH_BUCKETS`` (2, 4, 8) >= n (larger groups split at
8) and replays a graph of ``Flow.batch_core`` keyed by (bucket, T). A key depends on T only, so
it serves every prompt length whose chunks end there. :meth:`Token2Wav.capture_stream_shapes`
captures the keys of a prompt length's schedule at start-up (the engine: its default voice, for
steps of up to its ``max_chunks_per_step`` chunks); an uncaptured key is never captured
mid-stream: those of its chunks whose own single-chunk graph replays take it, the others run in
one eager batch. A group of one takes the single-chunk path. A full-size re-run chunk is
launch-bound, so a batch of B rows is expected to cost far less than B single replays.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from voice_out.fast.graphs import GraphedFn
from voice_out.model.chunk_schedule import ChunkPlan, ChunkSchedule, HopPolicy, plan_all
from voice_out.model.hift import HiFT
from voice_out.model.transfer import to_device

#: upstream's hops (25, 50, 100): what a stream gets unless told otherwise
DEFAULT_HOPS = HopPolicy()
MEL_FRAMES_PER_TOKEN = 2  # token_mel_ratio: 25 Hz tokens, 50 Hz mel
#: A final chunk's graph is keyed by prompt + tokens rounded up to a whole flow chunk while that
#: total is at most FINAL_FINE_TOKENS, beyond it to FINAL_COARSE_CHUNKS flow chunks (padding is
#: masked, so exact): a long utterance's final graphs are a quarter as many to capture, and its
#: final pass, once per utterance, computes at most 3 padding chunks more.
FINAL_FINE_TOKENS = 500
FINAL_COARSE_CHUNKS = 4
#: Start-up runs a dummy stream through its first STREAM_CAPTURE_TOKENS speech tokens (every
#: vocoder length of the schedule appears by then); the single-chunk flow graphs of longer
#: utterances are captured directly, without running their chunks or warming them up again.
STREAM_CAPTURE_TOKENS = 500
HIFT_CACHE_FRAMES = 8  # vocoder overlap between chunks (160 ms)
#: The ``GraphedFn`` family of every token2wav graph: they replay alongside the LLM's graphs
#: (family "llm"), so they are captured on a stream of their own (``voice_out.fast.graphs``).
GRAPH_FAMILY = "token2wav"
#: The family of the first-chunk lane's graphs (``use_cuda_graphs(first_lane=True)``): they
#: replay alongside the other token2wav graphs, so they have a capture stream (cuBLAS
#: workspace) and a memory pool of their own.
FIRST_GRAPH_FAMILY = "token2wav.first"
#: Row counts of the graphed batched re-run chunks: a group of n chunks runs in the smallest
#: bucket >= n (pad rows are copies of its first row); larger groups split at the largest.
CHUNK_BATCH_BUCKETS = (2, 4, 8)

FlowPath = Literal["rerun", "cached"]


@dataclass
class _LaneGraphs:
    """The graphs of the first-chunk lane: what a non-final first chunk replays (its re-run
    flow alone or batched, and the vocoder without overlap cache), in a family and a memory
    pool of their own, so they may replay while the other chunks' graphs do."""

    flow: GraphedFn  # one chunk's re-run flow, key (prompt length, tokens so far)
    hift: GraphedFn  # the vocoder without cache, key mel frames
    pool: Any
    batch: GraphedFn | None = None  # several chunks' flow, key (bucket, T)


@dataclass
class _PrefixSlot:
    """Where the graphs of first chunks from a prompt prefix of one length read the prefix:
    buffers of that size (a flow stream cache, only its estimator state used), holding the
    prefix of the voice last loaded (``voice``, compared by identity): a first chunk of another
    voice copies its prefix in first (~0.6 GB for a 125-token prefix at full size, device to
    device), one of the same voice copies nothing."""

    state: Any
    graph: GraphedFn
    voice: Any = None


@dataclass
class _StateSlot:
    """A flow state of one stream's own, under CUDA graphs (``Token2Wav.use_state_slots``): a
    flow stream cache of ``capacity`` tokens (prompt included) that a stream holds while its
    later chunks extend it, the graphs of ``Flow.state_core`` over it, one per chunk length in
    mel frames, and those of its encoder part (``Flow.state_mu``), one per ``Flow.StateKey``
    (the chunk's position: ``key``, the one being run). ``owner``: the stream holding it, or
    None; ``started``: whether the owner's state was set up (its voice's prompt prefix copied
    in, at its first chunk here); ``captured``: the (prompt, tokens, hops, fast first) whose
    chunks start-up ran through it."""

    cache: Any
    graph: GraphedFn
    encoder: GraphedFn | None = None
    key: Any = None
    owner: Token2WavStream | None = None
    started: bool = False
    captured: set[tuple[Any, ...]] = field(default_factory=set)


class FlowInference(Protocol):
    """The flow's one-shot entry point (``voice_out.model.flow.Flow.inference``).

    token [1, N], prompt_token [1, P], prompt_feat [1, 2P, 80], embedding [1, spk_dim] ->
    mel [1, 80, 2N] float32 without the prompt frames; with ``finalize=False`` the last
    ``lookahead`` tokens are context only and the mel has 2(N - lookahead) frames.
    """

    def inference(
        self,
        token: Tensor,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        streaming: bool,
        finalize: bool,
    ) -> Tensor: ...


class StreamingFlow(FlowInference, Protocol):
    """The flow's cached incremental API (see the top of ``voice_out.model.flow``).

    ``prepare_prompt`` once per voice (shareable, read-only), one stream cache per request
    (``new_stream_cache`` / ``reset_stream_cache`` in place), then ``stream_chunk`` per chunk with
    the tokens not yet given as new (+ 3 look-ahead tokens unless ``finalize``): mel of the new
    tokens only, equal to the re-run path's slice.
    """

    def prepare_prompt(self, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor) -> Any: ...

    def new_stream_cache(self, prompt: Any, capacity: int | None = None) -> Any: ...

    def reset_stream_cache(self, cache: Any, prompt: Any) -> None: ...

    def stream_chunk(self, cache: Any, tokens: Tensor, finalize: bool) -> Tensor: ...


class BatchFlow(FlowInference, Protocol):
    """The flow's batched entry point (``voice_out.model.flow.Flow.inference_batch``): several
    non-final streaming calls (token, prompt_token, prompt_feat, embedding) -> one mel each,
    equal to ``inference(..., streaming=True, finalize=False)`` of that item.

    ``inference_batch`` is ``batch_inputs`` (host side: ids ``[B, T + 3]``, embedding ``[B,
    spk_dim]``, cond ``[B, 80, 2T]`` and each row's mel span) then ``batch_core`` (fixed shapes,
    no host sync: mel float32 ``[B, 80, 2T]``, what the graphed batched chunks capture)."""

    def inference_batch(self, items: Sequence[tuple[Tensor, Tensor, Tensor, Tensor]]) -> list[Tensor]: ...

    def batch_inputs(
        self, items: Sequence[tuple[Tensor, Tensor, Tensor, Tensor]]
    ) -> tuple[Tensor, Tensor, Tensor, list[tuple[int, int]]]: ...

    def batch_core(self, ids: Tensor, embedding: Tensor, cond: Tensor) -> Tensor: ...


class PrefixFlow(FlowInference, Protocol):
    """A flow that computes a first chunk from a voice's prepared prompt prefix
    (``voice_out.model.flow.Flow.prefix_core``): ``prepare_prompt`` once per voice, then
    ``prefix_inputs`` (host side) and ``prefix_core`` (fixed shapes, the prefix only read)."""

    def prepare_prompt(self, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor) -> Any: ...

    def allocate_stream_cache(self, capacity: int) -> Any: ...

    def prefix_inputs(self, token: Tensor, prompt: Any) -> tuple[Tensor, Tensor, Tensor]: ...

    def prefix_core(self, ids: Tensor, embedding: Tensor, cond: Tensor, prefix: Any) -> Tensor: ...


class StateFlow(PrefixFlow, Protocol):
    """A flow whose later chunks extend a stream's own state under graphs
    (``voice_out.model.flow.Flow.state_inputs`` / ``state_core``)."""

    def reset_stream_cache(self, cache: Any, prompt: Any) -> None: ...

    def state_inputs(
        self, cache: Any, tokens: Tensor, encode: Callable[[Tensor, Any], Tensor] | None = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]: ...

    def state_mu(self, cache: Any, context: Tensor | None, key: Any) -> Tensor: ...

    def state_core(self, mu: Tensor, spk: Tensor, cond: Tensor, x0: Tensor, at: Tensor, cache: Any) -> Tensor: ...


class FinalFlow(FlowInference, Protocol):
    """The flow's graph-safe final pass (``voice_out.model.flow.Flow.final_core``): full
    attention over each row's prompt + tokens, right-padded to ``total`` tokens and masked, so
    one graph per ``total`` serves every utterance that ends within it.

    ``final_inputs(items, total)`` -> (ids ``[B, total]``, n_valid ``[B]``, embedding ``[B,
    spk_dim]``, cond ``[B, 80, 2 total]``, each row's mel span); ``final_core(...)`` -> mel
    float32 ``[B, 80, 2 total]``, the span of row i equal to ``inference(*items[i],
    streaming=False, finalize=True)``."""

    def final_inputs(
        self, items: Sequence[tuple[Tensor, Tensor, Tensor, Tensor]], total: int
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, list[tuple[int, int]]]: ...

    def final_core(self, ids: Tensor, n_valid: Tensor, embedding: Tensor, cond: Tensor) -> Tensor: ...


class ChunkBatchError(RuntimeError):
    """Some chunks of a :meth:`Token2Wav.run_chunks` call failed after its flow pass.

    ``results[i]``: the audio of chunk i (done: its stream advanced), or None where
    ``errors[i]`` holds why it failed.
    """

    def __init__(self, results: list[Tensor | None], errors: dict[int, Exception]) -> None:
        first = errors[min(errors)]
        super().__init__(f"{len(errors)} of {len(results)} chunks failed; first: {type(first).__name__}: {first}")
        self.results = results
        self.errors = errors


def _check_speed(speed: float, whole: bool = True) -> float:
    """``speed`` if it is a token2wav speed a stream can have (> 0, finite; != 1 only for a
    whole utterance), else ValueError."""
    if not math.isfinite(speed) or speed <= 0:
        raise ValueError(f"speed must be a finite number > 0, got {speed}")
    if speed != 1.0 and not whole:
        raise ValueError(f"speed {speed} needs the whole utterance in one chunk (whole=True; spec 5.6)")
    return float(speed)


def hamming(n: int, device: torch.device | str | None = None) -> Tensor:
    """Symmetric Hamming window of ``n`` points in float64: 0.54 - 0.46 cos(2 pi k / (n - 1))."""
    if n == 1:
        return torch.ones(1, dtype=torch.float64, device=device)
    k = torch.arange(n, dtype=torch.float64, device=device)
    return 0.54 - 0.46 * torch.cos(2.0 * math.pi * k / (n - 1))


@dataclass
class HiFTCache:
    """Vocoder overlap state of one request, preallocated and written in place.

    mel [1, C_mel, 8], source [1, 1, 3840], speech [1, 3840]; ``valid`` False = no cache yet.
    """

    mel: Tensor
    source: Tensor
    speech: Tensor
    valid: bool = False

    @staticmethod
    def allocate(mel_channels: int, n_frames: int, samples_per_frame: int, device: torch.device) -> HiFTCache:
        n = n_frames * samples_per_frame
        return HiFTCache(
            mel=torch.zeros(1, mel_channels, n_frames, device=device),
            source=torch.zeros(1, 1, n, device=device),
            speech=torch.zeros(1, n, device=device),
        )

    def reset(self) -> None:
        self.valid = False


@dataclass
class Token2WavStream:
    """All per-request token2wav state. Owned and called by one thread (the GPU worker).

    ``prompt_token`` [1, P] int, ``prompt_feat`` [1, 2P, 80] float32, ``embedding`` [1, spk_dim]:
    the voice. ``flow_prompt`` (the voice's precomputed flow state, shareable between requests)
    and ``flow_cache`` (this request's incremental flow state) are used by the cached path only.
    """

    model: Token2Wav
    prompt_token: Tensor
    prompt_feat: Tensor
    embedding: Tensor
    schedule: ChunkSchedule
    hift_cache: HiFTCache
    flow_path: FlowPath = "rerun"
    noise: torch.Generator | None = None
    flow_prompt: Any = None
    flow_cache: Any = None
    #: The voice's prompt prefix for a first chunk from it (``Token2Wav.prepare_prefix``;
    #: re-run path only), or None: the first chunk re-runs the whole prompt.
    first_prefix: Any = None
    #: The flow state this stream's later chunks extend (``Token2Wav.use_state_slots``), or
    #: None: they re-run the prompt and every token so far.
    state_slot: _StateSlot | None = None
    #: token2wav speed (spec 5.6): != 1 resamples the whole utterance's mel in time before the
    #: vocoder, so the stream's schedule is ``whole`` (one final chunk).
    speed: float = 1.0
    samples_emitted: int = 0
    chunk_log: list[ChunkPlan] = field(default_factory=list)
    #: Cached path: the first chunk's mel came from a re-run (graphed, or a fast first chunk that
    #: ends off a chunk boundary), so the flow cache has not taken in any speech token yet; the
    #: next chunk feeds it everything from the prompt's end (ending on a boundary again).
    flow_cache_behind: bool = False

    @property
    def finished(self) -> bool:
        return self.schedule.finished

    def ready_chunk(self, n_tokens_available: int, llm_finished: bool) -> ChunkPlan | None:
        """The chunk to run now for this request, or None. No tensor work."""
        return self.schedule.ready(n_tokens_available, llm_finished)

    def run_chunk(self, plan: ChunkPlan, tokens: Tensor | Sequence[int]) -> Tensor:
        """Run ``plan`` on the request's tokens so far (at least ``plan.token_len``): float32 (n,)."""
        return self.model.run_chunk(self, plan, tokens)

    def reset(
        self,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        *,
        hops: HopPolicy = DEFAULT_HOPS,
        fast_first: int = 0,
        flow_path: FlowPath | None = None,
        noise: torch.Generator | None = None,
        flow_prompt: Any = None,
        first_prefix: Any = None,
        speed: float = 1.0,
        whole: bool | None = None,
    ) -> None:
        """Reuse this state object for a new request (caches are kept allocated).

        ``speed``: token2wav speed (> 0; != 1 makes the audio in one final chunk, spec 5.6).
        ``whole``: one final chunk over every token (None: when ``speed`` != 1).

        ``flow_prompt``: the voice's ``Token2Wav.prepare_voice`` result (cached path), made on
        demand when None. ``first_prefix``: the voice's ``Token2Wav.prepare_prefix`` result
        (the first chunk from the prompt prefix), or None.
        """
        dev = self.model.device
        self.prompt_token, self.prompt_feat = prompt_token.to(dev), prompt_feat.to(dev)
        self.embedding = embedding.to(dev)
        whole = speed != 1.0 if whole is None else whole
        self.speed = _check_speed(speed, whole)
        self.schedule = hops.schedule(int(prompt_token.shape[-1]), fast_first, whole=whole)
        self.hift_cache.reset()
        if flow_path is not None:
            self.flow_path = flow_path
        self.noise = noise
        self.flow_prompt = flow_prompt
        self.first_prefix = first_prefix
        self.samples_emitted = 0
        self.chunk_log.clear()
        self.flow_cache_behind = False
        self.model.release_state(self)
        self.model.prepare_flow(self)


class Token2Wav:
    """Flow + HiFT and the chunk recipe. Holds no per-request state; safe to share by streams."""

    def __init__(self, flow: FlowInference, hift: HiFT, *, device: torch.device | str | None = None) -> None:
        self.flow = flow
        self.hift = hift
        self.device = torch.device(device) if device is not None else hift.stft_window.device
        self.samples_per_frame = hift.dims.samples_per_frame
        self.cache_frames = HIFT_CACHE_FRAMES
        self.cache_samples = HIFT_CACHE_FRAMES * self.samples_per_frame
        self.window = hamming(2 * self.cache_samples, device=self.device)  # [7680] float64
        self._graph_flow: GraphedFn | None = None
        self._capturing = False  # capture_stream_shapes running: any non-final shape is captured
        self._graph_hift: GraphedFn | None = None
        self._graph_hift_cached: GraphedFn | None = None
        #: Grouped batched chunks (``use_batch_buckets``): () = off, one eager padded pass.
        self.batch_buckets: tuple[int, ...] = ()
        self._graph_flow_batch: GraphedFn | None = None
        self._graph_flow_final: GraphedFn | None = None
        self._flow_pool: Any = None  # CUDA graph memory pool of the flow graphs
        #: The first-chunk lane's graphs (``use_cuda_graphs(first_lane=True)``), or None: every
        #: chunk replays the graphs above.
        self._first_lane: _LaneGraphs | None = None
        #: First chunks from a prompt prefix under graphs: a slot per prefix length (tokens).
        self._prefix_slots: dict[int, _PrefixSlot] = {}
        #: Streams' own flow states under graphs (``use_state_slots``).
        self._state_slots: list[_StateSlot] = []

    def use_cuda_graphs(
        self,
        enabled: bool = True,
        *,
        batch_buckets: Sequence[int] = CHUNK_BATCH_BUCKETS,
        first_lane: bool = False,
    ) -> None:
        """Replay non-final flow calls (every chunk of a re-run-path stream, the first chunk of a
        cached-path one) and non-final vocoder calls from CUDA graphs (CUDA only; a no-op on the
        CPU), and run a :meth:`run_chunks` call's batchable chunks in groups of one length, each
        padded to one of ``batch_buckets`` (:meth:`use_batch_buckets`). Vocoder graphs and the
        single-chunk flow graphs of first chunks are captured on first use; every other flow
        key only by :meth:`capture_stream_shapes` (start-up), and runs eagerly until then.

        ``first_lane``: the non-final first chunks (:meth:`in_first_lane`) replay graphs of
        their own (family ``FIRST_GRAPH_FAMILY``, their own memory pool), so a caller may run
        them on a second CUDA stream while other chunks run (the engine's first-chunk lane).
        Without it, two token2wav calls must never run at once: their graphs share a pool."""
        self._first_lane = None
        self._prefix_slots = {}
        self._drop_state_slots()
        if not enabled or self.device.type != "cuda":
            self._graph_flow = self._graph_hift = self._graph_hift_cached = self._graph_flow_final = None
            self._flow_pool = None
            self.use_batch_buckets(())
            return
        flow = self.flow

        def rerun_flow(token: Tensor, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor) -> Tensor:
            return flow.inference(token, prompt_token, prompt_feat, embedding, streaming=True, finalize=False)

        def hift_fresh(mel: Tensor) -> tuple[Tensor, Tensor]:
            return self.hift(mel, None, None)

        def hift_cached(mel: Tensor, source: Tensor) -> tuple[Tensor, Tensor]:
            return self.hift(mel, source, None)

        # one memory pool for the single and the batched flow graphs: only one runs at a time
        self._flow_pool = torch.cuda.graph_pool_handle()
        if first_lane:
            pool = torch.cuda.graph_pool_handle()
            self._first_lane = _LaneGraphs(
                flow=GraphedFn(rerun_flow, name="flow.first_chunk", pool=pool, family=FIRST_GRAPH_FAMILY),
                hift=GraphedFn(hift_fresh, name="hift.first_chunk", warmup_each=False, family=FIRST_GRAPH_FAMILY),
                pool=pool,
            )
        # start-up captures ~15 re-run and ~130 vocoder lengths: each graph is warmed up once,
        # not per length (its keys differ in lengths alone; docs/engine.md, "Start-up")
        self._graph_flow = GraphedFn(
            rerun_flow, name="flow.rerun_chunk", warmup_each=False, pool=self._flow_pool, family=GRAPH_FAMILY
        )
        self._graph_hift = GraphedFn(hift_fresh, name="hift.fresh", warmup_each=False, family=GRAPH_FAMILY)
        self._graph_hift_cached = GraphedFn(hift_cached, name="hift.cached", warmup_each=False, family=GRAPH_FAMILY)
        self._graph_flow_final = None
        if hasattr(flow, "final_core"):
            final_core = cast(FinalFlow, flow).final_core
            self._graph_flow_final = GraphedFn(
                final_core,
                name="flow.final_chunk",
                warmup=1,
                warmup_each=False,
                pool=self._flow_pool,
                family=GRAPH_FAMILY,
            )
        self.use_batch_buckets(batch_buckets if hasattr(flow, "batch_core") else ())

    def use_batch_buckets(self, buckets: Sequence[int]) -> None:
        """How :meth:`run_chunks` batches (``use_cuda_graphs`` sets it; callable alone, e.g. on
        the CPU to exercise the grouping).

        ``()``: every batchable chunk of the call in ONE eager ``flow.inference_batch``,
        right-padded to the longest. Buckets (strictly increasing, each >= 2): the batchable
        chunks are grouped by T (prompt + real tokens); a group of n >= 2 runs as
        ``flow.batch_core`` over the smallest bucket >= n rows (pad rows: copies of the first,
        their output dropped) through a :class:`GraphedFn` keyed by (bucket, T), split at the
        largest bucket; a group of one goes through :meth:`run_chunk`'s path (its own
        single-chunk graph). On CUDA a (bucket, T) graph is replayed only once captured
        (:meth:`capture_stream_shapes`); until then the group runs eagerly. Off CUDA the
        :class:`GraphedFn` runs eagerly, padding included.
        """
        buckets = tuple(int(b) for b in buckets)
        if any(b < 2 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"batch buckets must be strictly increasing integers >= 2, got {buckets}")
        self.batch_buckets = buckets
        self._graph_flow_batch = None
        lane = self._first_lane
        if lane is not None:
            lane.batch = None
        if buckets:
            core = cast(BatchFlow, self.flow).batch_core

            def batched(name: str, pool: Any, family: str) -> GraphedFn:
                # warm-up 1: the single-chunk graphs and the eager passes have run these kernels
                return GraphedFn(core, name=name, warmup=1, warmup_each=False, pool=pool, family=family)

            self._graph_flow_batch = batched("flow.batch_chunks", self._flow_pool, GRAPH_FAMILY)
            if lane is not None:
                lane.batch = batched("flow.batch_first_chunks", lane.pool, FIRST_GRAPH_FAMILY)

    @property
    def has_state_path(self) -> bool:
        """Whether the flow extends a stream's own state in fixed shapes (``StateFlow``)."""
        return self.has_prefix_path and all(
            hasattr(self.flow, m) for m in ("reset_stream_cache", "state_inputs", "state_mu", "state_core")
        )

    def use_state_slots(self, n: int, capacity: int) -> int:
        """Keep ``n`` flow states of ``capacity`` tokens each (prompt included; ~4.6 MB a token
        at full size in bf16) that streams hold while their later chunks extend them: a
        non-final chunk after the first then runs the flow's 10 estimator calls over its new
        tokens only (``Flow.state_core``), where a re-run recomputes the prompt and every token
        so far; one graph per (state, chunk length) serves every chunk of that length. Call
        after :meth:`use_cuda_graphs` (which drops them); 0 = off. Returns the states kept.

        A stream takes a free one when it starts, if its voice has a prompt prefix (the
        state starts as a copy of it: ``Token2WavStream.first_prefix``), and gives it back
        when it ends, is reset or :meth:`release_state`; it leaves it early, and re-runs from
        then on, where a chunk would not fit the capacity or its length has no graph (a
        capture mid-stream would stall every stream): the same audio either way. The final
        chunk is the full-attention re-run, as on the re-run path."""
        if n < 0 or capacity < 1:
            raise ValueError(f"state slots: n >= 0 and capacity >= 1 expected, got {n} and {capacity}")
        self._drop_state_slots()
        if n == 0:
            return 0
        if not self.has_state_path:
            raise TypeError(f"{type(self.flow).__name__} has no state path (Flow.state_inputs / state_core)")
        flow = cast(StateFlow, self.flow)
        for i in range(n):
            cache = flow.allocate_stream_cache(capacity)

            def core(mu: Tensor, spk: Tensor, cond: Tensor, x0: Tensor, at: Tensor, cache: Any = cache) -> Tensor:
                return flow.state_core(mu, spk, cond, x0, at, cache)

            graph = GraphedFn(core, name=f"flow.state_chunk[{i}]", warmup=1, pool=self._flow_pool, family=GRAPH_FAMILY)
            slot = _StateSlot(cache=cache, graph=graph)

            def encoder(context: Tensor, slot: _StateSlot = slot) -> Tensor:
                return flow.state_mu(slot.cache, context, slot.key)

            slot.encoder = GraphedFn(
                encoder, name=f"flow.state_encoder[{i}]", warmup=1, pool=self._flow_pool, family=GRAPH_FAMILY
            )
            self._state_slots.append(slot)
        return n

    def _drop_state_slots(self) -> None:
        """Forget every state slot; a stream holding one re-runs its later chunks from now on."""
        for slot in self._state_slots:
            if slot.owner is not None:
                slot.owner.state_slot = None
        self._state_slots = []

    def _acquire_state(self, stream: Token2WavStream, slot: _StateSlot | None = None) -> None:
        """Give ``stream`` a free state slot (``slot``, or the first free one) if it can use one."""
        if stream.state_slot is not None or stream.first_prefix is None or stream.flow_path != "rerun":
            return
        if slot is None:
            slot = next((s for s in self._state_slots if s.owner is None), None)
        if slot is None or slot.owner is not None:
            return
        slot.owner, slot.started = stream, False
        stream.state_slot = slot

    def release_state(self, stream: Token2WavStream) -> None:
        """Give back ``stream``'s state slot, if it holds one (its later chunks then re-run).
        Work already launched on the slot stays ordered before the next holder's on the same
        CUDA stream (later chunks all run on one)."""
        slot = stream.state_slot
        if slot is not None:
            slot.owner = None
            stream.state_slot = None

    @property
    def has_first_lane(self) -> bool:
        """Whether the first-chunk lane is on (``use_cuda_graphs(first_lane=True)`` on CUDA)."""
        return self._first_lane is not None

    def in_first_lane(self, plan: ChunkPlan) -> bool:
        """Whether ``plan`` replays the first-chunk lane's graphs: a non-final first chunk
        (``ChunkPlan.starts_audio``) while the lane is on (``use_cuda_graphs(first_lane=True)``).
        A caller running two :meth:`run_chunks` calls at once (on two CUDA streams) must keep
        these chunks and the others apart."""
        return self._first_lane is not None and plan.starts_audio

    def _flow_graph(self, first_lane: bool) -> GraphedFn | None:
        """The single-chunk re-run flow graph of a chunk of the first-chunk lane or not."""
        return self._first_lane.flow if first_lane and self._first_lane is not None else self._graph_flow

    def _batch_graph(self, first_lane: bool) -> GraphedFn | None:
        """The batched-chunk flow graph of a group of chunks of the first-chunk lane or not."""
        return self._first_lane.batch if first_lane and self._first_lane is not None else self._graph_flow_batch

    def batch_keys(
        self,
        prompt_tokens: int,
        n_tokens: int,
        max_batch: int,
        *,
        hops: HopPolicy = DEFAULT_HOPS,
        fast_first: int = 0,
    ) -> list[tuple[bool, int, int]]:
        """The (first lane, bucket, T) keys of the grouped batched chunks that streams of this
        prompt length meet in their first ``n_tokens`` speech tokens, in groups of at most
        ``max_batch`` chunks: every bucket a group of 2 .. ``max_batch`` uses, for the T (prompt
        + real tokens) of every batchable non-final chunk of the schedule, with whether the
        chunk is the first-chunk lane's (:meth:`in_first_lane`). No tensor work."""
        if not self.batch_buckets or max_batch < 2:
            return []
        buckets = sorted({self._bucket(n) for n in range(2, min(max_batch, self.batch_buckets[-1]) + 1)})
        sched = hops.schedule(prompt_tokens, fast_first)  # for flow_end and the chunk size only
        lengths = [
            (self.in_first_lane(plan), sched.flow_end(plan))
            for plan in plan_all(n_tokens, prompt_tokens, hops, fast_first)
            if not plan.finalize and not (plan.index == 0 and fast_first)
        ]
        return [(first, b, t) for first, t in lengths if t % sched.chunk_size == 0 for b in buckets]

    def _bucket(self, n: int) -> int:
        """The smallest batch bucket that holds ``n`` rows (``n`` <= the largest bucket)."""
        return next(b for b in self.batch_buckets if b >= n)

    @torch.inference_mode()
    def capture_stream_shapes(
        self,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        n_tokens: int,
        *,
        hops: HopPolicy = DEFAULT_HOPS,
        fast_first: int = 0,
        max_batch: int = 1,
        batch_tokens: int | None = None,
        first_prefix: Any = None,
    ) -> int:
        """Capture now (start-up) the graphs a stream of this prompt length meets in its first
        ``n_tokens`` speech tokens, instead of mid-stream: its single-chunk flow graphs (with
        ``first_prefix``, a voice's :meth:`prepare_prefix`: the first chunk's from it too), final
        chunk graphs (:meth:`final_total`) and vocoder graphs, and (``max_batch`` >= 2, grouped
        batching on) the batched-chunk graphs of :meth:`batch_keys` for groups of up to
        ``max_batch`` chunks within the first ``batch_tokens`` (None: ``n_tokens``; a batched
        key depends on T only, so it serves every prompt length whose chunks end at the same
        T; the long ones are the costliest to capture: B rows of a whole utterance each).
        Returns the number of graphs held."""
        if self._graph_flow is None:
            return 0
        self._capturing = True
        stream = self.open_stream(
            prompt_token, prompt_feat, embedding, hops=hops, fast_first=fast_first, first_prefix=first_prefix
        )
        self.release_state(stream)  # the re-run path's chunks here; the state slots' below
        # placeholder speech ids; the extra chunk's worth covers a final chunk rounded up
        dummy = [(7 * i + 1) % 6561 for i in range(n_tokens + stream.schedule.chunk_size)]
        try:
            for _ in self.stream_all(stream, dummy[: min(n_tokens, STREAM_CAPTURE_TOKENS)]):
                pass
        finally:
            self._capturing = False
        self._capture_state_slots(stream, dummy[:n_tokens], hops, fast_first)
        prompt_token, prompt_feat = prompt_token.to(self.device), prompt_feat.to(self.device)
        embedding = embedding.to(self.device)
        n_prompt = int(prompt_token.shape[1])
        for plan in plan_all(n_tokens, n_prompt, hops, fast_first):  # the longer utterances' chunks
            key = (n_prompt, plan.token_len)
            single = self._flow_graph(self.in_first_lane(plan))
            if plan.finalize or single is None or single.has(key):
                continue
            token = self._as_tokens(dummy[: plan.token_len])
            single.capture(key, token, prompt_token, prompt_feat, embedding, warmup=0)
        n_batched = n_tokens if batch_tokens is None else min(n_tokens, batch_tokens)
        keys = self.batch_keys(n_prompt, n_batched, max_batch, hops=hops, fast_first=fast_first)
        for first, bucket, total in keys:
            graph = self._batch_graph(first)
            assert graph is not None
            token = self._as_tokens(dummy[: total - n_prompt + stream.schedule.lookahead])
            ids, emb, cond, _ = cast(BatchFlow, self.flow).batch_inputs(
                [(token, prompt_token, prompt_feat, embedding)] * bucket
            )
            graph.capture((bucket, total), ids, emb, cond)
        final = self._graph_flow_final
        if final is not None:  # the final chunk of an utterance ending anywhere in n_tokens
            sched = stream.schedule
            totals = sorted({self.final_total(sched, n_prompt + n) for n in range(1, n_tokens + 1)})
            for total in totals:
                token = self._as_tokens(dummy[: total - n_prompt])
                ids, n_valid, emb, cond, _ = cast(FinalFlow, self.flow).final_inputs(
                    [(token, prompt_token, prompt_feat, embedding)], total
                )
                final.capture(total, ids, n_valid, emb, cond)
        self.capture_final_vocoder(n_prompt, hops=hops, fast_first=fast_first)
        graphs = [
            self._graph_flow,
            self._graph_flow_batch,
            self._graph_flow_final,
            self._graph_hift,
            self._graph_hift_cached,
        ]
        if self._first_lane is not None:
            graphs += [self._first_lane.flow, self._first_lane.batch, self._first_lane.hift]
        graphs += [slot.graph for slot in self._prefix_slots.values()]
        graphs += [slot.graph for slot in self._state_slots]
        return sum(len(g.captured_keys) for g in graphs if g is not None)

    def _capture_state_slots(
        self, like: Token2WavStream, dummy: Sequence[int], hops: HopPolicy, fast_first: int
    ) -> None:
        """Capture (start-up) every state slot's graphs of the chunks a stream like ``like`` (its
        voice, ``hops``, ``fast_first``) makes on a slot in ``dummy``'s tokens (its hops up to
        ``hops.state_max_hop``: ``HopPolicy.on_state``): the estimator's per chunk length, the
        encoder's per chunk position, by running a placeholder stream through each
        slot that has not run them. The slots' contents are placeholders after this: a stream's
        first chunk on a slot sets it up afresh."""
        prompt = like.first_prefix
        if prompt is None or not self._state_slots:
            return
        done = (int(prompt.n_prompt), int(prompt.n_prefix), len(dummy), hops, fast_first)
        for slot in self._state_slots:
            if slot.owner is not None or done in slot.captured:
                continue
            stream = self.open_stream(
                like.prompt_token,
                like.prompt_feat,
                like.embedding,
                hops=hops,
                fast_first=fast_first,
                first_prefix=prompt,
            )
            self.release_state(stream)
            self._acquire_state(stream, slot)
            hops.on_state(stream.schedule)  # as the engine's scheduler makes a slot's chunks
            self._capturing = True
            try:
                for _ in self.stream_all(stream, dummy):
                    pass
            finally:
                self._capturing = False
                self.release_state(stream)
            slot.captured.add(done)

    @torch.inference_mode()
    def capture_final_vocoder(self, prompt_tokens: int, *, hops: HopPolicy = DEFAULT_HOPS, fast_first: int = 0) -> None:
        """Capture the vocoder of every final chunk a stream of a voice of ``prompt_tokens``
        flow prompt tokens (with ``hops`` and ``fast_first``) can end with (start-up; part of
        :meth:`capture_stream_shapes`, which skips what is captured already). It needs none of
        the flow's kernels: the engine captures it while they compile.

        A final chunk's mel has a length of its own: the tokens left after the last chunk, fewer
        than a hop plus the lookahead (so 0 .. max_hop + lookahead - 1 new tokens after the
        cached frames), or, for an utterance shorter than its first chunk, 1 .. first hop +
        pad + lookahead - 1 tokens and no cache. HiFT's convolutions look ahead, so a padded
        length would change the tail: one graph per length (eager was ~40 ms of launches)."""
        fresh, cached = self._graph_hift, self._graph_hift_cached
        if fresh is None or cached is None:
            return
        first = hops.schedule(prompt_tokens, fast_first)  # as it starts: its first hop
        per = MEL_FRAMES_PER_TOKEN
        mels = self.hift.dims.in_channels
        source = torch.zeros(1, 1, self.cache_samples, device=self.device)  # HiFTCache.source
        for k in range(1, first.hop_now + first.lookahead):
            fresh.capture(per * k, torch.zeros(1, mels, per * k, device=self.device))
        for k in range(hops.max_hop + first.lookahead):
            n = self.cache_frames + per * k
            cached.capture(n, torch.zeros(1, mels, n, device=self.device), source)

    @property
    def samples_per_token(self) -> int:
        return MEL_FRAMES_PER_TOKEN * self.samples_per_frame

    # -- streams -------------------------------------------------------------------------------

    def open_stream(
        self,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        *,
        hops: HopPolicy = DEFAULT_HOPS,
        fast_first: int = 0,
        flow_path: FlowPath = "rerun",
        noise: torch.Generator | None = None,
        flow_prompt: Any = None,
        first_prefix: Any = None,
        speed: float = 1.0,
        whole: bool | None = None,
    ) -> Token2WavStream:
        """A new per-request state.

        ``fast_first``: tokens of a fast first chunk (0 = off; see ``chunk_schedule``).
        ``hops``: the hop policy, the same as the engine's own schedule for the request uses;
        ``noise`` None = deterministic vocoder source; ``flow_prompt`` and ``first_prefix`` as
        in :meth:`Token2WavStream.reset`; ``speed`` and ``whole`` likewise.
        """
        whole = speed != 1.0 if whole is None else whole
        _check_speed(speed, whole)
        stream = Token2WavStream(
            model=self,
            prompt_token=prompt_token.to(self.device),
            prompt_feat=prompt_feat.to(self.device),
            embedding=embedding.to(self.device),
            schedule=hops.schedule(int(prompt_token.shape[-1]), fast_first, whole=whole),
            speed=float(speed),
            hift_cache=HiFTCache.allocate(
                self.hift.dims.in_channels, self.cache_frames, self.samples_per_frame, self.device
            ),
            flow_path=flow_path,
            noise=noise,
            flow_prompt=flow_prompt,
            first_prefix=first_prefix,
        )
        self.prepare_flow(stream)
        return stream

    def _streaming_flow(self) -> StreamingFlow:
        if not all(hasattr(self.flow, m) for m in ("prepare_prompt", "new_stream_cache", "stream_chunk")):
            raise TypeError(f"{type(self.flow).__name__} has no cached streaming API: use flow_path='rerun'")
        return cast(StreamingFlow, self.flow)

    @torch.inference_mode()
    def prepare_voice(self, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor) -> Any:
        """The flow state of a voice's prompt for the cached path; share it between requests."""
        return self._streaming_flow().prepare_prompt(prompt_token, prompt_feat, embedding)

    @property
    def has_prefix_path(self) -> bool:
        """Whether the flow computes a first chunk from a prompt prefix (``PrefixFlow``)."""
        return all(hasattr(self.flow, m) for m in ("prepare_prompt", "prefix_inputs", "prefix_core"))

    @torch.inference_mode()
    def prepare_prefix(self, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor) -> Any:
        """A voice's prompt prefix for first chunks from it (``Token2WavStream.first_prefix``;
        share it between requests), or None where there is none to gain: a prompt too short
        for a prefix, or a flow without the prefix path. Its flow state costs memory (~4.6 MB
        a prefix token at full size in bf16) and an eager pass over the prefix (worker thread)."""
        if not self.has_prefix_path:
            return None
        prompt = cast(PrefixFlow, self.flow).prepare_prompt(prompt_token, prompt_feat, embedding)
        return prompt if prompt.n_prefix > 0 else None

    @torch.inference_mode()
    def prepare_flow(self, stream: Token2WavStream) -> None:
        """Set up the flow side of a (re)started stream: the cached path's per-request cache,
        reset in place when the stream already has one; a free state slot
        (:meth:`use_state_slots`) for a re-run-path stream whose voice has a prompt prefix."""
        if not stream.schedule.whole:  # a whole stream makes one final chunk: no state to extend
            self._acquire_state(stream)
        if stream.flow_path == "rerun":
            return
        flow = self._streaming_flow()
        if stream.flow_prompt is None:
            stream.flow_prompt = flow.prepare_prompt(stream.prompt_token, stream.prompt_feat, stream.embedding)
        if stream.flow_cache is not None:
            try:
                flow.reset_stream_cache(stream.flow_cache, stream.flow_prompt)
                return
            except ValueError:  # the new voice's prompt does not fit: allocate a bigger cache
                stream.flow_cache = None
        stream.flow_cache = flow.new_stream_cache(stream.flow_prompt)

    # -- one chunk -----------------------------------------------------------------------------

    def _flow_mel(self, stream: Token2WavStream, plan: ChunkPlan, token: Tensor) -> Tensor:
        """New mel frames of ``plan``: [1, 80, 2 * hop_tokens] float32."""
        if plan.hop_tokens == 0:  # a final chunk with nothing new (an empty request)
            return torch.zeros(1, self.hift.dims.in_channels, 0, device=self.device)
        first = plan.index == 0 and not plan.finalize
        graphs_on = self._graph_flow is not None and token.is_cuda
        if first and self._from_prefix(stream, plan):
            return self._prefix_chunk(stream, plan, token)
        if stream.state_slot is not None and not first and not plan.finalize:
            mel = self._state_chunk(stream, plan, token)
            if mel is not None:
                return mel
        if not plan.finalize and (stream.flow_path == "rerun" or (first and (graphs_on or stream.schedule.fast_first))):
            mel = self._rerun_chunk(stream, plan, token)
            # a cached-path stream whose first chunk came from a re-run: its flow cache has taken
            # in no speech token yet (the next chunk catches it up)
            stream.flow_cache_behind = first and stream.flow_path == "cached"
            return mel
        if stream.flow_path == "rerun":  # the final chunk: full attention over every token
            return self._final_chunk(stream, plan, token)
        flow = self._streaming_flow()
        if stream.flow_cache_behind:  # take in the first chunk's tokens too, then drop its frames
            stream.flow_cache_behind = False
            mel = flow.stream_chunk(stream.flow_cache, token[:, : plan.token_len], plan.finalize)
            return mel[:, :, MEL_FRAMES_PER_TOKEN * plan.token_offset :].float()
        new = token[:, plan.token_offset : plan.token_len]  # new tokens (+ look-ahead unless final)
        return flow.stream_chunk(stream.flow_cache, new, plan.finalize).float()

    def _rerun_chunk(self, stream: Token2WavStream, plan: ChunkPlan, token: Tensor) -> Tensor:
        """A non-final chunk by upstream's re-run (prompt + tokens so far, chunk-causal): the new
        frames, float32 [1, 80, 2 * hop_tokens]. From a graph per (prompt length, tokens so far)
        for first chunks and for lengths start-up captured (``capture_stream_shapes``);
        capturing any other length here would stall every stream, so those run eagerly."""
        args = self._rerun_args(stream, plan, token)
        graph = self._single_graph(stream, plan, token)
        start = MEL_FRAMES_PER_TOKEN * plan.token_offset
        if graph is not None:
            key = (int(stream.prompt_token.shape[1]), plan.token_len)
            return graph(key, *args)[:, :, start:].float().clone()  # the graph reuses its output
        return self.flow.inference(*args, streaming=True, finalize=False)[:, :, start:].float()

    @staticmethod
    def _from_prefix(stream: Token2WavStream, plan: ChunkPlan) -> bool:
        """Whether ``plan`` (a non-final first chunk) is computed from the voice's prompt
        prefix: the stream has one (re-run path) and the chunk ends on a flow chunk boundary
        (not a fast first chunk)."""
        sched = stream.schedule
        return (
            stream.first_prefix is not None
            and stream.flow_path == "rerun"
            and sched.flow_end(plan) % sched.chunk_size == 0
        )

    def _prefix_chunk(self, stream: Token2WavStream, plan: ChunkPlan, token: Tensor) -> Tensor:
        """A non-final first chunk from the voice's prompt prefix (``Flow.prefix_core``): its
        new frames, float32 [1, 80, 2 * hop_tokens], as :meth:`_rerun_chunk` gives them but
        without the prefix's frames in the estimator calls. Under CUDA graphs it replays a
        graph per (prompt length, tokens so far) of its prefix length's slot (captured on first
        use, as first chunks are), whose buffers take the voice's prefix first if another
        voice's is there."""
        flow = cast(PrefixFlow, self.flow)
        prompt = stream.first_prefix
        ids, emb, cond = flow.prefix_inputs(token[:, : plan.token_len], prompt)
        # the prompt's frames after the prefix come first, then the tokens' (from token_offset)
        start = MEL_FRAMES_PER_TOKEN * (prompt.n_prompt - prompt.n_prefix + plan.token_offset)
        if self._graph_flow is None or not token.is_cuda:
            return flow.prefix_core(ids, emb, cond, prompt.prefix)[:, :, start:].float()
        slot = self._prefix_slot(prompt)
        if slot.voice is not prompt:
            slot.state.copy_prefix_(prompt.prefix, prompt.n_prefix, MEL_FRAMES_PER_TOKEN)
            slot.voice = prompt
        key = (prompt.n_prompt, plan.token_len)
        return slot.graph(key, ids, emb, cond)[:, :, start:].float().clone()  # the graph reuses its output

    @staticmethod
    def _state_frames(stream: Token2WavStream, plan: ChunkPlan) -> int:
        """The mel frames a later non-final ``plan`` of ``stream`` computes on its state slot:
        those since the state's last boundary (the first time, since its voice's prompt
        prefix: the prompt's tail, the first chunk's tokens and this one's)."""
        slot = stream.state_slot
        sched = stream.schedule
        done = slot.cache.n_done if slot is not None and slot.started else stream.first_prefix.n_prefix
        return MEL_FRAMES_PER_TOKEN * (sched.flow_end(plan) - done)

    def _state_chunk(self, stream: Token2WavStream, plan: ChunkPlan, token: Tensor) -> Tensor | None:
        """A later non-final chunk on the stream's state slot: its new frames, float32 [1, 80,
        2 * hop_tokens], as :meth:`_rerun_chunk` gives them. The encoder runs over the new tokens
        from the slot's graph of this position (eagerly at a position start-up did not reach),
        the estimator calls from its graph of this length. None when the stream leaves its
        slot instead (the chunk would not fit, or its length has no graph outside start-up):
        the caller re-runs it, and every chunk after it."""
        slot = stream.state_slot
        assert slot is not None
        sched = stream.schedule
        frames = self._state_frames(stream, plan)
        fits = sched.flow_end(plan) <= slot.cache.capacity  # the tokens it keeps (Flow.state_inputs)
        graphed = token.is_cuda and (self._capturing or slot.graph.has(frames))
        if sched.flow_end(plan) % sched.chunk_size or not fits or (self._graph_flow is not None and not graphed):
            self.release_state(stream)
            return None
        flow = cast(StateFlow, self.flow)
        prompt = stream.first_prefix
        skip = 0  # frames before this chunk's own: the first time, the prompt's tail and the first chunk
        if not slot.started:
            flow.reset_stream_cache(slot.cache, prompt)
            slot.started = True
            skip = MEL_FRAMES_PER_TOKEN * (prompt.n_prompt - prompt.n_prefix + plan.token_offset)
            new = token[:, : plan.token_len]
        else:
            new = token[:, plan.token_offset : plan.token_len]

        def encode(context: Tensor, key: Any) -> Tensor:
            slot.key = key
            assert slot.encoder is not None
            if self._graph_flow is not None and not (self._capturing or slot.encoder.has(key)):
                return flow.state_mu(slot.cache, context, key)  # a position start-up did not reach
            return slot.encoder(key, context)

        mu, spk, cond, x0, at = flow.state_inputs(slot.cache, new, encode)
        mel = slot.graph(frames, mu, spk, cond, x0, at)
        return mel[:, :, skip:].float().clone()  # the graph reuses its output

    def _prefix_slot(self, prompt: Any) -> _PrefixSlot:
        """The graphs and buffers of first chunks from prefixes of ``prompt``'s length (made on
        first use: buffers of the prefix's size; the first-chunk lane's family and pool when
        the lane is on, so they may replay beside the other token2wav graphs)."""
        n_prefix = int(prompt.n_prefix)
        slot = self._prefix_slots.get(n_prefix)
        if slot is None:
            flow = cast(PrefixFlow, self.flow)
            state = flow.allocate_stream_cache(n_prefix)
            state.n_done = n_prefix  # a whole prefix of this length, once a voice's is copied in
            lane = self._first_lane

            def from_prefix(ids: Tensor, embedding: Tensor, cond: Tensor) -> Tensor:
                return flow.prefix_core(ids, embedding, cond, state)

            graph = GraphedFn(
                from_prefix,
                name=f"flow.prefix_first_chunk[{n_prefix}]",
                warmup=1,
                pool=lane.pool if lane is not None else self._flow_pool,
                family=FIRST_GRAPH_FAMILY if lane is not None else GRAPH_FAMILY,
            )
            slot = self._prefix_slots[n_prefix] = _PrefixSlot(state=state, graph=graph)
        return slot

    def _final_chunk(self, stream: Token2WavStream, plan: ChunkPlan, token: Tensor) -> Tensor:
        """The final chunk (full attention over prompt + every token): its new frames, float32
        [1, 80, 2 * hop_tokens]. From the graph of ``flow.final_core`` over the tokens right-
        padded to the next multiple of the flow chunk (T = prompt + tokens rounded up; padding
        is masked, so it is exact) when start-up captured that T, else eagerly: every utterance
        ends at its own length, so a capture here would stall every stream."""
        args = self._rerun_args(stream, plan, token)
        start = MEL_FRAMES_PER_TOKEN * plan.token_offset
        graph = self._graph_flow_final if token.is_cuda else None
        total = self.final_total(stream.schedule, stream.schedule.prompt_tokens + plan.token_len)
        if graph is not None and (self._capturing or graph.has(total)):
            flow = cast(FinalFlow, self.flow)
            ids, n_valid, emb, cond, spans = flow.final_inputs([args], total)
            lo, hi = spans[0]
            return graph(total, ids, n_valid, emb, cond)[:, :, lo + start : hi].float().clone()
        mel = self.flow.inference(*args, streaming=False, finalize=True)
        return mel[:, :, start:].float()

    def final_total(self, sched: ChunkSchedule, n_tokens: int) -> int:
        """The padded length (prompt + tokens, ``n_tokens`` of them real) of a final chunk's pass,
        its graph's key: a whole flow chunk up to ``FINAL_FINE_TOKENS``, then a multiple of
        ``FINAL_COARSE_CHUNKS`` chunks."""
        fine = sched.round_up(n_tokens)
        if fine <= FINAL_FINE_TOKENS:
            return fine
        coarse = sched.chunk_size * FINAL_COARSE_CHUNKS
        return -(-n_tokens // coarse) * coarse

    @staticmethod
    def _rerun_args(stream: Token2WavStream, plan: ChunkPlan, token: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(tokens so far [1, token_len], prompt_token, prompt_feat, embedding) of a re-run."""
        return token[:, : plan.token_len], stream.prompt_token, stream.prompt_feat, stream.embedding

    def _single_graph(self, stream: Token2WavStream, plan: ChunkPlan, token: Tensor) -> GraphedFn | None:
        """The single-chunk graph a re-run of ``plan`` replays (a first chunk's is captured on
        first use), or None: it runs eagerly."""
        graph = self._flow_graph(self.in_first_lane(plan)) if token.is_cuda else None
        key = (int(stream.prompt_token.shape[1]), plan.token_len)
        if graph is not None and (plan.index == 0 or self._capturing or graph.has(key)):
            return graph
        return None

    def _as_tokens(self, tokens: Tensor | Sequence[int]) -> Tensor:
        t = to_device(tokens if isinstance(tokens, Tensor) else list(tokens), self.device, torch.int32)
        return t[None, :] if t.dim() == 1 else t

    def _chunk_tokens(self, stream: Token2WavStream, plan: ChunkPlan, tokens: Tensor | Sequence[int]) -> Tensor:
        """Check that ``plan`` can run now (no state is touched): the request's tokens [1, n]."""
        stream.schedule.check(plan)
        token = self._as_tokens(tokens)
        if token.shape[1] < plan.token_len:
            raise ValueError(f"chunk needs {plan.token_len} tokens, got {token.shape[1]}")
        return token

    @torch.inference_mode()
    def run_chunk(self, stream: Token2WavStream, plan: ChunkPlan, tokens: Tensor | Sequence[int]) -> Tensor:
        """Make the audio of ``plan`` for ``stream``: float32 (n,) on the model device.

        ``tokens``: the request's speech tokens so far, [1, n] / [n] tensor or a list; only the
        first ``plan.token_len`` are read. Advances the stream's schedule and caches.
        """
        token = self._chunk_tokens(stream, plan, tokens)
        return self._finish_chunk(stream, plan, self._flow_mel(stream, plan, token))

    def batchable(self, stream: Token2WavStream, plan: ChunkPlan) -> bool:
        """Whether :meth:`run_chunks` may compute this chunk's flow in a batched pass: a
        non-final chunk of a re-run-path stream that ends on a flow chunk boundary (not a fast
        first chunk). With grouped batching (:meth:`use_batch_buckets`) a batchable chunk that
        ends up alone in its group still takes :meth:`run_chunk`'s path."""
        if plan.finalize or plan.hop_tokens == 0 or stream.flow_path != "rerun":
            return False
        if stream.state_slot is not None and plan.index > 0:  # its own state's graph
            return False
        if not hasattr(self.flow, "inference_batch"):
            return False
        if plan.index == 0 and stream.schedule.fast_first:
            return False
        return stream.schedule.flow_end(plan) % stream.schedule.chunk_size == 0

    @torch.inference_mode()
    def run_chunks(self, pairs: Sequence[tuple[Token2WavStream, ChunkPlan, Tensor | Sequence[int]]]) -> list[Tensor]:
        """:meth:`run_chunk` for several streams at once: the audio of each, in order.

        The flow of the :meth:`batchable` chunks runs batched: without batch buckets (the
        default off CUDA) all of them in ONE ``flow.inference_batch`` call (when there are two
        or more); with buckets (``use_cuda_graphs`` on CUDA) one batched pass per group of
        chunks with the same T, graphed per (bucket, T) once captured (see
        :meth:`use_batch_buckets`). The rest go through :meth:`run_chunk`'s flow step. Each
        chunk is then finished (vocoder, cross-fade, caches, schedule) as :meth:`run_chunk`
        does. Each stream may appear once.

        Failures: a bad pair (not its stream's next chunk, too few tokens) or a failing batched
        flow pass raises before any stream is touched (every batched pass runs before any
        chunk is finished), so every chunk can be run again (alone).
        Once the flow pass is done, each chunk is finished on its own; if some fail,
        :class:`ChunkBatchError` carries the audio of those that did and the error of each
        that did not (a failed chunk leaves its stream as a failed :meth:`run_chunk` does:
        drop or reset it).
        """
        if len({id(stream) for stream, _, _ in pairs}) != len(pairs):
            raise ValueError("run_chunks: a stream appears twice")
        tokens = [self._chunk_tokens(stream, plan, tok) for stream, plan, tok in pairs]
        batch = [i for i, (stream, plan, _) in enumerate(pairs) if self.batchable(stream, plan)]
        chunks = [(stream, plan, tokens[i]) for i, (stream, plan, _) in enumerate(pairs)]
        mels = self._batched_mels(chunks, batch) if self.batch_buckets else self._eager_batch(chunks, batch)
        results: list[Tensor | None] = []
        errors: dict[int, Exception] = {}
        for i, (stream, plan, _) in enumerate(pairs):
            try:
                mel = mels.pop(i) if i in mels else self._flow_mel(stream, plan, tokens[i])
                results.append(self._finish_chunk(stream, plan, mel))
            except Exception as e:  # noqa: BLE001 - one chunk fails alone; reported below
                results.append(None)
                errors[i] = e
        if errors:
            raise ChunkBatchError(results, errors)
        return [r for r in results if r is not None]

    def _eager_batch(
        self, chunks: Sequence[tuple[Token2WavStream, ChunkPlan, Tensor]], rows: list[int]
    ) -> dict[int, Tensor]:
        """New mel frames of ``chunks[i]`` for i in ``rows``, from ONE eager
        ``flow.inference_batch`` call (right-padded to the longest); {} for fewer than 2."""
        if len(rows) < 2:
            return {}
        flow = cast(BatchFlow, self.flow)
        mels = flow.inference_batch([self._rerun_args(*chunks[i]) for i in rows])
        return {
            i: mel[:, :, MEL_FRAMES_PER_TOKEN * chunks[i][1].token_offset :].float()
            for i, mel in zip(rows, mels, strict=True)
        }

    def _batched_mels(
        self, chunks: Sequence[tuple[Token2WavStream, ChunkPlan, Tensor]], rows: list[int]
    ) -> dict[int, Tensor]:
        """Grouped batching (:meth:`use_batch_buckets`): the new mel frames of the chunks
        ``rows`` that run batched, by index; the others are left to :meth:`run_chunk`'s path.

        Rows are grouped by T (prompt + real tokens) and each group split at the largest
        bucket; a part of n >= 2 chunks runs through the (bucket, T) :class:`GraphedFn` with
        n real rows and bucket - n pad rows (a replay on CUDA; eager elsewhere or with graphs
        disabled), except while that key is not captured: capturing mid-stream would stall
        every stream, so then its chunks whose own single-chunk graph replays leave it (as
        they would alone) and the others (two or more) go in one eager
        ``flow.inference_batch``."""
        flow = cast(BatchFlow, self.flow)
        groups: dict[tuple[bool, int], list[int]] = {}  # (first-chunk lane, T) -> rows
        for i in rows:
            stream, plan, _ = chunks[i]
            groups.setdefault((self.in_first_lane(plan), stream.schedule.flow_end(plan)), []).append(i)
        top = self.batch_buckets[-1]
        mels: dict[int, Tensor] = {}
        for (first, total), group in groups.items():
            graph = self._batch_graph(first)
            assert graph is not None
            for part in (group[k : k + top] for k in range(0, len(group), top)):
                if len(part) < 2:
                    continue  # alone: run_chunk's path (its single-chunk graph)
                bucket = self._bucket(len(part))
                items = [self._rerun_args(*chunks[i]) for i in part]
                if graph.would_capture((bucket, total), *items[0]) and not self._capturing:
                    eager = [i for i in part if self._single_graph(*chunks[i]) is None]
                    mels.update(self._eager_batch(chunks, eager))
                    continue
                items += [items[0]] * (bucket - len(part))  # pad rows: copies of row 0, dropped
                ids, embedding, cond, spans = flow.batch_inputs(items)
                out = graph((bucket, total), ids, embedding, cond)  # [bucket, 80, 2T] float32
                for j, i in enumerate(part):
                    start = spans[j][0] + MEL_FRAMES_PER_TOKEN * chunks[i][1].token_offset
                    mels[i] = out[j : j + 1, :, start : spans[j][1]].float().clone()  # the graph reuses out
        return mels

    def _finish_chunk(self, stream: Token2WavStream, plan: ChunkPlan, mel: Tensor) -> Tensor:
        """Vocoder, cross-fade and caches for ``plan``'s new mel [1, 80, F]; commits the plan."""
        cache = stream.hift_cache
        if mel.shape[2] == 0 and not cache.valid:
            speech = torch.zeros(0, device=self.device)
        else:
            if cache.valid:
                mel = torch.cat([cache.mel, mel], dim=2)
            elif plan.finalize and stream.speed != 1.0:  # only a whole utterance has a speed (spec 5.6)
                mel = F.interpolate(mel, size=int(mel.shape[2] / stream.speed), mode="linear")
            source_in = cache.source if cache.valid else None
            speech_b, source = self._vocoder(mel, source_in, stream.noise, plan.finalize, self.in_first_lane(plan))
            speech = speech_b[0]  # [S F]
            n = self.cache_samples
            if cache.valid:
                faded = speech[:n].double() * self.window[:n] + cache.speech[0].double() * self.window[n:]
                speech = torch.cat([faded.to(speech.dtype), speech[n:]])
            if not plan.finalize:
                cache.mel.copy_(mel[:, :, -self.cache_frames :])
                cache.source.copy_(source[:, :, -n:])
                cache.speech.copy_(speech[None, -n:])
                cache.valid = True
                speech = speech[:-n]
            else:
                cache.valid = False
        if plan.finalize:
            self.release_state(stream)
        stream.schedule.commit(plan)
        stream.chunk_log.append(plan)
        stream.samples_emitted += int(speech.shape[0])
        return speech

    def _vocoder(
        self, mel: Tensor, source: Tensor | None, noise: torch.Generator | None, final: bool, first_lane: bool = False
    ) -> tuple[Tensor, Tensor]:
        """HiFT, from a graph per mel length for deterministic calls (a final call only at a
        length start-up captured, ``capture_final_vocoder``; a first-chunk lane call from that
        lane's graphs). The speech is a tensor of its own; from a graph the source is its output
        buffer, valid until the next call: read at once."""
        graph = self._graph_hift if source is None else self._graph_hift_cached
        if first_lane and self._first_lane is not None:  # a first chunk: no overlap cache
            graph = self._first_lane.hift
        if graph is None or noise is not None or not mel.is_cuda:
            return self.hift(mel, source, noise)
        key = int(mel.shape[2])
        if final and not (self._capturing or graph.has(key)):
            # a final length start-up did not capture: capturing now would stall every stream
            return self.hift(mel, source, noise)
        args = (mel.contiguous(),) if source is None else (mel.contiguous(), source)
        speech, src = graph(key, *args)
        return speech.clone(), src  # the caller copies the source's tail into its cache now

    # -- conveniences --------------------------------------------------------------------------

    def stream_all(self, stream: Token2WavStream, tokens: Tensor | Sequence[int]) -> Iterator[Tensor]:
        """All chunks of a request whose tokens are all known (tests, offline use)."""
        n = int(self._as_tokens(tokens).shape[1])
        while (plan := stream.ready_chunk(n, llm_finished=True)) is not None:
            yield stream.run_chunk(plan, tokens)

    @torch.inference_mode()
    def synthesize(
        self,
        tokens: Tensor | Sequence[int],
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        *,
        speed: float = 1.0,
        noise: torch.Generator | None = None,
    ) -> Tensor:
        """Non-streaming: one full-attention flow pass and one HiFT pass, float32 (n,).

        ``speed`` != 1 resamples the mel in time (linear) to int(T / speed) frames: faster
        speech at the same pitch.
        """
        token = self._as_tokens(tokens)
        mel = self.flow.inference(token, prompt_token, prompt_feat, embedding, streaming=False, finalize=True)
        return self.vocode(mel, speed=speed, noise=noise)

    @torch.inference_mode()
    def vocode(self, mel: Tensor, *, speed: float = 1.0, noise: torch.Generator | None = None) -> Tensor:
        """One HiFT pass over a whole mel [1, 80, T] (no caches): float32 (n,).

        ``speed`` != 1 first resamples the mel to int(T / speed) frames (linear,
        align_corners=False), as upstream's non-streaming ``speed``.
        """
        if speed <= 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        mel = mel.float()
        if speed != 1.0:
            mel = F.interpolate(mel, size=int(mel.shape[2] / speed), mode="linear")
        speech, _ = self.hift(mel, None, noise)
        return speech[0]
