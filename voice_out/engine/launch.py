"""When token2wav chunks and LLM steps are launched on the device: CUDA lanes, launches in
flight, step-ahead guesses and waits. No torch: a small policy over plain records.

The runner side owns it: the worker holds the engine's :class:`LaunchPolicy` and plans each
step with :meth:`LaunchPolicy.plan`. The scheduler offers what its requests have ready (their
chunks in priority order, the chunks in flight, the LLM rows that may step); the policy chooses
what goes to the device in this step; the scheduler commits what was chosen, so that a
request's state advances only for launched work (``voice_out.engine.scheduler``, which does
not import this module):

* Lanes. There is one token2wav lane, or two with the plan's ``first_chunk_lane`` (the runner
  then has the first-chunk lane's graphs and pipelines token2wav on CUDA streams): the
  non-final first chunks (``ChunkPlan.starts_audio``) and the rest, at most
  ``max_chunks_per_step`` each, so a first chunk never waits for later chunks.
* In flight. A lane with a chunk in flight takes no new one: the chunks that become ready
  meanwhile go as one batch when it is free. While more than ``lane_max_playing`` streams are
  playing, the two lanes take turns: one launch in flight at a time, of the most pressing
  chunk's lane.
* First chunks alone. At light load (at most ``first_chunk_wait_rows`` rows, nothing in
  flight) a step that plans first chunks holds the LLM steps of those streams and waits for
  the chunks, so that they have the GPU to itself.
* Step ahead. With at most ``step_ahead_rows`` rows the runner launches each row's guessed
  next step (``LlmWork.guess``) before this step's token is known.

Worker thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TypeVar

from voice_out.engine.chunk_schedule import ChunkPlan
from voice_out.engine.scheduler import LlmWork, Scheduler, StepPlan, TakenStep
from voice_out.fast.plan import Plan

K = TypeVar("K")


@dataclass(frozen=True)
class LaunchPolicy:
    """The launch rules of one engine (see the module docstring); sizes in chunks and rows."""

    #: Chunks per token2wav launch (per lane with the first-chunk lane).
    max_chunks_per_step: int
    #: Two token2wav lanes: first chunks beside the others.
    first_chunk_lane: bool = False
    #: With two lanes: above this many playing streams the lanes take turns (0: never).
    lane_max_playing: int = 0
    #: At most this many LLM rows launch their guessed next steps ahead (0: never).
    step_ahead_rows: int = 0
    #: A step that plans a first chunk and decodes at most this many rows, none of them a
    #: stream still waiting for its own first audio, waits for the chunk (``wait_vocode``):
    #: at light load the first chunk then has the GPU to itself (on an H200 it came ~8 ms
    #: sooner at 1 stream). Under load, beside chunks in flight, or while other first audio
    #: needs LLM steps, the steps go on.
    first_chunk_wait_rows: int = 4

    def __post_init__(self) -> None:
        if self.max_chunks_per_step < 1:
            raise ValueError("max_chunks_per_step must be >= 1")

    @classmethod
    def of(cls, plan: Plan, *, first_chunk_wait_rows: int = 4) -> LaunchPolicy:
        """The policy of an engine's fast-path ``plan``."""
        return cls(
            max_chunks_per_step=plan.max_chunks_per_step,
            first_chunk_lane=plan.first_chunk_lane,
            lane_max_playing=plan.first_chunk_lane_max_playing,
            step_ahead_rows=plan.step_ahead_rows,
            first_chunk_wait_rows=first_chunk_wait_rows,
        )

    def plan(self, scheduler: Scheduler) -> StepPlan:
        """One worker step's plan: ``scheduler`` offers what its requests have ready, this
        policy chooses what launches beside what is in flight, and ``scheduler`` commits the
        choice (its chunks, then its LLM steps). Worker thread only."""
        offer = scheduler.offer()
        in_flight = bool(offer.in_flight)
        chosen = self.pick_chunks(offer.chunks, offer.in_flight, offer.playing)
        vocode = scheduler.launch_chunks(offer, chosen)
        firsts = {rid for rid, chunk in chosen if chunk.index == 0}
        decoding = scheduler.decoding(offer)
        steps: tuple[TakenStep, ...] = ()
        llm: tuple[LlmWork, ...] = ()
        if not self.hold_llm(in_flight=in_flight, firsts=firsts, decoding=decoding):
            steps = scheduler.take_steps(decoding)
            ahead = self.step_ahead(
                len(steps), in_flight=in_flight, readies_first_chunks=lambda: scheduler.readies_first_chunks(steps)
            )
            llm = scheduler.llm_work(offer, steps, guess=ahead)
        wait = self.wait_vocode(
            in_flight=in_flight,
            other_work=bool(offer.release or offer.admit or llm),
            firsts=bool(firsts),
            rows=len(llm),
            first_audio_rows=any(s.awaits_first_audio and s.request_id not in firsts for s in steps),
        )
        return StepPlan(offer.release, offer.admit, llm, vocode, wait_vocode=wait)

    def lane(self, chunk: ChunkPlan) -> bool:
        """The chunk's token2wav lane: True = the first-chunk lane (when there is one)."""
        return self.first_chunk_lane and chunk.starts_audio

    def lanes_take_turns(self, playing: int) -> bool:
        """With the first-chunk lane: whether more than ``lane_max_playing`` streams are
        ``playing`` (then the two lanes take turns)."""
        return self.first_chunk_lane and self.lane_max_playing > 0 and playing > self.lane_max_playing

    def pick_chunks(
        self, ready: Sequence[tuple[K, ChunkPlan]], in_flight: Collection[ChunkPlan], playing: int
    ) -> list[tuple[K, ChunkPlan]]:
        """The chunks of ``ready`` (most pressing first) launched now, beside the chunks
        ``in_flight``, with ``playing`` streams playing."""
        # a lane with a chunk in flight takes no new one: the chunks that become ready meanwhile
        # go as one batch when it is free (without lanes: one lane, every chunk)
        busy = {self.lane(c) for c in in_flight}
        turns = self.lanes_take_turns(playing)
        if busy and turns:
            busy = {True, False}  # heavy load: one launch in flight at a time, as with one lane
        free = [rc for rc in ready if self.lane(rc[1]) not in busy]
        if free and turns:  # one lane's chunks per launch: the most pressing's
            free = [rc for rc in free if self.lane(rc[1]) == self.lane(free[0][1])]
        taken = {True: 0, False: 0}  # chunks per lane, at most max_chunks_per_step each
        chosen: list[tuple[K, ChunkPlan]] = []
        for item, chunk in free:
            if taken[self.lane(chunk)] < self.max_chunks_per_step:
                taken[self.lane(chunk)] += 1
                chosen.append((item, chunk))
        return chosen

    def hold_llm(self, *, in_flight: bool, firsts: Collection[str], decoding: Sequence[str]) -> bool:
        """Whether the LLM steps of the streams ``decoding`` pause this step: light load, nothing
        ``in_flight``, and every one of them has its first chunk launched now (``firsts``).

        Paused until the chunk is back, it has the GPU to itself (an LLM step beside it slows
        it by about its own length, and brings the stream nothing it needs before its first
        chunk has played for a second). Not beside chunks in flight: the chunk shares the GPU
        with them anyway, and the host would sit idle for as long (steps of 56 ms beside a
        batch of 8 later chunks at 16 streams on an H100)."""
        if in_flight or not firsts or len(decoding) > self.first_chunk_wait_rows:
            return False
        return all(rid in firsts for rid in decoding)

    def step_ahead(self, rows: int, *, in_flight: bool, readies_first_chunks: Callable[[], bool]) -> bool:
        """Whether the ``rows`` LLM rows of this step launch their guessed next steps ahead.

        Light load only; and no guess where every row's token now readies its stream's first
        chunk with nothing ``in_flight`` (``readies_first_chunks``): the next step holds their
        LLM steps for that chunk (:meth:`hold_llm`), and a guess would run beside it."""
        if rows > self.step_ahead_rows:
            return False
        return in_flight or rows > self.first_chunk_wait_rows or not readies_first_chunks()

    def wait_vocode(
        self, *, in_flight: bool, other_work: bool, firsts: bool, rows: int, first_audio_rows: bool
    ) -> bool:
        """Whether the step blocks until its chunks are back (``StepPlan.wait_vocode``).

        ``in_flight``: chunks of earlier steps are in flight; ``other_work``: the step has
        releases, admissions or LLM rows; ``firsts``: it launches first chunks; ``rows``: its
        LLM rows; ``first_audio_rows``: one of them is a stream still waiting for its own first
        audio (whose first chunk is not in this step: the wait would delay it)."""
        if in_flight:
            return not other_work  # nothing else to do: wait for what is in flight
        # light load: wait for the first chunk, unless a row still needs steps for its own first audio
        return firsts and rows <= self.first_chunk_wait_rows and not first_audio_rows
