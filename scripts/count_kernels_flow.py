"""Count the ops (CPU) or CUDA kernels (GPU) of one flow-estimator call and of one ``Flow.solve``.

The first streaming flow chunk is bound by kernel count, not FLOPs or bytes: each of the 10
Euler steps is one estimator call on a CFG batch of 2, thousands of tiny kernels. This script
profiles one call of each (after a warm-up) and prints where the ops go, per module kind, so
the effect of a change to ``voice_out/model/flow_estimator.py`` or ``Flow.solve`` shows:

    python scripts/count_kernels_flow.py                        # tiny dims, CPU: aten ops
    python scripts/count_kernels_flow.py --full                 # full dims on the CPU (ops)
    python scripts/count_kernels_flow.py --full --device cuda   # full dims, bf16: CUDA kernels
    python scripts/count_kernels_flow.py --detail               # + the ops of one block of each kind
    python scripts/count_kernels_flow.py --full --device cuda --time   # + graph-replay time

What is counted: on the CPU, each aten op that does work and is not inside another one that
does (``addmm``, not the bias copy inside it; views, allocations and ops that only dispatch to
others, such as ``linear`` or ``layer_norm``, are left out); on CUDA, every kernel, memcpy and
memset on the device, which is what a CUDA graph of the call replays, and their summed run
time ("device busy"). Counts are attributed to the innermost profiled module
(``TransformerBlock``, ``ResBlock``, ...); "own" is what the estimator runs outside its blocks
(for the standalone call this includes its ``Estimator.prepare``), and the solve's own count is
everything ``Flow.solve`` runs outside the estimator calls (the time grid, ``prepare``, the
Euler updates).

Three calls are measured, all on a first-chunk-sized input (``--prompt`` tokens of prompt +
25 new + 3 look-ahead, as ``flow.inference(..., streaming=True)`` runs it): one estimator call
(streaming mask), one re-run-path ``Flow.solve`` (no cache) and one state-path ``Flow.solve``
(with the stream cache's ``EstimatorState``, the state path). Weights are seeded random
(``voice_out.model.checkpoint.random_flow``); the counts do not depend on their values. With
``OUT`` set, the counts are also written to ``$OUT/flow_kernel_counts.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from voice_out.bench.timing import save_out, time_ms  # noqa: E402
from voice_out.fast import fused_flow  # noqa: E402
from voice_out.fast.graphs import GraphedFn  # noqa: E402
from voice_out.model.checkpoint import random_flow  # noqa: E402
from voice_out.model.flow import Flow  # noqa: E402
from voice_out.model.flow_estimator import CausalBlock, Estimator, ResBlock, TransformerBlock  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SCOPE = "kc::"  # prefix of this script's record_function ranges

#: Aten ops that do no work on the data (views, metadata, allocation, host scalars); never counted.
NO_WORK_OPS = frozenset(
    "aten::" + name
    for name in (
        "view as_strided as_strided_ unfold transpose t permute expand expand_as unsqueeze squeeze select "
        "slice narrow split split_with_sizes unbind chunk _reshape_alias alias detach detach_ view_as "
        "unflatten empty empty_like empty_strided resolve_conj resolve_neg lift_fresh _unsafe_view "
        "numpy_T result_type is_nonzero item _local_scalar_dense lift set_ resize_ diagonal "
        "scalar_tensor _nnpack_available _has_compatible_shallow_copy_type"
    ).split()
)
#: Composite aten ops that only dispatch to other ops; their work is counted in those.
DISPATCH_OPS = frozenset(
    "aten::" + name
    for name in (
        "linear matmul conv1d conv2d convolution _convolution layer_norm scaled_dot_product_attention "
        "to contiguous reshape flatten pad einsum dropout _convolution_mode"
    ).split()
)
KINDS: dict[str, type[nn.Module]] = {
    "TransformerBlock": TransformerBlock,
    "ResBlock": ResBlock,
    "CausalBlock": CausalBlock,
    "Estimator": Estimator,
}


@contextmanager
def scoped_modules(flow: Flow) -> Iterator[None]:
    """Wrap every module of the kinds in ``KINDS`` in a record_function range while active."""
    handles = []
    stack: list[Any] = []

    def pre(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            rf = record_function(SCOPE + name)
            rf.__enter__()
            stack.append(rf)

        return hook

    def post(module: nn.Module, args: Any, out: Any) -> None:
        stack.pop().__exit__(None, None, None)

    for module in flow.modules():
        for name, kind in KINDS.items():
            if type(module) is kind:
                handles.append(module.register_forward_pre_hook(pre(name)))
                handles.append(module.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def scope_of(evt: Any) -> str:
    """The innermost ``kc::`` range enclosing a CPU event (or "solve" when none does)."""
    e = evt
    while e is not None:
        if e.name.startswith(SCOPE):
            return str(e.name[len(SCOPE) :])
        e = e.cpu_parent
    return "solve"


def does_work(evt: Any) -> bool:
    return evt.name.startswith("aten::") and evt.name not in NO_WORK_OPS and evt.name not in DISPATCH_OPS


def is_counted_cpu_op(evt: Any) -> bool:
    """An aten op that does work itself and is not part of an enclosing op that does (the
    outermost working op: ``addmm``, not the bias copy inside it; ``native_layer_norm`` under
    the dispatch-only ``layer_norm``)."""
    if not does_work(evt):
        return False
    e = evt.cpu_parent
    while e is not None:
        if does_work(e):
            return False
        e = e.cpu_parent
    return True


@dataclass
class Counts:
    """One profiled call: ops (or kernels) per scope, op names per scope, module calls per scope,
    and on CUDA the kernels' summed run time."""

    per_scope: Counter[str] = field(default_factory=Counter)
    names: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    calls: Counter[str] = field(default_factory=Counter)
    busy_us: float = 0.0


def count(fn: Callable[[], Any], device: torch.device) -> Counts:
    """Profile ``fn()`` and attribute its ops (CPU) or device events (CUDA) to module scopes."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.events()
    out = Counts()
    for evt in events:
        if evt.name.startswith(SCOPE) and evt.device_type == torch.autograd.DeviceType.CPU:
            out.calls[evt.name[len(SCOPE) :]] += 1
    if device.type != "cuda":
        for evt in events:
            if evt.device_type == torch.autograd.DeviceType.CPU and is_counted_cpu_op(evt):
                scope = scope_of(evt)
                out.per_scope[scope] += 1
                out.names[scope][evt.name] += 1
        return out
    # The profiler hangs each device event (kernel, memcpy, memset) on the CPU op that launched
    # it. This script's record_function ranges also show on the GPU timeline: not kernels.
    device_events = [
        e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(SCOPE)
    ]
    for evt in events:
        if evt.device_type != torch.autograd.DeviceType.CPU:
            continue
        for kernel in evt.kernels:
            scope = scope_of(evt)
            out.per_scope[scope] += 1
            out.names[scope][f"{evt.name} -> {kernel.name[:100]}"] += 1
            out.busy_us += kernel.duration
    if sum(out.per_scope.values()) != len(device_events):
        # Device events the profiler linked to no CPU op: counted, under "unattributed".
        seen = Counter(k.split(" -> ", 1)[1] for c in out.names.values() for k in c.elements())
        for evt in device_events:
            key = evt.name[:100]
            if seen[key] > 0:
                seen[key] -= 1
            else:
                out.per_scope["unattributed"] += 1
                out.names["unattributed"][f"? -> {key}"] += 1
                out.busy_us += evt.device_time_total
    return out


def report(title: str, counts: Counts) -> dict[str, Any]:
    """Print one table: total, and per module kind the ops per call."""
    per_scope, calls, busy_us = counts.per_scope, counts.calls, counts.busy_us
    total = sum(per_scope.values())
    busy = f" (device busy {busy_us / 1000:.2f} ms: the kernels' summed run time)" if busy_us else ""
    print(f"\n{title}: {total} total{busy}")
    print("| scope | calls | ops | ops per call |")
    print("|---|---|---|---|")
    rows: dict[str, Any] = {"total": total, "device_busy_ms": busy_us / 1000}
    for scope in ["solve", *KINDS, "unattributed"]:
        n = per_scope.get(scope, 0)
        c = calls.get(scope, 0) if scope not in ("solve", "unattributed") else 1
        if n == 0 and (c == 0 or scope == "unattributed"):
            continue
        labels = {
            "Estimator": "Estimator (own)",
            "solve": "solve (own, outside the estimator)",
            "unattributed": "device events linked to no CPU op",
        }
        label = labels.get(scope, scope)
        per = n / c if c else float("nan")
        print(f"| {label} | {c} | {n} | {per:.1f} |")
        rows[scope] = {"calls": c, "ops": n, "per_call": per}
    if calls.get("Estimator"):
        per_est = (total - per_scope.get("solve", 0)) / calls["Estimator"]
        print(f"| = per estimator call (blocks included) | | | {per_est:.1f} |")
        rows["per_estimator_call"] = per_est
    return rows


def cuda_ms(fn: Callable[[], Any], iters: int = 30) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA stream (after 3 warm-up calls)."""
    return float(statistics.median(time_ms(fn, "cuda", warmup=3, iters=iters)))


def launch_hidden_ms(fn: Callable[[], Any], iters: int = 20) -> tuple[float, float]:
    """``fn``'s GPU time when it is launched while the GPU still sleeps (so the host's launch
    is over before its first kernel may start), and the host time of the ``fn()`` call itself;
    medians in ms. ``cuda_ms`` starts its clock on an idle GPU, so its figure includes the
    launch's exposure as well: the difference is what a launch on an idle GPU costs."""
    gpu: list[float] = []
    host: list[float] = []
    for _ in range(iters + 3):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(50_000_000)  # ~25 ms at ~2 GHz: longer than any launch
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end))
    return float(statistics.median(gpu[3:])), float(statistics.median(host[3:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="full-size CosyVoice2-0.5B dims (random weights)")
    ap.add_argument("--config", type=Path, help="cosyvoice2.yaml or a model directory")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--prompt", type=int, default=75, help="prompt tokens before the first chunk")
    ap.add_argument("--detail", action="store_true", help="print the ops of one block of each kind")
    ap.add_argument("--time", action="store_true", help="CUDA: also time the re-run solve, eager and graphed")
    ap.add_argument(
        "--fused",
        action="store_true",
        help="CUDA: stateless estimator calls through the fused Triton kernels (the plan's fused_flow); their "
        "kernels are counted under 'Estimator (own)', as they bypass the blocks' forward",
    )
    args = ap.parse_args()

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    config = args.config or REPO / "configs" / "models" / ("cosyvoice2-0.5b" if args.full else "tiny")
    torch.set_num_threads(1)
    flow = random_flow(config, device=device, dtype=dtype, seed=0)
    if args.fused and not fused_flow.use_kernels(flow, True):
        raise SystemExit("--fused: the fused flow kernels cannot run here (need Triton, CUDA, bf16/fp16)")
    d = flow.dims
    gen = torch.Generator().manual_seed(1)
    n_tok = args.prompt + d.enc_chunk + d.pre_lookahead
    token = torch.randint(0, d.vocab_size, (1, n_tok), generator=gen).to(device)
    prompt_token = token[:, : args.prompt]
    prompt_feat = (torch.randn(1, d.token_mel_ratio * args.prompt, d.n_mels, generator=gen) - 5.0).to(device)
    embedding = torch.randn(1, d.spk_embed_dim, generator=gen).to(device)

    with torch.inference_mode():
        spk = flow.speaker(embedding)
        ids = flow.embed_tokens(token)
        h = flow.encoder(ids[:, : -d.pre_lookahead], ids[:, -d.pre_lookahead :], True)
        mu = flow.encoder_proj(h).transpose(1, 2).contiguous()  # [1, n_mels, L]
        n = mu.shape[2]
        cond = flow._cond(prompt_feat, 0, n)
        x2 = torch.randn(2, d.n_mels, n, generator=gen).to(device, dtype)
        est_args = (
            x2,
            torch.cat([mu, torch.zeros_like(mu)]),
            torch.cat([spk, torch.zeros_like(spk)]),
            torch.cat([cond, torch.zeros_like(cond)]),
            torch.full((2,), 0.3, device=device),
            True,
        )
        # The cached path: a prompt prefix state, then the first chunk's solve with the cache.
        prompt = flow.prepare_prompt(prompt_token, prompt_feat, embedding)
        cache = flow.allocate_stream_cache(n_tok + 8)
        flow.reset_stream_cache(cache, prompt)
        f0 = prompt.n_prefix * d.token_mel_ratio

        def estimator_call() -> Any:
            return flow.estimator(*est_args)

        def solve_rerun() -> Any:
            return flow.solve(mu, spk, cond, True)

        def solve_cached() -> Any:
            return flow.solve(mu[:, :, f0:], spk, cond[:, :, f0:], True, f0, cache)

        for fn in (estimator_call, solve_rerun, solve_cached):  # warm-up: kernels, allocator
            fn()
        with scoped_modules(flow):
            results = {
                name: count(fn, device)
                for name, fn in [
                    ("estimator", estimator_call),
                    ("solve", solve_rerun),
                    ("solve_cached", solve_cached),
                ]
            }

    what = "CUDA kernels" if device.type == "cuda" else "aten ops (CPU)"
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"flow kernel count: {config.name} dims, {dev}, {str(dtype).replace('torch.', '')}, {what}")
    print(
        f"estimator: {len(flow.estimator.transformer_blocks())} transformer blocks, "
        f"{1 + len(flow.estimator.mid_res) + 1} ResBlocks; {d.n_timesteps} Euler steps; "
        f"first chunk: {args.prompt} + {d.enc_chunk} + {d.pre_lookahead} tokens = {n} frames "
        f"(cached solve: {n - f0} frames after a {prompt.n_prefix}-token prefix)"
    )
    out: dict[str, Any] = {
        "config": str(config),
        "device": dev,
        "dtype": str(dtype),
        "counting": what,
        "fused": args.fused,
    }
    titles = {
        "estimator": "one estimator call (CFG batch 2, streaming mask)",
        "solve": f"one Flow.solve, re-run path ({d.n_timesteps} steps)",
        "solve_cached": f"one Flow.solve, cached path ({d.n_timesteps} steps, EstimatorState)",
    }
    for name, counts in results.items():
        out[name] = report(titles[name], counts)
    if args.detail:
        counts = results["solve"]
        for scope in ["TransformerBlock", "ResBlock", "CausalBlock", "Estimator", "unattributed"]:
            c = counts.calls.get(scope, 0) if scope != "unattributed" else 1
            if not c or not counts.names[scope]:
                continue
            print(f"\n{scope} (re-run solve): ops per call")
            for op, k in sorted(counts.names[scope].items(), key=lambda kv: -kv[1]):
                print(f"  {k / c:5.2f}  {op}")
        cached = results["solve_cached"]
        print("\nTransformerBlock (cached solve): ops per call")
        c = cached.calls.get("TransformerBlock", 1)
        for op, k in sorted(cached.names["TransformerBlock"].items(), key=lambda kv: -kv[1]):
            print(f"  {k / c:5.2f}  {op}")
        print("\nsolve (own, re-run path): ops")
        for op, k in sorted(counts.names["solve"].items(), key=lambda kv: -kv[1]):
            print(f"  {k:5d}  {op}")
    if args.time and device.type == "cuda":
        with torch.inference_mode():
            eager = cuda_ms(solve_rerun)
            graphed = GraphedFn(solve_rerun, name="solve")
            replay = cuda_ms(lambda: graphed("k"))
            hidden, host = launch_hidden_ms(lambda: graphed("k"))
        print(f"\nre-run solve ({n} frames): eager {eager:.2f} ms, CUDA-graph replay {replay:.2f} ms (median)")
        print(
            f"  the same replay launched while the GPU is still busy (its launch hidden): {hidden:.2f} ms; "
            f"the host's replay() call: {host:.2f} ms"
        )
        out["solve_ms"] = {"eager": eager, "graph": replay, "graph_launch_hidden": hidden, "replay_call": host}
    save_out("flow_kernel_counts.json", out)


if __name__ == "__main__":
    main()
