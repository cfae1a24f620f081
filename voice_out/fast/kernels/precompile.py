"""Compile the engine's Triton kernels before its warm-up, several at a time (start-up only).

Triton compiles a kernel the first time it is launched with a new specialisation, on the
launching thread, one after another: on a machine whose kernel cache (``TRITON_CACHE_DIR``,
else ``~/.triton/cache``) is empty that is ~25 compiles of ~1.3 s each in the engine's start.
:func:`precompile` first makes dry runs of the model calls that use them, a re-run chunk, a
batched chunk and a final chunk of the flow (short and tall: each tile tier) and one decode
step of the LLM, with their launches recorded instead of run
(``voice_out.fast.kernels.launch.recording``), then compiles each distinct launch with Triton's
``JITFunction.warmup`` on a thread pool: Triton releases the GIL while LLVM optimises and emits
PTX, and ``ptxas`` is a process of its own, so the compiles overlap.
The warm-up that follows then finds every kernel compiled. A launch that fails to compile ahead
is only logged: it compiles on first use, as before.

The compiles take ~10 s on an empty cache, and the start has work that needs none of the
flow's kernels: :func:`precompile` compiles the LLM's and the vocoder's kernels first (the
:func:`early` ones) and, once they are done, runs its ``meanwhile`` work (the LLM's warm-up and
graphs, the final chunks' vocoder graphs) on the calling thread while the flow's compile.

GPU worker thread only (the dry runs use the model); the pool's threads only compile.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Protocol

import torch
from torch import Tensor

from voice_out.fast import fused_flow
from voice_out.fast.flow_step import FastToken2Wav
from voice_out.fast.kernels import decode as decode_kernels
from voice_out.fast.kernels import flow as flow_kernels
from voice_out.fast.kernels import vocoder as hift_kernels
from voice_out.fast.kernels.launch import Launch, recording
from voice_out.fast.llm_step import GraphedLLM
from voice_out.model.flow import Flow

log = logging.getLogger(__name__)


class DryRunVoice(Protocol):
    """A voice's token2wav conditioning as the dry runs read it (the engine's ``FlowVoice``):
    ``prompt_token`` int [P], ``prompt_feat`` float [2P, 80], ``embedding`` float [D]."""

    @property
    def prompt_token(self) -> Tensor: ...
    @property
    def prompt_feat(self) -> Tensor: ...
    @property
    def embedding(self) -> Tensor: ...


class DryRunHops(Protocol):
    """The hop policy's longest hops (the engine's ``HopPolicy``), in tokens."""

    @property
    def max_hop(self) -> int: ...
    @property
    def state_max_hop(self) -> int: ...


class DryRunner(Protocol):
    """What the dry runs read of the engine's runner (``voice_out.engine.runner.Runner``): it
    is passed in, so this package imports nothing of the engine above it."""

    @property
    def t2w(self) -> FastToken2Wav: ...
    @property
    def graphed(self) -> GraphedLLM: ...
    @property
    def hops(self) -> DryRunHops: ...
    @property
    def prefix_voices(self) -> int: ...
    @property
    def device(self) -> torch.device: ...


#: Threads compiling at once: one per CPU core, at most 16 (each compile is mostly LLVM and
#: ptxas, off the GIL; a start compiles ~25 kernels of ~1.3 s each).
COMPILE_WORKERS = max(1, min(16, os.cpu_count() or 1))


def _arg_class(a: Any) -> tuple[Any, ...]:
    """What Triton specialises an argument on: a tensor's dtype and 16-byte alignment, an
    integer's being 1 or a multiple of 16, a float's type."""
    if isinstance(a, Tensor):
        return ("tensor", a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return ("bool", a)
    if isinstance(a, int):
        return ("int", a == 1, a % 16 == 0)
    if isinstance(a, float):
        return ("float",)
    return ("other", repr(a))


def _unspecialised(kernel: Any) -> frozenset[int]:
    """Positions of the kernel's ``do_not_specialize`` arguments (Triton's ``params``)."""
    return frozenset(p.num for p in getattr(kernel, "params", ()) if getattr(p, "do_not_specialize", False))


def specialisation(ln: Launch) -> tuple[Any, ...]:
    """What Triton compiles ``ln`` for: (kernel, constexprs, argument classes); an integer the
    kernel does not specialise on is of one class whatever its value."""
    dns = _unspecialised(ln.kernel)
    classes = tuple(
        ("int",) if i in dns and isinstance(a, int) and not isinstance(a, bool) else _arg_class(a)
        for i, a in enumerate(ln.args)
    )
    return (id(ln.kernel), tuple(sorted(ln.kwargs.items())), classes)


def distinct_launches(launches: list[Launch]) -> list[Launch]:
    """One launch per specialisation Triton would compile."""
    seen: dict[tuple[Any, ...], Launch] = {}
    for ln in launches:
        seen.setdefault(specialisation(ln), ln)
    return list(seen.values())


#: The modules whose kernels :func:`early` picks: the LLM's decode step and the vocoder's.
EARLY_MODULES = frozenset({decode_kernels.__name__, hift_kernels.__name__})


def early(ln: Launch) -> bool:
    """Whether ``ln`` is one of the kernels :func:`precompile` compiles first: the LLM's and the
    vocoder's (the start's work beside the flow's compiles launches them)."""
    return getattr(getattr(ln.kernel, "fn", None), "__module__", "") in EARLY_MODULES


def _nothing_compiles() -> bool:
    return False


def compile_ahead(
    launches: list[Launch],
    workers: int = COMPILE_WORKERS,
    *,
    meanwhile: Callable[[Callable[[], bool]], None] | None = None,
    device: torch.device | None = None,
) -> int:
    """Compile the kernels of ``launches`` (distinct ones) on ``workers`` threads; returns how
    many compiled (or were already in Triton's caches). With ``meanwhile``: the :func:`early`
    kernels are compiled first, and once they are, the calling thread runs
    ``meanwhile(compiling)`` while the others compile (it must launch none of them;
    ``compiling()`` says whether any still is, so it may stop what can wait). ``device``: the CUDA device the
    threads compile for (Triton keeps a kernel per current device: the engine's, not cuda:0)."""
    todo = sorted(distinct_launches(launches), key=lambda ln: not early(ln))  # stable: early first
    if not todo:
        if meanwhile is not None:
            meanwhile(_nothing_compiles)
        return 0

    def compile_one(ln: Launch) -> bool:
        try:
            ln.kernel.warmup(*ln.args, grid=ln.grid, **ln.kwargs)
            return True
        except Exception:  # noqa: BLE001 - it compiles on first use instead
            log.warning("compiling %s ahead failed; it compiles on first use", ln.kernel, exc_info=True)
            return False

    def on_device() -> None:
        if device is not None and device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)

    with ThreadPoolExecutor(
        max_workers=min(workers, len(todo)), thread_name_prefix="voice_out-compile", initializer=on_device
    ) as pool:
        futures = [pool.submit(compile_one, ln) for ln in todo]  # started in this order
        if meanwhile is not None:
            wait([f for f, ln in zip(futures, todo, strict=True) if early(ln)])
            meanwhile(lambda: not all(f.done() for f in futures))
        return sum(f.result() for f in futures)


def dry_run_ends(flow: Flow, n_prompt: int) -> list[int]:
    """The chunk ends (prompt + tokens) the flow's dry runs take: the first chunk boundary
    after the prompt, then, where the noise buffer allows, the first end whose every call has
    rows enough for each taller tile tier (:data:`voice_out.fast.kernels.flow.TILE_TIERS`)
    than the ends before reach. The kernels are compiled once per tier: start-up captures
    chunks of several (a long utterance's re-run and final chunks are the tall ones), so a dry
    run of the first chunk alone left their compiles for the captures, one after another."""
    d = flow.dims
    ends = [-(-(n_prompt + 1) // d.enc_chunk) * d.enc_chunk]
    for start, _ in flow_kernels.TILE_TIERS[1:]:
        # the shortest call of a chunk ending at e: one row pair (CFG) of ratio x e frames
        need = -(-start // (2 * d.token_mel_ratio))
        end = -(-need // d.enc_chunk) * d.enc_chunk
        if end > ends[-1] and end + d.pre_lookahead <= d.max_tokens:
            ends.append(end)
    return ends


def dry_run_launches(runner: DryRunner, voice: DryRunVoice, *, state_chunks: bool = True) -> list[Launch]:
    """The Triton launches of a re-run chunk, a batched chunk and a final chunk (graphed and
    eager) of the flow for ``voice``'s prompt length, each at the chunk ends of
    :func:`dry_run_ends`, of a first chunk from a prompt prefix and of later chunks on a
    stream's own state (when the runner keeps prefixes), of a vocoder call and of a decode
    step, recorded (not run: nothing they compute is kept, and nothing is written to any
    stream's state: the state chunks' are stand-ins). ``state_chunks``: whether streams will
    have flow states of their own (the plan's ``flow_state_streams``); without, their chunks'
    dry runs (a stand-in state of up to 400 tokens, ~1.8 GB at full size) are left out.

    Recorded launches keep no tensor of the dry runs (``voice_out.fast.kernels.launch.recording``):
    its peak is one model call's, within what serving holds for the same calls."""
    flow = runner.t2w.flow
    if not isinstance(flow, Flow):
        return []
    dev = runner.t2w.device
    d = flow.dims
    prompt = voice.prompt_token.reshape(1, -1).to(dev, torch.int32)
    feat = voice.prompt_feat.reshape(1, -1, voice.prompt_feat.shape[-1]).to(dev, torch.float32)
    emb = voice.embedding.reshape(1, -1).to(dev, torch.float32)
    p = int(prompt.shape[1])
    with torch.inference_mode(), recording() as launches:
        for end in dry_run_ends(flow, p):
            tokens = torch.ones(1, end - p + d.pre_lookahead, dtype=torch.int32, device=dev)
            item = (tokens, prompt, feat, emb)
            flow.inference(tokens, prompt, feat, emb, streaming=True, finalize=False)
            if runner.t2w.batch_buckets:
                ids, embedding, cond, _ = flow.batch_inputs([item, item])
                flow.batch_core(ids, embedding, cond)
            final = tokens[:, : end - p]
            ids, n_valid, embedding, cond, _ = flow.final_inputs([(final, prompt, feat, emb)], end)
            flow.final_core(ids, n_valid, embedding, cond)
            # a final chunk of a length start-up did not capture runs eagerly: full attention,
            # no key padding (another specialisation of the attention kernel)
            flow.inference(final, prompt, feat, emb, streaming=False, finalize=True)
        if runner.prefix_voices and fused_flow.enabled(flow):
            # a first chunk from a prompt prefix (its attention and convs read the prefix's
            # keys and conv contexts: other specialisations); a stand-in prefix of one chunk
            prefix = flow.allocate_stream_cache(d.enc_chunk)
            prefix.n_done = d.enc_chunk
            ids = torch.ones(1, 2 * d.enc_chunk + d.pre_lookahead, dtype=torch.int32, device=dev)
            cond = torch.zeros(1, d.n_mels, d.token_mel_ratio * d.enc_chunk, device=dev, dtype=flow.dtype)
            flow.prefix_core(ids, emb, cond, prefix)
            del prefix
        if runner.prefix_voices and fused_flow.enabled(flow) and state_chunks:
            spk = flow.speaker(emb)
            # later chunks extending a stream's state (Token2Wav.use_state_slots): the attention
            # stores keys at a start on the device, one more specialisation; a short chunk, the
            # longest hop of a stream not on a state and of one on a state (their tile tiers),
            # each on a stand-in state of its size
            hops = runner.hops
            for chunk_tokens in sorted({d.enc_chunk, hops.max_hop, max(hops.state_max_hop, hops.max_hop)}):
                if 2 * chunk_tokens > d.max_tokens:
                    break
                state = flow.allocate_stream_cache(2 * chunk_tokens)
                n = d.token_mel_ratio * chunk_tokens
                mu = torch.zeros(1, d.n_mels, n, device=dev, dtype=flow.dtype)
                x0 = torch.zeros(1, d.n_mels, n, device=dev)
                at = torch.full((1,), n, dtype=torch.long, device=dev)
                flow.state_core(mu, spk, mu, x0, at, state)
                del state
        # the vocoder's Snake kernels (a compile per channel count; lengths are not specialised)
        runner.t2w.hift(torch.zeros(1, d.n_mels, 8, device=dev))
        if runner.graphed.fused:
            # idle rows: nothing is appended to the cache. One row (the fused linears), the
            # buckets past them (the library's GEMMs with the MLP gate kernel), and a bucket of
            # every other split of the attention's keys
            buckets = runner.graphed.decode_buckets
            runs = [1]
            big = [b for b in buckets if b > decode_kernels.LINEAR_MAX_ROWS]
            if runner.graphed.fused_linear and big:
                runs.append(big[0])
            for b in buckets:
                if decode_kernels.attention_splits(b) not in {decode_kernels.attention_splits(r) for r in runs}:
                    runs.append(b)
            for b in runs:
                runner.graphed.decode_eagerly(b)
    return launches


def precompile(
    runner: DryRunner,
    voice: DryRunVoice,
    workers: int = COMPILE_WORKERS,
    *,
    meanwhile: Callable[[Callable[[], bool]], None] | None = None,
    state_chunks: bool = True,
) -> tuple[int, float]:
    """:func:`dry_run_launches`, then :func:`compile_ahead`: (kernels compiled, seconds, the
    ``meanwhile`` work included). Off CUDA nothing compiles and ``meanwhile`` just runs."""
    if runner.device.type != "cuda":
        if meanwhile is not None:
            meanwhile(_nothing_compiles)
        return 0, 0.0
    t0 = time.perf_counter()
    n = compile_ahead(
        dry_run_launches(runner, voice, state_chunks=state_chunks), workers, meanwhile=meanwhile, device=runner.device
    )
    torch.cuda.synchronize(runner.device)
    return n, time.perf_counter() - t0
