"""Character timings per chunk (voice_out.engine.alignment): the estimator on hand-built token
streams, then the real engine (random:tiny) whose chunks must cover the input exactly once."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_engine import make_engine
from voice_out.engine.alignment import (
    SAMPLES_PER_TOKEN,
    TOKENS_PER_TEXT_ID,
    Alignment,
    AlignmentTracker,
    interleave_chars,
)
from voice_out.engine.api import PcmChunk
from voice_out.engine.engine import Engine
from voice_out.engine.scheduler import ForcedTokens

pytestmark = pytest.mark.filterwarnings("ignore:.*RANDOM WEIGHTS")


def check_chunks(spans: list[tuple[int, int, Alignment]], total: int) -> None:
    """Every character once, in order; starts never go backwards; each inside its chunk."""
    expected, last_start = 0, -1
    for start, n, a in spans:
        assert a.char_start == expected
        expected = a.char_end
        for s, e in zip(a.start_samples, a.end_samples, strict=True):
            assert start <= s <= e <= start + n
            assert s >= last_start
            last_start = s
        ms, dur = a.relative_ms(start)
        assert all(x >= 0 for x in ms + dur) and ms == sorted(ms)
    assert expected == total


def simulate(char_ends: list[int], n_tokens: int, hops: list[int], fed: list[int]) -> list[tuple[int, int, Alignment]]:
    """Feed ``n_tokens`` speech tokens (token i drawn with ``fed[i]`` characters given), cut them
    in chunks of ``hops`` tokens (the last takes the rest) and collect the alignments."""
    tr = AlignmentTracker()
    out: list[tuple[int, int, Alignment]] = []
    made, start = 0, 0
    for i in range(n_tokens):
        tr.on_speech_token(fed[i], char_ends)
        made += 1
        if hops and made == hops[0] and i < n_tokens - 1:
            n = hops.pop(0) * SAMPLES_PER_TOKEN
            out.append((start, n, tr.chunk(start, n, False, char_ends[-1])))
            start += n
            made = 0
    n = made * SAMPLES_PER_TOKEN
    out.append((start, n, tr.chunk(start, n, True, char_ends[-1])))
    return out


def test_interleave_chars() -> None:
    ends = [4, 6, 12]
    assert [interleave_chars(t, ends) for t in range(11)] == [0, 1, 2, 4, 4, 5, 6, 8, 10, 12, 12]
    assert interleave_chars(5, []) == 0


def test_text_ahead_of_speech_is_not_reported_early() -> None:
    """Text fed 5 ids ahead: a chunk reports only what the interleave gives its tokens."""
    char_ends = [3 * (k + 1) for k in range(20)]  # 20 text ids of 3 characters
    fed = [char_ends[min(19, 5 + i // TOKENS_PER_TEXT_ID)] for i in range(90)]
    spans = simulate(char_ends, 90, [25, 25], fed)
    check_chunks(spans, 60)
    first = spans[0][2]
    assert first.char_end == interleave_chars(25, char_ends) == 25  # not the 33 fed by then
    # text id k's first character starts at token 3k
    assert first.start_samples[3] == 3 * SAMPLES_PER_TOKEN


def test_fed_bound_holds_characters_back() -> None:
    """The LLM got no text beyond 3 characters for its first 30 tokens: nothing past them is
    reported in the first chunk, whatever the interleave says."""
    char_ends = [3, 6, 9, 12]
    fed = [3] * 30 + [12] * 20
    spans = simulate(char_ends, 50, [25], fed)
    check_chunks(spans, 12)
    assert spans[0][2].char_end == 3


@pytest.mark.parametrize("seed", range(40))
def test_random_streams_cover_every_character_once(seed: int) -> None:
    rng = random.Random(seed)
    n_ids = rng.randint(1, 40)
    char_ends = list(__import__("itertools").accumulate(rng.randint(1, 6) for _ in range(n_ids)))
    n_tokens = rng.randint(1, 200)
    fed, got = [], 0
    for _ in range(n_tokens):
        got = min(char_ends[-1], got + rng.choice([0, 0, 2, 5, 11]))
        fed.append(got)
    hops = [rng.choice([12, 25, 50, 100]) for _ in range(10)]
    check_chunks(simulate(char_ends, n_tokens, hops, fed), char_ends[-1])


def test_empty_final_chunk_takes_the_rest() -> None:
    tr = AlignmentTracker()
    a = tr.chunk(0, 0, True, 5)
    assert (a.char_start, a.char_end, a.start_samples, a.end_samples) == (0, 5, (0,) * 5, (0,) * 5)


# ---- the real engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    eng = make_engine(tmp_path_factory.mktemp("align"), forced=ForcedTokens(4))
    eng.start(timeout=120)
    yield eng
    eng.close()


def run(engine: Engine, deltas: list[str]) -> list[PcmChunk]:
    stream = engine.open_stream()
    for d in deltas:
        stream.push_text(d)
    stream.end_text()
    return list(stream)


@pytest.mark.parametrize(
    "deltas",
    [
        ["Hello there, a sentence ", "in several ", "deltas, ", "with a tail.  "],
        ["x"],
    ],
)
def test_engine_chunks_cover_the_text_once(engine: Engine, deltas: list[str], tmp_path: Path) -> None:
    chunks = run(engine, deltas)
    total = len("".join(deltas))
    assert chunks and chunks[-1].final
    spans = []
    for c in chunks:
        assert c.alignment is not None
        spans.append((c.start_sample, len(c.pcm), c.alignment))
    check_chunks(spans, total)
    # the estimate is not the fed text: the first chunk's characters lag what was fed
    if len(chunks) > 1:
        assert chunks[0].alignment is not None and chunks[0].alignment.char_end <= chunks[0].text_end
