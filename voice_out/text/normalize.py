"""Whole-text normalization and sentence splitting, as CosyVoice2's frontend does it.

Two engines, chosen by :func:`create_text_normalizer`:

* ``"wetext"`` (the default when it loads): the WeTextProcessing FSTs of the ``wetext`` package
  (they ship inside its wheel and are read from disk; nothing is downloaded) for numbers, dates,
  times, money, units, ..., followed by upstream's post-rules;
* ``"rules"``: upstream's built-in fallback only (what it does when no TN engine is installed;
  parity case g2 records exactly this mode).

The rules around the engine (upstream ``text_normalize``):

* text holding both ``<|`` and ``|>`` is left untouched (no strip, no split);
* Chinese path (any char in U+4E00..U+9FFF): TN, drop newlines, drop spaces that are not
  between two non-space ASCII chars, ``²``/``³`` -> 平方/立方, every ``.`` -> ``。``,
  `` - `` -> ``，``, drop ``（）【】`` and backticks, ``——`` -> space, a final run of
  ``，,、`` -> ``。``;
* English path: TN, then every run of digit characters (``str.isdigit``) is spelled out with
  :func:`number_to_words` (our re-implementation of inflect's, see there);
* splitting (:func:`split_paragraph`) into segments of at most ~80 length units (characters for
  Chinese, tokens for English), dropping segments made only of punctuation and symbols.

Everything here is pure Python; a :class:`TextNormalizer` can be shared between threads (the
wetext FSTs are read-only after loading).
"""

from __future__ import annotations

import logging
import re
import threading
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, Protocol

log = logging.getLogger(__name__)

NormalizerMode = Literal["auto", "wetext", "rules"]
Lang = Literal["zh", "en"]

ZH_SENTENCE_PUNCT = frozenset("。？！；：、.?!;")
EN_SENTENCE_PUNCT = frozenset(".?!;:")
CLOSING_QUOTES = frozenset('"”')
TOKEN_MAX_N = 80
TOKEN_MIN_N = 60
MERGE_LEN = 20


# --------------------------------------------------------------------------------------------
# numbers (inflect-compatible)

_UNITS = ("", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_TEENS = (
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
)
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
_SCALES = (
    "",
    "thousand",
    "million",
    "billion",
    "trillion",
    "quadrillion",
    "quintillion",
    "sextillion",
    "septillion",
    "octillion",
    "nonillion",
    "decillion",
)


def _two_digits(tens: int, units: int) -> str:
    if tens == 1:
        return _TEENS[units]
    if tens and units:
        return f"{_TENS[tens]}-{_UNITS[units]}"
    return _TENS[tens] or _UNITS[units]


def _group_words(hundreds: int, tens: int, units: int) -> str:
    rest = _two_digits(tens, units)
    if hundreds:
        return f"{_UNITS[hundreds]} hundred" + (f" and {rest}" if rest else "")
    return rest


def number_to_words(digits: str) -> str:
    """Spell a run of digit characters the way ``inflect.engine().number_to_words`` does.

    Only what upstream feeds it is covered: a string of digits (no sign, no decimal point, no
    ordinal suffix), with inflect's defaults (``andword="and"``, ``zero="zero"``, ``group=0``):

    * groups of three from the right, each "N hundred and TU" with hyphenated tens-units,
      followed by its scale word; groups are joined with ``", "``;
    * when the last non-empty group has no hundreds and is a single word ("twenty-four",
      "ten"), it is joined with ``" and "`` instead: 2024 -> "two thousand and twenty-four",
      1998 -> "one thousand, nine hundred and ninety-eight";
    * 0 -> "zero", 1 -> "one", leading zeros are ignored.

    Characters that ``str.isdigit`` accepts but that are not decimal digits (superscripts) are
    dropped, as inflect's ``\\D`` filter does; nothing left reads "zero". Numbers beyond the
    decillions, where inflect raises, are read digit by digit.
    """
    decimals = [unicodedata.decimal(c) for c in digits if unicodedata.decimal(c, -1) >= 0]
    value = int("".join(str(d) for d in decimals)) if decimals else 0
    if value == 0:
        return "zero"
    text = str(value)
    if len(text) > 3 * len(_SCALES):
        return " ".join(_UNITS[int(c)] or "zero" for c in text)
    groups: list[tuple[int, int, int]] = []
    for end in range(len(text), 0, -3):
        chunk = text[max(0, end - 3) : end].rjust(3, "0")
        groups.append((int(chunk[0]), int(chunk[1]), int(chunk[2])))
    parts: list[str] = []
    for scale, (h, t, u) in reversed(list(enumerate(groups))):
        words = _group_words(h, t, u)
        if words:
            parts.append(f"{words} {_SCALES[scale]}".rstrip())
    # inflect rewrites a final ", <one word>" as " and <one word>".
    if len(parts) > 1 and " " not in parts[-1]:
        return ", ".join(parts[:-1]) + " and " + parts[-1]
    return ", ".join(parts)


def spell_out_digit_runs(text: str) -> str:
    """Replace every maximal run of ``str.isdigit`` characters by :func:`number_to_words`."""
    out: list[str] = []
    start: int | None = None
    for i, c in enumerate(text):
        if c.isdigit():
            if start is None:
                start = i
            continue
        if start is not None:
            out.append(number_to_words(text[start:i]))
            start = None
        out.append(c)
    if start is not None:
        out.append(number_to_words(text[start:]))
    return "".join(out)


# --------------------------------------------------------------------------------------------
# upstream's Chinese post-rules


def contains_chinese(text: str) -> bool:
    """Whether any char is a CJK unified ideograph (U+4E00..U+9FFF), upstream's language test."""
    return any("\u4e00" <= c <= "\u9fff" for c in text)


def is_cjk(char: str) -> bool:
    return "\u4e00" <= char <= "\u9fff"


def _space_kept(prev: str, nxt: str) -> bool:
    return prev.isascii() and prev != " " and nxt.isascii() and nxt != " "


def remove_blanks(text: str) -> str:
    """Drop each ``" "`` whose two neighbours are not both non-space ASCII (upstream ``replace_blank``).

    At the ends, upstream reads ``text[-1]`` for the left neighbour of position 0 (Python's
    wrap-around) and would fail on a final space; its input is stripped, so neither happens. Here
    a space at either end is dropped.
    """
    out: list[str] = []
    last = len(text) - 1
    for i, c in enumerate(text):
        if c == " " and not (0 < i < last and _space_kept(text[i - 1], text[i + 1])):
            continue
        out.append(c)
    return "".join(out)


def zh_post_rules(text: str, *, final: bool = True) -> str:
    """Upstream's Chinese rules after TN (newlines, blanks, marks, dots, dashes, brackets).

    ``final=False`` leaves out the last rule (a trailing ``，,、`` run -> ``。``), which only
    applies at the very end of a text.
    """
    text = text.replace("\n", "")
    text = remove_blanks(text)
    text = text.replace("²", "平方").replace("³", "立方")
    text = text.replace(".", "。")
    text = text.replace(" - ", "，")
    for mark in ("（", "）", "【", "】", "`"):
        text = text.replace(mark, "")
    text = text.replace("——", " ")
    if final:
        text = re.sub(r"[，,、]+$", "。", text)
    return text


def is_only_punctuation(text: str) -> bool:
    """True when every char is Unicode punctuation (P*) or a symbol (S*); also for ``""``."""
    return all(unicodedata.category(c)[0] in "PS" for c in text)


# --------------------------------------------------------------------------------------------
# sentence splitting


def split_paragraph(text: str, lang: Lang, length: Callable[[str], int]) -> list[str]:
    """Cut ``text`` after sentence punctuation and merge the pieces greedily (upstream rules).

    ``length`` measures a piece: characters for Chinese, tokens for English. Pieces are merged
    while the merged length stays within :data:`TOKEN_MAX_N` (a piece is closed early only when
    it is already longer than :data:`TOKEN_MIN_N`); a last piece shorter than :data:`MERGE_LEN`
    joins the previous one. A closing quote right after the punctuation stays with the sentence.
    """
    if not text:
        return []
    punct = ZH_SENTENCE_PUNCT if lang == "zh" else EN_SENTENCE_PUNCT
    if text[-1] not in punct:
        text += "。" if lang == "zh" else "."
    sentences: list[str] = []
    start = 0
    for i, c in enumerate(text):
        if c not in punct:
            continue
        if i > start:
            sentences.append(text[start : i + 1])
        if i + 1 < len(text) and text[i + 1] in CLOSING_QUOTES and sentences:
            sentences[-1] += text[i + 1]
            start = i + 2
        else:
            start = i + 1
    merged: list[str] = []
    current = ""
    for sentence in sentences:
        if length(current + sentence) > TOKEN_MAX_N and length(current) > TOKEN_MIN_N:
            merged.append(current)
            current = ""
        current += sentence
    if current:
        if length(current) < MERGE_LEN and merged:
            merged[-1] += current
        else:
            merged.append(current)
    return merged


# --------------------------------------------------------------------------------------------
# TN engines


class TNEngine(Protocol):
    """A text-normalization engine: written forms -> spoken forms for one language."""

    def normalize(self, text: str, lang: Lang) -> str: ...


class WetextEngine:
    """The ``wetext`` FSTs (zh with erhua kept, en), loaded from the installed package.

    Results are memoized per (text, lang): the streaming normalizer calls it once per segment and
    segments repeat a lot. One instance serves every thread (FST calls are serialized by a lock).
    """

    def __init__(self) -> None:
        from wetext import Normalizer  # local import: loading the FSTs takes ~0.4 s

        self._zh = Normalizer(lang="zh", operator="tn", remove_erhua=False)
        self._en = Normalizer(lang="en", operator="tn")
        self._cached = lru_cache(maxsize=65536)(self._normalize_uncached)
        self._lock = threading.Lock()  # kaldifst does not promise thread safety; calls are short
        # Fail now rather than on the first request if the FSTs cannot be read.
        self._zh.normalize("1")
        self._en.normalize("1")

    def normalize(self, text: str, lang: Lang) -> str:
        result: str = self._cached(text, lang)
        return result

    def _normalize_uncached(self, text: str, lang: Lang) -> str:
        if not text.strip():
            return text
        try:
            with self._lock:
                spoken = str((self._zh if lang == "zh" else self._en).normalize(text))
            return spoken if lang == "zh" else fix_wetext_en(text, spoken)
        except Exception as exc:  # the FST runtime asserts on some symbol strings ("$%")
            log.debug("wetext failed on %r (%s: %s); leaving it to the rules", text, type(exc).__name__, exc)
            return text


_WETEXT_ESCAPE = re.compile(r'\\(["\\])')
_NUMBER_WORDS = frozenset((*_UNITS[1:], *_TEENS, *_TENS[2:], "hundred", "zero", "oh"))


def fix_wetext_en(source: str, spoken: str) -> str:
    """Repair two defects of the English wetext 0.1 FSTs (upstream pins 0.0.4, which we cannot get).

    * ``"`` and ``\\`` come out backslash-escaped (``\\"``); the escape is removed;
    * a count of exactly one thousand loses its "one" ("$1,250" -> "thousand two hundred and
      fifty dollars"); "one" is put back where "thousand" follows no number word, only when the
      source had a digit.
    """
    spoken = _WETEXT_ESCAPE.sub(r"\1", spoken)
    if "thousand" in spoken and any(c.isdigit() for c in source):
        words = spoken.split(" ")
        for i, word in enumerate(words):
            prev = words[i - 1].split("-")[-1] if i else ""
            if word.startswith("thousand") and word.rstrip(",.;:!?") == "thousand" and prev not in _NUMBER_WORDS:
                words[i] = "one " + word
        spoken = " ".join(words)
    return spoken


_WETEXT_FAILURE: str | None = None
_WETEXT: WetextEngine | None = None


def load_wetext() -> WetextEngine | None:
    """The process-wide :class:`WetextEngine`, or None (with one warning) when it cannot load."""
    global _WETEXT, _WETEXT_FAILURE
    if _WETEXT is not None or _WETEXT_FAILURE is not None:
        return _WETEXT
    try:
        _WETEXT = WetextEngine()
    except Exception as exc:  # ImportError, missing FST files, kaldifst errors: all mean "no TN"
        _WETEXT_FAILURE = f"{type(exc).__name__}: {exc}"
        log.warning(
            "text normalization: wetext is unavailable (%s); using the built-in rules only "
            "(numbers are spelled digit run by digit run in English and left as digits in Chinese)",
            _WETEXT_FAILURE,
        )
    return _WETEXT


# --------------------------------------------------------------------------------------------
# the normalizer


@dataclass(frozen=True)
class TextNormalizer:
    """Upstream ``text_normalize`` with a chosen TN engine (None = the fallback rules only).

    ``length`` counts English tokens for splitting (the model's tokenizer ``encode``).
    """

    engine: TNEngine | None
    token_length: Callable[[str], int]

    @property
    def mode(self) -> Literal["wetext", "rules"]:
        return "rules" if self.engine is None else "wetext"

    def normalize(self, text: str) -> str:
        """The whole text normalized, not split (upstream ``split=False``)."""
        return self._normalize(text)[0]

    def split(self, text: str) -> list[str]:
        """The normalized text cut into synthesis segments (upstream ``split=True``)."""
        return self._normalize(text)[1]

    def normalize_piece(self, text: str, lang: Lang, *, final: bool) -> str:
        """Normalize one piece in a known language without stripping or splitting.

        Used by the streaming normalizer on self-contained segments. ``final`` says whether the
        piece ends the text (the Chinese trailing-comma rule applies only then).
        """
        if lang == "zh":
            if self.engine is not None:
                text = _keep_outer_space(text, lambda t: self.engine.normalize(t, "zh") if self.engine else t)
            return zh_post_rules(text, final=final)
        if self.engine is not None:
            text = _keep_outer_space(text, lambda t: self.engine.normalize(t, "en") if self.engine else t)
        return spell_out_digit_runs(text)

    def _normalize(self, text: str) -> tuple[str, list[str]]:
        if ("<|" in text and "|>" in text) or not text:
            return text, [text]
        text = text.strip()
        if contains_chinese(text):
            if self.engine is not None:
                text = self.engine.normalize(text, "zh")
            text = zh_post_rules(text)
            segments = split_paragraph(text, "zh", len)
        else:
            if self.engine is not None:
                text = self.engine.normalize(text, "en")
            text = spell_out_digit_runs(text)
            segments = split_paragraph(text, "en", self.token_length)
        return text, [s for s in segments if not is_only_punctuation(s)]


def _keep_outer_space(text: str, fn: Callable[[str], str]) -> str:
    stripped = text.strip()
    if not stripped:
        return text
    head = text[: len(text) - len(text.lstrip())]
    tail = text[len(text.rstrip()) :]
    return head + fn(stripped) + tail


def create_text_normalizer(mode: NormalizerMode, token_length: Callable[[str], int]) -> TextNormalizer:
    """``"auto"``: wetext when it loads, else the rules (logged once); ``"wetext"`` fails loudly."""
    if mode == "rules":
        return TextNormalizer(None, token_length)
    engine = load_wetext()
    if engine is None and mode == "wetext":
        raise RuntimeError(f"wetext text normalization was requested but cannot load: {_WETEXT_FAILURE}")
    return TextNormalizer(engine, token_length)
