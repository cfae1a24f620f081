"""Where the engine's start-up time goes: the phases of ``Engine.load`` + ``start`` with timers,
and the Triton kernels compiled on the way.

Loads the engine as ``voice-out bench`` does (random full-size weights by default, KV slots for
``--streams``), with a timer on each start-up phase: weights, the runner (KV cache), the
warm-up (one of every kind of work), the LLM's decode/prefill graph captures and the token2wav
graph captures of the default voice (those of its first chunks before ready, the rest after,
timed apart). Triton compiles its kernels on first use and keeps them in
its cache (``TRITON_CACHE_DIR``, else ``~/.triton/cache``); the script counts the kernels the
start compiled (cache entries added) per kernel name. Run it once with an empty cache dir and
once again with the same one to see what the compiles cost:

    TRITON_CACHE_DIR=$(mktemp -d) python scripts/profile_startup.py
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from voice_out.bench import engine_bench as eb  # noqa: E402
from voice_out.bench.timing import save_out, time_method  # noqa: E402
from voice_out.config import load_config, parse_overrides  # noqa: E402
from voice_out.engine import build  # noqa: E402
from voice_out.engine.runner import Runner  # noqa: E402
from voice_out.fast.flow_step import FastToken2Wav  # noqa: E402
from voice_out.fast.graphs import GraphedFn  # noqa: E402
from voice_out.fast.kernels import precompile as kernels  # noqa: E402
from voice_out.fast.llm_step import GraphedLLM  # noqa: E402
from voice_out.model import checkpoint  # noqa: E402

TIMES: dict[str, list[float]] = {}


def triton_cache_dir() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def cached_kernels(root: Path) -> collections.Counter[str]:
    """Compiled kernels in Triton's cache, per kernel name (one ``<name>.json`` per entry)."""
    names: collections.Counter[str] = collections.Counter()
    if root.is_dir():
        for meta in root.glob("*/*.json"):
            if not meta.name.startswith("__grp__"):
                names[meta.stem] += 1
    return names


def cache_entries(root: Path) -> set[Path]:
    """The metadata files of Triton's cache (one per compiled kernel)."""
    return {m for m in root.glob("*/*.json") if not m.name.startswith("__grp__")} if root.is_dir() else set()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:0.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--streams", type=int, default=48, help="KV slots, as a bench run whose largest count is this")
    p.add_argument("--gpu-memory", help="the engine's memory budget (GiB or a share of the card)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    args = p.parse_args()
    t_start = time.perf_counter()
    sets = [f"model.model={args.model}", f"model.device={args.device}", *args.set]
    if args.gpu_memory:
        sets.append(f"engine.gpu_memory={args.gpu_memory}")
    cfg = load_config(None, environ={}, overrides=parse_overrides(sets))
    opts = eb.EngineBenchOptions(streams=(args.streams,))
    cfg = eb.bench_config(cfg, opts)
    timer = functools.partial(time_method, times=TIMES, sync=True)
    for fn in ("random_llm", "random_flow", "random_hift", "load_llm", "load_flow", "load_hift"):
        original = getattr(checkpoint, fn)

        def timed(*a: object, _fn: object = original, _name: str = fn, **k: object) -> object:
            t0 = time.perf_counter()
            out = _fn(*a, **k)  # type: ignore[operator]
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            TIMES.setdefault(f"weights: {_name}", []).append((time.perf_counter() - t0) * 1e3)
            return out

        setattr(checkpoint, fn, timed)
    timer(build.RunnerRecipe, "_models", "runner: the models on the device (weights, fused paths)")
    timer(build, "enforce_budget", "runner: the memory cap")
    timer(Runner, "__init__", "runner: KV cache and graph buckets")
    timer(kernels, "dry_run_launches", "Triton kernels ahead: dry runs")
    timer(kernels, "compile_ahead", "Triton kernels ahead: compiles (with the LLM's and vocoder's part meanwhile)")
    ahead_fn = kernels.compile_ahead
    ahead_snapshot: dict[str, set[Path]] = {}

    def compile_ahead_snapshot(*a: object, **k: object) -> int:
        n: int = ahead_fn(*a, **k)  # type: ignore[arg-type]
        ahead_snapshot["entries"] = cache_entries(triton_cache_dir())
        return n

    setattr(kernels, "compile_ahead", compile_ahead_snapshot)  # noqa: B010 - the module's function, wrapped
    timer(Runner, "warmup_llm", "  meanwhile: the LLM's warm-up + graph capture")
    timer(GraphedLLM, "capture_all", "    of which: LLM graph capture")
    timer(Runner, "background_step", "deferred captures (beside the compiles, then after ready)")
    timer(Runner, "warmup_token2wav", "warm-up: a token2wav stream")
    timer(Runner, "prepare_first_prefix", "prompt prefixes")
    timer(Runner, "prepare_state_slots", "flow-state slots")
    timer(Runner, "precapture", "token2wav graph capture (default voice)")
    timer(FastToken2Wav, "_capture_state_slots", "  of which: the flow-state slots' graphs")
    timer(FastToken2Wav, "capture_stream_shapes", "  of which: capture_stream_shapes")
    timer(GraphedFn, "_capture", lambda self, *_: f"    graph captures: {self.name}")
    # inside each capture: cudaGraphInstantiate (the rest is running the function on the host)
    timer(torch.cuda.CUDAGraph, "capture_end", "      of which, all captures: capture_end (instantiate)", sync=False)
    root = triton_cache_dir()
    before = cached_kernels(root)
    entries_before = cache_entries(root)
    engine = eb.load_engine(cfg, opts)
    t_loaded = time.perf_counter()
    engine.start(timeout=600)
    t_ready = time.perf_counter()
    after_ready = eb.wait_warm(engine, 600)
    engine.close()
    compiled = cached_kernels(root) - before
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{args.model} on {dev}, {args.streams} KV slots, Triton cache {root}")
    built, started = 1e3 * (t_loaded - t_start), 1e3 * (t_ready - t_loaded)
    print(f"  script start -> engine built {built:9.1f} ms; start() {started:9.1f} ms")
    print(f"  ready -> start-up work after ready done {1e3 * after_ready:9.1f} ms")
    for label, v in TIMES.items():
        print(f"  {sum(v):9.1f} ms  ({len(v)} calls)  {label}")
    print(f"  Triton kernels compiled: {sum(compiled.values())}")
    for name, n in sorted(compiled.items(), key=lambda kv: -kv[1]):
        print(f"    {n:4d}  {name}")
    if "entries" in ahead_snapshot:
        late = sorted(cache_entries(root) - ahead_snapshot["entries"] - entries_before)
        # compiled on first use, after the kernels-ahead step: what its dry runs missed
        print(f"  compiled after the kernels-ahead step: {len(late)}")
        for meta in late:
            print(f"    {meta.stem}: {meta.read_text()[:2000]}")
    save_out(
        "startup_profile.json",
        {
            "device": dev,
            "build_s": t_loaded - t_start,
            "start_s": t_ready - t_loaded,
            "after_ready_s": after_ready,
            "phases_ms": {k: sum(v) for k, v in TIMES.items()},
            "triton_compiled": dict(compiled),
        },
    )


if __name__ == "__main__":
    main()
