"""HiFT vocoder parity (cases e1..e3) and hift.pt loading.

Every dimension comes from the parity directory (``VOICE_OUT_PARITY_DIR``); the reference
outputs were made with upstream's deterministic source (zero phases, no additive noise).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import load_case
from voice_out.model.checkpoint import (
    CheckpointError,
    fold_weight_norm,
    load_hift,
    load_state_dict,
    load_yaml,
    random_hift,
    section,
)
from voice_out.model.vocoder import HiFT, HiFTDims

F0_TOL_HZ = 1e-2
SPEECH_TOL = 2e-3
SPEECH_MIN_SNR_DB = 60.0
DECODER_TOL = 1e-4


def snr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    err = (ref.double() - x.double()).pow(2).sum().clamp_min(1e-300)
    return float(10.0 * torch.log10(ref.double().pow(2).sum() / err))


def report(name: str, ref: torch.Tensor, x: torch.Tensor) -> tuple[float, float]:
    assert ref.shape == x.shape, f"{name}: shape {tuple(x.shape)} != reference {tuple(ref.shape)}"
    err = float((ref - x).abs().max())
    snr = snr_db(ref, x)
    print(f"{name}: max abs {err:.3g}, SNR {snr:.1f} dB")
    return err, snr


@pytest.fixture(scope="module")
def hift(parity_dir: Path) -> HiFT:
    return load_hift(parity_dir)


def test_dims_come_from_the_yaml(parity_dir: Path, hift: HiFT) -> None:
    kw = section(load_yaml(parity_dir), "hift")
    d = hift.dims
    assert d.base_channels == kw["base_channels"]
    assert list(d.upsample_rates) == list(kw["upsample_rates"])
    assert d.istft_n_fft == kw["istft_params"]["n_fft"]
    assert d.samples_per_frame == 480  # 24 kHz / 50 Hz mel: the layout's fixed constant
    assert hift.conv_pre.out_channels == kw["base_channels"]
    assert hift.conv_post.out_channels == kw["istft_params"]["n_fft"] + 2


@pytest.mark.parametrize("name", ["e1_hift_flow_mel", "e2_hift_cache_source", "e3_hift_prompt_mel"])
def test_hift_speech(cases_dir: Path, hift: HiFT, name: str) -> None:
    case = load_case(cases_dir, name)
    mel, cache_source = case["mel"], case["cache_source"]
    with torch.no_grad():
        speech, source = hift(mel, cache_source)
    assert speech.dtype == torch.float32
    assert speech.shape == (1, hift.dims.samples_per_frame * mel.shape[2])
    if cache_source.shape[2] > 0:
        n = cache_source.shape[2]
        assert torch.equal(source[:, :, :n], cache_source), "cache_source must overwrite the first samples"
    err, snr = report(f"{name} speech", case["speech"], speech)
    assert err <= SPEECH_TOL and snr >= SPEECH_MIN_SNR_DB
    assert float(speech.abs().max()) <= float(torch.tensor(hift.dims.audio_limit))  # float32 limit


def test_hift_f0_source_and_decoder(cases_dir: Path, hift: HiFT) -> None:
    case = load_case(cases_dir, "e1_hift_flow_mel")
    with torch.no_grad():
        f0 = hift.predict_f0(case["mel"])
        source = hift.source(f0)
        from_recorded_source = hift.decode(case["mel"], case["source"])
    f0_err = float((f0 - case["f0"]).abs().max())
    print(f"e1 f0: max abs {f0_err:.3g} Hz")
    assert f0_err <= F0_TOL_HZ
    # the case must exercise both voiced and unvoiced frames
    voiced = case["f0"] > hift.dims.nsf_voiced_threshold
    assert bool(voiced.any()) and bool((~voiced).any())
    src_err, _ = report("e1 source", case["source"], source)
    assert src_err <= SPEECH_TOL
    dec_err, _ = report("e1 decoder given the recorded source", case["speech"], from_recorded_source)
    assert dec_err <= DECODER_TOL


def test_unvoiced_source_is_silent(hift: HiFT) -> None:
    """Deterministic mode: where f0 <= threshold the sines are zeroed, so source = tanh(bias)."""
    f0 = torch.tensor([[0.0, 5.0, 200.0]])
    with torch.no_grad():
        src = hift.source(f0)[0, 0]
        expected = torch.tanh(hift.m_source.l_linear.bias)
    spf = hift.dims.samples_per_frame
    assert torch.allclose(src[: 2 * spf], expected.expand(2 * spf))
    assert float((src[2 * spf :] - expected).abs().max()) > 1e-3


def test_noise_mode_uses_the_given_generator(cases_dir: Path, hift: HiFT) -> None:
    mel = load_case(cases_dir, "e1_hift_flow_mel")["mel"][:, :, :40]
    with torch.no_grad():
        det, _ = hift(mel)
        a, _ = hift(mel, noise=torch.Generator().manual_seed(1))
        b, _ = hift(mel, noise=torch.Generator().manual_seed(1))
        c, _ = hift(mel, noise=torch.Generator().manual_seed(2))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert not torch.equal(a, det)
    assert float((a - det).abs().max()) < 0.5  # noise perturbs, it does not replace the signal


# -- loading ------------------------------------------------------------------------------------


def test_fold_weight_norm_matches_torch_for_conv_transpose() -> None:
    conv = torch.nn.ConvTranspose1d(6, 4, 5, stride=2)
    wn = torch.nn.utils.parametrizations.weight_norm(conv, dim=0)
    with torch.no_grad():
        wn.parametrizations.weight.original0.mul_(torch.rand(6, 1, 1) + 0.5)  # g != ||v||
    state = {f"ups.0.{k}": v for k, v in wn.state_dict().items()}
    folded = fold_weight_norm(state)
    assert set(folded) == {"ups.0.weight", "ups.0.bias"}
    assert torch.allclose(folded["ups.0.weight"], wn.weight.detach(), atol=1e-6)
    legacy = {"c.weight_g": state["ups.0.parametrizations.weight.original0"]}
    legacy["c.weight_v"] = state["ups.0.parametrizations.weight.original1"]
    assert torch.allclose(fold_weight_norm(legacy)["c.weight"], folded["ups.0.weight"])


def _copy_model_dir(src: Path, dst: Path, state: dict[str, torch.Tensor]) -> Path:
    dst.mkdir()
    shutil.copy(src / "cosyvoice2.yaml", dst / "cosyvoice2.yaml")
    torch.save(state, dst / "hift.pt")
    return dst


def test_legacy_and_prefixed_keys_load_the_same_weights(parity_dir: Path, hift: HiFT, tmp_path: Path) -> None:
    raw = load_state_dict(parity_dir / "hift.pt")
    legacy: dict[str, torch.Tensor] = {}
    for k, v in raw.items():
        k = k.replace(".parametrizations.weight.original0", ".weight_g")
        k = k.replace(".parametrizations.weight.original1", ".weight_v")
        legacy["generator." + k] = v
    other = load_hift(_copy_model_dir(parity_dir, tmp_path / "legacy", legacy))
    ours = hift.state_dict()
    for k, v in other.state_dict().items():
        assert torch.equal(v, ours[k]), k


def test_key_mismatch_is_one_clear_error(parity_dir: Path, tmp_path: Path) -> None:
    raw = load_state_dict(parity_dir / "hift.pt")
    bad = dict(raw)
    del bad["conv_post.bias"]
    bad["extra.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError) as info:
        load_hift(_copy_model_dir(parity_dir, tmp_path / "bad", bad))
    msg = str(info.value)
    assert "missing keys (1): conv_post.bias" in msg
    assert "unexpected keys (1): extra.weight" in msg
    unpaired = {k: v for k, v in raw.items() if not k.startswith("conv_pre.parametrizations.weight.original1")}
    with pytest.raises(CheckpointError, match="conv_pre"):
        load_hift(_copy_model_dir(parity_dir, tmp_path / "unpaired", unpaired))


def test_missing_yaml_key_is_reported() -> None:
    with pytest.raises(KeyError, match="hift.istft_params is missing"):
        HiFTDims.from_config({"in_channels": 80, "base_channels": 64, "nb_harmonics": 8})


def test_random_hift_from_yaml(parity_dir: Path) -> None:
    model = random_hift(parity_dir / "cosyvoice2.yaml", seed=3)
    mel = torch.randn(1, model.dims.in_channels, 12, generator=torch.Generator().manual_seed(0)) - 5.0
    with torch.no_grad():
        speech, _ = model(mel)
        f0 = model.predict_f0(mel)
    assert speech.shape == (1, 12 * model.dims.samples_per_frame)
    assert bool(torch.isfinite(speech).all())
    assert float(speech.abs().max()) < float(torch.tensor(model.dims.audio_limit))  # bounded, not clipping
    assert bool((f0 > model.dims.nsf_voiced_threshold).float().mean() > 0.5)


def test_other_dims_load_from_the_official_layout(parity_dir: Path, tmp_path: Path) -> None:
    """A model directory with different HiFT dims (4 stages, other kernels and channels) loads
    through the same code: every dim comes from the yaml, every weight-normed conv is stored as
    (g, v) with g != ||v||, as in an official hift.pt."""
    text = (parity_dir / "cosyvoice2.yaml").read_text(encoding="utf-8")
    kw = section(load_yaml(parity_dir), "hift")
    swaps = {
        f"base_channels: {kw['base_channels']}": "base_channels: 48",
        "upsample_rates: [8, 5, 3]": "upsample_rates: [4, 5, 3, 2]",
        "upsample_kernel_sizes: [16, 11, 7]": "upsample_kernel_sizes: [8, 11, 7, 4]",
        "source_resblock_kernel_sizes: [7, 7, 11]": "source_resblock_kernel_sizes: [7, 7, 11, 3]",
        "source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]": (
            "source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5], [1, 2]]"
        ),
        "resblock_kernel_sizes: [3, 7, 11]": "resblock_kernel_sizes: [3, 5]",
        "resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]": "resblock_dilation_sizes: [[1, 3], [1, 2]]",
    }
    for old, new in swaps.items():
        if old not in text:
            pytest.skip(f"parity yaml differs from tiny-a's hift section ({old!r} not found)")
        text = text.replace(old, new)
    model_dir = tmp_path / "other"
    model_dir.mkdir()
    (model_dir / "cosyvoice2.yaml").write_text(text, encoding="utf-8")
    ref = random_hift(model_dir, seed=5)
    assert ref.dims.upsample_rates == (4, 5, 3, 2) and len(ref.resblocks) == 8
    gen = torch.Generator().manual_seed(6)
    state: dict[str, torch.Tensor] = {}
    for name, t in ref.state_dict().items():
        module = ref.get_submodule(name.rsplit(".", 1)[0])
        normed = isinstance(module, torch.nn.Conv1d | torch.nn.ConvTranspose1d) and not name.startswith("source_downs")
        if normed and name.endswith(".weight"):
            prefix = name[: -len(".weight")]
            scale = torch.rand((t.shape[0],) + (1,) * (t.dim() - 1), generator=gen) + 0.5
            g = t.pow(2).sum(dim=tuple(range(1, t.dim())), keepdim=True).sqrt()
            state[f"{prefix}.parametrizations.weight.original0"] = g
            state[f"{prefix}.parametrizations.weight.original1"] = t * scale
        else:
            state[name] = t
    torch.save(state, model_dir / "hift.pt")
    loaded = load_hift(model_dir)
    mel = torch.randn(1, ref.dims.in_channels, 9, generator=gen) - 5.0
    with torch.no_grad():
        a, _ = ref(mel)
        b, _ = loaded(mel)
    assert a.shape == (1, 9 * 480)
    assert float((a - b).abs().max()) < 1e-5
