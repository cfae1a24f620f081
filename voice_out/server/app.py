"""The aiohttp application: routes of design §4.1, auth, admission, lifecycle, and ``serve``.

Routes::

    GET    /                        the demo page (web/index.html), when server.serve_web
    GET    /{file}                  the page's static files (web/), when server.serve_web
    POST   /offer                   SDP offer -> answer + session_id (503 beyond max_sessions)
    GET    /ice-servers             {"ice_servers": [RTCIceServer, ...]}: server.ice_servers, for the page
    GET    /voices                  {"voices": [{name, ...}]}
    POST   /voices                  multipart name, audio, transcript -> 201 {"voice": {...}}
    DELETE /voices/{name}           204
    GET    /healthz                 200 when the engine is warm and sessions are admitted, else 503
    GET    /metrics                 Prometheus text format (this app's own registry)
    GET    /sessions/{id}/control   WebSocket: protocol v1 for an agent backend driving a session
    POST   /v1/audio/speech         OpenAI's speech endpoint (voice_out.server.openai_speech)

Auth: with ``server.auth_token`` set, every route except the page, its static files and
``/healthz`` needs ``Authorization: Bearer <token>``; the control WebSocket also accepts
``?token=<token>`` (browsers cannot set headers on a WebSocket). Errors are JSON:
``{"error": {"code", "message"}}``, except under a compatibility API's path, where they take
that API's own shape (``ERROR_SHAPES_KEY``).

Lifecycle: the engine is entered (``async with engine``: worker started, warmed up) in a
``cleanup_ctx`` and left after every session has been closed in ``on_shutdown``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import hmac
import importlib
import json
import logging
import os
import signal
import site
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from aiohttp import BodyPartReader, WSMsgType, web

from voice_out.config import Config, ServerConfig
from voice_out.engine.api import EngineLike
from voice_out.errors import VoiceOutError
from voice_out.server import elevenlabs, openai_speech
from voice_out.server.body import ClientGoneError, HttpError, read_body, read_within
from voice_out.server.metrics import Metrics
from voice_out.server.session import Session
from voice_out.server.signaling import AdmissionError, SessionManager
from voice_out.server.track import Clock

log = logging.getLogger(__name__)


def find_web_dir(candidates: Sequence[Path] | None = None) -> Path | None:
    """Where the demo page's files are: ``web/`` next to the package in a source checkout (and
    an editable install), else where a wheel put them (``<prefix>/share/voice_out/web``, the
    user scheme's likewise); the first candidate holding ``index.html``, or None."""
    if candidates is None:
        share = Path("share", "voice_out", "web")
        candidates = [
            Path(__file__).resolve().parent.parent.parent / "web",
            Path(sys.prefix) / share,
            Path(site.getuserbase()) / share,
        ]
    return next((d for d in candidates if (d / "index.html").is_file()), None)


WEB_DIR = find_web_dir()
#: Prompt audio uploads: 30 s of 48 kHz stereo 16-bit WAV is ~5.8 MB.
MAX_UPLOAD_BYTES = 16 * 1024 * 1024
#: An SDP offer is a few KiB.
MAX_OFFER_BYTES = 256 * 1024
#: Outgoing messages a slow control WebSocket may have queued before it is dropped.
MAX_WS_BACKLOG = 1000
#: A control-WebSocket message up to this size is read and answered (over the protocol's
#: 64 KiB: ``message_too_large``, the session goes on); a larger one closes the socket (1009).
MAX_WS_MESSAGE_BYTES = 4 * 1024 * 1024
#: Methods that only read: every other method, and every WebSocket upgrade, changes state (a
#: session, a voice, engine time), which a page of another origin must not do (CSRF).
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: Stable ``code`` of the HTTP errors aiohttp raises itself (routing, body size).
HTTP_ERROR_CODES = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    408: "timeout",
    413: "too_large",
    414: "too_large",
    415: "bad_request",
    431: "too_large",
}


class VoiceStoreLike(Protocol):
    """What the server needs of the voice store (``voice_out.voices.store.VoiceStore``).

    Its methods block (file I/O, ONNX), so the server calls them in an executor.
    """

    def list(self) -> Sequence[Any]: ...

    def add(self, name: str, audio: bytes, transcript: str) -> Any: ...

    def delete(self, name: str) -> None: ...


CONFIG_KEY = web.AppKey("voice_out.config", Config)
ENGINE_KEY: web.AppKey[EngineLike] = web.AppKey("voice_out.engine")
VOICES_KEY: web.AppKey[VoiceStoreLike | None] = web.AppKey("voice_out.voices")
SESSIONS_KEY = web.AppKey("voice_out.sessions", SessionManager)
METRICS_KEY = web.AppKey("voice_out.metrics", Metrics)
WEB_DIR_KEY: web.AppKey[Path | None] = web.AppKey("voice_out.web_dir")

PUBLIC_ROUTES = frozenset({"index", "static", "healthz"})


def json_error(status: int, code: str, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status, headers=headers)


class ErrorShape(Protocol):
    """How the server words an error (``json_error`` is the default)."""

    def __call__(
        self, status: int, code: str, message: str, headers: Mapping[str, str] | None = None
    ) -> web.Response: ...


#: Path prefix -> its :data:`ErrorShape`, for a compatibility API whose clients read their own
#: error body (OpenAI's ``{"error": {"message", "type", "param", "code"}}``): the server's
#: refusals there (auth, no route, wrong method, an unexpected failure) take that shape.
ERROR_SHAPES_KEY: web.AppKey[dict[str, ErrorShape]] = web.AppKey("voice_out.error_shapes")


def error_shape(request: web.Request) -> ErrorShape:
    """The error shape of ``request``'s path (``json_error`` outside every compatibility API)."""
    for prefix, shape in request.app[ERROR_SHAPES_KEY].items():
        if request.path.startswith(prefix):
            return shape
    return json_error


# --------------------------------------------------------------------------------------------
# Middleware


@web.middleware
async def _errors_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every HTTP error as JSON ``{"error": {"code", "message"}}``: aiohttp's own (no route,
    wrong method, body over ``client_max_size``), ours, and an unexpected exception (500,
    logged). A client gone mid-body is one log line, not a traceback."""
    error = error_shape(request)
    try:
        return await handler(request)
    except HttpError as e:
        return error(e.status, e.code, e.message, e.headers)
    except web.HTTPMethodNotAllowed:
        return await _no_route(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = HTTP_ERROR_CODES.get(e.status, f"http_{e.status}")
        message = e.text if e.text and not e.text.startswith(f"{e.status}:") else e.reason
        headers = {k: v for k, v in e.headers.items() if k.lower() not in ("content-type", "content-length")}
        return error(e.status, code, f"{request.method} {request.path}: {message}", headers)
    except ClientGoneError as e:
        log.info("%s %s: %s", request.method, request.path, e)
        return error(400, "bad_request", str(e))
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return error(500, "internal", "internal error; the server goes on")


async def _no_route(request: web.Request) -> web.Response:
    """405 for a path some route serves with other methods; 404 for one only the static
    catch-all (``GET /{file}``) matched and that names no file."""
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource.name != "static":
            allowed |= (await resource.resolve(request))[1]
    if not allowed and _static_file(request.app, request.path.lstrip("/")) is not None:
        allowed = {"GET", "HEAD"}
    error = error_shape(request)
    if not allowed:
        return error(404, "not_found", f"no route {request.method} {request.path}")
    methods = ", ".join(sorted(allowed))
    return error(
        405,
        "method_not_allowed",
        f"{request.path} answers {methods}, not {request.method}",
        headers={"Allow": methods},
    )


def _origin_middleware(allowed: tuple[str, ...]) -> Callable[..., Awaitable[web.StreamResponse]]:
    allow_any = "*" in allowed
    allowed_set = frozenset(allowed)

    @web.middleware
    async def origin(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        given = request.headers.get("Origin")
        upgrade = request.headers.get("Upgrade", "").lower() == "websocket"
        if given is None or allow_any or (request.method in SAFE_METHODS and not upgrade):
            return await handler(request)
        if given in allowed_set or _same_origin(given, request.host):
            return await handler(request)
        return json_error(
            403,
            "forbidden_origin",
            f"a page of origin {given[:200]!r} may not call {request.method} {request.path}; "
            "add it to server.allowed_origins",
        )

    return origin


def _same_origin(origin: str, host: str) -> bool:
    """Whether ``origin`` (the Origin header) names the host the request was sent to (its Host
    header). The scheme is not compared: behind a TLS proxy the page is https, the hop to us
    http."""
    try:
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return False
        default_port = 443 if parts.scheme == "https" else 80
        port = parts.port or default_port
    except ValueError:
        return False
    req = urlsplit(f"//{host}")
    try:
        req_port = req.port
    except ValueError:
        return False
    if req.hostname is None or req.hostname != parts.hostname:
        return False
    return (req_port or default_port) == port


def _auth_middleware(token: str) -> Callable[..., Awaitable[web.StreamResponse]]:
    expected = token.encode()

    @web.middleware
    async def auth(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Any:
        route = request.match_info.route
        if route.name in PUBLIC_ROUTES or route.name in elevenlabs.OWN_AUTH_ROUTES:
            return await handler(request)
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given:
            given = request.query.get("token", "") if route.name == "control" else ""
        if not given or not hmac.compare_digest(given.strip().encode(), expected):
            return error_shape(request)(
                401,
                "unauthorized",
                "missing or wrong bearer token: send 'Authorization: Bearer <token>'",
                headers={"WWW-Authenticate": 'Bearer realm="voice_out"'},
            )
        return await handler(request)

    return auth


# --------------------------------------------------------------------------------------------
# Handlers


async def index(request: web.Request) -> web.StreamResponse:
    web_dir = request.app[WEB_DIR_KEY]
    if web_dir is None or not (web_dir / "index.html").is_file():
        return json_error(404, "no_page", "the demo page is not installed with this server")
    return web.FileResponse(web_dir / "index.html", headers={"Cache-Control": "no-cache"})


def _static_file(app: web.Application, name: str) -> Path | None:
    web_dir = app[WEB_DIR_KEY]
    if web_dir is None:
        return None
    root = web_dir.resolve()
    try:
        path = (root / name).resolve()
    except (OSError, ValueError):  # a NUL byte, a name too long
        return None
    return path if path.is_relative_to(root) and path.is_file() else None


async def static(request: web.Request) -> web.StreamResponse:
    path = _static_file(request.app, request.match_info["path"])
    if path is not None:
        return web.FileResponse(path, headers={"Cache-Control": "no-cache"})
    return await _no_route(request)  # e.g. GET /offer: 405, not "no such file"


async def offer(request: web.Request) -> web.Response:
    raw = await read_body(request, MAX_OFFER_BYTES, "SDP offer", request.app[CONFIG_KEY].server.body_timeout_s)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return json_error(400, "bad_json", 'the body must be JSON: {"sdp": ..., "type": "offer"}')
    if not isinstance(body, dict):
        return json_error(400, "bad_json", 'the body must be a JSON object: {"sdp": ..., "type": "offer"}')
    for name in ("sdp", "type"):
        if name not in body:
            return json_error(400, "missing_field", f"missing field {name!r}")
    if body["type"] != "offer" or not isinstance(body["sdp"], str):
        return json_error(400, "bad_field", 'expected {"sdp": <string>, "type": "offer"}')
    try:
        answer = await request.app[SESSIONS_KEY].offer(body["sdp"])
    except AdmissionError as e:
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return json_error(e.status, e.code, e.message, headers)
    return web.json_response(answer)


async def ice_servers(request: web.Request) -> web.Response:
    """``server.ice_servers`` as WebRTC's ``RTCIceServer`` dictionaries, for the page's
    ``RTCPeerConnection`` (TURN credentials included: behind the bearer token when one is set)."""
    servers = request.app[CONFIG_KEY].server.ice_servers
    return web.json_response({"ice_servers": [s.to_json() for s in servers]}, headers={"Cache-Control": "no-store"})


def _voice_json(v: Any) -> dict[str, Any]:
    if isinstance(v, str):
        return {"name": v}
    to_json = getattr(v, "to_json", None)
    if callable(to_json):
        return dict(to_json())
    info = getattr(v, "info", None)
    if info is not None and callable(getattr(info, "to_json", None)):
        return dict(info.to_json())
    return {"name": str(getattr(v, "name", v))}


def _voice_status(code: str) -> int:
    return {"unknown_voice": 404, "voice_exists": 409, "prompt_model_unavailable": 501}.get(code, 400)


async def list_voices(request: web.Request) -> web.Response:
    """The voices a session can name: the store's (with their manifests), then any the engine
    has built in (e.g. ``noise`` of random-weight models) as ``{"name", "builtin": true}``;
    and ``default_voice``, the one an utterance naming none gets (null: none)."""
    store = request.app[VOICES_KEY]
    loop = asyncio.get_running_loop()
    voices: list[dict[str, Any]] = []
    if store is not None:
        voices = [_voice_json(v) for v in await loop.run_in_executor(None, store.list)]
    listed = {v.get("name") for v in voices}
    engine = request.app[ENGINE_KEY]
    engine_names = await loop.run_in_executor(None, engine.voice_names)
    voices += [{"name": n, "builtin": True} for n in engine_names if n not in listed]
    # the voice of utterances that name none (null: they get no_voice), for the page's menu
    default = getattr(engine, "default_voice", None)
    return web.json_response({"voices": voices, "default_voice": default if isinstance(default, str) else None})


async def add_voice(request: web.Request) -> web.Response:
    store = request.app[VOICES_KEY]
    if store is None:
        return json_error(501, "no_voice_store", "this server has no voice store")
    if not request.content_type.startswith("multipart/"):
        return json_error(400, "bad_request", "send multipart/form-data with fields name, audio, transcript")
    if (request.content_length or 0) > MAX_UPLOAD_BYTES:
        return json_error(413, "too_large", f"upload larger than {MAX_UPLOAD_BYTES} bytes")
    # no byte for body_timeout_s: 408 (an upload may be slow, not stalled)
    idle_s = request.app[CONFIG_KEY].server.body_timeout_s
    fields: dict[str, bytes] = {}
    try:
        reader = await request.multipart()
        total = 0
        while True:
            part = await read_within("upload", reader.next(), idle_s)
            if part is None:
                break
            if not isinstance(part, BodyPartReader):
                return json_error(400, "bad_request", "nested multipart bodies are not accepted")
            keep = part.name in ("name", "audio", "transcript")
            data = bytearray()
            # an unknown part is read and dropped, but counted: it cannot grow memory or run on
            while chunk := await read_within("upload", part.read_chunk(), idle_s):
                total += len(chunk)
                if total > MAX_UPLOAD_BYTES:
                    return json_error(413, "too_large", f"upload larger than {MAX_UPLOAD_BYTES} bytes")
                if keep:
                    data += chunk
            if keep:
                fields[str(part.name)] = bytes(data)
    except ValueError as e:  # a malformed multipart body (boundary, headers)
        return json_error(400, "bad_request", f"malformed multipart body: {e}")
    for name in ("name", "audio", "transcript"):
        if name not in fields:
            return json_error(400, "missing_field", f"missing multipart field {name!r}")
    try:
        voice_name = fields["name"].decode("utf-8").strip()
        transcript = fields["transcript"].decode("utf-8")
    except UnicodeDecodeError:
        return json_error(400, "bad_field", "name and transcript must be UTF-8 text")
    loop = asyncio.get_running_loop()
    try:
        voice = await loop.run_in_executor(None, store.add, voice_name, fields["audio"], transcript)
    except VoiceOutError as e:
        code = str(getattr(e, "code", "bad_voice"))
        return json_error(_voice_status(code), code, str(e))
    body = _voice_json(voice) if voice is not None else {"name": voice_name}
    return web.json_response({"voice": body}, status=201)


async def delete_voice(request: web.Request) -> web.Response:
    store = request.app[VOICES_KEY]
    if store is None:
        return json_error(501, "no_voice_store", "this server has no voice store")
    name = request.match_info["name"]
    try:
        await asyncio.get_running_loop().run_in_executor(None, store.delete, name)
    except VoiceOutError as e:
        code = str(getattr(e, "code", "bad_voice"))
        return json_error(_voice_status(code), code, str(e))
    return web.Response(status=204)


async def healthz(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    sessions = request.app[SESSIONS_KEY]
    accepting = engine.ready and sessions.accepting and len(sessions) < sessions.max_sessions
    body: dict[str, Any] = {
        "status": "ok" if accepting else "unavailable",
        "engine_ready": engine.ready,
        "sessions": len(sessions),
        "max_sessions": sessions.max_sessions,
    }
    plan = getattr(engine, "plan", None)  # the engine's fast-path plan (voice_out.fast.plan); fakes have none
    if plan is not None:
        body["plan"] = plan.as_dict()
    warming = getattr(engine, "warming", None)  # an in-process engine's start-up work after ready
    if warming is not None:
        body["warming"] = bool(warming)
    reports = getattr(engine, "reports", None)
    if callable(reports):  # a placement or Ray's replicas: each engine (docs/scale-out.md)
        items = [report.to_json() for report in reports()]
        # a placement's engines are in this process's reach: each with its memory plan
        engines = getattr(engine, "engines", None)
        if engines is not None:
            for item, one in zip(items, engines, strict=True):
                one_plan = getattr(one, "plan", None)
                if one_plan is not None:
                    item["plan"] = one_plan.as_dict()
                one_warming = getattr(one, "warming", None)
                if one_warming is not None:
                    item["warming"] = bool(one_warming)
        body["engines"] = items
    return web.json_response(body, status=200 if accepting else 503)


async def metrics(request: web.Request) -> web.Response:
    m = request.app[METRICS_KEY]
    return web.Response(body=m.render(), headers={"Content-Type": m.content_type})


class WebSocketSink:
    """Queues a session's messages for one control WebSocket; its writer task sends them."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[str | None] = asyncio.Queue(MAX_WS_BACKLOG)
        self.overflowed = False

    def send(self, text: str) -> None:
        try:
            self.queue.put_nowait(text)
        except asyncio.QueueFull:
            self.overflowed = True
            self.close()

    def close(self) -> None:
        with contextlib.suppress(asyncio.QueueFull):
            self.queue.put_nowait(None)

    async def write(self, ws: web.WebSocketResponse) -> None:
        """Send queued messages until the session ends, then close. A message that fails to
        send is logged and dropped; a socket that is gone ends the writer (logged), which
        closes the socket: never a silent writer death behind an open socket."""
        try:
            while (text := await self.queue.get()) is not None:
                try:
                    await ws.send_str(text)
                except (ConnectionError, RuntimeError) as e:  # closed or closing under us
                    log.info("control WebSocket: the socket is gone (%s); its writer stops", e)
                    return
                except Exception:
                    log.exception("control WebSocket: a message could not be sent; dropped")
            await ws.close(message=b"session closed" if not self.overflowed else b"too slow")
        finally:
            if not ws.closed:
                with contextlib.suppress(Exception):
                    await ws.close(message=b"writer stopped")


async def control(request: web.Request) -> web.StreamResponse:
    """Protocol v1 over a WebSocket, for an agent backend driving (and observing) a session."""
    session: Session | None = request.app[SESSIONS_KEY].get(request.match_info["session_id"])
    if session is None:
        return json_error(404, "unknown_session", "no such session (it may have ended)")
    ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=MAX_WS_MESSAGE_BYTES)
    await ws.prepare(request)
    sink = WebSocketSink()
    writer = asyncio.get_running_loop().create_task(sink.write(ws), name=f"control-writer {session.id}")
    session.add_sink(sink)
    try:
        async for msg in ws:
            if msg.type == WSMsgType.TEXT:
                session.receive(msg.data, reply=sink)
            elif msg.type == WSMsgType.BINARY:
                session.receive(bytes(msg.data), reply=sink)
    finally:
        session.remove_sink(sink)
        sink.close()
        try:
            await asyncio.wait_for(writer, 5.0)
        except (TimeoutError, ConnectionError, asyncio.CancelledError):
            writer.cancel()
            with contextlib.suppress(BaseException):
                await writer
    return ws


# --------------------------------------------------------------------------------------------
# The factory


def create_app(
    config: Config | ServerConfig,
    engine: EngineLike,
    voice_store: VoiceStoreLike | None = None,
    *,
    web_dir: Path | None = WEB_DIR,
    connect_timeout_s: float = 30.0,
    clock_factory: Callable[[], Clock] | None = None,
) -> web.Application:
    """Build the server for ``engine`` (entered with ``async with`` when the app starts) and
    ``voice_store`` (None: voices are read-only, from the engine). ``clock_factory`` gives each
    session's track its clock (tests)."""
    cfg = config if isinstance(config, Config) else Config(server=config)
    server = cfg.server
    middlewares = [_errors_middleware, _origin_middleware(server.allowed_origins)]
    if server.auth_token:
        middlewares.append(_auth_middleware(server.auth_token))
    app = web.Application(middlewares=middlewares, client_max_size=MAX_UPLOAD_BYTES + 64 * 1024)
    metrics_ = Metrics()
    reports = getattr(engine, "reports", None)
    if callable(reports):  # /metrics reports each engine: label gpu, or replica (Ray Serve)
        metrics_.watch_engines(reports, getattr(engine, "report_label", "gpu"))
    app[CONFIG_KEY] = cfg
    app[ENGINE_KEY] = engine
    app[VOICES_KEY] = voice_store
    app[METRICS_KEY] = metrics_
    app[WEB_DIR_KEY] = web_dir if server.serve_web else None
    app[ERROR_SHAPES_KEY] = {}
    app[SESSIONS_KEY] = SessionManager(
        engine,
        metrics_,
        max_sessions=server.max_sessions,
        max_queued_utterances=server.max_queued_utterances,
        max_text_chars=cfg.engine.max_text_chars,
        connect_timeout_s=connect_timeout_s,
        clock_factory=clock_factory,
        frame_ms=server.frame_ms,
        ice_servers=server.ice_servers,
    )
    app.cleanup_ctx.append(_engine_ctx)
    app.on_shutdown.append(_close_sessions)

    r = app.router
    if server.serve_web:
        r.add_get("/", index, name="index")
    r.add_post("/offer", offer, name="offer")
    r.add_get("/ice-servers", ice_servers, name="ice_servers")
    r.add_get("/voices", list_voices, name="voices")
    r.add_post("/voices", add_voice, name="add_voice")
    r.add_delete("/voices/{name}", delete_voice, name="delete_voice")
    r.add_get("/healthz", healthz, name="healthz")
    r.add_get("/metrics", metrics, name="metrics")
    r.add_get("/sessions/{session_id}/control", control, name="control")
    elevenlabs.add_routes(
        app,
        engine,
        auth_token=server.auth_token,
        max_text_chars=cfg.engine.max_text_chars,
        body_timeout_s=server.body_timeout_s,
        metrics=metrics_,
    )
    openai_speech.add_routes(
        app,
        engine,
        metrics_,
        max_input_chars=cfg.engine.max_text_chars,
        accepting=lambda: app[SESSIONS_KEY].accepting,
        body_timeout_s=server.body_timeout_s,
        error_shapes=app[ERROR_SHAPES_KEY],
    )
    if server.serve_web:
        r.add_get("/{path:[^/].*}", static, name="static")
    return app


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    engine = app[ENGINE_KEY]
    async with AsyncExitStack() as stack:
        try:
            await stack.enter_async_context(engine)
        except VoiceOutError:
            raise
        except Exception as e:
            raise EngineStartError(f"the engine failed to start: {e}") from e
        await _warm_voices(app)
        stack.enter_context(_serving_runtime())
        yield
        # on_shutdown has closed every session before cleanup_ctx leaves the engine.


#: How long a thread may hold the GIL while another waits for it, while serving (Python's default
#: is 5 ms). The GPU worker runs Python between launches; with the default, a frame that falls
#: due while the worker plans waits up to 5 ms before the event loop may build it.
SWITCH_INTERVAL_S = 0.001


@contextlib.contextmanager
def _serving_runtime() -> Iterator[None]:
    """The interpreter settings of a serving process, from the engine's warm-up to shutdown.

    The model, the kernels and the libraries leave a large heap of long-lived objects; a full
    garbage collection walks all of it, on whichever thread allocates at the time, and stalls
    the event loop for tens of milliseconds (a gap in every session's audio). ``gc.freeze``
    moves what start-up made out of the collector's sight, so collections look only at what
    serving allocates. The GIL switch interval is shortened for the reason given at
    :data:`SWITCH_INTERVAL_S`. Both are undone on exit (tests run several apps in one process).
    """
    gc.collect()
    gc.freeze()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, SWITCH_INTERVAL_S))
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
        gc.unfreeze()


async def _warm_voices(app: web.Application) -> None:
    """Load every stored voice once, off the loop, so a session's first delta does not wait on
    disk (the engine resolves voices through the store's cache on the asyncio thread)."""
    store = app[VOICES_KEY]
    get, names_of = getattr(store, "get", None), getattr(store, "names", None)
    if not callable(get) or not callable(names_of):
        return

    def warm(names: list[str]) -> None:
        for name in names:
            try:
                get(name)
            except VoiceOutError as e:
                log.warning("voice %r cannot be used: %s", name, e)

    loop = asyncio.get_running_loop()
    names = await loop.run_in_executor(None, names_of)
    await loop.run_in_executor(None, warm, list(names))


async def _close_sessions(app: web.Application) -> None:
    await app[SESSIONS_KEY].close_all()


# --------------------------------------------------------------------------------------------
# serve


class EngineUnavailableError(VoiceOutError):
    """The streaming engine is not part of this build."""


class EngineStartError(VoiceOutError):
    """The engine could not start (model, device or memory); the message says why."""


class ListenError(VoiceOutError):
    """The server could not listen on its address."""


class UnknownDefaultVoiceError(VoiceOutError):
    """``server.default_voice`` names no registered voice: every utterance would fail."""


def serve(cfg: Config) -> int:
    """Load the engine and voice store, serve until SIGINT/SIGTERM, shut down cleanly.

    On a signal: new offers are refused, every session is closed (streams cancelled, tasks
    awaited, peer connections closed), then the engine is stopped; returns 0. A second
    SIGINT/SIGTERM while that runs exits the process at once (:func:`_exit_now`).
    """
    server = cfg.server
    check_port(server.host, server.port)  # before the model loads (seconds to minutes)
    engine, store = load_runtime(cfg)
    loop = _new_loop()

    def announce(_: str) -> None:
        print(f"voice_out serving on http://{server.host}:{server.port}/ (Ctrl-C to stop)", flush=True)

    app = create_app(cfg, engine, store)
    # first of the shutdown hooks: from here on a signal no longer asks for a graceful exit
    # (aiohttp's handler would raise GracefulExit inside the shutdown: a traceback, and the
    # engine never stopped), it ends the process
    app.on_shutdown.insert(0, _exit_on_next_signal)
    try:
        web.run_app(
            app,
            host=server.host,
            port=server.port,
            print=announce,
            loop=loop,
            shutdown_timeout=10.0,
            handle_signals=True,
        )
    except OSError as e:
        raise ListenError(f"cannot listen on {server.host}:{server.port}: {e.strerror or e}") from None
    finally:
        if not loop.is_closed():
            loop.close()
    return 0


def check_port(host: str, port: int) -> None:
    """Raise :class:`ListenError` when ``host:port`` cannot be bound now (in use, not an address
    of this machine, a privileged port): ``serve`` checks this before loading the model, so
    the user learns it at once. Binds like aiohttp will (SO_REUSEADDR) and lets go at once."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ListenError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    unavailable: OSError | None = None
    bound = 0
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio binds it
            try:
                sock.bind(addr)
                bound += 1
            except OSError as e:
                if e.errno == errno.EADDRNOTAVAIL:  # a family this host lacks: asyncio skips it too
                    unavailable = e
                    continue
                in_use = e.errno == errno.EADDRINUSE
                hint = " (another process listens there: stop it, or pass --port)" if in_use else ""
                raise ListenError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None
    if not bound and unavailable is not None:
        raise ListenError(f"cannot listen on {host}:{port}: {unavailable.strerror or unavailable}")


async def _exit_on_next_signal(app: web.Application) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # no loop signals here
            loop.add_signal_handler(sig, _exit_now, sig)


def _exit_now(sig: signal.Signals) -> None:
    """A second SIGINT/SIGTERM while the first's graceful shutdown runs: the user wants the
    process gone now. One line on stderr, exit status 128 + the signal's number; the OS frees
    the GPU and the sockets (sessions get no goodbye)."""
    print(f"voice_out: {sig.name} again while shutting down: exiting now", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(128 + int(sig))


def _new_loop() -> asyncio.AbstractEventLoop:
    if sys.platform != "win32":
        with contextlib.suppress(ImportError):
            import uvloop

            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def load_runtime(cfg: Config) -> tuple[EngineLike, VoiceStoreLike | None]:
    """The engine and voice store of ``cfg`` (blocking: resolves the model, reads dims).

    Raises a one-line :class:`VoiceOutError` when something the user can fix is missing.
    """
    try:
        # the streaming engine itself first: the loader may have been imported already
        importlib.import_module("voice_out.engine.engine")
        from voice_out.engine.placement import load_placement
    except ModuleNotFoundError as e:
        if e.name in ("voice_out.engine.engine", "voice_out.engine.build"):
            raise EngineUnavailableError(
                "cannot serve: the streaming engine (voice_out.engine.engine) is not part of this build"
            ) from None
        raise
    from voice_out.hub import resolve_model
    from voice_out.voices.store import VoiceStore

    mc = cfg.model
    source = resolve_model(mc.model, mc.cache_dir, revision=mc.revision, offline=mc.offline)
    # A real model directory brings the prompt networks, so voices can be added over HTTP;
    # random weights have none and the store is read-only (POST /voices answers 501).
    store = VoiceStore(cfg.server.voices_dir, source.path)
    if cfg.server.engine == "ray":
        # the engines live in Ray Serve replicas reading the same voices directory
        from voice_out.engine.ray_serve.client import RayEngine

        return RayEngine(cfg, store), store
    # one engine per device of model.device, new utterances placed by load (docs/scale-out.md)
    engine = load_placement(cfg, voices=store)
    default = cfg.server.default_voice
    if default is not None and default not in (names := engine.voice_names()):
        raise UnknownDefaultVoiceError(
            f"server.default_voice = {default!r} is not a registered voice "
            f"(registered in {cfg.server.voices_dir}: {', '.join(names) or 'none'}): register it with "
            f'`voice-out voices add {default} AUDIO "TRANSCRIPT"` or set server.default_voice to one of them'
        )
    return engine, store
