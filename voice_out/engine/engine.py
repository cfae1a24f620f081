"""The in-process engine: :class:`Engine` (implements ``EngineLike``), handing out
:class:`~voice_out.engine.stream.EngineStream` s.

::

    engine = Engine.load(model="random:tiny", device="cpu")
    async with engine:                                   # starts the GPU worker, warms up
        stream = engine.open_stream(voice="alice")
        stream.push_text("Hello, wor"); stream.push_text("ld!"); stream.end_text()
        async for chunk in stream:                       # chunk.pcm: float32 (n,), 24 kHz
            play(chunk.pcm)

Threads. ``Engine`` and ``EngineStream`` methods are called from the asyncio thread (or any one
non-worker thread for the synchronous ``start``/``close`` and the plain iterator). They only
put typed messages on the worker's queue (:mod:`voice_out.engine.worker`); the worker thread
owns the model and hands each stream's items to its outbox (:mod:`voice_out.engine.stream`),
which is thread-safe and wakes an async consumer with ``loop.call_soon_threadsafe``.

Cancellation. ``EngineStream.cancel()`` is idempotent and valid at any stage: it ends the
iteration at once, drops the queued audio, and sends a high-priority ``Cancel``; the worker
applies it before anything else in its next iteration, so the stream gets no further GPU work
after the step in flight (at most one LLM step plus the chunks already planned), and its KV
slot is reset and reused. A stream object that is garbage-collected unfinished is cancelled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import secrets
import threading
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from voice_out.config import Config, EngineConfig, load_config
from voice_out.config import replace as replace_config
from voice_out.engine.api import (
    SAMPLE_RATE,
    BadOptionError,
    OverloadedError,
    StreamClosedError,
    check_speed,
)
from voice_out.engine.launch import LaunchPolicy
from voice_out.engine.request import TextPipeline
from voice_out.engine.scheduler import FirstAudioTrace, ForcedTokens, Scheduler
from voice_out.engine.stream import EngineStream
from voice_out.engine.voicebook import ADD_VOICE_HINT, VoiceBook, instruct_prompt
from voice_out.engine.worker import (
    Barrier,
    Cancel,
    Message,
    Open,
    StepRunner,
    Stop,
    Worker,
    WorkerStats,
)
from voice_out.errors import VoiceOutError
from voice_out.fast.plan import Plan, cpu_plan

if TYPE_CHECKING:
    from voice_out.engine.build import BuildOptions

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# The engine


class EngineStartError(VoiceOutError, RuntimeError):
    """The worker could not start (model, device or memory); the message says why, once."""


@dataclass(frozen=True)
class EngineStats:
    """Resource accounting (any thread; a snapshot)."""

    used_slots: int
    live_requests: int
    runner_requests: int
    waiting: int
    worker_threads: int
    open_streams: int
    queued_chunks: int
    steps: int
    failed_steps: int
    busy_s: float = 0.0
    llm_rows: int = 0
    chunks: int = 0
    #: The latest streams' first-audio traces, oldest first, and how many were ever recorded.
    first_audio: tuple[FirstAudioTrace, ...] = ()
    first_audio_count: int = 0
    #: Start-up work is still running after ready (the graph captures past the first chunks:
    #: until they end, the chunks they are for run eagerly).
    warming: bool = False


class Engine:
    """The streaming engine (implements :class:`voice_out.engine.api.EngineLike`).

    Build it with :meth:`load`; start it with ``async with engine`` or :meth:`start`; open
    streams with :meth:`open_stream`. See the module docstring for the threading rules.
    """

    def __init__(
        self,
        config: Config,
        *,
        runner_factory: Callable[[], StepRunner],
        pipeline_factory: Callable[[], TextPipeline],
        voices: VoiceBook,
        forced: ForcedTokens | None = None,
        warmup: Callable[[StepRunner], None] | None = None,
        clock: Callable[[], float] | None = None,
        plan: Plan | None = None,
        max_open_streams: int | None = None,
    ) -> None:
        import time

        self.config = config
        self.voices = voices
        self.forced = forced
        self._runner_factory = runner_factory
        self._pipeline_factory = pipeline_factory
        self._warmup = warmup
        self._clock = clock or time.monotonic
        #: Every fast-path choice and size (voice_out.fast.plan): its KV slots, graphs, kernels,
        #: flow states, prompt prefixes, and what did not fit the memory budget.
        self.plan = plan if plan is not None else cpu_plan(config.engine.max_streams)
        self.max_open_streams = max_open_streams or 4 * self.plan.max_streams
        self._streams: weakref.WeakValueDictionary[str, EngineStream] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self._worker: Worker | None = None
        self._inbox: queue.Queue[Message] | None = None
        self._seeds = itertools.count(config.engine.seed) if config.engine.seed is not None else None
        self._ready_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._exit_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        config: Config | None = None,
        *,
        model: str | None = None,
        device: str | None = None,
        voices: Any | None = None,
        engine: EngineConfig | None = None,
        options: BuildOptions | None = None,
    ) -> Engine:
        """Resolve the model and build an engine (the weights load on the worker at start).

        ``config``: None = what the ``voice-out`` commands read without ``--config``: the
        file ``$VOICE_OUT_CONFIG`` names and the ``VOICE_OUT_<SECTION>_<FIELD>`` variables
        (a bad value raises ``ConfigError``); ``model``, ``device``, ``engine`` override it.
        ``model``: a CosyVoice2 directory, a hub id, or ``random:tiny`` / ``random:0.5b``
        (random weights: NOISE, with a loud warning; they come with a built-in voice
        ``noise``). ``voices``: a :class:`~voice_out.voices.store.VoiceStore` (default: a
        read-only store at ``server.voices_dir``). ``options``: how it is built besides the
        config (:class:`~voice_out.engine.build.BuildOptions`: forced tokens, KV length,
        warm-up, flow path, text normalizer, fast-path pins; tests and benchmarks).
        Raises ConfigError when ``engine.gpu_memory`` cannot hold the model and one stream.
        """
        # the assembly lives in build.py, which never imports this module (no circle)
        from voice_out.engine.build import build_engine

        # no config given: the one every command reads ($VOICE_OUT_CONFIG, VOICE_OUT_<SECTION>_<FIELD>)
        cfg = config if config is not None else load_config()
        if model is not None:
            cfg = replace_config(cfg, "model", model=model)
        if device is not None:
            cfg = replace_config(cfg, "model", device=device)
        if engine is not None:
            cfg = dataclasses.replace(cfg, engine=engine)
        parts = build_engine(cfg, voices, options)
        return cls(
            cfg,
            runner_factory=parts.runner_factory,
            pipeline_factory=parts.pipeline_factory,
            voices=parts.voices,
            forced=parts.forced,
            warmup=parts.warmup,
            plan=parts.plan,
        )

    # ---- EngineLike --------------------------------------------------------------------------

    @property
    def sample_rate(self) -> int:
        return SAMPLE_RATE

    @property
    def ready(self) -> bool:
        w = self._worker
        return w is not None and w.ready.is_set() and w.startup_error is None and w.thread.is_alive()

    def voice_names(self) -> list[str]:
        return self.voices.names()

    @property
    def default_voice(self) -> str | None:
        """The voice of streams opened without one (``server.default_voice``, or ``noise`` for
        random weights); None: such a stream raises NoVoiceError."""
        return self.voices.default

    def open_stream(
        self,
        voice: str | None = None,
        *,
        stream_id: str | None = None,
        seed: int | None = None,
        auto_ack: bool = True,
        fast_first: int | None = None,
        instructions: str | None = None,
        speed: float = 1.0,
    ) -> EngineStream:
        """Open a stream in ``voice`` (None: the default voice). Raises NoVoiceError,
        UnknownVoiceError, OverloadedError (not running, or too many open streams),
        BadOptionError (``fast_first``, ``speed`` or ``instructions`` out of range).

        ``instructions`` and ``speed``: CosyVoice2's instruct mode and token2wav speed (see
        ``EngineLike.open_stream``; the LLM input: :func:`instruct_prompt`).

        ``fast_first``: tokens of a fast first chunk for this stream (0 = upstream's 25 + pad;
        None = ``engine.fast_first_tokens``); less time to first audio, a first second that
        differs slightly from a single pass (docs/token2wav.md)."""
        first_hop = self.config.engine.first_hop_tokens
        if fast_first is not None and not 0 <= fast_first < first_hop:
            raise BadOptionError(f"fast_first = {fast_first} must be in 0..{first_hop - 1} tokens")
        check_speed(speed)
        if not self.ready:
            raise OverloadedError("the engine is not running (start it first)")
        prompt = self.voices.resolve(voice)
        if instructions is not None:
            prompt = instruct_prompt(prompt, instructions, self.voices.encode)
        sid = stream_id or uuid.uuid4().hex
        if seed is None:
            seed = next(self._seeds) if self._seeds is not None else secrets.randbits(62)
        with self._lock:
            open_now = sum(1 for s in self._streams.values() if not s.state.terminal)
            if open_now >= self.max_open_streams:
                raise OverloadedError(f"too many open streams ({open_now}); try again later")
            if sid in self._streams and not self._streams[sid].state.terminal:
                raise ValueError(f"a stream with id {sid!r} is already open")
            stream = EngineStream(
                sid,
                prompt.name,
                send=self._send,
                post=self._post,
                max_text_chars=self.config.engine.max_text_chars,
                auto_ack=auto_ack,
            )
            self._streams[sid] = stream
        inbox = self._inbox
        assert inbox is not None
        # an abandoned stream (garbage-collected unfinished) frees its GPU work
        stream.finalizer = weakref.finalize(stream, inbox.put, Cancel(sid))
        inbox.put(Open(sid, prompt, seed, stream.outbox, fast_first, float(speed)))
        return stream

    def _send(self, msg: Message) -> None:
        inbox = self._inbox
        if inbox is None or self._worker is None:
            raise StreamClosedError("the engine is stopped")
        inbox.put(msg)

    def _post(self, msg: Message) -> None:
        """Like ``_send`` but never raises (cancel paths): a stopped engine needs no message."""
        inbox = self._inbox
        if inbox is not None:
            inbox.put(msg)

    # ---- lifecycle ---------------------------------------------------------------------------

    def _new_worker(self) -> Worker:
        self._inbox = queue.Queue()
        scheduler = Scheduler(
            self.config.engine,
            self._pipeline_factory,
            clock=self._clock,
            forced=self.forced,
            plan=self.plan,
        )
        return Worker(
            scheduler,
            self._runner_factory,
            self._inbox,
            launch=LaunchPolicy.of(self.plan),
            warmup=self._warmup,
            on_ready=lambda: self._wake(self._ready_waiters),
            on_exit=lambda: self._wake(self._exit_waiters),
        )

    def _wake(self, waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]) -> None:
        with self._lock:
            pending, waiters[:] = list(waiters), []
        for loop, fut in pending:
            try:
                loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:
                pass

    def start(self, timeout: float | None = None) -> None:
        """Start the worker and wait until it is warm (blocking; scripts and tests)."""
        worker = self._launch()
        worker.ready.wait(timeout)
        self._check_started(worker)

    def _launch(self) -> Worker:
        if self._worker is not None and self._worker.thread.is_alive():
            raise RuntimeError("the engine is already started")
        self._worker = self._new_worker()
        self._worker.start()
        return self._worker

    def _check_started(self, worker: Worker) -> None:
        if not worker.ready.is_set():
            raise TimeoutError("the engine did not become ready in time")
        if worker.startup_error is not None:
            err = worker.startup_error
            self.close()
            raise EngineStartError(f"the engine failed to start: {type(err).__name__}: {err}") from err

    def close(self, timeout: float | None = None) -> None:
        """Stop the worker: every open stream ends ABORTED, the device is released (blocking)."""
        worker, inbox = self._worker, self._inbox
        if worker is None or inbox is None:
            return
        inbox.put(Stop())
        worker.join(timeout)
        self._close_streams()
        self._worker = None

    def _close_streams(self) -> None:
        for s in list(self._streams.values()):
            if not s.state.terminal:
                s.cancel()

    async def __aenter__(self) -> Engine:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self._ready_waiters.append((loop, fut))
        worker = self._launch()
        if worker.ready.is_set():
            _resolve(fut)
        await fut
        self._check_started(worker)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the worker without blocking the event loop."""
        worker, inbox = self._worker, self._inbox
        if worker is None or inbox is None:
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self._exit_waiters.append((loop, fut))
        inbox.put(Stop())
        if not worker.thread.is_alive():
            _resolve(fut)
        await fut
        worker.join()
        self._close_streams()
        self._worker = None

    # ---- accounting (tests, metrics) ----------------------------------------------------------

    @property
    def warming(self) -> bool:
        """Whether start-up work is still running after ready: the token2wav graph captures
        past the first chunks, which the worker does while no stream is live (until they end,
        the chunks they are for run eagerly). Any thread."""
        worker = self._worker
        return worker is not None and worker.stats.warming

    def stats(self) -> EngineStats:
        worker = self._worker
        ws = worker.stats if worker is not None else WorkerStats()
        streams = list(self._streams.values())
        return EngineStats(
            used_slots=ws.used_slots,
            live_requests=ws.live_requests,
            runner_requests=ws.runner_requests,
            waiting=ws.waiting,
            worker_threads=int(worker is not None and worker.thread.is_alive()),
            open_streams=sum(1 for s in streams if not s.state.terminal),
            queued_chunks=sum(len(s.outbox) for s in streams),
            steps=ws.steps,
            failed_steps=ws.failed_steps,
            busy_s=ws.busy_s,
            llm_rows=ws.llm_rows,
            chunks=ws.chunks,
            first_audio=ws.first_audio,
            first_audio_count=ws.first_audio_count,
            warming=ws.warming,
        )

    def wait_idle(self, timeout: float | None = 30.0) -> bool:
        """Block until the worker has applied every message sent so far and has no step to do."""
        done = threading.Event()
        self._send(Barrier(done.set))
        return done.wait(timeout)

    async def await_idle(self) -> None:
        """:meth:`wait_idle` for the event loop."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def notify() -> None:
            try:
                loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:
                pass

        self._send(Barrier(notify))
        await fut


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


__all__ = [
    "ADD_VOICE_HINT",
    "Engine",
    "EngineStartError",
    "EngineStats",
    "EngineStream",
    "VoiceBook",
]
