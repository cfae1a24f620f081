"""The launch policy (voice_out.engine.launch): lanes, launches in flight, holds, step-ahead
guesses and waits, over hand-built chunks. No model: the scheduler tests drive it through
``Scheduler.plan``; these pin each rule on its own."""

from __future__ import annotations

import pytest

from voice_out.engine.chunk_schedule import ChunkPlan
from voice_out.engine.launch import LaunchPolicy
from voice_out.fast.plan import cpu_plan

FIRST = ChunkPlan(index=0, token_offset=0, token_len=11, hop_tokens=8, finalize=False)
LATER = ChunkPlan(index=2, token_offset=40, token_len=43, hop_tokens=40, finalize=False)


def test_the_policy_of_a_plan_takes_its_sizes_and_lanes() -> None:
    plan = cpu_plan(8, {"first_chunk_lane": True, "max_chunks_per_step": 3})
    policy = LaunchPolicy.of(plan, first_chunk_wait_rows=2)
    assert (policy.max_chunks_per_step, policy.first_chunk_lane, policy.first_chunk_wait_rows) == (3, True, 2)
    assert (policy.step_ahead_rows, policy.lane_max_playing) == (
        plan.step_ahead_rows,
        plan.first_chunk_lane_max_playing,
    )
    with pytest.raises(ValueError, match="max_chunks_per_step must be >= 1"):
        LaunchPolicy(max_chunks_per_step=0)


def test_one_lane_takes_nothing_while_a_chunk_is_in_flight_and_caps_a_launch() -> None:
    one = LaunchPolicy(max_chunks_per_step=2)
    ready = [("a", FIRST), ("b", LATER), ("c", LATER)]
    assert one.pick_chunks(ready, [], playing=0) == ready[:2]  # most pressing first, at most 2
    assert one.pick_chunks(ready, [LATER], playing=0) == []  # the lane is busy: they go as one batch later
    assert not one.lane(FIRST) and not one.lane(LATER)


def test_the_first_chunk_lane_runs_first_chunks_beside_later_ones_in_flight() -> None:
    two = LaunchPolicy(max_chunks_per_step=1, first_chunk_lane=True)
    ready = [("a", FIRST), ("b", LATER), ("c", FIRST)]
    assert two.lane(FIRST) and not two.lane(LATER)
    assert two.pick_chunks(ready, [], playing=0) == [("a", FIRST), ("b", LATER)]  # one per lane
    assert two.pick_chunks(ready, [LATER], playing=0) == [("a", FIRST)]  # beside the later chunk
    assert two.pick_chunks(ready, [FIRST], playing=0) == [("b", LATER)]
    final_first = ChunkPlan(index=0, token_offset=0, token_len=30, hop_tokens=30, finalize=True)
    assert not two.lane(final_first)  # a final first chunk is no stream's start: the other lane


@pytest.mark.parametrize("playing", [2, 3])
def test_above_max_playing_the_lanes_take_turns(playing: int) -> None:
    policy = LaunchPolicy(max_chunks_per_step=4, first_chunk_lane=True, lane_max_playing=2)
    turns = playing > 2
    assert policy.lanes_take_turns(playing) == turns
    ready = [("b", LATER), ("a", FIRST)]
    # one launch in flight at a time: nothing beside a chunk in flight of either lane
    assert policy.pick_chunks(ready, [LATER], playing=playing) == ([] if turns else [("a", FIRST)])
    # one lane's chunks per launch: the most pressing chunk's
    assert policy.pick_chunks(ready, [], playing=playing) == (ready[:1] if turns else ready)
    assert not LaunchPolicy(max_chunks_per_step=4, first_chunk_lane=True).lanes_take_turns(100)  # 0: never


def test_light_load_holds_llm_steps_of_streams_whose_first_chunk_launches() -> None:
    policy = LaunchPolicy(max_chunks_per_step=4, first_chunk_wait_rows=2)
    assert policy.hold_llm(in_flight=False, firsts={"a", "b"}, decoding=["a", "b"])
    assert not policy.hold_llm(in_flight=True, firsts={"a"}, decoding=["a"])  # beside chunks in flight
    assert not policy.hold_llm(in_flight=False, firsts={"a"}, decoding=["a", "b"])  # b decodes on
    assert not policy.hold_llm(in_flight=False, firsts=set(), decoding=["a"])
    three = {"a", "b", "c"}
    assert not policy.hold_llm(in_flight=False, firsts=three, decoding=sorted(three))  # under load


def test_step_ahead_only_at_light_load_and_not_into_a_first_chunk() -> None:
    policy = LaunchPolicy(max_chunks_per_step=4, step_ahead_rows=3, first_chunk_wait_rows=2)
    assert policy.step_ahead(3, in_flight=False, readies_first_chunks=lambda: False)
    assert not policy.step_ahead(4, in_flight=False, readies_first_chunks=lambda: False)
    # every row's token readies its first chunk: the next step holds them for it, no guess
    assert not policy.step_ahead(2, in_flight=False, readies_first_chunks=lambda: True)
    assert policy.step_ahead(2, in_flight=True, readies_first_chunks=lambda: True)
    assert policy.step_ahead(3, in_flight=False, readies_first_chunks=lambda: True)  # more rows than held
    assert not LaunchPolicy(max_chunks_per_step=1).step_ahead(1, in_flight=False, readies_first_chunks=lambda: False)


def test_a_step_waits_for_chunks_in_flight_with_nothing_else_to_do_or_for_a_lone_first_chunk() -> None:
    wait = LaunchPolicy(max_chunks_per_step=4, first_chunk_wait_rows=1).wait_vocode
    assert wait(in_flight=True, other_work=False, firsts=False, rows=0, first_audio_rows=False)
    assert not wait(in_flight=True, other_work=True, firsts=False, rows=0, first_audio_rows=False)
    assert not wait(in_flight=False, other_work=False, firsts=False, rows=0, first_audio_rows=False)
    assert wait(in_flight=False, other_work=True, firsts=True, rows=1, first_audio_rows=False)
    assert not wait(in_flight=False, other_work=True, firsts=True, rows=2, first_audio_rows=False)
    # a row still needs steps for its own first audio: waiting would delay it
    assert not wait(in_flight=False, other_work=True, firsts=True, rows=1, first_audio_rows=True)
