"""Where the first-audio time goes: one stream, whole text, timed phase by phase.

Loads the engine like ``voice-out bench`` (random full-size weights on the GPU, forced tokens,
CUDA graphs as configured), wraps the runner's phases with synchronising timers, runs a few
single-stream utterances, and prints for the first chunk of the last one: prefill, decode
steps (count and total), sampling of prefill rows, token2wav first chunk (flow + vocoder), and
the rest (scheduling, queues, host work). The timers synchronise the GPU, so the total is a
little above the unprofiled TTFA; the shares are what matter.

    python scripts/profile_ttfa.py --model random:0.5b --device cuda [--fast-first 12] [--set engine.eager=true]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from voice_out.bench import engine_bench as eb  # noqa: E402
from voice_out.bench.timing import save_out, time_method  # noqa: E402
from voice_out.engine.engine import Engine  # noqa: E402
from voice_out.engine.runner import Runner  # noqa: E402
from voice_out.fast.flow_step import FastToken2Wav  # noqa: E402
from voice_out.fast.llm_step import PendingIds  # noqa: E402

TIMES: dict[str, list[float]] = {}


async def one(engine: Engine, text: str) -> float:
    """One utterance, the whole text at once: ms to its first chunk (the bench's measurement)."""
    TIMES.clear()
    return 1e3 * await eb.first_chunk_s(engine, 0, [text], 0.0, timeout_s=120.0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="random:0.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--fast-first", type=int, default=0)
    p.add_argument("--prompt-tokens", type=int, default=150)
    p.add_argument("--chars", type=int, default=100)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="config override")
    args = p.parse_args()
    opts = eb.EngineBenchOptions(streams=(1,), prompt_tokens=args.prompt_tokens, ttfa_chars=args.chars)
    engine = eb.engine_from_args(args.model, args.device, args.set, opts, fast_first_tokens=args.fast_first)
    text = eb.text_of(args.chars)
    labels: list[tuple[type, str, str]] = [
        (Runner, "execute", "step (all)"),
        (Runner, "_place_prefix", "LLM voice prefix (copy or prefill)"),
        (Runner, "_prefill_rows", "LLM prefill of rows that did not fit a step"),
        (Runner, "_launch", "LLM decode+sample launch (all rows batched; no wait)"),
        (PendingIds, "ids", "LLM: wait for a step's ids"),
        (Runner, "_sample", "sampling of prefilled rows"),
        (FastToken2Wav, "_flow_mel", "token2wav: flow"),
        (FastToken2Wav, "_vocoder", "token2wav: vocoder"),
    ]
    engine.start()
    try:

        async def run() -> dict[str, Any]:
            for _ in range(3):
                await one(engine, text)  # warm: graph capture for this prompt length
            for cls, name, label in labels:
                time_method(cls, name, label, TIMES)
            ttfa = await one(engine, text)
            return {"ttfa_ms_profiled": round(ttfa, 1), **{k: [round(x, 2) for x in v] for k, v in TIMES.items()}}

        res = asyncio.run(run())
    finally:
        engine.close()
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(
        f"TTFA breakdown, {args.model} on {dev}, fast_first={args.fast_first}, prompt {args.prompt_tokens} tokens"
        + (f", {' '.join(args.set)}" if args.set else "")
    )
    print(f"profiled TTFA: {res['ttfa_ms_profiled']} ms (timers synchronise the GPU)")
    accounted = 0.0
    for _, _, label in labels[1:]:
        v = res.get(label, [])
        if v:
            print(f"  {label:32s} {len(v):4d} calls  {sum(v):8.1f} ms")
            accounted += sum(v)
    steps = res.get("step (all)", [])
    print(f"  {'steps':32s} {len(steps):4d}        {sum(steps):8.1f} ms (inside: {accounted:.1f} ms)")
    print(f"  {'outside steps (loop, queues)':32s}             {res['ttfa_ms_profiled'] - sum(steps):8.1f} ms")
    save_out(f"ttfa_profile_ff{args.fast_first}.json", res, indent=1)


if __name__ == "__main__":
    main()
