"""``RayEngine``: an ``EngineLike`` over the Ray Serve deployment, for the voice_out front.

The front (the aiohttp server: WebRTC, the control WebSocket, the HTTP APIs) keeps every
session; only the engines live in Serve replicas. Each utterance is one streaming call of
``SpeechReplica.synthesize`` through ``handle.options(stream=True)``: Serve picks the replica
(power of two choices over queue lengths), the call streams the utterance's PCM chunks back,
and cancelling the call is the barge-in (Serve cancels the replica's coroutine, which cancels
the engine stream). The call carries the text pushed before it left (usually the first delta,
often all of it); later deltas and playback acknowledgements go through the front's text relay
(:mod:`.relay`), which the replica's call pulls from.

Threads: like the in-process engine, every method is called on the asyncio thread (the plain
iterator from one non-asyncio thread). Ray's handles do their own I/O on Ray's threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Iterator
from types import TracebackType
from typing import Any, NoReturn

from voice_out.config import Config
from voice_out.engine.api import (
    SAMPLE_RATE,
    BadOptionError,
    EngineError,
    NoVoiceError,
    OverloadedError,
    PcmChunk,
    StreamClosedError,
    StreamFailedError,
    StreamState,
    TextTooLongError,
    UnknownVoiceError,
    check_speed,
)
from voice_out.engine.ray_serve.messages import (
    EngineFailedError,
    Failed,
    Placed,
    ReplicaInfo,
    TextEvent,
    UtteranceRequest,
    error_of,
)

#: The front reports playback to the replica at most every this many samples (0.1 s): the
#: engine's back-pressure (``engine.max_ahead_s``, seconds) needs no finer news.
ACK_EVERY_SAMPLES = SAMPLE_RATE // 10
#: How often the front asks the deployment whether it answers (``ready``, ``/healthz``).
HEALTH_PERIOD_S = 2.0
HEALTH_TIMEOUT_S = 10.0
#: Serve names each replica's actor ``SERVE_REPLICA::<app>#<deployment>#<replica id>`` in the
#: ``serve`` namespace (what ``Placed.actor_name`` carries): how the front lists the live ones.
REPLICA_ACTOR_PREFIX = "SERVE_REPLICA::"
REPLICA_NAMESPACE = "serve"
#: Replicas that left the deployment (died, drained, scaled down) stay in the front's reports
#: while they hold its streams, and at most this many more (the latest to leave).
GONE_REPLICAS_KEPT = 8
#: A replica under which an utterance failed (``engine_failed``) is ``failed`` until a listing
#: taken this long after the failure still finds it live: then the call failed, not the
#: replica, and it is ``ready`` again. (Ray releases a dead actor's name when it confirms the
#: death, which is also what ends the caller's call with ``ActorDiedError``.)
FAILED_CONFIRM_S = 5.0


def _map_ray_error(e: BaseException) -> EngineError | None:
    """The engine error a Ray failure of an utterance's call stands for (None: not Ray's)."""
    from ray import exceptions as rex
    from ray.serve import exceptions as sex

    if isinstance(e, sex.BackPressureError):
        return OverloadedError(f"every engine replica is full; try again later ({e})")
    if isinstance(e, rex.RayActorError | sex.DeploymentUnavailableError | sex.ReplicaUnavailableError):
        return EngineFailedError(f"the engine replica serving this stream failed: {type(e).__name__}")
    if isinstance(e, rex.RayTaskError):
        return StreamFailedError(f"the engine replica raised: {e}")
    if isinstance(e, rex.RayError):
        return EngineFailedError(f"the call to the engine replica failed: {type(e).__name__}: {e}")
    return None


class _Replica:
    """The front's view of one replica: the streams it placed there and how they ended, and
    whether the replica is among the deployment's live actors (asyncio thread)."""

    def __init__(self, replica_id: str, actor_name: str) -> None:
        self.replica_id = replica_id
        self.actor_name = actor_name
        self.live = True
        self.failed = False
        self.failed_at = 0.0
        self.left_at = 0.0
        self.placed = 0
        self.failed_streams = 0
        self.streams: weakref.WeakSet[RayStream] = weakref.WeakSet()

    @property
    def in_flight(self) -> int:
        return sum(1 for s in self.streams if not s.state.terminal)


def _abandon(gen: Any, relay: Any, stream_id: str) -> None:
    """A stream garbage-collected unfinished: stop its replica's work (finalizer)."""
    with contextlib.suppress(Exception):
        gen.cancel()
        relay.close.remote(stream_id)


class RayStream:
    """One utterance served by a replica (implements :class:`voice_out.engine.api.Stream`).

    Call ``push_text``/``end_text``/``cancel``/``ack`` from the asyncio thread; iterate once.
    ``placed``: the replica serving it, once its first item arrived. ``chunk_transit_s``: per
    chunk, replica hand-off to arrival here (the replica's and this host's monotonic clocks:
    meaningful on one host; benchmarks).
    """

    def __init__(
        self,
        engine: RayEngine,
        stream_id: str,
        voice: str,
        *,
        seed: int | None,
        fast_first: int | None,
        auto_ack: bool,
        instructions: str | None = None,
        speed: float = 1.0,
        max_text_chars: int,
    ) -> None:
        self._engine = engine
        self._id = stream_id
        self._voice = voice
        self._seed = seed
        self._fast_first = fast_first
        self._instructions = instructions
        self._speed = speed
        self._auto_ack = auto_ack
        self._max_text_chars = max_text_chars
        self._pending: list[str] = []
        self._text: list[str] = []
        self._n_chars = 0
        self._ended = False
        self._cancelled = False
        self._iterated = False
        self._gen: Any = None
        self._seq = 0
        self._acked = 0
        self._state = StreamState.WAITING
        self.error: EngineError | None = None
        self.placed: Placed | None = None
        self.samples_received = 0
        self.chunk_transit_s: list[float] = []
        self._finalizer: weakref.finalize[Any, Any] | None = None

    # ---- Stream protocol ---------------------------------------------------------------------

    @property
    def id(self) -> str:
        return self._id

    @property
    def voice(self) -> str:
        return self._voice

    @property
    def state(self) -> StreamState:
        return self._state

    @property
    def text(self) -> str:
        return "".join(self._text)

    def push_text(self, delta: str) -> None:
        """Append ``delta``. Raises StreamClosedError after ``end_text``/``cancel``/the end,
        TextTooLongError past ``engine.max_text_chars`` (the text is not taken)."""
        if not isinstance(delta, str):
            raise TypeError(f"delta must be a str, not {type(delta).__name__}")
        if self._cancelled or self._ended or self._state.terminal:
            raise StreamClosedError(f"stream {self._id} no longer takes text")
        if self._n_chars + len(delta) > self._max_text_chars:
            raise TextTooLongError(f"an utterance may hold at most {self._max_text_chars} characters")
        if not delta:
            return
        self._text.append(delta)
        self._n_chars += len(delta)
        if self._gen is None:
            self._pending.append(delta)
        else:
            self._post(TextEvent("text", delta=delta))

    def end_text(self) -> None:
        """No more text. Idempotent; a no-op after ``cancel``."""
        if self._ended or self._cancelled:
            return
        self._ended = True
        if self._gen is not None:
            self._post(TextEvent("end"))

    def cancel(self) -> None:
        """Barge-in: cancel the call (the replica's coroutine is cancelled, and with it the
        engine stream); no further chunks are handed out. Idempotent, any stage."""
        if self._cancelled:
            return
        self._cancelled = True
        if not self._state.terminal:
            self._state = StreamState.ABORTED
        self._close_call(cancel=True)

    def ack(self, samples_played: int) -> None:
        """The listener has heard ``samples_played`` samples (monotone); reported to the
        replica's engine every :data:`ACK_EVERY_SAMPLES`."""
        if self._cancelled or self._state.terminal or self._gen is None:
            return
        if samples_played - self._acked >= ACK_EVERY_SAMPLES:
            self._acked = int(samples_played)
            self._post(TextEvent("ack", samples=self._acked))

    # ---- the call ----------------------------------------------------------------------------

    def start(self) -> None:
        """Send the utterance's call with the text so far (idempotent). Called soon after
        ``open_stream`` on the event loop, or when iteration begins."""
        if self._gen is not None or self._cancelled:
            return
        eng = self._engine
        req = UtteranceRequest(
            stream_id=self._id,
            voice=self._voice,
            text="".join(self._pending),
            ended=self._ended,
            seed=self._seed,
            fast_first=self._fast_first,
            instructions=self._instructions,
            speed=self._speed,
            ack_follows=True,
        )
        self._pending = []
        self._gen = eng.handle.options(stream=True, method_name="synthesize").remote(req, eng.relay)
        self._finalizer = weakref.finalize(self, _abandon, self._gen, eng.relay, self._id)

    def _post(self, event: TextEvent) -> None:
        relay = self._engine.relay
        if relay is None:
            raise StreamClosedError("the engine is stopped")
        # fire and forget: the relay orders batches by seq
        relay.post.remote(self._id, self._seq, [event])
        self._seq += 1

    def _close_call(self, *, cancel: bool) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        gen = self._gen
        if gen is not None:
            if cancel:
                with contextlib.suppress(Exception):
                    gen.cancel()
            with contextlib.suppress(Exception):
                self._engine.relay.close.remote(self._id)
        self._engine._forget(self)

    def _take(self, item: Any) -> PcmChunk | None:
        """One item of the call; None for items that are not audio. Raises the stream's
        error for a :class:`Failed`."""
        if isinstance(item, Placed):
            self.placed = item
            self._engine._on_placed(self, item)
            return None
        if isinstance(item, Failed):
            raise self._fail(error_of(item))
        chunk, sent_at = item
        self.chunk_transit_s.append(time.monotonic() - sent_at)
        if self._state is StreamState.WAITING:
            self._state = StreamState.RUNNING
        self.samples_received = chunk.start_sample + len(chunk.pcm)
        if self._auto_ack and not chunk.final:
            self.ack(self.samples_received)
        return chunk

    def _fail(self, err: EngineError) -> EngineError:
        self.error = err
        self._state = StreamState.FAILED
        self._engine._on_failed(self, err)
        self._close_call(cancel=True)
        return err

    def _finish(self) -> None:
        if not self._state.terminal:
            self._state = StreamState.FINISHED
        self._close_call(cancel=False)

    def _begin(self) -> Any:
        if self._iterated:
            raise RuntimeError(f"stream {self._id} is already being iterated")
        self._iterated = True
        self.start()
        return self._gen

    def _raise_failure(self, e: Exception) -> NoReturn:
        """Raise what an error of the streaming call means for this stream (not cancelled by
        us): the replica cancelled it or Ray lost it, an engine failure; else ``e`` itself."""
        from ray.serve.exceptions import RequestCancelledError

        if isinstance(e, RequestCancelledError):
            raise self._fail(EngineFailedError("the engine replica cancelled this stream")) from None
        err = _map_ray_error(e)
        if err is None:
            raise e
        raise self._fail(err) from e

    def __aiter__(self) -> AsyncIterator[PcmChunk]:
        return self._aiter(self._begin())

    async def _aiter(self, gen: Any) -> AsyncIterator[PcmChunk]:
        if gen is None:
            return  # cancelled before the call left
        while True:
            try:
                item = await gen.__anext__()
            except StopAsyncIteration:
                break
            except Exception as e:
                if self._cancelled:
                    return
                self._raise_failure(e)
            if self._cancelled:
                return
            chunk = self._take(item)
            if chunk is not None:
                yield chunk
        if not self._cancelled:
            self._finish()

    def __iter__(self) -> Iterator[PcmChunk]:
        return self._iter(self._begin())

    def _iter(self, gen: Any) -> Iterator[PcmChunk]:
        if gen is None:
            return
        while True:
            try:
                item = next(gen)
            except StopIteration:
                break
            except Exception as e:
                if self._cancelled:
                    return
                self._raise_failure(e)
            if self._cancelled:
                return
            chunk = self._take(item)
            if chunk is not None:
                yield chunk
        if not self._cancelled:
            self._finish()

    def __repr__(self) -> str:
        where = self.placed.replica_id if self.placed is not None else "?"
        return f"RayStream(id={self._id!r}, voice={self._voice!r}, state={self._state.value}, replica={where})"


class RayEngine:
    """An ``EngineLike`` over the ``SpeechReplica`` deployment of a Ray Serve application.

    ``async with RayEngine(cfg, store)`` connects to the Ray cluster at ``server.ray_address``
    (unless this process is connected already), finds the application ``server.ray_app``
    (``handle``: use this deployment handle instead), starts the text relay on this node, asks
    a replica for the deployment's facts (sample rate, voices, limits), and then checks every
    :data:`HEALTH_PERIOD_S` that the deployment answers (``ready``). ``voices``: the voice store
    the replicas share (its directory), for ``voice_names`` and early unknown-voice errors.

    ``reports()`` gives one :class:`~voice_out.engine.placement.EngineReport` per replica
    (label: its Serve replica id; ``/healthz`` and ``/metrics`` with the label ``replica``):
    the replicas listed live at the latest health check, and those that left while holding
    this front's streams. Its figures are this front's: its streams in flight there, those it
    placed there, and those that ended with ``engine_failed`` (the replica died under them).
    """

    #: The label of this engine's reports in ``/metrics`` (a placement's is ``gpu``).
    report_label = "replica"

    def __init__(
        self,
        config: Config,
        voices: Any | None = None,
        *,
        handle: Any | None = None,
        health_period_s: float = HEALTH_PERIOD_S,
    ) -> None:
        self.config = config
        self.voices = voices
        self.handle: Any = handle
        self.relay: Any = None
        self.info: ReplicaInfo | None = None
        self._health_period_s = health_period_s
        self._healthy = False
        self._health_task: asyncio.Task[None] | None = None
        self._streams: weakref.WeakValueDictionary[str, RayStream] = weakref.WeakValueDictionary()
        self._replicas: dict[str, _Replica] = {}
        #: Whether the live-replica listing ever found one (then it is trusted for ``ready``).
        self._listing_works = False

    # ---- EngineLike --------------------------------------------------------------------------

    @property
    def sample_rate(self) -> int:
        return self.info.sample_rate if self.info is not None else SAMPLE_RATE

    @property
    def ready(self) -> bool:
        """Connected, the deployment answered its latest health question, and (once the
        listing has found replicas at all) at least one replica was live at the latest look
        and not ``failed`` (see :meth:`reports`)."""
        if self._listing_works and not any(r.live and not r.failed for r in self._replicas.values()):
            return False
        return self.info is not None and self.relay is not None and self._healthy

    def reports(self) -> list[Any]:
        """One :class:`~voice_out.engine.placement.EngineReport` per replica (see the class
        docstring), in the order the front first saw them. A replica is ``ready`` while it is
        live, ``failed`` once an utterance of this front ended with ``engine_failed`` on it
        (unless a listing :data:`FAILED_CONFIRM_S` later still finds it live), and ``stopped``
        when it left the deployment otherwise (drained, scaled down, or died holding none of
        this front's streams). Asyncio thread (``/metrics`` scrapes on it)."""
        from voice_out.engine.placement import EngineReport, EngineState

        capacity = self.info.max_streams if self.info is not None else self.config.engine.max_streams
        out = []
        for r in self._replicas.values():
            if r.failed:
                state = EngineState.FAILED
            elif r.live:
                state = EngineState.READY
            else:
                state = EngineState.STOPPED
            out.append(EngineReport(r.replica_id, state, r.in_flight, capacity, r.placed, r.failed_streams, "replica"))
        return out

    def _replica(self, replica_id: str, actor_name: str) -> _Replica:
        r = self._replicas.get(replica_id)
        if r is None:
            r = self._replicas[replica_id] = _Replica(replica_id, actor_name)
        return r

    def _on_placed(self, stream: RayStream, placed: Placed) -> None:
        r = self._replica(placed.replica_id, placed.actor_name)
        r.placed += 1
        r.streams.add(stream)

    def _on_failed(self, stream: RayStream, err: EngineError) -> None:
        placed = stream.placed
        if placed is None or not isinstance(err, EngineFailedError):
            return
        r = self._replica(placed.replica_id, placed.actor_name)
        r.failed = True
        r.failed_at = time.monotonic()
        r.failed_streams += 1

    def _live_replicas(self) -> dict[str, str] | None:
        """The deployment's live replicas, replica id -> actor name, from Ray's named actors
        (an actor's name is released when it dies); None when Ray cannot say. Blocking (a GCS
        call): run it off the event loop."""
        import ray.util

        handle = self.handle
        prefix = f"{REPLICA_ACTOR_PREFIX}{handle.app_name}#{handle.deployment_name}#"
        try:
            named = ray.util.list_named_actors(all_namespaces=True)
        except Exception:  # noqa: BLE001 - the listing only decorates the reports
            return None
        return {
            a["name"][len(prefix) :]: a["name"]
            for a in named
            if a["namespace"] == REPLICA_NAMESPACE and a["name"].startswith(prefix)
        }

    def _note_live(self, live: dict[str, str] | None, taken_at: float | None = None) -> None:
        """Apply a listing of the live replicas, begun at ``taken_at`` (``time.monotonic()``;
        None: now). Asyncio thread."""
        if live is None:
            return
        if live:
            self._listing_works = True
        now = time.monotonic() if taken_at is None else taken_at
        for rid, name in live.items():
            r = self._replica(rid, name)
            if r.failed and now - r.failed_at >= FAILED_CONFIRM_S:
                r.failed = False  # alive well after the failure: the call failed, not the replica
        for r in self._replicas.values():
            if r.live and r.replica_id not in live:
                r.live = False
                r.left_at = now
        gone = sorted((r for r in self._replicas.values() if not r.live and r.in_flight == 0), key=lambda r: r.left_at)
        for r in gone[: max(0, len(gone) - GONE_REPLICAS_KEPT)]:
            del self._replicas[r.replica_id]

    def voice_names(self) -> list[str]:
        stored = list(self.voices.names()) if self.voices is not None else []
        builtin = list(self.info.builtin_voices) if self.info is not None else []
        return sorted(set(stored) | set(builtin))

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
    ) -> RayStream:
        """Open an utterance (its call leaves on the next turn of the event loop, carrying the
        text pushed until then). Raises NoVoiceError, UnknownVoiceError, OverloadedError (not
        connected, or the deployment does not answer), BadOptionError (``fast_first``,
        ``speed``; ``instructions`` are checked by the replica's engine, whose refusal ends the
        iteration); a
        replica's own refusal (e.g. ``overloaded``) ends the iteration with its error."""
        info = self.info
        if not self.ready or info is None:
            raise OverloadedError("the Ray engine deployment is not answering; try again later")
        if fast_first is not None and not 0 <= fast_first < info.first_hop_tokens:
            raise BadOptionError(f"fast_first = {fast_first} must be in 0..{info.first_hop_tokens - 1} tokens")
        speed = check_speed(speed)
        name = voice if voice is not None else info.default_voice
        if name is None:
            raise NoVoiceError("no voice was named and no default voice is configured")
        if name not in info.builtin_voices and (self.voices is None or name not in self.voices):
            known = ", ".join(self.voice_names()) or "none"
            raise UnknownVoiceError(f"unknown voice {name!r} (known: {known})")
        sid = stream_id or uuid.uuid4().hex
        old = self._streams.get(sid)
        if old is not None and not old.state.terminal:
            raise ValueError(f"a stream with id {sid!r} is already open")
        stream = RayStream(
            self,
            sid,
            name,
            seed=seed if seed is not None else secrets.randbits(62),
            fast_first=fast_first,
            auto_ack=auto_ack,
            instructions=instructions,
            speed=speed,
            max_text_chars=info.max_text_chars,
        )
        self._streams[sid] = stream
        with contextlib.suppress(RuntimeError):  # no loop here: the call leaves at iteration
            asyncio.get_running_loop().call_soon(stream.start)
        return stream

    def _forget(self, stream: RayStream) -> None:
        if self._streams.get(stream.id) is stream:
            del self._streams[stream.id]

    # ---- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> RayEngine:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Connect, start the relay, learn the deployment's facts (see the class docstring)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._connect)
        self.info = await asyncio.wait_for(self.handle.info.remote(), HEALTH_TIMEOUT_S * 6)
        self._healthy = True
        taken_at = time.monotonic()
        self._note_live(await loop.run_in_executor(None, self._live_replicas), taken_at)
        self._health_task = loop.create_task(self._watch(), name="ray engine health")

    def _connect(self) -> None:
        import ray
        from ray import serve

        from voice_out.engine.ray_serve.relay import relay_actor

        if not ray.is_initialized():
            ray.init(address=self.config.server.ray_address, logging_level=logging.WARNING)
        if self.handle is None:
            self.handle = serve.get_app_handle(self.config.server.ray_app)
        self.relay = relay_actor(ray.get_runtime_context().get_node_id())

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._health_period_s)
            # the listing first: the info call waits (up to HEALTH_TIMEOUT_S) while no replica is up
            taken_at = time.monotonic()
            self._note_live(await loop.run_in_executor(None, self._live_replicas), taken_at)
            try:
                await asyncio.wait_for(self.handle.info.remote(), HEALTH_TIMEOUT_S)
                self._healthy = True
            except asyncio.CancelledError:
                raise
            except Exception:
                self._healthy = False

    async def aclose(self) -> None:
        """Cancel every open stream, stop the health checks and the relay. The deployment
        stays up (it belongs to the Ray cluster, not to this front)."""
        task, self._health_task = self._health_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for s in list(self._streams.values()):
            s.cancel()
        relay, self.relay = self.relay, None
        self._healthy = False
        if relay is not None:
            import ray

            with contextlib.suppress(Exception):
                ray.kill(relay)
