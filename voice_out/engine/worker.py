"""The GPU worker: ONE thread per device that owns CUDA, the model, the caches and the policies:
the scheduler's (requests) and the launch policy (what goes to the device in one step).

Everything reaches it as a typed message on one ``queue.Queue`` (the thread boundary):

* :class:`Cancel` (barge-in) is an :class:`Interrupt`: every iteration drains the queue and
  applies interrupts first, so a cancel never waits behind text or acks, and text that arrived
  in the same batch for a cancelled stream is dropped;
* :class:`Open`, :class:`Text`, :class:`EndText`, :class:`Ack` (the consumer played audio: back-
  pressure), :class:`Barrier` (tests: answered when the worker has nothing to do) and
  :class:`Stop` are ordinary messages, applied in arrival order.

Then one step: ``plan -> runner.execute -> update``, where ``plan`` is the worker's
:class:`~voice_out.engine.launch.LaunchPolicy` choosing from the scheduler's offer
(``LaunchPolicy.plan``), and the outputs go to each stream's
:class:`Sink` (``deliver`` is thread-safe; the engine's sinks hop onto the event loop with
``loop.call_soon_threadsafe``). The stream's last item is always an :class:`EndOfStream`.
With nothing to do, the worker blocks on the queue.

Failures: an exception for one request (reported by the runner, or raised by the scheduler's
text handling) fails that request only. An exception escaping a whole step fails the requests
of that step; the worker goes on with the others.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from voice_out.engine.api import EngineError, EngineFailedError, PcmChunk, StreamFailedError
from voice_out.engine.launch import LaunchPolicy
from voice_out.engine.request import RequestStatus, VoicePrompt
from voice_out.engine.scheduler import Emitted, Ended, FirstAudioTrace, Output, Scheduler, StepPlan, StepResult

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Messages (consumer threads -> worker)


class Message:
    """Base of every message to the worker."""


class Interrupt(Message):
    """A message applied before any other in the same drain (barge-in)."""


@dataclass(frozen=True)
class Open(Message):
    request_id: str
    voice: VoicePrompt
    seed: int
    sink: Sink
    fast_first: int | None = None
    #: token2wav speed (!= 1: one final chunk; ``EngineLike.open_stream``).
    speed: float = 1.0


@dataclass(frozen=True)
class Text(Message):
    request_id: str
    delta: str


@dataclass(frozen=True)
class EndText(Message):
    request_id: str


@dataclass(frozen=True)
class Ack(Message):
    """The consumer of ``request_id`` has played ``samples`` samples."""

    request_id: str
    samples: int


@dataclass(frozen=True)
class Cancel(Interrupt):
    request_id: str


@dataclass(frozen=True)
class Barrier(Message):
    """Answered (``notify()``, on the worker thread) once every earlier message is applied and
    no step is left to do (every stream finished, waiting for text or held by back-pressure)."""

    notify: Callable[[], None]


@dataclass(frozen=True)
class Stop(Message):
    """Abort every stream, release the device, and end the thread."""


# --------------------------------------------------------------------------------------------
# Outputs (worker -> consumers)


@dataclass(frozen=True)
class EndOfStream:
    """The last item of every stream."""

    status: RequestStatus
    error: EngineError | None = None


class Sink(Protocol):
    """Where a stream's items go. ``deliver`` is called from the worker thread only and must be
    thread-safe and non-blocking."""

    def deliver(self, item: PcmChunk | EndOfStream) -> None: ...


class StepRunner(Protocol):
    """What the worker needs of :class:`~voice_out.engine.runner.Runner`."""

    def execute(self, plan: StepPlan) -> StepResult: ...

    def release_all(self) -> None: ...

    @property
    def n_live(self) -> int: ...

    # start-up work left for after ready (``Runner.defer``), advanced one piece at a time
    # while no request is live
    @property
    def warming(self) -> bool: ...

    def background_step(self) -> bool: ...

    def drop_deferred(self) -> None: ...


@dataclass(frozen=True)
class WorkerStats:
    """A snapshot the worker publishes after every iteration (read from any thread)."""

    live_requests: int = 0
    used_slots: int = 0
    waiting: int = 0
    runner_requests: int = 0
    steps: int = 0
    failed_steps: int = 0
    #: Seconds spent in ``runner.execute`` (device work and its host overhead).
    busy_s: float = 0.0
    llm_rows: int = 0
    chunks: int = 0
    #: The latest streams' first-audio traces (``Scheduler.first_audio``) and how many streams
    #: were ever traced.
    first_audio: tuple[FirstAudioTrace, ...] = ()
    first_audio_count: int = 0
    #: The runner has start-up work left (``StepRunner.warming``).
    warming: bool = False


class Worker:
    """The busy loop (see the module docstring). ``start`` from any thread; the loop runs on
    its own thread, which builds the runner with ``runner_factory`` (CUDA is initialised there),
    calls ``warmup(runner)`` and then sets :attr:`ready`. ``launch``: what goes to the device
    in each step, beside what the runner has in flight (the engine's plan's policy).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        runner_factory: Callable[[], StepRunner],
        inbox: queue.Queue[Message],
        *,
        launch: LaunchPolicy,
        warmup: Callable[[StepRunner], None] | None = None,
        on_ready: Callable[[], None] | None = None,
        on_exit: Callable[[], None] | None = None,
        name: str = "voice_out-gpu",
    ) -> None:
        self.scheduler = scheduler
        #: Lanes, launches in flight, step-ahead guesses and waits (voice_out.engine.launch).
        self.launch = launch
        self.inbox = inbox
        self._runner_factory = runner_factory
        self._warmup = warmup
        self._on_ready = on_ready
        self._on_exit = on_exit
        self._sinks: dict[str, Sink] = {}
        self.runner: StepRunner | None = None
        self.ready = threading.Event()
        self.startup_error: BaseException | None = None
        self.stats = WorkerStats()
        self._steps = 0
        self._failed_steps = 0
        self._busy_s = 0.0
        self._llm_rows = 0
        self._chunks = 0
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    # ---- the thread --------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            try:
                self.runner = self._runner_factory()
                if self._warmup is not None:
                    self._warmup(self.runner)
            except BaseException as e:  # noqa: BLE001 - reported to whoever waits on ``ready``
                log.exception("the engine failed to start")
                self.startup_error = e
                self._signal_ready()
                self._refuse_all()
                return
            self._publish()  # ``warming`` is true from ready on, if the warm-up left work
            self._signal_ready()
            try:
                self._loop(self.runner)
            except BaseException:
                # a bug in the loop itself: end every stream rather than leave consumers hanging
                log.exception("the engine worker crashed")
                err = EngineFailedError("the engine worker crashed")
                for sink in list(self._sinks.values()):
                    _safe_deliver(sink, EndOfStream(RequestStatus.FAILED, err))
                self._sinks.clear()
                raise
        finally:
            self.runner = None  # drop the model and caches with the thread
            self._publish()
            if self._on_exit is not None:
                self._on_exit()

    def _signal_ready(self) -> None:
        self.ready.set()
        if self._on_ready is not None:
            self._on_ready()

    def _refuse_all(self) -> None:
        """After a failed start-up: fail every stream that still arrives, until Stop."""
        err = StreamFailedError(f"the engine failed to start: {self.startup_error}")
        while True:
            msg = self.inbox.get()
            if isinstance(msg, Open):
                _safe_deliver(msg.sink, EndOfStream(RequestStatus.FAILED, err))
            elif isinstance(msg, Barrier):
                _safe_notify(msg)
            elif isinstance(msg, Stop):
                return

    def _drain(self, block: bool) -> list[Message]:
        msgs: list[Message] = []
        if block:
            msgs.append(self.inbox.get())
        while True:
            try:
                msgs.append(self.inbox.get_nowait())
            except queue.Empty:
                return msgs

    def _loop(self, runner: StepRunner) -> None:
        sched = self.scheduler
        # start-up's deferred work begins at once, not at the first message
        busy = runner.warming
        barriers: list[Barrier] = []
        while True:
            msgs = self._drain(block=not busy and not barriers)
            stop = self._apply(msgs, barriers)
            self._deliver(sched.take_outputs())
            if stop:
                sched.finish(list(sched.requests), RequestStatus.ABORTED)
                self._deliver(sched.take_outputs())
                runner.drop_deferred()
                runner.release_all()
                for b in barriers:
                    _safe_notify(b)
                return
            try:
                plan = self.launch.plan(sched)
            except Exception:  # noqa: BLE001 - a scheduler bug: fail what is live, keep serving
                log.exception("planning failed; failing every live stream")
                self._fail_all("the engine's scheduler failed")
                continue
            if plan.empty:
                busy = False
                self._publish()
                for b in barriers:
                    _safe_notify(b)
                barriers.clear()
                # with no request at all, a piece of start-up's deferred work (~30 to 300 ms):
                # a stream that opens meanwhile waits for that one piece at most
                if not sched.requests and runner.warming:
                    busy = runner.background_step()  # work left: look at the inbox, then on
                    if not busy:
                        self._publish()  # the deferred work has ended
                continue
            busy = True
            self._deliver(self._step(runner, plan))
            self._publish()

    def _apply(self, msgs: list[Message], barriers: list[Barrier]) -> bool:
        """Apply a drained batch: interrupts first, then the rest in order. True on Stop."""
        sched = self.scheduler
        cancelled: set[str] = set()
        for msg in msgs:
            if isinstance(msg, Cancel):
                cancelled.add(msg.request_id)
                sched.finish([msg.request_id], RequestStatus.ABORTED)
        stop = False
        for msg in msgs:
            if isinstance(msg, Interrupt):
                continue
            if isinstance(msg, Stop):
                stop = True
            elif isinstance(msg, Barrier):
                barriers.append(msg)
            elif isinstance(msg, Open):
                if msg.request_id in cancelled:
                    _safe_deliver(msg.sink, EndOfStream(RequestStatus.ABORTED))
                    continue
                try:
                    sched.add_request(msg.request_id, msg.voice, msg.seed, msg.fast_first, speed=msg.speed)
                except Exception as e:  # noqa: BLE001 - e.g. a duplicate id: that stream only
                    _safe_deliver(msg.sink, EndOfStream(RequestStatus.FAILED, StreamFailedError(str(e))))
                    continue
                self._sinks[msg.request_id] = msg.sink
            elif isinstance(msg, Text | EndText | Ack):
                if msg.request_id in cancelled:
                    continue
                try:
                    if isinstance(msg, Text):
                        sched.push_text(msg.request_id, msg.delta)
                    elif isinstance(msg, EndText):
                        sched.end_text(msg.request_id)
                    else:
                        sched.ack(msg.request_id, msg.samples)
                except Exception as e:  # noqa: BLE001 - the scheduler's own bug: that stream only
                    sched.finish([msg.request_id], RequestStatus.FAILED, StreamFailedError(str(e)))
        for rid in cancelled:
            # the stream's consumer already knows; close its sink without another item
            self._sinks.pop(rid, None)
        return stop

    def _step(self, runner: StepRunner, plan: StepPlan) -> list[Output]:
        sched = self.scheduler
        self._steps += 1
        self._llm_rows += len(plan.llm)
        self._chunks += len(plan.vocode)
        t0 = time.perf_counter()
        try:
            result = runner.execute(plan)
        except Exception as e:  # noqa: BLE001 - the step fails, the worker goes on
            self._failed_steps += 1
            log.exception("engine step failed; failing its %d streams", len(plan.request_ids()))
            message = f"engine step failed: {type(e).__name__}: {e}"
            failed = plan.request_ids()
            # chunks of earlier steps may still be in flight in the runner: the next result says
            result = StepResult(failed=dict.fromkeys(failed, message), inflight=sched.inflight_ids() - failed)
        self._busy_s += time.perf_counter() - t0
        try:
            return sched.update(plan, result)
        except Exception:  # noqa: BLE001
            log.exception("applying a step failed; failing its streams")
            sched.finish(plan.request_ids(), RequestStatus.FAILED, StreamFailedError("the engine failed a step"))
            return sched.take_outputs()

    def _fail_all(self, message: str) -> None:
        sched = self.scheduler
        sched.finish(list(sched.requests), RequestStatus.FAILED, StreamFailedError(message))
        self._deliver(sched.take_outputs())
        sched.waiting.clear()
        sched.free_slots = list(range(sched.fast_plan.max_streams))
        if self.runner is not None:
            self.runner.release_all()

    def _deliver(self, outputs: list[Output]) -> None:
        for out in outputs:
            if isinstance(out, Emitted):
                sink = self._sinks.get(out.request_id)
                if sink is not None:
                    _safe_deliver(sink, out.chunk)
            elif isinstance(out, Ended):
                sink = self._sinks.pop(out.request_id, None)
                if sink is not None:
                    _safe_deliver(sink, EndOfStream(out.status, out.error))

    def _publish(self) -> None:
        sched = self.scheduler
        runner = self.runner
        traces = self.stats.first_audio
        if sched.first_audio_count != self.stats.first_audio_count:
            traces = tuple(sched.first_audio)  # copied only when a stream got its first audio
        self.stats = WorkerStats(
            live_requests=sched.n_live,
            used_slots=sched.n_used_slots,
            waiting=len(sched.waiting),
            runner_requests=runner.n_live if runner is not None else 0,
            steps=self._steps,
            failed_steps=self._failed_steps,
            busy_s=self._busy_s,
            llm_rows=self._llm_rows,
            chunks=self._chunks,
            first_audio=traces,
            first_audio_count=sched.first_audio_count,
            warming=runner is not None and runner.warming,
        )


def _safe_notify(barrier: Barrier) -> None:
    try:
        barrier.notify()
    except Exception:  # noqa: BLE001
        log.exception("answering a barrier failed")


def _safe_deliver(sink: Sink, item: PcmChunk | EndOfStream) -> None:
    try:
        sink.deliver(item)
    except Exception:  # noqa: BLE001 - a broken consumer must not stop the worker
        log.exception("delivering to a stream failed")
