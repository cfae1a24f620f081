"""The few-kernel flow estimator and Euler solve against a plain reference computation.

``voice_out.model.flow_estimator`` runs the UNet time-major with convs as GEMMs over windows,
precomputed time projections, an additive chunk bias, a feed-forward bias carried through the
second GEMM, and ``Flow.solve`` makes the time grid and CFG coefficients up front. Here the
upstream computation is written out plainly (spec section 3.4: conv layout, ``F.conv1d`` after
left zero padding, one time MLP per ResBlock, a boolean chunk mask and an explicit softmax,
``v = 1.7 v_c - 0.7 v_u; x += dt v``) over the same parameters, and compared:

* in float64, so anything but float rounding (a tanh GELU, a wrong tap order, a shifted mask)
  would show: the estimator with and without fused weights, streaming or not, CFG batch 2 or 4
  with a different t per row, and continued from an ``EstimatorState`` in two calls;
* ``Flow.solve`` (re-run path) against upstream's Euler loop over the reference estimator;
* on CUDA (``requires_cuda``): the fused estimator equals the reference on the GPU, and the
  solve replays from a CUDA graph.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from tests.test_flow_streaming import make_flow, tiny_dims
from voice_out.fast import fused_flow
from voice_out.fast.fused_flow import FF_BIAS_CARRIER
from voice_out.model.flow import Flow
from voice_out.model.flow_estimator import (
    LN_EPS,
    MASK_ALIGN,
    CausalBlock,
    Estimator,
    EstimatorState,
    ResBlock,
    TransformerBlock,
    attention_bias,
)

TOL64 = 1e-10  # float64: only rounding differs


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_estimator(seed: int = 0, dtype: torch.dtype = torch.float64) -> Estimator:
    """A small estimator (2 blocks per stage, 2 mid stages, chunk 8) with every parameter random,
    LayerNorm affines included."""
    est = Estimator(
        in_channels=4 * 6, out_channels=6, channels=16, heads=2, head_dim=8, n_blocks=2, n_mid=2, chunk_frames=8
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in est.parameters():
            fan_in = p[0].numel() if p.dim() > 1 else 1
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in) * (0.3 if p.dim() == 1 else 1.0))
    return est.to(dtype).eval()


def fused(est: Estimator) -> Estimator:
    """``est`` with its weights arranged as the engine runs them eagerly: ``fuse_`` and the
    fast path's feed-forward bias carrier (``fused_flow.fuse_ff_``)."""
    out = copy.deepcopy(est)
    out.fuse_()
    return fused_flow.fuse_ff_(out)


# -- the reference: upstream's estimator written plainly -------------------------------------


def ref_sinusoidal(t: Tensor, dim: int) -> Tensor:
    half = dim // 2  # Matcha's SinusoidalPosEmb, in float32
    freqs = torch.exp(torch.arange(half).float() * -(math.log(10000) / (half - 1)))
    arg = 1000.0 * t.float()[:, None] * freqs[None, :]
    return torch.cat([arg.sin(), arg.cos()], dim=-1)


def ref_estimator(
    est: Estimator, x: Tensor, mu: Tensor, spks: Tensor, cond: Tensor, t: Tensor, streaming: bool
) -> Tensor:
    """Frames 0 .. L-1 from zero context, conv layout ``[B, C, T]`` throughout."""
    dtype = x.dtype
    n = x.shape[2]
    temb = est.time_linear2(F.silu(est.time_linear1(ref_sinusoidal(t, est.in_channels).to(dtype))))
    i = torch.arange(n)
    may = i[None, :] < (i // est.chunk_frames + 1)[:, None] * est.chunk_frames if streaming else None

    def cconv(conv: torch.nn.Conv1d, h: Tensor) -> Tensor:
        return F.conv1d(F.pad(h, (conv.kernel_size[0] - 1, 0)), conv.weight, conv.bias)

    def cblock(blk: CausalBlock, h: Tensor) -> Tensor:
        y = cconv(blk.conv, h).transpose(1, 2)
        y = F.layer_norm(y, (y.shape[-1],), blk.norm.weight, blk.norm.bias, LN_EPS)
        return F.mish(y).transpose(1, 2)

    def res(r: ResBlock, h: Tensor) -> Tensor:
        a = cblock(r.block1, h)
        a = a + r.time_proj(F.mish(temb))[:, :, None]
        a = cblock(r.block2, a)
        return a + F.conv1d(h, r.res_conv.weight, r.res_conv.bias)

    def tb(blk: TransformerBlock, h: Tensor) -> Tensor:  # [B, T, C]
        b, tt, _ = h.shape
        y = F.layer_norm(h, (h.shape[-1],), blk.norm1.weight, blk.norm1.bias, LN_EPS)

        def heads(z: Tensor) -> Tensor:
            return z.view(b, tt, blk.heads, blk.head_dim).transpose(1, 2)

        q, k, v = heads(blk.to_q(y)), heads(blk.to_k(y)), heads(blk.to_v(y))
        scores = q @ k.transpose(-1, -2) / math.sqrt(blk.head_dim)
        if may is not None:
            scores = scores.masked_fill(~may, float("-inf"))
        o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, tt, -1)
        h = h + blk.to_out(o)
        y = F.layer_norm(h, (h.shape[-1],), blk.norm3.weight, blk.norm3.bias, LN_EPS)
        return h + blk.ff_out(F.gelu(blk.ff_in(y)))

    def stage(blocks: torch.nn.ModuleList, h: Tensor) -> Tensor:
        y = h.transpose(1, 2)
        for blk in blocks:
            y = tb(blk, y)  # type: ignore[arg-type]
        return y.transpose(1, 2)

    h = torch.cat([x, mu, spks[:, :, None].expand(-1, -1, n), cond], dim=1)
    h = stage(est.down_tbs, res(est.down_res, h))
    skip = h
    h = cconv(est.down_conv, h)
    for r, blocks in zip(est.mid_res, est.mid_tbs, strict=True):
        h = stage(blocks, res(r, h))  # type: ignore[arg-type]
    h = torch.cat([h, skip], dim=1)
    h = stage(est.up_tbs, res(est.up_res, h))
    h = cconv(est.up_conv, h)
    h = cblock(est.final_block, h)
    return F.conv1d(h, est.final_proj.weight, est.final_proj.bias)


def est_inputs(est: Estimator, b: int, n: int, seed: int = 1) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    m = est.in_channels // 4
    dtype = est.time_linear1.weight.dtype

    def r(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    return r(b, m, n), r(b, m, n), r(b, m), r(b, m, n), torch.rand(b, generator=gen)


# -- the estimator ---------------------------------------------------------------------------


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("b", [2, 4])
def test_estimator_equals_the_reference(streaming: bool, b: int) -> None:
    est = make_estimator()
    args = est_inputs(est, b, 29)  # 29 frames: several 8-frame chunks, a partial last one
    with torch.no_grad():
        ref = ref_estimator(est, *args, streaming)
        for name, model in [("unfused", est), ("fused", fused(est))]:
            out = model(*args, streaming)
            assert out.shape == ref.shape == (b, est.final_proj.out_channels, 29)
            err = float((out - ref).abs().max())
            print(f"{name} streaming={streaming} B={b}: max abs {err:.3g}")
            assert err < TOL64


def test_estimator_state_continues_the_stream() -> None:
    """Frames 0..m from zero context, then m..n from the state: the reference's streaming output
    over 0..n (a chunk-aligned split, as the flow makes them)."""
    est = fused(make_estimator(seed=2))
    x, mu, spks, cond, t = est_inputs(est, 2, 37, seed=3)
    m = 16
    tb = est.transformer_blocks()
    cap = 40
    shapes = [(2, b.heads, cap, b.head_dim) for b in tb]
    kv = [(torch.zeros(s, dtype=x.dtype), torch.zeros(s, dtype=x.dtype)) for s in shapes]
    state = EstimatorState(kv=kv, conv_ctx=[torch.zeros(2, c, 2, dtype=x.dtype) for c in est.conv_channels()])
    with torch.no_grad():
        ref = ref_estimator(est, x, mu, spks, cond, t, True)
        first = est(x[..., :m], mu[..., :m], spks, cond[..., :m], t, True, state, 0)
        second = est(x[..., m:], mu[..., m:], spks, cond[..., m:], t, True, state, m)
    assert float((first - ref[..., :m]).abs().max()) < TOL64
    assert float((second - ref[..., m:]).abs().max()) < TOL64


def test_fused_weights_equal_float32() -> None:
    """In float32 the fused arrangement (stacked q/k/v, FF bias carrier, tap-major convs, one time
    GEMM) differs from the unfused modules only by summation order."""
    est = make_estimator(dtype=torch.float32)
    args = est_inputs(est, 2, 29)
    with torch.no_grad():
        err = float((fused(est)(*args, True) - est(*args, True)).abs().max())
    assert err < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ff_bias_carrier_passes_gelu_exactly(dtype: torch.dtype) -> None:
    carrier = torch.tensor([FF_BIAS_CARRIER], dtype=dtype)
    assert torch.equal(F.gelu(carrier), carrier)
    assert FF_BIAS_CARRIER == 2.0 ** round(math.log2(FF_BIAS_CARRIER))  # b / carrier is exact


def test_attention_bias_is_aligned() -> None:
    allowed = torch.rand(5, 37) > 0.5
    bias = attention_bias(allowed, torch.bfloat16)
    assert bias.shape == (5, 37) and bias.dtype == torch.bfloat16
    assert bias.stride(0) % MASK_ALIGN == 0 and bias.stride(1) == 1
    assert torch.equal(bias == 0, allowed) and bool((bias[~allowed] == float("-inf")).all())


# -- the solve -------------------------------------------------------------------------------


def ref_solve(flow: Flow, mu: Tensor, spk: Tensor, cond: Tensor, streaming: bool) -> Tensor:
    """Upstream's Euler loop (spec 3.3) over the reference estimator."""
    b, _, n = mu.shape
    x = flow.noise[:, :, :n].expand(b, -1, -1)
    mu_in, spk_in = torch.cat([mu, torch.zeros_like(mu)]), torch.cat([spk, torch.zeros_like(spk)])
    cond_in = torch.cat([cond, torch.zeros_like(cond)])
    tau = flow.time_grid()
    t, dt = tau[0], tau[1] - tau[0]
    cfg = flow.dims.cfg_rate
    for step in range(1, flow.dims.n_timesteps + 1):
        v = ref_estimator(flow.estimator, torch.cat([x, x]), mu_in, spk_in, cond_in, t.expand(2 * b), streaming)
        v = (1.0 + cfg) * v[:b] - cfg * v[b:]
        x = x + dt * v
        t = t + dt
        if step < flow.dims.n_timesteps:
            dt = tau[step + 1] - t
    return x


@pytest.mark.parametrize("streaming", [True, False])
def test_solve_equals_upstreams_euler_loop(streaming: bool) -> None:
    flow = make_flow(tiny_dims())
    gen = torch.Generator().manual_seed(4)
    b, n = 2, 46
    mu = torch.randn(b, flow.dims.n_mels, n, generator=gen)
    spk = torch.randn(b, flow.dims.n_mels, generator=gen)
    cond = torch.randn(b, flow.dims.n_mels, n, generator=gen)
    with torch.no_grad():
        ref = ref_solve(flow, mu, spk, cond, streaming)
        arranged = copy.deepcopy(flow).fuse_()
        fused_flow.fuse_ff_(arranged.estimator)
        for model in (flow, arranged):
            out = model.solve(mu, spk, cond, streaming)
            assert out.dtype == torch.float32 and out.shape == ref.shape
            err = float((out - ref).abs().max())
            print(f"solve streaming={streaming}: max abs {err:.3g} (mel std {float(ref.std()):.3g})")
            assert err < 1e-4


# -- CUDA ------------------------------------------------------------------------------------


@pytest.mark.requires_cuda
def test_cuda_estimator_equals_the_reference() -> None:
    est = make_estimator(dtype=torch.float32)
    args = est_inputs(est, 2, 29)
    prev = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            x, mu, spks, cond, t = args
            ref = ref_estimator(est.double(), x.double(), mu.double(), spks.double(), cond.double(), t, True)
            gpu = fused(est.float()).cuda()
            out = gpu(x.cuda(), mu.cuda(), spks.cuda(), cond.cuda(), t.cuda(), True).double().cpu()
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = prev
    assert float((out - ref).abs().max()) < 1e-4


@pytest.mark.requires_cuda
def test_cuda_graphed_solve_equals_eager() -> None:
    """The solve captures as one CUDA graph (no host sync, fixed shapes) and replays the eager result."""
    from voice_out.fast.graphs import GraphedFn

    flow = make_flow(tiny_dims()).fuse_().to("cuda")
    gen = torch.Generator().manual_seed(6)
    mu, cond = (torch.randn(1, flow.dims.n_mels, 46, generator=gen).cuda() for _ in range(2))
    spk = torch.randn(1, flow.dims.n_mels, generator=gen).cuda()
    with torch.no_grad():
        eager = flow.solve(mu, spk, cond, True).clone()
        graphed = GraphedFn(lambda m, s, c: flow.solve(m, s, c, True), name="solve")
        out = graphed("k", mu, spk, cond)
        assert graphed.has("k")
        out = graphed("k", mu, spk, cond)
    assert float((out - eager).abs().max()) < 1e-5
