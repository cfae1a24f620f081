"""Prompt audio: decoding any common format to float32 mono, and sinc resampling.

Decoding goes through PyAV (FFmpeg), so WAV, FLAC, MP3, Ogg (Vorbis/Opus), M4A/AAC, WebM and
the rest all work from a path or from bytes. Samples are scaled the way libsndfile scales them
when it reads into float (integer PCM divided by 2^(bits-1), float PCM as stored), then channels
are averaged, so a WAV file gives exactly what the reference frontend reads.

:func:`resample` reproduces the reference resampler: a band-limited sinc interpolator with a
squared-cosine (Hann) window, 6 zero crossings each side, cutoff at 0.99 of the lower Nyquist
frequency, evaluated as a strided convolution with one kernel per output phase.

Pure functions; any thread may call them.
"""

from __future__ import annotations

import functools
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from voice_out.voices.errors import (
    CorruptAudioError,
    EmptyAudioError,
    SampleRateTooLowError,
    UnsupportedAudioError,
)

#: Sample rate of the speech tokenizer and the speaker-embedding network.
TOKENIZER_SAMPLE_RATE = 16000
#: Sample rate of the prompt mel (the vocoder's rate).
MEL_SAMPLE_RATE = 24000
#: The lowest source rate accepted: upsampling would invent the band the networks listen to.
MIN_SAMPLE_RATE = 16000

#: Resampler constants (the reference defaults).
LOWPASS_FILTER_WIDTH = 6
ROLLOFF = 0.99

#: Leading bytes of containers we know: when one of these fails to open, the file is corrupt,
#: not of an unknown kind.
_KNOWN_MAGIC = (b"RIFF", b"RIFX", b"RF64", b"fLaC", b"OggS", b"ID3", b"FORM", b"\x1aE\xdf\xa3", b"caff")

# Scale of integer sample formats to [-1, 1) (libsndfile's normalisation on float reads).
_INT_SCALE = {"u8": 2.0**-7, "s16": 2.0**-15, "s32": 2.0**-31, "s64": 2.0**-63}

AudioSource = str | Path | bytes | bytearray | memoryview


@dataclass(frozen=True)
class DecodedAudio:
    """Mono audio: ``samples`` float32 (n,), nominally in [-1, 1], at ``sample_rate`` Hz."""

    samples: np.ndarray
    sample_rate: int
    #: Container format name as FFmpeg reports it (e.g. ``wav``, ``mp3``, ``ogg``).
    container: str
    codec: str
    channels: int
    #: Decoding stopped early at ``max_duration_s`` + 1 s: the file is longer than ``samples``.
    truncated: bool = False

    @property
    def duration_s(self) -> float:
        return len(self.samples) / self.sample_rate


def _looks_like_known_container(head: bytes) -> bool:
    if head.startswith(_KNOWN_MAGIC):
        return True
    if len(head) >= 8 and head[4:8] == b"ftyp":  # MP4 / M4A
        return True
    return len(head) >= 2 and head[0] == 0xFF and (head[1] & 0xE0) == 0xE0  # MPEG audio frame sync


def _frame_to_float(frame: Any) -> np.ndarray:
    """One decoded PyAV ``AudioFrame`` -> float32 (channels, n)."""
    fmt = frame.format
    channels = int(frame.layout.nb_channels)
    raw = frame.to_ndarray()
    if not fmt.is_planar:
        raw = raw.reshape(-1, channels).T  # interleaved [n*c] -> [c, n]
    base = fmt.name.rstrip("p")
    if base in ("flt", "dbl"):
        return np.asarray(raw, dtype=np.float32)
    if base == "u8":
        return ((raw.astype(np.float32) - 128.0) * np.float32(_INT_SCALE["u8"])).astype(np.float32)
    if base in _INT_SCALE:
        return (raw.astype(np.float32) * np.float32(_INT_SCALE[base])).astype(np.float32)
    raise UnsupportedAudioError(f"unsupported decoded sample format {fmt.name!r}")


def decode_audio(source: AudioSource, *, max_duration_s: float | None = None) -> DecodedAudio:
    """Decode the first audio stream of a file path or of in-memory bytes to float32 mono.

    ``max_duration_s`` stops decoding early (raising nothing; the caller checks the duration)
    once that much audio plus one second is decoded, so a huge upload costs little.

    Raises :class:`EmptyAudioError`, :class:`UnsupportedAudioError` (unknown format, no audio
    stream) or :class:`CorruptAudioError` (a known format that fails to decode).
    """
    import av  # local: importing FFmpeg is slow and most processes never decode audio

    if isinstance(source, bytes | bytearray | memoryview):
        data = bytes(source)
        if not data:
            raise EmptyAudioError("the audio is empty (0 bytes)")
        head = data[:16]
        opened: object = io.BytesIO(data)
        what = "the uploaded audio"
    else:
        path = Path(source)
        if not path.is_file():
            raise UnsupportedAudioError(f"audio file {str(path)!r} does not exist or is not a file")
        if path.stat().st_size == 0:
            raise EmptyAudioError(f"audio file {str(path)!r} is empty (0 bytes)")
        with path.open("rb") as f:
            head = f.read(16)
        opened = str(path)
        what = f"audio file {str(path)!r}"

    try:
        container = av.open(opened, mode="r")
    except (av.error.FFmpegError, ValueError, OSError) as e:
        if _looks_like_known_container(head):
            raise CorruptAudioError(f"{what} looks like audio but cannot be read: {e}") from None
        raise UnsupportedAudioError(
            f"{what} is not in a supported audio format (use wav, flac, mp3, ogg/opus or m4a)"
        ) from None
    with container:
        if not container.streams.audio:
            raise UnsupportedAudioError(f"{what} has no audio stream")
        stream = container.streams.audio[0]
        parts: list[np.ndarray] = []
        sample_rate: int | None = None
        channels = 0
        n_decoded = 0
        truncated = False
        try:
            for frame in container.decode(stream):
                if sample_rate is None:
                    sample_rate = int(frame.sample_rate)
                    channels = int(frame.layout.nb_channels)
                elif int(frame.sample_rate) != sample_rate or int(frame.layout.nb_channels) != channels:
                    raise UnsupportedAudioError(f"{what} changes its sample rate or channel count mid-stream")
                block = _frame_to_float(frame)
                parts.append(block)
                n_decoded += block.shape[1]
                if max_duration_s is not None and n_decoded > (max_duration_s + 1.0) * sample_rate:
                    truncated = True
                    break
        except av.error.FFmpegError as e:
            raise CorruptAudioError(f"{what} cannot be decoded: {e}") from None
        container_name = str(container.format.name)
        codec = str(stream.codec_context.name)
    if sample_rate is None or n_decoded == 0:
        raise EmptyAudioError(f"{what} contains no audio samples")
    multi = torch.from_numpy(np.concatenate(parts, axis=1))  # [C, n]
    # Average in float32 the way the reference does (torch mean over the channel axis).
    mono = multi.mean(dim=0).numpy().astype(np.float32, copy=False)
    return DecodedAudio(
        samples=np.ascontiguousarray(mono),
        sample_rate=sample_rate,
        container=container_name,
        codec=codec,
        channels=channels,
        truncated=truncated,
    )


@functools.lru_cache(maxsize=16)
def _sinc_kernel(in_period: int, out_period: int) -> tuple[torch.Tensor, int]:
    """Polyphase windowed-sinc kernels for a rate ratio reduced to ``out_period / in_period``.

    Returns (kernels [out_period, 1, 2*half + in_period] float32, half) where ``half`` is the
    one-sided support in input samples. Kernel ``j`` produces output samples ``j, j + M, ...``
    (M = ``out_period``): output ``q*M + j`` sits at input time ``q*L + j*L/M`` (L = ``in_period``).
    """
    # Cutoff in units of the reduced input rate: 0.99 of the lower of the two Nyquist bands.
    cutoff = min(in_period, out_period) * ROLLOFF
    half = math.ceil(LOWPASS_FILTER_WIDTH * in_period / cutoff)
    # Tap positions relative to the output instant, in input periods, computed in float64.
    taps = torch.arange(-half, half + in_period, dtype=torch.float64) / in_period  # [K]
    # The reference forms the phase offsets in float32 before widening them to float64; doing
    # the same keeps the kernels bit-identical for ratios whose phases are not exact in binary.
    phases = (-torch.arange(out_period, dtype=torch.float32) / out_period).to(torch.float64)  # [M]
    x = (phases[:, None] + taps[None, :]) * cutoff  # zero crossings of the sinc at integers
    x = x.clamp(-LOWPASS_FILTER_WIDTH, LOWPASS_FILTER_WIDTH)
    window = torch.cos(x * (math.pi / (2 * LOWPASS_FILTER_WIDTH))) ** 2
    arg = x * math.pi
    sinc = torch.where(arg == 0, torch.ones_like(arg), torch.sin(arg) / arg)
    kernels = sinc * window * (cutoff / in_period)
    return kernels.to(torch.float32)[:, None, :], half


def resample(wave: torch.Tensor, orig_sample_rate: int, new_sample_rate: int) -> torch.Tensor:
    """Resample float32 audio ``[..., n]`` from ``orig_sample_rate`` to ``new_sample_rate``.

    Output length is ``ceil(n * new / orig)``; equal rates return the input unchanged. Matches
    the reference (``sinc_interp_hann``, width 6, rolloff 0.99) to float32 rounding.
    """
    if orig_sample_rate <= 0 or new_sample_rate <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_sample_rate} -> {new_sample_rate}")
    if orig_sample_rate == new_sample_rate:
        return wave
    g = math.gcd(int(orig_sample_rate), int(new_sample_rate))
    in_period, out_period = int(orig_sample_rate) // g, int(new_sample_rate) // g
    kernels, half = _sinc_kernel(in_period, out_period)
    lead = wave.shape[:-1]
    n = wave.shape[-1]
    flat = wave.reshape(-1, 1, n).to(torch.float32)  # [B, 1, n]
    padded = torch.nn.functional.pad(flat, (half, half + in_period))
    out = torch.nn.functional.conv1d(padded, kernels.to(flat.device), stride=in_period)  # [B, M, Q]
    out = out.transpose(1, 2).reshape(flat.shape[0], -1)  # interleave phases: [B, Q*M]
    n_out = -(-out_period * n // in_period)
    return out[:, :n_out].reshape(*lead, -1)


def check_sample_rate(sample_rate: int) -> None:
    """Raise :class:`SampleRateTooLowError` below :data:`MIN_SAMPLE_RATE`."""
    if sample_rate < MIN_SAMPLE_RATE:
        raise SampleRateTooLowError(
            f"the audio is sampled at {sample_rate} Hz; prompts need at least {MIN_SAMPLE_RATE} Hz "
            "(record or export at 16 kHz or more)"
        )
