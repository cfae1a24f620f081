"""Bidirectional streaming (text in while speech comes out): the LLM feed schedule as a pure state machine.

No torch, no I/O, no threads. One :class:`BistreamState` per stream; the driver (the engine's
scheduler/runner) calls ``process(state, event) -> list[Action]`` and carries out the actions:

events                                   actions
``TextReceived(ids)``  text tokens       ``Step(feed, mode)``  append the ``feed`` rows to the
``TextEnded()``        no more text          stream's KV cache (one backbone step), then pick a
``StepDone(token)``    result of a Step      token per ``mode`` and report it with ``StepDone``
                                         ``Emit(token)``  a speech token for token2wav
                                         ``WaitForText()``  nothing to do until text arrives
                                         ``Finished(reason)``  the stream is done

A feed row is ``(kind, id)``: kind 0 = ``llm_embedding`` row (0 SOS, 1 TASK_ID), 1 = text
token, 2 = speech token. At most one ``Step`` is outstanding per stream (``state.step``), so
a scheduler batches every stream whose ``state.step`` is set, runs the step, and feeds each
stream its ``StepDone``. ``StepMode``: ``SAMPLE`` = sample with EOS masked; ``FORCE_FILL`` =
run the step (its K/V are needed) but do not sample: report ``StepDone(fill_token)``;
``SAMPLE_FINAL`` = sample with EOS allowed. Push every reported token, FILL included, to the
sampler's repetition history (as upstream does).

The schedule (cosyvoice2-spec 2.7; 5 text : 15 speech tokens):

1. pending input ``[SOS]``; the text buffer starts with the prompt transcript; each pulled text
   chunk is appended to it, and while prompt speech remains and the buffer holds 5 tokens,
   ``5 text + 15 prompt speech`` rows are appended to the pending input.
2. once the prompt speech is used up: at the start (pending is just ``[SOS]``) or after a FILL,
   5 text tokens become the pending input (after FILL the fill token itself is never fed);
   with fewer than 5 buffered, wait for the next chunk. Then step until FILL: the token is
   forced to FILL when the count of produced tokens reaches ``next_fill`` (initially
   ``(P // 15 + 1) * 15 - P`` for P prompt speech tokens); any FILL (forced or chosen) sets
   ``next_fill = produced + 16``. Each other token is emitted and becomes the next input.
3. when the text has ended: ``pending + all buffered text + [TASK_ID]`` is fed and the model
   decodes with EOS allowed until EOS.

Text chunks are "pulled" lazily, like upstream's generator: only while waiting or after FILL.

Upstream behaviours and what this module does by default (each has a flag; see
:meth:`BistreamConfig.upstream` for exact upstream parity):

* **Quirk A** (``refeed_last_input``, default False = fixed): when the text ends after a FILL,
  upstream feeds the last input (already in the cache) a second time before the remaining text
  and TASK_ID. Default: it is not fed again.
* **Quirk B** (``drop_unused_prompt_speech``, default False = fixed): when the text ends before
  all prompt speech was interleaved, upstream silently drops the rest. Default: the remaining
  prompt speech follows TASK_ID, which is the training layout ``t_rest TASK_ID s_rest``.
* **Quirk C** (``max_tokens_per_text_token``, default 20 = fixed): upstream's final phase has
  no length limit. Default: stop (``Finished(MAX_LEN)``) once ``20 x text tokens`` speech tokens
  were emitted (at least 20). None = upstream.
* **Chunk granularity** (``whole_chunk_events``, default False): upstream consumes at most one
  5-token group per pulled chunk, so a big chunk leaves a surplus in the buffer until the next
  chunk or the end. The official frontend yields ONE token per pull; by default each received
  id is a chunk of its own, which reproduces that and never stalls on buffered text. True makes
  a ``TextReceived`` one chunk (what the parity traces b1..b3 record).

:class:`WholeTextState` (``new_whole_text_state``) is the non-streaming request, text known up
front, with the same events and actions: one step on ``[SOS, text, TASK_ID, prompt speech]``,
then one speech row per step, EOS masked before ``min_len``, stop on 6561/6562/6563 or at
``max_len``.

Upstream raises on a stop id other than the expected one (6562 in the inner loop, 6562/6563 in
the final phase); here they end the stream with ``Finished(STOP_TOKEN)``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from enum import Enum, IntEnum

from voice_out.text.rows import SOS, TASK_ID, Row, RowKind


class StepMode(IntEnum):
    """How the token of a step is chosen (values match the parity traces' ``how``)."""

    SAMPLE = 0
    FORCE_FILL = 1
    SAMPLE_FINAL = 2


class FinishReason(Enum):
    EOS = "eos"
    MAX_LEN = "max_len"
    STOP_TOKEN = "stop_token"


class Phase(Enum):
    WAITING = "waiting"  # needs text (or the end of text) before it can step
    STEPPING = "stepping"  # a SAMPLE / FORCE_FILL step is outstanding
    FINAL = "final"  # text ended; a SAMPLE_FINAL step is outstanding
    FINISHED = "finished"


@dataclass(frozen=True)
class BistreamConfig:
    """The 5 : 15 mix ratio, the speech vocabulary size and the quirk flags (module docstring).

    The defaults fix quirks A, B, C and pull one text token at a time; :meth:`upstream` gives
    exact upstream behaviour (the parity traces).
    """

    text_per_group: int = 5
    speech_per_group: int = 15
    speech_token_size: int = 6561
    refeed_last_input: bool = False
    drop_unused_prompt_speech: bool = False
    max_tokens_per_text_token: int | None = 20
    whole_chunk_events: bool = False

    def __post_init__(self) -> None:
        if self.text_per_group < 1 or self.speech_per_group < 1:
            raise ValueError("text_per_group and speech_per_group must be >= 1")
        if self.max_tokens_per_text_token is not None and self.max_tokens_per_text_token < 1:
            raise ValueError("max_tokens_per_text_token must be >= 1 or None")

    @classmethod
    def upstream(cls, speech_token_size: int = 6561) -> BistreamConfig:
        """Every upstream behaviour reproduced (quirks A, B, C and whole-chunk events)."""
        return cls(
            speech_token_size=speech_token_size,
            refeed_last_input=True,
            drop_unused_prompt_speech=True,
            max_tokens_per_text_token=None,
            whole_chunk_events=True,
        )

    @property
    def eos_token(self) -> int:
        return self.speech_token_size

    @property
    def fill_token(self) -> int:
        return self.speech_token_size + 2


# Events ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextReceived:
    ids: tuple[int, ...]


@dataclass(frozen=True)
class TextEnded:
    pass


@dataclass(frozen=True)
class StepDone:
    token: int


Event = TextReceived | TextEnded | StepDone


# Actions --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    feed: tuple[Row, ...]
    mode: StepMode


@dataclass(frozen=True)
class Emit:
    token: int


@dataclass(frozen=True)
class WaitForText:
    pass


@dataclass(frozen=True)
class Finished:
    reason: FinishReason


Action = Step | Emit | WaitForText | Finished


@dataclass
class BistreamState:
    """Everything one stream's schedule knows. Mutated in place by :func:`process` only."""

    config: BistreamConfig
    #: Rows for the next step; after a FILL, the rows of the last step (already fed).
    pending: list[Row] = field(default_factory=lambda: [SOS])
    pending_fed: bool = False
    text_buf: list[int] = field(default_factory=list)
    prompt_speech: list[int] = field(default_factory=list)
    chunks: deque[tuple[int, ...]] = field(default_factory=deque)
    #: Text ids waiting in ``chunks`` (kept, so a caller asking per token need not sum them).
    chunk_tokens: int = 0
    text_ended: bool = False
    next_fill: int = 0
    #: Tokens produced by steps, FILL included (upstream ``len(out)``).
    produced: int = 0
    last_token: int | None = None
    emitted: int = 0
    text_tokens: int = 0
    chunks_pulled: int = 0
    steps: int = 0
    #: Rows fed so far = the stream's KV-cache length.
    cache_len: int = 0
    phase: Phase = Phase.WAITING
    step: Step | None = None
    finish_reason: FinishReason | None = None


def new_state(
    config: BistreamConfig, prompt_text: tuple[int, ...] = (), prompt_speech: tuple[int, ...] = ()
) -> BistreamState:
    """A stream before any text: ``prompt_text`` seeds the text buffer, ``prompt_speech`` is interleaved."""
    n_prompt = len(prompt_speech)
    group = config.speech_per_group
    return BistreamState(
        config=config,
        text_buf=list(prompt_text),
        prompt_speech=list(prompt_speech),
        next_fill=(n_prompt // group + 1) * group - n_prompt,
    )


@dataclass
class WholeTextState:
    """A request whose whole text is known up front: upstream's non-streaming path (spec 2.4, 2.5).

    Same events and actions as bistream, so one scheduler drives both. The first step (all
    ``rows``, e.g. from ``rows.zero_shot_rows``) is outstanding from the start. Step i
    masks EOS while ``i < min_len``; any stop id ends the stream; ``max_len`` tokens at most.
    """

    rows: tuple[Row, ...]
    min_len: int
    max_len: int
    speech_token_size: int = 6561
    produced: int = 0
    emitted: int = 0
    steps: int = 0
    cache_len: int = 0
    phase: Phase = Phase.WAITING
    step: Step | None = None
    finish_reason: FinishReason | None = None


def new_whole_text_state(
    rows: tuple[Row, ...], min_len: int, max_len: int, speech_token_size: int = 6561
) -> WholeTextState:
    """A whole-text request with its first step already outstanding (finished if ``max_len`` is 0)."""
    state = WholeTextState(tuple(rows), min_len, max_len, speech_token_size)
    if max_len <= 0:
        state.phase, state.finish_reason = Phase.FINISHED, FinishReason.MAX_LEN
    else:
        _issue_whole(state, state.rows)
    return state


def _issue_whole(state: WholeTextState, feed: tuple[Row, ...]) -> Step:
    mode = StepMode.SAMPLE if state.produced < state.min_len else StepMode.SAMPLE_FINAL
    state.step = Step(feed, mode)
    state.phase = Phase.STEPPING if mode is StepMode.SAMPLE else Phase.FINAL
    return state.step


def _process_whole(state: WholeTextState, event: Event) -> list[Action]:
    if isinstance(event, TextReceived):
        raise ValueError("a whole-text request takes no more text")
    if isinstance(event, TextEnded):
        return []
    step = state.step
    if step is None:
        raise ValueError(f"StepDone({event.token}) without an outstanding step (phase {state.phase.value})")
    token = int(event.token)
    state.step = None
    state.steps += 1
    state.cache_len += len(step.feed)
    state.produced += 1
    if not 0 <= token < state.speech_token_size:
        reason = FinishReason.EOS if token == state.speech_token_size else FinishReason.STOP_TOKEN
        state.phase, state.finish_reason = Phase.FINISHED, reason
        return [Finished(reason)]
    state.emitted += 1
    if state.produced >= state.max_len:
        state.phase, state.finish_reason = Phase.FINISHED, FinishReason.MAX_LEN
        return [Emit(token), Finished(FinishReason.MAX_LEN)]
    return [Emit(token), _issue_whole(state, ((RowKind.SPEECH, token),))]


def process(state: BistreamState | WholeTextState, event: Event) -> list[Action]:
    """Apply ``event``; return what the driver must do now (possibly nothing)."""
    if isinstance(state, WholeTextState):
        return _process_whole(state, event)
    if isinstance(event, TextReceived):
        if state.text_ended or state.phase in (Phase.FINAL, Phase.FINISHED):
            raise ValueError("text received after the end of text")
        ids = tuple(int(i) for i in event.ids)
        if not ids:
            return []
        state.text_tokens += len(ids)
        state.chunk_tokens += len(ids)
        if state.config.whole_chunk_events:
            state.chunks.append(ids)
        else:
            state.chunks.extend((i,) for i in ids)
        return _pull(state) if state.phase is Phase.WAITING else []
    if isinstance(event, TextEnded):
        if state.text_ended:
            return []
        state.text_ended = True
        return _pull(state) if state.phase is Phase.WAITING else []
    if isinstance(event, StepDone):
        return _step_done(state, int(event.token))
    raise TypeError(f"unknown event {event!r}")


def copy_state(state: BistreamState) -> BistreamState:
    """An independent copy of ``state`` (its containers copied; the rest is immutable): to ask
    what :func:`process` would do without changing the stream."""
    return replace(
        state,
        pending=list(state.pending),
        text_buf=list(state.text_buf),
        prompt_speech=list(state.prompt_speech),
        chunks=deque(state.chunks),
    )


def _pull(state: BistreamState) -> list[Action]:
    """Upstream's outer loop: pull chunks until a step can run, the text ends, or text runs out."""
    cfg = state.config
    n_text, n_speech = cfg.text_per_group, cfg.speech_per_group
    while state.chunks:
        chunk = state.chunks.popleft()
        state.chunk_tokens -= len(chunk)
        state.text_buf.extend(chunk)
        state.chunks_pulled += 1
        while state.prompt_speech and len(state.text_buf) >= n_text:
            state.pending += [(RowKind.TEXT, t) for t in state.text_buf[:n_text]]
            state.pending += [(RowKind.SPEECH, s) for s in state.prompt_speech[:n_speech]]
            del state.text_buf[:n_text]
            del state.prompt_speech[:n_speech]
            state.pending_fed = False
        if state.prompt_speech:
            continue
        after_fill = state.last_token == cfg.fill_token
        at_start = state.produced == 0 and state.pending == [SOS]
        if after_fill or at_start:
            if len(state.text_buf) < n_text:
                continue
            group = [(RowKind.TEXT, t) for t in state.text_buf[:n_text]]
            state.pending = group if after_fill else state.pending + group
            state.pending_fed = False
            del state.text_buf[:n_text]
        return [_issue(state, _inner_mode(state))]
    if state.text_ended:
        return [_enter_final(state)]
    state.phase = Phase.WAITING
    return [WaitForText()]


def _inner_mode(state: BistreamState) -> StepMode:
    return StepMode.FORCE_FILL if state.produced == state.next_fill else StepMode.SAMPLE


def _issue(state: BistreamState, mode: StepMode) -> Step:
    step = Step(tuple(state.pending), mode)
    state.step = step
    state.pending_fed = True
    state.phase = Phase.FINAL if mode is StepMode.SAMPLE_FINAL else Phase.STEPPING
    return step


def _enter_final(state: BistreamState) -> Step:
    cfg = state.config
    rows: list[Row] = []
    if not state.pending_fed or cfg.refeed_last_input:
        rows += state.pending
    rows += [(RowKind.TEXT, t) for t in state.text_buf]
    rows.append(TASK_ID)
    if not cfg.drop_unused_prompt_speech:
        rows += [(RowKind.SPEECH, s) for s in state.prompt_speech]
    state.text_buf.clear()
    state.prompt_speech.clear()
    state.pending = rows
    state.pending_fed = False
    return _issue(state, StepMode.SAMPLE_FINAL)


def _finish(state: BistreamState, reason: FinishReason) -> Finished:
    state.phase = Phase.FINISHED
    state.step = None
    state.finish_reason = reason
    return Finished(reason)


def _step_done(state: BistreamState, token: int) -> list[Action]:
    step = state.step
    if step is None:
        raise ValueError(f"StepDone({token}) without an outstanding step (phase {state.phase.value})")
    cfg = state.config
    if step.mode is StepMode.FORCE_FILL and token != cfg.fill_token:
        raise ValueError(f"a FORCE_FILL step must report the fill token {cfg.fill_token}, got {token}")
    state.step = None
    state.steps += 1
    state.cache_len += len(step.feed)
    state.produced += 1
    state.last_token = token
    final = step.mode is StepMode.SAMPLE_FINAL
    if token == cfg.fill_token and not final:
        state.next_fill = state.produced - 1 + cfg.speech_per_group + 1
        return _pull(state)
    if token == cfg.eos_token and final:
        return [_finish(state, FinishReason.EOS)]
    if token >= cfg.speech_token_size or token < 0:
        return [_finish(state, FinishReason.STOP_TOKEN)]
    state.emitted += 1
    state.pending = [(RowKind.SPEECH, token)]
    state.pending_fed = False
    actions: list[Action] = [Emit(token)]
    limit = cfg.max_tokens_per_text_token
    if final and limit is not None and state.emitted >= limit * max(1, state.text_tokens):
        actions.append(_finish(state, FinishReason.MAX_LEN))
        return actions
    actions.append(_issue(state, StepMode.SAMPLE_FINAL if final else _inner_mode(state)))
    return actions
