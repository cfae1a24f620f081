"""The engine as a Ray Serve deployment, on a real local Ray instance with two tiny replicas
(``random:tiny`` on the CPU, forced tokens): utterances served through ``RayEngine`` and through
the server's front, text deltas that arrive while the call streams, a cancel that stops the
replica's work, a killed replica that fails only its own utterances. The relay's ordering logic
is tested alone first (no Ray).

Starting Ray and the two replicas costs ~30-45 s on two shared cores; the module shares them.
Under CI these tests fail, not skip, when Ray is missing.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import time
import warnings
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

from voice_out.config import Config, ConfigError, EngineConfig, ModelConfig, ServerConfig
from voice_out.engine.api import (
    EngineLike,
    OverloadedError,
    Stream,
    StreamFailedError,
    StreamState,
    UnknownVoiceError,
)
from voice_out.engine.ray_serve.messages import EngineFailedError, Failed, TextEvent, error_of
from voice_out.engine.ray_serve.relay import TextChannels
from voice_out.engine.ray_serve.replica import DeploymentOptions

# Serve's router asks two replicas for their queue lengths and waits 0.1 s by default; on two
# shared cores an answer can take longer, and the router then picks without it
os.environ.setdefault("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "1.0")

if os.environ.get("CI"):
    import ray  # CI installs the ray extra: a missing Ray must fail here, not skip
    from ray import serve
else:
    ray = pytest.importorskip("ray", reason="needs the ray extra (pip install 'voice_out[ray]')")
    serve = pytest.importorskip("ray.serve")

from voice_out.engine.build import BuildOptions  # noqa: E402
from voice_out.engine.engine import Engine  # noqa: E402
from voice_out.engine.ray_serve.client import RayEngine, RayStream  # noqa: E402
from voice_out.engine.ray_serve.replica import ReplicaStats, speech_app  # noqa: E402
from voice_out.engine.scheduler import ForcedTokens  # noqa: E402

TIMEOUT_S = 120.0
# the in-process engine of the comparison runs here too: one torch thread on two shared cores
pytestmark = pytest.mark.usefixtures("one_torch_thread")

# --------------------------------------------------------------------------------------------
# The relay's channels alone


@pytest.mark.asyncio
async def test_channels_deliver_in_order_and_close() -> None:
    ch = TextChannels()
    ch.post("u", 1, [TextEvent("text", delta="b")])  # arrived before batch 0
    assert await ch.take("u", timeout_s=0.01) == []  # nothing in order yet: ask again
    ch.post("u", 0, [TextEvent("text", delta="a")])
    ch.post("u", 2, [TextEvent("end")])
    got = await ch.take("u", timeout_s=1.0)
    assert got == [TextEvent("text", delta="a"), TextEvent("text", delta="b"), TextEvent("end")]
    ch.post("u", 1, [TextEvent("text", delta="again")])  # a replayed seq is dropped
    waiter = asyncio.ensure_future(ch.take("u", timeout_s=5.0))
    await asyncio.sleep(0.01)
    ch.close("u")
    assert await waiter is None  # a poll waiting on a closed utterance ends at once
    ch.post("u", 3, [TextEvent("text", delta="late")])  # a late post does not revive it
    assert await ch.take("u", timeout_s=0.01) is None
    assert len(ch) == 0


def test_errors_and_options_are_precise() -> None:
    assert isinstance(error_of(Failed("unknown_voice", "x")), UnknownVoiceError)
    assert isinstance(error_of(Failed("engine_failed", "x")), EngineFailedError)
    odd = error_of(Failed("some_new_code", "x"))
    assert isinstance(odd, StreamFailedError) and odd.code == "some_new_code"
    with pytest.raises(ConfigError, match="min_replicas"):
        DeploymentOptions(min_replicas=3, max_replicas=2)
    with pytest.raises(ConfigError, match="num_replicas"):
        DeploymentOptions(num_replicas=0)
    with pytest.raises(ConfigError, match="ray_app"):
        ServerConfig(ray_app="a/b")


def _static_conformance(engine: RayEngine, stream: RayStream) -> None:
    # checked by mypy: a missing or differently typed member of the contract fails the check
    as_engine: EngineLike = engine
    as_stream: Stream = stream
    assert as_engine and as_stream


def test_ray_engine_keeps_the_engine_contract() -> None:
    def params(fn: Any) -> list[tuple[str, object, object]]:
        return [(n, p.kind, p.default) for n, p in inspect.signature(fn).parameters.items() if n != "self"]

    assert params(RayEngine.open_stream) == params(EngineLike.open_stream)
    assert inspect.iscoroutinefunction(RayEngine.__aenter__) and inspect.iscoroutinefunction(RayEngine.__aexit__)


def test_reports_follow_the_live_replicas(cfg: Config) -> None:
    """The front's per-replica view, fed listings of live replicas (no Ray): a replica that
    leaves is ``stopped``; only the latest :data:`GONE_REPLICAS_KEPT` that left are kept."""
    from voice_out.engine.ray_serve.client import FAILED_CONFIRM_S, GONE_REPLICAS_KEPT
    from voice_out.engine.ray_serve.messages import Placed

    eng = RayEngine(cfg, None)

    def live(*ids: str) -> dict[str, str]:
        return {i: f"SERVE_REPLICA::voice_out#SpeechReplica#{i}" for i in ids}

    eng._note_live(live("a", "b"))
    assert [(r.label, r.state.value, r.kind) for r in eng.reports()] == [
        ("a", "ready", "replica"),
        ("b", "ready", "replica"),
    ]
    eng._note_live(live("b", "c"))
    assert [(r.label, r.state.value) for r in eng.reports()] == [("a", "stopped"), ("b", "ready"), ("c", "ready")]
    assert eng.reports()[0].to_json()["replica"] == "a"
    for i in range(GONE_REPLICAS_KEPT + 3):  # each listing replaces the replica of the last
        eng._note_live(live(f"n{i}"))
    states = [(r.label, r.state.value) for r in eng.reports()]
    assert states[-1] == (f"n{GONE_REPLICAS_KEPT + 2}", "ready")
    assert len(states) == GONE_REPLICAS_KEPT + 1 and all(st == "stopped" for _, st in states[:-1])
    eng._note_live(None)  # Ray could not say: nothing changes
    assert [(r.label, r.state.value) for r in eng.reports()] == states
    eng._note_live({})
    assert all(r.state.value == "stopped" for r in eng.reports())

    # an utterance failed with engine_failed: failed until a listing well after still finds it
    eng = RayEngine(cfg, None)
    eng._note_live(live("a", "b"))
    on_a = cast(RayStream, SimpleNamespace(placed=Placed("a", live("a")["a"])))
    eng._on_failed(on_a, StreamFailedError("not the replica's failure"))  # not engine_failed: no mark
    eng._on_failed(on_a, EngineFailedError("the engine replica serving this stream failed"))
    eng._note_live(live("a", "b"))  # at once: Ray may not have released a dead actor's name yet
    assert [(r.label, r.state.value, r.failed_streams) for r in eng.reports()] == [
        ("a", "failed", 1),
        ("b", "ready", 0),
    ]
    eng._note_live(live("a", "b"), taken_at=time.monotonic() + FAILED_CONFIRM_S)
    assert [(r.label, r.state.value, r.failed_streams) for r in eng.reports()] == [("a", "ready", 1), ("b", "ready", 0)]
    eng._on_failed(on_a, EngineFailedError("the engine replica serving this stream failed"))
    eng._note_live(live("b"), taken_at=time.monotonic() + FAILED_CONFIRM_S)  # it died: it stays failed
    assert [(r.label, r.state.value, r.failed_streams) for r in eng.reports()] == [
        ("a", "failed", 2),
        ("b", "ready", 0),
    ]


def test_serve_run_builder_takes_typed_arguments(tmp_path: Path) -> None:
    """``serve run voice_out.engine.ray_serve.replica:build_app config=FILE num_replicas=2 ...``"""
    from voice_out.engine.ray_serve.replica import build_app

    toml = tmp_path / "voice_out.toml"
    toml.write_text('[model]\nmodel = "random:tiny"\n[engine]\nmax_streams = 12\n')
    app = build_app({"config": str(toml), "num_replicas": "2", "num_gpus": "0", "target_streams": "8"})
    deployment = app._bound_deployment  # Serve's Application wraps the bound deployment
    assert deployment.num_replicas == 2 and deployment.max_ongoing_requests == 12 + 4
    assert deployment.ray_actor_options["num_gpus"] == 0
    with pytest.raises(ConfigError, match="unknown argument 'replicas'"):
        build_app({"replicas": "2"})
    with pytest.raises(ConfigError, match="num_gpus = 'one' is invalid"):
        build_app({"num_gpus": "one"})


# --------------------------------------------------------------------------------------------
# A local Ray instance with two tiny replicas

LOAD = BuildOptions(forced=ForcedTokens(3), warmup=False, text_normalizer="none", noise_prompt_tokens=0, kv_len=1024)


def tiny_config(voices_dir: Path) -> Config:
    return Config(
        model=ModelConfig(model="random:tiny", device="cpu"),
        engine=EngineConfig(max_streams=8, max_ahead_s=1.0, max_text_chars=600),
        server=ServerConfig(voices_dir=str(voices_dir), engine="ray"),
    )


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> Config:
    return tiny_config(tmp_path_factory.mktemp("ray") / "voices")


@pytest.fixture(scope="module")
def handle(cfg: Config) -> Iterator[Any]:
    # one torch thread per replica: two replicas share two cores
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        logging_level="ERROR",
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}},
    )
    try:
        serve.start(proxy_location="Disabled")
        options = DeploymentOptions(
            app_name="voice_out_test",
            num_replicas=2,
            num_gpus=0,
            num_cpus=0,
            health_check_period_s=1.0,
            health_check_timeout_s=30.0,
            graceful_shutdown_timeout_s=5.0,
        )
        yield serve.run(speech_app(cfg, options, LOAD), name=options.app_name, route_prefix=None)
    finally:
        serve.shutdown()
        ray.shutdown()


async def drain(stream: RayStream) -> np.ndarray:
    parts = [c.pcm async for c in stream]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


async def replica_stats(handle: Any, replica_id: str, until: Callable[[ReplicaStats], bool]) -> ReplicaStats:
    """Ask the deployment until ``replica_id`` answers with stats meeting ``until`` (Serve routes
    each call to either replica)."""
    deadline = time.monotonic() + 60.0
    last: ReplicaStats | None = None
    while time.monotonic() < deadline:
        st: ReplicaStats = await handle.stats.remote()
        if st.replica_id == replica_id:
            last = st
            if until(st):
                return st
        await asyncio.sleep(0.05)
    raise AssertionError(f"replica {replica_id} never met the condition; last stats: {last}")


async def first_chunk(stream: RayStream) -> Any:
    it = stream.__aiter__()
    await asyncio.wait_for(it.__anext__(), TIMEOUT_S)
    return it


async def with_timeout(aw: Awaitable[Any]) -> Any:
    return await asyncio.wait_for(aw, TIMEOUT_S)


@pytest.mark.asyncio
async def test_two_replicas_serve_streamed_text(cfg: Config, handle: Any) -> None:
    """Deltas pushed while the call streams reach the replica in order: the audio equals the
    in-process engine's for the same text and seed. Two concurrent utterances go to both
    replicas (the first one's replica is busier when the second leaves)."""
    parts = ["Hello there, ", "this text arrives ", "in pieces ", "while the call streams."]
    async with RayEngine(cfg, None, handle=handle) as eng:
        assert eng.ready and eng.voice_names() == ["noise"]
        with pytest.raises(UnknownVoiceError):
            eng.open_stream("nobody")
        a = eng.open_stream(None, seed=11)
        a.push_text(parts[0])  # rides the call
        await asyncio.sleep(0.05)  # the call has left: the rest goes through the relay
        for p in parts[1:]:
            a.push_text(p)
            await asyncio.sleep(0.02)
        a.end_text()
        it_a = await first_chunk(a)
        b = eng.open_stream(None, seed=12)
        b.push_text("A second utterance.")
        b.end_text()
        pcm_b = await with_timeout(drain(b))
        rest_a = [c.pcm async for c in it_a]
        assert a.state is StreamState.FINISHED and b.state is StreamState.FINISHED
        assert a.placed is not None and b.placed is not None
        assert a.placed.replica_id != b.placed.replica_id, "the second utterance went to the busier replica"
        assert len(pcm_b) > 0 and len(rest_a) > 0
        transit = sorted(a.chunk_transit_s + b.chunk_transit_s)
        assert 0 <= transit[len(transit) // 2] < 1.0

    # the same text and seed in process: the same audio (forced tokens: content is seed-driven)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        local = Engine.load(cfg, options=LOAD)
    async with local:
        s = local.open_stream(None, seed=11)
        for p in parts:
            s.push_text(p)
        s.end_text()
        want = np.concatenate([c.pcm async for c in s])
    async with RayEngine(cfg, None, handle=handle) as eng:
        again = eng.open_stream(None, seed=11)
        again.push_text(parts[0])
        await asyncio.sleep(0.05)
        for p in parts[1:]:
            again.push_text(p)
        again.end_text()
        got = await with_timeout(drain(again))
    assert len(got) == len(want)
    # the same tokens; float sums differ by ~1e-5 between the replica's one torch thread and ours
    np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.asyncio
async def test_cancel_stops_the_replica_work(cfg: Config, handle: Any) -> None:
    async with RayEngine(cfg, None, handle=handle) as eng:
        s = eng.open_stream(None)
        s.push_text("A long utterance that the listener interrupts, " * 6)  # text still open
        it = await first_chunk(s)
        assert s.placed is not None
        s.cancel()
        assert [c async for c in it] == [] and s.state is StreamState.ABORTED
        rid = s.placed.replica_id
        st = await replica_stats(handle, rid, lambda st: st.outcomes.get(s.id) == "aborted")
        # the engine dropped it: no request, no KV slot, and no step runs any more
        st = await replica_stats(handle, rid, lambda st: st.live_requests == 0 and st.used_slots == 0)
        await asyncio.sleep(0.5)
        later = await replica_stats(handle, rid, lambda _: True)
        assert later.steps == st.steps and later.open_streams == 0


@pytest.mark.asyncio
async def test_server_front_over_ray(cfg: Config, handle: Any) -> None:
    """The aiohttp front keeps WebRTC and the control protocol; the engine is the deployment."""
    import aiohttp
    from aiohttp.test_utils import TestServer

    from voice_out.client import connect
    from voice_out.server import protocol as p
    from voice_out.server.app import create_app

    engine = RayEngine(cfg, None, handle=handle)
    app = create_app(cfg, engine, None)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()  # enters the RayEngine: relay started, deployment asked
    url = str(server.make_url("")).rstrip("/")
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/healthz") as r:
                assert r.status == 200 and (await r.json())["engine_ready"] is True
        client = await connect(url)
        assert client.voices == ("noise",)
        client.send_text("u1", "Hi the")
        client.send_text("u1", "re, over Ray.")
        client.done("u1")
        started = await client.wait_for("audio.started", "u1", timeout_s=TIMEOUT_S)
        done = await client.wait_for("audio.done", "u1", timeout_s=TIMEOUT_S)
        assert isinstance(started, p.AudioStarted) and isinstance(done, p.AudioDone)
        assert done.audio_ms > 200
        client.send_text("u2", "This one is cut short by the listener, long before its end. " * 3)
        await client.wait_for("audio.started", "u2", timeout_s=TIMEOUT_S)
        client.cancel()
        cut = await client.wait_for("cancelled", "u2", timeout_s=10)
        assert isinstance(cut, p.Cancelled) and cut.played_ms > 0
        await client.close()
    finally:
        await server.close()
    assert not engine.ready


@pytest.mark.asyncio
async def test_killed_replica_fails_only_its_own_utterances(cfg: Config, handle: Any) -> None:
    """Runs after the tests that need both replicas: it kills one (Serve starts a replacement)."""
    async with RayEngine(cfg, None, handle=handle) as eng:
        victim = eng.open_stream(None)
        victim.push_text("This utterance is on the replica that dies, and it is long. " * 4)
        it_v = await first_chunk(victim)
        assert victim.placed is not None
        other: RayStream | None = None
        for _ in range(6):  # the router prefers the idle replica; retry if it did not
            s = eng.open_stream(None)
            s.push_text("This one is on the other replica and ends well.")
            s.end_text()
            it_o = await first_chunk(s)
            assert s.placed is not None
            if s.placed.replica_id != victim.placed.replica_id:
                other = s
                break
            s.cancel()
        assert other is not None, "no utterance reached the second replica"

        ray.kill(ray.get_actor(victim.placed.actor_name, namespace="serve"), no_restart=True)
        with pytest.raises(EngineFailedError) as failed:
            async for _ in it_v:
                pass
        assert failed.value.code == "engine_failed" and victim.state is StreamState.FAILED
        rest = [c async for c in it_o]  # the other replica's utterance goes on to its end
        assert other.state is StreamState.FINISHED and rest and rest[-1].final

        for _ in range(3):  # the next utterances avoid the dead replica and succeed
            n = eng.open_stream(None)
            n.push_text("After the failure.")
            n.end_text()
            assert len(await with_timeout(drain(n))) > 0
            assert n.placed is not None and n.placed.replica_id != victim.placed.replica_id
            assert n.state is StreamState.FINISHED
    with pytest.raises(OverloadedError):
        eng.open_stream(None)  # closed: not connected any more


def test_serve_with_the_ray_engine_builds_a_front(tmp_path: Path) -> None:
    """``server.engine = "ray"``: the front's runtime is a RayEngine over the shared voices
    directory; it connects when the server starts (``async with``), not here."""
    from voice_out.server.app import load_runtime

    engine, store = load_runtime(tiny_config(tmp_path / "voices"))
    assert isinstance(engine, RayEngine) and engine.voices is store and not engine.ready


def test_ray_deploy_command(cfg: Config, handle: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """``voice-out ray-deploy`` deploys a second application on the running cluster; it answers."""
    from voice_out.cli import main

    argv = ["ray-deploy", "--model", "random:tiny", "--device", "cpu", "--voices-dir", cfg.server.voices_dir]
    argv += ["--app", "voice_out_cli", "--replicas", "1", "--num-gpus", "0", "--num-cpus", "0"]
    try:
        assert main(argv) == 0
        assert "'voice_out_cli' is running (1 replicas" in capsys.readouterr().out
        info = serve.get_app_handle("voice_out_cli").info.remote().result(timeout_s=TIMEOUT_S)
        assert info.builtin_voices == ("noise",) and info.sample_rate == 24000
    finally:
        serve.delete("voice_out_cli")
    assert main(["ray-deploy", "--replicas", "0", "--model", "random:tiny"]) == 2
    assert "num_replicas = 0 is invalid" in capsys.readouterr().err


@pytest.mark.asyncio
async def test_delete_drains_a_streaming_utterance(cfg: Config, handle: Any) -> None:
    """Shutting the application down (as a scale-down or redeploy does to a replica) stops new
    routing but lets the utterance in flight speak to its end."""
    from voice_out.engine.ray_serve.replica import deploy

    options = DeploymentOptions(
        app_name="voice_out_drain", num_replicas=1, num_gpus=0, num_cpus=0, graceful_shutdown_timeout_s=60.0
    )
    loop = asyncio.get_running_loop()
    drain_handle = await loop.run_in_executor(None, deploy, cfg, options, LOAD)
    async with RayEngine(cfg, None, handle=drain_handle) as eng:
        s = eng.open_stream(None)
        s.push_text("This utterance is still speaking when its replica is told to stop. " * 2)
        s.end_text()
        it = await first_chunk(s)
        deleting = loop.run_in_executor(None, serve.delete, "voice_out_drain")
        deadline = time.monotonic() + 30.0
        while (await loop.run_in_executor(None, app_status, "voice_out_drain")) != "DELETING":
            assert time.monotonic() < deadline, "the application never started deleting"
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)
        # back-pressure (engine.max_ahead_s = 1) holds the rest until we listen: still speaking
        assert not s.state.terminal
        rest = await with_timeout(drain_list(it))
        assert s.state is StreamState.FINISHED and rest and rest[-1].final
        await with_timeout(deleting)
    assert "voice_out_drain" not in serve.status().applications


def app_status(name: str) -> str | None:
    app = serve.status().applications.get(name)
    return None if app is None else str(app.status.value)


async def drain_list(it: Any) -> list[Any]:
    return [c async for c in it]


# --------------------------------------------------------------------------------------------
# The front over applications of its own: a replica killed under a WebRTC session, autoscaling


async def deploy_app(cfg: Config, options: DeploymentOptions) -> Any:
    from voice_out.engine.ray_serve.replica import deploy

    return await asyncio.get_running_loop().run_in_executor(None, deploy, cfg, options, LOAD)


async def delete_app(name: str) -> None:
    await with_timeout(asyncio.get_running_loop().run_in_executor(None, serve.delete, name))


async def get_healthz(http: Any, url: str) -> tuple[int, dict[str, Any]]:
    async with http.get(url + "/healthz") as r:
        return r.status, await r.json()


async def healthz_until(
    http: Any, url: str, until: Callable[[int, dict[str, Any]], bool], timeout_s: float = TIMEOUT_S
) -> tuple[int, dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        status, body = await get_healthz(http, url)
        if until(status, body):
            return status, body
        assert time.monotonic() < deadline, f"/healthz never met the condition; last: {status} {body}"
        await asyncio.sleep(0.2)


def replica_entries(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["replica"]: e for e in body["engines"]}


@pytest.mark.asyncio
async def test_a_killed_replica_surfaces_at_the_front(cfg: Config, handle: Any) -> None:
    """A one-replica application behind the aiohttp front. Killing the replica's actor while a
    WebRTC session's utterance speaks: the client gets ``error`` with ``engine_failed`` for that
    utterance, ``/healthz`` and ``/metrics`` show the replica failed, and once Serve has started
    a replacement, ``/healthz`` is 200 again and the same session speaks on the new replica.
    With the application deleted (nothing can serve), the front reports not ready and refuses
    the next utterance at once with ``not_ready``."""
    import aiohttp
    from aiohttp.test_utils import TestServer

    from voice_out.client import connect
    from voice_out.engine.ray_serve.client import REPLICA_ACTOR_PREFIX
    from voice_out.server import protocol as p
    from voice_out.server.app import create_app

    app_name = "voice_out_kill"
    options = DeploymentOptions(app_name=app_name, num_replicas=1, num_gpus=0, num_cpus=0, health_check_period_s=1.0)
    kill_handle = await deploy_app(cfg, options)
    engine = RayEngine(cfg, None, handle=kill_handle, health_period_s=0.5)
    server = TestServer(create_app(cfg, engine, None, web_dir=None), host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    try:
        async with aiohttp.ClientSession() as http:
            status, body = await get_healthz(http, url)
            assert status == 200 and body["engine_ready"] is True
            ((rid, entry),) = replica_entries(body).items()  # listed before any utterance
            assert (entry["state"], entry["streams"], entry["placed"], entry["capacity"]) == ("ready", 0, 0, 8)
            client = await connect(url)
            try:
                # text still open: the utterance is in flight on the replica when it dies
                client.send_text("u1", "This utterance is speaking when its replica is killed. " * 3)
                await client.wait_for("audio.started", "u1", timeout_s=TIMEOUT_S)
                _, body = await get_healthz(http, url)
                assert replica_entries(body)[rid]["streams"] == 1
                victim = ray.get_actor(f"{REPLICA_ACTOR_PREFIX}{app_name}#SpeechReplica#{rid}", namespace="serve")
                ray.kill(victim, no_restart=True)
                error = await client.wait_for("error", "u1", timeout_s=TIMEOUT_S)
                assert isinstance(error, p.Error) and error.code == "engine_failed", error

                _, body = await get_healthz(http, url)
                dead = replica_entries(body)[rid]
                assert (dead["state"], dead["streams"], dead["placed"], dead["failed_streams"]) == ("failed", 0, 1, 1)
                async with http.get(url + "/metrics") as r:
                    text = await r.text()
                assert f'voice_out_engine_up{{replica="{rid}"}} 0.0' in text
                assert f'voice_out_engine_failed_utterances_total{{replica="{rid}"}} 1.0' in text
                assert 'voice_out_errors_total{code="engine_failed"} 1.0' in text

                # Serve replaces the replica; the front sees it live and is ready again
                def replaced(status: int, body: dict[str, Any]) -> bool:
                    return status == 200 and any(
                        e["state"] == "ready" and r != rid for r, e in replica_entries(body).items()
                    )

                _, body = await healthz_until(http, url, replaced)
                (new_rid,) = [r for r, e in replica_entries(body).items() if e["state"] == "ready"]
                assert replica_entries(body)[rid]["state"] == "failed"  # still reported, apart
                client.send_text("u2", "Spoken after the replacement.")
                client.done("u2")
                done = await client.wait_for("audio.done", "u2", timeout_s=TIMEOUT_S)
                assert isinstance(done, p.AudioDone) and done.audio_ms > 0
                _, body = await get_healthz(http, url)
                assert replica_entries(body)[new_rid]["placed"] == 1

                # nothing can serve any more: not ready, and utterances are refused at once
                await delete_app(app_name)

                def gone(status: int, body: dict[str, Any]) -> bool:
                    # the replica's actor leaves a moment after serve.delete returns
                    return status == 503 and all(e["state"] != "ready" for e in body["engines"])

                status, body = await healthz_until(http, url, gone, timeout_s=30)
                assert body["engine_ready"] is False and replica_entries(body)[new_rid]["state"] == "stopped"
                client.send_text("u3", "Nobody is left to speak this.")
                refused = await client.wait_for("error", "u3", timeout_s=10)
                assert isinstance(refused, p.Error) and refused.code == "not_ready", refused
            finally:
                await client.close()
    finally:
        await server.close()
        if app_status(app_name) is not None:
            await delete_app(app_name)
    assert not engine.ready


@pytest.mark.asyncio
# a metrics_interval_s shorter than Serve's 10 s default is what makes this test short; Serve
# warns that the field will become an environment variable
@pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning")
async def test_autoscaling_adds_a_replica_under_load(cfg: Config, handle: Any) -> None:
    """Autoscaled between 1 and 2 replicas at 1 stream in flight each: four streams held open
    on the first replica make Serve start the second (``serve.status()`` counts 2 running);
    an utterance opened then goes to the new replica; every stream speaks to its end."""
    app_name = "voice_out_scale"
    options = DeploymentOptions(
        app_name=app_name,
        min_replicas=1,
        max_replicas=2,
        target_streams=1,
        upscale_delay_s=0.5,
        look_back_s=2.0,
        metrics_interval_s=0.5,
        num_gpus=0,
        num_cpus=0,
    )

    def running() -> int:
        app = serve.status().applications[app_name]
        return int(app.deployments["SpeechReplica"].replica_states.get("RUNNING", 0))

    loop = asyncio.get_running_loop()
    started = time.monotonic()
    scale_handle = await deploy_app(cfg, options)
    try:
        assert await loop.run_in_executor(None, running) == 1
        async with RayEngine(cfg, None, handle=scale_handle) as eng:
            text = "A stream held open while the deployment grows. "
            first = [eng.open_stream(None, seed=i) for i in range(4)]
            for s in first:
                s.push_text(text)  # no end_text yet: each stays in flight
            iters = await asyncio.gather(*(first_chunk(s) for s in first))
            assert len({s.placed.replica_id for s in first if s.placed is not None}) == 1
            old = first[0].placed.replica_id if first[0].placed is not None else None
            deadline = time.monotonic() + TIMEOUT_S
            while await loop.run_in_executor(None, running) < 2:
                assert time.monotonic() < deadline, f"never scaled up: {serve.status().applications[app_name]}"
                await asyncio.sleep(0.5)
            scaled_after_s = time.monotonic() - started
            # the front's router learns of the new replica shortly after the controller counts
            # it: open utterances (each held open) until one lands there
            later: list[RayStream] = []
            later_iters = []
            while not any(s.placed is not None and s.placed.replica_id != old for s in later):
                assert len(later) < 8, "no utterance reached the replica the autoscaler added"
                s = eng.open_stream(None, seed=10 + len(later))
                s.push_text("Opened once there are two replicas.")
                later.append(s)
                later_iters.append(await first_chunk(s))
                await asyncio.sleep(0.2)
            for s in first + later:
                s.end_text()
            rests = await with_timeout(asyncio.gather(*(drain_list(it) for it in iters + later_iters)))
            assert all(s.state is StreamState.FINISHED for s in first + later)
            assert all(rest and rest[-1].final for rest in rests)
            new = {s.placed.replica_id for s in later if s.placed is not None} - {old}
            assert len(new) == 1 and {r.label for r in eng.reports()} == {old} | new
        print(f"scaled to 2 replicas {scaled_after_s:.1f} s after the deploy call")
    finally:
        await delete_app(app_name)
