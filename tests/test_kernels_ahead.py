"""Compiling the fused kernels ahead: launches recorded by a dry run, one compile per
specialisation, on several threads; the CUDA test runs the real engine's dry runs."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from voice_out.engine.kernels import compile_ahead, distinct_launches, dry_run_launches
from voice_out.model import launch as launch_mod
from voice_out.model.launch import Launch, launch, recording


class FakeKernel:
    """Stands in for a Triton ``JITFunction``: counts launches and ``warmup`` compiles."""

    def __init__(self, fail: bool = False, compile_s: float = 0.0) -> None:
        self.launched: list[tuple[tuple[int, ...], tuple[Any, ...]]] = []
        self.compiled: list[tuple[Any, ...]] = []
        self.threads: set[str] = set()
        self.fail = fail
        self.compile_s = compile_s

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return lambda *args, **kw: self.launched.append((grid, args))

    def warmup(self, *args: Any, grid: tuple[int, ...], **kw: Any) -> None:
        self.threads.add(threading.current_thread().name)
        time.sleep(self.compile_s)
        if self.fail:
            raise RuntimeError("no compiler here")
        self.compiled.append(args)


def test_launch_runs_the_kernel_outside_a_recording_and_records_it_inside() -> None:
    k = FakeKernel()
    x = torch.zeros(4)
    launch(k, (2,), x, 7, BLOCK=16)
    assert k.launched == [((2,), (x, 7))]
    with recording() as launches:
        launch(k, (3,), x, 8, BLOCK=16)
        with pytest.raises(RuntimeError, match="already"), recording():
            pass
    assert k.launched == [((2,), (x, 7))]  # recorded, not run
    assert launches == [Launch(k, (3,), (x, 8), {"BLOCK": 16})]
    assert launch_mod._recorded is None  # the recording ended with its block
    launch(k, (1,), x, 1)
    assert len(k.launched) == 2


def test_one_compile_per_specialisation() -> None:
    k, other = FakeKernel(), FakeKernel()
    a, b = torch.zeros(64), torch.zeros(64, dtype=torch.float16)
    launches = [
        Launch(k, (1,), (a, 32), {"BLOCK": 16}),
        Launch(k, (9,), (a, 48), {"BLOCK": 16}),  # same classes (a multiple of 16): the same compile
        Launch(k, (1,), (a, 33), {"BLOCK": 16}),  # not a multiple of 16
        Launch(k, (1,), (a, 1), {"BLOCK": 16}),  # 1 is its own class
        Launch(k, (1,), (b, 32), {"BLOCK": 16}),  # another dtype
        Launch(k, (1,), (a[1:], 32), {"BLOCK": 16}),  # not 16-byte aligned
        Launch(k, (1,), (a, 32), {"BLOCK": 32}),  # another constexpr
        Launch(other, (1,), (a, 32), {"BLOCK": 16}),  # another kernel
    ]
    assert len(distinct_launches(launches)) == 7
    assert compile_ahead(launches, workers=4) == 7
    assert len(k.compiled) == 6 and len(other.compiled) == 1


def test_compiles_run_on_several_threads_and_a_failure_is_only_logged(caplog: pytest.LogCaptureFixture) -> None:
    kernels = [FakeKernel(compile_s=0.05) for _ in range(8)] + [FakeKernel(fail=True)]
    launches = [Launch(k, (1,), (torch.zeros(4),), {}) for k in kernels]
    t0 = time.perf_counter()
    assert compile_ahead(launches, workers=8) == 8  # the failing one is not counted
    assert time.perf_counter() - t0 < 8 * 0.05  # overlapped
    assert len({name for k in kernels for name in k.threads}) > 1
    assert "compiles on first use" in caplog.text
    assert compile_ahead([], workers=8) == 0


@pytest.mark.requires_cuda
def test_the_engine_dry_runs_record_every_fused_kernel_and_compile_them() -> None:
    from voice_out.engine.engine import Engine
    from voice_out.engine.runner import Runner, noise_voice

    eng = Engine.load(model="random:tiny", device="cuda", text_normalizer="none", kv_len=256, warmup=False)
    eng.start(timeout=300)
    try:
        worker = eng._worker
        assert worker is not None and isinstance(worker.runner, Runner)
        runner = worker.runner
        flow_fused = getattr(getattr(runner.t2w.flow, "estimator", None), "kernels", False)
        if not (runner.graphed is not None and runner.graphed.fused and flow_fused):
            pytest.skip("the fused kernels do not run for this model here")
        _, voice = noise_voice(25)
        launches = dry_run_launches(runner, voice)
        names = {ln.kernel.fn.__name__ for ln in launches}
        flow_names = {"_ln_linear_kernel", "_linear_kernel", "_attention_kernel", "_conv_kernel"}
        decode_names = {"_rope_append_attend_kernel", "_silu_mul_kernel", "_ras_sample_kernel"}
        if runner.graphed.fused_linear:  # steps of up to 16 rows; the gate above is the larger buckets'
            decode_names |= {"_norm_linear_kernel", "_linear_residual_kernel"}
        assert flow_names | decode_names <= names
        assert any(ln.kwargs.get("HAS_KF") for ln in launches)  # the final chunk's key-padded attention
        n = compile_ahead(launches)
        assert n == len(distinct_launches(launches)) >= 10
        # compiled: a launch of each now finds its kernel in Triton's cache
        for ln in distinct_launches(launches):
            assert ln.kernel.warmup(*ln.args, grid=ln.grid, **ln.kwargs) is not None
    finally:
        eng.close()
