"""Text tokenizers: the Qwen2 byte-level BPE of a model directory, and a byte fallback.

:class:`QwenTokenizer` rebuilds the tokenizer CosyVoice2 uses from the files of
``<model_dir>/CosyVoice-BlankEN`` (``vocab.json``, ``merges.txt``, ``tokenizer_config.json``;
the official folder ships no ``tokenizer.json``) with the ``tokenizers`` library:

* NFC normalizer;
* Qwen2's pre-tokenizer regex (contractions, letter runs with one optional leading
  non-letter, single digits, punctuation runs, whitespace runs), then GPT-2 byte-level mapping;
* BPE by merge rank, no BOS/EOS added;
* the special tokens of ``tokenizer_config.json`` (``<|endoftext|>``, ``<|im_start|>``,
  ``<|im_end|>``) and then CosyVoice2's own list, in its order (:data:`COSYVOICE2_SPECIAL_TOKENS`),
  each matched whole in the raw text before normalization and BPE.

:class:`ByteTokenizer` is for ``random:*`` models, which have no vocabulary files: it maps UTF-8
bytes into the model's text vocabulary. Its ids mean nothing to a trained model; the speech it
leads to is noise, which is all a random model can produce anyway.

Both are pure Python/Rust objects without torch; ``encode`` is safe to call from any thread.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

#: Qwen2's pre-tokenization pattern (digits one by one).
QWEN2_PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: Special tokens registered by CosyVoice2 after the Qwen ones, in registration order (ids follow it).
COSYVOICE2_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|im_start|>",
    "<|im_end|>",
    "<|endofprompt|>",
    "[breath]",
    "<strong>",
    "</strong>",
    "[noise]",
    "[laughter]",
    "[cough]",
    "[clucking]",
    "[accent]",
    "[quick_breath]",
    "<laughter>",
    "</laughter>",
    "[hissing]",
    "[sigh]",
    "[vocalized-noise]",
    "[lipsmack]",
    "[mn]",
)
EOS_TOKEN = "<|endoftext|>"
#: Every special token, in id order (``<|endoftext|>`` first).
ALL_SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, *COSYVOICE2_SPECIAL_TOKENS)

TOKENIZER_SUBDIR = "CosyVoice-BlankEN"


class Tokenizer(Protocol):
    """What the engine needs from a text tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (regular + special); every id is below it."""
        ...

    @property
    def special_token_ids(self) -> dict[str, int]:
        """Special token string -> id."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: no BOS/EOS; special-token strings become their single id."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens skipped."""
        ...


class QwenTokenizer:
    """Qwen2 byte-level BPE plus the CosyVoice2 special tokens (see the module docstring)."""

    def __init__(self, backend: _HFTokenizer, special_token_ids: dict[str, int]) -> None:
        self._backend = backend
        self._special_token_ids = dict(special_token_ids)
        self._vocab_size = int(backend.get_vocab_size(with_added_tokens=True))

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> QwenTokenizer:
        """Build from ``<model_dir>/CosyVoice-BlankEN`` (or from that folder itself)."""
        root = Path(model_dir)
        folder = root / TOKENIZER_SUBDIR if (root / TOKENIZER_SUBDIR).is_dir() else root
        return cls.from_files(folder / "vocab.json", folder / "merges.txt", folder / "tokenizer_config.json")

    @classmethod
    def from_files(cls, vocab_path: Path, merges_path: Path, config_path: Path | None = None) -> QwenTokenizer:
        with open(vocab_path, encoding="utf-8") as f:
            vocab: dict[str, int] = json.load(f)
        merges = _read_merges(merges_path)
        backend = _HFTokenizer(
            models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, fuse_unk=False, byte_fallback=False)
        )
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            ]
        )
        backend.decoder = decoders.ByteLevel()

        # The Qwen specials come with fixed ids in tokenizer_config.json; register them in id order
        # so that the library hands out exactly those ids, then CosyVoice2's list after them.
        config_tokens: list[tuple[int, str]] = []
        if config_path is not None and config_path.is_file():
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
            for key, entry in config.get("added_tokens_decoder", {}).items():
                config_tokens.append((int(key), str(entry["content"])))
        config_tokens.sort()
        expected = {content: idx for idx, content in config_tokens}
        ordered: list[str] = [content for _, content in config_tokens]
        for token in ALL_SPECIAL_TOKENS:
            if token not in ordered:
                ordered.append(token)
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ordered])

        special_ids: dict[str, int] = {}
        for token in ALL_SPECIAL_TOKENS:
            idx = backend.token_to_id(token)
            if idx is None:
                raise ValueError(f"special token {token!r} was not registered")
            special_ids[token] = int(idx)
        for token, idx in expected.items():
            if backend.token_to_id(token) != idx:
                raise ValueError(
                    f"{config_path}: {token!r} should have id {idx} but got {backend.token_to_id(token)} "
                    f"(does vocab.json have {idx} entries?)"
                )
        return cls(backend, special_ids)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def special_token_ids(self) -> dict[str, int]:
        return dict(self._special_token_ids)

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        return list(self._backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=True))


class ByteTokenizer:
    """Noise-only tokenizer for models without vocabulary files (``random:*``).

    Text is NFC-normalized and encoded as UTF-8; byte ``b`` becomes id ``b % n_regular`` where
    ``n_regular = text_vocab_size - len(ALL_SPECIAL_TOKENS)``; the special tokens take the last
    ids of the text vocabulary, in :data:`ALL_SPECIAL_TOKENS` order. Every id is below
    ``text_vocab_size``. Tokenization is per byte, so it is trivially stable under splitting.
    """

    def __init__(self, text_vocab_size: int) -> None:
        n_special = len(ALL_SPECIAL_TOKENS)
        if text_vocab_size < n_special + 2:
            raise ValueError(f"text_vocab_size must be at least {n_special + 2}, got {text_vocab_size}")
        self._vocab_size = text_vocab_size
        self._n_regular = text_vocab_size - n_special
        self._special_token_ids = {t: self._n_regular + i for i, t in enumerate(ALL_SPECIAL_TOKENS)}
        # Longest first, so that no special token is shadowed by a shorter one.
        self._specials_by_length = sorted(ALL_SPECIAL_TOKENS, key=len, reverse=True)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def special_token_ids(self) -> dict[str, int]:
        return dict(self._special_token_ids)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        plain_start = 0
        i = 0
        while i < len(text):
            special = self._special_at(text, i)
            if special is None:
                i += 1
                continue
            ids.extend(self._encode_plain(text[plain_start:i]))
            ids.append(self._special_token_ids[special])
            i += len(special)
            plain_start = i
        ids.extend(self._encode_plain(text[plain_start:]))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(i for i in ids if 0 <= i < min(256, self._n_regular))
        return data.decode("utf-8", errors="replace")

    def _special_at(self, text: str, i: int) -> str | None:
        if text[i] not in "<[":
            return None
        for token in self._specials_by_length:
            if text.startswith(token, i):
                return token
        return None

    def _encode_plain(self, text: str) -> list[int]:
        return [b % self._n_regular for b in unicodedata.normalize("NFC", text).encode("utf-8")]


def load_tokenizer(model_dir: str | Path | None, text_vocab_size: int | None = None) -> Tokenizer:
    """The tokenizer of ``model_dir``; a :class:`ByteTokenizer` when there is no directory.

    ``text_vocab_size`` (the rows of the text embedding) is required for the byte fallback and,
    when given, checked against the BPE tokenizer's ids.
    """
    if model_dir is None:
        if text_vocab_size is None:
            raise ValueError("a model without a tokenizer directory needs text_vocab_size")
        return ByteTokenizer(text_vocab_size)
    tokenizer = QwenTokenizer.from_model_dir(model_dir)
    if text_vocab_size is not None and tokenizer.vocab_size > text_vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but the text embedding only {text_vocab_size} rows")
    return tokenizer


def _read_merges(path: Path) -> list[tuple[str, str]]:
    merges: list[tuple[str, str]] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f):
            line = line.rstrip("\r\n")
            if not line or (line_no == 0 and line.startswith("#version")):
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise ValueError(f"{path}:{line_no + 1}: expected two symbols, got {line!r}")
            merges.append((parts[0], parts[1]))
    return merges
