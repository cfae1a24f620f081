"""CosyVoice2 flow (``CausalMaskedDiffWithXvec``, spec section 3): speech tokens -> 80-bin mel.

Token embedding -> ``UpsampleConformerEncoder`` (:mod:`voice_out.model.flow_encoder`) ->
``encoder_proj`` = mu -> conditional flow matching (10 Euler steps, classifier-free guidance
as a batch of 2, fixed noise) with the causal UNet of :mod:`voice_out.model.flow_estimator`.

Public API (stable; :mod:`voice_out.model.token2wav` drives it; GPU worker thread only)::

    flow = load_flow(model_dir, device, dtype)        # voice_out.model.checkpoint

    # Reference path, upstream-exact: re-runs prompt + every token on each call (cost grows).
    mel = flow.inference(token, prompt_token, prompt_feat, embedding, streaming, finalize)
    #   token [1, N] int, prompt_token [1, P] int, prompt_feat [1, 2P, 80], embedding [1, 192]
    #   -> float32 [1, 80, 2N] (finalize) or [1, 80, 2(N - 3)] (not finalize: last 3 = look-ahead)

    # Several streams' non-final streaming calls in ONE right-padded pass (each call on a chunk
    # boundary); mels[i] == inference(*items[i], streaming=True, finalize=False).
    mels = flow.inference_batch([(token, prompt_token, prompt_feat, embedding), ...])
    # = its two halves: host-side layout, then a fixed-shape core (one CUDA graph per (B, T))
    ids, embedding, cond, spans = flow.batch_inputs(items)  # [B, T + 3], [B, 192], [B, 80, 2T]
    mel = flow.batch_core(ids, embedding, cond)              # float32 [B, 80, 2T], prompt frames included

    # Several streams' FINAL calls (full attention) in ONE right-padded pass of T tokens (any
    # T >= every P_i + N_i; one CUDA graph per (B, T)): the mel over spans[i] equals
    # inference(*items[i], streaming=False, finalize=True).
    ids, n_valid, embedding, cond, spans = flow.final_inputs(items, total=T)  # [B, T], [B], ..
    mel = flow.final_core(ids, n_valid, embedding, cond)                      # float32 [B, 80, 2T]

    # A first chunk from a voice's prompt prefix (once per voice; share it): the prefix's frames
    # are read, not recomputed, in the 10 estimator calls.
    prompt = flow.prepare_prompt(prompt_token, prompt_feat, embedding)
    ids, embedding, cond = flow.prefix_inputs(token[:, : hop + 3], prompt)
    mel = flow.prefix_core(ids, embedding, cond, prompt.prefix)   # the prompt's tail + the chunk

    # Later chunks extending a stream's own state (a FlowStreamCache of fixed capacity, reset
    # to the voice's prompt): each costs its new tokens only, in fixed shapes (CUDA graphs:
    # voice_out.fast.flow_step's state slots).
    cache = flow.allocate_stream_cache(capacity)
    flow.reset_stream_cache(cache, prompt)
    mu, spk, cond, x0, at = flow.state_inputs(cache, token[:, offset : offset + hop + 3])
    mel = flow.state_core(mu, spk, cond, x0, at, cache)           # [1, 80, 2 (tokens since the last boundary)]

A state chunk's tokens are the tokens not yet given as new, then ``pre_lookahead`` (3)
look-ahead tokens, given again at the start of the next call. It must end on a chunk boundary
counted from the first prompt token (prompt + tokens so far a multiple of 25), as upstream's
schedule 25+pad, 50, 100... guarantees. Its mel equals the matching slice of ``inference(token[:,
:offset + hop + 3], ..., streaming=True, finalize=False)``. The final chunk is the re-run's
full-attention pass (every frame attends to every other there: nothing earlier can be reused).

Memory: a stream cache holds every layer's keys/values for every Euler step and CFG row (4.6 MB
per token of capacity for CosyVoice2-0.5B in bfloat16; ``cache.nbytes``). ``FlowPrompt.to("cpu")``
keeps a voice's state in host memory; ``reset_stream_cache`` copies it to the flow's device.

Pure torch: no I/O, no threads, no logging; the noise buffer comes from a local generator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from voice_out.model.flow_dims import UPSTREAM_ENCODER_CHANNELS, FlowDims, FlowPrompt, FlowStreamCache
from voice_out.model.flow_encoder import LOOKAHEAD_CONV2_KERNEL, Encoder
from voice_out.model.flow_estimator import Estimator, EstimatorPrep
from voice_out.model.transfer import to_device

#: Fixed by upstream code, in no config file (with the encoder's, see flow_encoder).
NOISE_SEED = 0


class StateKey(NamedTuple):
    """What the encoder's part of a chunk on a stream's state depends on besides its tensors
    (:meth:`Flow.state_mu`): tokens ``start .. stop`` and the cache's positional rows
    already projected (``enc_pos_valid``, ``up_pos_valid``) as the chunk begins."""

    start: int
    stop: int
    enc_valid: int
    up_valid: int


# --------------------------------------------------------------------------------------------
# Flow


def fixed_noise(n_mels: int, n_frames: int) -> Tensor:
    """Upstream's CFM noise: seed 0 on a CPU generator, ``randn(1, n_mels, n_frames)`` float32.

    A local generator: the global RNG is left untouched.
    """
    gen = torch.Generator(device="cpu").manual_seed(NOISE_SEED)
    return torch.randn(1, n_mels, n_frames, generator=gen, dtype=torch.float32)


class Flow(nn.Module):
    """``CausalMaskedDiffWithXvec`` inference: the reference path, batched and final passes, a
    first chunk from a prompt prefix, and later chunks extending a stream's state.

    Weights and activations use the module dtype (float32 for parity; bfloat16/float16 for
    speed); the Euler state is float32 in every mode. Call under ``torch.no_grad()`` /
    ``torch.inference_mode()``.
    """

    noise: Tensor

    def __init__(self, dims: FlowDims) -> None:
        super().__init__()
        d = dims
        self.dims = d
        self.input_embedding = nn.Embedding(d.vocab_size, d.input_size)
        self.spk_affine = nn.Linear(d.spk_embed_dim, d.n_mels)
        self.encoder = Encoder(d)
        self.encoder_proj = nn.Linear(d.enc_dim, d.n_mels)
        self.estimator = Estimator(
            in_channels=d.est_in,
            out_channels=d.est_out,
            channels=d.est_channels,
            heads=d.est_heads,
            head_dim=d.est_head_dim,
            n_blocks=d.est_blocks,
            n_mid=d.est_mid_blocks,
            chunk_frames=d.est_chunk,
        )
        self.register_buffer("noise", fixed_noise(d.n_mels, d.noise_frames), persistent=False)

    def _apply(self, fn: Any, recurse: bool = True) -> Flow:
        # ``.to(dtype)`` casts floating buffers; the noise must stay upstream's float32 values.
        super()._apply(fn, recurse)
        if self.noise.dtype != torch.float32:
            self.noise = fixed_noise(self.dims.n_mels, self.dims.noise_frames).to(self.noise.device)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.spk_affine.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.spk_affine.weight.device

    # -- pieces ------------------------------------------------------------------------------

    def fuse_(self) -> Flow:
        """Inference-time weight arrangement after loading (:meth:`Estimator.fuse_`: q/k/v in
        one matmul, tap-major conv weights, stacked time projections). Re-run it if the
        weights change (the loaders call it)."""
        self.estimator.fuse_()
        return self

    def speaker(self, embedding: Tensor) -> Tensor:
        """x-vector ``[1, spk_dim]`` -> ``[1, n_mels]``: affine of the L2-normalised vector."""
        return self.spk_affine(F.normalize(embedding.to(self.device, self.dtype), dim=1))

    def embed_tokens(self, ids: Tensor) -> Tensor:
        return self.input_embedding(ids.to(self.device).long().clamp(min=0))

    def time_grid(self) -> Tensor:
        """Cosine schedule ``[n_timesteps + 1]`` float32: 1 - cos(pi/2 * k / n)."""
        tau = torch.linspace(0, 1, self.dims.n_timesteps + 1, device=self.device, dtype=torch.float32)
        return 1 - torch.cos(tau * 0.5 * torch.pi)

    def solve(
        self,
        mu: Tensor,
        spk: Tensor,
        cond: Tensor,
        streaming: bool,
        start: int = 0,
        cache: FlowStreamCache | None = None,
        key_frames: Tensor | None = None,
        x0: Tensor | None = None,
        velocity: Callable[[Tensor, EstimatorPrep, int], Tensor] | None = None,
    ) -> Tensor:
        """CFM Euler solve for frames ``start .. start + L`` -> float32 ``[B, n_mels, L]``.

        mu, cond ``[B, n_mels, L]``; spk ``[B, n_mels]``. x starts from the fixed noise at the
        same absolute frames (the same noise for every row); with ``cache`` (B = 1 only) every
        step extends its own estimator state. The estimator sees the CFG batch as
        ``[cond rows (B), uncond rows (B)]``. ``key_frames`` ``[B]`` int64 (start = 0, no
        cache): row b's real frames are its first ``key_frames[b]``; attention reads no key
        past them (right padding, see :meth:`final_core`). ``x0`` ``[B, n_mels, L]``: the noise
        of those frames (default: the fixed noise from ``start``). ``velocity(x, prep, step)``
        (instead of ``cache``): each step's estimator call on the CFG batch's x ``[2B, n_mels,
        L]`` with this solve's ``prep`` (the fast path's fused calls over a read-only prefix
        or at a device start, ``voice_out.fast.fused_flow``); None: ``self.estimator``.

        Upstream's loop (spec 3.3) with its per-step constants made once: the time values and
        their embeddings (:meth:`Estimator.prepare`: one batched time MLP for all steps, the
        conditions' input buffer, the chunk mask), and the CFG combine and Euler update as two
        in-place multiply-adds on a float32 state that holds both CFG halves. Fixed shapes, no
        host sync: capturable as one CUDA graph.
        """
        b, _, n = mu.shape
        d = self.dims
        if start + n > d.noise_frames:
            raise ValueError(f"{start + n} mel frames exceed the flow's {d.noise_frames}-frame noise buffer")
        if cache is not None and b != 1:
            raise ValueError("a cached solve runs one stream (batch 1)")
        # Upstream's time values: the accumulated t (t_k = t_{k-1} + dt_{k-1}, dt_k = tau_{k+1} - t_k),
        # made up front so every step's time embedding comes from ONE batched call.
        tau = self.time_grid()
        t, dt = tau[0], tau[1] - tau[0]
        ts, dts = [], []
        for step in range(1, d.n_timesteps + 1):
            ts.append(t)
            dts.append(dt)
            t = t + dt
            if step < d.n_timesteps:
                dt = tau[step + 1] - t
        # x += dt ((1 + cfg) v_cond - cfg v_uncond), as two multiply-adds per step
        dt_steps = torch.stack(dts)  # [S]
        coef_cond, coef_uncond = dt_steps * (1.0 + d.cfg_rate), dt_steps * -d.cfg_rate
        mu_in = torch.cat([mu, torch.zeros_like(mu)]).to(self.dtype)
        spk_in = torch.cat([spk, torch.zeros_like(spk)]).to(self.dtype)
        cond_in = torch.cat([cond, torch.zeros_like(cond)]).to(self.dtype)
        t_steps = torch.stack(ts)
        cfg_frames = torch.cat([key_frames, key_frames]) if key_frames is not None else None  # [2B]
        prep = self.estimator.prepare(mu_in, spk_in, cond_in, t_steps.unsqueeze(1), streaming, start, cfg_frames)
        # The CFG batch's x: both halves hold the same float32 Euler state, updated together,
        # so the estimator input needs no concatenation. [2, B, n_mels, L]
        noise = x0 if x0 is not None else self.noise[:, :, start : start + n]
        x = noise.to(self.device, torch.float32).expand(2, b, -1, -1).clone()
        x_in = x.view(2 * b, -1, n)
        for step in range(d.n_timesteps):
            if velocity is not None:
                v = velocity(x_in, prep, step).view(2, b, -1, n)
            else:
                state = cache.estimator_state(step) if cache is not None else None
                v = self.estimator(
                    x_in,
                    mu_in,
                    spk_in,
                    cond_in,
                    t_steps[step].expand(2 * b),
                    streaming,
                    state,
                    start,
                    prep=prep,
                    step=step,
                ).view(2, b, -1, n)
            x.addcmul_(v[:1], coef_cond[step])
            x.addcmul_(v[1:], coef_uncond[step])
        return x[0]

    def _cond(self, prompt_feat: Tensor, start: int, n: int) -> Tensor:
        """Condition frames ``start .. start + n``: the prompt mel where it exists, else zeros."""
        cond = torch.zeros(1, self.dims.n_mels, n, device=self.device, dtype=self.dtype)
        feat = prompt_feat.to(self.device, self.dtype).transpose(1, 2)  # [1, n_mels, ratio P]
        stop = min(feat.shape[2], start + n)
        if stop > start:
            cond[:, :, : stop - start] = feat[:, :, start:stop]
        return cond

    def _check_prompt(self, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor) -> None:
        d = self.dims
        p = prompt_token.shape[1]
        if prompt_token.dim() != 2 or prompt_token.shape[0] != 1:
            raise ValueError(f"prompt_token must be [1, P], got {tuple(prompt_token.shape)}")
        if tuple(prompt_feat.shape) != (1, d.token_mel_ratio * p, d.n_mels):
            raise ValueError(
                f"prompt_feat must be [1, {d.token_mel_ratio} x {p}, {d.n_mels}], got {tuple(prompt_feat.shape)}"
            )
        if tuple(embedding.shape) != (1, d.spk_embed_dim):
            raise ValueError(f"embedding must be [1, {d.spk_embed_dim}], got {tuple(embedding.shape)}")

    # -- reference path ----------------------------------------------------------------------

    def inference(
        self,
        token: Tensor,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        streaming: bool,
        finalize: bool,
    ) -> Tensor:
        """Upstream ``flow.inference`` exactly: re-runs prompt + all tokens (spec 3.1).

        token ``[1, N]``; returns float32 ``[1, n_mels, ratio N]`` (finalize) or
        ``[1, n_mels, ratio (N - lookahead)]`` (the last ``lookahead`` tokens are context only).
        ``streaming`` selects chunk-causal attention (else full attention).
        """
        d = self.dims
        self._check_prompt(prompt_token, prompt_feat, embedding)
        spk = self.speaker(embedding)
        x = self.embed_tokens(torch.cat([prompt_token.to(self.device), token.to(self.device)], dim=1))
        if finalize:
            h = self.encoder(x, None, streaming)
        else:
            if token.shape[1] < d.pre_lookahead:
                raise ValueError(f"a non-final call needs at least {d.pre_lookahead} tokens (look-ahead)")
            h = self.encoder(x[:, : -d.pre_lookahead], x[:, -d.pre_lookahead :], streaming)
        mu = self.encoder_proj(h).transpose(1, 2)
        cond = self._cond(prompt_feat, 0, mu.shape[2])
        mel = self.solve(mu, spk, cond, streaming)
        return mel[:, :, d.token_mel_ratio * prompt_token.shape[1] :]

    def inference_batch(self, items: Sequence[tuple[Tensor, Tensor, Tensor, Tensor]]) -> list[Tensor]:
        """Several streams' non-final streaming calls in ONE batched pass.

        ``items``: (token ``[1, N_i]``, prompt_token ``[1, P_i]``, prompt_feat ``[1, ratio P_i,
        n_mels]``, embedding ``[1, spk_dim]``) per stream; item i's result is float32
        ``[1, n_mels, ratio (N_i - lookahead)]``, the same mel as ``inference(*items[i],
        streaming=True, finalize=False)``. Each call must end its real tokens on a chunk
        boundary: ``P_i + N_i - lookahead`` a multiple of the chunk (``FlowDims.chunk_aligned``),
        as every non-final chunk of upstream's schedule does; anything else raises ValueError.

        It is :meth:`batch_inputs` (host side) then :meth:`batch_core` (the pass itself).

        Why one padded batch is exact: row i holds its prompt, its tokens and its look-ahead
        tokens, then padding up to the longest row. The pre-lookahead conv of a real token t
        reads tokens t .. t + lookahead, all row i's own; every other conv is causal; attention
        is chunk-causal counted from the prompt start (the same chunk mask for every row), and
        row i's real tokens end on a chunk boundary, so no real frame attends to a padded one;
        the relative-position term depends on i - j only; the noise is taken at the same
        absolute frames for every row. Padding only adds work for the padded frames, whose
        output is dropped.
        """
        if not items:
            return []
        ids, embedding, cond, spans = self.batch_inputs(items)
        mel = self.batch_core(ids, embedding, cond)
        return [mel[i : i + 1, :, start:stop] for i, (start, stop) in enumerate(spans)]

    def batch_inputs(
        self, items: Sequence[tuple[Tensor, Tensor, Tensor, Tensor]]
    ) -> tuple[Tensor, Tensor, Tensor, list[tuple[int, int]]]:
        """Host side of :meth:`inference_batch`: check ``items`` (as there) and lay them out.

        Returns, for B items and T = the longest row's prompt + real tokens (a chunk multiple):

        * ``ids`` ``[B, T + lookahead]`` int64: row i = prompt, real tokens, look-ahead tokens,
          then padding (id 0);
        * ``embedding`` ``[B, spk_dim]`` float32: the x-vectors;
        * ``cond`` ``[B, n_mels, ratio T]`` (flow dtype): the prompt mel, then zeros;
        * ``spans``: row i's mel frames in :meth:`batch_core`'s output, ``(ratio P_i, ratio
          (P_i + N_i - lookahead))``.

        Only shapes are read on the host: no device sync.
        """
        d = self.dims
        la, ratio = d.pre_lookahead, d.token_mel_ratio
        if not items:
            raise ValueError("batch_inputs needs at least one item")
        lengths: list[tuple[int, int]] = []  # (prompt tokens, real tokens incl. the prompt)
        for token, prompt_token, prompt_feat, embedding in items:
            self._check_prompt(prompt_token, prompt_feat, embedding)
            if token.dim() != 2 or token.shape[0] != 1:
                raise ValueError(f"token must be [1, N], got {tuple(token.shape)}")
            p, n = int(prompt_token.shape[1]), int(token.shape[1])
            if n < la:
                raise ValueError(f"a non-final call needs at least {la} tokens (look-ahead)")
            if not d.chunk_aligned(p + n - la):
                raise ValueError(
                    f"a batched call must end on a {d.enc_chunk}-token chunk boundary counted from the "
                    f"prompt start; prompt + tokens = {p + n - la}"
                )
            lengths.append((p, p + n - la))
        t = max(real for _, real in lengths)
        ids, embedding, cond = self._padded_rows(items, t + la, t)  # each row: real tokens, then look-ahead
        return ids, embedding, cond, [(ratio * p, ratio * real) for p, real in lengths]

    def _padded_rows(
        self, items: Sequence[tuple[Tensor, Tensor, Tensor, Tensor]], width: int, cond_tokens: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The batched passes' common layout of checked ``items``: ids ``[B, width]`` int64 (row
        i = its prompt, then its tokens, then padding id 0), the x-vectors ``[B, spk_dim]``
        float32, and cond ``[B, n_mels, ratio cond_tokens]`` (the prompt mel, then zeros)."""
        d = self.dims
        ids = torch.zeros(len(items), width, dtype=torch.long, device=self.device)
        embedding = torch.cat([emb.to(self.device, torch.float32) for _, _, _, emb in items])
        cond = torch.zeros(len(items), d.n_mels, d.token_mel_ratio * cond_tokens, device=self.device, dtype=self.dtype)
        for i, (token, prompt_token, prompt_feat, _) in enumerate(items):
            p, n = int(prompt_token.shape[1]), int(token.shape[1])
            ids[i, :p] = prompt_token[0].to(self.device).long()
            ids[i, p : p + n] = token[0].to(self.device).long()
            cond[i : i + 1] = self._cond(prompt_feat, 0, d.token_mel_ratio * cond_tokens)
        return ids, embedding, cond

    def batch_core(self, ids: Tensor, embedding: Tensor, cond: Tensor) -> Tensor:
        """The batched non-final streaming pass over rows laid out by :meth:`batch_inputs`.

        ids ``[B, T + lookahead]`` int64 (T a multiple of the chunk), embedding ``[B, spk_dim]``,
        cond ``[B, n_mels, ratio T]`` -> mel float32 ``[B, n_mels, ratio T]``, prompt frames
        included (row i's are the first ``ratio P_i``; frames past its real tokens are padding).
        Fixed shapes, no host sync, no value-dependent allocation: capturable as one CUDA graph
        per (B, T) (``voice_out.model.token2wav`` does).
        """
        d = self.dims
        b, t = ids.shape[0], ids.shape[1] - d.pre_lookahead
        if ids.dim() != 2 or t <= 0 or tuple(embedding.shape) != (b, d.spk_embed_dim):
            raise ValueError(f"ids [B, T + {d.pre_lookahead}] and embedding [B, {d.spk_embed_dim}] expected")
        if tuple(cond.shape) != (b, d.n_mels, d.token_mel_ratio * t):
            raise ValueError(f"cond must be [{b}, {d.n_mels}, {d.token_mel_ratio * t}], got {tuple(cond.shape)}")
        return self.solve(self._streaming_mu(ids), self.speaker(embedding), cond.to(self.device, self.dtype), True)

    def _streaming_mu(self, ids: Tensor) -> Tensor:
        """The encoder's chunk-causal pass over rows ``ids`` ``[B, T + lookahead]`` (the last
        ``lookahead`` ids are context only): mu ``[B, n_mels, ratio T]``."""
        t = ids.shape[1] - self.dims.pre_lookahead
        x = self.embed_tokens(ids)
        # The encoder concatenates x and the context again, so row i's conv input is exactly
        # [prompt, tokens, look-ahead, padding].
        h = self.encoder(x[:, :t], x[:, t:], True)
        return self.encoder_proj(h).transpose(1, 2)

    def final_inputs(
        self, items: Sequence[tuple[Tensor, Tensor, Tensor, Tensor]], total: int
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, list[tuple[int, int]]]:
        """Host side of the batched final pass: lay ``items`` out as ``total`` right-padded tokens.

        ``items``: (token ``[1, N_i]``, prompt_token ``[1, P_i]``, prompt_feat ``[1, ratio P_i,
        n_mels]``, embedding ``[1, spk_dim]``) per stream, N_i >= 1; ``total`` = T >= every
        ``P_i + N_i`` (a bucket size; at most ``FlowDims.max_tokens``). Returns:

        * ``ids`` ``[B, T]`` int64: row i = prompt, tokens, then padding (id 0);
        * ``n_valid`` ``[B]`` int64: ``P_i + N_i``, the real tokens of each row;
        * ``embedding`` ``[B, spk_dim]`` float32: the x-vectors;
        * ``cond`` ``[B, n_mels, ratio T]`` (flow dtype): the prompt mel, then zeros;
        * ``spans``: row i's mel frames in :meth:`final_core`'s output, ``(ratio P_i, ratio
          (P_i + N_i))``.

        Only shapes are read on the host: no device sync.
        """
        d = self.dims
        ratio = d.token_mel_ratio
        if not items:
            raise ValueError("final_inputs needs at least one item")
        if not 0 < total <= d.max_tokens:
            raise ValueError(f"total = {total} tokens: must be in 1 .. {d.max_tokens} (the noise buffer)")
        lengths: list[tuple[int, int]] = []  # (prompt tokens, real tokens incl. the prompt)
        for token, prompt_token, prompt_feat, embedding in items:
            self._check_prompt(prompt_token, prompt_feat, embedding)
            if token.dim() != 2 or token.shape[0] != 1 or token.shape[1] < 1:
                raise ValueError(f"token must be [1, N] with N >= 1, got {tuple(token.shape)}")
            p, n = int(prompt_token.shape[1]), int(token.shape[1])
            if p + n > total:
                raise ValueError(f"prompt + tokens = {p + n} exceed total = {total}")
            lengths.append((p, p + n))
        ids, embedding, cond = self._padded_rows(items, total, total)
        n_valid = to_device([real for _, real in lengths], self.device, torch.long)
        return ids, n_valid, embedding, cond, [(ratio * p, ratio * real) for p, real in lengths]

    def final_core(self, ids: Tensor, n_valid: Tensor, embedding: Tensor, cond: Tensor) -> Tensor:
        """The final (full-attention) pass of several streams over rows laid out by
        :meth:`final_inputs`.

        ids ``[B, T]`` int64, n_valid ``[B]`` int64 (real tokens per row, 1 .. T), embedding
        ``[B, spk_dim]``, cond ``[B, n_mels, ratio T]`` -> mel float32 ``[B, n_mels, ratio T]``,
        prompt frames included: row i's frames ``0 .. ratio n_valid[i]`` equal ``inference(...,
        streaming=False, finalize=True)`` of its prompt + tokens (within float rounding);
        frames past them are finite padding. Fixed shapes, no host sync, nothing depends on
        n_valid's values on the host: capturable as one CUDA graph per (B, T).

        Why right padding is exact: the padded tokens' embedded rows are zeroed before the
        pre-lookahead conv, so the last real tokens see the zero look-ahead the unpadded call
        gives them; every other conv is causal; every attention (encoder at token and mel rate,
        estimator) masks the keys past the row's real frames, while a padded query still sees
        the real keys (no empty softmax); relative positions depend on i - j only; LayerNorms
        are per frame; the noise is taken at the same absolute frames for every row.
        """
        d = self.dims
        b, t = ids.shape[0], ids.shape[1]
        if ids.dim() != 2 or tuple(n_valid.shape) != (b,) or tuple(embedding.shape) != (b, d.spk_embed_dim):
            raise ValueError(f"ids [B, T], n_valid [B] and embedding [B, {d.spk_embed_dim}] expected")
        if tuple(cond.shape) != (b, d.n_mels, d.token_mel_ratio * t):
            raise ValueError(f"cond must be [{b}, {d.n_mels}, {d.token_mel_ratio * t}], got {tuple(cond.shape)}")
        n_valid = n_valid.to(self.device)
        spk = self.speaker(embedding)  # [B, n_mels]
        h = self.encoder(self.embed_tokens(ids), None, False, n_valid=n_valid)
        mu = self.encoder_proj(h).transpose(1, 2)
        cond = cond.to(self.device, self.dtype)
        return self.solve(mu, spk, cond, False, key_frames=n_valid * d.token_mel_ratio)

    # -- a first chunk from the voice's prompt prefix -------------------------------------------

    def prefix_inputs(self, token: Tensor, prompt: FlowPrompt) -> tuple[Tensor, Tensor, Tensor]:
        """Host side of :meth:`prefix_core`: a non-final streaming call of ``token`` ``[1, N]``
        (the tokens so far, the look-ahead tokens last) for the voice of ``prompt``.

        Returns ``ids`` ``[1, P + N]`` int64 (prompt, tokens), ``embedding`` ``[1, spk_dim]``
        and ``cond`` ``[1, n_mels, ratio (P + N - lookahead - n_prefix)]`` (flow dtype: the
        prompt mel from the prefix's end, then zeros). The real tokens must end on a chunk
        boundary (as in :meth:`inference_batch`), else ValueError. No device sync.
        """
        d = self.dims
        p, n = prompt.n_prompt, int(token.shape[1])
        if token.dim() != 2 or token.shape[0] != 1 or n <= d.pre_lookahead:
            raise ValueError(f"token must be [1, N] with N > {d.pre_lookahead} (look-ahead), got {tuple(token.shape)}")
        if not d.chunk_aligned(p + n - d.pre_lookahead):
            raise ValueError(
                f"prompt + real tokens = {p + n - d.pre_lookahead}: not on a {d.enc_chunk}-token chunk boundary"
            )
        ids = torch.cat([prompt.prompt_token.to(self.device).long(), token.to(self.device).long()], dim=1)
        f0, f1 = d.token_mel_ratio * prompt.n_prefix, d.token_mel_ratio * (p + n - d.pre_lookahead)
        return ids, prompt.embedding.to(self.device), self._cond(prompt.prompt_feat, f0, f1 - f0)

    def prefix_core(self, ids: Tensor, embedding: Tensor, cond: Tensor, prefix: FlowStreamCache) -> Tensor:
        """A non-final streaming call from a voice's prompt prefix (``FlowPrompt.prefix``):
        the same mel as ``inference(..., streaming=True, finalize=False)`` for the frames from
        the prefix's end on, without recomputing the prefix's frames in the 10 estimator calls.

        ids ``[1, T + lookahead]`` (prompt, real tokens ending on a chunk boundary, look-ahead),
        embedding ``[1, spk_dim]``, cond ``[1, n_mels, ratio (T - n_prefix)]``
        (:meth:`prefix_inputs`) -> mel float32 ``[1, n_mels, ratio (T - n_prefix)]``: the
        prompt's frames after the prefix, then the tokens'.

        Why it is exact: every estimator dependency on earlier frames is chunk-causal attention
        or a causal conv, and the prefix ends on a chunk boundary with its look-ahead inside the
        prompt, so its keys, values and conv contexts at every Euler step do not depend on the
        tokens (see "Why caching is exact" in docs/token2wav.md); the encoder runs over the
        whole prompt + tokens (a few hundred kernels whatever their number) and its frames
        from the prefix's end on are the ones this call needs.

        The plain estimator extends a state as it reads it, so the prefix is first copied into
        a state of this call's size (the fast path's fused calls only read it:
        ``voice_out.fast.fused_flow.FusedFlow.prefix_core``).
        """
        mu, spk, cond, f0 = self.prefix_conditions(ids, embedding, cond, prefix)
        state = self.allocate_stream_cache(ids.shape[1] - self.dims.pre_lookahead)
        state.copy_prefix_(prefix, prefix.n_done, self.dims.token_mel_ratio)
        return self.solve(mu, spk, cond, True, f0, state)

    def prefix_conditions(
        self, ids: Tensor, embedding: Tensor, cond: Tensor, prefix: FlowStreamCache
    ) -> tuple[Tensor, Tensor, Tensor, int]:
        """The checked conditions of :meth:`prefix_core`'s solve: mu ``[1, n_mels, L]``, spk
        ``[1, n_mels]``, cond ``[1, n_mels, L]`` (flow dtype) and the first frame after the
        prefix, L = ratio (T - n_prefix); ValueError on shapes that do not fit."""
        d = self.dims
        ratio = d.token_mel_ratio
        b, t = ids.shape[0], ids.shape[1] - d.pre_lookahead
        n_pre = prefix.n_done
        if ids.dim() != 2 or b != 1 or t <= n_pre or tuple(embedding.shape) != (1, d.spk_embed_dim):
            raise ValueError(
                f"ids [1, T + {d.pre_lookahead}] with T past the prefix's {n_pre} tokens and embedding "
                f"[1, {d.spk_embed_dim}] expected"
            )
        if tuple(cond.shape) != (1, d.n_mels, ratio * (t - n_pre)):
            raise ValueError(f"cond must be [1, {d.n_mels}, {ratio * (t - n_pre)}], got {tuple(cond.shape)}")
        spk = self.speaker(embedding)
        f0 = ratio * n_pre
        mu = self._streaming_mu(ids)[:, :, f0:]
        return mu, spk, cond.to(self.device, self.dtype), f0

    # -- a stream's own state: the prompt prefix, then each chunk extends it -------------------

    def allocate_stream_cache(self, capacity: int) -> FlowStreamCache:
        """An empty :class:`FlowStreamCache` for ``capacity`` tokens (prompt included)."""
        d = self.dims
        if capacity > d.max_tokens:
            capacity = d.max_tokens
        frames = capacity * d.token_mel_ratio
        kw: dict[str, Any] = {"device": self.device, "dtype": self.dtype}
        enc = (d.enc_blocks, 1, d.enc_heads, capacity, d.enc_head_dim)
        up = (d.enc_up_blocks, 1, d.enc_heads, frames, d.enc_head_dim)
        est = (d.n_timesteps, d.n_est_blocks, 2, d.est_heads, frames, d.est_head_dim)
        c = UPSTREAM_ENCODER_CHANNELS
        return FlowStreamCache(
            tokens=torch.zeros(capacity, dtype=torch.long, device=self.device),
            enc_k=torch.zeros(enc, **kw),
            enc_v=torch.zeros(enc, **kw),
            la_ctx=torch.zeros(1, c, LOOKAHEAD_CONV2_KERNEL - 1, **kw),
            up_ctx=torch.zeros(1, c, 2 * d.token_mel_ratio, **kw),
            up_k=torch.zeros(up, **kw),
            up_v=torch.zeros(up, **kw),
            est_k=torch.zeros(est, **kw),
            est_v=torch.zeros(est, **kw),
            est_ctx=[torch.zeros(d.n_timesteps, 2, ch, 2, **kw) for ch in self.estimator.conv_channels()],
            enc_pos=torch.zeros(d.enc_blocks, 1, d.enc_heads, capacity + d.enc_chunk - 1, d.enc_head_dim, **kw),
            up_pos=torch.zeros(d.enc_up_blocks, 1, d.enc_heads, frames + d.up_chunk - 1, d.enc_head_dim, **kw),
        )

    def _advance(self, cache: FlowStreamCache, context: Tensor | None, spk: Tensor, prompt_feat: Tensor) -> Tensor:
        """Run tokens ``n_done .. n_tokens`` of ``cache`` through the whole flow, chunk-causally,
        extending every layer's state; ``context`` ``[1, lookahead]`` ids or None (zeros).
        Returns their float32 mel ``[1, n_mels, ratio (n_tokens - n_done)]``."""
        mu, cond, f0 = self._encode_next(cache, context, prompt_feat)
        mel = self.solve(mu, spk.to(self.device, self.dtype), cond, True, f0, cache)
        cache.n_done = cache.n_tokens
        return mel

    def _encode_next(
        self, cache: FlowStreamCache, context: Tensor | None, prompt_feat: Tensor
    ) -> tuple[Tensor, Tensor, int]:
        """The encoder's part of :meth:`_advance` (extends the cache's encoder state): mu and
        cond ``[1, n_mels, ratio (n_tokens - n_done)]`` and the first frame, ratio n_done."""
        key = StateKey(cache.n_done, cache.n_tokens, cache.enc_pos_valid, cache.up_pos_valid)
        mu = self.state_mu(cache, context, key)
        f0 = key.start * self.dims.token_mel_ratio
        return mu, self._cond(prompt_feat, f0, mu.shape[2]), f0

    def prepare_prompt(self, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor) -> FlowPrompt:
        """Precompute a voice's prompt state (once per voice; reuse it for every request).

        Runs the largest chunk-aligned prefix of the prompt that has ``pre_lookahead`` prompt
        tokens after it through the flow and keeps every layer's state (see :class:`FlowPrompt`).
        """
        d = self.dims
        self._check_prompt(prompt_token, prompt_feat, embedding)
        p = prompt_token.shape[1]
        token = prompt_token.to(self.device).long()
        n_prefix = max(p - d.pre_lookahead, 0)
        while n_prefix > 0 and not d.chunk_aligned(n_prefix):
            n_prefix -= 1
        spk = self.speaker(embedding)
        prefix = self.allocate_stream_cache(n_prefix)
        if n_prefix > 0:
            prefix.tokens[:n_prefix] = token[0, :n_prefix]
            prefix.n_tokens = n_prefix
            self._advance(prefix, token[:, n_prefix : n_prefix + d.pre_lookahead], spk, prompt_feat)
        return FlowPrompt(
            prompt_token=token,
            prompt_feat=prompt_feat.to(self.device, torch.float32),
            embedding=embedding.to(self.device, torch.float32),
            spk=spk,
            prefix=prefix,
        )

    def reset_stream_cache(self, cache: FlowStreamCache, prompt: FlowPrompt) -> None:
        """Start a new request in ``cache`` (in place): copy the prompt prefix state in."""
        p = prompt.n_prompt
        if cache.capacity < p:
            raise ValueError(f"cache capacity {cache.capacity} tokens < prompt length {p}")
        cache.copy_prefix_(prompt.prefix, prompt.n_prefix, self.dims.token_mel_ratio)
        cache.tokens[:p] = prompt.prompt_token[0]
        cache.n_tokens = p
        cache.n_done = prompt.n_prefix
        cache.finished = False
        cache.prompt = prompt

    def _split_chunk(self, cache: FlowStreamCache, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """A non-final chunk's ``tokens`` ``[1, n_new + lookahead]`` as (new, look-ahead), checked:
        the new tokens must end on a chunk boundary counted from the prompt start."""
        d = self.dims
        if tokens.shape[1] <= d.pre_lookahead:
            raise ValueError(f"a non-final chunk needs new tokens plus {d.pre_lookahead} look-ahead tokens")
        stop = cache.n_tokens + tokens.shape[1] - d.pre_lookahead
        if not d.chunk_aligned(stop):
            raise ValueError(
                f"a non-final chunk must end on a {d.enc_chunk}-token chunk boundary counted from the "
                f"prompt start; prompt + tokens = {stop}"
            )
        return tokens[:, : -d.pre_lookahead], tokens[:, -d.pre_lookahead :]

    # -- a stream's own state under CUDA graphs ----------------------------------------------

    def state_inputs(
        self,
        cache: FlowStreamCache,
        tokens: Tensor,
        encode: Callable[[Tensor, StateKey], Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Host side and encoder of :meth:`state_core`: the next non-final chunk of the stream
        whose state is ``cache`` (reset to its prompt, :meth:`reset_stream_cache`).

        ``tokens`` ``[1, n_new + lookahead]``: the tokens not given yet, then the look-ahead (the new
        tokens must end on a chunk boundary). The cache is never grown (a graph holds its
        buffers): ValueError when they do not fit its capacity. Appends the new tokens, runs
        the encoder over them (its state extended) and counts them as done, so
        :meth:`state_core` must run next, on what this returns: mu ``[1, n_mels, L]``, spk
        ``[1, n_mels]``, cond ``[1, n_mels, L]`` (flow dtype), x0 ``[1, n_mels, L]`` (the fixed
        noise of those frames, float32) and at ``[1]`` int64 (their first frame, on the
        device), L = ratio x (tokens since the last boundary). No device sync.

        ``encode(context, key)``: how the encoder runs: :meth:`state_mu` (the default, eager:
        a few hundred small kernels whatever the length) or a CUDA graph of it per ``key``.
        """
        d = self.dims
        prompt = cache.prompt
        if prompt is None or cache.finished:
            raise ValueError("state_inputs needs a stream cache reset to a prompt and not finalized")
        if tokens.dim() != 2 or tokens.shape[0] != 1:
            raise ValueError(f"tokens must be [1, n], got {tuple(tokens.shape)}")
        new, context = self._split_chunk(cache, tokens.to(self.device).long())
        stop = cache.n_tokens + new.shape[1]
        if stop > cache.capacity:
            raise ValueError(f"{stop} tokens (prompt included) exceed the stream state's capacity of {cache.capacity}")
        f0, n = d.token_mel_ratio * cache.n_done, d.token_mel_ratio * (stop - cache.n_done)
        if f0 + n > d.noise_frames:
            raise ValueError(f"{f0 + n} mel frames exceed the flow's {d.noise_frames}-frame noise buffer")
        cache.tokens[cache.n_tokens : stop] = new[0]
        key = StateKey(cache.n_done, stop, cache.enc_pos_valid, cache.up_pos_valid)
        mu = (encode or partial(self.state_mu, cache))(context, key)
        # what the encoder's call left in the cache's host fields (a replayed graph runs no Python)
        cache.enc_pos_valid, cache.up_pos_valid = self.encoder.pos_valid_after(stop, key.enc_valid, key.up_valid)
        cache.n_tokens = cache.n_done = stop
        x0 = self.noise[:, :, f0 : f0 + n].to(self.device, torch.float32)
        cond = self._cond(prompt.prompt_feat, f0, n)
        return mu, prompt.spk, cond, x0, to_device([f0], self.device, torch.long)

    def state_mu(self, cache: FlowStreamCache, context: Tensor | None, key: StateKey) -> Tensor:
        """The encoder's part of a chunk on a stream's state: tokens ``key.start .. key.stop``
        of ``cache`` (already in its ``tokens``) and ``context`` ``[1, lookahead]`` ids (None:
        zeros) ->
        mu ``[1, n_mels, ratio (stop - start)]``, the cache's encoder state extended. The cache's
        host fields are set from ``key`` first, so every run of one key takes the same path
        (a CUDA graph per key: its warm-up and capture both run this); the caller sets them
        after (:meth:`state_inputs`)."""
        cache.n_done, cache.n_tokens = key.start, key.stop
        cache.enc_pos_valid, cache.up_pos_valid = key.enc_valid, key.up_valid
        start, stop = key.start, key.stop
        x = self.embed_tokens(cache.tokens[start:stop].unsqueeze(0))
        ctx = self.embed_tokens(context) if context is not None else None
        h = self.encoder(x, ctx, True, cache, start)
        return self.encoder_proj(h).transpose(1, 2)

    def state_core(
        self, mu: Tensor, spk: Tensor, cond: Tensor, x0: Tensor, at: Tensor, cache: FlowStreamCache
    ) -> Tensor:
        """The 10 estimator calls of a stream's next non-final chunk (:meth:`state_inputs` made
        its arguments), extending the estimator state of ``cache`` at frame ``at``: float32
        ``[1, n_mels, L]``, the chunk's mel (the matching slice of the re-run's).

        The plain estimator reads the start on the host (a sync): the same result as the fast
        path's fused calls, which read it on the device and so are capturable
        (``voice_out.fast.fused_flow.FusedFlow.state_core``).
        """
        return self.solve(mu, spk, cond, True, int(at.item()), cache, x0=x0)
