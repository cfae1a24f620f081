"""Data-channel protocol v1: the message vocabulary, parsing and serialization.

Every message is one JSON object (a text message on the data channel ``voice_out`` or on the
control WebSocket) with a ``"type"`` field. Client messages are parsed with :func:`parse`, which
returns a frozen dataclass or raises :class:`ProtocolError` carrying a stable :class:`ErrorCode`.
Server messages are frozen dataclasses turned into JSON text with :func:`dumps`.

Interruptibility is part of the type: :class:`Cancel` is an :class:`InterruptMessage`, handled
the moment it arrives, ahead of anything else; :class:`TextDelta` / :class:`TextDone` are
:class:`DataMessage` s, applied in arrival order. Unknown extra fields are ignored so that
clients can be newer than the server.

Pure logic: no I/O, no asyncio; any thread may call it.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from voice_out.engine.api import MAX_SPEED, MIN_SPEED
from voice_out.engine.voicebook import MAX_INSTRUCTION_CHARS
from voice_out.errors import VoiceOutError

PROTOCOL_VERSION = 1
#: Channel label the client creates before its offer.
CHANNEL_LABEL = "voice_out"
#: Longest utterance id (characters).
MAX_ID_CHARS = 128
#: Largest message accepted (bytes of UTF-8 JSON); a delta is meant to be a few tokens.
MAX_MESSAGE_BYTES = 64 * 1024
#: Longest voice name on a text.delta.
MAX_VOICE_CHARS = 128
#: Largest ``fast_first`` a text.delta may name (the engine's own limit is lower: below its
#: first hop, 25 tokens by default); guards the integer before it reaches the engine.
MAX_FAST_FIRST = 1000
#: Longest ``instructions`` a text.delta may carry: the engine's own limit (every character is LLM prompt).
MAX_INSTRUCTIONS_CHARS = MAX_INSTRUCTION_CHARS


class ErrorCode(enum.StrEnum):
    """Stable error codes of the ``error`` message (and of HTTP error bodies)."""

    BAD_JSON = "bad_json"  # not JSON, not an object, or a binary message
    MESSAGE_TOO_LARGE = "message_too_large"  # over MAX_MESSAGE_BYTES
    UNKNOWN_TYPE = "unknown_type"
    MISSING_FIELD = "missing_field"
    BAD_FIELD = "bad_field"  # a field of the wrong type or out of range
    TEXT_TOO_LONG = "text_too_long"  # the utterance's text would exceed the limit
    TOO_MANY_UTTERANCES = "too_many_utterances"  # over server.max_queued_utterances
    UNKNOWN_ID = "unknown_id"  # text.done / cancel naming an utterance never started
    UTTERANCE_CLOSED = "utterance_closed"  # text for an utterance already done, cancelled or failed
    UNKNOWN_VOICE = "unknown_voice"
    NO_VOICE = "no_voice"  # no voice named and no default voice configured
    VOICE_UNUSABLE = "voice_unusable"  # a registered voice that cannot be loaded (damaged, other model)
    OVERLOADED = "overloaded"  # the engine has no capacity for another stream now
    NOT_READY = "not_ready"  # the engine is starting or stopping
    INTERNAL = "internal"  # a failure inside the server or engine; the session goes on
    SHUTTING_DOWN = "shutting_down"  # the server is stopping: the session ends after this message
    ENGINE_FAILED = "engine_failed"  # the engine (GPU) holding the utterance failed; others go on


class ProtocolError(VoiceOutError):
    """A client message that cannot be applied. ``id`` is the utterance it concerns, if known."""

    def __init__(self, code: ErrorCode, message: str, id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.id = id


# --------------------------------------------------------------------------------------------
# Client -> server


@dataclass(frozen=True)
class ClientMessage:
    """Base of every client message."""


@dataclass(frozen=True)
class DataMessage(ClientMessage):
    """Applied in arrival order."""


@dataclass(frozen=True)
class InterruptMessage(ClientMessage):
    """Applied at once, ahead of queued work: it drops audio that has not been played."""


@dataclass(frozen=True)
class TextDelta(DataMessage):
    """Append ``delta`` to utterance ``id``; a new id starts an utterance in ``voice``, with a
    first chunk of ``fast_first`` speech tokens when set (0: upstream's; None: the server's
    ``engine.fast_first_tokens``), ``audio.alignment`` events when ``alignment`` is set,
    CosyVoice2's ``instructions`` (instruct mode) and token2wav ``speed`` (None: 1; != 1: the
    utterance's audio comes in one piece once all of it is made)."""

    id: str
    delta: str
    voice: str | None = None
    fast_first: int | None = None
    alignment: bool = False
    instructions: str | None = None
    speed: float | None = None


@dataclass(frozen=True)
class TextDone(DataMessage):
    """No more text for ``id``."""

    id: str


@dataclass(frozen=True)
class Cancel(InterruptMessage):
    """Barge-in: stop everything (``id`` None) or ``id`` and every utterance started after it."""

    id: str | None = None


@dataclass(frozen=True)
class Ping(DataMessage):
    """Answered by :class:`Pong` with the same ``t``."""

    t: float | int


# --------------------------------------------------------------------------------------------
# Server -> client


@dataclass(frozen=True)
class ServerMessage:
    """Base of every server message; ``TYPE`` is the wire ``"type"``."""

    TYPE = ""


@dataclass(frozen=True)
class SessionReady(ServerMessage):
    TYPE = "session.ready"
    session_id: str
    sample_rate: int
    voices: tuple[str, ...]


@dataclass(frozen=True)
class AudioStarted(ServerMessage):
    TYPE = "audio.started"
    id: str
    ttfa_ms: float


@dataclass(frozen=True)
class AudioDone(ServerMessage):
    TYPE = "audio.done"
    id: str
    audio_ms: float


@dataclass(frozen=True)
class Cancelled(ServerMessage):
    TYPE = "cancelled"
    id: str
    played_ms: float
    played_text: str


@dataclass(frozen=True)
class AudioAlignment(ServerMessage):
    """The characters of a chunk of ``id`` that went into the track's queue, and when each is
    spoken: ms from the utterance's first sample (an estimate: docs/agents.md, "Alignment")."""

    TYPE = "audio.alignment"
    id: str
    chars: str
    char_start_ms: tuple[float, ...]
    char_duration_ms: tuple[float, ...]


@dataclass(frozen=True)
class Error(ServerMessage):
    TYPE = "error"
    id: str | None
    code: str
    message: str


@dataclass(frozen=True)
class Pong(ServerMessage):
    TYPE = "pong"
    t: float | int


SERVER_TYPES: dict[str, type[ServerMessage]] = {
    cls.TYPE: cls for cls in (SessionReady, AudioStarted, AudioDone, AudioAlignment, Cancelled, Error, Pong)
}


def to_dict(msg: ServerMessage) -> dict[str, Any]:
    """The wire object of a server message (``type`` first)."""
    body = asdict(msg)
    if isinstance(msg, SessionReady):
        body["voices"] = list(msg.voices)
    if isinstance(msg, AudioAlignment):
        body["char_start_ms"] = [round(float(t), 1) for t in msg.char_start_ms]
        body["char_duration_ms"] = [round(float(t), 1) for t in msg.char_duration_ms]
    for key in ("ttfa_ms", "audio_ms", "played_ms"):
        if key in body:
            body[key] = round(float(body[key]), 3)
    return {"type": msg.TYPE, **body}


def dumps(msg: ServerMessage) -> str:
    """Serialize a server message to JSON text, always encodable as UTF-8: a lone surrogate
    (which :func:`parse` refuses, so only a bug could bring one here) is written as a JSON
    ``\\uXXXX`` escape rather than break the transport's encoding."""
    body = to_dict(msg)
    text = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    if has_surrogate(text):
        text = json.dumps(body, ensure_ascii=True, separators=(",", ":"))
    return text


def has_surrogate(text: str) -> bool:
    """Whether ``text`` holds a UTF-16 surrogate code point (JSON's ``\\ud800``), which is not
    Unicode text: UTF-8 cannot encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def is_high_surrogate(ch: str) -> bool:
    return "\ud800" <= ch <= "\udbff"


def is_low_surrogate(ch: str) -> bool:
    return "\udc00" <= ch <= "\udfff"


def _check_delta_surrogates(delta: str, uid: str) -> None:
    """A delta may start with a low surrogate and end with a high one: JavaScript slices strings
    by UTF-16 unit, so a character outside the BMP (an emoji) can be split across two deltas
    (the session joins them). A surrogate anywhere else is not text."""
    if not has_surrogate(delta):
        return
    last = len(delta) - 1
    for i, ch in enumerate(delta):
        if is_high_surrogate(ch) and i != last or is_low_surrogate(ch) and i != 0:
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"text.delta: 'delta' holds a lone surrogate {ch!r} at {i}: not Unicode text "
                "(only a character split across two deltas may leave one at an end)",
                uid,
            )


def error_from(exc: ProtocolError) -> Error:
    return Error(id=exc.id, code=str(exc.code), message=exc.message)


# --------------------------------------------------------------------------------------------
# Parsing


def _field(obj: dict[str, Any], name: str, mtype: str, id: str | None = None) -> Any:
    if name not in obj:
        raise ProtocolError(ErrorCode.MISSING_FIELD, f"{mtype}: missing field {name!r}", id)
    return obj[name]


def _id(obj: dict[str, Any], mtype: str, *, required: bool = True) -> str | None:
    if not required and obj.get("id") is None:
        return None
    value = _field(obj, "id", mtype)
    if not isinstance(value, str) or not value or has_surrogate(value):
        raise ProtocolError(
            ErrorCode.BAD_FIELD, f"{mtype}: 'id' must be a non-empty string of Unicode text, got {value!r:.40}"
        )
    if len(value) > MAX_ID_CHARS:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{mtype}: 'id' is longer than {MAX_ID_CHARS} characters")
    return value


def parse(text: str | bytes) -> ClientMessage:
    """Parse one client message. Raises :class:`ProtocolError` with a stable code."""
    if isinstance(text, bytes | bytearray):
        raise ProtocolError(ErrorCode.BAD_JSON, "binary messages are not part of the protocol; send JSON text")
    if len(text) > MAX_MESSAGE_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_MESSAGE_BYTES:
        raise ProtocolError(ErrorCode.MESSAGE_TOO_LARGE, f"message larger than {MAX_MESSAGE_BYTES} bytes")
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise ProtocolError(ErrorCode.BAD_JSON, f"message is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_JSON, f"message must be a JSON object, got {type(obj).__name__}")
    mtype = obj.get("type")
    if mtype is None:
        raise ProtocolError(ErrorCode.MISSING_FIELD, "message has no 'type'")
    if not isinstance(mtype, str):
        raise ProtocolError(ErrorCode.BAD_FIELD, f"'type' must be a string, got {type(mtype).__name__}")

    if mtype == "text.delta":
        uid = _id(obj, mtype)
        delta = _field(obj, "delta", mtype, uid)
        if not isinstance(delta, str):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"text.delta: 'delta' must be a string, got {delta!r:.40}", uid)
        assert uid is not None
        _check_delta_surrogates(delta, uid)
        voice = obj.get("voice")
        if voice is not None and (
            not isinstance(voice, str) or not voice or len(voice) > MAX_VOICE_CHARS or has_surrogate(voice)
        ):
            raise ProtocolError(
                ErrorCode.BAD_FIELD, f"text.delta: 'voice' must be a voice name, got {voice!r:.40}", uid
            )
        fast_first = obj.get("fast_first")
        if fast_first is not None and (type(fast_first) is not int or not 0 <= fast_first <= MAX_FAST_FIRST):
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"text.delta: 'fast_first' must be a whole number of speech tokens, got {fast_first!r:.40}",
                uid,
            )
        alignment = obj.get("alignment", False)
        if type(alignment) is not bool:
            raise ProtocolError(
                ErrorCode.BAD_FIELD, f"text.delta: 'alignment' must be true or false, got {alignment!r:.40}", uid
            )
        instructions = obj.get("instructions")
        if instructions is not None and (
            not isinstance(instructions, str)
            or not instructions.strip()
            or len(instructions) > MAX_INSTRUCTIONS_CHARS
            or has_surrogate(instructions)
        ):
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"text.delta: 'instructions' must be a non-empty string of at most {MAX_INSTRUCTIONS_CHARS} "
                f"characters, got {instructions!r:.40}",
                uid,
            )
        speed = obj.get("speed")
        if speed is not None and (
            isinstance(speed, bool) or not isinstance(speed, int | float) or not MIN_SPEED <= speed <= MAX_SPEED
        ):
            raise ProtocolError(
                ErrorCode.BAD_FIELD,
                f"text.delta: 'speed' must be a number in [{MIN_SPEED}, {MAX_SPEED}], got {speed!r:.40}",
                uid,
            )
        return TextDelta(
            id=uid,
            delta=delta,
            voice=voice,
            fast_first=fast_first,
            alignment=alignment,
            instructions=instructions,
            speed=None if speed is None else float(speed),
        )
    if mtype == "text.done":
        uid = _id(obj, mtype)
        assert uid is not None
        return TextDone(id=uid)
    if mtype == "cancel":
        return Cancel(id=_id(obj, mtype, required=False))
    if mtype == "ping":
        t = _field(obj, "t", mtype)
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"ping: 't' must be a number, got {t!r:.40}")
        return Ping(t=t)
    raise ProtocolError(
        ErrorCode.UNKNOWN_TYPE,
        f"unknown message type {mtype!r:.40}; expected text.delta, text.done, cancel or ping",
    )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_server(text: str) -> ServerMessage:
    """Parse a server message (for clients). Raises ValueError on anything malformed."""
    obj = json.loads(text)
    if not isinstance(obj, dict) or obj.get("type") not in SERVER_TYPES:
        raise ValueError(f"not a protocol v1 server message: {text[:80]!r}")
    cls = SERVER_TYPES[obj.pop("type")]
    known = {f.name for f in fields(cls)}
    kwargs = {k: v for k, v in obj.items() if k in known}
    if cls is SessionReady:
        kwargs["voices"] = tuple(kwargs.get("voices", ()))
    if cls is AudioAlignment:
        for key in ("char_start_ms", "char_duration_ms"):
            kwargs[key] = tuple(kwargs.get(key, ()))
    return cls(**kwargs)
