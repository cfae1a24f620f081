"""The fast-path plan: every GPU-mechanics choice and size of the engine, from one budget.

:func:`make_plan` is a pure function (no torch, no device, no clock): a device-memory budget,
the GPU's compute capability, the model's sizes (read from its dims, :class:`ModelSizes`) and
the deployer's few settings (``engine.max_streams``, ``engine.eager``) in, a frozen
:class:`Plan` out. The plan says which kernels run (fused Triton kernels, programmatic
dependent launch), what is captured as CUDA graphs and over which lengths, how many KV slots,
flow states and prompt prefixes are preallocated, and what was left out for lack of memory.
The engine builds itself from it (``voice_out.engine.build``); tests and the bench may pin
single choices through ``pins`` (field name -> value), never through the user's config.

Memory model (bytes of device memory the process holds, as the driver counts it): the CUDA
context and the libraries' own allocations, ONNX Runtime's arena when voices are prepared on
the GPU, the weights, the engine's fixed buffers and base graphs, then per item: KV slot and
activations per stream, the token2wav graph pools of a capture range, the batched-chunk
graphs, prompt prefixes and flow states. The per-item constants were calibrated on an H200
(``scripts/calibrate_memory.py``, random full-size weights, bf16, a 150-token prompt;
docs/benchmarks.md "Memory budget"); the sizes that follow from the dims (KV, flow states,
prefixes, weights) are computed, the graph pools are fitted.

Any thread may call; nothing here touches a device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

GIB = 1 << 30
MIB = 1 << 20

#: Shared memory a block may use (opt-in maximum, bytes) by compute capability: the Triton
#: kernels' tiles must fit it. Others are unknown: they get the most conservative plan.
SHARED_MEMORY_PER_BLOCK: dict[tuple[int, int], int] = {
    (8, 0): 166912,  # A100: 163 KB
    (8, 6): 101376,  # RTX 30xx, A10, A40: 99 KB
    (8, 9): 101376,  # RTX 40xx, L4, L40: 99 KB
    (9, 0): 232448,  # H100, H200: 227 KB
}

#: Non-torch device memory of the process: the CUDA context (0.61 GiB measured on an H200
#: after the first tensor) plus cuBLAS workspaces and Triton's loaded modules (1.04 GiB in all
#: before any token2wav graph), and the graphs' executables (GRAPH_EXEC_BYTES_PER_TOKEN of
#: captured range: 1.6 GiB in all after a start capturing 1500 tokens).
CONTEXT_BYTES = int(0.61 * GIB)
LIBRARY_BYTES = int(0.45 * GIB)
GRAPH_EXEC_BYTES_PER_TOKEN = int(0.37 * MIB)
#: ONNX Runtime on the GPU (voice preparation: speaker embedding, speech tokenizer): its arena,
#: capped at 0.5 GiB by ``voice_out.voices.onnx.ORT_ARENA_BYTES``, and its CUDA libraries.
ORT_BYTES = int(0.75 * GIB)
#: The engine's buffers beside weights, KV slots, prefixes and states, with the allocator's
#: slack among them, 1.5 GiB in all as measured on an H200 (0.97 GiB allocated and 0.46
#: reserved but free when the first token2wav graph was captured, a 4 GiB start with 5 KV
#: slots), in three parts. LLM_BASE_BYTES: the LLM's decode graphs and static inputs, the
#: flow's noise, eager token2wav's working memory (a 4 GiB start with eager token2wav and 16
#: KV slots held 3.45 GiB of device memory). TOKEN2WAV_BASE_BYTES, with token2wav's CUDA
#: graphs: the vocoder's captured lengths and the flow graphs' fixed part. FIRST_LANE_BYTES:
#: the first-chunk lane's graphs, in a pool of their own.
LLM_BASE_BYTES = int(0.6 * GIB)
TOKEN2WAV_BASE_BYTES = int(0.45 * GIB)
FIRST_LANE_BYTES = int(0.45 * GIB)
#: Activations and per-stream buffers a serving stream adds beside its KV slot (18 MB a stream
#: measured over a 32-stream round).
STREAM_WORK_BYTES = 24 * MIB
#: The token2wav graph pools of a capture range of C speech tokens (a 150-token prompt) and the
#: allocator's slack around them: POOL_SCALE * (POOL_LINEAR * C + POOL_QUADRATIC * C**2) bytes
#: (re-run chunks grow with the utterance, and each length's graph keeps its outputs). The
#: shape was fitted to the reserved memory of starts capturing C = 100, 500 and 1500 on an
#: H200; the scale to whole starts within a budget: capture 1500 with batched chunks within
#: 500 held 7.0 GiB (22 GiB budget) beyond the weights, caches and base, and capture 500 with
#: batched 500 ran out past 3.0 GiB of its 8 GiB budget (measured on an H200,
#: docs/benchmarks.md "Memory budget"). POOL_SCALE = 2 keeps 1.4 GiB of margin at the former.
POOL_LINEAR = int(4.42e-4 * GIB)
POOL_QUADRATIC = 9.0e-7 * GIB
POOL_SCALE = 2.0
#: The batched-chunk graphs (up to 8 rows) within the first 500 tokens: 1.5 GiB measured alone
#: (times POOL_SCALE, as above).
BATCH_POOL_AT_500_8ROWS = int(1.5 * GIB)
#: Allocator slack on the sizes the plan adds beside its fixed part.
SLACK = 0.08

#: Speech tokens the capture ranges step through, largest first (25 per second of audio).
CAPTURE_LADDER = (1500, 1000, 500, 250, 100)
BATCH_LADDER = (500, 250, 100)
FLOW_STATE_LADDER = (1500, 1000, 500)
#: Rows of the LLM's graphed decode buckets (the largest is max_streams + batched input rows).
GRAPH_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128)


class PlanError(ValueError):
    """The budget cannot hold the model and one stream, or a pin is invalid."""


@dataclass(frozen=True)
class Capability:
    """A CUDA device's compute capability and opt-in shared memory per block (bytes)."""

    major: int
    minor: int
    shared_memory_per_block: int

    @classmethod
    def of(cls, major: int, minor: int) -> Capability:
        """The capability ``major.minor`` with its table's shared memory (0 when unknown)."""
        return cls(major, minor, SHARED_MEMORY_PER_BLOCK.get((major, minor), 0))

    @property
    def known(self) -> bool:
        return (self.major, self.minor) in SHARED_MEMORY_PER_BLOCK

    @property
    def hopper(self) -> bool:
        return (self.major, self.minor) == (9, 0)

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"


@dataclass(frozen=True)
class ModelSizes:
    """What the model's dims make each buffer cost (bytes; ``voice_out.fast.sizes`` reads them
    from a model directory)."""

    #: Parameters and buffers of LLM, flow (with its fused copies) and vocoder.
    weight_bytes: int
    #: One KV slot: layers x (K, V) x kv heads x head dim x dtype bytes x positions.
    kv_slot_bytes: int
    #: One speech token of a flow state (every estimator attention layer's K and V for both
    #: CFG rows and every timestep, and the encoders'): prompt prefixes and streams' states.
    flow_state_bytes_per_token: int
    #: Speech tokens of the default voice's prompt (prefix and state lengths).
    prompt_tokens: int = 150
    #: Whether the fused Triton kernels can run for this model's dtype (bf16/fp16 on CUDA).
    half_precision: bool = True


@dataclass(frozen=True)
class Plan:
    """Every fast-path choice and size of an engine (frozen; see the module docstring).

    Sizes are counts (streams, voices) or speech tokens (25 per second of audio)."""

    #: Device the plan is for: "cpu" or "cuda".
    device_type: str = "cpu"
    capability: str = ""
    budget_bytes: int = 0
    #: CUDA graphs for the LLM's decode steps (small pools: worth it on any budget).
    cuda_graphs: bool = False
    #: CUDA graphs for token2wav's flow and vocoder calls (large pools: the plan keeps them
    #: only where its smallest capture range fits; without them token2wav runs eagerly).
    token2wav_graphs: bool = False
    fused_decode: bool = False
    fused_linear: bool = False
    dependent_launch: bool = False
    fused_flow: bool = False
    fused_vocoder: bool = False
    #: KV slots: the most streams decoding at once (``engine.max_streams``, maybe lowered).
    max_streams: int = 64
    graph_batch_buckets: tuple[int, ...] = GRAPH_BATCH_BUCKETS
    batched_input_rows: int = 128
    max_chunks_per_step: int = 4
    pipeline_vocode: bool = False
    first_chunk_lane: bool = False
    first_chunk_lane_max_playing: int = 32
    capture_tokens: int = 1500
    capture_batch_tokens: int = 500
    capture_voice_tokens: int = 500
    first_chunk_prefix_voices: int = 4
    flow_state_streams: int = 1
    flow_state_tokens: int = 1500
    flow_state_max_hop_tokens: int = 200
    step_ahead_rows: int = 4
    first_audio_priority: bool = True
    #: Estimated device memory per part (name, bytes), in the order the plan took them.
    estimate: tuple[tuple[str, int], ...] = ()
    #: What did not fit the budget: (what, bytes it would have needed).
    left_out: tuple[tuple[str, int], ...] = ()
    #: Choices the plan made against the user's settings (e.g. max_streams lowered).
    notes: tuple[str, ...] = ()
    pins: tuple[tuple[str, object], ...] = field(default=())

    @property
    def estimated_bytes(self) -> int:
        return sum(b for _, b in self.estimate)

    def summary(self) -> str:
        """One line for the start-up log."""
        if self.device_type != "cuda":
            return f"plan: cpu, {self.max_streams} streams, eager"
        mode = (
            ("graphs" if self.token2wav_graphs else "LLM graphs, eager token2wav")
            if self.cuda_graphs
            else "no CUDA graphs"
        )
        kernels = ",".join(
            n
            for n, on in (
                ("decode", self.fused_decode),
                ("linear", self.fused_linear),
                ("pdl", self.dependent_launch),
                ("flow", self.fused_flow),
                ("vocoder", self.fused_vocoder),
            )
            if on
        )
        left = "; left out: " + ", ".join(f"{w} ({b / GIB:.1f} GiB)" for w, b in self.left_out) if self.left_out else ""
        notes = "; " + "; ".join(self.notes) if self.notes else ""
        captured = (
            f"captured {self.capture_tokens} tokens (batched {self.capture_batch_tokens})"
            if self.token2wav_graphs
            else "no token2wav capture"
        )
        return (
            f"plan: budget {self.budget_bytes / GIB:.1f} GiB on sm {self.capability}, {mode}, kernels "
            f"[{kernels or 'none'}], {self.max_streams} streams, {captured}, "
            f"{self.first_chunk_prefix_voices} prompt prefixes, "
            f"{self.flow_state_streams} flow states x {self.flow_state_tokens} tokens, "
            f"estimated {self.estimated_bytes / GIB:.1f} GiB{left}{notes}"
        )

    def as_dict(self) -> dict[str, Any]:
        """The plan for ``/healthz`` (JSON types; bytes as GiB)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("estimate", "left_out"):
                out[f.name] = {w: round(b / GIB, 3) for w, b in v}
            elif f.name == "pins":
                out[f.name] = {k: val for k, val in v}
            elif f.name == "budget_bytes":
                out["budget_gib"] = round(v / GIB, 3)
            elif isinstance(v, tuple):
                out[f.name] = list(v)
            else:
                out[f.name] = v
        out["estimated_gib"] = round(self.estimated_bytes / GIB, 3)
        return out


#: Plan fields a pin may set (the accounting fields are the plan's own).
PINNABLE = frozenset(
    f.name
    for f in dataclasses.fields(Plan)
    if f.name not in {"device_type", "capability", "budget_bytes", "estimate", "left_out", "notes", "pins"}
)


def _pool(tokens: int) -> float:
    return POOL_SCALE * (POOL_LINEAR * tokens + POOL_QUADRATIC * tokens * tokens)


def pool_bytes(tokens: int) -> int:
    """The token2wav graph pools (and executables) of a capture range of ``tokens``."""
    return int(_pool(tokens)) + GRAPH_EXEC_BYTES_PER_TOKEN * tokens


def batch_pool_bytes(tokens: int, rows: int) -> int:
    """The batched-chunk graphs of up to ``rows`` rows within the first ``tokens``."""
    if tokens <= 0 or rows <= 1:
        return 0
    return int(POOL_SCALE * BATCH_POOL_AT_500_8ROWS * (rows / 8) * _pool(tokens) / _pool(500))


def prefix_bytes(sizes: ModelSizes) -> int:
    """One voice's prompt prefix (whole 25-token chunks of its prompt) and the working copy
    of its length."""
    return 2 * (sizes.prompt_tokens // 25) * 25 * sizes.flow_state_bytes_per_token


def flow_state_bytes(sizes: ModelSizes, tokens: int) -> int:
    """One stream's flow state: the prompt plus ``tokens`` speech tokens (and the look-ahead)."""
    return (sizes.prompt_tokens + tokens + 16) * sizes.flow_state_bytes_per_token


def stream_bytes(sizes: ModelSizes) -> int:
    return sizes.kv_slot_bytes + STREAM_WORK_BYTES


def _fixed(sizes: ModelSizes, onnx_on_device: bool) -> list[tuple[str, int]]:
    fixed = [("cuda_context", CONTEXT_BYTES), ("libraries", LIBRARY_BYTES)]
    if onnx_on_device:
        fixed.append(("onnx_runtime", ORT_BYTES))
    fixed += [("weights", sizes.weight_bytes), ("engine_base", LLM_BASE_BYTES)]
    return fixed


def _check_pins(pins: Mapping[str, object]) -> None:
    defaults = Plan()
    for name, value in pins.items():
        if name not in PINNABLE:
            raise PlanError(f"plan pin {name!r}: no such choice; choices: {', '.join(sorted(PINNABLE))}")
        want = type(getattr(defaults, name))
        if want is tuple:
            ok = isinstance(value, tuple) and all(isinstance(x, int) and x >= 1 for x in value)
        elif want is bool:
            ok = isinstance(value, bool)
        else:
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        if not ok:
            raise PlanError(f"plan pin {name}={value!r}: expected {want.__name__}")
        if name == "max_streams" and value == 0:
            raise PlanError("plan pin max_streams=0: expected at least 1 stream")


def cpu_plan(max_streams: int, pins: Mapping[str, object] | None = None) -> Plan:
    """The plan of a CPU engine: no graphs, no Triton kernels, no memory budget; prompt
    prefixes and flow states as on a GPU (they are exact and the CPU tests cover them)."""
    pins = dict(pins or {})
    _check_pins(pins)
    plan = Plan(device_type="cpu", max_streams=max_streams, max_chunks_per_step=4)
    return _graphs_consistent(dataclasses.replace(plan, **pins, pins=tuple(sorted(pins.items()))))  # type: ignore[arg-type]


def _graphs_consistent(plan: Plan) -> Plan:
    """token2wav's graphs only with CUDA graphs at all (a pin ``cuda_graphs=False`` turns both
    off), so that the engine reads ``token2wav_graphs`` alone."""
    return plan if plan.cuda_graphs or not plan.token2wav_graphs else dataclasses.replace(plan, token2wav_graphs=False)


def make_plan(
    budget_bytes: int | None,
    capability: Capability | None,
    sizes: ModelSizes,
    *,
    max_streams: int,
    eager: bool = False,
    onnx_on_device: bool = False,
    triton: bool = True,
    voices: int = 4,
    pins: Mapping[str, object] | None = None,
) -> Plan:
    """The engine's plan (pure; see the module docstring).

    ``budget_bytes``: device memory the whole process may hold (None with ``capability`` None:
    a CPU engine). ``capability``: the CUDA device's. ``max_streams``: the user's cap (the plan
    may lower it, saying so in ``notes``). ``eager``: no fast path (plain PyTorch, no graphs,
    no Triton kernels). ``onnx_on_device``: ONNX Runtime runs voice preparation on this GPU
    (its arena is budgeted). ``triton``: Triton is installed. ``voices``: voices known at
    start-up (prompt prefixes and other prompt lengths' captures are planned for at most
    these; a voice added later re-runs its prompt, as beyond the plan). ``pins``: plan fields set by
    hand (tests, the bench), applied after the derivation and counted against the budget.

    Raises :class:`PlanError` (one line: the budget, what is needed, the setting to change)
    when the budget cannot hold the model and one stream, and for an invalid pin."""
    pins = dict(pins or {})
    _check_pins(pins)
    if capability is None or budget_bytes is None:
        return cpu_plan(max_streams, pins)
    fixed = _fixed(sizes, onnx_on_device)
    need_one = sum(b for _, b in fixed) + int(stream_bytes(sizes) * (1 + SLACK)) + 1
    if budget_bytes < need_one:
        raise PlanError(
            f"engine.gpu_memory: a budget of {budget_bytes / GIB:.2f} GiB cannot hold the model and one stream "
            f"(needs {need_one / GIB:.2f} GiB: weights {sizes.weight_bytes / GIB:.2f}, CUDA context and "
            f"libraries {(CONTEXT_BYTES + LIBRARY_BYTES) / GIB:.2f}, engine buffers and one stream); "
            "raise engine.gpu_memory or free the GPU"
        )
    # capability gating: Triton's kernels need sm 8.0+ of a known table (their tiles are sized
    # for its shared memory) and half precision; dependent launch is Hopper's
    kernels = not eager and triton and capability.known and sizes.half_precision
    graphs = not eager
    choice: dict[str, Any] = {
        "cuda_graphs": graphs,
        "token2wav_graphs": graphs,
        "fused_decode": kernels,
        "fused_linear": kernels,
        "dependent_launch": kernels and capability.hopper,
        "fused_flow": kernels,
        "fused_vocoder": kernels,
        "pipeline_vocode": True,
        "first_chunk_lane": graphs,
        "max_chunks_per_step": 8 if graphs else 4,
    }
    # the prefix and state paths need the fused flow kernels on a GPU
    state_path = bool(pins.get("fused_flow", choice["fused_flow"]))

    room = int((budget_bytes - sum(b for _, b in fixed)) / (1 + SLACK))
    left_out: list[tuple[str, int]] = []
    notes: list[str] = []
    streams = 0

    def take(what: str, cost: int) -> bool:
        nonlocal room
        if cost <= room:
            room -= cost
            return True
        if what not in {w for w, _ in left_out}:
            left_out.append((what, cost))
        return False

    def add_streams(upto: int) -> None:
        nonlocal streams, room
        upto = min(upto, max_streams)
        if upto <= streams:
            return
        fit = min(upto - streams, room // stream_bytes(sizes))
        if fit > 0:
            room -= fit * stream_bytes(sizes)
            streams += fit

    add_streams(1)
    capture = 0
    batch = 0
    prefixes = 0
    states = 0
    state_tokens = FLOW_STATE_LADDER[0]
    if graphs and not take(
        f"token2wav graphs, capture {CAPTURE_LADDER[-1]} tokens",
        TOKEN2WAV_BASE_BYTES + pool_bytes(CAPTURE_LADDER[-1]),
    ):
        # not even the first chunks' graphs fit (a stream's first chunk is captured on first
        # use): token2wav runs eagerly (its fused kernels need no pool); the LLM's graphs,
        # a small part of the base, stay
        graphs = False
        choice.update(token2wav_graphs=False, first_chunk_lane=False, max_chunks_per_step=4)
        notes.append("token2wav's CUDA graphs left out for lack of memory: token2wav runs eagerly")
    capture = CAPTURE_LADDER[-1] if graphs else 0
    add_streams(4)
    if graphs and choice["first_chunk_lane"] and not take("first-chunk lane", FIRST_LANE_BYTES):
        # first chunks queue behind the others' chunks instead of running beside them
        choice.update(first_chunk_lane=False)

    def grow_capture(limit: int) -> None:
        nonlocal capture
        for c in sorted(x for x in CAPTURE_LADDER if capture < x <= limit):
            if not take(f"capture {c} tokens", pool_bytes(c) - pool_bytes(capture)):
                break
            capture = c

    if graphs:
        grow_capture(250)
    if state_path and voices >= 1 and take("prompt prefix, voice 1", prefix_bytes(sizes)):
        prefixes = 1
    add_streams(16)
    if graphs:
        grow_capture(500)
    add_streams(32)
    if graphs:
        for b in sorted(BATCH_LADDER):
            if b > capture:
                break
            if not take(f"batched chunks {b} tokens", batch_pool_bytes(b, 8) - batch_pool_bytes(batch, 8)):
                break
            batch = b
        grow_capture(CAPTURE_LADDER[0])
    add_streams(max_streams)
    if state_path:
        while prefixes < min(4, voices) and take(f"prompt prefix, voice {prefixes + 1}", prefix_bytes(sizes)):
            prefixes += 1
        if prefixes:
            fits = [t for t in FLOW_STATE_LADDER if flow_state_bytes(sizes, t) <= room]
            if fits and take(f"flow state {fits[0]} tokens", flow_state_bytes(sizes, fits[0])):
                states, state_tokens = 1, fits[0]
            else:
                take(f"flow state {FLOW_STATE_LADDER[-1]} tokens", flow_state_bytes(sizes, FLOW_STATE_LADDER[-1]))
    voice_capture = min(500, capture)
    if (
        graphs
        and voices > 1
        and not take(f"captures for {voices - 1} more voices", (voices - 1) * pool_bytes(voice_capture))
    ):
        voice_capture = 0  # their first chunks only
    if streams < max_streams:
        left_out.append((f"streams {streams + 1}..{max_streams}", (max_streams - streams) * stream_bytes(sizes)))
        notes.append(f"engine.max_streams lowered from {max_streams} to {streams} to fit engine.gpu_memory")
    top = streams + 128
    plan = Plan(
        device_type="cuda",
        capability=str(capability),
        budget_bytes=budget_bytes,
        max_streams=streams,
        graph_batch_buckets=tuple(b for b in GRAPH_BATCH_BUCKETS if b < top),
        capture_tokens=max(capture, 1),
        capture_batch_tokens=batch,
        capture_voice_tokens=voice_capture if graphs else 0,
        first_chunk_prefix_voices=prefixes,
        flow_state_streams=states,
        flow_state_tokens=state_tokens,
        estimate=(),
        left_out=tuple(left_out),
        notes=tuple(notes),
        **choice,
    )
    if pins:
        plan = _apply_pins(plan, pins, sizes, budget_bytes, fixed)
    else:
        plan = dataclasses.replace(plan, estimate=tuple(estimate_parts(plan, sizes, fixed)))
    return plan


def estimate_parts(plan: Plan, sizes: ModelSizes, fixed: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The memory estimate of a plan's sizes, by part (the same model :func:`make_plan` fills)."""
    parts = list(fixed)
    if plan.token2wav_graphs:
        parts.append(("token2wav_base", TOKEN2WAV_BASE_BYTES))
        if plan.first_chunk_lane:
            parts.append(("first_chunk_lane", FIRST_LANE_BYTES))
        parts.append(("token2wav_graphs", pool_bytes(plan.capture_tokens)))
        parts.append(("batched_graphs", batch_pool_bytes(plan.capture_batch_tokens, plan.max_chunks_per_step)))
    parts.append(("prompt_prefixes", plan.first_chunk_prefix_voices * prefix_bytes(sizes)))
    parts.append(("flow_states", plan.flow_state_streams * flow_state_bytes(sizes, plan.flow_state_tokens)))
    parts.append(("kv_slots_and_streams", plan.max_streams * stream_bytes(sizes)))
    return [(w, b) for w, b in parts if b > 0]


def _apply_pins(
    plan: Plan, pins: Mapping[str, object], sizes: ModelSizes, budget: int, fixed: list[tuple[str, int]]
) -> Plan:
    if pins.get("dependent_launch") and plan.capability != "9.0":
        raise PlanError(
            f"plan pin dependent_launch=True: needs a Hopper GPU (sm 9.0), this one is sm {plan.capability}"
        )
    pinned = _graphs_consistent(dataclasses.replace(plan, **pins, pins=tuple(sorted(pins.items()))))  # type: ignore[arg-type]
    if "graph_batch_buckets" not in pins:
        top = pinned.max_streams + pinned.batched_input_rows
        pinned = dataclasses.replace(pinned, graph_batch_buckets=tuple(b for b in GRAPH_BATCH_BUCKETS if b < top))
    parts = estimate_parts(pinned, sizes, fixed)
    fixed_total = sum(b for _, b in fixed)
    total = fixed_total + (sum(b for _, b in parts) - fixed_total) * (1 + SLACK)
    if total > budget:
        raise PlanError(
            f"engine.gpu_memory: the pinned plan needs {total / GIB:.2f} GiB, more than the budget "
            f"of {budget / GIB:.2f} GiB; raise engine.gpu_memory or pin less"
        )
    return dataclasses.replace(pinned, estimate=tuple(parts), left_out=(), notes=())
