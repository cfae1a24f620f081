"""The flow's dimensions and the state it keeps, below both the flow and its encoder.

:class:`FlowDims` (read from the checkpoint's config), :class:`FlowStreamCache` (the incremental
state of one stream, or of a voice's prompt prefix) and :class:`FlowPrompt` (a voice's prepared
flow inputs). :mod:`voice_out.model.flow` and :mod:`voice_out.model.flow_encoder` both import
them from here, so neither has to import the other.

Pure torch: no I/O, no threads, no logging.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import Tensor

from voice_out.model.flow_estimator import EstimatorState

#: Hard-coded by upstream, in no config file (parity README: the only fixed flow constants).
UPSTREAM_ENCODER_CHANNELS = 512  # PreLookaheadLayer and Upsample1D widths
UPSTREAM_UP_BLOCKS = 4  # conformer blocks after the upsampling
N_TIMESTEPS = 10  # Euler steps of the CFM
NOISE_FRAMES = 15000  # fixed noise buffer length (300 s of mel); longer inputs are rejected


@dataclass(frozen=True)
class FlowDims:
    """Every dimension of the flow, read from ``cosyvoice2.yaml`` (see :meth:`from_config`)."""

    vocab_size: int  # speech tokens (6561)
    input_size: int  # token embedding width (512)
    n_mels: int  # flow output_size (80)
    spk_embed_dim: int  # x-vector width (192)
    token_mel_ratio: int  # mel frames per token = upsampling stride (2)
    pre_lookahead: int  # look-ahead tokens (3)
    enc_input_size: int  # encoder embed input width (512)
    enc_dim: int  # encoder output_size (512)
    enc_heads: int
    enc_ffn: int  # linear_units
    enc_blocks: int  # num_blocks before the upsampling
    enc_chunk: int  # static_chunk_size in tokens (25)
    cfg_rate: float  # inference_cfg_rate (0.7)
    est_in: int  # estimator in_channels (320 = x, mu, spks, cond)
    est_out: int  # estimator out_channels (80)
    est_channels: int  # channels[0]
    est_heads: int
    est_head_dim: int
    est_blocks: int  # transformer blocks per stage
    est_mid_blocks: int
    est_chunk: int  # estimator static_chunk_size in frames (50)
    enc_up_blocks: int = UPSTREAM_UP_BLOCKS
    n_timesteps: int = N_TIMESTEPS
    noise_frames: int = NOISE_FRAMES

    def __post_init__(self) -> None:
        checks = [
            (self.enc_dim % self.enc_heads == 0, f"encoder output_size {self.enc_dim} % heads {self.enc_heads} != 0"),
            (
                self.enc_dim == UPSTREAM_ENCODER_CHANNELS,
                f"encoder output_size {self.enc_dim}: upstream hard-codes {UPSTREAM_ENCODER_CHANNELS} "
                "channels in its pre-lookahead and upsampling layers",
            ),
            (self.est_in == 4 * self.n_mels, f"estimator in_channels {self.est_in} != 4 x {self.n_mels} mel bins"),
            (self.est_out == self.n_mels, f"estimator out_channels {self.est_out} != {self.n_mels} mel bins"),
            (self.token_mel_ratio >= 1 and self.pre_lookahead >= 1, "token_mel_ratio and pre_lookahead must be >= 1"),
            (self.enc_chunk > 0 and self.est_chunk > 0, "streaming chunk sizes must be > 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)

    @property
    def enc_head_dim(self) -> int:
        return self.enc_dim // self.enc_heads

    @property
    def up_chunk(self) -> int:
        """Chunk of the upsampled conformer stage, in frames (25 x 2)."""
        return self.enc_chunk * self.token_mel_ratio

    @property
    def n_est_blocks(self) -> int:
        """Transformer blocks of the estimator (down + mid + up)."""
        return self.est_blocks * (self.est_mid_blocks + 2)

    @property
    def max_tokens(self) -> int:
        """Prompt + generated tokens the fixed noise buffer can cover."""
        return self.noise_frames // self.token_mel_ratio

    def chunk_aligned(self, n_tokens: int) -> bool:
        """Whether a stream may stop at ``n_tokens`` (prompt included) and keep its state final."""
        frames = n_tokens * self.token_mel_ratio
        return n_tokens % self.enc_chunk == 0 and frames % self.est_chunk == 0

    def upstream_plan(self, n_prompt: int, n_tokens: int) -> list[tuple[int, int, bool]]:
        """Upstream's streaming chunk plan for these dims, as (offset, hop, finalize): a chunk
        plus the pad that makes the first chunk end aligned (``chunk_aligned``: the encoder's
        and the estimator's chunks), then x2 up to 4 chunks; the rest is the final chunk. For
        CosyVoice2's dims it is the engine's ``chunk_schedule`` (25 + pad, 50, 100, ...)."""
        hop = self.enc_chunk
        pad = -n_prompt % hop
        while not self.chunk_aligned(n_prompt + hop + pad):
            pad += self.enc_chunk
        plan: list[tuple[int, int, bool]] = []
        offset, first = 0, True
        while True:
            now = hop + pad if first else hop
            if n_tokens - offset < now + self.pre_lookahead:
                plan.append((offset, n_tokens - offset, True))
                return plan
            plan.append((offset, now, False))
            offset, first = offset + now, False
            hop = min(4 * self.enc_chunk, 2 * hop)

    @staticmethod
    def from_config(flow: Mapping[str, Any]) -> FlowDims:
        """Build from the kwargs of the ``flow: !new:...CausalMaskedDiffWithXvec`` node."""

        def kw(node: Any) -> Mapping[str, Any]:
            return getattr(node, "kwargs", node)

        def need(src: Mapping[str, Any], key: str, where: str) -> Any:
            if key not in src:
                raise KeyError(f"cosyvoice2.yaml: {where}.{key} is missing")
            return src[key]

        enc = kw(need(flow, "encoder", "flow"))
        dec = kw(need(flow, "decoder", "flow"))
        est = kw(need(dec, "estimator", "flow.decoder"))
        cfm = kw(dec.get("cfm_params", {}))
        cfm = kw(cfm.get("content", cfm))
        channels = list(need(est, "channels", "flow.decoder.estimator"))
        if len(channels) != 1:
            raise ValueError(f"flow.decoder.estimator.channels = {channels}: only one level is supported")
        if str(cfm.get("t_scheduler", "cosine")) != "cosine" or str(cfm.get("solver", "euler")) != "euler":
            raise ValueError("flow.decoder.cfm_params: only the euler solver with the cosine scheduler is supported")
        if str(est.get("act_fn", "gelu")) != "gelu":
            raise ValueError(f"flow.decoder.estimator.act_fn = {est.get('act_fn')!r}: only 'gelu' is supported")
        left = est.get("num_decoding_left_chunks", -1)
        if int(left) >= 0:
            raise ValueError(f"flow.decoder.estimator.num_decoding_left_chunks = {left}: only -1 (all) is supported")
        return FlowDims(
            vocab_size=int(need(flow, "vocab_size", "flow")),
            input_size=int(need(flow, "input_size", "flow")),
            n_mels=int(need(flow, "output_size", "flow")),
            spk_embed_dim=int(need(flow, "spk_embed_dim", "flow")),
            token_mel_ratio=int(need(flow, "token_mel_ratio", "flow")),
            pre_lookahead=int(need(flow, "pre_lookahead_len", "flow")),
            enc_input_size=int(need(enc, "input_size", "flow.encoder")),
            enc_dim=int(need(enc, "output_size", "flow.encoder")),
            enc_heads=int(need(enc, "attention_heads", "flow.encoder")),
            enc_ffn=int(need(enc, "linear_units", "flow.encoder")),
            enc_blocks=int(need(enc, "num_blocks", "flow.encoder")),
            enc_chunk=int(need(enc, "static_chunk_size", "flow.encoder")),
            cfg_rate=float(cfm.get("inference_cfg_rate", 0.7)),
            est_in=int(need(est, "in_channels", "flow.decoder.estimator")),
            est_out=int(need(est, "out_channels", "flow.decoder.estimator")),
            est_channels=int(channels[0]),
            est_heads=int(need(est, "num_heads", "flow.decoder.estimator")),
            est_head_dim=int(need(est, "attention_head_dim", "flow.decoder.estimator")),
            est_blocks=int(need(est, "n_blocks", "flow.decoder.estimator")),
            est_mid_blocks=int(need(est, "num_mid_blocks", "flow.decoder.estimator")),
            est_chunk=int(need(est, "static_chunk_size", "flow.decoder.estimator")),
        )


@dataclass
class FlowStreamCache:
    """Incremental flow state of one request (or of a voice's prompt prefix). Preallocated for
    ``capacity`` tokens (prompt included), never grown (a CUDA graph may hold its buffers).

    Shapes (Tc = capacity tokens, Fc = ratio x Tc frames, S = Euler steps, dtype = the flow's):

    * ``tokens`` ``[Tc]`` int64: prompt + new tokens received.
    * ``enc_k`` / ``enc_v`` ``[enc_blocks, 1, H, Tc, D]``: keys/values of the first conformer stage.
    * ``la_ctx`` ``[1, 512, 2]``: last two pre-lookahead conv1 outputs (conv2's left context).
    * ``up_ctx`` ``[1, 512, 2 ratio]``: last upsampled frames (the upsampling conv's left context).
    * ``up_k`` / ``up_v`` ``[4, 1, H, Fc, D]``: keys/values of the upsampled conformer stage.
    * ``enc_pos`` ``[enc_blocks, 1, H, Tc + 24, D]`` / ``up_pos`` ``[4, 1, H, Fc + 49, D]``: each
      layer's projected relative-position keys for r = -(chunk - 1) .. (a function of r only;
      kept per stream so a chunk projects only its new distances); the first
      ``enc_pos_valid`` / ``up_pos_valid`` rows are filled.
    * ``est_k`` / ``est_v`` ``[S, n_tb, 2, He, Fc, De]``: estimator keys/values per Euler step,
      transformer block and CFG row.
    * ``est_ctx``: per estimator causal conv, ``[S, 2, C_in, 2]`` (its last two input frames).
    * ``n_tokens``: tokens in ``tokens``; ``n_done``: tokens whose state is final (a chunk
      boundary); ``finished``: the final chunk was made.

    Memory per frame of capacity ~ S x n_tb x 2 rows x 2 (k, v) x He x De elements (2.3 MB in
    bf16 for CosyVoice2-0.5B): size ``capacity`` for the expected utterance length.
    """

    tokens: Tensor
    enc_k: Tensor
    enc_v: Tensor
    la_ctx: Tensor
    up_ctx: Tensor
    up_k: Tensor
    up_v: Tensor
    est_k: Tensor
    est_v: Tensor
    est_ctx: list[Tensor]
    enc_pos: Tensor
    up_pos: Tensor
    enc_pos_valid: int = 0
    up_pos_valid: int = 0
    n_tokens: int = 0
    n_done: int = 0
    finished: bool = False
    prompt: FlowPrompt | None = field(default=None, repr=False)

    @property
    def capacity(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def nbytes(self) -> int:
        """Device memory held by this cache's tensors."""
        tensors = [self.tokens, self.enc_k, self.enc_v, self.la_ctx, self.up_ctx, self.up_k, self.up_v]
        tensors += [self.est_k, self.est_v, self.enc_pos, self.up_pos, *self.est_ctx]
        return sum(t.numel() * t.element_size() for t in tensors)

    def to(self, device: torch.device | str) -> FlowStreamCache:
        """This cache on ``device`` (e.g. a voice's prompt prefix kept in host memory); tensors
        already on ``device`` are shared, not copied."""
        moved: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                moved[f.name] = value.to(device)
            elif f.name == "est_ctx":
                moved[f.name] = [t.to(device) for t in value]
        return replace(self, **moved)

    def estimator_state(self, step: int) -> EstimatorState:
        n_tb = self.est_k.shape[1]
        kv = [(self.est_k[step, i], self.est_v[step, i]) for i in range(n_tb)]
        return EstimatorState(kv=kv, conv_ctx=[c[step] for c in self.est_ctx])

    def copy_prefix_(self, src: FlowStreamCache, n_tokens: int, ratio: int) -> None:
        """Copy the state of ``src``'s first ``n_tokens`` tokens into this cache (in place)."""
        f = n_tokens * ratio
        self.tokens[:n_tokens] = src.tokens[:n_tokens]
        self.enc_k[:, :, :, :n_tokens] = src.enc_k[:, :, :, :n_tokens]
        self.enc_v[:, :, :, :n_tokens] = src.enc_v[:, :, :, :n_tokens]
        self.up_k[:, :, :, :f] = src.up_k[:, :, :, :f]
        self.up_v[:, :, :, :f] = src.up_v[:, :, :, :f]
        self.est_k[:, :, :, :, :f] = src.est_k[:, :, :, :, :f]
        self.est_v[:, :, :, :, :f] = src.est_v[:, :, :, :, :f]
        self.la_ctx.copy_(src.la_ctx)
        self.up_ctx.copy_(src.up_ctx)
        for dst, s in zip(self.est_ctx, src.est_ctx, strict=True):
            dst.copy_(s)
        self.enc_pos[:, :, :, : src.enc_pos_valid] = src.enc_pos[:, :, :, : src.enc_pos_valid]
        self.up_pos[:, :, :, : src.up_pos_valid] = src.up_pos[:, :, :, : src.up_pos_valid]
        self.enc_pos_valid = src.enc_pos_valid
        self.up_pos_valid = src.up_pos_valid


@dataclass
class FlowPrompt:
    """A voice's flow state, made once by :meth:`Flow.prepare_prompt` and shared read-only.

    ``prompt_token`` ``[1, P]`` int64, ``prompt_feat`` ``[1, ratio P, n_mels]`` float32,
    ``embedding`` ``[1, spk_dim]`` float32, ``spk`` ``[1, n_mels]`` (flow dtype). ``prefix``
    holds the final state of the first ``n_prefix`` prompt tokens: the largest chunk boundary
    with ``pre_lookahead`` prompt tokens after it (the rest of the prompt depends on the first
    generated tokens through chunk attention and is computed with the first chunk).
    """

    prompt_token: Tensor
    prompt_feat: Tensor
    embedding: Tensor
    spk: Tensor
    prefix: FlowStreamCache

    @property
    def n_prompt(self) -> int:
        return int(self.prompt_token.shape[1])

    @property
    def n_prefix(self) -> int:
        return self.prefix.n_done

    @property
    def nbytes(self) -> int:
        return self.prefix.nbytes

    def to(self, device: torch.device | str) -> FlowPrompt:
        """This prompt on ``device`` (tensors already there are shared). A prompt kept in
        host memory still serves ``reset_stream_cache``: its state is copied into the request's
        cache on the flow's device."""
        return FlowPrompt(
            prompt_token=self.prompt_token.to(device),
            prompt_feat=self.prompt_feat.to(device),
            embedding=self.embedding.to(device),
            spk=self.spk.to(device),
            prefix=self.prefix.to(device),
        )
