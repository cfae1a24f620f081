"""The GPU side of the engine: executes a :class:`~voice_out.engine.scheduler.StepPlan`.

The runner owns the model, the static KV cache, each admitted request's sampling counter and
token2wav stream. It never decides policy: it resets the slots it is told to, feeds
each LLM work item its inputs (ONE batched decode step for all of them: a row per single-row
input, a run of rows per multi-row input such as a text group; a voice prefix is copied in,
and what does not fit the step is prefilled per slot), samples every input's last row at
once with each request's own counter uniforms, applies forced tokens, and runs the token2wav
chunks in the order given (the flow of several streams' chunks in one batched call,
``Token2Wav.run_chunks``), on CUDA on a second stream alongside the LLM step (and, with
``pipeline_vocode``, without waiting for them: their audio comes back in a later step's
result).
Failures are reported per request in the :class:`StepResult`; an exception escaping
:meth:`Runner.execute` means the whole step failed (the worker fails the step's requests).

GPU worker thread only: every method, the constructor excepted.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import numpy as np
import torch
from torch import Tensor

from voice_out.engine.chunk_schedule import ChunkPlan, HopPolicy, plan_all
from voice_out.engine.request import FlowVoice
from voice_out.engine.scheduler import Admit, LlmWork, Release, StepPlan, StepResult, VocodeWork
from voice_out.fast.flow_step import FastToken2Wav, StreamShapes
from voice_out.fast.graphs import family_stream
from voice_out.fast.llm_step import GraphedLLM, PendingIds, pack_decode_rows
from voice_out.model.llm import KVCache, SpeechLM
from voice_out.model.sampling import NO_TOKEN, SamplingParams, counter_uniforms, ras_sample_batch
from voice_out.model.token2wav import ChunkBatchError, Token2WavStream
from voice_out.model.transfer import to_device
from voice_out.text.rows import SOS, Row, RowKind, text_rows

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")

#: Voices whose device tensors the runner keeps (a re-registered voice is a new entry).
VOICE_CACHE_SIZE = 32
#: ``family_stream`` names of the side stream token2wav runs on, of the first-chunk lane's
#: stream (``FastToken2Wav.in_first_lane``) and of the runner's own stream.
SIDE_STREAM_FAMILY = "vocode"
FIRST_STREAM_FAMILY = "vocode.first"
MAIN_STREAM_FAMILY = "steps"
#: Attention window granularity of the warm-up's eager decode (positions).
KV_WINDOW_STEP = 256
#: The uniforms of a row whose draw is not used (a run's inner rows).
_IDLE_UNIFORMS = np.full(2, 0.5)
#: ``next``'s default for deferred work that has ended.
_DONE = object()


class FaultHook(Protocol):
    """Test hook: called as ``hook(request_id, phase)`` before each per-request operation
    (phase ``"admit"``, ``"llm"`` or ``"vocode"``); raising fails that request only."""

    def __call__(self, request_id: str, phase: str) -> None: ...


@dataclass
class _Inflight:
    """Chunks launched on a token2wav stream: (request id, pinned host buffer their audio is
    being copied into), the event recorded after the copies, and the stream."""

    audio: list[tuple[str, Tensor]]
    done: torch.cuda.Event
    stream: torch.cuda.Stream


@dataclass
class _Run:
    """One request's rows in a decode launch: ``rows`` (kind, id) appended to ``slot`` from
    position ``start``; the last row samples with EOS ``masked``, repetition ``window`` and the
    request's draw number ``draw``. ``fed``: one speech row whose id, and the window's last,
    are the slot's last sampled id on the device (placeholders here). ``guess``: a guessed
    next step (``LlmWork.guess``), launched ahead."""

    request_id: str
    slot: int
    start: int
    rows: list[tuple[int, int]]
    fed: bool
    masked: bool
    window: tuple[int, ...]
    draw: int
    guess: bool = False


@dataclass
class _Ahead:
    """A guessed next step already launched (``LlmWork.guess``): its run, and where its id
    comes back (``pending``, row ``index``). ``after``: the token of the step it follows, once
    the runner has it (a fed row's id)."""

    run: _Run
    pending: PendingIds
    index: int
    after: int | None = None


@dataclass
class _Live:
    """A request the runner holds: its KV slot, its sampling seed and the number of draws made
    (the counter of :func:`voice_out.model.sampling.counter_uniforms`), its token2wav stream."""

    slot: int | None
    seed: int
    t2w: Token2WavStream
    draws: int = 0


def _on_main_stream(method: Callable[Concatenate[Runner, P], R]) -> Callable[Concatenate[Runner, P], R]:
    """A runner entry point that runs its CUDA work on the runner's own stream (one stream: its
    admissions, resets and LLM steps stay in order; ``Runner.llm_stream_priority``)."""

    @functools.wraps(method)
    def on_stream(self: Runner, *args: P.args, **kwargs: P.kwargs) -> R:
        if self._main_stream is None:
            return method(self, *args, **kwargs)
        with torch.cuda.stream(self._main_stream):
            return method(self, *args, **kwargs)

    return on_stream


class Runner:
    """Owns the model, the KV cache and per-request GPU state (see the module docstring)."""

    #: Run a step's token2wav chunks through ``Token2Wav.run_chunks``: the flow of the
    #: non-final re-run chunks batched (eager: one padded pass; CUDA graphs: one graph replay
    #: per group of chunks ending at the same length), the same audio within float rounding;
    #: False: one ``run_chunk`` per chunk, bit-identical to a stream running alone.
    batch_chunks: bool = True
    #: CUDA: the priority of the stream the runner's own work (LLM steps, admissions) runs on;
    #: token2wav's side stream has the default (0). Higher (-1): when both streams have work,
    #: the GPU starts the LLM step's small kernels first, so a step's latency does not grow
    #: with the flow batch running beside it. None: the calling thread's current stream.
    llm_stream_priority: int | None = -1
    #: CUDA: the priority of the first-chunk lane's stream (``FastToken2Wav.in_first_lane``); the
    #: other chunks' side stream has 0. At -1 one first chunk beside a batch of 8 later ones
    #: took 54 ms on an H100 (100 ms at 0, 26 ms alone), but in the engine the 16-stream first
    #: audio was as fast at 0, and at -1 the later chunks it held back made a few 48-stream
    #: listeners wait (docs/benchmarks.md, seventh round).
    first_lane_priority: int = 0
    #: Voice prefixes whose K/V the runner keeps (least recently used dropped; ~2.5 MB each for
    #: a 200-row prompt of the 0.5B model), and the fewest rows worth keeping (below it a
    #: prefill costs about what the copy does).
    prefix_cache_size: int = 32
    min_prefix_rows: int = 16

    def __init__(
        self,
        llm: SpeechLM,
        t2w: FastToken2Wav,
        *,
        n_slots: int,
        max_len: int,
        sampling: SamplingParams | None = None,
        hops: HopPolicy | None = None,
        fast_first: int = 0,
        fault_hook: FaultHook | None = None,
        graphs: bool = False,
        graph_buckets: Sequence[int] = (1, 2, 4, 8, 16, 32, 48, 64),
        pipeline_vocode: bool = True,
        fused_decode: bool = True,
        fused_linear: bool = True,
        dependent_launch: bool = True,
        batched_input_rows: int = 128,
        prefix_voices: int = 0,
    ) -> None:
        self.llm = llm
        #: Most voices whose first chunks are computed from their prompt prefix
        #: (:meth:`prepare_first_prefix`, start-up; the plan's ``first_chunk_prefix_voices``).
        self.prefix_voices = prefix_voices
        #: CUDA: launch a step's token2wav chunks on the side stream and return their audio in
        #: a later step, once done (``StepResult.inflight`` meanwhile), so LLM steps go on while
        #: the flow runs; the worker's launch policy launches no new chunk on their lane until
        #: they are back (the plan's ``pipeline_vocode``). False: every step waits for its own chunks (they still
        #: overlap that step's LLM work on the side stream).
        self.pipeline_vocode = pipeline_vocode
        self.t2w = t2w
        self.device = llm.llm_decoder.weight.device
        self.sampling = sampling or SamplingParams()
        self.hops = hops or HopPolicy()
        self.fast_first = fast_first
        self.fault_hook = fault_hook
        self.batched_input_rows = batched_input_rows
        # one extra slot takes the writes of idle rows (a graph bucket's padding)
        self.cache = KVCache.allocate(llm.dims, n_slots + 1, max_len, self.device, llm.llm_decoder.weight.dtype)
        # a step's rows: one per decoding stream, plus the multi-row inputs that ride along
        top = n_slots + batched_input_rows
        buckets = [b for b in graph_buckets if b < top] + [top]
        #: The LLM steps: CUDA graphs with ``graphs``, else the same code eagerly.
        self.graphed = GraphedLLM(
            llm,
            self.cache,
            self.sampling,
            decode_buckets=buckets,
            scratch_slot=n_slots,
            fused=fused_decode,
            fused_linear=fused_linear,
            dependent_launch=dependent_launch,
            enabled=graphs,
        )
        #: CUDA: the stream token2wav runs on while the LLM steps run on the runner's own one
        #: (``llm_stream_priority``). A family stream: no graph was captured on it, so its eager
        #: GEMMs have a cuBLAS workspace of their own (``voice_out.fast.graphs``).
        self._side_stream = family_stream(SIDE_STREAM_FAMILY, self.device) if self.device.type == "cuda" else None
        #: CUDA, when token2wav has the first-chunk lane's graphs (``use_cuda_graphs(first_lane=
        #: True)``, before the runner is built): the stream of that lane's chunks
        #: (``FastToken2Wav.in_first_lane``), a family stream of its own like the side stream. None
        #: otherwise, so settling and admissions wait on no idle stream.
        self._first_stream: torch.cuda.Stream | None = None
        if self._side_stream is not None and t2w.has_first_lane:
            self._first_stream = family_stream(FIRST_STREAM_FAMILY, self.device, priority=self.first_lane_priority)
        self._main_stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda" and self.llm_stream_priority is not None:
            self._main_stream = family_stream(MAIN_STREAM_FAMILY, self.device, priority=self.llm_stream_priority)
        self._inflight: list[_Inflight] = []
        #: The token2wav streams whose next chunks must wait for work an admission queued on the
        #: runner's stream (by ``cuda_stream`` handle; both lanes' streams after an admission).
        self._side_waits: set[int] = set()
        #: Guessed next steps already launched, by request (``_llm_step``), and how many were
        #: confirmed / dropped so far.
        self._ahead: dict[str, _Ahead] = {}
        self.ahead_confirmed = 0
        self.ahead_dropped = 0
        #: Host copy of the cache lengths: no sync is needed to place rows or bound attention.
        self.slot_len = [0] * n_slots
        self.live: dict[str, _Live] = {}
        #: Token2wav streams of dropped requests, for the next admissions, each with the event
        #: of the last launch that used it (None: nothing of it is in flight).
        self._t2w_pool: list[tuple[Token2WavStream, torch.cuda.Event | None]] = []
        #: Start-up work left for after ready (:meth:`defer`), oldest first.
        self._deferred: deque[Iterator[None]] = deque()
        #: CUDA: the event of the latest launch that used each live token2wav stream (by id):
        #: a stream reused after its request is dropped waits for that one launch alone.
        self._last_launch: dict[int, torch.cuda.Event] = {}
        # voice -> device tensors; the entry keeps the voice alive, so its id cannot be reused
        # while cached. Least recently used first; bounded.
        self._voice_cache: OrderedDict[int, tuple[FlowVoice, Tensor, Tensor, Tensor]] = OrderedDict()
        #: voice -> (the voice, its prompt prefix for first chunks: ``Token2Wav.prepare_prefix``);
        #: made at start-up only (an eager pass over the prefix would stall every stream), at
        #: most ``prefix_voices`` of them; the entry keeps the voice alive, as above.
        self._first_prefixes: dict[int, tuple[FlowVoice, Any]] = {}
        #: voice prefix rows -> (K, V ``[n_layers, n_kv_heads, P, head_dim]``, last hidden ``[H]``)
        self._prefixes: OrderedDict[tuple[Row, ...], tuple[Tensor, Tensor, Tensor]] = OrderedDict()

    # ---- accounting --------------------------------------------------------------------------

    @property
    def n_live(self) -> int:
        return len(self.live)

    def used_slots(self) -> list[int]:
        return sorted(s for s, n in enumerate(self.slot_len) if n > 0)

    # ---- one step ----------------------------------------------------------------------------

    @_on_main_stream
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        result = StepResult()
        for rel in plan.release:
            self._release(rel)
        for adm in plan.admit:
            try:
                self._hook(adm.request_id, "admit")
                self._admit(adm)
                if self.live[adm.request_id].t2w.state_slot is not None:
                    result.flow_state.add(adm.request_id)
            except Exception as e:  # noqa: BLE001 - one request's setup fails alone
                result.failed[adm.request_id] = _describe(e)
        llm = [w for w in plan.llm if w.request_id in self.live and w.request_id not in result.failed]
        vocode: list[tuple[VocodeWork, Token2WavStream]] = []
        for work in plan.vocode:
            if work.request_id in result.failed:
                continue
            try:
                self._hook(work.request_id, "vocode")
                vocode.append((work, self._t2w_stream(work)))
            except Exception as e:  # noqa: BLE001
                result.failed[work.request_id] = _describe(e)
        if self._side_stream is not None:
            # token2wav on the side stream, launched first, so the GPU runs its kernels alongside
            # the LLM step's (the chunks' tokens came from earlier steps: nothing here depends
            # on this step's LLM output); pipelined, its audio may come back in a later step
            # first chunks are launched on their own, ahead of the rest: their audio comes
            # back as soon as they are done, not when the step's last chunk is; with the
            # first-chunk lane, on a stream of their own, beside the chunks still in flight
            lane: list[tuple[VocodeWork, Token2WavStream]] = []
            firsts: list[tuple[VocodeWork, Token2WavStream]] = []
            rest: list[tuple[VocodeWork, Token2WavStream]] = []
            for item in vocode:
                chunk = item[0].chunk
                (lane if self.t2w.in_first_lane(chunk) else firsts if chunk.index == 0 else rest).append(item)
            launched: set[int] = set()
            for part, side in ((lane, self._first_stream), (firsts, self._side_stream), (rest, self._side_stream)):
                if part:
                    assert side is not None
                    self._launch_vocode(part, result, side)
                    launched.add(side.cuda_stream)
            if llm or self._ahead:
                self._llm_step(llm, result)
            if not self.pipeline_vocode:
                self._collect_vocode(result, block=True)
            elif plan.wait_vocode:
                # this step's chunks (a first chunk held for at light load): the other lane's
                # launches are not waited for, which held such steps for a batch of later
                # chunks (~120 ms at 16 streams); with none, every launch in flight
                self._collect_vocode(result, block=True, streams=launched or None)
            else:
                self._collect_vocode(result, block=False)
            return result
        made: list[tuple[str, Tensor]] = []
        if llm or self._ahead:
            self._llm_step(llm, result)
        if vocode:
            made = self._vocode_step(vocode, result)
        for request_id, audio in made:
            try:
                result.audio[request_id] = _pcm(audio)
            except Exception as e:  # noqa: BLE001 - the copy to the host fails alone too
                result.failed[request_id] = _describe(e)
        return result

    def _vocode_streams(self) -> list[torch.cuda.Stream]:
        """The token2wav streams (none on the CPU): the side stream and the first-chunk lane's."""
        return [s for s in (self._side_stream, self._first_stream) if s is not None]

    def _launch_vocode(
        self, vocode: Sequence[tuple[VocodeWork, Token2WavStream]], result: StepResult, side: torch.cuda.Stream
    ) -> None:
        """Queue the chunks and their copies to pinned host memory on ``side`` (a token2wav
        stream); no wait. Their tokens come from earlier steps, so nothing depends on the LLM
        work queued next. Chunks of the first-chunk lane and the others may run at once (on
        their two streams): their graphs are apart (``FastToken2Wav.in_first_lane``), and each
        request has one chunk in flight at most."""
        if side.cuda_stream in self._side_waits:
            # what admissions queued on the runner's stream (a pooled token2wav stream's reset,
            # a voice's tensors); nothing else there is read by a chunk, so otherwise the side
            # stream does not wait behind the LLM step launched ahead
            side.wait_stream(torch.cuda.current_stream(self.device))
            self._side_waits.discard(side.cuda_stream)
        done = torch.cuda.Event()
        host: list[tuple[str, Tensor]] = []
        with torch.cuda.stream(side):
            try:
                made = self._vocode_step(vocode, result)
                for request_id, audio in made:
                    try:
                        buf = torch.empty(audio.shape, dtype=torch.float32, pin_memory=True)
                        buf.copy_(audio, non_blocking=True)
                        host.append((request_id, buf))
                    except Exception as e:  # noqa: BLE001 - the copy to the host fails alone too
                        result.failed[request_id] = _describe(e)
            finally:
                # after whatever was queued, a failed launch's included: the streams' reuse waits for it
                done.record(side)
                for _, t2w in vocode:
                    self._last_launch[id(t2w)] = done
        if host:
            self._inflight.append(_Inflight(host, done, side))

    def _collect_vocode(self, result: StepResult, *, block: bool, streams: set[int] | None = None) -> None:
        """Hand back the audio of every finished launch (each stream's in launch order); with
        ``block``, first wait for all of them, or for those on ``streams`` (``cuda_stream``
        handles) when given (each stream's newest: a stream runs its launches in order). The
        rest stay in ``result.inflight``."""
        if block:
            newest = {f.stream.cuda_stream: f for f in self._inflight}
            for handle, f in newest.items():
                if streams is None or handle in streams:
                    f.done.synchronize()
        pending: list[_Inflight] = []
        for f in self._inflight:
            # a launch behind an unfinished one of its stream is not done either
            if any(p.stream is f.stream for p in pending) or not f.done.query():
                pending.append(f)
                continue
            for request_id, buf in f.audio:
                result.audio[request_id] = buf.numpy().copy()
        self._inflight = pending
        result.inflight = {rid for f in self._inflight for rid, _ in f.audio}

    def _settle_vocode_reads(self) -> None:
        """Make the LLM stream wait for the launched chunks (GPU side, the host goes on): state
        they may read (an evicted voice's tensors) is about to be freed."""
        for side in self._vocode_streams():
            torch.cuda.current_stream(self.device).wait_stream(side)

    def _settle_vocode(self) -> None:
        """Wait for every launched chunk and drop its audio (shutdown, a failed step)."""
        for side in self._vocode_streams():
            side.synchronize()
        self._inflight.clear()

    def _hook(self, request_id: str, phase: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(request_id, phase)

    # ---- lifecycle ---------------------------------------------------------------------------

    def _release(self, rel: Release) -> None:
        self._ahead.pop(rel.request_id, None)  # its slot's length is reset below, or was
        if rel.slot is not None:
            self.cache.reset(rel.slot)  # in place: the tensors (and any graph over them) stay
            self.slot_len[rel.slot] = 0
        live = self.live.get(rel.request_id)
        if live is None:
            return
        live.slot = None
        if rel.drop:
            del self.live[rel.request_id]
            self.t2w.release_state(live.t2w)  # a later stream may take its flow state now
            self._t2w_pool.append((live.t2w, self._last_launch.pop(id(live.t2w), None)))

    @_on_main_stream
    def release_all(self) -> None:
        """Drop every request and reset every slot (after a failed step, or on shutdown)."""
        self._settle_vocode()
        self._ahead.clear()
        for rid in list(self.live):
            self._release(Release(rid, self.live[rid].slot, drop=True))
        self.cache.reset()
        self.slot_len = [0] * len(self.slot_len)

    def _voice(self, voice: FlowVoice) -> tuple[Tensor, Tensor, Tensor]:
        """Device copies of a voice's conditioning, batch-1 shaped: made once per voice, shared
        by its requests."""
        hit = self._voice_cache.get(id(voice))
        if hit is None or hit[0] is not voice:
            dev = self.t2w.device
            token = voice.prompt_token.reshape(1, -1).to(dev, torch.int32)
            feat = voice.prompt_feat.reshape(1, -1, voice.prompt_feat.shape[-1]).to(dev, torch.float32)
            emb = voice.embedding.reshape(1, -1).to(dev, torch.float32)
            hit = (voice, token, feat, emb)
            self._voice_cache[id(voice)] = hit
            while len(self._voice_cache) > VOICE_CACHE_SIZE:
                if self._inflight:  # launched chunks may still read the evicted voice's tensors
                    self._settle_vocode_reads()
                self._voice_cache.popitem(last=False)
        else:
            self._voice_cache.move_to_end(id(voice))
        return hit[1], hit[2], hit[3]

    def _first_prefix(self, voice: FlowVoice) -> object:
        """The voice's prompt prefix for its first chunks, or None (not prepared)."""
        hit = self._first_prefixes.get(id(voice))
        return hit[1] if hit is not None and hit[0] is voice else None

    @_on_main_stream
    def prepare_first_prefix(self, voice: FlowVoice) -> bool:
        """Start-up: keep ``voice``'s prompt prefix on the device, so its first chunks compute
        only the prompt's tail and the new tokens in the flow's 10 estimator calls (the prefix's
        keys, values and conv contexts are read; ``Flow.prefix_core``). At most
        ``prefix_voices`` voices; a prompt too short for a prefix has none. Returns whether the
        voice's first chunks now come from its prefix. ~0.6 GB of device memory for a
        150-token prompt at full size (bf16)."""
        if self._first_prefix(voice) is not None:
            return True
        if len(self._first_prefixes) >= self.prefix_voices:
            return False
        token, feat, emb = self._voice(voice)
        prefix = self.t2w.prepare_prefix(token, feat, emb)
        if prefix is None:
            return False
        self._first_prefixes[id(voice)] = (voice, prefix)
        return True

    @_on_main_stream
    def prepare_state_slots(self, n: int, tokens: int) -> int:
        """Start-up, after :meth:`prepare_first_prefix`: keep ``n`` flow states that streams of
        the voices with a prompt prefix hold while their later chunks extend them
        (``FastToken2Wav.use_state_slots``), each for the longest of those prompts plus ``tokens``
        speech tokens. Returns the states kept (0 without a prepared prefix or a flow that
        can extend a state)."""
        prompts = [prefix for _, prefix in self._first_prefixes.values()]
        if n <= 0 or not prompts or not self.t2w.has_state_path:
            return 0
        return self.t2w.use_state_slots(n, max(int(p.n_prompt) for p in prompts) + tokens)

    def _admit(self, adm: Admit) -> None:
        flow_voice = adm.voice.flow
        if flow_voice is None:
            raise TypeError(f"voice {adm.voice.name!r} has no token2wav conditioning")
        token, feat, emb = self._voice(flow_voice)
        # the chunks come planned by the request's schedule (the scheduler's); speed != 1 makes
        # the stream whole (one final chunk), as it makes the schedule
        kw: dict[str, Any] = {
            "speed": adm.speed,
            "first_prefix": self._first_prefix(flow_voice),
        }
        if self._t2w_pool:
            stream, last = self._t2w_pool.pop()
            if last is not None and not last.query():
                # a cancelled request's chunk may still read this stream's state, which the
                # reset below rewrites on the runner's stream: that stream waits for that launch
                # alone (GPU side), not for every chunk in flight, which held a whole LLM step
                # behind the later chunks of other streams (~120 ms at 16 streams)
                torch.cuda.current_stream(self.device).wait_event(last)
            stream.reset(token, feat, emb, **kw)
        else:
            stream = self.t2w.open_stream(token, feat, emb, **kw)
        self.cache.reset(adm.slot)
        self.slot_len[adm.slot] = 0
        self.live[adm.request_id] = _Live(adm.slot, adm.seed, stream)
        self._side_waits = {s.cuda_stream for s in self._vocode_streams()}

    @_on_main_stream
    def warmup_llm(self) -> None:
        """Start-up: run the LLM's every kind of work once (a prefill, a decode step and a draw),
        then reset and capture its CUDA graphs (``GraphedLLM.capture_all``), so first-use costs
        (kernels, allocator) are paid before the first stream. It launches none of the flow's
        kernels (start-up runs it while they compile); :meth:`warmup_token2wav` is the rest."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the weights, loaded on the default stream
        with torch.inference_mode():
            dims = self.llm.dims
            rows: list[tuple[int, int]] = [SOS, *text_rows([i % dims.text_vocab_size for i in range(7)])]
            h = self.llm.prefill(self.cache, 0, self.llm.embed_rows(rows), start_pos=0)
            speech = torch.zeros(1, dtype=torch.long, device=self.device)
            window = min(KV_WINDOW_STEP, self.cache.max_len)
            h2 = self.llm.decode_step(self.cache, None, self.llm.embed_speech(speech), kv_len=window)
            logp = self.llm.logprobs(torch.stack([h, h2[0]]))
            history = torch.full((2, self.sampling.win_size), NO_TOKEN, dtype=torch.long, device=self.device)
            uniforms = to_device(torch.from_numpy(counter_uniforms([0, 1], [0, 0])), self.device, torch.float32)
            ras_sample_batch(logp, history, uniforms, self.sampling).tolist()
            self.cache.reset()
        self.graphed.capture_all()  # before any stream holds a slot (capture runs the step)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @_on_main_stream
    def warmup_token2wav(self, voice: FlowVoice) -> None:
        """Start-up, after :meth:`warmup_llm` and the flow's kernels: a token2wav stream of a
        few chunks for ``voice``, then pooled for the first request."""
        with torch.inference_mode():
            token, feat, emb = self._voice(voice)
            stream = self.t2w.open_stream(token, feat, emb)
            tokens = list(range(1, 9))
            for _ in self.t2w.stream_all(stream, tokens, plan_all(len(tokens), stream.prompt_tokens, self.hops)):
                pass
            self._t2w_pool.append((stream, None))  # synchronised below
            self._voice_cache.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @_on_main_stream
    def precapture(
        self,
        voice: FlowVoice,
        n_tokens: int = 500,
        *,
        max_batch: int = 1,
        batch_tokens: int | None = None,
        final_vocoder: bool = True,
    ) -> int:
        """Capture the token2wav graphs of ``voice``'s prompt length for its first ``n_tokens``
        speech tokens (start-up, so no stream stalls on a capture later), with the batched-chunk
        graphs for steps of up to ``max_batch`` chunks (the engine passes its
        ``max_chunks_per_step``) within the first ``batch_tokens`` (None: ``n_tokens``), and
        with ``final_vocoder`` the vocoder graphs of every final chunk length. Returns graphs
        held."""
        work = self.iter_precapture(
            voice, n_tokens, max_batch=max_batch, batch_tokens=batch_tokens, final_vocoder=final_vocoder
        )
        for _ in work:
            pass
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.t2w.graphs_held()

    def iter_precapture(
        self,
        voice: FlowVoice,
        n_tokens: int,
        *,
        max_batch: int = 1,
        batch_tokens: int | None = None,
        final_vocoder: bool = True,
    ) -> Iterator[None]:
        """:meth:`precapture` one capture at a time (``FastToken2Wav.iter_capture_stream_shapes``):
        for :meth:`defer`, or run to its end on the runner's stream."""
        token, feat, emb = self._voice(voice)
        yield from self.t2w.iter_capture_stream_shapes(
            token,
            feat,
            emb,
            n_tokens,
            stream_shapes(self.hops, int(token.shape[1]), self.fast_first),
            max_batch=max_batch,
            batch_tokens=batch_tokens,
            first_prefix=self._first_prefix(voice),
            final_vocoder=final_vocoder,
        )

    def iter_precapture_vocoder(self, voice: FlowVoice) -> Iterator[None]:
        """Capture the vocoder graphs of the final chunks of ``voice``'s prompt length
        (``FastToken2Wav.iter_capture_final_vocoder``; :meth:`precapture` captures them too),
        one at a time, for :meth:`defer`: they need none of the flow's kernels, so start-up
        captures them while those compile, and the rest after ready."""
        n_prompt = int(voice.prompt_token.reshape(-1).shape[0])
        yield from self.t2w.iter_capture_final_vocoder(stream_shapes(self.hops, n_prompt, self.fast_first))

    # ---- start-up work after ready -------------------------------------------------------------

    def defer(self, work: Iterator[None]) -> None:
        """Start-up work to finish after the engine is ready (the graph captures past the
        first chunks), after any deferred before: the worker advances it one piece at a time
        (:meth:`background_step`) while no stream is live. Until it is done, a chunk whose
        graph is missing runs eagerly."""
        self._deferred.append(work)

    def drop_deferred(self) -> None:
        """End the deferred start-up work here and now (shutdown): what it holds (a state slot
        lent to its placeholder stream) is given back on this thread."""
        while self._deferred:
            close = getattr(self._deferred.popleft(), "close", None)
            if close is not None:
                close()

    @property
    def warming(self) -> bool:
        """Whether deferred start-up work is left (:meth:`defer`)."""
        return bool(self._deferred)

    def background_step(self) -> bool:
        """Advance the deferred start-up work by one piece (one capture or placeholder chunk,
        ~30 to 300 ms at full size) on the runner's stream, and wait for it; the worker calls
        this only while no stream is live, so a stream that opens meanwhile waits for one piece
        at most. Returns whether work is left. A failure ends the deferred work (logged): the
        engine goes on, running the shapes not captured eagerly."""
        if not self._deferred:
            return False
        try:
            if self.device.type == "cuda":
                # a cancelled stream's last chunk may still replay a graph the piece replays too
                torch.cuda.synchronize(self.device)
            main = self._main_stream
            with torch.cuda.stream(main) if main is not None else contextlib.nullcontext():
                while self._deferred and next(self._deferred[0], _DONE) is _DONE:
                    self._deferred.popleft()  # that one is done: the next one's first piece
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception:  # noqa: BLE001 - the graphs are a speed-up: serve without the rest
            log.exception("start-up work after ready failed; the shapes not captured run eagerly")
            self.drop_deferred()
        return self.warming

    # ---- LLM ---------------------------------------------------------------------------------

    def _llm_step(self, work: Sequence[LlmWork], result: StepResult) -> None:
        """Feed every item, then pick one token per item; the step waits once, for its tokens.

        Every item's rows go into ONE batched decode step (``GraphedLLM.decode_launch``): a
        decode row, or a run of rows for a multi-row input (a bistream text group, the rest of
        a first input after its voice prefix), as long as the step has room
        (``GraphedLLM.max_rows``, at most ``batched_input_rows`` of them multi-row). An input
        that does not fit is prefilled into its slot by itself and its last row sampled apart.

        Planning ahead (``LlmWork.guess``, the plan's ``step_ahead_rows``): an item the previous step
        already launched as its guess (same slot position, rows, EOS mask, window and draw)
        is not run again: its token is that launch's. The same launch carries the guesses of
        this step's confirmed items (fed with the ids being sampled, on the device); the
        guesses of the items it computes itself follow in a second launch. The host then waits
        for this step's tokens while the next step is already queued behind them. A guess
        the plan does not confirm is dropped and its slot's length rolled back (its K/V rows
        lie past the length, masked, and are overwritten later)."""
        confirmed, fresh = self._take_ahead(work, result)
        prefilled: list[LlmWork] = []
        hidden: list[Tensor] = []
        batched: list[tuple[LlmWork, list[tuple[int, int]]]] = []
        multi = sum(len(w.step.inputs) > 1 for w in fresh)
        room = min(self.graphed.max_rows - len(confirmed) - (len(fresh) - multi), self.batched_input_rows)
        for w in fresh:
            try:
                self._check_room(w.slot, len(w.step.inputs))
                rows, h = self._place_prefix(w)
                if h is not None:
                    prefilled.append(w)
                    hidden.append(h)
                elif len(w.step.inputs) == 1 or len(rows) <= room:
                    room -= len(rows) if len(w.step.inputs) > 1 else 0
                    batched.append((w, rows))
                else:
                    hidden.append(self._prefill_rows(w.slot, rows, self.slot_len[w.slot]))
                    prefilled.append(w)
            except Exception as e:  # noqa: BLE001 - one request's input fails alone
                result.failed[w.request_id] = _describe(e)
        # queued in this order: the prefilled items' draws (they set their slots' last ids),
        # this step's rows with the confirmed items' guesses, then the other items' guesses
        # on their way to the host before the launches below: waiting for them then waits for
        # the draws alone, not for the decode step queued behind them on the same stream
        prefill_ids = PendingIds(self._sample(prefilled, torch.stack(hidden))) if prefilled else None
        runs = [self._commit_run(w, rows) for w, rows in batched]
        launched = self._launch([*runs, *self._guess_runs([w for w, _ in confirmed], room)])
        self._launch(self._guess_runs([*prefilled, *(w for w, _ in batched)], self.batched_input_rows))
        picked: dict[str, int] = {}
        for w, done in confirmed:
            picked[w.request_id] = done.pending.ids()[done.index]
        if prefill_ids is not None:
            picked.update(zip((w.request_id for w in prefilled), prefill_ids.ids(), strict=True))
        if launched is not None and runs:  # this step's rows come first in the launch
            ids = launched.ids()
            picked.update((r.request_id, ids[i]) for r, i in zip(runs, self._last_rows(runs), strict=True))
        for w in (*(w for w, _ in confirmed), *prefilled, *(w for w, _ in batched)):
            token = w.step.force if w.step.force is not None else picked[w.request_id]
            result.tokens[w.request_id] = token
            guessed = self._ahead.get(w.request_id)
            if guessed is not None:
                guessed.after = token

    def _take_ahead(
        self, work: Sequence[LlmWork], result: StepResult
    ) -> tuple[list[tuple[LlmWork, _Ahead]], list[LlmWork]]:
        """Split the items into those the previous launch already ran as its guess (their rows
        are committed here) and the rest; drop every other guess, rolling back its slot's
        length on the device."""
        guesses, self._ahead = self._ahead, {}
        confirmed: list[tuple[LlmWork, _Ahead]] = []
        fresh: list[LlmWork] = []
        for w in work:
            try:
                self._hook(w.request_id, "llm")
            except Exception as e:  # noqa: BLE001 - one request's input fails alone
                result.failed[w.request_id] = _describe(e)
                continue  # its guess, if any, is dropped below
            ahead = guesses.get(w.request_id)
            if ahead is not None and self._confirms(ahead, w):
                del guesses[w.request_id]
                self.slot_len[w.slot] += len(ahead.run.rows)
                self.live[w.request_id].draws += 1
                confirmed.append((w, ahead))
            else:
                fresh.append(w)
        if guesses:
            slots = [a.run.slot for a in guesses.values()]
            self.ahead_dropped += len(slots)
            lengths = to_device([*slots, *(self.slot_len[s] for s in slots)], self.device, torch.long)
            self.cache.lengths.index_copy_(0, lengths[: len(slots)], lengths[len(slots) :].to(torch.int32))
        self.ahead_confirmed += len(confirmed)
        return confirmed, fresh

    def _confirms(self, ahead: _Ahead, w: LlmWork) -> bool:
        """Whether the guess ``ahead`` launched is exactly item ``w``: slot and position, rows,
        EOS mask, repetition window and draw."""
        run, after = ahead.run, ahead.after
        if after is None or run.slot != w.slot or run.start != self.slot_len[w.slot]:
            return False
        rows = [(kind, after) for kind, _ in run.rows] if run.fed else run.rows
        window = (*run.window[:-1], after) if run.fed else run.window
        win = self.sampling.win_size
        return (
            rows == self._rows(w)
            and run.masked == (not w.step.allow_eos)
            and window[-win:] == tuple(w.recent)[-win:]
            and run.draw == self.live[w.request_id].draws
        )

    def _guess_runs(self, items: Sequence[LlmWork], room: int) -> list[_Run]:
        """The runs of ``items``' guessed next steps (``LlmWork.guess``), after their rows of
        this step (already counted in ``slot_len``; their draws taken). A guessed input of
        several rows takes ``room`` (left over from this step's multi-row inputs)."""
        runs: list[_Run] = []
        for w in items:
            guess, known = w.guess, w.step.force
            if guess is None:
                continue
            rows: list[tuple[int, int]]
            if guess.inputs is None:  # one speech row: this step's token
                fed = known is None
                rows = [(RowKind.SPEECH, 0 if known is None else known)]
            elif known is not None:  # the rows after a forced token (a text group after FILL)
                fed, rows = False, [*guess.inputs]
            else:
                continue
            start = self.slot_len[w.slot]
            if start + len(rows) > self.cache.max_len or (len(rows) > 1 and len(rows) > room):
                continue
            room -= len(rows) if len(rows) > 1 else 0
            window = (*w.recent, NO_TOKEN if known is None else known)
            lv = self.live[w.request_id]
            runs.append(_Run(w.request_id, w.slot, start, rows, fed, not guess.allow_eos, window, lv.draws, guess=True))
        return runs

    def _commit_run(self, w: LlmWork, rows: list[tuple[int, int]]) -> _Run:
        """The run of item ``w``'s ``rows`` in this step (:meth:`_draw_run`), appended to its
        slot's length."""
        run = self._draw_run(w, rows)
        self.slot_len[w.slot] += len(rows)
        return run

    def _draw_run(self, w: LlmWork, rows: list[tuple[int, int]]) -> _Run:
        """Item ``w``'s ``rows`` from its slot's length, sampled with its step's inputs; takes
        the request's next draw."""
        lv = self.live[w.request_id]
        run = _Run(w.request_id, w.slot, self.slot_len[w.slot], rows, False, not w.step.allow_eos, w.recent, lv.draws)
        lv.draws += 1
        return run

    def _check_room(self, slot: int, n: int) -> None:
        if self.slot_len[slot] + n > self.cache.max_len:
            raise RuntimeError(
                f"utterance too long: the KV cache holds {self.cache.max_len} positions per stream "
                "(raise it with Engine.load(options=BuildOptions(kv_len=...)))"
            )

    def _rows(self, w: LlmWork) -> list[tuple[int, int]]:
        return [*w.step.inputs]

    def _place_prefix(self, w: LlmWork) -> tuple[list[tuple[int, int]], Tensor | None]:
        """Put a first step's voice prefix into its slot (if it has one worth reusing); returns
        the rows still to append, and the last hidden state ``[H]`` when the prefix was the
        whole input (else None).

        A first step's voice prefix (``LlmStep.voice_prefix``: SOS and the prompt, the same rows
        at the same positions for every request of a voice) is prefilled once per voice and
        kept, K/V and last hidden state (``prefix_cache_size`` voices); later requests copy
        it into their slot. The K/V are those a prefill of the prefix computes, so every
        request of the voice starts from the same state."""
        rows = self._rows(w)
        p = w.step.voice_prefix if self.slot_len[w.slot] == 0 and w.step.voice_prefix >= self.min_prefix_rows else 0
        if not p:
            return rows, None
        key = w.step.inputs[:p]
        hit = self._prefixes.get(key)
        if hit is None:
            h = self._prefill_rows(w.slot, rows[:p], 0)
            hit = (*self.cache.read_prefix(w.slot, p), h)  # h: a fresh tensor (see _prefill_rows)
            self._prefixes[key] = hit
            while len(self._prefixes) > self.prefix_cache_size:
                self._prefixes.popitem(last=False)
        else:
            self._prefixes.move_to_end(key)
            self.cache.write_prefix(w.slot, hit[0], hit[1])
            self.slot_len[w.slot] = p
        return rows[p:], (hit[2] if p == len(rows) else None)

    def _prefill_rows(self, slot: int, rows: list[tuple[int, int]], start: int) -> Tensor:
        embeds = self.llm.embed_rows(rows)  # [L, H]
        # a graph returns its static output buffer: the next prefill of the same length
        # bucket in this step would overwrite it
        h = self.graphed.prefill(slot, embeds, start).clone()
        self.slot_len[slot] += len(rows)
        return h  # [H]

    def _launch(self, runs: Sequence[_Run]) -> PendingIds | None:
        """One decode step over ``runs`` (none: nothing launched); no wait. Its runs that are
        guesses (``_Run.guess``) are kept for the next step to confirm (:meth:`_take_ahead`)."""
        if not runs:
            return None
        longest = max(r.start + len(r.rows) for r in runs)
        launched = self.graphed.decode_launch(self._pack(runs), kv_len=longest)
        for r, i in zip(runs, self._last_rows(runs), strict=True):
            if r.guess:
                self._ahead[r.request_id] = _Ahead(r, launched, i)
        return launched

    @staticmethod
    def _last_rows(runs: Sequence[_Run]) -> list[int]:
        """The packed index of each run's last row (its draw)."""
        return [n - 1 for n in itertools.accumulate(len(r.rows) for r in runs)]

    def _pack(self, runs: Sequence[_Run]) -> np.ndarray:
        """The runs packed (``pack_decode_rows``). A run's sampling inputs go on its last row
        (its draw's counter uniforms); the rows before it draw with idle inputs, their ids
        unused."""
        uniforms = counter_uniforms([self.live[r.request_id].seed for r in runs], [r.draw for r in runs])
        slots: list[int] = []
        offsets: list[int] = []
        kinds: list[int] = []
        ids: list[int] = []
        masked: list[bool] = []
        fed: list[bool] = []
        history: list[Sequence[int]] = []
        draws: list[np.ndarray] = []
        for r, u in zip(runs, uniforms, strict=True):
            n = len(r.rows)
            slots += [r.slot] * n
            offsets += range(n)
            kinds += [kind for kind, _ in r.rows]
            ids += [ident for _, ident in r.rows]
            masked += [True] * (n - 1) + [r.masked]
            fed += [False] * (n - 1) + [r.fed]
            history += [()] * (n - 1) + [r.window]
            draws += [_IDLE_UNIFORMS] * (n - 1) + [u]
        return pack_decode_rows(
            slots, ids, masked, np.stack(draws), history, self.sampling.win_size, offsets=offsets, kinds=kinds, feed=fed
        )

    def _sample(self, items: Sequence[LlmWork], hidden: Tensor) -> Tensor:
        """The head and RAS for prefilled items' final-norm hidden states ``[N, H]``: int64 ids
        ``[N]`` on the device (no sync), as the decode step samples (``GraphedLLM.draw``: its
        ``sample`` replayed from a graph of N rows); the sampling inputs reach the device in
        one packed copy. Takes each item's draw."""
        return self.graphed.draw(hidden, self._pack([self._draw_run(w, self._rows(w)[-1:]) for w in items]))

    # ---- token2wav ---------------------------------------------------------------------------

    def _t2w_stream(self, work: VocodeWork) -> Token2WavStream:
        live = self.live.get(work.request_id)
        if live is None:
            raise RuntimeError("vocode for a request the runner does not hold")
        return live.t2w

    def _vocode_step(
        self, items: Sequence[tuple[VocodeWork, Token2WavStream]], result: StepResult
    ) -> list[tuple[str, Tensor]]:
        """The step's token2wav chunks: one ``Token2Wav.run_chunks`` call (the flow of the
        batchable chunks in one pass, or one per length with CUDA graphs), each chunk failing
        alone. Returns (request id, audio on the device); the caller copies it to the host (no
        sync here).

        A failure before any chunk was made (a batched flow pass that raises, e.g. out of
        memory) runs every chunk again by itself, so only a chunk that fails alone fails; a
        failure after the flow pass fails just its chunk (``ChunkBatchError``).
        """
        made: list[tuple[str, Tensor]] = []
        if not self.batch_chunks or len(items) == 1:
            for work, stream in items:
                self._vocode_alone(work, stream, result, made)
            return made
        pairs = [(stream, work.chunk, list(work.tokens[: work.chunk.token_len])) for work, stream in items]
        try:
            audio: Sequence[Tensor | None] = self.t2w.run_chunks(pairs)
        except ChunkBatchError as e:
            audio = e.results
            for i, err in e.errors.items():
                result.failed[items[i][0].request_id] = _describe(err)
        except Exception:  # noqa: BLE001 - nothing was made yet: each chunk on its own
            log.warning("batched token2wav step failed; running its %d chunks one by one", len(items), exc_info=True)
            for work, stream in items:
                self._vocode_alone(work, stream, result, made)
            return made
        made.extend((work.request_id, pcm) for (work, _), pcm in zip(items, audio, strict=True) if pcm is not None)
        return made

    def _vocode_alone(
        self, work: VocodeWork, stream: Token2WavStream, result: StepResult, made: list[tuple[str, Tensor]]
    ) -> None:
        try:
            tokens = list(work.tokens[: work.chunk.token_len])
            made.append((work.request_id, stream.run_chunk(work.chunk, tokens)))
        except Exception as e:  # noqa: BLE001 - one request's chunk fails alone
            result.failed[work.request_id] = _describe(e)


def stream_shapes(hops: HopPolicy, prompt_tokens: int, fast_first: int = 0) -> StreamShapes:
    """The chunks of ``hops`` for streams of a voice of ``prompt_tokens`` flow prompt tokens
    (with ``fast_first``), as the scheduler's schedules make them: what token2wav's start-up
    captures are for (``FastToken2Wav.capture_stream_shapes``)."""
    first = hops.schedule(prompt_tokens, fast_first)  # as it starts: its first hop

    def plans(n_tokens: int, state: bool) -> list[ChunkPlan]:
        return plan_all(n_tokens, prompt_tokens, hops, fast_first, state=state)

    return StreamShapes(plans, first.tokens_for_next_chunk, hops.max_hop + first.lookahead)


def _pcm(audio: Tensor) -> np.ndarray:
    return np.ascontiguousarray(audio.detach().float().cpu().numpy(), dtype=np.float32)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def noise_voice(
    n_prompt_tokens: int, *, n_mels: int = 80, spk_dim: int = 192, seed: int = 0
) -> tuple[list[int], FlowVoice]:
    """A synthetic voice for random-weight models: (prompt speech ids, conditioning).

    Random prompt tokens, a smooth random prompt mel and a random x-vector. It sounds like
    nothing (nor does a random model); it exists so that the pipeline runs end to end.
    """
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 6561, (n_prompt_tokens,), generator=gen)
    mel = torch.randn(2 * n_prompt_tokens, n_mels, generator=gen).cumsum(0) * 0.05 - 6.0
    emb = torch.randn(spk_dim, generator=gen)
    return [int(i) for i in ids.tolist()], FlowVoice(ids.to(torch.int32), mel.float(), emb.float())
