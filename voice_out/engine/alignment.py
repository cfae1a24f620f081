"""Character timings of an utterance's audio, estimated from the bistream interleave. No torch.

The engine does not know which characters a speech token speaks (there is no aligner); what it
knows is the 5 text : 15 speech interleave the LLM was trained on (cosyvoice2-spec 2.7), and,
for each speech token, how much text the LLM had been given when it drew it. The estimate:

* ``F(t)``, the characters spoken by the first ``t`` speech tokens, advances one text token per
  :data:`TOKENS_PER_TEXT_ID` speech tokens (15 / 5), the text token's characters spread evenly
  over its three tokens; and never past the characters fed to the LLM when token ``t - 1`` was
  drawn (a token cannot speak text the model has not seen).
* a character starts where ``F`` crosses its index and ends where ``F`` crosses the next one
  (linear between the 40 ms token boundaries), in samples of the utterance at 24 kHz;
* a non-final chunk reports the not yet reported characters that start before its last sample;
  the final chunk reports every character left, ``F`` over the final chunk stretched so that
  the last character ends with the audio.

Guarantees (tested): start times never go backwards, every character of the input is reported
exactly once, in order, and no character is reported before the LLM was given it. Error bound:
see docs/agents.md ("Alignment"); in short, a character's time is exact only for a voice that
speaks 120 ms per text token, and otherwise errs by the accumulated difference, at most until
the end of the utterance, where the final chunk absorbs the rest.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

#: Speech tokens per text token in the bistream interleave (15 speech : 5 text).
TOKENS_PER_TEXT_ID = 3
#: Samples of 24 kHz audio per speech token (25 Hz tokens).
SAMPLES_PER_TOKEN = 960


@dataclass(frozen=True)
class Alignment:
    """Characters ``[char_start, char_end)`` of the input text (every ``push_text`` delta
    concatenated, raw) and where each is spoken: ``start_samples[i]`` / ``end_samples[i]`` are
    samples of the utterance (24 kHz, from its first sample) of character ``char_start + i``.
    Both are non-decreasing and ``start <= end``."""

    char_start: int
    char_end: int
    start_samples: tuple[int, ...]
    end_samples: tuple[int, ...]

    def __post_init__(self) -> None:
        n = self.char_end - self.char_start
        if n < 0 or len(self.start_samples) != n or len(self.end_samples) != n:
            raise ValueError("an alignment needs one start and one end per character")

    def relative_ms(self, chunk_start_sample: int, sample_rate: int = 24000) -> tuple[list[int], list[int]]:
        """Start times and durations in whole ms from ``chunk_start_sample`` (ElevenLabs'
        ``charStartTimesMs`` / ``charDurationsMs``): never negative, starts non-decreasing."""
        starts: list[int] = []
        durations: list[int] = []
        for s, e in zip(self.start_samples, self.end_samples, strict=True):
            a = max(0, round((s - chunk_start_sample) * 1000 / sample_rate))
            b = max(a, round((e - chunk_start_sample) * 1000 / sample_rate))
            starts.append(a)
            durations.append(b - a)
        return starts, durations


def interleave_chars(tokens: int, text_id_char_end: Sequence[int]) -> int:
    """Characters the first ``tokens`` speech tokens speak by the interleave alone (see the
    module docstring); ``text_id_char_end[k]`` is the raw character end of text token ``k``."""
    if not text_id_char_end:
        return 0
    k, rem = divmod(tokens, TOKENS_PER_TEXT_ID)
    if k >= len(text_id_char_end):
        return text_id_char_end[-1]
    done = text_id_char_end[k - 1] if k > 0 else 0
    return done + (text_id_char_end[k] - done) * rem // TOKENS_PER_TEXT_ID


@dataclass
class AlignmentTracker:
    """One request's estimate (worker thread only): ``grid[t]`` is ``F(t)`` for every speech
    token made so far, ``reported`` the characters already handed out in chunks."""

    grid: list[int] = field(default_factory=lambda: [0])
    reported: int = 0

    def on_speech_token(self, fed_chars: int, text_id_char_end: Sequence[int]) -> None:
        """A speech token was drawn with ``fed_chars`` characters given to the LLM."""
        t = len(self.grid)
        estimate = min(interleave_chars(t, text_id_char_end), fed_chars)
        self.grid.append(max(self.grid[-1], estimate))

    def chunk(self, start_sample: int, n_samples: int, final: bool, total_chars: int) -> Alignment:
        """The characters of the chunk whose audio is ``[start_sample, start_sample +
        n_samples)`` of the utterance; ``final``: the last chunk, which reports everything left
        (``total_chars``: the input's length)."""
        end_sample = start_sample + n_samples
        grid = [float(v) for v in self.grid]
        if final:
            grid = _stretch_tail(grid, start_sample / SAMPLES_PER_TOKEN, self.reported, total_chars)
            last = total_chars
        else:
            last = self.reported
            while last < int(grid[-1]) and _crossing(grid, last) * SAMPLES_PER_TOKEN < end_sample:
                last += 1
        starts: list[int] = []
        ends: list[int] = []
        for c in range(self.reported, last):
            s = max(start_sample, round(_crossing(grid, c) * SAMPLES_PER_TOKEN))
            e = round(_crossing(grid, c + 1) * SAMPLES_PER_TOKEN)
            s = min(s, end_sample)
            if starts:
                s = max(s, starts[-1])
            starts.append(s)
            ends.append(min(max(e, s), end_sample))
        first = self.reported
        self.reported = last
        return Alignment(first, last, tuple(starts), tuple(ends))


def _crossing(grid: Sequence[float], c: float) -> float:
    """Token position where the non-decreasing ``grid`` first reaches ``c`` (linear between grid
    points); ``len(grid) - 1`` when it never does. O(log n)."""
    if c <= grid[0]:
        return 0.0
    t = bisect.bisect_left(grid, c)
    if t >= len(grid):
        return float(len(grid) - 1)
    lo = grid[t - 1]
    return t - 1 + (c - lo) / (grid[t] - lo)


def _stretch_tail(grid: list[float], t0: float, reported: int, total: int) -> list[float]:
    """``grid`` with its part after token position ``t0`` rescaled so that it runs from the
    characters already reported to ``total`` at the last token (uniform if it was flat)."""
    n = len(grid) - 1
    if n == 0:
        return [float(total)] if total > 0 else grid
    first = max(0, min(n, int(t0)))
    base, top = max(float(reported), grid[first]), grid[-1]
    out = list(grid)
    span = n - first
    for t in range(first, n + 1):
        frac = (grid[t] - base) / (top - base) if top > base else (t - first) / span if span else 1.0
        out[t] = reported + max(0.0, frac) * (total - reported)
    for t in range(1, n + 1):
        out[t] = max(out[t], out[t - 1])
    out[n] = float(total)
    return out
