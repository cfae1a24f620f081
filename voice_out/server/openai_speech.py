"""``POST /v1/audio/speech``: OpenAI's speech endpoint, a thin adapter of the engine API.

An agent written against OpenAI's client (``client.audio.speech.create`` or
``with_streaming_response``) points ``base_url`` at voice_out and gets this engine's speech:

=================  =============================================================================
request field      here
=================  =============================================================================
``model``          required string; any value (voice_out serves one model)
``input``          required, 1 .. ``engine.max_text_chars`` characters
``voice``          required: a registered voice name, or ``{"id": name}``; ``default``: the
                   server's default voice; OpenAI's built-in names
                   (``alloy`` ...) are not voices here and get 400 listing the registered ones
``response_format``  ``mp3`` (default, as OpenAI's), ``opus``, ``aac``, ``flac``, ``wav``, ``pcm``
                   (24 kHz s16le mono); one whose encoder the PyAV build lacks gets 400
``speed``          0.25 .. 4.0 (default 1): CosyVoice2's token2wav speed, which needs the whole
                   utterance before its first sample (the mel is resampled in time, spec 5.6);
                   != 1 is refused with ``stream_format`` set (400), and without it the audio
                   comes in one piece once made
``instructions``   CosyVoice2's instruct mode: e.g. "Speak happily" (``engine.open_stream``)
``stream_format``  ``audio``: the bytes of each engine chunk as it is made (also the behaviour
                   when omitted, at speed 1); ``sse``: ``data: {"type": "speech.audio.delta",
                   "audio": <base64>}`` per chunk, then ``{"type": "speech.audio.done",
                   "usage": {...}}``
=================  =============================================================================

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, auth (the
bearer token of ``server.auth_token``) included. A failure after audio has started cannot change
the status: an ``sse`` stream gets an ``error`` event, an ``audio`` stream is cut without its
terminating chunk (a client sees a truncated body, never a short "complete" one).

Cancellation: a client that hangs up cancels the engine stream (its KV slot and token2wav work
are freed at the worker's next step). aiohttp does not cancel handlers on disconnect, so the
route's one :class:`DisconnectWatch` checks the connections every :data:`DISCONNECT_POLL_S` while
their handlers wait for the engine.

Threads: asyncio thread only; costly encoders (``AudioEncoder.heavy``) run in the default
executor.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from voice_out.engine.api import (
    MAX_SPEED,
    MIN_SPEED,
    SAMPLE_RATE,
    BadOptionError,
    EngineError,
    EngineLike,
    NoVoiceError,
    OverloadedError,
    PcmChunk,
    Stream,
    StreamFailedError,
    StreamState,
    UnknownVoiceError,
)
from voice_out.engine.voicebook import MAX_INSTRUCTION_CHARS
from voice_out.server.audio_encode import AudioEncoder, UnsupportedFormatError, available_formats, make_encoder
from voice_out.server.body import HttpError, read_body
from voice_out.server.metrics import Metrics

log = logging.getLogger(__name__)

ROUTE = "/v1/audio/speech"
ROUTE_NAME = "openai_speech"
#: The ``voice`` that names ``server.default_voice`` (the ElevenLabs routes' ``voice_id`` too).
DEFAULT_VOICE = "default"
#: OpenAI's ``response_format`` values -> our encoder's format name.
RESPONSE_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
STREAM_FORMATS = ("audio", "sse")
#: A request body: ``input`` of 4,000 characters of 4-byte UTF-8 is 16 KB; JSON escapes (\uXXXX)
#: can make it 6 times that.
MAX_BODY_BYTES = 128 * 1024
#: How often a handler waiting on the engine checks that its client is still there (s).
DISCONNECT_POLL_S = 0.02
#: Speech tokens per second of (speed-1) audio: the ``output_tokens`` of ``usage``.
SPEECH_TOKENS_PER_S = 25


class SpeechRequestError(Exception):
    """A request OpenAI's API would refuse: ``status``, and the error object's fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        return openai_error(
            self.status, self.message, param=self.param, code=self.code, type_=self.type, headers=headers
        )


def openai_error(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    type_: str = "invalid_request_error",
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def server_error(status: int, code: str, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    """A refusal of the server's own (auth, no route, wrong method, a failure) in OpenAI's
    shape: ``voice_out.server.app``'s error-shape hook for this API's paths."""
    if status == 401:
        code = "invalid_api_key"  # what OpenAI answers a wrong key with
    type_ = "server_error" if status >= 500 else "invalid_request_error"
    return openai_error(status, message, code=code, type_=type_, headers=headers)


@dataclass(frozen=True)
class SpeechRequest:
    """A validated request. ``stream_format`` None: the client named none."""

    model: str
    input: str
    voice: str
    response_format: str = "mp3"
    speed: float = 1.0
    instructions: str | None = None
    stream_format: str | None = None

    @property
    def streamed(self) -> bool:
        """The client asked for streaming, or takes it by default (speed 1)."""
        return self.stream_format is not None or self.speed == 1.0


def parse_speech_request(body: Any, *, max_input_chars: int) -> SpeechRequest:
    """Validate a decoded JSON body; raise :class:`SpeechRequestError` naming the field.
    Unknown fields are ignored (a newer client may send more)."""
    if not isinstance(body, dict):
        raise SpeechRequestError(400, "the request body must be a JSON object", code="invalid_json")
    for name in ("model", "input", "voice"):
        if name not in body:
            raise SpeechRequestError(
                400, f"missing required parameter: {name!r}", param=name, code="missing_required_parameter"
            )
    model, text, voice = body["model"], body["input"], body["voice"]
    if not isinstance(model, str) or not model:
        raise SpeechRequestError(400, "'model' must be a non-empty string", param="model", code="invalid_type")
    if not isinstance(text, str):
        raise SpeechRequestError(400, "'input' must be a string", param="input", code="invalid_type")
    if not text.strip():
        raise SpeechRequestError(400, "'input' is empty: give the text to speak", param="input", code="empty_string")
    if len(text) > max_input_chars:
        raise SpeechRequestError(
            400,
            f"'input' is {len(text)} characters; this server takes at most {max_input_chars} (engine.max_text_chars)",
            param="input",
            code="string_above_max_length",
        )
    if isinstance(voice, dict) and set(voice) == {"id"}:
        voice = voice["id"]
    if not isinstance(voice, str) or not voice:
        raise SpeechRequestError(
            400, "'voice' must be a voice name or {\"id\": name}", param="voice", code="invalid_type"
        )
    fmt = body.get("response_format", "mp3")
    if fmt not in RESPONSE_FORMATS:
        raise SpeechRequestError(
            400,
            f"'response_format' {fmt!r} is not one of {', '.join(RESPONSE_FORMATS)}",
            param="response_format",
            code="invalid_value",
        )
    if fmt not in available_formats():
        raise SpeechRequestError(
            400,
            f"'response_format' {fmt!r} needs an encoder this server's PyAV build lacks; it has: "
            f"{', '.join(f for f in RESPONSE_FORMATS if f in available_formats())}",
            param="response_format",
            code="unsupported_value",
        )
    speed = body.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, int | float) or not math.isfinite(speed):
        raise SpeechRequestError(400, "'speed' must be a number", param="speed", code="invalid_type")
    if not MIN_SPEED <= speed <= MAX_SPEED:
        raise SpeechRequestError(
            400, f"'speed' {speed} is outside {MIN_SPEED} .. {MAX_SPEED}", param="speed", code="invalid_value"
        )
    stream_format = body.get("stream_format")
    if stream_format is not None and stream_format not in STREAM_FORMATS:
        raise SpeechRequestError(
            400,
            f"'stream_format' {stream_format!r} is not one of {', '.join(STREAM_FORMATS)}",
            param="stream_format",
            code="invalid_value",
        )
    if stream_format is not None and speed != 1.0:
        raise SpeechRequestError(
            400,
            f"'speed' {speed} cannot stream: CosyVoice2 changes speed by resampling the whole utterance's mel, "
            "so no sample exists before the last token; omit 'stream_format' (the audio then comes in one "
            "piece once made) or use speed 1",
            param="speed",
            code="unsupported_value",
        )
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise SpeechRequestError(400, "'instructions' must be a string", param="instructions", code="invalid_type")
        if len(instructions) > MAX_INSTRUCTION_CHARS:
            raise SpeechRequestError(
                400,
                f"'instructions' is {len(instructions)} characters; at most {MAX_INSTRUCTION_CHARS}",
                param="instructions",
                code="string_above_max_length",
            )
        instructions = instructions.strip() or None
    return SpeechRequest(model, text, voice, fmt, float(speed), instructions, stream_format)


async def _read_body(request: web.Request, timeout_s: float) -> bytes:
    """The body, read as every route reads one (``voice_out.server.body``): refused beyond
    :data:`MAX_BODY_BYTES` read, whatever Content-Length says (a chunked body has none), and
    when it takes over ``timeout_s`` to arrive; the refusals in OpenAI's shape."""
    try:
        return await read_body(request, MAX_BODY_BYTES, "request body", timeout_s)
    except HttpError as e:
        code = {413: "request_too_large", 408: "request_timeout"}.get(e.status, e.code)
        raise SpeechRequestError(e.status, e.message, code=code) from None


def _decode_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise SpeechRequestError(
            400,
            "the request body is not valid JSON: send Content-Type: application/json with "
            '{"model": ..., "input": ..., "voice": ...}',
            code="invalid_json",
        ) from None


def _engine_error(e: EngineError) -> SpeechRequestError:
    if isinstance(e, UnknownVoiceError | NoVoiceError):
        return SpeechRequestError(400, str(e), param="voice", code="unknown_voice")
    if isinstance(e, OverloadedError):
        return SpeechRequestError(503, str(e), code="overloaded", type_="server_error")
    if isinstance(e, BadOptionError):
        return SpeechRequestError(400, str(e), code="invalid_value")
    return SpeechRequestError(400, str(e), code=e.code)


def _media_type(req: SpeechRequest, encoder: AudioEncoder) -> str:
    return "text/event-stream" if req.stream_format == "sse" else encoder.media_type


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


class _ClientGone(Exception):
    """The client closed the connection."""


class DisconnectWatch:
    """Tells the handlers waiting on the engine that their client has gone: one timer for all
    of them, every :data:`DISCONNECT_POLL_S`, instead of one per request (16 concurrent
    requests made 800 event-loop wake-ups a second, each one a GIL hand-over from the engine's
    worker thread). aiohttp tells a handler nothing when its client leaves unless the server
    cancels handlers, hence the polling. One per :class:`SpeechHandler`; asyncio thread only.
    """

    def __init__(self, period_s: float = DISCONNECT_POLL_S) -> None:
        self.period_s = period_s
        self._watched: dict[asyncio.Future[None], web.Request] = {}
        self._task: asyncio.Task[None] | None = None

    def gone(self, request: web.Request) -> asyncio.Future[None]:
        """A future resolved once ``request``'s connection is closed; pass it to :meth:`forget`
        when the response is done."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._watched[fut] = request
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        return fut

    def forget(self, fut: asyncio.Future[None]) -> None:
        self._watched.pop(fut, None)
        fut.cancel()

    @property
    def watching(self) -> int:
        return len(self._watched)

    async def _run(self) -> None:
        try:
            while self._watched:
                await asyncio.sleep(self.period_s)
                for fut, request in list(self._watched.items()):
                    transport = request.transport
                    if transport is None or transport.is_closing():
                        del self._watched[fut]
                        if not fut.done():
                            fut.set_result(None)
        finally:
            self._task = None


class SpeechHandler:
    """The route's handler, holding what it needs of the server: the engine, the input limit,
    the metrics, and whether the server admits work now (not while shutting down). One
    instance per app; asyncio thread only."""

    def __init__(
        self,
        engine: EngineLike,
        metrics: Metrics,
        *,
        max_input_chars: int,
        accepting: Callable[[], bool],
        body_timeout_s: float,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_input_chars = max_input_chars
        self.accepting = accepting
        self.body_timeout_s = body_timeout_s
        self.watch = DisconnectWatch()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        received = time.perf_counter()
        metrics = self.metrics
        try:
            raw = await _read_body(request, self.body_timeout_s)
            req = parse_speech_request(_decode_json(raw), max_input_chars=self.max_input_chars)
            if not self.engine.ready or not self.accepting():
                raise SpeechRequestError(
                    503, "the engine is not ready (starting or shutting down)", code="unavailable", type_="server_error"
                )
            encoder = make_encoder(req.response_format, SAMPLE_RATE)
        except SpeechRequestError as e:
            metrics.api_requests.labels("openai", str(e.status)).inc()
            return e.response({"Retry-After": "1"} if e.status == 503 else None)
        except UnsupportedFormatError as e:  # available, yet the encoder refused: say why
            metrics.api_requests.labels("openai", "400").inc()
            return openai_error(400, str(e), param="response_format", code="unsupported_value")
        try:
            try:
                voice = None if req.voice == DEFAULT_VOICE else req.voice
                stream = self.engine.open_stream(voice, instructions=req.instructions, speed=req.speed)
            except EngineError as e:
                err = _engine_error(e)
                metrics.api_requests.labels("openai", str(err.status)).inc()
                return err.response({"Retry-After": "1"} if err.status == 503 else None)
            metrics.utterances.inc()
            metrics.active_streams.inc()
            try:
                return await self._speak(request, req, stream, encoder, received)
            finally:
                stream.cancel()  # no-op once finished; frees the GPU work on any other exit
                metrics.active_streams.dec()
        finally:
            encoder.close()

    def _gone(self, stream: Stream, samples: int) -> None:
        stream.cancel()
        self.metrics.api_requests.labels("openai", "499").inc()  # nginx's "client closed request"
        log.info("openai speech: client went away after %d samples; stream %s cancelled", samples, stream.id)

    async def _speak(
        self, request: web.Request, req: SpeechRequest, stream: Stream, encoder: AudioEncoder, received: float
    ) -> web.StreamResponse:
        metrics = self.metrics
        stream.push_text(req.input)
        stream.end_text()
        resp = web.StreamResponse(
            status=200, headers={"Content-Type": _media_type(req, encoder), "Cache-Control": "no-cache"}
        )
        sse = req.stream_format == "sse"
        loop = asyncio.get_running_loop()
        samples = 0
        #: the encode running in the executor: the encoder is closed only once it has returned
        #: (FFmpeg state is not for two threads at once), also when the client left meanwhile
        inflight: asyncio.Future[bytes] | None = None

        async def encode(pcm: Any | None) -> bytes:
            nonlocal inflight
            if not encoder.heavy:
                return encoder.flush() if pcm is None else encoder.encode(pcm)
            args = () if pcm is None else (pcm,)
            inflight = loop.run_in_executor(None, encoder.flush if pcm is None else encoder.encode, *args)
            return await asyncio.shield(inflight)

        async def send(data: bytes) -> None:
            if not data:
                return
            if not resp.prepared:
                await resp.prepare(request)
                metrics.api_first_audio.labels("openai").observe(time.perf_counter() - received)
            await resp.write(
                _sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}) if sse else data
            )

        async def produce() -> None:
            nonlocal samples
            chunk: PcmChunk
            async for chunk in stream:
                samples += len(chunk.pcm)
                await send(await encode(chunk.pcm))
            if stream.state is StreamState.ABORTED:  # not by us: the engine is stopping
                raise StreamFailedError("the server is shutting down; the utterance was cut")
            await send(await encode(None))

        gone = self.watch.gone(request)
        work = asyncio.ensure_future(produce())
        try:
            await asyncio.wait({gone, work}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                raise _ClientGone
            work.result()  # raises what the production raised
        except (_ClientGone, ConnectionResetError):
            self._gone(stream, samples)
            return resp if resp.prepared else web.Response(status=499)
        except asyncio.CancelledError:  # a server run with handler_cancellation: the client left
            self._gone(stream, samples)
            raise
        except StreamFailedError as e:
            stream.cancel()
            metrics.errors.labels("internal").inc()
            metrics.api_requests.labels("openai", "500").inc()
            if not resp.prepared:
                return openai_error(500, f"synthesis failed: {e}", code="internal", type_="server_error")
            if sse:
                err = {"type": "error", "error": {"message": f"synthesis failed: {e}", "type": "server_error"}}
                with contextlib.suppress(ConnectionResetError):
                    await resp.write(_sse(err))
                    await resp.write_eof()
                return resp
            # an audio body cannot say "failed": cut the connection so it is not taken as complete
            if request.transport is not None:
                request.transport.abort()
            return resp
        finally:
            self.watch.forget(gone)
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
            if inflight is not None:
                await asyncio.wait({inflight})
        if not resp.prepared:  # an utterance with no audio at all (an empty wav still has a header)
            await resp.prepare(request)
        if sse:
            n_out = round(samples / SAMPLE_RATE * req.speed * SPEECH_TOKENS_PER_S)
            usage = {"input_tokens": len(req.input), "output_tokens": n_out, "total_tokens": len(req.input) + n_out}
            await resp.write(_sse({"type": "speech.audio.done", "usage": usage}))
        await resp.write_eof()
        metrics.api_requests.labels("openai", "200").inc()
        return resp


def add_routes(
    app: web.Application,
    engine: EngineLike,
    metrics: Metrics,
    *,
    max_input_chars: int,
    accepting: Callable[[], bool],
    body_timeout_s: float,
    error_shapes: dict[str, Any],
) -> None:
    """Register ``POST /v1/audio/speech`` on ``app`` (``voice_out.server.app.create_app`` does),
    and in ``error_shapes`` (path prefix -> error shape) OpenAI's shape for the server's own
    refusals under ``/v1/audio/`` (auth, wrong method, an unexpected failure)."""
    handler = SpeechHandler(
        engine, metrics, max_input_chars=max_input_chars, accepting=accepting, body_timeout_s=body_timeout_s
    )
    app.router.add_post(ROUTE, handler.handle, name=ROUTE_NAME)
    error_shapes["/v1/audio/"] = server_error
