"""The in-process engine: :class:`Engine` (implements ``EngineLike``) and its :class:`EngineStream`.

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
owns the model and hands each stream's items to its :class:`_Outbox`, which is thread-safe and
wakes an async consumer with ``loop.call_soon_threadsafe``.

Cancellation. ``EngineStream.cancel()`` is idempotent and valid at any stage: it ends the
iteration at once, drops the queued audio, and sends a high-priority ``Cancel``; the worker
applies it before anything else in its next iteration, so the stream gets no further GPU work
after the step in flight (at most one LLM step plus the chunks already planned), and its KV
slot is reset and reused. A stream object that is garbage-collected unfinished is cancelled.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import queue
import secrets
import threading
import uuid
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from voice_out.config import Config, EngineConfig
from voice_out.config import replace as replace_config
from voice_out.engine.api import (
    SAMPLE_RATE,
    EngineError,
    NoVoiceError,
    OverloadedError,
    PcmChunk,
    StreamClosedError,
    StreamFailedError,
    StreamState,
    TextTooLongError,
    UnknownVoiceError,
)
from voice_out.engine.request import RequestStatus, TextPiece, TextPipeline, VoicePrompt
from voice_out.engine.scheduler import ForcedTokens, Scheduler
from voice_out.engine.worker import (
    Ack,
    Barrier,
    Cancel,
    EndOfStream,
    EndText,
    Message,
    Open,
    StepRunner,
    Stop,
    Text,
    Worker,
    WorkerStats,
)

log = logging.getLogger(__name__)

#: The built-in voice of ``random:*`` models (random prompt features: it sounds like noise).
NOISE_VOICE = "noise"
#: ``random:<preset>`` -> the dims directory under ``configs/models``.
RANDOM_DIMS = {"tiny": "tiny", "0.5b": "cosyvoice2-0.5b"}
ADD_VOICE_HINT = 'add one with `voice-out voices add NAME prompt.wav "what is said in it"`'


def random_dims_dir(preset: str) -> Path:
    """The directory holding the dims (no weights) of a ``random:<preset>`` model."""
    root = Path(__file__).resolve().parents[2] / "configs" / "models"
    path = root / RANDOM_DIMS[preset]
    if not (path / "cosyvoice2.yaml").is_file():
        raise FileNotFoundError(f"the dims of random:{preset} are missing: {path / 'cosyvoice2.yaml'}")
    return path


# --------------------------------------------------------------------------------------------
# Per-stream outbox: the only object both threads touch


class _Outbox:
    """A stream's queue of items from the worker. ``deliver`` (worker) and ``close`` (consumer)
    are thread-safe; once closed, deliveries are dropped."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: collections.deque[PcmChunk | EndOfStream] = collections.deque()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        # the stream's state lives here, not in the stream: the worker holds the outbox, and
        # must not keep an abandoned stream alive (its finalizer cancels it)
        self.state = StreamState.WAITING
        self.error: EngineError | None = None

    def _track(self, item: PcmChunk | EndOfStream) -> None:
        if isinstance(item, PcmChunk):
            if self.state is StreamState.WAITING:
                self.state = StreamState.RUNNING
        else:
            self.state = item.status.stream_state()
            self.error = item.error

    def abort(self) -> bool:
        """Mark the stream ABORTED and close; False when it had already ended."""
        with self._cond:
            ended = self.state.terminal
            if not ended:
                self.state = StreamState.ABORTED
        self.close()
        return not ended

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return len(self._items)

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> asyncio.Event:
        """Called on the loop's thread by the async iterator."""
        with self._cond:
            if self._event is None or self._loop is not loop:
                self._loop, self._event = loop, asyncio.Event()
            return self._event

    def deliver(self, item: PcmChunk | EndOfStream) -> None:
        with self._cond:
            if self._closed:
                return
            self._items.append(item)
            self._track(item)
            self._cond.notify_all()
            loop, event = self._loop, self._event
        if loop is not None and event is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._items.clear()
            self._cond.notify_all()
            loop, event = self._loop, self._event
        if loop is not None and event is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:
                pass

    def poll(self) -> PcmChunk | EndOfStream | None:
        with self._cond:
            return self._items.popleft() if self._items else None

    def get(self, timeout: float | None = None) -> PcmChunk | EndOfStream | None:
        """Block until an item arrives (None: closed, or ``timeout`` passed)."""
        with self._cond:
            self._cond.wait_for(lambda: self._items or self._closed, timeout)
            return self._items.popleft() if self._items else None


# --------------------------------------------------------------------------------------------
# The stream handle


class EngineStream:
    """One utterance (implements :class:`voice_out.engine.api.Stream`).

    Call ``push_text``/``end_text``/``cancel``/``ack`` from the asyncio thread (or the one
    thread that owns the stream); iterate it once, async or plain. With ``auto_ack`` (the
    default) a chunk counts as played when the iterator hands it out; a transport that buffers
    ahead of playback turns it off and calls :meth:`ack` with what was actually played, so that
    back-pressure (``engine.max_ahead_s``) follows the listener.
    """

    def __init__(
        self,
        engine: Engine,
        stream_id: str,
        voice: str,
        *,
        auto_ack: bool,
    ) -> None:
        self._engine = engine
        self._id = stream_id
        self._voice = voice
        self._auto_ack = auto_ack
        self._text: list[str] = []
        self._n_chars = 0
        self._ended = False
        self._cancelled = False
        self._iterated = False
        self.outbox = _Outbox()
        self.samples_received = 0
        #: Cancels the stream if it is garbage-collected unfinished (set by the engine).
        self.finalizer: weakref.finalize[Any, Any] | None = None

    # ---- Stream protocol ---------------------------------------------------------------------

    @property
    def id(self) -> str:
        return self._id

    @property
    def voice(self) -> str:
        return self._voice

    @property
    def state(self) -> StreamState:
        return self.outbox.state

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def error(self) -> EngineError | None:
        """Why the stream FAILED (None otherwise)."""
        return self.outbox.error

    def push_text(self, delta: str) -> None:
        """Append ``delta`` to the utterance. Raises StreamClosedError after ``end_text`` or
        ``cancel``, TextTooLongError past ``engine.max_text_chars`` (the text is not taken)."""
        if not isinstance(delta, str):
            raise TypeError(f"delta must be a str, not {type(delta).__name__}")
        if self._cancelled or self._ended or self.state.terminal:
            raise StreamClosedError(f"stream {self._id} no longer takes text")
        limit = self._engine.config.engine.max_text_chars
        if self._n_chars + len(delta) > limit:
            raise TextTooLongError(f"an utterance may hold at most {limit} characters")
        if not delta:
            return
        self._text.append(delta)
        self._n_chars += len(delta)
        self._engine._send(Text(self._id, delta))

    def end_text(self) -> None:
        """No more text: speak what is left. Idempotent; a no-op after ``cancel``."""
        if self._ended or self._cancelled:
            return
        self._ended = True
        self._engine._send(EndText(self._id))

    def cancel(self) -> None:
        """Stop now (barge-in): see the module docstring. Idempotent, any stage."""
        if self._cancelled:
            return
        self._cancelled = True
        if self.finalizer is not None:
            self.finalizer.detach()
        if self.outbox.abort():
            self._engine._post(Cancel(self._id))

    def ack(self, samples_played: int) -> None:
        """The listener has heard ``samples_played`` samples of this stream (monotone)."""
        if not self._cancelled and not self.state.terminal:
            self._engine._send(Ack(self._id, int(samples_played)))

    def _take(self, item: PcmChunk | EndOfStream) -> PcmChunk | None:
        """Consume one item; None means the iteration ends (raises on failure)."""
        if isinstance(item, PcmChunk):
            self.samples_received = item.start_sample + len(item.pcm)
            if self._auto_ack and not item.final:
                self._engine._send(Ack(self._id, self.samples_received))
            return item
        self.outbox.close()
        if self.finalizer is not None:
            self.finalizer.detach()  # ended: nothing left to cancel
        if item.status is RequestStatus.FAILED:
            err = item.error or StreamFailedError("the stream failed")
            raise err
        return None

    def _start_iteration(self) -> None:
        if self._iterated:
            raise RuntimeError(f"stream {self._id} is already being iterated")
        self._iterated = True

    def __aiter__(self) -> AsyncIterator[PcmChunk]:
        self._start_iteration()
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[PcmChunk]:
        event = self.outbox.bind_loop(asyncio.get_running_loop())
        while True:
            item = self.outbox.poll()
            if item is None:
                if self.outbox.closed:
                    return
                event.clear()
                item = self.outbox.poll()
                if item is None:
                    if self.outbox.closed:
                        return
                    await event.wait()
                    continue
            chunk = self._take(item)
            if chunk is None:
                return
            yield chunk

    def __iter__(self) -> Iterator[PcmChunk]:
        self._start_iteration()
        return self._iter()

    def _iter(self) -> Iterator[PcmChunk]:
        while True:
            item = self.outbox.get()
            if item is None:
                return
            chunk = self._take(item)
            if chunk is None:
                return
            yield chunk

    def __repr__(self) -> str:
        return f"EngineStream(id={self._id!r}, voice={self._voice!r}, state={self.state.value})"


# --------------------------------------------------------------------------------------------
# Voices


VoiceResolver = Callable[[str | None], VoicePrompt]


class VoiceBook:
    """Voice name -> :class:`VoicePrompt` (token ids for the scheduler, tensors for the runner).

    Looks in the voice store, then in the built-in voices (``noise`` for random models).
    ``default``: the voice used when none is named. Any thread.
    """

    def __init__(
        self,
        store: Any | None,
        encode: Callable[[str], list[int]],
        *,
        builtin: Mapping[str, VoicePrompt] | None = None,
        default: str | None = None,
    ) -> None:
        self.store = store
        self.encode = encode
        self.builtin = dict(builtin or {})
        self.default = default
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[object, VoicePrompt]] = {}

    def names(self) -> list[str]:
        stored = list(self.store.names()) if self.store is not None else []
        return sorted(set(stored) | set(self.builtin))

    def resolve(self, name: str | None) -> VoicePrompt:
        chosen = name if name is not None else self.default
        if chosen is None:
            raise NoVoiceError(f"no voice was named and no default voice is configured: {ADD_VOICE_HINT}")
        if chosen in self.builtin and (self.store is None or chosen not in self.store):
            return self.builtin[chosen]
        if self.store is None:
            known = ", ".join(self.names()) or "none"
            raise UnknownVoiceError(f"unknown voice {chosen!r} (known: {known}); {ADD_VOICE_HINT}")
        voice = self.store.get(chosen)  # raises UnknownVoiceError with the store's own hint
        with self._lock:
            hit = self._cache.get(chosen)
            if hit is not None and hit[0] is voice:
                return hit[1]
        prompt = self._from_store_voice(voice)
        with self._lock:
            self._cache[chosen] = (voice, prompt)
        return prompt

    def _from_store_voice(self, voice: Any) -> VoicePrompt:
        from voice_out.engine.runner import FlowVoice

        flow_tokens = voice.flow_prompt_tokens
        return VoicePrompt(
            name=voice.name,
            prompt_text_ids=tuple(self.encode(voice.prompt_text)),
            prompt_speech_ids=tuple(int(t) for t in voice.llm_prompt_tokens.tolist()),
            flow_prompt_tokens=int(flow_tokens.shape[0]),
            flow=FlowVoice(flow_tokens, voice.prompt_mel, voice.embedding),
        )


# --------------------------------------------------------------------------------------------
# The engine


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
        max_chunks_per_step: int = 4,
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
        self._max_chunks_per_step = max_chunks_per_step
        self.max_open_streams = max_open_streams or 4 * config.engine.max_streams
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
        forced: ForcedTokens | None = None,
        kv_len: int = 4096,
        warmup: bool = True,
        flow_path: str = "rerun",
        fault_hook: Any | None = None,
        max_chunks_per_step: int = 4,
        noise_prompt_tokens: int = 25,
        text_normalizer: str = "auto",
        llm_graphs: bool | None = None,
        engine: EngineConfig | None = None,
    ) -> Engine:
        """Resolve the model and build an engine (the weights load on the worker at start).

        ``model``: a CosyVoice2 directory, a hub id, or ``random:tiny`` / ``random:0.5b``
        (random weights: NOISE, with a loud warning; they come with a built-in voice
        ``noise``). ``voices``: a :class:`~voice_out.voices.store.VoiceStore` (default: a
        read-only store at ``server.voices_dir``). ``forced``: forced-tokens mode for tests and
        benchmarks. ``kv_len``: KV-cache positions per stream. ``text_normalizer``: ``auto``,
        ``wetext``, ``rules`` or ``none``. ``flow_path``: token2wav's ``rerun`` (upstream) or
        ``cached`` flow. ``fault_hook``: a test hook (see ``Runner``). ``llm_graphs``: run the
        LLM through ``voice_out.model.llm_graphs`` (CUDA graphs per batch bucket; eager code
        off the GPU); None = ``engine.cuda_graphs`` on a CUDA device.
        """
        from voice_out.engine import loading

        cfg = config or Config()
        if model is not None:
            cfg = replace_config(cfg, "model", model=model)
        if device is not None:
            cfg = replace_config(cfg, "model", device=device)
        if engine is not None:
            cfg = dataclasses.replace(cfg, engine=engine)
        return loading.build_engine(
            cls,
            cfg,
            voices=voices,
            forced=forced,
            kv_len=kv_len,
            warmup=warmup,
            flow_path=flow_path,
            fault_hook=fault_hook,
            max_chunks_per_step=max_chunks_per_step,
            noise_prompt_tokens=noise_prompt_tokens,
            text_normalizer=text_normalizer,
            llm_graphs=llm_graphs,
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

    def open_stream(
        self,
        voice: str | None = None,
        *,
        stream_id: str | None = None,
        seed: int | None = None,
        auto_ack: bool = True,
    ) -> EngineStream:
        """Open a stream in ``voice`` (None: the default voice). Raises NoVoiceError,
        UnknownVoiceError, OverloadedError (not running, or too many open streams)."""
        if not self.ready:
            raise OverloadedError("the engine is not running (start it first)")
        prompt = self.voices.resolve(voice)
        sid = stream_id or uuid.uuid4().hex
        if seed is None:
            seed = next(self._seeds) if self._seeds is not None else secrets.randbits(62)
        with self._lock:
            open_now = sum(1 for s in self._streams.values() if not s.state.terminal)
            if open_now >= self.max_open_streams:
                raise OverloadedError(f"too many open streams ({open_now}); try again later")
            if sid in self._streams and not self._streams[sid].state.terminal:
                raise ValueError(f"a stream with id {sid!r} is already open")
            stream = EngineStream(self, sid, prompt.name, auto_ack=auto_ack)
            self._streams[sid] = stream
        inbox = self._inbox
        assert inbox is not None
        # an abandoned stream (garbage-collected unfinished) frees its GPU work
        stream.finalizer = weakref.finalize(stream, inbox.put, Cancel(sid))
        inbox.put(Open(sid, prompt, seed, stream.outbox))
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
            max_chunks_per_step=self._max_chunks_per_step,
        )
        return Worker(
            scheduler,
            self._runner_factory,
            self._inbox,
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
            raise RuntimeError(f"the engine failed to start: {type(err).__name__}: {err}") from err

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


def warn_random(spec: str) -> None:
    """The loud warning for random weights."""
    msg = (
        f"model {spec!r} has RANDOM WEIGHTS: the engine runs the real architecture but speaks NOISE. "
        "Use it for pipeline checks and benchmarks only; pass a CosyVoice2 model directory to hear speech."
    )
    log.warning("!" * 20 + " " + msg + " " + "!" * 20)
    warnings.warn(msg, stacklevel=4)  # the caller of Engine.load


__all__ = [
    "ADD_VOICE_HINT",
    "NOISE_VOICE",
    "Engine",
    "EngineStats",
    "EngineStream",
    "TextPiece",
    "VoiceBook",
]
