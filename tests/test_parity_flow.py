"""Flow parity (cases c and d) and flow.pt loading.

Every dimension comes from the parity directory (``VOICE_OUT_PARITY_DIR``): the model is
built from its ``cosyvoice2.yaml`` and the cases are read key by key, so another directory in
the same format with other dims runs the same checks.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import load_case
from tests.test_flow_streaming import state_chunk
from voice_out.model.checkpoint import (
    CheckpointError,
    flow_key,
    load_flow,
    load_state_dict,
    load_yaml,
    random_flow,
    section,
)
from voice_out.model.flow import Flow, fixed_noise
from voice_out.model.flow_dims import FlowDims

TOL = 1e-4  # max abs, mel values ~ -10..0 (parity README section 5)


def report(name: str, ref: torch.Tensor, x: torch.Tensor) -> float:
    assert ref.shape == x.shape, f"{name}: shape {tuple(x.shape)} != reference {tuple(ref.shape)}"
    err = float((ref.float() - x.float()).abs().max())
    print(f"{name}: max abs {err:.3g}")
    return err


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def flow(parity_dir: Path) -> Flow:
    return load_flow(parity_dir)


def test_dims_come_from_the_yaml(parity_dir: Path, flow: Flow) -> None:
    kw = section(load_yaml(parity_dir), "flow")
    enc, est = kw["encoder"].kwargs, kw["decoder"].kwargs["estimator"].kwargs
    d = flow.dims
    assert (d.enc_heads, d.enc_ffn, d.enc_blocks) == (enc["attention_heads"], enc["linear_units"], enc["num_blocks"])
    assert (d.est_heads, d.est_head_dim) == (est["num_heads"], est["attention_head_dim"])
    assert (d.est_blocks, d.est_mid_blocks, d.est_channels) == (
        est["n_blocks"],
        est["num_mid_blocks"],
        est["channels"][0],
    )
    assert d.est_chunk == est["static_chunk_size"] and d.enc_chunk == enc["static_chunk_size"]
    assert len(flow.encoder.blocks) == enc["num_blocks"] and len(flow.estimator.mid_res) == est["num_mid_blocks"]
    tb = flow.estimator.transformer_blocks()
    assert len(tb) == d.n_est_blocks and tb[0].to_q.out_features == est["num_heads"] * est["attention_head_dim"]


def test_flow_pt_keys_all_map(parity_dir: Path, flow: Flow) -> None:
    raw = load_state_dict(parity_dir / "flow.pt")
    names = [flow_key(k) for k in raw]
    assert None not in names
    assert sorted(n for n in names if n is not None) == sorted(flow.state_dict())
    assert "noise" not in flow.state_dict()  # the fixed noise is not a checkpoint tensor
    # float16 storage is upcast: the loaded weight equals the stored value exactly
    w = flow.state_dict()["encoder.blocks.0.self_attn.linear_q.weight"]
    assert w.dtype == torch.float32
    assert torch.equal(w, raw["encoder.encoders.0.self_attn.linear_q.weight"].float())


def test_noise_is_upstreams_and_leaves_the_global_rng_alone(cases_dir: Path, flow: Flow) -> None:
    case = load_case(cases_dir, "c_flow_offline")
    noise = case["noise"]
    state = torch.get_rng_state()
    made = fixed_noise(noise.shape[1], flow.dims.noise_frames)
    assert torch.equal(torch.get_rng_state(), state)
    assert made.shape == (1, noise.shape[1], flow.dims.noise_frames)
    assert torch.equal(made[:, :, : noise.shape[2]], noise)
    assert torch.equal(flow.noise[:, :, : noise.shape[2]], noise)


def test_case_c_offline(cases_dir: Path, flow: Flow) -> None:
    case = load_case(cases_dir, "c_flow_offline")
    assert case["streaming"] is False and case["finalize"] is True
    assert case["n_timesteps"] == flow.dims.n_timesteps
    token, prompt_token, prompt_feat, embedding = (
        case["token"],
        case["prompt_token"],
        case["prompt_feat"],
        case["embedding"],
    )
    with torch.no_grad():
        spks = flow.speaker(embedding)
        ids = torch.cat([prompt_token, token], dim=1)
        mu = flow.encoder_proj(flow.encoder(flow.embed_tokens(ids), None, False)).transpose(1, 2)
        cond = torch.zeros_like(mu)
        cond[:, :, : prompt_feat.shape[1]] = prompt_feat.transpose(1, 2)
        z = case["noise"]
        out0 = flow.estimator(
            torch.cat([z, z]),
            torch.cat([mu, torch.zeros_like(mu)]),
            torch.cat([spks, torch.zeros_like(spks)]),
            torch.cat([cond, torch.zeros_like(cond)]),
            case["estimator_in_step0_t"],
            False,
        )
        mel = flow.inference(token, prompt_token, prompt_feat, embedding, streaming=False, finalize=True)
    assert report("c spks", case["spks"], spks) <= TOL
    assert report("c mu", case["mu"], mu) <= TOL
    assert report("c estimator step 0", case["estimator_out_step0"], out0) <= TOL
    assert mel.dtype == torch.float32
    assert report("c mel", case["mel"], mel) <= TOL
    assert float(case["mel"].std()) > 0.1  # the case is not degenerate


def test_case_d_every_streaming_call(cases_dir: Path, flow: Flow) -> None:
    case = load_case(cases_dir, "d_flow_streaming")
    token, prompt_token, prompt_feat, embedding = (
        case["token"],
        case["prompt_token"],
        case["prompt_feat"],
        case["embedding"],
    )
    lookahead = flow.dims.pre_lookahead
    ratio = flow.dims.token_mel_ratio
    assert any(c["finalize"] for c in case["calls"]) and any(not c["finalize"] for c in case["calls"])
    worst = 0.0
    for k, call in enumerate(case["calls"]):
        n = int(call["token_len"])
        with torch.no_grad():
            mel = flow.inference(
                token[:, :n],
                prompt_token,
                prompt_feat,
                embedding,
                streaming=call["streaming"],
                finalize=call["finalize"],
            )
        n_out = n if call["finalize"] else n - lookahead
        assert mel.shape == (1, flow.dims.n_mels, ratio * n_out)
        worst = max(worst, report(f"d call {k} (len {n}, finalize {call['finalize']})", call["mel"], mel))
    print(f"d all calls: max abs {worst:.3g}")
    assert worst <= TOL


def test_case_d_through_a_stream_state(cases_dir: Path, flow: Flow) -> None:
    """The same calls made through prepare_prompt / state_inputs / state_core (the engine's
    incremental path: later chunks extending a stream's own state; its final chunk is the
    full-attention re-run)."""
    case = load_case(cases_dir, "d_flow_streaming")
    token = case["token"]
    lookahead = flow.dims.pre_lookahead
    ratio = flow.dims.token_mel_ratio
    voice = (case["prompt_token"], case["prompt_feat"], case["embedding"])
    with torch.no_grad():
        prompt = flow.prepare_prompt(*voice)
        cache = flow.allocate_stream_cache(prompt.n_prompt + int(token.shape[1]))
        flow.reset_stream_cache(cache, prompt)
        offset = 0
        worst = 0.0
        for k, call in enumerate(case["calls"]):
            n = int(call["token_len"])
            if call["finalize"]:
                mel = flow.inference(token[:, :n], *voice, streaming=False, finalize=True)[:, :, ratio * offset :]
            else:
                mel = state_chunk(flow, cache, token[:, offset:n])
            expected = call["mel"][:, :, ratio * offset :]
            worst = max(worst, report(f"d state call {k}", expected, mel))
            offset = n - (0 if call["finalize"] else lookahead)
    assert worst <= TOL


# -- loading ------------------------------------------------------------------------------------


def _copy_model_dir(src: Path, dst: Path, state: dict[str, torch.Tensor]) -> Path:
    dst.mkdir()
    shutil.copy(src / "cosyvoice2.yaml", dst / "cosyvoice2.yaml")
    torch.save(state, dst / "flow.pt")
    return dst


def test_key_mismatch_is_one_clear_error(parity_dir: Path, tmp_path: Path) -> None:
    raw = load_state_dict(parity_dir / "flow.pt")
    bad = dict(raw)
    del bad["encoder_proj.bias"]
    bad["decoder.estimator.extra.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError) as info:
        load_flow(_copy_model_dir(parity_dir, tmp_path / "bad", bad))
    msg = str(info.value)
    assert "missing keys (1): encoder_proj.bias" in msg
    assert "unexpected keys (1): decoder.estimator.extra.weight" in msg


def test_dims_errors_are_precise() -> None:
    with pytest.raises(KeyError, match="flow.encoder is missing"):
        FlowDims.from_config({"input_size": 512})
    with pytest.raises(ValueError, match="only one level"):
        FlowDims.from_config(
            {"encoder": {}, "decoder": {"estimator": {"channels": [256, 256]}}},
        )


def test_random_flow_from_yaml(parity_dir: Path) -> None:
    model = random_flow(parity_dir / "cosyvoice2.yaml", seed=3)
    assert model.dims == load_flow(parity_dir).dims
    again = random_flow(parity_dir, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
    gen = torch.Generator().manual_seed(0)
    token = torch.randint(0, model.dims.vocab_size, (1, 30), generator=gen)
    prompt = torch.randint(0, model.dims.vocab_size, (1, 20), generator=gen)
    feat = torch.randn(1, model.dims.token_mel_ratio * 20, model.dims.n_mels, generator=gen) - 5.0
    emb = torch.randn(1, model.dims.spk_embed_dim, generator=gen)
    with torch.no_grad():
        mel = model.inference(token, prompt, feat, emb, streaming=True, finalize=True)
    assert mel.shape == (1, model.dims.n_mels, model.dims.token_mel_ratio * 30)
    assert bool(torch.isfinite(mel).all())
    assert 0.1 < float(mel.std()) < 20.0  # activations stay sane through 10 Euler steps


def test_fused_qkv_equals_separate_projections(parity_dir: Path, cases_dir: Path) -> None:
    case = load_case(cases_dir, "c_flow_offline")
    fused = load_flow(parity_dir)
    separate = load_flow(parity_dir)
    blocks = separate.estimator.transformer_blocks()
    assert all(b.qkv_weight.numel() > 0 for b in fused.estimator.transformer_blocks())
    for block in blocks:
        block.qkv_weight = torch.empty(0)  # back to three matmuls
    args = (case["token"], case["prompt_token"], case["prompt_feat"], case["embedding"])
    with torch.no_grad():
        a = fused.inference(*args, streaming=False, finalize=True)
        b = separate.inference(*args, streaming=False, finalize=True)
    assert float((a - b).abs().max()) < 1e-5
