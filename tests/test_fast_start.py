"""Fast start: a small first chunk, then back onto the flow's chunk boundaries."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import REPO_ROOT, chunk_plans, random_speech, random_voice
from voice_out.engine.chunk_schedule import ChunkSchedule, plan_all
from voice_out.fast.flow_step import FastToken2Wav
from voice_out.model.checkpoint import random_flow, random_hift

TINY = REPO_ROOT / "configs" / "models" / "tiny"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("prompt", [0, 13, 75, 87, 150])
@pytest.mark.parametrize("fast", [5, 8, 12, 24])
@pytest.mark.parametrize("n_tokens", [4, 30, 61, 400])
def test_schedule_realigns_after_the_fast_chunk(prompt: int, fast: int, n_tokens: int) -> None:
    plans = plan_all(n_tokens, prompt, fast_first=fast)
    assert sum(p.hop_tokens for p in plans) == n_tokens
    assert sum(p.n_samples() for p in plans) == 960 * n_tokens
    assert plans[-1].finalize and not any(p.finalize for p in plans[:-1])
    if n_tokens >= fast + 3:
        assert plans[0].hop_tokens == fast and plans[0].token_len == fast + 3
    for p in plans[1:-1]:  # every later non-final chunk ends on a flow chunk boundary
        assert (prompt + p.token_offset + p.hop_tokens) % 25 == 0
        assert p.hop_tokens >= 25


def test_first_audio_needs_fast_plus_lookahead_tokens() -> None:
    s = ChunkSchedule(prompt_tokens=75, fast_first=10)
    assert s.tokens_for_next_chunk == 13
    assert s.ready(12, llm_finished=False) is None
    plan = s.ready(13, llm_finished=False)
    assert plan is not None and plan.hop_tokens == 10
    assert ChunkSchedule(prompt_tokens=75).tokens_for_next_chunk == 28
    with pytest.raises(ValueError, match="fast_first"):
        ChunkSchedule(prompt_tokens=75, fast_first=25)


def test_fast_start_on_a_flow_state_equals_rerun_and_keeps_every_sample() -> None:
    """A fast first chunk (off a chunk boundary: a re-run), then the later chunks of a stream
    holding a flow state (the realigning second chunk catches the state up)."""
    t2w = FastToken2Wav(random_flow(TINY, "cpu"), random_hift(TINY, "cpu"))
    token, feat, emb = random_voice(50, seed=2)
    speech = random_speech(140, 2)
    t2w.use_state_slots(1, 50 + 140)
    out = {}
    for path in ("rerun", "state"):
        prefix = t2w.prepare_prefix(token, feat, emb) if path == "state" else None
        stream = t2w.open_stream(token, feat, emb, first_prefix=prefix)
        assert (stream.state_slot is not None) == (path == "state")
        chunks = list(t2w.stream_all(stream, speech, chunk_plans(stream, speech, fast_first=8)))
        assert sum(len(c) for c in chunks) == 960 * len(speech)
        assert len(chunks[0]) == 8 * 960 - 3840
        out[path] = torch.cat(chunks)
    torch.testing.assert_close(out["state"], out["rerun"], atol=1e-4, rtol=0)
