"""Sessions and their peer connections: admission, SDP offer/answer, and every way one ends.

:class:`SessionManager` owns the sessions of one server. ``offer()`` admits a client (or raises
:class:`AdmissionError`), negotiates an aiortc ``RTCPeerConnection`` that sends the session's
:class:`~voice_out.server.track.UtteranceTrack` on the client's recvonly audio transceiver, and
joins the client's data channel ``voice_out`` to the session. A session ends when its data
channel closes, its connection fails or closes, it does not connect within
``connect_timeout_s``, or the server shuts down; ending cancels its streams, awaits its tasks
and closes the peer connection. Every task the manager starts is tracked and awaited.

Threads: asyncio thread only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription
from aiortc import sdp as aiortc_sdp
from aiortc.rtcdatachannel import RTCDataChannel

from voice_out.config import IceServer, ServerConfig
from voice_out.engine.api import EngineLike
from voice_out.errors import VoiceOutError
from voice_out.server.metrics import Metrics
from voice_out.server.protocol import CHANNEL_LABEL, Error, ErrorCode
from voice_out.server.session import Session
from voice_out.server.track import Clock, UtteranceTrack

log = logging.getLogger(__name__)

#: Media sections an offer may carry: ours needs two (audio, data); a page may add a few.
MAX_OFFER_SECTIONS = 8
#: Lines an offer may have (a browser's has ~100-150): bounds the cost of parsing it.
MAX_OFFER_LINES = 2000
#: ICE candidates per media section (a host with many interfaces offers a dozen or two).
MAX_OFFER_CANDIDATES = 64
#: How long a closing session waits for its last messages to leave on the data channel (s).
DRAIN_TIMEOUT_S = 1.0


class AdmissionError(VoiceOutError):
    """An offer refused (HTTP 503 for capacity, 400 for a bad offer). ``code`` is stable."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def ice_configuration(servers: Sequence[IceServer]) -> RTCConfiguration:
    """The peer connection's configuration for ``server.ice_servers``.

    None configured: host candidates only, nothing is ever sent to a STUN server (aiortc's
    default would be a public one). aiortc gathers through the first ``stun:`` URL and the
    first ``turn:``/``turns:`` URL of the list only (the page's browser uses them all); each
    session's answer waits for that gathering, a TURN allocation included."""
    return RTCConfiguration(
        iceServers=[RTCIceServer(urls=list(s.urls), username=s.username, credential=s.credential) for s in servers]
    )


def canonical_offer(sdp: str) -> str:
    """Parse ``sdp`` and write it back as aiortc does (any thread; pure Python, ~1 ms per 100
    lines, so the server runs it in an executor). What aiortc does not read is dropped, so the
    parse ``setRemoteDescription`` repeats on the event loop is of a short text. Raises
    AdmissionError (400 bad_offer) for an offer that cannot be parsed or is too large."""
    try:
        description = aiortc_sdp.SessionDescription.parse(sdp)
    except Exception as e:  # aiortc's parser raises whatever its input trips (IndexError, ...)
        raise AdmissionError(400, "bad_offer", f"the offer is not valid SDP ({type(e).__name__}: {e})") from None
    for media in description.media:
        if len(media.ice_candidates) > MAX_OFFER_CANDIDATES:
            raise AdmissionError(
                400,
                "bad_offer",
                f"the offer's {media.kind} section has {len(media.ice_candidates)} ICE candidates; "
                f"at most {MAX_OFFER_CANDIDATES}",
            )
    return str(description)


def check_offer_size(sdp: str) -> None:
    """Cheap bounds checked on the event loop before the offer is parsed at all."""
    n_lines = sdp.count("\n") + 1
    if n_lines > MAX_OFFER_LINES:
        raise AdmissionError(400, "bad_offer", f"the offer has {n_lines} lines; at most {MAX_OFFER_LINES}")
    n_sections = sdp.startswith("m=") + sdp.count("\nm=")
    if n_sections > MAX_OFFER_SECTIONS:
        raise AdmissionError(
            400, "bad_offer", f"the offer has {n_sections} media sections (m= lines); at most {MAX_OFFER_SECTIONS}"
        )
    if "m=audio" not in sdp:
        raise AdmissionError(
            400, "bad_offer", "the offer has no audio section: add a recvonly audio transceiver before the offer"
        )


def guard_text_decoding(pc: RTCPeerConnection, on_bad_text: Callable[[UnicodeDecodeError], None]) -> None:
    """Keep a data-channel text message that is not UTF-8 from ending the connection.

    aiortc decodes each string message with ``data.decode("utf8")`` inside its SCTP receive
    path (aiortc 1.x ``RTCSctpTransport._data_channel_receive``); the UnicodeDecodeError ends
    the association, so the session would close without a word while the client believes it
    is connected. Wrapped here at our boundary: such a message is dropped and
    ``on_bad_text`` reports it. (A channel-open request whose label is not UTF-8 is dropped
    the same way: that channel never opens.) Call after ``setRemoteDescription``, which
    creates the SCTP transport."""
    sctp = pc.sctp
    receive = getattr(sctp, "_data_channel_receive", None)
    if sctp is None or receive is None:
        raise RuntimeError("aiortc's SCTP transport has changed: update guard_text_decoding for this version")

    async def guarded(stream_id: int, pp_id: int, data: bytes) -> None:
        try:
            await receive(stream_id, pp_id, data)
        except UnicodeDecodeError as e:
            on_bad_text(e)

    sctp._data_channel_receive = guarded  # type: ignore[method-assign]  # this connection only


class ChannelSink:
    """Sends a session's messages on its data channel (dropped once the channel is not open)."""

    def __init__(self, channel: RTCDataChannel) -> None:
        self.channel = channel

    def send(self, text: str) -> None:
        if self.channel.readyState == "open":
            self.channel.send(text)

    def close(self) -> None:
        """The peer connection closes the channel."""


@dataclass(eq=False)
class Peer:
    session: Session
    pc: RTCPeerConnection
    connected: asyncio.Event
    watch: asyncio.Task[None] | None = None
    channel: RTCDataChannel | None = None
    sink: ChannelSink | None = None


class SessionManager:
    """The sessions of one server (see the module docstring)."""

    def __init__(
        self,
        engine: EngineLike,
        metrics: Metrics,
        *,
        max_sessions: int = 32,
        max_queued_utterances: int = 16,
        max_text_chars: int = 4000,
        connect_timeout_s: float = 30.0,
        clock_factory: Callable[[], Clock] | None = None,
        frame_ms: int = ServerConfig.frame_ms,
        ice_servers: Sequence[IceServer] = (),
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_sessions = max_sessions
        self.max_queued_utterances = max_queued_utterances
        self.max_text_chars = max_text_chars
        self.connect_timeout_s = connect_timeout_s
        self.clock_factory = clock_factory
        self.frame_ms = frame_ms
        self.ice_servers = tuple(ice_servers)
        self.peers: dict[str, Peer] = {}
        self.accepting = True
        self._tasks: set[asyncio.Task[None]] = set()

    # -- queries -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.peers)

    def get(self, session_id: str) -> Session | None:
        peer = self.peers.get(session_id)
        return peer.session if peer is not None else None

    @property
    def n_tasks(self) -> int:
        """Tasks of the manager and of every session (for leak checks)."""
        return len(self._tasks) + sum(p.session.n_tasks for p in self.peers.values())

    def check_admission(self) -> None:
        """Raise :class:`AdmissionError` (503) unless a new session can be admitted now."""
        if not self.accepting or not self.engine.ready:
            raise AdmissionError(503, "not_ready", "the server is starting or shutting down; retry shortly")
        if len(self.peers) >= self.max_sessions:
            self.metrics.sessions_rejected.inc()
            raise AdmissionError(
                503,
                "too_many_sessions",
                f"the server is at its limit of {self.max_sessions} sessions; retry later",
            )

    # -- lifecycle -----------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def offer(self, sdp: str) -> dict[str, str]:
        """Admit a client and answer its SDP offer: ``{"sdp", "type": "answer", "session_id"}``."""
        self.check_admission()
        check_offer_size(sdp)
        # parsed off the event loop: even a bounded offer costs ~10 ms of pure Python
        sdp = await asyncio.get_running_loop().run_in_executor(None, canonical_offer, sdp)
        self.check_admission()  # it may have changed while the offer was parsed
        session_id = uuid.uuid4().hex
        clock = self.clock_factory() if self.clock_factory is not None else None
        track = UtteranceTrack(sample_rate=self.engine.sample_rate, clock=clock, frame_ms=self.frame_ms, encode=True)
        session = Session(
            session_id,
            self.engine,
            metrics=self.metrics,
            max_queued_utterances=self.max_queued_utterances,
            max_text_chars=self.max_text_chars,
            track=track,
        )
        pc = RTCPeerConnection(ice_configuration(self.ice_servers))
        peer = Peer(session, pc, asyncio.Event())
        self.peers[session_id] = peer  # counted from now on, so concurrent offers respect the limit
        self.metrics.active_sessions.inc()

        @pc.on("datachannel")
        def on_datachannel(channel: RTCDataChannel) -> None:
            if channel.label != CHANNEL_LABEL:
                log.info("session %s: closing data channel %r (expected %r)", session_id, channel.label, CHANNEL_LABEL)
                channel.close()
                return
            sink = ChannelSink(channel)
            peer.channel, peer.sink = channel, sink

            @channel.on("message")
            def on_message(message: str | bytes) -> None:
                session.receive(message, reply=sink)

            @channel.on("close")
            def on_close() -> None:
                self.end(session_id, "data channel closed")

            session.add_sink(sink)

        @pc.on("connectionstatechange")
        def on_state() -> None:
            state = pc.connectionState
            if state == "connected":
                peer.connected.set()
            elif state in ("failed", "closed"):
                self.end(session_id, f"connection {state}")

        def on_bad_text(e: UnicodeDecodeError) -> None:
            log.warning("session %s: dropped a data-channel text message that is not UTF-8 (%s)", session_id, e)
            session.reply_error(
                ErrorCode.BAD_JSON,
                f"a text message that is not UTF-8 was dropped (byte {e.start}); send JSON text",
                peer.sink,
            )

        try:
            await pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
            guard_text_decoding(pc, on_bad_text)
            pc.addTrack(track)
            answer = await pc.createAnswer()
            await pc.setLocalDescription(answer)
        except Exception as e:
            await self.close(session_id)
            raise AdmissionError(400, "bad_offer", f"the offer could not be negotiated: {e}") from None
        peer.watch = self._spawn(self._watch_connect(session_id, peer), name=f"connect-watch {session_id}")
        local = pc.localDescription
        return {"sdp": local.sdp, "type": local.type, "session_id": session_id}

    async def _watch_connect(self, session_id: str, peer: Peer) -> None:
        try:
            await asyncio.wait_for(peer.connected.wait(), self.connect_timeout_s)
        except TimeoutError:
            log.info("session %s: not connected after %.0f s; closing", session_id, self.connect_timeout_s)
            self.end(session_id, "connect timeout")

    def end(self, session_id: str, reason: str) -> None:
        """Close a session from a synchronous callback (the close runs as an owned task)."""
        if session_id in self.peers:
            log.info("session %s: ending (%s)", session_id, reason)
            self._spawn(self.close(session_id), name=f"close {session_id}")

    async def close(self, session_id: str, notice: Error | None = None) -> None:
        """Close one session and its peer connection (idempotent). With ``notice`` the
        client is told (each live utterance ``cancelled``, then ``notice``) and those messages
        leave on the data channel before the connection closes."""
        peer = self.peers.pop(session_id, None)
        if peer is None:
            return
        self.metrics.active_sessions.dec()
        if peer.watch is not None and peer.watch is not asyncio.current_task():
            peer.watch.cancel()
        try:
            await peer.session.close(notice)
            if notice is not None and peer.channel is not None:
                await _drain(peer.channel, DRAIN_TIMEOUT_S)
        finally:
            with contextlib.suppress(Exception):
                await peer.pc.close()

    async def close_all(self) -> None:
        """Stop admitting, close every session (telling its clients: ``shutting_down``), then
        await every task the manager started."""
        self.accepting = False
        notice = Error(None, ErrorCode.SHUTTING_DOWN, "the server is shutting down; this session ends")
        await asyncio.gather(*(self.close(sid, notice) for sid in list(self.peers)), return_exceptions=True)
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


async def _drain(channel: RTCDataChannel, timeout_s: float) -> None:
    """Wait until ``channel`` has handed every queued message to the network (or it closed,
    or ``timeout_s`` passed)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while channel.readyState == "open" and channel.bufferedAmount > 0:
        if asyncio.get_running_loop().time() > deadline:
            log.info("data channel %s: %d bytes not sent at close", channel.label, channel.bufferedAmount)
            return
        await asyncio.sleep(0.01)
