"""Placement of utterances over several real engines (random:tiny on the CPU, ``cpu,cpu``):
by headroom, around an engine's failure, through the server (one session's utterances on two
engines, one track), and engines in processes of their own (audio, cancel, a killed child)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from aiohttp.test_utils import TestServer

from voice_out.client import connect
from voice_out.config import Config, EngineConfig, ModelConfig, ServerConfig
from voice_out.engine.api import EngineFailedError, OverloadedError, PcmChunk, Stream, StreamState
from voice_out.engine.build import BuildOptions
from voice_out.engine.engine import Engine
from voice_out.engine.placement import EngineState, PlacedStream, Placement, load_placement
from voice_out.engine.process import ProcessEngine
from voice_out.engine.scheduler import ForcedTokens
from voice_out.server import protocol as p
from voice_out.server.app import create_app

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*RANDOM WEIGHTS"),
    pytest.mark.usefixtures("one_torch_thread"),
]

TEXT = "Hello there, how are you?"
#: Engine.load options of every engine here: tiny, deterministic, quick to start.
OPTIONS = BuildOptions(forced=ForcedTokens(3), warmup=False, text_normalizer="none", noise_prompt_tokens=0, kv_len=512)


class WorkerDeath(BaseException):
    """Raised in an engine's worker thread by the fault hook: it escapes the step's error
    handling and ends the thread, as a crash of the engine would."""


class Killer:
    """A fault hook that kills the worker running ``victim``'s first LLM step."""

    def __init__(self) -> None:
        self.victim: str | None = None

    def __call__(self, request_id: str, phase: str) -> None:
        if request_id == self.victim and phase == "llm":
            raise WorkerDeath(f"injected engine failure at {request_id}")


def config(tmp: Path, device: str = "cpu", processes: str = "shared", max_streams: int = 4) -> Config:
    return Config(
        model=ModelConfig(model="random:tiny", device=device, engine_processes=processes),
        engine=EngineConfig(max_streams=max_streams, max_ahead_s=1.0, max_text_chars=200),
        server=ServerConfig(voices_dir=str(tmp / "no-voices")),
    )


def tiny_engine(tmp: Path, max_streams: int = 4) -> Engine:
    return Engine.load(config(tmp, max_streams=max_streams), options=OPTIONS)


async def speak(stream: Stream, text: str = TEXT) -> list[PcmChunk]:
    stream.push_text(text)
    stream.end_text()
    return [chunk async for chunk in stream]


def labels(streams: list[PlacedStream]) -> list[str]:
    return [s.engine_label for s in streams]


# --------------------------------------------------------------------------------------------
# in-process engines


@pytest.mark.asyncio
async def test_each_utterance_goes_to_the_engine_with_the_most_headroom(tmp_path: Path) -> None:
    # the capacities given are the engines' own plans (4 and 2 KV slots): placement reads them
    placement = Placement([("cpu:0", tiny_engine(tmp_path), 1), ("cpu:1", tiny_engine(tmp_path, max_streams=2), 1)])
    async with placement:
        # open and no text yet: each stream stays in flight on its engine
        held = [placement.open_stream(seed=i) for i in range(6)]
        # headroom (capacity - in flight) before each: (4,2) (3,2) (2,2) (1,2) (1,1) (0,1); ties: first
        assert labels(held) == ["cpu:0", "cpu:0", "cpu:0", "cpu:1", "cpu:0", "cpu:1"]
        assert [(r.label, r.in_flight, r.capacity) for r in placement.reports()] == [("cpu:0", 4, 4), ("cpu:1", 2, 2)]
        assert placement.default_voice == "noise"  # the engines' own, as GET /voices reports it
        held[0].cancel()
        held[1].cancel()
        last = placement.open_stream(seed=6)
        assert last.engine_label == "cpu:0"  # headroom now (1, 0)
        # the utterances in flight speak, wherever they were placed
        live = [s for s in held if not s.state.terminal]
        spoken = await asyncio.wait_for(asyncio.gather(*(speak(s) for s in live)), 120)
        assert all(chunks and chunks[-1].final and sum(len(c.pcm) for c in chunks) > 0 for chunks in spoken)
        assert all(s.state is StreamState.FINISHED for s in live)
        assert [r.in_flight for r in placement.reports()] == [1, 0]  # the one opened last
        del last  # dropped unfinished: its engine cancels it, and it no longer counts
        gc.collect()
        assert [r.in_flight for r in placement.reports()] == [0, 0]


@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
async def test_a_failed_engine_fails_only_its_utterances_and_new_ones_avoid_it(tmp_path: Path) -> None:
    killer = Killer()
    placement = load_placement(config(tmp_path, "cpu,cpu"), options=dataclasses.replace(OPTIONS, fault_hook=killer))
    assert all(isinstance(e, Engine) for e in placement.engines)  # shared: in this process
    async with placement:
        streams = [placement.open_stream(seed=i) for i in range(4)]
        assert labels(streams) == ["cpu:0", "cpu:1", "cpu:0", "cpu:1"]
        killer.victim = streams[0].id
        results = await asyncio.wait_for(asyncio.gather(*(speak(s) for s in streams), return_exceptions=True), 120)
        for stream, result in zip(streams, results, strict=True):
            if stream.engine_label == "cpu:0":
                assert isinstance(result, EngineFailedError) and result.code == "engine_failed", result
                assert stream.state is StreamState.FAILED
            else:
                assert isinstance(result, list) and result[-1].final, result
        r0, r1 = placement.reports()
        assert (r0.state, r0.failed_streams) == (EngineState.FAILED, 2)
        assert (r1.state, r1.failed_streams) == (EngineState.READY, 0)
        assert placement.ready
        after = [placement.open_stream(seed=10 + i) for i in range(3)]
        assert labels(after) == ["cpu:1"] * 3
        spoken = await asyncio.wait_for(asyncio.gather(*(speak(s) for s in after)), 120)
        assert all(chunks[-1].final for chunks in spoken)


@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
async def test_one_session_over_two_engines_plays_on_its_one_track(tmp_path: Path) -> None:
    killer = Killer()
    placement = load_placement(config(tmp_path, "cpu,cpu"), options=dataclasses.replace(OPTIONS, fault_hook=killer))
    app = create_app(config(tmp_path, "cpu,cpu"), placement, None, web_dir=None)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    try:
        async with aiohttp.ClientSession() as http:
            client = await connect(url)
            try:
                # held open on cpu:0, the next two land on cpu:1 then cpu:0 (most headroom)
                client.send_text("a", "First one. ")
                client.send_text("b", "Second one. ")
                await asyncio.sleep(0.2)
                assert [r.placed for r in placement.reports()] == [1, 1]
                client.done("a")
                client.done("b")
                done_a = await client.wait_for("audio.done", "a", timeout_s=120)
                done_b = await client.wait_for("audio.done", "b", timeout_s=120)
                # both on the one track, in start order
                assert isinstance(done_a, p.AudioDone) and isinstance(done_b, p.AudioDone)
                assert done_a.audio_ms > 0 and done_b.audio_ms > 0
                async with http.get(url + "/healthz") as r:
                    body = await r.json()
                assert r.status == 200 and [e["gpu"] for e in body["engines"]] == ["cpu:0", "cpu:1"]
                assert [e["state"] for e in body["engines"]] == ["ready", "ready"]
                # CPU engines defer no start-up work: each says so, and so does the placement
                assert [e["warming"] for e in body["engines"]] == [False, False] and body["warming"] is False
                # cpu:0 dies under the next utterance placed on it; the session goes on
                client.send_text("c", "Third. ")
                await asyncio.sleep(0.2)
                killer.victim = f"{client.session_id}/c"
                client.done("c")
                error = await client.wait_for("error", "c", timeout_s=120)
                assert isinstance(error, p.Error) and error.code == "engine_failed"
                client.send_text("d", "Fourth. ")
                client.done("d")
                await client.wait_for("audio.done", "d", timeout_s=120)
                async with http.get(url + "/healthz") as r:
                    body = await r.json()
                assert r.status == 200 and [e["state"] for e in body["engines"]] == ["failed", "ready"]
                async with http.get(url + "/metrics") as r:
                    text = await r.text()
                assert 'voice_out_engine_up{gpu="cpu:0"} 0.0' in text
                assert 'voice_out_engine_up{gpu="cpu:1"} 1.0' in text
                assert 'voice_out_engine_failed_utterances_total{gpu="cpu:0"} 1.0' in text
                assert 'voice_out_engine_utterances_total{gpu="cpu:1"} 2.0' in text
                assert 'voice_out_errors_total{code="engine_failed"} 1.0' in text
            finally:
                await client.close()
    finally:
        await server.close()


# --------------------------------------------------------------------------------------------
# engines in processes of their own


@pytest.fixture(scope="module")
def children(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ProcessEngine]]:
    """Two tiny engines, each in a child process (started once for the module)."""
    tmp = tmp_path_factory.mktemp("children")
    engines = [
        ProcessEngine(config(tmp, "cpu"), label=f"cpu:{i}", load_options=OPTIONS, torch_threads=1) for i in range(2)
    ]

    async def start() -> None:
        await asyncio.gather(*(e.start() for e in engines))

    asyncio.run(start())
    yield engines

    async def stop() -> None:
        await asyncio.gather(*(e.aclose() for e in engines))

    asyncio.run(stop())


@contextlib.asynccontextmanager
async def placed(engines: list[ProcessEngine]) -> AsyncIterator[Placement]:
    async with Placement([(e.label, e, 4) for e in engines]) as placement:
        yield placement


def test_per_device_processes_are_chosen_by_config(tmp_path: Path) -> None:
    assert all(isinstance(e, ProcessEngine) for e in load_placement(config(tmp_path, "cpu,cpu", "auto")).engines)
    assert all(isinstance(e, Engine) for e in load_placement(config(tmp_path, "cpu", "auto")).engines)
    one = load_placement(config(tmp_path, "cpu", "per_device"))
    assert [type(e) for e in one.engines] == [ProcessEngine]
    assert [r.label for r in one.reports()] == ["cpu"]


@pytest.mark.asyncio
async def test_a_child_engine_speaks_like_the_engine_in_process(children: list[ProcessEngine], tmp_path: Path) -> None:
    async with placed(children) as placement:
        streams = [placement.open_stream(seed=5), placement.open_stream(seed=5)]
        assert labels(streams) == ["cpu:0", "cpu:1"]
        spoken = await asyncio.wait_for(asyncio.gather(*(speak(s) for s in streams)), 120)
    async with tiny_engine(tmp_path) as here:
        alone = await asyncio.wait_for(speak(here.open_stream(seed=5)), 120)

    def shape(chunks: list[PcmChunk]) -> list[tuple[int, int, bool, int]]:
        return [(c.start_sample, c.text_end, c.final, len(c.pcm)) for c in chunks]

    assert shape(spoken[0]) == shape(spoken[1]) == shape(alone)
    for chunks in spoken:  # the same forced tokens and seed: the same audio, within float noise
        assert np.allclose(np.concatenate([c.pcm for c in chunks]), np.concatenate([c.pcm for c in alone]), atol=1e-4)


@pytest.mark.asyncio
async def test_cancel_stops_the_child_s_work(children: list[ProcessEngine]) -> None:
    engine = children[0]
    stream = engine.open_stream(seed=3)  # auto_ack: unread audio holds it back (max_ahead_s)
    stream.push_text("A long utterance that would go on for a good many seconds of audio. " * 2)
    stream.end_text()
    async for _ in stream:
        break  # the first chunk
    await engine.await_idle()
    held = engine.stats()
    assert held.live_requests == 1  # paused by back-pressure, not finished
    stream.cancel()
    await engine.await_idle()
    stopped = engine.stats()
    assert (stopped.live_requests, stopped.used_slots, stopped.open_streams) == (0, 0, 0), stopped
    await asyncio.sleep(0.3)
    assert engine.stats().steps == stopped.steps  # nothing more runs for it
    assert stream.state is StreamState.ABORTED


@pytest.mark.asyncio
async def test_a_killed_child_fails_only_its_own_utterances(children: list[ProcessEngine]) -> None:
    async with placed(children) as placement:
        streams = [placement.open_stream(seed=i) for i in range(4)]
        assert labels(streams) == ["cpu:0", "cpu:1", "cpu:0", "cpu:1"]
        victims = [s for s in streams if s.engine_label == "cpu:0"]
        for s in victims:  # they wait for text, in flight on the child
            s.push_text(TEXT)
        await children[0].await_idle()
        children[0].kill()
        spoken = await asyncio.wait_for(asyncio.gather(*(speak(s) for s in streams[1::2])), 120)
        assert all(chunks[-1].final for chunks in spoken)
        for s in victims:
            with pytest.raises(EngineFailedError):
                async for _ in s:
                    pass
            assert s.state is StreamState.FAILED
        assert [r.state for r in placement.reports()] == [EngineState.FAILED, EngineState.READY]
        assert placement.open_stream(seed=9).engine_label == "cpu:1"
        with pytest.raises(OverloadedError):
            children[0].open_stream()
    # a supervisor's SIGTERM stops a child as the server would: cleanly, exit status 0
    survivor = children[1]
    assert survivor.pid is not None
    os.kill(survivor.pid, signal.SIGTERM)
    assert await asyncio.get_running_loop().run_in_executor(None, survivor.wait, 60) == 0


def test_a_placement_is_warming_while_one_of_its_engines_is() -> None:
    """``/healthz``'s top-level ``warming`` of a placement: any engine of this process still
    capturing after ready; an engine that does not say (in a process of its own) counts as not."""
    from types import SimpleNamespace

    def placement(*flags: bool | None) -> Placement:
        engines = [SimpleNamespace() if f is None else SimpleNamespace(warming=f) for f in flags]
        return Placement([(f"cuda:{i}", e, 4) for i, e in enumerate(engines)])

    assert placement(False, True).warming
    assert not placement(False, False).warming
    assert not placement(None, False).warming
