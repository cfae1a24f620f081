"""Streaming audio encoders for the HTTP/WebSocket compatibility APIs (OpenAI, ElevenLabs).

The engine makes float32 mono PCM at 24 kHz in chunks (``voice_out.engine.api.PcmChunk``); a
client of a cloud-TTS protocol asks for bytes in a format of its choice. An :class:`AudioEncoder`
turns chunks into bytes as they come: ``encode(pcm)`` returns what can be sent now, ``flush()``
the rest at the end of the utterance. Nothing waits for the whole utterance, so the first bytes
leave with the first chunk.

Formats (:data:`FORMATS`; :func:`make_encoder` builds one):

=======  ==============================  =====================================================
name     bytes                           rates
=======  ==============================  =====================================================
pcm      raw s16le mono                  any (PyAV's resampler from 24 kHz)
wav      RIFF header + s16le mono        any; the header's sizes say "unknown" (0xFFFFFFFF):
                                         the length is not known when the header leaves
ulaw     raw G.711 µ-law mono            any; 8 kHz is the telephony one
opus     Ogg Opus, one page per packet   8, 12, 16, 24, 48 kHz (libopus)
flac     native FLAC stream              any
mp3      MPEG audio                      the encoder's list; only where PyAV has an encoder
aac      ADTS AAC                        the encoder's list
=======  ==============================  =====================================================

Resampling and µ-law use FFmpeg through PyAV (``av.AudioResampler``, the ``pcm_mulaw`` codec),
not hand-written filters. The resampler keeps the duration: n samples in at 24 kHz come out as
n * rate / 24000 samples once flushed.

Streamed == whole: chunking the input does not change the output bytes. FFmpeg's encoders
re-frame their input internally, and the muxers run with ``fflags=+bitexact`` (an Ogg stream's
serial number is otherwise random) into a non-seekable sink (a seekable one would let the FLAC
and MP3 muxers rewrite their headers at the end, which a stream that already left cannot have).

Threads: an encoder is plain synchronous code with its own FFmpeg state; one encoder serves
one utterance and is called from one thread at a time (the event loop, or an executor thread
when the format is costly). It holds no thread or event-loop object.
"""

from __future__ import annotations

import abc
import struct
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from voice_out.engine.api import SAMPLE_RATE

#: The wav header's RIFF and data sizes when the length is unknown (streamed): readers that
#: honour it read to the end of the stream (FFmpeg, Python's ``wave``, browsers).
WAV_UNKNOWN_SIZE = 0xFFFFFFFF

#: Ogg page length limit in microseconds: one page per Opus packet (20 ms), so every packet
#: the encoder has made leaves with the chunk that made it (the muxer's default is 1 s).
OGG_PAGE_DURATION_US = 20_000


class UnsupportedFormatError(ValueError):
    """The format is unknown, the PyAV build lacks its encoder, or the rate is not one the
    codec takes. The message names what is available."""


@dataclass(frozen=True)
class FormatSpec:
    """How one output format is made.

    ``media_type``: the HTTP Content-Type of its bytes. ``codec``: the FFmpeg encoder names to
    try, in order (None: raw PCM made here). ``container``: the FFmpeg muxer (None: no
    container). ``default_rate``: the rate when the caller names none.
    """

    name: str
    media_type: str
    codecs: tuple[str, ...] = ()
    container: str | None = None
    default_rate: int = SAMPLE_RATE


#: Every format an encoder can be asked for (whether this PyAV build can make it:
#: :func:`available_formats`).
FORMATS: dict[str, FormatSpec] = {
    spec.name: spec
    for spec in (
        FormatSpec("pcm", "audio/pcm"),
        FormatSpec("wav", "audio/wav"),
        FormatSpec("ulaw", "audio/basic", codecs=("pcm_mulaw",), default_rate=8000),
        FormatSpec("opus", "audio/ogg", codecs=("libopus",), container="ogg"),
        FormatSpec("flac", "audio/flac", codecs=("flac",), container="flac"),
        FormatSpec("mp3", "audio/mpeg", codecs=("libmp3lame", "mp3", "libshine"), container="mp3"),
        FormatSpec("aac", "audio/aac", codecs=("aac", "libfdk_aac"), container="adts"),
    )
}


def _encoder_name(spec: FormatSpec) -> str | None:
    """The first of ``spec.codecs`` this PyAV build can encode with (None: none can)."""
    import av  # local: importing FFmpeg is slow and most processes never encode audio

    for name in spec.codecs:
        try:
            av.Codec(name, "w")
        except (av.error.FFmpegError, ValueError):  # UnknownCodecError is a ValueError
            continue
        return name
    return None


def available_formats() -> list[str]:
    """The names of :data:`FORMATS` this PyAV build can encode, in the table's order."""
    return [name for name, spec in FORMATS.items() if not spec.codecs or _encoder_name(spec) is not None]


def make_encoder(
    name: str, sample_rate: int | None = None, *, bit_rate: int | None = None, input_rate: int = SAMPLE_RATE
) -> AudioEncoder:
    """An encoder of float32 mono PCM at ``input_rate`` into format ``name`` at ``sample_rate``
    (None: the format's default rate). ``bit_rate`` in bit/s applies to lossy codecs (None: the
    encoder's default). Raises :class:`UnsupportedFormatError` with what is available."""
    spec = FORMATS.get(name)
    if spec is None:
        raise UnsupportedFormatError(f"unknown audio format {name!r}; available: {', '.join(available_formats())}")
    rate = spec.default_rate if sample_rate is None else sample_rate
    if not isinstance(rate, int) or isinstance(rate, bool) or not 1000 <= rate <= 192_000:
        raise UnsupportedFormatError(f"sample rate must be an integer in [1000, 192000] Hz, got {rate!r}")
    if name == "pcm":
        return PcmEncoder(rate, input_rate=input_rate)
    if name == "wav":
        return WavEncoder(rate, input_rate=input_rate)
    codec = _encoder_name(spec)
    if codec is None:
        raise UnsupportedFormatError(
            f"audio format {name!r} needs one of the encoders {', '.join(spec.codecs)}, which this PyAV/FFmpeg "
            f"build lacks; available: {', '.join(available_formats())}"
        )
    if name == "ulaw":
        return MulawEncoder(rate, input_rate=input_rate)
    return ContainerEncoder(spec, codec, rate, bit_rate=bit_rate, input_rate=input_rate)


def pcm16(pcm: np.ndarray) -> np.ndarray:
    """float32 [-1, 1] (n,) -> int16 (n,), clipped and rounded (the scale ``voice-out say`` and
    its WAV files use)."""
    return np.rint(np.clip(pcm, -1.0, 1.0) * 32767.0).astype(np.int16)


def _check_pcm(pcm: np.ndarray) -> np.ndarray:
    arr = np.asarray(pcm)
    if arr.ndim != 1 or arr.dtype != np.float32:
        raise ValueError(f"pcm must be float32 of shape (n,), got {arr.dtype} {arr.shape}")
    return arr


def _frame(pcm: np.ndarray, rate: int, pts: int) -> Any:
    """float32 (n,) -> a mono ``flt`` av.AudioFrame at ``rate``, stamped ``pts`` in 1/rate."""
    import av

    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm)[None, :], format="flt", layout="mono")
    frame.sample_rate = rate
    frame.pts = pts
    frame.time_base = Fraction(1, rate)
    return frame


def _frames_pcm(frames: list[Any]) -> np.ndarray:
    """The samples of PyAV ``flt`` mono frames, concatenated: float32 (n,)."""
    if not frames:
        return np.zeros(0, np.float32)
    return np.concatenate([f.to_ndarray().reshape(-1) for f in frames]).astype(np.float32, copy=False)


class Resampler:
    """float32 mono PCM from ``input_rate`` to ``output_rate``, streamed, through FFmpeg's
    swresample (PyAV ``AudioResampler``). ``process`` returns what is ready (the filter holds a
    few samples back); ``flush`` the rest, after which the total is n * output / input samples.
    Equal rates pass through untouched. One thread at a time."""

    def __init__(self, input_rate: int, output_rate: int) -> None:
        import av

        self.input_rate = input_rate
        self.output_rate = output_rate
        self._pts = 0
        self._resampler = (
            None if input_rate == output_rate else av.AudioResampler(format="flt", layout="mono", rate=output_rate)
        )

    def process(self, pcm: np.ndarray) -> np.ndarray:
        """float32 (n,) at ``input_rate`` -> float32 (m,) at ``output_rate``."""
        pcm = _check_pcm(pcm)
        if self._resampler is None or len(pcm) == 0:
            return pcm if self._resampler is None else np.zeros(0, np.float32)
        frame = _frame(pcm, self.input_rate, self._pts)
        self._pts += len(pcm)
        return _frames_pcm(self._resampler.resample(frame))

    def flush(self) -> np.ndarray:
        """The samples the filter still holds: float32 (m,). The resampler is spent after it."""
        if self._resampler is None:
            return np.zeros(0, np.float32)
        return _frames_pcm(self._resampler.resample(None))


class AudioEncoder(abc.ABC):
    """float32 mono PCM chunks in, encoded bytes out. ``encode`` may return b"" (a codec waits
    for a whole frame); ``flush`` ends the stream and returns the rest; ``close`` releases the
    FFmpeg state without output (the client went away). One thread at a time."""

    media_type: str
    sample_rate: int
    #: A codec's encoder runs (Opus, MP3, AAC: about 1 % of real time on one core, 10 ms per
    #: second of audio; FLAC less): an event-loop caller runs ``encode``/``flush`` in an
    #: executor, so one client's format does not delay the loop's other work. Raw PCM, WAV and
    #: µ-law cost ~0.3 ms per second of audio and run inline.
    heavy: bool = False

    @abc.abstractmethod
    def encode(self, pcm: np.ndarray) -> bytes:
        """Encode float32 (n,) at the input rate; return the bytes ready now."""

    @abc.abstractmethod
    def flush(self) -> bytes:
        """End of the utterance: the remaining bytes. The encoder is closed after it."""

    def close(self) -> None:  # noqa: B027 - a no-op default: raw formats hold no FFmpeg state
        """Release without output; idempotent."""


class PcmEncoder(AudioEncoder):
    """Raw s16le mono at ``sample_rate``."""

    media_type = FORMATS["pcm"].media_type

    def __init__(self, sample_rate: int, *, input_rate: int = SAMPLE_RATE) -> None:
        self.sample_rate = sample_rate
        self._resampler = Resampler(input_rate, sample_rate)

    def encode(self, pcm: np.ndarray) -> bytes:
        return pcm16(self._resampler.process(pcm)).astype("<i2", copy=False).tobytes()

    def flush(self) -> bytes:
        return pcm16(self._resampler.flush()).astype("<i2", copy=False).tobytes()


class WavEncoder(PcmEncoder):
    """A 44-byte RIFF/WAVE header (PCM s16 mono, sizes unknown) then raw s16le."""

    media_type = FORMATS["wav"].media_type

    def __init__(self, sample_rate: int, *, input_rate: int = SAMPLE_RATE) -> None:
        super().__init__(sample_rate, input_rate=input_rate)
        self._header: bytes | None = wav_header(sample_rate)

    def _take_header(self) -> bytes:
        header, self._header = self._header or b"", None
        return header

    def encode(self, pcm: np.ndarray) -> bytes:
        return self._take_header() + super().encode(pcm)

    def flush(self) -> bytes:
        return self._take_header() + super().flush()


def wav_header(sample_rate: int, n_samples: int | None = None) -> bytes:
    """The 44-byte header of a mono s16le WAV file; ``n_samples`` None: a streamed file of
    unknown length (both sizes 0xFFFFFFFF)."""
    if n_samples is None:
        riff_size = data_size = WAV_UNKNOWN_SIZE
    else:
        data_size = 2 * n_samples
        riff_size = 36 + data_size
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, 2 * sample_rate, 2, 16)  # PCM, mono, byte rate, align, bits
    return (
        b"RIFF"
        + struct.pack("<I", riff_size)
        + b"WAVEfmt "
        + struct.pack("<I", len(fmt))
        + fmt
        + b"data"
        + (struct.pack("<I", data_size))
    )


class MulawEncoder(AudioEncoder):
    """Raw G.711 µ-law mono at ``sample_rate`` (FFmpeg's ``pcm_mulaw``)."""

    media_type = FORMATS["ulaw"].media_type

    def __init__(self, sample_rate: int, *, input_rate: int = SAMPLE_RATE) -> None:
        import av

        self.sample_rate = sample_rate
        self._resampler = Resampler(input_rate, sample_rate)
        self._codec = av.CodecContext.create("pcm_mulaw", "w")
        self._codec.sample_rate = sample_rate
        self._codec.layout = "mono"
        self._codec.format = "s16"
        self._pts = 0

    def _encode16(self, pcm: np.ndarray) -> bytes:
        import av

        if len(pcm) == 0:
            return b""
        frame = av.AudioFrame.from_ndarray(pcm16(pcm)[None, :], format="s16", layout="mono")
        frame.sample_rate = self.sample_rate
        frame.pts = self._pts
        self._pts += len(pcm)
        return b"".join(bytes(p) for p in self._codec.encode(frame))

    def encode(self, pcm: np.ndarray) -> bytes:
        return self._encode16(self._resampler.process(pcm))

    def flush(self) -> bytes:
        return self._encode16(self._resampler.flush())  # pcm_mulaw holds nothing back


class _Sink:
    """A write-only, non-seekable file for PyAV's muxer: what it writes is taken by ``take``.
    Non-seekable on purpose: a muxer that could seek would rewrite its header at the end."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def write(self, data: bytes) -> int:
        self._buf += data
        return len(data)

    def take(self) -> bytes:
        out = bytes(self._buf)
        self._buf.clear()
        return out


class ContainerEncoder(AudioEncoder):
    """A codec in a muxer (Ogg Opus, FLAC, MP3, ADTS AAC), streamed: each ``encode`` returns
    the packets the codec has finished, muxed, and flushed out of FFmpeg's I/O buffer."""

    heavy = True

    def __init__(
        self, spec: FormatSpec, codec: str, sample_rate: int, *, bit_rate: int | None, input_rate: int
    ) -> None:
        import av

        assert spec.container is not None
        rates = av.Codec(codec, "w").audio_rates
        if rates and sample_rate not in rates:
            raise UnsupportedFormatError(
                f"{spec.name} ({codec}) does not take {sample_rate} Hz; it takes {', '.join(map(str, sorted(rates)))}"
            )
        self.media_type = spec.media_type
        self.sample_rate = sample_rate
        self._resampler = Resampler(input_rate, sample_rate)
        self._sink = _Sink()
        options = {"fflags": "+bitexact", "flush_packets": "1"}
        if spec.container == "ogg":
            options["page_duration"] = str(OGG_PAGE_DURATION_US)
        self._container = av.open(self._sink, mode="w", format=spec.container, container_options=options)
        try:
            stream = self._container.add_stream(codec, rate=sample_rate)
            assert isinstance(stream, av.AudioStream)
            stream.layout = "mono"
            if bit_rate is not None:
                stream.bit_rate = bit_rate
            self._stream = stream
        except BaseException:
            self._container.close()
            raise
        self._pts = 0
        self._closed = False

    def _mux(self, frame: Any) -> bytes:
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        return self._sink.take()

    def encode(self, pcm: np.ndarray) -> bytes:
        if self._closed:
            raise RuntimeError("encode() after flush() or close()")
        pcm = self._resampler.process(pcm)
        if len(pcm) == 0:
            return self._sink.take()  # the header, when the codec has nothing yet
        frame = _frame(pcm, self.sample_rate, self._pts)
        self._pts += len(pcm)
        return self._mux(frame)

    def flush(self) -> bytes:
        if self._closed:
            raise RuntimeError("flush() after flush() or close()")
        rest = self._resampler.flush()
        out = b""
        if len(rest):
            out += self._mux(_frame(rest, self.sample_rate, self._pts))
            self._pts += len(rest)
        out += self._mux(None)  # drain the codec
        self._closed = True
        self._container.close()  # writes the trailer
        return out + self._sink.take()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._container.close()
