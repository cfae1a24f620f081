"""``voice-out say``: speak text into a 24 kHz mono 16-bit WAV file.

::

    voice-out say "Hello there!" --voice alice -o hello.wav
    my_llm | voice-out say --stream --voice alice -o reply.wav     # text deltas from stdin

With ``--stream`` the text is read from standard input as it arrives (any chunking, UTF-8) and
fed to the engine delta by delta, as an agent's LLM would, until end of input. The engine runs
in this process (its worker thread); the main thread writes the audio as it comes.
"""

from __future__ import annotations

import argparse
import codecs
import os
import sys
import threading
import time
import wave
from pathlib import Path
from typing import BinaryIO

import numpy as np

from voice_out.config import Config
from voice_out.engine.api import SAMPLE_RATE, EngineError
from voice_out.engine.engine import Engine, EngineStream
from voice_out.errors import VoiceOutError

READ_BYTES = 4096


class SayError(VoiceOutError):
    """A ``say`` usage error (printed as one line)."""


def pcm16(pcm: np.ndarray) -> bytes:
    """float32 [-1, 1] -> little-endian int16 bytes (clipped)."""
    return (np.clip(pcm, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def feed_stdin(stream: EngineStream, source: BinaryIO, errors: list[BaseException]) -> None:
    """Push UTF-8 text from ``source`` to ``stream`` as it arrives, then end the text.

    Runs on its own thread (reading blocks). A rejected delta cancels the stream.
    """
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    fd = source.fileno()
    try:
        while True:
            data = os.read(fd, READ_BYTES)  # returns what is there, as soon as there is some
            text = decoder.decode(data, final=not data)
            if text:
                stream.push_text(text)
            if not data:
                break
        stream.end_text()
    except EngineError as e:
        errors.append(e)
        stream.cancel()


def write_wav(path: Path) -> wave.Wave_write:
    out = wave.open(str(path), "wb")
    out.setnchannels(1)
    out.setsampwidth(2)
    out.setframerate(SAMPLE_RATE)
    return out


def say(cfg: Config, args: argparse.Namespace) -> int:
    """Entry point of ``voice-out say`` (see the module docstring). Returns the exit status."""
    text: str | None = getattr(args, "text", None)
    streaming = bool(getattr(args, "stream", False))
    if streaming and text:
        raise SayError("give the text as an argument or use --stream (stdin), not both")
    if not streaming and not text:
        raise SayError('nothing to say: give the text, e.g. voice-out say "Hello!", or pipe it in with --stream')
    output = Path(getattr(args, "output", None) or "out.wav")
    if output.parent and not output.parent.exists():
        raise SayError(f"cannot write {output}: directory {output.parent} does not exist")

    # (random weights speak a capped length: Engine.load's rule, the same as serve's)
    engine = Engine.load(cfg)
    t_start = time.monotonic()
    engine.start()
    errors: list[BaseException] = []
    n_samples = 0
    first_audio: float | None = None
    try:
        stream = engine.open_stream(getattr(args, "voice", None))
        t_text = time.monotonic()
        reader = None
        if streaming:
            reader = threading.Thread(target=feed_stdin, args=(stream, sys.stdin.buffer, errors), daemon=True)
            reader.start()
        else:
            assert text is not None
            stream.push_text(text)
            stream.end_text()
        wav = write_wav(output)
        try:
            for chunk in stream:
                if first_audio is None:
                    first_audio = time.monotonic() - t_text
                wav.writeframes(pcm16(chunk.pcm))
                n_samples += len(chunk.pcm)
        except BaseException:
            wav.close()
            output.unlink(missing_ok=True)
            raise
        wav.close()
        if errors:
            output.unlink(missing_ok=True)
            raise errors[0]
    finally:
        engine.close()
    took = time.monotonic() - t_start
    ttfa = f"; first audio after {first_audio:.2f} s" if first_audio is not None else ""
    print(
        f"wrote {output}: {n_samples / SAMPLE_RATE:.2f} s of audio at {SAMPLE_RATE} Hz in {took:.2f} s{ttfa}",
        file=sys.stderr,
    )
    return 0
