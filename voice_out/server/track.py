"""The outgoing audio track: utterances played in order, paced by the clock, cut on barge-in.

:class:`UtteranceTrack` is an aiortc ``MediaStreamTrack`` that emits s16 mono frames of
``frame_ms`` (10 or 20 ms). It works on the engine's 24 kHz samples and sends 48 kHz
(upsampled here, which saves the 20 ms that aiortc's Opus-encoder resampler would hold back;
24 kHz output is an option). With ``encode=True`` (the server's way) it encodes each frame to
one Opus packet itself (:class:`OpusFrameEncoder`) and hands aiortc the packet: aiortc's own
encoder packs 20 ms, so a 10 ms frame would wait there for the next one.
``pts`` comes from a sample counter and ``recv`` sleeps until ``start + pts / sample_rate``,
so RTP time never drifts; when there is nothing to play it emits silence, so RTP never stalls.

Utterances are opened in start order and played in that order without gaps: when one ends
inside a frame, the next one fills the rest of that frame. On cancel, queued audio is dropped
and the utterance that was audible gets a linear fade of at most 5 ms (no click), then silence.

The track accounts for what was actually *sent* (handed to the encoder) per utterance, so the
``played_ms`` / ``played_text`` of a cancel are exact: only samples returned by ``recv`` count.

Threads: every method runs on the asyncio thread. The per-frame work is a copy of at most 480
int16 samples, the upsampling, and (``encode=True``) one Opus frame's encoding (~0.1 ms;
libopus runs without the GIL).
"""

from __future__ import annotations

import asyncio
import fractions
import time
import unicodedata
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av import AudioFrame, CodecContext, Packet

from voice_out.engine.api import SAMPLE_RATE, PcmChunk

#: The track's own default frame (tests and scripts); the server passes ``server.frame_ms``
#: (10 by default).
FRAME_MS = 20
#: Frame durations the track (and an Opus packet) may have, ms.
FRAME_MS_CHOICES = (10, 20)
FADE_MS = 5
#: When ``recv`` is called this late, re-anchor the clock instead of sending a burst.
MAX_LAG_S = 0.2
#: A frame built at least this long after its time is reported (:class:`Late`): a browser's
#: jitter buffer grows after late packets and comes down only slowly.
LATE_S = 0.005


class Clock(Protocol):
    """Time source of the track (seconds). Tests inject a fake one."""

    def now(self) -> float: ...

    async def sleep_until(self, t: float) -> None: ...


class MonotonicClock:
    """The real clock: ``time.monotonic`` and ``asyncio.sleep``."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep_until(self, t: float) -> None:
        delay = t - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)


# --------------------------------------------------------------------------------------------
# Events the track reports (delivered synchronously from ``recv``, in order).


@dataclass(frozen=True)
class Started:
    """The first sample of utterance ``id`` went out in a frame at time ``t``."""

    id: str
    t: float


@dataclass(frozen=True)
class Done:
    """The last sample of ``id`` went out at time ``t``; ``n_samples`` were sent in all."""

    id: str
    n_samples: int
    t: float


@dataclass(frozen=True)
class Played:
    """``id`` has now sent ``n_samples`` in all (once per frame in which it sent any)."""

    id: str
    n_samples: int


@dataclass(frozen=True)
class Underrun:
    """``id`` was playing and its buffer ran dry before its audio was complete."""

    id: str


@dataclass(frozen=True)
class Silenced:
    """The fade after a cancel has been sent: ``latency_s`` from cancel to the last audible sample."""

    latency_s: float


@dataclass(frozen=True)
class Late:
    """A frame was built ``lag_s`` after its time (at least :data:`LATE_S`): the event loop was
    busy, or waited for the GIL, when the frame fell due."""

    lag_s: float


TrackEvent = Started | Played | Done | Underrun | Silenced | Late


@dataclass(frozen=True)
class PlayoutReport:
    """What the listener got of one utterance that was removed (cancelled or failed).

    ``n_samples`` excludes the fade-out; ``text_end`` is the ``PcmChunk.text_end`` of the last
    chunk of which at least one sample was sent (0 when nothing was).
    """

    id: str
    n_samples: int
    text_end: int
    sample_rate: int = SAMPLE_RATE

    @property
    def played_ms(self) -> float:
        return 1000.0 * self.n_samples / self.sample_rate


@dataclass(eq=False)
class _Playout:
    """One utterance in the play queue."""

    id: str
    pending: deque[tuple[np.ndarray, int]] = field(default_factory=deque)  # (int16 [n], text_end)
    head_offset: int = 0  # samples of pending[0] already taken
    pending_samples: int = 0
    complete: bool = False  # no more audio will be pushed
    n_sent: int = 0
    text_end: int = 0
    started: bool = False
    starved: bool = False
    room: asyncio.Event = field(default_factory=asyncio.Event)

    def take(self, n: int) -> np.ndarray:
        """Remove and return up to ``n`` samples (int16)."""
        parts: list[np.ndarray] = []
        while n > 0 and self.pending:
            arr, text_end = self.pending[0]
            piece = arr[self.head_offset : self.head_offset + n]
            parts.append(piece)
            self.text_end = text_end
            self.head_offset += len(piece)
            n -= len(piece)
            if self.head_offset >= len(arr):
                self.pending.popleft()
                self.head_offset = 0
        out = np.concatenate(parts) if len(parts) != 1 else parts[0]
        self.pending_samples -= len(out)
        self.n_sent += len(out)
        self.room.set()
        return out

    def peek(self, n: int) -> np.ndarray:
        parts: list[np.ndarray] = []
        offset = self.head_offset
        for arr, _ in self.pending:
            piece = arr[offset : offset + n]
            parts.append(piece)
            n -= len(piece)
            offset = 0
            if n <= 0:
                break
        return np.concatenate(parts) if parts else np.zeros(0, np.int16)


class Upsampler2x:
    """Streaming 2x upsampler (zero-stuffing + a Kaiser-windowed sinc low-pass), s16 -> s16.

    One instance filters one continuous signal (the track's output, silence included), so there
    are no edges between frames or utterances. Delay: ``(TAPS - 1) / 2`` output samples (about
    1 ms at 48 kHz). Digital silence stays exactly zero.

    Why: aiortc's Opus encoder resamples 24 kHz input to 48 kHz with a resampler that holds
    back one 20 ms frame; feeding it 48 kHz removes that frame from every latency (first
    audio and barge-in).
    """

    TAPS = 96
    CUTOFF = 0.45  # of the output rate: 10.8 kHz at 48 kHz, below the input's 12 kHz Nyquist
    KAISER_BETA = 8.0

    def __init__(self) -> None:
        n = np.arange(self.TAPS) - (self.TAPS - 1) / 2
        h = 2 * self.CUTOFF * np.sinc(2 * self.CUTOFF * n) * np.kaiser(self.TAPS, self.KAISER_BETA)
        self.taps = (2.0 * h / h.sum()).astype(np.float64)  # gain 2: half the stuffed samples are 0
        self._history = np.zeros(self.TAPS - 1, np.float64)

    def process(self, frame: np.ndarray) -> np.ndarray:
        """int16 [n] -> int16 [2n]. About 60 us per 20 ms frame; nothing for silence."""
        if not self._history.any() and not frame.any():
            return np.zeros(2 * len(frame), np.int16)  # idle: most of a session's frames
        stuffed = np.zeros(2 * len(frame), np.float64)
        stuffed[0::2] = frame
        ext = np.concatenate([self._history, stuffed])
        self._history = ext[len(ext) - (self.TAPS - 1) :]
        out = np.convolve(ext, self.taps, mode="valid")
        return np.clip(np.rint(out), -32768, 32767).astype(np.int16)


class OpusFrameEncoder:
    """Encodes each frame of the track to exactly one Opus packet of the frame's duration.

    libopus as aiortc configures it ("voip"), mono, ``bitrate`` bits/s. Not "lowdelay" (CELT
    only, 2.5 ms of look-ahead against 6.5): it gained ~1.5 ms to the first audible sample but
    left a tail decaying over ~90 ms above -60 dBFS after the audio stopped (a cancel's
    silence), where "voip" is silent ~20 ms after it. The packets' ``pts`` are the frames' own,
    so RTP time stays exactly paced.
    """

    def __init__(self, rate: int, frame_ms: int, bitrate: int = 64000) -> None:
        _check_frame_ms(frame_ms)
        self.rate = rate
        self.frame_samples = rate * frame_ms // 1000
        self.time_base = fractions.Fraction(1, rate)
        codec = CodecContext.create("libopus", "w")
        codec.bit_rate = bitrate
        codec.format = "s16"
        codec.layout = "mono"
        codec.sample_rate = rate
        codec.time_base = self.time_base
        codec.options = {"application": "voip", "frame_duration": str(frame_ms)}
        codec.open()
        self._codec = codec

    def encode(self, frame: AudioFrame) -> Packet:
        """One s16 mono frame of ``frame_samples`` at ``rate`` (:func:`s16_frame`) -> one Opus
        packet with the frame's ``pts``."""
        if frame.samples != self.frame_samples or frame.sample_rate != self.rate:
            raise ValueError(
                f"expected {self.frame_samples} samples at {self.rate} Hz, "
                f"got {frame.samples} at {frame.sample_rate} Hz"
            )
        packets = self._codec.encode(frame)
        if len(packets) != 1:  # libopus takes whole frames of frame_duration and buffers none
            raise RuntimeError(f"libopus returned {len(packets)} packets for one frame")
        packet = packets[0]
        packet.pts = frame.pts
        packet.time_base = self.time_base
        return packet


def _check_frame_ms(frame_ms: int) -> None:
    if frame_ms not in FRAME_MS_CHOICES:
        raise ValueError(f"frame_ms must be one of {FRAME_MS_CHOICES}, not {frame_ms}")


def s16_frame(samples: np.ndarray, rate: int, pts: int) -> AudioFrame:
    """int16 [n] mono samples at ``rate`` as an AudioFrame stamped ``pts`` (in 1/rate)."""
    frame = AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
    frame.sample_rate = rate
    frame.pts = pts
    frame.time_base = fractions.Fraction(1, rate)
    return frame


def pcm_to_s16(pcm: np.ndarray) -> np.ndarray:
    """float32 [-1, 1] -> int16, clipped."""
    return (np.clip(np.asarray(pcm, dtype=np.float32), -1.0, 1.0) * 32767.0).astype(np.int16)


class UtteranceTrack(MediaStreamTrack):
    """An audio track that plays queued utterances gaplessly and emits silence in between.

    Queueing, pacing, fades and accounting work at ``sample_rate`` (the engine's 24 kHz);
    frames go out at ``output_rate``: 48 kHz by default (see :class:`Upsampler2x`), or 24 kHz.

    ``on_event`` receives :data:`TrackEvent` s synchronously from ``recv``, after the frame that
    caused them has been built (so ``Started`` follows the frame holding the first sample).

    ``frame_ms``: each frame's duration (10 or 20). A frame holding newly arrived audio waits
    for the next frame time, 0 to ``frame_ms`` (half of it on average), so shorter frames bring
    the first audio and the silence after a cancel sooner, at twice the packets per second.
    ``encode``: ``recv`` returns one Opus packet per frame (see :class:`OpusFrameEncoder`)
    instead of the raw frame.
    """

    kind = "audio"

    def __init__(
        self,
        *,
        sample_rate: int = SAMPLE_RATE,
        clock: Clock | None = None,
        on_event: Callable[[TrackEvent], None] | None = None,
        output_rate: int = 2 * SAMPLE_RATE,
        frame_ms: int = FRAME_MS,
        encode: bool = False,
    ) -> None:
        super().__init__()
        _check_frame_ms(frame_ms)
        self.sample_rate = sample_rate
        self.frame_ms = frame_ms
        self.frame_samples = sample_rate * frame_ms // 1000
        self.fade_samples = sample_rate * FADE_MS // 1000
        if output_rate not in (sample_rate, 2 * sample_rate):
            raise ValueError(f"output_rate must be {sample_rate} or {2 * sample_rate}, not {output_rate}")
        self.output_rate = output_rate
        self._upsampler = Upsampler2x() if output_rate != sample_rate else None
        self._encode = encode
        self._encoder = OpusFrameEncoder(output_rate, frame_ms) if encode else None
        self.clock: Clock = clock or MonotonicClock()
        self.on_event = on_event
        self._queue: deque[_Playout] = deque()
        self._by_id: dict[str, _Playout] = {}
        self._fade = np.zeros(0, np.int16)
        self._cancel_t: float | None = None
        self._start: float | None = None
        self._pts = 0
        self.frames_sent = 0

    # -- feeding (asyncio thread) ------------------------------------------------------------

    def open(self, uid: str) -> None:
        """Reserve ``uid``'s place: it plays after every utterance opened before it."""
        if uid in self._by_id:
            raise ValueError(f"utterance {uid!r} is already queued")
        p = _Playout(uid)
        self._queue.append(p)
        self._by_id[uid] = p

    def push(self, uid: str, chunk: PcmChunk) -> None:
        """Append a chunk of ``uid``'s audio. Ignored when ``uid`` was cancelled meanwhile."""
        p = self._by_id.get(uid)
        if p is None or p.complete:
            return
        s16 = pcm_to_s16(chunk.pcm)
        if len(s16):
            p.pending.append((s16, chunk.text_end))
            p.pending_samples += len(s16)
        if chunk.final:
            p.complete = True

    def finish(self, uid: str) -> None:
        """No more audio for ``uid``; it ends when its buffer is played."""
        p = self._by_id.get(uid)
        if p is not None:
            p.complete = True

    def has(self, uid: str) -> bool:
        return uid in self._by_id

    def queued_ids(self) -> list[str]:
        return [p.id for p in self._queue]

    def buffered_samples(self, uid: str) -> int:
        p = self._by_id.get(uid)
        return 0 if p is None else p.pending_samples

    async def wait_room(self, uid: str, max_samples: int) -> None:
        """Wait until ``uid`` holds at most ``max_samples`` unplayed samples (or is gone)."""
        while True:
            p = self._by_id.get(uid)
            if p is None or p.pending_samples <= max_samples or self.readyState != "live":
                return
            p.room.clear()
            await p.room.wait()

    def flush(self, uid: str | None = None) -> list[PlayoutReport]:
        """Drop ``uid`` and everything opened after it (None: everything), in queue order.

        If the utterance being heard is dropped, its next <= 5 ms fade out to silence.
        """
        if uid is None:
            victims = list(self._queue)
        else:
            ids = [p.id for p in self._queue]
            if uid not in ids:
                return []
            victims = list(self._queue)[ids.index(uid) :]
        return self._remove(victims)

    def drop(self, uid: str) -> PlayoutReport | None:
        """Remove only ``uid`` (a failed utterance); later ones move up."""
        p = self._by_id.get(uid)
        if p is None:
            return None
        return self._remove([p])[0]

    def _remove(self, victims: list[_Playout]) -> list[PlayoutReport]:
        reports = []
        head = self._queue[0] if self._queue else None
        for p in victims:
            if p is head and p.started and not len(self._fade):
                tail = p.peek(self.fade_samples)
                if len(tail):
                    ramp = np.linspace(1.0, 0.0, len(tail) + 1, dtype=np.float32)[1:]
                    self._fade = (tail.astype(np.float32) * ramp).astype(np.int16)
                self._cancel_t = self.clock.now()
            self._queue.remove(p)
            del self._by_id[p.id]
            p.room.set()
            reports.append(PlayoutReport(p.id, p.n_sent, p.text_end if p.n_sent else 0, self.sample_rate))
        return reports

    # -- playing -------------------------------------------------------------------------------

    def next_frame(self, now: float) -> tuple[np.ndarray, list[TrackEvent]]:
        """Build the next frame (int16 [frame_samples]) and the events it causes."""
        n = self.frame_samples
        out = np.zeros(n, np.int16)
        events: list[TrackEvent] = []
        pos = 0
        if len(self._fade):
            k = min(n, len(self._fade))
            out[:k] = self._fade[:k]
            self._fade = self._fade[k:]
            pos = k
            if not len(self._fade) and self._cancel_t is not None:
                events.append(Silenced(now - self._cancel_t))
                self._cancel_t = None
        while pos < n and self._queue:
            p = self._queue[0]
            if p.pending_samples:
                piece = p.take(n - pos)
                out[pos : pos + len(piece)] = piece
                pos += len(piece)
                p.starved = False
                if not p.started:
                    p.started = True
                    events.append(Started(p.id, now))
                events.append(Played(p.id, p.n_sent))
            if p.pending_samples == 0:
                if not p.complete:
                    if p.started and not p.starved:
                        p.starved = True
                        events.append(Underrun(p.id))
                    break
                self._queue.popleft()
                del self._by_id[p.id]
                p.room.set()
                events.append(Done(p.id, p.n_sent, now))
        if self._cancel_t is not None and not len(self._fade):
            # Cancelled with nothing left to fade: silent from this frame on.
            events.append(Silenced(now - self._cancel_t))
            self._cancel_t = None
        return out, events

    async def recv(self) -> AudioFrame | Packet:
        if self.readyState != "live":
            raise MediaStreamError
        late: Late | None = None
        if self._start is None:
            self._start = self.clock.now()
        else:
            self._pts += self.frame_samples
            target = self._start + self._pts / self.sample_rate
            lag = self.clock.now() - target
            if lag > MAX_LAG_S:
                self._start += lag
            else:
                await self.clock.sleep_until(target)
                lag = self.clock.now() - target
            if lag >= LATE_S:
                late = Late(lag)
            if self.readyState != "live":
                raise MediaStreamError
        samples, events = self.next_frame(self.clock.now())
        if late is not None:
            events.append(late)
        factor = 1
        if self._upsampler is not None:
            samples = self._upsampler.process(samples)
            factor = 2
        frame = s16_frame(samples, self.output_rate, self._pts * factor)
        if self._encode:
            if self._encoder is None:  # stopped while this frame was being paced
                raise MediaStreamError
            out: AudioFrame | Packet = self._encoder.encode(frame)
        else:
            out = frame
        self.frames_sent += 1
        if self.on_event is not None:
            for ev in events:
                self.on_event(ev)
        return out

    def stop(self) -> None:
        for p in self._queue:
            p.room.set()
        # libav's encoder keeps two threads until it is freed: free it now, not when the
        # garbage collector next reaches the session's reference cycles
        self._encoder = None
        super().stop()


# --------------------------------------------------------------------------------------------
# What was heard, as text


def _in_word(ch: str) -> bool:
    """True for characters of space-delimited scripts that continue a word."""
    if ch.isalnum() or ch in "'’-":
        return unicodedata.east_asian_width(ch) not in ("W", "F")
    return False


def heard_text(text: str, text_end: int, text_complete: bool) -> str:
    """The input text up to ``text_end``, cut back to a word boundary.

    A cut inside a word (or at the end of text that may still grow, ``text_complete`` False)
    drops the partial word; CJK characters count as words of their own.
    """
    text_end = max(0, min(text_end, len(text)))
    if text_end == len(text) and text_complete:
        return text.rstrip()
    cut = text_end
    if cut > 0 and _in_word(text[cut - 1]) and (cut == len(text) or _in_word(text[cut])):
        while cut > 0 and _in_word(text[cut - 1]):
            cut -= 1
    return text[:cut].rstrip()
