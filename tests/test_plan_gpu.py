"""The plan on a real GPU: a plan forced to what an sm 8.9 card (RTX 40xx, L4) gets runs the
engine on this one as close to the float32 reference as the plain bf16 path, and every Triton
kernel it launches fits the shared memory of an 8.6/8.9 card; and a budget is kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import REPO_ROOT
from voice_out.config import Config, EngineConfig, ModelConfig, ServerConfig
from voice_out.engine.build import BuildOptions
from voice_out.engine.engine import Engine
from voice_out.engine.scheduler import ForcedTokens
from voice_out.fast.kernels import decode as decode_kernels
from voice_out.fast.kernels import flow as flow_kernels
from voice_out.fast.kernels import launch as launch_mod
from voice_out.fast.kernels import vocoder as hift_kernels
from voice_out.fast.kernels.launch import Launch, launch
from voice_out.fast.plan import GIB, SHARED_MEMORY_PER_BLOCK

#: Opt-in shared memory per block of an sm 8.6 / 8.9 card (99 KB).
ADA_SHARED = SHARED_MEMORY_PER_BLOCK[(8, 9)]
TEXTS = ("Hello there, and a bit more to say.", "A second stream, speaking beside it.")


def _engine(tmp: Path, dtype: str, *, eager: bool = False, pins: dict[str, object] | None = None) -> Engine:
    cfg = Config(
        model=ModelConfig(dtype=dtype),  # type: ignore[arg-type]
        engine=EngineConfig(max_streams=4, eager=eager),
        server=ServerConfig(voices_dir=str(tmp / "no-voices")),
    )
    return Engine.load(
        cfg,
        model="random:tiny",
        device="cuda",
        options=BuildOptions(
            forced=ForcedTokens(3), text_normalizer="none", kv_len=512, noise_prompt_tokens=50, pins=pins
        ),
    )


def _speak(eng: Engine) -> list[np.ndarray]:
    eng.start(timeout=600)
    try:
        streams = [eng.open_stream(seed=7 + i) for i in range(len(TEXTS))]
        for s, t in zip(streams, TEXTS, strict=True):
            s.push_text(t)
            s.end_text()
        return [np.concatenate([c.pcm for c in s]) for s in streams]
    finally:
        eng.close()


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b)) / max(float(np.linalg.norm(b)), 1e-12)


def _shared_bytes(compiled: Any) -> int:
    """A compiled Triton kernel's shared memory per block (its metadata's, by Triton version)."""
    meta = getattr(compiled, "metadata", None)
    for holder in (meta, compiled):
        value = getattr(holder, "shared", None)
        if value is not None:
            return int(value)
    raise AssertionError(f"no shared-memory figure on {compiled!r}")


@pytest.mark.requires_cuda
def test_the_8_9_plan_runs_here_like_the_plain_path_and_its_kernels_fit_99_kb(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launched: dict[tuple[Any, ...], Launch] = {}

    def spy(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        if not launch_mod.recording_active():  # a dry run's launches are recorded, not run
            key = (id(kernel), tuple(sorted(kwargs.items())), tuple(type(a).__name__ for a in args), grid[:0])
            launched.setdefault(key, Launch(kernel, grid, args, kwargs))
        launch(kernel, grid, *args, **kwargs)

    for mod in (flow_kernels, decode_kernels, hift_kernels):
        monkeypatch.setattr(mod, "launch", spy)
    ada = _engine(tmp_path / "a", "bfloat16", pins={"capability": "8.9"})
    plan = ada.plan
    assert plan.capability == "8.9" and not plan.dependent_launch
    assert plan.cuda_graphs and plan.fused_decode and plan.fused_flow and plan.fused_vocoder
    fast = _speak(ada)
    assert launched, "the 8.9 plan launched no Triton kernel"
    too_big = []
    for ln in launched.values():
        compiled = ln.kernel.warmup(*ln.args, grid=ln.grid, **ln.kwargs)
        shared = _shared_bytes(compiled)
        if shared > ADA_SHARED:
            too_big.append((ln.kernel.fn.__name__, dict(ln.kwargs), shared))
    assert not too_big, f"kernels over {ADA_SHARED} bytes of shared memory a block: {too_big}"
    monkeypatch.undo()
    plain = _speak(_engine(tmp_path / "p", "bfloat16", eager=True))
    ref = _speak(_engine(tmp_path / "r", "float32", eager=True))
    for got, base, want in zip(fast, plain, ref, strict=True):
        assert got.shape == base.shape == want.shape
        e_fast, e_plain = _rel(got, want), _rel(base, want)
        assert e_fast < 1.5 * e_plain + 5e-3, (e_fast, e_plain)


#: The budgeted engine, in a process of its own: the budget is the process's, and blocks that
#: the tests before it left in this one (their engines, cached models) would count against it.
BUDGET_CHILD = """
import json, sys, time
import torch
from voice_out.config import Config, EngineConfig, ServerConfig
from voice_out.engine.build import BuildOptions
from voice_out.engine.engine import Engine
from voice_out.engine.scheduler import ForcedTokens

GIB = 1 << 30
cfg = Config(engine=EngineConfig(gpu_memory=4.0), server=ServerConfig(voices_dir=sys.argv[1]))
opts = BuildOptions(forced=ForcedTokens(3), text_normalizer="none")
eng = Engine.load(cfg, model="random:tiny", device="cuda", options=opts)
out = {"budget": eng.plan.budget_bytes, "estimated": eng.plan.estimated_bytes}
eng.start(timeout=600)
while eng.warming:  # start-up's captures after ready are start-up too
    time.sleep(0.01)
stream = eng.open_stream()
stream.push_text("Hello there, and a bit more to say.")
stream.end_text()
out["samples"] = sum(len(c.pcm) for c in stream)
out["reserved"] = torch.cuda.memory_reserved()
eng.close()
try:
    torch.empty(4 * GIB, dtype=torch.uint8, device="cuda")
    out["cap_holds"] = False
except torch.OutOfMemoryError:
    out["cap_holds"] = True
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.requires_cuda
def test_a_budget_is_planned_for_and_enforced(tmp_path: Path) -> None:
    """A 4 GiB budget: the plan fits it, torch's allocator is capped below it while the engine
    starts and speaks, and a budget below the model and one stream fails at load in one line."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(
        [sys.executable, "-c", BUDGET_CHILD, str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT ") :])
    assert out["budget"] == 4 * GIB and out["estimated"] <= 4 * GIB
    assert out["samples"] > 0
    assert out["reserved"] <= 4 * GIB
    assert out["cap_holds"]
    tiny = Config(engine=EngineConfig(gpu_memory="0.5 GiB"))
    from voice_out.config import ConfigError

    with pytest.raises(ConfigError, match=r"^engine.gpu_memory: a budget of 0.50 GiB cannot hold"):
        Engine.load(tiny, model="random:0.5b", device="cuda")
