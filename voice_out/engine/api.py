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
from typing import Protocol, runtime_checkable

import numpy as np

from voice_out.errors import VoiceOutError

SAMPLE_RATE = 24000


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


class StreamClosedError(EngineError):
    """Text pushed after ``end_text()`` or ``cancel()``."""

    code = "stream_closed"


class StreamFailedError(EngineError):
    """The stream failed inside the engine; other streams are unaffected."""

    code = "internal"


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
    """

    pcm: np.ndarray
    start_sample: int
    text_end: int
    final: bool = False

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

    def __aiter__(self) -> AsyncIterator[PcmChunk]: ...

    def __iter__(self) -> Iterator[PcmChunk]: ...


class EngineLike(Protocol):
    """What a transport needs from an engine."""

    @property
    def sample_rate(self) -> int: ...

    @property
    def ready(self) -> bool:
        """Warm and accepting streams."""
        ...

    def open_stream(self, voice: str | None = None, *, stream_id: str | None = None) -> Stream:
        """Open a stream in ``voice`` (None: the configured default voice).

        Raises NoVoiceError, UnknownVoiceError or OverloadedError.
        """
        ...

    def voice_names(self) -> list[str]: ...
