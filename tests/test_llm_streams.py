"""Many bistream streams driven together: schedule + batched decode + batched RAS sampling.

A minimal driver of the public pieces (the engine's runner does the same with a scheduler):
multi-row feeds go through ``prefill`` (one slot), single-row feeds of every ready stream go
through ONE ``decode_step``, and one ``ras_sample_batch`` call samples all of them with
per-stream generators. Each stream's tokens must not depend on its batch mates.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import REPO_ROOT
from voice_out.model.checkpoint import random_llm
from voice_out.model.llm import KVCache, SpeechLM
from voice_out.model.sampling import (
    SamplingParams,
    draw_uniforms,
    mask_eos_,
    new_history,
    push_history_,
    ras_sample_batch,
    stream_generator,
)
from voice_out.text import bistream as bs

Spec = tuple[tuple[int, ...], tuple[int, ...], list[tuple[int, ...]], int]
SPECS: list[Spec] = [
    ((11, 12, 13), tuple(range(100, 131)), [(1, 2, 3), (4, 5, 6, 7, 8, 9, 10, 11), (12,)], 1),
    ((), (), [(1,), (2,), (3,), (4,), (5,), (6,), (7,)], 2),
    ((20, 21), tuple(range(500, 520)), [tuple(range(30, 42))], 3),
    ((7,), (), [(9, 8, 7, 6, 5, 4)], 4),
]


@pytest.fixture(scope="module")
def lm() -> SpeechLM:
    model = random_llm(REPO_ROOT / "configs" / "models" / "tiny", "cpu", torch.float32, seed=7)
    with torch.no_grad():  # make EOS likely once it is allowed, so the final phase ends quickly
        model.llm_decoder.bias[model.dims.eos_token] += 9.0
    return model


def run(lm: SpeechLM, specs: list[Spec], max_batch: int) -> list[tuple[list[int], bs.FinishReason | None]]:
    params = SamplingParams()
    cfg = bs.BistreamConfig(speech_token_size=lm.dims.speech_token_size, max_tokens_per_text_token=6)
    n = len(specs)
    cache = KVCache.allocate(lm.dims, n, 256)
    states = [bs.new_state(cfg, pt, ps) for pt, ps, _, _ in specs]
    gens = [stream_generator(seed) for *_, seed in specs]
    history = new_history(n, params)
    emitted: list[list[int]] = [[] for _ in range(n)]

    def apply(i: int, actions: list[bs.Action]) -> None:
        for a in actions:
            if isinstance(a, bs.Emit):
                emitted[i].append(a.token)

    for i, (_, _, chunks, _) in enumerate(specs):
        for c in chunks:
            apply(i, bs.process(states[i], bs.TextReceived(c)))
        apply(i, bs.process(states[i], bs.TextEnded()))

    for _ in range(2000):
        ready = [i for i in range(n) if states[i].step is not None][:max_batch]
        if not ready:
            break
        steps = [states[i].step for i in ready]
        hidden = torch.empty(len(ready), lm.dims.hidden_size)
        single = [j for j, s in enumerate(steps) if s is not None and len(s.feed) == 1]
        for j, s in enumerate(steps):
            assert s is not None
            if len(s.feed) > 1:
                hidden[j] = lm.prefill(cache, ready[j], lm.embed_rows(s.feed))
        if single:
            slots = torch.tensor([ready[j] for j in single])
            rows = [steps[j].feed[0] for j in single]  # type: ignore[union-attr]
            hidden[single] = lm.decode_step(cache, slots, lm.embed_rows(rows))
        logp = lm.logprobs(hidden)
        eos_masked = torch.tensor([s is not None and s.mode is not bs.StepMode.SAMPLE_FINAL for s in steps])
        mask_eos_(logp, eos_masked, lm.dims.eos_token)
        idx = torch.tensor(ready)
        tokens = ras_sample_batch(logp, history[idx], draw_uniforms([gens[i] for i in ready], "cpu"), params)
        for j, s in enumerate(steps):
            assert s is not None
            if s.mode is bs.StepMode.FORCE_FILL:
                tokens[j] = cfg.fill_token
        sub = history[idx]
        push_history_(sub, tokens)
        history[idx] = sub
        for j, i in enumerate(ready):
            apply(i, bs.process(states[i], bs.StepDone(int(tokens[j]))))
            assert int(cache.lengths[i]) == states[i].cache_len
    return [(emitted[i], states[i].finish_reason) for i in range(n)]


def test_streams_decoded_together_equal_streams_decoded_alone(lm: SpeechLM) -> None:
    together = run(lm, SPECS, max_batch=len(SPECS))
    alone = [run(lm, [spec], max_batch=1)[0] for spec in SPECS]
    assert together == alone
    # Another batch composition and slot assignment: streams in reverse order, two at a time.
    assert run(lm, SPECS[::-1], max_batch=2)[::-1] == together
    for tokens, reason in together:
        assert reason in (bs.FinishReason.EOS, bs.FinishReason.MAX_LEN)
        assert tokens and all(0 <= t < lm.dims.speech_token_size for t in tokens)
    # Different seeds and inputs give different token streams.
    assert len({tuple(t) for t, _ in together}) == len(SPECS)
