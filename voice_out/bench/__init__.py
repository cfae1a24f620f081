"""The benchmark suite, ``voice-out bench`` (what each figure means: docs/benchmarks.md).

``--mode engine`` (default) measures the in-process engine: TTFA with the whole text and with
text arriving at set rates, a capacity sweep over stream counts with simulated real-time
listeners, RTF, memory and cold start (:mod:`voice_out.bench.engine_bench`). ``--mode webrtc``
measures end-to-end TTFA and barge-in latency through the real server and a client over
loopback, the aiortc client or the demo page in headless Chromium (``--client chromium``,
:mod:`voice_out.bench.chromium`) (:mod:`voice_out.bench.webrtc_bench`; only this mode imports
aiortc and av).

Results: a markdown table on stdout, a JSON document with ``--out FILE``, and with
``--update-docs`` one line appended to docs/results.jsonl, the history of every recorded run;
``--history METRIC`` prints one figure's course through it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from voice_out.bench.report import RESULTS_FILE, Report, history_markdown, metric_history, update_docs, write_json
from voice_out.config import DEFAULT_MODEL, Config
from voice_out.config import replace as replace_config

if TYPE_CHECKING:
    from voice_out.bench.engine_bench import EngineBenchOptions
    from voice_out.bench.placement_bench import PlacementBenchOptions
    from voice_out.bench.webrtc_bench import WebrtcBenchOptions

#: The model ``voice-out bench`` measures unless one is named: the full-size architecture
#: with random weights, built on the device.
BENCH_MODEL = "random:0.5b"
DOCS_DIR = Path(__file__).resolve().parent.parent.parent / "docs"


def _ints(spec: str | None) -> tuple[int, ...] | None:
    if spec is None or spec == "":
        return None
    try:
        return tuple(int(x) for x in str(spec).split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {spec!r}") from None


def _floats(spec: str | None) -> tuple[float, ...] | None:
    if spec is None or spec == "":
        return None
    try:
        return tuple(float(x) for x in str(spec).split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {spec!r}") from None


def command_line(args: argparse.Namespace) -> str:
    """The exact command: ``voice-out`` and the arguments it was given."""
    argv = getattr(args, "argv", None)
    return shlex.join(["voice-out", *(argv if argv is not None else sys.argv[1:])])


def bench_model_config(cfg: Config, args: argparse.Namespace) -> Config:
    """The configured model, or random:0.5b when none was chosen."""
    if getattr(args, "model", None) is None and cfg.model.model == DEFAULT_MODEL:
        return replace_config(cfg, "model", model=BENCH_MODEL)
    return cfg


def _engine_options(args: argparse.Namespace) -> EngineBenchOptions:
    from voice_out.bench.engine_bench import DEFAULT_STREAMS, SCENARIOS, EngineBenchOptions

    over: dict[str, Any] = {"streams": _ints(getattr(args, "streams", None)) or DEFAULT_STREAMS}
    for name in ("reps", "tokens_per_text_token", "ttfa_target_ms", "ramp_s", "threads"):
        value = getattr(args, name, None)
        if value is not None:
            over[name] = value
    pins = getattr(args, "pin", None)
    if pins:
        over["pins"] = tuple(parse_pin(p) for p in pins)
    rates = _floats(getattr(args, "text_rates", None))
    if rates is not None:
        over["text_rates"] = rates
    scenarios = getattr(args, "scenarios", None)
    if scenarios:
        over["scenarios"] = tuple(s.strip() for s in scenarios.split(",") if s.strip())
    else:
        over["scenarios"] = SCENARIOS
    if getattr(args, "quick", False):
        return EngineBenchOptions.quick(**over)
    return EngineBenchOptions(**over)


def parse_pin(item: str) -> tuple[str, object]:
    """``NAME=VALUE`` of ``--pin`` -> (name, value): true/false, an integer, a comma list of
    integers (``graph_batch_buckets``), or the text (``capability=8.9``)."""
    from voice_out.cli import UserError

    name, sep, raw = item.partition("=")
    name, raw = name.strip(), raw.strip()
    if not sep or not name:
        raise UserError(f"--pin {item!r}: expected NAME=VALUE, e.g. capture_tokens=500 or capability=8.9")
    if name == "capability":
        return name, raw
    if raw.lower() in ("true", "false"):
        return name, raw.lower() == "true"
    try:
        if "," in raw:
            return name, tuple(int(x) for x in raw.split(",") if x.strip())
        return name, int(raw)
    except ValueError:
        raise UserError(f"--pin {item!r}: expected true/false, an integer or a list of integers") from None


def _placement_options(args: argparse.Namespace) -> PlacementBenchOptions:
    """``--streams`` (the first count, per GPU), ``--reps`` (searches), ``--step``,
    ``--engine-processes`` (designs), ``--budget-s``; the capacity round's own options as in
    engine mode."""
    from voice_out.bench.placement_bench import PlacementBenchOptions

    engine = _engine_options(args)
    over: dict[str, Any] = {"engine": engine}
    streams = _ints(getattr(args, "streams", None))
    if streams:
        over["start"] = streams[0]
    for name in ("reps", "step", "budget_s"):
        value = getattr(args, name, None)
        if value is not None:
            over[name] = value
    designs = getattr(args, "engine_processes", None)
    if designs:
        over["designs"] = tuple(d.strip() for d in designs.split(",") if d.strip())
    return PlacementBenchOptions(**over)


def _webrtc_options(args: argparse.Namespace) -> WebrtcBenchOptions:
    from voice_out.bench.webrtc_bench import WebrtcBenchOptions

    over: dict[str, Any] = {}
    for name in ("reps", "tokens_per_text_token", "threads", "url", "voice", "fast_first", "client", "chromium"):
        value = getattr(args, name, None)
        if value is not None:
            over[name] = value
    if getattr(args, "quick", False):
        return WebrtcBenchOptions.quick(**over)
    return WebrtcBenchOptions(**over)


def _logger() -> Callable[[str], None]:
    t0 = time.monotonic()

    def log(msg: str) -> None:
        print(f"bench [{time.monotonic() - t0:6.1f} s]: {msg}", file=sys.stderr, flush=True)

    return log


def bench(cfg: Config, args: argparse.Namespace) -> int:
    """``voice-out bench``: run the mode's scenarios, print the table, write the results."""
    from voice_out.cli import UserError

    docs = Path(getattr(args, "docs_dir", None) or DOCS_DIR)
    history = getattr(args, "history", None)
    if history:
        try:
            points = metric_history(docs / RESULTS_FILE, history, getattr(args, "history_gpu", None))
        except (OSError, ValueError, KeyError) as e:
            raise UserError(f"--history: cannot read {docs / RESULTS_FILE}: {e}") from None
        if not points:
            raise UserError(f"--history: no recorded value of {history!r} in {docs / RESULTS_FILE}")
        print(history_markdown(history, points), end="", flush=True)
        return 0
    mode = getattr(args, "mode", None) or "engine"
    cfg = bench_model_config(cfg, args)
    if getattr(args, "gpu_memory", None) is not None:
        from voice_out.config import ConfigError

        try:
            cfg = replace_config(cfg, "engine", gpu_memory=args.gpu_memory)
        except ConfigError as e:
            raise UserError(str(e)) from None
    command = command_line(args)
    log = _logger()
    if mode not in ("engine", "webrtc", "placement"):
        raise UserError(f"unknown bench mode {mode!r} (engine, webrtc or placement)")
    if getattr(args, "update_docs", False) and not docs.is_dir():
        raise UserError(f"--update-docs: no docs directory at {docs}")
    from_json = getattr(args, "from_json", None)
    if from_json:  # a run made elsewhere (e.g. on the GPU machine): report it, measure nothing
        try:
            report = Report.from_json(json.loads(Path(from_json).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"--from-json {from_json}: not a benchmark result ({e})") from None
        if not report.complete:
            report.notes.append("the run was cut short: these are the figures it measured before it stopped")
    elif mode in ("engine", "placement"):
        out = getattr(args, "out", None)

        def save() -> None:  # partial results survive a run cut short
            if out:
                report.complete = False
                write_json(report, out)
                report.complete = True

        if mode == "engine":
            from voice_out.bench.engine_bench import gpu_name, run_engine_bench

            try:
                opts = _engine_options(args)
            except ValueError as e:
                raise UserError(str(e)) from None
            report = Report("engine", gpu_name(cfg), command)
            run_engine_bench(cfg, opts, report, log, save)
        else:
            from voice_out.bench.placement_bench import gpu_name as gpus_name
            from voice_out.bench.placement_bench import run_placement_bench
            from voice_out.engine.build import expand_devices

            try:
                popts = _placement_options(args)
            except ValueError as e:
                raise UserError(str(e)) from None
            report = Report("placement", gpus_name(expand_devices(cfg.model.device)), command)
            run_placement_bench(cfg, popts, report, log, save)
    else:
        try:
            from voice_out.bench.webrtc_bench import NoBrowserError, run_webrtc_bench
        except ModuleNotFoundError as e:
            if e.name is not None and e.name.split(".")[0] in ("aiortc", "av"):
                msg = f"--mode webrtc needs aiortc and av (the WebRTC client); {e.name} is not installed"
                raise UserError(msg) from None
            raise

        try:
            wopts = _webrtc_options(args)
        except ValueError as e:
            raise UserError(str(e)) from None
        try:
            report = run_webrtc_bench(cfg, wopts, command, log)
        except NoBrowserError as e:  # found before the engine loads
            raise UserError(str(e)) from None

    print(report.markdown(), flush=True)
    out = getattr(args, "out", None)
    if out:
        write_json(report, out)
        log(f"wrote {out}")
    if getattr(args, "update_docs", False):
        log(f"appended to {update_docs(report, docs)}")
    return 0
