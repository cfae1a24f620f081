from __future__ import annotations

import pytest
import torch

from voice_out.model.cuda_graphs import GraphedFn, GraphShapeError, graphs_disabled


def _fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w) * 2.0


def test_cpu_runs_eagerly() -> None:
    g = GraphedFn(_fn, name="mlp")
    x, w = torch.randn(3, 4), torch.randn(4, 5)
    torch.testing.assert_close(g(3, x, w), _fn(x, w))
    assert g.captured_keys == []
    assert not g.would_capture(3, x, w)  # eager: a call never captures


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
