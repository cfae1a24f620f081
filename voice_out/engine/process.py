"""An engine in a process of its own: :class:`ProcessEngine` (implements ``EngineLike``).

Why. Each engine's worker spends host time planning every step; two engines in one Python
process take turns at one GIL, and past ~24 streams per GPU each slows the other
(docs/scale-out.md has the measurements). In a child process per GPU every engine has its own
interpreter; the server's process only moves text in and PCM out.

How. The child (started with ``spawn``: CUDA and threads do not survive a fork) loads an
:class:`~voice_out.engine.engine.Engine` for one device and serves it over a duplex
``multiprocessing`` pipe. Parent -> child: ``("open", id, voice, seed, fast_first,
instructions, speed)`` and the worker's own messages (``Text``, ``EndText``, ``Ack``, ``Cancel``) as the parent's stream
handles send them; ``("stats" | "idle" | "voices", token)`` requests; ``("stop",)``. Child ->
parent: ``("ready", voices, default_voice, plan)`` or ``("start_failed", message)``; per stream
``("chunk", id, PcmChunk)`` ... then ``("end", id, RequestStatus, error)``; the answers to
requests. The parent's streams are the engine's own :class:`~voice_out.engine.stream.EngineStream`
handles (same text limits, cancel and ack semantics), their outboxes filled by a reader thread.

Failure. When the child dies (killed, crashed, out of memory) the pipe reaches EOF: every open
stream ends with :class:`~voice_out.engine.api.EngineFailedError` and ``ready`` turns False,
so a placement routes new streams elsewhere. Errors the child's engine raises when it opens a
stream (unknown voice, no voice) end that stream with the same error and code.

Threads: ``open_stream``, the stream methods, ``stats`` and the lifecycle run on the asyncio
thread (or one owning thread); the reader thread only fills outboxes and resolves waiters.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import multiprocessing
import signal
import threading
import uuid
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from types import TracebackType
from typing import TYPE_CHECKING, Any

from voice_out.config import Config
from voice_out.engine.api import (
    SAMPLE_RATE,
    BadOptionError,
    EngineError,
    EngineFailedError,
    OverloadedError,
    StreamClosedError,
    StreamFailedError,
    StreamState,
    check_speed,
)
from voice_out.engine.request import RequestStatus
from voice_out.engine.stream import EngineStream, _Outbox
from voice_out.engine.worker import Ack, Cancel, EndOfStream, EndText, Message, Text

if TYPE_CHECKING:
    from voice_out.engine.build import BuildOptions

log = logging.getLogger(__name__)

#: How long :meth:`ProcessEngine.stats` waits for the child's answer.
STATS_TIMEOUT_S = 10.0
#: How long a stopped child may take to close its engine before it is killed.
STOP_TIMEOUT_S = 30.0

_END_STATUS = {
    StreamState.FINISHED: RequestStatus.FINISHED,
    StreamState.ABORTED: RequestStatus.ABORTED,
    StreamState.FAILED: RequestStatus.FAILED,
}


class ProcessEngine:
    """The engine of ``config`` (one device) in a child process; see the module docstring.

    ``load_options``: :meth:`Engine.load`'s ``options`` (picklable: no ``fault_hook``).
    ``voice_store``: the child opens the voice store at ``server.voices_dir`` writable for
    the model (as the server does), else the engine's default read-only one.
    ``torch_threads``: the child's torch CPU threads (0: torch's default). ``voices``: this
    process's view of the same store (its names, before the child is up).
    """

    def __init__(
        self,
        config: Config,
        *,
        label: str | None = None,
        load_options: BuildOptions | None = None,
        voice_store: bool = False,
        torch_threads: int = 0,
        voices: Any | None = None,
    ) -> None:
        self.config = config
        self.label = label or config.model.device
        self._options = load_options
        self._voice_store = voice_store
        self._torch_threads = torch_threads
        self._store = voices
        self.max_open_streams = 4 * config.engine.max_streams
        self._process: Any = None
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # _outboxes, _waiters, the state below
        self._outboxes: dict[str, _Outbox] = {}
        self._streams: weakref.WeakValueDictionary[str, EngineStream] = weakref.WeakValueDictionary()
        self._waiters: dict[int, Callable[[Any], None]] = {}
        self._tokens = itertools.count()
        self._reader: threading.Thread | None = None
        self._ready = False
        self._closing = False
        self._dead = False
        self._voices: list[str] = []
        self._default_voice: str | None = None
        #: The child engine's fast-path plan (voice_out.fast.plan.Plan), once it is ready.
        self.plan: Any = None
        self._started: Callable[[Any], None] | None = None

    # ---- EngineLike --------------------------------------------------------------------------

    @property
    def sample_rate(self) -> int:
        return SAMPLE_RATE

    @property
    def ready(self) -> bool:
        return self._ready and not self._dead and self._process is not None and self._process.is_alive()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else int(self._process.pid)

    def voice_names(self) -> list[str]:
        """The child's voices as of its last answer (a fresh answer is asked for each call);
        before the child is up, those it will have: the store's and a random model's own."""
        if self.ready:
            self._request("voices", self._set_voices)
            return list(self._voices)
        if self._voices or self._store is None:
            return list(self._voices)
        from voice_out.engine.build import NOISE_VOICE

        builtin = {NOISE_VOICE} if self.config.model.model.startswith("random:") else set()
        return sorted(set(self._store.names()) | builtin)

    def _set_voices(self, answer: Any) -> None:
        if isinstance(answer, list):
            self._voices = answer

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
        """Open a stream in the child. Raises OverloadedError (not running, too many open
        streams), BadOptionError (``fast_first`` or ``speed`` out of range), ValueError (an id
        in use); a voice or ``instructions`` the child cannot take end the stream with its
        error (``unknown_voice``, ``no_voice``, ``bad_field``)."""
        first_hop = self.config.engine.first_hop_tokens
        if fast_first is not None and not 0 <= fast_first < first_hop:
            raise BadOptionError(f"fast_first = {fast_first} must be in 0..{first_hop - 1} tokens")
        check_speed(speed)
        if not self.ready:
            raise OverloadedError(f"the engine on {self.label} is not running")
        sid = stream_id or uuid.uuid4().hex
        with self._lock:
            open_now = sum(1 for s in self._streams.values() if not s.state.terminal)
            if open_now >= self.max_open_streams:
                raise OverloadedError(f"too many open streams ({open_now}); try again later")
            if sid in self._streams and not self._streams[sid].state.terminal:
                raise ValueError(f"a stream with id {sid!r} is already open")
            stream = EngineStream(
                sid,
                voice if voice is not None else (self._default_voice or ""),
                send=self._send,
                post=self._post,
                max_text_chars=self.config.engine.max_text_chars,
                auto_ack=auto_ack,
            )
            self._streams[sid] = stream
            self._outboxes[sid] = stream.outbox
        stream.finalizer = weakref.finalize(stream, self._post, Cancel(sid))
        try:
            self._write(("open", sid, voice, seed, fast_first, instructions, float(speed)))
        except OSError:
            self._forget(sid)
            raise OverloadedError(f"the engine on {self.label} is not running") from None
        return stream

    def _forget(self, sid: str) -> None:
        with self._lock:
            self._outboxes.pop(sid, None)
            self._streams.pop(sid, None)

    def _write(self, msg: object) -> None:
        conn = self._conn
        if conn is None:
            raise OSError("not started")
        with self._send_lock:
            conn.send(msg)

    def _send(self, msg: Message) -> None:
        """A stream's message to the child; raises StreamClosedError when the child is gone."""
        try:
            self._write(msg)
        except OSError:
            if isinstance(msg, Ack):  # what was played means nothing to a stopped engine
                return
            raise StreamClosedError(f"the engine on {self.label} has stopped") from None
        if isinstance(msg, Cancel):
            self._forget(msg.request_id)

    def _post(self, msg: Message) -> None:
        """Like ``_send`` but never raises (cancel paths)."""
        try:
            self._send(msg)
        except StreamClosedError:
            pass
        if isinstance(msg, Cancel):
            self._forget(msg.request_id)

    def _request(self, kind: str, answer: Callable[[Any], None]) -> None:
        """Ask the child ``kind``; ``answer(value)`` runs on the reader thread (None: the child
        is gone)."""
        token = next(self._tokens)
        with self._lock:
            if self._dead:
                dead = True
            else:
                dead = False
                self._waiters[token] = answer
        if dead:
            answer(None)
            return
        try:
            self._write((kind, token))
        except OSError:
            with self._lock:
                self._waiters.pop(token, None)
            answer(None)

    # ---- the reader thread -------------------------------------------------------------------

    def _read(self, conn: Connection) -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            except Exception:  # noqa: BLE001 - an unreadable message: the pipe is broken
                log.exception("engine %s: unreadable message from its process", self.label)
                break
            kind = msg[0]
            if kind == "chunk":
                with self._lock:
                    outbox = self._outboxes.get(msg[1])
                if outbox is not None:
                    outbox.deliver(msg[2])
            elif kind == "end":
                with self._lock:
                    outbox = self._outboxes.pop(msg[1], None)
                if outbox is not None:
                    outbox.deliver(EndOfStream(msg[2], msg[3]))
            elif kind == "answer":
                with self._lock:
                    waiter = self._waiters.pop(msg[1], None)
                if waiter is not None:
                    waiter(msg[2])
            elif kind in ("ready", "start_failed"):
                if kind == "ready":
                    self._voices, self._default_voice, self.plan = msg[1], msg[2], msg[3]
                    if self.plan is not None:
                        self.max_open_streams = 4 * self.plan.max_streams
                    self._ready = True
                started = self._started
                if started is not None:
                    started(None if kind == "ready" else msg[1])
        self._gone()

    def _gone(self) -> None:
        """The child's pipe closed: end every stream and wake every waiter."""
        with self._lock:
            self._dead = True
            outboxes, self._outboxes = list(self._outboxes.values()), {}
            waiters, self._waiters = list(self._waiters.values()), {}
        expected = self._closing
        if not expected:
            code = self._process.exitcode if self._process is not None else None
            log.error("the engine process of %s exited (code %s): its streams fail", self.label, code)
        err = EngineFailedError(f"the engine process of {self.label} exited")
        for outbox in outboxes:
            outbox.deliver(EndOfStream(RequestStatus.ABORTED) if expected else EndOfStream(RequestStatus.FAILED, err))
        for waiter in waiters:
            waiter(None)
        started = self._started
        if started is not None:
            started(f"the process exited (code {self._process.exitcode if self._process else None})")

    # ---- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> ProcessEngine:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start the child and wait until its engine is warm. RuntimeError when it fails."""
        if self._process is not None:
            raise RuntimeError(f"the engine on {self.label} is already started")
        loop = asyncio.get_running_loop()
        started: asyncio.Future[str | None] = loop.create_future()

        def on_started(error: str | None) -> None:
            self._started = None

            def resolve() -> None:
                if not started.done():
                    started.set_result(error)

            try:
                loop.call_soon_threadsafe(resolve)
            except RuntimeError:
                pass

        self._started = on_started
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        spec = (self.config, self._options, self._voice_store, self._torch_threads, self.label)
        self._process = ctx.Process(
            target=child_main, args=(child, spec), name=f"voice_out-engine {self.label}", daemon=True
        )
        await loop.run_in_executor(None, self._process.start)
        child.close()  # the child holds its end: EOF here means it is gone
        self._conn = parent
        self._reader = threading.Thread(
            target=self._read, args=(parent,), name=f"voice_out-pipe {self.label}", daemon=True
        )
        self._reader.start()
        error = await started
        if error is not None:
            await self.aclose()
            raise RuntimeError(f"the engine on {self.label} failed to start: {error}")

    async def aclose(self) -> None:
        """Stop the child (its streams end ABORTED); kill it if it does not exit in time."""
        proc = self._process
        if proc is None:
            return
        self._closing = True
        self._ready = False
        try:
            self._write(("stop",))
        except OSError:
            pass
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, proc.join, STOP_TIMEOUT_S)
        if proc.is_alive():
            log.warning("the engine process of %s did not stop in %g s: killed", self.label, STOP_TIMEOUT_S)
            proc.kill()
            await loop.run_in_executor(None, proc.join)
        if self._reader is not None:
            await loop.run_in_executor(None, self._reader.join)
        if self._conn is not None:
            self._conn.close()
        self._process = None

    def kill(self) -> None:
        """Kill the child at once (tests: an engine that dies)."""
        if self._process is not None:
            self._process.kill()

    def wait(self, timeout: float | None = None) -> int | None:
        """Block until the child exits (at most ``timeout`` s); its exit code (None: running)."""
        proc = self._process
        if proc is None:
            return None
        proc.join(timeout)
        return None if proc.exitcode is None else int(proc.exitcode)

    # ---- accounting (bench, tests) -----------------------------------------------------------

    def stats(self) -> Any:
        """The child engine's :class:`~voice_out.engine.engine.EngineStats` (blocks the calling
        thread for one round trip to the child, ~1 ms; not for hot paths). RuntimeError when
        the child is gone."""
        done = threading.Event()
        box: list[Any] = []

        def answer(value: Any) -> None:
            box.append(value)
            done.set()

        self._request("stats", answer)
        if not done.wait(STATS_TIMEOUT_S) or box[0] is None:
            raise RuntimeError(f"the engine on {self.label} did not answer")
        return box[0]

    async def await_idle(self) -> None:
        """Until the child's engine has applied every message sent so far and has no step left."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def answer(_: Any) -> None:
            def resolve() -> None:
                if not fut.done():
                    fut.set_result(None)

            try:
                loop.call_soon_threadsafe(resolve)
            except RuntimeError:
                pass

        self._request("idle", answer)
        await fut


# --------------------------------------------------------------------------------------------
# The child


def child_main(conn: Connection, spec: tuple[Config, BuildOptions | None, bool, int, str]) -> None:
    """The child process: load the engine of ``spec`` and serve it on ``conn`` until told to
    stop or until the parent is gone."""
    config, options, voice_store, torch_threads, label = spec
    # Ctrl-C reaches the whole process group: the server's shutdown stops this engine itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s [engine {label}] %(name)s: %(message)s")
    try:
        import torch

        from voice_out.engine.engine import Engine

        if torch_threads > 0:
            torch.set_num_threads(torch_threads)
        voices = None
        if voice_store:
            from voice_out.hub import resolve_model
            from voice_out.voices.store import VoiceStore

            mc = config.model
            source = resolve_model(mc.model, mc.cache_dir, revision=mc.revision, offline=mc.offline)
            voices = VoiceStore(config.server.voices_dir, source.path)
        engine = Engine.load(config, voices=voices, options=options)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        conn.send(("start_failed", f"{type(e).__name__}: {e}"))
        conn.close()
        return
    asyncio.run(_serve(conn, engine))
    conn.close()


async def _serve(conn: Connection, engine: Any) -> None:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[Any] = asyncio.Queue()

    def read() -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the parent is gone
                msg = ("stop",)
            loop.call_soon_threadsafe(inbox.put_nowait, msg)
            if isinstance(msg, tuple) and msg[0] == "stop":
                return

    try:
        await engine.__aenter__()
    except Exception as e:  # noqa: BLE001 - reported to the parent
        conn.send(("start_failed", f"{type(e).__name__}: {e}"))
        return
    streams: dict[str, Any] = {}
    tasks: set[asyncio.Task[None]] = set()

    async def pump(sid: str, stream: Any) -> None:
        try:
            async for chunk in stream:
                conn.send(("chunk", sid, chunk))
            status = _END_STATUS.get(stream.state, RequestStatus.ABORTED)
            conn.send(("end", sid, status, None))
        except EngineError as e:
            conn.send(("end", sid, RequestStatus.FAILED, e))
        except Exception as e:  # noqa: BLE001 - that stream only
            log.exception("stream %s failed in the engine process", sid)
            conn.send(("end", sid, RequestStatus.FAILED, StreamFailedError(f"{type(e).__name__}: {e}")))
        finally:
            streams.pop(sid, None)

    async def answer_idle(token: int) -> None:
        await engine.await_idle()
        conn.send(("answer", token, True))

    def spawn(coro: Any) -> None:
        task = loop.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    # SIGTERM (a supervisor stopping every process, multiprocessing at the parent's exit):
    # stop as if told to, streams cancelled and the device released
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGTERM, inbox.put_nowait, ("stop",))
    # what start-up made stays out of the collector's sight (as in the serving process)
    gc.collect()
    gc.freeze()
    reader = threading.Thread(target=read, name="voice_out-pipe", daemon=True)
    reader.start()
    conn.send(("ready", engine.voice_names(), engine.voices.default, getattr(engine, "plan", None)))
    try:
        while True:
            msg = await inbox.get()
            if isinstance(msg, tuple):
                kind = msg[0]
                if kind == "stop":
                    break
                if kind == "open":
                    _, sid, voice, seed, fast_first, instructions, speed = msg
                    try:
                        stream = engine.open_stream(
                            voice,
                            stream_id=sid,
                            seed=seed,
                            auto_ack=False,
                            fast_first=fast_first,
                            instructions=instructions,
                            speed=speed,
                        )
                    except EngineError as e:
                        conn.send(("end", sid, RequestStatus.FAILED, e))
                        continue
                    except ValueError as e:
                        conn.send(("end", sid, RequestStatus.FAILED, StreamFailedError(str(e))))
                        continue
                    streams[sid] = stream
                    spawn(pump(sid, stream))
                elif kind == "stats":
                    conn.send(("answer", msg[1], engine.stats()))
                elif kind == "voices":
                    conn.send(("answer", msg[1], engine.voice_names()))
                elif kind == "idle":
                    spawn(answer_idle(msg[1]))
                continue
            stream = streams.get(getattr(msg, "request_id", ""))
            if stream is None:
                continue
            try:
                if isinstance(msg, Text):
                    stream.push_text(msg.delta)
                elif isinstance(msg, EndText):
                    stream.end_text()
                elif isinstance(msg, Ack):
                    stream.ack(msg.samples)
                elif isinstance(msg, Cancel):
                    stream.cancel()
            except EngineError:
                pass  # the stream has ended: its pump reports how
    finally:
        for stream in list(streams.values()):
            stream.cancel()
        await engine.aclose()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


__all__ = ["ProcessEngine", "child_main"]
