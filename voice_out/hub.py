"""Model resolution: a directory, a hub id fetched into a cache, or random weights.

``resolve_model`` turns the ``model`` setting into a :class:`ModelSource`:

* an existing directory: used as is (it must hold ``cosyvoice2.yaml``);
* ``random:tiny`` / ``random:0.5b``: random weights of the real architecture (noise);
* anything else is a hub repo id (``owner/name``): looked up in the cache; when it is missing
  and we are online it is downloaded with ``huggingface_hub`` (with a progress bar), otherwise a
  :class:`ModelNotFoundError` names the fix.

Called from the main thread (CLI) or the server's start-up, never from the GPU worker.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from voice_out.errors import VoiceOutError

RANDOM_PREFIX = "random:"
RANDOM_PRESETS = ("tiny", "0.5b")
#: The files a CosyVoice2 directory needs for inference (the rest of the repo is skipped).
REQUIRED_FILES = (
    "cosyvoice2.yaml",
    "llm.pt",
    "flow.pt",
    "hift.pt",
    "campplus.onnx",
    "speech_tokenizer_v2.onnx",
    "CosyVoice-BlankEN/config.json",
    "CosyVoice-BlankEN/vocab.json",
    "CosyVoice-BlankEN/merges.txt",
    "CosyVoice-BlankEN/tokenizer_config.json",
)
ALLOW_PATTERNS = (
    "cosyvoice2.yaml",
    "*.pt",
    "campplus.onnx",
    "speech_tokenizer_v2.onnx",
    "CosyVoice-BlankEN/*.json",
    "CosyVoice-BlankEN/merges.txt",
)


class ModelNotFoundError(VoiceOutError):
    """The model could not be found or fetched; the message says how to fix it."""


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from: exactly one of ``path`` and ``random_preset`` is set."""

    spec: str
    path: Path | None = None
    random_preset: str | None = None

    @property
    def is_random(self) -> bool:
        return self.random_preset is not None


def missing_files(model_dir: Path) -> list[str]:
    """The required files that ``model_dir`` lacks."""
    return [f for f in REQUIRED_FILES if not (model_dir / f).is_file()]


def _first_line(e: BaseException) -> str:
    """The first non-empty line of an exception's message (hub errors span several lines)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


def _hub_cache(cache_dir: str) -> str:
    return str(Path(cache_dir) / "hub")


def download(repo_id: str, cache_dir: str, revision: str | None = None, endpoint: str | None = None) -> Path:
    """Download the inference files of ``repo_id`` into the cache; return the snapshot dir.

    Shows huggingface_hub's progress bars. Raises :class:`ModelNotFoundError` with the fix when
    the hub cannot be reached or the repo does not exist.
    """
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import HfHubHTTPError
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise ModelNotFoundError("huggingface_hub is not installed: pip install huggingface_hub") from e
    try:
        path = snapshot_download(
            repo_id=repo_id,
            revision=revision,
            cache_dir=_hub_cache(cache_dir),
            allow_patterns=list(ALLOW_PATTERNS),
            endpoint=endpoint,
        )
    except HfHubHTTPError as e:
        raise ModelNotFoundError(
            f"could not download {repo_id!r}: {_first_line(e)}. "
            "Check the id, or pass --model with a local CosyVoice2 directory."
        ) from None
    except OSError as e:
        raise ModelNotFoundError(
            f"could not download {repo_id!r} ({type(e).__name__}: {_first_line(e)}). Are you offline? Download it on a "
            f"connected machine with `voice-out download {repo_id} --cache-dir DIR` and copy DIR, or pass "
            "--model with a local CosyVoice2 directory."
        ) from None
    snapshot = Path(path)
    lacking = missing_files(snapshot)
    if lacking:
        raise ModelNotFoundError(
            f"{repo_id!r} was downloaded to {snapshot} but lacks {', '.join(lacking)}; is it a CosyVoice2 model repo?"
        )
    return snapshot


def cached_snapshot(repo_id: str, cache_dir: str, revision: str | None = None) -> Path | None:
    """The cached snapshot directory of ``repo_id`` if it is complete, else None (no network)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover
        return None
    try:
        path = Path(
            snapshot_download(
                repo_id=repo_id,
                revision=revision,
                cache_dir=_hub_cache(cache_dir),
                allow_patterns=list(ALLOW_PATTERNS),
                local_files_only=True,
            )
        )
    except Exception:  # noqa: BLE001 - any failure means "not in the cache"
        return None
    return path if not missing_files(path) else None


def resolve_model(
    spec: str,
    cache_dir: str,
    *,
    revision: str | None = None,
    offline: bool = False,
    allow_download: bool = True,
) -> ModelSource:
    """Resolve the ``model`` setting; may download (see the module docstring)."""
    spec = spec.strip()
    if spec.startswith(RANDOM_PREFIX):
        preset = spec[len(RANDOM_PREFIX) :]
        if preset not in RANDOM_PRESETS:
            raise ModelNotFoundError(
                f"unknown random model {spec!r}; choose one of " + ", ".join(RANDOM_PREFIX + p for p in RANDOM_PRESETS)
            )
        return ModelSource(spec=spec, random_preset=preset)
    local = Path(spec).expanduser()
    if local.is_dir():
        lacking = missing_files(local)
        if lacking:
            raise ModelNotFoundError(
                f"{str(local)!r} is not a complete CosyVoice2 model directory: it lacks {', '.join(lacking)}"
            )
        return ModelSource(spec=spec, path=local)
    looks_like_path = spec.startswith((".", "/", "~")) or os.sep in spec.replace("/", "", 1)
    if looks_like_path or spec.count("/") != 1:
        raise ModelNotFoundError(f"model {spec!r} is neither an existing directory nor a hub id of the form owner/name")
    snap = cached_snapshot(spec, cache_dir, revision)
    if snap is not None:
        return ModelSource(spec=spec, path=snap)
    offline = offline or os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
    if offline or not allow_download:
        raise ModelNotFoundError(
            f"model {spec!r} is not in the cache {str(Path(cache_dir))!r} and downloads are off. "
            f"Run `voice-out download {spec}` while online, or pass --model with a local CosyVoice2 directory."
        )
    return ModelSource(spec=spec, path=download(spec, cache_dir, revision))
