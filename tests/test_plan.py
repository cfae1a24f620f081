"""The fast-path plan (voice_out.fast.plan): budget + capability + model sizes -> every choice.

Pure: every test runs on the CPU, over the sizes of the full-size model (random:0.5b's dims,
weights counted on the meta device) in bf16 with the engine's default KV length.
"""

from __future__ import annotations

import dataclasses

import pytest

from voice_out.engine.build import random_dims_dir
from voice_out.fast.plan import (
    CAPTURE_LADDER,
    GIB,
    Capability,
    ModelSizes,
    Plan,
    PlanError,
    cpu_plan,
    flow_state_bytes,
    make_plan,
    prefix_bytes,
    stream_bytes,
)
from voice_out.fast.sizes import model_sizes
from voice_out.model.checkpoint import flow_dims, hift_dims, llm_dims, load_yaml

H100_80GB = int(79.2 * GIB)  # what an H100 80 GB reports as its total memory
HOPPER = Capability.of(9, 0)
ADA = Capability.of(8, 9)


@pytest.fixture(scope="module")
def sizes() -> ModelSizes:
    """The benchmark's model: KV slots of 2048 positions, a 150-token voice prompt."""
    d = random_dims_dir("0.5b")
    y = load_yaml(d)
    return model_sizes(llm_dims(d), flow_dims(y), hift_dims(y), dtype_bytes=2, kv_len=2048, prompt_tokens=150)


def plan_for(sizes: ModelSizes, gib: float, cap: Capability = HOPPER, **kw: object) -> Plan:
    """The plan for ``gib`` GiB; by default as the benchmark asks (its one voice, 64 streams)."""
    kw.setdefault("voices", 1)
    return make_plan(int(gib * GIB), cap, sizes, max_streams=kw.pop("max_streams", 64), **kw)  # type: ignore[arg-type]


def test_the_sizes_follow_the_dims(sizes: ModelSizes) -> None:
    """Weights, a KV slot and a flow-state token of the full-size model, as measured on an H200
    (scripts/calibrate_memory.py): 1.448 GB of weights, 25.2 MB a KV slot of 2048 positions,
    ~4.6 MB a flow-state token."""
    assert sizes.weight_bytes == pytest.approx(1_448_095_872, rel=0.01)
    assert sizes.kv_slot_bytes == 25_165_824  # 2048 positions
    assert sizes.flow_state_bytes_per_token == pytest.approx(4.59e6, rel=0.02)


@pytest.mark.parametrize(
    ("gib", "streams_at_least", "prefixes_at_least", "capture_at_least"),
    [
        (8, 16, 1, 500),  # 16 streams, the default voice's prefix, 20 s captured
        (22, 32, 1, 1500),  # a 24 GB card: 32 streams, 60 s captured
    ],
)
def test_each_budget_row_fits_its_target(
    sizes: ModelSizes, gib: float, streams_at_least: int, prefixes_at_least: int, capture_at_least: int
) -> None:
    """The issue's table rows of 8 and 22 GiB: the plan fits its budget (the estimate within
    it) and holds at least the streams, prefixes and captured range the row's targets need;
    what did not fit is named, and a lowered ``max_streams`` says so."""
    plan = plan_for(sizes, gib)
    assert plan.estimated_bytes <= gib * GIB
    assert plan.max_streams >= streams_at_least
    assert plan.first_chunk_prefix_voices >= prefixes_at_least
    assert plan.capture_tokens >= capture_at_least
    assert plan.cuda_graphs and plan.token2wav_graphs and plan.fused_flow and plan.dependent_launch
    if plan.max_streams < 64:
        assert any("max_streams lowered from 64" in n for n in plan.notes)
        assert any(w.startswith("streams ") for w, _ in plan.left_out)
    assert dict(plan.estimate)["weights"] == sizes.weight_bytes
    # the LLM's graph buckets reach max_streams + the batched input rows, no further
    assert plan.graph_batch_buckets[-1] < plan.max_streams + plan.batched_input_rows


def test_4_gib_keeps_token2wav_graphs_for_4_streams(sizes: ModelSizes) -> None:
    """The 4 GiB row (beside an agent's LLM): the weights, context, libraries and the LLM's
    base leave room for token2wav's graphs over the first 100 tokens (eager token2wav gave a
    first audio of 167 ms on an H200, against the row's 90 ms) and the row's 4 streams; the
    first-chunk lane, a prompt prefix and longer captures are left out, and named."""
    plan = plan_for(sizes, 4, max_streams=4)
    assert plan.estimated_bytes <= 4 * GIB
    assert plan.max_streams == 4 and plan.notes == ()
    assert plan.cuda_graphs and plan.token2wav_graphs and plan.capture_tokens == CAPTURE_LADDER[-1]
    assert not plan.first_chunk_lane and plan.capture_batch_tokens == 0
    assert plan.fused_flow  # the kernels need no pool: they stay
    assert [w for w, _ in plan.left_out][:2] == ["first-chunk lane", "capture 250 tokens"]


def test_below_4_gib_token2wav_runs_eagerly_beside_graphed_llm(sizes: ModelSizes) -> None:
    """When not even token2wav's smallest capture fits, only the LLM's graphs (a small part of
    the base) stay: token2wav runs eagerly with its fused kernels, and the plan says so."""
    plan = plan_for(sizes, 3.5, max_streams=4)
    assert plan.estimated_bytes <= 3.5 * GIB
    assert plan.cuda_graphs and not plan.token2wav_graphs and not plan.first_chunk_lane
    assert plan.fused_flow and plan.max_chunks_per_step == 4
    assert any("token2wav's CUDA graphs left out" in n for n in plan.notes)
    assert "token2wav_graphs" not in dict(plan.estimate)
    assert "eager token2wav" in plan.summary()


def test_a_small_budget_leaves_out_the_costly_parts_first(sizes: ModelSizes) -> None:
    small, mid = plan_for(sizes, 5), plan_for(sizes, 8)
    assert small.flow_state_streams == 0 and small.first_chunk_prefix_voices == 0
    assert any(w.startswith("prompt prefix") for w, _ in small.left_out)
    assert mid.max_streams > small.max_streams and mid.capture_tokens > small.capture_tokens
    assert mid.flow_state_streams == 0  # a 500-token state is 3 GB: not at 8 GiB


def test_a_whole_h100_gets_today_s_full_plan(sizes: ModelSizes) -> None:
    """The whole card (90% of it free): every stream and every fast path at its largest, as the
    engine ran before budgets (64 streams, 60 s captured, 4 prefixes, one 60 s flow state)."""
    plan = plan_for(sizes, 0.9 * H100_80GB / GIB, voices=4)
    assert (plan.max_streams, plan.capture_tokens, plan.capture_batch_tokens) == (64, 1500, 500)
    assert (plan.first_chunk_prefix_voices, plan.flow_state_streams, plan.flow_state_tokens) == (4, 1, 1500)
    assert plan.left_out == () and plan.notes == ()
    assert plan.graph_batch_buckets == (1, 2, 4, 8, 16, 32, 48, 64, 96, 128)
    assert plan.estimated_bytes < 35 * GIB


def test_prefixes_are_planned_for_the_voices_known(sizes: ModelSizes) -> None:
    one, four = plan_for(sizes, 40), plan_for(sizes, 40, voices=4)
    assert (one.first_chunk_prefix_voices, four.first_chunk_prefix_voices) == (1, 4)
    assert four.estimated_bytes > one.estimated_bytes


def test_the_22_gib_row_takes_a_shorter_flow_state(sizes: ModelSizes) -> None:
    plan = plan_for(sizes, 22)
    assert plan.flow_state_streams == 1 and plan.flow_state_tokens < 1500
    assert dict(plan.estimate)["flow_states"] == flow_state_bytes(sizes, plan.flow_state_tokens)
    assert dict(plan.estimate)["prompt_prefixes"] == plan.first_chunk_prefix_voices * prefix_bytes(sizes)


@pytest.mark.parametrize(
    ("cap", "kernels", "pdl"),
    [((8, 0), True, False), ((8, 6), True, False), ((8, 9), True, False), ((9, 0), True, True), ((7, 5), False, False)],
)
def test_capability_gates_every_kernel_and_launch_option(
    sizes: ModelSizes, cap: tuple[int, int], kernels: bool, pdl: bool
) -> None:
    """Triton kernels on the capabilities whose shared memory their tiles were sized for (8.0,
    8.6, 8.9, 9.0); programmatic dependent launch on Hopper only; an unknown capability gets
    the most conservative plan: CUDA graphs of plain PyTorch, no prefixes or flow states (they
    need the fused flow)."""
    plan = plan_for(sizes, 22, Capability.of(*cap))
    assert (plan.fused_decode, plan.fused_linear, plan.fused_flow, plan.fused_vocoder) == (kernels,) * 4
    assert plan.dependent_launch is pdl
    assert plan.cuda_graphs
    if not kernels:
        assert plan.first_chunk_prefix_voices == 0 and plan.flow_state_streams == 0
        assert not Capability.of(*cap).known
    else:
        assert Capability.of(*cap).shared_memory_per_block >= 99 * 1024


def test_without_triton_or_in_fp32_no_kernels(sizes: ModelSizes) -> None:
    assert not plan_for(sizes, 22, triton=False).fused_flow
    fp32 = dataclasses.replace(sizes, half_precision=False)
    assert not plan_for(fp32, 22).fused_decode


def test_eager_is_no_fast_path(sizes: ModelSizes) -> None:
    plan = plan_for(sizes, 22, eager=True)
    assert not (plan.cuda_graphs or plan.token2wav_graphs or plan.fused_decode or plan.fused_flow)
    assert not plan.dependent_launch and not plan.first_chunk_lane and plan.max_chunks_per_step == 4
    assert plan.capture_batch_tokens == 0 and plan.first_chunk_prefix_voices == 0


def test_max_streams_is_a_cap(sizes: ModelSizes) -> None:
    plan = plan_for(sizes, 22, max_streams=8)
    assert plan.max_streams == 8 and plan.notes == ()
    assert plan.graph_batch_buckets[-1] < 8 + 128


def test_a_budget_below_the_model_and_one_stream_fails_in_one_line(sizes: ModelSizes) -> None:
    with pytest.raises(PlanError) as e:
        plan_for(sizes, 2.5)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("engine.gpu_memory: a budget of 2.50 GiB cannot hold the model and one stream (needs ")
    assert "raise engine.gpu_memory" in msg
    # the smallest budget that works is the one the message names
    need = float(msg.split("(needs ")[1].split(" GiB")[0])
    plan = plan_for(sizes, need + 0.01)
    assert plan.max_streams >= 1 and plan.estimated_bytes <= (need + 0.01) * GIB


def test_the_onnx_runtime_arena_is_budgeted(sizes: ModelSizes) -> None:
    plain, with_ort = plan_for(sizes, 8), plan_for(sizes, 8, onnx_on_device=True)
    assert dict(with_ort.estimate)["onnx_runtime"] > 0 and "onnx_runtime" not in dict(plain.estimate)
    assert with_ort.max_streams <= plain.max_streams


def test_pins_set_single_choices_and_count_against_the_budget(sizes: ModelSizes) -> None:
    plan = plan_for(sizes, 22, pins={"capture_tokens": 250, "step_ahead_rows": 0, "flow_state_streams": 0})
    assert (plan.capture_tokens, plan.step_ahead_rows, plan.flow_state_streams) == (250, 0, 0)
    assert plan.pins == (("capture_tokens", 250), ("flow_state_streams", 0), ("step_ahead_rows", 0))
    with pytest.raises(PlanError, match="more than the budget"):
        plan_for(sizes, 8, pins={"flow_state_streams": 2, "first_chunk_prefix_voices": 1})
    with pytest.raises(PlanError, match="needs a Hopper GPU"):
        plan_for(sizes, 22, ADA, pins={"dependent_launch": True})
    with pytest.raises(PlanError, match="no such choice"):
        plan_for(sizes, 22, pins={"budget_bytes": 1})
    with pytest.raises(PlanError, match="expected int"):
        plan_for(sizes, 22, pins={"capture_tokens": "500"})


def test_the_plan_reads_as_one_log_line_and_a_healthz_object(sizes: ModelSizes) -> None:
    plan = plan_for(sizes, 8, voices=4)
    line = plan.summary()
    assert "\n" not in line and "budget 8.0 GiB on sm 9.0" in line and f"{plan.max_streams} streams" in line
    assert "left out:" in line
    d = plan.as_dict()
    assert d["max_streams"] == plan.max_streams and d["budget_gib"] == 8.0
    assert d["left_out"] and all(isinstance(v, float) for v in d["left_out"].values())
    assert d["estimated_gib"] == pytest.approx(plan.estimated_bytes / GIB, abs=1e-3)


def test_a_cpu_plan_has_no_budget_and_no_gpu_mechanics() -> None:
    plan = cpu_plan(8)
    assert plan.device_type == "cpu" and not plan.cuda_graphs and not plan.fused_decode
    assert plan.max_streams == 8 and plan.max_chunks_per_step == 4
    assert cpu_plan(8, {"first_chunk_lane": True}).first_chunk_lane


def test_more_budget_never_plans_less(sizes: ModelSizes) -> None:
    prev: Plan | None = None
    for gib in (4, 8, 22, 0.9 * H100_80GB / GIB):
        plan = plan_for(sizes, gib)
        assert plan.estimated_bytes <= gib * GIB
        if prev is not None:
            assert plan.max_streams >= prev.max_streams
            assert plan.capture_tokens >= prev.capture_tokens
            assert plan.first_chunk_prefix_voices >= prev.first_chunk_prefix_voices
        prev = plan
    assert stream_bytes(sizes) > sizes.kv_slot_bytes
    assert CAPTURE_LADDER[0] == 1500


def test_the_budget_is_gib_a_share_of_the_card_or_most_of_what_is_free() -> None:
    from voice_out.config import ConfigError
    from voice_out.engine.build import DEFAULT_FREE_SHARE, device_budget

    total, free = int(80 * GIB), int(60 * GIB)
    assert device_budget(22.0, free, total) == 22 * GIB
    assert device_budget("80%", free, total) == int(0.8 * total)
    assert device_budget(0.5, free, total) == int(0.5 * total)
    assert device_budget("6 GiB", free, total) == 6 * GIB
    assert device_budget(None, free, total) == int(DEFAULT_FREE_SHARE * free)
    with pytest.raises(ConfigError, match="more than the card's 80.0 GiB"):
        device_budget(100, free, total)


def test_a_pin_without_cuda_graphs_turns_token2wav_s_off_too(sizes: ModelSizes) -> None:
    """token2wav's graphs exist only with CUDA graphs: the engine reads ``token2wav_graphs``
    alone, so a plan never says the one without the other."""
    plan = plan_for(sizes, 22, pins={"cuda_graphs": False})
    assert not plan.cuda_graphs and not plan.token2wav_graphs
    assert not cpu_plan(4, {"token2wav_graphs": True}).token2wav_graphs
    assert plan_for(sizes, 22).token2wav_graphs
