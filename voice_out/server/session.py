"""A session: one listener's audio track, fed by engine streams driven by protocol v1 messages.

Messages arrive on the data channel ``voice_out`` (the browser) and on any number of control
WebSockets (an agent backend); events go to all of them. A reply to one message (``error`` for
bad input, ``pong``) goes only to whoever sent it.

Ownership: the session owns one pump task per utterance (engine stream -> track). ``close()``
cancels every stream, cancels and awaits every task and stops the track; after it nothing of
the session runs. Nothing a client sends raises out of :meth:`Session.receive`.

Threads: everything here runs on the asyncio thread.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from voice_out.engine.api import SAMPLE_RATE, EngineError, EngineLike, PcmChunk, Stream
from voice_out.errors import VoiceOutError
from voice_out.server import protocol as p
from voice_out.server.metrics import Metrics
from voice_out.server.track import (
    Done,
    Late,
    Played,
    Silenced,
    Started,
    TrackEvent,
    Underrun,
    UtteranceTrack,
    heard_text,
)

log = logging.getLogger(__name__)

#: How much synthesized audio a pump lets pile up in the track per utterance before it stops
#: pulling from the engine. Keep it below the engine's own ``max_ahead_s`` (4 s by default): then
#: the time a pump waits on the engine is real synthesis time (the RTF metric), never the
#: engine holding back for the listener.
MAX_BUFFERED_S = 1.0
#: Tell the engine what was played at most this often (samples).
ACK_EVERY_SAMPLES = 2400
#: Ids of ended utterances remembered to tell "closed" from "unknown" (bounded).
REMEMBERED_IDS = 1024


class Sink(Protocol):
    """Where a session's messages go (the data channel, a control WebSocket)."""

    def send(self, text: str) -> None:
        """Deliver one JSON message; must not block or raise."""
        ...

    def close(self) -> None:
        """The session ended."""
        ...


class UtteranceState(enum.Enum):
    OPEN = "open"  # text may still arrive
    TEXT_DONE = "text_done"  # text.done received; audio may still be coming or playing
    PLAYED = "played"  # audio.done sent
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass(eq=False)
class Utterance:
    id: str
    seq: int
    stream: Stream
    t_first_delta: float
    state: UtteranceState = UtteranceState.OPEN
    task: asyncio.Task[None] | None = None
    engine_wait_s: float = 0.0
    n_samples: int = 0
    n_acked: int = 0
    #: A high surrogate that ended the last delta, joined to the low one the next begins with.
    held: str = ""
    #: ``audio.alignment`` events asked for on the first delta.
    alignment: bool = False


def _alignment_event(u: Utterance, chunk: PcmChunk) -> p.AudioAlignment:
    """The chunk's characters and their times in ms from the utterance's first sample."""
    a = chunk.alignment
    assert a is not None
    ms = 1000.0 / SAMPLE_RATE
    starts = tuple(s * ms for s in a.start_samples)
    durations = tuple((e - s) * ms for s, e in zip(a.start_samples, a.end_samples, strict=True))
    return p.AudioAlignment(u.id, u.stream.text[a.char_start : a.char_end], starts, durations)


def _lone_low_surrogate(uid: str) -> p.ProtocolError:
    return p.ProtocolError(
        p.ErrorCode.BAD_FIELD,
        f"utterance {uid!r}: the delta starts with a low surrogate that no high surrogate precedes (not text)",
        uid,
    )


def _join_split_character(u: Utterance, delta: str) -> tuple[str, bool]:
    """The text of ``delta`` to push, joining a character split across deltas by UTF-16 unit
    (``"Hi \\ud83d"`` then ``"\\ude00 there"``), and whether a held half had to be dropped.

    A high surrogate ending ``delta`` is held in ``u.held`` for the next one. Raises
    ProtocolError (bad_field) for a low surrogate with nothing to join (:func:`parse` refuses
    surrogates anywhere else)."""
    held, dropped = u.held, False
    u.held = ""
    if delta and p.is_low_surrogate(delta[0]):
        if not held:
            raise _lone_low_surrogate(u.id)
        # one code point from the pair, as a UTF-16 decoder makes it
        delta = (held + delta[0]).encode("utf-16-le", "surrogatepass").decode("utf-16-le") + delta[1:]
    elif held:
        dropped = True
    if delta and p.is_high_surrogate(delta[-1]):
        u.held, delta = delta[-1], delta[:-1]
    return delta, dropped


def _error_code(exc: VoiceOutError) -> p.ErrorCode:
    """The protocol code of an engine or voice-store error."""
    code = str(getattr(exc, "code", "internal"))
    if code == "invalid_voice_name":  # a name no voice can have
        return p.ErrorCode.UNKNOWN_VOICE
    if code == "stream_closed":  # the engine already ended this utterance (e.g. its length guard)
        return p.ErrorCode.UTTERANCE_CLOSED
    try:
        return p.ErrorCode(code)
    except ValueError:
        pass
    if isinstance(exc, EngineError):
        return p.ErrorCode.INTERNAL
    return p.ErrorCode.VOICE_UNUSABLE  # a stored voice that is damaged or made for another model


class Session:
    """Joins protocol messages to engine streams and the session's :class:`UtteranceTrack`."""

    def __init__(
        self,
        session_id: str,
        engine: EngineLike,
        *,
        metrics: Metrics | None = None,
        max_queued_utterances: int = 16,
        max_text_chars: int = 4000,
        track: UtteranceTrack | None = None,
    ) -> None:
        self.id = session_id
        self.engine = engine
        self.metrics = metrics or Metrics()
        self.max_queued_utterances = max_queued_utterances
        self.max_text_chars = max_text_chars
        self.track = track or UtteranceTrack(sample_rate=engine.sample_rate)
        self.track.on_event = self._on_track_event
        self.clock = self.track.clock
        self.live: OrderedDict[str, Utterance] = OrderedDict()  # start order
        self._ended: OrderedDict[str, int] = OrderedDict()  # id -> seq of ended utterances
        # ids whose first delta was refused (no_voice, ...): the error said so once; the
        # text.done a client sent right behind that delta is not a second mistake
        self._refused: OrderedDict[str, None] = OrderedDict()
        self._seq = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._sinks: list[Sink] = []
        self.closed = False
        self._closing: asyncio.Task[None] | None = None

    # -- wiring --------------------------------------------------------------------------------

    def add_sink(self, sink: Sink, *, greet: bool = True) -> None:
        """Mirror events to ``sink``; ``greet`` sends it ``session.ready`` first."""
        self._sinks.append(sink)
        if greet:
            self._send_to(sink, self.ready_message())

    def remove_sink(self, sink: Sink) -> None:
        if sink in self._sinks:
            self._sinks.remove(sink)

    def ready_message(self) -> p.SessionReady:
        return p.SessionReady(self.id, self.engine.sample_rate, tuple(self.engine.voice_names()))

    @property
    def n_tasks(self) -> int:
        return len(self._tasks)

    def _send_to(self, sink: Sink, msg: p.ServerMessage) -> None:
        if isinstance(msg, p.Error):
            self.metrics.errors.labels(code=msg.code).inc()
        try:
            sink.send(p.dumps(msg))
        except Exception:  # a broken sink must not break the session
            log.exception("session %s: sending to %r failed", self.id, sink)

    def _broadcast(self, msg: p.ServerMessage) -> None:
        for sink in list(self._sinks):
            self._send_to(sink, msg)

    # -- input ---------------------------------------------------------------------------------

    def receive(self, raw: str | bytes, reply: Sink | None = None) -> None:
        """Apply one raw client message. Errors go to ``reply`` (or everyone); never raises."""
        if self.closed:
            return
        try:
            self.handle(p.parse(raw), reply)
        except p.ProtocolError as e:
            self._reply(reply, p.error_from(e))
        except Exception:
            log.exception("session %s: internal error handling a message", self.id)
            self._reply(reply, p.Error(None, p.ErrorCode.INTERNAL, "internal error; the session goes on"))

    def reply_error(self, code: p.ErrorCode, message: str, reply: Sink | None = None) -> None:
        """Tell ``reply`` (None: everyone) about bad input that never became a message (e.g. a
        data-channel text that is not UTF-8); the session goes on."""
        self._reply(reply, p.Error(None, code, message))

    def _reply(self, reply: Sink | None, msg: p.ServerMessage) -> None:
        if reply is None:
            self._broadcast(msg)
        else:
            self._send_to(reply, msg)

    def handle(self, msg: p.ClientMessage, reply: Sink | None = None) -> None:
        """Apply a parsed message. Raises :class:`~voice_out.server.protocol.ProtocolError`."""
        if isinstance(msg, p.Cancel):
            self.cancel(msg.id)
        elif isinstance(msg, p.TextDelta):
            self._text_delta(msg)
        elif isinstance(msg, p.TextDone):
            self._text_done(msg)
        elif isinstance(msg, p.Ping):
            self._reply(reply, p.Pong(msg.t))

    def _text_delta(self, msg: p.TextDelta) -> None:
        u = self.live.get(msg.id)
        if u is None:
            if msg.id in self._ended:
                raise p.ProtocolError(
                    p.ErrorCode.UTTERANCE_CLOSED, f"utterance {msg.id!r} has ended; start a new id", msg.id
                )
            try:
                if msg.delta and p.is_low_surrogate(msg.delta[0]):
                    raise _lone_low_surrogate(msg.id)
                u = self._start(msg)
            except p.ProtocolError:
                self._refused[msg.id] = None
                while len(self._refused) > REMEMBERED_IDS:
                    self._refused.popitem(last=False)
                raise
            self._refused.pop(msg.id, None)
        elif u.state is not UtteranceState.OPEN:
            raise p.ProtocolError(
                p.ErrorCode.UTTERANCE_CLOSED, f"utterance {msg.id!r} got text.done; start a new id", msg.id
            )
        if len(u.stream.text) + len(msg.delta) > self.max_text_chars:
            raise p.ProtocolError(
                p.ErrorCode.TEXT_TOO_LONG,
                f"utterance {msg.id!r} would exceed {self.max_text_chars} characters; this delta was dropped",
                msg.id,
            )
        delta, dropped = _join_split_character(u, msg.delta)
        try:
            u.stream.push_text(delta)
        except VoiceOutError as e:
            raise p.ProtocolError(_error_code(e), str(e), msg.id) from None
        if dropped:
            raise p.ProtocolError(
                p.ErrorCode.BAD_FIELD,
                f"utterance {msg.id!r}: the previous delta ended in a lone high surrogate (half a character); "
                "it was dropped and this delta applied",
                msg.id,
            )

    def _start(self, msg: p.TextDelta) -> Utterance:
        if len(self.live) >= self.max_queued_utterances:
            raise p.ProtocolError(
                p.ErrorCode.TOO_MANY_UTTERANCES,
                f"{len(self.live)} utterances are already queued (limit {self.max_queued_utterances})",
                msg.id,
            )
        if len(msg.delta) > self.max_text_chars:
            raise p.ProtocolError(
                p.ErrorCode.TEXT_TOO_LONG, f"delta longer than {self.max_text_chars} characters", msg.id
            )
        if not self.engine.ready:
            raise p.ProtocolError(p.ErrorCode.NOT_READY, "the engine is not accepting streams now", msg.id)
        try:
            # auto_ack off: the track acks what was *played*, so the engine's back-pressure
            # follows the listener, not this session's buffer.
            stream = self.engine.open_stream(
                msg.voice,
                stream_id=f"{self.id}/{msg.id}",
                auto_ack=False,
                fast_first=msg.fast_first,
                instructions=msg.instructions,
                speed=1.0 if msg.speed is None else msg.speed,
            )
        except VoiceOutError as e:
            code = _error_code(e)
            # bad_field: an option of this text.delta out of the engine's range (fast_first,
            # speed, instructions)
            text = f"text.delta: {e}" if code is p.ErrorCode.BAD_FIELD else str(e)
            raise p.ProtocolError(code, text, msg.id) from None
        self._seq += 1
        u = Utterance(msg.id, self._seq, stream, self.clock.now(), alignment=msg.alignment)
        self.live[msg.id] = u
        self.track.open(msg.id)
        u.task = asyncio.get_running_loop().create_task(self._pump(u), name=f"pump {self.id}/{msg.id}")
        self._tasks.add(u.task)
        u.task.add_done_callback(self._tasks.discard)
        self.metrics.utterances.inc()
        self.metrics.active_streams.inc()
        return u

    def _text_done(self, msg: p.TextDone) -> None:
        u = self.live.get(msg.id)
        if u is None:
            if msg.id in self._ended or msg.id in self._refused:
                return  # cancelled, failed or refused meanwhile: nothing left to finish
            raise p.ProtocolError(p.ErrorCode.UNKNOWN_ID, f"text.done for unknown utterance {msg.id!r}", msg.id)
        if u.state is UtteranceState.OPEN:
            u.state = UtteranceState.TEXT_DONE
            try:
                u.stream.end_text()
            except EngineError as e:
                raise p.ProtocolError(_error_code(e), str(e), msg.id) from None

    def cancel(self, uid: str | None = None) -> list[p.Cancelled]:
        """Barge-in: cut ``uid`` and every utterance started after it (None: all), now.

        Streams are cancelled (the engine stops working on them), their pumps are cancelled,
        queued audio is dropped with a <= 5 ms fade and ``cancelled`` is sent per utterance.
        """
        if uid is None:
            victims = list(self.live.values())
        else:
            if uid in self.live:
                seq = self.live[uid].seq
            elif uid in self._ended:
                seq = self._ended[uid] + 1  # already ended: cut only what came after it
            else:
                raise p.ProtocolError(p.ErrorCode.UNKNOWN_ID, f"cancel for unknown utterance {uid!r}", uid)
            victims = [u for u in self.live.values() if u.seq >= seq]
        if not victims:
            return []
        for u in victims:
            u.stream.cancel()
            if u.task is not None:
                u.task.cancel()
        reports = {r.id: r for r in self.track.flush(victims[0].id)}
        out = []
        for u in victims:
            r = reports.get(u.id)
            n_samples = r.n_samples if r else 0
            text_end = r.text_end if r else 0
            msg = p.Cancelled(
                u.id,
                1000.0 * n_samples / self.track.sample_rate,
                heard_text(u.stream.text, text_end, u.state is not UtteranceState.OPEN) if n_samples else "",
            )
            self._retire(u, UtteranceState.CANCELLED)
            self.metrics.cancels.inc()
            self._broadcast(msg)
            out.append(msg)
        return out

    # -- engine -> track -----------------------------------------------------------------------

    async def _pump(self, u: Utterance) -> None:
        """Pull ``u``'s chunks from the engine into the track, at most MAX_BUFFERED_S ahead."""
        max_buffered = int(MAX_BUFFERED_S * self.track.sample_rate)
        try:
            chunks = u.stream.__aiter__()
            while True:
                t0 = self.clock.now()
                try:
                    chunk: PcmChunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
                u.engine_wait_s += self.clock.now() - t0
                u.n_samples += len(chunk.pcm)
                self.track.push(u.id, chunk)
                if (
                    u.alignment
                    and chunk.alignment is not None
                    and chunk.alignment.char_end > chunk.alignment.char_start
                ):
                    self._broadcast(_alignment_event(u, chunk))
                if chunk.final:
                    break
                await self.track.wait_room(u.id, max_buffered)
            self.track.finish(u.id)
            if u.n_samples:
                self.metrics.rtf.observe(u.engine_wait_s * self.track.sample_rate / u.n_samples)
        except asyncio.CancelledError:
            raise
        except EngineError as e:
            self._fail(u, _error_code(e), str(e) or "the engine failed on this utterance")
        except Exception:
            log.exception("session %s: utterance %s failed", self.id, u.id)
            self._fail(u, p.ErrorCode.INTERNAL, "internal error while synthesizing; the session goes on")

    def _fail(self, u: Utterance, code: p.ErrorCode, message: str) -> None:
        if self.live.get(u.id) is not u:
            return
        self.track.drop(u.id)
        self._retire(u, UtteranceState.FAILED)
        self._broadcast(p.Error(u.id, code, message))

    def _retire(self, u: Utterance, state: UtteranceState) -> None:
        """``u`` leaves the live set (played, cancelled or failed)."""
        if self.live.pop(u.id, None) is None:
            return
        u.state = state
        if not u.stream.state.terminal:
            u.stream.cancel()
        self._ended[u.id] = u.seq
        while len(self._ended) > REMEMBERED_IDS:
            self._ended.popitem(last=False)
        self.metrics.active_streams.dec()

    def _on_track_event(self, ev: TrackEvent) -> None:
        if isinstance(ev, Started):
            u = self.live.get(ev.id)
            if u is not None:
                ttfa_s = max(0.0, ev.t - u.t_first_delta)
                self.metrics.ttfa.observe(ttfa_s)
                self._broadcast(p.AudioStarted(ev.id, 1000.0 * ttfa_s))
        elif isinstance(ev, Played):
            u = self.live.get(ev.id)
            if u is not None and ev.n_samples - u.n_acked >= ACK_EVERY_SAMPLES:
                u.n_acked = ev.n_samples
                u.stream.ack(ev.n_samples)
        elif isinstance(ev, Done):
            u = self.live.get(ev.id)
            if u is not None:
                self._retire(u, UtteranceState.PLAYED)
                self._broadcast(p.AudioDone(ev.id, 1000.0 * ev.n_samples / self.track.sample_rate))
        elif isinstance(ev, Underrun):
            self.metrics.underruns.inc()
        elif isinstance(ev, Silenced):
            self.metrics.barge_in.observe(ev.latency_s)
        elif isinstance(ev, Late):
            self.metrics.late_frames.observe(ev.lag_s)

    # -- shutdown ------------------------------------------------------------------------------

    async def close(self, notice: p.Error | None = None) -> None:
        """Cancel every stream (each live utterance's clients get ``cancelled``, then
        ``notice`` if given, e.g. ``shutting_down``), cancel and await every task, stop the
        track (its codec freed now, not when the garbage collector runs). Idempotent."""
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(self._close(notice))
        await asyncio.shield(self._closing)

    async def _close(self, notice: p.Error | None) -> None:
        self.closed = True
        self.cancel()  # every live utterance: cancelled (what was heard), stream and pump stopped
        if notice is not None:
            self._broadcast(notice)
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self.track.flush()
        self.track.stop()
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            try:
                sink.close()
            except Exception:
                log.exception("session %s: closing %r failed", self.id, sink)

    def __repr__(self) -> str:
        return f"<Session {self.id} live={list(self.live)} tasks={len(self._tasks)}>"
