"""``voice-out voices add NAME AUDIO TRANSCRIPT | list | rm NAME``.

Runs on the CLI's main thread. Errors are :class:`~voice_out.errors.VoiceOutError` subclasses;
the CLI prints them as one line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from voice_out.config import Config
from voice_out.hub import resolve_model
from voice_out.voices.errors import PromptModelUnavailableError, UnsupportedAudioError
from voice_out.voices.store import ADD_HINT, VoiceStore

_TRANSCRIPT_WIDTH = 48


def _model_dir(cfg: Config) -> Path:
    source = resolve_model(
        cfg.model.model,
        cfg.model.cache_dir,
        revision=cfg.model.revision,
        offline=cfg.model.offline,
    )
    if source.path is None:
        raise PromptModelUnavailableError(
            f"model {source.spec} has random weights and no prompt networks (speech_tokenizer_v2.onnx, "
            "campplus.onnx); pass --model with a CosyVoice2 model directory or hub id to add voices"
        )
    return source.path


def _short(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def voices_command(cfg: Config, args: argparse.Namespace) -> int:
    """Entry point of ``voice-out voices``; returns the exit status."""
    directory = Path(cfg.server.voices_dir).expanduser()
    action = args.voices_command
    if action == "add":
        # Cheap checks first: a typo should not wait for (or trigger) a model download.
        VoiceStore(directory, None).check_new(args.name, args.transcript)
        if not Path(args.audio).expanduser().is_file():
            raise UnsupportedAudioError(f"audio file {args.audio!r} does not exist or is not a file")
        store = VoiceStore(directory, _model_dir(cfg))
        voice = store.add(args.name, args.audio, args.transcript)
        info = voice.info
        cut = f", flow prompt cut to {info.n_flow_tokens}" if info.n_flow_tokens != info.n_tokens_aligned else ""
        print(
            f"added voice {info.name!r}: {info.duration_s:.2f} s at {info.sample_rate} Hz "
            f"({info.source_format}), {info.n_tokens_aligned} prompt tokens{cut}"
        )
        return 0
    store = VoiceStore(directory, None)
    if action == "list":
        voices = store.list()
        if not voices:
            print(f"no voices in {directory}; {ADD_HINT}")
            return 0
        width = max(4, *(len(v.name) for v in voices))
        print(f"{'NAME':<{width}}  {'SECONDS':>7}  {'TOKENS':>6}  {'CREATED':<25}  TRANSCRIPT")
        for v in voices:
            print(
                f"{v.name:<{width}}  {v.duration_s:>7.2f}  {v.n_flow_tokens:>6}  {v.created_at:<25}  "
                f"{_short(v.transcript, _TRANSCRIPT_WIDTH)}"
            )
        return 0
    if action == "rm":
        store.delete(args.name)
        print(f"removed voice {args.name!r}")
        return 0
    raise ValueError(f"unknown voices action {action!r}")  # argparse restricts the choices
