"""Incremental normalization of LLM text deltas, with token-stable release and input offsets.

A :class:`DeltaNormalizer` takes the deltas of one utterance (``push``), returns the normalized
text that can no longer change, and holds back only what still could. Its defining property,
tested over a corpus: for ANY way of cutting a text into deltas, the concatenated output is the
same string, and tokenizing each released piece separately gives the same ids as tokenizing the
whole output at once. Three stages, each deciding only on what it has seen:

1. **Markdown and emoji** (:class:`_MarkupStage`): ``**bold**``/``*em*``/``_em_`` markers,
   ``#`` headings, ``-``/``*``/``+``/``1.`` list bullets, ``>`` quotes, backticks and code
   fences, horizontal rules, ``[text](url)`` and ``![alt](url)`` -> text, table ``|`` -> space,
   emoji -> space. A line end after text without final punctuation becomes a sentence end
   (``.`` or ``。``), so list items and headings are read as sentences. CosyVoice2's
   paralinguistic tags (``[breath]``, ``[laughter]``, ``<strong>`` ...) pass through whole;
   the chat-structure tokens (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``,
   ``<|endofprompt|>``) are dropped. Held back: an undecided marker (``*`` before its next
   char, ``#``/digits at a line start before the space, a prefix of a tag, ``]`` before a
   possible ``(``).
2. **Segments** (:class:`_SegmentStage`): the clean text is cut into units (whitespace-separated
   words; in Chinese, clauses ending with ``，。！？；：、``), and units are glued into segments
   where a number needs its neighbour (a unit ending in a digit or a currency sign, a unit made
   only of symbols, a month name before a day). Each finished segment is normalized on its own
   (:meth:`TextNormalizer.normalize_piece`: wetext or the rules, plus upstream's post-rules) in
   the segment's language: Chinese when it holds a CJK ideograph, English when it holds a Latin
   letter, else the language of the last segment that had letters (``default_lang`` first).
   Segments are joined by one space when the input had whitespace there and both neighbours are
   ASCII (upstream's Chinese blank rule, applied to both languages), else by nothing.
   Held back: the unfinished unit, and a unit that waits for its neighbour.
3. **Token-safe release** (:func:`is_token_boundary`): normalized text is released only up to a
   position where the Qwen2 pre-tokenizer always starts a new pre-token, whatever follows, so
   BPE can never merge across it: never after whitespace, never inside a letter run (a whole
   CJK clause is one letter run), never between two punctuation chars or before a letter that
   a punctuation char could prefix, never where NFC could compose. Held back: at least the last
   normalized char (the one after it decides).

Offsets: every normalized char carries the input offset up to which the input has been
accounted for once that char is spoken. Chars copied one to one (words and clauses that
normalization leaves alone) advance it char by char; a rewritten segment (a number read out)
advances it only at its last char. :attr:`DeltaNormalizer.input_end` is the offset reached by
everything released so far: the engine reports "the input up to here was heard".

An instance belongs to one utterance and one thread (the thread that feeds text, in the engine
the GPU worker); it is cheap to create. The :class:`TextNormalizer` it uses may be shared.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field

from voice_out.text.normalize import Lang, TextNormalizer, is_cjk
from voice_out.text.tokenizer import ALL_SPECIAL_TOKENS, Tokenizer

#: Tags that reach the model (CosyVoice2's paralinguistic tokens); other specials are dropped.
SPOKEN_TAGS: frozenset[str] = frozenset(t for t in ALL_SPECIAL_TOKENS if not t.startswith("<|"))
DROPPED_TAGS: frozenset[str] = frozenset(t for t in ALL_SPECIAL_TOKENS if t.startswith("<|"))
_TAGS_BY_LENGTH = sorted(ALL_SPECIAL_TOKENS, key=len, reverse=True)

#: Chars after which a Chinese clause (a unit) ends.
CJK_BREAK_PUNCT = frozenset("，。！？；：、")
_ASCII_BREAK_PUNCT = frozenset(",.!?;:")
#: A unit starting with one of these takes no space before it.
_CLOSING_PUNCT = frozenset(".,!?;:)]}%") | CJK_BREAK_PUNCT | frozenset("”’）】》」")
_CURRENCY = frozenset("$€£¥￥₩₹")
_MONTHS = frozenset(
    "january february march april may june july august september october november december "
    "jan feb mar apr jun jul aug sep sept oct nov dec".split()
)

#: Hold-back caps. They cut where the content says (never where a delta happened to end), so
#: they keep the split invariance; only text beyond a cap tokenizes differently from one pass.
#: A unit (word, Chinese clause) is cut after this many chars ...
MAX_UNIT_CHARS = 48
#: ... a segment glues at most this many units ...
MAX_SEGMENT_UNITS = 6
#: ... and normalized text without a pre-token boundary is released after this many chars.
MAX_RUN_CHARS = 64


@dataclass(frozen=True)
class _Item:
    """One char of clean text (or a whole tag) and the input offset reached after it."""

    text: str
    input_end: int
    is_tag: bool = False


# --------------------------------------------------------------------------------------------
# stage 1: markdown and emoji


def is_emoji(char: str) -> bool:
    """Pictographs, dingbats, arrows and the like: never spoken."""
    cp = ord(char)
    return (
        0x1F000 <= cp <= 0x1FAFF
        or 0x2600 <= cp <= 0x27BF
        or 0x2B00 <= cp <= 0x2BFF
        or 0x2190 <= cp <= 0x21FF
        or 0x2300 <= cp <= 0x23FF
        or 0x25A0 <= cp <= 0x25FF
        or cp in (0x3030, 0x303D, 0x3297, 0x3299)
    )


def is_invisible_modifier(char: str) -> bool:
    """Joiners, variation selectors, keycap and tag chars that only modify an emoji."""
    cp = ord(char)
    return cp in (0x200D, 0x20E3) or 0xFE00 <= cp <= 0xFE0F or 0xE0000 <= cp <= 0xE007F


class _MarkupStage:
    """Strips markdown and emoji; see the module docstring. Decisions use only seen chars."""

    def __init__(self) -> None:
        self.raw = ""  # pending input
        self.raw_start = 0  # input offset of raw[0]
        self.line_start = True
        self.link_depth = 0
        self.url_depth = 0
        self.fence_line = False
        self.prev_raw = "\n"
        self.last_clean = ""  # last emitted non-space char

    def run(self, final: bool) -> list[_Item]:
        out: list[_Item] = []
        while self.raw:
            step = self._step(final)
            if step is None:
                break
            consumed, emitted = step
            end = self.raw_start + consumed
            for text in emitted:
                is_tag = len(text) > 1
                out.append(_Item(text, end, is_tag))
                if not text.isspace():
                    self.last_clean = text[-1]
            self.prev_raw = self.raw[consumed - 1]
            self.raw = self.raw[consumed:]
            self.raw_start = end
        return out

    def _step(self, final: bool) -> tuple[int, list[str]] | None:
        """(chars consumed, texts emitted) for the head of ``raw``; None = need more input."""
        raw = self.raw
        c = raw[0]
        if c == "\r":
            return 1, []
        if self.fence_line:
            if c == "\n":
                self.fence_line = False
                self.line_start = True
                return 1, [" "]
            return 1, []
        if self.url_depth:
            if c.isspace():
                self.url_depth = 0  # not a URL after all: resume normal processing
                return self._step(final)
            self.url_depth += {"(": 1, ")": -1}.get(c, 0)
            return 1, []
        if self.line_start:
            return self._line_start(final)
        return self._inline(final)

    def _line_start(self, final: bool) -> tuple[int, list[str]] | None:
        """Block markers at the start of a line (indentation is dropped)."""
        raw = self.raw
        c = raw[0]
        if c in " \t\n":
            return 1, []
        marker = re.match(r"(?:#{1,6}|[-*+>]|\d{1,3}[.)])[ \t]", raw)
        if marker:
            self.line_start = False
            return marker.end(), []
        if not final and re.fullmatch(r"#{1,6}|[-*+>]|\d{1,3}[.)]?", raw):
            return None  # may still become a marker
        if c in "-*_":
            run = re.match(r"([-*_])(?:[ \t]*\1)*[ \t]*", raw)
            assert run is not None
            rest = raw[run.end() :]
            if not rest and not final:
                return None
            if run.group(0).count(c) >= 3 and (not rest or rest[0] == "\n"):
                return run.end(), []  # a horizontal rule
        if c == "`":
            if raw.startswith("```"):
                self.fence_line = True
                self.line_start = False
                return 3, []
            if not final and "```".startswith(raw):
                return None
        self.line_start = False
        return self._inline(final)

    def _inline(self, final: bool) -> tuple[int, list[str]] | None:
        raw = self.raw
        c = raw[0]
        if c == "\n":
            self.line_start = True
            self.link_depth = 0
            if self.last_clean.isalnum():  # a line that ends without punctuation ends a sentence
                return 1, ["。" if _is_cjk_like(self.last_clean) else ".", " "]
            return 1, [" "]
        if c == "`":
            return 1, []
        if c in "*_":
            run = len(raw) - len(raw.lstrip(c))
            if run == len(raw) and not final:
                return None
            nxt = raw[run] if run < len(raw) else " "
            prev = self.prev_raw
            if c == "_" and run < 3 and prev.isalnum() and nxt.isalnum():
                return run, [c] * run  # snake_case
            if c == "*" and run == 1 and prev.isspace() and nxt.isspace() and self.last_clean.isdigit():
                return 1, ["*"]  # 5 * 3
            return run, [" "] if run >= 3 else []
        if c == "-":
            run = len(raw) - len(raw.lstrip("-"))
            if run == len(raw) and not final:
                return None
            return (run, [" "]) if run >= 3 else (run, ["-"] * run)
        if c == "!":
            if len(raw) < 2 and not final:
                return None
            return 1, [] if raw[1:2] == "[" else ["!"]
        if c in "[<":
            tag = _tag_at(raw)
            if tag is not None:
                return len(tag), [] if tag in DROPPED_TAGS else [tag]
            if not final and any(t.startswith(raw) for t in _TAGS_BY_LENGTH):
                return None
            if c == "[":
                self.link_depth += 1
                return 1, []
            return 1, ["<"]
        if c == "]":
            if self.link_depth:
                if len(raw) < 2 and not final:
                    return None
                self.link_depth -= 1
                if raw[1:2] == "(":
                    self.url_depth = 1
                    return 2, []
            return 1, []
        if c == "|" or c == "\t":
            return 1, [" "]
        if is_invisible_modifier(c):
            return 1, []
        if is_emoji(c):
            return 1, [" "]
        return 1, [c]


def _tag_at(text: str) -> str | None:
    for tag in _TAGS_BY_LENGTH:
        if text.startswith(tag):
            return tag
    return None


def _is_cjk_like(char: str) -> bool:
    """CJK ideographs and full-width punctuation: no space is spoken next to them."""
    return is_cjk(char) or "\u3000" <= char <= "\u303f" or "\uff00" <= char <= "\uffef"


# --------------------------------------------------------------------------------------------
# stage 2: segments


@dataclass
class _Unit:
    items: list[_Item]
    space_before: bool  # whitespace separated it from the previous unit

    @property
    def text(self) -> str:
        return "".join(i.text for i in self.items)

    @property
    def is_tag(self) -> bool:
        return len(self.items) == 1 and self.items[0].is_tag


def needs_right_context(unit: str) -> bool:
    """Whether a unit's reading may depend on the unit after it (units, years, ranges, ...)."""
    core = unit.rstrip(".,:;")
    if not core:
        return False
    if core[-1].isdigit() or core[-1] in _CURRENCY:
        return True
    if all(unicodedata.category(c)[0] in "PS" for c in core) and not any(c in CJK_BREAK_PUNCT for c in core):
        return True  # "-", "$", "&", "~": read with what follows
    return core.lower().rstrip(".") in _MONTHS or core.lower() == "no."


@dataclass
class _Segment:
    units: list[_Unit] = field(default_factory=list)


class _SegmentStage:
    def __init__(self, normalizer: TextNormalizer, default_lang: Lang) -> None:
        self.normalizer = normalizer
        self.lang: Lang = default_lang
        self.items: list[_Item] = []
        self.open: _Segment | None = None  # a segment waiting for its next unit
        self.pending_space = False  # whitespace seen since the last unit
        self.deferred_space = False  # that whitespace waits for the next segment's output
        self.space_end = 0  # input offset after that whitespace
        self.last_out = ""  # last normalized char handed on
        self.last_input_end = 0
        self.last_lang: Lang = default_lang

    def run(self, items: list[_Item], final: bool) -> list[_Item]:
        self.items.extend(items)
        out: list[_Item] = []
        pos = 0
        n = len(self.items)
        while True:
            while pos < n and self.items[pos].text.isspace():
                self.pending_space = True
                self.space_end = self.items[pos].input_end
                pos += 1
            if pos == n:
                break
            first = self.items[pos]
            if self.open is None and self.pending_space and not first.is_tag:
                # The space before a new segment: a letter keeps its script through TN, so its
                # first char decides now; a digit or symbol may be read in CJK, so the
                # segment's normalized first char decides (at flush).
                if first.text[0].isalpha():
                    out.extend(self._separator(first.text[0]))
                else:
                    self.pending_space = False
                    self.deferred_space = True
            unit_end = self._unit_end(pos, final)
            if unit_end is None:
                break
            unit = _Unit(self.items[pos:unit_end], self.pending_space)
            pos = unit_end
            self.pending_space = False
            if unit.is_tag:
                out.extend(self._flush())
                if unit.space_before:
                    out.extend(self._separator(unit.text[0]))
                out.extend(self._hand_on(unit.items))
                continue
            if self.open is None:
                self.open = _Segment()
            self.open.units.append(unit)
            if not needs_right_context(unit.text) or len(self.open.units) >= MAX_SEGMENT_UNITS:
                out.extend(self._flush())
        del self.items[:pos]
        if final:
            out.extend(self._flush())
        return out

    def _unit_end(self, start: int, final: bool) -> int | None:
        items = self.items
        if items[start].is_tag:
            return start + 1
        for i in range(start, len(items)):
            item = items[i]
            if i > start and (item.is_tag or item.text.isspace()):
                return i
            ch = item.text
            if ch in CJK_BREAK_PUNCT or (ch in _ASCII_BREAK_PUNCT and i > start and is_cjk(items[i - 1].text)):
                return i + 1
            if i + 1 - start >= MAX_UNIT_CHARS:
                return i + 1  # bound the hold-back: an over-long run is cut where it reaches the cap
        return len(items) if final else None

    def _separator(self, next_char: str) -> list[_Item]:
        self.pending_space = False
        self.deferred_space = False
        prev = self.last_out
        if not prev or _is_cjk_like(prev) or _is_cjk_like(next_char) or next_char in _CLOSING_PUNCT:
            return []
        return self._hand_on([_Item(" ", self.space_end)])

    def _hand_on(self, items: list[_Item]) -> list[_Item]:
        if items:
            self.last_out = items[-1].text[-1]
            self.last_input_end = items[-1].input_end
        return items

    def _flush(self) -> list[_Item]:
        segment, self.open = self.open, None
        if segment is None or not segment.units:
            return []
        raw_items: list[_Item] = []
        for k, unit in enumerate(segment.units):
            if k and unit.space_before:
                raw_items.append(_Item(" ", raw_items[-1].input_end))
            raw_items.extend(unit.items)
        raw = "".join(i.text for i in raw_items)
        lang = self._language(raw)
        text = self.normalizer.normalize_piece(raw, lang, final=False)
        self.last_lang = lang
        if not text:
            return []
        lead: list[_Item] = self._separator(text[0]) if self.deferred_space else []
        if len(text) == len(raw):
            # One to one (untouched words, "." -> "。"): offsets follow the chars.
            items = [_Item(ch, src.input_end) for ch, src in zip(text, raw_items, strict=True)]
        else:
            before = self.last_input_end
            end = raw_items[-1].input_end
            items = [_Item(ch, before) for ch in text[:-1]] + [_Item(text[-1], end)]
        return lead + self._hand_on(items)

    def _language(self, raw: str) -> Lang:
        if any(is_cjk(c) for c in raw):
            self.lang = "zh"
        elif any(c.isascii() and c.isalpha() for c in raw):
            self.lang = "en"
        return self.lang


# --------------------------------------------------------------------------------------------
# stage 3: token-safe release


def _char_class(ch: str) -> str:
    if ch in "\r\n":
        return "NL"
    if ch.isspace():
        return "S"
    cat = unicodedata.category(ch)
    if cat[0] == "L":
        return "L"
    if cat[0] == "N":
        return "N"
    if cat[0] == "M":
        return "M"
    return "P"


def is_token_boundary(left: str, right: str) -> bool:
    """Whether the Qwen2 pre-tokenizer always starts a new pre-token between ``left`` and ``right``.

    ``left`` and ``right`` are the chars on each side (not special tags). True means: for any
    text after ``right``, tokenizing the two sides separately gives the same ids as tokenizing
    them together. The cases (``\\p{L}`` letters, ``\\p{N}`` digits, P = anything else):

    * nothing ends after whitespace (it may become the leading space of a word, or grow);
    * a letter run ends before a non-letter; a digit is always its own pre-token;
    * a punctuation run ends before a digit or a blank that is not a newline; before a letter
      it may be the one-char prefix of that letter run, and it grows with more punctuation;
    * never before a combining mark, nor where NFC would compose the two chars.
    """
    a, b = _char_class(left), _char_class(right)
    if b == "M" or a in ("S", "NL"):
        return False
    if unicodedata.normalize("NFC", left + right) != unicodedata.normalize("NFC", left) + unicodedata.normalize(
        "NFC", right
    ):
        return False
    if a == "L":
        return b != "L"
    if a == "N":
        return True
    # a is punctuation / symbol / mark
    return b in ("N", "S")


# --------------------------------------------------------------------------------------------
# the public objects


@dataclass(frozen=True)
class Piece:
    """Released normalized text and the input offset everything released so far accounts for."""

    text: str
    input_end: int


class DeltaNormalizer:
    """Normalizes one utterance's text deltas as they arrive (see the module docstring).

    ``push(delta)`` returns the newly final normalized text (possibly ``""``), ``finish()`` the
    rest. Tokenizing each returned string on its own and concatenating the ids gives exactly
    the ids of the whole normalized text. :attr:`input_end` is the number of input chars the
    returned text accounts for; :attr:`held_chars` how many pushed chars it does not yet.

    ``markdown=False`` skips stage 1 (plain text in, plain text out; tags still pass whole).
    """

    def __init__(self, normalizer: TextNormalizer, *, default_lang: Lang = "en", markdown: bool = True) -> None:
        self._markup = _MarkupStage() if markdown else None
        self._plain_raw = ""
        self._plain_start = 0
        self._segments = _SegmentStage(normalizer, default_lang)
        self._out: list[_Item] = []
        self._boundary = 0  # index in _out of the last release boundary found
        self._scanned = 1  # boundaries before _out[:_scanned] have been examined
        self._released_end = 0
        self._pushed = 0
        self._finished = False

    @property
    def input_chars(self) -> int:
        """Input chars pushed so far."""
        return self._pushed

    @property
    def input_end(self) -> int:
        """Input offset accounted for by all text released so far (monotone)."""
        return self._released_end

    @property
    def held_chars(self) -> int:
        """Pushed input chars that released text does not account for yet."""
        return self._pushed - self._released_end

    def push(self, delta: str) -> str:
        """Feed a delta; return the normalized text that became final."""
        return self._advance(delta, final=False).text

    def push_piece(self, delta: str) -> Piece:
        """Like :meth:`push`, with the input offset reached."""
        return self._advance(delta, final=False)

    def finish(self) -> str:
        """No more input: return everything still held."""
        return self.finish_piece().text

    def finish_piece(self) -> Piece:
        if self._finished:
            return Piece("", self._released_end)
        piece = self._advance("", final=True)
        self._finished = True
        return piece

    def _advance(self, delta: str, final: bool) -> Piece:
        if self._finished:
            raise RuntimeError("DeltaNormalizer.push after finish(); create a new one per utterance")
        self._pushed += len(delta)
        items = self._clean(delta, final)
        self._out.extend(self._segments.run(items, final))
        if final:
            cut = len(self._out)
            self._apply_final_rules()
        else:
            cut = self._safe_cut()
        released, self._out = self._out[:cut], self._out[cut:]
        self._boundary -= cut
        self._scanned = max(1, self._scanned - cut)
        if released:
            self._released_end = max(self._released_end, released[-1].input_end)
        if final:
            self._released_end = self._pushed
        return Piece("".join(i.text for i in released), self._released_end)

    def _clean(self, delta: str, final: bool) -> list[_Item]:
        if self._markup is not None:
            self._markup.raw += delta
            return self._markup.run(final)
        # Without markdown, only whole tags need care: hold a possible tag prefix.
        self._plain_raw += delta
        out: list[_Item] = []
        raw = self._plain_raw
        i = 0
        while i < len(raw):
            c = raw[i]
            if c in "[<":
                tag = _tag_at(raw[i:])
                if tag is not None:
                    if tag not in DROPPED_TAGS:
                        out.append(_Item(tag, self._plain_start + i + len(tag), True))
                    i += len(tag)
                    continue
                if not final and any(t.startswith(raw[i:]) for t in _TAGS_BY_LENGTH):
                    break
            out.append(_Item(c, self._plain_start + i + 1))
            i += 1
        self._plain_raw = raw[i:]
        self._plain_start += i
        return out

    def _safe_cut(self) -> int:
        """The last release boundary in ``_out``, scanning each new char once.

        A boundary at p (before ``_out[p]``) is either a pre-token boundary or forced after
        :data:`MAX_RUN_CHARS` chars without one; both depend only on the text.
        """
        out = self._out
        for p in range(self._scanned, len(out)):
            left, right = out[p - 1], out[p]
            natural = left.is_tag or right.is_tag or is_token_boundary(left.text[-1], right.text[0])
            if natural or p - self._boundary >= MAX_RUN_CHARS:
                self._boundary = p
        self._scanned = max(self._scanned, len(out))
        return self._boundary

    def _apply_final_rules(self) -> None:
        # Upstream's Chinese rule: a trailing run of "，,、" ends the text as "。". Only the
        # held tail can hold it: the last char is never released before finish().
        if self._segments.last_lang != "zh":
            return
        k = len(self._out)
        while k and self._out[k - 1].text in ("，", ",", "、"):
            k -= 1
        if k < len(self._out):
            end = self._out[-1].input_end
            self._out[k:] = [_Item("。", end)]


@dataclass(frozen=True)
class TokenChunk:
    """Token ids of newly released text, with that text and the input offset reached."""

    ids: list[int]
    text: str
    input_end: int


class DeltaTokenizer:
    """A :class:`DeltaNormalizer` followed by the tokenizer: deltas in, token ids out.

    The ids of all chunks concatenated equal ``tokenizer.encode`` of the whole normalized text.
    One instance per utterance; call from the thread that feeds the text.
    """

    def __init__(self, normalizer: DeltaNormalizer, tokenizer: Tokenizer) -> None:
        self.normalizer = normalizer
        self.tokenizer = tokenizer

    def push(self, delta: str) -> TokenChunk:
        return self._chunk(self.normalizer.push_piece(delta))

    def finish(self) -> TokenChunk:
        return self._chunk(self.normalizer.finish_piece())

    def _chunk(self, piece: Piece) -> TokenChunk:
        return TokenChunk(self.tokenizer.encode(piece.text) if piece.text else [], piece.text, piece.input_end)


def normalize_whole(normalizer: TextNormalizer, text: str, *, default_lang: Lang = "en", markdown: bool = True) -> str:
    """The streaming normalization of a text given at once (one push, then finish)."""
    dn = DeltaNormalizer(normalizer, default_lang=default_lang, markdown=markdown)
    return dn.push(text) + dn.finish()
