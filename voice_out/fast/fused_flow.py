"""The flow estimator's calls with the fused Triton kernels, applied to a built :class:`Flow`.

:class:`voice_out.model.flow_estimator.Estimator` is the eager UNet (the reference). Here each
of its pieces runs as the kernels of ``voice_out.fast.kernels.flow``: a causal conv (with its
LayerNorm, Mish, time add and 1x1 residual) as one kernel, a transformer block as five (norm +
q/k/v, attention, out + residual, norm + FF in + GELU, FF out + residual), the whole call as
:func:`forward`. Two calls exist only here, because only the kernels can make them in fixed
shapes: a call over a voice's prompt prefix that is READ and never extended (the first chunk's
``prefix_core``), and a call that extends a stream's state at a frame read on the device
(``state_core``, one CUDA graph per chunk length).

:func:`use_kernels` turns them on for a built flow, in place: the flow becomes a
:class:`FusedFlow` and its estimator a :class:`FusedEstimator`. Both only add methods (no
state, no weights), so every holder of the flow sees the fused calls and the weights stay as
they are; ``use_kernels(flow, False)`` gives the plain classes back. The stateless calls (the
re-run and final paths) and the two above then run the kernels; a call on a stream state
without a device start stays eager.

``tests/test_flow_kernels.py``, ``tests/test_state_slots.py`` and
``tests/test_token2wav_graphs.py`` hold the fused calls to the eager ones (CUDA). Start-up
(``use_kernels``) and the GPU worker thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from itertools import repeat

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from voice_out.fast.kernels import flow as flow_kernels
from voice_out.model.flow import Flow
from voice_out.model.flow_dims import FlowStreamCache
from voice_out.model.flow_estimator import (
    CONV_KERNEL,
    CausalBlock,
    CausalConv,
    Estimator,
    EstimatorPrep,
    EstimatorState,
    ResBlock,
    TransformerBlock,
    pointwise,
)

# -- the pieces -------------------------------------------------------------------------------


def keep_context(ctx: Tensor | None, x: Tensor) -> None:
    """A stream's conv context after a call that read it: ``ctx`` ``[B, C, k-1]`` = the last
    k-1 frames of the call's input x ``[B, T >= k-1, C]`` (in place; a no-op without ``ctx``).
    A separate copy, launched after the conv: every program of the conv reads the old one."""
    if ctx is not None:
        ctx.copy_(x[:, x.shape[1] - ctx.shape[2] :].transpose(1, 2))


def _bias(conv: nn.Conv1d) -> Tensor:
    assert conv.bias is not None  # every conv of the estimator has one
    return conv.bias


def conv(c: CausalConv, x: Tensor, ctx: Tensor | None = None, ws: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """``c`` as one fused kernel: x ``[B, T, Cin]`` -> ``[B, T, Cout]``; left context zeros or
    ``ctx`` ``[B, Cin, k-1]`` (only read); ``ws``: a split reduction's workspace
    (:func:`voice_out.fast.kernels.flow.conv_workspace`) or None."""
    return flow_kernels.conv(x, c.weight_taps(), _bias(c), c.kernel_size[0], ctx=ctx, ws=ws)


def conv_block(
    block: CausalBlock,
    x: Tensor,
    add: Tensor | None = None,
    res: tuple[Tensor, Tensor, Tensor] | None = None,
    ctx: Tensor | None = None,
    ws: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """``block`` (conv, LayerNorm, Mish) as one fused kernel: x ``[B, T, Cin]`` -> ``[B, T,
    Cout]``, plus ``add`` ``[1 or B, Cout]`` on every frame, plus a 1x1 conv ``res`` = (input,
    weight, bias) of the same frame (:func:`voice_out.fast.kernels.flow.conv`); left context
    zeros or ``ctx`` ``[B, Cin, k-1]`` (only read); ``ws``: a split reduction's workspace or
    None."""
    norm = (block.norm.weight, block.norm.bias, block.norm.eps)
    w, b = block.conv.weight_taps(), _bias(block.conv)
    return flow_kernels.conv(x, w, b, CONV_KERNEL, norm=norm, add=add, res=res, ctx=ctx, ws=ws)


def res_block(
    block: ResBlock,
    x: Tensor,
    tproj: Tensor,
    ctx1: Tensor | None = None,
    ctx2: Tensor | None = None,
    ws: tuple[Tensor, Tensor] | None = None,
    keep: bool = False,
) -> Tensor:
    """``block`` in two fused kernels: x ``[B, T, Cin]`` (channels contiguous), ``tproj`` ``[1
    or B, Cout]`` -> ``[B, T, Cout]``; the two convs' left contexts zeros, or ``ctx1`` ``[B,
    Cin, k-1]`` and ``ctx2`` ``[B, Cout, k-1]`` (read; with ``keep`` then set to this call's
    last frames, :func:`keep_context`); ``ws``: their split reduction's workspace or None."""
    a = conv_block(block.block1, x, add=tproj, ctx=ctx1, ws=ws)
    res = (x, block.res_conv.weight.view(block.res_conv.out_channels, -1), _bias(block.res_conv))
    out = conv_block(block.block2, a, res=res, ctx=ctx2, ws=ws)
    if keep:
        keep_context(ctx1, x)
        keep_context(ctx2, a)
    return out


def transformer_block(
    block: TransformerBlock,
    x: Tensor,
    chunk: int,
    key_frames: Tensor | None,
    prefix: tuple[Tensor, Tensor] | None = None,
    start: int = 0,
    at: Tensor | None = None,
    write: bool = False,
    ws: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """``block`` in 5 fused kernels (norm + q/k/v, attention, out + residual, norm + FF in +
    GELU, FF out + residual): x ``[B, T, C]`` with contiguous rows, frames ``start ..`` (or
    from ``at``, on the device); the mask as :func:`voice_out.fast.kernels.flow.attention`
    takes it (``chunk`` frames, 0 = none; ``key_frames`` ``[B]`` or None); the keys and values
    of frames ``0 .. start`` from ``prefix`` (a state's ``[B, H, capacity, D]`` buffers; with
    ``write`` this call's are stored there too, at ``start ..``); ``ws``: the attention's split
    workspace or None."""
    b, t, c = x.shape
    xf = x.reshape(b * t, c)
    qkv = flow_kernels.ln_linear(xf, block.norm1.weight, block.norm1.bias, block.norm1.eps, block.stacked_qkv())
    o = flow_kernels.attention(
        qkv,
        b,
        block.heads,
        block.head_dim,
        chunk,
        key_frames,
        prefix=prefix,
        start=start,
        at=at,
        write=write,
        ws=ws,
    )
    x2 = flow_kernels.linear(o, block.to_out.weight, block.to_out.bias, residual=xf)
    n3 = block.norm3
    g = flow_kernels.ln_linear(x2, n3.weight, n3.bias, n3.eps, block.ff_in.weight, block.ff_in.bias, gelu=True)
    flow_kernels.linear(g, block.ff_out.weight, block.ff_out.bias, residual=x2, out=x2)
    return x2.view(b, t, c)


# -- the feed-forward's bias carrier (plain torch) --------------------------------------------

#: :func:`fuse_ff_` carries ff_out's bias through one extra hidden unit of this constant value:
#: gelu(8) == 8 exactly in every float dtype (erf(8 / sqrt 2) rounds to 1), and b / 8 is exact,
#: so ff_out adds 8 * (b / 8) = b inside its GEMM.
FF_BIAS_CARRIER = 8.0
FF_PAD = 8  # columns added to the FF width for the carrier (keeps rows 16-byte aligned)


class CarrierBlock(TransformerBlock):
    """A :class:`TransformerBlock` whose feed-forward is ONE in-place GEMM with its bias and the
    residual add (``x.addmm_``), from the weights :func:`fuse_ff_` arranged: ``ff_in_weight``
    ``[F + FF_PAD, dim]``, ``ff_in_bias`` ``[F + FF_PAD]``, ``ff_out_weight`` ``[dim, F +
    FF_PAD]`` (non-persistent buffers)."""

    ff_in_weight: Tensor
    ff_in_bias: Tensor
    ff_out_weight: Tensor

    def feed_forward(self, x: Tensor, h: Tensor) -> Tensor:
        return x.addmm_(F.gelu(F.linear(h, self.ff_in_weight, self.ff_in_bias)), self.ff_out_weight.t())


@torch.no_grad()
def fuse_ff_(est: Estimator) -> Estimator:
    """Arrange every transformer block's feed-forward of ``est`` (a flow's estimator) so ``x +
    ff_out(g)`` is ONE in-place GEMM, bias included: ``ff_in`` gets ``FF_PAD`` extra outputs of
    weight 0, the first with bias ``FF_BIAS_CARRIER`` (gelu keeps it exactly), and ``ff_out``
    reads it with weight ``bias / FF_BIAS_CARRIER`` (exact: a power of two), the other extra
    columns with 0. The blocks become :class:`CarrierBlock` in place (weights and their names
    unchanged); run it again if the weights change. The fused kernels read the plain weights
    (their GEMM epilogue adds the bias). Returns ``est``."""
    for block in est.transformer_blocks():
        w1, b1, w2, b2 = block.ff_in.weight, block.ff_in.bias, block.ff_out.weight, block.ff_out.bias
        carrier = torch.zeros(FF_PAD, dtype=b1.dtype, device=b1.device)
        carrier[0] = FF_BIAS_CARRIER
        extra = w2.new_zeros(w2.shape[0], FF_PAD)
        extra[:, 0] = b2 / FF_BIAS_CARRIER
        block.register_buffer("ff_in_weight", torch.cat([w1, w1.new_zeros(FF_PAD, w1.shape[1])]), persistent=False)
        block.register_buffer("ff_in_bias", torch.cat([b1, carrier]), persistent=False)
        block.register_buffer("ff_out_weight", torch.cat([w2, extra], dim=1), persistent=False)
        block.__class__ = CarrierBlock
    return est


# -- the estimator ----------------------------------------------------------------------------


@dataclass
class FusedPrep(EstimatorPrep):
    """:class:`EstimatorPrep` with the fused kernels' scratch, shared by a solve's calls one at
    a time: ``conv_ws`` the convs' split-reduction workspace for ``B L`` rows
    (:func:`voice_out.fast.kernels.flow.conv_workspace`, None for a tier that does not split),
    ``attn_ws`` the attention's for calls after a prefix
    (:func:`voice_out.fast.kernels.flow.attention_workspace`), or None."""

    conv_ws: tuple[Tensor, Tensor] | None = None
    attn_ws: tuple[Tensor, Tensor] | None = None


def forward(
    est: Estimator,
    x: Tensor,
    prep: FusedPrep,
    step: int,
    prefix: EstimatorState | None = None,
    at: Tensor | None = None,
) -> Tensor:
    """One velocity call of ``est`` with the fused kernels: ~5 kernels per transformer block,
    2 per ResBlock, 1 per causal conv. Same contract as :meth:`Estimator.forward` without
    state, or with a read-only ``prefix`` of frames ``0 .. prep.start`` (its keys, values and
    conv contexts are read, never written), or with ``at``: ``prefix`` is a stream's state of
    frames ``0 .. at``, which the call extends (the attention kernels store the keys and
    values, a copy after each conv its context)."""
    k = CONV_KERNEL
    b, n_x, n = x.shape
    xp = prep.inputs
    xp[:, k - 1 :, :n_x].copy_(x.transpose(1, 2))
    tproj = prep.tproj[step]  # [R, n_res, C]
    start = prep.start if prefix is not None else 0
    write = at is not None
    ctxs: Iterator[Tensor | None] = iter(prefix.conv_ctx) if prefix is not None else repeat(None)
    kvs: Iterator[tuple[Tensor, Tensor] | None] = iter(prefix.kv) if prefix is not None else repeat(None)

    def attn(stage: nn.ModuleList, h: Tensor) -> Tensor:
        for blk in stage:
            assert isinstance(blk, TransformerBlock)
            h = transformer_block(blk, h, prep.chunk, prep.key_frames, next(kvs), start, at, write, prep.attn_ws)
        return h

    ws = prep.conv_ws

    def res(block: ResBlock, h: Tensor, tp: Tensor) -> Tensor:
        ctx1 = next(ctxs)
        return res_block(block, h, tp, ctx1, next(ctxs), ws, keep=write)

    def one_conv(c: CausalConv | CausalBlock, h: Tensor) -> Tensor:
        ctx = next(ctxs)
        out = conv(c, h, ctx=ctx, ws=ws) if isinstance(c, CausalConv) else conv_block(c, h, ctx=ctx, ws=ws)
        if write:
            keep_context(ctx, h)
        return out

    h = res(est.down_res, xp[:, k - 1 :], tproj[:, 0])
    h = attn(est.down_tbs, h)
    skip = h
    h = one_conv(est.down_conv, h)
    for i, (block, stage) in enumerate(zip(est.mid_res, est.mid_tbs, strict=True)):
        assert isinstance(stage, nn.ModuleList) and isinstance(block, ResBlock)
        h = attn(stage, res(block, h, tproj[:, 1 + i]))
    h = res(est.up_res, torch.cat([h, skip], dim=2), tproj[:, -1])
    h = attn(est.up_tbs, h)
    h = one_conv(est.up_conv, h)
    h = one_conv(est.final_block, h)
    out = pointwise(est.final_proj, h.view(b * n, -1)).view(b, n, -1)
    return out.transpose(1, 2)


class FusedEstimator(Estimator):
    """An :class:`Estimator` whose stateless calls (no stream state, start 0) run the fused
    kernels; a call on a stream state runs the eager form. Made by :func:`use_kernels`."""

    def prepare(
        self,
        mu: Tensor,
        spks: Tensor,
        cond: Tensor,
        t: Tensor,
        streaming: bool,
        start: int = 0,
        key_frames: Tensor | None = None,
    ) -> FusedPrep:
        """:meth:`Estimator.prepare`, with the fused kernels' workspaces for its ``B L`` rows."""
        prep = super().prepare(mu, spks, cond, t, streaming, start, key_frames)
        rows = mu.shape[0] * mu.shape[2]
        block = self.transformer_blocks()[0]
        return FusedPrep(
            **{f.name: getattr(prep, f.name) for f in fields(EstimatorPrep)},
            conv_ws=flow_kernels.conv_workspace(rows, self.channels, mu.device),
            attn_ws=flow_kernels.attention_workspace(rows, block.heads, block.head_dim, mu.device),
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
        if prep is None:
            prep = self.prepare(mu, spks, cond, t.reshape(1, -1), streaming, start)
            step = 0
        if state is None and prep.start == 0:
            assert isinstance(prep, FusedPrep)
            return forward(self, x, prep, step)
        return super().forward(x, mu, spks, cond, t, streaming, state, start, prep=prep, step=step)


# -- the flow ---------------------------------------------------------------------------------


class FusedFlow(Flow):
    """A :class:`Flow` whose estimator is a :class:`FusedEstimator` and whose first chunk from
    a prompt prefix and chunks on a stream's state run the fused kernels in fixed shapes.
    Made by :func:`use_kernels`."""

    estimator: FusedEstimator

    def prefix_core(self, ids: Tensor, embedding: Tensor, cond: Tensor, prefix: FlowStreamCache) -> Tensor:
        """:meth:`Flow.prefix_core` with the prefix only read: fixed shapes, no host sync,
        capturable as one CUDA graph per (prefix, T) whose prefix buffers stay where they were
        captured."""
        mu, spk, cond, f0 = self.prefix_conditions(ids, embedding, cond, prefix)
        est = self.estimator

        def velocity(x: Tensor, prep: EstimatorPrep, step: int) -> Tensor:
            assert isinstance(prep, FusedPrep)
            return forward(est, x, prep, step, prefix.estimator_state(step))

        return self.solve(mu, spk, cond, True, f0, velocity=velocity)

    def state_core(
        self, mu: Tensor, spk: Tensor, cond: Tensor, x0: Tensor, at: Tensor, cache: FlowStreamCache
    ) -> Tensor:
        """:meth:`Flow.state_core` with the start read on the device (the attention kernel
        stores each call's keys and values, a copy after each conv its left context): fixed
        shapes for a given L, no host sync, so one CUDA graph per (cache, L) serves every
        chunk of that length, wherever it falls."""
        if mu.shape[0] != 1:
            raise ValueError("a cached solve runs one stream (batch 1)")
        est = self.estimator

        def velocity(x: Tensor, prep: EstimatorPrep, step: int) -> Tensor:
            assert isinstance(prep, FusedPrep)
            return forward(est, x, prep, step, cache.estimator_state(step), at=at)

        return self.solve(mu, spk, cond, True, 0, x0=x0, velocity=velocity)


def enabled(flow: Flow) -> bool:
    """Whether ``flow`` runs the fused kernels (:func:`use_kernels` turned them on)."""
    return isinstance(flow, FusedFlow)


def use_kernels(flow: Flow, on: bool = True) -> bool:
    """Run ``flow``'s stateless estimator calls, its first chunks from a prompt prefix and its
    chunks on a stream's state through the fused kernels where they can run (Triton, CUDA,
    bf16/fp16, the estimator's widths: :func:`voice_out.fast.kernels.flow.available`), or the
    eager way again. Changes the classes of ``flow`` and its estimator in place (they add
    methods only). Returns whether the kernels now run. Call after moving the flow to its
    device and dtype."""
    est = flow.estimator
    w = est.time_linear1.weight
    on = on and flow_kernels.available(w.device, w.dtype, est.channels, est.in_channels, est.head_dim)
    flow.__class__ = FusedFlow if on else Flow
    est.__class__ = FusedEstimator if on else Estimator
    return on
