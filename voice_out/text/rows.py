"""The LLM's input rows, and their assembly for whole-text requests (cosyvoice2-spec section
2.4). No torch.

The LM never sees token ids directly: its input is a sequence of embedding rows, each named by
a ``(kind, id)`` pair, :data:`Row`: :class:`RowKind` ``LLM`` (0, an ``llm_embedding`` row:
SOS or TASK_ID), ``TEXT`` (1, a text token) or ``SPEECH`` (2, a speech token); the same
numbering as the parity traces. This is the one representation of a row from the bistream
feed through the scheduler and the runner to ``SpeechLM.embed_rows``, which turns a list of
them into embeddings (``RowKind`` is an ``IntEnum``: the model reads the kinds as ints). The
layout is::

    [SOS] + text(prompt_text ++ text) + [TASK_ID] + speech(prompt_speech)

and the three synthesis modes differ only in which pieces are empty:

=============  ========================================  ===================
mode           prompt text                               prompt speech (LLM)
=============  ========================================  ===================
zero-shot      normalised transcript of the prompt audio prompt speech tokens
cross-lingual  (none)                                    (none)
instruct       instruct text ending in ``<|endofprompt|>``  (none)
=============  ========================================  ===================

Length limits count only the target text: ``min_len = 2 * N``, ``max_len = 20 * N``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence


class RowKind(enum.IntEnum):
    """Which embedding table a row reads."""

    LLM = 0  # llm_embedding: row 0 SOS, row 1 TASK_ID (speech starts after it)
    TEXT = 1  # the text token embedding table
    SPEECH = 2  # the speech token embedding table


SOS_ROW = 0
TASK_ID_ROW = 1

Row = tuple[RowKind, int]
SOS: Row = (RowKind.LLM, SOS_ROW)
TASK_ID: Row = (RowKind.LLM, TASK_ID_ROW)

#: Upstream ratios of speech tokens to target text tokens (spec 2.4).
MIN_TOKENS_PER_TEXT_TOKEN = 2
MAX_TOKENS_PER_TEXT_TOKEN = 20


def text_rows(ids: Sequence[int]) -> list[Row]:
    return [(RowKind.TEXT, int(i)) for i in ids]


def speech_rows(ids: Sequence[int]) -> list[Row]:
    return [(RowKind.SPEECH, int(i)) for i in ids]


def zero_shot_rows(prompt_text: Sequence[int], text: Sequence[int], prompt_speech: Sequence[int]) -> list[Row]:
    """``[SOS, text(prompt_text ++ text), TASK_ID, speech(prompt_speech)]``."""
    return [SOS, *text_rows(prompt_text), *text_rows(text), TASK_ID, *speech_rows(prompt_speech)]


def cross_lingual_rows(text: Sequence[int]) -> list[Row]:
    """No prompt transcript and no prompt speech in the LLM (the flow still uses the prompt)."""
    return zero_shot_rows((), text, ())


def instruct_rows(instruct_text: Sequence[int], text: Sequence[int]) -> list[Row]:
    """The (un-normalised) instruct text takes the place of the prompt transcript; no prompt speech."""
    return zero_shot_rows(instruct_text, text, ())


def length_limits(
    n_text_tokens: int,
    min_ratio: int = MIN_TOKENS_PER_TEXT_TOKEN,
    max_ratio: int = MAX_TOKENS_PER_TEXT_TOKEN,
) -> tuple[int, int]:
    """``(min_len, max_len)`` in speech tokens for ``n_text_tokens`` target text tokens.

    EOS is masked while fewer than ``min_len`` tokens were produced; decoding stops after
    ``max_len`` tokens.
    """
    return int(n_text_tokens * min_ratio), int(n_text_tokens * max_ratio)
