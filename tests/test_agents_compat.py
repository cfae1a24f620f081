"""The agent frameworks' own ElevenLabs plug-ins, unchanged, against ``voice-out serve`` on the
tiny random model over loopback: pipecat's ``ElevenLabsTTSService(url=...)`` in a pipeline fed
LLM tokens, and LiveKit Agents' ``elevenlabs.TTS(base_url=...)`` (``stream()`` and
``synthesize()``). Under CI (``CI=true``) a missing package fails these tests instead of
skipping them."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TOKEN = "agents-test-token"
CANCELS = "voice_out_cancelled_utterances_total"


def need(module: str) -> Any:
    """Import ``module``; a missing one skips the test locally and fails it under CI."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{module} is not installed (the dev extra installs it): {e}")
        pytest.skip(f"{module} is not installed: {e}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _metric(base: str, name: str) -> float:
    req = urllib.request.Request(base + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``voice-out serve`` on random:tiny; its speech is bounded to 4 tokens per text token."""
    tmp: Path = tmp_path_factory.mktemp("serve")
    port = _free_port()
    cmd = [sys.executable, "-m", "voice_out.cli", "serve", "--model", "random:tiny", "--device", "cpu"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--voices-dir", str(tmp / "voices")]
    cmd += ["--set", "engine.max_speech_tokens_per_text_token=4", "--set", f"server.auth_token={TOKEN}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO_ROOT))
    log = open(tmp / "serve.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail("voice-out serve exited: " + (tmp / "serve.log").read_text()[-2000:])
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(base + "/healthz", timeout=2) as r:
                    if r.status == 200:
                        break
            if time.monotonic() > deadline:
                pytest.fail("voice-out serve did not become healthy: " + (tmp / "serve.log").read_text()[-2000:])
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def wait_streams_freed(base: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while _metric(base, "voice_out_active_streams") != 0:
        assert time.monotonic() < deadline, "an ElevenLabs stream was not released"
        time.sleep(0.2)


# ---- pipecat ---------------------------------------------------------------------------------


def test_pipecat_elevenlabs_service(server: str) -> None:
    """LLM tokens in TOKEN mode -> audio frames and word timestamps (TTSTextFrame); then a
    second reply cut by an InterruptionFrame: its audio stops and the server frees its stream."""
    frames = need("pipecat.frames.frames")
    pipeline_mod = need("pipecat.pipeline.pipeline")
    worker_mod = need("pipecat.pipeline.worker")
    runner_mod = need("pipecat.workers.runner")
    fp = need("pipecat.processors.frame_processor")
    el = need("pipecat.services.elevenlabs.tts")
    tts_service = need("pipecat.services.tts_service")

    class Sink(fp.FrameProcessor):  # type: ignore[name-defined]
        def __init__(self, queue: asyncio.Queue[Any]) -> None:
            super().__init__()
            self.queue = queue

        async def process_frame(self, frame: Any, direction: Any) -> None:
            await super().process_frame(frame, direction)
            await self.queue.put(frame)
            await self.push_frame(frame, direction)

    async def main() -> dict[str, Any]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        tts = el.ElevenLabsTTSService(
            api_key=TOKEN,
            url="ws" + server.removeprefix("http"),
            sample_rate=24000,
            settings=el.ElevenLabsTTSService.Settings(voice="noise"),
            text_aggregation_mode=tts_service.TextAggregationMode.TOKEN,
        )
        worker = worker_mod.PipelineWorker(
            pipeline_mod.Pipeline([tts, Sink(queue)]),
            cancel_on_idle_timeout=False,
            params=worker_mod.PipelineParams(audio_out_sample_rate=24000),
        )
        runner = runner_mod.WorkerRunner()
        await runner.add_workers(worker)
        run = asyncio.get_running_loop().create_task(runner.run())

        async def reply(tokens: list[str], end: bool) -> None:
            await worker.queue_frame(frames.LLMFullResponseStartFrame())
            for tok in tokens:
                await worker.queue_frame(frames.LLMTextFrame(tok))
            if end:
                await worker.queue_frame(frames.LLMFullResponseEndFrame())

        async def collect(until: type, within_s: float) -> list[Any]:
            got: list[Any] = []
            deadline = time.monotonic() + within_s
            while time.monotonic() < deadline:
                try:
                    f = await asyncio.wait_for(queue.get(), deadline - time.monotonic())
                except TimeoutError:
                    break
                got.append(f)
                if isinstance(f, until):
                    break
            return got

        out: dict[str, Any] = {}
        await reply(["Hello", " there", ",", " how", " are", " you", "?"], end=True)
        out["first"] = await collect(frames.TTSStoppedFrame, 240)
        # the second reply is interrupted once its audio has started
        await reply(["This", " reply", " is", " long", " and", " will", " be", " cut", " short", "."] * 3, end=False)
        out["second"] = await collect(frames.TTSAudioRawFrame, 240)
        cancels = _metric(server, CANCELS)
        await worker.queue_frame(frames.InterruptionFrame())
        out["after"] = await collect(frames.TTSStoppedFrame, 3)
        # freed by the interruption itself: the socket is still open, the reply never ended
        await asyncio.get_running_loop().run_in_executor(None, wait_streams_freed, server)
        out["cancelled"] = _metric(server, CANCELS) - cancels
        await worker.queue_frame(frames.EndFrame())
        await asyncio.wait_for(run, 60)
        return out

    out = asyncio.run(main())
    first = out["first"]
    audio = [f for f in first if isinstance(f, frames.TTSAudioRawFrame)]
    words = [f for f in first if isinstance(f, frames.TTSTextFrame)]
    assert isinstance(first[-1], frames.TTSStoppedFrame), [type(f).__name__ for f in first]
    assert audio and all(f.sample_rate == 24000 and f.num_channels == 1 for f in audio)
    assert sum(len(f.audio) for f in audio) > 24000  # > 0.5 s of s16 audio
    assert [w.text for w in words] == ["Hello", "there,", "how", "are", "you?"]
    pts = [w.pts for w in words]
    assert all(p is not None for p in pts) and pts == sorted(pts)
    assert any(isinstance(f, frames.TTSAudioRawFrame) for f in out["second"])
    # after the interruption: at most frames already in flight, and no end-of-speech of a
    # finished reply
    assert not any(isinstance(f, frames.TTSStoppedFrame) for f in out["after"])
    assert out["cancelled"] == 1


# ---- LiveKit Agents --------------------------------------------------------------------------


def test_livekit_elevenlabs_tts(server: str) -> None:
    """``stream()`` with push_text / flush / end_input: audio frames and a timed transcript;
    ``synthesize()`` over the HTTP route; an interrupted stream frees the server's stream."""
    need("livekit.agents")
    el = need("livekit.plugins.elevenlabs")
    aiohttp = need("aiohttp")
    from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with aiohttp.ClientSession() as http:
            tts = el.TTS(
                api_key=TOKEN,
                base_url=server + "/v1",
                voice_id="noise",
                encoding="pcm_24000",
                http_session=http,
            )
            stream = tts.stream()
            for word in ["Hello ", "there, ", "how ", "are ", "you?"]:
                stream.push_text(word)
            stream.flush()
            stream.end_input()
            events = [ev async for ev in stream]
            await stream.aclose()
            out["stream"] = events

            out["synth"] = [ev async for ev in tts.synthesize("Short one.")]

            cut = tts.stream()
            cut.push_text("This reply is long and will be cut short. " * 3)
            async for ev in cut:
                if ev.frame is not None and ev.frame.samples_per_channel:
                    break
            cancels = _metric(server, CANCELS)
            await cut.aclose()  # what an interruption does
            await asyncio.get_running_loop().run_in_executor(None, wait_streams_freed, server)
            out["cancelled"] = _metric(server, CANCELS) - cancels
            await tts.aclose()
        return out

    out = asyncio.run(main())
    events = out["stream"]
    assert events and events[-1].is_final
    assert all(ev.frame.sample_rate == 24000 for ev in events)
    assert sum(ev.frame.samples_per_channel for ev in events) > 12000
    timed = [t for ev in events for t in ev.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])]
    assert "".join(str(t) for t in timed).split() == ["Hello", "there,", "how", "are", "you?"]
    # ElevenLabs' times restart at 0 in every message (pipecat adds them up); this plug-in
    # passes them on as they come, so only each word's own span is checked
    assert all(t.end_time >= t.start_time >= 0 for t in timed)
    synth = out["synth"]
    assert synth and sum(ev.frame.samples_per_channel for ev in synth) > 0
    assert out["cancelled"] == 1
