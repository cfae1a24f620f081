"""The flow's velocity estimator: a causal 1-D UNet with transformer blocks (spec section 3.4).

Upstream's ``CausalConditionalDecoder`` with a single channel level (``channels: [C]``): no
temporal down-sampling, so every stage runs at the mel frame rate. Every convolution is causal
(left-padded) and attention is chunk-causal when streaming, which is what lets
:class:`voice_out.model.flow.Flow` run it incrementally: each causal conv keeps its last
``kernel - 1`` input frames, each transformer block its keys and values (see ``EstimatorState``).

Shapes: x, mu, cond ``[B, n_mels, L]``; spks ``[B, n_mels]``; t ``[B]``; output ``[B, n_mels, L]``.
At inference B = 2 (classifier-free guidance: row 0 conditional, row 1 unconditional). The
upstream padding mask is all ones at batch 1 (every multiplication by it is the identity), so
it is not represented here; right-padded batches mask the padded keys instead
(:meth:`Estimator.prepare`'s ``key_frames``).

Few kernels per call: a first streaming chunk is 10 calls on a few hundred frames, so its cost
is the number of (tiny) kernels launched, not FLOPs or bytes (``scripts/count_kernels_flow.py``
counts them per block). Hence:

* the whole UNet runs time-major (``[B, T, C]``, what LayerNorm and the transformer blocks
  want): no layout copy between stages, only the input is transposed (once, when written) and
  the output returned as a ``[B, out, L]`` view;
* a causal conv is ONE GEMM over k-frame windows (:func:`windows`: one strided copy of the
  left-padded input, :func:`pad_left`) with its bias in the GEMM epilogue, instead of cuDNN's
  pad + layout transforms + conv + bias add; a ResBlock's 1x1 residual conv reads the last tap
  of its first conv's windows, and its time add writes straight into the second conv's padded
  input;
* everything that depends only on the solve's inputs and time grid is made once per solve by
  :meth:`Estimator.prepare` (:class:`EstimatorPrep`): the stacked [x | mu | spks | cond] input
  buffer (each call only writes x), every ResBlock's time projection for every Euler step (one
  batched time MLP and one GEMM), and the chunk mask as an additive bias in the compute dtype
  (:func:`attention_bias`), so attention converts nothing per block;
* :meth:`Estimator.fuse_` pre-arranges the weights: stacked q/k/v, tap-major conv weights,
  stacked time projections. Unfused modules (before ``fuse_``) compute the same thing with
  plain layers and reshapes on the fly. (The fast path also folds the feed-forward's output
  bias into its GEMM: ``voice_out.fast.fused_flow.fuse_ff_``.)

Not used: ``torch._addmm_activation(..., use_gelu=True)`` (bias + GELU in the GEMM epilogue) is
the tanh approximation on CUDA, not upstream's exact erf GELU; calling the memory-efficient
attention kernel directly saves cuDNN's per-call memset but runs twice as long on an H200.

Pure torch: no I/O, no threads, no global state.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
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
#: Row stride (elements) of the attention bias: SDPA's memory-efficient kernel (fp32 on CUDA)
#: pads a bias whose rows are not 16-aligned, per call; cuDNN's (bf16/fp16) takes it as is.
MASK_ALIGN = 16


def append_kv(kv: tuple[Tensor, Tensor], k: Tensor, v: Tensor, start: int) -> tuple[Tensor, Tensor]:
    """Write this call's keys/values ``[B, H, T, D]`` into the cached buffers ``kv`` ``[B, H,
    capacity, D]`` at ``start ..``; returns the keys/values of positions ``0 .. start + T``."""
    k_buf, v_buf = kv
    t = k.shape[2]
    k_buf[:, :, start : start + t] = k
    v_buf[:, :, start : start + t] = v
    return k_buf[:, :, : start + t], v_buf[:, :, : start + t]


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


def valid_keys(n_valid: Tensor, length: int) -> Tensor:
    """Key-padding "may attend" mask ``[B, 1, 1, length]`` (bool): key j of row b is real iff
    ``j < n_valid[b]`` (``n_valid`` ``[B]`` int64, on the keys' device). No host sync."""
    j = torch.arange(length, device=n_valid.device)
    return (j[None, :] < n_valid[:, None]).view(-1, 1, 1, length)


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


def attention_bias(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """Additive attention bias (0 where ``allowed``, -inf elsewhere) in ``dtype``, of the shape
    of ``allowed`` (``[q, k]``, or e.g. ``[B, 1, 1 or q, k]``), laid out with a row stride padded
    to ``MASK_ALIGN`` elements (a view into a wider buffer)."""
    *lead, k = allowed.shape
    wide = -(-k // MASK_ALIGN) * MASK_ALIGN
    bias = torch.full((*lead, wide), float("-inf"), dtype=dtype, device=allowed.device)[..., :k]
    return bias.masked_fill_(allowed, 0.0)


def sinusoidal_time(t: Tensor, dim: int) -> Tensor:
    """Concatenated [sin | cos] embedding ``[N, dim]`` of t ``[N]``, computed in float32."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    arg = TIME_EMBED_SCALE * t.float().unsqueeze(1) * freqs.unsqueeze(0)
    return torch.cat([arg.sin(), arg.cos()], dim=-1)


def pad_left(x: Tensor, ctx: Tensor | None, zeros: Tensor) -> Tensor:
    """x ``[B, T, C]`` -> ``[B, k-1 + T, C]``: a causal conv's left context, then x.

    The left context is ``ctx`` ``[B, C, k-1]`` (conv layout, as :class:`EstimatorState` keeps
    it; overwritten in place with the last k-1 frames of this call) or zeros (``zeros`` ``[B,
    k-1, >= C]``).
    """
    c = x.shape[2]
    left = ctx.transpose(1, 2) if ctx is not None else zeros[:, :, :c]
    xp = torch.cat([left, x], dim=1)
    if ctx is not None:
        left.copy_(xp[:, xp.shape[1] - left.shape[1] :])
    return xp


def load_context(xp: Tensor, ctx: Tensor | None) -> None:
    """Left context of a padded buffer ``xp`` ``[B, k-1 + T, C]`` whose frames are written:
    rows ``0 .. k-2`` from ``ctx`` ``[B, C, k-1]`` (then ``ctx`` = the last k-1 rows, in place).
    Without ``ctx`` the rows are left as they are (zeros, in :class:`EstimatorPrep`'s buffers)."""
    if ctx is not None:
        left = ctx.transpose(1, 2)
        xp[:, : left.shape[1]].copy_(left)
        left.copy_(xp[:, xp.shape[1] - left.shape[1] :])


def windows(xp: Tensor, k: int) -> Tensor:
    """Tap-major k-frame windows ``[B * T, k * C]`` of ``xp`` ``[B, k-1 + T, C]`` (one copy):
    row (b, t) = ``[xp[b, t], xp[b, t + 1], .., xp[b, t + k - 1]]``."""
    b, n, c = xp.shape
    return xp.unfold(1, k, 1).transpose(2, 3).reshape(b * (n - k + 1), k * c)


class CausalConv(nn.Conv1d):
    """A causal conv (stride 1) run time-major as ONE GEMM over k-frame windows.

    Same parameters as ``nn.Conv1d(c_in, c_out, k)``; ``forward`` takes the left-padded input
    ``[B, k-1 + T, Cin]`` (see :func:`pad_left`) and returns ``[B * T, Cout]``.
    """

    def __init__(self, c_in: int, c_out: int, kernel: int) -> None:
        super().__init__(c_in, c_out, kernel)
        # [Cout, k * Cin], tap-major (column j * Cin + c = tap j, channel c), the layout of
        # windows(); filled by fuse_(), empty (rearranged per call) until then
        self.register_buffer("weight2d", torch.empty(0), persistent=False)

    @torch.no_grad()
    def fuse_(self) -> None:
        self.weight2d = self._weight2d().detach().clone()

    def _weight2d(self) -> Tensor:
        return self.weight.permute(0, 2, 1).reshape(self.out_channels, -1)

    def from_windows(self, win: Tensor) -> Tensor:
        """``[B * T, k * Cin]`` windows -> ``[B * T, Cout]``."""
        w = self.weight2d if self.weight2d.numel() else self._weight2d()
        return F.linear(win, w, self.bias)

    def forward(self, xp: Tensor) -> Tensor:
        return self.from_windows(windows(xp, self.kernel_size[0]))

    def weight_taps(self) -> Tensor:
        """The tap-major ``[Cout, k * Cin]`` weight (made by ``fuse_``, or now)."""
        return self.weight2d if self.weight2d.numel() else self._weight2d().contiguous()


def pointwise(conv: nn.Conv1d, x: Tensor) -> Tensor:
    """A 1x1 ``conv`` on time-major rows ``[N, Cin]`` (any row stride) -> ``[N, Cout]``."""
    return F.linear(x, conv.weight.view(conv.out_channels, conv.in_channels), conv.bias)


class CausalBlock(nn.Module):
    """Causal conv (k=3) -> LayerNorm over channels -> Mish, time-major.

    ``[B, k-1 + T, Cin]`` (left-padded) -> ``[B * T, Cout]``.
    """

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = CausalConv(c_in, c_out, CONV_KERNEL)
        self.norm = nn.LayerNorm(c_out, eps=LN_EPS)

    def from_windows(self, win: Tensor) -> Tensor:
        return F.mish(self.norm(self.conv.from_windows(win)))

    def forward(self, xp: Tensor) -> Tensor:
        return F.mish(self.norm(self.conv(xp)))


class ResBlock(nn.Module):
    """Two causal blocks with the time embedding added between them, plus a 1x1 residual conv.

    Time-major: ``xp`` ``[B, k-1 + T, Cin]`` (left-padded), the time projection ``tproj``
    ``[1 or B, Cout]`` -> ``[B, T, Cout]``. ``time_proj`` is applied by the caller, for every
    Euler step at once (:meth:`Estimator.time_projections`). ``scratch`` ``[B, k-1 + T, Cout]``:
    the second conv's padded input, written here (rows 0 .. k-2 zeros, or from ``ctx2``).
    """

    def __init__(self, c_in: int, c_out: int, time_dim: int) -> None:
        super().__init__()
        self.block1 = CausalBlock(c_in, c_out)
        self.block2 = CausalBlock(c_out, c_out)
        self.time_proj = nn.Linear(time_dim, c_out)
        self.res_conv = nn.Conv1d(c_in, c_out, 1)

    def forward(self, xp: Tensor, tproj: Tensor, ctx2: Tensor | None, scratch: Tensor) -> Tensor:
        b, n, c_in = xp.shape
        k = CONV_KERNEL
        t = n - (k - 1)
        win = windows(xp, k)  # [B T, k Cin]
        a = self.block1.from_windows(win).view(b, t, -1)
        torch.add(a, tproj.unsqueeze(1), out=scratch[:, k - 1 :])  # straight into the padded buffer
        load_context(scratch, ctx2)
        a = self.block2(scratch)  # [B T, Cout]
        # the 1x1 conv's input is the windows' last tap (the current frame): no copy
        a = a + pointwise(self.res_conv, win[:, (k - 1) * c_in :])
        return a.view(b, t, -1)


class TransformerBlock(nn.Module):
    """Pre-LN self-attention (heads x head_dim, q/k/v without bias) + exact-GELU feed-forward.

    Time-major ``[B, T, C]`` (contiguous). ``mask``: additive bias ``[T, keys]`` or ``[B, 1, 1
    or T, keys]`` in the compute dtype (:func:`attention_bias`), or None. With ``kv`` = (k_buf,
    v_buf) ``[B, H, capacity, D]`` the block writes this call's keys/values at ``start ..`` and
    attends over ``0 .. start + T``. 10 kernels per call on CUDA (LN, q/k/v GEMM, cuDNN
    attention with its memset, out GEMM, residual add, LN, FF GEMM, GELU, FF GEMM with bias and
    residual), plus the two key/value writes with ``kv``.
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
        self.qkv_weight = self.stacked_qkv().detach().clone()

    def stacked_qkv(self) -> Tensor:
        """The q, k and v weights as one ``[3 inner, dim]`` (``fuse_qkv_``'s, or made now)."""
        if self.qkv_weight.numel():
            return self.qkv_weight
        return torch.cat([self.to_q.weight, self.to_k.weight, self.to_v.weight])

    def forward(self, x: Tensor, mask: Tensor | None, kv: tuple[Tensor, Tensor] | None, start: int) -> Tensor:
        b, t, c = x.shape
        inner = self.heads * self.head_dim
        x = x.view(b * t, c)
        h = self.norm1(x)
        if self.qkv_weight.numel():
            q, k, v = F.linear(h, self.qkv_weight).split(inner, dim=-1)
        else:
            q, k, v = self.to_q(h), self.to_k(h), self.to_v(h)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = k.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        if kv is not None:
            k, v = append_kv(kv, k, v, start)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        # a view where attention returns [B, T, H, D] memory (the CUDA kernels do)
        x = x + self.to_out(o.transpose(1, 2).reshape(b * t, inner))
        x = self.feed_forward(x, self.norm3(x))
        return x.view(b, t, c)

    def feed_forward(self, x: Tensor, h: Tensor) -> Tensor:
        """The residual stream ``x`` ``[N, C]`` plus the feed-forward of its normed rows ``h``
        (the fast path folds the bias and the add into one GEMM: ``voice_out.fast.fused_flow``)."""
        return x + self.ff_out(F.gelu(self.ff_in(h)))


@dataclass
class EstimatorState:
    """One Euler step's incremental state of the estimator (views into ``FlowStreamCache``).

    kv: per transformer block (k_buf, v_buf), each ``[2, heads, capacity_frames, head_dim]``.
    conv_ctx: per causal conv (order of :meth:`Estimator.conv_channels`), ``[2, C_in, 2]``.
    """

    kv: Sequence[tuple[Tensor, Tensor]]
    conv_ctx: Sequence[Tensor]


@dataclass
class EstimatorPrep:
    """What every velocity call of one solve shares, made once by :meth:`Estimator.prepare`.

    * ``inputs`` ``[B, k-1 + L, in_channels]`` (compute dtype): rows ``k-1 ..`` hold the
      stacked input ``[x | mu | spks | cond]`` time-major; mu, spks and cond are written once,
      x by every call; rows ``0 .. k-2`` are the first conv's left context (zeros, or the
      state's, copied in by the call). Scratch: a call overwrites it.
    * ``tproj`` ``[S, R, n_res, C]``: every ResBlock's time projection ``Linear(Mish(temb(t)))``
      for each of S time values, per row (R = B) or shared by all rows (R = 1).
    * ``mask``: additive attention bias in the compute dtype (see :func:`attention_bias`):
      ``[L, start + L]`` (chunk mask), ``[B, 1, 1, L]`` (key padding, ``key_frames``), ``[B, 1,
      L, L]`` (both), or None when no key is masked.
    * ``scratch`` ``[B, k-1 + L, C]``: the padded input of every ResBlock's second conv
      (rows 0 .. k-2 zeros, or the state's, copied in by the call). Scratch, like ``inputs``.
    * ``zeros`` ``[B, k-1, max C_in]``: a causal conv's left context when there is no state.
    * ``start``: absolute frame of ``x[..., 0]``.
    * ``chunk``, ``key_frames``: the same mask as the fused kernels take it (chunk frames, 0
      when not streaming; the key-padding lengths ``[B]`` or None).
    """

    inputs: Tensor
    tproj: Tensor
    mask: Tensor | None
    scratch: Tensor
    zeros: Tensor
    start: int
    chunk: int = 0
    key_frames: Tensor | None = None


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
        self.channels = channels
        self.head_dim = head_dim
        self.chunk_frames = chunk_frames
        self.time_linear1 = nn.Linear(in_channels, time_dim)
        self.time_linear2 = nn.Linear(time_dim, time_dim)

        def tbs() -> nn.ModuleList:
            return nn.ModuleList(TransformerBlock(channels, heads, head_dim) for _ in range(n_blocks))

        self.down_res = ResBlock(in_channels, channels, time_dim)
        self.down_tbs = tbs()
        self.down_conv = CausalConv(channels, channels, CONV_KERNEL)
        self.mid_res = nn.ModuleList(ResBlock(channels, channels, time_dim) for _ in range(n_mid))
        self.mid_tbs = nn.ModuleList(tbs() for _ in range(n_mid))
        self.up_res = ResBlock(2 * channels, channels, time_dim)
        self.up_tbs = tbs()
        self.up_conv = CausalConv(channels, channels, CONV_KERNEL)
        self.final_block = CausalBlock(channels, channels)
        self.final_proj = nn.Conv1d(channels, out_channels, 1)
        # every ResBlock's time_proj stacked ([n_res C, time_dim], [n_res C]): one GEMM for all;
        # filled by fuse_(), empty (stacked per call) until then
        self.register_buffer("time_proj_weight", torch.empty(0), persistent=False)
        self.register_buffer("time_proj_bias", torch.empty(0), persistent=False)

    def res_blocks(self) -> list[ResBlock]:
        """All ResBlocks in execution order (the order of ``EstimatorPrep.tproj``'s n_res axis)."""
        blocks = [self.down_res, *self.mid_res, self.up_res]
        return [b for b in blocks if isinstance(b, ResBlock)]

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
        for res in self.res_blocks():
            out += [res.block1.conv.in_channels, res.block2.conv.in_channels]
            if res is self.down_res:
                out.append(self.down_conv.in_channels)
            if res is self.up_res:
                out.append(self.up_conv.in_channels)
        out.append(self.final_block.conv.in_channels)
        return out

    @torch.no_grad()
    def fuse_(self) -> None:
        """Pre-arrange the loaded weights for the fewest kernels per call (call after loading,
        again if the weights change): stacked q/k/v, tap-major
        conv weights, stacked time projections."""
        for block in self.transformer_blocks():
            block.fuse_qkv_()
        for module in self.modules():
            if isinstance(module, CausalConv):
                module.fuse_()
        weight, bias = self._time_proj_stacked()
        self.time_proj_weight = weight.detach().clone()
        self.time_proj_bias = bias.detach().clone()

    def _time_proj_stacked(self) -> tuple[Tensor, Tensor]:
        if self.time_proj_weight.numel():
            return self.time_proj_weight, self.time_proj_bias
        projs = [res.time_proj for res in self.res_blocks()]
        return torch.cat([p.weight for p in projs]), torch.cat([p.bias for p in projs])

    def time_projections(self, t: Tensor) -> Tensor:
        """Every ResBlock's ``time_proj(Mish(temb(t)))`` for t ``[N]``: ``[N, n_res, C]``."""
        dtype = self.time_linear1.weight.dtype
        temb = self.time_linear2(F.silu(self.time_linear1(sinusoidal_time(t, self.in_channels).to(dtype))))
        weight, bias = self._time_proj_stacked()
        return F.linear(F.mish(temb), weight, bias).view(t.shape[0], -1, self.channels)

    def prepare(
        self,
        mu: Tensor,
        spks: Tensor,
        cond: Tensor,
        t: Tensor,
        streaming: bool,
        start: int = 0,
        key_frames: Tensor | None = None,
    ) -> EstimatorPrep:
        """The per-solve constants of the velocity calls (see :class:`EstimatorPrep`).

        mu, cond ``[B, n_mels, L]``, spks ``[B, n_mels]``: the CFG batch's conditions (fixed
        over the Euler steps); t ``[S, R]``: the time of each step (R = 1: one value for all
        rows, or R = B); ``start``: absolute frame of the first of the L frames.
        ``key_frames`` ``[B]`` int64 (uncached calls, start = 0): row b's real frames are its
        first ``key_frames[b]``, the rest right padding whose keys no query attends to (built
        on the device: no host sync).
        """
        dtype = self.time_linear1.weight.dtype
        b, n_mels, n = mu.shape
        k = CONV_KERNEL
        inputs = torch.zeros(b, k - 1 + n, self.in_channels, device=mu.device, dtype=dtype)
        body = inputs[:, k - 1 :]  # [B, L, in]: x | mu | spks | cond
        c0 = self.in_channels - n_mels - spks.shape[1] - cond.shape[1]  # x channels
        body[:, :, c0 : c0 + n_mels].copy_(mu.transpose(1, 2))
        body[:, :, c0 + n_mels : c0 + n_mels + spks.shape[1]].copy_(spks.unsqueeze(1).expand(-1, n, -1))
        body[:, :, self.in_channels - cond.shape[1] :].copy_(cond.transpose(1, 2))
        s, r = t.shape
        tproj = self.time_projections(t.reshape(s * r)).view(s, r, -1, self.channels)
        allowed = chunk_mask(start, n, start + n, self.chunk_frames, mu.device) if streaming else None
        if key_frames is not None:
            if start != 0:
                raise ValueError("key_frames (right padding) needs start = 0")
            key_frames = key_frames.to(mu.device)
            keys = valid_keys(key_frames, n)  # [B, 1, 1, L]
            allowed = keys if allowed is None else allowed & keys
        mask = attention_bias(allowed, dtype) if allowed is not None else None
        scratch = torch.zeros(b, k - 1 + n, self.channels, device=mu.device, dtype=dtype)
        width = max(self.conv_channels())
        zeros = torch.zeros(1, k - 1, width, device=mu.device, dtype=dtype).expand(b, -1, -1)
        return EstimatorPrep(
            inputs=inputs,
            tproj=tproj,
            mask=mask,
            scratch=scratch,
            zeros=zeros,
            start=start,
            chunk=self.chunk_frames if streaming else 0,
            key_frames=key_frames,
        )

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
        *,
        prep: EstimatorPrep | None = None,
        step: int = 0,
    ) -> Tensor:
        """One velocity evaluation. ``start``: absolute frame index of ``x[..., 0]`` (cached calls).

        Without ``state`` the call covers frames 0..L-1 from zero left context. With it, the
        call continues a stream: it reads/extends the state's keys, values and conv contexts.
        (The fast path's fused calls, ``voice_out.fast.fused_flow``, can also read a state
        without extending it, or extend it at a frame read on the device.)

        ``prep``: :meth:`prepare` of this call's mu, spks, cond, streaming and start, with the
        time grid of a whole solve (``t`` is then ``prep``'s time value ``step``; the arguments
        mu .. t are not read again). Without it the call prepares for itself. The result is
        a ``[B, out, L]`` view of time-major memory.
        """
        if prep is None:
            prep = self.prepare(mu, spks, cond, t.reshape(1, -1), streaming, start)
            step = 0
        k = CONV_KERNEL
        n = x.shape[2]
        ctxs: Iterator[Tensor] | None = iter(state.conv_ctx) if state is not None else None
        kvs: Iterator[tuple[Tensor, Tensor]] | None = iter(state.kv) if state is not None else None
        zeros, mask = prep.zeros, prep.mask

        def c() -> Tensor | None:
            return next(ctxs) if ctxs is not None else None

        def attn(stage: nn.ModuleList, h: Tensor) -> Tensor:
            for blk in stage:
                h = blk(h, mask, next(kvs) if kvs is not None else None, prep.start)
            return h

        xp = prep.inputs
        xp[:, k - 1 :, : x.shape[1]].copy_(x.transpose(1, 2))
        load_context(xp, c())
        tproj = prep.tproj[step]  # [R, n_res, C]
        scratch = prep.scratch
        b = x.shape[0]
        h = self.down_res(xp, tproj[:, 0], c(), scratch)
        h = attn(self.down_tbs, h)
        skip = h
        h = self.down_conv(pad_left(h, c(), zeros)).view(b, n, -1)
        for i, (res, stage) in enumerate(zip(self.mid_res, self.mid_tbs, strict=True)):
            h = res(pad_left(h, c(), zeros), tproj[:, 1 + i], c(), scratch)
            assert isinstance(stage, nn.ModuleList)
            h = attn(stage, h)
        h = torch.cat([h, skip], dim=2)
        h = self.up_res(pad_left(h, c(), zeros), tproj[:, -1], c(), scratch)
        h = attn(self.up_tbs, h)
        h = self.up_conv(pad_left(h, c(), zeros)).view(b, n, -1)
        h = self.final_block(pad_left(h, c(), zeros))  # [B L, C]
        out = pointwise(self.final_proj, h).view(b, n, -1)
        return out.transpose(1, 2)
