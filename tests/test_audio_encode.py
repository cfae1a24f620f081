"""The streaming encoders of voice_out.server.audio_encode: every format decodes back with PyAV
to audio of the right rate and length, the resampler keeps the duration, and a streamed encode
gives the bytes of a whole one."""

from __future__ import annotations

import io
import struct
import wave

import av
import numpy as np
import pytest

from voice_out.server.audio_encode import (
    FORMATS,
    Resampler,
    UnsupportedFormatError,
    available_formats,
    make_encoder,
    pcm16,
)

RATE = 24000


def tone(seconds: float = 1.5, freq: float = 440.0) -> np.ndarray:
    """A sine with a little noise: float32 (n,) at 24 kHz."""
    t = np.arange(int(seconds * RATE)) / RATE
    rng = np.random.default_rng(0)
    return (0.4 * np.sin(2 * np.pi * freq * t) + 0.01 * rng.standard_normal(len(t))).astype(np.float32)


def chunks_of(pcm: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """Split into uneven chunks (engine chunks are not frame multiples), then the rest."""
    out, at = [], 0
    for n in sizes:
        out.append(pcm[at : at + n])
        at += n
    out.append(pcm[at:])
    return out


UNEVEN = [1, 4799, 0, 12001, 333, 7000]


def encode(name: str, parts: list[np.ndarray], rate: int | None = None) -> tuple[bytes, list[int]]:
    """All bytes, and the number of bytes out after each part (the streaming profile)."""
    enc = make_encoder(name, rate)
    out, sizes = b"", []
    for p in parts:
        out += enc.encode(p)
        sizes.append(len(out))
    return out + enc.flush(), sizes


def decode(data: bytes, fmt: str | None = None, options: dict[str, str] | None = None) -> tuple[np.ndarray, int]:
    """PyAV decode of a whole file: (float mono samples, rate)."""
    container = av.open(io.BytesIO(data), mode="r", format=fmt, options=options or {})
    frames = list(container.decode(audio=0))
    container.close()
    rate = frames[0].sample_rate
    pcm = np.concatenate([f.to_ndarray().astype(np.float64).reshape(f.samples, -1)[:, 0] for f in frames])
    if frames[0].format.name.startswith("s16"):
        pcm = pcm / 32768.0
    return pcm, rate


def test_the_bundled_pyav_encodes_the_formats_the_apis_promise() -> None:
    # the formats the OpenAI and ElevenLabs endpoints serve; mp3 and aac are conditional in
    # the APIs, but this PyAV build has them, so a change of build that drops one shows here
    assert available_formats() == list(FORMATS)


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 24000, 44100, 48000])
def test_pcm_at_any_rate_keeps_duration_and_streams_as_whole(rate: int) -> None:
    x = tone()
    whole, _ = encode("pcm", [x], rate)
    streamed, sizes = encode("pcm", chunks_of(x, UNEVEN), rate)
    assert streamed == whole
    assert len(whole) == 2 * round(len(x) * rate / RATE)
    assert sizes[0] < sizes[1] < sizes[3]  # bytes leave chunk by chunk, not at the end
    got = np.frombuffer(whole, "<i2").astype(np.float64) / 32767
    if rate == RATE:
        np.testing.assert_array_equal(np.frombuffer(whole, "<i2"), pcm16(x))
    else:  # the same tone at the new rate: compare with the ideal sine away from the edges
        t = np.arange(len(got)) / rate
        ideal = 0.4 * np.sin(2 * np.pi * 440.0 * t)
        mid = slice(len(got) // 10, -len(got) // 10)
        assert np.sqrt(np.mean((got[mid] - ideal[mid]) ** 2)) < 0.02


def test_resampler_keeps_duration_over_uneven_chunks() -> None:
    x = tone(2.0)
    for rate in (8000, 16000, 22050, 44100, 48000):
        r = Resampler(RATE, rate)
        n = sum(len(r.process(p)) for p in chunks_of(x, UNEVEN)) + len(r.flush())
        assert n == len(x) * rate // RATE if (len(x) * rate) % RATE == 0 else abs(n - len(x) * rate / RATE) <= 1


def test_resampler_streamed_equals_whole() -> None:
    x = tone()
    a = Resampler(RATE, 16000)
    whole = np.concatenate([a.process(x), a.flush()])
    b = Resampler(RATE, 16000)
    parts = [b.process(p) for p in chunks_of(x, UNEVEN)] + [b.flush()]
    np.testing.assert_allclose(np.concatenate(parts), whole, atol=1e-6)


def test_wav_header_then_pcm_decodes_with_pyav_and_wave() -> None:
    x = tone()
    data, sizes = encode("wav", chunks_of(x, UNEVEN), 16000)
    assert sizes[0] >= 44 and data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt "
    assert struct.unpack("<I", data[40:44])[0] == 0xFFFFFFFF  # streamed: length unknown
    pcm, rate = decode(data)
    assert rate == 16000 and len(pcm) == len(x) * 16000 // RATE
    w = wave.open(io.BytesIO(data))
    assert w.getframerate() == 16000 and w.getnchannels() == 1 and w.getsampwidth() == 2
    assert len(w.readframes(10**9)) == 2 * len(pcm)


def test_wav_of_an_empty_utterance_is_a_header() -> None:
    enc = make_encoder("wav")
    assert len(enc.flush()) == 44


def test_ulaw_8k_decodes_to_the_tone() -> None:
    x = tone()
    data, sizes = encode("ulaw", chunks_of(x, UNEVEN))
    assert len(data) == len(x) // 3  # one byte per 8 kHz sample
    whole, _ = encode("ulaw", [x])
    assert data == whole
    pcm, rate = decode(data, fmt="mulaw", options={"sample_rate": "8000"})
    assert rate == 8000 and len(pcm) == len(x) // 3
    t = np.arange(len(pcm)) / 8000
    mid = slice(800, -800)
    err = pcm[mid] - 0.4 * np.sin(2 * np.pi * 440.0 * t[mid])
    assert np.sqrt(np.mean(err**2)) < 0.03  # µ-law is ~8 bits: a few % of error


# (format, decoded rate, samples the codec may add: encoder delay + the last frame's padding)
CODECS = [("opus", 48000, 0), ("flac", RATE, 0), ("mp3", RATE, 1105 + 1152), ("aac", RATE, 2048)]


@pytest.mark.parametrize(("name", "decoded_rate", "slack"), CODECS)
def test_codec_streams_decodes_and_equals_whole(name: str, decoded_rate: int, slack: int) -> None:
    x = tone()
    whole, _ = encode(name, [x])
    streamed, sizes = encode(name, chunks_of(x, UNEVEN))
    assert streamed == whole
    # the bytes of each chunk leave with it (not all at flush): after the 12001-sample part the
    # codec has whole frames to send
    assert 0 < sizes[2] < sizes[3] < sizes[5] < len(streamed)
    pcm, rate = decode(streamed)
    assert rate == decoded_rate
    expected = len(x) * decoded_rate // RATE
    assert expected <= len(pcm) <= expected + slack * decoded_rate // RATE
    # the tone survives: its spectrum peaks at 440 Hz
    spectrum = np.abs(np.fft.rfft(pcm[: decoded_rate // 2 * 2]))
    peak_hz = np.argmax(spectrum) * decoded_rate / (decoded_rate // 2 * 2)
    assert abs(peak_hz - 440.0) < 4.0


def test_flac_is_lossless() -> None:
    x = tone()
    pcm, _ = decode(encode("flac", [x])[0])
    # FFmpeg's float->s16 conversion (x 32768, rounded) differs from pcm16 (x 32767) by <= 1 LSB
    # per 2^15 of amplitude: compare in float
    np.testing.assert_allclose(pcm, x, atol=2 / 32768)


@pytest.mark.parametrize("rate", [16000, 48000])
def test_opus_at_other_rates(rate: int) -> None:
    x = tone()
    pcm, got = decode(encode("opus", chunks_of(x, UNEVEN), rate)[0])
    assert got == 48000 and len(pcm) == len(x) * 2


def test_mp3_bit_rate_applies() -> None:
    x = tone(3.0)
    small = make_encoder("mp3", 24000, bit_rate=32_000)
    big = make_encoder("mp3", 24000, bit_rate=128_000)
    a = small.encode(x) + small.flush()
    b = big.encode(x) + big.flush()
    assert 3 * len(a) < len(b)


def test_unknown_format_and_bad_rate_say_what_is_available() -> None:
    with pytest.raises(UnsupportedFormatError, match="available: pcm, wav, ulaw, opus, flac"):
        make_encoder("ogg_vorbis")
    with pytest.raises(UnsupportedFormatError, match="takes 8000, 12000, 16000, 24000, 48000"):
        make_encoder("opus", 44100)
    with pytest.raises(UnsupportedFormatError, match="1000, 192000"):
        make_encoder("pcm", 0)


def test_missing_encoder_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from voice_out.server import audio_encode

    real = audio_encode._encoder_name
    monkeypatch.setattr(audio_encode, "_encoder_name", lambda spec: None if spec.name == "mp3" else real(spec))
    with pytest.raises(UnsupportedFormatError, match=r"'mp3' needs one of the encoders libmp3lame.*available: "):
        make_encoder("mp3")
    assert "mp3" not in audio_encode.available_formats()


def test_bad_pcm_and_use_after_flush() -> None:
    enc = make_encoder("opus")
    with pytest.raises(ValueError, match="float32"):
        enc.encode(np.zeros(10, np.float64))
    enc.flush()
    with pytest.raises(RuntimeError):
        enc.encode(tone(0.1))
    other = make_encoder("flac")
    other.encode(tone(0.1))
    other.close()
    other.close()  # idempotent
