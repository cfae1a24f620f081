"""Streaming token2wav: speech tokens -> flow mel -> HiFT waveform, chunk by chunk.

cosyvoice2-spec.md sections 5.3-5.4. :class:`Token2Wav` holds the shared, stateless models (the
flow and the vocoder); :class:`Token2WavStream` is ALL the state of one request (its prompt, its
vocoder overlap cache, its flow cache, which chunk comes next) and is reset in place for the
next request. When a chunk is made and how big is not decided here: the engine's chunk schedule
(``voice_out.engine.chunk_schedule``, one per request, the scheduler's) plans each chunk and
hands it over as a :class:`Chunk`; a stream only checks that it is its next one.

How an engine drives one request (GPU worker thread only)::

    stream = t2w.open_stream(prompt_token, prompt_feat, embedding)       # or stream.reset(...)
    for each chunk the schedule plans (no tensor work there):
        pcm = stream.run_chunk(plan, tokens)                              # float32 (n,), 24 kHz

Per chunk (non-final chunks hold back their last 160 ms)::

    mel = flow(tokens[:token_len])[:, :, 2*token_offset:]       # only the new frames
    if cache: mel = [cache.mel (8 frames), mel]; cache_source = cache.source (3840 samples)
    speech, source = hift(mel, cache_source)
    if cache: speech[:3840] = speech[:3840] * w[:3840] + cache.speech * w[3840:]   (float64)
    non-final: cache = (mel[-8:], source[-3840:], speech[-3840:]); emit speech[:-3840]
    final:     emit speech

``w`` is the symmetric Hamming window of 7680 points (its halves sum to ~1.08, as upstream).

The flow of a chunk: upstream's re-run (``flow.inference`` over the prompt and every token so
far, chunk-causal; the final chunk with full attention), or, for a first chunk of a voice with
a prompt prefix (:meth:`Token2Wav.prepare_prefix`), ``Flow.prefix_core`` from that prefix: the
same frames without the prefix's in the estimator calls. The one incremental path, later
chunks extending a flow state of the stream's own, is the fast token2wav's (state slots);
every path gives the re-run's waveform.

Batched chunks (:meth:`Token2Wav.run_chunks`): an engine step with chunks of several streams
computes the flow of its non-final re-run-path chunks in ONE ``flow.inference_batch`` call, rows
right-padded to the longest, then finishes each chunk as :meth:`Token2Wav.run_chunk` does. Rows
are exact because the real tokens of a non-final chunk end on a flow chunk boundary, so right
padding never reaches a real frame (see ``Flow.inference_batch``).

This is the eager recipe, the reference: ``voice_out.fast.flow_step.FastToken2Wav`` is the same
with CUDA graphs, grouped batches, the first-chunk lane and state slots on top, and overrides
the per-chunk steps below (``_rerun_chunk``, ``_prefix_chunk``, ``_final_chunk``, ``_vocoder``,
``_batch_mels``, ...) with the same outputs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from voice_out.model.flow import Flow
from voice_out.model.transfer import to_device
from voice_out.model.vocoder import HiFT

#: The flow's chunk (static_chunk_size of its encoder) and look-ahead, in speech tokens: a
#: non-final chunk's audio ends on a chunk boundary counted from the prompt's start, with this
#: many tokens after it (the engine's chunk schedule keeps to the same two numbers).
CHUNK_TOKENS = 25
LOOKAHEAD_TOKENS = 3
MEL_FRAMES_PER_TOKEN = 2  # token_mel_ratio: 25 Hz tokens, 50 Hz mel
HIFT_CACHE_FRAMES = 8  # vocoder overlap between chunks (160 ms)


class Chunk(Protocol):
    """One token2wav call, as the engine's chunk schedule plans it
    (``voice_out.engine.chunk_schedule.ChunkPlan``): ``token_len`` tokens (a prefix of the
    request's speech tokens) go to the flow; the chunk's audio starts at token ``token_offset``;
    ``hop_tokens`` tokens become final (a non-final chunk's are followed by
    ``LOOKAHEAD_TOKENS`` of context; the ``finalize`` chunk takes all the rest); ``index``
    counts the request's chunks from 0; ``starts_audio``: a non-final first chunk."""

    @property
    def index(self) -> int: ...

    @property
    def token_offset(self) -> int: ...

    @property
    def token_len(self) -> int: ...

    @property
    def hop_tokens(self) -> int: ...

    @property
    def finalize(self) -> bool: ...

    @property
    def starts_audio(self) -> bool: ...


class FlowInference(Protocol):
    """The flow's one-shot entry point (``voice_out.model.flow.Flow.inference``).

    token [1, N], prompt_token [1, P], prompt_feat [1, 2P, 80], embedding [1, spk_dim] ->
    mel [1, 80, 2N] float32 without the prompt frames; with ``finalize=False`` the last
    ``lookahead`` tokens are context only and the mel has 2(N - lookahead) frames.
    """

    def inference(
        self,
        token: Tensor,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        streaming: bool,
        finalize: bool,
    ) -> Tensor: ...


class ChunkBatchError(RuntimeError):
    """Some chunks of a :meth:`Token2Wav.run_chunks` call failed after its flow pass.

    ``results[i]``: the audio of chunk i (done: its stream advanced), or None where
    ``errors[i]`` holds why it failed.
    """

    def __init__(self, results: list[Tensor | None], errors: dict[int, Exception]) -> None:
        first = errors[min(errors)]
        super().__init__(f"{len(errors)} of {len(results)} chunks failed; first: {type(first).__name__}: {first}")
        self.results = results
        self.errors = errors


def _check_speed(speed: float, whole: bool = True) -> float:
    """``speed`` if it is a token2wav speed a stream can have (> 0, finite; != 1 only for a
    whole utterance), else ValueError."""
    if not math.isfinite(speed) or speed <= 0:
        raise ValueError(f"speed must be a finite number > 0, got {speed}")
    if speed != 1.0 and not whole:
        raise ValueError(f"speed {speed} needs the whole utterance in one chunk (whole=True; spec 5.6)")
    return float(speed)


def hamming(n: int, device: torch.device | str | None = None) -> Tensor:
    """Symmetric Hamming window of ``n`` points in float64: 0.54 - 0.46 cos(2 pi k / (n - 1))."""
    if n == 1:
        return torch.ones(1, dtype=torch.float64, device=device)
    k = torch.arange(n, dtype=torch.float64, device=device)
    return 0.54 - 0.46 * torch.cos(2.0 * math.pi * k / (n - 1))


@dataclass
class HiFTCache:
    """Vocoder overlap state of one request, preallocated and written in place.

    mel [1, C_mel, 8], source [1, 1, 3840], speech [1, 3840]; ``valid`` False = no cache yet.
    """

    mel: Tensor
    source: Tensor
    speech: Tensor
    valid: bool = False

    @staticmethod
    def allocate(mel_channels: int, n_frames: int, samples_per_frame: int, device: torch.device) -> HiFTCache:
        n = n_frames * samples_per_frame
        return HiFTCache(
            mel=torch.zeros(1, mel_channels, n_frames, device=device),
            source=torch.zeros(1, 1, n, device=device),
            speech=torch.zeros(1, n, device=device),
        )

    def reset(self) -> None:
        self.valid = False


@dataclass
class Token2WavStream:
    """All per-request token2wav state. Owned and called by one thread (the GPU worker).

    ``prompt_token`` [1, P] int, ``prompt_feat`` [1, 2P, 80] float32, ``embedding`` [1, spk_dim]:
    the voice.
    """

    model: Token2Wav
    prompt_token: Tensor
    prompt_feat: Tensor
    embedding: Tensor
    hift_cache: HiFTCache
    noise: torch.Generator | None = None
    #: The voice's prompt prefix for a first chunk from it (``Token2Wav.prepare_prefix``), or
    #: None: the first chunk re-runs the whole prompt.
    first_prefix: Any = None
    #: The flow state this stream's later chunks extend, lent by the fast token2wav
    #: (``voice_out.fast.flow_step``: a state slot), or None: they re-run the prompt and every
    #: token so far.
    state_slot: Any = None
    #: token2wav speed (spec 5.6): != 1 resamples the whole utterance's mel in time before the
    #: vocoder, so the stream is ``whole``.
    speed: float = 1.0
    #: The request's audio is ONE final chunk over every token (its schedule is ``whole``).
    whole: bool = False
    #: Progress, to check each chunk handed over: chunks made, the token the next one starts
    #: at, whether the final one was made.
    chunks_done: int = 0
    token_offset: int = 0
    finished: bool = False
    samples_emitted: int = 0
    chunk_log: list[Chunk] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        """P, the voice's flow prompt tokens."""
        return int(self.prompt_token.shape[-1])

    def flow_end(self, plan: Chunk) -> int:
        """T of a non-final ``plan``: prompt + the tokens its audio covers (its look-ahead
        excluded), where its flow pass ends; a multiple of ``CHUNK_TOKENS`` on a boundary."""
        return self.prompt_tokens + plan.token_len - LOOKAHEAD_TOKENS

    def check(self, plan: Chunk) -> None:
        """ValueError unless ``plan`` is this stream's next chunk (and, for a ``whole`` stream,
        its one final chunk). No state changes."""
        if self.finished or plan.index != self.chunks_done or plan.token_offset != self.token_offset:
            raise ValueError(f"chunk plan {plan} is not the next chunk of this stream")
        if self.whole and not plan.finalize:
            raise ValueError(f"chunk plan {plan}: a whole stream makes one final chunk")
        if not plan.finalize and plan.token_len != plan.token_offset + plan.hop_tokens + LOOKAHEAD_TOKENS:
            raise ValueError(f"chunk plan {plan}: a non-final chunk takes {LOOKAHEAD_TOKENS} look-ahead tokens")

    def _commit(self, plan: Chunk) -> None:
        """Record that ``plan`` was made (its audio emitted)."""
        self.chunks_done += 1
        self.token_offset = plan.token_len if plan.finalize else plan.token_offset + plan.hop_tokens
        self.finished = plan.finalize
        self.chunk_log.append(plan)

    def run_chunk(self, plan: Chunk, tokens: Tensor | Sequence[int]) -> Tensor:
        """Run ``plan`` on the request's tokens so far (at least ``plan.token_len``): float32 (n,)."""
        return self.model.run_chunk(self, plan, tokens)

    def reset(
        self,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        *,
        noise: torch.Generator | None = None,
        first_prefix: Any = None,
        speed: float = 1.0,
        whole: bool | None = None,
    ) -> None:
        """Reuse this state object for a new request (caches are kept allocated).

        ``speed``: token2wav speed (> 0; != 1 makes the audio in one final chunk, spec 5.6).
        ``whole``: one final chunk over every token (None: when ``speed`` != 1).

        ``first_prefix``: the voice's ``Token2Wav.prepare_prefix`` result (the first chunk from
        the prompt prefix), or None.
        """
        dev = self.model.device
        self.prompt_token, self.prompt_feat = prompt_token.to(dev), prompt_feat.to(dev)
        self.embedding = embedding.to(dev)
        whole = speed != 1.0 if whole is None else whole
        self.speed = _check_speed(speed, whole)
        self.whole = whole
        self.chunks_done = self.token_offset = 0
        self.finished = False
        self.hift_cache.reset()
        self.noise = noise
        self.first_prefix = first_prefix
        self.samples_emitted = 0
        self.chunk_log.clear()
        self.model.release_state(self)
        self.model.prepare_flow(self)


class Token2Wav:
    """Flow + HiFT and the chunk recipe. Holds no per-request state; safe to share by streams."""

    def __init__(self, flow: FlowInference, hift: HiFT, *, device: torch.device | str | None = None) -> None:
        self.flow = flow
        self.hift = hift
        self.device = torch.device(device) if device is not None else hift.stft_window.device
        self.samples_per_frame = hift.dims.samples_per_frame
        self.cache_frames = HIFT_CACHE_FRAMES
        self.cache_samples = HIFT_CACHE_FRAMES * self.samples_per_frame
        self.window = hamming(2 * self.cache_samples, device=self.device)  # [7680] float64

    @property
    def full_flow(self) -> Flow | None:
        """The flow when it is the real :class:`~voice_out.model.flow.Flow` (batched, final,
        prefix and incremental entry points besides ``inference``); None for a stand-in with
        ``inference`` alone (the tests' replays of upstream's calls)."""
        return self.flow if isinstance(self.flow, Flow) else None

    def _full_flow(self) -> Flow:
        """:attr:`full_flow`, or TypeError for a stand-in."""
        flow = self.full_flow
        if flow is None:
            raise TypeError(f"{type(self.flow).__name__} has only the one-shot flow.inference")
        return flow

    def release_state(self, stream: Token2WavStream) -> None:
        """Give back what ``stream`` borrowed of shared state (a chunk's end, a drop, a reset).
        The eager token2wav lends none; ``FastToken2Wav`` lends state slots."""

    @property
    def samples_per_token(self) -> int:
        return MEL_FRAMES_PER_TOKEN * self.samples_per_frame

    # -- streams -------------------------------------------------------------------------------

    def open_stream(
        self,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        *,
        noise: torch.Generator | None = None,
        first_prefix: Any = None,
        speed: float = 1.0,
        whole: bool | None = None,
    ) -> Token2WavStream:
        """A new per-request state.

        ``noise`` None = deterministic vocoder source; ``first_prefix``, ``speed`` and ``whole``
        as in :meth:`Token2WavStream.reset`.
        """
        whole = speed != 1.0 if whole is None else whole
        _check_speed(speed, whole)
        stream = Token2WavStream(
            model=self,
            prompt_token=prompt_token.to(self.device),
            prompt_feat=prompt_feat.to(self.device),
            embedding=embedding.to(self.device),
            speed=float(speed),
            whole=whole,
            hift_cache=HiFTCache.allocate(
                self.hift.dims.in_channels, self.cache_frames, self.samples_per_frame, self.device
            ),
            noise=noise,
            first_prefix=first_prefix,
        )
        self.prepare_flow(stream)
        return stream

    @property
    def has_prefix_path(self) -> bool:
        """Whether the flow computes a first chunk from a prompt prefix (``Flow.prefix_core``)."""
        return self.full_flow is not None

    @torch.inference_mode()
    def prepare_prefix(self, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor) -> Any:
        """A voice's prompt prefix for first chunks from it (``Token2WavStream.first_prefix``;
        share it between requests), or None where there is none to gain: a prompt too short
        for a prefix, or a flow without the prefix path. Its flow state costs memory (~4.6 MB
        a prefix token at full size in bf16) and an eager pass over the prefix (worker thread)."""
        if not self.has_prefix_path:
            return None
        prompt = self._full_flow().prepare_prompt(prompt_token, prompt_feat, embedding)
        return prompt if prompt.n_prefix > 0 else None

    def prepare_flow(self, stream: Token2WavStream) -> None:
        """Set up the flow side of a (re)started stream. The eager token2wav keeps no flow
        state for a stream (its chunks re-run); ``FastToken2Wav`` lends it a state slot."""

    # -- one chunk -----------------------------------------------------------------------------

    def _flow_mel(self, stream: Token2WavStream, plan: Chunk, token: Tensor) -> Tensor:
        """New mel frames of ``plan``: [1, 80, 2 * hop_tokens] float32."""
        if plan.hop_tokens == 0:  # a final chunk with nothing new (an empty request)
            return torch.zeros(1, self.hift.dims.in_channels, 0, device=self.device)
        first = plan.index == 0 and not plan.finalize
        if first and self._from_prefix(stream, plan):
            return self._prefix_chunk(stream, plan, token)
        if not plan.finalize:
            return self._rerun_chunk(stream, plan, token)
        return self._final_chunk(stream, plan, token)  # full attention over every token

    def _rerun_chunk(self, stream: Token2WavStream, plan: Chunk, token: Tensor) -> Tensor:
        """A non-final chunk by upstream's re-run (prompt + tokens so far, chunk-causal): the new
        frames, float32 [1, 80, 2 * hop_tokens]."""
        args = self._rerun_args(stream, plan, token)
        start = MEL_FRAMES_PER_TOKEN * plan.token_offset
        return self.flow.inference(*args, streaming=True, finalize=False)[:, :, start:].float()

    @staticmethod
    def _from_prefix(stream: Token2WavStream, plan: Chunk) -> bool:
        """Whether ``plan`` (a non-final first chunk) is computed from the voice's prompt
        prefix: the stream has one and the chunk ends on a flow chunk boundary (not a fast
        first chunk)."""
        return stream.first_prefix is not None and stream.flow_end(plan) % CHUNK_TOKENS == 0

    def _prefix_chunk(self, stream: Token2WavStream, plan: Chunk, token: Tensor) -> Tensor:
        """A non-final first chunk from the voice's prompt prefix (``Flow.prefix_core``): its
        new frames, float32 [1, 80, 2 * hop_tokens], as :meth:`_rerun_chunk` gives them but
        without the prefix's frames in the estimator calls."""
        flow = self._full_flow()
        prompt = stream.first_prefix
        ids, emb, cond = flow.prefix_inputs(token[:, : plan.token_len], prompt)
        # the prompt's frames after the prefix come first, then the tokens' (from token_offset)
        start = MEL_FRAMES_PER_TOKEN * (prompt.n_prompt - prompt.n_prefix + plan.token_offset)
        return flow.prefix_core(ids, emb, cond, prompt.prefix)[:, :, start:].float()

    def _final_chunk(self, stream: Token2WavStream, plan: Chunk, token: Tensor) -> Tensor:
        """The final chunk (full attention over prompt + every token): its new frames, float32
        [1, 80, 2 * hop_tokens]."""
        args = self._rerun_args(stream, plan, token)
        start = MEL_FRAMES_PER_TOKEN * plan.token_offset
        mel = self.flow.inference(*args, streaming=False, finalize=True)
        return mel[:, :, start:].float()

    @staticmethod
    def _rerun_args(stream: Token2WavStream, plan: Chunk, token: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(tokens so far [1, token_len], prompt_token, prompt_feat, embedding) of a re-run."""
        return token[:, : plan.token_len], stream.prompt_token, stream.prompt_feat, stream.embedding

    def _as_tokens(self, tokens: Tensor | Sequence[int]) -> Tensor:
        t = to_device(tokens if isinstance(tokens, Tensor) else list(tokens), self.device, torch.int32)
        return t[None, :] if t.dim() == 1 else t

    def _chunk_tokens(self, stream: Token2WavStream, plan: Chunk, tokens: Tensor | Sequence[int]) -> Tensor:
        """Check that ``plan`` can run now (no state is touched): the request's tokens [1, n]."""
        stream.check(plan)
        token = self._as_tokens(tokens)
        if token.shape[1] < plan.token_len:
            raise ValueError(f"chunk needs {plan.token_len} tokens, got {token.shape[1]}")
        return token

    @torch.inference_mode()
    def run_chunk(self, stream: Token2WavStream, plan: Chunk, tokens: Tensor | Sequence[int]) -> Tensor:
        """Make the audio of ``plan`` for ``stream``: float32 (n,) on the model device.

        ``tokens``: the request's speech tokens so far, [1, n] / [n] tensor or a list; only the
        first ``plan.token_len`` are read. Advances the stream's progress and caches.
        """
        token = self._chunk_tokens(stream, plan, tokens)
        return self._finish_chunk(stream, plan, self._flow_mel(stream, plan, token))

    def batchable(self, stream: Token2WavStream, plan: Chunk) -> bool:
        """Whether :meth:`run_chunks` may compute this chunk's flow in a batched pass: a
        non-final chunk that ends on a flow chunk boundary (so right
        padding never reaches its frames), with the real flow (``Flow.inference_batch``)."""
        if plan.finalize or plan.hop_tokens == 0:
            return False
        if self.full_flow is None:
            return False
        return stream.flow_end(plan) % CHUNK_TOKENS == 0

    @torch.inference_mode()
    def run_chunks(self, pairs: Sequence[tuple[Token2WavStream, Chunk, Tensor | Sequence[int]]]) -> list[Tensor]:
        """:meth:`run_chunk` for several streams at once: the audio of each, in order.

        The flow of the :meth:`batchable` chunks runs batched (:meth:`_batch_mels`: here all
        of them in ONE ``flow.inference_batch`` call, when there are two or more; the fast
        token2wav groups them by length under graphs). The rest go through :meth:`run_chunk`'s
        flow step. Each
        chunk is then finished (vocoder, cross-fade, caches, progress) as :meth:`run_chunk`
        does. Each stream may appear once.

        Failures: a bad pair (not its stream's next chunk, too few tokens) or a failing batched
        flow pass raises before any stream is touched (every batched pass runs before any
        chunk is finished), so every chunk can be run again (alone).
        Once the flow pass is done, each chunk is finished on its own; if some fail,
        :class:`ChunkBatchError` carries the audio of those that did and the error of each
        that did not (a failed chunk leaves its stream as a failed :meth:`run_chunk` does:
        drop or reset it).
        """
        if len({id(stream) for stream, _, _ in pairs}) != len(pairs):
            raise ValueError("run_chunks: a stream appears twice")
        tokens = [self._chunk_tokens(stream, plan, tok) for stream, plan, tok in pairs]
        batch = [i for i, (stream, plan, _) in enumerate(pairs) if self.batchable(stream, plan)]
        chunks = [(stream, plan, tokens[i]) for i, (stream, plan, _) in enumerate(pairs)]
        mels = self._batch_mels(chunks, batch)
        results: list[Tensor | None] = []
        errors: dict[int, Exception] = {}
        for i, (stream, plan, _) in enumerate(pairs):
            try:
                mel = mels.pop(i) if i in mels else self._flow_mel(stream, plan, tokens[i])
                results.append(self._finish_chunk(stream, plan, mel))
            except Exception as e:  # noqa: BLE001 - one chunk fails alone; reported below
                results.append(None)
                errors[i] = e
        if errors:
            raise ChunkBatchError(results, errors)
        return [r for r in results if r is not None]

    def _batch_mels(
        self, chunks: Sequence[tuple[Token2WavStream, Chunk, Tensor]], rows: list[int]
    ) -> dict[int, Tensor]:
        """New mel frames of the batchable ``chunks[i]`` (i in ``rows``) that run batched, by
        index; the others are left to :meth:`run_chunk`'s path. Eagerly: :meth:`_eager_batch`."""
        return self._eager_batch(chunks, rows)

    def _eager_batch(
        self, chunks: Sequence[tuple[Token2WavStream, Chunk, Tensor]], rows: list[int]
    ) -> dict[int, Tensor]:
        """New mel frames of ``chunks[i]`` for i in ``rows``, from ONE eager
        ``flow.inference_batch`` call (right-padded to the longest); {} for fewer than 2."""
        if len(rows) < 2:
            return {}
        mels = self._full_flow().inference_batch([self._rerun_args(*chunks[i]) for i in rows])
        return {
            i: mel[:, :, MEL_FRAMES_PER_TOKEN * chunks[i][1].token_offset :].float()
            for i, mel in zip(rows, mels, strict=True)
        }

    def _finish_chunk(self, stream: Token2WavStream, plan: Chunk, mel: Tensor) -> Tensor:
        """Vocoder, cross-fade and caches for ``plan``'s new mel [1, 80, F]; commits the plan."""
        cache = stream.hift_cache
        if mel.shape[2] == 0 and not cache.valid:
            speech = torch.zeros(0, device=self.device)
        else:
            if cache.valid:
                mel = torch.cat([cache.mel, mel], dim=2)
            elif plan.finalize and stream.speed != 1.0:  # only a whole utterance has a speed (spec 5.6)
                mel = F.interpolate(mel, size=int(mel.shape[2] / stream.speed), mode="linear")
            source_in = cache.source if cache.valid else None
            speech_b, source = self._vocoder(mel, source_in, stream.noise, plan)
            speech = speech_b[0]  # [S F]
            n = self.cache_samples
            if cache.valid:
                faded = speech[:n].double() * self.window[:n] + cache.speech[0].double() * self.window[n:]
                speech = torch.cat([faded.to(speech.dtype), speech[n:]])
            if not plan.finalize:
                cache.mel.copy_(mel[:, :, -self.cache_frames :])
                cache.source.copy_(source[:, :, -n:])
                cache.speech.copy_(speech[None, -n:])
                cache.valid = True
                speech = speech[:-n]
            else:
                cache.valid = False
        if plan.finalize:
            self.release_state(stream)
        stream._commit(plan)
        stream.samples_emitted += int(speech.shape[0])
        return speech

    def _vocoder(
        self, mel: Tensor, source: Tensor | None, noise: torch.Generator | None, plan: Chunk
    ) -> tuple[Tensor, Tensor]:
        """HiFT over ``mel`` [1, 80, F] of ``plan`` with the overlap ``source`` (None: no
        cache): (speech [1, n], source). The eager token2wav calls the vocoder alike for every
        chunk; the fast one picks a graph by the chunk (final, first-chunk lane)."""
        return self.hift(mel, source, noise)

    # -- conveniences --------------------------------------------------------------------------

    def stream_all(
        self, stream: Token2WavStream, tokens: Tensor | Sequence[int], plans: Iterable[Chunk]
    ) -> Iterator[Tensor]:
        """The audio of each of ``plans`` in turn, on a request whose tokens are all known
        (tests, offline use, start-up; ``voice_out.engine.chunk_schedule.plan_all`` plans them)."""
        for plan in plans:
            yield stream.run_chunk(plan, tokens)

    @torch.inference_mode()
    def synthesize(
        self,
        tokens: Tensor | Sequence[int],
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        *,
        speed: float = 1.0,
        noise: torch.Generator | None = None,
    ) -> Tensor:
        """Non-streaming: one full-attention flow pass and one HiFT pass, float32 (n,).

        ``speed`` != 1 resamples the mel in time (linear) to int(T / speed) frames: faster
        speech at the same pitch.
        """
        token = self._as_tokens(tokens)
        mel = self.flow.inference(token, prompt_token, prompt_feat, embedding, streaming=False, finalize=True)
        return self.vocode(mel, speed=speed, noise=noise)

    @torch.inference_mode()
    def vocode(self, mel: Tensor, *, speed: float = 1.0, noise: torch.Generator | None = None) -> Tensor:
        """One HiFT pass over a whole mel [1, 80, T] (no caches): float32 (n,).

        ``speed`` != 1 first resamples the mel to int(T / speed) frames (linear,
        align_corners=False), as upstream's non-streaming ``speed``.
        """
        if speed <= 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        mel = mel.float()
        if speed != 1.0:
            mel = F.interpolate(mel, size=int(mel.shape[2] / speed), mode="linear")
        speech, _ = self.hift(mel, None, noise)
        return speech[0]
