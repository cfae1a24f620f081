"""Should the track's 24 -> 48 kHz upsampler be PyAV's (FFmpeg swresample) instead of our own
:class:`voice_out.server.track.Upsampler2x`? Measures, per 10 and 20 ms frame of a continuous
signal: the delay each adds (the lag of the output's cross-correlation peak against an ideal
2x signal, plus what the resampler holds back), and the CPU time per frame.

    python scripts/track_upsampler.py
"""

from __future__ import annotations

import time

import numpy as np

from voice_out.server.audio_encode import Resampler, pcm16
from voice_out.server.track import Upsampler2x

RATE = 24000


def signal(seconds: float) -> np.ndarray:
    rng = np.random.default_rng(0)
    t = np.arange(int(seconds * RATE)) / RATE
    chirp = 0.3 * np.sin(2 * np.pi * (200 + 2000 * t) * t) + 0.05 * rng.standard_normal(len(t))
    return chirp.astype(np.float32)


def delay_samples(x24: np.ndarray, y48: np.ndarray) -> int:
    """Lag (48 kHz samples) of y48 behind the 2x-interpolated x24."""
    ref = np.interp(np.arange(2 * len(x24)) / 2, np.arange(len(x24)), x24)
    n = min(len(ref), len(y48)) - 400
    lags = range(0, 200)
    corr = [float(np.dot(ref[:n], y48[lag : lag + n])) for lag in lags]
    return int(np.argmax(corr))


def run(frame_ms: int) -> None:
    n = RATE * frame_ms // 1000
    x = signal(4.0)
    frames = [x[i : i + n] for i in range(0, len(x) - n + 1, n)]

    ours = Upsampler2x()
    t0 = time.perf_counter()
    out_ours = [ours.process(pcm16(f)) for f in frames]
    cpu_ours = (time.perf_counter() - t0) / len(frames) * 1e6

    av = Resampler(RATE, 2 * RATE)
    t0 = time.perf_counter()
    out_av = [pcm16(av.process(f)) for f in frames]
    cpu_av = (time.perf_counter() - t0) / len(frames) * 1e6
    first_short = 2 * n - len(out_av[0])  # samples the first frame comes out short

    y_ours = np.concatenate(out_ours).astype(np.float32) / 32767
    y_av = np.concatenate(out_av).astype(np.float32) / 32767
    d_ours, d_av = delay_samples(x, y_ours), delay_samples(x, y_av)
    print(
        f"{frame_ms} ms frames: ours {cpu_ours:.0f} us/frame, delay {d_ours / 48:.2f} ms | "
        f"PyAV {cpu_av:.0f} us/frame, delay {d_av / 48:.2f} ms, first frame {first_short} samples short "
        f"(a frame of {2 * n} must wait {first_short / 48:.2f} ms more)"
    )


if __name__ == "__main__":
    for frame_ms in (10, 20):
        run(frame_ms)
