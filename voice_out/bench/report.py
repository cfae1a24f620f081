"""Benchmark results: metric records, the JSON document, the markdown table, docs/benchmarks.*.

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
        """The report of a JSON document written by :func:`write_json`."""
        report = cls(
            mode=doc["mode"],
            gpu=doc["gpu"],
            command=doc["command"],
            date=doc["date"],
            settings=dict(doc.get("settings", {})),
            notes=list(doc.get("notes", [])),
            complete=bool(doc.get("complete", True)),
        )
        report.metrics = [Metric(**m) for m in doc["metrics"]]
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


def variant(command: str) -> tuple[str, ...]:
    """What makes a run's figures a variant of the defaults: its ``--set`` overrides and its
    ``--flow-path`` / ``--dtype`` / ``--tokens-per-text-token`` options, sorted."""
    words = command.split()
    out = []
    for i, w in enumerate(words):
        name, eq, value = w.partition("=")
        if name in ("--set", "--flow-path", "--dtype", "--tokens-per-text-token"):
            out.append(f"{name} {value}" if eq else f"{name} {words[i + 1] if i + 1 < len(words) else ''}")
    return tuple(sorted(out))


def update_docs(report: Report, docs_dir: str | Path) -> tuple[Path, Path]:
    """Append a dated section (command + table) to ``benchmarks.md`` and rewrite
    ``benchmarks.json``: the latest figures, one list of metric records, where this run's
    records replace earlier records of the same GPU, mode, metric, stream count and
    :func:`variant` (so runs of separate scenarios add up, and a run with ``--set
    engine.fast_first_tokens=12`` keeps its own figures beside the defaults'; each record keeps
    its own command and date)."""
    docs = Path(docs_dir)
    md, js = docs / "benchmarks.md", docs / "benchmarks.json"
    if not md.exists():
        md.write_text("# Benchmarks\n\n## Results\n")
    title = f"{report.date[:16].replace('T', ' ')} UTC, {report.mode} mode, {report.gpu}"
    if report.gpu == "cpu":
        title += " — " + CPU_LABEL
    section = f"\n### {title}\n\n```\n{report.command}\n```\n\n{report.markdown()}"
    with md.open("a") as f:
        f.write(section)
    old: list[dict[str, Any]] = []
    if js.exists():
        loaded = json.loads(js.read_text())
        old = loaded if isinstance(loaded, list) else []

    def key(r: dict[str, Any]) -> tuple[object, ...]:
        return (r.get("gpu"), r.get("mode"), r.get("name"), r.get("streams"), variant(str(r.get("command", ""))))

    new = {key(m.as_dict()) for m in report.metrics}
    kept = [r for r in old if key(r) not in new]
    records = kept + [m.as_dict() for m in report.metrics]
    # the defaults' record first, then each variant's: the order never depends on which ran last
    records.sort(
        key=lambda r: (
            str(r.get("gpu")),
            str(r.get("mode")),
            str(r.get("name")),
            int(r.get("streams", 0)),
            variant(str(r.get("command", ""))),
        )
    )
    js.write_text(json.dumps(records, indent=2) + "\n")
    return md, js
