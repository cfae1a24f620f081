"""When streaming token2wav makes a chunk, and how big it is (cosyvoice2-spec.md section 5.3).

Pure Python, no torch: the engine scheduler asks "is a chunk ready for this request, and how
big" from here without touching tensors. The scheduler owns the one schedule of a request
(``voice_out.engine.request.Request.schedule``) and hands each chunk to token2wav as a
``voice_out.model.token2wav.ChunkPlan``; token2wav keeps no schedule of its own.

The rule, with P prompt tokens and hop h (first hop h0, default 25)::

    pad      = (-P) mod h0                  # P + first hop ends on a chunk boundary
    hop_now  = h0 + pad (first chunk), else h
    a chunk is ready when  n_available - offset >= hop_now + lookahead (3)
        -> flow over tokens[:offset + hop_now + 3], non-final; offset += hop_now;
           h = min(max_hop, h * hop_scale)       # 25 -> 50 -> 100 -> 100 ...
           with hop_growth "buffered": also h <= the tokens made so far, rounded down to whole
           chunks (25 -> 25 -> 50 -> 100 ...)
    once the LLM has finished and no full chunk is left
        -> final chunk: flow over all tokens with full attention, emits everything left.

A stream whose later chunks extend a flow state of its own (``HopPolicy.state_max_hop``,
``voice_out.fast.flow_step.FastToken2Wav.use_state_slots``) grows its hop further: such a chunk costs about the
same whatever its length (its kernels are bound by their count, not their rows), so fewer,
longer chunks make the utterance sooner. Its final chunk stays within the policy's
``max_hop`` + lookahead tokens (the vocoder's graphs are captured for those lengths): once the
LLM has finished, a longer rest first gets a non-final chunk of ``max_hop``.

Every boundary P + offset is a multiple of ``chunk_size`` tokens, which is what makes the audio
of a non-final chunk final (the flow's chunk masks count from the prompt start).

Hop growth ("double", upstream's, or "buffered"): upstream doubles the hop after every chunk,
so its second chunk (50 + 3 tokens) must be decoded while the first chunk's 25 tokens of audio
play: the LLM must run at twice real time per stream. Under load (dozens of streams in one
batch) it does not, and every stream runs dry after its first chunk. "buffered" never lets a
hop exceed the audio already made, so a chunk's tokens take no longer to decode than the
queued audio lasts at real time: one more chunk per utterance (25, 25, 50, 100 ...).

Unlike upstream, the hop is per request: it starts at ``first_hop`` for every request (upstream
keeps it on the model object and never resets it, so its second request starts at 100).

Whole (``whole``, a per-request option): no chunk until the LLM has finished, then ONE final
chunk over every token (full attention, no caches): upstream's non-streaming path (spec 5.6),
the only one where token2wav's ``speed`` is defined (the mel of the whole utterance is
resampled in time, so no sample exists before the last token).

Fast start (``fast_first`` = n > 0, a per-request option that upstream's PyTorch path lacks):
the first chunk makes only n tokens final (no pad), so the first audio needs n + 3 tokens
instead of 25 + pad + 3; the second chunk then realigns (hop = first_hop + the tokens up to
the next boundary) and the schedule goes on as above. The first chunk's audio is then NOT
bit-equal to a single pass: its frames attend to part of their 25-token chunk only (the same
trade upstream's Triton server makes with its 15-token first hop). Every later chunk is exact.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from voice_out.config import HOP_GROWTHS

#: The flow's chunk (static_chunk_size of its encoder) and look-ahead, in tokens: the
#: schedule's boundaries and lookahead are these (``voice_out.model.token2wav`` checks the
#: chunks it is given against the same two numbers).
CHUNK_SIZE_TOKENS = 25  # also the default first hop
LOOKAHEAD_TOKENS = 3  # tokens that must exist beyond a non-final chunk
MAX_HOP_TOKENS = 100
HOP_SCALE = 2


@dataclass(frozen=True)
class ChunkPlan:
    """One token2wav call.

    ``token_len`` tokens (prefix of the request's speech tokens) go to the flow; the chunk's
    audio starts at token ``token_offset``. ``hop_tokens`` is how many tokens this chunk makes
    final: the hop for a non-final chunk, all remaining tokens for the final one.
    """

    index: int
    token_offset: int
    token_len: int
    hop_tokens: int
    finalize: bool

    @property
    def starts_audio(self) -> bool:
        """A non-final first chunk: the one a listener waits on for its first audio. With a
        first-chunk lane (the plan's ``first_chunk_lane``) these run on their own CUDA stream,
        beside the other chunks."""
        return self.index == 0 and not self.finalize

    def n_samples(self, samples_per_token: int = 960, holdback_samples: int = 3840) -> int:
        """Samples this chunk emits (non-final chunks hold back the last ``holdback_samples``).

        The first chunk emits hop * 960 - 3840; later non-final chunks exactly hop * 960 (the
        held-back samples of the previous chunk are emitted now); the final chunk emits its hop
        plus the held-back samples. The total over a request is 960 * n_tokens.
        """
        n = self.hop_tokens * samples_per_token
        if self.index > 0:
            n += holdback_samples
        if not self.finalize:
            n -= holdback_samples
        return n


@dataclass
class ChunkSchedule:
    """Per-request chunk schedule. Mutable; :meth:`reset` reuses it for the next request.

    Not thread-safe: owned by whoever owns the request (the GPU worker).
    """

    prompt_tokens: int = 0
    first_hop: int = CHUNK_SIZE_TOKENS
    max_hop: int = MAX_HOP_TOKENS
    hop_scale: int = HOP_SCALE
    #: "double" (upstream) or "buffered" (see the module docstring).
    hop_growth: str = "double"
    lookahead: int = LOOKAHEAD_TOKENS
    chunk_size: int = CHUNK_SIZE_TOKENS
    #: Tokens of a fast first chunk (0 = off: upstream's first hop of first_hop + pad).
    fast_first: int = 0
    #: Most tokens a final chunk makes final, lookahead aside (0 = ``max_hop``): once the LLM
    #: has finished, a longer rest first gets a non-final chunk of this hop. Set where
    #: ``max_hop`` is a stream's own larger one (``HopPolicy.schedule(state=True)``).
    final_max: int = 0
    #: One final chunk over every token once the LLM has finished (see the module docstring).
    whole: bool = False
    # progress
    offset: int = 0
    hop: int = CHUNK_SIZE_TOKENS
    n_chunks: int = 0
    finished: bool = False

    def __post_init__(self) -> None:
        self.reset(self.prompt_tokens, self.first_hop)

    def reset(self, prompt_tokens: int, first_hop: int | None = None, fast_first: int | None = None) -> None:
        """Start a new request with ``prompt_tokens`` flow prompt tokens (in place)."""
        if first_hop is not None:
            self.first_hop = first_hop
        if fast_first is not None:
            self.fast_first = fast_first
        if not 0 <= self.fast_first < self.chunk_size:
            raise ValueError(f"fast_first must be in 0..{self.chunk_size - 1} tokens, got {self.fast_first}")
        if prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
        for name in ("first_hop", "max_hop"):
            v = getattr(self, name)
            if v <= 0 or v % self.chunk_size != 0:
                raise ValueError(f"{name} must be a positive multiple of the flow chunk ({self.chunk_size}), got {v}")
        if self.final_max < 0 or self.final_max % self.chunk_size != 0:
            raise ValueError(f"final_max must be 0 or a multiple of the flow chunk, got {self.final_max}")
        if self.hop_scale < 1 or self.lookahead < 0:
            raise ValueError("hop_scale must be >= 1 and lookahead >= 0")
        if self.hop_growth not in HOP_GROWTHS:
            raise ValueError(f"hop_growth must be one of {', '.join(HOP_GROWTHS)}, got {self.hop_growth!r}")
        self.prompt_tokens = prompt_tokens
        self.offset = 0
        self.hop = self.first_hop
        self.n_chunks = 0
        self.finished = False

    @property
    def pad(self) -> int:
        """Extra tokens of the first chunk so that prompt + first chunk ends on a boundary."""
        return (-self.prompt_tokens) % self.first_hop

    @property
    def hop_now(self) -> int:
        """Tokens the next non-final chunk will make final."""
        if self.n_chunks == 0:
            return self.fast_first if self.fast_first else self.hop + self.pad
        # after a fast first chunk: back onto a chunk boundary (0 otherwise: already aligned)
        return self.hop + (-(self.prompt_tokens + self.offset)) % self.chunk_size

    @property
    def tokens_for_next_chunk(self) -> int:
        """Speech tokens that must exist before the next non-final chunk can run."""
        return self.offset + self.hop_now + self.lookahead

    def ready(self, n_available: int, llm_finished: bool) -> ChunkPlan | None:
        """The chunk to make now, or None (wait for more tokens, or the request is done).

        A full chunk takes precedence over the final chunk, as upstream: when the LLM has
        finished but a whole hop plus lookahead is still available, a non-final chunk comes first.
        """
        if self.finished:
            return None
        if self.whole:
            return ChunkPlan(0, 0, n_available, n_available, True) if llm_finished else None
        hop = self.hop_now
        left = n_available - self.offset
        if llm_finished and self.n_chunks > 0 and left < hop + self.lookahead:
            # the rest is the final chunk, unless it is longer than a final chunk may be
            hop = min(hop, self.hop_now - self.hop + (self.final_max or self.max_hop))
        if left >= hop + self.lookahead:
            return ChunkPlan(self.n_chunks, self.offset, self.offset + hop + self.lookahead, hop, False)
        if llm_finished:
            return ChunkPlan(self.n_chunks, self.offset, n_available, n_available - self.offset, True)
        return None

    def tokens_after(self, plan: ChunkPlan) -> int:
        """Speech tokens that must exist before the chunk after ``plan`` (the next non-final
        chunk, not committed yet) can run, once ``plan`` is. No state changes."""
        after = copy.copy(self)
        after.commit(plan)
        return after.tokens_for_next_chunk

    def flow_end(self, plan: ChunkPlan) -> int:
        """T of a non-final ``plan``: prompt + the tokens its audio covers (its lookahead
        excluded), where its flow pass ends; a multiple of ``chunk_size`` on a boundary."""
        return self.prompt_tokens + plan.token_len - self.lookahead

    def round_up(self, n_tokens: int) -> int:
        """``n_tokens`` rounded up to a whole flow chunk."""
        return -(-n_tokens // self.chunk_size) * self.chunk_size

    def check(self, plan: ChunkPlan) -> None:
        """Raise ValueError unless ``plan`` is the next chunk of this schedule."""
        if self.finished or plan.index != self.n_chunks or plan.token_offset != self.offset:
            raise ValueError(f"chunk plan {plan} is not the next chunk of this schedule")

    def commit(self, plan: ChunkPlan) -> None:
        """Record that ``plan`` was run (its audio emitted)."""
        self.check(plan)
        self.n_chunks += 1
        if plan.finalize:
            self.finished = True
            self.offset = plan.token_len
            return
        self.offset += plan.hop_tokens
        if plan.index == 0 and self.fast_first:
            return  # the realigning second chunk starts from first_hop
        hop = min(self.max_hop, self.hop * self.hop_scale)
        if self.hop_growth == "buffered":
            hop = max(self.chunk_size, min(hop, self.offset // self.chunk_size * self.chunk_size))
        self.hop = hop


@dataclass(frozen=True)
class HopPolicy:
    """How every request's hop goes (see the module docstring): its first hop, the largest hop
    and how it grows ("double" or "buffered"). The engine makes one from its config; the
    scheduler's and token2wav's schedules of a request both come from it, so they agree."""

    first_hop: int = CHUNK_SIZE_TOKENS
    max_hop: int = MAX_HOP_TOKENS
    growth: str = "double"
    #: The largest hop of a stream whose later chunks extend a flow state of its own, where
    #: larger than ``max_hop``; its final chunk stays within ``max_hop`` (see the module
    #: docstring).
    state_max_hop: int = 0

    def __post_init__(self) -> None:
        if self.state_max_hop < 0 or self.state_max_hop % CHUNK_SIZE_TOKENS:
            raise ValueError(
                f"state_max_hop must be 0 or a multiple of the flow chunk ({CHUNK_SIZE_TOKENS}),"
                f" got {self.state_max_hop}"
            )

    def schedule(
        self, prompt_tokens: int = 0, fast_first: int = 0, *, state: bool = False, whole: bool = False
    ) -> ChunkSchedule:
        """A new request's schedule (ValueError for a policy or ``fast_first`` out of range);
        ``state``: the schedule of a stream on a flow state of its own (:meth:`on_state`);
        ``whole``: one final chunk once the LLM has finished (``fast_first`` is then moot)."""
        sched = ChunkSchedule(
            prompt_tokens=prompt_tokens,
            first_hop=self.first_hop,
            max_hop=self.max_hop,
            hop_growth=self.growth,
            fast_first=0 if whole else fast_first,
            whole=whole,
        )
        if state:
            self.on_state(sched)
        return sched

    def on_state(self, sched: ChunkSchedule) -> None:
        """Let ``sched`` (one of this policy's) grow its hop to ``state_max_hop`` (where larger
        than ``max_hop``) from its next chunk on, its final chunk still within ``max_hop``: its
        stream now extends a flow state of its own. In place; the chunks already made stay as
        they were."""
        sched.final_max = self.max_hop
        sched.max_hop = max(self.state_max_hop, self.max_hop)


def plan_all(
    n_tokens: int,
    prompt_tokens: int,
    hops: HopPolicy | None = None,
    fast_first: int = 0,
    *,
    state: bool = False,
    whole: bool = False,
) -> list[ChunkPlan]:
    """The whole schedule of a request whose ``n_tokens`` speech tokens are all known (``hops``
    None: upstream's; ``state`` and ``whole`` as in :meth:`HopPolicy.schedule`)."""
    schedule = (hops or HopPolicy()).schedule(prompt_tokens, fast_first, state=state, whole=whole)
    plans: list[ChunkPlan] = []
    while (plan := schedule.ready(n_tokens, llm_finished=True)) is not None:
        plans.append(plan)
        schedule.commit(plan)
    return plans
