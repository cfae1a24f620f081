"""``POST /v1/audio/speech`` (voice_out.server.openai_speech) driven by the real ``openai``
package against the real engine (random:tiny, forced tokens) on a loopback aiohttp server:
streamed pcm whose first bytes arrive while the engine still makes the utterance, SSE events,
every response format, speed, OpenAI's error shape, and a client that hangs up cancelling the
engine's work. Failure paths after the first byte use the fake engine (scripted failure)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import av
import numpy as np
import pytest
import pytest_asyncio
from aiohttp import web

from tests.fakes import FakeEngine, FakeScript
from voice_out.config import Config, EngineConfig, ServerConfig
from voice_out.engine.api import EngineLike, PcmChunk, Stream, StreamState
from voice_out.engine.build import BuildOptions
from voice_out.engine.engine import Engine
from voice_out.engine.scheduler import ForcedTokens
from voice_out.server.app import METRICS_KEY, create_app
from voice_out.server.audio_encode import pcm16

TOKEN = "openai-test-token"
VOICE = "noise"  # random:tiny's built-in voice
#: one text id per character here (random:tiny, no normalizer), 3 speech tokens each: 108
#: tokens -> token2wav chunks of 25, 50, then the final 33
LONG_TEXT = "a few words for the flow, then more"
SHORT_TEXT = "a short line"

pytestmark = pytest.mark.asyncio


def _require(name: str) -> ModuleType:
    """The package, or a skip; under CI (CI=true) a missing package fails the test."""
    try:
        return __import__(name)
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed: CI installs it with the dev extras (pip install -e '.[dev]')")
        pytest.skip(f"{name} is not installed (pip install -e '.[dev]')")


@dataclass
class SpyStream:
    """Records what the real engine stream hands out, and when (perf_counter)."""

    inner: Stream
    chunks: list[tuple[float, PcmChunk]] = field(default_factory=list)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def __aiter__(self) -> AsyncIterator[PcmChunk]:
        async for chunk in self.inner:
            self.chunks.append((time.perf_counter(), chunk))
            yield chunk


class SpyEngine:
    """The real engine, with each opened stream wrapped in a :class:`SpyStream`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.streams: list[SpyStream] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def open_stream(self, voice: str | None = None, **kw: Any) -> SpyStream:
        s = SpyStream(self.engine.open_stream(voice, **kw))
        self.streams.append(s)
        return s

    async def __aenter__(self) -> SpyEngine:
        await self.engine.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.engine.__aexit__(*exc)


def tiny_engine(tmp: Path) -> Engine:
    cfg = Config(
        server=ServerConfig(voices_dir=str(tmp / "no-voices")),
        engine=EngineConfig(max_streams=4, max_text_chars=400),
    )
    return Engine.load(
        cfg,
        model="random:tiny",
        device="cpu",
        options=BuildOptions(
            forced=ForcedTokens(3), warmup=False, text_normalizer="none", noise_prompt_tokens=0, kv_len=512
        ),
    )


@dataclass
class Served:
    url: str
    app: web.Application
    engine: Any  # SpyEngine or FakeEngine
    http: aiohttp.ClientSession

    def client(self, token: str = TOKEN) -> Any:
        openai = _require("openai")
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=token, max_retries=0)

    async def post(self, body: Any, *, raw: bytes | None = None, token: str = TOKEN) -> aiohttp.ClientResponse:
        data = raw if raw is not None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        return await self.http.post(f"{self.url}/v1/audio/speech", data=data, headers=headers)


async def _serve(engine: EngineLike, cfg: Config) -> AsyncIterator[Served]:
    """The app on loopback as ``voice-out serve`` runs it (``web.run_app``'s runner: aiohttp's
    test server would cancel handlers on disconnect, which ``serve`` does not)."""
    app = create_app(cfg, engine, web_dir=None)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as http:
            yield Served(f"http://127.0.0.1:{port}", app, engine, http)
    finally:
        await runner.cleanup()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    yield tiny_engine(tmp_path_factory.mktemp("openai"))


@pytest_asyncio.fixture
async def served(engine: Engine) -> AsyncIterator[Served]:
    cfg = Config(server=ServerConfig(auth_token=TOKEN), engine=EngineConfig(max_text_chars=400))
    async for s in _serve(SpyEngine(engine), cfg):
        yield s


@pytest_asyncio.fixture
async def fake_served() -> AsyncIterator[Served]:
    fake = FakeEngine(voices=("alice",), script=FakeScript(chars_per_chunk=4, chunk_delay_s=0.02), capacity=2)
    cfg = Config(server=ServerConfig(auth_token=TOKEN))
    async for s in _serve(fake, cfg):
        yield s


async def until(done: Callable[[], bool], what: str) -> None:
    """Poll ``done`` (the engine's worker changes it from its own thread) for up to 30 s."""
    try:
        async with asyncio.timeout(30):
            while True:
                if done():
                    return
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"timed out waiting until {what}") from None


async def wait_freed(engine: Engine) -> None:
    """Until the engine holds no request, slot or open stream (the worker frees them)."""

    def freed() -> bool:
        st = engine.stats()
        return (st.used_slots, st.live_requests, st.runner_requests, st.open_streams) == (0, 0, 0, 0)

    await until(freed, f"the engine holds no work ({engine.stats()})")


def spoken(stream: SpyStream) -> np.ndarray:
    return np.concatenate([c.pcm for _, c in stream.chunks])


# -- the real client, the real engine -----------------------------------------------------------


async def test_openai_client_streams_pcm_before_the_utterance_is_made(served: Served, engine: Engine) -> None:
    client = served.client()
    t0 = time.perf_counter()
    first_byte: float | None = None
    data = bytearray()
    async with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice=VOICE, input=LONG_TEXT, response_format="pcm"
    ) as response:
        assert response.headers["content-type"] == "audio/pcm"
        async for piece in response.iter_bytes():
            if first_byte is None and piece:
                first_byte = time.perf_counter()
            data += piece
    done = time.perf_counter()
    (stream,) = served.engine.streams
    assert stream.state is StreamState.FINISHED
    made = [t for t, _ in stream.chunks]
    assert len(made) >= 3, f"the utterance should take several engine chunks, got {len(made)}"
    assert first_byte is not None
    # the first bytes were at the client while the engine was still making later chunks
    print(
        f"first byte {1e3 * (first_byte - t0):.0f} ms, engine chunks at "
        f"{[round(1e3 * (t - t0)) for t in made]} ms, body done {1e3 * (done - t0):.0f} ms"
    )
    assert first_byte < made[-1] < done
    # pcm = the engine's samples as 24 kHz s16le, byte for byte
    np.testing.assert_array_equal(np.frombuffer(bytes(data), "<i2"), pcm16(spoken(stream)))
    await wait_freed(engine)
    metrics = served.app[METRICS_KEY].render().decode()
    assert 'voice_out_api_requests_total{api="openai",status="200"} 1.0' in metrics
    assert 'voice_out_api_first_audio_seconds_count{api="openai"} 1.0' in metrics


@pytest.mark.parametrize("fmt", ["pcm", "opus"])  # opus: its encoder runs in the executor
async def test_a_client_that_hangs_up_cancels_the_engine_stream(served: Served, engine: Engine, fmt: str) -> None:
    client = served.client()
    async with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice=VOICE, input=LONG_TEXT, response_format=fmt
    ) as response:
        async for piece in response.iter_bytes():
            if piece:
                break  # hang up after the first bytes: leaving the block closes the connection
    (stream,) = served.engine.streams
    await until(lambda: stream.state.terminal, "the stream ends")
    assert stream.state is StreamState.ABORTED
    await wait_freed(engine)  # KV slot, runner state and the stream handle released
    assert 'status="499"} 1.0' in served.app[METRICS_KEY].render().decode()


async def test_sse_events_carry_the_audio_then_done_with_usage(served: Served, engine: Engine) -> None:
    resp = await served.post(
        {
            "model": "gpt-4o-mini-tts",
            "input": SHORT_TEXT,
            "voice": VOICE,
            "response_format": "pcm",
            "stream_format": "sse",
        }
    )
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    body = (await resp.read()).decode()
    events = [json.loads(block[len("data: ") :]) for block in body.split("\n\n") if block]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1) and len(events) >= 2
    done = events[-1]
    assert done["type"] == "speech.audio.done"
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    (stream,) = served.engine.streams
    np.testing.assert_array_equal(np.frombuffer(audio, "<i2"), pcm16(spoken(stream)))
    n_tokens = len(spoken(stream)) // 960
    assert done["usage"] == {
        "input_tokens": len(SHORT_TEXT),
        "output_tokens": n_tokens,
        "total_tokens": len(SHORT_TEXT) + n_tokens,
    }
    await wait_freed(engine)


@pytest.mark.parametrize(
    ("fmt", "decoded_rate"), [("wav", 24000), ("opus", 48000), ("flac", 24000), ("mp3", 24000), ("aac", 24000)]
)
async def test_every_response_format_decodes_to_the_utterance(
    served: Served, engine: Engine, fmt: str, decoded_rate: int
) -> None:
    client = served.client()
    response = await client.audio.speech.create(model="tts-1", voice=VOICE, input=SHORT_TEXT, response_format=fmt)
    container = av.open(io.BytesIO(response.content), mode="r")
    frames = list(container.decode(audio=0))
    container.close()
    (stream,) = served.engine.streams
    n = len(spoken(stream)) * decoded_rate // 24000
    got = sum(f.samples for f in frames)
    assert frames[0].sample_rate == decoded_rate
    assert n <= got <= n + 2400 * decoded_rate // 24000  # lossy codecs add their delay and padding
    await wait_freed(engine)


async def test_speed_makes_one_whole_chunk_and_refuses_to_stream(served: Served, engine: Engine) -> None:
    client = served.client()
    response = await client.audio.speech.create(
        model="tts-1", voice=VOICE, input=SHORT_TEXT, response_format="pcm", speed=1.25
    )
    (stream,) = served.engine.streams
    assert len(stream.chunks) == 1 and stream.chunks[0][1].final  # the whole utterance at once
    assert len(response.content) == 2 * len(spoken(stream))
    openai = _require("openai")
    with pytest.raises(openai.BadRequestError) as err:
        await client.audio.speech.create(
            model="tts-1", voice=VOICE, input=SHORT_TEXT, response_format="pcm", speed=1.25, stream_format="audio"
        )
    assert err.value.body["param"] == "speed" and "cannot stream" in err.value.body["message"]
    assert len(served.engine.streams) == 1  # the refused request opened no stream
    await wait_freed(engine)


async def test_bad_requests_get_openais_error_shape_and_free_everything(served: Served, engine: Engine) -> None:
    openai = _require("openai")
    client = served.client()

    async def refused(**kw: Any) -> dict[str, Any]:
        args = {"model": "tts-1", "voice": VOICE, "input": SHORT_TEXT, "response_format": "pcm", **kw}
        with pytest.raises(openai.APIStatusError) as err:
            await client.audio.speech.create(**args)
        assert err.value.status_code == 400
        body: dict[str, Any] = err.value.body
        assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
        return body

    body = await refused(voice="alloy")
    assert body["param"] == "voice" and "noise" in body["message"]  # names the voices there are
    body = await refused(response_format="ogg")
    assert body["param"] == "response_format" and "mp3, opus, aac, flac, wav, pcm" in body["message"]
    body = await refused(input="x" * 401)
    assert body["param"] == "input" and body["code"] == "string_above_max_length"
    body = await refused(speed=9)
    assert body["param"] == "speed"
    body = await refused(input="   ")
    assert body["param"] == "input"

    with pytest.raises(openai.AuthenticationError) as auth:
        await served.client(token="wrong-token-value").audio.speech.create(model="tts-1", voice=VOICE, input="hi")
    assert auth.value.body["code"] == "invalid_api_key" and auth.value.body["type"] == "invalid_request_error"

    for raw in (b"{not json", b"[" * 5000 + b"]" * 5000, b'"a string"'):
        resp = await served.post(None, raw=raw)
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert set(error) == {"message", "type", "param", "code"} and "JSON" in error["message"]
    resp = await served.post({"model": "tts-1", "voice": VOICE})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "input"
    resp = await served.post(None, raw=b" " * (200 * 1024))
    assert resp.status == 413 and (await resp.json())["error"]["code"] == "request_too_large"
    assert served.engine.streams == []  # nothing reached the engine
    await wait_freed(engine)


# -- failure paths, on the fake engine ----------------------------------------------------------


async def test_overloaded_engine_answers_503_in_openais_shape(fake_served: Served) -> None:
    fake: FakeEngine = fake_served.engine
    fake.capacity = 0
    resp = await fake_served.post({"model": "tts-1", "input": "hello", "voice": "alice"})
    assert resp.status == 503 and resp.headers["Retry-After"] == "1"
    assert (await resp.json())["error"]["type"] == "server_error"


async def test_instructions_and_speed_reach_the_engine(fake_served: Served) -> None:
    resp = await fake_served.post(
        {"model": "tts-1", "input": "hello", "voice": {"id": "alice"}, "instructions": " Speak softly. ", "speed": 0.5}
    )
    assert resp.status == 200 and resp.headers["Content-Type"] == "audio/mpeg"  # OpenAI's default format
    await resp.read()
    (stream,) = fake_served.engine.opened
    assert (stream.instructions, stream.speed) == ("Speak softly.", 0.5)


async def test_a_failure_after_audio_started_truncates_or_reports(fake_served: Served) -> None:
    text = "one two three <FAIL> four five six"
    resp = await fake_served.post({"model": "tts-1", "input": text, "voice": "alice", "response_format": "pcm"})
    assert resp.status == 200
    with pytest.raises(aiohttp.ClientPayloadError):  # cut: never a short body that looks complete
        await resp.read()
    resp = await fake_served.post(
        {"model": "tts-1", "input": text, "voice": "alice", "response_format": "pcm", "stream_format": "sse"}
    )
    body = (await resp.read()).decode()
    last = json.loads(body.strip().split("\n\n")[-1][len("data: ") :])
    assert last["type"] == "error" and "synthesis failed" in last["error"]["message"]
    fake: FakeEngine = fake_served.engine
    assert not fake.active and all(s.state.terminal for s in fake.opened)


# -- the documentation's examples, run as written -----------------------------------------------

REPO = Path(__file__).resolve().parent.parent


def openai_snippets() -> list[tuple[str, str]]:
    """(file, code) of every Python block of README.md and docs/agents.md that uses the client."""
    out = []
    for name in ("README.md", "docs/agents.md"):
        text = (REPO / name).read_text()
        for block in text.split("```python\n")[1:]:
            code = block.split("```", 1)[0]
            if "audio.speech" in code:
                out.append((name, code))
    return out


def test_the_docs_have_openai_snippets() -> None:
    assert {name for name, _ in openai_snippets()} == {"README.md", "docs/agents.md"}


@pytest.mark.parametrize(("name", "code"), openai_snippets())
async def test_doc_snippet_runs_against_the_server(
    served: Served, engine: Engine, name: str, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _require("openai")
    for placeholder in ("<server.auth_token, or anything without one>", "change-me-please"):
        code = code.replace(placeholder, TOKEN)
    monkeypatch.setenv("VOICE_OUT_URL", served.url)
    monkeypatch.chdir(tmp_path)
    scope: dict[str, Any] = {}
    await asyncio.to_thread(exec, compile(code, name, "exec"), scope)  # the sync client; the server runs here
    first = served.engine.streams[0]
    assert first.voice == VOICE  # voice="default": the engine's default voice
    assert len(scope["pcm"]) == 2 * len(spoken(first))
    await wait_freed(engine)


async def test_the_servers_own_refusals_take_openais_shape_under_v1_audio(fake_served: Served) -> None:
    async with fake_served.http.get(
        f"{fake_served.url}/v1/audio/speech", headers={"Authorization": f"Bearer {TOKEN}"}
    ) as resp:
        assert resp.status == 405 and resp.headers["Allow"] == "POST"
        error = (await resp.json())["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "method_not_allowed"
    async with fake_served.http.post(f"{fake_served.url}/v1/audio/speech", json={}) as resp:  # no token
        assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
    async with fake_served.http.get(f"{fake_served.url}/voices") as resp:  # elsewhere: the server's shape
        assert resp.status == 401 and set((await resp.json())["error"]) == {"code", "message"}


async def test_an_utterance_cut_by_the_engine_is_not_a_complete_body(fake_served: Served) -> None:
    """The engine ends the stream ABORTED (it is shutting down): the client must not take the
    audio so far for the whole utterance."""
    text = "a longer line of text that takes several chunks to speak"
    resp = await fake_served.post({"model": "tts-1", "input": text, "voice": "alice", "response_format": "pcm"})
    assert resp.status == 200
    assert await resp.content.readany()  # audio has started
    (stream,) = fake_served.engine.opened
    stream.cancel()  # as Engine.__aexit__ does to every open stream
    with pytest.raises(aiohttp.ClientPayloadError):
        await resp.read()


async def test_waiting_requests_share_one_disconnect_timer() -> None:
    """16 requests waiting on a slow engine wake the event loop for one disconnect check per
    period, not one per request (which was 800 wake-ups a second at 16, each one taking the GIL
    from the engine's worker); a client that hangs up among them is still seen within a few
    periods, and its engine stream cancelled."""
    from voice_out.server import openai_speech

    n, wait_s = 16, 0.6
    fake = FakeEngine(voices=("alice",), script=FakeScript(first_chunk_delay_s=wait_s), capacity=n)
    cfg = Config(server=ServerConfig(auth_token=TOKEN))
    async with contextlib.asynccontextmanager(_serve)(fake, cfg) as served:
        loop = asyncio.get_running_loop()
        timers = 0
        call_at = loop.call_at

        def counting_call_at(when: float, callback: Any, *args: Any, **kw: Any) -> asyncio.TimerHandle:
            nonlocal timers
            timers += 1
            return call_at(when, callback, *args, **kw)

        body = {"model": "tts-1", "input": "hello there", "voice": "alice", "response_format": "pcm"}
        resps = await asyncio.gather(*(served.post(body) for _ in range(n)))  # headers: first audio
        await asyncio.gather(*(r.content.readany() for r in resps))
        for r in resps:
            r.close()
        await until(lambda: not fake.active, "the first round's streams end")

        posts = [asyncio.ensure_future(served.post(body)) for _ in range(n)]
        await until(lambda: len(fake.opened) == 2 * n, "every stream is open")
        loop.call_at = counting_call_at  # type: ignore[method-assign,assignment]
        try:
            await asyncio.sleep(wait_s / 2)  # all n wait for the engine's first chunk
        finally:
            del loop.call_at
        periods = (wait_s / 2) / openai_speech.DISCONNECT_POLL_S
        # One timer per period for the watch, plus a few of aiohttp's and the test's own; one
        # timer per request per period would be n * periods = 240.
        assert timers < periods + 3 * n, (timers, periods)
        resps = await asyncio.gather(*posts)
        for r in resps:
            assert r.status == 200
            r.close()
        # the engine holds n streams at most: the next round waits until these have ended
        await until(lambda: not fake.active, "the second round's streams end")
        # A hang-up among many waiting requests.
        fake.script.first_chunk_delay_s = 5.0
        posts = [asyncio.ensure_future(served.post(body)) for _ in range(n)]
        await until(lambda: len(fake.opened) == 3 * n, "every stream is open")
        third = fake.opened[2 * n :]
        posts[3].cancel()  # the client closes its connection before any audio
        t0 = time.perf_counter()
        await until(lambda: any(s.state is StreamState.ABORTED for s in third), "the hung-up stream is cancelled")
        assert time.perf_counter() - t0 < 1.0
        assert sum(s.state is StreamState.ABORTED for s in third) == 1
        for p in posts:
            p.cancel()
        await until(lambda: not fake.active, "every stream ends")


@pytest.mark.parametrize("stream_format", ["audio", "sse"])
async def test_the_first_chunk_reaches_the_client_before_the_second_is_made(stream_format: str) -> None:
    """Nothing holds the first chunk back (response buffering, chunked-transfer batching, SSE
    framing): the client has its bytes while the engine is still 5 s from the second chunk."""
    fake = FakeEngine(voices=("alice",), script=FakeScript(first_chunk_delay_s=0.05, chunk_delay_s=5.0))
    body = {"model": "tts-1", "input": "hello there, two chunks", "voice": "alice", "response_format": "pcm"}
    async with contextlib.asynccontextmanager(_serve)(fake, Config(server=ServerConfig(auth_token=TOKEN))) as served:
        t0 = time.perf_counter()
        resp = await served.post({**body, "stream_format": stream_format})
        assert resp.status == 200
        first = await asyncio.wait_for(resp.content.readany(), 2.0)
        elapsed = time.perf_counter() - t0
        (stream,) = fake.opened
        assert first and stream.n_chunks == 1, (first[:40], stream.n_chunks)
        assert elapsed < 2.0
        if stream_format == "sse":
            assert first.startswith(b'data: {"type":"speech.audio.delta"')
        resp.close()
        await until(lambda: not fake.active, "the stream is cancelled")
