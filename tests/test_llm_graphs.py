"""The LLM fast path (graph-safe prefill, graphed decode+sample) equals the eager path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import REPO_ROOT
from voice_out.model.checkpoint import random_llm
from voice_out.model.llm_graphs import GraphedLLM, decode_cols, pack_decode_rows, prefill_static
from voice_out.model.qwen2 import KVCache, SpeechLM
from voice_out.model.sampling import NO_TOKEN, SamplingParams, counter_uniforms, mask_eos_, ras_sample_batch

TINY = REPO_ROOT / "configs" / "models" / "tiny"


def _setup(device: str, dtype: torch.dtype, n_slots: int = 6, max_len: int = 96) -> tuple[SpeechLM, KVCache, KVCache]:
    lm = random_llm(TINY, device, dtype, seed=3)
    a = KVCache.allocate(lm.dims, n_slots, max_len, device, dtype)
    b = KVCache.allocate(lm.dims, n_slots, max_len, device, dtype)
    return lm, a, b


def _embeds(lm: SpeechLM, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 6561, (n,), generator=g).to(lm.llm_decoder.weight.device)
    return lm.embed_speech(ids)


def test_static_prefill_equals_prefill_cpu() -> None:
    lm, ref, fast = _setup("cpu", torch.float32)
    for slot, (start_len, n) in enumerate([(0, 7), (5, 3), (0, 16)]):
        if start_len:
            e0 = _embeds(lm, start_len, 100 + slot)
            lm.prefill(ref, slot, e0, start_pos=0)
            lm.prefill(fast, slot, e0, start_pos=0)
        e = _embeds(lm, n, slot)
        want = lm.prefill(ref, slot, e, start_pos=start_len)
        padded = torch.cat([e, torch.randn(16 - n, e.shape[1])])  # garbage padding rows
        t = lambda v: torch.tensor([v])  # noqa: E731
        window = None if slot == 0 else 24 + 8 * slot  # the whole cache, or the first 32 / 40
        got = prefill_static(lm, fast, t(slot), t(start_len), t(n), padded, window)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert fast.lengths[slot] == ref.lengths[slot] == start_len + n
        k_ref = ref.k[:, slot, :, : start_len + n]
        torch.testing.assert_close(fast.k[:, slot, :, : start_len + n], k_ref, atol=1e-5, rtol=1e-5)


def _decode_reference(
    lm: SpeechLM,
    cache: KVCache,
    slots: list[int],
    tokens: list[int],
    hist: list[list[int]],
    u: np.ndarray,
    masked: list[bool],
) -> list[int]:
    """The eager decode step and sampling of the same inputs, unpacked."""
    dev = lm.llm_decoder.weight.device
    win = SamplingParams().win_size
    embeds = lm.embed_speech(torch.tensor(tokens, device=dev))
    h = lm.decode_step(cache, torch.tensor(slots, device=dev), embeds)
    window = torch.tensor([[NO_TOKEN] * (win - len(r)) + r for r in hist], dtype=torch.long, device=dev)
    logp = mask_eos_(lm.logprobs(h), torch.tensor(masked, device=dev), lm.dims.eos_token)
    uniforms = torch.from_numpy(u).float().to(dev)
    return [int(t) for t in ras_sample_batch(logp, window, uniforms, SamplingParams()).tolist()]


def test_pack_decode_rows_layout() -> None:
    u = counter_uniforms([5, 6], [0, 3])
    rows = pack_decode_rows([17, 4], [True, False], u, [[], [1, 2, 3]], 4)
    assert rows.shape == (2, decode_cols(4)) and rows.dtype == np.int64
    assert rows[:, :3].tolist() == [[1, 17, 1], [1, 4, 0]]
    assert rows[:, 3:5].copy().view(np.float64).tolist() == u.tolist()
    assert rows[:, 5:].tolist() == [[NO_TOKEN] * 4, [NO_TOKEN, 1, 2, 3]]
    assert pack_decode_rows([1], [False], u[:1], [list(range(9))], 4)[0, 5:].tolist() == [5, 6, 7, 8]


def _run_equivalence(device: str, dtype: torch.dtype) -> None:
    lm, ref, fast = _setup(device, dtype)
    params = SamplingParams()
    fast_llm = GraphedLLM(lm, fast, params, decode_buckets=(1, 2, 4), decode_windows=(32, 64), prefill_buckets=(8, 32))
    assert fast_llm.decode_windows == (32, 64, 96)
    fast_llm.capture_all()
    for slot, n in enumerate([9, 4, 20, 13, 30]):
        e = _embeds(lm, n, slot)
        want = lm.prefill(ref, slot, e, start_pos=0)
        got = fast_llm.prefill(slot, e, 0)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    gen = torch.Generator().manual_seed(7)
    for step, slots in enumerate([[0], [3, 1], [2, 4, 0], [1, 0, 3, 2], [4, 3, 2, 1, 0]]):
        tokens = torch.randint(0, 6561, (len(slots),), generator=gen).tolist()
        # short windows that repeat one token, so the repetition fallback fires sometimes
        hist = [[tokens[i]] * (i * 3 % (params.win_size + 1)) for i in range(len(slots))]
        u = counter_uniforms(slots, [step] * len(slots))
        masked = [i % 2 == 0 for i in range(len(slots))]
        want = _decode_reference(lm, ref, slots, tokens, hist, u, masked)
        # the smallest window that holds the longest row (32, 64 or the whole cache, 96)
        longest = max(int(fast.lengths[s]) for s in slots) + 1
        rows = pack_decode_rows(tokens, masked, u, hist, params.win_size)
        got = fast_llm.decode_sample(slots, rows, kv_len=longest + 2 * step)
        assert got == want
        assert ref.lengths[:5].tolist() == fast.lengths[:5].tolist()
    for layer in range(lm.dims.n_layers):
        for s in range(5):
            n = int(ref.lengths[s])
            torch.testing.assert_close(
                fast.k[layer, s, :, :n].float(), ref.k[layer, s, :, :n].float(), atol=2e-2, rtol=2e-2
            )
    assert int(fast.lengths[fast_llm.scratch_slot]) <= 4  # padding never reaches real slots


def test_decode_window_too_small_for_the_cache_is_refused() -> None:
    lm, _, fast = _setup("cpu", torch.float32)
    g = GraphedLLM(lm, fast, SamplingParams(), decode_windows=(32,))
    rows = pack_decode_rows([1], [False], counter_uniforms([0], [0]), [[]], SamplingParams().win_size)
    with pytest.raises(ValueError, match="needs 97 positions"):
        g.decode_sample([0], rows, kv_len=97)
    with pytest.raises(ValueError, match="int64"):
        g.decode_sample([0, 1], rows, kv_len=90)  # one row for two slots


def test_graphed_llm_eager_fallback_equals_reference_cpu() -> None:
    _run_equivalence("cpu", torch.float32)  # CPU: graphs off, same code


@pytest.mark.requires_cuda
def test_graphed_llm_equals_eager_cuda_fp32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    _run_equivalence("cuda", torch.float32)


@pytest.mark.requires_cuda
def test_graphed_llm_captures_every_bucket() -> None:
    lm, _, fast = _setup("cuda", torch.bfloat16)
    g = GraphedLLM(
        lm, fast, SamplingParams(), decode_buckets=(1, 2, 4), decode_windows=(32,), prefill_buckets=(8, 32), fused=False
    )
    g.capture_all()
    assert sorted(g._decode) == [32, 96]
    for graphs in g._decode.values():
        assert sorted(graphs.captured_keys) == [1, 2, 4]  # type: ignore[type-var]
    assert sorted(g._prefill) == [32, 96]
    for graphs in g._prefill.values():
        assert sorted(graphs.captured_keys) == [8, 32]  # type: ignore[type-var]
    assert int(fast.lengths.sum()) == 0
