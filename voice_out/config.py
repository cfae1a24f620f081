"""Configuration: frozen dataclasses for the model, the engine and the server.

Values come from, in increasing priority: the dataclass defaults, a TOML file (by default
``configs/default.toml``), environment variables ``VOICE_OUT_<SECTION>_<FIELD>`` (for example
``VOICE_OUT_SERVER_PORT=9000``) and CLI overrides (``--set server.port=9000`` or the dedicated
flags of each subcommand). Every value is validated when its dataclass is built; a bad value
raises :class:`ConfigError` naming the field, the value and what would be accepted.

Model dimensions never live here: they are read from the model directory (see
``voice_out.model.checkpoint``). Any thread may read a config; nothing mutates one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from voice_out.errors import VoiceOutError

#: How a stream's chunk hop grows (``engine.hop_growth``; ``voice_out.engine.chunk_schedule``).
HOP_GROWTHS = ("double", "buffered")

ENV_PREFIX = "VOICE_OUT_"
DEFAULT_MODEL = "FunAudioLLM/CosyVoice2-0.5B"
DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
#: Where the engines of several devices run: ``shared`` (all in the server's process, one
#: worker thread each), ``per_device`` (each in a process of its own), ``auto`` (the measured
#: default: docs/scale-out.md).
ENGINE_PROCESSES = ("auto", "shared", "per_device")

DType = Literal["float32", "bfloat16", "float16"]


class ConfigError(VoiceOutError, ValueError):
    """A configuration value is missing, malformed or out of range."""


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "voice_out")


def _check(cond: bool, section: str, name: str, value: object, expected: str) -> None:
    if not cond:
        raise ConfigError(f"{section}.{name} = {value!r} is invalid: expected {expected}")


DEVICE_EXPECTED = "auto, cpu, cuda, cuda:N, cuda:all, or a comma-separated list such as cuda:0,cuda:1"


def device_list(spec: str) -> tuple[str, ...]:
    """The devices of a ``model.device`` value, one engine each, in order (no torch here).

    One device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``. Several: ``cuda:0,cuda:1`` (distinct
    ``cuda:N``) or ``cpu,cpu`` (CPU engines, for tests); ``cuda:all`` stays as it is, for
    :func:`voice_out.engine.build.expand_devices` to expand to every visible GPU.
    Raises ConfigError naming what is wrong.
    """

    def bad(why: str) -> ConfigError:
        return ConfigError(f"model.device = {spec!r} is invalid: {why}; expected {DEVICE_EXPECTED}")

    items = [d.strip() for d in spec.split(",")]
    if any(not d for d in items):
        raise bad("an empty item in the list")
    for d in items:
        if d in DEVICES or d == "cuda:all":
            continue
        index = d.removeprefix("cuda:")
        if not d.startswith("cuda:") or not index.isdigit() or (len(index) > 1 and index[0] == "0"):
            raise bad(f"{d!r} is not a device")
    if len(items) == 1:
        return (items[0],)
    for d in items:
        if d in ("auto", "cuda", "cuda:all"):
            raise bad(f"{d!r} cannot be part of a list (name each GPU: cuda:0,cuda:1)")
    if "cpu" in items and len(set(items)) > 1:
        raise bad("a list is all CPU (tests) or all cuda:N, not both")
    dupes = sorted({d for d in items if d != "cpu" and items.count(d) > 1})
    if dupes:
        raise bad(f"{', '.join(dupes)} named twice (one engine per GPU)")
    return tuple(items)


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and how.

    ``model`` is an official CosyVoice2 model directory, a hub repo id (fetched into
    ``cache_dir`` by ``voice-out download`` or on first use), or ``random:tiny`` /
    ``random:0.5b`` (random weights of the real architecture: noise, for pipeline checks and
    benchmarks).
    """

    model: str = DEFAULT_MODEL
    revision: str | None = None
    cache_dir: str = field(default_factory=_default_cache_dir)
    offline: bool = False
    #: One device, or several (``cuda:0,cuda:1``, ``cuda:all``): one engine each, utterances
    #: placed by load (docs/scale-out.md); see :func:`device_list`.
    device: str = "auto"
    #: With several devices: where their engines run (``ENGINE_PROCESSES``).
    engine_processes: str = "auto"
    dtype: DType = "bfloat16"
    #: Seed of the random-weights builder (``random:*`` models only).
    random_seed: int = 0

    def __post_init__(self) -> None:
        s = "model"
        _check(bool(self.model.strip()), s, "model", self.model, "a model directory, hub id or random:NAME")
        device_list(self.device)
        _check(
            self.engine_processes in ENGINE_PROCESSES,
            s,
            "engine_processes",
            self.engine_processes,
            f"one of {', '.join(ENGINE_PROCESSES)}",
        )
        _check(self.dtype in DTYPES, s, "dtype", self.dtype, f"one of {', '.join(DTYPES)}")
        _check(bool(self.cache_dir), s, "cache_dir", self.cache_dir, "a directory path")

    @property
    def devices(self) -> tuple[str, ...]:
        """:func:`device_list` of ``device``."""
        return device_list(self.device)


#: Engine keys that are no longer settings, and what replaced them: the fast path's choices
#: and sizes follow from ``engine.gpu_memory`` and the GPU (voice_out.fast.plan).
_PLANNED = "derived from engine.gpu_memory and the GPU (voice_out.fast.plan)"
REMOVED_ENGINE_KEYS: dict[str, str] = {
    "cuda_graphs": "engine.eager (eager = true for no CUDA graphs)",
    **{
        k: _PLANNED
        for k in (
            "fused_decode",
            "fused_linear",
            "dependent_launch",
            "fused_flow",
            "fused_vocoder",
            "graph_batch_buckets",
            "batched_input_rows",
            "max_chunks_per_step",
            "pipeline_vocode",
            "first_chunk_lane",
            "first_chunk_lane_max_playing",
            "capture_tokens",
            "capture_batch_tokens",
            "capture_voice_tokens",
            "first_chunk_prefix_voices",
            "flow_state_streams",
            "flow_state_tokens",
            "flow_state_max_hop_tokens",
            "step_ahead_rows",
            "first_audio_priority",
        )
    },
}


def parse_gpu_memory(value: float | str) -> tuple[str, float]:
    """``engine.gpu_memory`` -> ("gib", GiB) or ("fraction", share of the card in (0, 1]).

    A number above 1 (or any with the unit, "0.5 GiB") is GiB; a number in (0, 1] or a
    percentage is a share of the card.
    Raises ValueError saying what is accepted."""
    expected = 'GiB as a number (e.g. 22), or a share of the card ("0.8" or "80%")'
    if isinstance(value, bool):
        raise ValueError(f"expected {expected}")
    if isinstance(value, str):
        text = value.strip().lower()
        unit = text.endswith("gib")
        text = text.removesuffix("gib").strip()
        pct = text.endswith("%")
        try:
            number = float(text.removesuffix("%"))
        except ValueError:
            raise ValueError(f"expected {expected}") from None
        if pct:
            if not 0 < number <= 100:
                raise ValueError(f"a percentage must be in (0, 100]; expected {expected}")
            return "fraction", number / 100
        if unit and number > 0:
            return "gib", number
    else:
        number = float(value)
    if not number > 0 or number != number or number == float("inf"):
        raise ValueError(f"expected {expected}")
    return ("fraction", number) if number <= 1 else ("gib", number)


@dataclass(frozen=True)
class EngineConfig:
    """What a deployer sets for the GPU worker: its memory budget, limits, chunking, sampling.

    The GPU mechanics (CUDA graphs, Triton kernels, captured ranges, flow states, prompt
    prefixes) are not settings: the engine derives them from ``gpu_memory`` and the GPU
    (``voice_out.fast.plan``)."""

    #: Static KV-cache slots: the most streams that can decode at once.
    max_streams: int = 64
    #: Longest text (characters) one utterance may carry.
    max_text_chars: int = 4000
    #: Guard for a model that never stops: at most this many speech tokens per text token.
    max_speech_tokens_per_text_token: int = 20
    #: Speech tokens of the first token2wav chunk before the prompt pad (upstream: 25).
    first_hop_tokens: int = 25
    #: Largest token2wav hop (upstream: 100).
    max_hop_tokens: int = 100
    #: How the token2wav hop grows after each chunk: "buffered" (never more than the audio
    #: already made: 25, 25, 50, 100 ...; streams do not run dry when many share the GPU) or
    #: "double" (upstream's: 25, 50, 100 ...; the second chunk needs the LLM at twice real
    #: time per stream). voice_out.engine.chunk_schedule; docs/benchmarks.md has both measured.
    hop_growth: str = "buffered"
    #: Fast start: a first token2wav chunk of this many tokens (0 = off, upstream's schedule);
    #: earlier first audio, the first chunk only approximately equal to a single pass.
    fast_first_tokens: int = 0
    #: How far (seconds of audio) the engine may run ahead of the consumer.
    max_ahead_s: float = 4.0
    #: Device memory the engine may hold on its GPU, the whole process counted (CUDA context,
    #: ONNX Runtime, weights, caches, graphs): GiB as a number (``22``), or a share of the card
    #: as a fraction or percentage (``"0.8"``, ``"80%"``); unset: 90% of what is free when the
    #: engine starts. The engine plans every buffer to fit it (voice_out.fast.plan), lowering
    #: ``max_streams`` if it must, and enforces it (torch's per-process memory fraction).
    gpu_memory: float | str | None = None
    #: No fast path: plain PyTorch, no CUDA graphs, no Triton kernels (debugging, or a GPU the
    #: kernels do not support).
    eager: bool = False
    #: Nucleus / top-k / repetition-aware sampling parameters (spec 2.6).
    top_p: float = 0.8
    top_k: int = 25
    ras_win_size: int = 10
    ras_tau_r: float = 0.1
    #: Seed for per-stream sampling generators; None draws a fresh seed per stream.
    seed: int | None = None

    def __post_init__(self) -> None:
        s = "engine"
        _check(1 <= self.max_streams <= 4096, s, "max_streams", self.max_streams, "an integer in 1..4096")
        _check(self.max_text_chars >= 1, s, "max_text_chars", self.max_text_chars, "an integer >= 1")
        _check(
            self.max_speech_tokens_per_text_token >= 2,
            s,
            "max_speech_tokens_per_text_token",
            self.max_speech_tokens_per_text_token,
            "an integer >= 2",
        )
        _check(
            1 <= self.first_hop_tokens <= self.max_hop_tokens,
            s,
            "first_hop_tokens",
            self.first_hop_tokens,
            f"an integer in 1..max_hop_tokens ({self.max_hop_tokens})",
        )
        _check(
            self.hop_growth in HOP_GROWTHS,
            s,
            "hop_growth",
            self.hop_growth,
            " or ".join(f'"{g}"' for g in HOP_GROWTHS),
        )
        _check(
            0 <= self.fast_first_tokens < self.first_hop_tokens,
            s,
            "fast_first_tokens",
            self.fast_first_tokens,
            f"0 (off) or a number of tokens below first_hop_tokens ({self.first_hop_tokens})",
        )
        _check(self.max_ahead_s > 0, s, "max_ahead_s", self.max_ahead_s, "a positive number of seconds")
        if self.gpu_memory is not None:
            try:
                parse_gpu_memory(self.gpu_memory)
            except ValueError as e:
                raise ConfigError(f"engine.gpu_memory = {self.gpu_memory!r} is invalid: {e}") from None
        _check(0.0 < self.top_p <= 1.0, s, "top_p", self.top_p, "a number in (0, 1]")
        _check(self.top_k >= 1, s, "top_k", self.top_k, "an integer >= 1")
        _check(self.ras_win_size >= 1, s, "ras_win_size", self.ras_win_size, "an integer >= 1")
        _check(self.ras_tau_r > 0, s, "ras_tau_r", self.ras_tau_r, "a positive number")


#: A STUN/TURN URL as RFC 7064/7065 write it and both WebRTC stacks (aiortc, the browser)
#: read it: scheme, host name or IPv4 address, optional port, optional transport (TURN only).
ICE_URL = re.compile(
    r"(?P<scheme>stun|turns?):(?P<host>[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)"
    r"(?::(?P<port>[0-9]{1,5}))?(?:\?transport=(?P<transport>udp|tcp))?"
)


@dataclass(frozen=True)
class IceServer:
    """One STUN or TURN server for WebRTC's ICE (the fields of WebRTC's ``RTCIceServer``).

    ``urls``: ``stun:HOST[:PORT]``, ``turn:HOST[:PORT][?transport=udp|tcp]`` or
    ``turns:HOST[:PORT][?transport=tcp]`` (TURN over TLS). A server with a ``turn:``/``turns:``
    URL needs ``username`` and ``credential`` (coturn's long-term credentials). Validated by
    :class:`ServerConfig`, which knows its place in the list.
    """

    urls: tuple[str, ...]
    username: str | None = None
    credential: str | None = None

    def to_json(self) -> dict[str, object]:
        """The ``RTCIceServer`` dictionary a browser takes (credentials only where set)."""
        out: dict[str, object] = {"urls": list(self.urls)}
        if self.username is not None:
            out["username"] = self.username
        if self.credential is not None:
            out["credential"] = self.credential
        return out


def _check_ice_server(index: int, server: IceServer) -> None:
    where = f"server.ice_servers[{index}]"
    if not isinstance(server, IceServer):
        raise ConfigError(f"{where} = {server!r} is invalid: expected a table with urls, username, credential")
    if not server.urls:
        raise ConfigError(f"{where}.urls is empty: expected at least one stun:, turn: or turns: URL")
    turn = False
    for url in server.urls:
        m = ICE_URL.fullmatch(url) if isinstance(url, str) else None
        if m is None:
            raise ConfigError(
                f"{where}.urls: {url!r} is invalid: expected stun:HOST[:PORT], "
                "turn:HOST[:PORT][?transport=udp|tcp] or turns:HOST[:PORT][?transport=tcp] "
                "(a host name or IPv4 address)"
            )
        port = m.group("port")
        if port is not None and not 1 <= int(port) <= 65535:
            raise ConfigError(f"{where}.urls: {url!r} is invalid: the port must be in 1..65535")
        scheme, transport = m.group("scheme"), m.group("transport")
        if scheme == "stun" and transport is not None:
            raise ConfigError(f"{where}.urls: {url!r} is invalid: a stun: URL takes no transport")
        if scheme == "turns" and transport == "udp":
            # TURN over DTLS: neither aiortc nor Chromium speaks it
            raise ConfigError(f"{where}.urls: {url!r} is invalid: turns: (TLS) runs over TCP only")
        turn = turn or scheme != "stun"
    if turn:
        for name in ("username", "credential"):
            value = getattr(server, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(
                    f"{where}.{name} is missing: a TURN server ({', '.join(server.urls)}) needs username and credential"
                )


@dataclass(frozen=True)
class ServerConfig:
    """HTTP / WebRTC server, admission control and the voice store."""

    host: str = "127.0.0.1"
    port: int = 8080
    max_sessions: int = 32
    max_queued_utterances: int = 16
    #: When set, every route requires ``Authorization: Bearer <token>``.
    auth_token: str | None = None
    voices_dir: str = field(default_factory=lambda: str(Path(_default_cache_dir()) / "voices"))
    default_voice: str | None = None
    #: Serve the demo page at ``/``.
    serve_web: bool = True
    #: Duration of each audio frame (one Opus packet), ms: 10 or 20. New audio waits for the
    #: next frame time (half a frame on average), and so does the silence after a cancel, and
    #: Chromium's jitter buffer settles lower with 10 ms packets (20 ms against 30 ms on an
    #: H200). 20 halves the packets per second each session costs the event loop
    #: (docs/browser.md, "Frame size").
    frame_ms: int = 10
    #: STUN/TURN servers for WebRTC beyond the LAN: the server's peer connections gather
    #: candidates through them, and the demo page gets them from ``GET /ice-servers``. Empty:
    #: host candidates only (a LAN or this machine). docs/browser.md, "WebRTC through TURN".
    ice_servers: tuple[IceServer, ...] = ()
    #: Origins (``scheme://host[:port]``) besides the server's own whose pages may call the
    #: state-changing routes (every method but GET/HEAD/OPTIONS, and every WebSocket: POST
    #: /offer, POST/DELETE /voices, the control socket, the compatible APIs); ``*`` allows any.
    #: A browser names its page's origin in ``Origin``; requests without one (curl, an agent
    #: backend) are not browsers and pass.
    allowed_origins: tuple[str, ...] = ()
    #: A request body must keep arriving: at most this long without a byte (s), and an offer
    #: whole within it. Guards against bodies trickled to hold connections open.
    body_timeout_s: float = 20.0
    #: Where the engines run: ``local`` (in this process) or ``ray`` (replicas of a Ray Serve
    #: deployment started with ``voice-out ray-deploy``; docs/scale-out.md).
    engine: Literal["local", "ray"] = "local"
    #: ``engine = "ray"``: the Ray cluster to join (``auto``: the one on this host) and the
    #: Serve application holding the engines.
    ray_address: str = "auto"
    ray_app: str = "voice_out"

    def __post_init__(self) -> None:
        s = "server"
        for i, server in enumerate(self.ice_servers):
            _check_ice_server(i, server)
        for origin in self.allowed_origins:
            problem = origin_problem(origin)
            if problem is not None:
                raise ConfigError(
                    f"server.allowed_origins: {origin!r} is invalid: {problem} "
                    "(expected scheme://host[:port] with scheme http or https, or *)"
                )
        _check(0 < self.body_timeout_s <= 3600, s, "body_timeout_s", self.body_timeout_s, "seconds in (0, 3600]")
        _check(bool(self.ray_address), s, "ray_address", self.ray_address, "auto or a Ray address (ray://host:10001)")
        _check(bool(self.ray_app) and "/" not in self.ray_app, s, "ray_app", self.ray_app, "a Serve application name")
        _check(self.frame_ms in (10, 20), s, "frame_ms", self.frame_ms, "10 or 20")
        _check(0 <= self.port <= 65535, s, "port", self.port, "an integer in 0..65535")
        _check(bool(self.host), s, "host", self.host, "a host name or address")
        _check(1 <= self.max_sessions <= 10000, s, "max_sessions", self.max_sessions, "an integer in 1..10000")
        _check(
            self.max_queued_utterances >= 1,
            s,
            "max_queued_utterances",
            self.max_queued_utterances,
            "an integer >= 1",
        )
        _check(
            self.auth_token is None or len(self.auth_token) >= 8,
            s,
            "auth_token",
            "<hidden>",
            "at least 8 characters, or unset",
        )


def origin_problem(origin: str) -> str | None:
    """Why ``origin`` is not a web origin as a browser sends it in ``Origin`` (None: it is)."""
    if origin == "*":
        return None
    scheme, sep, rest = origin.partition("://")
    if not sep:
        return "no scheme"
    if scheme not in ("http", "https"):
        return f"scheme {scheme!r} is not http or https"
    if any(c in rest for c in "/?#@ \\"):
        return "an origin has no path, query, user or spaces"
    if origin != origin.lower():
        return "browsers send origins in lower case"
    try:
        parts = urlsplit(origin)
        port = parts.port  # raises on a port that is not a number in 0..65535
    except ValueError as e:
        return str(e)
    if not parts.hostname:
        return "no host"
    if port == 0:
        return "port 0"
    return None


@dataclass(frozen=True)
class Config:
    """The whole configuration: one frozen record per part."""

    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)


SECTIONS: dict[str, type[Any]] = {"model": ModelConfig, "engine": EngineConfig, "server": ServerConfig}


def _convert(section: str, name: str, tp: Any, raw: object) -> object:
    """Convert a raw value (TOML value or string from env/CLI) to the field's type."""
    where = f"{section}.{name}"
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", "none", "null")):
            return None
        for i, option in enumerate(non_none):  # the first type that takes the value
            try:
                return _convert(section, name, option, raw)
            except ConfigError:
                if i == len(non_none) - 1:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover
    if origin is Literal:
        if raw not in args:
            raise ConfigError(f"{where} = {raw!r} is invalid: expected one of {', '.join(map(str, args))}")
        return raw
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _convert_table(where, tp, raw)
    if origin is tuple:
        if isinstance(raw, str) and dataclasses.is_dataclass(args[0]):
            # a list of tables from the environment or --set: JSON
            try:
                raw = json.loads(raw) if raw.strip() else []
            except ValueError as e:
                raise ConfigError(f"{where} = {raw!r} is invalid: expected a JSON list of tables ({e})") from None
        if isinstance(raw, str):
            items: list[object] = [p.strip() for p in raw.split(",") if p.strip()]
        elif isinstance(raw, list | tuple):
            items = list(raw)
        else:
            raise ConfigError(f"{where} = {raw!r} is invalid: expected a list")
        if dataclasses.is_dataclass(args[0]):
            return tuple(_convert(section, f"{name}[{i}]", args[0], it) for i, it in enumerate(items))
        return tuple(_convert(section, name, args[0], it) for it in items)
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.strip().lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(raw, str) and raw.strip().lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where} = {raw!r} is invalid: expected true or false")
    if tp is int:
        if isinstance(raw, bool):
            raise ConfigError(f"{where} = {raw!r} is invalid: expected an integer")
        try:
            return int(raw) if isinstance(raw, int) else int(str(raw).strip())
        except ValueError:
            raise ConfigError(f"{where} = {raw!r} is invalid: expected an integer") from None
    if tp is float:
        if isinstance(raw, bool):
            raise ConfigError(f"{where} = {raw!r} is invalid: expected a number")
        try:
            return float(raw) if isinstance(raw, int | float) else float(str(raw).strip())
        except ValueError:
            raise ConfigError(f"{where} = {raw!r} is invalid: expected a number") from None
    if tp is str:
        if not isinstance(raw, str):
            raise ConfigError(f"{where} = {raw!r} is invalid: expected a string")
        return raw
    raise ConfigError(f"{where}: unsupported field type {tp!r}")  # pragma: no cover


def _convert_table(where: str, cls: type[Any], raw: object) -> object:
    """A TOML table (or JSON object) into the dataclass ``cls``; a single string for a
    tuple field (``urls = "stun:..."``) becomes a one-item tuple."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} = {raw!r} is invalid: expected a table of {', '.join(f.name for f in fields(cls))}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(known)}")
    kwargs: dict[str, object] = {}
    for name, value in raw.items():
        if typing.get_origin(hints[name]) is tuple and isinstance(value, str):
            value = [value]
        kwargs[name] = _convert(where, name, hints[name], value)
    missing = [f.name for f in fields(cls) if f.name not in kwargs and f.default is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where}: missing key(s) {', '.join(missing)}")
    return cls(**kwargs)


def _build(section: str, values: Mapping[str, object]) -> Any:
    cls = SECTIONS[section]
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    if section == "engine":
        _reject_removed(set(values))
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(
            f"unknown key(s) in [{section}]: {', '.join(unknown)}; known keys: {', '.join(sorted(known))}"
        )
    kwargs = {k: _convert(section, k, hints[k], v) for k, v in values.items()}
    return cls(**kwargs)


def _reject_removed(names: set[str]) -> None:
    removed = sorted(names & set(REMOVED_ENGINE_KEYS))
    if removed:
        k = removed[0]
        raise ConfigError(f"engine.{k} is no longer a setting: {REMOVED_ENGINE_KEYS[k]}")


def parse_overrides(items: list[str]) -> dict[str, dict[str, object]]:
    """Parse ``section.field=value`` strings (from ``--set``) into nested dicts."""
    out: dict[str, dict[str, object]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise ConfigError(f"--set {item!r}: expected SECTION.FIELD=VALUE, e.g. server.port=9000")
        if section not in SECTIONS:
            raise ConfigError(f"--set {item!r}: unknown section {section!r}; sections: {', '.join(SECTIONS)}")
        out.setdefault(section, {})[name] = value
    return out


def env_overrides(environ: Mapping[str, str]) -> dict[str, dict[str, object]]:
    """Collect ``VOICE_OUT_<SECTION>_<FIELD>`` variables."""
    out: dict[str, dict[str, object]] = {}
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        rest = key[len(ENV_PREFIX) :].lower()
        section, _, name = rest.partition("_")
        if section in SECTIONS and name:
            names = {f.name for f in fields(SECTIONS[section])}
            if section == "engine":
                _reject_removed({name})
            if name not in names:
                raise ConfigError(
                    f"environment variable {key}: {section} has no field {name!r}; known: {', '.join(sorted(names))}"
                )
            out.setdefault(section, {})[name] = value
    return out


def load_config(
    path: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, object]] | None = None,
) -> Config:
    """Load the configuration from a TOML file, the environment and overrides.

    ``path`` None means: ``$VOICE_OUT_CONFIG`` if set, else no file (defaults only).
    """
    env = dict(os.environ if environ is None else environ)
    if path is None and env.get("VOICE_OUT_CONFIG"):
        path = env["VOICE_OUT_CONFIG"]
    merged: dict[str, dict[str, object]] = {s: {} for s in SECTIONS}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
        for section, values in data.items():
            if section not in SECTIONS:
                raise ConfigError(
                    f"config file {str(p)!r}: unknown section [{section}]; sections: {', '.join(SECTIONS)}"
                )
            if not isinstance(values, dict):
                raise ConfigError(f"config file {str(p)!r}: [{section}] must be a table")
            merged[section].update(values)
    env.pop("VOICE_OUT_CONFIG", None)
    for layer in (env_overrides(env), overrides or {}):
        for section, values in layer.items():
            merged[section].update(values)
    return Config(**{s: _build(s, v) for s, v in merged.items()})


def replace(cfg: Config, section: str, **changes: Any) -> Config:
    """A copy of ``cfg`` with fields of one section changed (validated again)."""
    part = dataclasses.replace(getattr(cfg, section), **changes)
    return dataclasses.replace(cfg, **{section: part})
