"""Parity of the audio frontend with the reference (cases g1 and the audio part of g4).

Every intermediate of case g1 is recomputed from the case's WAV file with our own decoder,
resampler, mel/fbank code and ONNX runners, and compared with the stored tensor. Nothing is
hard-coded about the case: sample rates, lengths and mel-bin counts come from the files, so a
parity directory with audio at another rate exercises the resampler from that rate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from voice_out.voices import features
from voice_out.voices.audio import decode_audio
from voice_out.voices.onnx import SpeakerEmbedder, SpeechTokenizer
from voice_out.voices.prompt import ExtractedPrompt, PromptExtractor, PromptFeatures, compute_features

TOL = 1e-4


def _load(path: Path) -> dict[str, Any]:
    if not path.is_file():
        pytest.skip(f"{path.name} is not in the parity directory")
    data: dict[str, Any] = torch.load(path, weights_only=True)
    return data


@pytest.fixture(scope="module")
def g1(cases_dir: Path) -> dict[str, Any]:
    return _load(cases_dir / "g1_frontend_audio.pt")


@pytest.fixture(scope="module")
def g4(cases_dir: Path) -> dict[str, Any]:
    return _load(cases_dir / "g4_zero_shot_model_input.pt")


@pytest.fixture(scope="module")
def decoded(g1: dict[str, Any], cases_dir: Path) -> Any:
    return decode_audio(cases_dir / str(g1["wav_file"]))


@pytest.fixture(scope="module")
def feats(decoded: Any, parity_dir: Path) -> PromptFeatures:
    n_mels = SpeechTokenizer(parity_dir / "speech_tokenizer_v2.onnx").n_mels
    return compute_features(decoded.samples, decoded.sample_rate, n_mels=n_mels)


@pytest.fixture(scope="module")
def prompt(decoded: Any, parity_dir: Path) -> ExtractedPrompt:
    return PromptExtractor(parity_dir).extract(decoded.samples, decoded.sample_rate)


def _max_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert tuple(ours.shape) == tuple(ref.shape), f"shape {tuple(ours.shape)} != reference {tuple(ref.shape)}"
    return float((ours.double() - ref.double()).abs().max()) if ours.numel() else 0.0


def _check(record_property: Any, key: str, ours: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    err = _max_err(ours, ref)
    record_property(f"max_abs_error[{key}]", err)
    print(f"{key}: max abs error {err:.3g}")
    assert err <= tol, f"{key}: max abs error {err:.3g} > {tol:g}"


def test_wav_read_rate_and_length(decoded: Any, g1: dict[str, Any]) -> None:
    assert decoded.sample_rate == int(g1["wav_sample_rate"])
    assert decoded.samples.dtype.name == "float32"
    n16 = int(g1["speech_16k"].shape[-1])
    # The reference resampler's output length is ceil(n * 16000 / sr).
    assert -(-len(decoded.samples) * 16000 // decoded.sample_rate) == n16


def test_speech_16k(feats: PromptFeatures, g1: dict[str, Any], record_property: Any) -> None:
    _check(record_property, "speech_16k", feats.speech_16k[None], g1["speech_16k"])


def test_speech_24k(feats: PromptFeatures, g1: dict[str, Any], decoded: Any, record_property: Any) -> None:
    if "speech_24k" in g1:
        _check(record_property, "speech_24k", feats.speech_24k[None], g1["speech_24k"])
    else:  # a 24 kHz file is used as read
        assert decoded.sample_rate == 24000
        assert torch.equal(feats.speech_24k, torch.from_numpy(decoded.samples))


def test_mel_filters(g1: dict[str, Any], record_property: Any) -> None:
    if "whisper_mel_filters_128" in g1:
        ref = g1["whisper_mel_filters_128"]
        ours = features.slaney_mel_filters(16000, 400, int(ref.shape[0]), 0.0, 8000.0)
        _check(record_property, "whisper_mel_filters_128", ours, ref, 1e-7)
    if "matcha_mel_basis_80" in g1:
        ref = g1["matcha_mel_basis_80"]
        ours = features.slaney_mel_filters(24000, 1920, 80, 0.0, 8000.0)
        _check(record_property, "matcha_mel_basis_80", ours, ref, 1e-7)


def test_whisper_logmel(feats: PromptFeatures, g1: dict[str, Any], record_property: Any) -> None:
    assert feats.whisper_log_mel.shape[1] == int(g1["whisper_logmel_len"])
    _check(record_property, "whisper_logmel", feats.whisper_log_mel[None], g1["whisper_logmel"])


def test_speech_token_raw_exact(feats: PromptFeatures, g1: dict[str, Any], parity_dir: Path) -> None:
    tokenizer = SpeechTokenizer(parity_dir / "speech_tokenizer_v2.onnx")
    ref = g1["speech_token_raw"].reshape(-1)
    # From the stored log-mel (the runner alone) and from ours (the whole chain).
    assert torch.equal(tokenizer(g1["whisper_logmel"][0]), ref)
    ours = tokenizer(feats.whisper_log_mel)
    assert ours.dtype == torch.int32
    assert torch.equal(ours, ref)


def test_fbank(feats: PromptFeatures, g1: dict[str, Any], decoded: Any, record_property: Any) -> None:
    raw = features.kaldi_fbank(feats.speech_16k)
    assert raw.shape[0] == 1 + (feats.speech_16k.shape[0] - 400) // 160
    _check(record_property, "fbank_mean", raw.mean(dim=0), g1["fbank_mean"])
    # Per element, a bin far below its frame's loudest carries float32 FFT noise: an error of
    # about eps * |X_max| in its amplitude, so about eps * sqrt(peak / energy) in its log (both
    # sides computed in float32; the FFT's rounding differs between CPUs). Loud bins are held
    # to TOL, quiet ones to TOL plus four times that noise.
    ours, ref = feats.fbank_cmn.double(), g1["fbank_cmn"].double()
    assert ours.shape == ref.shape
    energy = raw.double().exp()
    noise = torch.finfo(torch.float32).eps * (energy.amax(dim=1, keepdim=True) / energy).sqrt()
    err = (ours - ref).abs()
    record_property("max_abs_error[fbank_cmn]", float(err.max()))
    worst = float((err / (TOL + 4 * noise)).max())
    assert worst <= 1.0, f"fbank_cmn: error {worst:.2f} x its bound (max abs error {float(err.max()):.3g})"


def test_embedding(feats: PromptFeatures, g1: dict[str, Any], parity_dir: Path, record_property: Any) -> None:
    embedder = SpeakerEmbedder(parity_dir / "campplus.onnx")
    _check(record_property, "embedding(stored fbank)", embedder(g1["fbank_cmn"])[None], g1["embedding"])
    _check(record_property, "embedding", embedder(feats.fbank_cmn)[None], g1["embedding"])


def test_speech_feat(feats: PromptFeatures, g1: dict[str, Any], record_property: Any) -> None:
    assert feats.prompt_mel.shape[0] == int(g1["speech_feat_len"])
    _check(record_property, "speech_feat", feats.prompt_mel[None], g1["speech_feat"])


def test_alignment(prompt: ExtractedPrompt, g1: dict[str, Any], record_property: Any) -> None:
    k = int(g1["aligned_token_len"])
    assert features.aligned_token_count(int(g1["speech_feat_len"]), int(g1["speech_token_raw"].shape[-1])) == k
    assert prompt.n_tokens == k
    assert prompt.n_tokens_raw == int(g1["speech_token_raw"].shape[-1])
    assert prompt.n_mel_frames_raw == int(g1["speech_feat_len"])
    assert torch.equal(prompt.speech_tokens, g1["prompt_speech_token"].reshape(-1))
    assert prompt.prompt_mel.shape == (2 * k, g1["prompt_speech_feat"].shape[-1])
    _check(record_property, "prompt_speech_feat", prompt.prompt_mel[None], g1["prompt_speech_feat"])


def test_g4_prompt_inputs(prompt: ExtractedPrompt, g4: dict[str, Any], record_property: Any) -> None:
    for key in ("llm_prompt_speech_token", "flow_prompt_speech_token"):
        assert torch.equal(prompt.speech_tokens, g4[key].reshape(-1)), key
        assert int(g4[f"{key}_len"].reshape(-1)[0]) == prompt.n_tokens
    assert int(g4["prompt_speech_feat_len"].reshape(-1)[0]) == prompt.prompt_mel.shape[0]
    _check(record_property, "g4.prompt_speech_feat", prompt.prompt_mel[None], g4["prompt_speech_feat"])
    _check(record_property, "g4.llm_embedding", prompt.embedding[None], g4["llm_embedding"])
    _check(record_property, "g4.flow_embedding", prompt.embedding[None], g4["flow_embedding"])
    assert prompt.embedding.dtype == torch.float32
    assert prompt.prompt_mel.dtype == torch.float32
