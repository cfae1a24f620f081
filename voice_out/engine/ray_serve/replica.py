"""The deployment: one :class:`~voice_out.engine.engine.Engine` per Ray Serve replica.

A replica owns one engine (one GPU with ``num_gpus=1``: Ray sets the replica's
``CUDA_VISIBLE_DEVICES``, so ``model.device = auto`` finds its own GPU). Each utterance is one
streaming call of :meth:`SpeechReplica.synthesize`; Serve routes it (power of two choices over
the replicas' queue lengths), counts it as an ongoing request while it streams (the autoscaler's
signal: ``target_ongoing_requests`` = streams in flight per replica), checks the replica with
:meth:`SpeechReplica.check_health`, and on scale-down or shutdown stops routing to the replica
and lets its streams finish for up to ``graceful_shutdown_timeout_s`` before ``__del__`` stops
the engine.

Threads: Serve runs these methods on the replica's user-code event loop; the engine's worker
thread does the model work (its thread rules apply: :mod:`voice_out.engine.engine`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from voice_out.config import Config, ConfigError, load_config
from voice_out.engine.api import EngineError, PcmChunk
from voice_out.engine.ray_serve.messages import Failed, Placed, ReplicaInfo, TextEvent, UtteranceRequest

if TYPE_CHECKING:
    from voice_out.engine.build import BuildOptions

#: Outcomes of this many recent utterances are kept for :meth:`SpeechReplica.stats`.
OUTCOMES_KEPT = 256
#: Serve's default ``metrics_interval_s``: left out of the config (setting it warns).
DEFAULT_METRICS_INTERVAL_S = 10.0


@dataclass(frozen=True)
class DeploymentOptions:
    """How the deployment is laid out on the Ray cluster.

    ``num_replicas``: a fixed count; None autoscales between ``min_replicas`` and
    ``max_replicas`` on ``target_streams`` streams in flight per replica, averaged over the
    last ``look_back_s``: a replica is added once the average has called for it for
    ``upscale_delay_s`` and removed after ``downscale_delay_s`` (Serve's defaults: a GPU
    replica takes tens of seconds to start, so brief peaks should not start one);
    ``metrics_interval_s``: how often each front's router reports its streams in flight to
    Serve's controller (shorter reacts sooner, at one small message per front and
    interval). ``num_gpus``: per
    replica (1 on GPU hosts; 0 runs on CPUs). ``max_queued``: utterances waiting for a replica
    beyond every replica's ``engine.max_streams`` before new ones are refused (``overloaded``);
    -1: no limit. Times in seconds.
    """

    app_name: str = "voice_out"
    num_replicas: int | None = None
    min_replicas: int = 1
    max_replicas: int = 8
    target_streams: float = 16.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    look_back_s: float = 30.0
    metrics_interval_s: float = 10.0
    num_gpus: float = 1.0
    num_cpus: float = 1.0
    max_queued: int = 64
    health_check_period_s: float = 5.0
    health_check_timeout_s: float = 30.0
    graceful_shutdown_timeout_s: float = 30.0
    start_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        def bad(name: str, value: object, expected: str) -> ConfigError:
            return ConfigError(f"ray deployment {name} = {value!r} is invalid: expected {expected}")

        if not self.app_name or "/" in self.app_name:
            raise bad("app_name", self.app_name, "a non-empty name without '/'")
        if self.num_replicas is not None and self.num_replicas < 1:
            raise bad("num_replicas", self.num_replicas, "an integer >= 1, or unset to autoscale")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise bad("min_replicas", (self.min_replicas, self.max_replicas), "1 <= min_replicas <= max_replicas")
        if self.target_streams <= 0:
            raise bad("target_streams", self.target_streams, "a number > 0")
        if self.num_gpus < 0 or self.num_cpus < 0:
            raise bad("num_gpus/num_cpus", (self.num_gpus, self.num_cpus), "numbers >= 0")
        if self.max_queued < -1:
            raise bad("max_queued", self.max_queued, "-1 (no limit) or an integer >= 0")
        for name in ("health_check_period_s", "health_check_timeout_s", "graceful_shutdown_timeout_s"):
            if getattr(self, name) <= 0:
                raise bad(name, getattr(self, name), "a number of seconds > 0")
        for name in ("upscale_delay_s", "downscale_delay_s"):
            if getattr(self, name) < 0:
                raise bad(name, getattr(self, name), "a number of seconds >= 0")
        if not 0 < self.metrics_interval_s < self.look_back_s:
            raise bad(
                "metrics_interval_s",
                (self.metrics_interval_s, self.look_back_s),
                "0 < metrics_interval_s < look_back_s (the average needs several reports)",
            )


@dataclass(frozen=True)
class ReplicaStats:
    """A replica's accounting (tests, operators): its id, the engine's counters, and the final
    state (``finished``, ``aborted``, ``failed``) of its latest utterances by stream id."""

    replica_id: str
    ready: bool
    live_requests: int
    used_slots: int
    open_streams: int
    steps: int
    outcomes: Mapping[str, str]


def build_engine(cfg: Config, load: BuildOptions | None) -> Any:
    """The engine of one replica, its voices read from ``server.voices_dir`` (the store every
    replica shares). ``load``: :meth:`Engine.load`'s ``options`` (tests and benchmarks:
    ``forced``, ``warmup``, ``kv_len`` ...)."""
    from voice_out.engine.engine import Engine
    from voice_out.hub import resolve_model
    from voice_out.voices.store import VoiceStore

    mc = cfg.model
    source = resolve_model(mc.model, mc.cache_dir, revision=mc.revision, offline=mc.offline)
    store = VoiceStore(cfg.server.voices_dir, source.path)
    return Engine.load(cfg, voices=store, options=load)


class SpeechReplica:
    """One engine behind Ray Serve (see the module docstring). Built by Serve with the
    deployment's ``config``, ``load`` and ``start_timeout_s``; blocks until the engine is warm."""

    def __init__(self, config: Config, load: BuildOptions | None = None, start_timeout_s: float = 900.0) -> None:
        from ray import serve

        rid = serve.get_replica_context().replica_id
        self.replica_id: str = rid.unique_id
        self.actor_name: str = rid.to_full_id_str()
        self.config = config
        self.engine = build_engine(config, load)
        self.engine.start(timeout=start_timeout_s)
        self._outcomes: collections.OrderedDict[str, str] = collections.OrderedDict()

    # ---- the utterance call ------------------------------------------------------------------

    async def synthesize(
        self, req: UtteranceRequest, relay: Any
    ) -> AsyncIterator[Placed | tuple[PcmChunk, float] | Failed]:
        """Stream one utterance: :class:`Placed`, then ``(chunk, sent_at)`` pairs (``sent_at``:
        ``time.monotonic()`` when handed to Ray), then a :class:`Failed` if it failed.

        Text after ``req`` comes from ``relay`` (the front's :class:`~.relay.TextRelay`). When
        the front cancels the call, Serve cancels this coroutine: ``finally`` cancels the
        engine stream, whose worker drops it before its next step (no further GPU work)."""
        yield Placed(self.replica_id, self.actor_name)
        try:
            stream = self.engine.open_stream(
                req.voice,
                stream_id=req.stream_id,
                seed=req.seed,
                auto_ack=not req.ack_follows,
                fast_first=req.fast_first,
                instructions=req.instructions,
                speed=req.speed,
            )
        except EngineError as e:
            yield Failed(e.code, str(e))
            return
        errors: list[EngineError] = []
        feeder: asyncio.Task[None] | None = None
        try:
            if req.text:
                stream.push_text(req.text)
            if req.ended:
                stream.end_text()
            if relay is not None and (req.ack_follows or not req.ended):
                feeder = asyncio.get_running_loop().create_task(self._feed(stream, req.stream_id, relay, errors))
            async for chunk in stream:
                yield chunk, time.monotonic()
        except EngineError as e:
            errors.append(e)
        finally:
            stream.cancel()  # no-op once it ended; stops the worker's work on it otherwise
            if feeder is not None:
                feeder.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await feeder
            self._remember(req.stream_id, stream.state.value)
        if errors:
            yield Failed(errors[0].code, str(errors[0]))

    async def _feed(self, stream: Any, stream_id: str, relay: Any, errors: list[EngineError]) -> None:
        """Apply the utterance's later events from the relay until it ends."""
        while not stream.state.terminal:
            try:
                events: list[TextEvent] | None = await relay.take.remote(stream_id)
            except Exception:
                # the relay died with its front: nobody is listening any more
                stream.cancel()
                return
            if events is None:
                return
            for ev in events:
                try:
                    if ev.kind == "text":
                        stream.push_text(ev.delta)
                    elif ev.kind == "end":
                        stream.end_text()
                    elif ev.kind == "ack":
                        stream.ack(ev.samples)
                except EngineError as e:
                    errors.append(e)
                    stream.cancel()
                    return

    def _remember(self, stream_id: str, outcome: str) -> None:
        self._outcomes[stream_id] = outcome
        while len(self._outcomes) > OUTCOMES_KEPT:
            self._outcomes.popitem(last=False)

    # ---- the deployment's other calls ------------------------------------------------------------

    def info(self) -> ReplicaInfo:
        voices = self.engine.voices
        return ReplicaInfo(
            sample_rate=self.engine.sample_rate,
            builtin_voices=tuple(sorted(voices.builtin)),
            default_voice=voices.default,
            first_hop_tokens=self.config.engine.first_hop_tokens,
            max_text_chars=self.config.engine.max_text_chars,
            max_streams=self.config.engine.max_streams,
        )

    def stats(self) -> ReplicaStats:
        st = self.engine.stats()
        return ReplicaStats(
            replica_id=self.replica_id,
            ready=self.engine.ready,
            live_requests=st.live_requests,
            used_slots=st.used_slots,
            open_streams=st.open_streams,
            steps=st.steps,
            outcomes=dict(self._outcomes),
        )

    def check_health(self) -> None:
        """Serve's health check: raising marks the replica unhealthy, and Serve replaces it."""
        if not self.engine.ready:
            raise RuntimeError(f"replica {self.replica_id}: the engine's worker is not running")

    def __del__(self) -> None:
        # Serve calls this after the drain (graceful_shutdown_timeout_s): stop the worker and
        # free the device
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close(timeout=30.0)


# --------------------------------------------------------------------------------------------
# Building and deploying the application


def speech_app(cfg: Config, options: DeploymentOptions, load: BuildOptions | None = None) -> Any:
    """The Serve application (bound deployment) of ``cfg`` laid out as ``options``."""
    from ray import serve

    layout: dict[str, Any]
    if options.num_replicas is not None:
        layout = {"num_replicas": options.num_replicas}
    else:
        autoscaling: dict[str, Any] = {
            "min_replicas": options.min_replicas,
            "max_replicas": options.max_replicas,
            # one utterance = one streaming call in flight: the autoscaler's signal
            "target_ongoing_requests": options.target_streams,
            "upscale_delay_s": options.upscale_delay_s,
            "downscale_delay_s": options.downscale_delay_s,
            "look_back_period_s": options.look_back_s,
        }
        if options.metrics_interval_s != DEFAULT_METRICS_INTERVAL_S:
            # Serve warns that this field will become an environment variable; it is still
            # the interval at which a front's router reports its ongoing requests
            autoscaling["metrics_interval_s"] = options.metrics_interval_s
        layout = {"autoscaling_config": autoscaling}
    deployment = serve.deployment(
        SpeechReplica,
        name="SpeechReplica",
        # the engine admits engine.max_streams; a few more for info/stats calls beside them
        max_ongoing_requests=cfg.engine.max_streams + 4,
        max_queued_requests=options.max_queued,
        ray_actor_options={"num_gpus": options.num_gpus, "num_cpus": options.num_cpus},
        health_check_period_s=options.health_check_period_s,
        health_check_timeout_s=options.health_check_timeout_s,
        graceful_shutdown_wait_loop_s=1.0,
        graceful_shutdown_timeout_s=options.graceful_shutdown_timeout_s,
        **layout,
    )
    return deployment.bind(cfg, load, options.start_timeout_s)


def deploy(
    cfg: Config, options: DeploymentOptions, load: BuildOptions | None = None, *, address: str | None = None
) -> Any:
    """Deploy (or update) the application on the Ray cluster at ``address`` (None: the one
    this process is connected to, else ``auto``) and wait until its replicas are up; returns
    its deployment handle. Serve runs without an HTTP proxy: the voice_out front reaches it
    through handles. The application outlives this process; ``serve shutdown`` or
    ``serve.delete(app_name)`` removes it."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(address=address or "auto", logging_level=logging.WARNING)
    serve.start(proxy_location="Disabled")
    return serve.run(speech_app(cfg, options, load), name=options.app_name, route_prefix=None)


def build_app(args: Mapping[str, str]) -> Any:
    """The application builder for ``serve run voice_out.engine.ray_serve.replica:build_app
    config=FILE [app_name=...] [num_replicas=N] [num_gpus=G] ...``: every
    :class:`DeploymentOptions` field by name, and ``config`` for the voice_out TOML file."""
    known = {f.name: f.type for f in dataclasses.fields(DeploymentOptions)}
    values: dict[str, Any] = {}
    for key, raw in args.items():
        if key == "config":
            continue
        if key not in known:
            raise ConfigError(f"unknown argument {key!r}; expected config or one of {', '.join(known)}")
        default = getattr(DeploymentOptions, key)
        kind = type(default) if default is not None else int
        try:
            values[key] = kind(raw)
        except ValueError:
            raise ConfigError(f"argument {key} = {raw!r} is invalid: expected {kind.__name__}") from None
    cfg = load_config(args.get("config"))
    return speech_app(cfg, DeploymentOptions(**values))
