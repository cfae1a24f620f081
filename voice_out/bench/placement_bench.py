"""Placement mode of ``voice-out bench``: capacity at the SLO through the server's placement
layer (:mod:`voice_out.engine.placement`), on one GPU and on all of ``model.device``.

For each design of ``--engine-processes`` (``per_device``: each engine in a process of its
own; ``shared``: every engine in this process) it starts one engine per device, all designs at
once (their start-ups overlap; an idle engine costs the others nothing but device memory), and
then, for 1 GPU (a placement over the first engine) and for N GPUs (over all of them), finds
the capacity: the most concurrent streams whose capacity round (the ``capacity`` scenario's
:func:`~voice_out.bench.engine_bench.capacity_round`: streams started over ``--ramp-s``, each
with a real-time listener) has zero underruns, no failed stream and p95 TTFA within the target.

The search, per repetition: a round at the first count (``--streams``, per GPU, times the GPUs;
later repetitions start at the capacity found before), then steps of ``--step`` streams up
while rounds pass, up to ``engine.max_streams`` per GPU (or down until one passes). The
reported capacity is the median of the repetitions. ``--budget-s`` stops starting new rounds
past that time (the figures measured so far are reported, and the notes say what was cut).
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import torch

from voice_out.bench.engine_bench import (
    EngineBenchOptions,
    bench_config,
    capacity_round,
    load_engine,
    report_round,
    round_summary,
    text_of,
)
from voice_out.bench.report import Report
from voice_out.config import Config
from voice_out.config import replace as replace_config
from voice_out.engine.api import EngineLike
from voice_out.engine.loading import engine_labels, expand_devices, planned_capacity
from voice_out.engine.placement import Placement
from voice_out.engine.process import ProcessEngine
from voice_out.engine.scheduler import ForcedTokens

DESIGNS = ("per_device", "shared")
#: Characters of each warm-up stream's text (about 1.5 s of audio).
WARM_CHARS = 12


@dataclass(frozen=True)
class PlacementBenchOptions:
    """What the placement benchmark runs."""

    engine: EngineBenchOptions = dataclasses.field(default_factory=EngineBenchOptions)
    designs: tuple[str, ...] = ("per_device",)
    #: Streams per GPU of the first round.
    start: int = 20
    step: int = 2
    reps: int = 3
    #: Start no round past this many seconds of the run (0: no limit).
    budget_s: float = 0.0

    def __post_init__(self) -> None:
        unknown = set(self.designs) - set(DESIGNS)
        if unknown or not self.designs:
            raise ValueError(f"--engine-processes: choose from {', '.join(DESIGNS)}, got {', '.join(self.designs)}")
        if self.start < 1 or self.step < 1 or self.reps < 1:
            raise ValueError("the first count, the step and the repetitions must be >= 1")


def gpu_name(devices: Sequence[str]) -> str:
    """``NVIDIA H200 x2``, or ``cpu``."""
    if devices[0].startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(torch.device(devices[0]))} x{len(devices)}"
    return "cpu"


def build_engines(cfg: Config, design: str, devices: Sequence[str], opts: EngineBenchOptions) -> list[Any]:
    """One engine per device, in this process (``shared``) or a process each (``per_device``),
    as :func:`voice_out.engine.loading.load_placement` builds them for the server, with the
    engine benchmark's options (forced tokens, KV length, the synthetic voice)."""
    engines: list[Any] = []
    for device, label in zip(devices, engine_labels(tuple(devices)), strict=True):
        one = bench_config(replace_config(cfg, "model", device=device), opts)
        if design == "shared":
            engines.append(load_engine(one, opts))
        else:
            forced = ForcedTokens(opts.tokens_per_text_token) if opts.tokens_per_text_token > 0 else None
            load_options = {
                "forced": forced,
                "kv_len": opts.kv_len(),
                "flow_path": opts.flow_path,
                "noise_prompt_tokens": opts.prompt_tokens,
                "text_normalizer": "none",
            }
            engines.append(ProcessEngine(one, label=label, load_options=load_options, torch_threads=opts.threads))
    return engines


async def find_capacity(
    passes: Callable[[int], Awaitable[bool]], start: int, step: int, limit: int, over_budget: Callable[[], bool]
) -> tuple[int, bool]:
    """The most streams (at most ``limit``) whose round ``passes``, searching from ``start`` in
    steps of ``step``: (capacity, whether the search closed: a passing count with a failing
    one ``step`` above or ``limit`` reached, or 0 with the smallest count failing)."""
    n = min(start, limit)
    if await passes(n):
        best = n
        while not over_budget():
            if n + step > limit:
                return best, True
            if not await passes(n + step):
                return best, True
            n += step
            best = n
        return best, False
    while n - step >= 1:
        if over_budget():
            return 0, False
        n -= step
        if await passes(n):
            return n, True
    return 0, True


async def _measure(
    placement: Placement,
    name: str,
    gpus: int,
    popts: PlacementBenchOptions,
    report: Report,
    log: Callable[[str], None],
    save: Callable[[], None],
    over_budget: Callable[[], bool],
    start: int,
    limit: int,
) -> int | None:
    """The median capacity of ``popts.reps`` searches (None: no search closed in the budget)."""
    opts = popts.engine
    text = text_of(opts.capacity_chars)

    async def passes(n: int) -> bool:
        placed_before = [r.placed for r in placement.reports()]
        r = await capacity_round(placement, n, text, opts, None)
        sub = Report(report.mode, report.gpu, report.command, report.date)
        ok = report_round(sub, r, opts.ttfa_target_ms)
        for m in sub.metrics:
            report.metrics.append(dataclasses.replace(m, name=f"placement.{name}.gpus_{gpus}.rep{rep[0]}.{m.name}"))
        placed = [r.placed - b for r, b in zip(placement.reports(), placed_before, strict=True)]
        log(f"{name}, {gpus} GPU: {n} streams {'PASS' if ok else 'fail'}: {round_summary(r)}; placed {placed}")
        save()
        return ok

    found: list[int] = []
    rep = [0]  # the repetition the rounds belong to (1-based), for their records' names
    for k in range(popts.reps):
        rep[0] = k + 1
        if over_budget():
            report.notes.append(f"{name}, {gpus} GPU: {k} of {popts.reps} repetitions within the time budget")
            break
        best, closed = await find_capacity(passes, start, popts.step, limit, over_budget)
        if not closed:
            report.notes.append(f"{name}, {gpus} GPU, repetition {k + 1}: the time budget cut the search")
            break
        found.append(best)
        report.add(f"placement.{name}.gpus_{gpus}.rep{k + 1}.capacity.max_streams", best, "streams", best)
        log(f"{name}, {gpus} GPU: repetition {k + 1}: capacity {best} streams")
        start = max(best, popts.step)
    if not found:
        return None
    capacity = int(statistics.median_low(found))
    report.add(f"placement.{name}.gpus_{gpus}.capacity.max_streams", capacity, "streams", capacity)
    log(f"{name}, {gpus} GPU: capacity {capacity} streams (repetitions: {found})")
    save()
    return capacity


def run_placement_bench(
    cfg: Config,
    popts: PlacementBenchOptions,
    report: Report,
    log: Callable[[str], None],
    save: Callable[[], None] = lambda: None,
) -> None:
    """Start every design's engines, then measure each design on 1 GPU and on all of them."""
    # each engine's KV slots: model.engine.max_streams (64 unless set), also the most streams
    # per GPU a search tries
    per_engine = cfg.engine.max_streams
    opts = dataclasses.replace(popts.engine, streams=(per_engine,))
    popts = dataclasses.replace(popts, engine=opts)
    if opts.threads > 0:
        torch.set_num_threads(opts.threads)
    devices = expand_devices(cfg.model.device)
    report.settings.update(
        model=cfg.model.model,
        devices=list(devices),
        designs=list(popts.designs),
        dtype=cfg.model.dtype,
        tokens_per_text_token=opts.tokens_per_text_token,
        prompt_tokens=opts.prompt_tokens,
        capacity_chars=opts.capacity_chars,
        ramp_s=opts.ramp_s,
        ttfa_target_ms=opts.ttfa_target_ms,
        reps=popts.reps,
        step=popts.step,
        torch=torch.__version__,
    )
    t0 = time.perf_counter()

    def over_budget() -> bool:
        return popts.budget_s > 0 and time.perf_counter() - t0 > popts.budget_s

    async def main() -> None:
        built = {d: build_engines(cfg, d, devices, opts) for d in popts.designs}
        labels = engine_labels(devices)
        async with AsyncExitStack() as stack:
            log(f"starting {sum(len(e) for e in built.values())} engines ({', '.join(popts.designs)}) on {devices}")
            await asyncio.gather(*(stack.enter_async_context(e) for es in built.values() for e in es))
            report.add("placement.startup_s", time.perf_counter() - t0, "s", 0)
            log(f"engines ready in {time.perf_counter() - t0:.1f} s")
            capacities: dict[int, int] = {}  # GPUs -> the first design's capacity
            for k, (design, engines) in enumerate(built.items()):
                capacity = planned_capacity(bench_config(cfg, opts))
                # one GPU with the first design only: a lone engine is the same in either
                counts = sorted({1, len(engines)}) if k == 0 else [len(engines)]
                for gpus in counts:
                    members: list[tuple[str, EngineLike, int]] = [
                        (labels[i], engines[i], capacity) for i in range(gpus)
                    ]
                    async with Placement(members) as placement:
                        # the first use of each kernel on each engine is not a benchmark
                        await capacity_round(placement, 2 * gpus, text_of(WARM_CHARS), opts, None)
                        # the first design's capacity here; else linear scaling from one GPU
                        start = capacities.get(gpus) or capacities.get(1, popts.start) * gpus
                        found = await _measure(
                            placement, design, gpus, popts, report, log, save, over_budget, start, per_engine * gpus
                        )
                    if found is not None:
                        capacities.setdefault(gpus, found)
                        one = capacities.get(1)  # a lone engine: the same in either design
                        if gpus > 1 and one:
                            report.add(f"placement.{design}.gpus_{gpus}.scaling", found / one, "x", found)
                            log(f"{design}: {gpus} GPUs hold {found / one:.2f}x the streams of one")

    asyncio.run(main())
