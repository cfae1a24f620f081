"""The per-request text feed the scheduler drives. No torch.

:class:`BistreamFeed` implements :class:`~voice_out.engine.request.TextFeed` over the 5 text :
15 speech interleave of spec 2.7. :class:`CharPipeline` is a trivial text pipeline for tests and
for ``random:*`` models (one id per character).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from voice_out.engine.request import (
    EOS_TOKEN,
    FILL_TOKEN,
    STOP_TOKENS,
    LlmInputKind,
    LlmStep,
    TextPiece,
    TokenOutcome,
)

TEXT_GROUP = 5
SPEECH_GROUP = 15

_SOS = (LlmInputKind.SOS, 0)
_TASK = (LlmInputKind.TASK, 1)


class BistreamFeed:
    """Spec 2.7's ``inference_bistream`` as a state machine, one LLM forward per call.

    Deliberate differences from upstream: no duplicated speech token before the final text
    (quirk A), and a stop id other than FILL in the interleave phase counts as FILL (upstream
    raises). Quirk B (prompt speech dropped when the text ends first) is kept: it is what the
    model was run with upstream.
    """

    def __init__(self, prompt_text_ids: Sequence[int] = (), prompt_speech_ids: Sequence[int] = ()) -> None:
        # (id, is_prompt): prompt transcript ids seed the buffer but do not count as fed text
        self._text: deque[tuple[int, bool]] = deque((i, True) for i in prompt_text_ids)
        self._pspeech: deque[int] = deque(prompt_speech_ids)
        p = len(prompt_speech_ids)
        self._next_fill = (p // SPEECH_GROUP + 1) * SPEECH_GROUP - p
        self._pending: list[tuple[LlmInputKind, int]] = [_SOS]
        self._n_out = 0  # tokens picked, FILL included
        self._last: int | None = None
        self._ended = False
        self._final = False
        self._done = False
        self._text_fed = 0

    @property
    def text_fed(self) -> int:
        return self._text_fed

    @property
    def done(self) -> bool:
        return self._done

    @property
    def final_phase(self) -> bool:
        return self._final

    def add_text(self, ids: Sequence[int]) -> None:
        if self._ended:
            raise ValueError("text added after end_text")
        self._text.extend((i, False) for i in ids)

    def end_text(self) -> None:
        self._ended = True

    def _take_text(self, n: int) -> None:
        for _ in range(n):
            tid, is_prompt = self._text.popleft()
            self._pending.append((LlmInputKind.TEXT, tid))
            if not is_prompt:
                self._text_fed += 1

    def next_step(self) -> LlmStep | None:
        if self._done:
            return None
        if not self._final:
            while self._pspeech and len(self._text) >= TEXT_GROUP:
                self._take_text(TEXT_GROUP)
                for _ in range(min(SPEECH_GROUP, len(self._pspeech))):
                    self._pending.append((LlmInputKind.SPEECH, self._pspeech.popleft()))
            if self._pspeech and not self._ended:
                return None
            if not self._pspeech:
                needs_text = self._last == FILL_TOKEN or (self._n_out == 0 and self._pending == [_SOS])
                if needs_text and len(self._text) >= TEXT_GROUP:
                    self._take_text(TEXT_GROUP)
                    needs_text = False
                if not needs_text:
                    force = FILL_TOKEN if self._n_out == self._next_fill else None
                    return self._emit(allow_eos=False, force=force)
            if not self._ended:
                return None
            # text is over: everything left, then TASK, then speech until EOS
            self._pspeech.clear()
            self._take_text(len(self._text))
            self._pending.append(_TASK)
            self._final = True
        return self._emit(allow_eos=True, force=None)

    def _emit(self, allow_eos: bool, force: int | None) -> LlmStep:
        step = LlmStep(tuple(self._pending), allow_eos=allow_eos, force=force)
        self._pending = []
        return step

    def on_token(self, token: int) -> TokenOutcome:
        self._n_out += 1
        self._last = token
        if token in STOP_TOKENS:
            if self._final:
                self._done = True
                return TokenOutcome.END
            self._last = FILL_TOKEN
            self._next_fill = self._n_out + SPEECH_GROUP
            return TokenOutcome.FILL
        self._pending = [(LlmInputKind.SPEECH, token)]
        return TokenOutcome.SPEECH

    def stop(self) -> None:
        """End the LLM side now (a guard tripped)."""
        self._done = True


class CharPipeline:
    """One text id per input character (``ord(c) % vocab``); no normalization.

    For tests and for random-weight models without tokenizer files.
    """

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


__all__ = ["EOS_TOKEN", "BistreamFeed", "CharPipeline"]
