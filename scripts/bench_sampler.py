"""Time the fused RAS sampler (``decode_kernels.ras_sample``) alone: one program per row
against a row's vocabulary ranked in slices (``SampleWorkspace``), by rows, splits and warps,
with the repetition fallback taken or not. Every variant's ids are checked against the one
program per row first. CUDA graph replays (``voice_out.bench.timing.graph_us``).

    python scripts/bench_sampler.py [--rows 1,16,64] [--variants 1x8,4x4,8x4,8x2,16x2]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from voice_out.bench.timing import graph_us, save_out  # noqa: E402
from voice_out.fast.kernels import decode as decode_kernels  # noqa: E402
from voice_out.model.sampling import NO_TOKEN, SamplingParams  # noqa: E402

VOCAB, EOS = 6564, 6561


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--head", action="store_true", help="each call runs the head GEMM first, as the decode step does")
    p.add_argument("--pdl", action="store_true", help="launch the sampler programmatically dependent, as the step does")
    p.add_argument("--variants", default="1x8,4x4,8x4,8x2,16x2,16x4", help="SPLITSxWARPS, comma separated")
    args = p.parse_args()
    dev = torch.device("cuda")
    params = SamplingParams()
    gen = torch.Generator(device=dev).manual_seed(0)
    variants = [tuple(int(v) for v in item.split("x")) for item in args.variants.split(",")]
    res: dict[str, float] = {}
    for rows in (int(r) for r in args.rows.split(",")):
        logits = (torch.randn(rows, VOCAB, generator=gen, device=dev) * 3).to(torch.bfloat16)
        likely = logits.float().topk(4, dim=1).indices
        uniforms = torch.rand(rows, 2, generator=gen, device=dev)
        masked = torch.zeros(rows, dtype=torch.bool, device=dev)
        ws = decode_kernels.SampleWorkspace.allocate(dev, rows, params.top_k, splits=max(s for s, _ in variants))
        for fallback in (False, True):
            # a window of the likely tokens makes the first draw repeat: the fallback runs
            history = (
                likely.repeat(1, 3)[:, : params.win_size]
                if fallback
                else torch.full((rows, params.win_size), NO_TOKEN, device=dev)
            )
            ref = None
            hidden = torch.randn(rows, 896, generator=gen, device=dev).to(torch.bfloat16)
            head_w = (torch.randn(6592, 896, generator=gen, device=dev) * 0.1).to(torch.bfloat16)
            head_b = torch.zeros(6592, device=dev, dtype=torch.bfloat16)

            def head(logits: torch.Tensor = logits) -> torch.Tensor:
                if not args.head:
                    return logits
                return torch.nn.functional.linear(hidden, head_w, head_b)[:, :VOCAB]  # noqa: B023

            for splits, warps in variants:
                sample = functools.partial(
                    decode_kernels.ras_sample,
                    history=history,
                    uniforms=uniforms,
                    eos_masked=masked,
                    eos_token=EOS,
                    params=params,
                    workspace=ws if splits > 1 else None,
                    splits=splits,
                    num_warps=warps,
                    pdl=args.pdl,
                )

                def call(sample: functools.partial[torch.Tensor] = sample) -> torch.Tensor:
                    return sample(head())

                ids = call().tolist()
                ref = ids if ref is None else ref
                assert ids == ref, f"{splits}x{warps} drew other ids"
                us = graph_us(call, calls=20, reps=20)
                key = f"rows={rows} fallback={int(fallback)} {splits}x{warps}"
                res[key] = round(us, 2)
                print(f"{key:32s} {us:7.2f} us")
    save_out("sampler_us.json", {"device": torch.cuda.get_device_name(), **res})


if __name__ == "__main__":
    main()
