"""``Flow.inference_batch``: several streams' non-final chunks in one right-padded pass.

Same small random flow as tests/test_flow_streaming.py (5-token encoder chunk), so short
sequences cross many chunk boundaries. What is proven:

* every row of a batch mixing prompt lengths (none, short, long, chunk-aligned), token lengths
  and voices equals its own ``inference(..., streaming=True, finalize=False)`` within 1e-5 in
  float32, and a batch of one equals it bit for bit;
* it really is ONE pass: one encoder call over B padded rows, 10 estimator calls over 2B rows;
* a row does not depend on its neighbours (it is the same next to short or long rows);
* the same with an estimator chunk of two encoder chunks, and in bfloat16 (sanity bound);
* calls that are not batchable (not on a chunk boundary, no look-ahead) raise.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

from tests.test_flow_streaming import inputs, make_flow, tiny_dims
from voice_out.model.flow import Flow

TOL = 1e-5  # fp32: the batched pass differs from the single one only by matmul blocking

Item = tuple[Tensor, Tensor, Tensor, Tensor]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def flow() -> Flow:
    return make_flow(tiny_dims())


def item(flow: Flow, n_prompt: int, n_real: int, seed: int) -> Item:
    """A non-final call: ``n_real`` generated tokens (prompt + n_real on a chunk boundary) + 3
    look-ahead tokens, in the voice drawn from ``seed``."""
    assert flow.dims.chunk_aligned(n_prompt + n_real)
    return inputs(flow, n_prompt, n_real + flow.dims.pre_lookahead, seed=seed)


def single(flow: Flow, it: Item) -> Tensor:
    return flow.inference(*it, streaming=True, finalize=False)


def max_err(a: Tensor, b: Tensor) -> float:
    assert a.shape == b.shape and a.dtype == b.dtype == torch.float32
    return float((a - b).abs().max())


# (prompt tokens, generated tokens before the look-ahead): prompt + generated on a boundary
MIXED = [(0, 5), (2, 13), (13, 7), (20, 25), (24, 1), (7, 38), (13, 2)]


def test_every_row_equals_its_single_call(flow: Flow) -> None:
    items = [item(flow, p, n, seed=10 + k) for k, (p, n) in enumerate(MIXED)]
    with torch.no_grad():
        got = flow.inference_batch(items)
        want = [single(flow, it) for it in items]
    errs = [max_err(g, w) for g, w in zip(got, want, strict=True)]
    print("batched vs single, max abs per row:", ", ".join(f"{e:.2g}" for e in errs))
    assert max(errs) <= TOL
    ratio = flow.dims.token_mel_ratio
    assert [g.shape[2] for g in got] == [ratio * n for _, n in MIXED]
    # the rows are different streams (different voices and tokens): nothing trivially equal
    assert float((want[2][:, :, :4] - want[6]).abs().max()) > 1e-2


def test_a_batch_of_one_is_the_single_call_bit_for_bit(flow: Flow) -> None:
    it = item(flow, 13, 12, seed=3)
    with torch.no_grad():
        (got,) = flow.inference_batch([it])
        assert torch.equal(got, single(flow, it))
        assert flow.inference_batch([]) == []


def test_one_pass_over_padded_rows(flow: Flow) -> None:
    items = [item(flow, p, n, seed=20 + k) for k, (p, n) in enumerate(MIXED[:4])]
    longest = max(p + n for p, n in MIXED[:4])
    seen: list[tuple[str, tuple[int, ...]]] = []
    hooks = [
        flow.encoder.register_forward_hook(lambda m, a, o: seen.append(("encoder", tuple(a[0].shape[:2])))),
        flow.estimator.register_forward_hook(lambda m, a, o: seen.append(("estimator", tuple(a[0].shape[::2])))),
    ]
    try:
        with torch.no_grad():
            flow.inference_batch(items)
    finally:
        for h in hooks:
            h.remove()
    ratio, steps = flow.dims.token_mel_ratio, flow.dims.n_timesteps
    assert seen == [("encoder", (4, longest))] + [("estimator", (8, ratio * longest))] * steps


def test_a_row_does_not_depend_on_its_neighbours(flow: Flow) -> None:
    it = item(flow, 13, 12, seed=4)
    with torch.no_grad():
        alone = single(flow, it)
        short = flow.inference_batch([it, item(flow, 0, 5, seed=5)])[0]
        long = flow.inference_batch([item(flow, 24, 56, seed=6), it, item(flow, 2, 3, seed=7)])[1]
        same = flow.inference_batch([it, it])
    assert max_err(short, alone) <= TOL and max_err(long, alone) <= TOL
    assert torch.equal(same[0], same[1])  # identical rows stay identical


def test_other_chunk_geometry_and_bfloat16() -> None:
    """Estimator chunk = 2 x the upsampled encoder chunk (boundaries every 10 tokens)."""
    flow = make_flow(tiny_dims(enc_chunk=5, est_chunk=20), seed=9)
    shapes = [(7, 3), (0, 20), (13, 27), (5, 5)]
    items = [item(flow, p, n, seed=30 + k) for k, (p, n) in enumerate(shapes)]
    with torch.no_grad():
        want = [single(flow, it) for it in items]
        got = flow.inference_batch(items)
        assert max(max_err(g, w) for g, w in zip(got, want, strict=True)) <= TOL
        low = flow.to(torch.bfloat16)
        low_single = [single(low, it) for it in items]
        low_batch = low.inference_batch(items)
    err = max(max_err(g, w) for g, w in zip(low_batch, low_single, strict=True))
    drift = max(max_err(g, w) for g, w in zip(low_single, want, strict=True))
    print(f"bfloat16 batched vs bfloat16 single: {err:.3g}; bfloat16 single vs float32: {drift:.3g}")
    assert err <= max(drift, 1e-3)  # batching costs no more than bfloat16 itself


def test_calls_that_cannot_be_batched_raise(flow: Flow) -> None:
    good = item(flow, 13, 12, seed=8)
    off_boundary = inputs(flow, 13, 11 + 3, seed=8)  # 13 + 11 = 24: not a chunk boundary
    with torch.no_grad(), pytest.raises(ValueError, match="chunk boundary"):
        flow.inference_batch([good, off_boundary])
    token, prompt_token, prompt_feat, embedding = inputs(flow, 5, 2, seed=8)
    with torch.no_grad(), pytest.raises(ValueError, match="look-ahead"):
        flow.inference_batch([good, (token, prompt_token, prompt_feat, embedding)])
    with torch.no_grad(), pytest.raises(ValueError, match="prompt_feat"):
        flow.inference_batch([good, (token, prompt_token, prompt_feat[:, 1:], embedding)])
