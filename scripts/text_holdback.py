"""Measure the streaming normalizer's hold-back over a corpus of LLM replies.

Hold-back after a push = input chars pushed but not yet accounted for by released text
(``DeltaNormalizer.held_chars``). What is released after a prefix depends only on the prefix,
so feeding each text char by char visits every possible delta boundary: its maximum is the
worst case over all ways of cutting that text.

    python scripts/text_holdback.py [--corpus tests/data/llm_corpus.txt] [--top 8]

Needs no model directory (hold-back does not depend on the tokenizer).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from voice_out.text.normalize import TextNormalizer, create_text_normalizer, load_wetext
from voice_out.text.stream import DeltaNormalizer

REPO = Path(__file__).resolve().parent.parent


def load_corpus(path: Path) -> list[str]:
    lines = path.read_text(encoding="utf-8").split("\n")
    return [line.replace("\\n", "\n") for line in lines if line.strip() and not line.startswith(";;")]


def worst_held(normalizer: TextNormalizer, text: str) -> int:
    dn = DeltaNormalizer(normalizer)
    worst = 0
    for ch in text:
        dn.push(ch)
        worst = max(worst, dn.held_chars)
    dn.finish()
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=REPO / "tests" / "data" / "llm_corpus.txt")
    parser.add_argument("--top", type=int, default=8, help="list the texts with the largest hold-back")
    args = parser.parse_args(argv)

    texts = load_corpus(args.corpus)
    modes = ["rules"] + (["wetext"] if load_wetext() is not None else [])
    print(f"corpus: {len(texts)} texts, {sum(len(t) for t in texts)} chars")
    for mode in modes:
        normalizer = create_text_normalizer(mode, len)  # type: ignore[arg-type]
        held = [(worst_held(normalizer, t), t) for t in texts]
        values = sorted(h for h, _ in held)
        plain = [h for h, t in held if "](" not in t and "```" not in t]
        print(
            f"\n[{mode}] worst {values[-1]} chars; worst without links/code fences {max(plain)}; "
            f"per-text worst: median {statistics.median(values):.0f}, "
            f"p95 {values[int(0.95 * (len(values) - 1))]}"
        )
        for h, t in sorted(held, key=lambda x: -x[0])[: args.top]:
            print(f"  {h:3d}  {t!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
