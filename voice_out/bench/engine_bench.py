"""Engine mode of ``voice-out bench``: the in-process engine, no transport.

Scenarios (``EngineBenchOptions.scenarios``), in the order they run:

``cold``      process start -> engine ready, in a fresh ``python -c`` process with the same
              options (weights built or loaded, warm-up and any graph capture included).
``ttfa``      engine TTFA with the whole text known: 1 stream, ``reps`` times; first text in ->
              first PCM chunk out (the stream is cancelled at its first chunk).
``stream``    engine TTFA with text arriving at each of ``text_rates`` text tokens/s, in deltas
              of about one text token each, paced by the clock.
``capacity``  for each stream count: that many streams (started over ``ramp_s``), each with a
              simulated real-time listener that acknowledges what it has played; TTFA, underruns,
              RTF per stream; capacity = the largest count with zero underruns, no failed
              stream, and p95 TTFA within ``ttfa_target_ms``.
``rtf``       one stream, one long text, consumed as fast as it comes: synthesis time / audio time.
``memory``    peak GPU memory (allocated and reserved by torch) on CUDA; peak host RSS.

Random weights (``random:*``) never say EOS sensibly: the LLM is made to emit
``tokens_per_text_token`` speech tokens per text token (forced tokens: same compute, scripted
token ids). Text tokens are the engine's own: bytes for ``random:*`` models (they have no BPE
tokenizer), Qwen2 BPE tokens for a real model directory.

This module imports torch and the engine, never aiortc or av.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

import voice_out
from voice_out.bench.listener import Listener, percentile, run_stream
from voice_out.bench.report import Report
from voice_out.config import Config, load_config, parse_overrides
from voice_out.engine.api import SAMPLE_RATE, EngineLike, StreamClosedError
from voice_out.engine.build import BuildOptions, resolve_device
from voice_out.engine.engine import Engine, EngineStats
from voice_out.engine.scheduler import FirstAudioTrace, ForcedTokens

#: What an agent says: the benchmark's text, repeated to any length.
TEXT = (
    "Sure! I can help with that. Your order shipped this morning, and it should arrive on Thursday "
    "before noon. Would you like me to send the tracking link to your phone, or to your email address? "
    "I can also set a reminder for the delivery window if that helps. "
)
SCENARIOS = ("cold", "ttfa", "stream", "capacity", "rtf", "memory")
DEFAULT_STREAMS = (1, 2, 4, 8, 16, 32, 48, 64)
QUANTILES = (0.5, 0.95, 0.99)
#: Quantiles reported for each phase of the first audio (``capacity.ttfa_parts``).
PART_QUANTILES = (0.5, 0.95)
GIB = 2**30


def text_of(chars: int) -> str:
    return (TEXT * (chars // len(TEXT) + 1))[:chars]


@dataclass(frozen=True)
class EngineBenchOptions:
    """What the engine benchmark runs (defaults: the full GPU run)."""

    streams: tuple[int, ...] = DEFAULT_STREAMS
    #: Repetitions of each single-stream TTFA measurement.
    reps: int = 30
    #: Speech tokens per text token (forced; 0: let the model say EOS, real weights only).
    tokens_per_text_token: int = 3
    ttfa_target_ms: float = 150.0
    #: Text arrival rates (text tokens/s) of the ``stream`` scenario.
    text_rates: tuple[float, ...] = (20.0, 60.0)
    ttfa_chars: int = 100
    capacity_chars: int = 100
    long_chars: int = 400
    #: The capacity streams start evenly spread over this many seconds.
    ramp_s: float = 1.0
    #: Speech tokens of the synthetic voice prompt of random models.
    prompt_tokens: int = 150
    #: torch CPU threads (0: torch's default).
    threads: int = 0
    scenarios: tuple[str, ...] = SCENARIOS
    #: Fast-path plan choices set by hand (``voice_out.fast.plan.Plan`` field, value), e.g.
    #: (("capability", "8.9"),): the bench's ``--pin NAME=VALUE``.
    pins: tuple[tuple[str, Any], ...] = ()
    #: Longest wait for one measurement (a stream that never speaks fails the run).
    timeout_s: float = 600.0

    @classmethod
    def quick(cls, **overrides: Any) -> EngineBenchOptions:
        """Small repetitions and short texts: a smoke run that finishes in seconds on a CPU."""
        base = cls(reps=2, ttfa_chars=12, capacity_chars=10, long_chars=24, ramp_s=0.0, prompt_tokens=25)
        return dataclasses.replace(base, **overrides)

    def __post_init__(self) -> None:
        unknown = set(self.scenarios) - set(SCENARIOS)
        if unknown:
            raise ValueError(f"unknown scenarios {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
        if not self.streams or min(self.streams) < 1:
            raise ValueError(f"stream counts must be positive integers, got {self.streams}")
        if self.reps < 1:
            raise ValueError("reps must be >= 1")
        if min(self.text_rates, default=1.0) <= 0:
            raise ValueError("text rates must be positive")

    def kv_len(self) -> int:
        """KV positions per stream for the longest text: voice prompt + text + speech tokens."""
        per_text = 1 + (max(self.tokens_per_text_token, 3) if self.tokens_per_text_token else 20)
        longest = max(self.ttfa_chars, self.capacity_chars, self.long_chars)
        need = self.prompt_tokens + self.prompt_tokens // 3 + longest * per_text + 128
        return -(-need // 256) * 256


def bench_config(cfg: Config, opts: EngineBenchOptions) -> Config:
    """``cfg`` with KV slots for the largest stream count and room for the long text; random
    models use their built-in voice only (no voice store is read)."""
    engine = dataclasses.replace(
        cfg.engine,
        max_streams=max(opts.streams),
        max_text_chars=max(cfg.engine.max_text_chars, opts.long_chars, opts.ttfa_chars, opts.capacity_chars),
    )
    server = cfg.server
    if cfg.model.model.startswith("random:"):
        server = dataclasses.replace(server, voices_dir=str(Path(os.devnull) / "none"), default_voice=None)
    return Config(model=cfg.model, engine=engine, server=server)


def engine_from_args(
    model: str, device: str, sets: Sequence[str], opts: EngineBenchOptions, **engine_overrides: Any
) -> Engine:
    """The engine a measuring script loads (not started): ``model`` on ``device`` with the
    ``SECTION.FIELD=VALUE`` overrides ``sets`` and then ``engine_overrides`` (engine fields), as
    :func:`bench_config` and :func:`load_engine` make it for ``opts``."""
    over = parse_overrides([f"model.model={model}", f"model.device={device}", *sets])
    over.setdefault("engine", {}).update(engine_overrides)
    return load_engine(bench_config(load_config(None, environ={}, overrides=over), opts), opts)


def build_options(opts: EngineBenchOptions) -> BuildOptions:
    """The benchmark's engine build: forced tokens, its KV length, the synthetic voice's
    prompt, no text normalizer, the plan choices pinned by ``--pin``."""
    forced = ForcedTokens(opts.tokens_per_text_token) if opts.tokens_per_text_token > 0 else None
    return BuildOptions(
        forced=forced,
        kv_len=opts.kv_len(),
        noise_prompt_tokens=opts.prompt_tokens,
        text_normalizer="none",
        pins=dict(opts.pins),
    )


def load_engine(cfg: Config, opts: EngineBenchOptions) -> Engine:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the loud random-weights warning (logged as well)
        return Engine.load(cfg, options=build_options(opts))


def device_used(device: torch.device) -> int:
    """Bytes in use on ``device`` as the driver counts them (``cudaMemGetInfo``: this process's
    CUDA context, allocator, graphs and libraries, and any other process on the card)."""
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free)


def gpu_name(cfg: Config) -> str:
    device = resolve_device(cfg.model.device)
    if device.type == "cuda" and torch.cuda.is_available():
        return str(torch.cuda.get_device_name(device))
    return "cpu"


# --------------------------------------------------------------------------------------------
# cold start: a fresh process


def warming(engine: Any) -> bool:
    """Whether ``engine`` (in process: ``Engine.warming``; in a process of its own: its
    ``stats()``) still runs start-up work after ready."""
    flag = getattr(engine, "warming", None)
    if flag is not None:
        return bool(flag)
    stats = getattr(engine, "stats", None)
    return bool(getattr(stats(), "warming", False)) if callable(stats) else False


def wait_warm(engine: Any, timeout_s: float) -> float:
    """Block until the engine's start-up work after ready has ended (``EngineStats.warming``);
    seconds waited. Any thread (it polls the worker's published stats)."""
    t0 = time.perf_counter()
    while warming(engine):
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"the engine's start-up work after ready did not end within {timeout_s:.0f} s")
        time.sleep(0.02)
    return time.perf_counter() - t0


def cold_start_child(spec_json: str) -> None:
    """Run in the fresh process: load and start the engine, print ``READY {json}`` when it is
    ready and ``WARM {json}`` when its start-up work after ready has ended, close."""
    t0 = time.perf_counter()
    spec = json.loads(spec_json)
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["options"].items()}
    opts = EngineBenchOptions(**fields)
    if opts.threads > 0:
        torch.set_num_threads(opts.threads)
    engine = load_engine(load_config(None, environ={}, overrides=spec["config"]), opts)
    t1 = time.perf_counter()
    engine.start(timeout=opts.timeout_s)
    t2 = time.perf_counter()
    print("READY " + json.dumps({"load_s": t1 - t0, "start_s": t2 - t1}), flush=True)
    print("WARM " + json.dumps({"after_ready_s": wait_warm(engine, opts.timeout_s)}), flush=True)
    engine.close(timeout=60)


def measure_cold_start(cfg: Config, opts: EngineBenchOptions) -> tuple[float, dict[str, float]]:
    """Seconds from spawning ``python -c`` to its engine being ready, and the child's breakdown."""
    spec = json.dumps({"config": dataclasses.asdict(cfg), "options": dataclasses.asdict(opts)})
    code = "import sys; from voice_out.bench.engine_bench import cold_start_child; cold_start_child(sys.argv[1])"
    env = dict(os.environ)
    root = str(Path(voice_out.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-c", code, spec], stdout=subprocess.PIPE, stderr=err, text=True, env=env
        )
        assert proc.stdout is not None
        killer = threading.Timer(opts.timeout_s, proc.kill)  # a hung child cannot hang the benchmark
        killer.start()
        ready: dict[str, float] | None = None
        elapsed = 0.0
        try:
            for line in proc.stdout:
                if line.startswith("READY "):
                    elapsed = time.perf_counter() - t0
                    ready = json.loads(line[6:])
                elif line.startswith("WARM ") and ready is not None:
                    ready["warm_s"] = time.perf_counter() - t0
                    break
            rc = proc.wait()  # the child closes its engine and exits
        finally:
            killer.cancel()
            proc.stdout.close()
        if ready is None or rc != 0:
            err.seek(0)
            tail = err.read()[-2000:]
            raise RuntimeError(f"the cold-start process failed (exit {rc}):\n{tail}")
    return elapsed, ready


# --------------------------------------------------------------------------------------------
# single-stream TTFA


async def first_chunk_s(engine: Engine, seed: int, deltas: list[str], interval_s: float, timeout_s: float) -> float:
    """Feed ``deltas`` (one every ``interval_s``, by the clock), then ``end_text``; seconds from
    the first delta to the first chunk; the stream is cancelled there and the engine drained."""
    loop = asyncio.get_running_loop()
    stream = engine.open_stream(seed=seed)
    t_sent: list[float] = []

    async def feed() -> None:
        with contextlib.suppress(StreamClosedError):
            for n, delta in enumerate(deltas):
                if n:
                    await asyncio.sleep(max(0.0, t_sent[0] + n * interval_s - loop.time()))
                else:
                    t_sent.append(loop.time())
                stream.push_text(delta)
            stream.end_text()

    feeder = asyncio.create_task(feed())

    async def first() -> float:
        async for _chunk in stream:
            return loop.time()
        raise RuntimeError(f"the stream ended without audio ({stream.state.value})")

    try:
        t_first = await asyncio.wait_for(first(), timeout_s)
    finally:
        stream.cancel()
        feeder.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await feeder
    await engine.await_idle()
    return t_first - t_sent[0]


def token_deltas(engine: Engine, text: str) -> tuple[list[str], float]:
    """``text`` cut into deltas of about one of the engine's text tokens; characters per token."""
    n_tokens = max(1, len(engine.voices.encode(text)))
    chars_per_token = len(text) / n_tokens
    step = max(1, round(chars_per_token))
    return [text[k : k + step] for k in range(0, len(text), step)], chars_per_token


# --------------------------------------------------------------------------------------------
# capacity


@dataclass
class CapacityRound:
    streams: int
    listeners: list[Listener]
    failures: int
    #: Engine steps in the round, the seconds the worker spent in them, and the wall time.
    steps: int
    busy_s: float
    wall_s: float
    gpu_max_allocated_gib: float | None
    #: The engine's first-audio traces of the round's streams (where each TTFA went).
    first_audio: tuple[FirstAudioTrace, ...] = ()

    @property
    def ttfa_ms(self) -> list[float]:
        return [1000 * t for lis in self.listeners if (t := lis.ttfa_s) is not None]

    @property
    def underruns(self) -> int:
        return sum(lis.underruns for lis in self.listeners)

    @property
    def mean_step_ms(self) -> float:
        return 1000 * self.busy_s / max(self.steps, 1)

    @property
    def busy_fraction(self) -> float:
        return self.busy_s / max(self.wall_s, 1e-9)


class MeasuredEngine(EngineLike, Protocol):
    """What a capacity round needs of an engine: the in-process :class:`Engine`, or a
    placement over several (``voice_out.bench.placement_bench``)."""

    def stats(self) -> EngineStats: ...

    async def await_idle(self) -> None: ...


async def capacity_round(
    engine: MeasuredEngine, n: int, text: str, opts: EngineBenchOptions, device: torch.device | None
) -> CapacityRound:
    """``n`` streams of ``text`` started over ``opts.ramp_s``, each with a real-time listener.
    ``device``: whose peak memory the round reports (None: none)."""
    if device is not None and device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = engine.stats()
    t0 = time.perf_counter()
    tasks = [run_stream(engine, i, text, 0.0, opts.ramp_s * i / n) for i in range(n)]
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), opts.timeout_s)
    after = engine.stats()
    wall = time.perf_counter() - t0  # after the stats: every step they count ran within the wall time
    await engine.await_idle()
    listeners = [r for r in results if isinstance(r, Listener)]
    traced = after.first_audio_count - before.first_audio_count
    return CapacityRound(
        streams=n,
        listeners=listeners,
        failures=n - len(listeners),
        steps=after.steps - before.steps,
        busy_s=after.busy_s - before.busy_s,
        wall_s=wall,
        gpu_max_allocated_gib=(
            torch.cuda.max_memory_allocated(device) / GIB if device is not None and device.type == "cuda" else None
        ),
        first_audio=after.first_audio[-traced:] if traced > 0 else (),
    )


def report_round(report: Report, r: CapacityRound, target_ms: float) -> bool:
    """Add one round's figures; True when the round met the capacity criteria: every stream
    spoke, zero underruns, p95 TTFA within ``target_ms``."""
    n = r.streams
    ttfa, underruns = r.ttfa_ms, r.underruns
    rtf = [x for lis in r.listeners if (x := lis.rtf) is not None]
    report.add_quantiles("capacity.ttfa", ttfa, "ms", n, QUANTILES)
    report.add("capacity.underruns", underruns, "count", n)
    report.add("capacity.streams_with_underruns", sum(1 for lis in r.listeners if lis.underruns), "streams", n)
    report.add("capacity.stall_ms.max", 1000 * max((lis.stall_s for lis in r.listeners), default=0.0), "ms", n)
    report.add("capacity.failed_streams", r.failures, "streams", n)
    if rtf:
        report.add("capacity.rtf.p50", percentile(rtf, 0.5), "x", n)
        report.add("capacity.rtf.max", max(rtf), "x", n)
    audio = [lis.audio_s for lis in r.listeners]
    report.add("capacity.audio_s_per_stream", sum(audio) / max(len(audio), 1), "s", n)
    if sum(audio) > 0:
        # worker seconds per second of audio: the batched compute one second of a stream costs
        report.add("capacity.compute_rtf", r.busy_s / sum(audio), "x", n)
    report.add("capacity.worker_busy", r.busy_fraction, "fraction", n)
    report.add("capacity.step_ms.mean", r.mean_step_ms, "ms", n)
    if r.gpu_max_allocated_gib is not None:
        report.add("capacity.gpu_mem.max_allocated", r.gpu_max_allocated_gib, "GiB", n)
    for part, values in ttfa_parts(r.first_audio).items():
        unit = "count" if part == "llm_steps" else "ms"
        report.add_quantiles(f"capacity.ttfa_parts.{part}", values, unit, n, PART_QUANTILES)
    return r.failures == 0 and underruns == 0 and len(ttfa) == n and percentile(ttfa, 0.95) <= target_ms


def ttfa_parts(traces: Sequence[FirstAudioTrace]) -> dict[str, list[float]]:
    """The phases of the streams' time to first audio (``FirstAudioTrace``), ms, and the LLM
    steps each first chunk waited for."""
    return {
        "slot": [1000 * t.slot_s for t in traces],
        "tokens": [1000 * t.tokens_s for t in traces],
        "queue": [1000 * t.queue_s for t in traces],
        "vocode": [1000 * t.vocode_s for t in traces],
        "llm_steps": [float(t.llm_steps) for t in traces],
    }


def round_summary(r: CapacityRound) -> str:
    ttfa = r.ttfa_ms
    parts = ttfa_parts(r.first_audio)
    mean = {k: sum(v) / len(v) for k, v in parts.items() if v}
    split = (
        f" (mean: slot {mean['slot']:.0f}, tokens {mean['tokens']:.0f} in {mean['llm_steps']:.0f} steps, "
        f"queue {mean['queue']:.0f}, vocode {mean['vocode']:.0f} ms)"
        if mean
        else ""
    )
    return (
        f"TTFA p50 {percentile(ttfa, 0.5):.0f} ms p95 {percentile(ttfa, 0.95):.0f} ms{split}, "
        f"underruns {r.underruns}, failed {r.failures}, step {r.mean_step_ms:.1f} ms, busy {r.busy_fraction:.0%}"
    )


# --------------------------------------------------------------------------------------------
# the whole run


async def long_utterance(engine: Engine, chars: int, timeout_s: float) -> tuple[Listener, list[tuple[float, float]]]:
    """One stream of ``chars`` characters of text, its audio read as fast as it comes (the
    ``rtf`` scenario): its listener, and each chunk's (s since the text, s of audio so far).
    RuntimeError when it gives no audio."""
    loop = asyncio.get_running_loop()
    lis = Listener()
    stream = engine.open_stream(seed=7)
    lis.t_text = loop.time()
    stream.push_text(text_of(chars))
    stream.end_text()
    arrivals: list[tuple[float, float]] = []

    async def drain() -> None:
        async for chunk in stream:
            lis.on_chunk(loop.time(), chunk.start_sample, len(chunk.pcm))
            arrivals.append((loop.time() - lis.t_text, (chunk.start_sample + len(chunk.pcm)) / SAMPLE_RATE))

    await asyncio.wait_for(drain(), timeout_s)
    if lis.rtf is None:
        raise RuntimeError(f"the long utterance gave no audio ({stream.state.value})")
    return lis, arrivals


def _quantiles(values: list[float]) -> str:
    return " ".join(f"p{round(100 * q)} {percentile(values, q):.0f} ms" for q in QUANTILES)


async def _run_engine(
    engine: Engine,
    opts: EngineBenchOptions,
    report: Report,
    device: torch.device,
    log: Callable[[str], None],
    save: Callable[[], None],
) -> None:
    scen = set(opts.scenarios)
    peaks = {"allocated": 0.0, "reserved": 0.0, "device_used": 0.0}

    def note_peaks() -> None:
        if device.type == "cuda":
            peaks["allocated"] = max(peaks["allocated"], torch.cuda.max_memory_allocated(device) / GIB)
            peaks["reserved"] = max(peaks["reserved"], torch.cuda.max_memory_reserved(device) / GIB)
            peaks["device_used"] = max(peaks["device_used"], device_used(device) / GIB)

    # one untimed utterance: the first use of each kernel is not a benchmark
    await asyncio.wait_for(first_chunk_s(engine, 1, [text_of(opts.ttfa_chars)], 0.0, opts.timeout_s), opts.timeout_s)

    ttfa_text = text_of(opts.ttfa_chars)
    if "ttfa" in scen:
        log(f"ttfa: whole text ({opts.ttfa_chars} chars), {opts.reps} reps")
        values = [
            1000 * await first_chunk_s(engine, 10 + i, [ttfa_text], 0.0, opts.timeout_s) for i in range(opts.reps)
        ]
        report.add_quantiles("engine.ttfa.whole_text", values, "ms", 1, QUANTILES)
        log(f"ttfa: whole text: {_quantiles(values)}")
        save()

    if "stream" in scen:
        deltas, chars_per_token = token_deltas(engine, ttfa_text)
        report.settings["chars_per_text_token"] = round(chars_per_token, 3)
        for rate in opts.text_rates:
            log(f"ttfa: text at {rate:g} text tokens/s, {opts.reps} reps")
            interval = len(deltas[0]) / chars_per_token / rate
            values = [
                1000 * await first_chunk_s(engine, 100 + i, deltas, interval, opts.timeout_s) for i in range(opts.reps)
            ]
            report.add_quantiles(f"engine.ttfa.text_{rate:g}tps", values, "ms", 1, QUANTILES)
            log(f"ttfa: text at {rate:g} text tokens/s: {_quantiles(values)}")
            save()

    if "capacity" in scen:
        note_peaks()
        best = 0
        text = text_of(opts.capacity_chars)
        for n in opts.streams:
            log(f"capacity: {n} streams")
            r = await capacity_round(engine, n, text, opts, device)
            note_peaks()
            if report_round(report, r, opts.ttfa_target_ms):
                best = max(best, n)
            log(f"capacity: {n} streams: {round_summary(r)}")
            save()
        report.add("capacity.max_streams", best, "streams", max(opts.streams))
        log(f"capacity: {best} streams (zero underruns, p95 TTFA <= {opts.ttfa_target_ms:g} ms)")
        save()

    if "rtf" in scen:
        log(f"rtf: 1 stream, {opts.long_chars} chars")
        before = engine.stats()
        lis, arrivals = await long_utterance(engine, opts.long_chars, opts.timeout_s)
        after = engine.stats()
        assert lis.rtf is not None
        steps = after.steps - before.steps
        busy = after.busy_s - before.busy_s
        report.add("rtf.long_text", lis.rtf, "x", 1)
        report.add("rtf.long_text.audio_s", lis.audio_s, "s", 1)
        report.add("rtf.long_text.steps", steps, "count", 1)
        report.add("rtf.long_text.step_ms.mean", 1000 * busy / max(steps, 1), "ms", 1)
        report.add("rtf.long_text.worker_busy", busy / max(arrivals[-1][0], 1e-9), "fraction", 1)
        log(f"rtf: {lis.rtf:.3f} for {lis.audio_s:.1f} s of audio, {steps} steps, worker busy {busy:.2f} s")
        log("rtf: chunks (s since the text -> s of audio): " + ", ".join(f"{t:.3f}->{a:.1f}" for t, a in arrivals))
        save()

    if "memory" in scen:
        note_peaks()
        n = max(opts.streams) if "capacity" in scen else 1
        if device.type == "cuda":
            report.add("gpu.mem.serving.max_allocated", peaks["allocated"], "GiB", n)
            report.add("gpu.mem.serving.max_reserved", peaks["reserved"], "GiB", n)
            report.add("gpu.mem.serving.device_used", peaks["device_used"], "GiB", n)
        # ru_maxrss: KiB on Linux
        report.add("host.mem.max_rss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "GiB", n)


def run_engine_bench(
    cfg: Config,
    opts: EngineBenchOptions,
    report: Report,
    log: Callable[[str], None],
    save: Callable[[], None] = lambda: None,
) -> None:
    """Run the scenarios of ``opts`` on the engine of ``cfg``; figures go into ``report``.
    ``save`` is called whenever a scenario (or a capacity round) has added its figures, so
    that a run cut short keeps what it measured."""
    if opts.threads > 0:
        torch.set_num_threads(opts.threads)
    cfg = bench_config(cfg, opts)
    device = resolve_device(cfg.model.device)
    report.settings.update(
        model=cfg.model.model,
        device=str(device),
        dtype=cfg.model.dtype if device.type == "cuda" else "float32",
        tokens_per_text_token=opts.tokens_per_text_token,
        prompt_tokens=opts.prompt_tokens,
        # the engine's own switches (--gpu-memory, --set engine.eager=true); the plan is below
        gpu_memory=cfg.engine.gpu_memory,
        eager=cfg.engine.eager,
        pins=dict(opts.pins),
        max_ahead_s=cfg.engine.max_ahead_s,
        kv_len=opts.kv_len(),
        reps=opts.reps,
        ttfa_chars=opts.ttfa_chars,
        capacity_chars=opts.capacity_chars,
        long_chars=opts.long_chars,
        ramp_s=opts.ramp_s,
        ttfa_target_ms=opts.ttfa_target_ms,
        torch=torch.__version__,
        engine_config=dataclasses.asdict(cfg.engine),
    )
    if "cold" in opts.scenarios:  # first, while this process holds no device memory
        log("cold start: a fresh process loads and starts the engine")
        elapsed, parts = measure_cold_start(cfg, opts)
        report.add("startup.cold_start_s", elapsed, "s", 0)
        report.add("startup.cold_engine_load_start_s", parts["load_s"] + parts["start_s"], "s", 0)
        if "warm_s" in parts:
            report.add("startup.cold_warm_s", parts["warm_s"], "s", 0)
        log(f"cold start: ready in {elapsed:.1f} s, start-up work done {parts.get('warm_s', elapsed):.1f} s in")
        save()

    if set(opts.scenarios) <= {"cold"}:
        return
    t0 = time.perf_counter()
    engine = load_engine(cfg, opts)

    report.settings["plan"] = engine.plan.as_dict()
    log(engine.plan.summary())

    async def main() -> None:
        async with engine:
            ready_s = time.perf_counter() - t0
            report.add("startup.engine_ready_in_process_s", ready_s, "s", 0)
            # the figures below are of the engine as it serves once start-up's work after
            # ready (the graph captures past the first chunks) has ended
            await asyncio.to_thread(wait_warm, engine, opts.timeout_s)
            warm_s = time.perf_counter() - t0
            report.add("startup.engine_warm_in_process_s", warm_s, "s", 0)
            log(f"engine ready in {ready_s:.1f} s, its start-up work after ready done {warm_s:.1f} s in")
            if device.type == "cuda":  # start-up's peaks, then serving's alone
                report.add("gpu.mem.startup.max_allocated", torch.cuda.max_memory_allocated(device) / GIB, "GiB", 0)
                report.add("gpu.mem.startup.max_reserved", torch.cuda.max_memory_reserved(device) / GIB, "GiB", 0)
                report.add("gpu.mem.startup.device_used", device_used(device) / GIB, "GiB", 0)
                torch.cuda.reset_peak_memory_stats(device)
            await _run_engine(engine, opts, report, device, log, save)

    asyncio.run(main())
