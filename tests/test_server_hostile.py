"""What a hostile or careless client sends, against the real server (aiohttp + aiortc) on a fake
engine: every answer is a JSON error, the session and the server go on, nothing leaks.

Covers routing (JSON 404/405), malformed and oversized bodies (nested JSON, chunked bodies
over the limit, offers with thousands of media sections), stalled and reset bodies, Origin
checks, lone surrogates and characters split across deltas, a data-channel text that is not
UTF-8, a 1 MiB control-WebSocket message, process metrics, and codec threads freed with their
session.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer
from aiortc import RTCPeerConnection

from tests.fakes import FakeEngine, FakeVoiceStore
from voice_out.client import VoiceOutClient, connect
from voice_out.config import ConfigError, ServerConfig
from voice_out.server import protocol as p
from voice_out.server.app import SESSIONS_KEY, create_app


@dataclass
class Server:
    url: str
    app: web.Application
    engine: FakeEngine
    http: aiohttp.ClientSession

    @property
    def host_port(self) -> tuple[str, int]:
        rest = self.url.split("://", 1)[1]
        host, port = rest.rsplit(":", 1)
        return host, int(port)


@pytest_asyncio.fixture
async def make_server(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    web_dir = tmp_path / "web"
    web_dir.mkdir()
    (web_dir / "index.html").write_text("<!doctype html><title>voice_out</title>")
    (web_dir / "app.js").write_text("console.log('hi')")
    servers: list[TestServer] = []
    runners: list[web.AppRunner] = []
    https: list[aiohttp.ClientSession] = []

    async def make(*, as_served: bool = False, **server_cfg: Any) -> Server:
        """``as_served``: run the app as ``voice-out serve`` does (``web.run_app``'s runner), whose
        handlers run on when their client leaves; aiohttp's TestServer cancels them instead."""
        engine = FakeEngine()
        app = create_app(ServerConfig(**server_cfg), engine, FakeVoiceStore(engine), web_dir=web_dir)
        if as_served:
            runner = web.AppRunner(app)
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        else:
            srv = TestServer(app, host="127.0.0.1")
            await srv.start_server()
            servers.append(srv)
            url = str(srv.make_url("")).rstrip("/")
        http = aiohttp.ClientSession()
        https.append(http)
        return Server(url, app, engine, http)

    yield make
    for h in https:
        await h.close()
    for s in servers:
        await s.close()
    for r in runners:
        await r.cleanup()


async def json_error(resp: aiohttp.ClientResponse) -> tuple[int, str]:
    """The status and the ``error.code`` of a JSON error answer (fails on any other body)."""
    assert resp.content_type == "application/json", (resp.status, await resp.text())
    body = await resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}, body
    return resp.status, str(body["error"]["code"])


async def healthy(server: Server) -> None:
    async with server.http.get(server.url + "/healthz") as r:
        assert r.status == 200


# -- routing and bodies ----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_unknown_routes_404_and_wrong_methods_405_as_json(make_server: Callable[..., Any]) -> None:
    server: Server = await make_server()
    cases = [
        ("POST", "/v0/nothing/here", 404, "not_found"),
        ("GET", "/no/such/file", 404, "not_found"),
        ("DELETE", "/nothing", 404, "not_found"),
        ("PUT", "/offer", 405, "method_not_allowed"),
        ("DELETE", "/voices", 405, "method_not_allowed"),
        ("PATCH", "/healthz", 405, "method_not_allowed"),
        ("POST", "/app.js", 405, "method_not_allowed"),  # a static file: GET only
        ("GET", "/offer", 405, "method_not_allowed"),
    ]
    for method, path, status, code in cases:
        async with server.http.request(method, server.url + path) as r:
            assert await json_error(r) == (status, code), (method, path)
            if status == 405:
                assert "GET" in r.headers["Allow"] or "POST" in r.headers["Allow"], r.headers
    async with server.http.request("PATCH", server.url + "/healthz") as r:
        assert r.headers["Allow"] == "GET, HEAD"
    async with server.http.request("PUT", server.url + "/offer") as r:
        assert r.headers["Allow"] == "POST"


@pytest.mark.asyncio
async def test_malformed_offer_bodies_get_json_4xx(make_server: Callable[..., Any]) -> None:
    server: Server = await make_server()
    bodies: list[bytes] = [
        b"[" * 1000 + b"]" * 1000,  # a RecursionError in the JSON decoder
        b'{"sdp": ' + b"[" * 100_000 + b"]" * 100_000 + b', "type": "offer"}',
        b"\xff\xfe not utf-8",
        b"",
        b"null",
        b'{"sdp": 5, "type": "offer"}',
        b'{"sdp": "v=0", "type": "answer"}',
        b'{"sdp": "v=0\\r\\nm=audio 9 UDP/TLS/RTP/SAVPF 111\\r\\n", "type": "offer"}',  # not negotiable
        json.dumps({"sdp": "m=audio\n" + "\x00" * 1000, "type": "offer"}).encode(),
    ]
    for body in bodies:
        async with server.http.post(server.url + "/offer", data=body) as r:
            status, code = await json_error(r)
            assert 400 <= status < 500 and code in ("bad_json", "bad_field", "missing_field", "bad_offer"), (
                body[:40],
                status,
                code,
            )
    await healthy(server)


@pytest.mark.asyncio
async def test_offer_limit_holds_for_chunked_bodies(make_server: Callable[..., Any]) -> None:
    server: Server = await make_server()
    sent = 0

    async def chunks() -> AsyncIterator[bytes]:
        nonlocal sent
        piece = b'{"sdp": "' + b"a" * 65536
        for _ in range(80):  # 5 MiB, no Content-Length
            sent += len(piece)
            yield piece
            piece = b"a" * 65536

    async with server.http.post(server.url + "/offer", data=chunks()) as r:
        assert "Content-Length" not in r.request_info.headers
        assert await json_error(r) == (413, "too_large")
    assert sent > 256 * 1024
    await healthy(server)


async def offer_of(n_sections: int) -> str:
    """A real offer (aiortc's) whose audio section is repeated ``n_sections`` times."""
    pc = RTCPeerConnection()
    pc.addTransceiver("audio", direction="recvonly")
    await pc.setLocalDescription(await pc.createOffer())
    sdp = pc.localDescription.sdp
    await pc.close()
    head, audio = sdp[: sdp.index("m=audio")], sdp[sdp.index("m=audio") :]
    head = "".join(line + "\r\n" for line in head.splitlines() if not line.startswith("a=group:"))
    return head + "".join(audio.replace("a=mid:0", f"a=mid:{i}") for i in range(n_sections))


@pytest.mark.asyncio
async def test_offers_with_thousands_of_sections_are_refused_fast(make_server: Callable[..., Any]) -> None:
    server: Server = await make_server()
    for n in (9, 300, 2500):
        body = json.dumps({"sdp": await offer_of(n), "type": "offer"})
        t0 = time.perf_counter()
        async with server.http.post(server.url + "/offer", data=body) as r:
            status, code = await json_error(r)
        elapsed = time.perf_counter() - t0
        if len(body) > 256 * 1024:
            assert (status, code) == (413, "too_large")
        else:
            assert (status, code) == (400, "bad_offer"), n
        assert elapsed < 0.5, (n, elapsed)
    # Within every bound (8 sections, < 2000 lines) but heavy to parse: parsed off the loop,
    # so /healthz answers meanwhile.
    padding = "".join(f"a=x-pad:{i} {'y' * 100}\r\n" for i in range(1900))
    heavy = (await offer_of(1)).replace("a=recvonly\r\n", "a=recvonly\r\n" + padding)
    assert len(heavy) < 256 * 1024

    async def heavy_offer() -> None:
        async with server.http.post(server.url + "/offer", json={"sdp": heavy, "type": "offer"}) as r:
            await json_error(r)  # not negotiable (no ICE/DTLS); what matters is the loop

    async def probe() -> float:
        t0 = time.perf_counter()
        await healthy(server)
        return time.perf_counter() - t0

    task = asyncio.create_task(heavy_offer())
    worst = max([await probe() for _ in range(5)])
    await task
    assert worst < 0.2, worst


# -- slow and vanishing clients --------------------------------------------------------------


async def raw_request(server: Server, head: bytes, body: bytes) -> socket.socket:
    host, port = server.host_port
    sock = socket.create_connection((host, port))
    sock.sendall(head + body)
    return sock


@pytest.mark.asyncio
async def test_a_stalled_body_times_out_with_408(make_server: Callable[..., Any]) -> None:
    server: Server = await make_server(body_timeout_s=0.5)
    head = b"POST /offer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    sock = await raw_request(server, head, b'{"sdp"')
    sock.settimeout(5)
    t0 = time.perf_counter()
    answer = await asyncio.get_running_loop().run_in_executor(None, sock.recv, 4096)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
    assert b'"code": "timeout"' in answer or b'"code":"timeout"' in answer
    assert 0.4 < time.perf_counter() - t0 < 3


@pytest.mark.asyncio
async def test_a_client_reset_mid_body_logs_no_traceback(
    make_server: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """As served, a handler reading a body whose client resets gets the reset as an exception
    (aiohttp's TestServer would cancel the handler instead, and no traceback could ever show):
    one log line, no traceback, on every route that reads a body."""
    server: Server = await make_server(as_served=True)
    caplog.set_level(logging.INFO)
    json_start = {
        b"/offer": b'{"sdp": "',
        b"/v1/audio/speech": b'{"model": "tts-1", "input": "',
        b"/v1/text-to-speech/alice/stream?output_format=pcm_24000": b'{"text": "',
    }
    part = b'--XX\r\nContent-Disposition: form-data; name="audio"\r\n\r\nRIFF'
    for path, body in [*json_start.items(), (b"/voices", part)]:
        ctype = b"multipart/form-data; boundary=XX" if path == b"/voices" else b"application/json"
        head = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: %s\r\nContent-Length: 100000\r\n\r\n" % (path, ctype)
        sock = await raw_request(server, head, body)
        await asyncio.sleep(0.2)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
        sock.close()
    await asyncio.sleep(0.5)
    await healthy(server)
    tracebacks = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not tracebacks, [r.getMessage() for r in tracebacks]
    gone = [r.getMessage() for r in caplog.records if "went away while sending" in r.getMessage()]
    assert len(gone) == 4, gone  # each reset is seen, and said in one line
    assert not server.engine.opened


# -- the agents' HTTP routes read bodies as every route does --------------------------------


@dataclass(frozen=True)
class AgentRoute:
    """An agent-compatibility route: its path, a good body, its body limit (bytes), and how
    its own error shape names an error (OpenAI: ``error.code``; ElevenLabs: ``detail.status``)."""

    path: str
    body: dict[str, Any]
    limit: int

    def error_code(self, body: dict[str, Any]) -> str:
        if self.path.startswith("/v1/audio/"):
            assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
            return str(body["error"]["code"])
        assert set(body) == {"detail"} and set(body["detail"]) == {"status", "message"}, body
        return str(body["detail"]["status"])


AGENT_ROUTES = {
    "elevenlabs": AgentRoute("/v1/text-to-speech/alice/stream?output_format=pcm_24000", {"text": "Hi there."}, 1 << 20),
    "openai": AgentRoute(
        "/v1/audio/speech",
        {"model": "tts-1", "input": "Hi there.", "voice": "alice", "response_format": "pcm"},
        128 * 1024,
    ),
}
TOO_LARGE = {"elevenlabs": "text_too_long", "openai": "request_too_large"}
TIMEOUT = {"elevenlabs": "request_timeout", "openai": "request_timeout"}


async def agent_error(route: AgentRoute, resp: aiohttp.ClientResponse) -> tuple[int, str]:
    assert resp.content_type == "application/json", (resp.status, resp.content_type, (await resp.read())[:80])
    return resp.status, route.error_code(await resp.json())


async def speaks(server: Server, route: AgentRoute) -> None:
    """A good request on ``route`` answers audio, and the engine holds no stream after it."""
    async with server.http.post(server.url + route.path, json=route.body) as r:
        assert r.status == 200, await r.text()
        assert len(await r.read()) > 1000
    await asyncio.sleep(0.05)
    assert not server.engine.active


@pytest.mark.asyncio
@pytest.mark.parametrize("api", sorted(AGENT_ROUTES))
async def test_agent_routes_refuse_oversized_bodies_by_bytes_read(make_server: Callable[..., Any], api: str) -> None:
    server: Server = await make_server()
    route = AGENT_ROUTES[api]
    # Valid JSON over the limit, so that only the byte limit can refuse it (the text is short).
    big = json.dumps({**route.body, "pad": "x" * route.limit}).encode()

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the limit is on bytes read
        for i in range(0, len(big), 64 * 1024):
            yield big[i : i + 64 * 1024]

    for data in (chunked(), big):
        async with server.http.post(server.url + route.path, data=data) as r:
            assert await agent_error(route, r) == (413, TOO_LARGE[api])
    assert not server.engine.opened
    await speaks(server, route)
    await healthy(server)


@pytest.mark.asyncio
@pytest.mark.parametrize("api", sorted(AGENT_ROUTES))
async def test_agent_routes_time_out_a_stalled_body_with_408(make_server: Callable[..., Any], api: str) -> None:
    server: Server = await make_server(body_timeout_s=0.5)
    route = AGENT_ROUTES[api]
    never = asyncio.Event()

    async def stalled() -> AsyncIterator[bytes]:
        yield b'{"text": "Hi'
        await never.wait()  # the rest never comes

    t0 = time.perf_counter()
    async with server.http.post(server.url + route.path, data=stalled(), timeout=aiohttp.ClientTimeout(total=5)) as r:
        assert await agent_error(route, r) == (408, TIMEOUT[api])
    assert 0.4 < time.perf_counter() - t0 < 3
    assert not server.engine.opened
    await speaks(server, route)
    await healthy(server)


# -- Origin ----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_state_changing_routes_refuse_other_origins(make_server: Callable[..., Any]) -> None:
    server: Server = await make_server()
    evil = {"Origin": "http://evil.example"}
    text_offer = {"Content-Type": "text/plain", **evil}  # what a cross-site form or fetch sends
    async with server.http.post(server.url + "/offer", data='{"sdp": "x", "type": "offer"}', headers=text_offer) as r:
        assert await json_error(r) == (403, "forbidden_origin")
    form = aiohttp.FormData()
    form.add_field("name", "mallory")
    form.add_field("transcript", "hello")
    form.add_field("audio", b"RIFF....", filename="a.wav")
    async with server.http.post(server.url + "/voices", data=form, headers=evil) as r:
        assert await json_error(r) == (403, "forbidden_origin")
    async with server.http.delete(server.url + "/voices/alice", headers=evil) as r:
        assert await json_error(r) == (403, "forbidden_origin")
    assert "mallory" not in server.engine.voices and "alice" in server.engine.voices
    client = await connect(server.url)
    try:
        with pytest.raises(aiohttp.WSServerHandshakeError) as e:
            await server.http.ws_connect(f"{server.url}/sessions/{client.session_id}/control", headers=evil)
        assert e.value.status == 403
        # The server's own page (same host and port), and a client without Origin, pass.
        host, port = server.host_port
        own = {"Origin": f"http://{host}:{port}"}
        async with server.http.ws_connect(f"{server.url}/sessions/{client.session_id}/control", headers=own) as ws:
            assert json.loads((await ws.receive()).data)["type"] == "session.ready"
        async with server.http.delete(server.url + "/voices/bob", headers=own) as r:
            assert r.status == 204
        # Reads are not state-changing: any origin may read (CORS still keeps the answer from
        # another origin's script).
        async with server.http.get(server.url + "/voices", headers=evil) as r:
            assert r.status == 200
    finally:
        await client.close()


@pytest.mark.asyncio
async def test_allowed_origins_are_configured(make_server: Callable[..., Any]) -> None:
    server: Server = await make_server(allowed_origins=("https://app.example.com",))
    async with server.http.delete(server.url + "/voices/alice", headers={"Origin": "https://app.example.com"}) as r:
        assert r.status == 204
    async with server.http.delete(server.url + "/voices/bob", headers={"Origin": "https://other.example.com"}) as r:
        assert await json_error(r) == (403, "forbidden_origin")


@pytest.mark.parametrize(
    ("origin", "why"),
    [
        ("app.example.com", "no scheme"),
        ("ftp://app.example.com", "scheme 'ftp' is not http or https"),
        ("https://app.example.com/", "an origin has no path"),
        ("https://App.example.com", "lower case"),
        ("https://app.example.com:99999", "Port out of range"),
    ],
)
def test_allowed_origins_validation(origin: str, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        ServerConfig(allowed_origins=(origin,))
    assert f"server.allowed_origins: {origin!r} is invalid: " in str(e.value) and why in str(e.value)


# -- messages --------------------------------------------------------------------------------


async def ws_json(ws: aiohttp.ClientWebSocketResponse) -> dict[str, Any]:
    m = await asyncio.wait_for(ws.receive(), 5)
    assert m.type == aiohttp.WSMsgType.TEXT, m
    return dict(json.loads(m.data))


@pytest.mark.asyncio
async def test_lone_surrogates_are_bad_field_and_the_agent_keeps_hearing(make_server: Callable[..., Any]) -> None:
    server: Server = await make_server()
    client = await connect(server.url)
    try:
        async with server.http.ws_connect(f"{server.url}/sessions/{client.session_id}/control") as ws:
            assert (await ws_json(ws))["type"] == "session.ready"
            # From the browser: a lone surrogate in an id. The agent must still hear events.
            client.send_raw('{"type":"text.delta","id":"\\ud800","delta":"Hi."}')
            err = await client.wait_for("error")
            assert isinstance(err, p.Error) and err.code == "bad_field" and err.id is None
            for raw in (
                '{"type":"text.delta","id":"a","delta":"Hi.","voice":"\\udfff"}',
                '{"type":"text.delta","id":"b","delta":"H\\ud800i."}',
                '{"type":"text.delta","id":"c","delta":"\\udc00Hi."}',
            ):
                await ws.send_str(raw)
                got = await ws_json(ws)
                assert got["type"] == "error" and got["code"] == "bad_field", (raw, got)
            client.send_text("ok", "Still here. ")
            client.done("ok")
            assert (await ws_json(ws))["type"] == "audio.started"
            await ws.send_str('{"type":"ping","t":7}')
            msgs = [await ws_json(ws) for _ in range(2)]
            assert {"type": "pong", "t": 7} in msgs, msgs
    finally:
        await client.close()


@pytest.mark.asyncio
async def test_a_character_split_across_deltas_is_joined(make_server: Callable[..., Any]) -> None:
    server: Server = await make_server()
    client = await connect(server.url)
    try:
        # "Hi 😀 there." sliced by UTF-16 unit, as JavaScript's string.slice does
        client.send_raw('{"type":"text.delta","id":"e","delta":"Hi \\ud83d"}')
        client.send_raw('{"type":"text.delta","id":"e","delta":"\\ude00 there."}')
        client.done("e")
        done = await client.wait_for("audio.done", "e")
        assert isinstance(done, p.AudioDone)
        assert not [ev for ev in client.events if ev.message.TYPE == "error"]
        assert server.engine.opened[-1].text == "Hi \U0001f600 there."
        # a held half that no low surrogate follows is dropped and reported, the text goes on
        client.send_raw('{"type":"text.delta","id":"f","delta":"A \\ud83d"}')
        client.send_raw('{"type":"text.delta","id":"f","delta":"b."}')
        err = await client.wait_for("error", "f")
        assert isinstance(err, p.Error) and err.code == "bad_field"
        assert server.engine.opened[-1].text == "A b."
    finally:
        await client.close()


class _InvalidUtf8(str):
    """A str whose UTF-8 encoding is not UTF-8: how a broken peer's bytes reach aiortc."""

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return b'{"type":"ping","t":1}\xff\xfe'


@pytest.mark.asyncio
async def test_a_data_channel_text_that_is_not_utf8_is_reported(make_server: Callable[..., Any]) -> None:
    server: Server = await make_server()
    client = await connect(server.url)
    try:
        client.send_raw(_InvalidUtf8("x"))
        err = await client.wait_for("error", timeout_s=5)
        assert isinstance(err, p.Error) and err.code == "bad_json" and "UTF-8" in err.message
        client.ping(2.0)
        pong = await client.wait_for("pong", timeout_s=5)
        assert isinstance(pong, p.Pong) and pong.t == 2.0
        assert len(server.app[SESSIONS_KEY]) == 1
        client.send_text("u", "Still speaking. ")
        client.done("u")
        await client.wait_for("audio.done", "u")
    finally:
        await client.close()


@pytest.mark.asyncio
async def test_a_1mib_control_message_is_message_too_large(make_server: Callable[..., Any]) -> None:
    server: Server = await make_server()
    client = await connect(server.url)
    try:
        async with server.http.ws_connect(f"{server.url}/sessions/{client.session_id}/control") as ws:
            assert (await ws_json(ws))["type"] == "session.ready"
            big = json.dumps({"type": "text.delta", "id": "x", "delta": "a" * (1024 * 1024)})
            await ws.send_str(big)
            got = await ws_json(ws)
            assert got["type"] == "error" and got["code"] == "message_too_large"
            await ws.send_str('{"type":"ping","t":3}')
            assert await ws_json(ws) == {"type": "pong", "t": 3}
    finally:
        await client.close()


# -- metrics and threads ---------------------------------------------------------------------


@pytest.mark.asyncio
async def test_metrics_have_process_and_gc_figures(make_server: Callable[..., Any]) -> None:
    server: Server = await make_server()
    async with server.http.get(server.url + "/metrics") as r:
        text = await r.text()
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    expected = {
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_cpu_seconds_total",
        "python_gc_objects_collected_total",
        "python_gc_collections_total",
        "python_info",
    }
    assert expected <= names, expected - names


async def until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.02)


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)")
@pytest.mark.asyncio
async def test_a_closed_session_frees_its_codec_threads_without_gc(make_server: Callable[..., Any]) -> None:
    server: Server = await make_server()

    async def one_session() -> None:
        client: VoiceOutClient = await connect(server.url)
        client.send_text("u", "Hello there. ")
        client.done("u")
        await client.wait_for("audio.done", "u")
        await client.close()
        await until(lambda: not len(server.app[SESSIONS_KEY]))
        await asyncio.sleep(0.2)

    gc.collect()
    gc.disable()  # the leak was threads held until the collector ran
    try:
        await one_session()  # warm: first-use threads of libraries
        before = os_threads()
        for _ in range(3):
            await one_session()
        assert os_threads() <= before, (before, os_threads())
    finally:
        gc.enable()


class _FlakySocket:
    """A WebSocket stand-in whose sends fail as told: ``fail[i]`` is raised by send ``i``."""

    def __init__(self, fail: dict[int, Exception]) -> None:
        self.fail = fail
        self.calls = 0
        self.sent: list[str] = []
        self.closed = False
        self.close_message: bytes | None = None

    async def send_str(self, text: str) -> None:
        self.calls += 1
        if self.calls in self.fail:
            raise self.fail[self.calls]
        self.sent.append(text)

    async def close(self, *, message: bytes = b"") -> None:
        self.closed = True
        self.close_message = message


@pytest.mark.asyncio
async def test_a_failed_send_never_kills_the_control_writer_silently(caplog: pytest.LogCaptureFixture) -> None:
    from voice_out.server.app import WebSocketSink

    # one message that cannot be sent: logged, dropped, the next ones go out
    sink, ws = WebSocketSink(), _FlakySocket({2: ValueError("cannot encode")})
    for text in ("a", "b", "c"):
        sink.send(text)
    sink.close()
    await asyncio.wait_for(sink.write(ws), 5)  # type: ignore[arg-type]
    assert ws.sent == ["a", "c"] and ws.closed and ws.close_message == b"session closed"
    assert any("could not be sent" in r.getMessage() and r.exc_info for r in caplog.records)
    # the socket gone: the writer ends, says so, and closes the socket (no deaf open socket)
    caplog.clear()
    caplog.set_level(logging.INFO)
    sink, ws = WebSocketSink(), _FlakySocket({1: ConnectionResetError("reset")})
    sink.send("a")
    sink.send("b")
    await asyncio.wait_for(sink.write(ws), 5)  # type: ignore[arg-type]
    assert ws.sent == [] and ws.closed
    assert any("its writer stops" in r.getMessage() for r in caplog.records)
