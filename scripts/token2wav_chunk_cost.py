"""Time every token2wav chunk of one long utterance: cost against chunk index.

Builds the flow and HiFT with seeded random weights (dims from ``configs/models/tiny`` by
default, or ``configs/models/cosyvoice2-0.5b`` with ``--full``), streams ``--tokens`` speech
tokens through ``Token2WavStream`` as if the LLM had produced them all, and reports per chunk:
tokens given to the flow, new tokens, samples, flow ms, vocoder ms (HiFT + cross-fade), total
ms, the host's part (until the call returns, before the GPU is waited for) and the chunk's
real-time factor (time / audio duration). ``--flow-path both`` runs the
re-run path (upstream: cost grows with the utterance) and the state path one after the other.
``state`` is the engine's fast path: the first chunk from the voice's prompt prefix, the later
ones on a state slot (``FastToken2Wav.use_state_slots``; with
``--graphs``, replayed from the graphs start-up would capture); ``--kernels`` runs the flow's
fused kernels, as the engine does on a GPU. A warm-up stream runs first (``--warmup-tokens``),
so kernels are built.

    python scripts/token2wav_chunk_cost.py                                  # tiny, CPU
    python scripts/token2wav_chunk_cost.py --full --device cuda --tokens 1500
    python scripts/token2wav_chunk_cost.py --full --device cuda --flow-dtype bfloat16 --kernels \
        --graphs --flow-path rerun,state --prompt-tokens 150 --tokens 1320

With ``OUT`` set the results also go to ``$OUT/token2wav_chunks.json``.
"""

from __future__ import annotations

import argparse
import functools
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from voice_out.bench.timing import save_out  # noqa: E402
from voice_out.engine.chunk_schedule import MAX_HOP_TOKENS, HopPolicy  # noqa: E402
from voice_out.engine.runner import stream_shapes  # noqa: E402
from voice_out.fast import fused_flow  # noqa: E402
from voice_out.fast.flow_step import FastToken2Wav  # noqa: E402
from voice_out.model.checkpoint import random_flow, random_hift  # noqa: E402
from voice_out.model.vocoder import HiFT  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SAMPLE_RATE = 24000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="full-size CosyVoice2-0.5B dims instead of tiny")
    p.add_argument("--config", type=Path, default=None, help="a cosyvoice2.yaml (overrides --full)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--flow-dtype", default="float32", choices=sorted(DTYPES), help="HiFT always runs in float32")
    p.add_argument("--flow-path", default="both", help="rerun, state, a comma list, or both (rerun,state)")
    p.add_argument("--kernels", action="store_true", help="the flow's fused kernels (CUDA, bf16/fp16)")
    p.add_argument("--tokens", type=int, default=500, help="speech tokens of the utterance (25 per second)")
    p.add_argument("--prompt-tokens", type=int, default=87, help="flow prompt tokens (the voice)")
    p.add_argument("--warmup-tokens", type=int, default=160)
    p.add_argument(
        "--graphs",
        action="store_true",
        help="CUDA graphs (first-chunk flow, vocoder); per-chunk flow/vocoder split not measured then",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-hop", type=int, default=MAX_HOP_TOKENS, help="largest hop in tokens (a multiple of 25)")
    return p.parse_args(argv)


class TimedFlow:
    """Times the flow's re-run calls (``inference``), synchronized, into ``elapsed_ms``:
    installed on the flow object itself (``install``), so that token2wav still sees the real
    ``Flow`` and takes its prefix and state paths (untimed)."""

    def __init__(self, flow: Any, device: torch.device) -> None:
        self.flow = flow
        self.device = device
        self.elapsed_ms = 0.0
        self.installed = False

    def install(self) -> None:
        for name in ("inference",):
            setattr(self.flow, name, functools.partial(self._timed, getattr(self.flow, name)))
        self.installed = True

    def _timed(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        sync(self.device)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sync(self.device)
        self.elapsed_ms += (time.perf_counter() - t0) * 1e3
        return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_utterance(
    t2w: FastToken2Wav,
    timed: TimedFlow,
    voice: tuple[Tensor, Tensor, Tensor],
    tokens: Tensor,
    path: str,
    prefix: Any,
    hops: HopPolicy,
) -> list[dict[str, Any]]:
    device = t2w.device
    first_prefix = prefix if path == "state" else None
    stream = t2w.open_stream(*voice, first_prefix=first_prefix)
    rows: list[dict[str, Any]] = []
    n = int(tokens.shape[1])
    schedule = hops.schedule(stream.prompt_tokens)  # as the engine's scheduler keeps it
    while (plan := schedule.ready(n, llm_finished=True)) is not None:
        timed.elapsed_ms = 0.0
        sync(device)
        t0 = time.perf_counter()
        pcm = stream.run_chunk(plan, tokens)
        schedule.commit(plan)
        host_ms = (time.perf_counter() - t0) * 1e3  # until the call returns: launches, host work
        sync(device)
        total_ms = (time.perf_counter() - t0) * 1e3
        audio_s = pcm.shape[0] / SAMPLE_RATE
        rows.append(
            {
                "chunk": plan.index,
                "token_offset": plan.token_offset,
                "flow_tokens": plan.token_len,
                "new_tokens": plan.hop_tokens,
                "final": plan.finalize,
                "samples": int(pcm.shape[0]),
                # with graphs the flow is not timed apart: both are None, not 0 and the total
                "flow_ms": round(timed.elapsed_ms, 3) if timed.installed else None,
                "vocoder_ms": round(total_ms - timed.elapsed_ms, 3) if timed.installed else None,
                "host_ms": round(host_ms, 3),
                "total_ms": round(total_ms, 3),
                "rtf": round(total_ms / 1e3 / audio_s, 4) if audio_s > 0 else None,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    config = args.config or REPO_ROOT / "configs" / "models" / ("cosyvoice2-0.5b" if args.full else "tiny")
    config_file = config / "cosyvoice2.yaml" if config.is_dir() else config
    torch.manual_seed(args.seed)
    flow = random_flow(config_file, device=device, dtype=DTYPES[args.flow_dtype], seed=args.seed)
    if args.kernels and not fused_flow.use_kernels(flow.fuse_(), True):
        raise SystemExit("--kernels: the fused flow kernels do not run here (CUDA and bf16/fp16 needed)")
    hift: HiFT = random_hift(config_file, device=device, seed=args.seed)
    timed = TimedFlow(flow, device)
    t2w = FastToken2Wav(flow, hift, device=device)
    if args.graphs:  # the timing syncs, which a graph capture cannot contain
        t2w.use_cuda_graphs(True)
    else:
        timed.install()

    gen = torch.Generator().manual_seed(args.seed)
    n_mels = hift.dims.in_channels
    voice = (
        torch.randint(0, 6561, (1, args.prompt_tokens), generator=gen).to(device),
        (torch.randn(1, 2 * args.prompt_tokens, n_mels, generator=gen) - 5.0).to(device),
        torch.randn(1, 192, generator=gen).to(device),
    )
    tokens = torch.randint(0, 6561, (1, args.tokens), generator=gen).to(device)
    hops = HopPolicy(max_hop=args.max_hop)
    paths = ["rerun", "state"] if args.flow_path == "both" else args.flow_path.split(",")
    if not set(paths) <= {"rerun", "state"}:
        raise SystemExit(f"--flow-path: rerun, state or both, got {args.flow_path!r}")
    prefix = None
    if "state" in paths:
        with torch.no_grad():
            prefix = t2w.prepare_prefix(*voice)
        if prefix is None:
            raise SystemExit("--flow-path state: the prompt is too short for a prefix")
        t2w.use_state_slots(1, args.prompt_tokens + args.tokens)
    if args.graphs:  # what start-up captures, so no chunk below captures (or runs eagerly)
        for path in paths:
            shapes = stream_shapes(hops, args.prompt_tokens)
            t2w.capture_stream_shapes(*voice, args.tokens, shapes, first_prefix=prefix if path == "state" else None)

    result: dict[str, Any] = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "config": str(config_file.relative_to(REPO_ROOT) if config_file.is_relative_to(REPO_ROOT) else config_file),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "flow_dtype": args.flow_dtype,
        "cuda_graphs": bool(args.graphs),
        "tokens": args.tokens,
        "prompt_tokens": args.prompt_tokens,
        "max_hop": args.max_hop,
        "runs": {},
    }
    for path in paths:
        if args.warmup_tokens > 0:
            run_utterance(t2w, timed, voice, tokens[:, : args.warmup_tokens], path, prefix, hops)
        rows = run_utterance(t2w, timed, voice, tokens, path, prefix, hops)
        result["runs"][path] = rows
        print(f"\nflow path: {path}  ({args.tokens} tokens = {args.tokens / 25:.1f} s, prompt {args.prompt_tokens})")
        print(
            f"{'chunk':>5} {'flow_tok':>8} {'new':>5} {'final':>5} {'flow_ms':>9} {'voc_ms':>8} {'host':>7}"
            f" {'total':>9} {'rtf':>7}"
        )
        for r in rows:
            rtf = f"{r['rtf']:.3f}" if r["rtf"] is not None else "-"
            flow_ms, voc_ms = (f"{r[k]:.1f}" if r[k] is not None else "-" for k in ("flow_ms", "vocoder_ms"))
            print(
                f"{r['chunk']:>5} {r['flow_tokens']:>8} {r['new_tokens']:>5} {r['final']!s:>5} "
                f"{flow_ms:>9} {voc_ms:>8} {r['host_ms']:>7.1f} {r['total_ms']:>9.1f} {rtf:>7}"
            )
        total = sum(r["total_ms"] for r in rows)
        print(
            f"total {total:.1f} ms for {args.tokens / 25:.1f} s of audio (RTF {total / 1e3 / (args.tokens / 25):.3f})"
        )

    save_out("token2wav_chunks.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
