"""Time one batched LLM decode step and a prompt prefill with random full-size weights.

Builds the CosyVoice2-0.5B speech LM (dims from configs/models/cosyvoice2-0.5b) with random
weights directly on the device and reports:

* ms per eager ``decode_step`` at each batch size (every stream already holding
  ``--prompt-len`` positions), for slots given as an index tensor (``gather``: K/V gathered)
  and for packed slots 0..B-1 (``packed``), and for packed slots plus the head and batched RAS
  sampling (``packed+head+ras``: the whole LLM part of one engine step, uniforms pre-drawn);
* on CUDA, the same step as the engine runs it: ``GraphedLLM.decode_sample`` replayed from its
  CUDA graph (``graphed+head+ras``; ``--compile`` compiles it first), and the same with the
  Triton decode kernels where they can run (``graphed+head+ras+fused``); with ``--kernels``
  the number of CUDA kernels of one eager step of each (torch profiler);
* on CUDA with the fused kernels, a step where one stream takes a text group of
  ``--group-rows`` rows: as a run of rows in the one decode step (the engine's way), and as a
  prefill of its own with its own sampling beside the other rows' decode step (the old way);
* ms per ``prefill`` of a ``--prompt-len`` row prompt into one slot, eager and (CUDA) graphed.

Median and p95 over ``--iters`` timed runs after ``--warmup`` runs; CUDA events on a GPU,
``perf_counter`` on the CPU. With ``OUT`` set the results also go to ``$OUT/llm_step.json``.

    python scripts/bench_llm_step.py                        # GPU, bf16, batches 1 8 32
    python scripts/bench_llm_step.py --device cpu --tiny    # smoke test on a CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from voice_out.bench.timing import save_out, time_ms  # noqa: E402
from voice_out.fast.kernels import decode as decode_kernels  # noqa: E402
from voice_out.fast.kernels.launch import dependent_launch_available  # noqa: E402
from voice_out.fast.llm_step import GraphedLLM, pack_decode_rows  # noqa: E402
from voice_out.model.checkpoint import random_llm  # noqa: E402
from voice_out.model.llm import KVCache, SpeechLM  # noqa: E402
from voice_out.model.sampling import NO_TOKEN, SamplingParams, counter_uniforms, new_history, ras_sample_batch  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: Steps launched back to back by the chained timing of ``bench_graphed`` (a first chunk's 29).
CHAIN = 29


@dataclass(frozen=True)
class StepVariant:
    """Which fast paths a timed decode step takes: the Triton decode kernels (``fused``), the
    fused linears too (``linear``), launched programmatically dependent (``pdl``)."""

    fused: bool = False
    linear: bool = False
    pdl: bool = False

    @property
    def tag(self) -> str:
        """The variant's suffix in the result keys, e.g. ``+fused+linear``."""
        return "".join(f"+{n}" for n, on in (("fused", self.fused), ("linear", self.linear), ("pdl", self.pdl)) if on)

    def options(self) -> dict[str, bool]:
        """Its ``GraphedLLM`` options."""
        return {"fused": self.fused, "fused_linear": self.linear, "dependent_launch": self.pdl}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--tiny", action="store_true", help="tiny dims (configs/models/tiny) instead of 0.5B")
    p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=200, help="positions per stream before timing (and prefill)")
    p.add_argument("--max-len", type=int, default=4096, help="KV-cache positions per slot (the engine's kv_len)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="torch.compile the graphed decode step")
    p.add_argument("--kernels", action="store_true", help="also count the CUDA kernels of one eager step (profiler)")
    p.add_argument("--group-rows", type=int, default=5, help="rows of the text group step (0: skip it)")
    p.add_argument(
        "--linear-sweep",
        action="store_true",
        help="time the fused linears (decode_kernels.norm_linear, linear_residual) over tile choices instead",
    )
    p.add_argument("--sweep-kinds", default="norm,gated,residual,split", help="LINEAR_TILES kinds to sweep")
    return p.parse_args(argv)


def summary(ms: list[float]) -> dict[str, float]:
    ordered = sorted(ms)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"median_ms": statistics.median(ordered), "p95_ms": p95, "n": len(ordered)}


def bench_decode(
    lm: SpeechLM,
    batch: int,
    packed: bool,
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    with_sampling: bool = False,
) -> dict[str, float]:
    cache = KVCache.allocate(lm.dims, batch, args.max_len, device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    prompt = torch.randn(args.prompt_len, lm.dims.hidden_size, generator=gen, device=device, dtype=dtype)
    for s in range(batch):
        lm.prefill(cache, s, prompt, start_pos=0)
    slots = None if packed else torch.arange(batch, device=device).flip(0)
    tokens = torch.randint(0, lm.dims.speech_token_size, (batch,), generator=gen, device=device)
    embeds = lm.embed_speech(tokens)
    base = cache.lengths.clone()
    params = SamplingParams()
    history = new_history(batch, params, device)
    uniforms = torch.rand(batch, 2, generator=gen, device=device)

    def step() -> None:
        # Rewind so every timed step attends over prompt_len + 1 positions and never overflows.
        cache.lengths.copy_(base)
        hidden = lm.decode_step(cache, slots, embeds)
        if with_sampling:
            ras_sample_batch(lm.logprobs(hidden), history, uniforms, params)

    return summary(time_ms(step, device, args.warmup, args.iters))


def decode_rows(lm: SpeechLM, batch: int, params: SamplingParams, gen: torch.Generator) -> np.ndarray:
    """Packed decode rows (``pack_decode_rows``) of random speech tokens, empty windows."""
    tokens = torch.randint(0, lm.dims.speech_token_size, (batch,), generator=gen, device=gen.device).tolist()
    uniforms = counter_uniforms(range(batch), [0] * batch)
    return pack_decode_rows(list(range(batch)), tokens, [False] * batch, uniforms, [[]] * batch, params.win_size)


def step_llm(
    lm: SpeechLM, batch: int, args: argparse.Namespace, device: torch.device, dtype: torch.dtype, **options: Any
) -> GraphedLLM:
    """A ``GraphedLLM`` of one decode bucket of ``batch`` rows over a cache of ``batch`` slots
    and the scratch slot, default sampling; ``options`` go to ``GraphedLLM``."""
    cache = KVCache.allocate(lm.dims, batch + 1, args.max_len, device=device, dtype=dtype)
    return GraphedLLM(lm, cache, SamplingParams(), decode_buckets=(batch,), prefill_buckets=(), **options)


def prefilled_rows(
    lm: SpeechLM,
    llm: GraphedLLM,
    batch: int,
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    decode: int | None = None,
) -> tuple[np.ndarray, torch.Tensor]:
    """Slots 0 .. ``batch`` - 1 of ``llm``'s cache prefilled with one seeded ``--prompt-len``
    prompt (after any capture: a capture resets the scratch slot only); returns the packed
    decode rows of the first ``decode`` slots (None: all ``batch``) and the slot lengths to
    rewind to before each timed step."""
    gen = torch.Generator(device=device).manual_seed(args.seed)
    prompt = torch.randn(args.prompt_len, lm.dims.hidden_size, generator=gen, device=device, dtype=dtype)
    for s in range(batch):
        lm.prefill(llm.cache, s, prompt, start_pos=0)
    rows = decode_rows(lm, batch if decode is None else decode, llm.sampling, gen)
    return rows, llm.cache.lengths.clone()


def bench_graphed(
    lm: SpeechLM,
    batch: int,
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    variant: StepVariant,
) -> dict[str, float]:
    """CUDA-graphed decode + head + RAS (the engine's fast path) at ``batch`` rows, with the
    fast paths of ``variant``. The median and p95 of a step whose ids the host waits for, and
    ``chain_ms``: per step of :data:`CHAIN` steps launched back to back (as the engine launches
    fed steps before it has seen their input ids)."""
    fast = step_llm(lm, batch, args, device, dtype, compile=args.compile, **variant.options())
    t0 = time.perf_counter()
    fast.capture_all()
    took = time.perf_counter() - t0
    print(
        f"  capture (compile={args.compile}, fused={fast.fused}, linear={fast.fused_linear}, pdl={fast.pdl}) "
        f"batch {batch}: {took:.1f} s"
    )
    cache = fast.cache
    rows, base = prefilled_rows(lm, fast, batch, args, device, dtype)

    def step() -> None:
        cache.lengths.copy_(base)
        # the graph of the smallest attention window that holds prompt_len + 1 positions; the
        # host packs and copies the rows and waits for the tokens, as the engine does
        fast.decode_sample(rows, kv_len=args.prompt_len + 1)

    def chain() -> None:
        for _ in range(CHAIN):
            cache.lengths.copy_(base)
            fast.decode_launch(rows, kv_len=args.prompt_len + 1)

    out = summary(time_ms(step, device, args.warmup, args.iters))
    out["chain_ms"] = statistics.median(time_ms(chain, device, 2, 10)) / CHAIN
    return out


def count_kernels(
    lm: SpeechLM,
    batch: int,
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    variant: StepVariant,
) -> dict[str, Any]:
    """CUDA kernels launched by one eager decode step + head + RAS, exactly as the graph
    captures it (``GraphedLLM`` with graphs off and ``variant``'s fast paths: packed rows, the
    scratch slot), their summed GPU time and the 12 costliest names."""
    from torch.profiler import ProfilerActivity, profile

    eager = step_llm(lm, batch, args, device, dtype, enabled=False, **variant.options())
    cache = eager.cache
    rows, base = prefilled_rows(lm, eager, batch, args, device, dtype)
    window = -(-(args.prompt_len + 1) // 256) * 256

    def step() -> None:
        cache.lengths.copy_(base)
        eager.decode_sample(rows, kv_len=window)

    step()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:90], []).append(e.device_time_total / 1e3)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]
    total = sum(sum(v) for v in by_name.values())
    print(f"  kernels batch {batch} window {window} {variant}: {len(kernels)} kernels, {total:.3f} ms of GPU time")
    for name, times in top:
        print(f"    {len(times):5d} x  {sum(times):7.3f} ms  {name}")
    return {
        "window": window,
        "n_kernels": len(kernels),
        "gpu_ms": round(total, 3),
        "top": [{"name": n, "count": len(t), "ms": round(sum(t), 3)} for n, t in top],
    }


def bench_text_group(
    lm: SpeechLM, batch: int, args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> dict[str, dict[str, float]]:
    """A step where one of ``batch`` streams takes a 5-row text group (``--group-rows``) and the
    others decode, two ways: ``batched``, the group as a run of rows in the one graphed decode
    step (what the engine does); ``prefilled``, the group as a graphed prefill of its own plus
    the head and sampler for its last row, then the decode step of the other rows (before)."""
    n_rows = args.group_rows
    cache = KVCache.allocate(lm.dims, batch + 1, args.max_len, device=device, dtype=dtype)
    params = SamplingParams()
    buckets = sorted({max(1, batch - 1), batch - 1 + n_rows})
    fast = GraphedLLM(lm, cache, params, decode_buckets=buckets, prefill_buckets=(16,))
    fast.capture_all()
    g = batch - 1  # the slot taking the group; the others decode
    decode, base = prefilled_rows(lm, fast, batch, args, device, dtype, decode=g)
    text = [i % lm.dims.text_vocab_size for i in range(n_rows)]
    u = counter_uniforms([g] * n_rows, [0] * n_rows)
    group = pack_decode_rows(
        [g] * n_rows,
        text,
        [False] * n_rows,
        u,
        [[]] * n_rows,
        params.win_size,
        offsets=range(n_rows),
        kinds=[1] * n_rows,
    )
    mixed = np.concatenate([decode, group])
    embeds = lm.embed_rows([(1, t) for t in text])
    history = torch.full((1, params.win_size), NO_TOKEN, device=device, dtype=torch.long)
    uniforms = torch.full((1, 2), 0.5, device=device)
    no_mask = torch.zeros(1, dtype=torch.bool, device=device)

    def batched() -> None:
        cache.lengths.copy_(base)
        fast.decode_sample(mixed, kv_len=args.prompt_len + n_rows)

    def prefilled() -> None:
        cache.lengths.copy_(base)
        h = fast.prefill(g, embeds, args.prompt_len).clone()
        picked = decode_kernels.ras_sample(lm.logits(h[None]), history, uniforms, no_mask, lm.dims.eos_token, params)
        if batch > 1:
            fast.decode_sample(decode, kv_len=args.prompt_len + 1)
        picked.tolist()

    return {
        "batched": summary(time_ms(batched, device, args.warmup, args.iters)),
        "prefilled": summary(time_ms(prefilled, device, args.warmup, args.iters)),
    }


def bench_graphed_prefill(
    lm: SpeechLM, args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> dict[str, float]:
    cache = KVCache.allocate(lm.dims, 2, args.max_len, device=device, dtype=dtype)
    fast = GraphedLLM(lm, cache, SamplingParams(), decode_buckets=(), prefill_buckets=(args.prompt_len,))
    fast.capture_all()
    rows = [(0, 0)] + [(1, i % lm.dims.text_vocab_size) for i in range(args.prompt_len - 2)] + [(0, 1)]
    embeds = lm.embed_rows(rows)
    return summary(time_ms(lambda: fast.prefill(0, embeds, 0), device, args.warmup, args.iters))


def bench_prefill(lm: SpeechLM, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    cache = KVCache.allocate(lm.dims, 1, args.max_len, device=device, dtype=dtype)
    rows = [(0, 0)] + [(1, i % lm.dims.text_vocab_size) for i in range(args.prompt_len - 2)] + [(0, 1)]
    embeds = lm.embed_rows(rows)
    return summary(time_ms(lambda: lm.prefill(cache, 0, embeds, start_pos=0), device, args.warmup, args.iters))


def sweep_linears(lm: SpeechLM, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Each fused linear of the decode step as the step runs it: one launch per layer, each
    with that layer's weights (so nothing stays in L2), all layers' launches captured in one
    CUDA graph; the median replay / layers, per tile choice (``decode_kernels.LINEAR_TILES``)
    and row count, against the library's GEMMs (with a norm and ``silu_mul`` where the fused
    kernel has them inside)."""
    out: dict[str, Any] = {}
    for rows in (int(b) for b in args.batches.split(",")):
        if rows <= decode_kernels.LINEAR_MAX_ROWS:
            out.update(_sweep_rows(lm, rows, device, args.sweep_kinds.split(",")))
    return out


def _sweep_rows(lm: SpeechLM, rows: int, device: torch.device, kinds: list[str]) -> dict[str, Any]:
    dims = lm.dims
    eps = dims.rms_norm_eps
    x = torch.randn(rows, dims.hidden_size, device=device).to(lm.llm_decoder.weight.dtype)
    act = torch.randn(rows, dims.intermediate_size, device=device).to(x.dtype)
    workspaces = {sp: decode_kernels.SplitWorkspace.allocate(device, dims.hidden_size, sp) for sp in (2, 4, 8)}
    lt = decode_kernels.LinearTiles
    compute = ((4, 3), (4, 5), (8, 4))  # (num_warps, num_stages)
    choices = {
        "norm": [lt(n, k, w, st) for n in (16, 32) for k in (128, 256, 512) for w, st in compute],
        "gated": [lt(n, k, w, st) for n in (32, 64, 128) for k in (64, 128, 256) for w, st in compute],
        "residual": [lt(n, k, w, st) for n in (16, 32) for k in (128, 256, 512) for w, st in compute],
        "split": [lt(n, k, w, st, sp) for n in (16, 32) for k in (128, 256) for w, st in compute for sp in (2, 4, 8)],
    }
    fused: dict[str, Any] = {
        "norm": lambda L: decode_kernels.norm_linear(
            x, L.attn.wqkv.weight, L.input_layernorm.weight, eps, L.attn.wqkv.bias
        ),
        "gated": lambda L: decode_kernels.norm_linear(
            x, L.mlp.w13.weight, L.post_attention_layernorm.weight, eps, gated=True
        ),
        "residual_wo": lambda L: decode_kernels.linear_residual(x, L.attn.wo.weight, x),
        "split_w2": lambda L: decode_kernels.linear_residual(
            act, L.mlp.w2.weight, x, workspace=workspaces[decode_kernels.LINEAR_TILES["split"].splits]
        ),
    }
    library: dict[str, Any] = {
        "norm": lambda L: L.attn.wqkv(L.input_layernorm(x)),
        "gated": lambda L: decode_kernels.silu_mul(L.mlp.w13(L.post_attention_layernorm(x))),
        "residual_wo": lambda L: torch.addmm(x, x, L.attn.wo.weight.t()),
        "split_w2": lambda L: torch.addmm(x, act, L.mlp.w2.weight.t()),
    }
    out: dict[str, Any] = {}
    for name, fn in fused.items():
        kind = name.split("_")[0]
        if kind not in kinds:
            continue
        saved = decode_kernels.LINEAR_TILES[kind]
        timings: list[tuple[float, decode_kernels.LinearTiles | None]] = []
        kind_choices = choices[kind]
        for tiles in [None, *kind_choices, *([saved] if saved not in kind_choices else [])]:
            if tiles is not None:
                decode_kernels.LINEAR_TILES[kind] = tiles
            us = _graphed_us(lm, library[name] if tiles is None else fn, device)
            if us is None:
                print(f"  {name} {tiles}: does not run")
                continue
            timings.append((us, tiles))
        decode_kernels.LINEAR_TILES[kind] = saved
        base = timings[0][0]
        ranked = sorted(timings[1:], key=lambda t: t[0])
        print(f"linear {name:12s} rows {rows:3d}: library {base:6.2f} us; best fused:")
        for us, tiles in ranked[:4]:
            print(f"    {us:6.2f} us  {tiles}")
        default = next(us for us, t in timings[1:] if t == saved)
        print(f"    default {saved}: {default:6.2f} us")
        out[f"rows{rows}_{name}"] = {
            "library_us": round(base, 2),
            "default_us": round(default, 2),
            "best": [{"us": round(us, 2), "tiles": str(t)} for us, t in ranked[:4]],
        }
    return out


def _graphed_us(lm: SpeechLM, fn: Any, device: torch.device) -> float | None:
    """Median us per call of ``fn(layer)`` over every layer, replayed from one CUDA graph."""
    layers = list(lm.layers)
    try:
        for layer in layers:  # compile and warm up outside the capture
            fn(layer)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for layer in layers:
                fn(layer)
    except Exception:  # a tile set that does not compile or fit
        return None
    return statistics.median(time_ms(graph.replay, device, 5, 30)) * 1e3 / len(layers)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    dims_dir = REPO_ROOT / "configs" / "models" / ("tiny" if args.tiny else "cosyvoice2-0.5b")
    t0 = time.perf_counter()
    lm = random_llm(dims_dir, device, dtype, seed=args.seed)
    build_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in lm.parameters())
    result: dict[str, Any] = {
        "model": dims_dir.name,
        "params": n_params,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "mode": "eager and CUDA graphs" if device.type == "cuda" else "eager",
        "prompt_len": args.prompt_len,
        "cache_max_len": args.max_len,
        "build_s": round(build_s, 2),
        "decode": {},
    }
    print(f"{dims_dir.name}: {n_params / 1e6:.1f} M parameters, {args.dtype}, {result['device']}, {result['mode']}")
    with torch.inference_mode():
        if args.linear_sweep:
            result["linear_sweep"] = sweep_linears(lm, args, device)
            save_out("llm_step.json", result)
            return result
        for batch in (int(b) for b in args.batches.split(",")):
            for name, packed, sampling in (
                ("gather", False, False),
                ("packed", True, False),
                ("packed+head+ras", True, True),
            ):
                r = bench_decode(lm, batch, packed, args, device, dtype, with_sampling=sampling)
                result["decode"][f"b{batch}_{name}"] = r
                print(
                    f"decode step  batch {batch:3d} {name:16s}"
                    f"  median {r['median_ms']:7.3f} ms  p95 {r['p95_ms']:7.3f} ms"
                )
            linear = batch <= decode_kernels.LINEAR_MAX_ROWS
            variants = [StepVariant()]
            if GraphedLLM.can_fuse(lm, SamplingParams()):
                variants.append(StepVariant(fused=True))
                if linear:
                    variants.append(StepVariant(fused=True, linear=True))
                if dependent_launch_available(device):
                    variants.append(StepVariant(fused=True, linear=linear, pdl=True))
            for variant in variants if device.type == "cuda" else []:
                tag = variant.tag
                if args.kernels:
                    result["decode"][f"b{batch}_kernels{tag}"] = count_kernels(lm, batch, args, device, dtype, variant)
                r = bench_graphed(lm, batch, args, device, dtype, variant)
                result["decode"][f"b{batch}_graphed+head+ras{tag}"] = r
                print(
                    f"decode step  batch {batch:3d} {'GRAPHED+head+ras' + tag:28s}"
                    f"  median {r['median_ms']:7.3f} ms  p95 {r['p95_ms']:7.3f} ms"
                    f"  chained {r['chain_ms']:7.3f} ms a step"
                )
            if device.type == "cuda" and GraphedLLM.can_fuse(lm, SamplingParams()) and args.group_rows:
                for how, r in bench_text_group(lm, batch, args, device, dtype).items():
                    result["decode"][f"b{batch}_text_group_{how}"] = r
                    print(
                        f"text group   batch {batch:3d} {how:22s}"
                        f"  median {r['median_ms']:7.3f} ms  p95 {r['p95_ms']:7.3f} ms"
                    )
        result["prefill"] = bench_prefill(lm, args, device, dtype)
        if device.type == "cuda":
            result["prefill_graphed"] = bench_graphed_prefill(lm, args, device, dtype)
            g = result["prefill_graphed"]
            print(f"prefill {args.prompt_len} rows GRAPHED: median {g['median_ms']:7.3f} ms  p95 {g['p95_ms']:7.3f} ms")
        print(
            f"prefill {args.prompt_len} rows:  median {result['prefill']['median_ms']:7.3f} ms"
            f"  p95 {result['prefill']['p95_ms']:7.3f} ms"
        )
    save_out("llm_step.json", result)
    return result


if __name__ == "__main__":
    main()
