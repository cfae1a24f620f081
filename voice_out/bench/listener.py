"""A simulated real-time listener of one engine stream, and the stream runner that feeds it.

The listener starts playing at the first chunk and plays at 1x from then on. When a chunk
arrives after the listener has played everything before it, the playout buffer ran dry before
the utterance ended: an underrun; playback stalls until the chunk is there (the stall time is
added up). The runner acknowledges what the listener has played every ``ACK_PERIOD_S``, so the
engine's back-pressure follows the listener as it would follow a real transport.

No torch here: the engine is only used through its public stream API.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from voice_out.engine.api import SAMPLE_RATE

if TYPE_CHECKING:
    from voice_out.engine.api import EngineLike

#: How often the simulated listener reports what it has played to the engine (well below
#: ``engine.max_ahead_s``; 64 streams acknowledging every 20 ms would be 3,200 messages/s).
ACK_PERIOD_S = 0.05


@dataclass
class Listener:
    """A real-time listener of one stream: plays from the first chunk at 1x, stalls when dry.

    Times are the event loop's clock (seconds). ``t_text``: the first text went in;
    ``t_first``: the first chunk came out; ``t_done``: the stream ended.
    """

    t_text: float = 0.0
    t_first: float | None = None
    received: int = 0
    stall_s: float = 0.0
    underruns: int = 0
    chunk_times: list[float] = field(default_factory=list)
    t_done: float | None = None

    def played(self, now: float) -> int:
        """Samples played by ``now``."""
        if self.t_first is None:
            return 0
        return max(0, min(self.received, int((now - self.t_first - self.stall_s) * SAMPLE_RATE)))

    def on_chunk(self, now: float, start_sample: int, n: int) -> None:
        """A chunk of ``n`` samples starting at ``start_sample`` arrived at ``now``."""
        if self.t_first is None:
            self.t_first = now
        else:
            due = self.t_first + self.stall_s + start_sample / SAMPLE_RATE
            if now > due:  # the buffer ran dry before this chunk arrived
                self.underruns += 1
                self.stall_s += now - due
        self.received = start_sample + n
        self.chunk_times.append(now)

    @property
    def ttfa_s(self) -> float | None:
        """First text in -> first chunk out, in seconds (None: no audio)."""
        return None if self.t_first is None else self.t_first - self.t_text

    @property
    def audio_s(self) -> float:
        return self.received / SAMPLE_RATE

    @property
    def rtf(self) -> float | None:
        """Synthesis time (first text in -> last chunk out) / audio time (None: no audio)."""
        if not self.chunk_times or self.received == 0:
            return None
        return (self.chunk_times[-1] - self.t_text) / self.audio_s


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def run_stream(
    engine: EngineLike, i: int, text: str, rate: float, delay_s: float, *, step_chars: int = 4
) -> Listener:
    """Open one stream (seed ``1000 + i``) after ``delay_s``, give it ``text`` at once
    (``rate <= 0``) or at ``rate`` characters per second in deltas of ``step_chars``, and
    listen to it in real time until it ends."""
    await asyncio.sleep(delay_s)
    lis = Listener()
    stream = engine.open_stream(seed=1000 + i, auto_ack=False)
    loop = asyncio.get_running_loop()

    async def feed() -> None:
        if rate <= 0:
            stream.push_text(text)
        else:
            t0 = loop.time()
            for n, k in enumerate(range(0, len(text), step_chars)):
                # paced by the clock (no drift): delta n is due at t0 + n * step / rate
                await asyncio.sleep(max(0.0, t0 + n * step_chars / rate - loop.time()))
                stream.push_text(text[k : k + step_chars])
        stream.end_text()

    async def ack() -> None:
        acked = 0
        while True:
            await asyncio.sleep(ACK_PERIOD_S)
            played = lis.played(loop.time())
            if played != acked:
                stream.ack(played)
                acked = played

    lis.t_text = loop.time()
    feeder = asyncio.create_task(feed())
    acker = asyncio.create_task(ack())
    try:
        async for chunk in stream:
            lis.on_chunk(loop.time(), chunk.start_sample, len(chunk.pcm))
        lis.t_done = loop.time()
    finally:
        acker.cancel()
        await feeder
    return lis
