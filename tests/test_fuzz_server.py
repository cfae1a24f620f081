"""Hypothesis fuzz of what a client sends the real server: data-channel messages (through the
real aiortc data channel), control-WebSocket messages (through a real WebSocket) and
``POST /offer`` bodies. After each example a ping is answered on the data channel and on the
WebSocket, and ``/healthz`` answers 200: nothing a client sends ends its session or the server.

The server is the real one (aiohttp + aiortc, protocol, session, track) over the fake engine
of tests/fakes.py: the engine is not what is under test here (tests/test_soak.py drives the
real one). A few hundred examples in CI; thousands with ``-m slow``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fakes import FakeEngine, FakeVoiceStore
from voice_out.client import VoiceOutClient, connect
from voice_out.config import ServerConfig
from voice_out.server import protocol as p
from voice_out.server.app import SESSIONS_KEY, create_app

T = TypeVar("T")
CI_EXAMPLES = 300
SLOW_EXAMPLES = 3000
#: Each example must be answered within this (s): generous for a loaded 2-core machine.
ANSWER_TIMEOUT_S = 10.0


# -- the rig: one server, one browser-side client, one control WebSocket, on one loop ---------


@dataclass
class Rig:
    loop: asyncio.AbstractEventLoop
    server: TestServer
    engine: FakeEngine
    http: aiohttp.ClientSession
    client: VoiceOutClient
    ws: aiohttp.ClientWebSocketResponse
    n_pings: int = 0

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(asyncio.wait_for(coro, 4 * ANSWER_TIMEOUT_S))


async def start_rig(loop: asyncio.AbstractEventLoop) -> Rig:
    # many short utterances, fast: the fuzz is about messages, not audio
    engine = FakeEngine(voices=("alice", "bob"))
    app = create_app(ServerConfig(max_queued_utterances=8), engine, FakeVoiceStore(engine), web_dir=None)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    http = aiohttp.ClientSession()
    client = await connect(url)
    ws = await http.ws_connect(f"{url}/sessions/{client.session_id}/control")
    ready = json.loads((await ws.receive()).data)
    assert ready["type"] == "session.ready"
    return Rig(loop, server, engine, http, client, ws)


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    loop = asyncio.new_event_loop()
    r = loop.run_until_complete(start_rig(loop))
    try:
        yield r
    finally:
        loop.run_until_complete(r.ws.close())
        loop.run_until_complete(r.client.close())
        loop.run_until_complete(r.http.close())
        loop.run_until_complete(r.server.close())
        loop.close()


# -- what a client may send ----------------------------------------------------------------

#: Every code point, lone surrogates included (JSON can carry them as \ud800 escapes).
any_text = st.text(st.characters(codec=None, categories=None), max_size=40)
ids = st.one_of(
    st.sampled_from(["u1", "u2", "u3", ""]),
    any_text,
    st.integers(),
    st.none(),
    st.floats(allow_nan=False),
    st.lists(st.integers(), max_size=2),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | any_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(any_text, inner, max_size=3),
    max_leaves=8,
)


@st.composite
def protocol_objects(draw: st.DrawFn) -> dict[str, Any]:
    """A message shaped like the protocol's, with every field sometimes wrong or missing."""
    mtype = draw(st.sampled_from(["text.delta", "text.delta", "text.done", "cancel", "ping"]) | any_text)
    obj: dict[str, Any] = {"type": mtype}
    if draw(st.booleans()):
        obj["id"] = draw(ids)
    if mtype == "text.delta" or draw(st.integers(0, 4)) == 0:
        obj["delta"] = draw(any_text | st.sampled_from(["Hi \ud83d", "\ude00 there.", "Hello. "]) | json_values)
    if draw(st.integers(0, 3)) == 0:
        obj["voice"] = draw(st.sampled_from(["alice", "bob", "nobody", "../x"]) | json_values)
    if draw(st.integers(0, 3)) == 0:
        obj["fast_first"] = draw(st.integers(-5, 2000) | json_values)
    if mtype == "ping" or draw(st.integers(0, 5)) == 0:
        obj["t"] = draw(st.integers() | st.floats() | json_values)
    if draw(st.integers(0, 5)) == 0:
        obj[draw(any_text)] = draw(json_values)
    return obj


def dumps_any(obj: Any) -> str:
    """JSON text of ``obj``; surrogates as \\u escapes (a transport carries only UTF-8), NaN
    and Infinity as Python writes them (not JSON: the server must refuse them)."""
    return json.dumps(obj, ensure_ascii=True)


@st.composite
def raw_messages(draw: st.DrawFn) -> str | bytes:
    kind = draw(st.integers(0, 9))
    if kind <= 5:
        return dumps_any(draw(protocol_objects()))
    if kind == 6:
        return dumps_any(draw(json_values))
    if kind == 7:
        return draw(st.binary(max_size=64))
    if kind == 8:  # not JSON at all
        return draw(st.text(st.characters(codec="utf-8"), max_size=60))
    size = draw(st.sampled_from([p.MAX_MESSAGE_BYTES - 20, p.MAX_MESSAGE_BYTES + 1, 200_000]))
    return json.dumps({"type": "text.delta", "id": "big", "delta": "a" * size})


class NotUtf8(str):
    """A str whose UTF-8 encoding is other bytes: how a broken peer's text reaches aiortc."""

    payload: bytes = b""

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return self.payload


def not_utf8(payload: bytes) -> NotUtf8:
    s = NotUtf8("x")
    s.payload = payload
    return s


@dataclass(frozen=True)
class Example:
    messages: list[tuple[str, str | bytes]]  # (where: "channel" | "ws", the message)


examples = st.builds(
    Example,
    st.lists(
        st.tuples(st.sampled_from(["channel", "ws"]), raw_messages())
        | st.tuples(
            st.just("channel-bytes"),
            st.binary(min_size=1, max_size=40).filter(lambda b: not _is_utf8(b)),
        ),
        min_size=1,
        max_size=4,
    ),
)


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# -- one example -------------------------------------------------------------------------------


async def apply(rig: Rig, example: Example) -> None:
    for where, msg in example.messages:
        if where == "ws":
            if isinstance(msg, bytes):
                await rig.ws.send_bytes(msg)
            else:
                await rig.ws.send_str(msg)
        elif where == "channel-bytes":
            assert isinstance(msg, bytes)
            rig.client.send_raw(not_utf8(msg))
        elif isinstance(msg, bytes) and not msg:
            continue  # aiortc sends b"" as a one-byte message of its own kind: not ours to fuzz
        else:
            rig.client.send_raw(msg)
    await check_alive(rig)


async def check_alive(rig: Rig) -> None:
    """A ping answered on the data channel and on the WebSocket, /healthz 200. Each transport
    first cancels everything (applied before its ping is answered), so that the next example
    starts from an idle session."""
    rig.n_pings += 1
    t = 1e6 + rig.n_pings
    rig.client.cancel()
    rig.client.ping(t)
    await rig.ws.send_str('{"type":"cancel"}')
    await rig.ws.send_str(json.dumps({"type": "ping", "t": t}))
    pong = await rig.client.wait_for(lambda m: isinstance(m, p.Pong) and m.t == t, timeout_s=ANSWER_TIMEOUT_S)
    assert isinstance(pong, p.Pong)
    while True:
        m = await asyncio.wait_for(rig.ws.receive(), ANSWER_TIMEOUT_S)
        assert m.type == aiohttp.WSMsgType.TEXT, m  # the socket is open and its writer alive
        msg = json.loads(m.data)
        if msg == {"type": "pong", "t": t}:
            break
    async with rig.http.get(rig.url + "/healthz") as r:
        assert r.status == 200
    session = rig.server.app[SESSIONS_KEY].get(rig.client.session_id)
    assert session is not None and not session.closed
    assert not session.live


def fuzz_messages(rig: Rig, n: int) -> None:
    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(example=examples)
    def run(example: Example) -> None:
        rig.run(apply(rig, example))

    run()
    # nothing piled up: every utterance the fuzz started has ended
    rig.run(asyncio.sleep(0.2))
    assert rig.engine.active == set(), rig.engine.active
    assert len(rig.server.app[SESSIONS_KEY]) == 1


def test_fuzz_data_channel_and_control_websocket(rig: Rig) -> None:
    fuzz_messages(rig, CI_EXAMPLES)


@pytest.mark.slow
def test_fuzz_data_channel_and_control_websocket_long(rig: Rig) -> None:
    fuzz_messages(rig, SLOW_EXAMPLES)


# -- POST /offer bodies --------------------------------------------------------------------------

sdp_lines = st.sampled_from(
    [
        "v=0",
        "o=- 1 1 IN IP4 0.0.0.0",
        "s=-",
        "t=0 0",
        "m=audio 9 UDP/TLS/RTP/SAVPF 111",
        "m=application 9 UDP/DTLS/SCTP webrtc-datachannel",
        "a=mid:0",
        "a=rtpmap:111 opus/48000/2",
        "a=ice-ufrag:abcd",
        "a=ice-pwd:abcdefghijklmnopqrstuv",
        "a=fingerprint:sha-256 00:11",
        "a=setup:actpass",
        "a=candidate:1 1 udp 1 127.0.0.1 9 typ host",
        "a=group:BUNDLE 0 1",
        "c=IN IP4 0.0.0.0",
    ]
)
sdps = st.lists(sdp_lines | any_text, max_size=30).map(lambda lines: "\r\n".join(lines) + "\r\n")
offer_bodies = st.one_of(
    st.builds(lambda sdp, t: dumps_any({"sdp": sdp, "type": t}).encode(), sdps, st.sampled_from(["offer", "answer"])),
    st.builds(lambda v: dumps_any(v).encode(), json_values),
    st.binary(max_size=200),
    st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n),
    st.builds(lambda v: json.dumps({"sdp": v, "type": "offer"}).encode(), json_values),
)


async def post_offer(rig: Rig, body: bytes, content_type: str) -> None:
    async with rig.http.post(rig.url + "/offer", data=body, headers={"Content-Type": content_type}) as r:
        assert r.content_type == "application/json", (r.status, await r.text())
        answer = await r.json()
        assert r.status < 500, answer
        if r.status == 200:  # a random offer that negotiates: end the session it opened
            await rig.server.app[SESSIONS_KEY].close(answer["session_id"])
        else:
            assert set(answer) == {"error"}, answer
    await check_alive(rig)


def fuzz_offers(rig: Rig, n: int) -> None:
    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(body=offer_bodies, content_type=st.sampled_from(["application/json", "text/plain", ""]))
    def run(body: bytes, content_type: str) -> None:
        rig.run(post_offer(rig, body, content_type))

    run()
    assert len(rig.server.app[SESSIONS_KEY]) == 1


def test_fuzz_offer_bodies(rig: Rig) -> None:
    fuzz_offers(rig, CI_EXAMPLES // 2)


@pytest.mark.slow
def test_fuzz_offer_bodies_long(rig: Rig) -> None:
    fuzz_offers(rig, SLOW_EXAMPLES // 2)
