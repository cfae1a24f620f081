"""The real engine on CPU: random:tiny weights (LLM, flow, HiFT), the worker thread, the stream
handle. Forced tokens make every stream deterministic, so concurrency can be checked exactly."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import REPO_ROOT
from voice_out.config import Config, EngineConfig, ServerConfig
from voice_out.engine.api import (
    SAMPLE_RATE,
    EngineLike,
    NoVoiceError,
    OverloadedError,
    PcmChunk,
    Stream,
    StreamClosedError,
    StreamFailedError,
    StreamState,
    TextTooLongError,
    UnknownVoiceError,
)
from voice_out.engine.build import BuildOptions
from voice_out.engine.chunk_schedule import ChunkPlan, ChunkSchedule
from voice_out.engine.engine import Engine, EngineStats, EngineStream
from voice_out.engine.request import SAMPLES_PER_TOKEN, LlmStep, VoicePrompt
from voice_out.engine.runner import Runner, noise_voice
from voice_out.engine.scheduler import (
    Admit,
    ForcedTokens,
    LlmWork,
    NextGuess,
    Release,
    StepPlan,
    StepResult,
    VocodeWork,
)
from voice_out.fast.flow_step import FastToken2Wav
from voice_out.fast.plan import PINNABLE
from voice_out.model.token2wav import Token2WavStream
from voice_out.text.rows import SOS, Row, RowKind

pytestmark = pytest.mark.filterwarnings("ignore:.*RANDOM WEIGHTS")

PHASES = ("admit", "llm", "vocode")


class Hook:
    """Fault hook and probe: records every per-request runner call; runs ``action`` on a match."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.action: dict[tuple[str, str, int], object] = {}
        self._lock = threading.Lock()

    def __call__(self, request_id: str, phase: str) -> None:
        with self._lock:
            self.calls.append((request_id, phase))
            n = sum(1 for c in self.calls if c == (request_id, phase))
            act = self.action.get((request_id, phase, n))
        if isinstance(act, BaseException):
            raise act
        if callable(act):
            act()

    def calls_for(self, rid: str) -> list[str]:
        with self._lock:
            return [p for r, p in self.calls if r == rid]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    # 2 shared cores: intra-op threads only fight each other here
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


FORCED_3 = ForcedTokens(3)


def make_engine(
    tmp: Path, *, hook: Hook | None = None, forced: ForcedTokens | None = FORCED_3, **engine: object
) -> Engine:
    """A tiny random CPU engine over ``engine`` settings; plan choices among them
    (``step_ahead_rows``, ...) are pinned in its plan (``Engine.load``'s ``pins``)."""
    kw: dict[str, object] = {"max_streams": 8, "max_ahead_s": 1.0, "max_text_chars": 200}
    kw.update(engine)
    pins = {k: kw.pop(k) for k in list(kw) if k in PINNABLE}
    cfg = Config(server=ServerConfig(voices_dir=str(tmp / "no-voices")), engine=EngineConfig(**kw))  # type: ignore[arg-type]
    return Engine.load(
        cfg,
        model="random:tiny",
        device="cpu",
        options=BuildOptions(
            pins=pins,
            forced=forced,
            warmup=False,
            text_normalizer="none",
            noise_prompt_tokens=0,
            kv_len=512,
            fault_hook=hook,
        ),
    )


@pytest.fixture(scope="module")
def hook() -> Hook:
    return Hook()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, hook: Hook) -> Iterator[Engine]:
    eng = make_engine(tmp_path_factory.mktemp("engine"), hook=hook)
    eng.start(timeout=120)
    yield eng
    eng.close()


def assert_clean(engine: Engine) -> EngineStats:
    assert engine.wait_idle(60)
    gc.collect()
    st = engine.stats()
    assert (st.used_slots, st.live_requests, st.runner_requests, st.waiting) == (0, 0, 0, 0), st
    assert (st.open_streams, st.queued_chunks, st.worker_threads) == (0, 0, 1), st
    return st


def solo(engine: Engine, seed: int, deltas: Sequence[str]) -> list[PcmChunk]:
    stream = engine.open_stream(seed=seed)
    for d in deltas:
        stream.push_text(d)
    stream.end_text()
    return list(stream)


def signature(chunks: Sequence[PcmChunk]) -> list[tuple[int, int, bool, int]]:
    return [(c.start_sample, c.text_end, c.final, len(c.pcm)) for c in chunks]


def split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(3, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


# --------------------------------------------------------------------------------------------


def test_engine_implements_the_api(engine: Engine) -> None:
    like: EngineLike = engine  # statically checked against the contract
    assert like.ready and like.voice_names() == ["noise"]
    assert engine.ready and engine.sample_rate == SAMPLE_RATE
    assert engine.voice_names() == ["noise"]
    stream = engine.open_stream()
    assert isinstance(stream, Stream)
    assert stream.voice == "noise" and stream.state is StreamState.WAITING
    stream.cancel()
    with pytest.raises(UnknownVoiceError):
        engine.open_stream("nobody")
    assert_clean(engine)


def test_chunks_per_step_default_follows_token2wav_graphs(tmp_path: Path) -> None:
    """The plan's ``max_chunks_per_step`` is 4 off CUDA (token2wav graphs are CUDA only,
    whatever the LLM does); a pin overrides it, and the worker's launch policy takes the plan's."""
    assert make_engine(tmp_path).plan.max_chunks_per_step == 4
    eng = make_engine(tmp_path, max_chunks_per_step=6)
    assert eng.plan.max_chunks_per_step == 6 and eng._new_worker().launch.max_chunks_per_step == 6
    plain = Config(server=eng.config.server)
    graphed = Engine.load(plain, model="random:tiny", device="cpu", options=BuildOptions(pins={"cuda_graphs": True}))
    assert graphed.plan.max_chunks_per_step == 4 and graphed.plan.cuda_graphs


def test_one_stream_speaks_all_its_tokens(engine: Engine) -> None:
    text = "hi there, bob"  # 13 byte ids -> 39 speech tokens (forced 3 per text token)
    chunks = solo(engine, 5, [text[:4], text[4:9], text[9:]])
    assert [c.final for c in chunks] == [False, True]
    assert sum(len(c.pcm) for c in chunks) == 39 * SAMPLES_PER_TOKEN
    assert [c.start_sample for c in chunks] == [0, len(chunks[0].pcm)]
    assert all(c.pcm.dtype == np.float32 and np.isfinite(c.pcm).all() for c in chunks)
    assert chunks[-1].text_end == len(text)
    assert 0 < chunks[0].text_end <= len(text)
    assert_clean(engine)


def engine_runner(engine: Engine) -> Runner:
    worker = engine._worker
    assert worker is not None and isinstance(worker.runner, Runner)
    return worker.runner


def wait_not_warming(engine: Engine, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.warming:
        assert time.monotonic() < deadline, "the deferred start-up work did not end"
        time.sleep(0.01)


def test_start_up_work_left_by_the_warm_up_begins_at_ready_without_a_message(tmp_path: Path) -> None:
    """Work the warm-up defers (``Runner.defer``) is reported (``Engine.warming``) from the
    moment the engine is ready, and the worker starts it then, with nothing sent to it."""
    eng = make_engine(tmp_path)
    pieces: list[int] = []

    def work() -> Iterator[None]:
        for i in range(20):
            pieces.append(i)
            time.sleep(0.01)
            yield

    def warm(runner: object) -> None:
        assert isinstance(runner, Runner)
        runner.defer(work())

    eng._warmup = warm
    eng.start(timeout=120)
    try:
        assert eng.warming or len(pieces) == 20
        wait_not_warming(eng)
        assert pieces == list(range(20))
    finally:
        eng.close()


def test_start_up_work_left_at_close_ends_on_the_worker_thread(tmp_path: Path) -> None:
    """Closing an engine whose start-up work after ready is not done ends that work on the
    worker thread (what it holds, such as a state slot lent to a placeholder stream, is given
    back there), and the close does not wait for the rest of it."""
    eng = make_engine(tmp_path)
    ended: list[str] = []

    def work() -> Iterator[None]:
        try:
            for _ in range(10_000):  # 100 s of pieces
                time.sleep(0.01)
                yield
        finally:
            ended.append(threading.current_thread().name)

    def warm(runner: object) -> None:
        assert isinstance(runner, Runner)
        runner.defer(work())
        runner.defer(work())  # the second is never begun: nothing to end

    eng._warmup = warm
    eng.start(timeout=120)
    assert eng.warming
    t0 = time.monotonic()
    eng.close()
    assert time.monotonic() - t0 < 10
    assert ended == ["voice_out-gpu"]


def test_start_up_work_after_ready_runs_only_while_no_stream_is_live(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """``Runner.defer``: the worker advances start-up's deferred work (on a GPU, the graph
    captures past the first chunks) one piece at a time, and only while no request is live; a
    stream opened meanwhile is served between two pieces and speaks as it does alone;
    ``Engine.warming`` says whether work is left; a failing piece ends the work (logged) and
    the engine goes on."""
    runner = engine_runner(engine)
    worker = engine._worker
    assert worker is not None
    reference = signature(solo(engine, 7, ["Hello there."]))
    assert engine.wait_idle(60) and not engine.warming
    live_seen: list[int] = []  # requests the scheduler held when each piece ran

    def work() -> Iterator[None]:
        for _ in range(40):
            live_seen.append(len(worker.scheduler.requests))
            time.sleep(0.01)
            yield

    runner.defer(work())  # the worker is idle, blocked on its inbox: a message wakes it
    assert engine.wait_idle(60)
    assert engine.warming  # published before the first piece, which the barrier does not wait for
    assert signature(solo(engine, 7, ["Hello there."])) == reference
    wait_not_warming(engine)
    assert len(live_seen) == 40 and set(live_seen) == {0}

    def failing() -> Iterator[None]:
        yield
        raise RuntimeError("injected")

    runner.defer(failing())
    assert engine.wait_idle(60)
    wait_not_warming(engine)
    assert "start-up work after ready failed" in caplog.text
    assert signature(solo(engine, 7, ["Hello there."])) == reference
    assert_clean(engine)


class BatchSpy:
    """Wraps a flow's ``inference_batch`` (restored by ``monkeypatch``): rows per call, and an
    optional failure injected at call ``fail_at`` (1-based)."""

    def __init__(self, flow: object, monkeypatch: pytest.MonkeyPatch, fail_at: int = 0) -> None:
        self.sizes: list[int] = []
        real = flow.inference_batch  # type: ignore[attr-defined]

        def spy(items: list[object]) -> object:
            self.sizes.append(len(items))
            if len(self.sizes) == fail_at:
                raise RuntimeError("CUDA out of memory (injected)")
            return real(items)

        monkeypatch.setattr(flow, "inference_batch", spy)


def test_fast_first_is_a_per_stream_option(engine: Engine) -> None:
    text = "hi there, bob"  # 39 speech tokens; noise voice with P = 0 (no pad)
    fast = engine.open_stream(seed=5, fast_first=8)
    plain = engine.open_stream(seed=5)
    for s in (fast, plain):
        s.push_text(text)
        s.end_text()
    fast_chunks, plain_chunks = list(fast), list(plain)
    assert len(fast_chunks[0].pcm) == 8 * SAMPLES_PER_TOKEN - 3840  # 8 tokens, 160 ms held back
    assert len(plain_chunks[0].pcm) == 25 * SAMPLES_PER_TOKEN - 3840
    for chunks in (fast_chunks, plain_chunks):
        assert sum(len(c.pcm) for c in chunks) == 39 * SAMPLES_PER_TOKEN
    with pytest.raises(ValueError, match="fast_first"):
        engine.open_stream(fast_first=25)
    assert_clean(engine)


@pytest.mark.parametrize("batched", [False, True], ids=["one_by_one", "batched_chunks"])
def test_sixteen_concurrent_streams_produce_exactly_what_they_produce_alone(
    engine: Engine, batched: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One chunk per run_chunk: bit for bit. Batched token2wav (the default): the flow of a
    step's chunks runs as one padded batch, which differs from a batch of one only by float
    rounding (matmul blocking), so the audio agrees within 1e-5 (observed ~1e-6)."""
    runner = engine_runner(engine)
    monkeypatch.setattr(runner, "batch_chunks", batched)
    spy = BatchSpy(runner.t2w.flow, monkeypatch)
    rng = random.Random(7)
    words = ["ok", "yes", "no way", "hello", "a b", "right then", "sure", "fine, go"]
    texts = [" ".join(rng.sample(words, k=rng.randint(1, 3))) for _ in range(16)]
    plans = [split(t, rng) if len(t) > 1 else [t] for t in texts]
    alone = [solo(engine, 100 + i, plans[i]) for i in range(16)]
    assert_clean(engine)
    threads_before = threading.active_count()

    async def together() -> list[list[PcmChunk]]:
        streams = [engine.open_stream(seed=100 + i) for i in range(16)]

        async def consume(s: EngineStream) -> list[PcmChunk]:
            return [c async for c in s]

        tasks = [asyncio.create_task(consume(s)) for s in streams]
        # staggered: each round gives some streams their next delta, then lets the worker run
        pending = [list(p) for p in plans]
        order = list(range(16))
        while any(pending):
            rng.shuffle(order)
            for i in order[: rng.randint(1, 16)]:
                if pending[i]:
                    streams[i].push_text(pending[i].pop(0))
                    if not pending[i]:
                        streams[i].end_text()
            if rng.random() < 0.5:
                await engine.await_idle()
            else:
                await asyncio.sleep(0)
        out = await asyncio.gather(*tasks)
        assert len(asyncio.all_tasks()) == 1  # only this coroutine's own task is left
        return list(out)

    spy.sizes.clear()  # "alone" streams never batch; count the concurrent run only
    concurrent = asyncio.run(together())
    err = 0.0
    for i in range(16):
        assert signature(concurrent[i]) == signature(alone[i]), texts[i]
        got, want = np.concatenate([c.pcm for c in concurrent[i]]), np.concatenate([c.pcm for c in alone[i]])
        if batched:
            err = max(err, float(np.abs(got - want).max()))
        else:
            np.testing.assert_array_equal(got, want)
    if batched:
        print(f"batched token2wav: {len(spy.sizes)} batched flow calls of {spy.sizes}; max abs pcm {err:.2g}")
        assert err <= 1e-5 and max(spy.sizes) >= 2
    else:
        assert spy.sizes == []
    assert threading.active_count() == threads_before
    assert_clean(engine)


@pytest.mark.parametrize(
    "stage",
    ["before_text", "mid_prefill", "mid_decode", "mid_chunk", "after_first_chunk", "after_end_text", "after_finish"],
)
def test_cancel_at_every_stage_stops_gpu_work_and_frees_everything(engine: Engine, hook: Hook, stage: str) -> None:
    base_threads = threading.active_count()
    text = "one two three four five six"  # 27 ids: 81 tokens, several chunks
    stream = engine.open_stream(seed=1)
    rid = stream.id
    cancelled_at: list[int] = []

    def cancel_now() -> None:  # called from the worker thread, inside the step: the worst case
        cancelled_at.append(len(hook.calls_for(rid)))
        stream.cancel()

    if stage == "mid_prefill":
        hook.action[(rid, "llm", 1)] = cancel_now
    elif stage == "mid_decode":
        hook.action[(rid, "llm", 20)] = cancel_now
    elif stage == "mid_chunk":
        hook.action[(rid, "vocode", 1)] = cancel_now

    got: list[PcmChunk] = []
    if stage == "before_text":
        cancelled_at.append(0)
        stream.cancel()
        with pytest.raises(StreamClosedError):
            stream.push_text("late")
    else:
        stream.push_text(text)
        if stage != "after_first_chunk":
            stream.end_text()
        for chunk in stream:
            got.append(chunk)
            if stage in ("after_first_chunk", "after_end_text"):
                cancelled_at.append(len(hook.calls_for(rid)))
                stream.cancel()
        if stage == "after_finish":
            cancelled_at.append(len(hook.calls_for(rid)))
            stream.cancel()
    stream.cancel()  # idempotent
    assert_clean(engine)
    if stage == "after_finish":
        assert stream.state is StreamState.FINISHED
        assert sum(len(c.pcm) for c in got) == 81 * SAMPLES_PER_TOKEN
    else:
        assert stream.state is StreamState.ABORTED
        assert len(got) <= 1
        # GPU work ends with the step in flight: nothing of an earlier-or-same phase comes after
        later = hook.calls_for(rid)[cancelled_at[0] :]
        assert len(later) <= 1 and all(PHASES.index(p) > PHASES.index("llm") for p in later), later
    if stage == "before_text":
        assert list(stream) == []
    assert threading.active_count() == base_threads


def test_async_cancel_from_the_consumer_ends_the_iteration(engine: Engine) -> None:
    async def main() -> tuple[list[PcmChunk], StreamState]:
        stream = engine.open_stream(seed=3)
        stream.push_text("a long enough text to make several chunks")
        stream.end_text()
        got = []
        async for chunk in stream:
            got.append(chunk)
            stream.cancel()
        return got, stream.state

    got, state = asyncio.run(main())
    assert len(got) == 1 and state is StreamState.ABORTED
    assert_clean(engine)


def test_a_failure_in_one_stream_leaves_the_others_intact(engine: Engine, hook: Hook) -> None:
    texts = ["alpha beta gamma", "delta", "epsilon zeta", "eta theta iota"]
    alone = [solo(engine, 50 + i, [t]) for i, t in enumerate(texts)]
    streams = [engine.open_stream(seed=50 + i) for i in range(4)]
    hook.action[(streams[2].id, "vocode", 1)] = RuntimeError("injected token2wav failure")
    for s, t in zip(streams, texts, strict=True):
        s.push_text(t)
        s.end_text()
    results: list[list[PcmChunk]] = []
    for i, s in enumerate(streams):
        if i == 2:
            with pytest.raises(StreamFailedError, match="injected"):
                list(s)
            assert s.state is StreamState.FAILED
            results.append([])
        else:
            results.append(list(s))
    for i in (0, 1, 3):
        assert signature(results[i]) == signature(alone[i])
    assert_clean(engine)


def test_a_failing_step_fails_its_streams_and_the_worker_goes_on(engine: Engine) -> None:
    worker = engine._worker
    assert worker is not None and worker.runner is not None
    runner = worker.runner
    original = runner.execute
    calls = {"n": 0}

    def flaky(plan):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost (injected)")
        return original(plan)

    runner.execute = flaky  # type: ignore[method-assign]
    try:
        victim = engine.open_stream(seed=9)
        victim.push_text("doomed words here")
        victim.end_text()
        with pytest.raises(StreamFailedError, match="device lost"):
            list(victim)
    finally:
        runner.execute = original  # type: ignore[method-assign]
    assert engine.stats().failed_steps >= 1
    assert sum(len(c.pcm) for c in solo(engine, 10, ["still alive"])) == 33 * SAMPLES_PER_TOKEN
    assert_clean(engine)


def test_back_pressure_bounds_audio_ahead_of_a_slow_consumer(engine: Engine) -> None:
    limit = int(engine.config.engine.max_ahead_s * SAMPLE_RATE)
    stream = engine.open_stream(seed=4, auto_ack=False)
    stream.push_text("x" * 60)  # 180 tokens = 7.2 s of audio
    stream.end_text()
    it = iter(stream)
    received = acked = rounds = 0
    while True:
        assert engine.wait_idle(60)  # the engine stops on its own: nobody acknowledged the audio
        got = [c for _ in range(len(stream.outbox)) if (c := next(it, None)) is not None]
        received += sum(len(c.pcm) for c in got)
        if got and got[-1].final:
            break
        # held back: past the limit, but by at most one chunk (<= 100 tokens)
        assert limit < received - acked <= limit + 100 * SAMPLES_PER_TOKEN
        assert stream.state is StreamState.RUNNING
        rounds += 1
        stream.ack(received)  # the listener caught up
        acked = received
    assert rounds >= 2
    assert received == 180 * SAMPLES_PER_TOKEN
    assert_clean(engine)


def test_text_errors(engine: Engine) -> None:
    stream = engine.open_stream(seed=1)
    with pytest.raises(TextTooLongError):
        stream.push_text("y" * 201)
    stream.push_text("fine")
    stream.end_text()
    stream.end_text()  # idempotent
    with pytest.raises(StreamClosedError):
        stream.push_text("more")
    assert stream.text == "fine"
    assert len(list(stream)) == 1
    empty = engine.open_stream()
    empty.end_text()
    assert list(empty) == [] and empty.state is StreamState.FINISHED
    assert_clean(engine)


def test_too_many_open_streams_is_overload(engine: Engine) -> None:
    streams = [engine.open_stream() for _ in range(engine.max_open_streams)]
    with pytest.raises(OverloadedError):
        engine.open_stream()
    for s in streams:
        s.cancel()
    engine.open_stream().cancel()
    assert_clean(engine)


def test_a_hundred_short_streams_with_random_cancels_leak_nothing(engine: Engine) -> None:
    leak_round(engine, 100, seed=0)


@pytest.mark.slow
def test_a_thousand_short_streams_with_random_cancels_leak_nothing(engine: Engine) -> None:
    # about 100 s on 2 busy cores: only when slow tests are asked for (tests/conftest.py)
    leak_round(engine, 1000, seed=1)


def leak_round(engine: Engine, n: int, seed: int) -> None:
    rng = random.Random(seed)
    threads = threading.active_count()

    async def main() -> dict[str, int]:
        counts = {"finished": 0, "aborted": 0}

        gate = asyncio.Semaphore(engine.max_open_streams - 4)

        async def one(i: int) -> None:
            async with gate:
                s = engine.open_stream(seed=i)
                s.push_text(rng.choice(["a", "b.", "cd"]))
                roll = rng.random()
                if roll < 0.25:
                    s.cancel()
                else:
                    s.end_text()
                    async for _ in s:
                        if roll < 0.5:
                            s.cancel()
                counts[s.state.value] = counts.get(s.state.value, 0) + 1

        tasks = []
        for i in range(n):
            tasks.append(asyncio.create_task(one(i)))
            if rng.random() < 0.3:
                await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        await engine.await_idle()
        assert len(asyncio.all_tasks()) == 1
        return counts

    counts = asyncio.run(main())
    assert counts["finished"] + counts["aborted"] == n and counts["aborted"] > n // 5
    assert threading.active_count() == threads
    assert_clean(engine)


def test_engine_lifecycle_async_and_close_aborts_open_streams(tmp_path: Path) -> None:
    eng = make_engine(tmp_path)
    base = threading.active_count()

    async def main() -> EngineStream:
        async with eng:
            assert eng.ready and threading.active_count() == base + 1
            s = eng.open_stream()
            s.push_text("never ended")
            await eng.await_idle()
            return s

    s = asyncio.run(main())
    assert not eng.ready and s.state is StreamState.ABORTED
    assert threading.active_count() == base
    assert eng.stats().worker_threads == 0


def test_say_writes_a_24khz_wav(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import wave

    from voice_out.cli import main

    out = tmp_path / "hi.wav"
    common = ["--model", "random:tiny", "--device", "cpu", "--voices-dir", str(tmp_path / "v")]
    common += ["--set", "engine.max_streams=2"]
    assert main(["say", "Hi you.", *common, "-o", str(out)]) == 0
    with wave.open(str(out), "rb") as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, SAMPLE_RATE)
        assert w.getnframes() == 3 * len("Hi you.") * SAMPLES_PER_TOKEN  # forced: 3 tokens per byte id
    assert "wrote" in capsys.readouterr().err
    assert main(["say", "x", *common, "--voice", "bob", "-o", str(tmp_path / "no.wav")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("voice-out: error: unknown voice 'bob'") and "voice-out voices add" in err
    assert not (tmp_path / "no.wav").exists()


def test_an_abandoned_stream_is_cancelled_when_collected(engine: Engine) -> None:
    stream = engine.open_stream(seed=2)
    stream.push_text("nobody will ever listen to this one")
    stream.end_text()
    assert engine.wait_idle(60)  # back-pressure holds it: nobody consumes its audio
    assert engine.stats().live_requests == 1
    del stream
    gc.collect()
    assert_clean(engine)


def test_a_real_model_directory_speaks_in_a_registered_voice(parity_dir: Path, tmp_path: Path) -> None:
    """The loading path of real checkpoints: llm.pt/flow.pt/hift.pt, the BPE tokenizer, the
    streaming normalizer and a voice added to the store from audio (the parity model dir)."""
    from voice_out.voices.store import VoiceStore

    store = VoiceStore(tmp_path / "voices", parity_dir)
    voice = store.add("ann", parity_dir / "cases" / "zero_shot_prompt.wav", "Hope you can do better than me.")
    cfg = Config(server=ServerConfig(voices_dir=str(tmp_path / "voices")), engine=EngineConfig(max_streams=2))
    eng = Engine.load(
        cfg, model=str(parity_dir), device="cpu", voices=store, options=BuildOptions(forced=ForcedTokens(3), kv_len=512)
    )
    assert eng.voice_names() == ["ann"]
    eng.start(timeout=120)
    try:
        with pytest.raises(NoVoiceError, match="voice-out voices add"):
            eng.open_stream()  # no default voice configured
        stream = eng.open_stream("ann", seed=3)
        text = "Hello there, 2 friends!"
        for part in (text[:7], text[7:15], text[15:]):
            stream.push_text(part)
        stream.end_text()
        chunks = list(stream)
    finally:
        eng.close()
    assert chunks and chunks[-1].final and chunks[-1].text_end == len(text)
    assert all(np.isfinite(c.pcm).all() for c in chunks)
    n_tokens = sum(len(c.pcm) for c in chunks) // SAMPLES_PER_TOKEN
    assert n_tokens >= 3 * 5  # "two friends" is read out: several BPE tokens, 3 speech tokens each
    assert voice.flow_prompt_tokens.shape[0] % 25 == 0


def test_the_graphed_llm_path_speaks_like_the_eager_one(engine: Engine) -> None:
    """``voice_out.fast.llm_step`` (its eager code on the CPU): same audio as the plain path,
    and real sampling (no forced tokens) runs through its decode+sample step."""
    texts = [["graphs ", "or not"], ["x"]]
    eager = [solo(engine, 60 + i, t) for i, t in enumerate(texts)]
    kw = BuildOptions(warmup=True, text_normalizer="none", noise_prompt_tokens=0, kv_len=512)
    graphs = {"cuda_graphs": True}
    eng = Engine.load(engine.config, options=dataclasses.replace(kw, forced=ForcedTokens(3), pins=graphs))
    eng.start(timeout=120)
    try:
        graphed = [solo(eng, 60 + i, t) for i, t in enumerate(texts)]
    finally:
        eng.close()
    for a, b in zip(graphed, eager, strict=True):
        assert signature(a) == signature(b)
        np.testing.assert_array_equal(np.concatenate([c.pcm for c in a]), np.concatenate([c.pcm for c in b]))
    sampled = Engine.load(engine.config, options=dataclasses.replace(kw, forced=None, pins=graphs))
    sampled.start(timeout=120)
    try:
        chunks = solo(sampled, 1, ["ab"])
    finally:
        sampled.close()
    assert chunks and chunks[-1].final  # stopped by EOS or by the length guard (<= 20 per text id)
    assert sum(len(c.pcm) for c in chunks) <= 20 * 2 * SAMPLES_PER_TOKEN


def test_sampled_streams_are_isolated_in_the_batched_llm(engine: Engine) -> None:
    """Without forced tokens every token comes from the LLM's own logits and the stream's own
    generator, so cross-talk between KV slots or generators would change the audio."""
    kw = BuildOptions(forced=None, warmup=False, text_normalizer="none", noise_prompt_tokens=0, kv_len=512)
    eng = Engine.load(engine.config, options=kw)
    eng.start(timeout=120)
    texts = ["ab", "c d", "ef", "g", "hij", "kl"]
    try:
        alone = [solo(eng, 200 + i, [t]) for i, t in enumerate(texts)]

        async def together() -> list[list[PcmChunk]]:
            streams = [eng.open_stream(seed=200 + i) for i in range(len(texts))]
            for s, t in zip(streams, texts, strict=True):
                s.push_text(t)
                s.end_text()

            async def consume(s: EngineStream) -> list[PcmChunk]:
                return [c async for c in s]

            return list(await asyncio.gather(*(consume(s) for s in streams)))

        concurrent = asyncio.run(together())
        assert_clean(eng)
    finally:
        eng.close()
    lengths = {sum(len(c.pcm) for c in a) for a in alone}
    assert len(lengths) > 1  # the sampled streams really differ
    for a, b in zip(concurrent, alone, strict=True):
        assert signature(a) == signature(b)
        # the same tokens: batched token2wav moves the audio by float rounding only (a single
        # different token would move it by orders of magnitude more)
        np.testing.assert_allclose(
            np.concatenate([c.pcm for c in a]), np.concatenate([c.pcm for c in b]), atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("forced", [True, False], ids=["forced_tokens", "sampled"])
def test_planning_ahead_speaks_exactly_as_without(tmp_path: Path, forced: bool) -> None:
    """The plan's ``step_ahead_rows``: three streams with text arriving in pieces, their tokens forced
    (text groups after forced FILLs) or sampled (EOS included): the same audio, bit for bit,
    with the next steps launched ahead as without, and most of those guesses confirmed."""
    texts = ["hello there", "a b c", "quick fox"]
    audio: dict[bool, list[np.ndarray]] = {}
    for ahead in (False, True):
        eng = make_engine(tmp_path / str(ahead), forced=FORCED_3 if forced else None, step_ahead_rows=4 if ahead else 0)
        eng.start(timeout=120)
        try:

            async def together(eng: Engine = eng) -> list[list[PcmChunk]]:
                streams = [eng.open_stream(seed=300 + i) for i in range(len(texts))]
                for s, t in zip(streams, texts, strict=True):
                    for j in range(0, len(t), 4):
                        s.push_text(t[j : j + 4])
                    s.end_text()

                async def consume(s: EngineStream) -> list[PcmChunk]:
                    return [c async for c in s]

                return list(await asyncio.gather(*(consume(s) for s in streams)))

            audio[ahead] = [np.concatenate([c.pcm for c in chunks]) for chunks in asyncio.run(together())]
            runner = engine_runner(eng)
            assert_clean(eng)
        finally:
            eng.close()
        if ahead:
            print(f"step ahead: {runner.ahead_confirmed} guesses confirmed, {runner.ahead_dropped} dropped")
            assert runner.ahead_confirmed > 50 and runner.ahead_confirmed > 5 * runner.ahead_dropped
        else:
            assert runner.ahead_confirmed == runner.ahead_dropped == 0
    for a, b in zip(audio[True], audio[False], strict=True):
        np.testing.assert_array_equal(a, b)


def test_say_stream_reads_deltas_from_a_pipe_as_they_arrive(engine: Engine) -> None:
    import os

    from voice_out.engine.say import feed_stdin

    r, w = os.pipe()
    stream = engine.open_stream(seed=8)
    errors: list[BaseException] = []
    with os.fdopen(r, "rb") as source:
        reader = threading.Thread(target=feed_stdin, args=(stream, source, errors))
        reader.start()
        os.write(w, "Héllo ".encode()[:2])  # a UTF-8 character split across two reads
        assert engine.wait_idle(60)
        os.write(w, "Héllo ".encode()[2:] + b"world")
        os.close(w)
        chunks = list(stream)
        reader.join(10)
    assert not errors and stream.text == "Héllo world"
    assert chunks[-1].final and chunks[-1].text_end == len("Héllo world")
    assert_clean(engine)


def test_hops_that_are_not_whole_flow_chunks_fail_at_load(tmp_path: Path) -> None:
    from voice_out.config import ConfigError

    with pytest.raises(ConfigError, match="multiple of the flow chunk"):
        make_engine(tmp_path, first_hop_tokens=30, max_hop_tokens=90)


def test_fast_first_chunk_end_to_end(engine: Engine) -> None:
    cfg = dataclasses.replace(engine.config, engine=dataclasses.replace(engine.config.engine, fast_first_tokens=8))
    kw = BuildOptions(forced=ForcedTokens(3), warmup=False, text_normalizer="none", noise_prompt_tokens=0, kv_len=512)
    eng = Engine.load(cfg, options=kw)
    eng.start(timeout=120)
    try:
        chunks = solo(eng, 5, ["hi there, bob"])  # 39 tokens
    finally:
        eng.close()
    assert len(chunks[0].pcm) == 8 * SAMPLES_PER_TOKEN - 3840  # 8 tokens, minus the held-back crossfade
    assert sum(len(c.pcm) for c in chunks) == 39 * SAMPLES_PER_TOKEN
    assert chunks[-1].final and chunks[-1].text_end == len("hi there, bob")


FIRST_UTTERANCES = """
import json, sys
from voice_out.config import Config, ServerConfig
from voice_out.engine.engine import Engine
from voice_out.engine.scheduler import ForcedTokens
from voice_out.engine.build import BuildOptions
cfg = Config(server=ServerConfig(voices_dir=sys.argv[1]))
opts = BuildOptions(forced=ForcedTokens(3), noise_prompt_tokens=60)
eng = Engine.load(cfg, model="random:tiny", device="cpu", options=opts)
eng.start(timeout=120)
before = set(sys.modules)
for text, cancel in (("Hello there, a first request.", False), ("And 2 more at 3:45 pm.", False), ("Stop me.", True)):
    s = eng.open_stream()
    for k in range(0, len(text), 4):
        s.push_text(text[k : k + 4])
    s.end_text()
    for chunk in s:
        if cancel:
            s.cancel()
eng.close()
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def test_a_warm_engine_s_first_utterances_import_nothing(tmp_path: Path) -> None:
    """Whatever a request imports on first use, a fresh server's first listener waits for:
    ``np.unique``'s first call imported numpy.ma inside the first decode step (~40 ms of a
    server's first audio on an H200 machine). A warm engine's first utterances (text in
    deltas, digits and a time for the normaliser, a cancel) import no module. A fresh
    interpreter, since the modules other tests imported would hide one."""
    out = subprocess.run(
        [sys.executable, "-c", FIRST_UTTERANCES, str(tmp_path / "no-voices")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def engine_with_voices(
    tmp: Path,
    ec: EngineConfig,
    device: str,
    default_tokens: int,
    others: Sequence[int],
    pins: Mapping[str, object] | None = None,
) -> Engine:
    """A tiny random engine (not started, warmed up when started) whose default voice is a
    noise voice of ``default_tokens`` flow prompt tokens, with built-in noise voices ``n<P>``
    of each of ``others`` prompt lengths; ``pins``: plan choices set by hand."""
    cfg = Config(server=ServerConfig(voices_dir=str(tmp / "no-voices")), engine=ec)
    eng = Engine.load(
        cfg,
        model="random:tiny",
        device=device,
        options=BuildOptions(pins=pins, forced=FORCED_3, text_normalizer="none", noise_prompt_tokens=default_tokens),
    )
    for p in others:
        ids, fv = noise_voice(p, seed=p)
        eng.voices.builtin[f"n{p}"] = VoicePrompt(f"n{p}", tuple(range(p // 3)), tuple(ids), p, fv)
    return eng


def test_first_chunks_come_from_the_voices_prompt_prefixes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A warmed-up engine keeps the prompt prefixes of its default voice and its other voices
    up to the plan's ``first_chunk_prefix_voices`` (here 2 of 3: the third re-runs its prompt),
    and a first chunk of a voice with one is computed from it: the same audio as an engine
    that keeps none (0), within float rounding."""
    calls: list[int] = []
    real = FastToken2Wav._prefix_chunk

    def spy(self: FastToken2Wav, stream: Token2WavStream, plan: ChunkPlan, token: torch.Tensor) -> torch.Tensor:
        calls.append(int(stream.prompt_token.shape[1]))
        return real(self, stream, plan, token)

    monkeypatch.setattr(FastToken2Wav, "_prefix_chunk", spy)

    def run(n_voices: int) -> tuple[int, list[np.ndarray]]:
        ec = EngineConfig(max_streams=2)
        eng = engine_with_voices(tmp_path, ec, "cpu", 60, (40, 75), {"first_chunk_prefix_voices": n_voices})
        eng.start(timeout=300)
        try:
            kept = len(engine_runner(eng)._first_prefixes)
            audio = []
            for voice in (None, "n40", "n75"):
                stream = eng.open_stream(voice, seed=3)
                stream.push_text("Hello there, and a bit more.")
                stream.end_text()
                audio.append(np.concatenate([c.pcm for c in stream]))
        finally:
            eng.close()
        return kept, audio

    kept, want = run(0)
    assert (kept, calls) == (0, [])
    kept, got = run(2)
    assert kept == 2
    assert calls == [60, 40]  # the default voice and the first other one (names in order)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


def test_later_chunks_extend_a_flow_state_of_the_stream_s_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the plan's ``flow_state_streams`` = 1, one of two concurrent streams holds the engine's
    one flow state and makes its later chunks on it (the other re-runs), and the next request
    takes it again once given back; the audio is that of an engine with none (0), within
    float rounding, over the same chunks (``flow_state_max_hop_tokens`` = 0: the usual hops).
    With its default (200) the stream on the state grows its hop to 200 tokens."""
    used: list[tuple[int, int]] = []  # (round, hop) of each chunk made on the flow state
    current = [0]
    real = FastToken2Wav._state_chunk

    def spy(self: FastToken2Wav, stream: Token2WavStream, plan: ChunkPlan, token: torch.Tensor) -> torch.Tensor | None:
        mel = real(self, stream, plan, token)
        if mel is not None:
            used.append((current[0], plan.hop_tokens))
        return mel

    monkeypatch.setattr(FastToken2Wav, "_state_chunk", spy)
    text = "Hello there, and a bit more. " * 3

    def run(n_states: int, state_hop: int = 0, rounds: int = 2, text: str = text) -> tuple[int, list[np.ndarray]]:
        ec = EngineConfig(max_streams=2)
        pins = {"flow_state_streams": n_states, "flow_state_max_hop_tokens": state_hop}
        eng = engine_with_voices(tmp_path, ec, "cpu", 60, (), pins)
        eng.start(timeout=300)
        try:
            kept = len(engine_runner(eng).t2w._state_slots)
            audio = []
            for current[0] in range(rounds):  # rounds of two streams at once
                streams = [eng.open_stream(None, seed=seed) for seed in (3, 4)]
                for stream in streams:
                    stream.push_text(text)
                    stream.end_text()
                audio += [np.concatenate([c.pcm for c in stream]) for stream in streams]
        finally:
            eng.close()
        return kept, audio

    kept, want = run(0)
    assert (kept, used) == (0, [])
    kept, got = run(1)
    assert kept == 1
    rounds = [r for r, _ in used]
    assert rounds.count(0) >= 2 and rounds.count(1) == rounds.count(0)  # one stream a round held it
    assert max(h for _, h in used) == 100
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
    used.clear()
    _, (first, second) = run(1, 200, rounds=1, text=text * 2)
    assert 200 in {h for _, h in used} and first.shape == second.shape  # the same tokens either way


def record_captures(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The keys of every CUDA graph captured from now on (``GraphedFn._capture``, restored by
    ``monkeypatch``)."""
    from voice_out.fast.graphs import GraphedFn

    captured: list[object] = []
    real = GraphedFn._capture
    monkeypatch.setattr(
        GraphedFn,
        "_capture",
        lambda self, key, *a, **kw: captured.append(key) or real(self, key, *a, **kw),  # type: ignore[func-returns-value]
    )
    return captured


@pytest.mark.requires_cuda
@pytest.mark.parametrize(
    ("voice_tokens", "text"),
    [(0, "Hello there."), (100, "Hello there, and a bit more.")],  # 36 and 84 speech tokens
)
def test_a_start_captures_every_voice_s_prompt_length(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, voice_tokens: int, text: str
) -> None:
    """A voice whose prompt length differs from the default voice's has its token2wav graphs
    captured at start-up (the plan's ``capture_voice_tokens``; its first chunk's before ready
    whatever the setting, the rest after ready), so its first utterance captures none (the
    capture was 0.5 to 0.9 s of that utterance's first audio on an H200)."""

    ec = EngineConfig(max_streams=2)
    pins = {"capture_tokens": 100, "capture_batch_tokens": 60, "capture_voice_tokens": voice_tokens}
    eng = engine_with_voices(tmp_path, ec, "cuda", 50, (25, 75), pins)
    eng.start(timeout=600)
    wait_not_warming(eng, 300)
    try:
        captured = record_captures(monkeypatch)
        eager: list[int] = []  # non-final chunks with no graph (token2wav runs them eagerly)
        real_single = FastToken2Wav._single_graph

        def single(self: FastToken2Wav, stream: Token2WavStream, plan: ChunkPlan, token: torch.Tensor) -> object:
            graph = real_single(self, stream, plan, token)
            if graph is None:
                eager.append(plan.token_len)
            return graph

        monkeypatch.setattr(FastToken2Wav, "_single_graph", single)
        for voice in ("n25", "n75", "n25"):
            stream = eng.open_stream(voice)
            stream.push_text(text)
            stream.end_text()
            assert sum(len(c.pcm) for c in stream) > 0
        assert captured == []
        if voice_tokens:  # the chunks after the first too: graphed
            assert eager == []
    finally:
        eng.close()


@pytest.mark.requires_cuda
def test_the_captures_after_ready_complete_the_planned_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On a GPU, start-up captures the first chunks' token2wav graphs before ready and the rest
    of the plan's range after (``Runner.defer``), while no stream is live: once it is done, a
    start-up capturing the whole range at once would capture nothing more, and a stream speaks
    as one served while it ran (chunks not captured yet run eagerly: the same within bf16
    rounding)."""
    import logging

    caplog.set_level(logging.INFO, logger="voice_out.engine.build")
    ec = EngineConfig(max_streams=4)
    pins = {"capture_tokens": 300, "capture_batch_tokens": 100}
    eng = engine_with_voices(tmp_path, ec, "cuda", 50, (75,), pins)
    eng.start(timeout=600)
    try:
        text = "Hello there, and a bit more to say than that."
        early = np.concatenate([c.pcm for c in solo(eng, 5, [text])])
        wait_not_warming(eng, 300)
        assert "captured for the first 50 speech tokens" in caplog.text
        assert "start-up finished after ready: token2wav graphs of the first 300 speech tokens" in caplog.text
        late = np.concatenate([c.pcm for c in solo(eng, 5, [text])])
        assert early.shape == late.shape
        # bf16; eager or graphed chunks, and the re-run path while the placeholder held the state
        assert float(np.linalg.norm(early - late) / np.linalg.norm(late)) < 0.1
        captured = record_captures(monkeypatch)
        assert eng.wait_idle(60)
        runner = engine_runner(eng)  # the worker is idle: its runner, from this thread
        plan = eng.plan
        default = eng.voices.resolve(None).flow
        other = eng.voices.resolve("n75").flow
        assert default is not None and other is not None
        per_step = plan.max_chunks_per_step
        runner.precapture(default, plan.capture_tokens, max_batch=per_step, batch_tokens=plan.capture_batch_tokens)
        n_voice = max(50, min(plan.capture_voice_tokens, plan.capture_tokens))
        runner.precapture(other, n_voice, max_batch=per_step, batch_tokens=50)
        assert captured == []
    finally:
        eng.close()


# --------------------------------------------------------------------------------------------
# Batched token2wav at the runner: plans built by hand, so which chunks share a step is exact


VOICE_PROMPTS = (0, 10, 37, 25)  # flow prompt tokens: none, a pad of 15, a long one, aligned


def hand_runner(engine: Engine, hook: Hook | None = None) -> Runner:
    """A second runner over the engine's (stateless, shared) models; used from the test thread
    while the engine's worker is idle (its start-up work after ready done too)."""
    assert engine.wait_idle(60)
    wait_not_warming(engine, 300)
    shared = engine_runner(engine)
    return Runner(shared.llm, shared.t2w, n_slots=len(VOICE_PROMPTS), max_len=64, fault_hook=hook)


def test_a_voice_prefix_is_prefilled_once_and_equals_a_whole_prefill(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """First steps that start with the same voice rows: the first request prefills them, later
    ones copy their K/V (and, for a step that is the prefix alone, its last hidden state); the
    rest rides in the batched decode step. The state equals that of one whole prefill."""
    runner, whole = hand_runner(engine), hand_runner(engine)
    whole.min_prefix_rows = 10**9  # never reuses
    whole.batched_input_rows = 0  # every multi-row input prefilled
    _, flow = noise_voice(0, seed=1)
    voice = VoicePrompt("v", flow=flow)
    prefix = (SOS, *((RowKind.TEXT, 100 + i) for i in range(10)))
    prefix += tuple((RowKind.SPEECH, 7 * i) for i in range(20))  # 31 rows
    rest = tuple((RowKind.TEXT, 300 + i) for i in range(5))
    prefilled: list[int] = []
    real = runner._prefill_rows
    monkeypatch.setattr(
        runner,
        "_prefill_rows",
        lambda slot, rows, start: prefilled.append(len(rows)) or real(slot, rows, start),  # type: ignore[func-returns-value]
    )

    def first(r: Runner, rid: str, slot: int, inputs: tuple[Row, ...]) -> int:
        step = LlmStep(inputs, allow_eos=False, voice_prefix=len(prefix))
        result = r.execute(StepPlan(admit=(Admit(rid, slot, 5, voice),), llm=(LlmWork(rid, slot, step, ()),)))
        assert not result.failed
        return result.tokens[rid]

    tokens = [first(runner, "a", 0, prefix + rest), first(runner, "b", 1, prefix + rest)]
    alone = first(runner, "c", 2, prefix)
    want = first(whole, "a", 0, prefix + rest)
    assert prefilled == [len(prefix)]  # the rest was batched; the third step prefilled nothing
    assert tokens == [want, want]  # the same seed, the same state: the same draw
    n = len(prefix) + len(rest)
    assert runner.slot_len[:3] == [n, n, len(prefix)] and runner.cache.lengths[:3].tolist() == [n, n, len(prefix)]
    for cache_k in (runner.cache.k, runner.cache.v):
        torch.testing.assert_close(cache_k[:, 1, :, :n], cache_k[:, 0, :, :n], atol=0, rtol=0)
        torch.testing.assert_close(cache_k[:, 2, :, : len(prefix)], cache_k[:, 0, :, : len(prefix)], atol=0, rtol=0)
    torch.testing.assert_close(runner.cache.k[:, 0, :, :n], whole.cache.k[:, 0, :, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(runner.cache.v[:, 0, :, :n], whole.cache.v[:, 0, :, :n], atol=1e-5, rtol=1e-5)
    assert isinstance(alone, int) and len(runner._prefixes) == 1


SPEECH = RowKind.SPEECH
TEXT = RowKind.TEXT


def group(base: int) -> tuple[Row, ...]:
    return tuple((TEXT, base + i) for i in range(5))


Inputs = tuple[Row, ...]
#: One request's step in a hand-made script: (inputs, force, guess of its next step); None
#: inputs = one speech row of the request's last token.
ScriptStep = tuple[Inputs | None, int | None, NextGuess | None]


def guess_script() -> list[dict[str, ScriptStep]]:
    """15 steps of requests "a" and "b" (a request missing from a step is paused). "a": a text
    group after a forced FILL guessed right (step 5), an unexpected text group (8), a wrongly
    guessed one (12); "b": paused at step 6, a forced speech token at step 10."""
    speech_next = NextGuess(None, False)
    first: ScriptStep = ((SOS, *group(10)), None, speech_next)
    a: list[ScriptStep] = [first] + [(None, None, speech_next)] * 14
    a[4] = (None, 6563, NextGuess(group(20), False))  # forced FILL: guesses the next group
    a[5] = (group(20), None, speech_next)
    a[8] = (group(30), None, speech_next)
    a[11] = (None, 6563, NextGuess(group(50), False))
    a[12] = (group(60), None, speech_next)
    b: list[ScriptStep] = [((SOS, *group(70)), None, speech_next)] + [(None, None, speech_next)] * 14
    b[10] = (None, 123, speech_next)
    return [{"a": a[i], "b": b[i]} if i != 6 else {"a": a[i]} for i in range(15)]


def run_guess_script(runner: Runner, guesses: bool) -> list[dict[str, int]]:
    """:func:`guess_script` through ``runner`` (with its guesses, or none); the tokens per step."""
    _, flow = noise_voice(0, seed=3)
    voice = VoicePrompt("v", flow=flow)
    history: dict[str, list[int]] = {"a": [], "b": []}
    slots = {"a": 0, "b": 1}
    out = []
    for i, step in enumerate(guess_script()):
        work = []
        for rid, (inputs, force, guess) in step.items():
            rows = inputs if inputs is not None else ((SPEECH, history[rid][-1]),)
            llm_step = LlmStep(rows, allow_eos=False, force=force)
            work.append(LlmWork(rid, slots[rid], llm_step, tuple(history[rid][-10:]), guess if guesses else None))
        admit = tuple(Admit(rid, slots[rid], 40 + slots[rid], voice) for rid in slots) if i == 0 else ()
        result = runner.execute(StepPlan(admit=admit, llm=tuple(work)))
        assert not result.failed and set(result.tokens) == set(step)
        for rid, token in result.tokens.items():
            history[rid].append(token)
        out.append(dict(result.tokens))
    return out


def test_steps_launched_ahead_change_nothing_and_roll_back_what_the_plan_drops(engine: Engine) -> None:
    """``LlmWork.guess`` (the plan's step_ahead_rows): a guessed next step launched before the host has
    the token is used when the next plan confirms it and dropped (its slot's length rolled back
    on the device) when not; the sampled tokens and the KV cache are those of a runner that
    never guesses."""
    plain, ahead = hand_runner(engine), hand_runner(engine)
    want = run_guess_script(plain, guesses=False)
    got = run_guess_script(ahead, guesses=True)
    assert got == want
    assert len({t for step in want for t in step.values()}) > 10  # really sampled
    assert (plain.ahead_confirmed, plain.ahead_dropped) == (0, 0)
    # a: every step after the first but the unexpected group (8) and the wrong guess (12);
    # b: every step after the first but its pause (6) and its step after the pause (7)
    assert (ahead.ahead_confirmed, ahead.ahead_dropped) == (24, 3)
    lengths = ahead.cache.lengths[:2].tolist()
    assert ahead.slot_len[:2] == plain.slot_len[:2]
    assert lengths == [n + 1 for n in ahead.slot_len[:2]]  # the next guesses are in flight
    ahead.execute(StepPlan())  # a step without them: dropped, rolled back
    assert ahead.cache.lengths[:2].tolist() == ahead.slot_len[:2] and ahead.ahead_dropped == 5
    for slot, n in enumerate(plain.slot_len[:2]):
        for a, b in ((ahead.cache.k, plain.cache.k), (ahead.cache.v, plain.cache.v)):
            torch.testing.assert_close(a[:, slot, :, :n], b[:, slot, :, :n], atol=1e-5, rtol=1e-5)


def admit_all(runner: Runner, tag: str) -> list[tuple[str, VoicePrompt, list[int]]]:
    """One request per voice of ``VOICE_PROMPTS``, each with its own speech tokens."""
    reqs = []
    admits = []
    for k, p in enumerate(VOICE_PROMPTS):
        _, flow = noise_voice(p, seed=k + 1)
        voice = VoicePrompt(f"v{k}", flow_prompt_tokens=p, flow=flow)
        rid = f"{tag}{k}"
        tokens = torch.randint(0, 6561, (150 + 20 * k,), generator=torch.Generator().manual_seed(k)).tolist()
        reqs.append((rid, voice, tokens))
        admits.append(Admit(rid, k, k, voice))
    assert not runner.execute(StepPlan(admit=tuple(admits))).failed
    return reqs


def drive(runner: Runner, tag: str, starts: Sequence[int | None]) -> tuple[dict[str, list[np.ndarray]], dict[str, str]]:
    """Every request's whole schedule; request k joins at step ``starts[k]`` (None: never), and
    each step vocodes every chunk that is ready. Returns the audio and the failures by request
    (a failed request gets no more chunks)."""
    reqs = admit_all(runner, tag)
    scheds = [ChunkSchedule(prompt_tokens=v.flow_prompt_tokens) for _, v, _ in reqs]
    audio: dict[str, list[np.ndarray]] = {rid: [] for rid, _, _ in reqs}
    failed: dict[str, str] = {}
    for step in range(100):
        work: list[tuple[int, VocodeWork]] = []
        for k, (rid, _, tokens) in enumerate(reqs):
            start = starts[k]
            if start is None or step < start or rid in failed:
                continue
            plan = scheds[k].ready(len(tokens), True)
            if plan is not None:
                work.append((k, VocodeWork(rid, plan, tokens)))
        if not work and step > max(s for s in starts if s is not None):
            break
        result = runner.execute(StepPlan(vocode=tuple(w for _, w in work)))
        assert not result.tokens and set(result.audio) | set(result.failed) == {w.request_id for _, w in work}
        failed.update(result.failed)
        for k, w in work:
            if w.request_id in result.audio:
                audio[w.request_id].append(result.audio[w.request_id])
                scheds[k].commit(w.chunk)
    runner.release_all()
    return audio, failed


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max(float(np.abs(x - y).max(initial=0.0)) for x, y in zip(a, b, strict=True))


def run_alone(runner: Runner) -> dict[int, list[np.ndarray]]:
    """Each request on its own (no other chunk in its steps): audio by request index."""
    out = {}
    for k in range(len(VOICE_PROMPTS)):
        audio, failed = drive(runner, "alone", [0 if j == k else None for j in range(len(VOICE_PROMPTS))])
        assert not failed
        out[k] = audio[f"alone{k}"]
    return out


def test_batched_chunks_of_streams_at_different_points_equal_each_alone(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = hand_runner(engine)
    alone = run_alone(runner)
    spy = BatchSpy(runner.t2w.flow, monkeypatch)
    together, failed = drive(runner, "r", starts=[0, 0, 1, 2])
    assert not failed
    errs = [max_diff(together[f"r{k}"], alone[k]) for k in alone]
    print(f"runner, batched vs alone: flow batches {spy.sizes}; max abs pcm per request", errs)
    assert max(errs) <= 1e-5
    assert len(spy.sizes) >= 3 and max(spy.sizes) >= 3  # really batched, several times
    for k in alone:  # every sample of every request
        assert sum(len(c) for c in together[f"r{k}"]) == SAMPLES_PER_TOKEN * (150 + 20 * k)


def test_a_failure_in_a_batched_step_fails_only_its_request(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    hook = Hook()
    runner = hand_runner(engine, hook)
    alone = run_alone(runner)

    def check_others(audio: dict[str, list[np.ndarray]], tag: str, failed: set[int]) -> None:
        for k in alone:
            if k not in failed:
                assert max_diff(audio[f"{tag}{k}"], alone[k]) <= 1e-5, (tag, k)

    # 1. the fault hook fails one request before its chunk: the others are batched without it
    hook.action[("h2", "vocode", 2)] = RuntimeError("injected token2wav failure")
    spy = BatchSpy(runner.t2w.flow, monkeypatch)
    audio, failed = drive(runner, "h", starts=[0, 0, 0, 0])
    assert list(failed) == ["h2"] and "injected" in failed["h2"] and len(audio["h2"]) == 1
    assert hook.calls_for("h2") == ["admit", "vocode", "vocode"]  # its hook ran, its chunk did not
    assert spy.sizes[0] == 4 and spy.sizes[1] == 3
    check_others(audio, "h", {2})

    # 2. the batched flow pass itself fails (before any chunk is made): every chunk of that
    #    step runs again alone, and nobody fails
    monkeypatch.undo()
    spy = BatchSpy(runner.t2w.flow, monkeypatch, fail_at=1)
    audio, failed = drive(runner, "o", starts=[0, 0, 0, 0])
    assert not failed and spy.sizes[0] == 4 and len(spy.sizes) >= 2
    check_others(audio, "o", set())
    for k in alone:  # the failed step's chunks ran one by one: bit for bit what they make alone
        np.testing.assert_array_equal(audio[f"o{k}"][0], alone[k][0])

    # 3. one chunk fails after the batched flow pass (its vocoder): it alone fails
    monkeypatch.undo()
    spy = BatchSpy(runner.t2w.flow, monkeypatch)
    finish = runner.t2w._finish_chunk

    def flaky(stream: Token2WavStream, plan: ChunkPlan, mel: torch.Tensor) -> torch.Tensor:
        live = runner.live.get("v1")
        if live is not None and stream is live.t2w and plan.index == 1:
            raise RuntimeError("vocoder failure (injected)")
        return finish(stream, plan, mel)

    monkeypatch.setattr(runner.t2w, "_finish_chunk", flaky)
    audio, failed = drive(runner, "v", starts=[0, 0, 0, 0])
    assert list(failed) == ["v1"] and "vocoder failure" in failed["v1"] and len(audio["v1"]) == 1
    assert spy.sizes[:2] == [4, 4]  # v1's second chunk was in a batched pass, then failed alone
    check_others(audio, "v", {1})


@pytest.mark.requires_cuda
def test_cuda_engine_overlapping_token2wav_with_the_llm_changes_nothing(tmp_path: Path) -> None:
    """Pipelined (the default: first chunks in a lane of their own, beside the later chunks in
    flight), overlapped within a step, and serial token2wav: same audio. Half the streams start
    once the first has audio, so first chunks meet later chunks in flight."""
    cfg = Config(
        server=ServerConfig(voices_dir=str(tmp_path / "no-voices")),
        engine=EngineConfig(max_streams=8, max_ahead_s=30.0, max_text_chars=200),
    )
    eng = Engine.load(
        cfg,
        model="random:tiny",
        device="cuda",
        options=BuildOptions(forced=ForcedTokens(3), text_normalizer="none", kv_len=512),
    )
    eng.start(timeout=300)
    try:
        runner = engine_runner(eng)
        texts = [f"stream {i} says hello there" for i in range(4)]

        def run_all() -> list[np.ndarray]:
            streams = [eng.open_stream(seed=i) for i in range(len(texts))]
            for s, t in zip(streams[:2], texts[:2], strict=True):
                s.push_text(t)
                s.end_text()
            chunks = iter(streams[0])
            first = next(chunks)  # stream 0 has audio: the other two start now
            for s, t in zip(streams[2:], texts[2:], strict=True):
                s.push_text(t)
                s.end_text()
            pcm = [np.concatenate([first.pcm, *(c.pcm for c in chunks)])]
            return pcm + [np.concatenate([c.pcm for c in s]) for s in streams[1:]]

        assert runner._side_stream is not None and runner.pipeline_vocode and runner.t2w.has_first_lane
        assert eng._worker is not None and eng._worker.launch.first_chunk_lane
        worker = eng._worker
        worker.launch = dataclasses.replace(worker.launch, first_chunk_wait_rows=0)  # no first chunk waited for either
        pipelined = run_all()  # chunks come back in later steps while LLM steps go on
        assert not runner._inflight and runner._first_stream is not None  # the first-chunk lane ran
        runner.pipeline_vocode = False
        overlapped = run_all()  # each step waits for its own chunks
        runner._side_stream = None  # one stream: LLM step, then token2wav
        serial = run_all()
        for a, b, c in zip(pipelined, overlapped, serial, strict=True):
            assert a.shape == b.shape == c.shape
            np.testing.assert_allclose(a, c, atol=1e-4)
            np.testing.assert_allclose(b, c, atol=1e-4)
    finally:
        eng.close()


@pytest.mark.requires_cuda
def test_cuda_steps_wait_only_for_the_launches_they_need(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Launches in flight hold up no step that does not need them.

    * A new request takes a pooled token2wav stream and rewrites it on the runner's stream. A
      finished request's stream: nothing of it is in flight, so the new request's LLM step runs
      while other chunks are in flight (it used to wait for all of them: steps of ~120 ms at 16
      streams). A cancelled request's stream whose chunk is still in flight: the step waits for
      that launch before the rewrite.
    * A step that waits for its first chunk (``wait_vocode``) waits for that lane alone, not for
      the later chunks in flight on the other.

    A launch is held in flight by a GPU sleep queued before it. The scenario runs twice: the
    first pass makes every first use (kernels, graphs) that could outlast a sleep."""
    cfg = Config(server=ServerConfig(voices_dir=str(tmp_path / "no-voices")), engine=EngineConfig(max_streams=4))
    eng = Engine.load(
        cfg,
        model="random:tiny",
        device="cuda",
        options=BuildOptions(forced=ForcedTokens(3), text_normalizer="none", kv_len=512),
    )
    eng.start(timeout=300)
    try:
        runner = hand_runner(eng)
        assert runner._side_stream is not None and runner.pipeline_vocode and runner._first_stream is not None
        stalls: list[int] = []
        launch = runner._vocode_step

        def stalled(*args: object, **kw: object) -> object:
            if stalls:
                torch.cuda._sleep(stalls.pop())  # on the launch's stream, before its chunks
            return launch(*args, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(runner, "_vocode_step", stalled)

        def scenario(tag: str) -> dict[str, bool]:
            reqs = admit_all(runner, tag)
            scheds = [ChunkSchedule(prompt_tokens=v.flow_prompt_tokens) for _, v, _ in reqs]

            def chunk(k: int, *, wait: bool = False, stall: bool = False) -> StepResult:
                rid, _, tokens = reqs[k]
                plan = scheds[k].ready(len(tokens), False)
                assert plan is not None
                scheds[k].commit(plan)  # the next call plans the next chunk
                stalls.extend([int(2e9)] if stall else [])  # ~1 s of GPU clock cycles
                return runner.execute(StepPlan(vocode=(VocodeWork(rid, plan, tokens),), wait_vocode=wait))

            def admit_and_step(rid: str, slot: int) -> StepResult:
                step = LlmStep((SOS, *((TEXT, 100 + i) for i in range(6))), allow_eos=False)
                work = LlmWork(rid, slot, step, ())
                result = runner.execute(StepPlan(admit=(Admit(rid, slot, 7, reqs[slot][1]),), llm=(work,)))
                assert not result.failed and rid in result.tokens  # the host has read this step's token
                return result

            seen = {"first chunk back": f"{tag}0" in chunk(0, wait=True).audio}
            runner.execute(StepPlan(release=(Release(f"{tag}0", 0, drop=True),)))  # finished: pooled
            seen["stalled"] = f"{tag}1" in chunk(1, stall=True).inflight
            # the stream of request 0, with nothing in flight: no wait for request 1's chunk
            seen["no wait"] = f"{tag}1" in admit_and_step(f"{tag}n0", 0).inflight
            # request 1 cancelled with its chunk in flight; a new request takes its stream
            runner.execute(StepPlan(release=(Release(f"{tag}1", 1, drop=True),)))
            stream, last = runner._t2w_pool[-1]
            seen["pooled in flight"] = last is not None and not last.query()
            admit_and_step(f"{tag}n1", 1)
            seen["waited"] = last is not None and last.query() and runner.live[f"{tag}n1"].t2w is stream
            # request 2's second chunk stalled on the later chunks' lane; request 3's first chunk,
            # waited for, comes back while it runs
            chunk(2, wait=True)
            seen["later stalled"] = f"{tag}2" in chunk(2, stall=True).inflight
            first = chunk(3, wait=True)
            seen["first beside"] = f"{tag}3" in first.audio and f"{tag}2" in first.inflight
            runner.release_all()
            return seen

        scenario("warm")
        seen = scenario("p")
        assert all(seen.values()), seen
    finally:
        eng.close()
