from __future__ import annotations

import pytest
import torch

from voice_out.fast.graphs import GraphedFn, GraphShapeError, family_stream, graphs_disabled


def _fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w) * 2.0


def test_cpu_runs_eagerly() -> None:
    g = GraphedFn(_fn, name="mlp")
    x, w = torch.randn(3, 4), torch.randn(4, 5)
    torch.testing.assert_close(g(3, x, w), _fn(x, w))
    assert g.captured_keys == []
    assert not g.would_capture(3, x, w)  # eager: a call never captures
    assert g.static_inputs(3) is None


@pytest.mark.requires_cuda
def test_graph_replay_equals_eager_per_bucket() -> None:
    g = GraphedFn(_fn, name="mlp")
    w = torch.randn(64, 32, device="cuda")
    assert g.would_capture(1, torch.randn(1, 64, device="cuda"), w)
    for bucket in (1, 4, 1, 8, 4):
        x = torch.randn(bucket, 64, device="cuda")
        out = g(bucket, x, w).clone()
        torch.testing.assert_close(out, _fn(x, w))
    assert sorted(g.captured_keys) == [1, 4, 8]  # type: ignore[type-var]
    assert not g.would_capture(4, x, w) and g.would_capture(2, x, w)
    with pytest.raises(GraphShapeError, match="VOICE_OUT_CUDA_GRAPHS=0"):
        g(4, torch.randn(5, 64, device="cuda"), w)
    with graphs_disabled():
        x = torch.randn(5, 64, device="cuda")
        torch.testing.assert_close(g(4, x, w), _fn(x, w))


@pytest.mark.requires_cuda
@pytest.mark.parametrize("each", [True, False])
def test_warm_up_before_every_capture_or_only_the_first(each: bool) -> None:
    calls: list[int] = []

    def counted(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return _fn(x, w)

    g = GraphedFn(counted, name="mlp", warmup=2, warmup_each=each)
    w = torch.randn(64, 32, device="cuda")
    for bucket in (1, 4, 8):
        x = torch.randn(bucket, 64, device="cuda")
        torch.testing.assert_close(g(bucket, x, w).clone(), _fn(x, w))  # capture, then replay
        torch.testing.assert_close(g(bucket, x, w).clone(), _fn(x, w))  # replay
    # 2 warm-up runs + the captured one per capture; or the warm-up before the first only
    assert calls == ([1, 1, 1, 4, 4, 4, 8, 8, 8] if each else [1, 1, 1, 4, 8])


@pytest.mark.requires_cuda
def test_inputs_written_into_the_static_buffers_replay_without_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    g = GraphedFn(_fn, name="mlp")
    w = torch.randn(64, 32, device="cuda")
    assert g.static_inputs(4) is None
    g.capture(4, torch.zeros(4, 64, device="cuda"), w)
    bufs = g.static_inputs(4)
    assert bufs is not None and bufs[0].shape == (4, 64)
    x = torch.randn(4, 64, device="cuda")
    bufs[0].copy_(x)
    copies: list[torch.Tensor] = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(
        torch.Tensor,
        "copy_",
        lambda self, *a, **k: copies.append(self) or real_copy(self, *a, **k),  # type: ignore[func-returns-value]
    )
    out = g(4, *bufs).clone()
    monkeypatch.undo()
    assert copies == []
    torch.testing.assert_close(out, _fn(x, w))


@pytest.mark.requires_cuda
def test_family_streams_are_distinct_and_stable() -> None:
    a, b = family_stream("test-a"), family_stream("test-b")
    assert family_stream("test-a") is a
    handles = {a.cuda_stream, b.cuda_stream, torch.cuda.default_stream().cuda_stream}
    assert len(handles) == 3
    # many more streams drawn from PyTorch's round-robin pool do not change a family's stream
    for _ in range(70):
        torch.cuda.Stream()
    assert family_stream("test-b").cuda_stream == b.cuda_stream


@pytest.mark.requires_cuda
def test_graphs_of_two_families_capture_on_their_own_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real = torch.cuda.CUDAGraph.capture_begin

    def spy(graph: torch.cuda.CUDAGraph, *args: object, **kw: object) -> object:
        seen.append(torch.cuda.current_stream().cuda_stream)  # the stream the capture records
        return real(graph, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", spy)
    w = torch.randn(64, 32, device="cuda")
    x = torch.randn(4, 64, device="cuda")
    GraphedFn(_fn, family="test-llm").capture(4, x, w)
    GraphedFn(_fn, family="test-llm").capture(4, x, w)
    GraphedFn(_fn, family="test-t2w").capture(4, x, w)
    assert seen == [family_stream("test-llm").cuda_stream] * 2 + [family_stream("test-t2w").cuda_stream]
    assert seen[0] != seen[2]


def concurrent_replay_mismatches(family_one: str, family_two: str, reps: int = 200) -> int:
    """Replay graphs of skinny GEMM chains (split-K territory, like a decode step's) of the two
    families at once on two streams ``reps`` times; how many results differ from eager."""
    w1 = torch.randn(4864, 896, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(896, 4864, device="cuda", dtype=torch.bfloat16)

    def deep(x: torch.Tensor) -> torch.Tensor:
        for _ in range(8):
            x = torch.tanh((x @ w1) * 0.03) @ w2 * 0.03
        return x

    g1, g2 = GraphedFn(deep, family=family_one), GraphedFn(deep, family=family_two)
    x1 = torch.randn(2, 4864, device="cuda", dtype=torch.bfloat16)
    x2 = torch.randn(16, 4864, device="cuda", dtype=torch.bfloat16)
    want1, want2 = deep(x1), deep(x2)
    g1.capture(2, x1)
    g2.capture(16, x2)
    other = family_stream("test-side")
    outs1, outs2 = [], []
    for _ in range(reps):
        other.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(other):
            outs2.append(g2(16, x2).clone())
        outs1.append(g1(2, x1).clone())
    torch.cuda.current_stream().wait_stream(other)
    torch.cuda.synchronize()
    bad = sum(not torch.allclose(o, want1, rtol=1e-2, atol=1e-2) for o in outs1)
    return bad + sum(not torch.allclose(o, want2, rtol=1e-2, atol=1e-2) for o in outs2)


@pytest.mark.requires_cuda
def test_graphs_of_two_families_replay_concurrently() -> None:
    assert concurrent_replay_mismatches("test-one", "test-two") == 0
