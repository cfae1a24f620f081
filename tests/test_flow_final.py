"""``Flow.final_inputs`` + ``Flow.final_core``: several streams' final (full-attention) calls in
one right-padded pass of fixed length T.

Same small random flow as tests/test_flow_streaming.py. What is proven:

* every row's mel over its span equals its own ``inference(..., streaming=False,
  finalize=True)`` within 1e-5 in float32, for rows mixing prompt lengths (none, short, long),
  token lengths and voices, with T exactly the longest row, T much larger, B = 1 and B = 3;
* the output is finite everywhere, padding frames included;
* a row does not depend on its neighbours or on T beyond rounding;
* bad layouts raise;
* on CUDA (``requires_cuda``): the pass captures as one CUDA graph (no host sync, fixed shapes)
  and a replay with other rows' lengths equals eager.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tests.test_flow_streaming import inputs, make_flow, tiny_dims
from voice_out.fast import fused_flow
from voice_out.model.flow import Flow

TOL = 1e-5  # fp32: the padded pass differs from the single one only by matmul blocking

Item = tuple[Tensor, Tensor, Tensor, Tensor]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["fused", "unfused"])
def flow(request: pytest.FixtureRequest) -> Flow:
    """Both estimator layouts: fused weights (what the engine runs eagerly: the loaders'
    ``fuse_`` and the fast path's feed-forward carrier) and plain modules."""
    flow = make_flow(tiny_dims())
    if request.param == "fused":
        fused_flow.fuse_ff_(flow.fuse_().estimator)
    return flow


def single(flow: Flow, it: Item) -> Tensor:
    return flow.inference(*it, streaming=False, finalize=True)


def final_batch(flow: Flow, items: list[Item], total: int) -> tuple[list[Tensor], Tensor]:
    ids, n_valid, embedding, cond, spans = flow.final_inputs(items, total)
    mel = flow.final_core(ids, n_valid, embedding, cond)
    assert mel.dtype == torch.float32
    assert mel.shape == (len(items), flow.dims.n_mels, flow.dims.token_mel_ratio * total)
    return [mel[i : i + 1, :, start:stop] for i, (start, stop) in enumerate(spans)], mel


def max_err(a: Tensor, b: Tensor) -> float:
    assert a.shape == b.shape and a.dtype == b.dtype == torch.float32
    return float((a - b).abs().max())


# (prompt tokens, generated tokens): none, short and long prompts; 1 to 40 tokens
MIXED = [(0, 9), (7, 1), (13, 22), (24, 40), (3, 4)]


@pytest.mark.parametrize(
    ("rows", "total"),
    [
        ([0, 1, 2], 35),  # B = 3, T exactly the longest row
        ([0, 1, 2], 125),  # B = 3, T much larger
        ([3], 64),  # B = 1, T exactly P + N
        ([4], 100),  # B = 1, T much larger
        ([0, 1, 2, 3, 4], 75),  # mixed, the longest row short of T
    ],
)
def test_every_row_equals_its_final_inference(flow: Flow, rows: list[int], total: int) -> None:
    items = [inputs(flow, *MIXED[r], seed=20 + r) for r in rows]
    with torch.no_grad():
        got, mel = final_batch(flow, items, total)
        want = [single(flow, it) for it in items]
    errs = [max_err(g, w) for g, w in zip(got, want, strict=True)]
    print(f"rows {rows}, T = {total}: max abs per row {[f'{e:.2e}' for e in errs]}")
    assert max(errs) < TOL
    assert bool(torch.isfinite(mel).all())


def test_a_row_does_not_depend_on_its_neighbours_or_bucket(flow: Flow) -> None:
    target = inputs(flow, *MIXED[2], seed=22)
    with torch.no_grad():
        alone, _ = final_batch(flow, [target], 35)
        short, _ = final_batch(flow, [inputs(flow, 0, 2, seed=5), target], 50)
        long, _ = final_batch(flow, [inputs(flow, 30, 60, seed=6), target, inputs(flow, 1, 1, seed=7)], 100)
    assert max_err(alone[0], short[1]) < TOL
    assert max_err(alone[0], long[1]) < TOL


def test_bad_layouts_raise(flow: Flow) -> None:
    it = inputs(flow, 5, 10, seed=1)
    with pytest.raises(ValueError, match="exceed total"):
        flow.final_inputs([it], 14)
    with pytest.raises(ValueError, match="at least one"):
        flow.final_inputs([], 25)
    with pytest.raises(ValueError, match="N >= 1"):
        flow.final_inputs([(it[0][:, :0], *it[1:])], 25)
    ids, n_valid, embedding, cond, _ = flow.final_inputs([it], 25)
    with pytest.raises(ValueError, match="cond must be"):
        flow.final_core(ids, n_valid, embedding, cond[:, :, :-1])


# -- CUDA ------------------------------------------------------------------------------------


@pytest.mark.requires_cuda
def test_cuda_graphed_final_core_equals_eager() -> None:
    """``final_core`` captures as one CUDA graph (capture fails on any host sync) and a replay
    with other rows (other lengths, same (B, T)) equals the eager pass."""
    prev = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        flow = make_flow(tiny_dims()).fuse_().to("cuda")
        total = 75
        first = [inputs(flow, *MIXED[r], seed=30 + r) for r in (0, 1, 2)]
        second = [inputs(flow, *MIXED[r], seed=40 + r) for r in (3, 4, 1)]
        with torch.no_grad():
            static = [t.clone() for t in flow.final_inputs(first, total)[:4]]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up off the capture
                    flow.final_core(*static)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = flow.final_core(*static)
            *layout, spans = flow.final_inputs(second, total)
            for dst, src in zip(static, layout, strict=True):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            eager = flow.final_core(*layout)
            want = [single(flow, it) for it in second]
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = prev
    assert bool(torch.isfinite(out).all())
    assert float((out - eager).abs().max()) < 1e-5
    for i, (start, stop) in enumerate(spans):
        assert float((out[i : i + 1, :, start:stop] - want[i]).abs().max()) < 1e-4
