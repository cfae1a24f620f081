"""Runners for the two prompt networks of a CosyVoice2 model directory, through onnxruntime.

* :class:`SpeechTokenizer` (``speech_tokenizer_v2.onnx``): Whisper log-mel ``[n_mels, F]`` ->
  speech tokens ``[T']`` int32 at 25 Hz.
* :class:`SpeakerEmbedder` (``campplus.onnx``): mean-normalised fbank ``[F, 80]`` -> x-vector
  ``[D]`` float32 (D = 192 for CAM++; not L2-normalised).

Input and output names, the length input's integer type and the mel-bin counts are read from the
model files, never assumed. The CUDA provider is used first when onnxruntime offers it.

Threads: a runner may be called from one thread at a time per instance (onnxruntime sessions
are thread-safe for ``run``, but the runners are cheap to guard with the caller's lock). The
voice store calls them from its executor thread, never from the GPU worker or the event loop.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from voice_out.voices.errors import AudioTooLongError, PromptModelError

SPEECH_TOKENIZER_FILE = "speech_tokenizer_v2.onnx"
SPEAKER_EMBEDDER_FILE = "campplus.onnx"
#: The speech tokenizer accepts at most 30 s of audio (3000 Whisper frames).
MAX_PROMPT_S = 30.0
WHISPER_FRAMES_PER_S = 100

_NUMPY_OF = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(int32)": np.int32,
    "tensor(int64)": np.int64,
}


#: Most device memory ONNX Runtime's CUDA arena may hold (the engine's plan budgets it).
ORT_ARENA_BYTES = 512 * 1024 * 1024


def providers() -> list[str]:
    """onnxruntime providers in order of preference: CUDA when available, always CPU."""
    import onnxruntime as ort

    available = set(ort.get_available_providers())
    chosen = ["CUDAExecutionProvider"] if "CUDAExecutionProvider" in available else []
    return [*chosen, "CPUExecutionProvider"]


def open_session(path: str | Path, *, intra_op_threads: int | None = None, cpu_only: bool = False) -> Any:
    """An ``onnxruntime.InferenceSession`` for ``path`` (raises :class:`PromptModelError`)."""
    import onnxruntime as ort

    p = Path(path)
    if not p.is_file():
        raise PromptModelError(f"prompt network {str(p)!r} is missing from the model directory")
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads or max(1, min(4, os.cpu_count() or 1))
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    chosen: list[Any] = ["CPUExecutionProvider"] if cpu_only else providers()
    # the CUDA provider's arena within what the engine's memory plan leaves it
    # (voice_out.fast.plan.ORT_BYTES), grown by what each run asks for, not doubled
    chosen = [
        (name, {"gpu_mem_limit": ORT_ARENA_BYTES, "arena_extend_strategy": "kSameAsRequested"})
        if name == "CUDAExecutionProvider"
        else name
        for name in chosen
    ]
    try:
        return ort.InferenceSession(str(p), sess_options=options, providers=chosen)
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own untyped errors
        raise PromptModelError(f"cannot load {str(p)!r} with onnxruntime: {e}") from None


def _static_dim(shape: list[Any], axis: int) -> int | None:
    if len(shape) > axis and isinstance(shape[axis], int) and shape[axis] > 0:
        return int(shape[axis])
    return None


class SpeechTokenizer:
    """``speech_tokenizer_v2.onnx``: log-mel ``[n_mels, F]`` float32 -> tokens ``[T']`` int32."""

    def __init__(self, path: str | Path, *, intra_op_threads: int | None = None) -> None:
        self.path = Path(path)
        self.session = open_session(self.path, intra_op_threads=intra_op_threads)
        inputs = self.session.get_inputs()
        floats = [i for i in inputs if i.type in ("tensor(float)", "tensor(double)")]
        ints = [i for i in inputs if i.type in ("tensor(int32)", "tensor(int64)")]
        if len(floats) != 1 or len(ints) != 1 or len(inputs) != 2:
            raise PromptModelError(
                f"{self.path.name}: expected one float feature input and one integer length input, got "
                + ", ".join(f"{i.name}:{i.type}" for i in inputs)
            )
        self.feats_name: str = floats[0].name
        self.feats_dtype = _NUMPY_OF[floats[0].type]
        self.length_name: str = ints[0].name
        self.length_dtype = _NUMPY_OF[ints[0].type]
        self.output_name: str = self.session.get_outputs()[0].name
        #: Mel bins the network expects (read from the graph; 128 for the official file).
        self.n_mels: int = _static_dim(floats[0].shape, 1) or 128

    def __call__(self, log_mel: torch.Tensor) -> torch.Tensor:
        """Tokens of a whole prompt. ``log_mel`` [n_mels, F] (F = 100 per second, F <= 3000)."""
        if log_mel.dim() != 2 or log_mel.shape[0] != self.n_mels:
            raise ValueError(f"expected a log-mel of shape [{self.n_mels}, F], got {tuple(log_mel.shape)}")
        n_frames = int(log_mel.shape[1])
        if n_frames > MAX_PROMPT_S * WHISPER_FRAMES_PER_S:
            raise AudioTooLongError(f"the speech tokenizer accepts at most {MAX_PROMPT_S:g} s of audio")
        feats = log_mel[None].detach().cpu().numpy().astype(self.feats_dtype, copy=False)
        length = np.array([n_frames], dtype=self.length_dtype)
        (tokens,) = self.session.run([self.output_name], {self.feats_name: feats, self.length_name: length})
        # [1, T'] or [1, 1, T'], int32 or int64: flatten to int32 [T'].
        return torch.from_numpy(np.asarray(tokens).reshape(-1).astype(np.int32))


class SpeakerEmbedder:
    """``campplus.onnx``: fbank ``[F, n_mels]`` float32 (mean removed) -> x-vector ``[D]`` float32."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        # The reference runs CAM++ on the CPU with one thread; it is small.
        self.session = open_session(self.path, intra_op_threads=1, cpu_only=True)
        inputs = self.session.get_inputs()
        if len(inputs) != 1 or inputs[0].type not in ("tensor(float)", "tensor(double)"):
            raise PromptModelError(
                f"{self.path.name}: expected one float feature input, got "
                + ", ".join(f"{i.name}:{i.type}" for i in inputs)
            )
        self.input_name: str = inputs[0].name
        self.input_dtype = _NUMPY_OF[inputs[0].type]
        self.output_name: str = self.session.get_outputs()[0].name
        self.n_mels: int = _static_dim(inputs[0].shape, 2) or 80
        self.dim: int | None = _static_dim(self.session.get_outputs()[0].shape, 1)

    def __call__(self, fbank_cmn: torch.Tensor) -> torch.Tensor:
        if fbank_cmn.dim() != 2 or fbank_cmn.shape[1] != self.n_mels:
            raise ValueError(f"expected fbank features of shape [F, {self.n_mels}], got {tuple(fbank_cmn.shape)}")
        feats = fbank_cmn[None].detach().cpu().numpy().astype(self.input_dtype, copy=False)
        (embedding,) = self.session.run([self.output_name], {self.input_name: feats})
        return torch.from_numpy(np.asarray(embedding, dtype=np.float32).reshape(-1).copy())
