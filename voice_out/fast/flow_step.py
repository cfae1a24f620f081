"""Token2wav's fast paths, applied to the eager :class:`~voice_out.model.token2wav.Token2Wav`.

:class:`FastToken2Wav` is the eager token2wav (same constructor, same streams, same audio) with
these on top; the engine builds it, tests compare it with the eager one:

- CUDA graphs (``FastToken2Wav.use_cuda_graphs(True)``): a non-final re-run flow call of one
  stream is ONE captured graph, keyed by (prompt length, tokens so far): the schedule makes
  only a few lengths per prompt length (25 + pad, then 50 and 100 more each time), and one graph
  serves every voice of that prompt length. First chunks, which decide time to first audio,
  replay it (captured on first use); other lengths replay it once
  :meth:`FastToken2Wav.capture_stream_shapes` has captured them at start-up, and run eagerly
  until then (a capture mid-stream would stall every stream). Every non-final vocoder call
  replays a graph per mel length. Graph outputs equal the eager ones
  (tests/test_token2wav_graphs.py).
- Grouped batched chunks (:meth:`FastToken2Wav.use_batch_buckets`): with graphs, the chunks of a
  :meth:`~voice_out.model.token2wav.Token2Wav.run_chunks` call are grouped by T = prompt + real
  tokens (one pass per distinct T, no length padding); a group of n >= 2 is padded with copies
  of its first row to the smallest of ``CHUNK_BATCH_BUCKETS`` (2, 4, 8) >= n (larger groups
  split at 8) and replays a graph of ``Flow.batch_core`` keyed by (bucket, T). A key depends on
  T only, so it serves every prompt length whose chunks end there.
  :meth:`FastToken2Wav.capture_stream_shapes` captures the keys of a prompt length's schedule at
  start-up (the engine: its default voice, for steps of up to its ``max_chunks_per_step``
  chunks); an uncaptured key is never captured mid-stream: those of its chunks whose own
  single-chunk graph replays take it, the others run in one eager batch. A group of one takes
  the single-chunk path. A full-size re-run chunk is launch-bound, so a batch of B rows is
  expected to cost far less than B single replays.
- The first-chunk lane (``use_cuda_graphs(first_lane=True)``): non-final first chunks replay
  graphs of their own, so the runner may run them on a second CUDA stream beside the others.
- Prefix slots: first chunks from a voice's prompt prefix replay a graph per prefix length
  whose buffers hold the prefix of the voice last loaded.
- State slots (:meth:`FastToken2Wav.use_state_slots`): flow states that streams hold while
  their later chunks extend them (``Flow.state_core``), one graph per chunk length.

GPU worker thread only, as the eager token2wav.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from voice_out.fast.graphs import GraphedFn
from voice_out.model.token2wav import (
    CHUNK_TOKENS,
    LOOKAHEAD_TOKENS,
    MEL_FRAMES_PER_TOKEN,
    Chunk,
    FlowInference,
    Token2Wav,
    Token2WavStream,
)

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


@dataclass(frozen=True)
class StreamShapes:
    """The chunks that streams of one prompt length make, from the engine's chunk schedule
    (which the fast path does not import): what start-up captures for them.

    ``plans(n, state)``: the chunks of an utterance of ``n`` speech tokens, all known (``state``:
    of a stream on a state slot, whose hops the scheduler grows: ``HopPolicy.on_state``).
    ``first_tokens``: the tokens a first non-final chunk needs (its hop + look-ahead): a
    shorter utterance is one final chunk without an overlap cache. ``final_tokens``: the
    most tokens a final chunk after the first takes, plus one (the largest hop + look-ahead)."""

    plans: Callable[[int, bool], Sequence[Chunk]]
    first_tokens: int
    final_tokens: int


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
    """A flow state of one stream's own, under CUDA graphs (``FastToken2Wav.use_state_slots``): a
    flow stream cache of ``capacity`` tokens (prompt included) that a stream holds while its
    later chunks extend it, the graphs of ``Flow.state_core`` over it, one per chunk length in
    mel frames, and those of its encoder part (``Flow.state_mu``), one per ``Flow.StateKey``
    (the chunk's position: ``key``, the one being run). ``owner``: the stream holding it, or
    None; ``started``: whether the owner's state was set up (its voice's prompt prefix copied
    in, at its first chunk here); ``captured``: the (prompt, prefix, chunks) whose chunks
    start-up ran through it."""

    cache: Any
    graph: GraphedFn
    encoder: GraphedFn | None = None
    key: Any = None
    owner: Token2WavStream | None = None
    started: bool = False
    captured: set[tuple[Any, ...]] = field(default_factory=set)


class FastToken2Wav(Token2Wav):
    """The eager :class:`~voice_out.model.token2wav.Token2Wav` with its fast paths (see the
    module docstring); off (the default) it is the eager one. Holds no per-request state
    beyond the slots a stream borrows; GPU worker thread only."""

    def __init__(self, flow: FlowInference, hift: Any, *, device: torch.device | str | None = None) -> None:
        super().__init__(flow, hift, device=device)
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
        """Replay non-final flow calls (every re-run chunk, first chunks from a prompt prefix)
        and non-final vocoder calls from CUDA graphs (CUDA only; a no-op on the
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
        if self.full_flow is not None:
            self._graph_flow_final = GraphedFn(
                self.full_flow.final_core,
                name="flow.final_chunk",
                warmup=1,
                warmup_each=False,
                pool=self._flow_pool,
                family=GRAPH_FAMILY,
            )
        self.use_batch_buckets(batch_buckets if self.full_flow is not None else ())

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
            core = self._full_flow().batch_core

            def batched(name: str, pool: Any, family: str) -> GraphedFn:
                # warm-up 1: the single-chunk graphs and the eager passes have run these kernels
                return GraphedFn(core, name=name, warmup=1, warmup_each=False, pool=pool, family=family)

            self._graph_flow_batch = batched("flow.batch_chunks", self._flow_pool, GRAPH_FAMILY)
            if lane is not None:
                lane.batch = batched("flow.batch_first_chunks", lane.pool, FIRST_GRAPH_FAMILY)

    @property
    def has_state_path(self) -> bool:
        """Whether the flow extends a stream's own state in fixed shapes (``Flow.state_core``):
        the real flow, not a stand-in with ``inference`` alone."""
        return self.full_flow is not None

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
        flow = self._full_flow()
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
        if stream.state_slot is not None or stream.first_prefix is None:
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

    def in_first_lane(self, plan: Chunk) -> bool:
        """Whether ``plan`` replays the first-chunk lane's graphs: a non-final first chunk
        (``Chunk.starts_audio``) while the lane is on (``use_cuda_graphs(first_lane=True)``).
        A caller running two :meth:`run_chunks` calls at once (on two CUDA streams) must keep
        these chunks and the others apart."""
        return self._first_lane is not None and plan.starts_audio

    def _flow_graph(self, first_lane: bool) -> GraphedFn | None:
        """The single-chunk re-run flow graph of a chunk of the first-chunk lane or not."""
        return self._first_lane.flow if first_lane and self._first_lane is not None else self._graph_flow

    def _batch_graph(self, first_lane: bool) -> GraphedFn | None:
        """The batched-chunk flow graph of a group of chunks of the first-chunk lane or not."""
        return self._first_lane.batch if first_lane and self._first_lane is not None else self._graph_flow_batch

    def batch_keys(self, plans: Sequence[Chunk], prompt_tokens: int, max_batch: int) -> list[tuple[bool, int, int]]:
        """The (first lane, bucket, T) keys of the grouped batched chunks that streams of this
        prompt length meet in ``plans`` (an utterance's chunks), in groups of at most
        ``max_batch`` chunks: every bucket a group of 2 .. ``max_batch`` uses, for the T (prompt
        + real tokens) of every batchable non-final chunk, with whether the chunk is the
        first-chunk lane's (:meth:`in_first_lane`). No tensor work."""
        if not self.batch_buckets or max_batch < 2:
            return []
        buckets = sorted({self._bucket(n) for n in range(2, min(max_batch, self.batch_buckets[-1]) + 1)})
        lengths = [
            (self.in_first_lane(plan), prompt_tokens + plan.token_len - LOOKAHEAD_TOKENS)
            for plan in plans
            if not plan.finalize
        ]
        return [(first, b, t) for first, t in lengths if t % CHUNK_TOKENS == 0 for b in buckets]

    def _bucket(self, n: int) -> int:
        """The smallest batch bucket that holds ``n`` rows (``n`` <= the largest bucket)."""
        return next(b for b in self.batch_buckets if b >= n)

    def capture_stream_shapes(
        self,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        n_tokens: int,
        shapes: StreamShapes,
        *,
        max_batch: int = 1,
        batch_tokens: int | None = None,
        first_prefix: Any = None,
        final_vocoder: bool = True,
    ) -> int:
        """Capture now (start-up) the graphs a stream of this prompt length meets in its first
        ``n_tokens`` speech tokens (:meth:`iter_capture_stream_shapes`, run to its end). Returns
        the number of graphs held."""
        for _ in self.iter_capture_stream_shapes(
            prompt_token,
            prompt_feat,
            embedding,
            n_tokens,
            shapes,
            max_batch=max_batch,
            batch_tokens=batch_tokens,
            first_prefix=first_prefix,
            final_vocoder=final_vocoder,
        ):
            pass
        return self.graphs_held()

    @torch.inference_mode()
    def iter_capture_stream_shapes(
        self,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        n_tokens: int,
        shapes: StreamShapes,
        *,
        max_batch: int = 1,
        batch_tokens: int | None = None,
        first_prefix: Any = None,
        final_vocoder: bool = True,
    ) -> Iterator[None]:
        """Capture the graphs a stream of this prompt length meets in its first ``n_tokens``
        speech tokens (its chunks: ``shapes``), instead of mid-stream: its single-chunk flow
        graphs (with ``first_prefix``, a voice's :meth:`prepare_prefix`: the first chunk's from
        it too), the state slots' graphs, final chunk graphs (:meth:`final_total`) and vocoder
        graphs, and (``max_batch`` >= 2, grouped batching on) the batched-chunk graphs of
        :meth:`batch_keys` for groups of up to ``max_batch`` chunks within the first
        ``batch_tokens`` (None: ``n_tokens``; a batched key depends on T only, so it serves
        every prompt length whose chunks end at the same T; the long ones are the costliest to
        capture: B rows of a whole utterance each), and with ``final_vocoder`` the vocoder of
        every final chunk length (:meth:`iter_capture_final_vocoder`; the engine captures those
        beside the kernel compiles and after ready). What is captured already is skipped.

        Yields after each placeholder chunk and each capture (~30 to 300 ms of work at full
        size), with no capture pending: the engine's worker serves streams between two steps
        (start-up's captures past the first chunks go on after the engine is ready). A stream
        that meets a shape not captured yet runs it eagerly. Worker thread only."""
        if self._graph_flow is None:
            return
        stream = self.open_stream(prompt_token, prompt_feat, embedding, first_prefix=first_prefix)
        self.release_state(stream)  # the re-run path's chunks here; the state slots' below
        # placeholder speech ids; the extra chunk's worth covers a final chunk rounded up
        dummy = [(7 * i + 1) % 6561 for i in range(n_tokens + CHUNK_TOKENS)]
        n_run = min(n_tokens, STREAM_CAPTURE_TOKENS)
        yield from self._run_capturing(stream, dummy[:n_run], shapes.plans(n_run, False))
        yield from self._capture_state_slots(stream, dummy[:n_tokens], shapes.plans(n_tokens, True))
        prompt_token, prompt_feat = prompt_token.to(self.device), prompt_feat.to(self.device)
        embedding = embedding.to(self.device)
        n_prompt = int(prompt_token.shape[1])
        for plan in shapes.plans(n_tokens, False):  # the longer utterances' chunks
            key = (n_prompt, plan.token_len)
            single = self._flow_graph(self.in_first_lane(plan))
            if plan.finalize or single is None or single.has(key):
                continue
            token = self._as_tokens(dummy[: plan.token_len])
            single.capture(key, token, prompt_token, prompt_feat, embedding, warmup=0)
            yield
        n_batched = n_tokens if batch_tokens is None else min(n_tokens, batch_tokens)
        keys = self.batch_keys(shapes.plans(n_batched, False), n_prompt, max_batch)
        for first, bucket, total in keys:
            graph = self._batch_graph(first)
            assert graph is not None
            if graph.has((bucket, total)):
                continue
            token = self._as_tokens(dummy[: total - n_prompt + LOOKAHEAD_TOKENS])
            ids, emb, cond, _ = self._full_flow().batch_inputs([(token, prompt_token, prompt_feat, embedding)] * bucket)
            graph.capture((bucket, total), ids, emb, cond)
            yield
        final = self._graph_flow_final
        if final is not None:  # the final chunk of an utterance ending anywhere in n_tokens
            totals = sorted({self.final_total(n_prompt + n) for n in range(1, n_tokens + 1)})
            for total in totals:
                if final.has(total):
                    continue
                token = self._as_tokens(dummy[: total - n_prompt])
                ids, n_valid, emb, cond, _ = self._full_flow().final_inputs(
                    [(token, prompt_token, prompt_feat, embedding)], total
                )
                final.capture(total, ids, n_valid, emb, cond)
                yield
        if final_vocoder:
            yield from self.iter_capture_final_vocoder(shapes)

    def graphs_held(self) -> int:
        """The token2wav graphs captured so far, of every family."""
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

    def _run_capturing(self, stream: Token2WavStream, tokens: Sequence[int], plans: Sequence[Chunk]) -> Iterator[None]:
        """Run ``plans`` of the placeholder ``stream``, capturing every non-final shape it meets;
        yields after each chunk, with capturing off (a real stream served meanwhile captures
        nothing on its own)."""
        chunks = self.stream_all(stream, tokens, plans)
        while True:
            self._capturing = True
            try:
                done = next(chunks, None) is None
            finally:
                self._capturing = False
            if done:
                return
            yield

    def _capture_state_slots(
        self, like: Token2WavStream, dummy: Sequence[int], plans: Sequence[Chunk]
    ) -> Iterator[None]:
        """Capture every state slot's graphs of the chunks ``plans`` that a stream like
        ``like`` (its voice) makes on a slot over ``dummy``'s tokens (the hops of a stream on a
        slot: ``HopPolicy.on_state``): the estimator's per chunk length, the encoder's per chunk
        position, by running a placeholder stream through each slot that has not run them
        (yielding after each chunk; the slot is the placeholder's until it ends, so streams
        served meanwhile re-run instead). The slots' contents are placeholders after this: a
        stream's first chunk on a slot sets it up afresh."""
        prompt = like.first_prefix
        if prompt is None or not self._state_slots:
            return
        done = (int(prompt.n_prompt), int(prompt.n_prefix), tuple(plans))
        for slot in self._state_slots:
            if slot.owner is not None or done in slot.captured:
                continue
            stream = self.open_stream(like.prompt_token, like.prompt_feat, like.embedding, first_prefix=prompt)
            self.release_state(stream)
            self._acquire_state(stream, slot)
            try:
                yield from self._run_capturing(stream, dummy, plans)
            finally:
                self.release_state(stream)
            slot.captured.add(done)

    @torch.inference_mode()
    def iter_capture_final_vocoder(self, shapes: StreamShapes) -> Iterator[None]:
        """Capture the vocoder of every final chunk a stream of ``shapes`` (a voice's prompt
        length, the engine's hops) can end with, yielding after each capture (~70 ms at full
        size: a length's cuDNN and cuFFT set-up); what is captured already is skipped. It needs
        none of the flow's kernels: the engine captures these while they compile, the rest
        after ready.

        A final chunk's mel has a length of its own: the tokens left after the last chunk, fewer
        than a hop plus the lookahead (so 0 .. ``shapes.final_tokens`` - 1 new tokens after the
        cached frames), or, for an utterance shorter than its first chunk, 1 ..
        ``shapes.first_tokens`` - 1 tokens and no cache. HiFT's convolutions look ahead, so a padded
        length would change the tail: one graph per length (eager was ~40 ms of launches)."""
        fresh, cached = self._graph_hift, self._graph_hift_cached
        if fresh is None or cached is None:
            return
        per = MEL_FRAMES_PER_TOKEN
        mels = self.hift.dims.in_channels
        source = torch.zeros(1, 1, self.cache_samples, device=self.device)  # HiFTCache.source
        for k in range(1, shapes.first_tokens):
            if not fresh.has(per * k):
                fresh.capture(per * k, torch.zeros(1, mels, per * k, device=self.device))
                yield
        for k in range(shapes.final_tokens):
            n = self.cache_frames + per * k
            if not cached.has(n):
                cached.capture(n, torch.zeros(1, mels, n, device=self.device), source)
                yield

    @torch.inference_mode()
    def prepare_flow(self, stream: Token2WavStream) -> None:
        """The eager set-up (:meth:`Token2Wav.prepare_flow`), and a free state slot
        (:meth:`use_state_slots`) for a re-run-path stream whose voice has a prompt prefix."""
        if not stream.whole:  # a whole stream makes one final chunk: no state to extend
            self._acquire_state(stream)
        super().prepare_flow(stream)

    def _flow_mel(self, stream: Token2WavStream, plan: Chunk, token: Tensor) -> Tensor:
        """A later non-final chunk of a stream holding a state slot extends it
        (:meth:`_state_chunk`); every other chunk, or one that leaves its slot, as the eager
        token2wav makes it (with the graphs of the overrides below)."""
        if stream.state_slot is not None and plan.index > 0 and not plan.finalize and plan.hop_tokens > 0:
            mel = self._state_chunk(stream, plan, token)
            if mel is not None:
                return mel
        return super()._flow_mel(stream, plan, token)

    def _rerun_chunk(self, stream: Token2WavStream, plan: Chunk, token: Tensor) -> Tensor:
        """A non-final chunk by upstream's re-run (prompt + tokens so far, chunk-causal): the new
        frames, float32 [1, 80, 2 * hop_tokens]. From a graph per (prompt length, tokens so far)
        for first chunks and for lengths start-up captured (``capture_stream_shapes``);
        capturing any other length here would stall every stream, so those run eagerly."""
        graph = self._single_graph(stream, plan, token)
        if graph is None:
            return super()._rerun_chunk(stream, plan, token)
        args = self._rerun_args(stream, plan, token)
        start = MEL_FRAMES_PER_TOKEN * plan.token_offset
        key = (int(stream.prompt_token.shape[1]), plan.token_len)
        return graph(key, *args)[:, :, start:].float().clone()  # the graph reuses its output

    def _prefix_chunk(self, stream: Token2WavStream, plan: Chunk, token: Tensor) -> Tensor:
        """A non-final first chunk from the voice's prompt prefix (``Flow.prefix_core``): its
        new frames, float32 [1, 80, 2 * hop_tokens], as :meth:`_rerun_chunk` gives them but
        without the prefix's frames in the estimator calls. Under CUDA graphs it replays a
        graph per (prompt length, tokens so far) of its prefix length's slot (captured on first
        use, as first chunks are), whose buffers take the voice's prefix first if another
        voice's is there."""
        if self._graph_flow is None or not token.is_cuda:
            return super()._prefix_chunk(stream, plan, token)
        flow = self._full_flow()
        prompt = stream.first_prefix
        ids, emb, cond = flow.prefix_inputs(token[:, : plan.token_len], prompt)
        # the prompt's frames after the prefix come first, then the tokens' (from token_offset)
        start = MEL_FRAMES_PER_TOKEN * (prompt.n_prompt - prompt.n_prefix + plan.token_offset)
        slot = self._prefix_slot(prompt)
        if slot.voice is not prompt:
            slot.state.copy_prefix_(prompt.prefix, prompt.n_prefix, MEL_FRAMES_PER_TOKEN)
            slot.voice = prompt
        key = (prompt.n_prompt, plan.token_len)
        return slot.graph(key, ids, emb, cond)[:, :, start:].float().clone()  # the graph reuses its output

    @staticmethod
    def _state_frames(stream: Token2WavStream, plan: Chunk) -> int:
        """The mel frames a later non-final ``plan`` of ``stream`` computes on its state slot:
        those since the state's last boundary (the first time, since its voice's prompt
        prefix: the prompt's tail, the first chunk's tokens and this one's)."""
        slot = stream.state_slot
        done = slot.cache.n_done if slot is not None and slot.started else stream.first_prefix.n_prefix
        return MEL_FRAMES_PER_TOKEN * (stream.flow_end(plan) - done)

    def _state_chunk(self, stream: Token2WavStream, plan: Chunk, token: Tensor) -> Tensor | None:
        """A later non-final chunk on the stream's state slot: its new frames, float32 [1, 80,
        2 * hop_tokens], as :meth:`_rerun_chunk` gives them. The encoder runs over the new tokens
        from the slot's graph of this position (eagerly at a position start-up did not reach),
        the estimator calls from its graph of this length. None when the stream leaves its
        slot instead (the chunk would not fit, or its length has no graph outside start-up):
        the caller re-runs it, and every chunk after it."""
        slot = stream.state_slot
        assert slot is not None
        frames = self._state_frames(stream, plan)
        end = stream.flow_end(plan)
        fits = end <= slot.cache.capacity  # the tokens it keeps (Flow.state_inputs)
        graphed = token.is_cuda and (self._capturing or slot.graph.has(frames))
        if end % CHUNK_TOKENS or not fits or (self._graph_flow is not None and not graphed):
            self.release_state(stream)
            return None
        flow = self._full_flow()
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
            flow = self._full_flow()
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

    def _final_chunk(self, stream: Token2WavStream, plan: Chunk, token: Tensor) -> Tensor:
        """The final chunk (full attention over prompt + every token): its new frames, float32
        [1, 80, 2 * hop_tokens]. From the graph of ``flow.final_core`` over the tokens right-
        padded to the next multiple of the flow chunk (T = prompt + tokens rounded up; padding
        is masked, so it is exact) when start-up captured that T, else eagerly: every utterance
        ends at its own length, so a capture here would stall every stream."""
        graph = self._graph_flow_final if token.is_cuda else None
        total = self.final_total(stream.prompt_tokens + plan.token_len)
        if graph is None or not (self._capturing or graph.has(total)):
            return super()._final_chunk(stream, plan, token)
        args = self._rerun_args(stream, plan, token)
        start = MEL_FRAMES_PER_TOKEN * plan.token_offset
        ids, n_valid, emb, cond, spans = self._full_flow().final_inputs([args], total)
        lo, hi = spans[0]
        return graph(total, ids, n_valid, emb, cond)[:, :, lo + start : hi].float().clone()

    @staticmethod
    def final_total(n_tokens: int) -> int:
        """The padded length (prompt + tokens, ``n_tokens`` of them real) of a final chunk's pass,
        its graph's key: a whole flow chunk up to ``FINAL_FINE_TOKENS``, then a multiple of
        ``FINAL_COARSE_CHUNKS`` chunks."""
        fine = -(-n_tokens // CHUNK_TOKENS) * CHUNK_TOKENS
        if fine <= FINAL_FINE_TOKENS:
            return fine
        coarse = CHUNK_TOKENS * FINAL_COARSE_CHUNKS
        return -(-n_tokens // coarse) * coarse

    def _single_graph(self, stream: Token2WavStream, plan: Chunk, token: Tensor) -> GraphedFn | None:
        """The single-chunk graph a re-run of ``plan`` replays (a first chunk's is captured on
        first use), or None: it runs eagerly."""
        graph = self._flow_graph(self.in_first_lane(plan)) if token.is_cuda else None
        key = (int(stream.prompt_token.shape[1]), plan.token_len)
        if graph is not None and (plan.index == 0 or self._capturing or graph.has(key)):
            return graph
        return None

    def batchable(self, stream: Token2WavStream, plan: Chunk) -> bool:
        """As :meth:`Token2Wav.batchable`, except a later chunk on a state slot (its own
        state's graph). With grouped batching (:meth:`use_batch_buckets`) a batchable chunk
        that ends up alone in its group still takes :meth:`run_chunk`'s path."""
        if stream.state_slot is not None and plan.index > 0:
            return False
        return super().batchable(stream, plan)

    def _batch_mels(
        self, chunks: Sequence[tuple[Token2WavStream, Chunk, Tensor]], rows: list[int]
    ) -> dict[int, Tensor]:
        """Grouped batching when batch buckets are set (:meth:`_batched_mels`), else the eager
        token2wav's one padded pass."""
        if self.batch_buckets:
            return self._batched_mels(chunks, rows)
        return super()._batch_mels(chunks, rows)

    def _batched_mels(
        self, chunks: Sequence[tuple[Token2WavStream, Chunk, Tensor]], rows: list[int]
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
        flow = self._full_flow()
        groups: dict[tuple[bool, int], list[int]] = {}  # (first-chunk lane, T) -> rows
        for i in rows:
            stream, plan, _ = chunks[i]
            groups.setdefault((self.in_first_lane(plan), stream.flow_end(plan)), []).append(i)
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

    def _vocoder(
        self, mel: Tensor, source: Tensor | None, noise: torch.Generator | None, plan: Chunk
    ) -> tuple[Tensor, Tensor]:
        """HiFT, from a graph per mel length for deterministic calls (a final call only at a
        length start-up captured, ``iter_capture_final_vocoder``; a first-chunk lane call from that
        lane's graphs). The speech is a tensor of its own; from a graph the source is its output
        buffer, valid until the next call: read at once."""
        graph = self._graph_hift if source is None else self._graph_hift_cached
        if self.in_first_lane(plan) and self._first_lane is not None:  # a first chunk: no overlap cache
            graph = self._first_lane.hift
        if graph is None or noise is not None or not mel.is_cuda:
            return super()._vocoder(mel, source, noise, plan)
        key = int(mel.shape[2])
        if plan.finalize and not (self._capturing or graph.has(key)):
            # a final length start-up did not capture: capturing now would stall every stream
            return super()._vocoder(mel, source, noise, plan)
        args = (mel.contiguous(),) if source is None else (mel.contiguous(), source)
        speech, src = graph(key, *args)
        return speech.clone(), src  # the caller copies the source's tail into its cache now
