"""Launch decisions, differentially: randomized event sequences against recorded plans.

Each seed builds a scheduler with random settings (streams, chunks per step, lanes, step-ahead
rows, first-chunk waits, back-pressure, forced or sampled tokens, hop growth), then plays a
random sequence of events on it (streams opened, text deltas, ends of text, acks, cancels,
clock ticks, steps) against a fake pipelined runner whose chunks come back 0 to 3 steps later,
and which fails a row now and then. Every plan and every output of the sequence is written down
canonically and hashed; ``tests/data/launch_golden.json`` holds the hash of each seed, recorded
on the code as it was before the launch decisions moved from the scheduler to the runner side
(the scheduler then consulted a ``LaunchPolicy`` of its own). The test requires the same hashes: for
each of these sequences the engine plans exactly what it planned then.

The counts beside each hash (steps, LLM rows, chunks, waits, guesses) and the policy's decisions
counted over all seeds show that the sequences exercise every rule, so an unchanged hash means
something. Re-record (only for an intended change of behaviour) with
``python -m tests.test_launch_golden --record``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from voice_out.config import EngineConfig
from voice_out.engine.chunk_schedule import ChunkPlan
from voice_out.engine.launch import LaunchPolicy
from voice_out.engine.request import EOS_TOKEN, SAMPLES_PER_TOKEN, SPEECH_VOCAB, RequestStatus, VoicePrompt
from voice_out.engine.scheduler import Emitted, ForcedTokens, Output, Scheduler, StepPlan, StepResult
from voice_out.engine.textfeed import CharPipeline
from voice_out.fast.plan import cpu_plan

GOLDEN = Path(__file__).parent / "data" / "launch_golden.json"
SEEDS = range(200)
#: Decisions of the launch policy over all seeds (``CountingPolicy``), reset per run.
DECISIONS: Counter[str] = Counter()
WORDS = ("hi ", "there", ", ", "bob", "the quick brown fox ", "jumps. ", "a", "over the lazy dog ", "?", "")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class CountingPolicy(LaunchPolicy):
    """The launch policy, counting the decisions it takes (so that the test can show each rule
    fired in the recorded sequences)."""

    def pick_chunks(self, ready: Any, in_flight: Any, playing: int) -> Any:
        chosen = super().pick_chunks(ready, in_flight, playing)
        DECISIONS["chunks_left_ready"] += len(chosen) < len(ready)
        DECISIONS["lanes_take_turns"] += self.lanes_take_turns(playing) and bool(ready)
        return chosen

    def hold_llm(self, **kw: Any) -> bool:
        held = super().hold_llm(**kw)
        DECISIONS["hold_llm"] += held
        return held

    def step_ahead(self, rows: int, **kw: Any) -> bool:
        ahead = super().step_ahead(rows, **kw)
        DECISIONS["step_ahead"] += ahead and rows > 0
        return ahead

    def wait_vocode(self, **kw: Any) -> bool:
        wait = super().wait_vocode(**kw)
        DECISIONS["wait_for_first_chunk" if wait and not kw["in_flight"] else "wait"] += wait
        return wait


@dataclasses.dataclass(frozen=True)
class Settings:
    max_streams: int
    max_chunks_per_step: int
    first_chunk_lane: bool
    lane_max_playing: int
    step_ahead_rows: int
    first_audio_priority: bool
    first_chunk_wait_rows: int
    max_ahead_s: float
    hop_growth: str
    max_hop_tokens: int
    fast_first_tokens: int
    forced: bool

    @classmethod
    def draw(cls, rng: random.Random) -> Settings:
        return cls(
            max_streams=rng.choice([1, 2, 3, 4, 6]),
            max_chunks_per_step=rng.choice([1, 2, 4]),
            first_chunk_lane=rng.random() < 0.5,
            lane_max_playing=rng.choice([0, 1, 2, 32]),
            step_ahead_rows=rng.choice([0, 1, 2, 4, 8]),
            first_audio_priority=rng.random() < 0.7,
            first_chunk_wait_rows=rng.choice([0, 1, 2, 4]),
            max_ahead_s=rng.choice([0.3, 1.0, 2.0, 4.0, 60.0]),
            hop_growth=rng.choice(["buffered", "double"]),
            max_hop_tokens=rng.choice([25, 50, 100]),
            fast_first_tokens=rng.choice([0, 0, 5, 12]),
            forced=rng.random() < 0.5,
        )


def compose(s: Settings, clock: Clock) -> tuple[Scheduler, Callable[[], StepPlan]]:
    """A scheduler and the function that plans one worker step with it, as the worker joins
    them (its launch policy choosing from the scheduler's offer). The one part of this file
    that follows the code's shape: when recorded, the scheduler held the policy and
    ``sched.plan`` consulted it."""
    pins = {
        "max_chunks_per_step": s.max_chunks_per_step,
        "first_chunk_lane": s.first_chunk_lane,
        "first_chunk_lane_max_playing": s.lane_max_playing,
        "step_ahead_rows": s.step_ahead_rows,
        "first_audio_priority": s.first_audio_priority,
    }
    plan = cpu_plan(s.max_streams, pins)
    config = EngineConfig(
        max_streams=s.max_streams,
        max_ahead_s=s.max_ahead_s,
        hop_growth=s.hop_growth,
        max_hop_tokens=s.max_hop_tokens,
        fast_first_tokens=s.fast_first_tokens,
        max_speech_tokens_per_text_token=6,
    )
    policy = CountingPolicy.of(plan, first_chunk_wait_rows=s.first_chunk_wait_rows)
    sched = Scheduler(
        config,
        lambda: CharPipeline(vocab=200),
        clock=clock,
        forced=ForcedTokens(3) if s.forced else None,
        plan=plan,
    )
    return sched, lambda: policy.plan(sched)


class FakeRunner:
    """Executes plans without a model: forced tokens as given, sampled ones drawn (speech, or
    EOS now and then where allowed); each chunk's audio back 0 to 3 steps later, at once for a
    plan that waits; a request's chunk dropped with its release; a row failed now and then."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.inflight: dict[str, tuple[ChunkPlan, int]] = {}  # request id -> (chunk, steps left)

    def execute(self, plan: StepPlan) -> StepResult:
        rng = self.rng
        res = StepResult()
        for rel in plan.release:
            if rel.drop:
                self.inflight.pop(rel.request_id, None)
        for a in plan.admit:
            if rng.random() < 0.3:
                res.flow_state.add(a.request_id)
        for w in plan.llm:
            if rng.random() < 0.004:
                res.failed[w.request_id] = "injected"
                continue
            if w.step.force is not None:
                res.tokens[w.request_id] = w.step.force
            elif w.step.allow_eos and rng.random() < 0.06:
                res.tokens[w.request_id] = EOS_TOKEN
            else:
                res.tokens[w.request_id] = rng.randrange(SPEECH_VOCAB)
        for v in plan.vocode:
            assert v.request_id not in self.inflight, "a chunk planned beside its request's chunk in flight"
            assert len(v.tokens) >= v.chunk.token_len
            self.inflight[v.request_id] = (v.chunk, rng.choice([0, 0, 1, 2, 3]))
        if plan.wait_vocode:
            waited = {v.request_id for v in plan.vocode} or set(self.inflight)
            for rid in waited:
                self.inflight[rid] = (self.inflight[rid][0], 0)
        for rid, (chunk, left) in list(self.inflight.items()):
            if left > 0:
                self.inflight[rid] = (chunk, left - 1)
                continue
            del self.inflight[rid]
            if rng.random() < 0.002:
                continue  # lost: the scheduler fails the request
            res.audio[rid] = np.zeros(chunk.n_samples(SAMPLES_PER_TOKEN), dtype=np.float32)
        res.inflight = set(self.inflight)
        return res


def _rows(rows: Any) -> list[list[int]] | None:
    return None if rows is None else [[int(kind), int(i)] for kind, i in rows]


def plan_record(plan: StepPlan) -> list[Any]:
    return [
        [[r.request_id, r.slot, r.drop] for r in plan.release],
        [[a.request_id, a.slot, a.seed, a.speed] for a in plan.admit],
        [
            [
                w.request_id,
                w.slot,
                _rows(w.step.inputs),
                w.step.allow_eos,
                w.step.force,
                w.step.voice_prefix,
                list(w.recent),
                None if w.guess is None else [_rows(w.guess.inputs), w.guess.allow_eos],
            ]
            for w in plan.llm
        ],
        [[v.request_id, *dataclasses.astuple(v.chunk), len(v.tokens)] for v in plan.vocode],
        plan.wait_vocode,
    ]


def output_records(outs: list[Output]) -> list[Any]:
    recs: list[Any] = []
    for o in outs:
        if isinstance(o, Emitted):
            c = o.chunk
            recs.append(["pcm", o.request_id, c.start_sample, len(c.pcm), c.final, c.text_end])
        else:
            recs.append(["end", o.request_id, o.status.name, None if o.error is None else str(o.error)])
    return recs


def play(seed: int) -> dict[str, Any]:
    """One seed's sequence: its record's hash and what it exercised."""
    rng = random.Random(seed)
    settings = Settings.draw(rng)
    clock = Clock()
    sched, plan_step = compose(settings, clock)
    runner = FakeRunner(random.Random(seed + 10_000))
    log: list[Any] = []
    stats = Counter[str]()
    opened: list[str] = []

    def step() -> bool:
        plan = plan_step()
        log.append(plan_record(plan))
        if plan.empty:
            return False
        stats["steps"] += 1
        stats["llm_rows"] += len(plan.llm)
        stats["chunks"] += len(plan.vocode)
        stats["waits"] += plan.wait_vocode
        stats["guesses"] += sum(w.guess is not None for w in plan.llm)
        log.append(output_records(sched.update(plan, runner.execute(plan))))
        clock.t += rng.choice([0.0, 0.01, 0.05, 0.2])
        return True

    def live() -> str | None:
        return rng.choice(opened) if opened else None

    for _ in range(rng.randrange(100, 320)):
        op = rng.choices(
            ["step", "burst", "open", "text", "end", "ack", "tick", "cancel"], [36, 6, 10, 22, 5, 10, 8, 2]
        )[0]
        rid = live()
        if op == "step":
            step()
        elif op == "burst":
            for _ in range(rng.randrange(2, 9)):
                step()
        elif op == "open":
            rid = f"s{len(opened)}"
            n_prompt = rng.choice([0, 0, 3, 9, 30])
            voice = VoicePrompt(
                "v", tuple(range(n_prompt // 3)), (7,) * n_prompt, flow_prompt_tokens=rng.choice([0, n_prompt])
            )
            fast_first = rng.choice([None, None, 0, 4])
            speed = 1.5 if rng.random() < 0.1 else 1.0
            sched.add_request(rid, voice, seed=seed * 100 + len(opened), fast_first=fast_first, speed=speed)
            opened.append(rid)
        elif op == "text" and rid is not None:
            sched.push_text(rid, "".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 9))))
        elif op == "end" and rid is not None:
            sched.end_text(rid)
        elif op == "ack" and rid is not None and rid in sched.requests:
            req = sched.requests[rid]
            sched.ack(rid, req.samples_consumed + int(rng.random() * (req.samples_produced - req.samples_consumed)))
        elif op == "tick":
            clock.t += rng.choice([0.1, 0.5, 2.0])
        elif op == "cancel" and rid is not None:
            sched.finish([rid], RequestStatus.ABORTED)
        log.append([op, output_records(sched.take_outputs())])

    for rid in opened:  # the rest: every text ends, every listener keeps up
        sched.end_text(rid)
    log.append(["end_all", output_records(sched.take_outputs())])
    for _ in range(5000):
        for rid, req in sched.requests.items():
            sched.ack(rid, req.samples_produced)
        if not step():
            break
        clock.t += 0.1
    assert not sched.requests, f"seed {seed}: streams left after the last step"
    log.append([[dataclasses.astuple(t) for t in sched.first_audio]])
    blob = json.dumps(log, separators=(",", ":"), sort_keys=True).encode()
    return {"sha256": hashlib.sha256(blob).hexdigest(), **{k: stats[k] for k in sorted(stats)}}


def play_all() -> dict[str, dict[str, Any]]:
    return {str(seed): play(seed) for seed in SEEDS}


def test_plans_match_the_recorded_sequences() -> None:
    DECISIONS.clear()
    golden = json.loads(GOLDEN.read_text())
    got = play_all()
    assert set(golden["seeds"]) == set(got)
    differ = [seed for seed in got if got[seed] != golden["seeds"][seed]]
    assert not differ, f"{len(differ)} of {len(got)} sequences plan differently, e.g. seed {differ[0]}: " + (
        f"{got[differ[0]]} != {golden['seeds'][differ[0]]}"
    )
    # the sequences exercise every launch rule, so that equal hashes say something
    totals = Counter[str]()
    for rec in got.values():
        totals.update({k: v for k, v in rec.items() if k != "sha256"})
    assert totals["steps"] > 20_000 and totals["chunks"] > 3_000 and totals["guesses"] > 1_000, totals
    assert totals["waits"] > 500, totals
    for decision in ("chunks_left_ready", "lanes_take_turns", "hold_llm", "step_ahead", "wait", "wait_for_first_chunk"):
        assert DECISIONS[decision] >= 20, (decision, DECISIONS)


def record() -> None:
    lines = [f"{json.dumps(seed)}: {json.dumps(rec, sort_keys=True)}" for seed, rec in play_all().items()]
    GOLDEN.write_text('{"seeds": {\n' + ",\n".join(lines) + "\n}}\n")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        raise SystemExit("usage: python -m tests.test_launch_golden --record")
    record()
