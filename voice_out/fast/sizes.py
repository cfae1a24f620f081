"""The model's sizes for the plan (:class:`voice_out.fast.plan.ModelSizes`), from its dims.

Weights are counted on PyTorch's ``meta`` device (the real modules built without memory, the
flow's fused weight copies included), so the plan and the budget check know them before a
byte is loaded; buffer sizes follow from the dims. Any thread may call (no device is touched).
"""

from __future__ import annotations

import torch

from voice_out.fast import fused_flow
from voice_out.fast.plan import ModelSizes
from voice_out.model.flow import Flow
from voice_out.model.flow_dims import FlowDims
from voice_out.model.llm import LLMDims, SpeechLM
from voice_out.model.vocoder import HiFT, HiFTDims


def _bytes(module: torch.nn.Module, dtype_bytes: int) -> int:
    n = sum(p.numel() for p in module.parameters()) + sum(b.numel() for b in module.buffers())
    return n * dtype_bytes


def weight_bytes(llm: LLMDims, flow: FlowDims, hift: HiFTDims, dtype_bytes: int) -> int:
    """Parameters and buffers of the three modules as the engine holds them: LLM and flow in
    the model dtype (the flow with its fused copies, ``Flow.fuse_`` and
    ``fused_flow.fuse_ff_``), the vocoder in float32."""
    with torch.device("meta"):
        lm = SpeechLM(llm)
        fl = Flow(flow)
        fused_flow.fuse_ff_(fl.fuse_().estimator)
        voc = HiFT(hift)
    return _bytes(lm, dtype_bytes) + _bytes(fl, dtype_bytes) + _bytes(voc, 4)


def kv_slot_bytes(llm: LLMDims, kv_len: int, dtype_bytes: int) -> int:
    """One KV slot: [layers, (K, V), kv heads, positions, head dim]."""
    return llm.n_layers * 2 * llm.n_kv_heads * kv_len * llm.head_dim * dtype_bytes


def flow_state_bytes_per_token(d: FlowDims, dtype_bytes: int) -> int:
    """One speech token of a flow state (``Flow.allocate_stream_cache``): the encoder's keys,
    values and positions per token, the upsampled encoder's per mel frame, and the estimator's
    keys and values per frame for both CFG rows and every timestep."""
    frames = d.token_mel_ratio
    enc = 3 * d.enc_blocks * d.enc_heads * d.enc_head_dim
    up = 3 * d.enc_up_blocks * d.enc_heads * frames * d.enc_head_dim
    est = 2 * d.n_timesteps * d.n_est_blocks * 2 * d.est_heads * frames * d.est_head_dim
    return (enc + up + est) * dtype_bytes + 8  # + the token id (int64)


def model_sizes(
    llm: LLMDims,
    flow: FlowDims,
    hift: HiFTDims,
    *,
    dtype_bytes: int,
    kv_len: int,
    prompt_tokens: int,
) -> ModelSizes:
    """The :class:`ModelSizes` of a model (dims) in a dtype of ``dtype_bytes`` (2: bf16/fp16)."""
    return ModelSizes(
        weight_bytes=weight_bytes(llm, flow, hift, dtype_bytes),
        kv_slot_bytes=kv_slot_bytes(llm, kv_len, dtype_bytes),
        flow_state_bytes_per_token=flow_state_bytes_per_token(flow, dtype_bytes),
        prompt_tokens=prompt_tokens,
        half_precision=dtype_bytes == 2,
    )
