"""The flow's encoder: ``UpsampleConformerEncoder`` (spec section 3.2), reference and cached.

Tokens ``[1, T, 512]`` -> Linear + LN + x sqrt(d) -> pre-lookahead (conv k=4 over t..t+3, leaky
0.01, causal conv k=3, residual) -> conformer blocks with ESPnet relative-position attention
(``pos_bias_u`` / ``pos_bias_v``, interleaved sin/cos table, LN eps 1e-12, SiLU FFN) -> x ratio
nearest upsampling + causal conv k = 2 ratio + 1 -> Linear + LN + x sqrt(d) -> 4 conformer
blocks -> LN: ``[1, ratio T, enc_dim]``. Chunk-causal attention when streaming (chunks counted
from the first prompt token).

With a stream cache (:class:`voice_out.model.flow_dims.FlowStreamCache`) each call continues the
stream: every layer reads and extends its cached keys/values, conv left contexts and projected
relative-position keys, so a call costs its new tokens (plus attention over cached keys).

Pure torch: no I/O, no threads, no global state.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from voice_out.model.flow_dims import UPSTREAM_ENCODER_CHANNELS, FlowDims, FlowStreamCache
from voice_out.model.flow_estimator import append_kv, causal_conv, chunk_mask, valid_keys

#: Hard-coded by upstream, in no config file (with the two of flow_dims).
ENC_LN_EPS = 1e-5  # embed / up_embed / after_norm
BLOCK_LN_EPS = 1e-12  # conformer blocks (norm_mha, norm_ff)
LOOKAHEAD_CONV2_KERNEL = 3
LEAKY_SLOPE = 0.01


def rel_pos_rows(r_min: int, count: int, dim: int, device: torch.device) -> Tensor:
    """ESPnet relative positional rows ``[count, dim]`` (float32) for r = r_min, r_min + 1, ...

    Row k encodes distance r = r_min + k with interleaved sin/cos: ``[2m] = sin(r w_m)``,
    ``[2m+1] = cos(r w_m)``, ``w_m = 10000^(-2m/dim)``; the products are formed in float32 the
    way upstream's table is, so any row of it is reproduced bit for bit.
    """
    r = (r_min + torch.arange(count, device=device)).float().unsqueeze(1)
    div = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32, device=device) * -(math.log(10000.0) / dim))
    arg = r * div
    pe = torch.empty(count, dim, device=device)
    pe[:, 0::2] = torch.sin(arg)
    pe[:, 1::2] = torch.cos(arg)
    return pe


def rel_index(start: int, t: int, tk: int, r_min: int, rows: int, device: torch.device) -> Tensor:
    """Row of the positional table for query i = start + i' and key j: ``i - j - r_min``
    ``[t, tk]`` (long), clamped into the table (clamped entries are masked-out pairs)."""
    i = torch.arange(start, start + t, device=device).unsqueeze(1)
    j = torch.arange(tk, device=device).unsqueeze(0)
    return (i - j - r_min).clamp_(0, rows - 1)


def pos_rows(n_keys: int, chunk: int) -> int:
    """Rows of a cached stage's positional keys that a call ending at ``n_keys`` keys reads:
    r = -(chunk - 1) .. n_keys - 1 (chunk-causal keys never lie further ahead)."""
    return n_keys + chunk - 1


class RelPosAttention(nn.Module):
    """Transformer-XL style relative-position multi-head attention (ESPnet ``rel_selfattn``).

    score_h(i, j) = [(q_i + u_h) . k_j + (q_i + v_h) . Wpos PE(i - j)] / sqrt(d_head).
    """

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.linear_q = nn.Linear(dim, dim)
        self.linear_k = nn.Linear(dim, dim)
        self.linear_v = nn.Linear(dim, dim)
        self.linear_out = nn.Linear(dim, dim)
        self.linear_pos = nn.Linear(dim, dim, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(heads, self.head_dim))
        self.pos_bias_v = nn.Parameter(torch.zeros(heads, self.head_dim))

    def project_pos(self, pe: Tensor) -> Tensor:
        """PE rows ``[R, C]`` -> per-head positional keys ``[1, H, R, D]``."""
        return self.linear_pos(pe).view(1, -1, self.heads, self.head_dim).transpose(1, 2)

    def forward(
        self,
        x: Tensor,
        pos: Tensor,
        pos_index: Tensor,
        mask: Tensor | None,
        kv: tuple[Tensor, Tensor] | None,
        start: int,
    ) -> Tensor:
        """x ``[B, T, C]`` at absolute positions ``start ..``; pos ``[1, H, R, D]`` positional
        keys (``project_pos``) and pos_index ``[T, Tk]`` the row of each (query, key) pair
        (``rel_index``); mask: bool "may attend", broadcastable to ``[B, H, T, Tk]`` (``[T,
        Tk]`` chunk mask, ``[B, 1, 1, Tk]`` key padding or both combined), or None; kv = cached
        (k, v) ``[1, H, capacity, D]`` written at ``start ..`` (keys then cover 0 .. start + T)
        or None (start must be 0)."""
        b, t, _ = x.shape
        hd = self.head_dim
        q = self.linear_q(x).view(b, t, self.heads, hd)
        k = self.linear_k(x).view(b, t, self.heads, hd).transpose(1, 2)  # [B, H, T, D]
        v = self.linear_v(x).view(b, t, self.heads, hd).transpose(1, 2)
        if kv is not None:
            k, v = append_kv(kv, k, v, start)
        tk = k.shape[2]
        ac = (q + self.pos_bias_u).transpose(1, 2) @ k.transpose(-2, -1)  # [B, H, T, Tk]
        bd = (q + self.pos_bias_v).transpose(1, 2) @ pos.transpose(-2, -1)  # [B, H, T, R]
        bd = torch.gather(bd, 3, pos_index.expand(b, self.heads, t, tk))  # relative shift
        scores = (ac + bd) / math.sqrt(hd)
        if mask is None:
            attn = torch.softmax(scores, dim=-1)
        else:
            scores = scores.masked_fill(~mask, float("-inf"))
            attn = torch.softmax(scores, dim=-1).masked_fill(~mask, 0.0)
        out = (attn @ v).transpose(1, 2).reshape(b, t, self.heads * hd)
        return self.linear_out(out)


class ConformerBlock(nn.Module):
    """Pre-LN block: x + MHA_rel(LN(x)); x + W2 SiLU(W1 LN(x)). No macaron, no conv module."""

    def __init__(self, dim: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.self_attn = RelPosAttention(dim, heads)
        self.norm_mha = nn.LayerNorm(dim, eps=BLOCK_LN_EPS)
        self.norm_ff = nn.LayerNorm(dim, eps=BLOCK_LN_EPS)
        self.w_1 = nn.Linear(dim, ffn)
        self.w_2 = nn.Linear(ffn, dim)

    def forward(
        self,
        x: Tensor,
        pos: Tensor,
        pos_index: Tensor,
        mask: Tensor | None,
        kv: tuple[Tensor, Tensor] | None,
        start: int,
    ) -> Tensor:
        x = x + self.self_attn(self.norm_mha(x), pos, pos_index, mask, kv, start)
        return x + self.w_2(F.silu(self.w_1(self.norm_ff(x))))


class Encoder(nn.Module):
    """``UpsampleConformerEncoder``: ``[1, T, input]`` tokens -> ``[1, ratio * T, enc_dim]``."""

    def __init__(self, d: FlowDims) -> None:
        super().__init__()
        c = UPSTREAM_ENCODER_CHANNELS
        self.dims = d
        self.embed = nn.Linear(d.enc_input_size, d.enc_dim)
        self.embed_norm = nn.LayerNorm(d.enc_dim, eps=ENC_LN_EPS)
        self.lookahead_conv1 = nn.Conv1d(c, c, d.pre_lookahead + 1)
        self.lookahead_conv2 = nn.Conv1d(c, c, LOOKAHEAD_CONV2_KERNEL)
        self.blocks = nn.ModuleList(ConformerBlock(d.enc_dim, d.enc_heads, d.enc_ffn) for _ in range(d.enc_blocks))
        self.up_conv = nn.Conv1d(c, c, 2 * d.token_mel_ratio + 1)
        self.up_embed = nn.Linear(d.enc_input_size, d.enc_dim)
        self.up_embed_norm = nn.LayerNorm(d.enc_dim, eps=ENC_LN_EPS)
        self.up_blocks = nn.ModuleList(
            ConformerBlock(d.enc_dim, d.enc_heads, d.enc_ffn) for _ in range(d.enc_up_blocks)
        )
        self.after_norm = nn.LayerNorm(d.enc_dim, eps=ENC_LN_EPS)

    def _stage(
        self,
        blocks: nn.ModuleList,
        x: Tensor,
        start: int,
        chunk: int | None,
        state: tuple[Tensor, Tensor, Tensor] | None,
        pos_valid: int,
        keys: Tensor | None = None,
    ) -> tuple[Tensor, int]:
        """Run one conformer stack over ``x`` ``[B, T, C]`` at positions ``start ..``.

        ``state`` = cached (k, v, pos) of the stack: k/v ``[L, 1, H, cap, D]`` and projected
        positional keys ``[L, 1, H, cap + chunk - 1, D]`` for r = -(chunk - 1) .. ; the first
        ``pos_valid`` rows are already filled. ``keys``: bool ``[B, 1, 1, T]``, the keys each
        row may attend to (key padding), or None (all). Returns the output and the new number
        of valid rows.
        """
        t = x.shape[1]
        tk = start + t
        dim = self.dims.enc_dim
        layers = [b for b in blocks if isinstance(b, ConformerBlock)]
        mask = chunk_mask(start, t, tk, chunk, x.device) if chunk is not None else None
        if keys is not None:
            mask = keys if mask is None else mask & keys
        if state is None:
            # Reference path: a fresh table for r = -(tk - 1) .. t - 1 (start is 0 here).
            r_min, rows = -(tk - 1), t + tk - 1
            pe = rel_pos_rows(r_min, rows, dim, x.device).to(x.dtype)
            index = rel_index(start, t, tk, r_min, rows, x.device)
            for blk in layers:
                x = blk(x, blk.self_attn.project_pos(pe), index, mask, None, start)
            return x, 0
        if chunk is None:
            raise ValueError("the cached encoder path is chunk-causal only")
        # Cached path: chunk-causal keys satisfy j <= i + chunk - 1, so rows from
        # r = -(chunk - 1) up to the newest query cover every allowed pair; only rows not yet
        # projected are computed.
        k_all, v_all, pos_all = state
        r_min = -(chunk - 1)
        rows = pos_rows(tk, chunk)
        new_pe = rel_pos_rows(r_min + pos_valid, rows - pos_valid, dim, x.device).to(x.dtype)
        index = rel_index(start, t, tk, r_min, rows, x.device)
        for i, blk in enumerate(layers):
            if rows > pos_valid:
                pos_all[i, :, :, pos_valid:rows] = blk.self_attn.project_pos(new_pe)
            x = blk(x, pos_all[i, :, :, :rows], index, mask, (k_all[i], v_all[i]), start)
        return x, max(rows, pos_valid)

    def pos_valid_after(self, stop: int, enc_valid: int, up_valid: int) -> tuple[int, int]:
        """A stream cache's ``(enc_pos_valid, up_pos_valid)`` after a cached call over tokens up
        to ``stop`` from ``(enc_valid, up_valid)``: what :meth:`forward` leaves there (for a
        caller that replays the call from a CUDA graph, where no Python runs)."""
        d = self.dims
        up_stop = stop * d.token_mel_ratio
        return max(enc_valid, pos_rows(stop, d.enc_chunk)), max(up_valid, pos_rows(up_stop, d.up_chunk))

    def forward(
        self,
        xs: Tensor,
        context: Tensor | None,
        streaming: bool,
        cache: FlowStreamCache | None = None,
        start: int = 0,
        n_valid: Tensor | None = None,
    ) -> Tensor:
        """xs ``[B, T, input]`` embedded tokens at absolute token positions ``start ..``;
        context ``[B, lookahead, input]`` (the next tokens, embedded) or None (zeros).

        With ``cache`` (B = 1) the call continues a stream: it extends the cached keys/values
        and conv contexts of every layer (``start`` = tokens already in the cache).

        ``n_valid`` ``[B]`` int64 (reference path, ``start`` = 0): row b's real tokens are its
        first ``n_valid[b]``, the rest right padding. Padded positions then act as absent: their
        embedded rows are zeroed before the pre-lookahead conv (so the last real tokens see the
        zero look-ahead an unpadded call gives them; ``context`` should then be None) and no
        attention reads their keys (token and upsampled rate). Real frames equal those of an
        unpadded call; padded frames are finite garbage. Fixed shapes, no host sync.
        """
        d = self.dims
        scale = math.sqrt(d.enc_dim)
        x = self.embed_norm(self.embed(xs)) * scale
        keys = up_keys = None
        if n_valid is not None:
            if cache is not None:
                raise ValueError("n_valid (right padding) is for the uncached path only")
            t_up = x.shape[1] * d.token_mel_ratio
            keys = valid_keys(n_valid, x.shape[1])  # [B, 1, 1, T]
            up_keys = valid_keys(n_valid * d.token_mel_ratio, t_up)  # [B, 1, 1, ratio T]
            x = x.masked_fill(~keys.view(x.shape[0], -1, 1), 0.0)
        if context is None:
            ctx = x.new_zeros(x.shape[0], d.pre_lookahead, d.enc_dim)
        else:
            ctx = self.embed_norm(self.embed(context)) * scale
        # Pre-lookahead: token t sees tokens t..t+lookahead through conv1, then a causal conv2.
        y = F.leaky_relu(self.lookahead_conv1(torch.cat([x, ctx], dim=1).transpose(1, 2)), LEAKY_SLOPE)
        y = causal_conv(self.lookahead_conv2, y, cache.la_ctx if cache is not None else None)
        x = x + y.transpose(1, 2)
        chunk = d.enc_chunk if streaming else None
        state = (cache.enc_k, cache.enc_v, cache.enc_pos) if cache is not None else None
        x, valid = self._stage(self.blocks, x, start, chunk, state, cache.enc_pos_valid if cache else 0, keys)
        if cache is not None:
            cache.enc_pos_valid = valid
        # x ratio: nearest-neighbour repeat, then a causal conv (k = 2 ratio + 1).
        up = x.transpose(1, 2).repeat_interleave(d.token_mel_ratio, dim=2)
        up = causal_conv(self.up_conv, up, cache.up_ctx if cache is not None else None)
        x = self.up_embed_norm(self.up_embed(up.transpose(1, 2))) * scale
        up_chunk = d.up_chunk if streaming else None
        state = (cache.up_k, cache.up_v, cache.up_pos) if cache is not None else None
        x, valid = self._stage(
            self.up_blocks, x, start * d.token_mel_ratio, up_chunk, state, cache.up_pos_valid if cache else 0, up_keys
        )
        if cache is not None:
            cache.up_pos_valid = valid
        return self.after_norm(x)
