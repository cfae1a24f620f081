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
    build_options,
    capacity_round,
    load_engine,
    report_round,
    round_summary,
    text_of,
    wait_warm,
)
from voice_out.bench.report import Report
from voice_out.config import Config
from voice_out.config import replace as replace_config
from voice_out.engine.api import EngineLike
from voice_out.engine.build import engine_labels, expand_devices, planned_capacity
from voice_out.engine.placement import Placement
from voice_out.engine.process import ProcessEngine

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
    as :func:`voice_out.engine.placement.load_placement` builds them for the server, with the
    engine benchmark's options (forced tokens, KV length, the synthetic voice)."""
    engines: list[Any] = []
    for device, label in zip(devices, engine_labels(tuple(devices)), strict=True):
        one = bench_config(replace_config(cfg, "model", device=device), opts)
        if design == "shared":
            engines.append(load_engine(one, opts))
        else:
            load_options = build_options(opts)
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


@dataclass
class _Setup:
    """One configuration measured: a design on ``gpus`` GPUs, and its searches so far."""

    design: str
    gpus: int
    placement: Placement
    limit: int
    start: int | None = None
    found: list[int] = dataclasses.field(default_factory=list)
    warm: bool = False

    @property
    def name(self) -> str:
        return f"placement.{self.design}.gpus_{self.gpus}"


async def _search(
    setup: _Setup,
    rep: int,
    popts: PlacementBenchOptions,
    report: Report,
    log: Callable[[str], None],
    save: Callable[[], None],
    over_budget: Callable[[], bool],
) -> bool:
    """One repetition's search of ``setup``; False when the budget cut it."""
    opts = popts.engine
    text = text_of(opts.capacity_chars)
    placement = setup.placement
    where = f"{setup.design}, {setup.gpus} GPU"

    async def passes(n: int) -> bool:
        placed_before = [r.placed for r in placement.reports()]
        r = await capacity_round(placement, n, text, opts, None)
        sub = Report(report.mode, report.gpu, report.command, report.date)
        ok = report_round(sub, r, opts.ttfa_target_ms)
        for m in sub.metrics:
            report.metrics.append(dataclasses.replace(m, name=f"{setup.name}.rep{rep}.{m.name}"))
        placed = [r.placed - b for r, b in zip(placement.reports(), placed_before, strict=True)]
        log(f"{where}: {n} streams {'PASS' if ok else 'fail'}: {round_summary(r)}; placed {placed}")
        save()
        return ok

    if not setup.warm:  # the first use of each kernel on each engine is not a benchmark
        await capacity_round(placement, 2 * setup.gpus, text_of(WARM_CHARS), opts, None)
        setup.warm = True
    assert setup.start is not None
    best, closed = await find_capacity(passes, setup.start, popts.step, setup.limit, over_budget)
    if not closed:
        report.notes.append(f"{where}, repetition {rep}: the time budget cut the search")
        return False
    setup.found.append(best)
    setup.start = max(best, popts.step)
    report.add(f"{setup.name}.rep{rep}.capacity.max_streams", best, "streams", best)
    log(f"{where}: repetition {rep}: capacity {best} streams")
    save()
    return True


def _conclude(setups: list[_Setup], popts: PlacementBenchOptions, report: Report, log: Callable[[str], None]) -> None:
    """The median capacity of each setup's searches, and each design's scaling over one GPU."""
    capacity: dict[tuple[str, int], int] = {}
    for setup in setups:
        if setup.found:
            c = int(statistics.median_low(setup.found))
            capacity[(setup.design, setup.gpus)] = c
            report.add(f"{setup.name}.capacity.max_streams", c, "streams", c)
            log(f"{setup.design}, {setup.gpus} GPU: capacity {c} streams (searches: {setup.found})")
            if len(setup.found) < popts.reps:
                report.notes.append(
                    f"{setup.design}, {setup.gpus} GPU: {len(setup.found)} of {popts.reps} searches within the budget"
                )
    # one GPU is measured with the first design: a lone engine is the same in either
    one = next((c for (_, g), c in capacity.items() if g == 1), None)
    for (design, gpus), c in capacity.items():
        if gpus > 1 and one:
            report.add(f"placement.{design}.gpus_{gpus}.scaling", c / one, "x", c)
            log(f"{design}: {gpus} GPUs hold {c / one:.2f}x the streams of one")


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

            # engines in processes of their own start at once; those of this process one after
            # the other (a start-up's graph captures allow no other thread's CUDA calls). A
            # design with an engine that fails to start is left out (the notes say why).
            failed: dict[str, str] = {}

            async def start(design: str, engine: Any) -> None:
                try:
                    await stack.enter_async_context(engine)
                except Exception as e:  # noqa: BLE001 - that design only
                    failed.setdefault(design, f"{type(e).__name__}: {e}")
                    log(f"{design}: an engine failed to start: {e}")

            async def start_shared() -> None:
                for e in built.get("shared", []):
                    await start("shared", e)

            children = [(d, e) for d, es in built.items() if d != "shared" for e in es]
            await asyncio.gather(start_shared(), *(start(d, e) for d, e in children))
            for design, why in failed.items():
                report.notes.append(f"{design}: not measured, an engine failed to start ({why})")
                del built[design]
            report.add("placement.startup_s", time.perf_counter() - t0, "s", 0)
            log(f"engines ready in {time.perf_counter() - t0:.1f} s")
            for engines in built.values():  # measured once their start-up work after ready is done
                for e in engines:
                    await asyncio.to_thread(wait_warm, e, 900.0)
            capacity = planned_capacity(bench_config(cfg, opts))
            setups: list[_Setup] = []
            async with AsyncExitStack() as placements:
                for k, (design, engines) in enumerate(built.items()):
                    # one GPU with the first design only: a lone engine is the same in either
                    for gpus in sorted({1, len(engines)}) if k == 0 else [len(engines)]:
                        members: list[tuple[str, EngineLike, int]] = [
                            (labels[i], engines[i], capacity) for i in range(gpus)
                        ]
                        placement = await placements.enter_async_context(Placement(members))
                        setups.append(_Setup(design, gpus, placement, per_engine * gpus))
                # repetitions outside, setups inside: a budget cut leaves every setup measured
                for rep in range(1, popts.reps + 1):
                    for setup in setups:
                        if over_budget():
                            break
                        if setup.start is None:
                            # the first design's capacity on as many GPUs; else linear from one GPU
                            found = [(s.gpus, s.found[0]) for s in setups if s.found and s.found[0] > 0]
                            same = next((c for g, c in found if g == setup.gpus), None)
                            one = next((c for g, c in found if g == 1), popts.start)
                            setup.start = same or one * setup.gpus
                        await _search(setup, rep, popts, report, log, save, over_budget)
            _conclude(setups, popts, report, log)
            save()

    asyncio.run(main())
