"""The Triton decode kernels equal the eager decode step (GPU), and are refused where they cannot run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import REPO_ROOT
from voice_out.fast import fused_llm
from voice_out.fast.kernels import decode as decode_kernels
from voice_out.fast.kernels.launch import dependent_launch_available, pdl_options
from voice_out.fast.llm_step import GraphedLLM, pack_decode_rows, unpack_decode_rows
from voice_out.model.checkpoint import random_llm
from voice_out.model.llm import KVCache, SpeechLM, apply_rope, rope_cos_sin, rope_inv_freq
from voice_out.model.sampling import NO_TOKEN, SamplingParams, counter_uniforms, mask_eos_, ras_sample_batch

TINY = REPO_ROOT / "configs" / "models" / "tiny"
FULL = REPO_ROOT / "configs" / "models" / "cosyvoice2-0.5b"


def test_available_only_for_cuda_half_precision_and_supported_heads() -> None:
    assert not decode_kernels.available("cpu", torch.bfloat16, 64, 7)
    assert not decode_kernels.available("cuda", torch.float32, 64, 7)
    assert not decode_kernels.available("cuda", torch.bfloat16, 48, 7)  # not a power of two
    assert not decode_kernels.available("cuda", torch.bfloat16, 8, 2)  # below tl.dot's 16
    assert not decode_kernels.available("cuda", torch.bfloat16, 64, decode_kernels.MAX_GROUP + 1)
    assert not decode_kernels.sampler_available("cpu", 6564, 25)
    assert not decode_kernels.sampler_available("cuda", decode_kernels.MAX_VOCAB + 1, 25)
    assert not decode_kernels.sampler_available("cuda", 6564, decode_kernels.MAX_TOP_K + 1)


def test_graphed_llm_does_not_fuse_on_the_cpu() -> None:
    lm = random_llm(TINY, "cpu", torch.float32, seed=1)
    cache = KVCache.allocate(lm.dims, 3, 64, "cpu", torch.float32)
    g = GraphedLLM(lm, cache, SamplingParams(), decode_windows=(32,))
    assert not g.fused and not g.pdl
    assert g.decode_windows == (32, 64)
    assert not dependent_launch_available("cpu")
    # a kernel launched dependent must wait inside: the launch option never comes without it
    assert pdl_options(False) == {"PDL": False}
    assert pdl_options(True) == {"PDL": True, "launch_pdl": True}


def _pdl_or_skip(pdl: bool) -> None:
    if pdl and not dependent_launch_available("cuda"):
        pytest.skip("programmatic dependent launch needs a Hopper or later GPU")


def _reference_layer(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: list[int],
    pos: list[int],
    hq: int,
    hkv: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch: rope every row, put every row's new k/v at (slot, pos) of copies of the
    caches, then row b attends over keys 0..pos[b] of its slot: (out, k, v)."""
    b, d = qkv.shape[0], k_cache.shape[-1]
    dtype = qkv.dtype
    cos, sin = rope_cos_sin(torch.tensor(pos, device=qkv.device), d, 1e6)  # [B, D]
    q = qkv[:, : hq * d].view(b, hq, 1, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(b, hkv, 1, d)
    v = qkv[:, (hq + hkv) * d :].view(b, hkv, d)
    q = apply_rope(q, cos[:, None], sin[:, None])[:, :, 0]  # [B, Hq, D] in dtype
    k = apply_rope(k, cos[:, None], sin[:, None])[:, :, 0]
    keys_all, vals_all = k_cache.clone(), v_cache.clone()
    for row in range(b):
        keys_all[slots[row], :, pos[row]] = k[row]
        vals_all[slots[row], :, pos[row]] = v[row]
    out = torch.empty(b, hq, d, device=qkv.device, dtype=torch.float32)
    for row in range(b):
        keys = keys_all[slots[row], :, : pos[row] + 1].float()  # [Hkv, P+1, D]
        vals = vals_all[slots[row], :, : pos[row] + 1].float()
        for h in range(hq):
            g = h // (hq // hkv)
            w = torch.softmax(keys[g] @ q[row, h].float() / d**0.5, dim=0)
            out[row, h] = w @ vals[g]
    return out.reshape(b, hq * d).to(dtype), k, v


def _workspace(splits: int, rows: int, hq: int, hkv: int, d: int) -> decode_kernels.AttentionWorkspace | None:
    return decode_kernels.AttentionWorkspace.allocate("cuda", rows, hq, hkv, d, splits) if splits > 1 else None


@pytest.mark.requires_cuda
@pytest.mark.parametrize("splits", [1, 3, 4])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(14, 2, 64), (4, 2, 16), (8, 8, 128)])
def test_rope_append_attend_equals_torch(hq: int, hkv: int, d: int, splits: int) -> None:
    """Also with each row's cached keys split over several programs (``splits``)."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(hq + d)
    pos = [0, 1, 63, 64, 65, 300]  # empty, block edges, several blocks
    b, n_slots, max_len = len(pos), len(pos) + 1, 320
    k_cache = torch.randn(n_slots, hkv, max_len, d, generator=gen, device=dev).to(dtype)
    v_cache = torch.randn(n_slots, hkv, max_len, d, generator=gen, device=dev).to(dtype)
    qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=gen, device=dev).to(dtype)
    want, k_new, v_new = _reference_layer(qkv, k_cache, v_cache, list(range(b)), pos, hq, hkv)
    # rows 2 and 4 are inactive: their K/V go to the scratch slot (the last), position 0
    active = torch.tensor([True, True, False, True, False, True], device=dev)
    pos_t = torch.tensor(pos, device=dev)
    scratch = n_slots - 1
    slot = torch.arange(b, device=dev)
    write_slot = torch.where(active, slot, scratch)
    write_pos = torch.where(active, pos_t, 0)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    cos, sin = rope_cos_sin(pos_t, d, 1e6)
    zeros = torch.zeros_like(pos_t)
    ws = _workspace(splits, b, hq, hkv, d)
    got = decode_kernels.rope_append_attend(
        qkv, k_cache, v_cache, cos, sin, pos_t, slot, zeros, write_slot, write_pos, hq, hkv, workspace=ws, splits=splits
    )
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert ws is None or int(ws.counters.abs().sum()) == 0  # left ready for the next launch
    for row in range(b):
        if bool(active[row]):
            expect_k[row, :, pos[row]] = k_new[row]
            expect_v[row, :, pos[row]] = v_new[row]
    torch.testing.assert_close(k_cache[:scratch].float(), expect_k[:scratch].float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(v_cache[:scratch], expect_v[:scratch], atol=0, rtol=0)
    # the scratch slot: position 0 holds the inactive rows' K/V; the rest is untouched
    # the programs of rows 2 and 4 race for it, element by element
    from_2, from_4 = v_cache[scratch, :, 0] == v_new[2], v_cache[scratch, :, 0] == v_new[4]
    assert bool((from_2 | from_4).all())
    torch.testing.assert_close(v_cache[scratch, :, 1:], expect_v[scratch, :, 1:], atol=0, rtol=0)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(14, 2, 64), (4, 2, 16)])
def test_rope_append_attend_runs_of_rows_equal_torch(hq: int, hkv: int, d: int, splits: int) -> None:
    """Runs of rows feeding one slot (offsets 0, 1, ..) attend causally over the slot and the
    run's earlier rows, whose keys this launch is still writing; a run longer than a block of
    keys (70 rows) included, and runs in any slot order beside lone decode rows."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(hq + d + 1)
    # (slot, cached length, rows): a decode row, a 5-row text group, an empty slot's 70 rows
    runs = [(3, 40, 1), (0, 64, 5), (2, 0, 70), (1, 129, 1), (4, 7, 2)]
    slots = [s for s, _, n in runs for _ in range(n)]
    offsets = [j for _, _, n in runs for j in range(n)]
    pos = [c + j for _, c, n in runs for j in range(n)]
    b, n_slots, max_len = len(slots), 6, 256
    k_cache = torch.randn(n_slots, hkv, max_len, d, generator=gen, device=dev).to(dtype)
    v_cache = torch.randn(n_slots, hkv, max_len, d, generator=gen, device=dev).to(dtype)
    qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=gen, device=dev).to(dtype)
    want, k_new, v_new = _reference_layer(qkv, k_cache, v_cache, slots, pos, hq, hkv)
    t = lambda v: torch.tensor(v, device=dev)  # noqa: E731
    cos, sin = rope_cos_sin(t(pos), d, 1e6)
    expect_v = v_cache.clone()
    got = decode_kernels.rope_append_attend(
        qkv,
        k_cache,
        v_cache,
        cos,
        sin,
        t(pos),
        t(slots),
        t(offsets),
        t(slots),
        t(pos),
        hq,
        hkv,
        workspace=_workspace(splits, b, hq, hkv, d),
        splits=splits,
    )
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    for row in range(b):
        expect_v[slots[row], :, pos[row]] = v_new[row]
        torch.testing.assert_close(k_cache[slots[row], :, pos[row]].float(), k_new[row].float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(v_cache, expect_v, atol=0, rtol=0)


@pytest.mark.requires_cuda
def test_silu_mul_equals_torch() -> None:
    x = torch.randn(5, 2 * 4864, device="cuda").to(torch.bfloat16)
    gate, up = x.float().chunk(2, dim=1)
    torch.testing.assert_close(decode_kernels.silu_mul(x).float(), F.silu(gate) * up, atol=2e-2, rtol=2e-2)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.requires_cuda
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_fused_linears_equal_torch(rows: int, pdl: bool) -> None:
    """norm_linear (plain, with bias, gated) and linear_residual (in place and not) against
    F.rms_norm, F.linear, silu * up and addmm, at the 0.5B model's shapes; launched
    programmatically dependent too (where the GPU can)."""
    _pdl_or_skip(pdl)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(rows)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dtype)

    hidden, qkv, inter, eps = 896, 1152, 4864, 1e-6
    x, g = rand(rows, hidden, scale=3.0), (1 + 0.2 * torch.randn(hidden, generator=gen, device=dev)).to(dtype)
    w, bias = rand(qkv, hidden, scale=hidden**-0.5), rand(qkv)
    want = F.linear(F.rms_norm(x, (hidden,), g, eps), w, bias)
    assert _relative_error(decode_kernels.norm_linear(x, w, g, eps, bias, pdl=pdl), want) < 1e-2
    assert _relative_error(decode_kernels.norm_linear(x, w, None, eps, pdl=pdl), F.linear(x, w)) < 1e-2
    w13 = rand(2 * inter, hidden, scale=hidden**-0.5)
    gate, up = F.linear(F.rms_norm(x, (hidden,), g, eps), w13).split(inter, dim=-1)
    want = _silu_mul_reference(gate, up)
    got = decode_kernels.norm_linear(x, w13, g, eps, gated=True, pdl=pdl)
    assert got.shape == (rows, inter) and _relative_error(got, want) < 1e-2
    a, w2, res = rand(rows, inter), rand(hidden, inter, scale=inter**-0.5), rand(rows, hidden)
    want = torch.addmm(res, a, w2.t())
    assert _relative_error(decode_kernels.linear_residual(a, w2, res, pdl=pdl), want) < 1e-2
    inplace = res.clone()
    assert decode_kernels.linear_residual(a, w2, inplace, out=inplace, pdl=pdl) is inplace
    assert _relative_error(inplace, want) < 1e-2
    # the split reduction: the same sum whichever program ends last, launch after launch
    ws = decode_kernels.SplitWorkspace.allocate(dev, hidden)
    split = decode_kernels.linear_residual(a, w2, res, workspace=ws, pdl=pdl)
    assert _relative_error(split, want) < 1e-2
    assert int(ws.counters.abs().sum()) == 0  # left ready for the next launch
    for _ in range(20):
        again = res.clone()
        decode_kernels.linear_residual(a, w2, again, out=again, workspace=ws, pdl=pdl)
        torch.testing.assert_close(again, split, atol=0, rtol=0)
    with pytest.raises(ValueError, match="do not fit"):
        decode_kernels.norm_linear(rand(decode_kernels.LINEAR_MAX_ROWS + 1, hidden), w, g, eps)


def _silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in float32, rounded once, as ``decode_kernels.silu_mul``."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dims_dir", [TINY, FULL], ids=["tiny", "0.5b"])
@pytest.mark.parametrize(
    ("linear", "pdl"), [(False, False), (True, False), (True, True)], ids=["library-gemms", "fused-linears", "pdl"]
)
def test_fused_decode_step_equals_eager(dims_dir: Path, linear: bool, pdl: bool) -> None:
    _pdl_or_skip(pdl)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    lm = random_llm(dims_dir, dev, dtype, seed=4)
    n_slots, max_len = 5, 160
    eager = KVCache.allocate(lm.dims, n_slots, max_len, dev, dtype)
    fused = KVCache.allocate(lm.dims, n_slots, max_len, dev, dtype)
    gen = torch.Generator(device=dev).manual_seed(0)
    # the fused linears with w2's split reduction, as GraphedLLM runs them
    linears: dict[str, Any] = {}
    if linear:
        linears = {
            "linear": True,
            "split_workspace": decode_kernels.SplitWorkspace.allocate(dev, lm.dims.hidden_size),
            "pdl": pdl,
        }
    for slot, n in enumerate([3, 70, 17, 1]):  # slot 4 is the scratch slot
        e = torch.randn(n, lm.dims.hidden_size, generator=gen, device=dev).to(dtype)
        lm.prefill(eager, slot, e, start_pos=0)
        lm.prefill(fused, slot, e, start_pos=0)
    for step in range(6):
        e = lm.embed_speech(torch.randint(0, 6561, (4,), generator=gen, device=dev))
        active = torch.tensor([True, step % 2 == 0, True, step != 3], device=dev)
        want = lm.decode_step(eager, None, e, kv_len=max_len, active=active, scratch_slot=4)
        got = fused_llm.decode_step(lm, fused, None, e, active=active, scratch_slot=4, **linears)
        rows = active.nonzero()[:, 0]
        err = _relative_error(got[rows], want[rows])
        assert err < 2e-2, f"step {step}: relative error {err:.4f}"
        assert fused.lengths.tolist() == eager.lengths.tolist()
    for slot in range(4):
        n = int(eager.lengths[slot])
        assert _relative_error(fused.k[:, slot, :, :n], eager.k[:, slot, :, :n]) < 2e-2
        assert _relative_error(fused.v[:, slot, :, :n], eager.v[:, slot, :, :n]) < 2e-2
    # a step with runs of rows: slot 2 takes 6 rows, slot 0 one, slot 3 three, idle padding
    runs = [(2, 6), (0, 1), (3, 3)]
    slots = torch.tensor([s for s, n in runs for _ in range(n)] + [4, 4], device=dev)
    offsets = torch.tensor([j for _, n in runs for j in range(n)] + [0, 0], device=dev)
    active = torch.tensor([True] * 10 + [False, False], device=dev)
    e = torch.randn(12, lm.dims.hidden_size, generator=gen, device=dev).to(dtype)
    kw: dict[str, Any] = {"active": active, "scratch_slot": 4, "offsets": offsets}
    want = lm.decode_step(eager, slots, e, kv_len=max_len, **kw)
    got = fused_llm.decode_step(lm, fused, slots, e, **linears, **kw)
    assert _relative_error(got[:10], want[:10]) < 2e-2
    assert fused.lengths.tolist() == eager.lengths.tolist()
    for slot in range(4):
        n = int(eager.lengths[slot])
        assert _relative_error(fused.k[:, slot, :, :n], eager.k[:, slot, :, :n]) < 2e-2


@pytest.mark.requires_cuda
def test_decode_prologue_equals_the_torch_rows() -> None:
    """The prologue kernel makes the rows the torch path makes: unpacked fields, fed ids and
    windows, embeddings of every kind, positions, scratch writes and RoPE angles; the layers
    fed from it give the fused decode_step's hidden states and lengths."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    lm: SpeechLM = random_llm(TINY, dev, dtype, seed=5)
    params = SamplingParams()
    caches = [KVCache.allocate(lm.dims, 6, 64, dev, dtype) for _ in range(2)]
    g = GraphedLLM(lm, caches[0], params, prefill_buckets=(), enabled=False)
    assert g.fused
    gen = torch.Generator(device=dev).manual_seed(2)
    for slot, n in enumerate([5, 9, 0, 3, 7]):
        if n:
            e = torch.randn(n, lm.dims.hidden_size, generator=gen, device=dev).to(dtype)
            for c in caches:
                lm.prefill(c, slot, e, start_pos=0)
    g.last_ids.copy_(torch.tensor([11, 22, 33, 44, 55, 66], device=dev))
    # a fed speech row, a run of three text rows, an llm_embedding row, an inactive row
    slots, offsets, kinds = [0, 1, 1, 1, 3, 4], [0, 0, 1, 2, 0, 0], [2, 1, 1, 1, 0, 2]
    windows = [[1, 2, 3], [], [4] * 20, [], [5, 6], [8]]
    rows = pack_decode_rows(
        slots,
        [7, 100, 101, 102, 1, 9],
        [False, True, False, False, True, False],
        counter_uniforms(slots, [3] * 6),
        windows,
        params.win_size,
        offsets=offsets,
        kinds=kinds,
        feed=[True, False, False, False, False, False],
    )
    rows[5, 0] = 0
    packed = torch.from_numpy(rows).to(dev)
    tables = (lm.llm_embedding.weight, lm.embed_tokens.weight, lm.speech_embedding.weight)
    inv_freq = rope_inv_freq(lm.dims.head_dim, lm.dims.rope_theta, dev)
    got = decode_kernels.decode_prologue(packed, g._columns, g.last_ids, caches[0].lengths, tables, inv_freq, 5)
    want = g._resolve_fed(unpack_decode_rows(packed))
    for field in ("active", "tokens", "slots", "offsets", "masked", "uniforms", "history"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert got.tokens[0] == 11 and got.history[0, -1] == 11  # the fed row took its slot's draw
    embeds = lm.embed_kinds(want.kinds, want.tokens)
    assert torch.equal(got.embeds, embeds)
    pos = caches[0].lengths.index_select(0, want.slots).long() + want.offsets
    assert got.pos.tolist() == [5, 9, 10, 11, 3, 7]
    assert torch.equal(got.pos, pos)
    assert torch.equal(got.write_slot, torch.where(want.active, want.slots, 5))
    assert torch.equal(got.write_pos, torch.where(want.active, pos, 0))
    cos, sin = rope_cos_sin(pos, lm.dims.head_dim, lm.dims.rope_theta)
    torch.testing.assert_close(got.cos, cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(got.sin, sin, atol=1e-6, rtol=0)
    hidden = fused_llm.decode_rows(lm, caches[0], got, linear=True, split_workspace=g._split_ws)
    ref = fused_llm.decode_step(
        lm,
        caches[1],
        want.slots,
        embeds,
        active=want.active,
        scratch_slot=5,
        offsets=want.offsets,
        linear=True,
        split_workspace=g._split_ws,
    )
    torch.testing.assert_close(hidden, ref, atol=2e-2, rtol=2e-2)
    assert caches[0].lengths.tolist() == caches[1].lengths.tolist() == [6, 12, 0, 4, 7, 0]


@pytest.mark.requires_cuda
def test_graphed_fused_decode_equals_the_same_step_eager() -> None:
    """A replayed fused graph gives the tokens and K/V of the same fused step run eagerly."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    lm: SpeechLM = random_llm(TINY, dev, dtype, seed=3)
    params = SamplingParams()
    caches = [KVCache.allocate(lm.dims, 6, 96, dev, dtype) for _ in range(2)]
    graphed = GraphedLLM(lm, caches[0], params, decode_buckets=(1, 2, 4), prefill_buckets=())
    # the eager step without programmatic dependent launch: the graph's (where the GPU has
    # it) changes when kernels start, not what they compute
    eager = GraphedLLM(
        lm, caches[1], params, decode_buckets=(1, 2, 4), prefill_buckets=(), enabled=False, dependent_launch=False
    )
    assert not eager.pdl and graphed.pdl == dependent_launch_available(dev)
    assert graphed.fused and eager.fused and graphed.fused_linear
    assert sorted(graphed._decode) == [96]  # one window: the kernel's attention runs to each row's length
    graphed.capture_all()
    gen = torch.Generator(device=dev).manual_seed(1)
    for slot, n in enumerate([9, 4, 20, 13]):
        e = torch.randn(n, lm.dims.hidden_size, generator=gen, device=dev).to(dtype)
        for c in caches:
            lm.prefill(c, slot, e, start_pos=0)
    # (slot, rows) runs in any order; each step's rows fill a bucket, so the eager call runs
    # the graph's batch shape
    for step, runs in enumerate([[(0, 1)], [(1, 1), (0, 1)], [(3, 4)], [(2, 1), (3, 1), (0, 2)], [(0, 1), (1, 3)]]):
        slots = [s for s, n in runs for _ in range(n)]
        offsets = [j for _, n in runs for j in range(n)]
        kinds = [1 if n > 1 else 2 for _, n in runs for _ in range(n)]  # runs of text, speech decode rows
        drawn = torch.randint(0, 6561, (len(slots),), generator=gen, device=dev).tolist()
        tokens = [t % lm.dims.text_vocab_size if k == 1 else t for t, k in zip(drawn, kinds, strict=True)]
        u = counter_uniforms(slots, [step] * len(slots))
        rows = pack_decode_rows(
            slots, tokens, [False] * len(slots), u, [[]] * len(slots), params.win_size, offsets=offsets, kinds=kinds
        )
        got = graphed.decode_sample(rows, kv_len=60 + step)
        want = eager.decode_sample(rows, kv_len=60 + step)
        assert got == want
    assert caches[0].lengths[:4].tolist() == caches[1].lengths[:4].tolist()
    for slot in range(4):
        n = int(caches[0].lengths[slot])
        torch.testing.assert_close(caches[0].k[:, slot, :, :n], caches[1].k[:, slot, :, :n], atol=0, rtol=0)
    assert caches[0].lengths.tolist() == [14, 8, 21, 18, 0, 0]


@pytest.mark.requires_cuda
@pytest.mark.parametrize(
    "params", [SamplingParams(), SamplingParams(top_p=0.5, top_k=5, win_size=4, tau_r=0.5)], ids=["default", "other"]
)
def test_ras_sample_equals_torch(params: SamplingParams) -> None:
    dev, vocab, eos = torch.device("cuda"), 6564, 6561
    gen = torch.Generator(device=dev).manual_seed(params.top_k)
    rows = 512
    # peaked to flat rows; every 4th row in coarse steps, so many probabilities tie
    scale = torch.tensor([0.5, 2.0, 5.0, 20.0], device=dev).repeat(rows // 4)[:, None]
    logits = torch.randn(rows, vocab, generator=gen, device=dev) * scale
    logits[::4] = torch.round(logits[::4] * 2) / 2
    padded = torch.full((rows, vocab + 28), 7.0, device=dev).to(torch.bfloat16)  # a strided view, as the graph's
    padded[:, :vocab] = logits.to(torch.bfloat16)
    view = padded[:, :vocab]
    # histories of likely tokens, so the repetition fallback fires on many rows
    likely = view.float().topk(8, dim=1).indices
    pick = torch.randint(0, 8, (rows, params.win_size + 2), generator=gen, device=dev)
    history = likely.gather(1, pick)
    history[::3] = NO_TOKEN
    uniforms = torch.rand(rows, 2, generator=gen, device=dev)
    masked = torch.rand(rows, generator=gen, device=dev) < 0.5
    logp = mask_eos_(torch.log_softmax(view.float(), dim=-1), masked, eos)
    want = ras_sample_batch(logp, history, uniforms, params)
    got = decode_kernels.ras_sample(view, history, uniforms, masked, eos, params)
    assert got.dtype == torch.long
    assert got.tolist() == want.tolist()
    # the window as a strided view (the graph reads it out of the packed decode rows)
    packed = torch.full((rows, 5 + history.shape[1]), 123, dtype=torch.long, device=dev)
    packed[:, 5:] = history
    assert decode_kernels.ras_sample(view, packed[:, 5:], uniforms, masked, eos, params).tolist() == want.tolist()
    first_draws = ras_sample_batch(logp, torch.full_like(history, NO_TOKEN), uniforms, params)
    assert int((want != first_draws).sum()) > 10  # the fallback really ran
    assert not bool((got[masked] == eos).any())
    # each row's vocabulary ranked in slices by several programs, the last one drawing: the
    # same ids, launch after launch (each leaves the arrival counters at zero for the next)
    ws = decode_kernels.SampleWorkspace.allocate(dev, rows, params.top_k, splits=16)
    for splits, warps in ((2, 8), (8, 4), (16, 2), (8, 4)):
        split = decode_kernels.ras_sample(
            view, packed[:, 5:], uniforms, masked, eos, params, workspace=ws, splits=splits, num_warps=warps
        )
        assert split.tolist() == want.tolist(), (splits, warps)
        assert int(ws.counters.count_nonzero()) == 0
    with pytest.raises(ValueError, match="does not fit"):
        decode_kernels.ras_sample(view, history, uniforms, masked, eos, params, workspace=ws, splits=32)
