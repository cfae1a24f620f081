"""``voice-out bench --mode placement``: the capacity search, and a smoke run on two CPU engines.

The figures say nothing about speed here; what is asserted is the search's rule (steps around
the limit, the budget, the cap) and that the run's records are complete and consistent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_bench import RUNNER, by_key
from voice_out.bench.placement_bench import find_capacity

ROOT = Path(__file__).resolve().parent.parent


def searcher(limit_ok: int) -> tuple[list[int], object]:
    """A round that passes up to ``limit_ok`` streams, and the counts it was asked for."""
    asked: list[int] = []

    async def passes(n: int) -> bool:
        asked.append(n)
        return n <= limit_ok

    return asked, passes


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("true_limit", "start", "found", "asked"),
    [
        (23, 20, 22, [20, 22, 24]),  # up in steps of 2 until a round fails
        (17, 20, 16, [20, 18, 16]),  # down until one passes
        (20, 20, 20, [20, 22]),  # a later repetition starting at the capacity found before
        (0, 4, 0, [4, 2]),  # nothing passes: 0
        (500, 60, 64, [60, 62, 64]),  # the cap (engine.max_streams per GPU)
    ],
)
async def test_the_search_steps_around_the_limit(true_limit: int, start: int, found: int, asked: list[int]) -> None:
    calls, passes = searcher(true_limit)
    assert await find_capacity(passes, start, 2, 64, lambda: False) == (found, True)  # type: ignore[arg-type]
    assert calls == asked


@pytest.mark.asyncio
async def test_the_budget_cuts_an_open_search() -> None:
    calls, passes = searcher(30)
    rounds = iter([False, True])
    assert await find_capacity(passes, 20, 2, 64, lambda: next(rounds)) == (22, False)  # type: ignore[arg-type]
    assert calls == [20, 22]


def test_placement_mode_smoke(tmp_path: Path) -> None:
    out = tmp_path / "placement.json"
    argv = [
        "bench", "--mode", "placement", "--model", "random:tiny", "--device", "cpu,cpu",
        "--engine-processes", "shared", "--quick", "--streams", "1", "--reps", "1", "--threads", "1",
        "--set", "engine.max_streams=2", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", RUNNER, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOADED \n" in proc.stdout, "the placement mode imported the WebRTC stack"
    doc = json.loads(out.read_text())
    assert doc["mode"] == "placement" and doc["gpu"] == "cpu" and doc["complete"]
    assert doc["settings"]["devices"] == ["cpu", "cpu"] and doc["settings"]["designs"] == ["shared"]
    v = by_key(doc)
    target = doc["settings"]["ttfa_target_ms"]
    for gpus in (1, 2):
        prefix = f"placement.shared.gpus_{gpus}.rep1.capacity"
        rounds = sorted(n for name, n in v if name == f"{prefix}.underruns")
        assert rounds and all(1 <= n <= 2 * gpus for n in rounds)  # engine.max_streams per GPU caps it
        capacity = next(
            int(val) for (name, _), val in v.items() if name == f"placement.shared.gpus_{gpus}.capacity.max_streams"
        )
        passed = [
            n
            for n in rounds
            if v[(f"{prefix}.underruns", n)] == 0
            and v[(f"{prefix}.failed_streams", n)] == 0
            and v[(f"{prefix}.ttfa.p95", n)] <= target
        ]
        assert capacity == max(passed, default=0)
        for n in rounds:
            assert v[(f"{prefix}.audio_s_per_stream", n)] > 0.5  # every stream spoke (10 chars)
    assert "| placement.shared.gpus_2.capacity.max_streams |" in proc.stdout
