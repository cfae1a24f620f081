"""Zero-shot prompt extraction: prompt audio -> speech tokens, x-vector and prompt mel.

The path of one prompt (all tensors float32 unless stated)::

    audio [n] @ sr (>= 16 kHz)
      ├─ resample 16 kHz ─► Whisper log-mel [128, F] ─► speech_tokenizer_v2.onnx ─► tokens [T'] int32
      ├─ resample 16 kHz ─► Kaldi fbank [F2, 80] − mean ─► campplus.onnx ─► x-vector [192]
      └─ resample 24 kHz ─► prompt mel [M, 80]
    K = min(M // 2, T'): tokens[:K], mel[:2K]

:class:`PromptExtractor` loads the two ONNX files once; it may be called from one thread at a
time (the voice store serialises calls with its lock).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from voice_out.voices import features
from voice_out.voices.audio import MEL_SAMPLE_RATE, TOKENIZER_SAMPLE_RATE, check_sample_rate, resample
from voice_out.voices.errors import (
    AudioTooLongError,
    AudioTooShortError,
    CorruptAudioError,
    PromptModelError,
    SilentAudioError,
)
from voice_out.voices.onnx import (
    MAX_PROMPT_S,
    SPEAKER_EMBEDDER_FILE,
    SPEECH_TOKENIZER_FILE,
    SpeakerEmbedder,
    SpeechTokenizer,
)

#: Shortest prompt accepted: below 1 s there is not one 25-token streaming block of speech.
MIN_PROMPT_S = 1.0
#: Silence: an RMS level below -60 dBFS.
SILENCE_RMS = 1e-3


@dataclass(frozen=True)
class PromptFeatures:
    """Every intermediate of the audio frontend, for parity tests and debugging."""

    speech_16k: torch.Tensor  # [N16] float32
    whisper_log_mel: torch.Tensor  # [n_mels, N16 // 160] float32
    fbank_cmn: torch.Tensor  # [1 + (N16 - 400) // 160, 80] float32
    speech_24k: torch.Tensor  # [N24] float32
    prompt_mel: torch.Tensor  # [N24 // 480, 80] float32


@dataclass(frozen=True)
class ExtractedPrompt:
    """What the model needs from a prompt: the aligned tokens, the x-vector and the mel.

    ``speech_tokens`` int32 [K]; ``embedding`` float32 [D] (192 for CAM++, not normalised);
    ``prompt_mel`` float32 [2K, 80] (50 frames/s, natural-log mel). ``n_tokens_raw`` and
    ``n_mel_frames_raw`` are the lengths before the alignment cut.
    """

    speech_tokens: torch.Tensor
    embedding: torch.Tensor
    prompt_mel: torch.Tensor
    n_tokens_raw: int
    n_mel_frames_raw: int
    sample_rate: int
    duration_s: float

    @property
    def n_tokens(self) -> int:
        return int(self.speech_tokens.shape[0])


def check_prompt_audio(
    samples: np.ndarray | torch.Tensor,
    sample_rate: int,
    *,
    min_duration_s: float = MIN_PROMPT_S,
    max_duration_s: float = MAX_PROMPT_S,
    silence_rms: float = SILENCE_RMS,
) -> None:
    """Raise the precise :class:`~voice_out.voices.errors.AudioError` for an unusable prompt."""
    check_sample_rate(sample_rate)
    wave = torch.as_tensor(samples, dtype=torch.float32).reshape(-1)
    duration = wave.shape[0] / sample_rate
    if duration > max_duration_s:
        raise AudioTooLongError(f"the prompt is {duration:.1f} s long; at most {max_duration_s:g} s is accepted")
    if duration < min_duration_s:
        raise AudioTooShortError(f"the prompt is {duration:.2f} s long; at least {min_duration_s:g} s is needed")
    if not bool(torch.isfinite(wave).all()):
        raise CorruptAudioError("the prompt contains NaN or infinite samples")
    rms = float(wave.double().pow(2).mean().sqrt())
    if rms < silence_rms:
        raise SilentAudioError(
            f"the prompt is silent or nearly so (RMS {20 * np.log10(max(rms, 1e-12)):.0f} dBFS; "
            f"needs at least {20 * np.log10(silence_rms):.0f} dBFS)"
        )


def compute_features(
    samples: np.ndarray | torch.Tensor,
    sample_rate: int,
    *,
    n_mels: int = features.WHISPER_N_MELS,
    n_fbank: int = features.FBANK_N_MELS,
) -> PromptFeatures:
    """All frontend features of mono float32 audio at ``sample_rate`` (>= 16 kHz).

    ``n_mels`` / ``n_fbank``: bins of the Whisper log-mel and of the fbank (read them from the
    ONNX networks' inputs).
    """
    check_sample_rate(sample_rate)
    wave = torch.as_tensor(samples, dtype=torch.float32).reshape(-1)
    speech_16k = resample(wave, sample_rate, TOKENIZER_SAMPLE_RATE)
    speech_24k = resample(wave, sample_rate, MEL_SAMPLE_RATE)
    return PromptFeatures(
        speech_16k=speech_16k,
        whisper_log_mel=features.whisper_log_mel(speech_16k, n_mels),
        fbank_cmn=features.mean_normalize(features.kaldi_fbank(speech_16k, n_fbank)),
        speech_24k=speech_24k,
        prompt_mel=features.prompt_mel(speech_24k),
    )


_FINGERPRINTS: dict[tuple[str, int, int], str] = {}
_FINGERPRINT_LOCK = threading.Lock()


def _file_digest(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    with _FINGERPRINT_LOCK:
        if key in _FINGERPRINTS:
            return _FINGERPRINTS[key]
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    digest = h.hexdigest()
    with _FINGERPRINT_LOCK:
        _FINGERPRINTS[key] = digest
    return digest


def model_fingerprint(model_dir: str | Path) -> str:
    """A short hash of the two prompt networks: voices made with other files are detected.

    Hashes the whole files once per (path, size, mtime) per process (about 1 s for the real
    500 MB tokenizer).
    """
    d = Path(model_dir)
    h = hashlib.sha256()
    for name in (SPEECH_TOKENIZER_FILE, SPEAKER_EMBEDDER_FILE):
        if not (d / name).is_file():
            raise PromptModelError(f"prompt network {str(d / name)!r} is missing from the model directory")
        h.update(name.encode())
        h.update(_file_digest(d / name).encode())
    return h.hexdigest()[:16]


class PromptExtractor:
    """Turns prompt audio into a :class:`ExtractedPrompt` with a model directory's ONNX networks.

    The sessions are opened lazily on the first :meth:`extract`. Calls are serialised by an
    internal lock, so any thread may call; the voice store calls from its executor thread.
    """

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self._lock = threading.Lock()
        self._tokenizer: SpeechTokenizer | None = None
        self._embedder: SpeakerEmbedder | None = None
        self._fingerprint: str | None = None

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model_dir)
        return self._fingerprint

    def load(self) -> None:
        """Open both ONNX sessions now (a server does this at start-up, off the event loop)."""
        with self._lock:
            self._networks()

    def _networks(self) -> tuple[SpeechTokenizer, SpeakerEmbedder]:
        if self._tokenizer is None or self._embedder is None:
            self._tokenizer = SpeechTokenizer(self.model_dir / SPEECH_TOKENIZER_FILE)
            self._embedder = SpeakerEmbedder(self.model_dir / SPEAKER_EMBEDDER_FILE)
        return self._tokenizer, self._embedder

    def extract(self, samples: np.ndarray | torch.Tensor, sample_rate: int) -> ExtractedPrompt:
        """Tokens, x-vector and aligned mel of mono float32 audio (sr >= 16 kHz, at most 30 s)."""
        wave = torch.as_tensor(samples, dtype=torch.float32).reshape(-1)
        duration = wave.shape[0] / sample_rate if sample_rate > 0 else 0.0
        check_sample_rate(sample_rate)
        if duration > MAX_PROMPT_S:
            raise AudioTooLongError(f"the prompt is {duration:.1f} s long; at most {MAX_PROMPT_S:g} s is accepted")
        with self._lock:
            tokenizer, embedder = self._networks()
            feats = compute_features(wave, sample_rate, n_mels=tokenizer.n_mels, n_fbank=embedder.n_mels)
            tokens = tokenizer(feats.whisper_log_mel)
            embedding = embedder(feats.fbank_cmn)
        n_mel = int(feats.prompt_mel.shape[0])
        k = features.aligned_token_count(n_mel, int(tokens.shape[0]))
        return ExtractedPrompt(
            speech_tokens=tokens[:k].clone(),
            embedding=embedding,
            prompt_mel=feats.prompt_mel[: features.MEL_FRAMES_PER_TOKEN * k].clone(),
            n_tokens_raw=int(tokens.shape[0]),
            n_mel_frames_raw=n_mel,
            sample_rate=int(sample_rate),
            duration_s=float(duration),
        )


def extract_prompt(samples: np.ndarray | torch.Tensor, sample_rate: int, model_dir: str | Path) -> ExtractedPrompt:
    """One-shot :meth:`PromptExtractor.extract` (opens the ONNX sessions each call)."""
    return PromptExtractor(model_dir).extract(samples, sample_rate)
