"""The persistent voice store: named zero-shot prompts, extracted once and kept on disk.

Layout under the store directory (one subdirectory per voice)::

    <dir>/<name>/voice.json          manifest: name, transcript, lengths, created_at, fingerprint
    <dir>/<name>/prompt.pt           torch.save({llm_prompt_tokens, flow_prompt_tokens,
                                                 prompt_mel, embedding}) (read with weights_only)
    <dir>/<name>/source.audio        the uploaded audio as given (to re-extract with a new model)
    <dir>/<name>/engine_state/<key>.pt   optional tensors the engine attaches (see below)
    <dir>/.tmp-*, <dir>/.trash-*     in-flight writes and deletes (never listed; cleaned on open)

Atomicity: a voice is written completely into a ``.tmp-`` directory (files fsynced), then moved
into place with one ``rename``; deletes rename it away first. A crash leaves the voice either
fully present or absent; leftovers are removed (or a replaced voice restored) when a store is
opened.

The 25-token cut (``cut_to_token_block``, default on): the flow prompt is shortened to a whole
number of 25-token streaming chunks, dropping tokens (and 2 mel frames each) from the START, so
the streaming first chunk needs no pad and the prompt still ends where the generated speech
begins. The LLM prompt keeps every aligned token, since its transcript covers all of the audio.

Threads: every method may be called from any thread; a lock guards the in-memory cache and the
rename step, and prompt extraction is serialised by the extractor. Methods block (file I/O,
ONNX), so the server calls them through ``run_in_executor``; the GPU worker only calls
:meth:`VoiceStore.get` (a ``stat`` plus a cache hit) or, better, is handed :class:`Voice` objects.
Several processes may share a directory (e.g. ``voice-out voices add`` while a server runs):
:meth:`get` notices voices added, replaced or removed by others.
"""

from __future__ import annotations

import builtins
import hashlib
import io
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from voice_out.engine.api import NoVoiceError, UnknownVoiceError
from voice_out.voices.audio import AudioSource, decode_audio
from voice_out.voices.errors import (
    AudioTooLongError,
    AudioTooShortError,
    EmptyTranscriptError,
    IncompatibleVoiceError,
    InvalidVoiceNameError,
    PromptModelUnavailableError,
    TranscriptTooLongError,
    UnsupportedAudioError,
    VoiceExistsError,
    VoiceStoreCorruptError,
    VoiceStoreWriteError,
)
from voice_out.voices.onnx import MAX_PROMPT_S
from voice_out.voices.prompt import MIN_PROMPT_S, ExtractedPrompt, PromptExtractor, check_prompt_audio

log = logging.getLogger(__name__)

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
FORMAT_VERSION = 1
MANIFEST_FILE = "voice.json"
TENSORS_FILE = "prompt.pt"
SOURCE_FILE = "source.audio"
ENGINE_STATE_DIR = "engine_state"
#: Streaming chunk of the flow, in speech tokens: the flow prompt is cut to a multiple of this.
TOKEN_BLOCK = 25
MAX_TRANSCRIPT_CHARS = 1000
ADD_HINT = 'add one with `voice-out voices add NAME AUDIO "TRANSCRIPT"` or POST /voices'

Normalizer = Callable[[str], str]


def validate_name(name: object, what: str = "voice name") -> str:
    """Return ``name`` if it is a valid voice (or engine-state key) name, else raise."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidVoiceNameError(
            f"invalid {what} {name!r}: use 1-64 characters from A-Z a-z 0-9 _ . -, starting with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class VoiceInfo:
    """The manifest of a stored voice (no tensors). ``created_at`` is ISO 8601 UTC."""

    name: str
    transcript: str
    normalized_transcript: str | None
    duration_s: float
    sample_rate: int
    source_format: str
    created_at: str
    model_fingerprint: str
    #: Tokens the speech tokenizer produced, mel frames of the prompt mel (before alignment).
    n_tokens_raw: int
    n_mel_frames_raw: int
    #: K = min(mel frames // 2, tokens): the LLM prompt tokens.
    n_tokens_aligned: int
    #: P: the flow prompt tokens (K, or K cut down to a multiple of 25).
    n_flow_tokens: int
    cut_to_token_block: bool
    embedding_dim: int
    engine_state_keys: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict (what ``GET /voices`` returns per voice)."""
        return {
            "name": self.name,
            "transcript": self.transcript,
            "normalized_transcript": self.normalized_transcript,
            "duration_s": round(self.duration_s, 3),
            "sample_rate": self.sample_rate,
            "source_format": self.source_format,
            "created_at": self.created_at,
            "model_fingerprint": self.model_fingerprint,
            "n_tokens_raw": self.n_tokens_raw,
            "n_mel_frames_raw": self.n_mel_frames_raw,
            "n_tokens_aligned": self.n_tokens_aligned,
            "n_flow_tokens": self.n_flow_tokens,
            "cut_to_token_block": self.cut_to_token_block,
            "embedding_dim": self.embedding_dim,
            "engine_state_keys": list(self.engine_state_keys),
        }


@dataclass(frozen=True, eq=False)
class Voice:
    """A stored voice: everything the model needs. Treat the tensors as read-only (shared).

    * ``llm_prompt_tokens`` int32 [K]: prompt speech tokens for the LLM (all aligned tokens);
    * ``flow_prompt_tokens`` int32 [P]: the last P of them, P = K or K cut to a multiple of 25;
    * ``prompt_mel`` float32 [2P, 80]: the prompt mel matching ``flow_prompt_tokens``;
    * ``embedding`` float32 [D] (D = 192): the x-vector (not normalised; the flow does that).
    """

    info: VoiceInfo
    llm_prompt_tokens: torch.Tensor
    flow_prompt_tokens: torch.Tensor
    prompt_mel: torch.Tensor
    embedding: torch.Tensor
    #: Absolute path of the voice's directory (for diagnostics).
    path: Path = field(default=Path())

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def prompt_text(self) -> str:
        """The transcript the LLM should see: normalised when a normaliser was given."""
        return self.info.normalized_transcript or self.info.transcript

    def model_inputs(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """Batch-1 prompt tensors under the reference zero-shot input names (spec 6.8).

        ``llm_prompt_speech_token`` int32 [1, K], ``flow_prompt_speech_token`` int32 [1, P],
        ``prompt_speech_feat`` float32 [1, 2P, 80], ``llm_embedding`` = ``flow_embedding``
        float32 [1, D], and the ``*_len`` int32 [1] companions. New tensors on ``device``.
        """

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.unsqueeze(0).to(device=device, copy=True)

        def length(n: int) -> torch.Tensor:
            return torch.tensor([n], dtype=torch.int32, device=device)

        emb = put(self.embedding)
        return {
            "llm_prompt_speech_token": put(self.llm_prompt_tokens),
            "llm_prompt_speech_token_len": length(self.llm_prompt_tokens.shape[0]),
            "flow_prompt_speech_token": put(self.flow_prompt_tokens),
            "flow_prompt_speech_token_len": length(self.flow_prompt_tokens.shape[0]),
            "prompt_speech_feat": put(self.prompt_mel),
            "prompt_speech_feat_len": length(self.prompt_mel.shape[0]),
            "llm_embedding": emb,
            "flow_embedding": emb.clone(),
        }


def cut_prompt(prompt: ExtractedPrompt, cut_to_token_block: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(llm tokens [K], flow tokens [P], prompt mel [2P, 80]) from an aligned prompt.

    With the cut, P = K - K % 25 and the first K - P tokens (2 mel frames each) are dropped.
    """
    k = prompt.n_tokens
    p = k - k % TOKEN_BLOCK if cut_to_token_block else k
    if p <= 0:
        raise AudioTooShortError(
            f"only {k} speech tokens could be extracted from the prompt; at least {TOKEN_BLOCK} "
            f"(1 s of speech) are needed"
        )
    drop = k - p
    llm_tokens = prompt.speech_tokens.to(torch.int32).contiguous().clone()
    flow_tokens = llm_tokens[drop:].clone()
    mel = prompt.prompt_mel[2 * drop : 2 * k].to(torch.float32).contiguous().clone()
    return llm_tokens, flow_tokens, mel


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _tensor_bytes(tensors: Mapping[str, torch.Tensor]) -> bytes:
    buf = io.BytesIO()
    torch.save({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, buf)
    return buf.getvalue()


class VoiceStore:
    """Named voices under ``directory`` (created if missing). See the module docstring.

    ``extractor``: a model directory (its ``speech_tokenizer_v2.onnx`` and ``campplus.onnx``),
    a :class:`PromptExtractor`, or None for a read-only store (``add`` then raises
    :class:`PromptModelUnavailableError`, e.g. with ``random:*`` models).
    ``normalizer`` turns a transcript into the text the LLM sees (stored beside the original).
    ``check_fingerprint``: :meth:`get` refuses voices extracted with other prompt networks.
    """

    def __init__(
        self,
        directory: str | Path,
        extractor: str | Path | PromptExtractor | None = None,
        *,
        cut_to_token_block: bool = True,
        normalizer: Normalizer | None = None,
        check_fingerprint: bool = True,
        min_duration_s: float = MIN_PROMPT_S,
        max_duration_s: float = MAX_PROMPT_S,
    ) -> None:
        self.directory = Path(directory).expanduser()
        if extractor is None or isinstance(extractor, PromptExtractor):
            self.extractor = extractor
        else:
            self.extractor = PromptExtractor(extractor)
        self.cut_to_token_block = cut_to_token_block
        self.normalizer = normalizer
        self.check_fingerprint = check_fingerprint
        self.min_duration_s = min_duration_s
        self.max_duration_s = min(max_duration_s, MAX_PROMPT_S)
        self._lock = threading.RLock()
        # name -> ((inode, mtime_ns, size) of voice.json, Voice)
        self._cache: dict[str, tuple[tuple[int, int, int], Voice]] = {}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise VoiceStoreWriteError(
                f"cannot create the voice store directory {str(self.directory)!r}: {e}"
            ) from None
        self._recover()
        if self.extractor is not None and check_fingerprint:
            # Hash the prompt networks now (about 1 s for the real model, once per process), so
            # that get() never pays for it on a latency-sensitive thread.
            _ = self.extractor.fingerprint

    # ----------------------------------------------------------------------------------------
    # housekeeping

    def _recover(self) -> None:
        """Finish what a crash interrupted: drop partial writes, restore half-replaced voices."""
        for entry in sorted(self.directory.iterdir()):
            if entry.name.startswith(".tmp-"):
                shutil.rmtree(entry, ignore_errors=True)
            elif entry.name.startswith(".trash-"):
                # .trash-<name>-<hex>-<op>: "r" = moved aside by a replace, "d" = a delete.
                parts = entry.name[len(".trash-") :].rsplit("-", 2)
                target = self.directory / parts[0] if len(parts) == 3 else None
                if target is not None and parts[2] == "r" and not target.exists():
                    try:
                        os.rename(entry, target)
                        continue
                    except OSError:
                        pass
                shutil.rmtree(entry, ignore_errors=True)

    def _voice_dir(self, name: str) -> Path:
        return self.directory / validate_name(name)

    @property
    def fingerprint(self) -> str | None:
        """Fingerprint of the loaded prompt networks (None for a read-only store)."""
        return self.extractor.fingerprint if self.extractor is not None else None

    # ----------------------------------------------------------------------------------------
    # add

    def add(
        self,
        name: str,
        audio: AudioSource,
        transcript: str,
        *,
        replace: bool = False,
    ) -> Voice:
        """Register a voice from prompt audio (path or bytes, any common format) and its transcript.

        Raises :class:`InvalidVoiceNameError`, :class:`VoiceExistsError` (unless ``replace``),
        :class:`EmptyTranscriptError` / :class:`TranscriptTooLongError`, an
        :class:`~voice_out.voices.errors.AudioError` subclass for unusable audio, or
        :class:`PromptModelUnavailableError`. On any error nothing is written.
        """
        text = self.check_new(name, transcript, replace=replace)
        if self.extractor is None:
            raise PromptModelUnavailableError(
                "this model has no prompt networks (speech_tokenizer_v2.onnx, campplus.onnx), so voices cannot "
                "be added with it; use a CosyVoice2 model directory"
            )
        source_bytes = self._read_source(audio)
        decoded = decode_audio(source_bytes, max_duration_s=self.max_duration_s)
        if decoded.truncated:
            raise AudioTooLongError(
                f"the prompt is longer than {decoded.duration_s:.0f} s; at most {self.max_duration_s:g} s is accepted"
            )
        check_prompt_audio(
            decoded.samples,
            decoded.sample_rate,
            min_duration_s=self.min_duration_s,
            max_duration_s=self.max_duration_s,
        )
        prompt = self.extractor.extract(decoded.samples, decoded.sample_rate)
        llm_tokens, flow_tokens, mel = cut_prompt(prompt, self.cut_to_token_block)
        normalized = self.normalizer(text) if self.normalizer is not None else None
        info = VoiceInfo(
            name=name,
            transcript=text,
            normalized_transcript=normalized,
            duration_s=decoded.duration_s,
            sample_rate=decoded.sample_rate,
            source_format=f"{decoded.container}/{decoded.codec}",
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
            model_fingerprint=self.extractor.fingerprint,
            n_tokens_raw=prompt.n_tokens_raw,
            n_mel_frames_raw=prompt.n_mel_frames_raw,
            n_tokens_aligned=prompt.n_tokens,
            n_flow_tokens=int(flow_tokens.shape[0]),
            cut_to_token_block=self.cut_to_token_block,
            embedding_dim=int(prompt.embedding.shape[0]),
        )
        tensors = {
            "llm_prompt_tokens": llm_tokens,
            "flow_prompt_tokens": flow_tokens,
            "prompt_mel": mel,
            "embedding": prompt.embedding.to(torch.float32),
        }
        self._commit(name, info, tensors, source_bytes, replace=replace)
        return self.get(name)

    def check_new(self, name: str, transcript: str, *, replace: bool = False) -> str:
        """Validate an add request's name and transcript cheaply (before any audio work).

        Returns the cleaned transcript; raises like :meth:`add`.
        """
        validate_name(name)
        text = self._check_transcript(transcript)
        if not replace and (self.directory / name).exists():
            raise VoiceExistsError(f"a voice named {name!r} already exists; remove it first or choose another name")
        return text

    def _check_transcript(self, transcript: object) -> str:
        if not isinstance(transcript, str) or not transcript.strip():
            raise EmptyTranscriptError("the transcript is empty: give the exact words spoken in the prompt audio")
        text = transcript.strip()
        if len(text) > MAX_TRANSCRIPT_CHARS:
            raise TranscriptTooLongError(
                f"the transcript has {len(text)} characters; at most {MAX_TRANSCRIPT_CHARS} are accepted"
            )
        return text

    @staticmethod
    def _read_source(audio: AudioSource) -> bytes:
        if isinstance(audio, bytes | bytearray | memoryview):
            return bytes(audio)
        path = Path(audio).expanduser()
        if not path.is_file():
            raise UnsupportedAudioError(f"audio file {str(path)!r} does not exist or is not a file")
        # Bounded read: a 30 s prompt is at most a few MB even as 32-bit float 96 kHz stereo.
        limit = 64 << 20
        if path.stat().st_size > limit:
            raise AudioTooLongError(f"audio file {str(path)!r} is larger than {limit >> 20} MB")
        return path.read_bytes()

    def _commit(
        self,
        name: str,
        info: VoiceInfo,
        tensors: Mapping[str, torch.Tensor],
        source_bytes: bytes,
        *,
        replace: bool,
    ) -> None:
        """Write a complete voice into a temp dir, then rename it into place."""
        token = uuid.uuid4().hex[:12]
        tmp = self.directory / f".tmp-{name}-{token}"
        try:
            try:
                tmp.mkdir()
                tensor_bytes = _tensor_bytes(tensors)
                _write_file(tmp / TENSORS_FILE, tensor_bytes)
                _write_file(tmp / SOURCE_FILE, source_bytes)
                manifest = {"format": FORMAT_VERSION, **info.to_json()}
                manifest["duration_s"] = info.duration_s
                manifest["tensors_sha256"] = hashlib.sha256(tensor_bytes).hexdigest()
                text = json.dumps(manifest, ensure_ascii=False, indent=2)
                _write_file(tmp / MANIFEST_FILE, text.encode("utf-8"))
                _fsync_dir(tmp)
            except OSError as e:
                raise VoiceStoreWriteError(f"cannot write voice {name!r} in {self.directory}: {e}") from None
            final = self.directory / name
            with self._lock:
                trash: Path | None = None
                if final.exists():
                    if not replace:
                        raise VoiceExistsError(f"a voice named {name!r} already exists")
                    trash = self.directory / f".trash-{name}-{token}-r"
                    os.rename(final, trash)
                try:
                    os.rename(tmp, final)
                except OSError as e:
                    if trash is not None:
                        os.rename(trash, final)  # put the old voice back
                    elif final.exists():  # another process won the race
                        raise VoiceExistsError(f"a voice named {name!r} already exists") from None
                    raise VoiceStoreWriteError(f"cannot store voice {name!r} in {self.directory}: {e}") from None
                _fsync_dir(self.directory)
                self._cache.pop(name, None)
            if trash is not None:
                shutil.rmtree(trash, ignore_errors=True)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    # ----------------------------------------------------------------------------------------
    # read

    def _read_info(self, vdir: Path) -> VoiceInfo:
        try:
            raw = json.loads((vdir / MANIFEST_FILE).read_text(encoding="utf-8"))
            if raw.get("format") != FORMAT_VERSION:
                raise ValueError(f"unknown format {raw.get('format')!r}")
            state_dir = vdir / ENGINE_STATE_DIR
            keys = tuple(sorted(p.stem for p in state_dir.glob("*.pt"))) if state_dir.is_dir() else ()
            return VoiceInfo(
                name=str(raw["name"]),
                transcript=str(raw["transcript"]),
                normalized_transcript=raw.get("normalized_transcript"),
                duration_s=float(raw["duration_s"]),
                sample_rate=int(raw["sample_rate"]),
                source_format=str(raw.get("source_format", "")),
                created_at=str(raw["created_at"]),
                model_fingerprint=str(raw["model_fingerprint"]),
                n_tokens_raw=int(raw["n_tokens_raw"]),
                n_mel_frames_raw=int(raw["n_mel_frames_raw"]),
                n_tokens_aligned=int(raw["n_tokens_aligned"]),
                n_flow_tokens=int(raw["n_flow_tokens"]),
                cut_to_token_block=bool(raw["cut_to_token_block"]),
                embedding_dim=int(raw["embedding_dim"]),
                engine_state_keys=keys,
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise VoiceStoreCorruptError(
                f"voice {vdir.name!r} is damaged ({MANIFEST_FILE}: {e}); remove it and add it again"
            ) from None

    def list(self) -> list[VoiceInfo]:
        """Every stored voice, sorted by name. Damaged entries are skipped (and logged)."""
        out: list[VoiceInfo] = []
        for entry in sorted(self.directory.iterdir(), key=lambda p: p.name):
            if not NAME_PATTERN.fullmatch(entry.name) or not (entry / MANIFEST_FILE).is_file():
                continue
            try:
                out.append(self._read_info(entry))
            except VoiceStoreCorruptError as e:
                log.warning("%s", e)
        return out

    def names(self) -> builtins.list[str]:
        """Names of the stored voices, sorted: a directory listing, no manifest is read (cheap
        enough for the event loop; a damaged voice is named here and refused by :meth:`get`)."""
        return sorted(
            e.name for e in self.directory.iterdir() if NAME_PATTERN.fullmatch(e.name) and (e / MANIFEST_FILE).is_file()
        )

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and bool(NAME_PATTERN.fullmatch(name)) and (self.directory / name).is_dir()

    def get(self, name: str) -> Voice:
        """The stored voice ``name`` (cached; reloaded when another process changed it).

        Raises :class:`~voice_out.engine.api.UnknownVoiceError`, :class:`VoiceStoreCorruptError`,
        or :class:`IncompatibleVoiceError` when it was made with other prompt networks.
        """
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise UnknownVoiceError(self._unknown_message(name))
        vdir = self.directory / name
        try:
            st = (vdir / MANIFEST_FILE).stat()
        except OSError:
            with self._lock:
                self._cache.pop(name, None)
            raise UnknownVoiceError(self._unknown_message(name)) from None
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        state_dir = vdir / ENGINE_STATE_DIR
        with self._lock:
            hit = self._cache.get(name)
            if hit is not None and hit[0] == stamp and not self._state_changed(hit[1], state_dir):
                voice = hit[1]
            else:
                voice = self._load(vdir)
                self._cache[name] = (stamp, voice)
        self._check_compatible(voice)
        return voice

    @staticmethod
    def _state_changed(voice: Voice, state_dir: Path) -> bool:
        keys = tuple(sorted(p.stem for p in state_dir.glob("*.pt"))) if state_dir.is_dir() else ()
        return keys != voice.info.engine_state_keys

    def _load(self, vdir: Path) -> Voice:
        info = self._read_info(vdir)
        try:
            data = (vdir / TENSORS_FILE).read_bytes()
            manifest = json.loads((vdir / MANIFEST_FILE).read_text(encoding="utf-8"))
            if manifest.get("tensors_sha256") not in (None, hashlib.sha256(data).hexdigest()):
                raise ValueError("checksum mismatch")
            tensors = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
            llm = tensors["llm_prompt_tokens"]
            flow = tensors["flow_prompt_tokens"]
            mel = tensors["prompt_mel"]
            emb = tensors["embedding"]
            ok = (
                llm.dtype == torch.int32
                and flow.dtype == torch.int32
                and mel.dtype == torch.float32
                and emb.dtype == torch.float32
                and llm.shape == (info.n_tokens_aligned,)
                and flow.shape == (info.n_flow_tokens,)
                and mel.dim() == 2
                and mel.shape[0] == 2 * info.n_flow_tokens
                and emb.shape == (info.embedding_dim,)
            )
            if not ok:
                raise ValueError("tensor shapes or dtypes do not match the manifest")
        except Exception as e:  # noqa: BLE001 - any failure to read back means a damaged voice
            raise VoiceStoreCorruptError(
                f"voice {vdir.name!r} is damaged ({TENSORS_FILE}: {e}); remove it and add it again"
            ) from None
        return Voice(
            info=info,
            llm_prompt_tokens=llm,
            flow_prompt_tokens=flow,
            prompt_mel=mel,
            embedding=emb,
            path=vdir.resolve(),
        )

    def _check_compatible(self, voice: Voice) -> None:
        current = self.fingerprint if self.check_fingerprint else None
        if current is not None and voice.info.model_fingerprint != current:
            raise IncompatibleVoiceError(
                f"voice {voice.name!r} was extracted with other prompt networks (fingerprint "
                f"{voice.info.model_fingerprint}, this model: {current}); remove it "
                f"(`voice-out voices rm {voice.name}`) and add it again"
            )

    def is_compatible(self, info: VoiceInfo) -> bool | None:
        """True/False when the store knows its model's fingerprint, else None."""
        current = self.fingerprint
        return None if current is None else info.model_fingerprint == current

    def _unknown_message(self, name: object) -> str:
        known = self.names()
        listing = ", ".join(known) if known else "none yet"
        return f"unknown voice {name!r} (registered: {listing}); {ADD_HINT}"

    def resolve(self, name: str | None, default: str | None = None) -> Voice:
        """The voice ``name``, else ``default``; raise :class:`NoVoiceError` when both are None."""
        chosen = name if name is not None else default
        if chosen is None:
            from voice_out.engine.voicebook import NO_VOICE_HINT

            raise NoVoiceError(f"no voice was named and no default voice is configured: {NO_VOICE_HINT}; or {ADD_HINT}")
        return self.get(chosen)

    def source_audio(self, name: str) -> bytes:
        """The audio the voice was made from, exactly as it was given."""
        vdir = self._voice_dir(name)
        try:
            return (vdir / SOURCE_FILE).read_bytes()
        except OSError:
            raise UnknownVoiceError(self._unknown_message(name)) from None

    def rebuild(self, name: str) -> Voice:
        """Extract ``name`` again from its stored audio with this store's model (keeps transcript)."""
        info = self._read_info(self._existing_dir(name))
        return self.add(name, self.source_audio(name), info.transcript, replace=True)

    # ----------------------------------------------------------------------------------------
    # delete

    def _existing_dir(self, name: str) -> Path:
        vdir = self._voice_dir(name)
        if not vdir.is_dir():
            raise UnknownVoiceError(self._unknown_message(name))
        return vdir

    def delete(self, name: str) -> None:
        """Remove a voice (raises :class:`~voice_out.engine.api.UnknownVoiceError` if absent)."""
        vdir = self._existing_dir(name)
        trash = self.directory / f".trash-{name}-{uuid.uuid4().hex[:12]}-d"
        with self._lock:
            try:
                os.rename(vdir, trash)
            except FileNotFoundError:
                raise UnknownVoiceError(self._unknown_message(name)) from None
            _fsync_dir(self.directory)
            self._cache.pop(name, None)
        shutil.rmtree(trash, ignore_errors=True)

    # ----------------------------------------------------------------------------------------
    # engine state slot

    def put_engine_state(self, name: str, key: str, tensors: Mapping[str, torch.Tensor], *, tag: str = "") -> None:
        """Attach precomputed engine tensors (e.g. a flow prompt state) to a voice, atomically.

        ``key`` names the slot (same rules as voice names); ``tag`` identifies what produced it
        (e.g. model weights + engine version), so :meth:`get_engine_state` can ignore stale
        state. Replaces an existing slot. Removed with the voice.
        """
        validate_name(key, "engine state key")
        vdir = self._existing_dir(name)
        state_dir = vdir / ENGINE_STATE_DIR
        state_dir.mkdir(exist_ok=True)
        payload = {
            "tag": tag,
            "created": time.time(),
            "tensors": {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()},
        }
        buf = io.BytesIO()
        torch.save(payload, buf)
        tmp = state_dir / f".tmp-{key}-{uuid.uuid4().hex[:12]}"
        try:
            _write_file(tmp, buf.getvalue())
            os.replace(tmp, state_dir / f"{key}.pt")
            _fsync_dir(state_dir)
        finally:
            if tmp.exists():
                tmp.unlink()
        with self._lock:
            self._cache.pop(name, None)

    def get_engine_state(self, name: str, key: str, *, tag: str | None = None) -> dict[str, torch.Tensor] | None:
        """The tensors of slot ``key`` (CPU), or None when absent or made with another ``tag``."""
        validate_name(key, "engine state key")
        path = self._existing_dir(name) / ENGINE_STATE_DIR / f"{key}.pt"
        try:
            payload = torch.load(path, weights_only=True, map_location="cpu")
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - a damaged slot is treated as absent
            log.warning("engine state %s of voice %s is unreadable (%s); ignoring it", key, name, e)
            return None
        if tag is not None and payload.get("tag") != tag:
            return None
        tensors: dict[str, torch.Tensor] = payload["tensors"]
        return tensors

    def delete_engine_state(self, name: str, key: str | None = None) -> None:
        """Drop one slot, or every slot when ``key`` is None."""
        state_dir = self._existing_dir(name) / ENGINE_STATE_DIR
        if key is None:
            shutil.rmtree(state_dir, ignore_errors=True)
        else:
            validate_name(key, "engine state key")
            (state_dir / f"{key}.pt").unlink(missing_ok=True)
        with self._lock:
            self._cache.pop(name, None)
