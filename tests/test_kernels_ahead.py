"""Compiling the fused kernels ahead: launches recorded by a dry run, one compile per
specialisation, on several threads; the CUDA test runs the real engine's dry runs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from voice_out.engine.build import BuildOptions
from voice_out.fast import fused_flow
from voice_out.fast.kernels.launch import Launch, launch, recording, recording_active
from voice_out.fast.kernels.precompile import (
    compile_ahead,
    distinct_launches,
    dry_run_ends,
    dry_run_launches,
    specialisation,
)


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
        launch(k, (3,), x[1:], 8, BLOCK=16)  # 4 bytes past a 16-byte boundary
        with pytest.raises(RuntimeError, match="already"), recording():
            pass
    assert k.launched == [((2,), (x, 7))]  # recorded, not run
    # recorded with a stand-in of each tensor: what Triton specialises on (dtype, alignment to
    # 16 bytes), none of the dry run's memory (its tensors are freed as it goes)
    assert [(ln.kernel, ln.grid, ln.args[1:], ln.kwargs) for ln in launches] == [(k, (3,), (8,), {"BLOCK": 16})] * 2
    for ln, real in zip(launches, (x, x[1:]), strict=True):
        stand_in = ln.args[0]
        assert stand_in.numel() == 1 and stand_in.dtype == real.dtype and stand_in.device == real.device
        assert stand_in.data_ptr() % 16 == real.data_ptr() % 16
        assert stand_in.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert not recording_active()  # the recording ended with its block
    launch(k, (1,), x, 1)
    assert len(k.launched) == 2


def test_a_recording_holds_its_own_thread_s_launches_only() -> None:
    """Two engines of one process start at once: one records its dry runs on its worker
    thread while the other's launches run."""
    k = FakeKernel()
    x = torch.zeros(4)
    with recording() as launches:
        other = threading.Thread(target=launch, args=(k, (5,), x))
        other.start()
        other.join()
        launch(k, (6,), x)
    assert k.launched == [((5,), (x,))]
    assert [(ln.kernel, ln.grid) for ln in launches] == [(k, (6,))]


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
    # an argument the kernel does not specialise on (Triton's params): one class for every value
    k.params = [SimpleNamespace(num=1, do_not_specialize=True)]  # type: ignore[attr-defined]
    assert len(distinct_launches(launches)) == 5  # 32, 33 and 1 are one compile now
    del k.params  # type: ignore[attr-defined]
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


def test_the_work_meanwhile_runs_once_the_llm_s_and_vocoder_s_kernels_are_compiled() -> None:
    """``compile_ahead(meanwhile=)``: the early kernels (the decode step's and the vocoder's
    modules) compile first, and the calling thread runs ``meanwhile`` once they are done, while
    the others go on, told whether they still are; everything is compiled when it returns."""
    early = [FakeKernel(compile_s=0.05) for _ in range(2)]
    late = [FakeKernel(compile_s=0.2) for _ in range(3)]
    for k, module in zip(early, ("voice_out.fast.kernels.decode", "voice_out.fast.kernels.vocoder"), strict=True):
        k.fn = SimpleNamespace(__module__=module)  # type: ignore[attr-defined]
    for k in late:
        k.fn = SimpleNamespace(__module__="voice_out.fast.kernels.flow")  # type: ignore[attr-defined]
    launches = [Launch(k, (1,), (torch.zeros(4),), {}) for k in late + early]  # the late ones listed first
    seen: list[tuple[int, int]] = []
    compiling: list[bool] = []

    def meanwhile(still: Callable[[], bool]) -> None:
        seen.append((sum(len(k.compiled) for k in early), threading.get_ident()))
        compiling.append(still())  # the late ones take 0.2 s: still compiling
        while still():
            time.sleep(0.01)
        compiling.append(still())
        compiling.append(all(len(k.compiled) == 1 for k in late))

    assert compile_ahead(launches, workers=2, meanwhile=meanwhile) == 5
    assert seen == [(2, threading.get_ident())]  # once, on this thread, the early ones done
    assert compiling == [True, False, True]
    assert all(len(k.compiled) == 1 for k in early + late)
    calls: list[bool] = []
    assert compile_ahead([], meanwhile=lambda still: calls.append(still())) == 0 and calls == [False]


def test_the_dry_runs_reach_every_tile_tier_the_noise_buffer_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    from voice_out.fast.kernels import flow as flow_kernels

    monkeypatch.setattr(flow_kernels, "TILE_TIERS", ((0, {}), (384, {}), (1024, {})))
    dims = SimpleNamespace(enc_chunk=25, token_mel_ratio=2, pre_lookahead=3, max_tokens=1500)
    flow: Any = SimpleNamespace(dims=dims)
    # P = 25: the first chunk ends at 50 (2 x 2 x 50 = 200 rows); 100 is the first end with
    # 400 >= 384 rows, 275 the first with 2 x 2 x 275 = 1100 >= 1024 rows (256 tokens would
    # do; ends are whole chunks)
    assert dry_run_ends(flow, 25) == [50, 100, 275]
    assert dry_run_ends(flow, 150) == [175, 275]  # 700 rows: the middle tier already
    assert dry_run_ends(flow, 300) == [325]  # the first chunk is tall already
    dims.max_tokens = 200  # the noise buffer holds no tall chunk
    assert dry_run_ends(flow, 25) == [50, 100]


@pytest.mark.requires_cuda
def test_the_engine_dry_runs_record_every_fused_kernel_and_compile_them() -> None:
    from voice_out.engine.engine import Engine
    from voice_out.engine.runner import Runner, noise_voice

    eng = Engine.load(
        model="random:tiny", device="cuda", options=BuildOptions(text_normalizer="none", kv_len=256, warmup=False)
    )
    eng.start(timeout=300)
    try:
        worker = eng._worker
        assert worker is not None and isinstance(worker.runner, Runner)
        runner = worker.runner
        flow_fused = isinstance(runner.t2w.flow, fused_flow.FusedFlow)
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


@pytest.mark.requires_cuda
def test_a_start_and_its_first_utterances_launch_no_kernel_its_dry_runs_missed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kernel specialisation that a start launches (warm-up, the LLM's and the default
    voice's token2wav graph captures), and then its first utterances (the voice's prefix
    prefilled, its first row drawn from the prefill, the decode steps, the chunks), was among
    its dry runs' launches: nothing is left to compile one after another during the captures,
    nor during a listener's first sentence (a missed sampler specialisation once cost a
    server's first utterance ~1.6 s on an H200); and every one the utterances launch was
    launched during the start already (its first launch loads it). A 150-token prompt (the
    benchmark's) with the 25-token warm-up voice: the long chunks captured reach the tall
    tile tier."""

    from voice_out.engine.engine import Engine
    from voice_out.engine.scheduler import ForcedTokens
    from voice_out.fast.kernels import decode as decode_kernels
    from voice_out.fast.kernels import flow as flow_kernels
    from voice_out.fast.kernels import precompile as kernels_mod

    launched: dict[tuple[Any, ...], str] = {}

    def spy(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        if not recording_active():
            key = specialisation(Launch(kernel, grid, args, kwargs))
            launched[key] = f"{kernel.fn.__name__} {key[1:]}"
        launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(flow_kernels, "launch", spy)
    monkeypatch.setattr(decode_kernels, "launch", spy)
    dry: list[Launch] = []
    real_dry_run = kernels_mod.dry_run_launches

    def keep(runner: Any, voice: Any, **kwargs: Any) -> list[Launch]:
        out = real_dry_run(runner, voice, **kwargs)
        dry.extend(out)
        return out

    monkeypatch.setattr(kernels_mod, "dry_run_launches", keep)
    eng = Engine.load(
        model="random:tiny",
        device="cuda",
        options=BuildOptions(
            text_normalizer="none",
            noise_prompt_tokens=150,
            pins={"capture_tokens": 400, "capture_batch_tokens": 300},
            forced=ForcedTokens(3),
        ),
    )
    eng.start(timeout=600)
    at_start = set(launched)
    try:
        # the whole text at once, then in small deltas (as an agent's LLM streams it)
        for deltas in (["Hello there, this is the first sentence."], ["And ", "a sec", "ond o", "ne."]):
            stream = eng.open_stream()
            for d in deltas:
                stream.push_text(d)
            stream.end_text()
            assert sum(len(c.pcm) for c in stream) > 0
    finally:
        eng.close()
    if not dry:
        pytest.skip("no fused kernels (no dry run) for this model here")
    assert launched, "the start launched no fused kernel"
    planned = {specialisation(ln) for ln in dry}
    missed = sorted(name for key, name in launched.items() if key not in planned)
    assert not missed, f"compiled on first use during the start or the first utterances: {missed}"
    # nor launched first by a request: a specialisation's first launch loads it and builds its
    # launcher (~70 ms on an H200), which the start's warm-up pays instead
    first_in_requests = sorted(name for key, name in launched.items() if key not in at_start)
    assert not first_in_requests, f"first launched by a request: {first_in_requests}"
