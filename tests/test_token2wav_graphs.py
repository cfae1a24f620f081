"""The token2wav fast path (graphed first-chunk flow, graphed vocoder) equals the eager path."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import REPO_ROOT
from voice_out.model.checkpoint import random_flow, random_hift
from voice_out.model.token2wav import Token2Wav

TINY = REPO_ROOT / "configs" / "models" / "tiny"


def _voice(n_prompt: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    token = torch.randint(0, 6561, (1, n_prompt), generator=g, dtype=torch.int32)
    feat = torch.randn(1, 2 * n_prompt, 80, generator=g).cumsum(1) * 0.05 - 6.0
    emb = torch.randn(1, 192, generator=g)
    return token.to(device), feat.to(device), emb.to(device)


def _stream_all(t2w: Token2Wav, flow_path: str, n_prompt: int, n_tokens: int, device: str) -> list[torch.Tensor]:
    token, feat, emb = _voice(n_prompt, device)
    prepared = t2w.prepare_voice(token, feat, emb) if flow_path == "cached" else None
    stream = t2w.open_stream(token, feat, emb, flow_path=flow_path, flow_prompt=prepared)  # type: ignore[arg-type]
    speech = torch.randint(0, 6561, (n_tokens,), generator=torch.Generator().manual_seed(9)).tolist()
    return [c.clone() for c in t2w.stream_all(stream, speech)]


def test_graphs_are_a_no_op_on_cpu() -> None:
    t2w = Token2Wav(random_flow(TINY, "cpu"), random_hift(TINY, "cpu"))
    t2w.use_cuda_graphs(True)
    assert t2w._graph_flow is None and t2w._graph_hift is None


@pytest.mark.requires_cuda
@pytest.mark.parametrize("flow_path", ["rerun", "cached"])
def test_graphed_token2wav_equals_eager(flow_path: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t2w = Token2Wav(random_flow(TINY, "cuda"), random_hift(TINY, "cuda"))
    want = _stream_all(t2w, flow_path, 50, 190, "cuda")
    t2w.use_cuda_graphs(True)
    for _ in range(2):  # the second run replays graphs captured by the first
        got = _stream_all(t2w, flow_path, 50, 190, "cuda")
        assert [len(c) for c in got] == [len(c) for c in want]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=0)
    assert t2w._graph_flow is not None and t2w._graph_flow.captured_keys
    assert t2w._graph_hift_cached is not None and t2w._graph_hift_cached.captured_keys
