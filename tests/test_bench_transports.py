"""scripts/bench_transports.py on random:tiny on the CPU: its smoke path, end to end.

The figures say nothing about speed here. What is asserted: every mode ran every round through
its own transport (the clients in a process of their own), every request was matched to its
engine stream, each was read to its end (the same audio for every mode), the per-request
figures agree with each other, and the repeats and their median are there. The client process
refuses to run with any of the server's stack imported (torch, voice_out, aiortc, av): the run
passing shows it ran without.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_transports.py"
MODES = ("engine", "elevenlabs", "openai", "openai_warm")


def test_bench_transports_smoke(tmp_path: Path) -> None:
    out = tmp_path / "transports.json"
    argv = [
        str(SCRIPT),
        *("--model", "random:tiny", "--device", "cpu", "--threads", "1"),
        *("--streams", "2", "--reps", "1", "--repeats", "2", "--warmup", "0"),
        *("--chars", "12", "--prompt-tokens", "25", "--ramp-s", "0.05", "--out", str(out)),
    ]
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "median over 2 repeats" in proc.stdout

    doc = json.loads(out.read_text())
    assert doc["rounds_per_repeat"] == {"2": 1} and doc["ramp_s"] == 0.05 and doc["cancel_at_first"] is False
    assert doc["complete"] is True and len(doc["repeats"]) == 2 and len(doc["requests"]) == 2
    for raw, per in zip(doc["requests"], doc["repeats"], strict=True):
        for mode in MODES:  # each request's own figures: its place in the ramp, client, engine part, arrive
            rows = raw["2"][mode]
            assert sorted(r[0] for r in rows) == [0, 1]
            assert max(r[1] for r in rows) >= per["2"][mode]["client_p50"] >= min(r[1] for r in rows)
    audio = set()
    for per in [*doc["repeats"], doc["median"]]:
        assert set(per) == {"2"} and set(per["2"]) == set(MODES)
        for mode, f in per["2"].items():
            assert all(math.isfinite(v) for v in f.values()), (mode, f)
            assert f["n"] == 2  # one round of 2 requests, each matched to its engine stream
            assert 0 < f["engine_part_p50"] and f["client_p50"] <= f["client_p95"]
            assert f["cost_p50"] <= f["cost_p95"]
            # the client's clock starts before the server's end_text and stops after the first chunk
            assert f["cost_p50"] > 0 and f["arrive_p50"] >= 0, (mode, f)
            audio.add(round(f["audio_s"], 3))
        assert per["2"]["engine"]["over_engine_p50"] == 0
        # in process there is no transport: the cost is open_stream + push_text
        assert per["2"]["engine"]["cost_p95"] < 50
    # every stream was read to its end: 12 characters x 3 forced speech tokens at 25 Hz, in
    # every mode alike (0.04 s per token, less the last tokens a chunk holds back)
    assert len(audio) == 1 and 1.0 <= audio.pop() <= 1.44
