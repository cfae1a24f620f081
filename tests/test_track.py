"""UtteranceTrack: pacing on an injected clock, silence, gapless order, cancel fade, accounting."""

from __future__ import annotations

import asyncio
import fractions

import numpy as np
import pytest
from av import AudioFrame, CodecContext, Packet

from voice_out.engine.api import PcmChunk
from voice_out.server.track import (
    FADE_MS,
    LATE_S,
    Done,
    Late,
    OpusFrameEncoder,
    Played,
    Silenced,
    Started,
    TrackEvent,
    Underrun,
    Upsampler2x,
    UtteranceTrack,
    heard_text,
    pcm_to_s16,
    s16_frame,
)

SR = 24000
FRAME = 480
FADE = SR * FADE_MS // 1000


class FakeClock:
    """Time moves only when the track sleeps (or the test says so)."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    async def sleep_until(self, t: float) -> None:
        self.sleeps.append(t - self.t)
        self.t = max(self.t, t)
        await asyncio.sleep(0)


def make_track() -> tuple[UtteranceTrack, FakeClock, list[TrackEvent]]:
    clock = FakeClock()
    events: list[TrackEvent] = []
    track = UtteranceTrack(sample_rate=SR, clock=clock, on_event=events.append, output_rate=SR)
    return track, clock, events


def tone(n: int, amp: float = 0.5, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (amp * rng.uniform(0.2, 1.0, n) * np.sign(rng.standard_normal(n))).astype(np.float32)


async def recv_frame(track: UtteranceTrack) -> AudioFrame:
    """The next raw frame of a track that does not encode."""
    f = await track.recv()
    assert isinstance(f, AudioFrame)
    return f


async def recv_packet(track: UtteranceTrack) -> Packet:
    """The next Opus packet of a track that encodes."""
    pk = await track.recv()
    assert isinstance(pk, Packet)
    return pk


async def frames(track: UtteranceTrack, n: int) -> np.ndarray:
    out = []
    for _ in range(n):
        f = await recv_frame(track)
        out.append(f.to_ndarray().reshape(-1))
    return np.concatenate(out)


@pytest.mark.asyncio
async def test_frames_are_20ms_s16_mono_paced_by_the_clock() -> None:
    track, clock, _ = make_track()
    t0 = clock.t
    for i in range(5):
        f = await recv_frame(track)
        assert f.format.name == "s16" and f.layout.name == "mono"
        assert f.samples == FRAME and f.sample_rate == SR
        assert f.time_base == fractions.Fraction(1, SR)
        assert f.pts == i * FRAME
        # Each frame is released exactly at start + pts / rate.
        assert clock.t == pytest.approx(t0 + i * FRAME / SR)
    assert clock.sleeps == pytest.approx([0.02] * 4)


@pytest.mark.asyncio
async def test_a_late_consumer_is_re_anchored_not_bursted() -> None:
    track, clock, _ = make_track()
    await track.recv()
    clock.t += 0.05  # 30 ms late: catch up without sleeping
    f = await track.recv()
    assert f.pts == FRAME
    clock.t += 1.0  # far behind: re-anchor, pts stays continuous
    f = await track.recv()
    assert f.pts == 2 * FRAME
    n_sleeps = len(clock.sleeps)
    before = clock.t
    f = await track.recv()
    assert f.pts == 3 * FRAME
    assert clock.t == pytest.approx(before + 0.02)  # paced again from the new anchor
    assert len(clock.sleeps) == n_sleeps + 1


@pytest.mark.asyncio
async def test_silence_when_idle_and_while_waiting_for_first_audio() -> None:
    track, _, events = make_track()
    assert not (await frames(track, 3)).any()
    track.open("u1")  # opened, no audio yet: silence, and no underrun either
    assert not (await frames(track, 3)).any()
    assert events == []


@pytest.mark.asyncio
async def test_utterances_play_in_start_order_without_gaps() -> None:
    track, clock, events = make_track()
    a, b = tone(1000, seed=1), tone(700, seed=2)
    track.open("a")
    track.open("b")
    track.push("b", PcmChunk(b, 0, 3, final=True))  # b's audio arrives first, still plays second
    track.push("a", PcmChunk(a[:600], 0, 2))
    track.push("a", PcmChunk(a[600:], 600, 5, final=True))
    out = await frames(track, 6)
    n = len(a) + len(b)
    assert np.array_equal(out[:n], np.concatenate([pcm_to_s16(a), pcm_to_s16(b)]))
    assert not out[n:].any()
    t0 = clock.t - 5 * 0.02
    played = [e for e in events if isinstance(e, Played)]
    assert played == [Played("a", 480), Played("a", 960), Played("a", 1000), Played("b", 440), Played("b", 700)]
    assert [e for e in events if not isinstance(e, Played)] == [
        Started("a", t0),
        Done("a", 1000, t0 + 0.04),  # a ends inside frame 3 (samples 960..1439) ...
        Started("b", t0 + 0.04),  # ... where b begins, in the same frame
        Done("b", 700, t0 + 0.06),
    ]
    assert track.queued_ids() == []


@pytest.mark.asyncio
async def test_cancel_fades_within_5ms_then_silence() -> None:
    track, clock, events = make_track()
    track.open("u")
    track.push("u", PcmChunk(np.full(SR, 0.5, np.float32), 0, 10))
    await frames(track, 3)
    reports = track.flush()
    assert [r.id for r in reports] == ["u"]
    after = await frames(track, 4)
    fade = after[:FADE]
    assert 0 < fade[0] <= 16383
    assert np.all(np.diff(fade.astype(np.int32)) <= 0)  # monotonically down
    assert fade[-1] == 0
    assert not after[FADE:].any()  # nothing after 5 ms, in this frame and every later one
    assert FADE == 120
    assert isinstance(events[-1], Silenced)
    assert events[-1].latency_s == pytest.approx(0.02)
    assert track.queued_ids() == []


@pytest.mark.asyncio
async def test_cancel_while_nothing_plays_is_silent_at_once() -> None:
    track, _, events = make_track()
    track.open("u")
    await frames(track, 2)
    reports = track.flush()
    assert reports[0].n_samples == 0 and reports[0].text_end == 0
    assert not (await frames(track, 2)).any()
    assert not any(isinstance(e, Silenced) for e in events)


@pytest.mark.asyncio
async def test_played_accounting_counts_only_samples_sent() -> None:
    track, _, _ = make_track()
    track.open("u")
    # Chunks of 500 samples covering 4, 9, 15 characters of input text.
    for i, text_end in enumerate((4, 9, 15)):
        track.push("u", PcmChunk(tone(500, seed=i), 500 * i, text_end))
    await frames(track, 2)  # 960 samples sent: all of chunk 0, 460 of chunk 1
    (report,) = track.flush()
    assert report.n_samples == 960
    assert report.played_ms == pytest.approx(40.0)
    assert report.text_end == 9  # the chunk holding the last sent sample


@pytest.mark.asyncio
async def test_flush_from_an_id_keeps_earlier_utterances() -> None:
    track, _, events = make_track()
    for uid in ("a", "b", "c"):
        track.open(uid)
    track.push("a", PcmChunk(tone(600, seed=1), 0, 1, final=True))
    track.push("b", PcmChunk(tone(600, seed=2), 0, 1, final=True))
    track.push("c", PcmChunk(tone(600, seed=3), 0, 1, final=True))
    reports = track.flush("b")
    assert [r.id for r in reports] == ["b", "c"]
    out = await frames(track, 3)
    assert np.array_equal(out[:600], pcm_to_s16(tone(600, seed=1)))  # a is untouched, no fade
    assert not out[600:].any()
    assert [type(e).__name__ for e in events] == ["Started", "Played", "Played", "Done"]
    assert track.flush("zzz") == []


@pytest.mark.asyncio
async def test_drop_of_a_failed_utterance_fades_and_the_next_moves_up() -> None:
    track, _, _ = make_track()
    track.open("a")
    track.open("b")
    track.push("a", PcmChunk(np.full(2000, 0.5, np.float32), 0, 1))
    track.push("b", PcmChunk(np.full(480, 0.25, np.float32), 0, 1, final=True))
    await frames(track, 1)
    report = track.drop("a")
    assert report is not None and report.n_samples == 480
    out = await frames(track, 2)
    assert np.all(np.diff(out[:FADE].astype(np.int32)) <= 0)
    assert np.all(out[FADE : FADE + 480] == pcm_to_s16(np.full(480, 0.25, np.float32)))
    assert not out[FADE + 480 :].any()


@pytest.mark.asyncio
async def test_underrun_is_reported_once_per_dry_spell() -> None:
    track, _, events = make_track()
    track.open("u")
    track.push("u", PcmChunk(tone(700), 0, 1))
    await frames(track, 4)
    track.push("u", PcmChunk(tone(100), 700, 2))
    await frames(track, 3)
    assert [e for e in events if isinstance(e, Underrun)] == [Underrun("u"), Underrun("u")]
    track.finish("u")
    await frames(track, 1)
    assert isinstance(events[-1], Done) and events[-1].n_samples == 800


@pytest.mark.asyncio
async def test_empty_utterance_ends_without_starting() -> None:
    track, _, events = make_track()
    track.open("u")
    track.push("u", PcmChunk(np.zeros(0, np.float32), 0, 3, final=True))
    await frames(track, 1)
    assert len(events) == 1
    assert isinstance(events[0], Done) and events[0].id == "u" and events[0].n_samples == 0


@pytest.mark.asyncio
async def test_wait_room_blocks_until_played_down() -> None:
    track, _, _ = make_track()
    track.open("u")
    track.push("u", PcmChunk(tone(2000), 0, 1))
    waiter = asyncio.get_running_loop().create_task(track.wait_room("u", 1000))
    await asyncio.sleep(0)
    assert not waiter.done()
    await frames(track, 2)  # 1040 left
    await asyncio.sleep(0)
    assert not waiter.done()
    await frames(track, 1)  # 560 left
    await asyncio.wait_for(waiter, 1)
    track.flush()
    await asyncio.wait_for(track.wait_room("u", 0), 1)  # gone: returns at once


@pytest.mark.asyncio
async def test_stopped_track_raises_media_stream_error() -> None:
    from aiortc.mediastreams import MediaStreamError

    track, _, _ = make_track()
    await track.recv()
    track.stop()
    with pytest.raises(MediaStreamError):
        await track.recv()


def test_open_twice_is_refused() -> None:
    track, _, _ = make_track()
    track.open("a")
    with pytest.raises(ValueError):
        track.open("a")


@pytest.mark.parametrize(
    ("text", "end", "complete", "heard"),
    [
        ("Hello world, how are you", 0, False, ""),
        ("Hello world, how are you", 5, False, "Hello"),
        ("Hello world, how are you", 8, False, "Hello"),  # mid "world": dropped
        ("Hello world, how are you", 12, False, "Hello world,"),
        ("Hello world, how are you", 24, False, "Hello world, how are"),  # "you" may still grow
        ("Hello world, how are you", 24, True, "Hello world, how are you"),
        ("Hello world, how are you", 99, True, "Hello world, how are you"),
        ("don't stop", 3, True, ""),
        ("你好世界", 2, False, "你好"),
        ("Say 你好 now", 5, False, "Say 你"),
    ],
)
def test_heard_text_cuts_at_word_boundaries(text: str, end: int, complete: bool, heard: str) -> None:
    assert heard_text(text, end, complete) == heard


# -- 48 kHz output -------------------------------------------------------------------------------


def test_upsampler_streaming_equals_one_pass() -> None:
    x = pcm_to_s16(tone(480 * 7, seed=5))
    up = Upsampler2x()
    streamed = np.concatenate([up.process(x[i : i + 480]) for i in range(0, len(x), 480)])
    one_pass = Upsampler2x().process(x)
    assert np.abs(streamed.astype(np.int32) - one_pass).max() <= 1  # float summation order only


def test_upsampler_keeps_the_band_and_rejects_images() -> None:
    n = SR  # one second
    t = np.arange(n) / SR
    x = pcm_to_s16(0.5 * np.sin(2 * np.pi * 1000 * t).astype(np.float32))
    y = Upsampler2x().process(x).astype(np.float64)[1000:-1000]  # skip the filter's edges
    spectrum = np.abs(np.fft.rfft(y * np.hanning(len(y))))
    freqs = np.fft.rfftfreq(len(y), 1 / (2 * SR))
    assert freqs[np.argmax(spectrum)] == pytest.approx(1000, abs=2)
    image = spectrum[(freqs > 22000) & (freqs < 24000)].max()  # the 1 kHz image sits at 23 kHz
    assert 20 * np.log10(image / spectrum.max()) < -60
    assert np.sqrt(np.mean(y**2)) / 32767 == pytest.approx(0.5 / np.sqrt(2), rel=0.02)
    assert not Upsampler2x().process(np.zeros(480, np.int16)).any()  # silence stays exact zero


@pytest.mark.asyncio
async def test_default_output_is_48khz_and_silent_right_after_a_cancel() -> None:
    clock = FakeClock()
    track = UtteranceTrack(sample_rate=SR, clock=clock)
    assert track.output_rate == 48000
    track.open("u")
    track.push("u", PcmChunk(np.full(SR, 0.5, np.float32), 0, 3))
    for i in range(3):
        f = await recv_frame(track)
        assert (f.samples, f.sample_rate, f.pts, f.time_base) == (960, 48000, 960 * i, fractions.Fraction(1, 48000))
    track.flush()
    after = np.concatenate([(await recv_frame(track)).to_ndarray().reshape(-1) for _ in range(3)])
    assert after[: 2 * FADE].any()
    assert not after[2 * FADE + Upsampler2x.TAPS :].any()  # the 5 ms fade, the filter's 2 ms, then zeros


def decode_opus(packets: list[Packet], rate: int) -> np.ndarray:
    """Decoded mono float32 of ``packets`` (libopus, as a receiver would)."""
    dec = CodecContext.create("libopus", "r")
    dec.sample_rate = rate
    dec.layout = "mono"
    dec.format = "s16"
    out = [f.to_ndarray().reshape(-1) for pk in packets for f in dec.decode(pk)]
    return np.concatenate(out).astype(np.float32) / 32768.0


@pytest.mark.parametrize("frame_ms", [10, 20])
def test_opus_encoder_makes_one_packet_per_frame_that_decodes_to_the_input(frame_ms: int) -> None:
    rate = 48000
    enc = OpusFrameEncoder(rate, frame_ms)
    n = rate * frame_ms // 1000
    t = np.arange(50 * n) / rate
    x = pcm_to_s16(0.3 * np.sin(2 * np.pi * 440 * t).astype(np.float32))
    packets = [enc.encode(s16_frame(x[i * n : (i + 1) * n], rate, 1000 + i * n)) for i in range(50)]
    assert [pk.pts for pk in packets] == [1000 + i * n for i in range(50)]  # the frames' own clock
    assert all(pk.time_base == fractions.Fraction(1, rate) for pk in packets)
    y = decode_opus(packets, rate)
    assert len(y) == len(x)  # one packet holds exactly one frame's duration
    body = y[rate // 10 :]
    spectrum = np.abs(np.fft.rfft(body * np.hanning(len(body))))
    assert np.fft.rfftfreq(len(body), 1 / rate)[np.argmax(spectrum)] == pytest.approx(440, abs=5)
    assert float(np.sqrt(np.mean(body**2))) == pytest.approx(0.3 / np.sqrt(2), rel=0.1)
    with pytest.raises(ValueError, match=f"expected {n} samples"):
        enc.encode(s16_frame(x[: n - 1], rate, 0))


@pytest.mark.asyncio
async def test_10ms_frames_are_paced_every_10ms_and_encoded_when_asked() -> None:
    clock = FakeClock()
    track = UtteranceTrack(sample_rate=SR, clock=clock, frame_ms=10, encode=True)
    assert track.frame_samples == SR // 100
    track.open("u")
    sine = 0.3 * np.sin(2 * np.pi * 440 * np.arange(SR // 5) / SR).astype(np.float32)
    track.push("u", PcmChunk(sine, 0, 3, final=True))  # 200 ms
    packets = [await recv_packet(track) for _ in range(30)]
    assert [pk.pts for pk in packets] == [480 * i for i in range(30)]  # 48 kHz RTP clock
    assert clock.sleeps == pytest.approx([0.01] * 29)
    y = decode_opus(packets, 48000)
    audible = np.flatnonzero(np.abs(y) > 0.05)
    # 200 ms of audio, shifted by the encoder's look-ahead (6.5 ms) and the upsampler's filter
    # (1 ms), and a codec tail of under 20 ms at its end.
    assert 5 < audible[0] / 48 < 10
    assert 199 < (audible[-1] - audible[0]) / 48 < 220


@pytest.mark.asyncio
async def test_a_cancel_is_silent_within_one_10ms_frame() -> None:
    clock = FakeClock()
    events: list[TrackEvent] = []
    track = UtteranceTrack(sample_rate=SR, clock=clock, on_event=events.append, output_rate=SR, frame_ms=10)
    track.open("u")
    track.push("u", PcmChunk(np.full(SR, 0.5, np.float32), 0, 3))
    await frames(track, 3)
    track.flush()
    after = await frames(track, 2)
    assert after[:FADE].any() and not after[FADE:].any()  # the 5 ms fade fits in the first frame
    silenced = [e for e in events if isinstance(e, Silenced)]
    assert len(silenced) == 1 and silenced[0].latency_s == pytest.approx(0.01)


def test_frame_ms_must_be_10_or_20() -> None:
    with pytest.raises(ValueError, match="frame_ms must be one of"):
        UtteranceTrack(sample_rate=SR, frame_ms=15)
    with pytest.raises(ValueError, match="frame_ms must be one of"):
        OpusFrameEncoder(48000, 5)


@pytest.mark.asyncio
async def test_a_frame_built_late_is_reported_with_its_lag() -> None:
    track, clock, events = make_track()
    await recv_frame(track)
    await recv_frame(track)  # on time
    assert not [e for e in events if isinstance(e, Late)]
    clock.t += 0.02 + 2 * LATE_S  # the loop was busy when the third frame fell due
    await recv_frame(track)
    late = [e for e in events if isinstance(e, Late)]
    assert len(late) == 1 and late[0].lag_s == pytest.approx(2 * LATE_S)
    clock.t += 1.0  # so late that the clock re-anchors: reported too
    await recv_frame(track)
    late = [e for e in events if isinstance(e, Late)]
    assert len(late) == 2 and late[1].lag_s == pytest.approx(1.0 - 0.02 + 2 * LATE_S)
    before = len(events)
    await recv_frame(track)  # paced again from the new anchor: on time
    assert not [e for e in events[before:] if isinstance(e, Late)]
