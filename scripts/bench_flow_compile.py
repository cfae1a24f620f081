"""First-chunk flow latency: eager vs CUDA graph vs torch.compile'd estimator + CUDA graph.

Random full-size CosyVoice2-0.5B flow on the GPU (bf16), one first chunk of ``--prompt`` +
25 + 3 tokens through the re-run path (what the engine's fast path replays). Prints median /
p95 ms of each variant and the compile time. GPU diagnostic for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from voice_out.bench.timing import time_ms  # noqa: E402
from voice_out.fast.graphs import GraphedFn  # noqa: E402
from voice_out.model.checkpoint import random_flow  # noqa: E402

FULL = Path(__file__).resolve().parent.parent / "configs" / "models" / "cosyvoice2-0.5b"


def timed(fn, iters: int = 20) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    ms = sorted(time_ms(fn, "cuda", warmup=3, iters=iters))
    return statistics.median(ms), ms[int(0.95 * (len(ms) - 1))]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompt", type=int, default=75)
    p.add_argument("--mode", default="default", help="torch.compile mode for the estimator")
    args = p.parse_args()
    flow = random_flow(FULL, "cuda", torch.bfloat16)
    n = args.prompt + 28
    tok = torch.randint(0, 6561, (1, n), device="cuda", dtype=torch.int32)
    pt, t = tok[:, : args.prompt].contiguous(), tok[:, args.prompt :].contiguous()
    feat = torch.randn(1, 2 * args.prompt, 80, device="cuda") - 5
    emb = torch.randn(1, 192, device="cuda")

    def first() -> torch.Tensor:
        return flow.inference(t, pt, feat, emb, streaming=True, finalize=False)

    with torch.inference_mode():
        print(f"prompt {args.prompt} tokens, first chunk 28 tokens, re-run over {n} tokens")
        print("eager          median {:.2f} ms  p95 {:.2f} ms".format(*timed(first)))
        g = GraphedFn(lambda: first(), name="first")
        print("graph          median {:.2f} ms  p95 {:.2f} ms".format(*timed(lambda: g("k"))))
        t0 = time.perf_counter()
        flow.estimator.forward = torch.compile(flow.estimator.forward, dynamic=False, mode=args.mode)  # type: ignore[method-assign]
        first()
        torch.cuda.synchronize()
        print(f"compile estimator: {time.perf_counter() - t0:.1f} s")
        print("compiled eager median {:.2f} ms  p95 {:.2f} ms".format(*timed(first)))
        g2 = GraphedFn(lambda: first(), name="first2")
        print("compiled graph median {:.2f} ms  p95 {:.2f} ms".format(*timed(lambda: g2("k"))))


if __name__ == "__main__":
    main()
