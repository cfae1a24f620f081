"""Time the fused flow-estimator kernels against the plain-torch blocks, and sweep their tiles.

Full-size CosyVoice2-0.5B estimator shapes (random weights, bf16) at a first streaming chunk:
a CFG batch of 2 x ``--frames`` mel frames (``--batch N``: N chunks, 2N rows, as a batched
re-run). Each timing is a CUDA graph of ``--calls`` back-to-back calls, replayed; the figure is
microseconds per call (median of ``--reps`` replays), so host launch cost is left out, as the
engine's graphs leave it out.

    python scripts/bench_flow_kernels.py                 # blocks: plain vs fused; each kernel
    python scripts/bench_flow_kernels.py --sweep         # + every tile candidate of each kernel

``--sweep`` prints the fastest tiles per kernel for the tier of this row count
(``voice_out.fast.kernels.flow.TILE_TIERS`` holds the chosen ones). GPU only.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from voice_out.bench.timing import graph_us, save_out  # noqa: E402
from voice_out.fast import fused_flow  # noqa: E402
from voice_out.fast.kernels import flow as flow_kernels  # noqa: E402
from voice_out.model.checkpoint import random_flow  # noqa: E402
from voice_out.model.flow_estimator import ResBlock  # noqa: E402

FULL = Path(__file__).resolve().parent.parent / "configs" / "models" / "cosyvoice2-0.5b"

CANDIDATES: dict[str, list[tuple[int, ...]]] = {
    "ln_linear": [(m, n, w) for m, n, w in itertools.product((16, 32, 64, 128), (32, 64, 128), (4, 8))],
    "ln_linear_gelu": [(m, n, w) for m, n, w in itertools.product((16, 32, 64, 128), (32, 64, 128), (4, 8))],
    "linear": [(m, n, k, w) for m, n, k, w in itertools.product((16, 32, 64, 128), (32, 64, 128), (32, 64), (4, 8))],
    "attention": [(m, n, w, s) for m, n, w, s in itertools.product((16, 32, 64), (32, 64), (4, 8), (1, 2, 4, 8))],
    "conv": [(m, 32, 64, w, s) for m, w, s in itertools.product((16, 32), (4, 8), (1, 2, 3, 4, 6))],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=356, help="mel frames per row (prompt 150 + 28 tokens: 356)")
    ap.add_argument("--batch", type=int, default=1, help="chunks per call (a batched re-run: 2 CFG rows each)")
    ap.add_argument(
        "--prefix",
        type=int,
        default=0,
        help="frames of a voice's prompt prefix before the call's (a first chunk from the prefix: attention over"
        " its keys too, convs from its context; prompt 150: --frames 106 --prefix 250)",
    )
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="time every tile candidate of each kernel")
    ap.add_argument("--only", default="", help="comma-separated tile kinds to sweep (default: all), e.g. conv")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    flow = random_flow(FULL, dev, dt, seed=0)
    est = flow.estimator
    b, t, c = 2 * args.batch, args.frames, est.channels
    chunk = est.chunk_frames
    tb = est.transformer_blocks()[0]
    res = cast(ResBlock, est.mid_res[0])  # a ModuleList's item is typed as a Module
    down = est.down_res
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(b, t, c, generator=gen, device=dev).to(dt)
    x_in = torch.randn(b, t, est.in_channels, generator=gen, device=dev).to(dt)
    tproj = torch.randn(b, c, generator=gen, device=dev).to(dt)
    inner = tb.heads * tb.head_dim
    qkv = torch.randn(b * t, 3 * inner, generator=gen, device=dev).to(dt)
    o = torch.randn(b * t, inner, generator=gen, device=dev).to(dt)
    g = torch.randn(b * t, tb.ff_in.out_features, generator=gen, device=dev).to(dt)
    xf = x.view(b * t, c)
    mask = est.prepare(
        torch.zeros(b, flow.dims.n_mels, t, device=dev),
        torch.zeros(b, flow.dims.n_mels, device=dev),
        torch.zeros(b, flow.dims.n_mels, t, device=dev),
        torch.zeros(1, 1, device=dev),
        True,
    ).mask
    zeros = torch.zeros(b, 2, 2 * c, device=dev, dtype=dt)
    padded = torch.cat([zeros[:, :, : est.in_channels], x_in], dim=1)
    scratch = torch.zeros(b, 2 + t, c, device=dev, dtype=dt)
    pad_c = torch.cat([zeros[:, :, :c], x], dim=1)
    n1, n3 = tb.norm1, tb.norm3
    start = args.prefix
    pk = torch.randn(b, tb.heads, max(start, 1), tb.head_dim, generator=gen, device=dev).to(dt)
    pv = torch.randn_like(pk)
    prefix = (pk, pv) if start else None
    ctx = torch.randn(b, c, 2, generator=gen, device=dev).to(dt) if start else None
    # the largest split any candidate takes: the tiers' tables are changed per candidate
    splits = max(cand[4] for cand in CANDIDATES["conv"])
    conv_ws = (
        torch.empty(2 * splits * b * t * c, device=dev),
        torch.zeros(b * t, dtype=torch.int32, device=dev),
    )
    res_in = (x, res.res_conv.weight.view(c, -1), cast(torch.Tensor, res.res_conv.bias))  # it has one
    # likewise the attention's, for the largest split of its candidates
    a_splits = max(cand[3] for cand in CANDIDATES["attention"])
    attn_ws = (
        torch.empty(a_splits * b * t * tb.heads * (tb.head_dim + 2), device=dev),
        torch.zeros(b * t * tb.heads, dtype=torch.int32, device=dev),
    )

    kernels: dict[str, Callable[[], Any]] = {
        "ln_linear": lambda: flow_kernels.ln_linear(xf, n1.weight, n1.bias, n1.eps, tb.qkv_weight),
        "ln_linear_gelu": lambda: flow_kernels.ln_linear(
            xf, n3.weight, n3.bias, n3.eps, tb.ff_in.weight, tb.ff_in.bias, gelu=True
        ),
        "attention": lambda: flow_kernels.attention(
            qkv, b, tb.heads, tb.head_dim, chunk, None, prefix=prefix, start=start, ws=attn_ws
        ),
        "linear_out": lambda: flow_kernels.linear(o, tb.to_out.weight, tb.to_out.bias, residual=xf),
        "linear_ff": lambda: flow_kernels.linear(g, tb.ff_out.weight, tb.ff_out.bias, residual=xf),
        "conv_norm_add": lambda: fused_flow.conv_block(res.block1, x, add=tproj, ctx=ctx, ws=conv_ws),
        "conv_res": lambda: fused_flow.conv_block(res.block2, x, res=res_in, ctx=ctx, ws=conv_ws),
        "conv_plain": lambda: fused_flow.conv(est.down_conv, x, ctx, conv_ws),
    }
    blocks: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
        "TransformerBlock": (lambda: tb(x, mask, None, 0), lambda: fused_flow.transformer_block(tb, x, chunk, None)),
        "ResBlock (C -> C)": (
            lambda: res(pad_c, tproj, None, scratch),
            lambda: fused_flow.res_block(res, x, tproj),
        ),
        "ResBlock (in -> C)": (
            lambda: down(padded, tproj, None, scratch),
            lambda: fused_flow.res_block(down, x_in, tproj),
        ),
    }
    gpu = torch.cuda.get_device_name(dev)
    out: dict[str, Any] = {
        "gpu": gpu,
        "frames": t,
        "prefix": start,
        "rows": b,
        "tiles": dict(flow_kernels.tier(b * t)),
    }
    with torch.inference_mode():
        print(f"{gpu}, bf16, {b} rows (CFG 2 x {args.batch} chunks) x {t} frames; us per call (graph replay)")
        print("| block | plain | fused |\n|---|---|---|")
        for name, (plain, fused) in blocks.items():
            p_us, f_us = graph_us(plain, args.calls, args.reps), graph_us(fused, args.calls, args.reps)
            print(f"| {name} | {p_us:.1f} | {f_us:.1f} |")
            out[name] = {"plain_us": p_us, "fused_us": f_us}
        print("\n| kernel | us |\n|---|---|")
        for name, fn in kernels.items():
            us = graph_us(fn, args.calls, args.reps)
            print(f"| {name} | {us:.1f} |")
            out[name] = us
        if args.sweep:
            groups = {
                "ln_linear": ["ln_linear"],
                "ln_linear_gelu": ["ln_linear_gelu"],
                "linear": ["linear_out", "linear_ff"],
                "attention": ["attention"],
                "conv": ["conv_norm_add", "conv_res", "conv_plain"],
            }
            if args.only:
                groups = {k: v for k, v in groups.items() if k in args.only.split(",")}
            best: dict[str, Any] = {}
            table = flow_kernels.tier(b * t)  # the tier's own table: the kernels read it per call
            for tile, names in groups.items():
                chosen = table[tile]
                scores = []
                for cand in CANDIDATES[tile]:
                    table[tile] = cand
                    try:
                        us = sum(graph_us(kernels[n], args.calls, 5) for n in names)
                    except Exception as e:  # noqa: BLE001 - a tile too large for shared memory
                        print(f"  {tile} {cand}: {type(e).__name__}")
                        continue
                    scores.append((us, cand))
                table[tile] = chosen
                scores.sort()
                print(f"\n{tile} ({' + '.join(names)}), fastest 5 of {len(scores)}:")
                for us, cand in scores[:5]:
                    print(f"  {cand}: {us:.1f} us")
                best[tile] = {"tiles": scores[0][1], "us": scores[0][0]}
            out["sweep_best"] = best
    save_out("flow_kernels.json", out)


if __name__ == "__main__":
    main()
