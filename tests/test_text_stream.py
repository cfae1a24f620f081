"""Unit tests of the text pieces: number words, markdown/emoji cleanup, offsets, caps, fallbacks."""

from __future__ import annotations

import logging

import pytest

from voice_out.text import normalize
from voice_out.text.normalize import (
    create_text_normalizer,
    fix_wetext_en,
    number_to_words,
    spell_out_digit_runs,
    split_paragraph,
    zh_post_rules,
)
from voice_out.text.stream import MAX_RUN_CHARS, MAX_UNIT_CHARS, DeltaNormalizer, normalize_whole
from voice_out.text.tokenizer import ALL_SPECIAL_TOKENS, ByteTokenizer

RULES = create_text_normalizer("rules", len)


def clean(text: str) -> str:
    return normalize_whole(RULES, text)


# ------------------------------------------------------------------------------- numbers


@pytest.mark.parametrize(
    ("digits", "words"),
    [
        ("0", "zero"),
        ("00", "zero"),
        ("7", "seven"),
        ("13", "thirteen"),
        ("40", "forty"),
        ("99", "ninety-nine"),
        ("100", "one hundred"),
        ("105", "one hundred and five"),
        ("1000", "one thousand"),
        ("1001", "one thousand and one"),
        ("1100", "one thousand, one hundred"),
        ("1998", "one thousand, nine hundred and ninety-eight"),
        ("2024", "two thousand and twenty-four"),
        ("0199", "one hundred and ninety-nine"),
        ("12345", "twelve thousand, three hundred and forty-five"),
        ("1000010", "one million and ten"),
        ("1001000", "one million, one thousand"),
        ("３", "three"),
    ],
)
def test_number_to_words_matches_inflect(digits: str, words: str) -> None:
    assert number_to_words(digits) == words


def test_digit_runs_are_spelled_one_by_one() -> None:
    assert spell_out_digit_runs("$1,234.56") == "$one,two hundred and thirty-four.fifty-six"
    assert spell_out_digit_runs("no digits") == "no digits"


def test_zh_rules_and_split() -> None:
    assert zh_post_rules("a b 中 文. x - y，，") == "a b中文。 x，y。"  # blanks go before "." -> "。"
    assert zh_post_rules("好，", final=False) == "好，"
    assert split_paragraph("一。二", "zh", len) == ["一。二。"]


# ------------------------------------------------------------------------------- wetext


def test_wetext_loads_offline_from_the_wheel() -> None:
    engine = normalize.load_wetext()
    assert engine is not None, "wetext should load from its bundled FSTs"
    assert engine.normalize("3.5 kg", "en") == "three point five kilograms"
    assert engine.normalize("温度是-3℃", "zh") == "温度是负三摄氏度"
    assert engine.normalize("$%", "en") == "$%"  # wetext's runtime asserts on this one: left as is


def test_wetext_en_defects_are_repaired() -> None:
    assert fix_wetext_en('"a"', '\\"a\\"') == '"a"'
    assert fix_wetext_en("$1,250", "thousand two hundred and fifty dollars") == (
        "one thousand two hundred and fifty dollars"
    )
    assert fix_wetext_en("a thousand", "a thousand") == "a thousand"  # no digit: left alone
    assert fix_wetext_en("3000", "three thousand") == "three thousand"


def test_without_wetext_the_rules_are_used_and_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(self: object) -> None:
        raise ImportError("no FSTs")

    monkeypatch.setattr(normalize, "_WETEXT", None)
    monkeypatch.setattr(normalize, "_WETEXT_FAILURE", None)
    monkeypatch.setattr(normalize.WetextEngine, "__init__", broken)
    with caplog.at_level(logging.WARNING):
        auto = create_text_normalizer("auto", len)
    assert auto.mode == "rules"
    assert "wetext is unavailable" in caplog.text
    with pytest.raises(RuntimeError, match="cannot load"):
        create_text_normalizer("wetext", len)


# ------------------------------------------------------------------------------- markdown and emoji


@pytest.mark.parametrize(
    ("text", "spoken"),
    [
        ("**Bold** and *em* and __strong__ and _em_.", "Bold and em and strong and em."),
        ("## Title\nBody text.", "Title. Body text."),
        ("Steps:\n1. Open it.\n2) Close it.", "Steps: Open it. Close it."),
        ("List:\n- one\n* two\n+ three", "List: one. two. three"),
        ("> quoted", "quoted"),
        ("Run `ls -l` now.", "Run ls -l now."),
        ("See [the docs](https://x.org/a_(b)) now.", "See the docs now."),
        ("An ![image](a.png) here.", "An image here."),
        ("Before\n---\nAfter", "Before. After"),
        ("| a | b |\n|---|---|", "a b."),
        ("```sh\necho hi\n```\nDone.", "echo hi. Done."),
        ("Great job 🎉!", "Great job!"),
        ("Thumbs 👍🏽 up", "Thumbs up"),
        ("Family 👨\u200d👩\u200d👧 time", "Family time"),
        ("snake_case_name stays", "snake_case_name stays"),
        ("2 * 3 is six", "two * three is six"),
        ("[breath] Hi <strong>there</strong> [laughter]", "[breath] Hi <strong>there</strong> [laughter]"),
        ("Hi<|endoftext|><|im_end|>", "Hi"),
        ("[not a tag] ok", "not a tag ok"),
        ("太棒了🎉🎉", "太棒了"),
        ("## 总结\n一切顺利", "总结。一切顺利"),
    ],
)
def test_markdown_and_emoji_are_not_spoken(text: str, spoken: str) -> None:
    assert clean(text) == spoken


def test_without_markdown_only_tags_are_special() -> None:
    assert normalize_whole(RULES, "**a** [breath]", markdown=False) == "**a** [breath]"


def test_chinese_trailing_commas_end_the_text() -> None:
    dn = DeltaNormalizer(RULES)
    out = dn.push("温度是85%，，")
    assert not out.endswith("，")
    assert out + dn.finish() == "温度是85%。"


# ------------------------------------------------------------------------------- offsets and caps


def test_offsets_follow_words_and_skip_markup() -> None:
    dn = DeltaNormalizer(RULES)
    assert dn.push("**Hi** there frie") == "Hi there"
    # "**Hi** there" is accounted for; " frie" is held.
    assert dn.input_end == len("**Hi** there")
    assert dn.finish() == " frie"
    assert dn.input_end == len("**Hi** there frie")


def test_a_rewritten_number_advances_the_offset_only_at_its_end() -> None:
    dn = DeltaNormalizer(RULES)
    text = "I have 25 cats and"
    out = dn.push(text)
    assert out == "I have twenty-five cats"
    assert dn.input_end == len("I have 25 cats")


def test_push_after_finish_is_an_error() -> None:
    dn = DeltaNormalizer(RULES)
    dn.push("a")
    dn.finish()
    assert dn.finish() == ""
    with pytest.raises(RuntimeError):
        dn.push("b")


def test_hold_back_is_bounded_on_unpunctuated_text() -> None:
    dn = DeltaNormalizer(RULES, default_lang="zh")
    worst = 0
    for ch in "天" * 500:
        dn.push(ch)
        worst = max(worst, dn.held_chars)
    assert worst <= MAX_UNIT_CHARS + MAX_RUN_CHARS  # a unit being built + a run without boundary
    dn = DeltaNormalizer(RULES)
    worst = 0
    for ch in "1 " * 200:
        dn.push(ch)
        worst = max(worst, dn.held_chars)
    assert worst <= 2 * MAX_RUN_CHARS


# ------------------------------------------------------------------------------- byte fallback


def test_byte_tokenizer_stays_in_the_vocabulary() -> None:
    tok = ByteTokenizer(text_vocab_size=100)
    ids = tok.encode("héllo [breath] 中文 <|endofprompt|>")
    assert ids and all(0 <= i < 100 for i in ids)
    assert tok.special_token_ids["[breath]"] in ids
    assert sorted(tok.special_token_ids.values()) == list(range(100 - len(ALL_SPECIAL_TOKENS), 100))
    big = ByteTokenizer(text_vocab_size=1024)
    assert big.decode(big.encode("héllo [breath]")) == "héllo "
    with pytest.raises(ValueError):
        ByteTokenizer(text_vocab_size=10)
