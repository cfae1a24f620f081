"""Repetition-aware sampling (RAS) of speech tokens, cosyvoice2-spec section 2.6.

Pinned variant: upstream HEAD, commit "fix ras" (2026-02-04). Per stream and step:

1. nucleus + top-k: ``p = softmax(logp)`` sorted descending (stable: ties keep id order);
   walk it and keep item i while (sum of the kept probabilities) < ``top_p`` and (number kept)
   < ``top_k``; the item that crosses ``top_p`` is kept. Draw ``tok`` from the kept items.
2. repetition check: if ``tok`` occurs at least ``win_size * tau_r`` times among the stream's
   last ``win_size`` tokens, set ``p[tok] = 0`` (``logp[tok] = -inf``) and draw again from the
   FULL distribution (no top-p / top-k). This draw may return any id, EOS included unless it
   was masked. (The older variant drew from the full softmax without masking ``tok``.)

Randomness is explicit and per stream: each draw is inverse-CDF sampling with two uniforms
per step, used whether or not the fallback fires, so a stream's sequence does not depend on its
past fallbacks or on its batch mates. They come from the stream's own ``torch.Generator``
(:func:`draw_uniforms`, single-stream :func:`ras_sample`), or, in the engine, from
:func:`counter_uniforms`: a hash of (seed, step), computed on the host for a whole batch at
once, with no generator state and no kernel per stream, and the same on every device.
Upstream uses ``torch.multinomial`` on a global generator, so exact upstream token sequences are
not reproducible anyway (parity tests feed tokens instead).

The math is batched and free of host syncs (``ras_sample_batch``); only :func:`draw_uniforms`
touches the per-stream generators. ``ras_sample`` is the single-stream form.

Length rules (spec 2.5): before ``min_len`` tokens only EOS (6561) is masked; decoding stops
on any id in ``{6561, 6562, 6563}`` or after ``max_len`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
from torch import Tensor

#: Marks an empty slot of a history buffer (no speech id is negative).
NO_TOKEN = -1


@dataclass(frozen=True)
class SamplingParams:
    """RAS parameters; the defaults are CosyVoice2's (``cosyvoice2.yaml`` ``llm.sampling``)."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p = {self.top_p} must be in (0, 1]")
        if self.top_k < 1 or self.win_size < 1 or self.tau_r <= 0:
            raise ValueError(f"bad RAS parameters: top_k {self.top_k}, win_size {self.win_size}, tau_r {self.tau_r}")

    @property
    def repeat_threshold(self) -> float:
        return self.win_size * self.tau_r


def stream_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one stream, on the device where its uniforms are drawn."""
    return torch.Generator(device=device).manual_seed(seed)


def draw_uniforms(generators: Sequence[torch.Generator], device: torch.device | str) -> Tensor:
    """``[B, 2]`` float32 uniforms in [0, 1): row b from ``generators[b]`` (its own device)."""
    rows = [torch.rand(2, generator=g, device=g.device) for g in generators]
    return torch.stack(rows).to(device)


#: Odd 32-bit constants that keep (seed, step) = (0, 0) away from the hash's fixed point 0.
_SALT = (0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F)
_MASK32 = 0xFFFF_FFFF
#: A Python int, or a numpy uint32 array (whose products wrap modulo 2^32 anyway).
_U32 = TypeVar("_U32", int, np.ndarray)


def _mix32(x: _U32) -> _U32:
    """A 32-bit integer finaliser (xor-shift-multiply, "lowbias32"): every input bit affecting
    every output bit; on one int or elementwise on a uint32 array."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _uniform_bits(draw: _U32, seed_lo: _U32, seed_hi: _U32) -> _U32:
    """24 random bits of draw ``draw`` of the stream seeded (``seed_hi``, ``seed_lo``)."""
    h = _mix32(draw ^ _SALT[0])
    h = _mix32(h ^ seed_lo ^ _SALT[1])
    return _mix32(h ^ seed_hi ^ _SALT[2]) >> 8


#: Up to this many streams :func:`counter_uniforms` hashes with Python ints: ~4 us a stream,
#: where the numpy path's ~30 array operations cost ~40 us whatever the batch (once per decode
#: step). Both compute the same :func:`_uniform_bits`.
SCALAR_UNIFORMS_MAX = 8


def counter_uniforms(seeds: Sequence[int], steps: Sequence[int]) -> np.ndarray:
    """float64 ``[N, 2]`` uniforms in [0, 1) for N streams: row n is a function of
    (``seeds[n]`` mod 2^64, ``steps[n]``) only, its two values those of draws ``2 step`` and
    ``2 step + 1``. Each value is a multiple of 2^-24 (exact in float32, like ``torch.rand``).

    A counter-based generator: a stream's step-s uniforms need no state and no kernel, and the
    whole batch is a few host operations (any thread). Not for cryptography."""
    if len(seeds) <= SCALAR_UNIFORMS_MAX:
        bits: list[int] = []
        for sd, st in zip(seeds, steps, strict=True):
            s64, draw = int(sd) & 0xFFFF_FFFF_FFFF_FFFF, (int(st) & 0x7FFF_FFFF) * 2
            bits += [_uniform_bits(draw + j, s64 & _MASK32, s64 >> 32) for j in (0, 1)]
        return np.array(bits, dtype=np.float64).reshape(-1, 2) * 2.0**-24
    seed = np.array([int(v) & 0xFFFF_FFFF_FFFF_FFFF for v in seeds], dtype=np.uint64)
    step = np.array([int(v) & 0x7FFF_FFFF for v in steps], dtype=np.uint32)
    lo = (seed & np.uint64(_MASK32)).astype(np.uint32)[:, None]
    hi = (seed >> np.uint64(32)).astype(np.uint32)[:, None]
    draws = step[:, None] * np.uint32(2) + np.arange(2, dtype=np.uint32)[None, :]  # [N, 2]
    with np.errstate(over="ignore"):
        return _uniform_bits(draws, lo, hi).astype(np.float64) * 2.0**-24


def new_history(batch: int, params: SamplingParams, device: torch.device | str = "cpu") -> Tensor:
    """An empty ``[B, win_size]`` int64 history (filled with ``NO_TOKEN``)."""
    return torch.full((batch, params.win_size), NO_TOKEN, dtype=torch.long, device=device)


def push_history_(history: Tensor, tokens: Tensor) -> None:
    """Shift ``history`` ``[B, W]`` left in place and append ``tokens`` ``[B]`` (no sync)."""
    history[:, :-1] = history[:, 1:].clone()
    history[:, -1] = tokens


def mask_eos_(logp: Tensor, masked: Tensor, eos_token: int) -> Tensor:
    """Set ``logp[b, eos] = -inf`` where ``masked[b]`` (bool ``[B]``); in place, returns ``logp``."""
    col = logp[:, eos_token]
    logp[:, eos_token] = torch.where(masked, torch.full_like(col, float("-inf")), col)
    return logp


def _inverse_cdf(weights: Tensor, u: Tensor) -> Tensor:
    """Index drawn from unnormalised non-negative ``weights`` ``[B, N]`` with uniforms ``u`` ``[B]``.

    Never returns a zero-weight index (it is clamped to the last positive one against rounding).
    """
    cdf = weights.double().cumsum(dim=1)
    target = (u.double() * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, target, right=True)[:, 0]
    positions = torch.arange(weights.shape[1], device=weights.device)
    last_positive = torch.where(weights > 0, positions, 0).amax(dim=1)
    return torch.minimum(idx, last_positive)


def ras_sample_batch(logp: Tensor, history: Tensor, uniforms: Tensor, params: SamplingParams) -> Tensor:
    """One RAS draw per row: ``logp`` ``[B, V]``, ``history`` ``[B, W]`` (``NO_TOKEN`` = empty),
    ``uniforms`` ``[B, 2]`` -> int64 token ids ``[B]`` on ``logp``'s device. No host sync.
    """
    probs = torch.softmax(logp.float(), dim=-1)  # [B, V]
    k = min(params.top_k, probs.shape[1])
    sorted_p, sorted_ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    top_p, top_ids = sorted_p[:, :k], sorted_ids[:, :k]
    cum = top_p.cumsum(dim=1)
    kept_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)  # sum of items 0..i-1
    keep = kept_before < params.top_p  # item 0 is always kept; a prefix since cum is monotone
    first = top_ids.gather(1, _inverse_cdf(top_p * keep, uniforms[:, 0])[:, None])[:, 0]

    window = history[:, -params.win_size :]
    repeats = (window == first[:, None]).sum(dim=1)
    masked = probs.scatter(1, first[:, None], 0.0)
    fallback = _inverse_cdf(masked, uniforms[:, 1])
    return torch.where(repeats.float() >= params.repeat_threshold, fallback, first)


def ras_sample(
    logp: Tensor,
    history: Sequence[int],
    params: SamplingParams,
    generator: torch.Generator,
) -> int:
    """Single-stream RAS: ``logp`` ``[V]``, ``history`` the stream's decoded tokens (any length)."""
    hist = new_history(1, params, logp.device)
    recent = [int(t) for t in history][-params.win_size :]
    if recent:
        hist[0, -len(recent) :] = torch.tensor(recent, dtype=torch.long, device=logp.device)
    uniforms = draw_uniforms([generator], logp.device)
    return int(ras_sample_batch(logp[None], hist, uniforms, params)[0].item())
