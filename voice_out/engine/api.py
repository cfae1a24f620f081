"""The in-process API of the engine: what a transport (WebRTC session, CLI, benchmark, agent
adapter) sees. The real engine (``voice_out.engine.engine``) and test fakes both implement it.

Threads: every method here is called from the asyncio thread (or, for the plain-iterator use,
from any single non-worker thread). The GPU worker never calls into these objects; it posts
results through thread-safe queues.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, Self, runtime_checkable

import numpy as np

from voice_out.engine.alignment import Alignment
from voice_out.errors import VoiceOutError

SAMPLE_RATE = 24000
#: token2wav speed range of a stream (``open_stream(speed=...)``), OpenAI's.
MIN_SPEED, MAX_SPEED = 0.25, 4.0


class EngineError(VoiceOutError):
    """Base of errors the engine reports to a caller. ``code`` is the stable protocol code."""

    code = "internal"


class NoVoiceError(EngineError):
    code = "no_voice"


class UnknownVoiceError(EngineError):
    code = "unknown_voice"


class OverloadedError(EngineError):
    code = "overloaded"


class TextTooLongError(EngineError):
    code = "text_too_long"


class BadOptionError(EngineError, ValueError):
    """A stream option out of its range (e.g. ``fast_first``); also a ValueError, as an
    in-process caller passing a bad argument would expect."""

    code = "bad_field"


def check_speed(speed: float) -> float:
    """``speed`` as a float when it is a stream's token2wav speed (a finite number in
    [MIN_SPEED, MAX_SPEED]), else :class:`BadOptionError`."""
    if isinstance(speed, bool) or not isinstance(speed, int | float) or not MIN_SPEED <= speed <= MAX_SPEED:
        raise BadOptionError(f"speed = {speed!r} must be a number in [{MIN_SPEED}, {MAX_SPEED}]")
    return float(speed)


class StreamClosedError(EngineError):
    """Text pushed after ``end_text()`` or ``cancel()``."""

    code = "stream_closed"


class StreamFailedError(EngineError):
    """The stream failed inside the engine; other streams are unaffected."""

    code = "internal"


class EngineFailedError(StreamFailedError):
    """The engine that held the stream failed as a whole (its worker crashed, its process
    died): every stream on it ends with this error; a placement layer routes new streams to
    its other engines (docs/scale-out.md)."""

    code = "engine_failed"


class StreamState(enum.Enum):
    """Lifecycle of one stream (utterance). Terminal: FINISHED, ABORTED, FAILED."""

    WAITING = "waiting"  # opened, not yet admitted to a KV slot
    RUNNING = "running"  # admitted: prefill / decode / token2wav in progress
    FINISHED = "finished"  # every PCM chunk delivered
    ABORTED = "aborted"  # cancelled (barge-in)
    FAILED = "failed"  # an error inside the engine

    @property
    def terminal(self) -> bool:
        return self in (StreamState.FINISHED, StreamState.ABORTED, StreamState.FAILED)


@dataclass(frozen=True)
class PcmChunk:
    """One chunk of speech.

    ``pcm``: float32, shape (n,), mono, 24 kHz, values in [-1, 1].
    ``text_end``: number of characters of the stream's input text (the concatenation of every
    ``push_text`` delta, before normalization) that had been fed to the LLM when the last speech
    token of this chunk was generated. The transport uses it to report what was heard.
    ``start_sample``: position of the first sample within the utterance.
    ``final``: the last chunk of the stream.
    ``alignment``: the characters this chunk speaks and when (estimated from the bistream
    interleave, :mod:`voice_out.engine.alignment`); over a stream's chunks every input character
    appears exactly once, in order. None from engines that do not estimate it.
    """

    pcm: np.ndarray
    start_sample: int
    text_end: int
    final: bool = False
    alignment: Alignment | None = None

    @property
    def duration_s(self) -> float:
        return len(self.pcm) / SAMPLE_RATE


@runtime_checkable
class Stream(Protocol):
    """One utterance. Iterate it (async or plain) to receive :class:`PcmChunk` s in order.

    ``cancel()`` is idempotent, may be called at any stage, and ends the iteration promptly
    (no further chunks). A failure inside the engine ends the iteration with
    :class:`StreamFailedError`.
    """

    @property
    def id(self) -> str: ...

    @property
    def voice(self) -> str: ...

    @property
    def state(self) -> StreamState: ...

    @property
    def text(self) -> str:
        """All text pushed so far."""
        ...

    def push_text(self, delta: str) -> None: ...

    def end_text(self) -> None: ...

    def cancel(self) -> None: ...

    def ack(self, samples_played: int) -> None:
        """The listener has heard the first ``samples_played`` samples (24 kHz) of this stream;
        monotone. Only a stream opened with ``auto_ack=False`` needs it (the engine paces its
        look-ahead, ``engine.max_ahead_s``, on it); a no-op once the stream has ended."""
        ...

    def __aiter__(self) -> AsyncIterator[PcmChunk]: ...

    def __iter__(self) -> Iterator[PcmChunk]: ...


class EngineLike(Protocol):
    """What a transport (the WebRTC session, a compatibility API, a placement layer over several
    engines) needs from an engine. Every name here is a stable contract.

    Lifecycle: ``async with engine:`` starts it (worker up, warmed; ``ready`` turns true) and
    stops it (every open stream cancelled). A start failure raises out of ``__aenter__``.
    """

    @property
    def sample_rate(self) -> int:
        """Of every :class:`PcmChunk` (Hz)."""
        ...

    @property
    def ready(self) -> bool:
        """Warm and accepting streams."""
        ...

    def open_stream(
        self,
        voice: str | None = None,
        *,
        stream_id: str | None = None,
        seed: int | None = None,
        auto_ack: bool = True,
        fast_first: int | None = None,
        instructions: str | None = None,
        speed: float = 1.0,
    ) -> Stream:
        """Open a stream in ``voice`` (None: the configured default voice).

        ``stream_id``: the caller's name for it (logs, traces); None: the engine picks one.
        ``seed``: of the stream's sampling (None: the engine's own sequence or a random one).
        ``auto_ack``: True counts a chunk as played when the iterator hands it out; False when
        the caller buffers ahead of playback and reports what was heard with
        :meth:`Stream.ack`. ``fast_first``: speech tokens of a fast first chunk (0: upstream's
        first hop; None: the engine's configured default).
        ``instructions``: CosyVoice2's instruct mode ("speak happily", "用四川话说这句话"): the
        instruction, not normalized, plus ``<|endofprompt|>`` takes the place of the voice's
        prompt transcript in the LLM input and the prompt's speech tokens are left out (spec
        2.4, 6.8: ``inference_instruct2``); the flow keeps the voice's prompt (its timbre).
        ``speed``: token2wav speed in [0.25, 4] (spec 5.6): != 1 resamples the whole
        utterance's mel in time, so the stream's audio comes as ONE final chunk once the LLM
        has finished (no streaming).

        Raises NoVoiceError, UnknownVoiceError, OverloadedError, or BadOptionError (an option
        out of the engine's range; the message names it).
        """
        ...

    def voice_names(self) -> list[str]: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...
