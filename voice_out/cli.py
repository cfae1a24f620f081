"""``voice-out``: serve | say | voices | bench | download | ray-deploy.

Every subcommand takes ``--config FILE`` and ``--set SECTION.FIELD=VALUE`` (repeatable), plus
its own flags. Errors a user can fix (bad config, missing model, unknown voice) print one line
prefixed ``voice-out: error:`` and exit with status 2; nothing prints a traceback for them.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from voice_out import __version__
from voice_out.config import DEFAULT_MODEL, Config, ConfigError, load_config, parse_overrides
from voice_out.errors import VoiceOutError
from voice_out.hub import ModelNotFoundError

#: What ``voices add`` accepts (voice_out.voices: MIN_PROMPT_S, MAX_PROMPT_S and
#: MAX_TRANSCRIPT_CHARS, which a test holds these to; not imported: ``--help`` stays fast).
PROMPT_SECONDS = "1 to 30"
TRANSCRIPT_CHARS = 1000


class UserError(VoiceOutError):
    """An error the user can fix; printed as one line without a traceback."""


class NotBuiltError(UserError):
    """A part of voice_out that this build does not have yet."""


LOG_LEVELS = ("debug", "info", "warning", "error")
#: Commands whose start-up (the memory plan, graph captures, kernel compiles) a user watches.
INFO_COMMANDS = frozenset({"serve", "bench", "ray-deploy"})


def log_level(args: argparse.Namespace) -> int:
    """The logging level of this command: ``--log-level``, else ``$VOICE_OUT_LOG_LEVEL``, else
    info for the long-running commands and warning for the others."""
    name = getattr(args, "log_level", None) or os.environ.get("VOICE_OUT_LOG_LEVEL", "").strip().lower()
    if name and name not in LOG_LEVELS:
        raise UserError(f"VOICE_OUT_LOG_LEVEL={name!r}: expected one of {', '.join(LOG_LEVELS)}")
    if not name:
        name = "info" if getattr(args, "command", None) in INFO_COMMANDS else "warning"
    return int(getattr(logging, name.upper()))


def configure_logging(level: int) -> None:
    """Log voice_out's records to stderr at ``level``, unless the process has configured
    logging itself (an application embedding the CLI keeps its handlers). aiohttp's access
    log stays at warning below debug: one line per request drowns the engine's."""
    root = logging.getLogger()
    if root.handlers:
        return
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if level > logging.DEBUG:
        logging.getLogger("aiohttp.access").setLevel(max(level, logging.WARNING))


def _common(p: argparse.ArgumentParser, *, nested: bool = False) -> None:
    """``--config`` and ``--set``. ``nested``: on an action's parser (``voices add``), so that
    they may follow the action too; they default to nothing there, leaving the values given
    before the action in place."""
    keep: dict[str, Any] = {"default": argparse.SUPPRESS} if nested else {}
    p.add_argument("--config", metavar="FILE", help="TOML config file (default: $VOICE_OUT_CONFIG or none)", **keep)
    p.add_argument(
        "--set",
        dest="overrides_after" if nested else "overrides",
        metavar="SECTION.FIELD=VALUE",
        action="append",
        default=argparse.SUPPRESS if nested else [],
        help="override one config value, e.g. --set server.port=9000 (repeatable)",
    )
    p.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        help="what the engine and server log to stderr (default: info for serve, bench and ray-deploy, "
        "warning otherwise; or $VOICE_OUT_LOG_LEVEL)",
        **keep,
    )


def _model_flags(p: argparse.ArgumentParser, *, nested: bool = False) -> None:
    keep: dict[str, Any] = {"default": argparse.SUPPRESS} if nested else {}
    p.add_argument(
        "--model",
        help=f"CosyVoice2 model directory, hub id (default {DEFAULT_MODEL}), or random:tiny / random:0.5b",
        **keep,
    )
    p.add_argument("--device", help="auto, cpu, cuda or cuda:N", **keep)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], **keep)


def _voices_dir_flag(p: argparse.ArgumentParser, *, nested: bool = False) -> None:
    keep: dict[str, Any] = {"default": argparse.SUPPRESS} if nested else {}
    p.add_argument("--voices-dir", dest="voices_dir", help="voice store directory (default: server.voices_dir)", **keep)


def load_cli_config(args: argparse.Namespace) -> Config:
    """Config from file + env + ``--set`` + the dedicated flags (highest priority)."""
    sets = [*(getattr(args, "overrides", None) or []), *(getattr(args, "overrides_after", None) or [])]
    over = parse_overrides(sets)
    for flag, (sec, name) in {
        "model": ("model", "model"),
        "device": ("model", "device"),
        "dtype": ("model", "dtype"),
        "cache_dir": ("model", "cache_dir"),
        "host": ("server", "host"),
        "port": ("server", "port"),
        "voices_dir": ("server", "voices_dir"),
        "engine": ("server", "engine"),
        "default_voice": ("server", "default_voice"),
    }.items():
        value = getattr(args, flag, None)
        if value is not None:
            over.setdefault(sec, {})[name] = value
    return load_config(getattr(args, "config", None), overrides=over)


# --------------------------------------------------------------------------------------------
# Subcommands. Each one imports its part lazily so that `--help` stays fast.


def _part(module: str, attr: str, what: str) -> Callable[..., int]:
    """Import ``module.attr`` or say in one line that this part is not built yet."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
            raise NotBuiltError(f"{what} is not built yet in this version of voice_out") from None
        raise
    func: Callable[..., int] | None = getattr(mod, attr, None)
    if func is None:
        raise NotBuiltError(f"{what} is not built yet in this version of voice_out")
    return func


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = load_cli_config(args)
    return _part("voice_out.server.app", "serve", "the server")(cfg)


def cmd_say(args: argparse.Namespace) -> int:
    cfg = load_cli_config(args)
    return _part("voice_out.engine.say", "say", "`say` (the streaming engine)")(cfg, args)


def cmd_voices(args: argparse.Namespace) -> int:
    cfg = load_cli_config(args)
    return _part("voice_out.voices.cli", "voices_command", "the voice store")(cfg, args)


def cmd_bench(args: argparse.Namespace) -> int:
    cfg = load_cli_config(args)
    return _part("voice_out.bench", "bench", "the benchmark suite")(cfg, args)


def cmd_ray_deploy(args: argparse.Namespace) -> int:
    cfg = load_cli_config(args)
    return _part("voice_out.engine.ray_serve.deploy_cli", "ray_deploy", "`ray-deploy` (the ray extra)")(cfg, args)


def cmd_download(args: argparse.Namespace) -> int:
    from voice_out.hub import download

    cfg = load_cli_config(args)
    repo = args.repo or cfg.model.model
    if repo.startswith("random:"):
        raise UserError(f"{repo} is built locally from random weights; there is nothing to download")
    path = download(repo, cfg.model.cache_dir, args.revision or cfg.model.revision, endpoint=args.endpoint)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="voice-out",
        description="voice_out: streaming CosyVoice2 speech for conversational agents, over WebRTC.",
    )
    parser.add_argument("--version", action="version", version=f"voice_out {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("serve", help="start the WebRTC server and demo page")
    _common(p)
    _model_flags(p)
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8080)")
    p.add_argument(
        "--voice",
        dest="default_voice",
        metavar="NAME",
        help="the default voice, for utterances that name none (server.default_voice; must be registered)",
    )
    p.add_argument("--voices-dir", dest="voices_dir", help="voice store directory")
    p.add_argument("--engine", choices=["local", "ray"], help="engines in this process or in Ray Serve replicas")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("ray-deploy", help="deploy the engines as a Ray Serve application (one replica per GPU)")
    _common(p)
    _model_flags(p)
    p.add_argument("--voices-dir", dest="voices_dir", help="voice store directory every replica can read")
    p.add_argument("--address", help="the Ray cluster (default: server.ray_address)")
    p.add_argument("--app", help="Serve application name (default: server.ray_app)")
    p.add_argument("--replicas", type=int, help="a fixed number of replicas (default: autoscale)")
    p.add_argument("--min-replicas", type=int, default=1, help="autoscaling: at least this many (default 1)")
    p.add_argument("--max-replicas", type=int, default=8, help="autoscaling: at most this many (default 8)")
    p.add_argument("--target-streams", type=float, default=16.0, help="autoscaling: streams per replica (default 16)")
    p.add_argument(
        "--upscale-delay-s", type=float, default=30.0, help="autoscaling: seconds of demand before adding (30)"
    )
    p.add_argument(
        "--downscale-delay-s", type=float, default=600.0, help="autoscaling: seconds of slack before removing (600)"
    )
    p.add_argument("--num-gpus", type=float, default=1.0, help="GPUs per replica (default 1; 0 runs on CPUs)")
    p.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per replica (default 1)")
    p.set_defaults(func=cmd_ray_deploy)

    p = sub.add_parser("say", help="speak text to a WAV file")
    _common(p)
    _model_flags(p)
    p.add_argument("text", nargs="?", help="text to speak (omit with --stream)")
    p.add_argument("--voice", help="registered voice name (default: server.default_voice)")
    p.add_argument("-o", "--output", default="out.wav", help="output WAV file (default out.wav)")
    p.add_argument("--stream", action="store_true", help="read text deltas from stdin as they arrive")
    p.add_argument("--voices-dir", dest="voices_dir", help="voice store directory")
    p.set_defaults(func=cmd_say)

    p = sub.add_parser(
        "voices",
        help="add, list or remove registered voices",
        description="Options go before or after the action: voice-out voices add NAME AUDIO TEXT --voices-dir DIR",
    )
    _common(p)
    _model_flags(p)
    _voices_dir_flag(p)
    vsub = p.add_subparsers(dest="voices_command", metavar="ACTION", required=True)
    a = vsub.add_parser(
        "add",
        help="register a voice from an audio file and its transcript",
        description=(
            "Register a voice: its prompt features are extracted once (this needs the model's prompt "
            "networks: a CosyVoice2 model directory or hub id, not random:*) and stored under the "
            "voices directory."
        ),
    )
    a.add_argument("name", help="letters, digits, '_', '.' and '-', at most 64 characters, starting alphanumeric")
    a.add_argument(
        "audio",
        help=f"prompt audio (wav, flac, mp3, ogg, ...) of one speaker, {PROMPT_SECONDS} s long "
        "(3 to 10 s of clear speech works best)",
    )
    a.add_argument("transcript", help=f"exactly what is said in the audio (at most {TRANSCRIPT_CHARS} characters)")
    lst = vsub.add_parser("list", help="list registered voices")
    r = vsub.add_parser("rm", help="remove a voice")
    r.add_argument("name")
    for action in (a, lst, r):
        _common(action, nested=True)
        _model_flags(action, nested=True)
        _voices_dir_flag(action, nested=True)
    p.set_defaults(func=cmd_voices)

    p = sub.add_parser("bench", help="measure latency and capacity")
    _common(p)
    _model_flags(p)
    p.add_argument(
        "--mode",
        choices=["engine", "webrtc", "placement"],
        default="engine",
        help="engine: one in-process engine; webrtc: the server and a client; placement: capacity through "
        "the placement layer on one GPU and on every device of --device (e.g. cuda:0,cuda:1)",
    )
    p.add_argument(
        "--streams",
        help="comma-separated stream counts (default 1,2,4,8,16,32,48,64); placement mode: the first count per GPU "
        "(default 20)",
    )
    p.add_argument("--out", help="write JSON results here")
    p.add_argument("--quick", action="store_true", help="small repetitions and short texts (a CPU smoke run)")
    p.add_argument(
        "--reps", type=int, help="repetitions of each TTFA measurement (default 30; webrtc 10; placement: searches, 3)"
    )
    p.add_argument("--step", type=int, help="placement mode: streams between two rounds of a search (default 2)")
    p.add_argument(
        "--engine-processes",
        help="placement mode: the designs to measure, per_device and/or shared (default per_device)",
    )
    p.add_argument("--budget-s", type=float, help="placement mode: start no capacity round after this many seconds")
    p.add_argument("--tokens-per-text-token", type=int, help="forced speech tokens per text token (default 3)")
    p.add_argument("--ttfa-target-ms", type=float, help="p95 TTFA target of the capacity sweep (default 150)")
    p.add_argument("--text-rates", help="text arrival rates in text tokens/s (default 20,60)")
    p.add_argument("--scenarios", help="engine scenarios (default cold,ttfa,stream,capacity,rtf,memory)")
    p.add_argument("--ramp-s", type=float, help="capacity streams start spread over this many seconds (default 1)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument(
        "--gpu-memory",
        metavar="GIB",
        help='engine.gpu_memory: GiB (22), or a share of the card ("0.8", "80%%"); the engine plans within it '
        "and caps torch's allocator at it",
    )
    p.add_argument(
        "--pin",
        action="append",
        metavar="NAME=VALUE",
        help="set one fast-path plan choice by hand (voice_out.fast.plan.Plan field, or capability=8.9); repeatable",
    )
    p.add_argument("--url", help="webrtc mode: measure this running server instead of starting one")
    p.add_argument("--voice", help="webrtc mode: the voice the utterances name (default: the server's)")
    p.add_argument(
        "--fast-first",
        type=int,
        metavar="N",
        help='webrtc mode: each utterance asks for a fast first chunk of N speech tokens ("fast_first")',
    )
    p.add_argument(
        "--client",
        choices=["aiortc", "chromium"],
        help="webrtc mode: who listens, the aiortc client (default) or the demo page in headless Chromium",
    )
    p.add_argument("--chromium", metavar="PATH", help="webrtc mode, --client chromium: the browser binary")
    p.add_argument("--update-docs", action="store_true", help="append the run to docs/results.jsonl (the history)")
    p.add_argument("--history", metavar="METRIC", help="print every recorded value of METRIC; measure nothing")
    p.add_argument("--history-gpu", metavar="NAME", help="--history: only runs on GPUs whose name contains NAME")
    p.add_argument("--from-json", metavar="FILE", help="report a result written by --out elsewhere; measure nothing")
    p.add_argument("--docs-dir", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("download", help="fetch a model from the hub into the cache")
    _common(p)
    p.add_argument("repo", nargs="?", help=f"hub id (default: the configured model, {DEFAULT_MODEL})")
    p.add_argument("--revision", help="branch, tag or commit")
    p.add_argument("--cache-dir", dest="cache_dir", help="cache directory (default ~/.cache/voice_out)")
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_download)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the exact command, for reports
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        configure_logging(log_level(args))
        return func(args)
    except (VoiceOutError, ConfigError, ModelNotFoundError) as e:
        print(f"voice-out: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
