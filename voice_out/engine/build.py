"""Assembling the parts of an :class:`~voice_out.engine.engine.Engine` from a configuration.

:func:`build_engine` resolves the model (directory, hub id, or ``random:*``), reads the dims and
the tokenizer, opens the voices and plans the fast paths on the calling thread, and returns
:class:`EngineParts`: among them a :class:`RunnerRecipe` whose ``build`` makes the weights, the
KV cache and token2wav on the GPU worker thread when the engine starts (CUDA belongs to that
thread), and whose ``warm`` compiles and captures there before the first stream.

``Engine.load`` calls this module; this module never imports the engine (no import circle).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from voice_out.config import Config, ConfigError, device_list, parse_gpu_memory
from voice_out.engine.request import FlowVoice, TextPiece, TextPipeline, VoicePrompt
from voice_out.engine.runner import Runner, noise_voice
from voice_out.engine.scheduler import AUTO_FORCED, AutoForced, ForcedTokens, hop_policy
from voice_out.engine.textfeed import TokenizerPipeline
from voice_out.engine.voicebook import VoiceBook
from voice_out.engine.worker import StepRunner
from voice_out.fast import fused_flow, fused_vocoder
from voice_out.fast.kernels.precompile import precompile
from voice_out.fast.plan import (
    CONTEXT_BYTES,
    GIB,
    LIBRARY_BYTES,
    ORT_BYTES,
    Capability,
    ModelSizes,
    Plan,
    PlanError,
    cpu_plan,
    make_plan,
)
from voice_out.fast.sizes import model_sizes
from voice_out.hub import ModelSource, resolve_model

if TYPE_CHECKING:
    from voice_out.fast.flow_step import FastToken2Wav
    from voice_out.model.flow import FlowDims
    from voice_out.model.llm import LLMDims, SpeechLM

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: The default budget: this share of the device memory free when the engine is built.
DEFAULT_FREE_SHARE = 0.9
#: The built-in voice of ``random:*`` models (random prompt features: it sounds like noise).
NOISE_VOICE = "noise"
#: Speech tokens per text token that random weights speak (they never stop sensibly on EOS:
#: left to the length guard, a one-line sentence played ~20 s). Real speech is ~3 (40 ms each).
RANDOM_TOKENS_PER_TEXT_TOKEN = 3
#: ``random:<preset>`` -> the dims directory under ``configs/models``.
RANDOM_DIMS = {"tiny": "tiny", "0.5b": "cosyvoice2-0.5b"}


def random_dims_dir(preset: str) -> Path:
    """The directory holding the dims (no weights) of a ``random:<preset>`` model."""
    root = Path(__file__).resolve().parents[2] / "configs" / "models"
    path = root / RANDOM_DIMS[preset]
    if not (path / "cosyvoice2.yaml").is_file():
        raise FileNotFoundError(f"the dims of random:{preset} are missing: {path / 'cosyvoice2.yaml'}")
    return path


def warn_random(spec: str) -> None:
    """The loud warning for random weights."""
    msg = (
        f"model {spec!r} has RANDOM WEIGHTS: the engine runs the real architecture but speaks NOISE. "
        "Use it for pipeline checks and benchmarks only; pass a CosyVoice2 model directory to hear speech."
    )
    # logged once (with no logging configured, Python's last-resort handler prints it on
    # stderr); a warnings.warn beside it printed the same message twice
    log.warning("!" * 20 + " " + msg + " " + "!" * 20)


class DeviceError(ConfigError):
    """``model.device`` names a device this torch cannot use (printed as one line)."""


def resolve_device(device: str) -> torch.device:
    """``model.device`` -> the torch device; raises :class:`DeviceError` (one line naming the
    fix) for a CUDA device that this torch build or machine does not have."""
    if "," in device or device == "cuda:all":
        raise ConfigError(
            f"model.device = {device!r} names several devices: one engine runs on one "
            "(the server and `voice-out bench --mode placement` run one per device)"
        )
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.backends.cuda.is_built():
            raise DeviceError(
                f"model.device = {device!r}, but this torch ({torch.__version__}) is a CPU-only build: "
                "install a CUDA build of torch (e.g. `make install TORCH_SPEC=...` with the CUDA wheel), "
                "or pass --device cpu (or auto)"
            )
        if not torch.cuda.is_available():
            raise DeviceError(
                f"model.device = {device!r}, but torch sees no CUDA device (driver or CUDA_VISIBLE_DEVICES?): "
                "fix that, or pass --device cpu (or auto)"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(
                f"model.device = {device!r}, but torch sees {torch.cuda.device_count()} CUDA device(s): "
                "pass --device cuda:0 .. cuda:N-1, or auto"
            )
    return dev


def expand_devices(spec: str) -> tuple[str, ...]:
    """The devices of ``model.device``, ``cuda:all`` expanded to every visible GPU."""
    devices = device_list(spec)
    if devices == ("cuda:all",):
        n = torch.cuda.device_count()
        if n == 0:
            raise ConfigError(f"model.device = {spec!r}: no CUDA device is visible")
        return tuple(f"cuda:{i}" for i in range(n))
    return devices


def engine_labels(devices: tuple[str, ...]) -> list[str]:
    """The label of each device's engine (the ``gpu`` label of /metrics): the device, with the
    engine's index where a device repeats (``cpu,cpu`` -> ``cpu:0``, ``cpu:1``)."""
    return [f"{d}:{i}" if devices.count(d) > 1 else d for i, d in enumerate(devices)]


def planned_capacity(cfg: Config) -> int:
    """The most streams the engine of ``cfg`` may hold before it has planned its memory: what
    placement measures an engine's headroom against until the engine's own plan
    (``engine.plan.max_streams``, voice_out.fast.plan) says how many it fit."""
    return cfg.engine.max_streams


def uses_processes(cfg: Config, n_devices: int) -> bool:
    """Whether the engines of ``cfg`` run in a process each (``model.engine_processes``)."""
    mode = cfg.model.engine_processes
    if mode == "auto":
        return n_devices > 1
    return mode == "per_device"


class DeltaPipeline:
    """:class:`TextPipeline` over ``voice_out.text.stream.DeltaTokenizer`` (normalization with
    token-stable release and input offsets)."""

    def __init__(self, delta_tokenizer: Any) -> None:
        self._dt = delta_tokenizer

    def push(self, delta: str) -> list[TextPiece]:
        chunk = self._dt.push(delta)
        return [TextPiece(tuple(chunk.ids), chunk.input_end)] if chunk.ids else []

    def finish(self) -> list[TextPiece]:
        chunk = self._dt.finish()
        return [TextPiece(tuple(chunk.ids), chunk.input_end)] if chunk.ids else []


def text_pipeline_factory(tokenizer: Any, mode: str) -> Callable[[], TextPipeline]:
    """Deltas -> normalized, tokenized pieces. ``mode``: ``auto``/``wetext``/``rules`` (the
    normalizer of :mod:`voice_out.text`), or ``none`` (word-boundary release, no normalization)."""
    if mode == "none":
        return lambda: TokenizerPipeline(tokenizer.encode)
    from voice_out.text.normalize import create_text_normalizer
    from voice_out.text.stream import DeltaNormalizer, DeltaTokenizer

    normalizer = create_text_normalizer(mode, lambda s: len(tokenizer.encode(s)))  # type: ignore[arg-type]
    return lambda: DeltaPipeline(DeltaTokenizer(DeltaNormalizer(normalizer), tokenizer))


@dataclass(frozen=True)
class EngineParts:
    """What :class:`~voice_out.engine.engine.Engine` is made of besides its config: the
    arguments of its constructor, as :func:`build_engine` assembles them."""

    runner_factory: Callable[[], StepRunner]
    pipeline_factory: Callable[[], TextPipeline]
    voices: VoiceBook
    forced: ForcedTokens | None
    warmup: Callable[[StepRunner], None] | None
    plan: Plan


@dataclass(frozen=True)
class ModelFiles:
    """The model as resolved on the calling thread: its source, where its dims are read
    (the weights' directory, or a ``random:*`` preset's), its dims and its YAML."""

    source: ModelSource
    dims_dir: Path
    dims: LLMDims
    flow_dims: FlowDims
    yaml_cfg: dict[str, Any]

    @property
    def weights_dir(self) -> Path | None:
        return self.source.path


@dataclass(frozen=True)
class BuildOptions:
    """How :meth:`Engine.load` builds an engine, besides its config (tests, benchmarks and the
    engines of a placement set these; a deployer sets the config).

    ``forced``: forced-tokens mode; by default (:data:`AUTO_FORCED`) random weights speak a
    realistic ``RANDOM_TOKENS_PER_TEXT_TOKEN`` tokens per text token and real ones stop on
    EOS, None forces nothing. ``kv_len``: KV-cache positions per stream. ``warmup``: compile,
    warm up and capture at start (False: on first use). ``fault_hook``: a test hook (see
    ``Runner``).
    ``noise_prompt_tokens``: prompt length of random weights' ``noise`` voice.
    ``text_normalizer``: ``auto``, ``wetext``, ``rules`` or ``none``. ``pins``: fast-path
    choices set by hand (``voice_out.fast.plan.Plan`` field -> value, plus ``capability``:
    "8.9" plans as for that GPU); e.g. ``{"cuda_graphs": True}`` runs the LLM through
    ``voice_out.fast.llm_step`` (its eager code off the GPU)."""

    forced: ForcedTokens | None | AutoForced = AUTO_FORCED
    kv_len: int = 4096
    warmup: bool = True
    fault_hook: Any | None = None
    noise_prompt_tokens: int = 25
    text_normalizer: str = "auto"
    pins: Mapping[str, object] | None = None


def build_engine(cfg: Config, voices: Any | None = None, options: BuildOptions | None = None) -> EngineParts:
    """The parts of an engine for ``cfg`` (calling thread; loads no weights): ``voices`` and
    ``options`` as :meth:`Engine.load` takes them."""
    from voice_out.text.tokenizer import load_tokenizer

    opts = options if options is not None else BuildOptions()
    files = resolve_model_files(cfg)
    forced = opts.forced
    if forced is AUTO_FORCED:
        forced = ForcedTokens(RANDOM_TOKENS_PER_TEXT_TOKEN) if files.source.is_random else None
    assert forced is None or isinstance(forced, ForcedTokens)
    device = resolve_device(cfg.model.device)
    dtype = _DTYPES[cfg.model.dtype] if device.type == "cuda" else torch.float32
    tokenizer = load_tokenizer(files.weights_dir, files.dims.text_vocab_size)
    book = voice_book(cfg, files, tokenizer.encode, voices, opts.noise_prompt_tokens)
    plan = plan_engine(cfg, files, device, dtype, opts.kv_len, book, opts.pins or {})
    recipe = RunnerRecipe(cfg, files, device, dtype, plan, book, opts.kv_len, opts.fault_hook)
    return EngineParts(
        runner_factory=recipe.build,
        pipeline_factory=text_pipeline_factory(tokenizer, opts.text_normalizer),
        voices=book,
        forced=forced,
        warmup=recipe.warm if opts.warmup else None,
        plan=plan,
    )


def resolve_model_files(cfg: Config) -> ModelFiles:
    """``model.model`` resolved (fetched from the hub if need be) and its dims read; warns
    loudly for random weights."""
    from voice_out.model.checkpoint import flow_dims, llm_dims, load_yaml

    mc = cfg.model
    source = resolve_model(mc.model, mc.cache_dir, revision=mc.revision, offline=mc.offline)
    if source.random_preset is not None:
        warn_random(source.spec)
        dims_dir = random_dims_dir(source.random_preset)
    else:
        assert source.path is not None
        dims_dir = source.path
    yaml_cfg = load_yaml(dims_dir)
    return ModelFiles(source, dims_dir, llm_dims(dims_dir), flow_dims(yaml_cfg), yaml_cfg)


def voice_book(
    cfg: Config,
    files: ModelFiles,
    encode: Callable[[str], list[int]],
    voices: Any | None,
    noise_prompt_tokens: int,
) -> VoiceBook:
    """The engine's voices: ``voices`` (a store) or a read-only store at ``server.voices_dir``
    when it exists, plus the built-in ``noise`` voice of random weights."""
    builtin: dict[str, VoicePrompt] = {}
    random = files.source.is_random
    if random:
        fd = files.flow_dims
        ids, fv = noise_voice(
            noise_prompt_tokens, n_mels=fd.n_mels, spk_dim=fd.spk_embed_dim, seed=cfg.model.random_seed
        )
        builtin[NOISE_VOICE] = VoicePrompt(
            NOISE_VOICE,
            # a transcript of P/3 ids, the 5 text : 15 speech ratio the interleave assumes
            prompt_text_ids=tuple((7 * i + 3) % files.dims.text_vocab_size for i in range(len(ids) // 3)),
            prompt_speech_ids=tuple(ids),
            flow_prompt_tokens=len(ids),
            flow=fv,
        )
    store = voices
    if store is None and Path(cfg.server.voices_dir).expanduser().is_dir():
        from voice_out.voices.store import VoiceStore

        store = VoiceStore(cfg.server.voices_dir, None, check_fingerprint=False)
    default = cfg.server.default_voice or (NOISE_VOICE if random else None)
    return VoiceBook(store, encode, builtin=builtin, default=default)


def plan_engine(
    cfg: Config,
    files: ModelFiles,
    device: torch.device,
    dtype: torch.dtype,
    kv_len: int,
    book: VoiceBook,
    pins: Mapping[str, object],
) -> Plan:
    """The engine's fast-path :class:`Plan` (see :func:`engine_plan`), its hop rules checked
    at load rather than per stream, and the first-chunk lane decided once for token2wav, the
    runner and the scheduler."""
    from voice_out.model.checkpoint import hift_dims

    ec = cfg.engine
    plan = engine_plan(
        cfg,
        device,
        dtype,
        lambda: model_sizes(
            files.dims,
            files.flow_dims,
            hift_dims(files.yaml_cfg),
            dtype_bytes=torch.finfo(dtype).bits // 8,
            kv_len=kv_len,
            prompt_tokens=_prompt_tokens(book),
        ),
        pins,
        voices=max(1, len(book.names())),
    )
    try:  # the token2wav schedule's own rules (hops are whole flow chunks): fail at load, not per stream
        hop_policy(ec, plan).schedule(0, ec.fast_first_tokens)
    except ValueError as e:
        raise ConfigError(f"engine.first_hop_tokens / max_hop_tokens / hop_growth / fast_first_tokens: {e}") from None
    # first chunks beside the others need their own token2wav graphs and a pipelined runner
    first_lane = plan.token2wav_graphs and device.type == "cuda" and plan.first_chunk_lane and plan.pipeline_vocode
    plan = dataclasses.replace(plan, first_chunk_lane=first_lane)
    log.info("engine: %s", plan.summary())
    return plan


@dataclass(frozen=True)
class RunnerRecipe:
    """How the GPU worker thread makes the engine's :class:`Runner` (:meth:`build`, the
    engine's ``runner_factory``) and warms it up before the first stream (:meth:`warm`).
    Made on the calling thread; both methods run on the worker thread (CUDA belongs to it)."""

    cfg: Config
    files: ModelFiles
    device: torch.device
    dtype: torch.dtype
    plan: Plan
    book: VoiceBook
    kv_len: int
    fault_hook: Any | None

    # ---- build (worker thread) ------------------------------------------------------------

    def build(self) -> StepRunner:
        device, plan = self.device, self.plan
        if device.type == "cuda" and device.index is not None:
            # this (worker) thread's current device: Triton launches, graph captures and the
            # default streams follow it, per thread; an engine on cuda:1 beside one on cuda:0
            # (several engines in one process) or in a process of its own needs it set
            torch.cuda.set_device(device)
        if device.type == "cuda":
            enforce_budget(plan, device)
        llm, t2w, flow_kernels = self._models()
        runner = self._runner(llm, t2w, flow_kernels)
        if plan.fused_decode and device.type == "cuda" and not runner.graphed.fused:
            log.info("engine: fused decode kernels unavailable here (need Triton and bf16/fp16): plain-torch decode")
        return runner

    def _models(self) -> tuple[SpeechLM, FastToken2Wav, bool]:
        """The weights (or random ones) on the device: the LLM, token2wav, and whether its flow
        estimator runs the fused kernels."""
        from voice_out.fast.flow_step import FastToken2Wav
        from voice_out.model.checkpoint import load_flow, load_hift, load_llm, random_flow, random_hift, random_llm

        device, dtype, plan, files = self.device, self.dtype, self.plan, self.files
        seed = self.cfg.model.random_seed
        if files.weights_dir is not None:
            llm = load_llm(files.weights_dir, device, dtype)
            flow = load_flow(files.weights_dir, device, dtype)
            hift = load_hift(files.weights_dir, device)
        else:
            llm = random_llm(files.dims_dir, device, dtype, seed)
            flow = random_flow(files.dims_dir, device, dtype, seed)
            hift = random_hift(files.dims_dir, device, seed)
        log.info(
            "engine: model %s on %s (%s), %d KV slots x %d positions",
            files.source.spec,
            device,
            dtype,
            plan.max_streams,
            self.kv_len,
        )
        # the eager calls' feed-forward as one GEMM (the kernels read the plain weights)
        fused_flow.fuse_ff_(flow.estimator)
        if fused_flow.use_kernels(flow, plan.fused_flow):
            log.info("engine: flow estimator with fused kernels")
        elif plan.fused_flow and device.type == "cuda":
            log.info("engine: fused flow kernels unavailable here (need Triton and bf16/fp16): plain-torch flow")
        if fused_vocoder.use_kernels(hift, plan.fused_vocoder):
            log.info("engine: vocoder with fused Snake kernels")
        t2w = FastToken2Wav(flow, hift, device=device)
        # graphed first-chunk flow and vocoder (CUDA only; a no-op elsewhere); the first-chunk
        # lane's graphs apart when first chunks run beside the others (the plan's first_chunk_lane)
        t2w.use_cuda_graphs(plan.token2wav_graphs, first_lane=plan.first_chunk_lane)
        return llm, t2w, fused_flow.enabled(flow)

    def _runner(self, llm: SpeechLM, t2w: FastToken2Wav, flow_kernels: bool) -> Runner:
        from voice_out.model.sampling import SamplingParams

        ec, plan = self.cfg.engine, self.plan
        return Runner(
            llm,
            t2w,
            n_slots=plan.max_streams,
            max_len=self.kv_len,
            sampling=SamplingParams(top_p=ec.top_p, top_k=ec.top_k, win_size=ec.ras_win_size, tau_r=ec.ras_tau_r),
            hops=hop_policy(ec, plan),
            fast_first=ec.fast_first_tokens,
            fault_hook=self.fault_hook,
            graphs=plan.cuda_graphs,
            graph_buckets=plan.graph_batch_buckets,
            pipeline_vocode=plan.pipeline_vocode,
            fused_decode=plan.fused_decode,
            fused_linear=plan.fused_linear,
            dependent_launch=plan.dependent_launch,
            batched_input_rows=plan.batched_input_rows,
            # on a GPU only with the fused kernels: the plain estimator would copy a voice's
            # prefix (~0.6 GB) into a state of its own for every first chunk
            prefix_voices=plan.first_chunk_prefix_voices if flow_kernels or self.device.type != "cuda" else 0,
        )

    # ---- warm-up (worker thread) ----------------------------------------------------------

    def warm(self, runner: StepRunner) -> None:
        """Compile the kernels, warm the LLM and token2wav up, prepare the voices' prefixes and
        flow states, and capture the token2wav graphs of every prompt length's first chunks.
        The rest of the planned captures (the final chunks' vocoder lengths, the default
        voice's range past its first chunks, the other voices' ranges) waits for after ready
        (``Runner.defer``): the worker runs it while no stream is live, and a chunk whose graph
        is not captured yet runs eagerly meanwhile."""
        assert isinstance(runner, Runner)
        plan, fd = self.plan, self.files.flow_dims
        voice = FlowVoice(*_warm_voice(fd.n_mels, fd.spk_embed_dim))
        # the default voice's token2wav graphs are captured here
        default_voice = _default_voice(self.book) if plan.token2wav_graphs else None
        if default_voice is not None:  # while the flow's kernels compile; what is left, after ready
            runner.defer(runner.iter_precapture_vocoder(default_voice[1]))
        self._compile(runner, voice)
        runner.warmup_token2wav(voice)
        _prepare_prefixes(runner, self.book, plan.first_chunk_prefix_voices)
        # (prefix_voices is 0 on a GPU without the fused kernels: nor does a stream need a state)
        if runner.prefix_voices:
            n_states = runner.prepare_state_slots(plan.flow_state_streams, plan.flow_state_tokens)
            if n_states:
                log.info(
                    "engine: %d flow states of %d speech tokens for streams' later chunks",
                    n_states,
                    plan.flow_state_tokens,
                )
        if default_voice is not None:  # the token2wav graphs of its prompt length, before any stream
            self._capture(runner, *default_voice)

    def _compile(self, runner: Runner, voice: FlowVoice) -> None:
        """The fused kernels, compiled several at a time rather than on first use (with graphs),
        and meanwhile what needs none of the flow's kernels."""

        def meanwhile(compiling: Callable[[], bool]) -> None:
            """The LLM's warm-up and graphs, then the deferred vocoder captures while kernels
            still compile."""
            runner.warmup_llm()
            while compiling() and runner.background_step():
                pass

        if not self.plan.cuda_graphs:
            runner.warmup_llm()
            return
        n, seconds = precompile(runner, voice, meanwhile=meanwhile, state_chunks=self.plan.flow_state_streams > 0)
        if n:
            log.info(
                "engine: %d Triton kernels compiled ahead in %.1f s (the LLM's graphs and the vocoder's meanwhile)",
                n,
                seconds,
            )

    def _capture(self, runner: Runner, name: str, flow_voice: FlowVoice) -> None:
        """The token2wav graphs of the first chunks of the default voice's prompt length and of
        the other voices' (now), and of the rest of their planned ranges (after ready)."""
        plan = self.plan
        per_step = plan.max_chunks_per_step
        first = min(2 * self.cfg.engine.first_hop_tokens, plan.capture_tokens)  # the first chunks' shapes
        t0 = time.perf_counter()
        # (the final chunks' vocoder lengths: beside the compiles and after ready)
        n = runner.precapture(flow_voice, first, max_batch=per_step, batch_tokens=first, final_vocoder=False)
        log.info(
            "engine: %d token2wav graphs captured for the first %d speech tokens of voice %r in %.1f s",
            n,
            first,
            name,
            time.perf_counter() - t0,
        )
        others = _other_prompt_lengths(self.book, flow_voice)
        if others:
            t0 = time.perf_counter()
            for _, voice in others:
                runner.precapture(voice, first, max_batch=per_step, batch_tokens=first, final_vocoder=False)
            log.info(
                "engine: graphs of the first %d tokens captured for %d more prompt lengths (voices %s) in %.1f s",
                first,
                len(others),
                ", ".join(repr(n) for n, _ in others),
                time.perf_counter() - t0,
            )
        n_voice = max(first, min(plan.capture_voice_tokens, plan.capture_tokens))
        rest = itertools.chain(
            runner.iter_precapture(
                flow_voice, plan.capture_tokens, max_batch=per_step, batch_tokens=plan.capture_batch_tokens
            ),
            *(runner.iter_precapture(v, n_voice, max_batch=per_step, batch_tokens=first) for _, v in others),
        )
        what = f"the first {plan.capture_tokens} speech tokens of voice {name!r}"
        if others:
            what += f" and {n_voice} of {len(others)} more prompt lengths"
        runner.defer(_logged_after_ready(rest, runner, what, time.perf_counter()))


def _logged_after_ready(work: Iterator[None], runner: Runner, what: str, t0: float) -> Iterator[None]:
    """``work``, then one log line: the start-up captures finished after ready (``t0``: the
    warm-up's end, perf_counter seconds; the work deferred before this runs first)."""
    yield from work
    log.info(
        "engine: start-up finished after ready: token2wav graphs of %s captured (%d held), %.1f s after start-up's end",
        what,
        runner.t2w.graphs_held(),
        time.perf_counter() - t0,
    )


def _warm_voice(n_mels: int, spk_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, fv = noise_voice(25, n_mels=n_mels, spk_dim=spk_dim, seed=1)
    return fv.prompt_token, fv.prompt_feat, fv.embedding


def _default_voice(book: VoiceBook) -> tuple[str, FlowVoice] | None:
    """The default voice's name and token2wav conditioning, or None (no default voice, or an
    unusable one: its graphs are then captured on first use)."""
    try:
        voice = book.resolve(None)
    except Exception:  # noqa: BLE001 - the request that names it fails instead
        return None
    return (voice.name, voice.flow) if voice.flow is not None else None


def _prepare_prefixes(runner: Runner, book: VoiceBook, limit: int) -> None:
    """Keep the prompt prefixes of the default voice and then the others the engine knows, up
    to ``limit`` voices (the plan's ``first_chunk_prefix_voices``), for first chunks from them
    (``Runner.prepare_first_prefix``); before the graph captures, which capture their graphs."""
    if limit <= 0:
        return
    t0 = time.perf_counter()
    names: list[str | None] = [None, *book.names()]
    prepared: list[str] = []
    for name in names:
        if len(prepared) >= limit:
            break
        try:
            voice = book.resolve(name)
        except Exception:  # noqa: BLE001 - an unusable voice fails the request that names it
            continue
        if voice.flow is not None and voice.name not in prepared and runner.prepare_first_prefix(voice.flow):
            prepared.append(voice.name)
    if prepared:
        log.info(
            "engine: first chunks from the prompt prefix for voices %s (prepared in %.1f s)",
            ", ".join(repr(n) for n in prepared),
            time.perf_counter() - t0,
        )


def _other_prompt_lengths(book: VoiceBook, default: FlowVoice) -> list[tuple[str, FlowVoice]]:
    """One voice (name, conditioning) of every other prompt length the engine knows: token2wav
    graphs are shaped by the prompt's length, and a voice of a length start-up did not capture
    paid its first chunk's capture in its first utterance (0.5 to 0.9 s of first audio on an
    H200) and ran its later chunks eagerly."""
    lengths = {int(default.prompt_token.numel())}
    voices: list[tuple[str, FlowVoice]] = []
    for name in book.names():
        try:
            voice = book.resolve(name)
        except Exception:  # noqa: BLE001 - an unusable voice fails the request that names it
            continue
        flow = voice.flow
        if flow is None or int(flow.prompt_token.numel()) in lengths:
            continue
        lengths.add(int(flow.prompt_token.numel()))
        voices.append((name, flow))
    return voices


def _prompt_tokens(book: VoiceBook) -> int:
    """Speech tokens of the default voice's prompt (the prefix and state lengths the plan
    sizes), or 150 (a typical prompt) without a usable default voice."""
    try:
        voice = book.resolve(None)
    except Exception:  # noqa: BLE001 - the request that names it fails instead
        return 150
    flow = voice.flow
    return int(flow.prompt_token.numel()) if flow is not None and flow.prompt_token.numel() else 150


def onnx_on_device() -> bool:
    """Whether voice preparation's ONNX models run on the GPU (onnxruntime's CUDA provider)."""
    try:
        from voice_out.voices.onnx import providers
    except ImportError:  # pragma: no cover - onnxruntime is a dependency
        return False
    try:
        return "CUDAExecutionProvider" in providers()
    except Exception:  # noqa: BLE001 - no onnxruntime: voices are not prepared here at all
        return False


def device_budget(gpu_memory: float | str | None, free: int, total: int) -> int:
    """``engine.gpu_memory`` in bytes on a card of ``total`` bytes with ``free`` free now (the
    memory this process's allocator already caches counted as free): GiB, a share of the
    card, or (unset) ``DEFAULT_FREE_SHARE`` of what is free."""
    if gpu_memory is None:
        return int(DEFAULT_FREE_SHARE * free)
    kind, amount = parse_gpu_memory(gpu_memory)
    budget = int(amount * GIB) if kind == "gib" else int(amount * total)
    if budget > total:
        raise ConfigError(
            f"engine.gpu_memory = {gpu_memory!r} is {budget / GIB:.1f} GiB, more than the card's "
            f"{total / GIB:.1f} GiB: set engine.gpu_memory to at most that"
        )
    return budget


def engine_plan(
    cfg: Config,
    device: torch.device,
    dtype: torch.dtype,
    sizes: Callable[[], ModelSizes],
    pins: Mapping[str, object],
    voices: int = 4,
) -> Plan:
    """The engine's :class:`Plan` on ``device`` (calling thread; reads the device's capability
    and free memory, allocates nothing). ``pins``: plan fields set by hand, and
    ``capability`` ("8.9": plan as for that GPU). ``voices``: voices known at start-up. A
    budget too small fails here, in one line."""
    pins = dict(pins)
    cap_pin = pins.pop("capability", None)
    ec = cfg.engine
    if device.type != "cuda":
        try:
            return cpu_plan(ec.max_streams, pins)
        except PlanError as e:
            raise ConfigError(str(e)) from None
    from voice_out.fast.kernels.launch import triton

    props = torch.cuda.get_device_properties(device)
    capability = Capability.of(props.major, props.minor)
    if cap_pin is not None:
        major, _, minor = str(cap_pin).partition(".")
        capability = Capability.of(int(major), int(minor or 0))
    free, total = torch.cuda.mem_get_info(device)
    budget = device_budget(ec.gpu_memory, free + torch.cuda.memory_reserved(device), total)
    try:
        return make_plan(
            budget,
            capability,
            sizes(),
            max_streams=ec.max_streams,
            eager=ec.eager,
            onnx_on_device=onnx_on_device(),
            triton=triton is not None and dtype != torch.float32,
            voices=voices,
            pins=pins,
        )
    except PlanError as e:
        raise ConfigError(str(e)) from None


def enforce_budget(plan: Plan, device: torch.device) -> None:
    """Cap torch's allocator on ``device`` at the plan's budget less what lives outside it (the
    CUDA context, the libraries, ONNX Runtime's arena): an allocation past it raises an
    out-of-memory error instead of taking memory the budget leaves to others. GPU worker
    thread, before the weights load."""
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        # segments that grow in place instead of fixed blocks: without them the blocks freed
        # between start-up's captures stayed reserved (1.5 GiB at an 8 GiB cap on an H200)
        # and a 4 GiB start ran out of memory; with them it starts (docs/benchmarks.md).
        # Process-wide, as the variable would be; a deployer's own setting wins.
        setting = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.10
        (setting or torch.cuda.memory._set_allocator_settings)("expandable_segments:True")
    outside = CONTEXT_BYTES + LIBRARY_BYTES + (ORT_BYTES if onnx_on_device() else 0)
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = max(plan.budget_bytes - outside, 0) / total
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(min(1.0, fraction), index)
