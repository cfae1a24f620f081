"""The vocoder's Snake activations as one Triton kernel each, swapped into a built HiFT.

:class:`voice_out.model.vocoder.Snake` is the torch form (the reference). :func:`use_kernels`
replaces every Snake of a HiFT with a :class:`FusedSnake` that shares its ``alpha`` and runs
``voice_out.fast.kernels.vocoder.snake`` on contiguous inputs (the torch form otherwise), and
puts the plain Snakes back when turned off. The weights and their names do not change.
``tests/test_hift_kernels.py`` holds the two to the same output. Start-up only (it changes the
module); the GPU worker thread.
"""

from __future__ import annotations

from torch import Tensor, nn

from voice_out.fast.kernels import vocoder as vocoder_kernels
from voice_out.model.vocoder import SNAKE_EPS, HiFT, Snake


class FusedSnake(Snake):
    """A :class:`Snake` computed by one fused kernel where the input is contiguous."""

    @classmethod
    def of(cls, snake: Snake) -> FusedSnake:
        """A FusedSnake sharing ``snake``'s ``alpha`` (the parameter itself, not a copy)."""
        fused = cls(0)
        fused.alpha = snake.alpha
        return fused

    def forward(self, x: Tensor) -> Tensor:  # x: [B, C, T]
        if x.is_contiguous():
            return vocoder_kernels.snake(x, self.alpha, SNAKE_EPS)
        return super().forward(x)


def use_kernels(hift: HiFT, on: bool = True) -> bool:
    """Run every Snake activation of ``hift`` as one fused kernel where it can run (Triton,
    CUDA, float32), or in torch again. Returns whether they now run the kernel. Call after
    moving the module to its device."""
    weight = hift.conv_pre.weight
    on = on and vocoder_kernels.available(weight.device, weight.dtype)
    for parent in list(hift.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, Snake):
                continue
            if on and not isinstance(child, FusedSnake):
                _replace(parent, name, FusedSnake.of(child))
            elif not on and isinstance(child, FusedSnake):
                plain = Snake(0)
                plain.alpha = child.alpha
                _replace(parent, name, plain)
    return on


def _replace(parent: nn.Module, name: str, module: nn.Module) -> None:
    # a ModuleList's children are named by index; setattr works for both
    setattr(parent, name, module)
