"""The bistream feed schedule as a pure state machine (no torch, no model)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from voice_out.text import bistream as bs
from voice_out.text.rows import RowKind

FILL = 6563
EOS = 6561
TASK = bs.TASK_ID


def text_rows(ids: Sequence[int]) -> list[bs.Row]:
    return [(RowKind.TEXT, i) for i in ids]


def speech_rows(ids: Sequence[int]) -> list[bs.Row]:
    return [(RowKind.SPEECH, i) for i in ids]


class Driver:
    """Runs a schedule with a scripted model: ``choose(step_index, mode)`` returns the token."""

    def __init__(self, state: bs.BistreamState, choose: Callable[[int, bs.StepMode], int]) -> None:
        self.state = state
        self.choose = choose
        self.steps: list[bs.Step] = []
        self.tokens: list[int] = []
        self.emitted: list[int] = []
        self.waits = 0
        self.finished: bs.Finished | None = None

    def handle(self, actions: list[bs.Action]) -> None:
        queue = list(actions)
        while queue:
            a = queue.pop(0)
            if isinstance(a, bs.Emit):
                self.emitted.append(a.token)
            elif isinstance(a, bs.WaitForText):
                self.waits += 1
            elif isinstance(a, bs.Finished):
                self.finished = a
            else:
                assert self.state.step == a
                self.steps.append(a)
                token = FILL if a.mode is bs.StepMode.FORCE_FILL else self.choose(len(self.steps) - 1, a.mode)
                self.tokens.append(token)
                queue += bs.process(self.state, bs.StepDone(token))
            assert self.state.chunk_tokens == sum(len(c) for c in self.state.chunks)

    def text(self, ids: Sequence[int]) -> None:
        self.handle(bs.process(self.state, bs.TextReceived(tuple(ids))))
        assert self.state.chunk_tokens == sum(len(c) for c in self.state.chunks)

    def end(self) -> None:
        self.handle(bs.process(self.state, bs.TextEnded()))


def speech_then_eos(after: int) -> Callable[[int, bs.StepMode], int]:
    """Speech tokens 100, 101, ...; in the final phase EOS once ``after`` final steps ran."""
    final_steps = [0]

    def choose(i: int, mode: bs.StepMode) -> int:
        if mode is bs.StepMode.SAMPLE_FINAL:
            final_steps[0] += 1
            if final_steps[0] > after:
                return EOS
        return 100 + i

    return choose


def test_no_prompt_waits_for_five_text_tokens_then_forces_fill_after_fifteen() -> None:
    d = Driver(bs.new_state(bs.BistreamConfig()), speech_then_eos(3))
    for t in (1, 2, 3, 4):
        d.text([t])
    assert d.steps == [] and d.waits == 4
    d.text([5])
    first = d.steps[0]
    assert first.feed == (bs.SOS, *text_rows([1, 2, 3, 4, 5])) and first.mode is bs.StepMode.SAMPLE
    # P = 0 -> next_fill = 15: 15 sampled steps, then one forced FILL, then wait for text.
    assert [s.mode for s in d.steps] == [bs.StepMode.SAMPLE] * 15 + [bs.StepMode.FORCE_FILL]
    assert d.emitted == list(range(100, 115))
    assert all(s.feed == tuple(speech_rows([99 + i])) for i, s in enumerate(d.steps[1:], start=1))
    assert d.state.phase is bs.Phase.WAITING and d.state.step is None
    d.text([6, 7, 8, 9, 10])
    # After FILL the next input is 5 text rows; the fill token is never fed.
    assert d.steps[16].feed == tuple(text_rows([6, 7, 8, 9, 10]))
    assert [s.mode for s in d.steps[16:]] == [bs.StepMode.SAMPLE] * 15 + [bs.StepMode.FORCE_FILL]
    assert all((RowKind.SPEECH, FILL) not in s.feed for s in d.steps)


def test_prompt_speech_is_interleaved_five_to_fifteen_and_sets_the_fill_phase() -> None:
    prompt_speech = tuple(range(1000, 1020))  # P = 20 -> two groups (15 + 5); next_fill = 10
    state = bs.new_state(bs.BistreamConfig(), prompt_text=(50, 51, 52), prompt_speech=prompt_speech)
    assert state.next_fill == 10
    d = Driver(state, speech_then_eos(2))
    d.text([1, 2])  # buffer 5 -> first group, 5 prompt speech tokens remain
    assert d.steps == [] and state.pending[-15:] == speech_rows(prompt_speech[:15])
    d.text([3, 4, 5, 6])  # buffer 4 < 5: wait
    assert d.steps == []
    d.text([7])  # second group; prompt speech used up: decode at once, without more text
    expected = [bs.SOS, *text_rows([50, 51, 52, 1, 2]), *speech_rows(prompt_speech[:15])]
    expected += [*text_rows([3, 4, 5, 6, 7]), *speech_rows(prompt_speech[15:])]
    assert d.steps[0].feed == tuple(expected)
    assert [s.mode for s in d.steps].index(bs.StepMode.FORCE_FILL) == 10


def test_prompt_multiple_of_fifteen_starts_with_next_fill_fifteen() -> None:
    assert bs.new_state(bs.BistreamConfig(), prompt_speech=tuple(range(30))).next_fill == 15
    assert bs.new_state(bs.BistreamConfig(), prompt_speech=tuple(range(29))).next_fill == 1


def test_a_chosen_fill_rebases_the_schedule() -> None:
    def choose(i: int, mode: bs.StepMode) -> int:
        return FILL if i == 3 else 200 + i

    d = Driver(bs.new_state(bs.BistreamConfig()), choose)
    d.text([1, 2, 3, 4, 5])
    assert len(d.steps) == 4 and d.state.next_fill == 3 + 16
    d.text([6, 7, 8, 9, 10])
    modes = [s.mode for s in d.steps[4:]]
    # produced count is 4 after the chosen FILL; the next forced FILL comes at produced == 19.
    assert modes == [bs.StepMode.SAMPLE] * 15 + [bs.StepMode.FORCE_FILL]


def _run_to_end_after_fill(config: bs.BistreamConfig) -> Driver:
    d = Driver(bs.new_state(config), speech_then_eos(2))
    d.text([1, 2, 3, 4, 5])
    d.text([6, 7])  # buffered, fewer than 5: wait
    d.end()
    return d


def test_quirk_a_last_input_refed_only_in_upstream_mode() -> None:
    fixed = _run_to_end_after_fill(bs.BistreamConfig())
    final = fixed.steps[16]
    assert final.mode is bs.StepMode.SAMPLE_FINAL
    assert final.feed == (*text_rows([6, 7]), TASK)
    upstream = _run_to_end_after_fill(bs.BistreamConfig(refeed_last_input=True))
    # The FILL step fed speech token 114; upstream feeds it again.
    assert upstream.steps[15].feed == tuple(speech_rows([114]))
    assert upstream.steps[16].feed == (*speech_rows([114]), *text_rows([6, 7]), TASK)
    for d in (fixed, upstream):
        assert d.finished == bs.Finished(bs.FinishReason.EOS)
        assert d.state.cache_len == sum(len(s.feed) for s in d.steps)


def test_quirk_b_unused_prompt_speech_kept_after_task_id_unless_upstream() -> None:
    prompt = tuple(range(1000, 1040))  # needs 15 text tokens to interleave; text gives 7
    for drop in (False, True):
        state = bs.new_state(bs.BistreamConfig(drop_unused_prompt_speech=drop), prompt_speech=prompt)
        d = Driver(state, speech_then_eos(0))
        d.text([1, 2, 3, 4, 5, 6, 7])
        d.end()
        head = [bs.SOS, *text_rows([1, 2, 3, 4, 5]), *speech_rows(prompt[:15])]
        tail = [*text_rows([6, 7]), TASK]
        if not drop:
            tail += speech_rows(prompt[15:])
        assert d.steps[0].feed == (*head, *tail)
        assert d.finished == bs.Finished(bs.FinishReason.EOS)


def test_quirk_c_final_phase_length_guard() -> None:
    never_eos = speech_then_eos(10**9)
    guarded = Driver(bs.new_state(bs.BistreamConfig(max_tokens_per_text_token=4)), never_eos)
    guarded.text([1, 2, 3])
    guarded.end()
    assert guarded.finished == bs.Finished(bs.FinishReason.MAX_LEN)
    assert len(guarded.emitted) == 4 * 3
    state = bs.new_state(bs.BistreamConfig(max_tokens_per_text_token=None))
    actions = bs.process(state, bs.TextReceived((1, 2, 3))) + bs.process(state, bs.TextEnded())
    for _ in range(200):  # upstream has no limit: it keeps stepping
        step = actions[-1]
        assert isinstance(step, bs.Step) and step.mode is bs.StepMode.SAMPLE_FINAL
        actions = bs.process(state, bs.StepDone(7))
    assert state.emitted == 200 and state.phase is bs.Phase.FINAL


def test_big_chunk_is_drained_by_default_but_waits_in_whole_chunk_mode() -> None:
    text = list(range(1, 21))  # 4 groups in one delta
    default = Driver(bs.new_state(bs.BistreamConfig()), speech_then_eos(1))
    default.text(text)
    # Per-token pulls: every group is consumed without waiting for more text.
    text_fed = [r[1] for s in default.steps for r in s.feed if r[0] == RowKind.TEXT]
    assert text_fed == text
    assert sum(s.mode is bs.StepMode.FORCE_FILL for s in default.steps) == 4
    whole = Driver(bs.new_state(bs.BistreamConfig(whole_chunk_events=True)), speech_then_eos(1))
    whole.text(text)
    text_fed = [r[1] for s in whole.steps for r in s.feed if r[0] == RowKind.TEXT]
    assert text_fed == text[:5] and whole.state.text_buf == text[5:]
    whole.end()  # upstream flushes the surplus at once before TASK_ID
    assert whole.steps[16].feed[-16:] == (*text_rows(text[5:]), TASK)


def test_text_during_a_step_is_buffered_and_pulled_after_fill() -> None:
    state = bs.new_state(bs.BistreamConfig())
    first = bs.process(state, bs.TextReceived((1, 2, 3, 4, 5)))
    assert isinstance(first[0], bs.Step)
    assert bs.process(state, bs.TextReceived((6, 7, 8, 9, 10))) == []
    assert bs.process(state, bs.TextEnded()) == []
    assert state.text_buf == [] and len(state.chunks) == 5


def test_protocol_errors() -> None:
    state = bs.new_state(bs.BistreamConfig())
    try:
        bs.process(state, bs.StepDone(5))
    except ValueError as e:
        assert "without an outstanding step" in str(e)
    else:
        raise AssertionError("StepDone without a step must raise")
    state = bs.new_state(bs.BistreamConfig(), prompt_speech=tuple(range(15)))  # next_fill 15
    bs.process(state, bs.TextReceived((1, 2, 3, 4, 5)))
    for i in range(15):
        bs.process(state, bs.StepDone(i))
    assert state.step is not None and state.step.mode is bs.StepMode.FORCE_FILL
    try:
        bs.process(state, bs.StepDone(3))
    except ValueError as e:
        assert "FORCE_FILL" in str(e)
    else:
        raise AssertionError("a forced fill step must report FILL")
    bs.process(state, bs.TextEnded())
    try:
        bs.process(state, bs.TextReceived((9,)))
    except ValueError as e:
        assert "after the end of text" in str(e)
    else:
        raise AssertionError("text after the end must raise")


def test_unexpected_stop_ids_finish_the_stream() -> None:
    d = Driver(bs.new_state(bs.BistreamConfig()), lambda i, m: 6562 if i == 2 else 100 + i)
    d.text([1, 2, 3, 4, 5])
    assert d.finished == bs.Finished(bs.FinishReason.STOP_TOKEN) and d.state.phase is bs.Phase.FINISHED
    d2 = Driver(bs.new_state(bs.BistreamConfig()), lambda i, m: FILL if m is bs.StepMode.SAMPLE_FINAL else 100 + i)
    d2.text([1, 2])
    d2.end()
    assert d2.finished == bs.Finished(bs.FinishReason.STOP_TOKEN)


def test_nothing_but_the_end_of_text() -> None:
    d = Driver(bs.new_state(bs.BistreamConfig(), prompt_text=(8, 9)), speech_then_eos(0))
    d.end()
    assert d.steps[0].feed == (bs.SOS, *text_rows([8, 9]), TASK)
    assert d.finished == bs.Finished(bs.FinishReason.EOS)


@settings(max_examples=150, deadline=None)
@given(
    prompt_text=st.lists(st.integers(0, 999), max_size=8),
    prompt_speech=st.lists(st.integers(0, 6560), max_size=50),
    chunks=st.lists(st.lists(st.integers(0, 999), min_size=1, max_size=9), max_size=12),
    fill_at=st.sets(st.integers(0, 80), max_size=4),
    final_len=st.integers(0, 30),
)
def test_default_schedule_feeds_everything_once_in_order(
    prompt_text: list[int],
    prompt_speech: list[int],
    chunks: list[list[int]],
    fill_at: set[int],
    final_len: int,
) -> None:
    """Default mode: every text token and prompt speech token is fed exactly once, in order;
    every emitted token but the last is the next input; FILL is never fed; the cache length
    equals the rows fed."""

    def choose(i: int, mode: bs.StepMode) -> int:
        if mode is bs.StepMode.SAMPLE_FINAL:
            return EOS if i >= first_final[0] + final_len else 3000 + i
        return FILL if i in fill_at else 3000 + i

    first_final = [10**9]
    state = bs.new_state(bs.BistreamConfig(), tuple(prompt_text), tuple(prompt_speech))
    d = Driver(state, choose)
    for c in chunks:
        d.text(c)
    first_final[0] = len(d.steps)
    d.end()
    assert d.finished is not None
    rows = [r for s in d.steps for r in s.feed]
    all_text = prompt_text + [t for c in chunks for t in c]
    assert [r[1] for r in rows if r[0] == RowKind.TEXT] == all_text
    speech_fed = [r[1] for r in rows if r[0] == RowKind.SPEECH]
    assert speech_fed[: len(prompt_speech)] == prompt_speech
    assert speech_fed[len(prompt_speech) :] == d.emitted[: len(speech_fed) - len(prompt_speech)]
    assert FILL not in speech_fed
    assert rows.count(TASK) == 1 and rows[0] == bs.SOS
    assert state.cache_len == len(rows)
    # Before the final phase, never more than 15 speech tokens without a FILL.
    run = 0
    for s, token in zip(d.steps, d.tokens, strict=True):
        if s.mode is bs.StepMode.SAMPLE_FINAL:
            break
        run = 0 if token == FILL else run + 1
        assert run <= 15


def test_module_does_not_need_torch() -> None:
    code = "import sys; sys.modules['torch'] = None; import voice_out.text.bistream"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_whole_text_request_masks_eos_before_min_len_and_stops() -> None:
    rows = (bs.SOS, *text_rows([1, 2]), TASK)
    state = bs.new_whole_text_state(rows, min_len=3, max_len=40)
    first = state.step
    assert first is not None and first.feed == rows and first.mode is bs.StepMode.SAMPLE
    modes = []
    for tok in (10, 11, 12, 13):
        step = state.step
        assert step is not None
        modes.append(step.mode)
        actions = bs.process(state, bs.StepDone(tok))
        assert actions[0] == bs.Emit(tok)
        assert isinstance(actions[1], bs.Step) and actions[1].feed == ((RowKind.SPEECH, tok),)
    assert modes == [bs.StepMode.SAMPLE] * 3 + [bs.StepMode.SAMPLE_FINAL]
    assert bs.process(state, bs.StepDone(EOS)) == [bs.Finished(bs.FinishReason.EOS)]
    assert state.cache_len == len(rows) + 4 and state.emitted == 4
    with_reserved = bs.new_whole_text_state(rows, min_len=0, max_len=40)
    assert bs.process(with_reserved, bs.StepDone(6562)) == [bs.Finished(bs.FinishReason.STOP_TOKEN)]


def test_whole_text_request_stops_at_max_len() -> None:
    state = bs.new_whole_text_state((bs.SOS, TASK), min_len=0, max_len=2)
    assert bs.process(state, bs.StepDone(5))[0] == bs.Emit(5)
    assert bs.process(state, bs.StepDone(6)) == [bs.Emit(6), bs.Finished(bs.FinishReason.MAX_LEN)]
    assert state.step is None and state.phase is bs.Phase.FINISHED
    empty = bs.new_whole_text_state((bs.SOS, TASK), min_len=0, max_len=0)
    assert empty.step is None and empty.finish_reason is bs.FinishReason.MAX_LEN


def test_row_kinds_are_the_numbers_of_the_models_embedding_tables() -> None:
    """A row travels as ``(RowKind, id)`` from the feed to ``SpeechLM.embed_rows``, which reads
    the kind as the number of its embedding table: the two numberings are one."""
    from voice_out.model.llm import KIND_LLM, KIND_SPEECH, KIND_TEXT

    assert [RowKind.LLM, RowKind.TEXT, RowKind.SPEECH] == [KIND_LLM, KIND_TEXT, KIND_SPEECH]
    assert sorted(int(k) for k in RowKind) == [KIND_LLM, KIND_TEXT, KIND_SPEECH]
