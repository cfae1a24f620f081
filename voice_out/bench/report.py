"""Benchmark results: metric records, the JSON document, the markdown table, docs/results.jsonl.

Every figure is one :class:`Metric` record ``{name, value, unit, streams, gpu, command, date}``
(plus ``mode``): what was measured, with how many concurrent streams, on which GPU (``"cpu"``
for CPU runs), by which exact command line, when (UTC, ISO 8601).

No torch here: the GPU name is passed in by the caller.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

#: The figures on the machines that run CI say nothing about the GPU: their docs section says so.
CPU_LABEL = "CPU smoke figures (random weights on a CPU: they say nothing about GPU speed)"


def utc_now() -> str:
    """The current UTC time, ISO 8601, to the second."""
    return datetime.now(UTC).replace(microsecond=0).isoformat()


@dataclass(frozen=True)
class Metric:
    """One measured figure."""

    name: str
    value: float
    unit: str
    streams: int
    gpu: str
    command: str
    date: str
    mode: str = "engine"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Report:
    """The figures of one benchmark run, with what they were measured with."""

    mode: str
    gpu: str
    command: str
    date: str = field(default_factory=utc_now)
    settings: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    metrics: list[Metric] = field(default_factory=list)
    #: False while the run is still going (a partial result written as it goes).
    complete: bool = True

    def add(self, name: str, value: float, unit: str, streams: int) -> None:
        self.metrics.append(
            Metric(name, float(value), unit, int(streams), self.gpu, self.command, self.date, self.mode)
        )

    def add_quantiles(self, name: str, values: list[float], unit: str, streams: int, qs: Iterable[float]) -> None:
        """``name.pNN`` for each quantile of ``values`` (nothing when there are no values)."""
        from voice_out.bench.listener import percentile

        if not values:
            return
        for q in qs:
            self.add(f"{name}.p{round(q * 100)}", percentile(values, q), unit, streams)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Report:
        """The report of a JSON document written by :func:`write_json` (or a run of a results
        file, whose metrics leave out what the run states once)."""
        report = cls(
            mode=doc["mode"],
            gpu=doc["gpu"],
            command=doc["command"],
            date=doc["date"],
            settings=dict(doc.get("settings", {})),
            notes=list(doc.get("notes", [])),
            complete=bool(doc.get("complete", True)),
        )
        shared = {"gpu": report.gpu, "command": report.command, "date": report.date, "mode": report.mode}
        report.metrics = [Metric(**{**shared, **m}) for m in doc["metrics"]]
        return report

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "gpu": self.gpu,
            "command": self.command,
            "date": self.date,
            "complete": self.complete,
            "settings": self.settings,
            "notes": self.notes,
            "metrics": [m.as_dict() for m in self.metrics],
        }

    def markdown(self) -> str:
        """The metrics as a markdown table, with the command, GPU, date and notes above it."""
        lines = [
            f"- command: `{self.command}`",
            f"- gpu: {self.gpu}" + (f" — {CPU_LABEL}" if self.gpu == "cpu" else ""),
            f"- date: {self.date}",
        ]
        flat = {k: v for k, v in self.settings.items() if not isinstance(v, dict)}  # nested: JSON only
        if flat:
            lines.append("- settings: " + ", ".join(f"{k}={_fmt_setting(v)}" for k, v in flat.items()))
        lines += [f"- note: {n}" for n in self.notes]
        lines += ["", "| metric | streams | value | unit |", "|---|---:|---:|---|"]
        lines += [f"| {m.name} | {m.streams} | {_fmt(m.value)} | {m.unit} |" for m in self.metrics]
        return "\n".join(lines) + "\n"


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "n/a"
    if v == int(v) and abs(v) < 1e9:
        return str(int(v))
    return f"{v:.4g}" if abs(v) < 10 else f"{v:.1f}"


def _fmt_setting(v: object) -> str:
    if isinstance(v, list | tuple):
        return ",".join(str(x) for x in v)
    return str(v)


def write_json(report: Report, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report.to_json(), indent=2) + "\n")


#: The history of every recorded run and round, one JSON object a line, oldest first.
RESULTS_FILE = "results.jsonl"


def update_docs(report: Report, docs_dir: str | Path) -> Path:
    """Append ``report`` to ``results.jsonl`` in ``docs_dir`` as one line: ``{"kind": "run",
    mode, gpu, command, date, complete, settings, notes, metrics: [{name, value, unit,
    streams}]}``. Nothing is ever rewritten: the file is the history, and
    :func:`metric_history` reads one figure's course through it."""
    path = Path(docs_dir) / RESULTS_FILE
    run = report.to_json()
    run["metrics"] = [{"name": m.name, "value": m.value, "unit": m.unit, "streams": m.streams} for m in report.metrics]
    with path.open("a") as f:
        f.write(json.dumps({"kind": "run", **run}, ensure_ascii=False) + "\n")
    return path


@dataclass(frozen=True)
class HistoryPoint:
    """One recorded value of a metric."""

    date: str
    gpu: str
    streams: int
    value: float
    unit: str
    command: str


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a results file (``kind`` ``"run"`` or ``"round"``), in file order.
    A line that is not a JSON object raises ValueError naming the line."""
    records = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{i}: not JSON ({e})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{i}: not a JSON object")
        records.append(record)
    return records


def metric_history(path: str | Path, name: str, gpu: str | None = None) -> list[HistoryPoint]:
    """Every recorded value of metric ``name``, oldest first; with ``gpu``, only runs whose GPU
    name contains it (case-insensitive)."""
    points = []
    for run in read_results(path):
        if run.get("kind") != "run" or (gpu is not None and gpu.lower() not in str(run.get("gpu", "")).lower()):
            continue
        for m in run.get("metrics", []):
            if m.get("name") == name:
                points.append(
                    HistoryPoint(
                        run["date"], run["gpu"], int(m["streams"]), float(m["value"]), m["unit"], run["command"]
                    )
                )
    points.sort(key=lambda p: p.date)
    return points


def history_markdown(name: str, points: list[HistoryPoint]) -> str:
    """``points`` as a markdown table (what ``voice-out bench --history`` prints)."""
    lines = [f"{name}: {len(points)} recorded values", "", "| date | gpu | streams | value | unit | command |"]
    lines.append("|---|---|---:|---:|---|---|")
    lines += [f"| {p.date} | {p.gpu} | {p.streams} | {_fmt(p.value)} | {p.unit} | `{p.command}` |" for p in points]
    return "\n".join(lines) + "\n"
