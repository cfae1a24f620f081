"""The ElevenLabs-compatible routes (voice_out.server.elevenlabs) over the real engine
(random:tiny, forced tokens) in this process, so that every check can also look at the engine:
an interrupted or abandoned context must leave no stream, request or KV slot behind."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.test_engine import assert_clean, make_engine
from voice_out.config import Config, EngineConfig, ServerConfig
from voice_out.engine.engine import Engine
from voice_out.server.app import create_app
from voice_out.server.elevenlabs import ElevenLabsError, parse_output_format

pytestmark = pytest.mark.filterwarnings("ignore:.*RANDOM WEIGHTS")

TOKEN = "el-test-token"
MAX_CHARS = 200


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    eng = make_engine(tmp_path_factory.mktemp("el"), max_text_chars=MAX_CHARS)
    eng.start(timeout=120)
    yield eng
    eng.close()


class Server:
    def __init__(self, engine: Engine, tmp: Path) -> None:
        cfg = Config(
            server=ServerConfig(auth_token=TOKEN, voices_dir=str(tmp / "v"), serve_web=False),
            engine=EngineConfig(max_text_chars=MAX_CHARS),
        )

        class Borrowed:  # the module's engine, not entered and left by each app
            def __getattr__(self, name: str) -> Any:
                return getattr(engine, name)

            async def __aenter__(self) -> Any:
                return self

            async def __aexit__(self, *exc: object) -> None:
                return None

        self.app = create_app(cfg, Borrowed())
        self.runner = web.AppRunner(self.app)
        self.url = ""

    async def __aenter__(self) -> Server:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"127.0.0.1:{port}/v1/text-to-speech"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


def run(engine: Engine, tmp: Path, body: Any) -> Any:
    async def main() -> Any:
        async with Server(engine, tmp) as srv, aiohttp.ClientSession(headers={"xi-api-key": TOKEN}) as http:
            return await body(srv, http)

    return asyncio.run(main())


async def messages(ws: aiohttp.ClientWebSocketResponse, until_final: str | None = "a") -> AsyncIterator[dict[str, Any]]:
    async for m in ws:
        if m.type != aiohttp.WSMsgType.TEXT:
            return
        d = json.loads(m.data)
        yield d
        if until_final is not None and d.get("isFinal") and d.get("contextId", "a") == until_final:
            return


TEXT = "Hi there, you. "


def test_output_formats() -> None:
    assert parse_output_format("pcm_16000").sample_rate == 16000
    assert parse_output_format("ulaw_8000").encoder == "ulaw"
    assert parse_output_format(None).name == "mp3_44100_128"
    for bad in ("pcm_12345", "ulaw_16000", "mp3_44100_7", "wav", "pcm_16000_3"):
        with pytest.raises(ElevenLabsError, match="accepted"):
            parse_output_format(bad)


def test_multi_context_end_of_turn_delivers_all(engine: Engine, tmp_path: Path) -> None:
    async def body(srv: Server, http: aiohttp.ClientSession) -> None:
        url = f"ws://{srv.url}/noise/multi-stream-input?output_format=pcm_16000&sync_alignment=true"
        async with http.ws_connect(url) as ws:
            await ws.send_json({"text": " ", "voice_settings": {"stability": 0.5}, "context_id": "a"})
            for word in TEXT.split(" "):
                await ws.send_json({"text": word + " ", "context_id": "a"})
            await ws.send_json({"text": "", "context_id": "a", "flush": True})
            await ws.send_json({"context_id": "a", "close_context": True})
            got = [d async for d in messages(ws)]
        assert got[-1] == {"isFinal": True, "contextId": "a"}
        audio = b"".join(base64.b64decode(d["audio"]) for d in got if d.get("audio"))
        assert all(d["contextId"] == "a" for d in got)
        # forced tokens: 3 per text id, 40 ms each, at 16 kHz s16
        assert len(audio) % 2 == 0 and len(audio) > 16000 * 2 // 2
        chars = "".join("".join(d["alignment"]["chars"]) for d in got if d.get("alignment"))
        sent = "".join(w + " " for w in TEXT.split(" "))  # what was pushed, spaces included
        assert chars == sent
        for d in got:
            if d.get("alignment"):
                starts = d["alignment"]["charStartTimesMs"]
                assert starts == sorted(starts) and d["normalizedAlignment"] == d["alignment"]

    run(engine, tmp_path, body)
    assert_clean(engine)


def test_close_context_without_flush_interrupts(engine: Engine, tmp_path: Path) -> None:
    """Barge-in: close_context with text since the last flush cancels the engine stream: no audio
    after isFinal, nothing left in the engine."""

    async def body(srv: Server, http: aiohttp.ClientSession) -> list[dict[str, Any]]:
        url = f"ws://{srv.url}/noise/multi-stream-input?output_format=pcm_24000"
        async with http.ws_connect(url) as ws:
            await ws.send_json({"text": " ", "context_id": "a"})
            await ws.send_json({"text": TEXT * 4, "context_id": "a"})
            got = []
            async for d in messages(ws, until_final=None):
                got.append(d)
                if d.get("audio"):
                    break
            await ws.send_json({"context_id": "a", "close_context": True})
            async for d in messages(ws):
                got.append(d)
            # the socket goes on: a second context on it speaks
            await ws.send_json({"text": "Next one. ", "context_id": "b"})
            await ws.send_json({"flush": True, "context_id": "b"})
            await ws.send_json({"context_id": "b", "close_context": True})
            got += [d async for d in messages(ws, until_final="b")]
            return got

    got = run(engine, tmp_path, body)
    a = [d for d in got if d.get("contextId") == "a"]
    assert a[-1] == {"isFinal": True, "contextId": "a"}
    assert sum(1 for d in a if d.get("audio")) >= 1
    assert got[-1] == {"isFinal": True, "contextId": "b"} and any(d.get("audio") for d in got if d["contextId"] == "b")
    st = assert_clean(engine)
    assert st.open_streams == 0


def test_second_close_context_interrupts_a_closing_context(engine: Engine, tmp_path: Path) -> None:
    """pipecat's interruption after its end of turn: a second close_context."""

    async def body(srv: Server, http: aiohttp.ClientSession) -> list[dict[str, Any]]:
        async with http.ws_connect(f"ws://{srv.url}/noise/multi-stream-input?output_format=pcm_24000") as ws:
            await ws.send_json({"text": " ", "context_id": "a"})
            await ws.send_json({"text": TEXT * 4, "context_id": "a"})
            await ws.send_json({"flush": True, "context_id": "a"})
            await ws.send_json({"context_id": "a", "close_context": True})
            got = []
            async for d in messages(ws, until_final=None):
                got.append(d)
                if d.get("audio"):
                    break
            await ws.send_json({"context_id": "a", "close_context": True})
            got += [d async for d in messages(ws)]
            return got

    got = run(engine, tmp_path, body)
    assert got[-1] == {"isFinal": True, "contextId": "a"}
    audio_s = sum(len(base64.b64decode(d["audio"])) for d in got if d.get("audio")) / 48000
    assert audio_s < 0.04 * 3 * len(TEXT * 4) / 2  # far less than the whole text (forced: 3 tokens per byte)
    assert_clean(engine)


def test_single_context_with_key_in_first_message(engine: Engine, tmp_path: Path) -> None:
    async def body(srv: Server, _: aiohttp.ClientSession) -> tuple[list[dict[str, Any]], Any]:
        async with (
            aiohttp.ClientSession() as http,
            http.ws_connect(f"ws://{srv.url}/noise/stream-input?output_format=ulaw_8000") as ws,
        ):
            await ws.send_json({"text": " ", "voice_settings": {}, "xi_api_key": TOKEN})
            await ws.send_json({"text": "One two three. ", "try_trigger_generation": True})
            await ws.send_json({"text": ""})
            got = [d async for d in messages(ws, until_final=None)]
            return got, ws.close_code

    got, code = run(engine, tmp_path, body)
    assert got[-1] == {"isFinal": True} and code == 1000
    assert all("contextId" not in d for d in got)
    ulaw = b"".join(base64.b64decode(d["audio"]) for d in got if d.get("audio"))
    assert len(ulaw) > 0
    assert "".join("".join(d["alignment"]["chars"]) for d in got if d.get("alignment")) == "One two three. "
    assert_clean(engine)


def test_websocket_bad_input(engine: Engine, tmp_path: Path) -> None:
    async def body(srv: Server, http: aiohttp.ClientSession) -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with aiohttp.ClientSession() as anon, anon.ws_connect(f"ws://{srv.url}/noise/multi-stream-input") as ws:
            out["auth"] = (await ws.receive_json(), (await ws.receive()).type, ws.close_code)
        async with http.ws_connect(f"ws://{srv.url}/bob/multi-stream-input") as ws:
            out["voice"] = (await ws.receive_json(), ws.close_code)
            await ws.receive()
            out["voice_code"] = ws.close_code
        async with http.ws_connect(f"ws://{srv.url}/noise/stream-input?output_format=pcm_1") as ws:
            out["format"] = await ws.receive_json()
            await ws.receive()
            out["format_code"] = ws.close_code
        async with http.ws_connect(f"ws://{srv.url}/noise/multi-stream-input?output_format=pcm_24000") as ws:
            await ws.send_str("{not json")
            out["json"] = await ws.receive_json()
            await ws.send_json({"text": 5, "context_id": "a"})
            out["type"] = await ws.receive_json()
        return out

    async def long_body(srv: Server, http: aiohttp.ClientSession) -> dict[str, Any]:
        async with http.ws_connect(f"ws://{srv.url}/noise/multi-stream-input?output_format=pcm_24000") as ws:
            await ws.send_json({"text": " ", "context_id": "a"})
            await ws.send_json({"text": "x" * (MAX_CHARS + 1), "context_id": "a"})
            got = [await ws.receive_json() for _ in range(2)]
        return {"long": got}

    out = run(engine, tmp_path, body)
    assert out["auth"][0]["error"] == "invalid_api_key" and out["auth"][2] == 1008
    assert out["voice"][0]["error"] == "voice_not_found" and out["voice_code"] == 1008
    assert out["format"]["error"] == "invalid_output_format" and "16000" in out["format"]["message"]
    assert out["format_code"] == 1008
    assert out["json"]["error"] == "invalid_message" and out["json"]["code"] == 1008
    assert out["type"]["error"] == "invalid_message"
    long = run(engine, tmp_path, long_body)["long"]
    assert {"isFinal": True, "contextId": "a"} in long
    err = next(d for d in long if "error" in d)
    assert err["error"] == "text_too_long" and err["contextId"] == "a"
    assert_clean(engine)


def test_socket_closed_mid_context_frees_the_stream(engine: Engine, tmp_path: Path) -> None:
    async def body(srv: Server, http: aiohttp.ClientSession) -> None:
        async with http.ws_connect(f"ws://{srv.url}/noise/multi-stream-input?output_format=mp3_44100_128") as ws:
            await ws.send_json({"text": " ", "context_id": "a"})
            await ws.send_json({"text": TEXT * 4, "context_id": "a"})
            async for d in messages(ws, until_final=None):
                if d.get("audio"):
                    break
        await asyncio.sleep(0.2)

    run(engine, tmp_path, body)
    assert_clean(engine)


def test_http_stream(engine: Engine, tmp_path: Path) -> None:
    async def body(srv: Server, http: aiohttp.ClientSession) -> dict[str, Any]:
        out: dict[str, Any] = {}
        base = f"http://{srv.url}"
        async with http.post(
            f"{base}/noise/stream?output_format=pcm_16000", json={"text": "Hi you.", "model_id": "x"}
        ) as r:
            out["ok"] = (r.status, r.content_type, await r.read())
        async with http.post(f"{base}/noise?output_format=mp3_22050_32", json={"text": "Hi you."}) as r:
            out["mp3"] = (r.status, r.content_type, await r.read())
        async with aiohttp.ClientSession() as anon, anon.post(f"{base}/noise/stream", json={"text": "x"}) as r:
            out["auth"] = (r.status, await r.json())
        for key, path, kw in (
            ("json", "/noise/stream", {"data": b"{nope"}),
            ("voice", "/bob/stream", {"json": {"text": "x"}}),
            ("format", "/noise/stream?output_format=flac_1", {"json": {"text": "x"}}),
            ("long", "/noise/stream", {"json": {"text": "x" * (MAX_CHARS + 1)}}),
            ("empty", "/noise/stream", {"json": {"text": " "}}),
        ):
            async with http.post(base + path, **kw) as r:
                out[key] = (r.status, await r.json())
        # a client that hangs up mid-stream
        async with http.post(f"{base}/noise/stream?output_format=pcm_24000", json={"text": TEXT * 4}) as r:
            await r.content.readany()
        await asyncio.sleep(0.2)
        return out

    out = run(engine, tmp_path, body)
    status, ctype, pcm = out["ok"]
    assert (status, ctype) == (200, "audio/pcm")
    # forced: 3 tokens per byte id of "Hi you." (7 ids) x 40 ms, at 16 kHz s16
    assert abs(len(pcm) - 7 * 3 * 0.04 * 16000 * 2) <= 64
    assert out["mp3"][0] == 200 and out["mp3"][1] == "audio/mpeg" and len(out["mp3"][2]) > 100
    assert out["auth"] == (
        401,
        {"detail": {"status": "invalid_api_key", "message": out["auth"][1]["detail"]["message"]}},
    )
    expect = {
        "json": (400, "invalid_json"),
        "voice": (404, "voice_not_found"),
        "format": (400, "invalid_output_format"),
    }
    expect |= {"long": (400, "text_too_long"), "empty": (422, "invalid_request")}
    for key, (code, status_) in expect.items():
        assert out[key][0] == code and out[key][1]["detail"]["status"] == status_, (key, out[key])
    assert_clean(engine)
