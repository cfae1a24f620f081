"""Engine benchmark: N concurrent streams (default 16) with a real-time listener each.

Runs the in-process engine (no WebRTC) at the full CosyVoice2-0.5B shape with random weights
(eager PyTorch unless ``--cuda-graphs``), with the LLM forced to a fixed number of speech tokens per text token so that
every stream speaks a realistic length. Each stream gets its text at once (or at ``--text-rate``
characters per second, like an LLM streaming), and a simulated listener plays its audio in real
time from the first chunk on, acknowledging what it has played (so back-pressure follows the
listener) and counting underruns: times the playout buffer ran dry before the utterance ended.

Reports engine TTFA (first text delta in -> first PCM chunk out) p50/p95/p99, underruns, stall
time, audio seconds and per-stream real-time factor; writes JSON to ``$OUT/engine16.json`` when
``OUT`` is set (and to ``--json`` when given).

    python scripts/bench_engine_16.py                               # random:0.5b on CUDA
    python scripts/bench_engine_16.py --model random:tiny --device cpu --threads 1 --streams 2 --chars 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from voice_out.bench.engine_bench import TEXT, text_of
from voice_out.bench.listener import Listener, percentile, run_stream
from voice_out.config import Config, EngineConfig, ModelConfig, ServerConfig
from voice_out.engine.build import BuildOptions
from voice_out.engine.engine import Engine
from voice_out.engine.scheduler import ForcedTokens


async def bench(engine: Engine, args: argparse.Namespace, stats_out: dict[str, float]) -> list[Listener]:
    async with engine:
        # one untimed stream first: the first use of each kernel is not a benchmark
        await run_stream(engine, -1, args.text[:40], 0.0, 0.0)
        before = engine.stats()
        tasks = [
            asyncio.create_task(run_stream(engine, i, args.text, args.text_rate, i * args.stagger_ms / 1000))
            for i in range(args.streams)
        ]
        listeners = list(await asyncio.gather(*tasks))
        after = engine.stats()
        steps = after.steps - before.steps
        busy = after.busy_s - before.busy_s
        stats_out.update(
            steps=steps,
            busy_s=busy,
            mean_step_ms=1000 * busy / max(steps, 1),
            llm_rows_per_step=(after.llm_rows - before.llm_rows) / max(steps, 1),
            chunks=after.chunks - before.chunks,
        )
        return listeners


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:0.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--chars", type=int, default=len(TEXT), help="characters of text per stream")
    p.add_argument("--text-rate", type=float, default=0.0, help="chars/s of text arrival; 0 = all at once")
    p.add_argument("--stagger-ms", type=float, default=0.0, help="delay between stream starts")
    p.add_argument("--tokens-per-text-token", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=150, help="speech tokens of the synthetic voice prompt")
    p.add_argument("--max-ahead-s", type=float, default=4.0)
    p.add_argument(
        "--max-chunks-per-step", type=int, default=None, help="default: the plan's (8 with CUDA graphs, else 4)"
    )
    p.add_argument("--kv-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="the LLM step and token2wav from CUDA graphs, 8 chunks per step (default: eager, engine.eager)",
    )
    p.add_argument("--fast-first", type=int, default=0, help="tokens of a fast first chunk (0: upstream's 25)")
    p.add_argument("--json", help="also write the JSON result here")
    args = p.parse_args(argv)
    args.text = text_of(args.chars)
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    cfg = Config(
        model=ModelConfig(model=args.model, device=args.device, dtype=args.dtype),
        engine=EngineConfig(
            max_streams=max(args.streams, 1),
            max_ahead_s=args.max_ahead_s,
            max_text_chars=100_000,
            eager=not args.cuda_graphs,
            fast_first_tokens=args.fast_first,
        ),
        server=ServerConfig(voices_dir=str(Path(os.devnull) / "none")),
    )
    t0 = time.perf_counter()
    engine = Engine.load(
        cfg,
        options=BuildOptions(
            forced=ForcedTokens(args.tokens_per_text_token),
            kv_len=args.kv_len,
            noise_prompt_tokens=args.prompt_tokens,
            text_normalizer="none",
            pins={} if args.max_chunks_per_step is None else {"max_chunks_per_step": args.max_chunks_per_step},
        ),
    )
    engine_stats: dict[str, float] = {}
    listeners = asyncio.run(bench(engine, args, engine_stats))
    wall = time.perf_counter() - t0

    ttfa = [1000 * t for lis in listeners if (t := lis.ttfa_s) is not None]
    audio_s = [lis.audio_s for lis in listeners]
    lag = [
        (lis.chunk_times[-1] - lis.t_first - lis.stall_s) - lis.audio_s
        for lis in listeners
        if lis.t_first is not None and lis.chunk_times
    ] or [float("nan")]
    result = {
        "benchmark": "engine16",
        "command": " ".join([sys.executable, *sys.argv]),
        "model": args.model,
        "device": str(args.device),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() and "cuda" in args.device else None,
        "dtype": args.dtype,
        "eager": not args.cuda_graphs,
        "torch": torch.__version__,
        "host": platform.node(),
        "streams": args.streams,
        "chars_per_stream": args.chars,
        "text_rate_chars_per_s": args.text_rate,
        "tokens_per_text_token": args.tokens_per_text_token,
        "prompt_tokens": args.prompt_tokens,
        "max_ahead_s": args.max_ahead_s,
        "fast_first_tokens": args.fast_first,
        "ttfa_ms": {
            "p50": percentile(ttfa, 0.5),
            "p95": percentile(ttfa, 0.95),
            "p99": percentile(ttfa, 0.99),
            "max": max(ttfa, default=float("nan")),
        },
        "underruns_total": sum(lis.underruns for lis in listeners),
        "streams_with_underruns": sum(1 for lis in listeners if lis.underruns),
        "stall_s": {
            "p50": percentile([lis.stall_s for lis in listeners], 0.5),
            "max": max(lis.stall_s for lis in listeners),
        },
        "audio_s_per_stream": statistics.mean(audio_s),
        # > 0: the last chunk came after the listener had played everything before it (a stall)
        "last_chunk_lag_s_max": max(lag),
        "engine": engine_stats,
        "peak_gpu_mem_gib": (torch.cuda.max_memory_allocated() / 2**30) if torch.cuda.is_available() else None,
        "wall_s": wall,
        "per_stream": [
            {k: v for k, v in asdict(lis).items() if k != "chunk_times"}
            | {"ttfa_ms": 1000 * lis.ttfa_s if lis.ttfa_s is not None else None, "chunks": len(lis.chunk_times)}
            for lis in listeners
        ],
    }
    text = json.dumps(result, indent=2)
    keys = ("streams", "ttfa_ms", "underruns_total", "streams_with_underruns", "audio_s_per_stream", "engine", "wall_s")
    summary = {k: result[k] for k in keys}
    print(json.dumps(summary, indent=2))
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "engine16.json").write_text(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
