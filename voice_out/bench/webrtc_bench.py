"""WebRTC mode of ``voice-out bench``: the real server, reached over loopback by the aiortc client.

The server runs in this process on a free loopback port with the engine of the configuration
(or ``url`` names a running server). One session speaks ``reps`` utterances; in each:

* **end-to-end TTFA**: the first ``text.delta`` sent -> the first audible (non-silent) frame
  decoded by the client;
* **barge-in latency**: once the utterance has been audible for ``barge_after_s``, ``cancel``
  is sent -> the last audible frame decoded after it (0 when nothing audible follows; the
  utterance is over once ``quiet_s`` of silent frames follow).

Two clients (``client``):

* ``aiortc``: :mod:`voice_out.client`, in a process of its own (a listener is never in the
  server's process: sharing its event loop and GIL would make the server's frames late). A
  frame's time is when aiortc handed it over decoded,
  and aiortc's receiver holds about 4 packets in its jitter buffer before it plays (40 ms of
  the server's default 10 ms frames, 80 ms of 20 ms ones), so both figures include that hold;
  a browser's jitter buffer differs.
* ``chromium``: the demo page (web/) in headless Chromium (:mod:`voice_out.bench.chromium`),
  measuring itself as it does for a person (docs/browser.md): the page sends the deltas, hears
  the first audible 128-sample block in its WebAudio graph (AudioWorklet), barges in while it
  hears sound, and times the last audible block before 250 ms of silence; all on the page's
  own clock. WebRTC's statistics give the jitter-buffer delay of each utterance, so barge-in
  can be read against it (design: silence within the jitter-buffer delay + 40 ms).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import multiprocessing
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from voice_out.bench.chromium import Page, chromium, find_chromium
from voice_out.bench.engine_bench import (
    EngineBenchOptions,
    bench_config,
    gpu_name,
    load_engine,
    text_of,
    wait_warm,
)
from voice_out.bench.report import Report
from voice_out.client import ClientError, VoiceOutClient, connect
from voice_out.config import Config
from voice_out.server import protocol as p
from voice_out.server.app import METRICS_KEY, create_app
from voice_out.server.metrics import Metrics

QUANTILES = (0.5, 0.95, 0.99)
CLIENTS = ("aiortc", "chromium")
JITTER_NOTE = (
    "end-to-end figures are measured by the aiortc client (voice_out.client): a frame counts when "
    "aiortc hands it over decoded, and aiortc's receiver holds about 4 packets before it plays "
    "them (40 ms of 10 ms frames, 80 ms of 20 ms ones: the settings' frame_ms), so TTFA and "
    "barge-in include that hold"
)
CHROMIUM_NOTE = (
    "end-to-end figures are measured by the demo page in headless Chromium, on the page's clock: "
    "TTFA = its first text.delta sent -> the first audible 128-sample block (RMS at least the "
    "settings' audible_rms) of the decoded track in its WebAudio graph; barge-in = its cancel sent "
    "-> the end of the last audible block before 250 ms of silence; jitter_buffer = WebRTC's "
    "average jitter-buffer delay over the "
    "utterance (inbound-rtp jitterBufferDelay / jitterBufferEmittedCount between two readings); "
    "rtp_jitter = its RFC 3550 interarrival jitter at the utterance's end"
)


class NoBrowserError(ValueError):
    """``client="chromium"`` and no browser to launch."""


@dataclass(frozen=True)
class WebrtcBenchOptions:
    """What the WebRTC benchmark runs (defaults: the full run)."""

    reps: int = 10
    #: Untimed utterances first (the first use of each kernel and codec is not a benchmark).
    warmup_reps: int = 1
    tokens_per_text_token: int = 3
    threads: int = 0
    #: A running server to measure instead of one started here.
    url: str | None = None
    #: The voice every utterance names (None: the server's default voice).
    voice: str | None = None
    #: ``"fast_first"`` on every utterance's first delta (None: not sent; the server's default).
    fast_first: int | None = None
    text_chars: int = 100
    #: Characters per ``text.delta`` (the deltas are sent back to back).
    delta_chars: int = 4
    #: How long the utterance is audible before the benchmark barges in.
    barge_after_s: float = 0.5
    #: After a cancel, the utterance counts as over once this much silence follows its last
    #: audible frame at the client.
    quiet_s: float = 0.5
    prompt_tokens: int = 150
    timeout_s: float = 120.0
    #: Who listens: ``"aiortc"`` (voice_out.client) or ``"chromium"`` (the demo page).
    client: str = "aiortc"
    #: The Chromium binary for ``client="chromium"`` (None: :func:`find_chromium`).
    chromium: str | None = None
    #: Chromium: the RMS of a 128-sample block from which the page counts it audible. The page's
    #: own default (0.005, about -46 dBFS) suits speech; random weights can speak quieter (the
    #: tiny random model peaks at an RMS of ~0.002), so the benchmark listens from -60 dBFS.
    #: Opus-decoded digital silence stays far below either.
    audible_rms: float = 1e-3

    @classmethod
    def quick(cls, **overrides: object) -> WebrtcBenchOptions:
        import dataclasses

        base = cls(reps=1, warmup_reps=0, text_chars=40, barge_after_s=0.2, quiet_s=0.3, prompt_tokens=25)
        return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        if self.reps < 1:
            raise ValueError("reps must be >= 1")
        if self.client not in CLIENTS:
            raise ValueError(f"client must be one of {', '.join(CLIENTS)}, got {self.client!r}")

    def chromium_binary(self) -> str:
        """The browser ``client="chromium"`` launches (:class:`NoBrowserError` when there is none)."""
        if self.chromium is not None:
            found = shutil.which(self.chromium)
            if found is None:
                raise NoBrowserError(f"--chromium {self.chromium}: no such executable")
            return found
        binary = find_chromium()
        if binary is None:
            raise NoBrowserError(
                "--client chromium: no Chromium found (install chromium or chromium-headless-shell, "
                "or pass --chromium PATH or set VOICE_OUT_CHROMIUM)"
            )
        return binary


@dataclass(frozen=True)
class Utterance:
    """What one utterance measured (times in ms)."""

    ttfa_ms: float
    server_ttfa_ms: float
    barge_in_ms: float
    #: The client's average jitter-buffer delay over the utterance (Chromium only).
    jitter_buffer_ms: float | None = None
    #: The RTP interarrival jitter the client estimated at the utterance's end (RFC 3550,
    #: Chromium only): how irregularly the server's frames arrive.
    rtp_jitter_ms: float | None = None
    #: Frames the server built at least 5 ms late while this utterance ran (a server started
    #: here only).
    late_frames: int | None = None


@dataclass(frozen=True)
class LateFrames:
    """The frames the server built late over a whole run (warm-up included), from its
    ``voice_out_late_frame_seconds`` histogram: at least 5 ms late, and more than 20 ms."""

    over_5ms: int
    over_20ms: int


def late_frames(metrics: Metrics) -> LateFrames:
    """Read :class:`LateFrames` from a server's instruments."""
    r = metrics.registry
    total = r.get_sample_value("voice_out_late_frame_seconds_count") or 0.0
    within_20ms = r.get_sample_value("voice_out_late_frame_seconds_bucket", {"le": "0.02"}) or 0.0
    return LateFrames(int(total), int(total - within_20ms))


def parse_late_frames(exposition: str) -> LateFrames:
    """Read :class:`LateFrames` from a server's ``GET /metrics`` text."""
    total = within_20ms = 0.0
    for family in text_string_to_metric_families(exposition):
        if family.name != "voice_out_late_frame_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_count"):
                total = sample.value
            elif sample.name.endswith("_bucket") and sample.labels.get("le") == "0.02":
                within_20ms = sample.value
    return LateFrames(int(total), int(total - within_20ms))


async def fetch_late_frames(url: str) -> LateFrames:
    """The late frames of the server at ``url`` so far, from its ``/metrics``."""
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        resp.raise_for_status()
        return parse_late_frames(await resp.text())


#: The server's late frames so far, or None (not counted).
LateCount = Callable[[], Awaitable[int]] | None


async def _watched(late: LateCount, run: Awaitable[Utterance]) -> Utterance:
    """``run`` one utterance; with ``late``, it comes back with the count of frames the server
    built late meanwhile (``Utterance.late_frames``)."""
    before = await late() if late is not None else 0
    u = await run
    if late is None:
        return u
    return dataclasses.replace(u, late_frames=await late() - before)


async def _series(
    opts: WebrtcBenchOptions,
    log: Callable[[str], None],
    late: LateCount,
    one: Callable[[str], Awaitable[Utterance]],
    describe: Callable[[Utterance], str],
) -> tuple[list[Utterance], list[Utterance]]:
    """The warm-up utterances, then the measured ones (``one(uid)`` each), each logged with
    ``describe`` and its late frames; returns (warm-ups, measured)."""

    def note(u: Utterance) -> str:
        return describe(u) + ("" if u.late_frames is None else f", {u.late_frames} frames late")

    warm = []
    for i in range(opts.warmup_reps):
        warm.append(await _watched(late, one(f"warm{i}")))
        log(f"webrtc: warm-up utterance {i + 1}: {note(warm[-1])}")
    results = []
    for i in range(opts.reps):
        results.append(await _watched(late, one(f"u{i}")))
        log(f"webrtc: utterance {i + 1}/{opts.reps}: {note(results[-1])}")
    return warm, results


async def speak_and_barge_in(client: VoiceOutClient, uid: str, opts: WebrtcBenchOptions) -> Utterance:
    """One utterance: its end-to-end TTFA, the server's TTFA, and the barge-in latency."""
    text = text_of(opts.text_chars)
    deltas = [text[k : k + opts.delta_chars] for k in range(0, len(text), opts.delta_chars)]
    t_send = client.send_text(uid, deltas[0], voice=opts.voice, fast_first=opts.fast_first)
    for d in deltas[1:]:
        client.send_text(uid, d)
    client.done(uid)
    started = await client.wait_for(
        lambda m: (isinstance(m, p.AudioStarted) and m.id == uid) or isinstance(m, p.Error), timeout_s=opts.timeout_s
    )
    if isinstance(started, p.Error):
        raise ClientError(f"the server refused the utterance: {started.code}: {started.message}", code=started.code)
    assert isinstance(started, p.AudioStarted)
    deadline = time.monotonic() + opts.timeout_s
    while (first := client.first_audible(t_send)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError("no audible audio reached the client")
        await asyncio.sleep(0.005)
    await asyncio.sleep(max(0.0, first.t + opts.barge_after_s - time.monotonic()))
    t_cancel = client.cancel()
    await client.wait_for(
        lambda m: isinstance(m, p.Cancelled | p.AudioDone) and getattr(m, "id", None) == uid,
        timeout_s=opts.timeout_s,
    )
    # the track goes on sending frames (silence): wait until ``quiet_s`` of them follow the last
    # audible one, so that a long tail is measured, not cut off
    deadline = time.monotonic() + opts.timeout_s
    while True:
        frames = client.frames_since(t_cancel)
        last_frame = client.last_audible(t_cancel)
        last = t_cancel if last_frame is None else last_frame.t
        if frames and frames[-1].t - last >= opts.quiet_s:
            break
        if time.monotonic() > deadline:
            raise TimeoutError("the audio did not fall silent after the cancel")
        await asyncio.sleep(0.02)
    return Utterance(1000 * (first.t - t_send), started.ttfa_ms, 1000 * (last - t_cancel))


# Runs in the page: one utterance, start to barge-in, timed by the page itself. The cancel is
# sent at a moment the page hears sound (random weights pause now and then), once the
# utterance has been audible for bargeAfterMs; the result is read once the page hears silence
# and the server has confirmed the cancel.
PAGE_UTTERANCE = """(async (o) => {
  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
  const deadline = performance.now() + o.timeoutMs;
  const late = () => performance.now() > deadline;
  const before = await voiceOut.rtpStats();
  const id = voiceOut.speak(o.text, {voice: o.voice, fastFirst: o.fastFirst, deltaChars: o.deltaChars});
  const u = voiceOut.utterances[id];
  while (u.firstAudibleAt === null) {
    if (u.status === "error") return {id, error: `the server refused it: ${JSON.stringify(u.error)}`};
    if (late()) return {id, error: "no audible audio reached the page"};
    await sleep(1);
  }
  while (performance.now() < u.firstAudibleAt + o.bargeAfterMs ||
         !(voiceOut.audio.lastAudibleEnd > performance.now() - 20)) {
    if (u.status === "done") return {id, error: "the utterance ended before the barge-in"};
    if (late()) return {id, error: "no audible moment to barge in on"};
    await sleep(1);
  }
  const bargeIn = voiceOut.cancel(null, "bench");
  while (bargeIn.silenceAt === null || u.status !== "cancelled") {
    if (late()) return {id, error: "no silence (or no cancelled event) after the cancel"};
    await sleep(5);
  }
  const after = await voiceOut.rtpStats();
  return {id, pageTtfaMs: u.pageTtfaMs, serverTtfaMs: u.serverTtfaMs, bargeInMs: bargeIn.ms, before, after};
})"""


def jitter_buffer_ms(before: dict[str, Any] | None, after: dict[str, Any] | None) -> float | None:
    """The average jitter-buffer delay (ms) of the samples played between two ``rtpStats()``
    readings of the page; None when either is missing or nothing was played."""
    if not before or not after:
        return None
    emitted = after["jitterBufferEmittedCount"] - before["jitterBufferEmittedCount"]
    if emitted <= 0:
        return None
    return 1000.0 * (after["jitterBufferDelayS"] - before["jitterBufferDelayS"]) / emitted


async def page_utterance(page: Page, opts: WebrtcBenchOptions) -> Utterance:
    """One utterance spoken, heard and interrupted by the demo page (see PAGE_UTTERANCE)."""
    args = {
        "text": text_of(opts.text_chars),
        "voice": opts.voice,
        "fastFirst": opts.fast_first,
        "deltaChars": opts.delta_chars,
        "bargeAfterMs": 1000 * opts.barge_after_s,
        "timeoutMs": 1000 * opts.timeout_s,
    }
    r = await page.evaluate(f"{PAGE_UTTERANCE}({json.dumps(args)})", timeout_s=opts.timeout_s + 10)
    if r.get("error"):
        raise ClientError(f"utterance {r['id']}: {r['error']}")
    before, after = r.get("before"), r.get("after")
    return Utterance(
        r["pageTtfaMs"],
        r["serverTtfaMs"],
        r["bargeInMs"],
        jitter_buffer_ms(before, after),
        after.get("jitterMs") if after else None,
    )


async def _measure_chromium(
    url: str,
    opts: WebrtcBenchOptions,
    binary: str,
    log: Callable[[str], None],
    settings: dict[str, Any],
    late: LateCount,
) -> tuple[list[Utterance], list[Utterance]]:
    """The utterances through the demo page in ``binary`` (warm-ups, measured); the browser's
    version goes into ``settings["browser"]``."""
    with tempfile.TemporaryDirectory(prefix="voice-out-bench-chromium-") as profile:
        async with chromium(Path(profile), binary) as page:
            settings["browser"] = page.version
            log(f"webrtc: {page.version} ({binary}) opens {url}/")
            await page.send("Page.navigate", {"url": url + "/"})
            await page.wait_for("window.voiceOut && window.voiceOut.loaded", 30, "the demo page to load")
            await page.evaluate("voiceOut.connect()")
            await page.evaluate(f"voiceOut.audio.threshold = {float(opts.audible_rms)!r}")
            return await _series(
                opts,
                log,
                late,
                lambda _uid: page_utterance(page, opts),
                lambda r: (
                    f"TTFA {r.ttfa_ms:.0f} ms in the page (server {r.server_ttfa_ms:.0f} ms), "
                    f"barge-in {r.barge_in_ms:.0f} ms"
                ),
            )


async def _measure(
    url: str, opts: WebrtcBenchOptions, log: Callable[[str], None], late: LateCount
) -> tuple[list[Utterance], list[Utterance]]:
    client = await connect(url, timeout_s=opts.timeout_s)
    try:
        return await _series(
            opts,
            log,
            late,
            lambda uid: speak_and_barge_in(client, uid, opts),
            lambda r: f"TTFA {r.ttfa_ms:.0f} ms",
        )
    finally:
        await client.close()


def _stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _client_process(url: str, opts: WebrtcBenchOptions, count_late: bool) -> tuple[list[Utterance], list[Utterance]]:
    """The aiortc client's series in a process of its own (see :func:`_measure_apart`)."""

    async def late() -> int:
        return (await fetch_late_frames(url)).over_5ms

    return asyncio.run(_measure(url, opts, _stderr_log, late if count_late else None))


async def _measure_apart(
    url: str, opts: WebrtcBenchOptions, count_late: bool
) -> tuple[list[Utterance], list[Utterance]]:
    """:func:`_measure` in a child process: the client's Opus decoding, jitter buffer and RMS
    checks then neither share the server's event loop nor contend for its GIL, so a frame the
    server sends late is the server's doing (a listener's browser is never in the server's
    process either). The child counts late frames through the server's ``/metrics``."""
    loop = asyncio.get_running_loop()
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return await loop.run_in_executor(pool, _client_process, url, opts, count_late)


@dataclass(frozen=True)
class Run:
    """What one run measured: the utterances (warm-ups, measured), the server's late frames over
    the whole run, and the engine's own time to first audio of each measured utterance (s),
    for a server started here."""

    warm: list[Utterance]
    results: list[Utterance]
    late: LateFrames | None = None
    engine_ttfa_s: list[float] | None = None


async def _run(
    cfg: Config,
    opts: WebrtcBenchOptions,
    log: Callable[[str], None],
    measure: Callable[[str, LateCount], Awaitable[tuple[list[Utterance], list[Utterance]]]],
) -> Run:
    """``measure`` the server at ``opts.url`` (no late-frame count), or at one started here
    (its base URL, and a count of its late frames)."""
    if opts.url is not None:
        return Run(*await measure(opts.url.rstrip("/"), None))
    eopts = EngineBenchOptions(
        streams=(1,),
        tokens_per_text_token=opts.tokens_per_text_token,
        prompt_tokens=opts.prompt_tokens,
        long_chars=opts.text_chars,
        threads=opts.threads,
    )
    bcfg = bench_config(cfg, eopts)
    engine = load_engine(bcfg, eopts)
    app = create_app(bcfg, engine, None)
    runner = web.AppRunner(app)
    await runner.setup()  # enters the engine: worker started and warm
    await asyncio.to_thread(wait_warm, engine, 900.0)  # and its start-up work after ready done
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        log(f"webrtc: server on http://{host}:{port}")
        metrics = app[METRICS_KEY]

        async def late() -> int:
            return late_frames(metrics).over_5ms

        before = engine.stats().first_audio_count
        warm, results = await measure(f"http://{host}:{port}", late)
        stats = engine.stats()
        # one session speaks one utterance at a time: the engine's latest traces are its streams'
        # first audio, in order; the measured ones are the last len(results)
        traces = list(stats.first_audio)[-len(results) :] if stats.first_audio_count - before >= len(results) else []
        engine_ttfa = [t.total_s for t in traces] if len(traces) == len(results) else None
        return Run(warm, results, late_frames(metrics), engine_ttfa)
    finally:
        with contextlib.suppress(Exception):
            await runner.cleanup()


def run_webrtc_bench(cfg: Config, opts: WebrtcBenchOptions, command: str, log: Callable[[str], None]) -> Report:
    """Measure end-to-end TTFA and barge-in latency; returns the report
    (:class:`NoBrowserError` before anything starts when ``client="chromium"`` finds no browser)."""
    binary = opts.chromium_binary() if opts.client == "chromium" else None
    if opts.threads > 0:
        import torch

        torch.set_num_threads(opts.threads)
    report = Report("webrtc", "remote server" if opts.url else gpu_name(cfg), command)
    report.settings.update(
        model="(the server's)" if opts.url else cfg.model.model,
        reps=opts.reps,
        text_chars=opts.text_chars,
        delta_chars=opts.delta_chars,
        barge_after_s=opts.barge_after_s,
        tokens_per_text_token=opts.tokens_per_text_token,
        fast_first=opts.fast_first,
        client=opts.client,
    )

    async def measure(url: str, late: LateCount) -> tuple[list[Utterance], list[Utterance]]:
        if binary is None:
            return await _measure_apart(url, opts, late is not None)
        return await _measure_chromium(url, opts, binary, log, report.settings, late)

    if binary is not None:
        report.settings.update(audible_rms=opts.audible_rms)
    if opts.url is None:
        report.settings.update(frame_ms=cfg.server.frame_ms)
    report.notes.append(JITTER_NOTE if binary is None else CHROMIUM_NOTE)
    run = asyncio.run(_run(cfg, opts, log, measure))
    warm, results, late = run.warm, run.results, run.late
    # The two clients measure differently, so their figures have names of their own.
    prefix = "e2e" if binary is None else f"e2e.{opts.client}"
    report.add_quantiles(f"{prefix}.ttfa", [r.ttfa_ms for r in results], "ms", 1, QUANTILES)
    report.add_quantiles(f"{prefix}.server_ttfa", [r.server_ttfa_ms for r in results], "ms", 1, QUANTILES)
    report.add_quantiles(f"{prefix}.barge_in", [r.barge_in_ms for r in results], "ms", 1, QUANTILES)
    # the session's first utterance (the first warm-up): what a fresh server's first listener
    # waits, first-use costs included, which the quantiles leave out
    first = (warm or results)[0]
    report.add(f"{prefix}.first_ttfa", first.ttfa_ms, "ms", 1)
    report.add(f"{prefix}.first_server_ttfa", first.server_ttfa_ms, "ms", 1)
    buffered = [(r.barge_in_ms, r.jitter_buffer_ms) for r in results if r.jitter_buffer_ms is not None]
    report.add_quantiles(f"{prefix}.jitter_buffer", [jb for _, jb in buffered], "ms", 1, QUANTILES)
    over = [barge_in - jb for barge_in, jb in buffered]
    report.add_quantiles(f"{prefix}.barge_in_over_jitter_buffer", over, "ms", 1, QUANTILES)
    jitter = [r.rtp_jitter_ms for r in results if r.rtp_jitter_ms is not None]
    report.add_quantiles(f"{prefix}.rtp_jitter", jitter, "ms", 1, QUANTILES)
    if run.engine_ttfa_s is not None:
        # the engine's own first audio of the same utterances (its first text to its first PCM),
        # and what the server adds to it: the hop to the event loop and the wait for a frame
        engine_ms = [1000 * t for t in run.engine_ttfa_s]
        report.add_quantiles("engine.ttfa", engine_ms, "ms", 1, QUANTILES)
        over = [r.server_ttfa_ms - e for r, e in zip(results, engine_ms, strict=True)]
        report.add_quantiles(f"{prefix}.server_ttfa_over_engine", over, "ms", 1, QUANTILES)
    if late is not None:
        report.add("server.late_frames", late.over_5ms, "count", 1)
        report.add("server.late_frames.over_20ms", late.over_20ms, "count", 1)
        report.add("server.late_frames.warmup", sum(w.late_frames or 0 for w in warm), "count", 1)
        report.add("server.late_frames.utterance.max", max(r.late_frames or 0 for r in results), "count", 1)
    return report
