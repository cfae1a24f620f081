"""What crosses Ray between the voice_out front and a replica: plain frozen dataclasses,
pickled by Ray (no Ray import here).

Front -> replica: one :class:`UtteranceRequest` opens the streaming call; later
:class:`TextEvent` s travel through the front's text relay (:mod:`.relay`).
Replica -> front, on the call's stream: one :class:`Placed`, then ``(PcmChunk, sent_at)``
pairs, and at most one :class:`Failed` last.
"""

from __future__ import annotations

from dataclasses import dataclass

from voice_out.engine.api import (
    BadOptionError,
    EngineError,
    EngineFailedError,
    NoVoiceError,
    OverloadedError,
    StreamClosedError,
    StreamFailedError,
    TextTooLongError,
    UnknownVoiceError,
)

__all__ = ["EngineFailedError", "Failed", "Placed", "ReplicaInfo", "TextEvent", "UtteranceRequest", "error_of"]


@dataclass(frozen=True)
class UtteranceRequest:
    """Opens one utterance on a replica.

    ``text``: the deltas pushed before the call left (concatenated; often the whole text).
    ``ended``: ``end_text()`` came before the call left. Text after that arrives through the
    relay as :class:`TextEvent` s numbered from 0.
    ``ack_follows``: the front reports playback (``Ack`` events); otherwise the replica's engine
    counts a chunk as played when the replica hands it to Ray.
    """

    stream_id: str
    voice: str | None
    text: str = ""
    ended: bool = False
    seed: int | None = None
    fast_first: int | None = None
    #: CosyVoice2's instruct mode and token2wav speed (``EngineLike.open_stream``).
    instructions: str | None = None
    speed: float = 1.0
    ack_follows: bool = False


@dataclass(frozen=True)
class TextEvent:
    """One front -> replica event of an utterance: ``kind`` is ``text`` (``delta``), ``end``,
    or ``ack`` (``samples``: the listener has heard this many samples, monotone)."""

    kind: str
    delta: str = ""
    samples: int = 0


@dataclass(frozen=True)
class Placed:
    """First item of every call: which replica serves the utterance (its Serve replica id and
    the Ray actor's name)."""

    replica_id: str
    actor_name: str


@dataclass(frozen=True)
class Failed:
    """Last item of a call whose stream failed inside the replica: the engine error's stable
    ``code`` and message."""

    code: str
    message: str


@dataclass(frozen=True)
class ReplicaInfo:
    """What the front needs to know of the deployment (any replica answers the same)."""

    sample_rate: int
    builtin_voices: tuple[str, ...]
    default_voice: str | None
    first_hop_tokens: int
    max_text_chars: int
    #: ``engine.max_streams`` of the replicas: each one's capacity in the front's reports.
    max_streams: int


_ERRORS: dict[str, type[EngineError]] = {
    cls.code: cls
    for cls in (
        NoVoiceError,
        UnknownVoiceError,
        OverloadedError,
        TextTooLongError,
        BadOptionError,
        StreamClosedError,
        EngineFailedError,
    )
}


def error_of(failed: Failed) -> EngineError:
    """The front-side exception for a replica's :class:`Failed` (same code and message)."""
    cls = _ERRORS.get(failed.code, StreamFailedError)
    err = cls(failed.message)
    if cls is StreamFailedError and failed.code != StreamFailedError.code:
        err.code = failed.code  # an engine code this front does not know: keep it for the client
    return err
