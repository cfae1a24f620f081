"""The request record of the engine: one utterance as the scheduler sees it. No torch.

A :class:`Request` is created by the worker thread when a stream is opened and is owned by the
:class:`~voice_out.engine.scheduler.Scheduler` from then on; only the worker thread touches it.
Its life, mirroring vLLM's ``RequestStatus``::

    WAITING ──admit (KV slot)──► PREFILL ──first speech token──► RUNNING ──LLM done──► VOCODING
       │                            │                               │      (slot freed)   │
       └────────────── cancel: ABORTED / error: FAILED ◄────────────┴──────────────────────┤
                                                                                last chunk ▼
                                                                                    FINISHED

``PREFILL`` and ``RUNNING`` hold a KV slot; ``VOCODING`` does not (the LLM is done, only
token2wav chunks remain), so a slot is handed to the next waiting stream as soon as its
previous owner stops decoding.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from voice_out.engine.alignment import AlignmentTracker
from voice_out.engine.api import SAMPLE_RATE, StreamState
from voice_out.engine.chunk_schedule import ChunkPlan, ChunkSchedule
from voice_out.text.rows import Row

if TYPE_CHECKING:
    from torch import Tensor

#: Speech-token vocabulary (spec 2.1): ids below it are FSQ speech tokens.
SPEECH_VOCAB = 6561
EOS_TOKEN = 6561
UNUSED_STOP_TOKEN = 6562
FILL_TOKEN = 6563
STOP_TOKENS = frozenset((EOS_TOKEN, UNUSED_STOP_TOKEN, FILL_TOKEN))
#: 25 speech tokens per second, 2 mel frames per token, 480 samples per mel frame.
SAMPLES_PER_TOKEN = SAMPLE_RATE // 25


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Values >= FINISHED are terminal."""

    WAITING = 0  # opened, no KV slot yet
    PREFILL = 1  # holds a slot; prompt and text are being fed, no speech token yet
    RUNNING = 2  # holds a slot; decoding speech tokens (and vocoding them)
    VOCODING = 3  # LLM done and slot released; token2wav chunks remain
    FINISHED = 4  # every chunk delivered
    ABORTED = 5  # cancelled (barge-in)
    FAILED = 6  # an error inside the engine, this request only

    @property
    def terminal(self) -> bool:
        return self >= RequestStatus.FINISHED

    @property
    def holds_slot(self) -> bool:
        return self in (RequestStatus.PREFILL, RequestStatus.RUNNING)

    def stream_state(self) -> StreamState:
        """The public :class:`StreamState` this status shows as."""
        return _STREAM_STATE[self]


_STREAM_STATE = {
    RequestStatus.WAITING: StreamState.WAITING,
    RequestStatus.PREFILL: StreamState.RUNNING,
    RequestStatus.RUNNING: StreamState.RUNNING,
    RequestStatus.VOCODING: StreamState.RUNNING,
    RequestStatus.FINISHED: StreamState.FINISHED,
    RequestStatus.ABORTED: StreamState.ABORTED,
    RequestStatus.FAILED: StreamState.FAILED,
}


@dataclass(frozen=True)
class FlowVoice:
    """A voice's token2wav conditioning on the CPU: ``prompt_token`` int32 [P], ``prompt_feat``
    float32 [2P, 80], ``embedding`` float32 [D]. Made by the voice book (from a stored voice)
    or the engine's build (a random model's ``noise``); read by the runner alone."""

    prompt_token: Tensor
    prompt_feat: Tensor
    embedding: Tensor


@dataclass(frozen=True)
class VoicePrompt:
    """What the scheduler needs of a voice: token ids only (the tensors stay in the runner).

    ``prompt_text_ids``: the tokenized transcript of the prompt audio (seeds the text buffer).
    ``prompt_speech_ids``: the prompt's speech tokens for the LLM (interleaved into its input);
    ``flow_prompt_tokens`` sets the pad of the first token2wav chunk.
    """

    name: str
    prompt_text_ids: tuple[int, ...] = ()
    prompt_speech_ids: tuple[int, ...] = ()
    #: Flow prompt tokens P (may be fewer than the LLM's: the store cuts it to whole chunks).
    flow_prompt_tokens: int = 0
    #: The runner's conditioning for token2wav (None: a voice of token ids alone, which the
    #: runner refuses to admit). The scheduler never touches its tensors.
    flow: FlowVoice | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class TextPiece:
    """Text token ids released by the text pipeline, and the input characters they cover.

    ``char_end``: number of characters of the raw input (the concatenated deltas) consumed
    once these ids are fed.
    """

    ids: tuple[int, ...]
    char_end: int


class TextPipeline(Protocol):
    """Raw deltas -> normalized, tokenized pieces (per request; worker thread only)."""

    def push(self, delta: str) -> list[TextPiece]: ...

    def finish(self) -> list[TextPiece]: ...


@dataclass(frozen=True)
class LlmStep:
    """One LLM forward of one request: feed ``inputs`` (appended to its KV slot), then pick a
    token from the logits at the last position.

    ``allow_eos``: EOS may be sampled (the final phase). ``force``: the token to take instead of
    sampling (a forced FILL, or a scripted token in forced-tokens mode); the forward still runs
    because it appends ``inputs`` to the cache. ``voice_prefix``: on a request's first step, how
    many leading rows come from the voice alone (SOS, the prompt transcript and prompt speech
    before the first row of the request's own text): every request of the voice starts with
    them at the same positions, so the runner may reuse their K/V instead of computing them.
    """

    inputs: tuple[Row, ...]
    allow_eos: bool
    force: int | None = None
    voice_prefix: int = 0


class TokenOutcome(enum.Enum):
    SPEECH = "speech"  # a speech token: emit it
    FILL = "fill"  # the model asks for more text
    END = "end"  # the LLM is done with this request


class TextFeed(Protocol):
    """The text-in / speech-out interleave of one request (spec 2.7), as a pure state machine.

    The scheduler pushes text ids, asks what the LLM must do next, and reports each token.
    """

    def add_text(self, ids: Sequence[int]) -> None: ...

    def end_text(self) -> None: ...

    def next_step(self) -> LlmStep | None:
        """The next LLM forward, or None while waiting for text (or when done)."""
        ...

    def on_token(self, token: int) -> TokenOutcome: ...

    def step_after(self, token: int) -> LlmStep | None:
        """The step ``next_step`` would give once the outstanding step is answered with
        ``token`` and nothing else happens; changes nothing (a guess to plan ahead with)."""
        ...

    @property
    def text_fed(self) -> int:
        """How many of the request's text ids (prompt transcript excluded) were given to the
        LLM so far."""
        ...

    @property
    def done(self) -> bool: ...

    @property
    def final_phase(self) -> bool:
        """All text is in; the LLM speaks the rest until EOS."""
        ...


@dataclass
class Request:
    """One utterance inside the engine (worker thread only).

    Counters are in speech tokens, characters of raw input and samples at 24 kHz; times are
    seconds of the scheduler's clock.
    """

    request_id: str
    voice: VoicePrompt
    feed: TextFeed
    pipeline: TextPipeline
    schedule: ChunkSchedule
    seed: int
    arrival_time: float
    #: token2wav speed (!= 1: the schedule is ``whole``, one final chunk).
    speed: float = 1.0
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None

    # text side
    chars_received: int = 0
    text_ended: bool = False
    #: ``char_end`` of each text id handed to the feed, in order (prompt transcript excluded).
    text_id_char_end: list[int] = field(default_factory=list)
    first_text_time: float | None = None

    # LLM side
    #: Every token the LLM picked, FILL included (the repetition window of the sampler).
    history: list[int] = field(default_factory=list)
    #: Speech tokens only: what token2wav vocodes.
    speech_tokens: list[int] = field(default_factory=list)
    #: For each speech token, the input characters fed to the LLM when it was generated.
    speech_text_end: list[int] = field(default_factory=list)
    #: Character timings estimated from the interleave (voice_out.engine.alignment).
    alignment: AlignmentTracker = field(default_factory=AlignmentTracker)
    llm_steps: int = 0
    llm_done: bool = False

    # audio side
    samples_produced: int = 0
    samples_consumed: int = 0
    chunks_produced: int = 0
    #: The token2wav chunk handed to the runner whose audio has not come back yet (a pipelined
    #: runner returns it in a later step); no other chunk of the request is planned meanwhile.
    vocode_inflight: ChunkPlan | None = None
    first_audio_time: float | None = None
    finish_time: float | None = None
    # where the time to first audio goes (FirstAudioTrace): admitted to a KV slot, the first
    # chunk's tokens all made, that chunk handed to the runner
    admit_time: float | None = None
    first_chunk_ready_time: float | None = None
    first_chunk_plan_time: float | None = None
    first_chunk_llm_steps: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.status.terminal

    @property
    def n_text_ids(self) -> int:
        return len(self.text_id_char_end)

    def chars_fed(self) -> int:
        """Raw input characters whose text ids the LLM has been given."""
        n = self.feed.text_fed
        return self.text_id_char_end[n - 1] if n > 0 else 0

    def ahead_samples(self) -> int:
        """Audio made (or decided, as tokens not yet vocoded) ahead of the consumer."""
        pending = len(self.speech_tokens) - self.schedule.offset
        return self.samples_produced + pending * SAMPLES_PER_TOKEN - self.samples_consumed

    def buffered_samples(self) -> int:
        """Audio delivered but not yet consumed."""
        return self.samples_produced - self.samples_consumed

    def playout_deadline(self) -> float:
        """When the consumer runs out of audio if it plays in real time from the first chunk.

        Before the first chunk there is no deadline (first chunks go first anyway).
        """
        if self.first_audio_time is None:
            return float("-inf")
        return self.first_audio_time + self.samples_produced / SAMPLE_RATE
