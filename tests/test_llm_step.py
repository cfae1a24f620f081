"""The LLM fast path (graph-safe prefill, graphed decode+sample) equals the eager path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import REPO_ROOT
from voice_out.fast.llm_step import (
    COL_FEED,
    COL_HISTORY,
    COL_KIND,
    COL_OFFSET,
    COL_SLOT,
    COL_UNIFORMS,
    GraphedLLM,
    check_runs,
    decode_cols,
    pack_decode_rows,
    prefill_static,
    unpack_decode_rows,
)
from voice_out.model.checkpoint import random_llm
from voice_out.model.llm import KIND_LLM, KIND_SPEECH, KIND_TEXT, KVCache, SpeechLM
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
    rows = pack_decode_rows([2, 0], [17, 4], [True, False], u, [[], [1, 2, 3]], 4)
    assert rows.shape == (2, decode_cols(4)) and rows.dtype == np.int64
    # active, token, kind (speech), slot, offset, masked
    assert rows[:, :COL_UNIFORMS].tolist() == [[1, 17, 2, 2, 0, 1], [1, 4, 2, 0, 0, 0]]
    assert rows[:, COL_UNIFORMS : COL_UNIFORMS + 2].copy().view(np.float64).tolist() == u.tolist()
    assert rows[:, COL_FEED].tolist() == [0, 0]
    assert rows[:, COL_HISTORY:].tolist() == [[NO_TOKEN] * 4, [NO_TOKEN, 1, 2, 3]]
    fed = pack_decode_rows([2, 0], [17, 4], [True, False], u, [[], [1, 2, 3]], 4, feed=[False, True])
    assert fed[:, COL_FEED].tolist() == [0, 1]
    tail = pack_decode_rows([0], [1], [False], u[:1], [list(range(9))], 4)[0, COL_HISTORY:]
    assert tail.tolist() == [5, 6, 7, 8]
    run = pack_decode_rows([3, 3], [9, 8], [True, True], u, [[], []], 4, offsets=[0, 1], kinds=[1, 1])
    assert run[:, COL_KIND].tolist() == [1, 1] and run[:, COL_OFFSET].tolist() == [0, 1]


def test_the_unpacked_window_is_aligned_as_the_sampler_is_compiled() -> None:
    """A prefilled row's draw samples from views of the packed rows: its window must be 16-byte
    aligned, like the decode step's, or Triton compiles the sampler a second time (in a fresh
    server's first request: ~1.6 s on an H200) and loads it on its first launch."""
    u = counter_uniforms([5, 6], [0, 3])
    for n in (1, 2):
        packed = torch.empty(n, decode_cols(4), dtype=torch.int64)  # an allocator's block
        packed.copy_(torch.from_numpy(pack_decode_rows([2] * n, [17] * n, [True] * n, u[:n], [[1]] * n, 4)))
        rows = unpack_decode_rows(packed)
        assert rows.history.data_ptr() % 16 == 0
        assert rows.history.tolist() == [[NO_TOKEN] * 3 + [1]] * n


def test_check_runs() -> None:
    a = lambda *v: np.array(v, dtype=np.int64)  # noqa: E731
    assert check_runs(a(0, 3, 3, 3, 1), a(0, 0, 1, 2, 0)) is None
    assert "follow" in str(check_runs(a(3, 0, 3), a(0, 0, 1)))  # the run is broken
    assert "follow" in str(check_runs(a(3, 3), a(0, 2)))  # an offset skipped
    assert "one run" in str(check_runs(a(1, 1), a(0, 0)))  # two runs (or two decode rows) of slot 1


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
        want_ids = _decode_reference(lm, ref, slots, tokens, hist, u, masked)
        # the smallest window that holds the longest row (32, 64 or the whole cache, 96)
        longest = max(int(fast.lengths[s]) for s in slots) + 1
        rows = pack_decode_rows(slots, tokens, masked, u, hist, params.win_size)
        got_ids = fast_llm.decode_sample(rows, kv_len=longest + 2 * step)
        assert got_ids == want_ids
        assert ref.lengths[:5].tolist() == fast.lengths[:5].tolist()
    for layer in range(lm.dims.n_layers):
        for s in range(5):
            n = int(ref.lengths[s])
            torch.testing.assert_close(
                fast.k[layer, s, :, :n].float(), ref.k[layer, s, :, :n].float(), atol=2e-2, rtol=2e-2
            )
    assert int(fast.lengths[fast_llm.scratch_slot]) <= 4  # padding never reaches real slots


def _run_fed_rows(device: str, dtype: torch.dtype) -> None:
    """A step launched before the previous one's ids reached the host, its rows fed on the
    device (``feed``), equals the same step fed from the host after waiting."""
    lm, a, b = _setup(device, dtype)
    params = SamplingParams()
    win = params.win_size
    ahead, waits = (GraphedLLM(lm, c, params, decode_buckets=(1, 2, 4), prefill_buckets=(8, 32)) for c in (a, b))
    for g in (ahead, waits):
        g.capture_all()
        for slot, n in enumerate([6, 11, 3]):
            g.prefill(slot, _embeds(lm, n, slot), 0)
    slots, hist = [2, 0, 1], [[5, 5, 5], [], [7] * win]
    first = pack_decode_rows(slots, [11, 12, 13], [True] * 3, counter_uniforms([1, 2, 3], [0] * 3), hist, win)
    second_u = counter_uniforms([1, 2, 3], [1] * 3)
    for step in range(3):
        launched = ahead.decode_launch(first, kv_len=40)
        fed = [[*h, NO_TOKEN] for h in hist]  # the window's last id: fed too
        # slot 0 is not fed (its id known on the host): fed and host rows mix in one step
        known = [False, True, False]
        ids = [0, 4321, 0]
        rows = pack_decode_rows(slots, ids, [True] * 3, second_u, fed, win, feed=[not k for k in known])
        launched_next = ahead.decode_launch(rows, kv_len=40)
        got = launched.ids(), launched_next.ids()
        picked = waits.decode_sample(first, kv_len=40)
        tokens = [4321 if k else p for k, p in zip(known, picked, strict=True)]
        rows = pack_decode_rows(
            slots, tokens, [True] * 3, second_u, [[*h, t] for h, t in zip(hist, tokens, strict=True)], win
        )
        want = picked, waits.decode_sample(rows, kv_len=40)
        assert got == want, step
        first = pack_decode_rows(slots, want[1], [True] * 3, counter_uniforms([1, 2, 3], [2 + step] * 3), hist, win)
    assert a.lengths.tolist() == b.lengths.tolist()
    torch.testing.assert_close(a.k, b.k, atol=0, rtol=0)
    assert ahead.last_ids[slots].tolist() == want[1]
    # a fed row's window ends with the fed id too (it decides the repetition fallback)
    fed_rows = pack_decode_rows(
        slots, [0, 9, 0], [True] * 3, second_u, [[1, NO_TOKEN]] * 3, win, feed=[True, False, True]
    )
    resolved = ahead._resolve_fed(unpack_decode_rows(torch.from_numpy(fed_rows).to(device)))
    assert resolved.tokens.tolist() == [want[1][0], 9, want[1][2]]
    assert resolved.history[:, -2:].tolist() == [[1, want[1][0]], [1, NO_TOKEN], [1, want[1][2]]]


def test_fed_rows_equal_rows_fed_from_the_host_cpu() -> None:
    _run_fed_rows("cpu", torch.float32)


@pytest.mark.requires_cuda
def test_fed_rows_equal_rows_fed_from_the_host_cuda() -> None:
    _run_fed_rows("cuda", torch.bfloat16)  # the graphed fused step where Triton runs


def test_decode_window_too_small_for_the_cache_is_refused() -> None:
    lm, _, fast = _setup("cpu", torch.float32)
    g = GraphedLLM(lm, fast, SamplingParams(), decode_windows=(32,))
    rows = pack_decode_rows([0], [1], [False], counter_uniforms([0], [0]), [[]], SamplingParams().win_size)
    with pytest.raises(ValueError, match="needs 97 positions"):
        g.decode_sample(rows, kv_len=97)
    with pytest.raises(ValueError, match="int64"):
        g.decode_sample(rows.astype(np.int32), kv_len=90)
    with pytest.raises(ValueError, match="slots must be in"):
        g.decode_sample(np.concatenate([rows, rows]) + np.eye(1, rows.shape[1], COL_SLOT, dtype=np.int64) * 9, 90)
    with pytest.raises(ValueError, match="one run"):
        g.decode_sample(np.concatenate([rows, rows]), kv_len=90)  # two rows for slot 0, both offset 0


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


def test_decode_step_with_runs_equals_prefill_and_decode_cpu() -> None:
    """One step where streams decode while others append runs of rows (a text group, a first
    input's rest with SOS/TASK rows) gives the K/V, lengths and sampled ids of a prefill per
    run plus a decode step for the rest."""
    lm, ref, fast = _setup("cpu", torch.float32)
    params = SamplingParams()
    g = GraphedLLM(lm, fast, params, decode_buckets=(16,), prefill_buckets=())
    for slot, n in enumerate([9, 0, 20, 13]):
        if n:
            e = _embeds(lm, n, 50 + slot)
            lm.prefill(ref, slot, e, start_pos=0)
            lm.prefill(fast, slot, e, start_pos=0)
    # (slot, rows): slot 0 decodes, slot 2 takes a text group, slot 1 (empty) a first input,
    # slot 3 decodes
    text = [(KIND_TEXT, 11 + i) for i in range(5)]
    first = [(KIND_LLM, 0), (KIND_TEXT, 3), (KIND_TEXT, 4), (KIND_LLM, 1), (KIND_SPEECH, 77)]
    runs = [(0, [(KIND_SPEECH, 5)]), (2, text), (1, first), (3, [(KIND_SPEECH, 6)])]
    u = counter_uniforms([s for s, _ in runs], [4] * len(runs))
    hist = [[5, 5, 5], [], [1], [6] * 9]
    masked = [True, False, True, False]
    # the reference: a prefill per run (its last hidden), a decode step for the single rows
    hidden = {s: lm.prefill(ref, s, lm.embed_rows(rows), start_pos=int(ref.lengths[s])) for s, rows in runs[1:3]}
    singles = [0, 3]
    h = lm.decode_step(ref, torch.tensor(singles), lm.embed_rows([runs[0][1][0], runs[3][1][0]]))
    hidden.update(zip(singles, h, strict=True))
    stacked = torch.stack([hidden[s] for s, _ in runs])
    window = torch.tensor([[NO_TOKEN] * (params.win_size - len(r)) + r for r in hist], dtype=torch.long)
    logp = mask_eos_(lm.logprobs(stacked), torch.tensor(masked), lm.dims.eos_token)
    want = ras_sample_batch(logp, window, torch.from_numpy(u).float(), params).tolist()
    # the same as one step: each run's sampling inputs on its last row, idle draws before it
    offsets: list[int]
    hs: list[list[int]]
    slots, offsets, kinds, ids, m, hs, us, last = [], [], [], [], [], [], [], []
    for (s, rows), ui, hi, mi in zip(runs, u, hist, masked, strict=True):
        n = len(rows)
        slots += [s] * n
        offsets += range(n)
        kinds += [k for k, _ in rows]
        ids += [i for _, i in rows]
        m += [True] * (n - 1) + [mi]
        hs += [[]] * (n - 1) + [hi]
        us += [np.full(2, 0.5)] * (n - 1) + [ui]
        last.append(len(ids) - 1)
    packed = pack_decode_rows(slots, ids, m, np.stack(us), hs, params.win_size, offsets=offsets, kinds=kinds)
    picked = g.decode_sample(packed, kv_len=32)
    assert [picked[i] for i in last] == want
    assert fast.lengths.tolist() == ref.lengths.tolist() == [10, 5, 25, 14, 0, 0]
    for s in range(4):
        n = int(ref.lengths[s])
        torch.testing.assert_close(fast.k[:, s, :, :n], ref.k[:, s, :, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fast.v[:, s, :, :n], ref.v[:, s, :, :n], atol=1e-5, rtol=1e-5)


def _run_draws(device: str, dtype: torch.dtype) -> None:
    """``GraphedLLM.draw`` (prefilled rows' draws from packed host rows: graphed per row count
    where captured, eager otherwise) gives the ids and per-slot last ids of ``sample`` over
    the same rows unpacked on the device, draw after draw of one row count."""
    lm, _, fast = _setup(device, dtype)
    g = GraphedLLM(lm, fast, SamplingParams(), decode_buckets=(1, 2), decode_windows=(32,), prefill_buckets=(8,))
    g.capture_all()
    if device == "cuda":
        assert sorted(g._draw.captured_keys) == list(range(1, 5))  # type: ignore[type-var]
    win = SamplingParams().win_size
    gen = torch.Generator().manual_seed(4)
    for step, n in enumerate([1, 2, 1, 5]):  # 5 rows: no graph, eager
        hidden = torch.randn(n, lm.dims.hidden_size, generator=gen).to(device, dtype)
        slots = list(range(n))
        history = [[int(t) for t in torch.randint(0, 50, (win,), generator=gen)] for _ in range(n)]
        rows = pack_decode_rows(slots, [0] * n, [step % 2 == 0] * n, counter_uniforms(slots, [step] * n), history, win)
        got = g.draw(hidden, rows).tolist()
        got_last = g.last_ids[:n].tolist()
        g.last_ids.zero_()
        want = g.sample(hidden, unpack_decode_rows(torch.from_numpy(rows).to(device))).tolist()
        assert got == want and got_last == g.last_ids[:n].tolist() == want, (step, n)


def test_draws_of_prefilled_rows_equal_sample_cpu() -> None:
    _run_draws("cpu", torch.float32)


@pytest.mark.requires_cuda
def test_draws_of_prefilled_rows_equal_sample_cuda() -> None:
    _run_draws("cuda", torch.bfloat16)  # graphed for 1 to 4 rows, the fused sampler where Triton runs
