"""Time per streaming chunk of the flow: a stream's own state (``state_inputs`` / ``state_core``,
eager) vs upstream-style re-run.

Upstream re-runs the flow over the prompt and every token so far at each chunk, so a chunk
costs more the longer the utterance; the state path runs only the new tokens through the
network. This prints, per chunk index, the wall time of both paths on the same tokens. The
final chunk is upstream's full-attention pass on both (token2wav runs it so): timed once, as
the re-run.

    python scripts/flow_chunk_cost.py                                  # tiny model, CPU
    python scripts/flow_chunk_cost.py --full --device cuda             # random CosyVoice2-0.5B, bf16
    python scripts/flow_chunk_cost.py --full --device cuda --dtype float32

Dims come from a ``cosyvoice2.yaml`` (``--config``, a file or a model directory; default
``configs/models/tiny`` or, with ``--full``, ``configs/models/cosyvoice2-0.5b``); weights are
seeded random. With ``OUT`` set, the results are also written to ``$OUT/flow_chunks.json``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from voice_out.bench.timing import save_out  # noqa: E402
from voice_out.model.checkpoint import random_flow

REPO = Path(__file__).resolve().parent.parent
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def timed(device: torch.device, fn: Any) -> tuple[float, Any]:
    """Milliseconds of ``fn()``: wall time after a sync on CUDA; on the CPU the process's CPU
    time, which other processes sharing the cores do not inflate (run with one thread)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize(device)
        return 1000.0 * (time.perf_counter() - t0), out
    c0 = time.process_time()
    out = fn()
    return 1000.0 * (time.process_time() - c0), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="full-size CosyVoice2-0.5B dims (random weights)")
    ap.add_argument("--config", type=Path, help="cosyvoice2.yaml or a model directory")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--prompt-tokens", type=int, default=150, help="flow prompt length (150 = 6 s)")
    ap.add_argument("--tokens", type=int, help="generated tokens (default 600 on CPU, 1500 on CUDA)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads for torch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-rerun", action="store_true", help="time only the state path")
    ap.add_argument("--repeat", type=int, default=1, help="run the stream N times, keep each chunk's fastest")
    args = ap.parse_args()

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    config = args.config or REPO / "configs" / "models" / ("cosyvoice2-0.5b" if args.full else "tiny")
    n_tokens = args.tokens or (1500 if device.type == "cuda" else 600)
    torch.set_num_threads(args.threads)
    flow = random_flow(config, device=device, dtype=dtype, seed=args.seed)
    d = flow.dims
    gen = torch.Generator().manual_seed(args.seed + 1)
    p = args.prompt_tokens
    token = torch.randint(0, d.vocab_size, (1, n_tokens), generator=gen).to(device)
    prompt_token = torch.randint(0, d.vocab_size, (1, p), generator=gen).to(device)
    prompt_feat = (torch.randn(1, d.token_mel_ratio * p, d.n_mels, generator=gen) - 5.0).to(device)
    embedding = torch.randn(1, d.spk_embed_dim, generator=gen).to(device)
    plan = flow.dims.upstream_plan(p, n_tokens)
    la = d.pre_lookahead

    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        # warm-up (kernels, allocator) on a short stream
        warm = flow.prepare_prompt(prompt_token, prompt_feat, embedding)
        wcache = flow.allocate_stream_cache(p + 200)
        flow.reset_stream_cache(wcache, warm)
        for off, hop, final in plan[:3]:
            if not final:
                flow.state_core(*flow.state_inputs(wcache, token[:, off : off + hop + la]), wcache)
        flow.inference(token[:, :60], prompt_token, prompt_feat, embedding, streaming=True, finalize=False)

        prep_times: list[float] = []
        for rep in range(args.repeat):
            ms, prompt = timed(device, lambda: flow.prepare_prompt(prompt_token, prompt_feat, embedding))
            prep_times.append(ms)
            cache = flow.allocate_stream_cache(p + n_tokens)
            flow.reset_stream_cache(cache, prompt)
            for k, (off, hop, final) in enumerate(plan):
                stop = off + hop + (0 if final else la)
                state_ms = None
                if not final:  # the final chunk is the full-attention re-run on both paths
                    state_ms, _ = timed(
                        device,
                        lambda c=cache, a=off, b=stop: flow.state_core(*flow.state_inputs(c, token[:, a:b]), c),
                    )
                rerun_ms = None
                if not args.no_rerun:
                    rerun_ms, _ = timed(
                        device,
                        lambda b=stop, f=final: flow.inference(
                            token[:, :b], prompt_token, prompt_feat, embedding, streaming=not f, finalize=f
                        ),
                    )
                if rep == 0:
                    rows.append({"chunk": k, "offset": off, "hop": hop, "final": final, "tokens_so_far": stop})
                row = rows[k]
                if state_ms is not None:
                    row["state_ms"] = min(row.get("state_ms", state_ms), state_ms)
                if rerun_ms is not None:
                    row["rerun_ms"] = min(row.get("rerun_ms", rerun_ms), rerun_ms)
        prep_ms = min(prep_times)

    if device.type == "cuda":
        name = f"{torch.cuda.get_device_name(device)}, wall time"
    else:
        name = f"CPU, {args.threads} thread(s), process CPU time"
    print(f"flow chunk cost: {config.name} dims, {name}, {str(dtype).replace('torch.', '')}")
    print(f"prompt {p} tokens (prefix state {prompt.n_prefix} tokens, prepare_prompt {prep_ms:.1f} ms)")
    print(f"stream cache: {cache.nbytes / 2**20:.1f} MiB for {cache.capacity} tokens")
    print("| chunk | tokens so far | hop | state ms | re-run ms | state ms/token | re-run ms/token |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        rerun = r.get("rerun_ms")
        state = r.get("state_ms")
        label = f"{r['chunk']}{' (final)' if r['final'] else ''}"
        cells = [
            label,
            str(r["tokens_so_far"]),
            str(r["hop"]),
            f"{state:.1f}" if state is not None else "-",
            f"{rerun:.1f}" if rerun is not None else "-",
            f"{state / max(r['hop'], 1):.2f}" if state is not None else "-",
            f"{rerun / max(r['hop'], 1):.2f}" if rerun is not None else "-",
        ]
        print("| " + " | ".join(cells) + " |")
    result = {
        "device": name,
        "dtype": str(dtype),
        "config": str(config),
        "prompt_tokens": p,
        "prefix_tokens": prompt.n_prefix,
        "prepare_prompt_ms": prep_ms,
        "repeat": args.repeat,
        "cache_bytes": cache.nbytes,
        "cache_capacity_tokens": cache.capacity,
        "chunks": rows,
    }
    save_out("flow_chunks.json", result)


if __name__ == "__main__":
    main()
