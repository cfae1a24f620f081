"""The scheduler without a model: hand-built step results, an injected clock, no torch."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from voice_out.config import EngineConfig
from voice_out.engine.api import SAMPLE_RATE, StreamFailedError, TextTooLongError
from voice_out.engine.chunk_schedule import ChunkPlan
from voice_out.engine.launch import LaunchPolicy
from voice_out.engine.request import (
    EOS_TOKEN,
    FILL_TOKEN,
    SAMPLES_PER_TOKEN,
    SPEECH_VOCAB,
    LlmStep,
    RequestStatus,
    TextPiece,
    VoicePrompt,
)
from voice_out.engine.scheduler import (
    Emitted,
    Ended,
    ForcedTokens,
    Output,
    Release,
    Scheduler,
    StepPlan,
    StepResult,
)
from voice_out.engine.textfeed import BistreamFeed, CharPipeline
from voice_out.fast.plan import PINNABLE, cpu_plan
from voice_out.text.rows import TASK_ID, RowKind

FORCED = ForcedTokens(3)


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class LaunchedScheduler(Scheduler):
    """The scheduler joined to a launch policy as the worker joins them: ``plan()`` is one
    worker step's ``LaunchPolicy.plan`` over this scheduler, ``launch`` the policy (the
    plan's, as the engine builds it; a test may replace it)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.launch = LaunchPolicy.of(self.fast_plan)

    def plan(self) -> StepPlan:
        return self.launch.plan(self)


def create_scheduler(
    *,
    max_streams: int = 4,
    max_ahead_s: float = 60.0,
    forced: ForcedTokens | None = FORCED,
    max_chunks_per_step: int = 8,
    clock: FakeClock | None = None,
    first_chunk_lane: bool = False,
    **engine: object,
) -> LaunchedScheduler:
    """A scheduler over ``engine`` settings; plan choices among them (``step_ahead_rows``,
    ``first_audio_priority``, ...) are pinned in its plan, as the engine's planner would; its
    ``plan()`` asks the plan's launch policy, as the worker does."""
    pins = {k: engine.pop(k) for k in list(engine) if k in PINNABLE}
    pins.update(max_chunks_per_step=max_chunks_per_step, first_chunk_lane=first_chunk_lane)
    cfg = EngineConfig(max_streams=max_streams, max_ahead_s=max_ahead_s, **engine)  # type: ignore[arg-type]
    return LaunchedScheduler(
        cfg,
        CharPipeline,
        clock=clock or FakeClock(),
        forced=forced,
        plan=cpu_plan(max_streams, pins),
    )


def create_requests(
    sched: Scheduler, n: int, *, text: str | None = None, end: bool = True, prompt_speech: int = 0, prefix: str = "r"
) -> list[str]:
    voice = VoicePrompt("v", prompt_text_ids=tuple(range(prompt_speech // 3)), prompt_speech_ids=(7,) * prompt_speech)
    ids = []
    for i in range(n):
        rid = f"{prefix}{i}"
        sched.add_request(rid, voice, seed=i)
        if text is not None:
            sched.push_text(rid, text)
            if end:
                sched.end_text(rid)
        ids.append(rid)
    return ids


def fake_result(plan: StepPlan, *, token: Callable[[str], int] | None = None, fail: Sequence[str] = ()) -> StepResult:
    """What a runner would return: the forced token (or ``token(id)``), audio of the right size."""
    res = StepResult()
    for w in plan.llm:
        if w.request_id in fail:
            continue
        res.tokens[w.request_id] = w.step.force if w.step.force is not None else (token or (lambda _: 5))(w.request_id)
    for v in plan.vocode:
        if v.request_id in fail:
            continue
        res.audio[v.request_id] = np.zeros(v.chunk.n_samples(SAMPLES_PER_TOKEN), dtype=np.float32)
    for rid in fail:
        res.failed[rid] = "injected"
    return res


def unplan_vocode(sched: LaunchedScheduler, plan: StepPlan) -> StepPlan:
    """The plan without its chunks, as if the scheduler had never planned them."""
    for w in plan.vocode:
        sched.requests[w.request_id].vocode_inflight = None
    return dataclasses.replace(plan, vocode=())


def step(sched: LaunchedScheduler, **kw: object) -> tuple[StepPlan, list[Output]]:
    plan = sched.plan()
    return plan, sched.update(plan, fake_result(plan, **kw))  # type: ignore[arg-type]


def run_until_idle(sched: LaunchedScheduler, max_steps: int = 10_000) -> list[Output]:
    outs: list[Output] = []
    for _ in range(max_steps):
        plan, o = step(sched)
        outs += o
        if plan.empty:
            return outs
    raise AssertionError("scheduler did not go idle")


def chunks_of(outs: list[Output], rid: str) -> list[Emitted]:
    return [o for o in outs if isinstance(o, Emitted) and o.request_id == rid]


def ended(outs: list[Output], rid: str) -> Ended:
    found = [o for o in outs if isinstance(o, Ended) and o.request_id == rid]
    assert len(found) == 1, found
    return found[0]


# --------------------------------------------------------------------------------------------


def test_scheduler_module_does_not_import_torch() -> None:
    code = "import sys, voice_out.engine.scheduler, voice_out.engine.request; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_one_request_runs_to_the_end_with_every_sample_accounted() -> None:
    sched = create_scheduler()
    (rid,) = create_requests(sched, 1, text="hello world")  # 11 text ids -> 33 speech tokens
    outs = run_until_idle(sched)
    chunks = chunks_of(outs, rid)
    assert [c.chunk.final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert sum(len(c.chunk.pcm) for c in chunks) == 33 * SAMPLES_PER_TOKEN
    starts = [c.chunk.start_sample for c in chunks]
    assert starts == list(np.cumsum([0] + [len(c.chunk.pcm) for c in chunks[:-1]]))
    assert ended(outs, rid).status is RequestStatus.FINISHED
    assert sched.n_live == 0 and sched.n_used_slots == 0


def test_bistream_interleave_feeds_text_in_groups_and_forces_fill() -> None:
    sched = create_scheduler()
    (rid,) = create_requests(sched, 1, text="abcdefghijk")
    first = sched.plan()
    (work,) = first.llm
    kinds = [k for k, _ in work.step.inputs]
    assert kinds == [RowKind.LLM] + [RowKind.TEXT] * 5
    sched.update(first, fake_result(first))
    forced_fill = []
    for _ in range(40):
        plan, _ = step(sched)
        forced_fill += [w.step.force == FILL_TOKEN for w in plan.llm]
    # the 16th pick of each group of the interleave is the forced FILL
    assert forced_fill[14] and forced_fill[30]
    assert sum(forced_fill) == 2


def test_admission_is_bounded_by_slots_and_first_come_first_served() -> None:
    sched = create_scheduler(max_streams=2)
    ids = create_requests(sched, 4, text="hi there")
    plan = sched.plan()
    assert [a.request_id for a in plan.admit] == ids[:2]
    assert sorted(a.slot for a in plan.admit) == [0, 1]
    assert sched.n_used_slots == 2 and list(sched.waiting) == ids[2:]
    sched.update(plan, fake_result(plan))
    # the LLM of r0/r1 finishes; their slots go to r2/r3 while r0/r1 are still vocoding
    admitted: list[str] = []
    for _ in range(200):
        plan, _ = step(sched)
        admitted += [a.request_id for a in plan.admit]
        if admitted == ids[2:]:
            break
    assert admitted == ids[2:]
    assert {sched.requests[r].status for r in ids[:2] if r in sched.requests} <= {RequestStatus.VOCODING}
    outs = run_until_idle(sched)
    assert sched.n_used_slots == 0 and sched.n_live == 0
    assert all(ended(outs, r).status is RequestStatus.FINISHED for r in ids[2:])


def test_slot_is_released_when_the_llm_is_done_and_reset_before_reuse() -> None:
    sched = create_scheduler(max_streams=1)
    a, b = create_requests(sched, 2, text="hey you")
    releases: list[Release] = []
    for _ in range(200):
        plan, _ = step(sched)
        releases += plan.release
        if plan.admit and plan.admit[0].request_id == b:
            # the release of a's slot comes in the same plan as b's admission, before it
            assert any(r.request_id == a and r.slot == 0 and not r.drop for r in plan.release)
            break
    else:
        raise AssertionError("b was never admitted")


def test_text_slower_than_speech_waits_without_holding_up_others() -> None:
    sched = create_scheduler()
    slow, fast = create_requests(sched, 2, text="abcde", end=False)
    sched.push_text(fast, "fghijklmnopqrstuvwxyz")
    sched.end_text(fast)
    llm_counts = {slow: 0, fast: 0}
    for _ in range(60):
        plan, _ = step(sched)
        for w in plan.llm:
            llm_counts[w.request_id] += 1
    # slow: one text group -> 15 speech + FILL, then it waits for text
    assert llm_counts[slow] == 16
    assert llm_counts[fast] == 60
    req = sched.requests[slow]
    assert req.status is RequestStatus.RUNNING and not req.llm_done
    sched.push_text(slow, "fghij")
    plan, _ = step(sched)
    assert slow in {w.request_id for w in plan.llm}


def test_text_faster_than_speech_drops_nothing() -> None:
    sched = create_scheduler()
    (rid,) = create_requests(sched, 1, text="x" * 97)
    req = sched.requests[rid]
    outs = run_until_idle(sched)
    assert req.feed.text_fed == 97
    chunks = chunks_of(outs, rid)
    assert sum(len(c.chunk.pcm) for c in chunks) == 3 * 97 * SAMPLES_PER_TOKEN
    assert chunks[-1].chunk.text_end == 97


def test_text_end_counts_characters_fed_when_the_tokens_were_made() -> None:
    sched = create_scheduler()
    (rid,) = create_requests(sched, 1, text="a" * 10, end=False)
    outs: list[Output] = []
    for _ in range(30):  # 2 groups of 5 text -> 30 speech tokens (+ fills)
        outs += step(sched)[1]
    sched.push_text(rid, "b" * 40)
    sched.end_text(rid)
    outs += run_until_idle(sched)
    text_ends = [c.chunk.text_end for c in chunks_of(outs, rid)]
    assert text_ends == sorted(text_ends)
    assert text_ends[0] == 10  # the first chunk's tokens were made from the first 10 characters
    assert text_ends[-1] == 50


def test_first_chunks_go_first_then_earliest_deadline() -> None:
    clock = FakeClock()
    sched = create_scheduler(max_chunks_per_step=1, clock=clock)
    checked_first = checked_edf = 0
    for n in range(600):
        if n % 15 == 0 and n < 60:  # staggered arrivals
            create_requests(sched, 1, text="a" * (100 + n), prefix=f"s{n}-")
        clock.t += 0.01
        ready = {
            rid: (c.index, req.playout_deadline())
            for rid, req in sched.requests.items()
            if (c := sched._vocode_candidate(req)) is not None
        }
        plan = sched.plan()
        if n < 150:  # hold vocoding back so that chunks pile up and compete
            plan = unplan_vocode(sched, plan)
            sched.update(plan, fake_result(plan))
            continue
        sched.update(plan, fake_result(plan))
        if not plan.vocode:
            assert not ready
            continue
        (chosen,) = plan.vocode
        index, deadline = ready[chosen.request_id]
        urgent = [d for i, d in ready.values() if i > 0 and d - clock.t < sched.urgent_s]
        if urgent:
            assert index > 0 and deadline == min(urgent)
        elif any(i == 0 for i, _ in ready.values()):
            assert index == 0
            checked_first += 1
        else:
            assert deadline == min(d for _, d in ready.values())
            checked_edf += int(len(ready) > 1)
    assert checked_first >= 4 and checked_edf >= 3


def test_a_stream_about_to_run_dry_goes_before_new_first_chunks() -> None:
    clock = FakeClock()
    sched = create_scheduler(max_chunks_per_step=1, clock=clock)
    (old,) = create_requests(sched, 1, text="a" * 60, prefix="old")
    while sched.requests[old].chunks_produced < 1:
        step(sched)
    first_audio = clock.t
    fresh = create_requests(sched, 3, text="b" * 20, prefix="new")
    # make the old stream's next chunk ready and every new stream's first chunk ready too
    while True:
        plan = unplan_vocode(sched, sched.plan())
        sched.update(plan, fake_result(plan))
        req = sched.requests[old]
        if req.schedule.ready(len(req.speech_tokens), False) and all(
            sched.requests[r].schedule.ready(len(sched.requests[r].speech_tokens), False) for r in fresh
        ):
            break
    deadline = sched.requests[old].playout_deadline()
    assert deadline == first_audio + sched.requests[old].samples_produced / SAMPLE_RATE
    clock.t = deadline - 2.0  # plenty of audio left: the new streams' first chunks go first
    plan = sched.plan()
    assert plan.vocode[0].request_id == fresh[0]
    unplan_vocode(sched, plan)
    clock.t = deadline - 0.2  # about to run dry: it goes first
    plan = sched.plan()
    assert plan.vocode[0].request_id == old and plan.vocode[0].chunk.index == 1


def test_back_pressure_stops_a_stream_that_is_far_ahead_of_its_consumer() -> None:
    sched = create_scheduler(max_ahead_s=2.0)
    (rid,) = create_requests(sched, 1, text="a" * 200)  # 600 tokens = 24 s of audio
    req = sched.requests[rid]
    limit = int(2.0 * SAMPLE_RATE)
    for _ in range(1000):
        plan, _ = step(sched)
        if plan.empty:
            break
    else:
        raise AssertionError("a stream without a consumer should stop, not run on")
    # delivered audio: at most one chunk past the limit; decided tokens: at most one more chunk
    assert limit < req.buffered_samples() <= limit + 100 * SAMPLES_PER_TOKEN
    assert req.ahead_samples() <= req.buffered_samples() + (100 + 3) * SAMPLES_PER_TOKEN
    assert not req.llm_done and req.status is RequestStatus.RUNNING
    produced = req.samples_produced
    sched.ack(rid, produced)  # the consumer played everything
    plan, _ = step(sched)
    assert not plan.empty
    outs = run_until_idle_with_consumer(sched, rid)
    assert ended(outs, rid).status is RequestStatus.FINISHED


def test_back_pressure_decodes_on_beside_a_chunk_in_flight() -> None:
    """A stream past its limit pauses while a chunk of it is ready, and, while no stream waits
    for its first audio, not while one runs: beside a chunk in flight it decodes on, up to
    the tokens of the chunk after it. Once another stream waits for first audio it pauses."""
    sched = create_scheduler(max_ahead_s=4.0)  # the engine's default: a hop of 100 tokens is 4 s
    (rid,) = create_requests(sched, 1, text="a" * 200)  # 600 tokens
    req = sched.requests[rid]
    runner = PipelinedRunner(delay=4)
    beside = 0
    newcomer: str | None = None
    for _ in range(10_000):
        plan = sched.plan()
        if plan.empty:
            break
        running = req.vocode_inflight if rid not in {v.request_id for v in plan.vocode} else None
        decodes = any(w.request_id == rid for w in plan.llm)
        if running is not None and req.ahead_samples() > int(4.0 * SAMPLE_RATE) and newcomer is None:
            assert decodes == (len(req.speech_tokens) < req.schedule.tokens_after(running))
            beside += decodes
            if beside == 3:  # a new stream comes: until its first audio, this one waits
                (newcomer,) = create_requests(sched, 1, text="b" * 20, prefix="n")
                planned = unplan_vocode(sched, plan)
                sched.update(planned, runner.execute(planned))
                plan = sched.plan()
                assert any(a.request_id == newcomer for a in plan.admit)
                assert req.vocode_inflight is not None and not any(w.request_id == rid for w in plan.llm)
        sched.update(plan, runner.execute(plan))
        sched.ack(rid, req.samples_produced)  # a consumer that takes everything at once
    else:
        raise AssertionError("did not finish")
    assert beside == 3 and req.status is RequestStatus.FINISHED


def test_a_stream_on_a_flow_state_takes_the_state_s_hops() -> None:
    """A request the runner reports on a flow state of its own (``StepResult.flow_state``, at
    admission) grows its hop to the plan's ``flow_state_max_hop_tokens``; the others keep
    ``max_hop_tokens``; every token is vocoded either way."""
    sched = create_scheduler(max_streams=2, flow_state_max_hop_tokens=200)
    on, off = create_requests(sched, 2, text="a" * 250)  # 750 tokens each
    chunks: dict[str, list[ChunkPlan]] = {on: [], off: []}
    outs: list[Output] = []
    for i in range(10_000):
        plan = sched.plan()
        if plan.empty:
            break
        assert {a.request_id for a in plan.admit} == ({on, off} if i == 0 else set())
        for v in plan.vocode:
            chunks[v.request_id].append(v.chunk)
        result = fake_result(plan)
        if i == 0:
            result.flow_state.add(on)
        outs += sched.update(plan, result)
    for rid, largest in ((on, 200), (off, 100)):
        hops = [c.hop_tokens for c in chunks[rid]]
        assert max(hops) == largest and hops[-1] < 100 + 3 and chunks[rid][-1].finalize
        assert sum(hops) == 750 and ended(outs, rid).status is RequestStatus.FINISHED


def run_until_idle_with_consumer(sched: LaunchedScheduler, rid: str) -> list[Output]:
    outs: list[Output] = []
    for _ in range(10_000):
        plan, o = step(sched)
        outs += o
        if rid in sched.requests:
            sched.ack(rid, sched.requests[rid].samples_produced)
        if plan.empty:
            return outs
    raise AssertionError("did not finish")


def test_ack_never_exceeds_what_was_produced() -> None:
    sched = create_scheduler()
    (rid,) = create_requests(sched, 1, text="abc")
    sched.ack(rid, 10**9)
    assert sched.requests[rid].samples_consumed == 0


@pytest.mark.parametrize("stage", ["waiting", "prefill", "waiting_for_text", "running", "vocoding"])
def test_cancel_at_every_stage_frees_everything(stage: str) -> None:
    sched = create_scheduler(max_streams=1)
    blocker = None
    if stage == "waiting":
        (blocker,) = create_requests(sched, 1, text="hold the slot", end=False, prefix="b")
        sched.plan()
    (rid,) = create_requests(sched, 1, text=None)
    req = sched.requests[rid]
    if stage == "prefill":
        step(sched)
        assert req.status is RequestStatus.PREFILL
    elif stage == "waiting_for_text":
        sched.push_text(rid, "abcde")
        for _ in range(20):
            step(sched)
        assert req.status is RequestStatus.RUNNING and not sched.plan().llm
    elif stage == "running":
        sched.push_text(rid, "a" * 30)
        for _ in range(10):
            step(sched)
        assert req.status is RequestStatus.RUNNING
    elif stage == "vocoding":
        sched.push_text(rid, "a" * 30)
        sched.end_text(rid)
        while req.status is not RequestStatus.VOCODING:
            step(sched)
    else:
        assert req.status is RequestStatus.WAITING
    plan_before = sched.plan() if stage in ("running", "vocoding") else None
    sched.finish([rid], RequestStatus.ABORTED)
    sched.finish([rid], RequestStatus.ABORTED)  # idempotent
    outs = sched.take_outputs()
    assert [o for o in outs if isinstance(o, Ended)] == [Ended(rid, RequestStatus.ABORTED)]
    if plan_before is not None:
        # results of the step that was in flight are dropped
        assert sched.update(plan_before, fake_result(plan_before)) == []
    nxt = sched.plan()
    assert rid not in nxt.request_ids()
    if stage in ("prefill", "waiting_for_text", "running"):
        assert [(r.request_id, r.slot, r.drop) for r in nxt.release] == [(rid, 0, True)]
    if stage == "vocoding":
        assert [(r.request_id, r.slot, r.drop) for r in nxt.release] == [(rid, None, True)]
    assert rid not in sched.requests and rid not in sched.waiting
    if blocker is None:
        assert sched.n_used_slots == 0 and sched.n_live == 0
    else:
        assert sched.n_used_slots == 1 and sched.n_live == 1


def test_cancel_of_an_unknown_or_finished_request_is_a_no_op() -> None:
    sched = create_scheduler()
    (rid,) = create_requests(sched, 1, text="ok")
    run_until_idle(sched)
    sched.finish([rid, "nope"], RequestStatus.ABORTED)
    assert sched.take_outputs() == []


def test_a_failure_in_one_request_leaves_the_others_alone() -> None:
    sched = create_scheduler()
    a, b, c = create_requests(sched, 3, text="some words here")
    outs: list[Output] = []
    for i in range(500):
        plan = sched.plan()
        if plan.empty:
            break
        outs += sched.update(plan, fake_result(plan, fail=[b] if i == 20 else []))
    assert ended(outs, b).status is RequestStatus.FAILED
    assert isinstance(ended(outs, b).error, StreamFailedError)
    for rid in (a, c):
        assert ended(outs, rid).status is RequestStatus.FINISHED
        assert sum(len(e.chunk.pcm) for e in chunks_of(outs, rid)) == 3 * 15 * SAMPLES_PER_TOKEN
    assert sched.n_used_slots == 0


def test_a_missing_token_fails_only_that_request() -> None:
    sched = create_scheduler()
    a, b = create_requests(sched, 2, text="abcdef")
    plan = sched.plan()
    res = fake_result(plan)
    del res.tokens[a]
    outs = sched.update(plan, res)
    assert ended(outs, a).status is RequestStatus.FAILED
    assert sched.requests[b].llm_steps == 1


def test_text_too_long_fails_the_stream() -> None:
    sched = create_scheduler(max_text_chars=10)
    (rid,) = create_requests(sched, 1, text=None)
    sched.push_text(rid, "0123456789")
    assert rid in sched.requests
    sched.push_text(rid, "!")
    outs = sched.take_outputs()
    assert ended(outs, rid).status is RequestStatus.FAILED
    assert isinstance(ended(outs, rid).error, TextTooLongError)


def test_a_text_pipeline_error_fails_only_its_stream() -> None:
    class Broken(CharPipeline):
        def push(self, delta: str) -> list[TextPiece]:
            if "!" in delta:
                raise UnicodeError("bad input")
            return super().push(delta)

    sched = LaunchedScheduler(EngineConfig(max_streams=2), Broken, clock=FakeClock(), forced=ForcedTokens(3))
    a, b = create_requests(sched, 2, text=None)
    sched.push_text(a, "boom!")
    sched.push_text(b, "fine")
    sched.end_text(b)
    outs = sched.take_outputs() + run_until_idle(sched)
    assert ended(outs, a).status is RequestStatus.FAILED
    assert "bad input" in str(ended(outs, a).error)
    assert ended(outs, b).status is RequestStatus.FINISHED


def test_speech_token_guard_stops_a_model_that_never_ends() -> None:
    sched = create_scheduler(forced=None, max_speech_tokens_per_text_token=4)
    (rid,) = create_requests(sched, 1, text="abcdefg")  # 7 text ids -> at most 28 speech tokens
    req = sched.requests[rid]
    outs = run_until_idle(sched)  # the fake model always answers speech token 5 (never EOS)
    assert ended(outs, rid).status is RequestStatus.FINISHED
    assert len(req.speech_tokens) == 28


def test_eos_ends_the_llm_and_the_stream_finishes() -> None:
    sched = create_scheduler(forced=None)
    (rid,) = create_requests(sched, 1, text="abc")  # < 5 text ids: straight to the final phase
    plan = sched.plan()
    assert plan.llm[0].step.allow_eos
    sched.update(plan, fake_result(plan, token=lambda _: 11))
    plan = sched.plan()
    sched.update(plan, fake_result(plan, token=lambda _: EOS_TOKEN))
    assert sched.requests[rid].status is RequestStatus.VOCODING
    outs = run_until_idle(sched)
    assert sum(len(c.chunk.pcm) for c in chunks_of(outs, rid)) == SAMPLES_PER_TOKEN


def test_empty_text_finishes_without_running_the_model() -> None:
    sched = create_scheduler()
    (rid,) = create_requests(sched, 1, text="")
    outs = sched.take_outputs()
    assert ended(outs, rid).status is RequestStatus.FINISHED
    assert sched.plan().llm == ()


def test_eos_before_any_speech_finishes_with_no_audio() -> None:
    sched = create_scheduler(forced=None)
    (rid,) = create_requests(sched, 1, text="ab")
    plan = sched.plan()
    outs = sched.update(plan, fake_result(plan, token=lambda _: EOS_TOKEN))
    assert ended(outs, rid).status is RequestStatus.FINISHED and not chunks_of(outs, rid)


@pytest.mark.parametrize(
    ("n_prompt_text", "text", "want"),
    [
        (10, 10, 1 + 10 + 30),  # the prompt alone fills whole groups: SOS + 2 x (5 + 15)
        (8, 10, 1 + 5 + 15 + 3),  # group 2 mixes 3 prompt ids with the request's: cut there
        (0, 10, 1),  # no transcript: only SOS is the voice's
    ],
)
def test_first_step_marks_the_voice_prefix(n_prompt_text: int, text: int, want: int) -> None:
    feed = BistreamFeed(prompt_text_ids=list(range(100, 100 + n_prompt_text)), prompt_speech_ids=[9] * 30)
    feed.add_text(list(range(200, 200 + text)))
    first = feed.next_step()
    assert first is not None and first.voice_prefix == want
    assert all(ident < 200 for kind, ident in first.inputs[:want] if kind is RowKind.TEXT)
    if want < len(first.inputs):
        assert first.inputs[want] == (RowKind.TEXT, 200)
    feed.on_token(3)
    later = feed.next_step()
    assert later is not None and later.voice_prefix == 0  # only a first step has one


@pytest.mark.parametrize("forced", [FORCED, None], ids=["forced", "sampled"])
def test_the_first_llm_work_carries_the_voice_prefix(forced: ForcedTokens | None) -> None:
    """The runner reuses a voice's prefix K/V only if the plan says where it ends; forced-tokens
    mode (benchmarks) rewrites the step and must keep it."""
    sched = create_scheduler(forced=forced)
    create_requests(sched, 1, text="hello there", prompt_speech=30)
    first = sched.plan().llm[0]
    assert first.step.voice_prefix == 1 + 10 + 30  # SOS and two groups of 5 prompt ids + 15 speech
    assert (first.step.force is not None) == (forced is not None)


def test_prompt_speech_is_interleaved_with_text_before_decoding() -> None:
    feed = BistreamFeed(prompt_text_ids=[1, 2, 3, 4, 5], prompt_speech_ids=[9] * 20)
    assert feed.next_step() is None  # 5 prompt text ids cover 15 prompt speech; 5 more are left
    feed.add_text([10, 11, 12, 13])
    assert feed.next_step() is None
    feed.add_text([14])
    s = feed.next_step()
    assert s is not None and not s.allow_eos
    kinds = [k for k, _ in s.inputs]
    assert (
        kinds == [RowKind.LLM] + [RowKind.TEXT] * 5 + [RowKind.SPEECH] * 15 + [RowKind.TEXT] * 5 + [RowKind.SPEECH] * 5
    )
    assert feed.text_fed == 5
    # next_fill = (20 // 15 + 1) * 15 - 20 = 10 picks until the forced FILL
    forces = []
    for _ in range(10):
        assert feed.on_token(3).value == "speech"
        nxt = feed.next_step()
        assert nxt is not None
        forces.append(nxt.force)
    assert forces == [None] * 9 + [FILL_TOKEN]


def test_many_requests_with_random_cancels_leak_nothing() -> None:
    rng = np.random.default_rng(0)
    sched = create_scheduler(max_streams=8, max_chunks_per_step=3)
    live: list[str] = []
    for n in range(300):
        rid = f"q{n}"
        sched.add_request(rid, VoicePrompt("v"), seed=n)
        sched.push_text(rid, "hi " * int(rng.integers(1, 6)))
        if rng.random() < 0.8:
            sched.end_text(rid)
        live.append(rid)
        for _ in range(int(rng.integers(0, 4))):
            step(sched)
        if rng.random() < 0.3:
            sched.finish([live[int(rng.integers(len(live)))]], RequestStatus.ABORTED)
    for rid in list(sched.requests):
        sched.end_text(rid)
    run_until_idle(sched)
    assert sched.n_live == 0 and sched.n_used_slots == 0 and not sched.waiting
    assert sorted(sched.free_slots) == list(range(8))


def test_tokenizer_pipeline_releases_whole_words_with_their_input_offsets() -> None:
    from voice_out.engine.textfeed import TokenizerPipeline

    seen: list[str] = []

    def encode(text: str) -> list[int]:
        seen.append(text)
        return [len(w) for w in text.split()]

    pipe = TokenizerPipeline(encode)
    assert pipe.push("Hel") == []  # half a word is held back
    pieces = pipe.push("lo wor")
    assert [(p.ids, p.char_end) for p in pieces] == [((5,), 6)]
    pieces = pipe.push("ld, you")
    assert [(p.ids, p.char_end) for p in pieces] == [((6,), 13)]  # "world, " up to the last space
    assert [(p.ids, p.char_end) for p in pipe.finish()] == [((3,), 16)]
    assert "".join(seen) == "Hello world, you"


def test_fast_first_chunk_makes_the_first_audio_sooner() -> None:
    sched = create_scheduler(fast_first_tokens=8)
    (rid,) = create_requests(sched, 1, text="a" * 20)  # 60 tokens
    first_ready_at = None
    for _ in range(100):
        plan, outs = step(sched)
        if plan.vocode and first_ready_at is None:
            first_ready_at = len(sched.requests[rid].speech_tokens)
            assert plan.vocode[0].chunk.hop_tokens == 8 and plan.vocode[0].chunk.token_len == 11
        if plan.empty:
            break
    assert first_ready_at is not None and first_ready_at < 25 + 3  # upstream's first chunk needs 28


class PipelinedRunner:
    """A fake runner that hands each chunk's audio back ``delay`` steps after it was planned
    (as the CUDA runner does when token2wav runs on a second stream), listing the rest in
    ``StepResult.inflight``."""

    def __init__(self, delay: int = 2) -> None:
        self.delay = delay
        self.pending: list[tuple[int, str, np.ndarray]] = []  # (step due, request id, audio)
        self.steps = 0
        self.waits = 0

    def execute(self, plan: StepPlan) -> StepResult:
        self.steps += 1
        res = fake_result(dataclasses.replace(plan, vocode=()))
        for v in plan.vocode:
            pcm = np.full(v.chunk.n_samples(SAMPLES_PER_TOKEN), v.chunk.index, dtype=np.float32)
            self.pending.append((self.steps + self.delay, v.request_id, pcm))
        if plan.wait_vocode:
            self.waits += 1
            self.steps = max(self.steps, min(due for due, _, _ in self.pending))  # block until one is done
        done = [p for p in self.pending if p[0] <= self.steps]
        self.pending = [p for p in self.pending if p[0] > self.steps]
        for _, rid, pcm in done:
            res.audio[rid] = pcm
        res.inflight = {rid for _, rid, _ in self.pending}
        return res


def drive(
    sched: LaunchedScheduler,
    runner: PipelinedRunner,
    *,
    check: Callable[[StepPlan], None] | None = None,
    clock: FakeClock | None = None,
) -> list[Output]:
    """Plan and execute until idle: each plan ``check``ed first, the clock one second on after each step."""
    outs: list[Output] = []
    for _ in range(10_000):
        plan = sched.plan()
        if plan.empty:
            return outs
        if check is not None:
            check(plan)
        outs += sched.update(plan, runner.execute(plan))
        if clock is not None:
            clock.t += 1.0
    raise AssertionError("did not finish")


@pytest.mark.parametrize("lanes", [False, True])
def test_pipelined_audio_comes_back_later_in_order_and_nothing_else_is_planned_meanwhile(lanes: bool) -> None:
    sync = create_scheduler(max_chunks_per_step=2)
    ids = create_requests(sync, 3, text="a" * 40)
    want = run_until_idle(sync)
    sched = create_scheduler(max_chunks_per_step=2, first_chunk_lane=lanes)
    create_requests(sched, 3, text="a" * 40)
    runner = PipelinedRunner(delay=3)

    def nothing_new_while_in_flight(plan: StepPlan) -> None:
        def lane(chunk: ChunkPlan) -> bool:  # one lane without the first-chunk lane
            return lanes and chunk.starts_audio

        planned = {v.request_id for v in plan.vocode}
        earlier = [r.vocode_inflight for r in sched.requests.values() if r.request_id not in planned]
        # while a chunk is in flight, no new chunk of its lane is planned (the next batch waits
        # for the lane's stream)
        busy = {lane(c) for c in earlier if c is not None}
        assert not any(lane(v.chunk) in busy for v in plan.vocode)

    outs = drive(sched, runner, check=nothing_new_while_in_flight)
    assert runner.waits > 0  # at the end only in-flight chunks were left: the plan waited for them
    for rid in ids:
        got, ref = chunks_of(outs, rid), chunks_of(want, rid)
        assert [c.chunk.start_sample for c in got] == [c.chunk.start_sample for c in ref]
        assert [len(c.chunk.pcm) for c in got] == [len(c.chunk.pcm) for c in ref]
        assert [int(c.chunk.pcm[0]) for c in got] == list(range(len(got)))  # chunk i's audio as chunk i
        assert ended(outs, rid).status == RequestStatus.FINISHED


@pytest.mark.parametrize("lanes", [False, True])
def test_a_first_chunk_goes_beside_a_later_chunk_in_flight_only_with_the_first_chunk_lane(lanes: bool) -> None:
    sched = create_scheduler(first_chunk_lane=lanes)
    (a,) = create_requests(sched, 1, text="a" * 60, prefix="a")
    runner = PipelinedRunner(delay=200)  # a's chunks stay in flight for 200 steps
    while not any(r.vocode_inflight is not None and r.vocode_inflight.index > 0 for r in sched.requests.values()):
        plan = sched.plan()
        sched.update(plan, runner.execute(plan))
    (b,) = create_requests(sched, 1, text="a" * 60, prefix="b")
    planned_at = None
    for i in range(150):  # b's first chunk needs 28 tokens: ready well before a's chunk is back
        plan = sched.plan()
        if any(v.request_id == b for v in plan.vocode):
            assert next(v for v in plan.vocode if v.request_id == b).chunk.starts_audio
            planned_at = i
            break
        sched.update(plan, runner.execute(plan))
    assert (inflight := sched.requests[a].vocode_inflight) is not None and inflight.index > 0
    if lanes:
        assert planned_at is not None and planned_at < 40  # as soon as its tokens were there
    else:
        assert planned_at is None  # behind a's chunk


def test_a_first_chunk_beside_chunks_in_flight_holds_no_steps() -> None:
    """A stream's first chunk planned while another stream's chunk is in flight shares the GPU
    with it: the plan keeps the stream's LLM step and does not wait (a wait would idle the host
    until the chunk is back), and the plan before it launched its guess."""
    sched = create_scheduler(first_chunk_lane=True)
    (a,) = create_requests(sched, 1, text="a" * 20, prefix="a")
    runner = PipelinedRunner(delay=200)  # a's chunks stay in flight for 200 steps
    req_a = sched.requests[a]
    while not (req_a.llm_done and req_a.vocode_inflight is not None):
        plan = sched.plan()
        sched.update(plan, runner.execute(plan))
    (b,) = create_requests(sched, 1, text="a" * 60, prefix="b")
    before: StepPlan | None = None
    for _ in range(150):  # b's first chunk needs 28 tokens: ready well before a's chunk is back
        plan = sched.plan()
        if any(v.request_id == b for v in plan.vocode):
            break
        before = plan
        sched.update(plan, runner.execute(plan))
    else:
        raise AssertionError("b's first chunk was not planned")
    assert req_a.vocode_inflight is not None  # still in flight
    assert [w.request_id for w in plan.llm] == [b] and not plan.wait_vocode
    assert before is not None and [w.request_id for w in before.llm] == [b] and before.llm[0].guess is not None


@pytest.mark.parametrize(("max_playing", "beside"), [(0, True), (2, True), (1, False)])
def test_past_max_playing_streams_first_chunks_take_turns_with_the_others(max_playing: int, beside: bool) -> None:
    """The plan's first_chunk_lane_max_playing: two streams playing, a later chunk in flight; a
    new stream's first chunk goes beside it at most that many playing (0: any number), else
    waits for it (one launch at a time, as with one lane)."""
    sched = create_scheduler(first_chunk_lane=True, first_chunk_lane_max_playing=max_playing)
    create_requests(sched, 2, text="a" * 60, prefix="a")
    runner = PipelinedRunner(delay=200)  # chunks stay in flight for 200 steps unless waited for
    for _ in range(2000):
        reqs = list(sched.requests.values())
        if all(r.first_audio_time is not None for r in reqs) and any(
            r.vocode_inflight is not None and r.vocode_inflight.index > 0 for r in reqs
        ):
            break
        plan = sched.plan()
        sched.update(plan, runner.execute(plan))
    else:
        raise AssertionError("the two streams never played with a later chunk in flight")
    (b,) = create_requests(sched, 1, text="a" * 60, prefix="b")
    planned_at = None
    for i in range(150):  # b's first chunk needs 28 tokens: ready well before the chunk is back
        plan = sched.plan()
        if any(v.request_id == b for v in plan.vocode):
            planned_at = i
            break
        assert not plan.vocode or beside or len({v.chunk.starts_audio for v in plan.vocode}) == 1
        sched.update(plan, runner.execute(plan))
    assert any(r.vocode_inflight is not None and r.vocode_inflight.index > 0 for r in sched.requests.values())
    if beside:
        assert planned_at is not None and planned_at < 40  # as soon as its tokens were there
    else:
        assert planned_at is None  # behind the later chunk in flight


def test_a_request_cancelled_with_a_chunk_in_flight_drops_its_late_audio() -> None:
    sched = create_scheduler()
    a, b = create_requests(sched, 2, text="a" * 40)
    runner = PipelinedRunner(delay=4)
    outs: list[Output] = []
    while not any(r.vocode_inflight for r in sched.requests.values()):
        plan = sched.plan()
        outs += sched.update(plan, runner.execute(plan))
    victim = next(r.request_id for r in sched.requests.values() if r.vocode_inflight is not None)
    before = len(chunks_of(outs, victim))  # a first chunk waited for at light load came back at once
    sched.finish([victim], RequestStatus.ABORTED)
    for _ in range(10_000):
        plan = sched.plan()
        if plan.empty:
            break
        outs += sched.update(plan, runner.execute(plan))
    assert len(chunks_of(outs, victim)) == before  # its in-flight audio came back and was dropped
    other = b if victim == a else a
    assert ended(outs, other).status == RequestStatus.FINISHED and chunks_of(outs, other)


def test_a_chunk_neither_returned_nor_in_flight_fails_its_request() -> None:
    sched = create_scheduler()
    (rid,) = create_requests(sched, 1, text="a" * 40)
    outs: list[Output] = []
    while rid in sched.requests:
        plan = sched.plan()
        res = fake_result(plan)
        res.audio.clear()  # a runner that forgets the chunk
        outs += sched.update(plan, res)
    end = ended(outs, rid)
    assert end.status == RequestStatus.FAILED and "no audio" in str(end.error)


def test_first_audio_traces_split_each_streams_ttfa_into_phases() -> None:
    clock = FakeClock()
    sched = create_scheduler(max_streams=1, clock=clock)
    sched.launch = dataclasses.replace(
        sched.launch, first_chunk_wait_rows=0
    )  # each first chunk planned while its stream decodes: no wait
    a, b = create_requests(sched, 2, text="a" * 40)  # b waits for a's KV slot
    outs = drive(sched, PipelinedRunner(delay=3), clock=clock)  # a second a step: phases count whole steps
    assert [t.request_id for t in sched.first_audio] == [a, b] and sched.first_audio_count == 2
    first_chunk_tokens = sched.hops.schedule(0, 0).ready(10_000, False)
    assert first_chunk_tokens is not None
    for trace in sched.first_audio:
        assert trace.slot_s >= 0 and trace.tokens_s > 0 and trace.queue_s >= 0
        assert trace.vocode_s == 3.0  # the runner's delay, in steps
        # the steps it took to make the first chunk's tokens, prompt and text steps included
        assert trace.llm_steps >= first_chunk_tokens.token_len
        # the clock moves after each step: admitted at the first step, ready at the end of the last
        assert trace.tokens_s == trace.llm_steps - 1
        first = chunks_of(outs, trace.request_id)[0]
        assert first.chunk.start_sample == 0
    ta, tb = sched.first_audio
    assert ta.slot_s == 0 and tb.slot_s > 0  # b was admitted only when a's LLM part was done
    assert ta.total_s == ta.tokens_s + ta.queue_s + ta.vocode_s


@pytest.mark.parametrize("priority", [True, False])
def test_while_a_stream_waits_for_first_audio_only_first_and_urgent_chunks_go(priority: bool) -> None:
    clock = FakeClock()
    sched = create_scheduler(clock=clock, first_audio_priority=priority)
    (old,) = create_requests(sched, 1, text="a" * 60, prefix="old")
    while sched.requests[old].chunks_produced < 1:
        step(sched)
    # the old stream's second chunk ready, held back
    while not sched._vocode_candidate(sched.requests[old]):
        plan = unplan_vocode(sched, sched.plan())
        sched.update(plan, fake_result(plan))
    (new,) = create_requests(sched, 1, text="b" * 20, prefix="new")
    deadline = sched.requests[old].playout_deadline()
    clock.t = deadline - 2.0  # the old stream has 2 s of audio: it can wait for the new one's first
    plan = sched.plan()
    assert [a.request_id for a in plan.admit] == [new]
    assert [w.request_id for w in plan.vocode] == ([] if priority else [old])
    plan = unplan_vocode(sched, plan)
    sched.update(plan, fake_result(plan))
    clock.t = deadline - 0.2  # about to run dry: it goes, first audio pending or not
    plan = sched.plan()
    assert [w.request_id for w in plan.vocode] == [old]
    plan = unplan_vocode(sched, plan)
    sched.update(plan, fake_result(plan))
    clock.t = deadline - 2.0
    # once the new stream has its first audio, nothing is held back any more
    while sched.requests[new].first_audio_time is None:
        plan = sched.plan()
        if priority:
            assert old not in {w.request_id for w in plan.vocode}
        sched.update(plan, fake_result(plan))
    if priority:
        assert old in {w.request_id for w in sched.plan().vocode}


def test_a_first_chunk_is_waited_for_only_when_no_other_first_audio_needs_the_llm() -> None:
    def waits_at_first_chunk(sched: LaunchedScheduler, rid: str) -> bool:
        while True:
            plan = sched.plan()
            if any(w.request_id == rid and w.chunk.index == 0 for w in plan.vocode):
                return plan.wait_vocode
            sched.update(plan, fake_result(plan))

    alone = create_scheduler()
    (a,) = create_requests(alone, 1, text="a" * 40)
    assert waits_at_first_chunk(alone, a)  # light load: the first chunk gets the GPU to itself

    busy = create_scheduler()
    (a,) = create_requests(busy, 1, text="a" * 40)
    for _ in range(10):
        step(busy)
    (b,) = create_requests(busy, 1, text="b" * 40, prefix="b")  # still decoding for its first audio
    assert not waits_at_first_chunk(busy, a)  # waiting would stall b's LLM steps

    many = create_scheduler(max_streams=8, first_audio_priority=False)
    create_requests(many, 6, text="a" * 40, prefix="m")  # 6 rows decode: more than the wait allows
    assert not waits_at_first_chunk(many, "m0")


def test_step_after_guesses_the_next_step_and_changes_nothing() -> None:
    feed = BistreamFeed()
    feed.add_text([10, 11, 12, 13, 14, 15, 16])
    assert feed.step_after(3) is None  # no step handed out yet
    first = feed.next_step()
    assert first is not None
    guess = feed.step_after(3)
    assert guess is not None and guess.inputs == ((RowKind.SPEECH, 3),) and guess.voice_prefix == 0
    fed, state = feed.text_fed, repr(feed.state)
    step: LlmStep | None
    step = first
    while step.force != FILL_TOKEN:
        guessed = feed.step_after(4)
        feed.on_token(4)
        step = feed.next_step()
        assert step is not None and guessed == step and step.inputs == ((RowKind.SPEECH, 4),)
    # a forced FILL: the next step is the next text group, but only 2 ids are buffered
    assert feed.step_after(FILL_TOKEN) is None
    feed.add_text([17, 18, 19])
    after = feed.step_after(FILL_TOKEN)
    assert after is not None and [i for _, i in after.inputs] == [15, 16, 17, 18, 19]
    assert feed.text_fed == 5 and fed == 5 and state != repr(feed.state)
    before = repr(feed.state)
    feed.step_after(FILL_TOKEN)
    assert repr(feed.state) == before  # asking changed nothing
    feed.on_token(FILL_TOKEN)
    assert feed.next_step() == after


def test_the_plan_guesses_each_stream_s_next_step() -> None:
    """``LlmWork.guess`` (the plan's step_ahead_rows): one speech row of the token being picked, the
    next text group after a forced FILL, nothing before a forced stop, before a first chunk the
    next plan holds the steps for, near the back-pressure limit, or in a step feeding more
    streams than ``step_ahead_rows``."""
    sched = create_scheduler(max_ahead_s=60.0)
    (rid,) = create_requests(sched, 1, text="abcdefghij")
    plan = sched.plan()
    (w,) = plan.llm
    assert w.guess is not None and w.guess.inputs is None and w.guess.allow_eos is False
    fills = held = 0
    for _ in range(60):
        (w,) = plan.llm
        if w.step.force == FILL_TOKEN:
            fills += 1
            assert w.guess is not None and w.guess.inputs is not None  # the rest of the text, TASK
            assert {r for r in w.guess.inputs if r[0] != RowKind.TEXT} <= {TASK_ID}
            sched.update(plan, fake_result(plan))
            plan = sched.plan()
            assert plan.llm[0].step.inputs == w.guess.inputs  # the guess was right
            continue
        if w.step.force == EOS_TOKEN:
            assert w.guess is None
            break
        sched.update(plan, fake_result(plan))
        if w.guess is None:  # the token readied the first chunk: the next plan holds the LLM for it
            held += 1
            plan = sched.plan()
            assert not plan.llm and [v.chunk.index for v in plan.vocode] == [0] and plan.wait_vocode
            sched.update(plan, fake_result(plan))
        else:
            assert w.guess.inputs is None and w.guess.allow_eos == w.step.allow_eos
        plan = sched.plan()
    assert fills >= 1 and held == 1 and w.step.force == EOS_TOKEN

    # near the back-pressure limit (2.5 tokens ahead, no consumer): a guess is made exactly
    # when the next plan decodes the stream
    tight = create_scheduler(max_ahead_s=SAMPLES_PER_TOKEN * 2.5 / SAMPLE_RATE)
    (rid,) = create_requests(tight, 1, text="abcdefghij" * 4)
    plan, paused = tight.plan(), 0
    for _ in range(500):
        if not plan.llm:  # the first chunk's hold (above), or the stream paused for good
            if not plan.vocode:
                break
            tight.update(plan, fake_result(plan))
            plan = tight.plan()
            continue
        (w,) = plan.llm
        tight.update(plan, fake_result(plan))
        plan = tight.plan()
        if w.step.force is not None and w.step.force >= SPEECH_VOCAB and w.step.force != FILL_TOKEN:
            break  # a stop
        if any(v.chunk.index == 0 for v in plan.vocode):
            continue  # the first chunk's own hold (above)
        decodes = any(x.request_id == rid for x in plan.llm)
        assert (w.guess is not None) == decodes
        paused += not decodes
    assert paused >= 1

    off = create_scheduler(step_ahead_rows=0)
    create_requests(off, 1, text="abc")
    assert off.plan().llm[0].guess is None
    for limit, guessed in ((4, False), (5, True)):
        busy = create_scheduler(max_streams=5, step_ahead_rows=limit)
        create_requests(busy, 5, text="abc")
        assert [w.guess is not None for w in busy.plan().llm] == [guessed] * 5


def first_chunk_plans(sched: LaunchedScheduler, max_steps: int = 500) -> list[tuple[StepPlan, StepPlan, StepPlan]]:
    """Step until idle; (the plan before, the plan, the plan after) for each plan that chose a
    first chunk."""
    plans: list[StepPlan] = []
    for _ in range(max_steps):
        plan, _outs = step(sched)
        plans.append(plan)
        if plan.empty:
            break
    else:
        raise AssertionError("scheduler did not go idle")
    return [(plans[i - 1], p, plans[i + 1]) for i, p in enumerate(plans) if any(v.chunk.index == 0 for v in p.vocode)]


def test_at_light_load_a_stream_s_steps_pause_for_its_first_chunk() -> None:
    """A plan that chooses a first chunk while every stream that would decode is one whose first
    chunk it chooses holds their LLM steps (the chunk has the GPU to itself) and waits for it;
    the plan before launches no guess that would run beside it. The steps go on after."""
    sched = create_scheduler(max_streams=2)
    create_requests(sched, 2, text="abcdefghij" * 3)  # both start together: their chunks go as one
    ((before, plan, after),) = first_chunk_plans(sched)
    assert {v.request_id for v in plan.vocode} == {"r0", "r1"}
    assert not plan.llm and plan.wait_vocode
    assert {w.request_id for w in before.llm} == {"r0", "r1"} and all(w.guess is None for w in before.llm)
    assert {w.request_id for w in after.llm} == {"r0", "r1"}


@pytest.mark.parametrize("case", ["playing", "wait_rows_0"])
def test_a_first_chunk_holds_no_steps_another_stream_or_the_config_needs(case: str) -> None:
    """No hold while a stream that already plays decodes beside the new one (its listener's
    tokens go on), nor with ``first_chunk_wait_rows`` 0: those plans keep their LLM work, and
    the plan before them its guesses."""
    sched = create_scheduler(max_streams=2)
    if case == "wait_rows_0":
        sched.launch = dataclasses.replace(sched.launch, first_chunk_wait_rows=0)
    (old,) = create_requests(sched, 1, text="abcdefghij" * 6, prefix="old")
    while sched.requests[old].chunks_produced < 1:
        step(sched)
    create_requests(sched, 1, text="abcdefghij" * 3, prefix="new")
    ((before, plan, _after),) = first_chunk_plans(sched)
    assert [(v.request_id, v.chunk.index) for v in plan.vocode if v.chunk.index == 0] == [("new0", 0)]
    expected = {"old0", "new0"} if case == "playing" else {"new0"}
    assert {w.request_id for w in plan.llm} >= expected
    assert any(w.guess is not None for w in before.llm)


def test_a_request_advances_only_for_the_work_the_launch_policy_chose() -> None:
    """The scheduler offers, the launch policy chooses, the scheduler commits: of two first
    chunks offered with room for one, only the launched one is in flight and the other is
    offered again; a row the policy does not take keeps its step for a later plan."""
    sched = create_scheduler(max_chunks_per_step=1)
    a, b = create_requests(sched, 2, text="a" * 40)
    while len((offer := sched.offer()).chunks) < 2:  # decode, launching nothing, until both are ready
        steps = sched.take_steps(sched.decoding(offer))
        plan = StepPlan(offer.release, offer.admit, sched.llm_work(offer, steps, guess=False))
        sched.update(plan, fake_result(plan))
    assert [rid for rid, _ in offer.chunks] == [a, b] and not offer.in_flight
    chosen = sched.launch.pick_chunks(offer.chunks, offer.in_flight, offer.playing)
    assert [rid for rid, _ in chosen] == [a]
    vocode = sched.launch_chunks(offer, chosen)
    assert [(w.request_id, w.chunk) for w in vocode] == chosen
    assert sched.inflight_ids() == {a} and sched.requests[b].first_chunk_plan_time is None
    # the rows are not taken in this step: their feeds keep the steps
    held = {rid: sched.requests[rid].llm_steps for rid in (a, b)}
    nxt = sched.offer()
    assert [rid for rid, _ in nxt.chunks] == [b] and nxt.in_flight == (chosen[0][1],)
    taken = sched.take_steps(sched.decoding(nxt))
    assert [s.request_id for s in taken] == [a, b]  # each feed hands its step out now, once
    assert sched.take_steps(sched.decoding(nxt)) == ()
    assert {rid: sched.requests[rid].llm_steps for rid in (a, b)} == held
