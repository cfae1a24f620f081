"""A Python WebRTC client of a voice_out server: protocol v1 over the data channel, audio decoded
to PCM with arrival times. Used by the tests and the benchmark; usable by agents.

    client = await connect("http://127.0.0.1:8080", token=None)
    client.send_text("u1", "Hello, wor", voice="alice")
    client.send_text("u1", "ld!")
    client.done("u1")
    started = await client.wait_for("audio.started", "u1")
    ...
    client.cancel()                      # barge-in
    cut = await client.wait_for("cancelled", "u1")
    await client.close()

Received audio frames are kept in ``client.frames`` (48 kHz mono float32, with the
``time.monotonic()`` they were decoded at; the last minute by default, see ``max_frames``),
every server message in ``client.events``.

Threads: asyncio thread only. The send methods are synchronous (aiortc queues the message).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp
import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.rtcdatachannel import RTCDataChannel
from av import AudioFrame

from voice_out.errors import VoiceOutError
from voice_out.server import protocol as p

#: Peak (full scale 1.0) below which a decoded frame counts as silent.
SILENCE_PEAK = 1e-3
#: Decoded frames a client keeps by default: the last minute at the server's default 10 ms
#: frames (a frame of 480 float32 samples is 1.9 KB, so about 11.5 MB). None keeps everything.
DEFAULT_MAX_FRAMES = 6000


class ClientError(VoiceOutError):
    """The server refused the connection or did not answer in time."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(frozen=True)
class ReceivedFrame:
    """One decoded audio frame: ``pcm`` float32 [n] mono at ``sample_rate``."""

    t: float  # time.monotonic() when it was decoded
    pts: int  # RTP timestamp (units of 1/sample_rate)
    pcm: np.ndarray
    sample_rate: int

    @property
    def peak(self) -> float:
        return float(np.max(np.abs(self.pcm))) if len(self.pcm) else 0.0

    @property
    def rms(self) -> float:
        return float(np.sqrt(np.mean(self.pcm.astype(np.float64) ** 2))) if len(self.pcm) else 0.0

    @property
    def audible(self) -> bool:
        return self.peak >= SILENCE_PEAK

    @property
    def duration_ms(self) -> float:
        """The frame's duration (the server's frame size: 10 or 20 ms)."""
        return 1000.0 * len(self.pcm) / self.sample_rate


@dataclass(frozen=True)
class ReceivedEvent:
    t: float  # time.monotonic() when it arrived
    message: p.ServerMessage


class VoiceOutClient:
    """A connected session. Build it with :func:`connect`."""

    def __init__(
        self,
        pc: RTCPeerConnection,
        channel: RTCDataChannel,
        http: aiohttp.ClientSession | None,
        *,
        max_frames: int | None = DEFAULT_MAX_FRAMES,
    ) -> None:
        self.pc = pc
        self.channel = channel
        self.session_id = ""
        self.sample_rate = 0
        self.voices: tuple[str, ...] = ()
        #: The most recent decoded frames (at most ``max_frames``; None keeps all).
        self.frames: deque[ReceivedFrame] = deque(maxlen=max_frames)
        self.events: list[ReceivedEvent] = []
        self._cursor = 0
        self._changed = asyncio.Event()
        self._http = http
        self._reader: asyncio.Task[None] | None = None
        self.closed = False

        @channel.on("message")
        def on_message(message: str | bytes) -> None:
            if isinstance(message, str):
                try:
                    msg = p.parse_server(message)
                except (ValueError, TypeError):
                    return
                self.events.append(ReceivedEvent(time.monotonic(), msg))
                self._changed.set()

        @pc.on("track")
        def on_track(track: MediaStreamTrack) -> None:
            if track.kind == "audio" and self._reader is None:
                self._reader = asyncio.get_running_loop().create_task(self._read_audio(track))

    async def _read_audio(self, track: MediaStreamTrack) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            if not isinstance(frame, AudioFrame):
                continue
            pcm = frame.to_ndarray()  # s16, [1, n * channels] interleaved (packed)
            channels = len(frame.layout.channels)
            mono = pcm.reshape(-1, channels).astype(np.float32).mean(axis=1) / 32768.0
            self.frames.append(ReceivedFrame(time.monotonic(), int(frame.pts or 0), mono, frame.sample_rate))

    # -- sending -------------------------------------------------------------------------------

    def send_raw(self, text: str | bytes) -> float:
        """Send one raw message; returns the ``time.monotonic()`` it was sent at."""
        if self.channel.readyState != "open":
            raise ClientError("the data channel is not open")
        self.channel.send(text)
        return time.monotonic()

    def send_text(
        self,
        uid: str,
        delta: str,
        voice: str | None = None,
        fast_first: int | None = None,
        alignment: bool = False,
        *,
        instructions: str | None = None,
        speed: float | None = None,
    ) -> float:
        """Send a ``text.delta``; ``voice``, ``fast_first``, ``alignment`` (ask for
        ``audio.alignment`` events), ``instructions`` and ``speed`` count on an utterance's
        first one."""
        msg: dict[str, object] = {"type": "text.delta", "id": uid, "delta": delta}
        options = {"voice": voice, "fast_first": fast_first, "instructions": instructions, "speed": speed}
        msg.update({k: v for k, v in options.items() if v is not None})
        if alignment:
            msg["alignment"] = True
        return self._send(msg)

    def done(self, uid: str) -> float:
        return self._send({"type": "text.done", "id": uid})

    def cancel(self, uid: str | None = None) -> float:
        return self._send({"type": "cancel"} if uid is None else {"type": "cancel", "id": uid})

    def ping(self, t: float) -> float:
        return self._send({"type": "ping", "t": t})

    def _send(self, msg: dict[str, object]) -> float:
        return self.send_raw(json.dumps(msg))

    # -- receiving -----------------------------------------------------------------------------

    async def next_event(self, timeout_s: float = 10.0) -> p.ServerMessage:
        """The next server message not yet consumed by ``next_event`` / ``wait_for``."""
        deadline = time.monotonic() + timeout_s
        while self._cursor >= len(self.events):
            self._changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no server message within {timeout_s} s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        ev = self.events[self._cursor]
        self._cursor += 1
        return ev.message

    async def wait_for(
        self,
        type_: str | Callable[[p.ServerMessage], bool],
        uid: str | None = None,
        timeout_s: float = 10.0,
    ) -> p.ServerMessage:
        """Consume messages up to the first of ``type_`` (and ``uid``, if given)."""
        deadline = time.monotonic() + timeout_s
        while True:
            msg = await self.next_event(max(0.0, deadline - time.monotonic()))
            if callable(type_):
                if type_(msg):
                    return msg
            elif msg.TYPE == type_ and (uid is None or getattr(msg, "id", None) == uid):
                return msg

    async def messages(self) -> AsyncIterator[p.ServerMessage]:
        """Server messages as they arrive (until the client closes)."""
        while not self.closed:
            try:
                yield await self.next_event(timeout_s=3600.0)
            except TimeoutError:
                continue

    def frames_since(self, t: float) -> list[ReceivedFrame]:
        return [f for f in self.frames if f.t >= t]

    def first_audible(self, since: float) -> ReceivedFrame | None:
        """The first audible frame decoded at or after ``since`` (end-to-end TTFA: its ``t``)."""
        return next((f for f in self.frames if f.t >= since and f.audible), None)

    def last_audible(self, since: float) -> ReceivedFrame | None:
        """The last audible frame decoded at or after ``since`` (barge-in: its ``t``).

        Note: aiortc's receiver holds about four packets in its jitter buffer (40 ms of the
        server's default 10 ms frames, 80 ms of 20 ms ones), so times measured with this client
        include that hold, which a browser's adaptive buffer may not.
        """
        return next((f for f in reversed(self.frames) if f.t >= since and f.audible), None)

    def audio(self, since: float = 0.0) -> np.ndarray:
        """Concatenated mono PCM of the frames decoded at or after ``since``."""
        parts = [f.pcm for f in self.frames if f.t >= since]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    # -- closing -------------------------------------------------------------------------------

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._changed.set()
        await self.pc.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, MediaStreamError):
                await self._reader
        if self._http is not None:
            await self._http.close()

    async def __aenter__(self) -> VoiceOutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def connect(
    url: str,
    token: str | None = None,
    *,
    timeout_s: float = 15.0,
    http: aiohttp.ClientSession | None = None,
    max_frames: int | None = DEFAULT_MAX_FRAMES,
) -> VoiceOutClient:
    """Open a session on the server at ``url`` (e.g. ``http://127.0.0.1:8080``).

    Returns once ``session.ready`` has arrived. Raises :class:`ClientError` when the server
    refuses (the HTTP status and error code are attached) or does not answer within ``timeout_s``.
    """
    owned = http is None
    session = http or aiohttp.ClientSession()
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    channel = pc.createDataChannel(p.CHANNEL_LABEL)
    pc.addTransceiver("audio", direction="recvonly")
    client = VoiceOutClient(pc, channel, session if owned else None, max_frames=max_frames)
    try:
        await pc.setLocalDescription(await pc.createOffer())
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        body = {"sdp": pc.localDescription.sdp, "type": pc.localDescription.type}
        async with session.post(url.rstrip("/") + "/offer", json=body, headers=headers) as resp:
            data = await resp.json(content_type=None)
            if resp.status != 200:
                err = data.get("error", {}) if isinstance(data, dict) else {}
                raise ClientError(
                    f"POST /offer: HTTP {resp.status}: {err.get('message', data)}", resp.status, err.get("code")
                )
        await pc.setRemoteDescription(RTCSessionDescription(sdp=data["sdp"], type=data["type"]))
        ready = await client.wait_for("session.ready", timeout_s=timeout_s)
        assert isinstance(ready, p.SessionReady)
        client.session_id = ready.session_id
        client.sample_rate = ready.sample_rate
        client.voices = ready.voices
        if ready.session_id != data["session_id"]:
            raise ClientError("session.ready names another session than the answer")
    except BaseException:
        await client.close()
        raise
    return client
