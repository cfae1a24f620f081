"""What the Ray Serve path adds to each PCM chunk, against the in-process engine.

Starts a local Ray instance, deploys one replica of the engine (``random:tiny`` on the CPU by
default, forced tokens so every utterance has the same length), and plays the same utterances
(whole text, one delta, then ``end_text``) one after another, alternating between
``RayEngine`` and an in-process engine built the same way (so both see the same load). Reports:

* per chunk, the replica handing the chunk to Ray (the point where an in-process consumer
  holds it) -> the front holding it: what Ray adds per chunk (one host: both read the same
  monotonic clock). Median, p95 over every chunk;
* per utterance, ``open_stream`` -> first chunk, both ways: the difference is what the Ray path
  adds to first audio (routing, the call, the first chunk's transit).

    python scripts/ray_chunk_latency.py --utterances 24
    python scripts/ray_chunk_latency.py --model random:0.5b --device cuda --num-gpus 1

Writes JSON to ``--json`` when given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from voice_out.config import Config, EngineConfig, ModelConfig, ServerConfig  # noqa: E402
from voice_out.engine.build import BuildOptions  # noqa: E402
from voice_out.engine.scheduler import ForcedTokens  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs away."


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def play(open_stream: Any, n: int) -> tuple[list[float], list[float], list[Any]]:
    """``n`` utterances one after another: (first-chunk times s, chunk counts, streams)."""
    firsts: list[float] = []
    streams: list[Any] = []
    counts: list[float] = []
    for i in range(n):
        t0 = time.monotonic()
        s = open_stream(None, seed=1000 + i)
        s.push_text(TEXT)
        s.end_text()
        first = None
        k = 0
        async for _ in s:
            if first is None:
                first = time.monotonic() - t0
            k += 1
        assert first is not None
        firsts.append(first)
        counts.append(k)
        streams.append(s)
    return firsts, counts, streams


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the Ray workers

    import ray
    import torch
    from ray import serve

    from voice_out.engine.engine import Engine
    from voice_out.engine.ray_serve.client import RayEngine
    from voice_out.engine.ray_serve.replica import DeploymentOptions, speech_app

    torch.set_num_threads(args.threads)
    voices = tempfile.mkdtemp(prefix="voices-")
    cfg = Config(
        model=ModelConfig(model=args.model, device=args.device),
        engine=EngineConfig(max_streams=8, seed=1),
        server=ServerConfig(voices_dir=voices, engine="ray"),
    )
    load = BuildOptions(forced=ForcedTokens(3), text_normalizer="none")

    local = Engine.load(cfg, options=load)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        serve.start(proxy_location="Disabled")
        options = DeploymentOptions(app_name="latency", num_replicas=1, num_gpus=args.num_gpus, num_cpus=0)
        handle = serve.run(speech_app(cfg, options, load), name="latency", route_prefix=None)
        async with local, RayEngine(cfg, None, handle=handle) as eng:
            await play(local.open_stream, 2)  # warm
            await play(eng.open_stream, 2)  # warm: the router, the relay
            # alternate, so that both ways see the same load on the machine
            local_first: list[float] = []
            ray_first: list[float] = []
            local_chunks: list[float] = []
            ray_chunks: list[float] = []
            streams: list[Any] = []
            for _ in range(args.utterances):
                f, c, _ = await play(local.open_stream, 1)
                local_first += f
                local_chunks += c
                f, c, s = await play(eng.open_stream, 1)
                ray_first += f
                ray_chunks += c
                streams += s
    finally:
        serve.shutdown()
        ray.shutdown()

    transit = [t for s in streams for t in s.chunk_transit_s]
    result = {
        "model": args.model,
        "device": args.device,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "utterances": args.utterances,
        "chunks": len(transit),
        "chunk_transit_ms": {"p50": 1e3 * statistics.median(transit), "p95": 1e3 * pct(transit, 0.95)},
        "first_chunk_ms": {
            "in_process": {"p50": 1e3 * statistics.median(local_first), "p95": 1e3 * pct(local_first, 0.95)},
            "ray": {"p50": 1e3 * statistics.median(ray_first), "p95": 1e3 * pct(ray_first, 0.95)},
        },
        "chunks_per_utterance": {"in_process": statistics.mean(local_chunks), "ray": statistics.mean(ray_chunks)},
        "command": "python " + " ".join(sys.argv),
    }
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-gpus", type=float, default=0.0)
    ap.add_argument("--utterances", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1, help="torch threads, both ways (default 1)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    result = asyncio.run(measure(args))
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
