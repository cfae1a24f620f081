"""Parity of the text frontend with upstream: cases g2 (normalization + split), g3 (tokenizer), g4 (text ids).

The cases were recorded without a TN engine, so the normalizer runs in ``"rules"`` mode here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from voice_out.text.normalize import TextNormalizer, create_text_normalizer
from voice_out.text.tokenizer import ALL_SPECIAL_TOKENS, QwenTokenizer

torch = pytest.importorskip("torch")


def _load(cases_dir: Path, name: str) -> dict[str, Any]:
    case: dict[str, Any] = torch.load(cases_dir / name, weights_only=True)
    return case


@pytest.fixture(scope="module")
def tokenizer(parity_dir: Path) -> QwenTokenizer:
    return QwenTokenizer.from_model_dir(parity_dir)


@pytest.fixture(scope="module")
def rules(tokenizer: QwenTokenizer) -> TextNormalizer:
    return create_text_normalizer("rules", lambda s: len(tokenizer.encode(s)))


def manifest_len(cases_dir: Path, case: str, key: str) -> int:
    """How many entries the directory's ``cases/manifest.json`` records for list ``key`` of
    ``case`` (``"list[23]"`` -> 23): another parity directory in the same format has other
    counts, so no test hard-codes them."""
    described = json.loads((cases_dir / "manifest.json").read_text())[case]["keys"][key]
    m = re.fullmatch(r"list\[(\d+)\]", described)
    assert m is not None, f"manifest.json: {case}.{key} is {described!r}, not list[N]"
    return int(m.group(1))


def _ids(t: Any) -> list[int]:
    return [int(x) for x in t.reshape(-1).tolist()]


# ------------------------------------------------------------------------------------------- g3


def test_g3_ids_and_decoded_text(tokenizer: QwenTokenizer, cases_dir: Path) -> None:
    check_g3_items(tokenizer, cases_dir)


def check_g3_items(tokenizer: QwenTokenizer, cases_dir: Path) -> None:
    case = _load(cases_dir, "g3_tokenizer.pt")
    assert len(case["items"]) == manifest_len(cases_dir, "g3_tokenizer", "items") > 0
    for item in case["items"]:
        ids = tokenizer.encode(item["input"])
        assert ids == list(item["ids"]), item["input"]
        assert tokenizer.decode(ids) == item["decoded"], item["input"]


def test_g3_special_tokens_and_vocab(tokenizer: QwenTokenizer, cases_dir: Path) -> None:
    case = _load(cases_dir, "g3_tokenizer.pt")
    assert tokenizer.special_token_ids == dict(case["special_token_ids"])
    assert tokenizer.vocab_size == case["total_vocab"]
    # Registration order fixes the ids: consecutive, <|endoftext|> first.
    ids = [tokenizer.special_token_ids[t] for t in ALL_SPECIAL_TOKENS]
    assert ids == list(range(ids[0], ids[0] + len(ALL_SPECIAL_TOKENS)))
    assert ids[-1] == tokenizer.vocab_size - 1


def test_g3_every_id_below_the_embedding_rows(tokenizer: QwenTokenizer, parity_dir: Path) -> None:
    import json

    config = json.loads((parity_dir / "CosyVoice-BlankEN" / "config.json").read_text())
    assert tokenizer.vocab_size <= config["vocab_size"]


# ------------------------------------------------------------------------------------------- g2


def test_g2_all_items(rules: TextNormalizer, tokenizer: QwenTokenizer, cases_dir: Path) -> None:
    check_g2_items(rules, tokenizer, cases_dir)


def check_g2_items(rules: TextNormalizer, tokenizer: QwenTokenizer, cases_dir: Path) -> None:
    case = _load(cases_dir, "g2_frontend_text.pt")
    assert len(case["items"]) == manifest_len(cases_dir, "g2_frontend_text", "items") > 0
    for item in case["items"]:
        text = item["input"]
        assert rules.normalize(text) == item["nosplit"], text
        segments = rules.split(text)
        assert segments == list(item["split"]), text
        assert [tokenizer.encode(s) for s in segments] == [list(ids) for ids in item["split_token_ids"]], text


# ------------------------------------------------------------------------------------------- g4


def test_g4_text_parts(rules: TextNormalizer, tokenizer: QwenTokenizer, cases_dir: Path) -> None:
    case = _load(cases_dir, "g4_zero_shot_model_input.pt")
    prompt_normalized = rules.normalize(case["prompt_text_raw"])
    assert prompt_normalized == case["prompt_text_normalized"]
    segments = rules.split(case["tts_text_raw"])
    assert segments == list(case["tts_text_segments"])

    prompt_ids = tokenizer.encode(prompt_normalized)
    assert prompt_ids == _ids(case["prompt_text"])
    assert [len(prompt_ids)] == _ids(case["prompt_text_len"])
    text_ids = tokenizer.encode(segments[0])
    assert text_ids == _ids(case["text"])
    assert [len(text_ids)] == _ids(case["text_len"])


# ------------------------------------------------------------------ another directory, other counts


def test_the_counts_come_from_the_directory(
    rules: TextNormalizer, tokenizer: QwenTokenizer, cases_dir: Path, tmp_path: Path
) -> None:
    """A directory in the same format with fewer cases (and a manifest saying so) passes; one
    whose manifest disagrees with its case files fails."""
    other = tmp_path / "cases"
    other.mkdir()
    manifest = json.loads((cases_dir / "manifest.json").read_text())
    for case, keep in (("g2_frontend_text", 5), ("g3_tokenizer", 4)):
        data = _load(cases_dir, f"{case}.pt")
        assert len(data["items"]) > keep
        data["items"] = data["items"][:keep]
        torch.save(data, other / f"{case}.pt")
        manifest[case]["keys"]["items"] = f"list[{keep}]"
    (other / "manifest.json").write_text(json.dumps(manifest))
    check_g2_items(rules, tokenizer, other)
    check_g3_items(tokenizer, other)

    manifest["g3_tokenizer"]["keys"]["items"] = "list[5]"
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(AssertionError):
        check_g3_items(tokenizer, other)
