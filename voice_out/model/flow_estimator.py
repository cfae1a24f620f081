"""The flow's velocity estimator: a causal 1-D UNet with transformer blocks (spec section 3.4).

Upstream's ``CausalConditionalDecoder`` with a single channel level (``channels: [C]``): no
temporal down-sampling, so every stage runs at the mel frame rate. Every convolution is causal
(left-padded) and attention is chunk-causal when streaming, which is what lets
:class:`voice_out.model.flow.Flow` run it incrementally: each causal conv keeps its last
``kernel - 1`` input frames, each transformer block its keys and values (see ``EstimatorState``).

Shapes: x, mu, cond ``[B, n_mels, L]``; spks ``[B, n_mels]``; t ``[B]``; output ``[B, n_mels, L]``.
At inference B = 2 (classifier-free guidance: row 0 conditional, row 1 unconditional). The
upstream padding mask is all ones at batch 1 (every multiplication by it is the identity), so
it is not represented here.

Pure torch: no I/O, no threads, no global state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: Upstream fixed constants of the estimator (not in any config file).
TIME_EMBED_SCALE = 1000.0  # sinusoidal time embedding argument = 1000 * t * f_k
TIME_EMBED_MULT = 4  # time MLP width = 4 * channels
FF_MULT = 4  # transformer feed-forward width = 4 * channels
CONV_KERNEL = 3  # every causal conv of the UNet
LN_EPS = 1e-5


def causal_conv(conv: nn.Conv1d, x: Tensor, ctx: Tensor | None) -> Tensor:
    """Causal ``conv`` over x ``[B, C, T]``: left context = zeros, or ``ctx`` ``[B, C, k-1]``.

    With ``ctx`` the call is one step of a stream: ``ctx`` holds the last ``k - 1`` input frames
    of the previous call and is overwritten in place with this call's last ``k - 1`` frames.
    """
    k = conv.kernel_size[0]
    if k == 1:
        return conv(x)
    if ctx is None:
        return conv(F.pad(x, (k - 1, 0)))
    xp = torch.cat([ctx, x], dim=2)
    ctx.copy_(xp[:, :, xp.shape[2] - (k - 1) :])
    return conv(xp)


def chunk_mask(q_start: int, q_len: int, k_len: int, chunk: int, device: torch.device) -> Tensor | None:
    """Chunk-causal "may attend" matrix ``[q_len, k_len]`` (bool) for queries at absolute
    positions ``q_start ..`` and keys ``0 .. k_len - 1``: j < chunk * (i // chunk + 1).

    Returns None when every entry is True (the queries' chunks all end at or after the last key).
    """
    if ((q_start // chunk) + 1) * chunk >= k_len:
        return None
    i = torch.arange(q_start, q_start + q_len, device=device)
    j = torch.arange(k_len, device=device)
    return j[None, :] < ((i // chunk + 1) * chunk)[:, None]


def sinusoidal_time(t: Tensor, dim: int) -> Tensor:
    """Concatenated [sin | cos] embedding ``[B, dim]`` of t ``[B]``, computed in float32."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    arg = TIME_EMBED_SCALE * t.float().unsqueeze(1) * freqs.unsqueeze(0)
    return torch.cat([arg.sin(), arg.cos()], dim=-1)


class CausalBlock(nn.Module):
    """Causal conv (k=3) -> LayerNorm over channels -> Mish. ``[B, Cin, T] -> [B, Cout, T]``."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, CONV_KERNEL)
        self.norm = nn.LayerNorm(c_out, eps=LN_EPS)

    def forward(self, x: Tensor, ctx: Tensor | None) -> Tensor:
        y = causal_conv(self.conv, x, ctx)
        return F.mish(self.norm(y.transpose(1, 2)).transpose(1, 2))


class ResBlock(nn.Module):
    """Two causal blocks with the time embedding added between them, plus a 1x1 residual conv."""

    def __init__(self, c_in: int, c_out: int, time_dim: int) -> None:
        super().__init__()
        self.block1 = CausalBlock(c_in, c_out)
        self.block2 = CausalBlock(c_out, c_out)
        self.time_proj = nn.Linear(time_dim, c_out)
        self.res_conv = nn.Conv1d(c_in, c_out, 1)

    def forward(self, x: Tensor, temb: Tensor, ctx1: Tensor | None, ctx2: Tensor | None) -> Tensor:
        a = self.block1(x, ctx1)
        a = a + self.time_proj(F.mish(temb)).unsqueeze(-1)
        a = self.block2(a, ctx2)
        return a + self.res_conv(x)


class TransformerBlock(nn.Module):
    """Pre-LN self-attention (heads x head_dim, q/k/v without bias) + exact-GELU feed-forward.

    Time-major ``[B, T, C]``. With ``kv`` = (k_buf, v_buf) ``[B, H, capacity, D]`` the block
    writes this call's keys/values at ``start ..`` and attends over ``0 .. start + T``.
    """

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        inner = heads * head_dim
        self.heads = heads
        self.head_dim = head_dim
        self.norm1 = nn.LayerNorm(dim, eps=LN_EPS)
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.Linear(inner, dim)
        self.norm3 = nn.LayerNorm(dim, eps=LN_EPS)
        self.ff_in = nn.Linear(dim, FF_MULT * dim)
        self.ff_out = nn.Linear(FF_MULT * dim, dim)
        # [3 * inner, dim]: q, k and v in one matmul (one kernel instead of three); filled by
        # fuse_qkv_() once the weights are loaded, empty (separate projections) until then
        self.register_buffer("qkv_weight", torch.empty(0), persistent=False)

    @torch.no_grad()
    def fuse_qkv_(self) -> None:
        """Stack the loaded q/k/v weights for the one-matmul projection (call after loading)."""
        self.qkv_weight = torch.cat([self.to_q.weight, self.to_k.weight, self.to_v.weight]).detach().clone()

    def forward(self, x: Tensor, mask: Tensor | None, kv: tuple[Tensor, Tensor] | None, start: int) -> Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        if self.qkv_weight.numel():
            q, k, v = F.linear(h, self.qkv_weight).split(self.heads * self.head_dim, dim=-1)
        else:
            q, k, v = self.to_q(h), self.to_k(h), self.to_v(h)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = k.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        if kv is not None:
            k_buf, v_buf = kv
            k_buf[:, :, start : start + t] = k
            v_buf[:, :, start : start + t] = v
            k = k_buf[:, :, : start + t]
            v = v_buf[:, :, : start + t]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.to_out(o.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))
        return x + self.ff_out(F.gelu(self.ff_in(self.norm3(x))))


@dataclass
class EstimatorState:
    """One Euler step's incremental state of the estimator (views into ``FlowStreamCache``).

    kv: per transformer block (k_buf, v_buf), each ``[2, heads, capacity_frames, head_dim]``.
    conv_ctx: per causal conv (order of :meth:`Estimator.conv_channels`), ``[2, C_in, 2]``.
    """

    kv: Sequence[tuple[Tensor, Tensor]]
    conv_ctx: Sequence[Tensor]


class Estimator(nn.Module):
    """Velocity field v(x, mu, spks, cond, t): ``[B, n_mels, L]`` -> ``[B, out, L]``.

    down: Res(in->C) + n x TB + CConv3; mid: m x (Res(C->C) + n x TB); up: concat(h, skip),
    Res(2C->C) + n x TB + CConv3; head: CausalBlock(C->C) + 1x1 conv (C->out).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        channels: int,
        heads: int,
        head_dim: int,
        n_blocks: int,
        n_mid: int,
        chunk_frames: int,
    ) -> None:
        super().__init__()
        time_dim = TIME_EMBED_MULT * channels
        self.in_channels = in_channels
        self.chunk_frames = chunk_frames
        self.time_linear1 = nn.Linear(in_channels, time_dim)
        self.time_linear2 = nn.Linear(time_dim, time_dim)

        def tbs() -> nn.ModuleList:
            return nn.ModuleList(TransformerBlock(channels, heads, head_dim) for _ in range(n_blocks))

        self.down_res = ResBlock(in_channels, channels, time_dim)
        self.down_tbs = tbs()
        self.down_conv = nn.Conv1d(channels, channels, CONV_KERNEL)
        self.mid_res = nn.ModuleList(ResBlock(channels, channels, time_dim) for _ in range(n_mid))
        self.mid_tbs = nn.ModuleList(tbs() for _ in range(n_mid))
        self.up_res = ResBlock(2 * channels, channels, time_dim)
        self.up_tbs = tbs()
        self.up_conv = nn.Conv1d(channels, channels, CONV_KERNEL)
        self.final_block = CausalBlock(channels, channels)
        self.final_proj = nn.Conv1d(channels, out_channels, 1)

    def transformer_blocks(self) -> list[TransformerBlock]:
        """All transformer blocks in execution order (the order of ``EstimatorState.kv``)."""
        blocks: list[nn.Module] = [*self.down_tbs]
        for stage in self.mid_tbs:
            blocks.extend(stage)  # type: ignore[arg-type]
        blocks.extend(self.up_tbs)
        return [b for b in blocks if isinstance(b, TransformerBlock)]

    def conv_channels(self) -> list[int]:
        """Input channels of every causal conv in execution order (``EstimatorState.conv_ctx``)."""
        out: list[int] = []
        for res in [self.down_res, *self.mid_res, self.up_res]:
            assert isinstance(res, ResBlock)
            out += [res.block1.conv.in_channels, res.block2.conv.in_channels]
            if res is self.down_res:
                out.append(self.down_conv.in_channels)
            if res is self.up_res:
                out.append(self.up_conv.in_channels)
        out.append(self.final_block.conv.in_channels)
        return out

    def forward(
        self,
        x: Tensor,
        mu: Tensor,
        spks: Tensor,
        cond: Tensor,
        t: Tensor,
        streaming: bool,
        state: EstimatorState | None = None,
        start: int = 0,
    ) -> Tensor:
        """One velocity evaluation. ``start``: absolute frame index of ``x[..., 0]`` (cached calls).

        Without ``state`` the call covers frames 0..L-1 from zero left context. With it, the
        call continues a stream: it reads/extends the state's keys, values and conv contexts.
        """
        dtype = self.time_linear1.weight.dtype
        temb = self.time_linear2(F.silu(self.time_linear1(sinusoidal_time(t, self.in_channels).to(dtype))))
        n = x.shape[2]
        h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, n), cond], dim=1).to(dtype)
        mask = chunk_mask(start, n, start + n, self.chunk_frames, x.device) if streaming else None
        ctx = iter(state.conv_ctx) if state is not None else None
        kv = iter(state.kv) if state is not None else None

        def c() -> Tensor | None:
            return next(ctx) if ctx is not None else None

        def attn(stage: nn.ModuleList, h: Tensor) -> Tensor:
            y = h.transpose(1, 2)
            for blk in stage:
                y = blk(y, mask, next(kv) if kv is not None else None, start)
            return y.transpose(1, 2)

        h = self.down_res(h, temb, c(), c())
        h = attn(self.down_tbs, h)
        skip = h
        h = causal_conv(self.down_conv, h, c())
        for res, stage in zip(self.mid_res, self.mid_tbs, strict=True):
            h = res(h, temb, c(), c())
            assert isinstance(stage, nn.ModuleList)
            h = attn(stage, h)
        h = torch.cat([h, skip], dim=1)
        h = self.up_res(h, temb, c(), c())
        h = attn(self.up_tbs, h)
        h = causal_conv(self.up_conv, h, c())
        h = self.final_block(h, c())
        out: Tensor = self.final_proj(h)
        return out
