"""Find which op breaks CUDA-graph capture of the token2wav pieces (GPU diagnostic)."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from voice_out.model.checkpoint import random_flow, random_hift  # noqa: E402

TINY = Path(__file__).resolve().parent.parent / "configs" / "models" / "tiny"


def try_capture(name: str, fn) -> None:  # type: ignore[no-untyped-def]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            fn()
        print(f"{name}: captured OK")
    except Exception:
        tb = traceback.format_exc().splitlines()
        print(f"{name}: FAILED")
        print("\n".join(line for line in tb if "voice_out" in line or "Error" in line or "torch/" in line)[:3000])


def main() -> None:
    flow = random_flow(TINY, "cuda")
    hift = random_hift(TINY, "cuda")
    p = 50
    tok = torch.randint(0, 6561, (1, p + 28), device="cuda", dtype=torch.int32)
    pt, t = tok[:, :p].contiguous(), tok[:, p:].contiguous()
    feat = torch.randn(1, 2 * p, 80, device="cuda")
    emb = torch.randn(1, 192, device="cuda")
    with torch.inference_mode():
        try_capture("hift", lambda: hift(torch.randn(1, 80, 50, device="cuda"), None, None))
        try_capture("flow", lambda: flow.inference(t, pt, feat, emb, streaming=True, finalize=False))


if __name__ == "__main__":
    main()
