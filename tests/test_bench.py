"""``voice-out bench`` on random:tiny on the CPU: the smoke run of every scenario.

The figures themselves say nothing about speed here; what is asserted is that every metric is
there, well-formed and consistent (quantiles ordered, capacity agreeing with its own per-count
figures, paced text arriving no faster than its rate), that the engine mode never imports the
WebRTC stack (the GPU machine has no aiortc or av), and that --update-docs writes the docs.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from voice_out.bench.report import RESULTS_FILE, Report, metric_history, read_results, update_docs

ROOT = Path(__file__).resolve().parent.parent

#: The engine mode runs in a fresh interpreter where importing these fails.
BLOCKED = ("aiortc", "av")
RUNNER = textwrap.dedent(
    """
    import importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in {blocked!r}:
                raise ModuleNotFoundError("No module named " + repr(name), name=name)
            return None

    sys.meta_path.insert(0, Block())
    from voice_out.cli import main
    rc = main(sys.argv[1:])
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in {blocked!r})
    print("LOADED", ",".join(loaded))
    sys.exit(rc)
    """
).format(blocked=set(BLOCKED))

ENGINE_ARGV = ["bench", "--model", "random:tiny", "--device", "cpu", "--streams", "1,2", "--quick", "--threads", "1"]
SINGLE = ("engine.ttfa.whole_text", "engine.ttfa.text_20tps", "engine.ttfa.text_60tps")
PER_COUNT = (
    "capacity.ttfa.p50",
    "capacity.ttfa.p95",
    "capacity.ttfa.p99",
    "capacity.underruns",
    "capacity.streams_with_underruns",
    "capacity.stall_ms.max",
    "capacity.failed_streams",
    "capacity.rtf.p50",
    "capacity.rtf.max",
    "capacity.compute_rtf",
    "capacity.worker_busy",
    "capacity.audio_s_per_stream",
    "capacity.step_ms.mean",
)
OTHER = (
    "startup.cold_start_s",
    "startup.cold_engine_load_start_s",
    "startup.engine_ready_in_process_s",
    "capacity.max_streams",
    "rtf.long_text",
    "rtf.long_text.audio_s",
    "host.mem.max_rss",
)


def by_key(doc: dict[str, Any]) -> dict[tuple[str, int], float]:
    out: dict[tuple[str, int], float] = {}
    for m in doc["metrics"]:
        key = (m["name"], m["streams"])
        assert key not in out, f"duplicate metric {key}"
        out[key] = m["value"]
    return out


def check_records(doc: dict[str, Any], mode: str, command: str) -> None:
    now = datetime.now(UTC)
    assert doc["mode"] == mode and doc["gpu"] == "cpu" and doc["command"] == command and doc["complete"] is True
    for m in doc["metrics"]:
        assert set(m) == {"name", "value", "unit", "streams", "gpu", "command", "date", "mode"}, m
        assert m["gpu"] == "cpu" and m["command"] == command and m["mode"] == mode
        date = datetime.fromisoformat(m["date"])
        assert date.utcoffset() == timedelta(0) and now - timedelta(minutes=10) < date <= now
        assert isinstance(m["value"], float) and math.isfinite(m["value"]) and m["value"] >= 0, m
        assert m["unit"] in {"ms", "s", "x", "count", "streams", "GiB", "fraction"}, m


def check_quantiles(v: dict[tuple[str, int], float], name: str, streams: int) -> None:
    p50, p95, p99 = (v[(f"{name}.{q}", streams)] for q in ("p50", "p95", "p99"))
    assert 0 < p50 <= p95 <= p99, (name, p50, p95, p99)


def test_engine_mode_smoke(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    docs = tmp_path / "docs"
    docs.mkdir()
    argv = [*ENGINE_ARGV, "--out", str(out), "--update-docs", "--docs-dir", str(docs)]
    proc = subprocess.run([sys.executable, "-c", RUNNER, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOADED \n" in proc.stdout, "the engine mode imported the WebRTC stack"

    doc = json.loads(out.read_text())
    command = "voice-out " + " ".join(argv)
    check_records(doc, "engine", command)
    v = by_key(doc)
    # every metric, and nothing for counts that were not asked for
    for name in SINGLE:
        check_quantiles(v, name, 1)
    for n in (1, 2):
        for name in PER_COUNT:
            assert (name, n) in v, (name, n)
        check_quantiles(v, "capacity.ttfa", n)
    assert {n for (name, n) in v if name.startswith("capacity.") and name != "capacity.max_streams"} == {1, 2}
    for name in OTHER:
        assert any(k[0] == name for k in v), name
    assert not any(name.startswith("gpu.") for name, _ in v)  # CPU: no GPU memory figures

    # consistency of the figures with each other
    for n in (1, 2):
        assert v[("capacity.failed_streams", n)] == 0
        assert v[("capacity.streams_with_underruns", n)] <= min(n, v[("capacity.underruns", n)])
        assert v[("capacity.audio_s_per_stream", n)] > 0.5  # 10 chars x 3 speech tokens at 25 Hz: 1.2 s
        assert v[("capacity.rtf.p50", n)] <= v[("capacity.rtf.max", n)]
        assert 0 < v[("capacity.worker_busy", n)] <= 1
        # the engine's own split of the first audio: every stream traced; the first chunk waits
        # for 28 speech tokens (25-token prompt, so no pad) and the steps before them
        for part in ("slot", "tokens", "queue", "vocode"):
            assert 0 <= v[(f"capacity.ttfa_parts.{part}.p50", n)] <= v[(f"capacity.ttfa_parts.{part}.p95", n)]
        assert v[("capacity.ttfa_parts.llm_steps.p50", n)] >= 28
        parts = sum(v[(f"capacity.ttfa_parts.{part}.p50", n)] for part in ("tokens", "vocode"))
        assert parts <= v[("capacity.ttfa.p99", n)] * 1.01 + 1
    assert doc["settings"]["engine_config"]["max_streams"] == 2  # one KV slot per stream of the largest count
    target = doc["settings"]["ttfa_target_ms"]
    qualifying = [n for n in (1, 2) if v[("capacity.underruns", n)] == 0 and v[("capacity.ttfa.p95", n)] <= target]
    assert v[("capacity.max_streams", 2)] == max(qualifying, default=0)
    # paced text: the LLM's first step needs a group of 5 text tokens (bytes here; unless the
    # text ends first), the 5th of which arrives 4 / rate seconds after the first
    assert doc["settings"]["chars_per_text_token"] == 1.0
    assert v[("engine.ttfa.text_20tps.p50", 1)] >= 1000 * 4 / 20
    assert v[("engine.ttfa.text_60tps.p50", 1)] >= 1000 * 4 / 60
    assert v[("startup.cold_start_s", 0)] > v[("startup.cold_engine_load_start_s", 0)] > 0
    assert v[("rtf.long_text.audio_s", 1)] == pytest.approx(24 * 3 / 25, rel=0.1)  # 24 chars x 3 tokens

    # the table on stdout, and the docs
    assert "| metric | streams | value | unit |" in proc.stdout
    assert "| capacity.max_streams | 2 |" in proc.stdout
    (run,) = read_results(docs / RESULTS_FILE)  # the history: this run, one line
    assert run["kind"] == "run" and run["command"] == command and run["gpu"] == "cpu"
    assert Report.from_json(run).to_json() == {k: v for k, v in doc.items() if k != "kind"}

    # a result brought back from another machine goes into the history the same way
    from voice_out.cli import main

    docs2 = tmp_path / "docs2"
    docs2.mkdir()
    assert main(["bench", "--from-json", str(out), "--update-docs", "--docs-dir", str(docs2)]) == 0
    assert read_results(docs2 / RESULTS_FILE) == [run]


def test_webrtc_mode_without_aiortc_is_a_one_line_error() -> None:
    argv = ["bench", "--mode", "webrtc", "--model", "random:tiny", "--device", "cpu", "--quick"]
    proc = subprocess.run([sys.executable, "-c", RUNNER, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "voice-out: error: --mode webrtc needs aiortc and av (the WebRTC client); aiortc is not installed"
    )


def test_webrtc_mode_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from voice_out.cli import main

    out = tmp_path / "webrtc.json"
    argv = ["bench", "--mode", "webrtc", "--model", "random:tiny", "--device", "cpu", "--quick", "--threads", "1"]
    argv += ["--voice", "noise"]  # the built-in voice of random models, named
    argv += ["--fast-first", "4"]  # a per-utterance fast first chunk: refused, it would fail the run
    assert main([*argv, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["settings"]["fast_first"] == 4
    check_records(doc, "webrtc", "voice-out " + " ".join([*argv, "--out", str(out)]))
    v = by_key(doc)
    for name in ("e2e.ttfa", "e2e.server_ttfa", "e2e.barge_in"):
        p50, p95, p99 = (v[(f"{name}.{q}", 1)] for q in ("p50", "p95", "p99"))
        assert p50 <= p95 <= p99
    assert {n for _, n in v} == {1}
    # the client hears the first audio after the server put it on the track
    assert v[("e2e.ttfa.p50", 1)] >= v[("e2e.server_ttfa.p50", 1)] > 0
    # --quick: no warm-up, so the session's first utterance is the one measured
    assert (v[("e2e.first_ttfa", 1)], v[("e2e.first_server_ttfa", 1)]) == (
        v[("e2e.ttfa.p50", 1)],
        v[("e2e.server_ttfa.p50", 1)],
    )
    assert v[("e2e.barge_in.p50", 1)] < 1000
    # the engine's own first audio of the same utterance, and what the server added to it
    assert 0 < v[("engine.ttfa.p50", 1)] <= v[("e2e.server_ttfa.p50", 1)]
    assert v[("e2e.server_ttfa_over_engine.p50", 1)] == pytest.approx(
        v[("e2e.server_ttfa.p50", 1)] - v[("engine.ttfa.p50", 1)], abs=0.2
    )
    assert 0 <= v[("server.late_frames.over_20ms", 1)] <= v[("server.late_frames", 1)]
    assert v[("server.late_frames.warmup", 1)] == 0  # --quick: no warm-up utterance
    assert 0 <= v[("server.late_frames.utterance.max", 1)] <= v[("server.late_frames", 1)]
    assert any("80 ms" in n for n in doc["notes"])
    assert "| e2e.barge_in.p50 | 1 |" in capsys.readouterr().out


@pytest.mark.browser
def test_webrtc_mode_chromium_client(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--client chromium``: the demo page in headless Chromium speaks, hears and barges in,
    and its own measurements come back under names of their own."""
    from voice_out.cli import main

    out = tmp_path / "chromium.json"
    argv = ["bench", "--mode", "webrtc", "--client", "chromium", "--model", "random:tiny", "--device", "cpu"]
    argv += ["--quick", "--threads", "1", "--reps", "2"]
    assert main([*argv, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    check_records(doc, "webrtc", "voice-out " + " ".join([*argv, "--out", str(out)]))
    assert doc["settings"]["client"] == "chromium" and "Chrome/" in doc["settings"]["browser"]
    assert doc["settings"]["frame_ms"] == 10  # the server's default
    v = by_key(doc)
    names = ("ttfa", "server_ttfa", "barge_in", "jitter_buffer", "barge_in_over_jitter_buffer", "rtp_jitter")
    late = {f"server.late_frames{k}" for k in ("", ".over_20ms", ".warmup", ".utterance.max")}
    first = {"e2e.chromium.first_ttfa", "e2e.chromium.first_server_ttfa"}
    qs = ("p50", "p95", "p99")
    engine = {f"{n}.{q}" for n in ("engine.ttfa", "e2e.chromium.server_ttfa_over_engine") for q in qs}
    quantiles = {f"e2e.chromium.{n}.{q}" for n in names for q in qs}
    assert {n for n, _ in v} == quantiles | late | first | engine
    # the session's first utterance (no warm-up with --quick: the first of the two measured)
    assert v[("e2e.chromium.first_ttfa", 1)] > v[("e2e.chromium.first_server_ttfa", 1)] + 20
    assert 0 <= v[("server.late_frames.over_20ms", 1)] <= v[("server.late_frames", 1)]
    for name in names[:4]:
        check_quantiles(v, f"e2e.chromium.{name}", 1)
    # the page hears the first audio only after the server put it on the track, and after the
    # jitter buffer held it: never sooner than the server's TTFA plus a frame
    assert v[("e2e.chromium.ttfa.p50", 1)] > v[("e2e.chromium.server_ttfa.p50", 1)] + 20
    # the audio already in the browser plays out after a cancel, nothing sent after it does
    assert v[("e2e.chromium.barge_in.p50", 1)] < 1000
    assert any("headless Chromium" in n for n in doc["notes"])
    assert "| e2e.chromium.barge_in.p50 | 1 |" in capsys.readouterr().out


def test_webrtc_chromium_client_errors(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """No browser, or a bad one named: a one-line error before any engine loads."""
    from voice_out.bench.webrtc_bench import WebrtcBenchOptions
    from voice_out.cli import main

    argv = ["bench", "--mode", "webrtc", "--client", "chromium", "--model", "no/such-model", "--device", "cpu"]
    assert main([*argv, "--chromium", "/no/such/chromium"]) == 2
    monkeypatch.setenv("VOICE_OUT_CHROMIUM", "")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "voice-out: error: --chromium /no/such/chromium: no such executable",
        "voice-out: error: --client chromium: no Chromium found (install chromium or chromium-headless-shell, "
        "or pass --chromium PATH or set VOICE_OUT_CHROMIUM)",
    ]
    with pytest.raises(ValueError, match="client must be one of aiortc, chromium"):
        WebrtcBenchOptions(client="firefox")


def test_jitter_buffer_between_two_readings() -> None:
    from voice_out.bench.webrtc_bench import jitter_buffer_ms

    before = {"jitterBufferDelayS": 10.0, "jitterBufferEmittedCount": 48_000}
    after = {"jitterBufferDelayS": 10.0 + 48_000 * 0.06, "jitterBufferEmittedCount": 96_000}
    assert jitter_buffer_ms(before, after) == pytest.approx(60.0)
    assert jitter_buffer_ms(before, before) is None  # nothing played in between
    assert jitter_buffer_ms(None, after) is None


def test_webrtc_mode_refused_utterance_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    """A ``--fast-first`` the server refuses (at or above its first hop) ends the run with the
    server's reason on one line, not a traceback."""
    from voice_out.cli import main

    argv = ["bench", "--mode", "webrtc", "--model", "random:tiny", "--device", "cpu", "--quick", "--threads", "1"]
    assert main([*argv, "--fast-first", "30"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "voice-out: error: the server refused the utterance: bad_field: text.delta: fast_first = 30 must be in "
        "0..24 tokens"
    )


def test_update_docs_appends_to_the_history_and_reads_one_metric_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def report(gpu: str, value: float, date: str, name: str = "x.p50") -> Report:
        r = Report("engine", gpu, f"voice-out bench --value {value}", date=date)
        r.add(name, value, "ms", 1)
        r.add("other", -1.0, "ms", 1)
        return r

    first = report("cpu", 1.0, "2026-01-01T00:00:00+00:00")
    assert Report.from_json(first.to_json()) == first
    path = update_docs(first, tmp_path)
    assert path == tmp_path / RESULTS_FILE
    update_docs(report("NVIDIA H100", 3.0, "2026-01-03T00:00:00+00:00"), tmp_path)
    update_docs(report("NVIDIA H200", 2.0, "2026-01-02T00:00:00+00:00"), tmp_path)
    update_docs(report("NVIDIA H100", 5.0, "2026-01-04T00:00:00+00:00", name="y.p50"), tmp_path)
    # nothing is rewritten: every run stays, in the order recorded
    runs = read_results(path)
    assert [r["metrics"][0]["value"] for r in runs] == [1.0, 3.0, 2.0, 5.0]
    assert Report.from_json(runs[0]) == first
    # one metric's course, oldest first, across GPUs or on one
    assert [(p.gpu, p.value) for p in metric_history(path, "x.p50")] == [
        ("cpu", 1.0),
        ("NVIDIA H200", 2.0),
        ("NVIDIA H100", 3.0),
    ]
    assert [p.value for p in metric_history(path, "x.p50", gpu="h100")] == [3.0]
    assert metric_history(path, "nothing") == []

    from voice_out.cli import main

    assert main(["bench", "--history", "x.p50", "--history-gpu", "nvidia h", "--docs-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("x.p50: 2 recorded values")
    assert "| 2026-01-02T00:00:00+00:00 | NVIDIA H200 | 1 | 2 | ms | `voice-out bench --value 2.0` |" in out
    assert main(["bench", "--history", "nothing", "--docs-dir", str(tmp_path)]) == 2
    assert "no recorded value of 'nothing'" in capsys.readouterr().err
    path.write_text(path.read_text() + "not json\n")
    with pytest.raises(ValueError, match=r"results.jsonl:5: not JSON"):
        read_results(path)


def test_the_projects_history_holds_every_recorded_run() -> None:
    """docs/results.jsonl parses, and its runs carry what a figure needs to be quoted."""
    records = read_results(ROOT / "docs" / RESULTS_FILE)
    runs = [r for r in records if r["kind"] == "run"]
    assert runs and {r["kind"] for r in records} <= {"run", "round"}
    for r in runs:
        assert r["command"].startswith("voice-out bench") and r["gpu"] and r["date"] and r["metrics"]


def test_bad_options_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from voice_out.cli import main

    assert main(["bench", "--model", "random:tiny", "--device", "cpu", "--streams", "1,x"]) == 2
    assert main(["bench", "--model", "random:tiny", "--device", "cpu", "--scenarios", "ttfa,nope"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("voice-out: error: ") for line in err)
    assert "1,x" in err[0] and "nope" in err[1]


def test_component_timers_time_each_call_and_keep_results() -> None:
    from voice_out.bench.timing import time_method, time_ms

    calls: list[int] = []
    ms = time_ms(lambda: calls.append(1), "cpu", warmup=2, iters=5)
    assert len(ms) == 5 and len(calls) == 7 and all(m >= 0 for m in ms)

    class Box:
        def double(self, x: int) -> int:
            return 2 * x

    times: dict[str, list[float]] = {}
    time_method(Box, "double", lambda self, x: f"x={x}", times, sync=False)
    time_method(Box, "missing", "never", times)  # no such method: left alone
    assert Box().double(3) == 6 and Box().double(3) == 6 and Box().double(4) == 8
    assert sorted((k, len(v)) for k, v in times.items()) == [("x=3", 2), ("x=4", 1)]

    class Slow:
        def wait(self) -> None:
            time.sleep(0.002)

    timeline: list[tuple[float, float, str]] = []
    t0 = time.perf_counter()
    time_method(Slow, "wait", "wait", {}, sync=False, timeline=timeline)
    Slow().wait()
    Slow().wait()
    assert [tag for _, _, tag in timeline] == ["wait", "wait"]
    (s1, d1, _), (s2, _, _) = timeline
    assert t0 <= s1 and d1 >= 0.002 and s2 >= s1 + d1  # starts and durations in perf_counter seconds


def test_late_frames_are_read_from_the_servers_histogram() -> None:
    from voice_out.bench.webrtc_bench import LateFrames, late_frames
    from voice_out.server.metrics import Metrics

    m = Metrics()
    assert late_frames(m) == LateFrames(0, 0)
    for lag_s in (0.006, 0.012, 0.02, 0.021, 0.3):
        m.late_frames.observe(lag_s)
    assert late_frames(m) == LateFrames(5, 2)  # 20 ms itself is within the 20 ms bucket


def test_late_frames_are_read_from_a_servers_exposition() -> None:
    """The aiortc client runs in a process of its own and reads the count from ``/metrics``."""
    from voice_out.bench.webrtc_bench import LateFrames, parse_late_frames
    from voice_out.server.metrics import Metrics

    m = Metrics()
    assert parse_late_frames(m.render().decode()) == LateFrames(0, 0)
    for lag_s in (0.006, 0.012, 0.02, 0.021, 0.3):
        m.late_frames.observe(lag_s)
    assert parse_late_frames(m.render().decode()) == LateFrames(5, 2)


@pytest.mark.asyncio
async def test_each_utterance_counts_the_frames_built_late_meanwhile() -> None:
    from voice_out.bench.webrtc_bench import Utterance, WebrtcBenchOptions, _series, _watched, late_frames
    from voice_out.server.metrics import Metrics

    m = Metrics()
    m.late_frames.observe(0.5)  # before the utterances: not theirs
    lags = {"warm0": (0.01, 0.03), "u0": ()}

    async def utterance(uid: str) -> Utterance:
        for lag in lags[uid]:
            m.late_frames.observe(lag)
        return Utterance(100.0, 60.0, 50.0)

    async def late() -> int:
        return late_frames(m).over_5ms

    lines: list[str] = []
    opts = WebrtcBenchOptions(reps=1, warmup_reps=1)
    warm, measured = await _series(opts, lines.append, late, utterance, lambda r: f"TTFA {r.ttfa_ms:.0f} ms")
    assert ([w.late_frames for w in warm], [r.late_frames for r in measured]) == ([2], [0])
    assert lines == [
        "webrtc: warm-up utterance 1: TTFA 100 ms, 2 frames late",
        "webrtc: utterance 1/1: TTFA 100 ms, 0 frames late",
    ]
    assert (await _watched(None, utterance("u0"))).late_frames is None  # a remote server: unknown
