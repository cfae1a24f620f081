"""A fake engine for transport tests: scripted latency, deterministic audio, failure injection.

FakeEngine implements ``EngineLike``. Each stream "speaks" its text as a 440 Hz tone,
``ms_per_char`` of audio per input character, in chunks of ``chars_per_chunk`` characters as
the text arrives; every chunk's ``text_end`` is the number of characters it covers, so the
expected ``played_text`` of a cut is easy to compute. A stream whose text contains
``fail_marker`` fails (StreamFailedError) after its first chunk.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from voice_out.engine.api import (
    SAMPLE_RATE,
    BadOptionError,
    NoVoiceError,
    OverloadedError,
    PcmChunk,
    StreamClosedError,
    StreamFailedError,
    StreamState,
    UnknownVoiceError,
    check_speed,
)


@dataclass
class FakeScript:
    first_chunk_delay_s: float = 0.03
    chunk_delay_s: float = 0.01
    ms_per_char: float = 40.0
    chars_per_chunk: int = 5
    amplitude: float = 0.3
    fail_marker: str = "<FAIL>"
    crash_marker: str = "<CRASH>"  # raises a plain exception (a bug inside the engine)
    pause_marker: str = "~"  # a chunk of text holding it is silence (a pause in the speech)


class FakeStream:
    def __init__(self, engine: FakeEngine, voice: str, stream_id: str) -> None:
        self.engine = engine
        self._id = stream_id
        self._voice = voice
        self._text = ""
        self._state = StreamState.WAITING
        self._text_done = False
        self._changed = asyncio.Event()
        self.n_chunks = 0
        self.iterating = False
        self.auto_ack = True
        self.acks: list[int] = []
        self.fast_first: int | None = None
        self.seed: int | None = None
        self.instructions: str | None = None
        self.speed = 1.0

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
        return self._text

    def push_text(self, delta: str) -> None:
        if self._text_done or self._state.terminal:
            raise StreamClosedError(f"stream {self._id} takes no more text")
        self._text += delta
        self._changed.set()

    def end_text(self) -> None:
        if self._state.terminal:
            raise StreamClosedError(f"stream {self._id} has ended")
        self._text_done = True
        self._changed.set()

    def cancel(self) -> None:
        if not self._state.terminal:
            self._state = StreamState.ABORTED
            self.engine.active.discard(self)
        self._changed.set()

    def ack(self, samples_played: int) -> None:
        """The listener has heard ``samples_played`` samples (the real engine paces on it)."""
        self.acks.append(samples_played)

    def _end(self, state: StreamState) -> None:
        if not self._state.terminal:
            self._state = state
        self.engine.active.discard(self)

    def _tone(self, start_sample: int, n: int) -> np.ndarray:
        t = (start_sample + np.arange(n)) / SAMPLE_RATE
        return (self.engine.script.amplitude * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)

    async def _chunks(self) -> AsyncIterator[PcmChunk]:
        script = self.engine.script
        fed = 0
        sample = 0
        self.iterating = True
        try:
            while True:
                while not self._state.terminal:
                    ready = len(self._text) - fed
                    if ready >= script.chars_per_chunk or (self._text_done and ready > 0) or self._text_done:
                        break
                    self._changed.clear()
                    await self._changed.wait()
                if self._state.terminal:
                    return
                self._state = StreamState.RUNNING
                await asyncio.sleep(script.first_chunk_delay_s if self.n_chunks == 0 else script.chunk_delay_s)
                if self._state.terminal:
                    return
                if self.n_chunks >= 1 and script.fail_marker in self._text:
                    self._end(StreamState.FAILED)
                    raise StreamFailedError(f"injected failure in {self._id}")
                if script.crash_marker in self._text:
                    self._end(StreamState.FAILED)
                    raise RuntimeError("injected crash")
                take = min(script.chars_per_chunk, len(self._text) - fed)
                fed += take
                n = int(round(take * script.ms_per_char * SAMPLE_RATE / 1000))
                final = self._text_done and fed == len(self._text)
                pcm = self._tone(sample, n)
                if script.pause_marker in self._text[fed - take : fed]:
                    pcm[:] = 0.0
                chunk = PcmChunk(pcm, sample, fed, final)
                sample += n
                self.n_chunks += 1
                if final:
                    self._end(StreamState.FINISHED)
                yield chunk
                if final:
                    return
        finally:
            self.iterating = False
            if not self._state.terminal:
                self._end(StreamState.ABORTED)

    def __aiter__(self) -> AsyncIterator[PcmChunk]:
        return self._chunks()

    def __iter__(self) -> Iterator[PcmChunk]:
        raise TypeError("FakeStream supports async iteration only")


class FakeEngine:
    """An ``EngineLike`` with scripted timing; ``active`` holds the streams not yet ended."""

    def __init__(
        self,
        voices: tuple[str, ...] = ("alice", "bob"),
        default_voice: str | None = "alice",
        *,
        capacity: int = 64,
        script: FakeScript | None = None,
        first_hop_tokens: int = 4,
    ) -> None:
        self.voices = list(voices)
        self.default_voice = default_voice
        self.capacity = capacity
        #: ``fast_first`` must be below it, as in the real engine (whose default is 25)
        self.first_hop_tokens = first_hop_tokens
        self.script = script or FakeScript()
        self.active: set[FakeStream] = set()
        self.opened: list[FakeStream] = []
        self.broken_voices: set[str] = set()
        self._ready = False
        self.started = 0
        self.stopped = 0

    @property
    def sample_rate(self) -> int:
        return SAMPLE_RATE

    @property
    def ready(self) -> bool:
        return self._ready

    async def __aenter__(self) -> FakeEngine:
        self._ready = True
        self.started += 1
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._ready = False
        for s in list(self.active):
            s.cancel()
        self.stopped += 1

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
    ) -> FakeStream:
        from voice_out.voices.errors import InvalidVoiceNameError, VoiceStoreCorruptError

        if fast_first is not None and not 0 <= fast_first < self.first_hop_tokens:
            raise BadOptionError(f"fast_first = {fast_first} must be in 0..{self.first_hop_tokens - 1} tokens")
        check_speed(speed)
        name = voice or self.default_voice
        if name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name):
            raise InvalidVoiceNameError(f"invalid voice name {name!r}")
        if name in self.broken_voices:
            raise VoiceStoreCorruptError(f"voice {name!r} is damaged; remove it and add it again")
        if name is None:
            raise NoVoiceError("no voice named and no default voice configured")
        if name not in self.voices:
            raise UnknownVoiceError(f"unknown voice {name!r}; registered: {', '.join(self.voices)}")
        if len(self.active) >= self.capacity:
            raise OverloadedError(f"all {self.capacity} stream slots are busy")
        s = FakeStream(self, name, stream_id or f"s{len(self.opened)}")
        s.auto_ack = auto_ack
        s.fast_first = fast_first
        s.seed = seed
        s.instructions = instructions
        s.speed = speed
        self.active.add(s)
        self.opened.append(s)
        return s

    def voice_names(self) -> list[str]:
        return list(self.voices)


class FakeVoiceStore:
    """The voice-store surface the server uses, in memory."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.transcripts: dict[str, str] = {}
        self.gets: list[str] = []

    def names(self) -> list[str]:
        return list(self.engine.voices)

    def get(self, name: str) -> str:
        self.gets.append(name)
        if name not in self.engine.voices:
            raise UnknownVoiceError(f"unknown voice {name!r}")
        return name

    def list(self) -> list[str]:
        return list(self.engine.voices)

    def add(self, name: str, audio: bytes, transcript: str) -> None:
        from voice_out.voices.errors import EmptyAudioError, InvalidVoiceNameError, VoiceExistsError

        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name):
            raise InvalidVoiceNameError(f"invalid voice name {name!r}")
        if name in self.engine.voices:
            raise VoiceExistsError(f"voice {name!r} exists")
        if not audio:
            raise EmptyAudioError("empty audio")
        self.engine.voices.append(name)
        self.transcripts[name] = transcript

    def delete(self, name: str) -> None:
        if name not in self.engine.voices:
            raise UnknownVoiceError(f"unknown voice {name!r}")
        self.engine.voices.remove(name)
