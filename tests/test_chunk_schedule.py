"""Hop growth of the token2wav chunk schedule: upstream's doubling and the "buffered" rule."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import REPO_ROOT, chunk_plans, random_speech, random_voice
from voice_out.config import ConfigError, EngineConfig
from voice_out.engine.chunk_schedule import HOP_GROWTHS, ChunkPlan, ChunkSchedule, HopPolicy, plan_all
from voice_out.model.checkpoint import random_flow, random_hift
from voice_out.model.token2wav import Token2Wav

TINY = REPO_ROOT / "configs" / "models" / "tiny"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def plans_of(n_tokens: int, prompt: int, growth: str, fast_first: int = 0) -> list[ChunkPlan]:
    return plan_all(n_tokens, prompt, HopPolicy(growth=growth), fast_first)


def test_doubling_is_upstreams_and_buffered_waits_one_chunk() -> None:
    assert [p.hop_tokens for p in plans_of(400, 150, "double")] == [25, 50, 100, 100, 100, 25]
    assert [p.hop_tokens for p in plans_of(400, 150, "buffered")] == [25, 25, 50, 100, 100, 100]
    # a first chunk padded to the boundary (P = 140: pad 10) is not "made" beyond its whole chunks
    assert [p.hop_tokens for p in plans_of(300, 140, "buffered")] == [35, 25, 50, 100, 90]


@pytest.mark.parametrize("prompt", [0, 13, 75, 140, 150])
@pytest.mark.parametrize("fast", [0, 8])
@pytest.mark.parametrize("n_tokens", [4, 30, 61, 400, 777])
def test_buffered_hops_never_exceed_the_audio_made(prompt: int, fast: int, n_tokens: int) -> None:
    plans = plans_of(n_tokens, prompt, "buffered", fast)
    assert sum(p.hop_tokens for p in plans) == n_tokens
    assert plans[-1].finalize and not any(p.finalize for p in plans[:-1])
    for p in plans[1:-1]:
        assert (prompt + p.token_offset + p.hop_tokens) % 25 == 0  # still on flow chunk boundaries
        if fast and p.index == 1:
            continue  # the chunk that realigns after a fast first chunk: 25 + the way to the boundary
        assert p.hop_tokens <= max(25, p.token_offset)
        assert p.hop_tokens <= 100
    doubled = plans_of(n_tokens, prompt, "double", fast)
    assert len(doubled) <= len(plans) <= len(doubled) + 1  # at most one more chunk


def test_bad_growth_is_rejected() -> None:
    with pytest.raises(ValueError, match="hop_growth"):
        ChunkSchedule(hop_growth="triple")
    with pytest.raises(ConfigError, match="hop_growth"):
        EngineConfig(hop_growth="triple")


def test_token2wav_follows_the_buffered_schedule() -> None:
    t2w = Token2Wav(random_flow(TINY, "cpu"), random_hift(TINY, "cpu"))
    token, feat, emb = random_voice(50, seed=3)
    speech = random_speech(160, 3)
    out = {}
    for growth in ("double", "buffered"):
        stream = t2w.open_stream(token, feat, emb)
        chunks = list(t2w.stream_all(stream, speech, chunk_plans(stream, speech, HopPolicy(growth=growth))))
        assert [p.hop_tokens for p in stream.chunk_log] == [p.hop_tokens for p in plans_of(160, 50, growth)]
        assert sum(len(c) for c in chunks) == 960 * len(speech)
        out[growth] = chunks
    torch.testing.assert_close(out["buffered"][0], out["double"][0])  # the same first chunk


@pytest.mark.parametrize("growth", HOP_GROWTHS)
def test_tokens_after_a_plan_is_what_the_chunk_after_it_needs_and_changes_nothing(growth: str) -> None:
    sched = HopPolicy(growth=growth).schedule(prompt_tokens=37)
    n = 2000
    while (plan := sched.ready(n, llm_finished=False)) is not None:
        before = (sched.offset, sched.hop, sched.n_chunks)
        after = sched.tokens_after(plan)
        assert (sched.offset, sched.hop, sched.n_chunks) == before
        sched.commit(plan)
        assert after == sched.tokens_for_next_chunk
        # the chunk after it is ready exactly from that many tokens on
        assert sched.ready(after - 1, llm_finished=False) is None
        assert sched.ready(after, llm_finished=False) is not None


@pytest.mark.parametrize("growth", HOP_GROWTHS)
def test_a_stream_on_a_state_grows_its_hop_further_and_ends_within_the_usual_final_chunk(growth: str) -> None:
    hops = HopPolicy(growth=growth, state_max_hop=200)
    for n in range(1, 1300, 7):
        sched = hops.schedule(37, state=True)
        plans = []
        while (plan := sched.ready(n, llm_finished=True)) is not None:
            plans.append(plan)
            sched.commit(plan)
        assert sum(p.hop_tokens for p in plans) == n and plans[-1].finalize
        assert max(p.hop_tokens for p in plans) <= 200
        assert 200 in {p.hop_tokens for p in plans} or n < 600
        assert plans[-1].hop_tokens < 100 + 3 or len(plans) == 1  # as a stream not on a state ends
        for p in plans[:-1]:
            assert not p.finalize and (37 + p.token_offset + p.hop_tokens) % 25 == 0
    # the state's hops from the next chunk on (the engine learns of the state at admission)
    sched = hops.schedule(37)
    assert sched.max_hop == 100
    hops.on_state(sched)
    assert (sched.max_hop, sched.final_max) == (200, 100)
    assert HopPolicy(state_max_hop=50).schedule(0, state=True).max_hop == 100  # never below max_hop
    with pytest.raises(ValueError, match="state_max_hop"):
        HopPolicy(state_max_hop=30)
