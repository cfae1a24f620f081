"""The fused flow-estimator kernels equal the plain-torch estimator (GPU), and are refused where
they cannot run."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import REPO_ROOT
from voice_out.fast import fused_flow
from voice_out.fast.graphs import GraphedFn
from voice_out.fast.kernels import flow as flow_kernels
from voice_out.model.checkpoint import random_flow
from voice_out.model.flow import Flow
from voice_out.model.flow_estimator import Estimator, ResBlock, attention_bias, chunk_mask, pad_left, valid_keys

TINY = REPO_ROOT / "configs" / "models" / "tiny"
FULL = REPO_ROOT / "configs" / "models" / "cosyvoice2-0.5b"


def test_available_only_for_cuda_half_precision_and_supported_widths() -> None:
    assert flow_kernels.available("cuda", torch.bfloat16, 256, 320, 64) == (flow_kernels.triton is not None)
    assert not flow_kernels.available("cpu", torch.bfloat16, 256, 320, 64)
    assert not flow_kernels.available("cuda", torch.float32, 256, 320, 64)
    assert not flow_kernels.available("cuda", torch.bfloat16, 256, 320, 48)  # not a power of two
    assert not flow_kernels.available("cuda", torch.bfloat16, flow_kernels.MAX_ROW + 1, 320, 64)


def test_flow_does_not_use_the_kernels_on_the_cpu() -> None:
    flow = random_flow(TINY, "cpu", torch.float32, seed=0)
    assert not fused_flow.use_kernels(flow, True)
    assert not fused_flow.enabled(flow) and type(flow.estimator) is Estimator


def test_tile_tiers_pick_by_rows() -> None:
    tiers = flow_kernels.TILE_TIERS
    assert tiers[0][0] == 0 and [start for start, _ in tiers] == sorted({start for start, _ in tiers})
    assert all(set(tiles) == set(tiers[0][1]) for _, tiles in tiers)
    for i, (start, tiles) in enumerate(tiers):
        assert flow_kernels.tier(start) is tiles
        if i + 1 < len(tiers):
            assert flow_kernels.tier(tiers[i + 1][0] - 1) is tiles
    assert flow_kernels.tier(10**9) is tiers[-1][1]
    with pytest.raises(ValueError, match="rows"):
        flow_kernels.tier(-1)


#: Row counts of the kernel tests: one in every tile tier (the last ends inside a tile)
TIER_ROWS = [max(start, 1) + 357 for start, _ in flow_kernels.TILE_TIERS]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.requires_cuda
@pytest.mark.parametrize("m", TIER_ROWS)
def test_ln_linear_and_linear_equal_torch(m: int) -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dt)

    k, n = 256, 1024
    x, lw, lb = rnd(m, k), rnd(k), rnd(k)
    w, b = rnd(n, k, scale=k**-0.5), rnd(n)
    h = F.layer_norm(x, (k,), lw, lb, 1e-5)
    torch.testing.assert_close(flow_kernels.ln_linear(x, lw, lb, 1e-5, w), F.linear(h, w), atol=2e-2, rtol=2e-2)
    want = F.gelu(F.linear(h, w, b))
    torch.testing.assert_close(flow_kernels.ln_linear(x, lw, lb, 1e-5, w, b, gelu=True), want, atol=2e-2, rtol=2e-2)
    a, w2, res = rnd(m, n), rnd(k, n, scale=n**-0.5), rnd(m, k)
    want = res + F.linear(a, w2, b[:k])
    torch.testing.assert_close(flow_kernels.linear(a, w2, b[:k], residual=res), want, atol=3e-2, rtol=2e-2)
    inplace = res.clone()
    out = flow_kernels.linear(a, w2, b[:k], residual=inplace, out=inplace)
    assert out.data_ptr() == inplace.data_ptr()
    torch.testing.assert_close(inplace, want, atol=3e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="do not fit"):
        flow_kernels.linear(a, w, None)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("chunk", [0, 50])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("b", [4, 16])
def test_attention_equals_sdpa(chunk: int, padded: bool, b: int) -> None:
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(chunk + padded)
    t, heads, d = 213, 8, 64  # t spans several key blocks and ends inside one; b x t: both tiers
    qkv = torch.randn(b * t, 3 * heads * d, generator=gen, device=dev).to(dt)
    key_frames = torch.tensor([t, 1, 64, 150] * (b // 4), device=dev) if padded else None
    q, k, v = qkv.view(b, t, 3, heads, d).permute(2, 0, 3, 1, 4)
    allowed = chunk_mask(0, t, t, chunk, dev) if chunk else None
    if key_frames is not None:
        keys = valid_keys(key_frames, t)
        allowed = keys if allowed is None else allowed & keys
    mask = attention_bias(allowed, dt) if allowed is not None else None
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b * t, heads * d)
    got = flow_kernels.attention(qkv, b, heads, d, chunk, key_frames)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def _res_block(c_in: int, c: int, seed: int) -> ResBlock:
    """A bf16 ResBlock on the GPU with random weights (norms near 1), its convs fused."""
    torch.manual_seed(seed)
    block = ResBlock(c_in, c, 1024).to("cuda")
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.05)
        block.block1.norm.weight.add_(1.0)
        block.block2.norm.weight.add_(1.0)
    block = block.to(torch.bfloat16)
    block.block1.conv.fuse_()
    block.block2.conv.fuse_()
    return block


@pytest.mark.requires_cuda
@pytest.mark.parametrize(("start", "cap"), [(250, 300), (100, 100), (75, 90)])
def test_attention_after_a_prefix_equals_sdpa(start: int, cap: int) -> None:
    """Frames ``start ..`` attending over a read-only prefix (its keys and values in [B, H,
    cap, D] buffers, as a state keeps them) and their own keys, chunk-causally counted from
    frame 0: SDPA over the concatenated keys with the same mask. 75 is no chunk multiple (the
    mask then hides part of the prefix from nothing but later chunks' keys)."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(start)
    b, t, heads, d, chunk = 2, 106, 8, 64, 50
    qkv = torch.randn(b * t, 3 * heads * d, generator=gen, device=dev).to(dt)
    pk = torch.randn(b, heads, cap, d, generator=gen, device=dev).to(dt)
    pv = torch.randn(b, heads, cap, d, generator=gen, device=dev).to(dt)
    q, k, v = qkv.view(b, t, 3, heads, d).permute(2, 0, 3, 1, 4)
    keys, vals = torch.cat([pk[:, :, :start], k], dim=2), torch.cat([pv[:, :, :start], v], dim=2)
    allowed = chunk_mask(start, t, start + t, chunk, dev)
    mask = attention_bias(allowed, dt) if allowed is not None else None
    want = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask).transpose(1, 2).reshape(b * t, heads * d)
    got = flow_kernels.attention(qkv, b, heads, d, chunk, None, prefix=(pk, pv), start=start)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="prefix keys"):
        flow_kernels.attention(qkv, b, heads, d, chunk, None, prefix=(pk[:, :, :10], pv), start=start)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("b", [2, 6])
def test_resblock_kernels_after_a_context_equal_the_plain_block(b: int) -> None:
    """The two conv kernels of a ResBlock and a plain causal conv reading a stream's left
    context (the previous two input frames, [B, C, 2]) instead of zeros, against the plain
    modules fed the same context; the context is only read. With a workspace, the rows of a
    tier that splits the reduction (106 and 318 rows) split it."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    c_in, c, t = 320, 256, 53
    block = _res_block(c_in, c, seed=1)
    x = torch.randn(b, t, c_in, device=dev).to(dt)
    ctx1 = torch.randn(b, c_in, 2, device=dev).to(dt)
    ctx2 = torch.randn(b, c, 2, device=dev).to(dt)
    tproj = torch.randn(b, c, device=dev).to(dt)
    kept = (ctx1.clone(), ctx2.clone())
    ws = flow_kernels.conv_workspace(b * t, c, dev)
    assert flow_kernels.tier(b * t)["conv"][4] > 1 and ws is not None  # these rows' tier splits
    with torch.inference_mode():
        zeros = torch.zeros(b, 2, c_in, device=dev, dtype=dt)
        scratch = torch.zeros(b, 2 + t, c, device=dev, dtype=dt)
        want = block(pad_left(x, ctx1.clone(), zeros), tproj, ctx2.clone(), scratch)
        got = fused_flow.res_block(block, x, tproj, ctx1, ctx2)
        assert _rel(got, want) < 1e-2
        # the split reduction: the same within rounding, and the same bits launch after launch
        split = fused_flow.res_block(block, x, tproj, ctx1, ctx2, ws)
        assert _rel(split, want) < 1e-2
        for _ in range(3):
            assert torch.equal(fused_flow.res_block(block, x, tproj, ctx1, ctx2, ws), split)
        assert not ws[1].any()  # every launch leaves its counters at zero
        conv = block.block2.conv
        want = conv(pad_left(got, ctx2.clone(), zeros)).view(b, t, c)
        assert _rel(fused_flow.conv(conv, got, ctx2), want) < 1e-2
        assert _rel(fused_flow.conv(conv, got, ctx2, ws), want) < 1e-2
        with pytest.raises(ValueError, match="workspace"):
            fused_flow.conv(conv, got, ctx2, (ws[0][:10], ws[1]))
    assert torch.equal(ctx1, kept[0]) and torch.equal(ctx2, kept[1])
    with pytest.raises(ValueError, match="ctx"):
        fused_flow.conv(conv, got, ctx1)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("b", [2, 16])
def test_resblock_kernels_equal_the_plain_block(b: int) -> None:
    """Two conv kernels (conv + LayerNorm + Mish + time add; conv + LayerNorm + Mish + 1x1
    residual) against the plain ResBlock, on a strided input (the body of a padded buffer);
    2 and 16 rows of 181 frames: one call in each tile tier."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    c_in, c, t = 320, 256, 181
    block = _res_block(c_in, c, seed=0)
    padded = torch.zeros(b, 2 + t, c_in, device=dev, dtype=dt)
    padded[:, 2:] = torch.randn(b, t, c_in, device=dev).to(dt)
    tproj = torch.randn(b, c, device=dev).to(dt)
    with torch.inference_mode():
        want = block(padded, tproj, None, torch.zeros(b, 2 + t, c, device=dev, dtype=dt))
        got = fused_flow.res_block(block, padded[:, 2:], tproj)
        assert _rel(got, want) < 1e-2
        # a plain causal conv (no norm): the up/down convs
        conv = block.block2.conv
        want = conv(pad_left(got, None, torch.zeros(b, 2, c, device=dev, dtype=dt))).view(b, t, c)
        assert _rel(fused_flow.conv(conv, got), want) < 1e-2


def _flow_pair(dims: Path) -> tuple[Flow, Flow, Flow]:
    """(float32 reference, bf16 plain, bf16 with kernels): the same random weights."""
    ref = random_flow(dims, "cuda", torch.float32, seed=0)
    plain = copy.deepcopy(ref).to(torch.bfloat16).fuse_()
    fused = copy.deepcopy(plain)
    assert fused_flow.use_kernels(fused, True)
    return ref, plain, fused


def _first_chunk_inputs(flow: Flow, prompt: int) -> tuple[torch.Tensor, ...]:
    d = flow.dims
    gen = torch.Generator().manual_seed(1)
    tok = torch.randint(0, d.vocab_size, (1, prompt + d.enc_chunk + d.pre_lookahead), generator=gen)
    feat = torch.randn(1, d.token_mel_ratio * prompt, d.n_mels, generator=gen) - 5
    emb = torch.randn(1, d.spk_embed_dim, generator=gen)
    dev = flow.device
    return tok[:, prompt:].to(dev), tok[:, :prompt].to(dev), feat.to(dev), emb.to(dev)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dims", [TINY, FULL], ids=["tiny", "0.5b"])
def test_first_chunk_and_final_pass_with_kernels_are_as_close_as_plain_bf16(dims: Path) -> None:
    """A first streaming chunk (chunk mask) and a right-padded final pass (key padding) with the
    kernels are within bf16 error of the float32 flow, no further off than the plain bf16 flow."""
    ref, plain, fused = _flow_pair(dims)
    token, prompt_token, feat, emb = _first_chunk_inputs(ref, 40)
    with torch.inference_mode():
        want = ref.inference(token, prompt_token, feat, emb, streaming=True, finalize=False)
        e_plain = _rel(plain.inference(token, prompt_token, feat, emb, streaming=True, finalize=False), want)
        e_fused = _rel(fused.inference(token, prompt_token, feat, emb, streaming=True, finalize=False), want)
        assert e_fused < 5e-2 and e_fused < 1.5 * e_plain + 5e-3, (e_fused, e_plain)

        items = [(token, prompt_token, feat, emb), (token[:, :7], prompt_token[:, :30], feat[:, :60], emb)]
        total = prompt_token.shape[1] + token.shape[1] + 5
        rows = [ref.final_inputs(items, total)[:4], plain.final_inputs(items, total)[:4]]
        spans = ref.final_inputs(items, total)[4]
        want = ref.final_core(*rows[0])
        got_plain = plain.final_core(*rows[1])
        got = fused.final_core(*rows[1])
        for i, (_, stop) in enumerate(spans):
            e_plain = _rel(got_plain[i, :, :stop], want[i, :, :stop])
            e_fused = _rel(got[i, :, :stop], want[i, :, :stop])
            assert e_fused < 5e-2 and e_fused < 1.5 * e_plain + 5e-3, (i, e_fused, e_plain)


@pytest.mark.requires_cuda
def test_graphed_first_chunk_with_kernels_equals_eager() -> None:
    """The fused first chunk replayed from a CUDA graph equals the same call run eagerly."""
    _, _, fused = _flow_pair(TINY)
    token, prompt_token, feat, emb = _first_chunk_inputs(fused, 25)
    with torch.inference_mode():

        def first() -> torch.Tensor:
            return fused.inference(token, prompt_token, feat, emb, streaming=True, finalize=False)

        want = first().clone()
        graphed = GraphedFn(first, name="first")
        got = graphed("k").clone()
        got = graphed("k").clone()
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dims", [TINY, FULL], ids=["tiny", "0.5b"])
def test_first_chunk_from_a_prefix_with_kernels_is_as_close_as_plain_bf16(dims: Path) -> None:
    """A first chunk computed from the voice's prompt prefix with the fused kernels (the prefix
    only read: its keys, values and conv contexts at every Euler step) is within bf16 error of
    the float32 re-run, no further off than the plain bf16 re-run; the prefix is unchanged, and
    the call replayed from a CUDA graph equals it run eagerly. A 150-token prompt (prefix 125)
    for the 0.5B shape, as the engine's voices."""
    ref, plain, fused = _flow_pair(dims)
    n_prompt = 150 if dims == FULL else 50  # the chunk then ends on a boundary (+ 25)
    token, prompt_token, feat, emb = _first_chunk_inputs(ref, n_prompt)
    with torch.inference_mode():
        want = ref.inference(token, prompt_token, feat, emb, streaming=True, finalize=False)
        e_plain = _rel(plain.inference(token, prompt_token, feat, emb, streaming=True, finalize=False), want)
        prompt = fused.prepare_prompt(prompt_token, feat, emb)
        assert prompt.n_prefix > 0
        kept = prompt.prefix.est_v.clone()
        ids, e, cond = fused.prefix_inputs(token, prompt)
        mel = fused.prefix_core(ids, e, cond, prompt.prefix)
        new = mel[:, :, mel.shape[2] - want.shape[2] :]
        e_fused = _rel(new, want)
        assert e_fused < 5e-2 and e_fused < 1.5 * e_plain + 5e-3, (e_fused, e_plain)
        assert torch.equal(prompt.prefix.est_v, kept)

        def first() -> torch.Tensor:
            return fused.prefix_core(ids, e, cond, prompt.prefix)

        graphed = GraphedFn(first, name="prefix")
        graphed("k")
        got = graphed("k").clone()
    torch.testing.assert_close(got, mel, atol=0, rtol=0)
