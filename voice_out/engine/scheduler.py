"""Scheduling policy of the GPU worker: requests, not launches. No torch: it exchanges plain
records with the runner side.

The scheduler owns the requests: their KV slots, text feeds, chunk schedules, back-pressure
and the priority of their work. It does not decide what goes to the device in one step beside
the work still in flight (CUDA lanes, launches in flight, first-chunk holds and waits,
step-ahead guesses): that is the runner side's :class:`~voice_out.engine.launch.LaunchPolicy`,
which the worker owns and which this module does not import. One worker step is planned in
turns (``LaunchPolicy.plan`` walks them):

1. ``offer()``: releases (KV slots to reset, GPU state to drop: finished, cancelled or failed
   requests, and requests whose LLM part is done) and admissions (waiting requests given a
   free KV slot, first come first served, at most ``max_streams`` holding slots), both final;
   and the :class:`Offer` of what is ready: every request's next token2wav chunk, most
   pressing first (a stream whose listener runs dry within ``urgent_s``, then first chunks in
   arrival order, then by playout deadline; while an admitted stream still waits for its first
   audio, the plan's ``first_audio_priority``, only first chunks and urgent ones), with the
   chunks in flight. A request whose delivered audio exceeds ``max_ahead_s`` ahead of its
   consumer offers no chunk (back-pressure).
2. ``launch_chunks(offer, chosen)``: the chunks the policy launches are committed (in flight).
3. ``decoding(offer)``: the requests whose LLM may step beside them: admitted, with input
   (text or its last speech token) and not too far ahead of their consumer.
4. ``take_steps(decoding)``: unless the policy holds them, each one's step is handed out (a
   request waiting for text is left out, holding nobody up); ``llm_work(offer, steps,
   guess=...)`` writes them as ONE batched LLM forward, with the guesses of the next steps
   when the policy launches them ahead.

So a request's state advances only for work that is launched. Then ``result =
runner.execute(plan)`` and ``scheduler.update(plan, result)``.

Pipelined token2wav: a runner may return a chunk's audio in a later step than the one that
planned it (on CUDA the runner launches token2wav on a second stream and goes on with LLM steps
while it runs). It lists such requests in ``StepResult.inflight``; no other chunk of such a
request is offered meanwhile.

Cancellation is ``finish(ids, ABORTED)``: the request leaves at once and its slot is released
in the next plan. Every method is called from the worker thread only.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from voice_out.config import EngineConfig
from voice_out.engine.api import (
    SAMPLE_RATE,
    EngineError,
    PcmChunk,
    StreamFailedError,
    TextTooLongError,
)
from voice_out.engine.chunk_schedule import ChunkPlan, HopPolicy
from voice_out.engine.request import (
    EOS_TOKEN,
    FILL_TOKEN,
    SAMPLES_PER_TOKEN,
    SPEECH_VOCAB,
    LlmStep,
    Request,
    RequestStatus,
    TextFeed,
    TextPiece,
    TextPipeline,
    TokenOutcome,
    VoicePrompt,
)
from voice_out.engine.textfeed import BistreamFeed
from voice_out.fast.plan import Plan, cpu_plan
from voice_out.text.bistream import BistreamConfig
from voice_out.text.rows import Row

Clock = Callable[[], float]
#: First-audio traces the scheduler keeps (``Scheduler.first_audio``).
FIRST_AUDIO_TRACES = 1024


# --------------------------------------------------------------------------------------------
# Records exchanged with the runner


@dataclass(frozen=True)
class Release:
    """Reset ``slot`` in place (when not None); drop all GPU state of the request when ``drop``."""

    request_id: str
    slot: int | None
    drop: bool


@dataclass(frozen=True)
class Admit:
    """Set up a request in ``slot``: its sampling generator (``seed``) and token2wav stream."""

    request_id: str
    slot: int
    seed: int
    voice: VoicePrompt
    #: token2wav speed: != 1 makes the request's audio in one final chunk (spec 5.6). How big
    #: each chunk is comes with its ``VocodeWork`` (the request's schedule is the scheduler's).
    speed: float = 1.0


@dataclass(frozen=True)
class NextGuess:
    """What a request's next LLM step will likely be, for the runner to launch it before this
    step's token is known (the plan's ``step_ahead_rows``): ``inputs`` None = one speech row, the token
    this step picks; else these rows (a text group after a forced FILL). A guess the next
    plan does not confirm is dropped."""

    inputs: tuple[Row, ...] | None
    allow_eos: bool


@dataclass(frozen=True)
class LlmWork:
    """Feed ``step.inputs`` into ``slot``, then pick a token (``step.force`` or a sample over the
    logits with ``recent`` as the repetition window). ``guess``: the likely next step (None: no
    guess, nothing is launched ahead)."""

    request_id: str
    slot: int
    step: LlmStep
    recent: tuple[int, ...]
    guess: NextGuess | None = None


@dataclass(frozen=True)
class VocodeWork:
    """Run token2wav ``chunk`` of a request over ``tokens[:chunk.token_len]``."""

    request_id: str
    chunk: ChunkPlan
    tokens: Sequence[int]


@dataclass(frozen=True)
class StepPlan:
    release: tuple[Release, ...] = ()
    admit: tuple[Admit, ...] = ()
    llm: tuple[LlmWork, ...] = ()
    vocode: tuple[VocodeWork, ...] = ()
    #: Block until this plan's chunks are back (with none, every chunk in flight): the plan
    #: has nothing else to do, or it holds a first chunk at light load
    #: (``LaunchPolicy.first_chunk_wait_rows``). A pipelined runner waits for the streams this
    #: plan's chunks run on, not for the other lane's launches.
    wait_vocode: bool = False

    @property
    def empty(self) -> bool:
        return not (self.release or self.admit or self.llm or self.vocode or self.wait_vocode)

    def request_ids(self) -> set[str]:
        """Requests whose GPU work is in this plan (releases excluded)."""
        ids = {a.request_id for a in self.admit}
        ids.update(w.request_id for w in self.llm)
        ids.update(w.request_id for w in self.vocode)
        return ids


@dataclass(frozen=True)
class Offer:
    """What the requests have ready for one worker step (``Scheduler.offer``), for the launch
    policy of the runner side to choose from (``voice_out.engine.launch``)."""

    #: Decided by the scheduler; they go into the step as they are.
    release: tuple[Release, ...]
    admit: tuple[Admit, ...]
    #: Every request's next chunk that may be vocoded now, by request id, most pressing first:
    #: streams about to run dry, then first chunks in arrival order, then by playout deadline.
    chunks: tuple[tuple[str, ChunkPlan], ...]
    #: The live requests' chunks launched in earlier steps whose audio is not back yet.
    in_flight: tuple[ChunkPlan, ...]
    #: Streams that have had first audio and are not finished.
    playing: int
    #: An admitted stream with text still waits for its first audio (then no stream past its
    #: back-pressure limit decodes beside its chunk in flight).
    first_audio_due: bool
    #: The scheduler's clock when the offer was made (seconds).
    time: float


@dataclass(frozen=True)
class TakenStep:
    """A request's LLM step handed out for this plan (``Scheduler.take_steps``);
    ``awaits_first_audio``: the request has had no audio yet."""

    request_id: str
    step: LlmStep
    awaits_first_audio: bool


@dataclass
class StepResult:
    """What the runner did: a token per LLM work item, float32 audio per finished chunk (of
    this plan or, pipelined, of an earlier one), the requests whose chunk is still in flight,
    and the requests that failed (message per request)."""

    tokens: dict[str, int] = field(default_factory=dict)
    audio: dict[str, np.ndarray] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    inflight: set[str] = field(default_factory=set)
    #: Requests admitted in this step that hold a flow state of their own (the runner's
    #: token2wav lent them a state slot): their later chunks cost about the same whatever
    #: their length. What their hops become is the scheduler's choice (``HopPolicy.on_state``).
    flow_state: set[str] = field(default_factory=set)


# --------------------------------------------------------------------------------------------
# Outputs for the consumers


@dataclass(frozen=True)
class Emitted:
    request_id: str
    chunk: PcmChunk


@dataclass(frozen=True)
class Ended:
    """The request reached a terminal status; ``error`` is set for FAILED."""

    request_id: str
    status: RequestStatus
    error: EngineError | None = None


Output = Emitted | Ended


@dataclass(frozen=True)
class FirstAudioTrace:
    """Where one stream's time to first audio went, in seconds of the scheduler's clock.

    The phases add up to ``total_s``, first text (or the request, if later) to first audio:
    ``slot_s`` waiting for a KV slot; ``tokens_s`` admitted until the LLM had made every token
    the first chunk needs (``llm_steps`` steps); ``queue_s`` waiting for the chunk to be handed
    to the runner (behind chunks in flight, or other streams' chunks); ``vocode_s`` until its
    audio came back."""

    request_id: str
    slot_s: float
    tokens_s: float
    queue_s: float
    vocode_s: float
    llm_steps: int

    @property
    def total_s(self) -> float:
        return self.slot_s + self.tokens_s + self.queue_s + self.vocode_s


@dataclass(frozen=True)
class ForcedTokens:
    """Forced-tokens mode for tests and benchmarks with random weights.

    The LLM still runs every step, but the picked speech token is ``token_fn(seed, i)`` for the
    i-th speech token of a request, and EOS is forced once the request has
    ``tokens_per_text_token`` speech tokens per text token (in the final phase; the interleave
    phase makes 15 per 5 text tokens by itself).
    """

    tokens_per_text_token: int = 3
    token_fn: Callable[[int, int], int] | None = None

    def token(self, seed: int, i: int) -> int:
        if self.token_fn is not None:
            return self.token_fn(seed, i)
        return (seed * 1_000_003 + i * 7919 + 17) % SPEECH_VOCAB


class AutoForced(enum.Enum):
    """The type of :data:`AUTO_FORCED`."""

    AUTO = "auto"


#: ``Engine.load``'s default ``forced``: random weights speak a realistic length of forced
#: tokens per text token (``voice_out.engine.build.RANDOM_TOKENS_PER_TEXT_TOKEN``), real weights
#: stop on EOS. ``serve``, ``say`` and the in-process API all take this one rule; None forces nothing.
AUTO_FORCED = AutoForced.AUTO


def _default_feed(voice: VoicePrompt, config: EngineConfig) -> TextFeed:
    feed_config = BistreamConfig(max_tokens_per_text_token=config.max_speech_tokens_per_text_token)
    return BistreamFeed(voice.prompt_text_ids, voice.prompt_speech_ids, feed_config)


def hop_policy(config: EngineConfig, plan: Plan) -> HopPolicy:
    """The chunk hops of ``config`` (``engine.first_hop_tokens``, ``max_hop_tokens``,
    ``hop_growth``) and ``plan`` (``flow_state_max_hop_tokens``): the scheduler's schedules and
    the runner's token2wav streams use this one."""
    return HopPolicy(config.first_hop_tokens, config.max_hop_tokens, config.hop_growth, plan.flow_state_max_hop_tokens)


class Scheduler:
    """Decides what each worker step does (see the module docstring). Worker thread only."""

    def __init__(
        self,
        config: EngineConfig,
        pipeline_factory: Callable[[], TextPipeline],
        *,
        feed_factory: Callable[[VoicePrompt, EngineConfig], TextFeed] = _default_feed,
        clock: Clock,
        forced: ForcedTokens | None = None,
        plan: Plan | None = None,
        urgent_s: float = 0.5,
    ) -> None:
        """``plan``: the engine's fast-path plan (its KV slots and policies; None: a CPU
        engine's for ``config.max_streams``)."""
        plan = plan if plan is not None else cpu_plan(config.max_streams)
        self.config = config
        self.fast_plan = plan
        self.hops = hop_policy(config, plan)
        self.clock = clock
        self.forced = forced
        self.urgent_s = urgent_s
        self._pipeline_factory = pipeline_factory
        self._feed_factory = feed_factory
        self.requests: dict[str, Request] = {}
        self.waiting: deque[str] = deque()
        self.free_slots: list[int] = list(range(plan.max_streams))
        self._slot_owner: dict[int, str] = {}
        self._releases: list[Release] = []
        self._outputs: list[Output] = []
        self._max_ahead = int(config.max_ahead_s * SAMPLE_RATE)
        self._seq = itertools.count()
        self._order: dict[str, int] = {}
        #: The latest streams' first-audio traces, and how many were ever recorded.
        self.first_audio: deque[FirstAudioTrace] = deque(maxlen=FIRST_AUDIO_TRACES)
        self.first_audio_count = 0

    # ---- accounting --------------------------------------------------------------------------

    @property
    def n_live(self) -> int:
        return len(self.requests)

    @property
    def n_used_slots(self) -> int:
        return self.fast_plan.max_streams - len(self.free_slots)

    def inflight_ids(self) -> set[str]:
        """Requests with a chunk handed to the runner whose audio has not come back."""
        return {rid for rid, r in self.requests.items() if r.vocode_inflight is not None}

    def take_outputs(self) -> list[Output]:
        out, self._outputs = self._outputs, []
        return out

    # ---- events from the consumers -------------------------------------------------------------

    def add_request(
        self, request_id: str, voice: VoicePrompt, seed: int, fast_first: int | None = None, *, speed: float = 1.0
    ) -> Request:
        """Register a request; ``fast_first`` None = ``engine.fast_first_tokens``; ``speed`` != 1:
        its audio is one final chunk once the LLM has finished (the runner resamples its mel)."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} already exists")
        req = Request(
            request_id=request_id,
            voice=voice,
            feed=self._feed_factory(voice, self.config),
            pipeline=self._pipeline_factory(),
            schedule=self.hops.schedule(
                voice.flow_prompt_tokens,
                self.config.fast_first_tokens if fast_first is None else fast_first,
                whole=speed != 1.0,
            ),
            speed=speed,
            seed=seed,
            arrival_time=self.clock(),
        )
        self.requests[request_id] = req
        self._order[request_id] = next(self._seq)
        self.waiting.append(request_id)
        return req

    def push_text(self, request_id: str, delta: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.text_ended:
            return
        if req.first_text_time is None:
            req.first_text_time = self.clock()
        req.chars_received += len(delta)
        if req.chars_received > self.config.max_text_chars:
            self._fail(req, TextTooLongError(f"text longer than {self.config.max_text_chars} characters"))
            return
        self._guarded_feed(req, lambda: req.pipeline.push(delta))

    def end_text(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.text_ended:
            return
        req.text_ended = True
        if not self._guarded_feed(req, req.pipeline.finish):
            return
        req.feed.end_text()
        if req.n_text_ids == 0:
            self.finish([request_id], RequestStatus.FINISHED)  # nothing to say

    def ack(self, request_id: str, samples_consumed: int) -> None:
        req = self.requests.get(request_id)
        if req is not None:
            req.samples_consumed = max(req.samples_consumed, min(samples_consumed, req.samples_produced))

    def _guarded_feed(self, req: Request, produce: Callable[[], list[TextPiece]]) -> bool:
        try:
            for piece in produce():
                req.feed.add_text(piece.ids)
                req.text_id_char_end.extend([piece.char_end] * len(piece.ids))
        except Exception as e:  # noqa: BLE001 - a bad text fails its own stream only
            self._fail(req, StreamFailedError(f"text processing failed: {type(e).__name__}: {e}"))
            return False
        return True

    # ---- termination -------------------------------------------------------------------------

    def finish(self, request_ids: Iterable[str], status: RequestStatus, error: EngineError | None = None) -> None:
        """End requests now (cancel: ABORTED). Their GPU state is released by the next plan."""
        if not status.terminal:
            raise ValueError(f"finish() needs a terminal status, not {status.name}")
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            self._order.pop(rid, None)
            if req.status == RequestStatus.WAITING:
                self.waiting.remove(rid)
            else:
                self._releases.append(Release(rid, self._free_slot(req), drop=True))
            req.status = status
            req.finish_time = self.clock()
            req.error = str(error) if error is not None else None
            self._outputs.append(Ended(rid, status, error))

    def _fail(self, req: Request, error: EngineError) -> None:
        self.finish([req.request_id], RequestStatus.FAILED, error)

    def _free_slot(self, req: Request) -> int | None:
        slot = req.slot
        if slot is None:
            return None
        req.slot = None
        del self._slot_owner[slot]
        self.free_slots.append(slot)
        self.free_slots.sort()
        return slot

    def _llm_finished(self, req: Request) -> None:
        req.llm_done = True
        req.status = RequestStatus.VOCODING
        self._releases.append(Release(req.request_id, self._free_slot(req), drop=False))

    # ---- planning ----------------------------------------------------------------------------

    def _can_decode(self, req: Request, *, beside: bool, extra: int = 0) -> bool:
        """Back-pressure on the LLM (with ``extra`` more speech tokens than ``req`` has: would
        it decode then): a request more than ``max_ahead_s`` ahead of its consumer pauses
        while a chunk of it is ready, so that vocoding (and with it the consumer) can make
        progress. With ``beside`` (no stream waits for its first audio: the GPU has no more
        pressing work) a chunk already in flight needs no pause: the request decodes on beside
        it, up to the tokens of the chunk after it. Pausing kept the LLM idle while each later
        chunk ran (a hop of 4 s is as long as the default limit, so a stream read as fast as
        it comes was held at every chunk); while first audio is due, the steps beside would
        take the GPU from it (16-stream first audio p95 +35 ms)."""
        n = len(req.speech_tokens) + extra
        if req.ahead_samples() + extra * SAMPLES_PER_TOKEN <= self._max_ahead:
            return True
        chunk = req.schedule.ready(n, False)
        if chunk is None:
            return True
        return beside and req.vocode_inflight == chunk and n < req.schedule.tokens_after(chunk)

    def _vocode_candidate(self, req: Request) -> ChunkPlan | None:
        if req.status not in (RequestStatus.RUNNING, RequestStatus.VOCODING):
            return None
        if req.chunks_produced > 0 and req.buffered_samples() > self._max_ahead:
            return None
        return req.schedule.ready(len(req.speech_tokens), req.llm_done)

    def offer(self) -> Offer:
        """Begin a step: what the requests have ready (see :class:`Offer`). Releases and
        admissions are decided here and final; nothing else changes until the launch policy's
        choice is committed (:meth:`launch_chunks`, :meth:`take_steps`)."""
        releases, self._releases = tuple(self._releases), []
        admits = self._admit()
        now = self.clock()
        in_flight = tuple(r.vocode_inflight for r in self.requests.values() if r.vocode_inflight is not None)
        # streams admitted, with text, and still without audio: while there are any, only first
        # chunks and streams about to run dry get the GPU (the plan's first_audio_priority), and
        # no stream past its back-pressure limit decodes beside its chunk in flight. A stream
        # given no text yet has nothing to hurry: counting it would hold every other stream's
        # later chunks for as long as its client stays silent.
        awaiting = any(
            r.first_audio_time is None and r.first_text_time is not None and r.status is not RequestStatus.WAITING
            for r in self.requests.values()
        )
        chunks = tuple((r.request_id, c) for r, c in self._ready_chunks(now, awaiting))
        return Offer(releases, admits, chunks, in_flight, self._n_playing(), awaiting, now)

    def launch_chunks(self, offer: Offer, chosen: Sequence[tuple[str, ChunkPlan]]) -> tuple[VocodeWork, ...]:
        """Commit the chunks of ``offer`` the launch policy launches now: each is in flight
        until its audio comes back (:meth:`update`). Returns their work, in the given order."""
        vocode = []
        for rid, chunk in chosen:
            req = self.requests[rid]
            req.vocode_inflight = chunk
            if chunk.index == 0:
                req.first_chunk_plan_time = offer.time
            vocode.append(VocodeWork(rid, chunk, req.speech_tokens))
        return tuple(vocode)

    def decoding(self, offer: Offer) -> tuple[str, ...]:
        """The requests whose LLM may step now, in arrival order, with the chunks launched
        (:meth:`launch_chunks`): admitted, not done, and not held by back-pressure (see
        ``_can_decode``). Some may still wait for text (:meth:`take_steps` leaves them out)."""
        return tuple(
            r.request_id
            for r in self._ordered(r for r in self.requests.values() if r.status.holds_slot)
            if not r.llm_done and self._can_decode(r, beside=not offer.first_audio_due)
        )

    def take_steps(self, decoding: Sequence[str]) -> tuple[TakenStep, ...]:
        """Commit the LLM rows of ``decoding`` the launch policy runs now: each request's next
        step is handed out (the feed hands a step out once; its token comes with
        :meth:`update`). A request waiting for text is left out, holding nobody up."""
        taken = []
        for rid in decoding:
            req = self.requests[rid]
            step = req.feed.next_step()
            if step is None:
                continue  # waiting for text: the others go on
            if self.forced is not None and step.force is None:
                step = self._force(req, step)
            taken.append(TakenStep(rid, step, req.first_audio_time is None))
        return tuple(taken)

    def readies_first_chunks(self, steps: Sequence[TakenStep]) -> bool:
        """Whether every one of ``steps`` draws the token that completes its request's first
        chunk (not launched yet): the plan after it may hold their steps for those chunks."""
        return all(self._readies_first_chunk(self.requests[s.request_id], s.step) for s in steps)

    def llm_work(self, offer: Offer, steps: Sequence[TakenStep], *, guess: bool) -> tuple[LlmWork, ...]:
        """The work of the ``steps`` taken, with each one's likely next step when the launch
        policy launches ``guess``es ahead (``LlmWork.guess``)."""
        win = self.config.ras_win_size
        llm: list[LlmWork] = []
        for s in steps:
            req = self.requests[s.request_id]
            assert req.slot is not None
            ahead = self._guess(req, s.step, beside=not offer.first_audio_due) if guess else None
            llm.append(LlmWork(s.request_id, req.slot, s.step, tuple(req.history[-win:]), ahead))
        return tuple(llm)

    def _admit(self) -> tuple[Admit, ...]:
        """Waiting requests given a free KV slot, first come first served."""
        admits = []
        while self.waiting and self.free_slots:
            rid = self.waiting.popleft()
            req = self.requests[rid]
            slot = self.free_slots.pop(0)
            req.slot = slot
            req.status = RequestStatus.PREFILL
            req.admit_time = self.clock()
            self._slot_owner[slot] = rid
            admits.append(Admit(rid, slot, req.seed, req.voice, req.speed))
        return tuple(admits)

    def _ready_chunks(self, now: float, awaiting: bool) -> list[tuple[Request, ChunkPlan]]:
        """Every request's next chunk that may be vocoded now (none of it in flight), most
        pressing first: streams about to run dry, then first chunks in arrival order, then by
        playout deadline. While first audio is due (``awaiting``, the plan's
        ``first_audio_priority``), later chunks wait unless their listener is about to run dry."""
        first_pending = self.fast_plan.first_audio_priority and awaiting
        ready: list[tuple[Request, ChunkPlan]] = []
        for req in self.requests.values():
            chunk = None if req.vocode_inflight is not None else self._vocode_candidate(req)
            if chunk is None:
                continue
            if first_pending and chunk.index > 0 and req.playout_deadline() - now >= self.urgent_s:
                continue  # its listener has audio for a while yet: after the first audio
            ready.append((req, chunk))

        def priority(rc: tuple[Request, ChunkPlan]) -> tuple[int, float, int]:
            req, chunk = rc
            order = self._order[req.request_id]
            if chunk.index == 0:
                return (1, 0.0, order)  # first chunks: time to first audio, in arrival order
            deadline = req.playout_deadline()
            # a stream about to run dry goes before new streams' first chunks
            return (0 if deadline - now < self.urgent_s else 2, deadline, order)

        return sorted(ready, key=priority)

    def _n_playing(self) -> int:
        """Streams that have had first audio and are not finished."""
        return sum(1 for r in self.requests.values() if r.first_audio_time is not None and not r.status.terminal)

    def _readies_first_chunk(self, req: Request, step: LlmStep) -> bool:
        """Whether the speech token ``step`` draws completes the tokens of ``req``'s first chunk
        (not planned yet): the plan after it may hold the request's steps for that chunk."""
        if req.first_chunk_plan_time is not None or (step.force is not None and step.force >= SPEECH_VOCAB):
            return False
        chunk = req.schedule.ready(len(req.speech_tokens) + 1, False)
        return chunk is not None and chunk.index == 0

    def _guess(self, req: Request, step: LlmStep, *, beside: bool) -> NextGuess | None:
        """The request's likely next step after ``step`` (``LlmWork.guess``), or None when it is
        unlikely to decode right after: a forced stop, or back-pressure about to pause it."""
        if step.force == FILL_TOKEN:
            after = req.feed.step_after(FILL_TOKEN)  # the next text group, if the text is there
            return NextGuess(after.inputs, after.allow_eos) if after is not None else None
        if step.force is not None and step.force >= SPEECH_VOCAB:
            return None  # EOS or another stop: the request's LLM ends
        if not self._can_decode(req, beside=beside, extra=1):
            return None  # this token brings it to its limit: the next plan pauses it
        return NextGuess(None, step.allow_eos)

    def _ordered(self, reqs: Iterable[Request]) -> list[Request]:
        return sorted(reqs, key=lambda r: self._order[r.request_id])

    def _force(self, req: Request, step: LlmStep) -> LlmStep:
        assert self.forced is not None
        n = len(req.speech_tokens)
        if step.allow_eos and n >= self.forced.tokens_per_text_token * req.n_text_ids:
            force = EOS_TOKEN
        else:
            force = self.forced.token(req.seed, n)
        return dataclasses.replace(step, force=force)

    # ---- results -----------------------------------------------------------------------------

    def _trace_first_audio(self, req: Request, audio: float) -> None:
        # text comes after the request; a request admitted before its first text waited for
        # no slot, and its LLM phase starts with the text
        start = req.first_text_time if req.first_text_time is not None else req.arrival_time
        admit = max(start, req.admit_time if req.admit_time is not None else start)
        planned = req.first_chunk_plan_time if req.first_chunk_plan_time is not None else audio
        ready = req.first_chunk_ready_time if req.first_chunk_ready_time is not None else planned
        ready = min(max(ready, admit), planned)
        steps = req.first_chunk_llm_steps or req.llm_steps
        trace = FirstAudioTrace(req.request_id, admit - start, ready - admit, planned - ready, audio - planned, steps)
        self.first_audio.append(trace)
        self.first_audio_count += 1

    def update(self, plan: StepPlan, result: StepResult) -> list[Output]:
        """Apply what the runner did; returns the outputs to deliver (chunks, ends)."""
        now = self.clock()
        for rid, message in result.failed.items():
            req = self.requests.get(rid)
            if req is not None:
                self._fail(req, StreamFailedError(message))

        for rid in result.flow_state:  # longer chunks where a chunk's cost does not grow with them
            req = self.requests.get(rid)
            if req is not None:
                self.hops.on_state(req.schedule)

        for work in plan.llm:
            req = self.requests.get(work.request_id)
            if req is not None:
                self._on_token(req, result.tokens.get(work.request_id), now)

        for rid, pcm in result.audio.items():
            req = self.requests.get(rid)
            if req is not None and req.vocode_inflight is not None:
                self._on_audio(req, pcm, now)
            # else: cancelled or failed while its chunk was in flight: the audio is dropped
        # a chunk neither returned nor reported in flight is lost: fail its request, never wait on it
        lost = [
            r for r in self.requests.values() if r.vocode_inflight is not None and r.request_id not in result.inflight
        ]
        for req in lost:
            self._fail(req, StreamFailedError("the runner returned no audio"))
        return self.take_outputs()

    def _on_token(self, req: Request, token: int | None, now: float) -> None:
        """The token the LLM picked for ``req`` this step (None: the runner returned none)."""
        if token is None:
            self._fail(req, StreamFailedError("the runner returned no token"))
            return
        req.llm_steps += 1
        req.history.append(token)
        outcome = req.feed.on_token(token)
        if outcome is TokenOutcome.SPEECH:
            req.speech_tokens.append(token)
            req.speech_text_end.append(req.chars_fed())
            req.alignment.on_speech_token(req.speech_text_end[-1], req.text_id_char_end)
            req.status = RequestStatus.RUNNING
            guard = self.config.max_speech_tokens_per_text_token
            if len(req.speech_tokens) >= guard * max(1, req.n_text_ids) and req.feed.final_phase:
                outcome = TokenOutcome.END  # a model that never stops (spec 2.7 quirk C)
        if req.feed.done:
            outcome = TokenOutcome.END  # the feed's own length guard or a stop token
        if outcome is TokenOutcome.END:
            if not req.speech_tokens:
                self.finish([req.request_id], RequestStatus.FINISHED)
                return
            self._llm_finished(req)
        if req.first_chunk_ready_time is None and req.speech_tokens:
            if req.schedule.ready(len(req.speech_tokens), req.llm_done) is not None:
                req.first_chunk_ready_time = now
                req.first_chunk_llm_steps = req.llm_steps

    def _on_audio(self, req: Request, pcm: np.ndarray, now: float) -> None:
        """The audio of ``req``'s chunk in flight: commit the chunk, emit the audio."""
        assert req.vocode_inflight is not None
        chunk, req.vocode_inflight = req.vocode_inflight, None
        req.schedule.commit(chunk)
        end = chunk.token_offset + chunk.hop_tokens
        text_end = req.speech_text_end[end - 1] if end > 0 else req.chars_fed()
        spoken = req.alignment.chunk(req.samples_produced, len(pcm), chunk.finalize, req.chars_received)
        pcm_chunk = PcmChunk(
            pcm=pcm, start_sample=req.samples_produced, text_end=text_end, final=chunk.finalize, alignment=spoken
        )
        req.samples_produced += len(pcm)
        req.chunks_produced += 1
        if req.first_audio_time is None:
            req.first_audio_time = now
            self._trace_first_audio(req, now)
        self._outputs.append(Emitted(req.request_id, pcm_chunk))
        if chunk.finalize:
            self.finish([req.request_id], RequestStatus.FINISHED)
