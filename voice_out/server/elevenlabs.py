"""ElevenLabs-compatible text-to-speech routes: a thin adapter of the engine API.

Routes (``voice_id`` names one of our voices; ``default`` is the server's default voice)::

    GET  /v1/text-to-speech/{voice_id}/stream-input        WebSocket, one context per socket
    GET  /v1/text-to-speech/{voice_id}/multi-stream-input  WebSocket, contexts by ``context_id``
    POST /v1/text-to-speech/{voice_id}/stream              HTTP, chunked audio as it is made
    POST /v1/text-to-speech/{voice_id}                     the same (clients that wait for it all)

Query ``output_format``: ``pcm_8000|16000|22050|24000|32000|44100|48000``, ``ulaw_8000``,
``mp3_22050_32``, ``mp3_44100_{32,64,96,128,192}`` and ``opus_48000_{32,64,96,128,192}``
(mp3 and opus where the PyAV build has the encoder), default ``mp3_44100_128``. Auth: with
``server.auth_token`` set, the token in ``xi-api-key``, ``Authorization: Bearer``, or (single
context) ``xi_api_key`` / ``authorization`` in the opening message.

What the two agent plug-ins send, and the rule that tells an end of turn from an interruption
(docs/agents.md has the table): a context's speech ends gracefully (every sample, then
``isFinal``) when ``close_context`` follows a flush that carries no text (``{"flush": true}`` from
pipecat, ``{"text": "", "flush": true}`` from LiveKit Agents) with no text since; any other
``close_context`` -- and a second one on a context already ending -- is an interruption: the
engine stream is cancelled at once (the GPU drops it at its next step) and ``isFinal`` follows.
A closed socket cancels every open context.

Threads: everything here runs on the event loop; the engine's worker only fills stream outboxes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, web

from voice_out.engine.api import SAMPLE_RATE, EngineError, EngineLike, PcmChunk, Stream, StreamState
from voice_out.server.audio_encode import AudioEncoder, UnsupportedFormatError, make_encoder
from voice_out.server.body import HttpError, read_body
from voice_out.server.metrics import Metrics

log = logging.getLogger(__name__)

#: Route names that authenticate themselves (the single-context socket may carry its key in
#: its opening message, after the upgrade), so the app's bearer middleware lets them through.
OWN_AUTH_ROUTES = frozenset({"el_stream_input", "el_multi_stream_input", "el_stream", "el_convert"})
#: A WebSocket message or HTTP body larger than this is refused (the text limit is the engine's).
MAX_MESSAGE_BYTES = 1 << 20
#: Contexts one multi-context socket may hold open at once (ElevenLabs allows 5).
MAX_CONTEXTS = 5
#: Seconds without a message before a socket is closed; ``inactivity_timeout`` (query) up to 180.
DEFAULT_INACTIVITY_S = 20.0
MAX_INACTIVITY_S = 180.0
DEFAULT_FORMAT = "mp3_44100_128"

PCM_RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)
_BITRATES = (32, 64, 96, 128, 192)
_FORMAT_RE = re.compile(r"^(pcm|ulaw|mp3|opus)_(\d+)(?:_(\d+))?$")


class ElevenLabsError(Exception):
    """An error in ElevenLabs' shape: ``status`` (stable code), ``message``, HTTP ``http``."""

    def __init__(self, status: str, message: str, http: int = 400) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.http = http

    def http_response(self) -> web.Response:
        return web.json_response({"detail": {"status": self.status, "message": self.message}}, status=self.http)

    def ws_message(self, context_id: str | None = None) -> dict[str, Any]:
        msg: dict[str, Any] = {"message": self.message, "error": self.status, "code": 1008}
        if context_id is not None:
            msg["contextId"] = context_id
        return msg


def _engine_error(e: EngineError) -> ElevenLabsError:
    http = {"unknown_voice": 404, "no_voice": 400, "overloaded": 429, "text_too_long": 400}.get(e.code, 500)
    status = {"unknown_voice": "voice_not_found", "overloaded": "too_many_concurrent_requests"}.get(e.code, e.code)
    return ElevenLabsError(status, str(e), http)


@dataclass(frozen=True)
class OutputFormat:
    """A parsed ``output_format``: our encoder's name, its rate (Hz) and bit rate (bit/s)."""

    name: str
    encoder: str
    sample_rate: int
    bit_rate: int | None = None

    def make_encoder(self) -> AudioEncoder:
        try:
            return make_encoder(self.encoder, self.sample_rate, bit_rate=self.bit_rate)
        except UnsupportedFormatError as e:
            raise ElevenLabsError("invalid_output_format", f"output_format {self.name!r}: {e}") from None


def parse_output_format(value: str | None) -> OutputFormat:
    """``pcm_24000`` -> OutputFormat; raises ElevenLabsError naming what is accepted."""
    name = value or DEFAULT_FORMAT
    m = _FORMAT_RE.match(name)
    accepted = (
        "pcm_{8000,16000,22050,24000,32000,44100,48000}, ulaw_8000, mp3_22050_32, mp3_44100_{32..192}, "
        "opus_48000_{32..192}"
    )
    if m is not None:
        kind, rate, kbps = m.group(1), int(m.group(2)), m.group(3)
        if kind == "pcm" and kbps is None and rate in PCM_RATES:
            return OutputFormat(name, "pcm", rate)
        if kind == "ulaw" and kbps is None and rate == 8000:
            return OutputFormat(name, "ulaw", rate)
        if kind == "mp3" and kbps is not None and (rate, int(kbps)) in {(22050, 32)} | {(44100, b) for b in _BITRATES}:
            fmt = OutputFormat(name, "mp3", rate, int(kbps) * 1000)
            fmt.make_encoder().close()  # the PyAV build may lack the encoder: say so now
            return fmt
        if kind == "opus" and kbps is not None and rate == 48000 and int(kbps) in _BITRATES:
            fmt = OutputFormat(name, "opus", rate, int(kbps) * 1000)
            fmt.make_encoder().close()
            return fmt
    raise ElevenLabsError("invalid_output_format", f"unknown output_format {name!r}; accepted: {accepted}")


def alignment_json(text: str, chunk: PcmChunk) -> dict[str, Any] | None:
    """The chunk's characters and their times in ms from the chunk's first sample (ElevenLabs'
    ``alignment``); the last character lasts to the chunk's end, so a client that advances its
    clock by each message's span (pipecat) stays on the audio's clock. None: no character."""
    a = chunk.alignment
    if a is None or a.char_end <= a.char_start:
        return None
    starts, durations = a.relative_ms(chunk.start_sample)
    chunk_ms = round(len(chunk.pcm) * 1000 / SAMPLE_RATE)
    durations[-1] = max(durations[-1], chunk_ms - starts[-1])
    return {"chars": list(text[a.char_start : a.char_end]), "charStartTimesMs": starts, "charDurationsMs": durations}


# --------------------------------------------------------------------------------------------
# Shared state and auth


@dataclass
class ElevenLabsApi:
    """What the routes need: the engine, the bearer token (None: open), the text limit, and the
    seconds an HTTP body may take to arrive (``server.body_timeout_s``)."""

    engine: EngineLike
    auth_token: str | None
    max_text_chars: int
    body_timeout_s: float
    metrics: Metrics | None = None

    def authorized(self, *keys: str | None) -> bool:
        if not self.auth_token:
            return True
        expected = self.auth_token.encode()
        for key in keys:
            if key:
                given = key.strip()
                if given.lower().startswith("bearer "):
                    given = given[7:].strip()
                if hmac.compare_digest(given.encode(), expected):
                    return True
        return False

    async def check_voice(self, voice_id: str) -> str | None:
        """The engine's voice name for ``voice_id`` (None: the default voice)."""
        if voice_id == "default":
            return None
        names = await asyncio.get_running_loop().run_in_executor(None, self.engine.voice_names)
        if voice_id not in names:
            raise ElevenLabsError("voice_not_found", f"a voice with the voice_id {voice_id!r} was not found", 404)
        return voice_id

    def open(self, voice: str | None) -> Stream:
        try:
            stream = self.engine.open_stream(voice)
        except EngineError as e:
            raise _engine_error(e) from None
        if self.metrics is not None:
            self.metrics.utterances.inc()
            self.metrics.active_streams.inc()
        return stream

    def closed(self, stream: Stream) -> None:
        """Metrics: ``stream`` (from :meth:`open`) has ended, however."""
        if self.metrics is not None:
            self.metrics.active_streams.dec()
            if stream.state is StreamState.ABORTED:
                self.metrics.cancels.inc()

    def count(self, e: ElevenLabsError) -> ElevenLabsError:
        if self.metrics is not None:
            self.metrics.errors.labels(e.status).inc()
        return e


API_KEY: web.AppKey[ElevenLabsApi] = web.AppKey("voice_out.elevenlabs")


def _header_keys(request: web.Request) -> tuple[str | None, str | None]:
    return request.headers.get("xi-api-key"), request.headers.get("Authorization")


async def _encode(encoder: AudioEncoder, pcm: Any | None) -> bytes:
    """Encode a chunk (None: flush), in an executor for a codec that costs CPU."""
    fn: Callable[[], bytes] = (lambda: encoder.flush()) if pcm is None else (lambda: encoder.encode(pcm))
    if encoder.heavy:
        return await asyncio.get_running_loop().run_in_executor(None, fn)
    return fn()


# --------------------------------------------------------------------------------------------
# HTTP


#: ElevenLabs' ``status`` for the body reader's refusals (``voice_out.server.body``).
_BODY_STATUS = {413: "text_too_long", 408: "request_timeout"}


async def _read_tts_body(request: web.Request, api: ElevenLabsApi) -> str:
    """The request's ``text``, read as every route reads a body (a limit on the bytes read, a
    deadline on the whole body), its refusals in ElevenLabs' shape. A client gone mid-body
    raises ``ClientGoneError`` (the app's middleware logs one line)."""
    try:
        raw = await read_body(request, MAX_MESSAGE_BYTES, "request body", api.body_timeout_s)
    except HttpError as e:
        raise ElevenLabsError(_BODY_STATUS.get(e.status, e.code), e.message, e.status) from None
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise ElevenLabsError("invalid_json", 'the body must be JSON: {"text": "..."}') from None
    if not isinstance(body, dict) or not isinstance(body.get("text"), str):
        raise ElevenLabsError("invalid_request", 'the body must be a JSON object with a string "text"', 422)
    text: str = body["text"]
    if not text.strip():
        raise ElevenLabsError("invalid_request", '"text" is empty', 422)
    if len(text) > api.max_text_chars:
        raise ElevenLabsError("text_too_long", f"text is limited to {api.max_text_chars} characters")
    return text


async def stream_http(request: web.Request) -> web.StreamResponse:
    """``POST /v1/text-to-speech/{voice_id}/stream``: the audio in the chunked body as each
    engine chunk is made. A client that hangs up cancels the engine stream."""
    api = request.app[API_KEY]
    try:
        if not api.authorized(*_header_keys(request)):
            raise ElevenLabsError("invalid_api_key", "missing or wrong API key (xi-api-key or Bearer token)", 401)
        fmt = parse_output_format(request.query.get("output_format"))
        voice = await api.check_voice(request.match_info["voice_id"])
        text = await _read_tts_body(request, api)
        stream = api.open(voice)
    except ElevenLabsError as e:
        return api.count(e).http_response()
    encoder = fmt.make_encoder()
    resp = web.StreamResponse(headers={"Content-Type": encoder.media_type})
    try:
        stream.push_text(text)
        stream.end_text()
        await resp.prepare(request)
        async for chunk in stream:
            data = await _encode(encoder, chunk.pcm)
            if data:
                await resp.write(data)
        tail = await _encode(encoder, None)
        if tail:
            await resp.write(tail)
        await resp.write_eof()
    except ConnectionError:
        pass  # the client hung up: the stream is cancelled below
    except EngineError as e:
        if not resp.prepared:
            return _engine_error(e).http_response()
        log.warning("elevenlabs http stream %s failed: %s", stream.id, e)  # the body is cut short
    finally:
        stream.cancel()  # no-op once finished; frees the engine stream on a hang-up
        encoder.close()
        api.closed(stream)
    return resp


# --------------------------------------------------------------------------------------------
# WebSocket


@dataclass
class _Context:
    """One utterance on a socket. ``end_marked``: a flush without text came last (the end of
    turn the plug-ins send before ``close_context``)."""

    id: str | None
    stream: Stream
    encoder: AudioEncoder
    task: asyncio.Task[None] | None = None
    end_marked: bool = False
    closing: bool = False


class _Socket:
    """One ElevenLabs WebSocket: its contexts, its writer lock, its rules (module docstring)."""

    def __init__(
        self, api: ElevenLabsApi, ws: web.WebSocketResponse, fmt: OutputFormat, voice: str | None, multi: bool
    ) -> None:
        self.api, self.ws, self.fmt, self.voice, self.multi = api, ws, fmt, voice, multi
        self.contexts: dict[str | None, _Context] = {}
        self.opened = False  # single context: its one utterance has started
        self._send_lock = asyncio.Lock()
        self._last_audio = 0.0  # loop time of the last audio message

    def sent_within(self, seconds: float) -> bool:
        """Whether an audio message left less than ``seconds`` ago, or an engine stream has
        text it has not yet spoken (its first audio may take a while on a loaded engine)."""
        now = asyncio.get_running_loop().time()
        pending = any(c.stream.state is StreamState.WAITING and c.stream.text for c in self.contexts.values())
        return pending or now - self._last_audio < seconds

    async def send(self, msg: dict[str, Any]) -> None:
        if self.ws.closed:
            return
        async with self._send_lock:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.ws.send_str(json.dumps(msg, separators=(",", ":")))

    async def error(self, e: ElevenLabsError, context_id: str | None = None) -> None:
        await self.send(self.api.count(e).ws_message(context_id if self.multi else None))

    def _reply(self, context_id: str | None, **fields: Any) -> dict[str, Any]:
        if self.multi:
            fields["contextId"] = context_id
        return fields

    # ---- contexts ---------------------------------------------------------------------------

    def open_context(self, context_id: str | None) -> _Context:
        if self.multi and len(self.contexts) >= MAX_CONTEXTS:
            raise ElevenLabsError(
                "max_active_conversations",
                f"at most {MAX_CONTEXTS} contexts may be open on one socket; close one first",
            )
        stream = self.api.open(self.voice)
        ctx = _Context(context_id, stream, self.fmt.make_encoder())
        ctx.task = asyncio.get_running_loop().create_task(self._pump(ctx), name=f"elevenlabs {stream.id}")
        self.contexts[context_id] = ctx
        return ctx

    async def _pump(self, ctx: _Context) -> None:
        """Engine chunks -> audio messages; then the encoder's tail and ``isFinal``."""
        try:
            async for chunk in ctx.stream:
                data = await _encode(ctx.encoder, chunk.pcm)
                align = alignment_json(ctx.stream.text, chunk)
                if data or align:
                    self._last_audio = asyncio.get_running_loop().time()
                    msg = self._reply(
                        ctx.id,
                        audio=base64.b64encode(data).decode() if data else None,
                        isFinal=None,
                        normalizedAlignment=align,
                        alignment=align,
                    )
                    await self.send(msg)
            if ctx.stream.state is not StreamState.ABORTED:  # an interrupted context sends no more audio
                tail = await _encode(ctx.encoder, None)
                if tail:
                    await self.send(self._reply(ctx.id, audio=base64.b64encode(tail).decode(), isFinal=None))
        except EngineError as e:
            await self.error(_engine_error(e), ctx.id)
        finally:
            ctx.encoder.close()
            self.api.closed(ctx.stream)
        if ctx.stream.state is not StreamState.ABORTED:
            await self.send(self._reply(ctx.id, isFinal=True))
        self.contexts.pop(ctx.id, None)
        if not self.multi:
            await self.ws.close()

    async def interrupt(self, ctx: _Context) -> None:
        """Barge-in: the engine stream is cancelled now; ``isFinal`` tells the client the
        context is released."""
        ctx.stream.cancel()
        if ctx.task is not None:
            await ctx.task
        self.contexts.pop(ctx.id, None)
        await self.send(self._reply(ctx.id, isFinal=True))

    async def close_context(self, ctx: _Context) -> None:
        if ctx.closing or not ctx.end_marked:
            await self.interrupt(ctx)
            return
        ctx.closing = True
        ctx.stream.end_text()

    async def cancel_all(self) -> None:
        for ctx in list(self.contexts.values()):
            ctx.stream.cancel()
        tasks = [c.task for c in self.contexts.values() if c.task is not None]
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        self.contexts.clear()

    # ---- messages ---------------------------------------------------------------------------

    async def handle(self, msg: dict[str, Any]) -> None:
        """One client message (already JSON-decoded to an object)."""
        if self.multi and msg.get("close_socket") is True:
            await self.cancel_all()
            await self.ws.close()
            return
        context_id: str | None = None
        if self.multi:
            raw_id = msg.get("context_id", "default")
            if not isinstance(raw_id, str) or not raw_id:
                raise ElevenLabsError("invalid_message", '"context_id" must be a non-empty string')
            context_id = raw_id
        text = msg.get("text")
        if text is not None and not isinstance(text, str):
            raise ElevenLabsError("invalid_message", '"text" must be a string')
        ctx = self.contexts.get(context_id)
        if self.multi and msg.get("close_context") is True:
            if ctx is not None:
                await self.close_context(ctx)
            else:
                await self.send(self._reply(context_id, isFinal=True))
            return
        flush = msg.get("flush") is True
        if ctx is None:
            if not text:
                return  # a keep-alive, or a flush, for no open context
            if not self.multi and self.opened:
                return  # single context: text after the end
            ctx = self.open_context(context_id)
            self.opened = True
            if text == " " and "text" in msg:
                return  # the opening message: its single space is not speech
        if ctx.closing:
            raise ElevenLabsError("context_closed", f"context {context_id!r} is closing; open a new one")
        if text:
            try:
                ctx.stream.push_text(text)
            except EngineError as e:
                await self.interrupt(ctx)
                raise _engine_error(e) from None
            ctx.end_marked = False
        elif flush:
            ctx.end_marked = True
        if not self.multi and text == "" and "text" in msg:
            # single context: {"text": ""} ends the input; the socket closes after isFinal
            ctx.closing = True
            ctx.stream.end_text()


async def _socket(request: web.Request, multi: bool) -> web.StreamResponse:
    api = request.app[API_KEY]
    ws = web.WebSocketResponse(max_msg_size=MAX_MESSAGE_BYTES, heartbeat=30.0)
    await ws.prepare(request)
    xi_key, bearer = _header_keys(request)
    try:
        fmt = parse_output_format(request.query.get("output_format"))
        voice = await api.check_voice(request.match_info["voice_id"])
        timeout = _inactivity(request.query.get("inactivity_timeout"))
    except ElevenLabsError as e:
        await ws.send_str(json.dumps(e.ws_message()))
        await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=e.status.encode())
        return ws
    sock = _Socket(api, ws, fmt, voice, multi)
    authed = api.authorized(xi_key, bearer)
    if multi and not authed:
        return await _refuse(sock)
    try:
        while not ws.closed:
            try:
                msg = await ws.receive(timeout=timeout)
            except TimeoutError:
                if any(c.closing for c in sock.contexts.values()) or sock.sent_within(timeout):
                    continue  # the client waits for audio it asked for, or gets it: not idle
                await sock.error(ElevenLabsError("input_timeout", f"no message for {timeout:.0f} s; closing"))
                break
            if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
                break
            if msg.type != WSMsgType.TEXT:
                await sock.error(ElevenLabsError("invalid_message", "messages are JSON text"))
                continue
            try:
                data = json.loads(msg.data)
                if not isinstance(data, dict):
                    raise ValueError("not an object")
            except ValueError:
                await sock.error(ElevenLabsError("invalid_message", "a message must be a JSON object"))
                continue
            if not authed:  # single context: the key may come in the opening message
                authed = api.authorized(data.get("xi_api_key"), data.get("authorization"))
                if not authed:
                    return await _refuse(sock)
            raw_id = data.get("context_id") if multi else None
            try:
                await sock.handle(data)
            except ElevenLabsError as e:
                await sock.error(e, raw_id if isinstance(raw_id, str) else None)
                if not multi and not sock.contexts:
                    break  # single context: the one utterance could not start
    finally:
        await sock.cancel_all()
        if not ws.closed:
            await ws.close()
    return ws


async def _refuse(sock: _Socket) -> web.WebSocketResponse:
    await sock.error(ElevenLabsError("invalid_api_key", "missing or wrong API key (xi-api-key or Bearer token)", 401))
    await sock.ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"invalid_api_key")
    return sock.ws


def _inactivity(value: str | None) -> float:
    if value is None:
        return DEFAULT_INACTIVITY_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 1.0 <= seconds <= MAX_INACTIVITY_S:
        raise ElevenLabsError("invalid_request", f"inactivity_timeout must be 1..{MAX_INACTIVITY_S:.0f} seconds")
    return seconds


async def stream_input(request: web.Request) -> web.StreamResponse:
    return await _socket(request, multi=False)


async def multi_stream_input(request: web.Request) -> web.StreamResponse:
    return await _socket(request, multi=True)


def add_routes(
    app: web.Application,
    engine: EngineLike,
    *,
    auth_token: str | None,
    max_text_chars: int,
    body_timeout_s: float,
    metrics: Metrics | None = None,
) -> None:
    """Register the routes of the module docstring on ``app``."""
    app[API_KEY] = ElevenLabsApi(engine, auth_token, max_text_chars, body_timeout_s, metrics)
    r = app.router
    base = "/v1/text-to-speech/{voice_id}"
    r.add_get(base + "/stream-input", stream_input, name="el_stream_input")
    r.add_get(base + "/multi-stream-input", multi_stream_input, name="el_multi_stream_input")
    r.add_post(base + "/stream", stream_http, name="el_stream")
    r.add_post(base, stream_http, name="el_convert")
