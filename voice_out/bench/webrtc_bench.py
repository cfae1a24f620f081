"""WebRTC mode of ``voice-out bench``: the real server, reached over loopback by the aiortc client.

The server runs in this process on a free loopback port with the engine of the configuration
(or ``url`` names a running server). One session speaks ``reps`` utterances; in each:

* **end-to-end TTFA**: the first ``text.delta`` sent -> the first audible (non-silent) frame
  decoded by the client;
* **barge-in latency**: once the utterance has been audible for ``barge_after_s``, ``cancel``
  is sent -> the last audible frame decoded after it (0 when nothing audible follows; the
  utterance is over once ``quiet_s`` of silent frames follow).

The client is :mod:`voice_out.client` (aiortc): a frame's time is when aiortc handed it over
decoded, and aiortc's receiver holds about 4 frames (80 ms) in its jitter buffer before it
plays, so both figures include that hold; a browser's jitter buffer differs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from voice_out.bench.engine_bench import EngineBenchOptions, bench_config, gpu_name, load_engine, text_of
from voice_out.bench.report import Report
from voice_out.client import ClientError, VoiceOutClient, connect
from voice_out.config import Config
from voice_out.server import protocol as p
from voice_out.server.app import create_app

QUANTILES = (0.5, 0.95, 0.99)
JITTER_NOTE = (
    "end-to-end figures are measured by the aiortc client (voice_out.client): a frame counts when "
    "aiortc hands it over decoded, and aiortc's receiver holds about 4 frames (80 ms) before it "
    "plays them, so TTFA and barge-in include that hold"
)


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

    @classmethod
    def quick(cls, **overrides: object) -> WebrtcBenchOptions:
        import dataclasses

        base = cls(reps=1, warmup_reps=0, text_chars=40, barge_after_s=0.2, quiet_s=0.3, prompt_tokens=25)
        return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        if self.reps < 1:
            raise ValueError("reps must be >= 1")


@dataclass(frozen=True)
class Utterance:
    ttfa_ms: float
    server_ttfa_ms: float
    barge_in_ms: float


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


async def _measure(url: str, opts: WebrtcBenchOptions, log: Callable[[str], None]) -> list[Utterance]:
    client = await connect(url, timeout_s=opts.timeout_s)
    try:
        for i in range(opts.warmup_reps):
            await speak_and_barge_in(client, f"warm{i}", opts)
        results = []
        for i in range(opts.reps):
            results.append(await speak_and_barge_in(client, f"u{i}", opts))
            log(f"webrtc: utterance {i + 1}/{opts.reps}: TTFA {results[-1].ttfa_ms:.0f} ms")
        return results
    finally:
        await client.close()


async def _run(cfg: Config, opts: WebrtcBenchOptions, log: Callable[[str], None]) -> list[Utterance]:
    if opts.url is not None:
        return await _measure(opts.url, opts, log)
    eopts = EngineBenchOptions(
        streams=(1,),
        tokens_per_text_token=opts.tokens_per_text_token,
        prompt_tokens=opts.prompt_tokens,
        long_chars=opts.text_chars,
        threads=opts.threads,
    )
    bcfg = bench_config(cfg, eopts)
    engine = load_engine(bcfg, eopts)
    runner = web.AppRunner(create_app(bcfg, engine, None))
    await runner.setup()  # enters the engine: worker started and warm
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        log(f"webrtc: server on http://{host}:{port}")
        return await _measure(f"http://{host}:{port}", opts, log)
    finally:
        with contextlib.suppress(Exception):
            await runner.cleanup()


def run_webrtc_bench(cfg: Config, opts: WebrtcBenchOptions, command: str, log: Callable[[str], None]) -> Report:
    """Measure end-to-end TTFA and barge-in latency; returns the report."""
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
    )
    report.notes.append(JITTER_NOTE)
    results = asyncio.run(_run(cfg, opts, log))
    report.add_quantiles("e2e.ttfa", [r.ttfa_ms for r in results], "ms", 1, QUANTILES)
    report.add_quantiles("e2e.server_ttfa", [r.server_ttfa_ms for r in results], "ms", 1, QUANTILES)
    report.add_quantiles("e2e.barge_in", [r.barge_in_ms for r in results], "ms", 1, QUANTILES)
    return report
