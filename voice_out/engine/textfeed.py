"""The per-request text side the scheduler drives. No torch.

* :class:`BistreamFeed`: :class:`~voice_out.engine.request.TextFeed` over the pure bistream
  state machine of :mod:`voice_out.text.bistream` (the 5 text : 15 speech interleave, spec 2.7).
* :class:`TokenizerPipeline`: raw deltas -> text pieces: held back to word boundaries so that BPE
  never sees half a word, then tokenized, each piece carrying the input characters it covers.
* :class:`CharPipeline`: one id per character, for tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from voice_out.engine.request import FILL_TOKEN, LlmStep, TextPiece, TokenOutcome
from voice_out.text import bistream as bs
from voice_out.text.rows import TASK_ID, Row, RowKind


class BistreamFeed:
    """One request's interleave, driven through :func:`voice_out.text.bistream.process`.

    ``next_step`` hands out the state machine's outstanding ``Step`` once; ``on_token`` reports
    its result. Worker thread only.
    """

    def __init__(
        self,
        prompt_text_ids: Sequence[int] = (),
        prompt_speech_ids: Sequence[int] = (),
        config: bs.BistreamConfig | None = None,
    ) -> None:
        self._n_prompt_text = len(prompt_text_ids)
        self.state = bs.new_state(config or bs.BistreamConfig(), tuple(prompt_text_ids), tuple(prompt_speech_ids))
        self._handed_out = False
        self._first = True

    @property
    def done(self) -> bool:
        return self.state.phase is bs.Phase.FINISHED

    @property
    def final_phase(self) -> bool:
        return self.state.phase is bs.Phase.FINAL or self.state.text_ended

    @property
    def text_fed(self) -> int:
        """Request text ids (prompt transcript excluded) already in an issued LLM step."""
        s = self.state
        unfed = len(s.text_buf) + s.chunk_tokens
        if not s.pending_fed:
            unfed += sum(1 for kind, _ in s.pending if kind == RowKind.TEXT)
        # the prompt transcript is fed first, so it is what the buffers lack first
        return max(0, s.text_tokens - unfed)

    def add_text(self, ids: Sequence[int]) -> None:
        bs.process(self.state, bs.TextReceived(tuple(ids)))

    def end_text(self) -> None:
        bs.process(self.state, bs.TextEnded())

    def next_step(self) -> LlmStep | None:
        step = self.state.step
        if step is None or self._handed_out:
            return None
        self._handed_out = True
        first, self._first = self._first, False
        return self._llm_step(step, first)

    def step_after(self, token: int) -> LlmStep | None:
        """The step :meth:`next_step` would hand out once the step handed out now is answered
        with ``token`` and no text arrives in between (None: it would wait for text, or end, or
        no step is out). Changes nothing: a guess the scheduler plans ahead with."""
        if not self._handed_out:
            return None
        state = bs.copy_state(self.state)
        bs.process(state, bs.StepDone(token))
        return self._llm_step(state.step, False) if state.step is not None else None

    def _llm_step(self, step: bs.Step, first: bool) -> LlmStep:
        inputs = tuple(step.feed)
        prefix = self._voice_prefix(inputs) if first else 0
        if step.mode is bs.StepMode.FORCE_FILL:
            return LlmStep(inputs, allow_eos=False, force=FILL_TOKEN, voice_prefix=prefix)
        return LlmStep(inputs, allow_eos=step.mode is bs.StepMode.SAMPLE_FINAL, voice_prefix=prefix)

    def _voice_prefix(self, inputs: Sequence[Row]) -> int:
        """Rows of the first step before the first one that is not the voice's: a text row past
        the prompt transcript (the transcript is fed first), or TASK (it follows the end of the
        request's text). Speech rows of a first step are prompt speech."""
        seen_text = 0
        for i, row in enumerate(inputs):
            if row == TASK_ID:
                return i
            if row[0] == RowKind.TEXT:
                if seen_text == self._n_prompt_text:
                    return i
                seen_text += 1
        return len(inputs)

    def on_token(self, token: int) -> TokenOutcome:
        if not self._handed_out:
            raise ValueError("on_token without a handed-out step")
        self._handed_out = False
        actions = bs.process(self.state, bs.StepDone(token))
        if any(isinstance(a, bs.Emit) for a in actions):
            return TokenOutcome.SPEECH  # possibly also finished (length guard): see ``done``
        if self.done:
            return TokenOutcome.END
        return TokenOutcome.FILL


class CharPipeline:
    """One text id per input character (``ord(c) % vocab``); no normalization. For tests."""

    def __init__(self, vocab: int = 1000) -> None:
        self._vocab = vocab
        self._chars = 0

    def push(self, delta: str) -> list[TextPiece]:
        out = []
        for c in delta:
            self._chars += 1
            out.append(TextPiece((ord(c) % self._vocab,), self._chars))
        return out

    def finish(self) -> list[TextPiece]:
        return []


_BOUNDARY = frozenset(" \t\n\r.,;:!?\u3002\uff0c\uff1b\uff1a\uff01\uff1f\u3001")


class TokenizerPipeline:
    """Deltas -> tokenized pieces, released at word boundaries.

    Text is held until a boundary character (space or punctuation; every CJK character stands
    alone), so a word split across deltas is tokenized whole, as upstream's frontend sees it.
    ``normalize`` (optional) maps each released piece to the text the LLM sees; the characters
    a piece covers are counted in the raw input.
    """

    def __init__(self, encode: Callable[[str], list[int]], normalize: Callable[[str], str] | None = None) -> None:
        self._encode = encode
        self._normalize = normalize
        self._held = ""
        self._chars = 0  # raw characters released so far

    def _release(self, text: str) -> list[TextPiece]:
        self._chars += len(text)
        shown = self._normalize(text) if self._normalize is not None else text
        ids = tuple(self._encode(shown))
        return [TextPiece(ids, self._chars)] if ids else []

    def push(self, delta: str) -> list[TextPiece]:
        self._held += delta
        cut = max((i for i, c in enumerate(self._held) if c in _BOUNDARY or _is_cjk(c)), default=-1)
        if cut < 0:
            return []
        text, self._held = self._held[: cut + 1], self._held[cut + 1 :]
        return self._release(text)

    def finish(self) -> list[TextPiece]:
        text, self._held = self._held, ""
        return self._release(text) if text else []


def _is_cjk(c: str) -> bool:
    return "\u4e00" <= c <= "\u9fff" or "\u3040" <= c <= "\u30ff"
