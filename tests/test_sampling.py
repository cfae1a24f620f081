"""Repetition-aware sampling: nucleus/top-k set, the pinned fallback, per-stream determinism."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from voice_out.model.sampling import (
    NO_TOKEN,
    SCALAR_UNIFORMS_MAX,
    SamplingParams,
    counter_uniforms,
    draw_uniforms,
    mask_eos_,
    new_history,
    push_history_,
    ras_sample,
    ras_sample_batch,
    stream_generator,
)

V = 40


def logp_of(probs: list[float]) -> torch.Tensor:
    """log-probs over V ids: the given head, the rest sharing what is left equally."""
    rest = (1.0 - sum(probs)) / (V - len(probs))
    p = torch.tensor(probs + [rest] * (V - len(probs)), dtype=torch.float64)
    return p.log().float()


def sample_grid(logp: torch.Tensor, history: list[int], params: SamplingParams, n: int = 2000) -> torch.Tensor:
    """Tokens for a uniform grid of first draws (second draw fixed): an exact picture of the CDF."""
    u = torch.stack([(torch.arange(n) + 0.5) / n, torch.full((n,), 0.37)], dim=1)
    hist = new_history(n, params)
    if history:
        hist[:, -len(history) :] = torch.tensor(history[-params.win_size :])
    return ras_sample_batch(logp.expand(n, -1), hist, u, params)


def test_nucleus_keeps_the_item_that_crosses_top_p() -> None:
    params = SamplingParams(top_p=0.8, top_k=25)
    # 0.5, 0.2 (cum 0.7 < 0.8) and 0.15 (crosses 0.8, kept); 0.1 is not.
    logp = logp_of([0.5, 0.2, 0.15, 0.1])
    tokens = sample_grid(logp, [], params)
    counts = torch.bincount(tokens, minlength=V)
    assert set(tokens.tolist()) == {0, 1, 2}
    for tok, p in ((0, 0.5), (1, 0.2), (2, 0.15)):
        assert abs(counts[tok].item() / len(tokens) - p / 0.85) < 2e-3


def test_top_k_caps_the_set_and_ties_keep_id_order() -> None:
    params = SamplingParams(top_p=1.0, top_k=3)
    logp = torch.zeros(V)  # all equal: a stable sort keeps ids 0, 1, 2
    tokens = sample_grid(logp, [], params)
    assert set(tokens.tolist()) == {0, 1, 2}
    counts = torch.bincount(tokens, minlength=3).tolist()
    assert max(counts) - min(counts) <= 1


def test_repetition_masks_the_token_and_samples_the_full_distribution() -> None:
    params = SamplingParams(top_p=0.8, top_k=25, win_size=10, tau_r=0.1)
    logp = logp_of([0.9])  # the nucleus is just token 0
    n = 4000
    u = torch.stack([torch.full((n,), 0.5), (torch.arange(n) + 0.5) / n], dim=1)
    hist = new_history(n, params)
    hist[:, -1] = 0  # token 0 was produced recently -> fallback
    tokens = ras_sample_batch(logp.expand(n, -1), hist, u, params)
    assert (tokens != 0).all(), "the repeated token is masked in the fallback (pinned 'fix ras' variant)"
    # The fallback draws from the full softmax without token 0: uniform over the other 39 ids.
    counts = torch.bincount(tokens, minlength=V)[1:]
    assert counts.min().item() > 0 and (counts.max() - counts.min()).item() <= 2
    # Without the repetition, the nucleus choice stands.
    assert (ras_sample_batch(logp.expand(n, -1), new_history(n, params), u, params) == 0).all()


def test_repetition_threshold_and_window() -> None:
    params = SamplingParams(top_p=0.5, top_k=25, win_size=4, tau_r=0.5)  # needs 2 occurrences in 4
    logp = logp_of([0.9])
    gen = stream_generator(0)
    assert ras_sample(logp, [0, 5, 6, 7], params, gen) == 0  # once: no fallback
    assert ras_sample(logp, [0, 5, 0, 7], params, gen) != 0  # twice: fallback
    assert ras_sample(logp, [0, 0, 5, 6, 7, 8], params, gen) == 0  # outside the last 4


def test_fallback_can_pick_eos_unless_masked() -> None:
    params = SamplingParams()
    eos = 30
    logp = torch.full((V,), -30.0)
    logp[3], logp[eos] = 0.0, 0.0  # equal mass on token 3 and "EOS"
    logp = torch.log_softmax(logp, -1)
    n = 500
    u = torch.stack([torch.full((n,), 0.25), (torch.arange(n) + 0.5) / n], dim=1)
    hist = new_history(n, params)
    hist[:, -1] = 3
    tokens = ras_sample_batch(logp.expand(n, -1).clone(), hist, u, params)
    assert set(tokens.tolist()) == {eos}  # nucleus picks 3 (stable tie), repeated -> fallback -> eos
    masked = mask_eos_(logp.expand(n, -1).clone(), torch.ones(n, dtype=torch.bool), eos)
    tokens = ras_sample_batch(masked, hist, u, params)
    assert eos not in tokens.tolist() and 3 not in tokens.tolist()


def test_extreme_uniforms_never_pick_zero_probability_ids() -> None:
    params = SamplingParams(top_p=0.8, top_k=25)
    logp = logp_of([0.6, 0.3])
    logp[10:] = -math.inf
    logp = torch.log_softmax(logp, -1)
    for u0, u1 in ((0.0, 0.0), (1.0 - 2**-24, 1.0 - 2**-24), (0.9999999, 0.9999999)):
        for history in ([], [0, 1]):
            u = torch.tensor([[u0, u1]])
            hist = new_history(1, params)
            if history:
                hist[0, -2:] = torch.tensor(history)
            tok = int(ras_sample_batch(logp[None], hist, u, params)[0])
            assert tok < 10


def test_batched_equals_single_streams_with_their_own_generators() -> None:
    params = SamplingParams()
    torch.manual_seed(0)
    logps = torch.log_softmax(torch.randn(6, V) * 3, dim=-1)
    histories = [[], [1, 2, 3], list(range(12)), [5] * 10, [7, 8], [0]]
    seeds = [11, 12, 13, 14, 15, 16]
    single = [ras_sample(logps[b], histories[b], params, stream_generator(seeds[b])) for b in range(6)]
    hist = new_history(6, params)
    for b, h in enumerate(histories):
        recent = h[-params.win_size :]
        if recent:
            hist[b, -len(recent) :] = torch.tensor(recent)
    u = draw_uniforms([stream_generator(s) for s in seeds], "cpu")
    assert ras_sample_batch(logps, hist, u, params).tolist() == single


def test_a_stream_is_reproducible_from_its_seed() -> None:
    params = SamplingParams()
    logp = torch.log_softmax(torch.randn(V, generator=torch.Generator().manual_seed(3)) * 2, -1)

    def run(seed: int) -> list[int]:
        gen = stream_generator(seed)
        out: list[int] = []
        for _ in range(40):
            out.append(ras_sample(logp, out, params, gen))
        return out

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_history_and_eos_helpers() -> None:
    params = SamplingParams(win_size=3)
    hist = new_history(2, params)
    assert (hist == NO_TOKEN).all()
    for t in (4, 5, 6, 7):
        push_history_(hist, torch.tensor([t, t + 10]))
    assert hist.tolist() == [[5, 6, 7], [15, 16, 17]]
    logp = torch.zeros(2, 8)
    mask_eos_(logp, torch.tensor([True, False]), eos_token=6)
    assert logp[0, 6] == -math.inf and logp[1, 6] == 0 and logp[0, 5] == 0


def test_params_are_validated() -> None:
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(top_k=0)
    assert SamplingParams().repeat_threshold == pytest.approx(1.0)


def test_counter_uniforms_are_a_pure_function_of_seed_and_step() -> None:
    u = counter_uniforms([3, 3, 4, 2**63 + 5, -1], [0, 1, 0, 7, 7])
    assert u.shape == (5, 2) and u.dtype == np.float64
    # the same (seed, step) gives the same pair whatever else is in the batch
    assert counter_uniforms([4, 3], [0, 1]).tolist() == [u[2].tolist(), u[1].tolist()]
    # seeds are taken mod 2^64: -1 is 2^64 - 1
    assert counter_uniforms([2**64 - 1], [7]).tolist() == [u[4].tolist()]
    # every value a multiple of 2^-24 in [0, 1): exact in float32, as the samplers take them
    assert ((u >= 0) & (u < 1)).all() and (u * 2**24 == np.floor(u * 2**24)).all()
    assert np.array_equal(torch.from_numpy(u).float().double().numpy(), u)


def test_counter_uniforms_small_batches_hash_with_python_ints_to_the_same_values() -> None:
    rng = np.random.default_rng(0)
    seeds = [int(v) for v in rng.integers(0, 2**63, 200)] + [0, -1, 2**64 - 1, 2**63 + 5]
    steps = [int(v) for v in rng.integers(0, 2**31, 200)] + [0, 7, 2**31 - 1, 2**31 + 3]
    assert len(seeds) > SCALAR_UNIFORMS_MAX  # one numpy call
    whole = counter_uniforms(seeds, steps)
    k = SCALAR_UNIFORMS_MAX
    parts = [counter_uniforms(seeds[i : i + k], steps[i : i + k]) for i in range(0, len(seeds), k)]
    assert np.array_equal(np.concatenate(parts), whole)
    assert counter_uniforms([], []).shape == (0, 2)


def test_counter_uniforms_look_uniform_and_independent() -> None:
    """Coarse checks that a broken hash would fail: the moments of U(0, 1), a flat histogram,
    no correlation between a stream's consecutive steps or between neighbouring seeds, and no
    two equal pairs among 200k."""
    seeds = np.repeat(np.arange(2000), 50)
    steps = np.tile(np.arange(50), 2000)
    u = counter_uniforms(seeds.tolist(), steps.tolist())
    flat = u.ravel()
    assert abs(flat.mean() - 0.5) < 0.005 and abs(flat.var() - 1 / 12) < 0.002
    counts = np.histogram(flat, bins=20, range=(0, 1))[0]
    expected = flat.size / 20
    assert ((counts - expected) ** 2 / expected).sum() < 60  # chi-square, 19 dof: p ~ 1e-6
    per_stream = u[:, 0].reshape(2000, 50)
    assert abs(np.corrcoef(per_stream[:, :-1].ravel(), per_stream[:, 1:].ravel())[0, 1]) < 0.02
    assert abs(np.corrcoef(per_stream[:-1].ravel(), per_stream[1:].ravel())[0, 1]) < 0.02
    assert abs(np.corrcoef(u[:, 0], u[:, 1])[0, 1]) < 0.02
    assert len({(a, b) for a, b in u.tolist()}) == len(u)
