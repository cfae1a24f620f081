"""The voice store, prompt-audio decoding and validation, and ``voice-out voices``.

Prompt networks come from the parity model directory (tiny ONNX stand-ins with the real
interfaces); test audio is synthesised here and encoded with PyAV's own encoders.
"""

from __future__ import annotations

import io
import json
import math
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
import torch

from voice_out.cli import main
from voice_out.engine.api import NoVoiceError, UnknownVoiceError
from voice_out.voices import store as store_mod
from voice_out.voices.audio import decode_audio, resample
from voice_out.voices.errors import (
    AudioError,
    IncompatibleVoiceError,
    InvalidVoiceNameError,
    PromptModelUnavailableError,
    VoiceError,
    VoiceExistsError,
    VoiceStoreCorruptError,
    VoiceStoreWriteError,
)
from voice_out.voices.prompt import PromptExtractor
from voice_out.voices.store import TOKEN_BLOCK, Voice, VoiceStore

SR = 24000


def tone(seconds: float, sample_rate: int = SR, amplitude: float = 0.3) -> np.ndarray:
    """A speech-like test signal: a 180 Hz harmonic tone with a 3 Hz syllable envelope."""
    t = np.arange(int(round(seconds * sample_rate))) / sample_rate
    voiced = sum(np.sin(2 * np.pi * 180 * k * t) / k for k in range(1, 6))
    envelope = 0.6 + 0.4 * np.sin(2 * np.pi * 3 * t)
    return (amplitude * 0.6 * voiced * envelope).astype(np.float32)


def encode(
    samples: np.ndarray,
    sample_rate: int,
    container: str,
    codec: str,
    *,
    sample_format: str = "flt",
    stream_rate: int | None = None,
) -> bytes:
    """Encode mono (or [C, n] multi-channel) float audio with PyAV."""
    data = samples if samples.ndim == 2 else samples[None]
    layout = "mono" if data.shape[0] == 1 else "stereo"
    if sample_format == "s16":
        frame_data: np.ndarray = np.round(np.clip(data, -1, 1) * 32767).astype(np.int16)
    else:
        frame_data = data.astype(np.float32)
    if data.shape[0] > 1:  # packed formats take interleaved [1, n*C]
        frame_data = frame_data.T.reshape(1, -1)
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=stream_rate or sample_rate)
        assert isinstance(stream, av.AudioStream)
        stream.layout = layout
        frame = av.AudioFrame.from_ndarray(frame_data, format=sample_format, layout=layout)
        frame.sample_rate = sample_rate
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


@pytest.fixture(scope="module")
def extractor(parity_dir: Path) -> PromptExtractor:
    return PromptExtractor(parity_dir)


@pytest.fixture(scope="module")
def prompt_wav(cases_dir: Path) -> Path:
    return cases_dir / "zero_shot_prompt.wav"


@pytest.fixture
def store(tmp_path: Path, extractor: PromptExtractor) -> VoiceStore:
    return VoiceStore(tmp_path / "voices", extractor)


def visible_entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# ---------------------------------------------------------------------------------------------
# decoding


def test_wav_s16_and_f32_decode_exactly() -> None:
    x = tone(1.0)
    d16 = decode_audio(encode(x, SR, "wav", "pcm_s16le", sample_format="s16"))
    expected16 = np.round(np.clip(x, -1, 1) * 32767).astype(np.int16).astype(np.float32) / 32768.0
    assert d16.sample_rate == SR and d16.samples.dtype == np.float32
    assert np.array_equal(d16.samples, expected16)
    d32 = decode_audio(encode(x, SR, "wav", "pcm_f32le"))
    assert np.array_equal(d32.samples, x)


def test_stereo_is_averaged() -> None:
    left, right = tone(1.0), tone(1.0, amplitude=0.1)[::-1].copy()
    decoded = decode_audio(encode(np.stack([left, right]), SR, "wav", "pcm_f32le"))
    assert decoded.channels == 2
    np.testing.assert_array_equal(decoded.samples, ((torch.tensor(left) + torch.tensor(right)) / 2).numpy())


def test_parity_wav_from_path_and_bytes_agree(prompt_wav: Path) -> None:
    a = decode_audio(prompt_wav)
    b = decode_audio(prompt_wav.read_bytes())
    assert a.sample_rate == b.sample_rate and np.array_equal(a.samples, b.samples)


@pytest.mark.parametrize(
    ("container", "codec", "stream_rate", "min_corr"),
    [
        ("flac", "flac", None, 0.9999),
        ("mp3", "libmp3lame", None, 0.98),
        ("ogg", "libopus", 48000, 0.95),
        ("ipod", "aac", None, 0.95),
    ],
)
def test_compressed_formats_decode(container: str, codec: str, stream_rate: int | None, min_corr: float) -> None:
    x = tone(2.0)
    sample_format = "s16" if codec == "flac" else "flt"
    decoded = decode_audio(encode(x, SR, container, codec, sample_format=sample_format, stream_rate=stream_rate))
    rate = stream_rate or SR
    assert decoded.sample_rate == rate
    y = torch.from_numpy(decoded.samples)
    if rate != SR:
        y = resample(y, rate, SR)
    # Codecs add priming delay: find the lag by FFT cross-correlation, then compare by correlation.
    ref = x.astype(np.float64)
    out = y.numpy().astype(np.float64)
    n_fft = 1 << (len(ref) + len(out)).bit_length()
    xcorr = np.fft.irfft(np.fft.rfft(out, n_fft) * np.conj(np.fft.rfft(ref, n_fft)), n_fft)
    lag = int(np.argmax(xcorr[:3000]))
    n = min(len(ref), len(out) - lag) - 1000
    a, b = ref[500 : 500 + n], out[lag + 500 : lag + 500 + n]
    best = float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-12))
    assert best >= min_corr, f"{codec}: correlation {best:.4f}"
    assert abs(decoded.duration_s - 2.0) < 0.1


# ---------------------------------------------------------------------------------------------
# resampling from any rate >= 16 kHz


@pytest.mark.parametrize(("src", "dst"), [(48000, 16000), (44100, 16000), (22050, 24000), (16000, 24000)])
def test_resample_reproduces_a_band_limited_sine(src: int, dst: int) -> None:
    freq = 1234.5
    n = src  # 1 s
    x = torch.sin(2 * math.pi * freq * torch.arange(n, dtype=torch.float64) / src).float()
    y = resample(x, src, dst)
    assert y.shape == (-(-n * dst // src),) and y.dtype == torch.float32
    expected = torch.sin(2 * math.pi * freq * torch.arange(y.shape[0], dtype=torch.float64) / dst).float()
    interior = slice(dst // 20, y.shape[0] - dst // 20)  # away from the zero-padded edges
    assert float((y[interior] - expected[interior]).abs().max()) < 2e-3


def test_resample_removes_content_above_the_new_nyquist() -> None:
    x = torch.sin(2 * math.pi * 11000 * torch.arange(48000) / 48000).float()
    y = resample(x, 48000, 16000)
    assert float(y[800:-800].abs().max()) < 1e-2


def test_resample_identity_and_batch() -> None:
    x = torch.randn(2, 1000)
    assert resample(x, 16000, 16000) is x
    both = resample(x, 48000, 16000)
    assert both.shape == (2, 334)
    torch.testing.assert_close(both[1], resample(x[1], 48000, 16000), atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------
# add / get / list / delete / restart


def test_add_get_list_delete(store: VoiceStore, prompt_wav: Path, extractor: PromptExtractor) -> None:
    voice = store.add("alice", prompt_wav, "  希望你以后能够做的比我还好呦。 ")
    assert voice.name == "alice" and voice.info.transcript == "希望你以后能够做的比我还好呦。"
    decoded = decode_audio(prompt_wav)
    raw = extractor.extract(decoded.samples, decoded.sample_rate)
    k = raw.n_tokens
    p = k - k % TOKEN_BLOCK
    assert voice.info.n_tokens_aligned == k and voice.info.n_flow_tokens == p and p % TOKEN_BLOCK == 0 and p > 0
    assert voice.llm_prompt_tokens.dtype == torch.int32 and torch.equal(voice.llm_prompt_tokens, raw.speech_tokens)
    # The cut drops tokens from the START: the prompt still ends where generation begins.
    assert torch.equal(voice.flow_prompt_tokens, raw.speech_tokens[k - p :])
    assert voice.prompt_mel.shape == (2 * p, 80) and voice.prompt_mel.dtype == torch.float32
    assert torch.equal(voice.prompt_mel, raw.prompt_mel[2 * (k - p) :])
    assert voice.embedding.shape == (192,) and torch.equal(voice.embedding, raw.embedding)
    assert voice.info.n_tokens_raw == raw.n_tokens_raw and voice.info.sample_rate == decoded.sample_rate
    assert voice.info.model_fingerprint == extractor.fingerprint
    assert abs(voice.info.duration_s - decoded.duration_s) < 1e-9

    infos = store.list()
    assert [i.name for i in infos] == ["alice"] and "alice" in store
    assert infos[0].to_json()["n_flow_tokens"] == p
    json.dumps(infos[0].to_json())

    store.delete("alice")
    assert store.list() == [] and "alice" not in store
    with pytest.raises(UnknownVoiceError) as e:
        store.get("alice")
    assert e.value.code == "unknown_voice" and "voice-out voices add" in str(e.value)
    with pytest.raises(UnknownVoiceError):
        store.delete("alice")
    assert visible_entries(store.directory) == []


def test_voices_survive_a_restart(tmp_path: Path, extractor: PromptExtractor, prompt_wav: Path) -> None:
    first = VoiceStore(tmp_path / "v", extractor)
    a = first.add("alice", prompt_wav, "one")
    b = first.add("bob.v2", prompt_wav.read_bytes(), "two")
    del first
    second = VoiceStore(tmp_path / "v", extractor)
    assert [i.name for i in second.list()] == ["alice", "bob.v2"]
    for before in (a, b):
        after = second.get(before.name)
        for field in ("llm_prompt_tokens", "flow_prompt_tokens", "prompt_mel", "embedding"):
            assert torch.equal(getattr(after, field), getattr(before, field)), field
        assert after.info == before.info
    # A store without prompt networks can still read and list voices.
    readonly = VoiceStore(tmp_path / "v", None)
    assert readonly.get("alice").info.transcript == "one"
    with pytest.raises(PromptModelUnavailableError):
        readonly.add("carol", prompt_wav, "three")


def test_cut_off_keeps_the_reference_prompt(tmp_path: Path, extractor: PromptExtractor, cases_dir: Path) -> None:
    g1 = torch.load(cases_dir / "g1_frontend_audio.pt", weights_only=True)
    s = VoiceStore(tmp_path / "v", extractor, cut_to_token_block=False)
    voice = s.add("ref", cases_dir / str(g1["wav_file"]), "text")
    assert voice.info.cut_to_token_block is False
    assert torch.equal(voice.flow_prompt_tokens, g1["prompt_speech_token"].reshape(-1))
    assert torch.equal(voice.llm_prompt_tokens, voice.flow_prompt_tokens)
    assert float((voice.prompt_mel - g1["prompt_speech_feat"][0]).abs().max()) <= 1e-4


def test_model_inputs_match_the_reference_zero_shot_input(
    tmp_path: Path, extractor: PromptExtractor, cases_dir: Path
) -> None:
    g4 = torch.load(cases_dir / "g4_zero_shot_model_input.pt", weights_only=True)
    voice = VoiceStore(tmp_path / "v", extractor, cut_to_token_block=False).add(
        "ref", cases_dir / "zero_shot_prompt.wav", str(g4["prompt_text_raw"])
    )
    inputs = voice.model_inputs()
    for key, ours in inputs.items():
        ref = g4[key]
        assert ours.dtype == ref.dtype and ours.shape == ref.shape, key
        if ref.dtype == torch.int32:
            assert torch.equal(ours, ref), key
        else:
            assert float((ours - ref).abs().max()) <= 1e-4, key
    # With the cut the flow inputs shrink to whole 25-token chunks; the LLM prompt is unchanged.
    cut = VoiceStore(tmp_path / "w", extractor).add("cut", cases_dir / "zero_shot_prompt.wav", "x").model_inputs()
    p = int(cut["flow_prompt_speech_token_len"][0])
    assert p % TOKEN_BLOCK == 0 and cut["prompt_speech_feat"].shape == (1, 2 * p, 80)
    assert torch.equal(cut["llm_prompt_speech_token"], g4["llm_prompt_speech_token"])


def test_replace_and_duplicate(store: VoiceStore, prompt_wav: Path) -> None:
    store.add("alice", prompt_wav, "first")
    with pytest.raises(VoiceExistsError) as e:
        store.add("alice", prompt_wav, "second")
    assert e.value.code == "voice_exists"
    assert store.get("alice").info.transcript == "first"
    replaced = store.add("alice", encode(tone(2.0), SR, "flac", "flac", sample_format="s16"), "second", replace=True)
    assert replaced.info.transcript == "second" and replaced.info.source_format.startswith("flac")
    assert store.get("alice").info.transcript == "second"
    assert visible_entries(store.directory) == ["alice"]


def test_mp3_upload_becomes_a_voice(store: VoiceStore) -> None:
    voice = store.add("mp3voice", encode(tone(3.0), SR, "mp3", "libmp3lame"), "hello there")
    assert voice.info.source_format.startswith("mp3")
    assert voice.info.n_flow_tokens % TOKEN_BLOCK == 0 and voice.info.n_flow_tokens >= TOKEN_BLOCK
    assert store.source_audio("mp3voice")[:3] in (b"ID3", b"\xff\xfb", b"\xff\xf3")


def test_other_process_changes_are_seen(tmp_path: Path, extractor: PromptExtractor, prompt_wav: Path) -> None:
    server = VoiceStore(tmp_path / "v", extractor)
    cli = VoiceStore(tmp_path / "v", extractor)
    cli.add("alice", prompt_wav, "one")
    assert server.get("alice").info.transcript == "one"
    cli.add("alice", prompt_wav, "two", replace=True)
    assert server.get("alice").info.transcript == "two"
    cli.delete("alice")
    with pytest.raises(UnknownVoiceError):
        server.get("alice")


def test_rebuild_from_stored_audio(store: VoiceStore, prompt_wav: Path) -> None:
    before = store.add("alice", prompt_wav, "words")
    after = store.rebuild("alice")
    assert after.info.transcript == "words"
    assert torch.equal(after.flow_prompt_tokens, before.flow_prompt_tokens)
    assert store.source_audio("alice") == prompt_wav.read_bytes()


def test_normalizer_hook(tmp_path: Path, extractor: PromptExtractor, prompt_wav: Path) -> None:
    s = VoiceStore(tmp_path / "v", extractor, normalizer=lambda text: text.upper() + ".")
    voice = s.add("n", prompt_wav, "hello world")
    assert voice.info.transcript == "hello world"
    assert voice.info.normalized_transcript == "HELLO WORLD."
    assert voice.prompt_text == "HELLO WORLD."
    plain = VoiceStore(tmp_path / "w", extractor).add("p", prompt_wav, "hello")
    assert plain.info.normalized_transcript is None and plain.prompt_text == "hello"


def test_resolve(store: VoiceStore, prompt_wav: Path) -> None:
    with pytest.raises(NoVoiceError) as e:
        store.resolve(None, None)
    assert e.value.code == "no_voice"
    assert 'voice-out voices add NAME AUDIO "TRANSCRIPT"' in str(e.value) and "POST /voices" in str(e.value)
    store.add("alice", prompt_wav, "x")
    store.add("bob", prompt_wav, "y")
    assert store.resolve(None, "alice").name == "alice"
    assert store.resolve("bob", "alice").name == "bob"
    with pytest.raises(UnknownVoiceError) as u:
        store.resolve("carol", "alice")
    assert "alice, bob" in str(u.value)
    with pytest.raises(UnknownVoiceError):
        store.resolve(None, "../etc")


# ---------------------------------------------------------------------------------------------
# atomicity


def test_crash_while_writing_leaves_nothing(
    store: VoiceStore, prompt_wav: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"n": 0}
    real_write = store_mod._write_file

    def dying_write(path: Path, data: bytes) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the tensors are written, the next file is not
            raise OSError(28, "No space left on device")
        real_write(path, data)

    monkeypatch.setattr(store_mod, "_write_file", dying_write)
    with pytest.raises(VoiceStoreWriteError) as e:
        store.add("alice", prompt_wav, "x")
    assert e.value.code == "voice_store_write_failed" and "No space left" in str(e.value)
    assert visible_entries(store.directory) == []
    assert store.list() == []
    with pytest.raises(UnknownVoiceError):
        store.get("alice")


def test_failed_replace_keeps_the_old_voice(
    store: VoiceStore, prompt_wav: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.add("alice", prompt_wav, "old")
    real_rename = os.rename

    def failing_rename(src: Any, dst: Any) -> None:
        if Path(src).name.startswith(".tmp-"):
            raise OSError(5, "I/O error")
        real_rename(src, dst)

    monkeypatch.setattr(store_mod.os, "rename", failing_rename)
    with pytest.raises(VoiceStoreWriteError) as e:
        store.add("alice", prompt_wav, "new", replace=True)
    assert e.value.code == "voice_store_write_failed"
    monkeypatch.undo()
    assert store.get("alice").info.transcript == "old"
    assert visible_entries(store.directory) == ["alice"]


def test_leftovers_of_a_hard_crash_are_cleaned(tmp_path: Path, extractor: PromptExtractor, prompt_wav: Path) -> None:
    root = tmp_path / "v"
    s = VoiceStore(root, extractor)
    s.add("alice", prompt_wav, "kept")
    s.add("bob", prompt_wav, "half-replaced")
    # A crash in the middle of a write, and one between the two renames of a replace.
    partial = root / ".tmp-carol-0123456789ab"
    partial.mkdir()
    (partial / "prompt.pt").write_bytes(b"partial")
    os.rename(root / "bob", root / ".trash-bob-0123456789ab-r")
    deleted = root / ".trash-alice-0123456789ab-d"
    deleted.mkdir()
    assert [i.name for i in s.list()] == ["alice"]  # in-flight entries are never listed
    reopened = VoiceStore(root, extractor)
    assert visible_entries(root) == ["alice", "bob"]
    assert reopened.get("bob").info.transcript == "half-replaced"
    with pytest.raises(UnknownVoiceError):
        reopened.get("carol")


def test_damaged_voice_is_reported_and_skipped(store: VoiceStore, prompt_wav: Path) -> None:
    store.add("alice", prompt_wav, "x")
    store.add("bob", prompt_wav, "y")
    (store.directory / "bob" / "prompt.pt").write_bytes(b"garbage")
    with pytest.raises(VoiceStoreCorruptError) as e:
        VoiceStore(store.directory, store.extractor).get("bob")
    assert e.value.code == "voice_corrupt"
    (store.directory / "alice" / "voice.json").write_text("{not json")
    assert store.list() == [i for i in store.list() if i.name == "bob"]


def test_voice_from_other_prompt_networks_is_detected(store: VoiceStore, prompt_wav: Path) -> None:
    store.add("alice", prompt_wav, "x")
    manifest_path = store.directory / "alice" / "voice.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["model_fingerprint"] = "0000000000000000"
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(IncompatibleVoiceError) as e:
        store.get("alice")
    assert e.value.code == "voice_incompatible"
    info = store.list()[0]
    assert store.is_compatible(info) is False
    assert VoiceStore(store.directory, None).get("alice").info.model_fingerprint == "0000000000000000"


# ---------------------------------------------------------------------------------------------
# engine state slots


def test_engine_state_slots(store: VoiceStore, prompt_wav: Path) -> None:
    store.add("alice", prompt_wav, "x")
    assert store.get_engine_state("alice", "flow_prompt") is None
    state = {"cache": torch.arange(12, dtype=torch.float32).reshape(3, 4), "len": torch.tensor([3])}
    store.put_engine_state("alice", "flow_prompt", state, tag="flow-v1")
    assert store.get("alice").info.engine_state_keys == ("flow_prompt",)
    got = store.get_engine_state("alice", "flow_prompt", tag="flow-v1")
    assert got is not None and torch.equal(got["cache"], state["cache"]) and torch.equal(got["len"], state["len"])
    assert store.get_engine_state("alice", "flow_prompt", tag="flow-v2") is None
    assert VoiceStore(store.directory, None).get_engine_state("alice", "flow_prompt") is not None
    with pytest.raises(InvalidVoiceNameError):
        store.put_engine_state("alice", "../x", state)
    with pytest.raises(UnknownVoiceError):
        store.put_engine_state("nobody", "flow_prompt", state)
    store.delete_engine_state("alice", "flow_prompt")
    assert store.get_engine_state("alice", "flow_prompt") is None
    assert store.get("alice").info.engine_state_keys == ()


# ---------------------------------------------------------------------------------------------
# validation: every bad input has its own code and writes nothing


@pytest.mark.parametrize(
    "name", ["", ".hidden", "..", "../x", "a/b", "a\\b", "a b", "x" * 65, "-lead", "é", "a\x00b", "_x"]
)
def test_bad_names(store: VoiceStore, prompt_wav: Path, name: str) -> None:
    with pytest.raises(InvalidVoiceNameError) as e:
        store.add(name, prompt_wav, "x")
    assert e.value.code == "invalid_voice_name"
    assert visible_entries(store.directory) == []


@pytest.mark.parametrize("name", ["a", "A1", "alice_2.v-3", "9" * 64])
def test_good_names(name: str) -> None:
    assert store_mod.validate_name(name) == name


def _riff_garbage() -> bytes:
    return b"RIFF\x24\x08\x00\x00WAVEfmt \x10\x00\x00\x00" + os.urandom(64)


def _wav_header_only() -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="wav") as out:
        stream = out.add_stream("pcm_s16le", rate=SR)
        stream.layout = "mono"
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


BAD_AUDIO: dict[str, tuple[Callable[[], bytes], str]] = {
    "empty": (lambda: b"", "audio_empty"),
    "no samples": (_wav_header_only, "audio_empty"),
    "not audio": (lambda: b"this is a text file, not audio at all\n" * 20, "audio_unsupported"),
    "corrupt wav": (_riff_garbage, "audio_corrupt"),
    "too short": (lambda: encode(tone(0.5), SR, "wav", "pcm_s16le", sample_format="s16"), "audio_too_short"),
    "too long": (lambda: encode(tone(31.0), 16000, "flac", "flac", sample_format="s16"), "audio_too_long"),
    "silent": (lambda: encode(np.zeros(2 * SR, np.float32), SR, "wav", "pcm_f32le"), "audio_silent"),
    "near silent": (lambda: encode(tone(2.0, amplitude=1e-4), SR, "wav", "pcm_f32le"), "audio_silent"),
    "nan samples": (
        lambda: encode(
            np.where(np.arange(2 * SR) == 100, np.nan, tone(2.0)).astype(np.float32), SR, "wav", "pcm_f32le"
        ),
        "audio_corrupt",
    ),
    "8 kHz": (
        lambda: encode(tone(2.0, 8000), 8000, "wav", "pcm_s16le", sample_format="s16"),
        "audio_sample_rate_too_low",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_AUDIO))
def test_bad_audio(store: VoiceStore, case: str) -> None:
    make, code = BAD_AUDIO[case]
    with pytest.raises(AudioError) as e:
        store.add("alice", make(), "some words")
    assert e.value.code == code, str(e.value)
    assert str(e.value).count("\n") == 0
    assert visible_entries(store.directory) == []


def test_missing_file(store: VoiceStore, tmp_path: Path) -> None:
    with pytest.raises(AudioError) as e:
        store.add("alice", tmp_path / "nope.wav", "x")
    assert e.value.code == "audio_unsupported"


@pytest.mark.parametrize(
    ("transcript", "code"),
    [("", "transcript_empty"), ("  \n", "transcript_empty"), ("a" * 1001, "transcript_too_long")],
)
def test_bad_transcripts(store: VoiceStore, prompt_wav: Path, transcript: str, code: str) -> None:
    with pytest.raises(VoiceError) as e:
        store.add("alice", prompt_wav, transcript)
    assert e.value.code == code
    assert visible_entries(store.directory) == []


def test_minimum_duration_holds_one_token_block(store: VoiceStore) -> None:
    voice = store.add("short", encode(tone(1.1), SR, "wav", "pcm_f32le"), "hi")
    assert voice.info.n_flow_tokens == TOKEN_BLOCK


def test_concurrent_readers_share_one_cached_voice(store: VoiceStore, prompt_wav: Path) -> None:
    store.add("alice", prompt_wav, "x")
    seen: list[Voice] = []
    lock = threading.Lock()

    def reader() -> None:
        for _ in range(20):
            v = store.get("alice")
            with lock:
                seen.append(v)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 80 and len({id(v) for v in seen}) == 1


# ---------------------------------------------------------------------------------------------
# CLI


def test_cli_add_list_rm(
    tmp_path: Path, parity_dir: Path, prompt_wav: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["voices", "--voices-dir", str(tmp_path / "v"), "--model", str(parity_dir)]
    assert main([*base, "list"]) == 0
    assert "no voices" in capsys.readouterr().out
    assert main([*base, "add", "alice", str(prompt_wav), "希望你以后能够做的比我还好呦。"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("added voice 'alice'") and "87 prompt tokens" in out
    assert main([*base, "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "SECONDS", "TOKENS", "CREATED", "TRANSCRIPT"]
    assert lines[1].split()[0] == "alice" and lines[1].split()[2] == "75"
    assert main([*base, "add", "alice", str(prompt_wav), "again"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("voice-out: error: a voice named 'alice' already exists") and err.count("\n") == 1
    assert main([*base, "rm", "alice"]) == 0
    assert "removed voice 'alice'" in capsys.readouterr().out
    assert main([*base, "rm", "alice"]) == 2
    assert "unknown voice 'alice'" in capsys.readouterr().err


def test_cli_options_after_the_action(
    tmp_path: Path, parity_dir: Path, prompt_wav: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``voices add NAME AUDIO TEXT --voices-dir DIR --model M`` as a user types it (the
    options were only accepted before the action); a ``--set`` before and one after both count."""
    where = ["--voices-dir", str(tmp_path / "v")]
    add = ["voices", "add", "alice", str(prompt_wav), "希望你以后能够做的比我还好呦。"]
    assert main([*add, *where, "--model", str(parity_dir)]) == 0
    assert capsys.readouterr().out.startswith("added voice 'alice'")
    assert (tmp_path / "v" / "alice").is_dir()
    assert main(["voices", "list", *where]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[0] == "alice"
    # before the action and after it: the one after wins, the one before is kept when alone
    assert main(["voices", "--voices-dir", str(tmp_path / "w"), "list", *where]) == 0
    assert "alice" in capsys.readouterr().out
    from voice_out.cli import build_parser, load_cli_config

    args = build_parser().parse_args(["voices", "--set", "model.offline=true", "list", "--set", "model.revision=x"])
    cfg = load_cli_config(args)
    assert cfg.model.offline is True and cfg.model.revision == "x"
    assert main(["voices", *where, "rm", "alice", "--model", "random:tiny"]) == 0
    assert not (tmp_path / "v" / "alice").exists()


def test_cli_add_help_lists_the_options_and_the_real_limits(capsys: pytest.CaptureFixture[str]) -> None:
    from voice_out.cli import PROMPT_SECONDS, TRANSCRIPT_CHARS
    from voice_out.voices.onnx import MAX_PROMPT_S
    from voice_out.voices.prompt import MIN_PROMPT_S
    from voice_out.voices.store import MAX_TRANSCRIPT_CHARS

    with pytest.raises(SystemExit):
        main(["voices", "add", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--model", "--voices-dir", "--config", "--set"):
        assert option in text
    assert PROMPT_SECONDS == f"{MIN_PROMPT_S:g} to {MAX_PROMPT_S:g}" and f"{PROMPT_SECONDS} s" in text
    assert TRANSCRIPT_CHARS == MAX_TRANSCRIPT_CHARS and f"at most {TRANSCRIPT_CHARS} characters" in text


def test_cli_errors_are_one_line(tmp_path: Path, prompt_wav: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["voices", "--voices-dir", str(tmp_path / "v")]
    assert main([*base, "--model", "random:tiny", "add", "bob", str(prompt_wav), "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no prompt networks" in err
    # Cheap checks come before the model is resolved (no download for a typo).
    assert main([*base, "add", "bad/name", str(prompt_wav), "x"]) == 2
    assert "invalid voice name" in capsys.readouterr().err
    assert main([*base, "add", "bob", str(tmp_path / "missing.wav"), "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"")
    assert main([*base, "--model", "random:tiny", "add", "bob", str(bad), "x"]) == 2
    assert visible_entries(tmp_path / "v") == []


# ---------------------------------------------------------------------------------------------
# ONNX runners read their interface from the model


class _Arg:
    def __init__(self, name: str, type_: str, shape: list[Any]) -> None:
        self.name, self.type, self.shape = name, type_, shape


class _FakeSession:
    """Stands in for an onnxruntime session with other names and integer types."""

    def __init__(self, inputs: list[_Arg], outputs: list[_Arg], result: np.ndarray) -> None:
        self._inputs, self._outputs, self.result = inputs, outputs, result
        self.fed: dict[str, np.ndarray] = {}

    def get_inputs(self) -> list[_Arg]:
        return self._inputs

    def get_outputs(self) -> list[_Arg]:
        return self._outputs

    def run(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        assert names == [self._outputs[0].name]
        self.fed = feeds
        return [self.result]


def test_speech_tokenizer_reads_names_and_types(monkeypatch: pytest.MonkeyPatch) -> None:
    from voice_out.voices import onnx as onnx_mod

    fake = _FakeSession(
        [_Arg("mel_len", "tensor(int64)", [1]), _Arg("mel", "tensor(float)", [1, 64, "T"])],
        [_Arg("codes", "tensor(int64)", [1, 1, "T2"])],
        np.arange(7, dtype=np.int64).reshape(1, 1, 7),
    )
    monkeypatch.setattr(onnx_mod, "open_session", lambda *a, **k: fake)
    tokenizer = onnx_mod.SpeechTokenizer("unused.onnx")
    assert (tokenizer.feats_name, tokenizer.length_name, tokenizer.n_mels) == ("mel", "mel_len", 64)
    tokens = tokenizer(torch.zeros(64, 25))
    assert tokens.dtype == torch.int32 and tokens.tolist() == list(range(7))
    assert fake.fed["mel"].shape == (1, 64, 25) and fake.fed["mel"].dtype == np.float32
    assert fake.fed["mel_len"].dtype == np.int64 and fake.fed["mel_len"].tolist() == [25]
    with pytest.raises(AudioError) as e:
        tokenizer(torch.zeros(64, 3001))
    assert e.value.code == "audio_too_long"


def test_speaker_embedder_reads_names(monkeypatch: pytest.MonkeyPatch) -> None:
    from voice_out.voices import onnx as onnx_mod

    fake = _FakeSession(
        [_Arg("fbank", "tensor(float)", ["B", "T", 80])],
        [_Arg("xvec", "tensor(float)", ["B", 256])],
        np.ones((1, 256), np.float32),
    )
    monkeypatch.setattr(onnx_mod, "open_session", lambda *a, **k: fake)
    embedder = onnx_mod.SpeakerEmbedder("unused.onnx")
    assert (embedder.input_name, embedder.n_mels, embedder.dim) == ("fbank", 80, 256)
    out = embedder(torch.zeros(10, 80))
    assert out.shape == (256,) and out.dtype == torch.float32
    assert fake.fed["fbank"].shape == (1, 10, 80)


def test_cuda_provider_first_when_available(monkeypatch: pytest.MonkeyPatch) -> None:
    import onnxruntime as ort

    from voice_out.voices import onnx as onnx_mod

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert onnx_mod.providers() == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert onnx_mod.providers() == ["CPUExecutionProvider"]


def test_missing_prompt_network(tmp_path: Path) -> None:
    from voice_out.voices.onnx import PromptModelError, SpeechTokenizer

    with pytest.raises(PromptModelError) as e:
        SpeechTokenizer(tmp_path / "speech_tokenizer_v2.onnx")
    assert "missing" in str(e.value)
    with pytest.raises(PromptModelError) as e:
        VoiceStore(tmp_path / "v", tmp_path)
    assert e.value.code == "prompt_model_invalid" and "speech_tokenizer_v2.onnx" in str(e.value)


def test_wav_24bit_scaling() -> None:
    ints = np.array([0, 1, -1, 2**23 - 1, -(2**23), 12345, -54321] * 100, dtype=np.int32)
    buf = io.BytesIO()
    with av.open(buf, "w", format="wav") as out:
        stream = out.add_stream("pcm_s24le", rate=SR)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray((ints << 8)[None], format="s32", layout="mono")
        frame.sample_rate = SR
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    decoded = decode_audio(buf.getvalue())
    np.testing.assert_array_equal(decoded.samples, (ints.astype(np.float64) / 2**23).astype(np.float32))


def test_long_upload_stops_decoding_early(store: VoiceStore) -> None:
    data = encode(tone(45.0, 16000), 16000, "flac", "flac", sample_format="s16")
    decoded = decode_audio(data, max_duration_s=30.0)
    assert decoded.truncated and decoded.duration_s < 32.0
    with pytest.raises(AudioError) as e:
        store.add("long", data, "words")
    assert e.value.code == "audio_too_long" and "longer than" in str(e.value)
