"""The vocoder's fused Snake kernel equals the torch form (GPU), and is refused where it cannot run."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import REPO_ROOT
from voice_out.fast import fused_vocoder
from voice_out.fast.fused_vocoder import FusedSnake
from voice_out.fast.kernels import vocoder as hift_kernels
from voice_out.model.checkpoint import random_hift
from voice_out.model.vocoder import SNAKE_EPS, Snake

FULL = REPO_ROOT / "configs" / "models" / "cosyvoice2-0.5b"
TINY = REPO_ROOT / "configs" / "models" / "tiny"


def test_snake_kernel_only_for_cuda_float32() -> None:
    assert not hift_kernels.available("cpu", torch.float32)
    assert not hift_kernels.available("cuda", torch.bfloat16)
    hift = random_hift(TINY, "cpu", seed=1)
    assert any(isinstance(m, Snake) for m in hift.modules())
    assert not fused_vocoder.use_kernels(hift, True)
    assert not any(isinstance(m, FusedSnake) for m in hift.modules())


@pytest.mark.requires_cuda
@pytest.mark.parametrize(("channels", "frames"), [(256, 56), (64, 26881), (3, 5)])
def test_snake_kernel_equals_torch(channels: int, frames: int) -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(channels)
    snake = Snake(channels).to(dev)
    with torch.no_grad():
        snake.alpha.copy_(torch.rand(channels, generator=gen, device=dev) * 4 - 1)  # either sign, near 0 too
    x = torch.randn(2, channels, frames, generator=gen, device=dev) * 3
    with torch.no_grad():
        want = snake(x)
        got = hift_kernels.snake(x, snake.alpha, SNAKE_EPS)
        fused = FusedSnake.of(snake)
        assert fused.alpha is snake.alpha
        assert torch.equal(fused(x), got)
        # a strided input falls back to the torch form
        strided = x.transpose(1, 2).contiguous().transpose(1, 2)
        torch.testing.assert_close(fused(strided), want, atol=0, rtol=0)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


@pytest.mark.requires_cuda
def test_vocoder_with_the_snake_kernel_equals_torch() -> None:
    """The whole vocoder of a first chunk, the full-size shapes: within float32 rounding."""
    dev = torch.device("cuda")
    hift = random_hift(FULL, dev, seed=2)
    mel = torch.randn(1, hift.dims.in_channels, 56, generator=torch.Generator(device=dev).manual_seed(3), device=dev)
    with torch.no_grad():
        want, want_source = hift(mel)
        names = [n for n, _ in hift.named_parameters()]
        assert fused_vocoder.use_kernels(hift, True)
        assert any(isinstance(m, FusedSnake) for m in hift.modules())
        assert [n for n, _ in hift.named_parameters()] == names  # the same weights, the same names
        got, source = hift(mel)
    assert torch.equal(source, want_source)  # the source has no Snake
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert not fused_vocoder.use_kernels(hift, False)  # and back to the torch form
    assert not any(isinstance(m, FusedSnake) for m in hift.modules())
    assert [n for n, _ in hift.named_parameters()] == names
