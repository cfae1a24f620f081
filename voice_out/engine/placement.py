"""Several engines behind one :class:`~voice_out.engine.api.EngineLike`: each new utterance goes
to the engine with the most headroom (docs/scale-out.md).

The engines may be anything that implements ``EngineLike``: the in-process
:class:`~voice_out.engine.engine.Engine` (one worker thread per GPU in the server's process), a
:class:`~voice_out.engine.process.ProcessEngine` (an engine in a process of its own), or an
engine reached over the network. The placement layer knows nothing about how they run; it
holds, per engine, a label (its device: the ``gpu`` label of ``/metrics``), its planned
capacity (the most streams it holds within the latency target) and the streams it placed there.

Placement rule. ``open_stream`` picks, among the engines that are READY (not starting, not
draining, not failed), the one with the most headroom: planned capacity minus streams in flight
(opened and not yet ended: finished, cancelled or failed). Ties go to the engine listed first.
An engine that refuses the stream (overloaded) is skipped for the next; only when every
engine refuses does the caller get ``OverloadedError``. Utterances of one WebRTC session may
land on different engines: the session plays each stream's chunks on its one track in start
order, wherever they were made.

Failure. An engine that was READY and is no longer ``ready`` (its worker crashed, its process
died), or whose stream ended with :class:`~voice_out.engine.api.EngineFailedError`, is FAILED:
its streams end with ``EngineFailedError`` (protocol code ``engine_failed``), new streams go
to the others. A failed engine stays failed (restart the server, or a supervisor restarts its
process, to bring it back).

Threads: everything here is called on the asyncio thread (or the one thread that owns the
placement), like the engines it holds.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import weakref
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from voice_out.engine.api import (
    EngineFailedError,
    EngineLike,
    OverloadedError,
    PcmChunk,
    Stream,
    StreamFailedError,
    StreamState,
)

if TYPE_CHECKING:
    from voice_out.config import Config
    from voice_out.engine.build import BuildOptions

log = logging.getLogger(__name__)


class EngineState(enum.Enum):
    """Where one engine of a placement is. Only READY engines get new streams."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"  # its streams finish; no new ones
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(frozen=True)
class EngineReport:
    """One engine's figures (``/healthz``, ``/metrics``, the bench): a snapshot."""

    label: str
    state: EngineState
    in_flight: int
    capacity: int
    #: Streams ever placed on it, and those of them that ended with ``engine_failed``.
    placed: int
    failed_streams: int
    #: What ``label`` names: ``gpu`` (an engine of a placement: its device) or ``replica``
    #: (a Ray Serve replica of ``RayEngine``: its replica id); the key of ``/healthz`` and the
    #: label of ``/metrics``.
    kind: str = "gpu"

    @property
    def headroom(self) -> int:
        return self.capacity - self.in_flight

    def to_json(self) -> dict[str, Any]:
        return {
            self.kind: self.label,
            "state": self.state.value,
            "streams": self.in_flight,
            "capacity": self.capacity,
            "placed": self.placed,
            "failed_streams": self.failed_streams,
        }


class _Slot:
    """One engine of the placement and the streams placed on it (weakly held: a stream its
    holder dropped is cancelled by its engine and no longer counts)."""

    def __init__(self, label: str, engine: EngineLike, capacity: int) -> None:
        self.label = label
        self.engine = engine
        self.capacity = capacity
        self.state = EngineState.STARTING
        self.streams: weakref.WeakSet[PlacedStream] = weakref.WeakSet()
        self.placed = 0
        self.failed_streams = 0

    @property
    def in_flight(self) -> int:
        return sum(1 for s in self.streams if not s.state.terminal)

    def report(self) -> EngineReport:
        return EngineReport(self.label, self.state, self.in_flight, self.capacity, self.placed, self.failed_streams)


class Placement:
    """Implements ``EngineLike`` over ``engines``: ``(label, engine, planned capacity)`` each;
    an engine with a memory plan (``engine.plan.max_streams``) has that as its capacity once
    started.

    Enter it (``async with``) to start every engine at once (each that is an async context
    manager and not already running; one after the other with ``serial_start``: engines of
    one process, whose start-ups capture CUDA graphs, which no other thread of the process may
    make CUDA calls beside); an engine that fails to start is FAILED and the others
    serve, unless none started (then the first start error is raised). Leaving it stops the
    engines it started.
    """

    def __init__(self, engines: Sequence[tuple[str, EngineLike, int]], *, serial_start: bool = False) -> None:
        if not engines:
            raise ValueError("a placement needs at least one engine")
        labels = [label for label, _, _ in engines]
        if len(set(labels)) != len(labels):
            raise ValueError(f"engine labels must be distinct, got {labels}")
        for label, _, capacity in engines:
            if capacity < 1:
                raise ValueError(f"engine {label}: planned capacity {capacity} must be >= 1")
        self._slots = [_Slot(label, engine, capacity) for label, engine, capacity in engines]
        self._serial_start = serial_start
        self._stack: AsyncExitStack | None = None

    # ---- what the placement holds ------------------------------------------------------------

    @property
    def engines(self) -> list[EngineLike]:
        return [s.engine for s in self._slots]

    @property
    def warming(self) -> bool:
        """Whether an engine of this process still runs start-up work after ready
        (``Engine.warming``; an engine in a process of its own does not say)."""
        return any(bool(getattr(s.engine, "warming", False)) for s in self._slots)

    def reports(self) -> list[EngineReport]:
        """Each engine's state and load, in the order they were given."""
        for slot in self._slots:
            self._check(slot)
        return [s.report() for s in self._slots]

    def drain(self, label: str) -> None:
        """Give engine ``label`` no new streams; its streams in flight finish."""
        slot = self._slot(label)
        if slot.state in (EngineState.READY, EngineState.STARTING):
            slot.state = EngineState.DRAINING

    def _slot(self, label: str) -> _Slot:
        for slot in self._slots:
            if slot.label == label:
                return slot
        raise KeyError(f"no engine {label!r} (engines: {', '.join(s.label for s in self._slots)})")

    def _check(self, slot: _Slot) -> None:
        """An engine that was serving and is no longer ready has failed."""
        if slot.state in (EngineState.READY, EngineState.DRAINING) and not slot.engine.ready:
            self._failed(slot, "it is no longer ready")

    def _failed(self, slot: _Slot, why: str) -> None:
        if slot.state is EngineState.FAILED or slot.state is EngineState.STOPPED:
            return
        slot.state = EngineState.FAILED
        log.error("engine %s failed (%s): new utterances go to the other engines", slot.label, why)

    # ---- EngineLike --------------------------------------------------------------------------

    @property
    def sample_rate(self) -> int:
        return self._slots[0].engine.sample_rate

    @property
    def ready(self) -> bool:
        """At least one engine takes new streams."""
        for slot in self._slots:
            self._check(slot)
        return any(s.state is EngineState.READY for s in self._slots)

    @property
    def default_voice(self) -> str | None:
        """The voice of streams opened without one: the engines' (one config serves them all),
        None when none is set or no engine says (``GET /voices`` and the page show it)."""
        for slot in self._slots:
            voice = getattr(slot.engine, "default_voice", None)
            if isinstance(voice, str):
                return voice
        return None

    def voice_names(self) -> list[str]:
        for slot in self._slots:
            if slot.state is EngineState.READY:
                return slot.engine.voice_names()
        return self._slots[0].engine.voice_names()

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
    ) -> PlacedStream:
        """Open a stream on the READY engine with the most headroom (see the module docstring).

        Raises what the engine raises (NoVoiceError, UnknownVoiceError, BadOptionError), or
        OverloadedError when no engine takes it."""
        for slot in self._slots:
            self._check(slot)
        ready = [s for s in self._slots if s.state is EngineState.READY]
        if not ready:
            states = ", ".join(f"{s.label} {s.state.value}" for s in self._slots)
            raise OverloadedError(f"no engine takes new streams now ({states})")
        # the most headroom first; sorted() is stable, so ties keep the listed order
        ranked = sorted(ready, key=lambda s: s.in_flight - s.capacity)
        # only the options a caller set travel: an engine without one (seed) still serves
        options: dict[str, Any] = {}
        if seed is not None:
            options["seed"] = seed
        if not auto_ack:
            options["auto_ack"] = False
        if fast_first is not None:
            options["fast_first"] = fast_first
        if instructions is not None:
            options["instructions"] = instructions
        if speed != 1.0:
            options["speed"] = speed
        refused: OverloadedError | None = None
        for slot in ranked:
            try:
                open_stream: Any = slot.engine.open_stream
                inner: Stream = open_stream(voice, stream_id=stream_id, **options)
            except OverloadedError as e:
                self._check(slot)
                refused = refused or e
                continue
            placed = PlacedStream(inner, self, slot)
            slot.streams.add(placed)
            slot.placed += 1
            return placed
        assert refused is not None
        raise refused

    def _stream_failed(self, slot: _Slot, error: StreamFailedError) -> StreamFailedError:
        """A stream on ``slot`` failed with ``error``: the error its holder gets."""
        self._check(slot)
        if isinstance(error, EngineFailedError):
            self._failed(slot, str(error))
        if slot.state is EngineState.FAILED:
            slot.failed_streams += 1
            if not isinstance(error, EngineFailedError):
                return EngineFailedError(f"engine {slot.label} failed: {error}")
        return error

    # ---- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Placement:
        stack = AsyncExitStack()
        if self._serial_start:
            errors = [await self._start(slot, stack) for slot in self._slots]
        else:
            errors = await asyncio.gather(*(self._start(slot, stack) for slot in self._slots))
        if not any(s.state is EngineState.READY for s in self._slots):
            await stack.aclose()
            first = next((e for e in errors if e is not None), None)
            raise RuntimeError(f"no engine started: {first}") from first
        self._stack = stack
        return self

    async def _start(self, slot: _Slot, stack: AsyncExitStack) -> BaseException | None:
        engine: Any = slot.engine
        try:
            # an engine already running is taken as it is: its owner stops it
            if not engine.ready and hasattr(engine, "__aenter__") and hasattr(engine, "__aexit__"):
                await stack.enter_async_context(engine)
        except Exception as e:  # noqa: BLE001 - that engine only; the others may serve
            slot.state = EngineState.FAILED
            log.error("engine %s failed to start: %s", slot.label, e)
            return e
        if slot.state is EngineState.STARTING:
            slot.state = EngineState.READY if engine.ready else EngineState.FAILED
        # the streams the engine's memory plan fit (voice_out.fast.plan), where it has one:
        # known once the engine has measured its GPU
        plan = getattr(engine, "plan", None)
        planned = getattr(plan, "max_streams", None)
        if isinstance(planned, int) and planned >= 1:
            slot.capacity = planned
        return None

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop every engine (their open streams end ABORTED)."""
        for slot in self._slots:
            if slot.state is not EngineState.FAILED:
                slot.state = EngineState.STOPPED
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    # ---- bench and tests ---------------------------------------------------------------------

    def stats(self) -> Any:
        """The engines' :class:`~voice_out.engine.engine.EngineStats`, summed (engines without
        ``stats`` count nothing): the bench reads steps, busy time and first-audio traces."""
        from voice_out.engine.engine import EngineStats

        parts = [s.engine.stats() for s in self._slots if callable(getattr(s.engine, "stats", None))]  # type: ignore[attr-defined]
        total: dict[str, Any] = {}
        for name in EngineStats.__dataclass_fields__:
            values = [getattr(p, name) for p in parts]
            if name == "first_audio":
                total[name] = tuple(t for v in values for t in v)
            else:
                total[name] = sum(values)
        return EngineStats(**total)

    async def await_idle(self) -> None:
        """Until every live engine has applied what it was sent and has nothing to do."""
        idle = [
            s.engine.await_idle()
            for s in self._slots
            if s.state in (EngineState.READY, EngineState.DRAINING) and hasattr(s.engine, "await_idle")
        ]
        await asyncio.gather(*idle)


class PlacedStream:
    """A stream placed on one engine of a :class:`Placement` (implements ``Stream``): every
    call goes to the engine's stream; a failure of the engine as a whole surfaces as
    :class:`EngineFailedError`. Asyncio thread (or the one thread that owns the stream)."""

    def __init__(self, inner: Stream, placement: Placement, slot: _Slot) -> None:
        self._inner = inner
        self._placement = placement
        self._slot = slot

    @property
    def engine_label(self) -> str:
        """The label (device) of the engine the stream was placed on."""
        return self._slot.label

    @property
    def id(self) -> str:
        return self._inner.id

    @property
    def voice(self) -> str:
        return self._inner.voice

    @property
    def state(self) -> StreamState:
        return self._inner.state

    @property
    def text(self) -> str:
        return self._inner.text

    @property
    def error(self) -> Any:
        return getattr(self._inner, "error", None)

    def push_text(self, delta: str) -> None:
        self._inner.push_text(delta)

    def end_text(self) -> None:
        self._inner.end_text()

    def cancel(self) -> None:
        self._inner.cancel()

    def ack(self, samples_played: int) -> None:
        ack: Any = getattr(self._inner, "ack", None)
        if ack is not None:
            ack(samples_played)

    def __aiter__(self) -> AsyncIterator[PcmChunk]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[PcmChunk]:
        try:
            async for chunk in self._inner:
                yield chunk
        except StreamFailedError as e:
            err = self._placement._stream_failed(self._slot, e)
            if err is e:
                raise
            raise err from e

    def __iter__(self) -> Iterator[PcmChunk]:
        try:
            yield from self._inner
        except StreamFailedError as e:
            err = self._placement._stream_failed(self._slot, e)
            if err is e:
                raise
            raise err from e

    def __repr__(self) -> str:
        return f"PlacedStream({self._inner!r} on {self._slot.label})"


def load_placement(cfg: Config, *, voices: Any | None = None, options: BuildOptions | None = None) -> Placement:
    """A :class:`Placement` of one engine per device of
    ``model.device`` (not started). ``options``: :meth:`Engine.load`'s ``options``.

    In-process engines share ``voices`` (the server's store); engines in processes of their
    own (:func:`~voice_out.engine.build.uses_processes`) open the store at ``server.voices_dir`` themselves when
    ``voices`` is given, else their engine's default."""
    from voice_out.config import replace as replace_config
    from voice_out.engine.build import engine_labels, expand_devices, planned_capacity, resolve_device, uses_processes
    from voice_out.engine.engine import Engine
    from voice_out.engine.process import ProcessEngine

    devices = expand_devices(cfg.model.device)
    if devices == ("auto",):
        devices = (str(resolve_device("auto")),)
    engines: list[tuple[str, EngineLike, int]] = []
    processes = uses_processes(cfg, len(devices))
    for device, label in zip(devices, engine_labels(devices), strict=True):
        one = replace_config(cfg, "model", device=device)
        engine: EngineLike
        if processes:
            engine = ProcessEngine(
                one, label=label, load_options=options, voice_store=voices is not None, voices=voices
            )
        else:
            engine = Engine.load(one, voices=voices, options=options)
        engines.append((label, engine, planned_capacity(one)))
    # in-process engines start one after the other: a start-up captures CUDA graphs, and no
    # other thread of the process may allocate on a GPU meanwhile
    return Placement(engines, serial_start=not processes)
