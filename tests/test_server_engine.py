"""The real server with the REAL engine (``random:tiny`` on CPU) and an in-process WebRTC client.

One test walks a whole session, since starting the engine dominates the cost: audio arrives
and carries energy, events arrive in order, a barge-in silences the track and the engine drops
the stream, a per-utterance fast first chunk is served (and one out of range refused), a
disconnect mid-utterance frees the engine's slots, shutdown stops the worker.
Random weights speak noise; forced tokens make the LLM stop after a realistic length.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from collections.abc import Callable

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from voice_out.client import VoiceOutClient, connect
from voice_out.config import Config, EngineConfig
from voice_out.engine.build import BuildOptions
from voice_out.server import protocol as p
from voice_out.server.app import METRICS_KEY, SESSIONS_KEY, create_app

engine_module = pytest.importorskip(
    "voice_out.engine.engine", reason="the streaming engine (voice_out.engine.engine) is not built yet"
)
scheduler_module = pytest.importorskip("voice_out.engine.scheduler")

#: Generous: CI machines have 2 shared cores and the tiny model still runs the full pipeline.
EVENT_TIMEOUT_S = 180.0


async def until(cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.05)


def audible_ms(client: VoiceOutClient, since: float) -> float:
    """Audio of the audible frames decoded since ``since``, ms."""
    return sum(f.duration_ms for f in client.frames_since(since) if f.audible)


@pytest.mark.asyncio
async def test_real_engine_session() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the loud random-weights warning
        engine = engine_module.Engine.load(
            Config(engine=EngineConfig(seed=1234)),
            model="random:tiny",
            device="cpu",
            options=BuildOptions(forced=scheduler_module.ForcedTokens(tokens_per_text_token=2)),
        )
    app = create_app(Config(), engine, None)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()  # enters the engine: worker started and warm
    url = str(server.make_url("")).rstrip("/")
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/healthz") as r:
                health = await r.json()
                assert r.status == 200 and health["engine_ready"] is True
                # the engine's plan: a CPU engine's (no budget, no graphs), its streams
                assert health["plan"]["device_type"] == "cpu" and health["plan"]["max_streams"] == 64
                assert health["plan"]["cuda_graphs"] is False and health["plan"]["left_out"] == {}
                assert health["warming"] is False  # a CPU engine defers no start-up work
            async with http.get(url + "/voices") as r:
                assert await r.json() == {"voices": [{"name": "noise", "builtin": True}], "default_voice": "noise"}

        client = await connect(url)
        assert client.voices == ("noise",)

        # 1. A short utterance, streamed in deltas, played to the end.
        t_send = client.send_text("u1", "Hi the", alignment=True)
        client.send_text("u1", "re.")
        client.done("u1")
        started = await client.wait_for("audio.started", "u1", timeout_s=EVENT_TIMEOUT_S)
        done = await client.wait_for("audio.done", "u1", timeout_s=EVENT_TIMEOUT_S)
        assert isinstance(started, p.AudioStarted) and isinstance(done, p.AudioDone)
        assert started.ttfa_ms > 0 and done.audio_ms > 200
        # opt-in audio.alignment: every character once, in order, times never going backwards
        aligned = [ev.message for ev in client.events if isinstance(ev.message, p.AudioAlignment)]
        assert "".join(a.chars for a in aligned) == "Hi there."
        starts = [t for a in aligned for t in a.char_start_ms]
        assert starts == sorted(starts) and all(0 <= t <= done.audio_ms for t in starts)
        assert all(len(a.chars) == len(a.char_start_ms) == len(a.char_duration_ms) for a in aligned)
        await asyncio.sleep(0.3)
        # The noise voice is audible; underruns (a slow CPU) add silent frames, never lose audio.
        assert audible_ms(client, t_send) >= done.audio_ms * 0.8

        # 2. Barge-in while it speaks: silence follows, the engine drops the stream.
        long_text = "This sentence is longer, and the listener interrupts it before the end."
        client.send_text("u2", long_text)
        client.done("u2")
        await client.wait_for("audio.started", "u2", timeout_s=EVENT_TIMEOUT_S)
        await asyncio.sleep(0.2)
        t_cancel = client.cancel()
        cut = await client.wait_for("cancelled", "u2", timeout_s=10)
        assert isinstance(cut, p.Cancelled)
        assert cut.played_ms > 0
        assert long_text.startswith(cut.played_text)
        await asyncio.sleep(1.0)
        frames = sorted(client.frames_since(t_cancel), key=lambda f: f.pts)
        last_audible = max((i for i, f in enumerate(frames) if f.audible), default=-1)
        # <= 3 frames past the cancel at the server, plus aiortc's ~4-frame receive jitter buffer.
        assert last_audible < 3 + 5, [round(f.peak, 4) for f in frames[:12]]
        assert len(frames) - last_audible > 10

        # 3. Per-utterance first hop: out of the engine's range it is refused and the session
        # goes on; a fast first chunk needs fewer LLM steps before the first audio.
        client.send_text("u2x", "Too fast.", fast_first=30)
        err = await client.wait_for("error", "u2x", timeout_s=10)
        assert isinstance(err, p.Error) and err.code == "bad_field" and "fast_first" in err.message
        client.send_text("u2y", "Quick start, then the rest of the sentence.", fast_first=4)
        client.done("u2y")
        await client.wait_for("audio.done", "u2y", timeout_s=EVENT_TIMEOUT_S)
        traces = {t.request_id.rsplit("/", 1)[-1]: t for t in engine.stats().first_audio}
        assert traces["u2y"].llm_steps < traces["u2"].llm_steps, traces

        # 4. A disconnect mid-utterance frees the session and the engine's slot.
        client.send_text("u3", "Nobody will hear this one, the client leaves.")
        client.done("u3")
        await asyncio.sleep(0.5)
        await client.close()
        sessions = app[SESSIONS_KEY]
        await until(lambda: len(sessions) == 0 and sessions.n_tasks == 0)
        await engine.await_idle()
        stats = engine.stats()
        assert stats.open_streams == 0 and stats.used_slots == 0 and stats.waiting == 0
        m = app[METRICS_KEY]
        assert m.active_streams._value.get() == 0 and m.active_sessions._value.get() == 0
        # u1, u2 and u2y started; u3 only if its first audio beat the disconnect (a fast machine)
        u3_started = any(isinstance(ev.message, p.AudioStarted) and ev.message.id == "u3" for ev in client.events)
        # (its audio.started may also have been sent but not yet received when the client left)
        assert 3 + int(u3_started) <= (m.registry.get_sample_value("voice_out_ttfa_seconds_count") or 0) <= 4
    finally:
        await server.close()  # on_shutdown + cleanup_ctx: the engine's worker stops
    assert not engine.ready and engine.stats().worker_threads == 0
