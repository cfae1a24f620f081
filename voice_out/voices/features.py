"""Prompt features: Whisper log-mel (speech tokenizer), Kaldi fbank (speaker embedding),
the 24 kHz prompt mel (flow conditioning), and the token/mel alignment.

Every function takes float32 mono audio ``[n]`` in [-1, 1] at the stated rate and returns
float32 tensors. Mel filter banks are computed here (Slaney scale and area normalisation for
Whisper and the prompt mel; Kaldi's 1127·ln(1 + f/700) scale for the fbank) and cached.

Pure torch on the CPU; any thread may call these functions.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

# Whisper log-mel (speech tokenizer input), 16 kHz.
WHISPER_N_FFT = 400
WHISPER_HOP = 160
WHISPER_N_MELS = 128
WHISPER_SAMPLE_RATE = 16000

# Kaldi fbank (speaker-embedding input), 16 kHz.
FBANK_SAMPLE_RATE = 16000
FBANK_FRAME_LENGTH = 400  # 25 ms
FBANK_FRAME_SHIFT = 160  # 10 ms
FBANK_N_FFT = 512  # frame length rounded up to a power of two
FBANK_N_MELS = 80
FBANK_LOW_FREQ = 20.0
FBANK_PREEMPH = 0.97
FBANK_POVEY_POWER = 0.85

# Prompt mel (flow conditioning), 24 kHz, 50 frames/s.
MEL_SAMPLE_RATE = 24000
MEL_N_FFT = 1920
MEL_HOP = 480
MEL_N_MELS = 80
MEL_FMIN = 0.0
MEL_FMAX = 8000.0

#: Mel frames per speech token (50 Hz mel, 25 Hz tokens).
MEL_FRAMES_PER_TOKEN = 2


# ---------------------------------------------------------------------------------------------
# Slaney mel filters


def _hz_to_slaney_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's scale: linear (3 mels per 200 Hz) below 1 kHz, logarithmic above."""
    f_sp = 200.0 / 3.0
    mel = hz / f_sp
    log_from_hz, log_from_mel, log_step = 1000.0, 1000.0 / f_sp, math.log(6.4) / 27.0
    above = hz >= log_from_hz
    mel = np.where(above, log_from_mel + np.log(np.maximum(hz, 1e-10) / log_from_hz) / log_step, mel)
    return mel


def _slaney_mel_to_hz(mel: np.ndarray) -> np.ndarray:
    f_sp = 200.0 / 3.0
    hz = mel * f_sp
    log_from_hz, log_from_mel, log_step = 1000.0, 1000.0 / f_sp, math.log(6.4) / 27.0
    return np.where(mel >= log_from_mel, log_from_hz * np.exp(log_step * (mel - log_from_mel)), hz)


@functools.lru_cache(maxsize=8)
def slaney_mel_filters(sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> torch.Tensor:
    """Triangular filters on the Slaney mel scale, each scaled to unit area: [n_mels, n_fft//2 + 1].

    Computed in float64 and stored as float32, like the reference filter banks.
    """
    bin_hz = np.linspace(0.0, sample_rate / 2.0, n_fft // 2 + 1)
    lo, hi = _hz_to_slaney_mel(np.array([fmin, fmax], dtype=np.float64))
    edges_hz = _slaney_mel_to_hz(np.linspace(lo, hi, n_mels + 2))  # [n_mels + 2]
    widths = np.diff(edges_hz)  # [n_mels + 1]
    dist = edges_hz[:, None] - bin_hz[None, :]  # [n_mels + 2, n_bins]
    rising = -dist[:-2] / widths[:-1, None]
    falling = dist[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling)).astype(np.float32)
    # Area normalisation: 2 / (bandwidth in Hz); the multiply rounds to float32 once more.
    area = 2.0 / (edges_hz[2:] - edges_hz[:-2])
    weights = (weights * area[:, None]).astype(np.float32)
    return torch.from_numpy(weights)


# ---------------------------------------------------------------------------------------------
# Whisper log-mel


@functools.lru_cache(maxsize=4)
def _periodic_hann(n: int) -> torch.Tensor:
    return torch.hann_window(n, periodic=True, dtype=torch.float32)


def whisper_log_mel(audio_16k: torch.Tensor, n_mels: int = WHISPER_N_MELS) -> torch.Tensor:
    """Whisper log-mel of 16 kHz audio ``[n]`` -> ``[n_mels, n // 160]`` float32.

    Centered STFT (reflect pad 200), power spectrum without the last frame, Slaney mels,
    log10 floored at 1e-10 and at (utterance max - 8), then (x + 4) / 4.
    """
    spec = torch.stft(
        audio_16k.to(torch.float32),
        WHISPER_N_FFT,
        WHISPER_HOP,
        window=_periodic_hann(WHISPER_N_FFT),
        center=True,
        pad_mode="reflect",
        return_complex=True,
    )  # [201, n//160 + 1]
    power = spec[:, :-1].abs() ** 2
    filters = slaney_mel_filters(WHISPER_SAMPLE_RATE, WHISPER_N_FFT, n_mels, 0.0, WHISPER_SAMPLE_RATE / 2.0)
    log_spec = torch.clamp(filters @ power, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


# ---------------------------------------------------------------------------------------------
# Kaldi fbank


def _kaldi_mel(hz: torch.Tensor | float) -> torch.Tensor | float:
    if isinstance(hz, torch.Tensor):
        return 1127.0 * (1.0 + hz / 700.0).log()
    return 1127.0 * math.log(1.0 + hz / 700.0)


@functools.lru_cache(maxsize=4)
def kaldi_mel_banks(n_mels: int, n_fft: int, sample_rate: int, low_freq: float) -> torch.Tensor:
    """Kaldi triangular filters (mel = 1127 ln(1 + f/700)), low_freq..Nyquist: [n_mels, n_fft//2 + 1].

    Triangles are linear in mel, not in Hz, and unnormalised. The Nyquist bin gets weight 0.
    Computed in float32, like Kaldi-compatible implementations.
    """
    n_bins = n_fft // 2
    nyquist = sample_rate / 2.0
    mel_lo = float(_kaldi_mel(low_freq))
    mel_hi = float(_kaldi_mel(nyquist))
    step = (mel_hi - mel_lo) / (n_mels + 1)
    index = torch.arange(n_mels).unsqueeze(1)
    left = mel_lo + index * step
    center = mel_lo + (index + 1.0) * step
    right = mel_lo + (index + 2.0) * step
    bin_mel = _kaldi_mel((sample_rate / n_fft) * torch.arange(n_bins))
    assert isinstance(bin_mel, torch.Tensor)
    bin_mel = bin_mel.unsqueeze(0)  # [1, n_bins]
    up = (bin_mel - left) / (center - left)
    down = (right - bin_mel) / (right - center)
    banks = torch.clamp(torch.minimum(up, down), min=0.0)  # [n_mels, n_bins]
    return torch.nn.functional.pad(banks, (0, 1))


@functools.lru_cache(maxsize=4)
def _povey_window(n: int) -> torch.Tensor:
    return torch.hann_window(n, periodic=False, dtype=torch.float32).pow(FBANK_POVEY_POWER)


def kaldi_fbank(audio_16k: torch.Tensor, n_mels: int = FBANK_N_MELS) -> torch.Tensor:
    """Kaldi-compatible log mel filter bank of 16 kHz audio ``[n]`` -> ``[F, n_mels]`` float32.

    Frames of 400 samples every 160, only whole frames (F = 1 + (n - 400) // 160), no dither;
    per frame: remove the DC offset, pre-emphasis 0.97 (first sample against itself), Povey
    window, zero-pad to 512, power spectrum, mel banks, ln with a float32-epsilon floor.
    """
    wave = audio_16k.to(torch.float32)
    n = wave.shape[-1]
    if n < FBANK_FRAME_LENGTH:
        return torch.empty(0, n_mels)
    n_frames = 1 + (n - FBANK_FRAME_LENGTH) // FBANK_FRAME_SHIFT
    frames = wave.as_strided((n_frames, FBANK_FRAME_LENGTH), (FBANK_FRAME_SHIFT, 1))  # [F, 400]
    frames = frames - frames.mean(dim=1, keepdim=True)
    previous = torch.cat([frames[:, :1], frames[:, :-1]], dim=1)
    frames = frames - FBANK_PREEMPH * previous
    frames = frames * _povey_window(FBANK_FRAME_LENGTH)
    frames = torch.nn.functional.pad(frames, (0, FBANK_N_FFT - FBANK_FRAME_LENGTH))
    power = torch.fft.rfft(frames).abs().pow(2.0)  # [F, 257]
    banks = kaldi_mel_banks(n_mels, FBANK_N_FFT, FBANK_SAMPLE_RATE, FBANK_LOW_FREQ)
    energies = torch.mm(power, banks.T)
    eps = torch.tensor(torch.finfo(torch.float32).eps)
    return torch.maximum(energies, eps).log()


def mean_normalize(feats: torch.Tensor) -> torch.Tensor:
    """Per-utterance cepstral mean normalisation: subtract the mean over frames ``[F, C]``."""
    return feats - feats.mean(dim=0, keepdim=True)


# ---------------------------------------------------------------------------------------------
# 24 kHz prompt mel


def prompt_mel(audio_24k: torch.Tensor) -> torch.Tensor:
    """Prompt mel of 24 kHz audio ``[n]`` -> ``[n // 480, 80]`` float32 (time-major).

    Reflect-pad 720 both sides, STFT 1920/480 (periodic Hann, not centered), magnitude
    sqrt(re² + im² + 1e-9), Slaney mels 0..8 kHz, ln floored at 1e-5.
    """
    pad = (MEL_N_FFT - MEL_HOP) // 2
    wave = torch.nn.functional.pad(audio_24k.to(torch.float32)[None, None], (pad, pad), mode="reflect")[0]
    spec = torch.stft(
        wave,
        MEL_N_FFT,
        hop_length=MEL_HOP,
        win_length=MEL_N_FFT,
        window=_periodic_hann(MEL_N_FFT),
        center=False,
        normalized=False,
        onesided=True,
        return_complex=True,
    )  # [1, 961, F]
    ri = torch.view_as_real(spec)
    magnitude = torch.sqrt(ri.pow(2).sum(-1) + 1e-9)
    filters = slaney_mel_filters(MEL_SAMPLE_RATE, MEL_N_FFT, MEL_N_MELS, MEL_FMIN, MEL_FMAX)
    mel = torch.matmul(filters, magnitude)
    return torch.log(torch.clamp(mel, min=1e-5))[0].T.contiguous()


def aligned_token_count(n_mel_frames: int, n_tokens: int) -> int:
    """Tokens kept so that the prompt mel is exactly 2 frames per token: min(⌊F/2⌋, T)."""
    return min(n_mel_frames // MEL_FRAMES_PER_TOKEN, n_tokens)
