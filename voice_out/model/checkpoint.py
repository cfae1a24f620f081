"""Reading an official CosyVoice2 model directory (spec section 1).

* ``load_yaml``: ``cosyvoice2.yaml`` with plain PyYAML. HyperPyYAML tags become inert records
  (``!new:`` -> :class:`New`, ``!name:`` -> :class:`Partial`, ``!apply:`` -> :class:`Apply`,
  ``!ref`` resolved with a small arithmetic evaluator). Nothing is imported or instantiated.
* ``read_qwen_config``: ``CosyVoice-BlankEN/config.json``.
* ``load_state_dict`` / ``strict_load``: ``*.pt`` with ``weights_only=True`` through a key map; a
  mismatch raises :class:`CheckpointError` listing every missing and unexpected key.

This is the only file of ``voice_out.model`` that touches the file system.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from voice_out.errors import VoiceOutError
from voice_out.model.flow import Flow
from voice_out.model.flow_dims import FlowDims
from voice_out.model.llm import LLMDims, SpeechLM, init_random_
from voice_out.model.vocoder import HiFT, HiFTDims


class CheckpointError(VoiceOutError):
    """The model directory or one of its files does not match what the engine expects."""


# --------------------------------------------------------------------------------------------
# YAML


@dataclass
class New:
    """``!new:dotted.Class`` with its keyword arguments (never instantiated)."""

    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Partial:
    """``!name:dotted.func`` with its keyword arguments (never called)."""

    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Apply:
    """``!apply:dotted.func [args]`` (ignored: upstream uses it to seed global RNGs)."""

    target: str
    args: list[Any] = field(default_factory=list)


@dataclass
class Ref:
    """``!ref <a> * <b>``: resolved after loading."""

    expr: str


class _Loader(yaml.SafeLoader):
    """SafeLoader that keeps HyperPyYAML tags as records and reads ``1e-06`` as a float."""


# YAML 1.1 needs a dot in a float; HyperPyYAML (YAML 1.2) reads 1e-06 as a float.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9]+[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _construct_new(loader: _Loader, suffix: str, node: yaml.Node) -> New:
    if isinstance(node, yaml.MappingNode):
        return New(suffix, {str(k): v for k, v in loader.construct_mapping(node, deep=True).items()})
    return New(suffix, {})


def _construct_name(loader: _Loader, suffix: str, node: yaml.Node) -> Partial:
    if isinstance(node, yaml.MappingNode):
        return Partial(suffix, {str(k): v for k, v in loader.construct_mapping(node, deep=True).items()})
    return Partial(suffix, {})


def _construct_apply(loader: _Loader, suffix: str, node: yaml.Node) -> Apply:
    if isinstance(node, yaml.SequenceNode):
        return Apply(suffix, loader.construct_sequence(node, deep=True))
    return Apply(suffix, [])


def _construct_ref(loader: _Loader, node: yaml.Node) -> Ref:
    return Ref(str(loader.construct_scalar(node)))  # type: ignore[arg-type]


_Loader.add_multi_constructor("!new:", _construct_new)
_Loader.add_multi_constructor("!name:", _construct_name)
_Loader.add_multi_constructor("!apply:", _construct_apply)
_Loader.add_constructor("!ref", _construct_ref)

_REF_NAME = re.compile(r"<([A-Za-z_][A-Za-z0-9_.]*)>")
_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
}


def _safe_eval(expr: str) -> Any:
    """Evaluate + - * / // over numbers (and parentheses); nothing else."""

    def ev(n: ast.AST) -> Any:
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, int | float):
            return n.value
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub | ast.UAdd):
            v = ev(n.operand)
            return -v if isinstance(n.op, ast.USub) else v
        if isinstance(n, ast.BinOp) and type(n.op) in _BINOPS:
            return _BINOPS[type(n.op)](ev(n.left), ev(n.right))
        raise CheckpointError(f"unsupported expression in !ref: {expr!r}")

    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        raise CheckpointError(f"malformed !ref expression: {expr!r}") from None
    return ev(tree)


def _resolve(node: Any, top: dict[str, Any], stack: tuple[str, ...]) -> Any:
    if isinstance(node, Ref):
        names = _REF_NAME.findall(node.expr)
        if not names:
            raise CheckpointError(f"!ref {node.expr!r} names no <key>")
        values = {}
        for name in names:
            if name in stack:
                raise CheckpointError(f"!ref cycle through {name!r}")
            if name not in top:
                raise CheckpointError(f"!ref <{name}> refers to a key that cosyvoice2.yaml does not define")
            values[name] = _resolve(top[name], top, (*stack, name))
        stripped = node.expr.strip()
        if _REF_NAME.fullmatch(stripped):
            return values[names[0]]  # a plain reference shares the object
        expr = _REF_NAME.sub(lambda m: repr(values[m.group(1)]), node.expr)
        return _safe_eval(expr)
    if isinstance(node, New | Partial):
        node.kwargs = {k: _resolve(v, top, stack) for k, v in node.kwargs.items()}
        return node
    if isinstance(node, Apply):
        node.args = [_resolve(v, top, stack) for v in node.args]
        return node
    if isinstance(node, dict):
        return {k: _resolve(v, top, stack) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve(v, top, stack) for v in node]
    return node


def parse_yaml(text: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Parse HyperPyYAML text into plain data; ``overrides`` replace top-level keys first."""
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - our SafeLoader subclass
    except yaml.YAMLError as e:
        raise CheckpointError(f"cosyvoice2.yaml is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError("cosyvoice2.yaml must be a mapping at top level")
    data.update(overrides or {})
    return {k: _resolve(v, data, (k,)) for k, v in data.items()}


def load_yaml(model_dir: str | Path) -> dict[str, Any]:
    """Load ``<model_dir>/cosyvoice2.yaml`` with ``qwen_pretrain_path`` pointed at the folder."""
    d = Path(model_dir)
    path = d / "cosyvoice2.yaml"
    if not path.is_file():
        raise CheckpointError(f"{path} not found: not a CosyVoice2 model directory")
    return parse_yaml(
        path.read_text(encoding="utf-8"),
        overrides={"qwen_pretrain_path": str(d / "CosyVoice-BlankEN")},
    )


def section(cfg: Mapping[str, Any], key: str) -> dict[str, Any]:
    """The kwargs of the ``!new:`` object at ``cfg[key]`` (e.g. ``flow``, ``hift``)."""
    node = cfg.get(key)
    if not isinstance(node, New):
        raise CheckpointError(f"cosyvoice2.yaml: {key!r} is missing or is not a !new: object")
    return node.kwargs


def read_qwen_config(model_dir: str | Path) -> dict[str, Any]:
    """``CosyVoice-BlankEN/config.json`` as a dict."""
    path = Path(model_dir) / "CosyVoice-BlankEN" / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


# --------------------------------------------------------------------------------------------
# State dicts


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """``torch.load(path, weights_only=True)`` on the CPU, checked to be a flat tensor dict."""
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"{p} not found")
    try:
        sd = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types for a bad file
        raise CheckpointError(f"{p} could not be loaded as a weights-only state dict: {e}") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{p} does not hold a flat dict of tensors")
    return sd


def strict_load(
    module: torch.nn.Module,
    state: Mapping[str, torch.Tensor],
    *,
    rename: Callable[[str], str | None] = lambda k: k,
    source: str = "checkpoint",
    ignore: Iterable[str] = (),
) -> None:
    """Copy ``state`` into ``module`` through ``rename``; every key must match exactly.

    ``rename`` maps a checkpoint key to a parameter/buffer name of ``module`` (None drops it).
    Keys in ``ignore`` are dropped before matching. Missing keys, unexpected keys and shape
    mismatches are collected and raised together as one :class:`CheckpointError`. Values are
    cast to the destination dtype.
    """
    skip = set(ignore)
    mapped: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for key, value in state.items():
        if key in skip:
            continue
        name = rename(key)
        if name is None:
            unexpected.append(key)
            continue
        mapped[name] = value
    own = dict(module.state_dict())
    missing = sorted(k for k in own if k not in mapped)
    unexpected += sorted(k for k in mapped if k not in own)
    bad_shape = [
        f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
        for k, v in mapped.items()
        if k in own and tuple(v.shape) != tuple(own[k].shape)
    ]
    if missing or unexpected or bad_shape:
        parts = [f"{source} does not match the model built from the model directory:"]
        if missing:
            parts.append(f"  missing keys ({len(missing)}): " + ", ".join(missing))
        if unexpected:
            parts.append(f"  unexpected keys ({len(unexpected)}): " + ", ".join(sorted(unexpected)))
        if bad_shape:
            parts.append(f"  shape mismatches ({len(bad_shape)}): " + "; ".join(bad_shape))
        raise CheckpointError("\n".join(parts))
    with torch.no_grad():
        for k, t in own.items():
            t.copy_(mapped[k].to(t.dtype))


# --------------------------------------------------------------------------------------------
# Component loaders: each component file builds its module from dims read here.
# (LLM, flow and HiFT loaders are added below by their components.)


# HiFT ---------------------------------------------------------------------------------------

_WN_G = (".parametrizations.weight.original0", ".weight_g")
_WN_V = (".parametrizations.weight.original1", ".weight_v")


def fold_weight_norm(state: Mapping[str, torch.Tensor], *, source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Replace every weight-norm pair (g, v) by ``<prefix>.weight = g * v / ||v||``.

    Both the parametrization names (``.parametrizations.weight.original0/1``) and the legacy
    ``.weight_g`` / ``.weight_v`` are accepted. The norm is taken over every dimension except
    dim 0 (for a ConvTranspose weight ``[in, out, k]`` dim 0 is the input channel), in float32.
    A g without its v (or the reverse) raises :class:`CheckpointError`.
    """
    out: dict[str, torch.Tensor] = {}
    g_of: dict[str, torch.Tensor] = {}
    v_of: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        for suffix in _WN_G:
            if key.endswith(suffix):
                g_of[key[: -len(suffix)]] = value
                break
        else:
            for suffix in _WN_V:
                if key.endswith(suffix):
                    v_of[key[: -len(suffix)]] = value
                    break
            else:
                out[key] = value
    unpaired = sorted(set(g_of) ^ set(v_of))
    if unpaired:
        raise CheckpointError(
            f"{source}: weight-norm tensors without their partner (g without v or v without g): " + ", ".join(unpaired)
        )
    for prefix, g in g_of.items():
        v = v_of[prefix].float()
        norm = v.pow(2).sum(dim=tuple(range(1, v.dim())), keepdim=True).sqrt()
        out[prefix + ".weight"] = g.float() * v / norm
    return out


def hift_dims(cfg: Mapping[str, Any]) -> HiFTDims:
    """``HiFTDims`` from a loaded ``cosyvoice2.yaml`` (errors as :class:`CheckpointError`)."""
    try:
        return HiFTDims.from_config(section(cfg, "hift"))
    except (KeyError, ValueError) as e:
        raise CheckpointError(str(e).strip("'\"")) from None


def load_hift(model_dir: str | Path, device: str | torch.device = "cpu") -> HiFT:
    """Build ``HiFT`` from ``<model_dir>/cosyvoice2.yaml`` and load ``hift.pt`` into it (float32, eval).

    Keys lose every ``generator.`` substring (HiFiGAN training checkpoints carry that prefix),
    weight norm is folded once here, then every key must match: missing / unexpected keys and
    shape mismatches are reported together in one :class:`CheckpointError`.
    """
    d = Path(model_dir)
    model = HiFT(hift_dims(load_yaml(d)))
    path = d / "hift.pt"
    raw = load_state_dict(path)
    state = fold_weight_norm({k.replace("generator.", ""): v for k, v in raw.items()}, source=str(path))
    strict_load(model, state, source=str(path))
    return model.to(device=device, dtype=torch.float32).eval()


def random_hift(config: str | Path, device: str | torch.device = "cpu", seed: int = 0) -> HiFT:
    """A ``HiFT`` with random weights, dims from a ``cosyvoice2.yaml`` (file or model directory).

    For speed measurements at full size without the real weights: same shapes and compute. The
    init keeps activations in a plausible range (f0 of tens to hundreds of Hz, bounded output).
    Drawn on ``device``: the values depend on the seed and the device type.
    """
    p = Path(config)
    cfg = load_yaml(p) if p.is_dir() else parse_yaml(p.read_text(encoding="utf-8"))
    dims = hift_dims(cfg)
    # built on the CPU (its fixed buffers come from CPU generators), drawn on ``device``: a
    # full-size model drawn on the CPU took seconds of start-up
    model = HiFT(dims).to(device)
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith("alpha"):
                t.fill_(1.0)
            elif name.endswith("bias"):
                t.zero_()
            else:
                fan_in = t[0].numel() if t.dim() > 1 else t.numel()
                t.copy_(torch.randn(t.shape, generator=gen, device=t.device) / math.sqrt(fan_in))
        # f0 = |linear(...)|: offset it so the source is mostly voiced, as in real speech.
        model.f0_predictor.classifier.bias.fill_(150.0)
        # keep the iSTFT magnitudes (exp of the first n_fft/2 + 1 rows) small: no clipping
        post = model.conv_post
        post.weight.mul_(0.1)
        if post.bias is not None:
            post.bias[: dims.n_bins].fill_(-3.0)
    return model.to(device=device, dtype=torch.float32).eval()


# LLM ----------------------------------------------------------------------------------------

#: The tied Qwen ``lm_head`` (a copy of ``embed_tokens``); CosyVoice2 never uses it.
LLM_IGNORED_KEYS = ("llm.model.lm_head.weight",)
_LLM_PLAIN = {
    "llm_embedding.weight": "llm_embedding.weight",
    "speech_embedding.weight": "speech_embedding.weight",
    "llm_decoder.weight": "llm_decoder.weight",
    "llm_decoder.bias": "llm_decoder.bias",
    "llm.model.model.embed_tokens.weight": "embed_tokens.weight",
    "llm.model.model.norm.weight": "norm.weight",
}
_LLM_LAYER = re.compile(r"^llm\.model\.model\.layers\.(\d+)\.(.+)$")
#: Per-layer checkpoint suffix -> (our parameter suffix, index of the part in a fused tensor).
_LLM_LAYER_MAP: dict[str, tuple[str, int]] = {
    "input_layernorm.weight": ("input_layernorm.weight", 0),
    "post_attention_layernorm.weight": ("post_attention_layernorm.weight", 0),
    "self_attn.q_proj.weight": ("attn.wqkv.weight", 0),
    "self_attn.k_proj.weight": ("attn.wqkv.weight", 1),
    "self_attn.v_proj.weight": ("attn.wqkv.weight", 2),
    "self_attn.q_proj.bias": ("attn.wqkv.bias", 0),
    "self_attn.k_proj.bias": ("attn.wqkv.bias", 1),
    "self_attn.v_proj.bias": ("attn.wqkv.bias", 2),
    "self_attn.o_proj.weight": ("attn.wo.weight", 0),
    "mlp.gate_proj.weight": ("mlp.w13.weight", 0),
    "mlp.up_proj.weight": ("mlp.w13.weight", 1),
    "mlp.down_proj.weight": ("mlp.w2.weight", 0),
}
#: How many checkpoint tensors make each of our per-layer parameters.
_LLM_PARTS = {name: 1 + max(p for n, p in _LLM_LAYER_MAP.values() if n == name) for name, _ in _LLM_LAYER_MAP.values()}


def llm_dims(model_dir: str | Path) -> LLMDims:
    """``LLMDims`` from ``cosyvoice2.yaml`` + ``CosyVoice-BlankEN/config.json`` (loader and random builder alike)."""
    cfg = load_yaml(model_dir)
    try:
        return LLMDims.from_configs(section(cfg, "llm"), read_qwen_config(model_dir))
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{model_dir}: {str(e).strip(chr(39) + chr(34))}") from None


def convert_llm_state(state: Mapping[str, torch.Tensor], *, source: str = "llm.pt") -> dict[str, torch.Tensor]:
    """Map ``llm.pt`` keys to :class:`SpeechLM` names, fusing q/k/v into ``wqkv`` and gate/up into ``w13``.

    ``llm.model.lm_head.weight`` is dropped. Unknown keys and the missing parts of a fused group
    raise :class:`CheckpointError` naming the checkpoint keys; :func:`strict_load` then reports
    whole parameters that are missing and shape mismatches.
    """
    out: dict[str, torch.Tensor] = {}
    groups: dict[tuple[str, str], dict[int, tuple[str, torch.Tensor]]] = {}
    unexpected: list[str] = []
    for key, value in state.items():
        if key in LLM_IGNORED_KEYS:
            continue
        if key in _LLM_PLAIN:
            out[_LLM_PLAIN[key]] = value
            continue
        m = _LLM_LAYER.match(key)
        if m is None or m.group(2) not in _LLM_LAYER_MAP:
            unexpected.append(key)
            continue
        name, part = _LLM_LAYER_MAP[m.group(2)]
        groups.setdefault((m.group(1), name), {})[part] = (key, value)
    missing: list[str] = []
    for (layer, suffix), parts in groups.items():
        n_parts = _LLM_PARTS[suffix]
        if sorted(parts) != list(range(n_parts)):
            missing += [
                f"llm.model.model.layers.{layer}.{ckpt}"
                for ckpt, (name, part) in _LLM_LAYER_MAP.items()
                if name == suffix and part not in parts
            ]
            continue
        fused = [parts[i][1] for i in range(n_parts)]
        out[f"layers.{layer}.{suffix}"] = fused[0] if n_parts == 1 else torch.cat(fused, dim=0)
    if unexpected or missing:
        msg = [f"{source} does not match the CosyVoice2 LLM layout:"]
        if missing:
            msg.append(f"  missing keys ({len(missing)}): " + ", ".join(sorted(missing)))
        if unexpected:
            msg.append(f"  unexpected keys ({len(unexpected)}): " + ", ".join(sorted(unexpected)))
        raise CheckpointError("\n".join(msg))
    return out


def load_llm(model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> SpeechLM:
    """Build ``SpeechLM`` from the model directory's configs and load ``llm.pt`` into it (eval mode).

    Only ``llm.pt`` is read: ``CosyVoice-BlankEN/model.safetensors`` is NOT the LLM (upstream
    overwrites it). Every key must match after :func:`convert_llm_state`; the tied
    ``lm_head`` is ignored. Weights are cast to ``dtype`` after loading in float32.
    """
    d = Path(model_dir)
    model = SpeechLM(llm_dims(d))
    path = d / "llm.pt"
    strict_load(model, convert_llm_state(load_state_dict(path), source=str(path)), source=str(path))
    return model.to(device=device, dtype=dtype).eval()


def random_llm(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> SpeechLM:
    """A ``SpeechLM`` with seeded random weights; dims read exactly as :func:`load_llm` reads them.

    ``model_dir`` needs only ``cosyvoice2.yaml`` and ``CosyVoice-BlankEN/config.json`` (for
    example ``configs/models/cosyvoice2-0.5b``). The weights are drawn on ``device``.
    """
    dims = llm_dims(model_dir)
    with torch.device(device):
        model = SpeechLM(dims)
    init_random_(model, seed)
    return model.to(dtype=dtype).eval()


# Flow ---------------------------------------------------------------------------------------

#: flow.pt key -> Flow parameter name, as (pattern, replacement) rules tried in order.
_FLOW_TB = r"(norm1|norm3|to_q|to_k|to_v)"
_FLOW_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), r)
    for p, r in (
        (r"^input_embedding\.weight$", "input_embedding.weight"),
        (r"^spk_embed_affine_layer\.(weight|bias)$", r"spk_affine.\1"),
        (r"^encoder_proj\.(weight|bias)$", r"encoder_proj.\1"),
        (r"^encoder\.(embed|up_embed)\.out\.0\.(weight|bias)$", r"encoder.\1.\2"),
        (r"^encoder\.(embed|up_embed)\.out\.1\.(weight|bias)$", r"encoder.\1_norm.\2"),
        (r"^encoder\.pre_lookahead_layer\.conv([12])\.(weight|bias)$", r"encoder.lookahead_conv\1.\2"),
        (r"^encoder\.up_layer\.conv\.(weight|bias)$", r"encoder.up_conv.\1"),
        (r"^encoder\.after_norm\.(weight|bias)$", r"encoder.after_norm.\1"),
        (
            r"^encoder\.(encoders|up_encoders)\.(\d+)\.self_attn\."
            r"(linear_[qkv]\.(?:weight|bias)|linear_out\.(?:weight|bias)|linear_pos\.weight|pos_bias_[uv])$",
            r"encoder.\1.\2.self_attn.\3",
        ),
        (r"^encoder\.(encoders|up_encoders)\.(\d+)\.feed_forward\.(w_[12]\.(?:weight|bias))$", r"encoder.\1.\2.\3"),
        (r"^encoder\.(encoders|up_encoders)\.(\d+)\.(norm_mha|norm_ff)\.(weight|bias)$", r"encoder.\1.\2.\3.\4"),
        (r"^decoder\.estimator\.time_mlp\.linear_([12])\.(weight|bias)$", r"estimator.time_linear\1.\2"),
        (r"^decoder\.estimator\.final_block\.block\.0\.(weight|bias)$", r"estimator.final_block.conv.\1"),
        (r"^decoder\.estimator\.final_block\.block\.2\.(weight|bias)$", r"estimator.final_block.norm.\1"),
        (r"^decoder\.estimator\.final_proj\.(weight|bias)$", r"estimator.final_proj.\1"),
        # resnet blocks: <stage>.0 (down/up) or mid_blocks.<m>.0
        (r"^decoder\.estimator\.(down|up)_blocks\.0\.0\.(.+)$", r"estimator.\1_res.\2"),
        (r"^decoder\.estimator\.mid_blocks\.(\d+)\.0\.(.+)$", r"estimator.mid_res.\1.\2"),
        # transformer blocks: <stage>.1.<j> or mid_blocks.<m>.1.<j>
        (r"^decoder\.estimator\.(down|up)_blocks\.0\.1\.(\d+)\.(.+)$", r"estimator.\1_tbs.\2.\3"),
        (r"^decoder\.estimator\.mid_blocks\.(\d+)\.1\.(\d+)\.(.+)$", r"estimator.mid_tbs.\1.\2.\3"),
        # the stand-alone causal convs closing the down and up stages
        (r"^decoder\.estimator\.(down|up)_blocks\.0\.2\.(weight|bias)$", r"estimator.\1_conv.\2"),
    )
)
#: Inner names of one resnet / transformer block: upstream suffix -> ours.
_FLOW_INNER: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), r)
    for p, r in (
        (r"^(estimator\.\w+_res(?:\.\d+)?)\.mlp\.1\.(weight|bias)$", r"\1.time_proj.\2"),
        (r"^(estimator\.\w+_res(?:\.\d+)?)\.block([12])\.block\.0\.(weight|bias)$", r"\1.block\2.conv.\3"),
        (r"^(estimator\.\w+_res(?:\.\d+)?)\.block([12])\.block\.2\.(weight|bias)$", r"\1.block\2.norm.\3"),
        (r"^(estimator\.\w+_res(?:\.\d+)?)\.res_conv\.(weight|bias)$", r"\1.res_conv.\2"),
        (rf"^(estimator\.\w+_tbs(?:\.\d+)*)\.(?:attn1\.)?{_FLOW_TB}\.(weight|bias)$", r"\1.\2.\3"),
        (r"^(estimator\.\w+_tbs(?:\.\d+)*)\.attn1\.to_out\.0\.(weight|bias)$", r"\1.to_out.\2"),
        (r"^(estimator\.\w+_tbs(?:\.\d+)*)\.ff\.net\.0\.proj\.(weight|bias)$", r"\1.ff_in.\2"),
        (r"^(estimator\.\w+_tbs(?:\.\d+)*)\.ff\.net\.2\.(weight|bias)$", r"\1.ff_out.\2"),
    )
)


def flow_key(key: str) -> str | None:
    """Map one ``flow.pt`` key to its :class:`Flow` parameter name (None: not a flow key)."""
    for pat, rep in _FLOW_RULES:
        if pat.match(key):
            name = pat.sub(rep, key).replace(".encoders.", ".blocks.").replace(".up_encoders.", ".up_blocks.")
            if not name.startswith("estimator.") or name.startswith(
                ("estimator.time_", "estimator.final_", "estimator.down_conv", "estimator.up_conv")
            ):
                return name
            for inner, inner_rep in _FLOW_INNER:
                if inner.match(name):
                    return inner.sub(inner_rep, name)
            return None
    return None


def flow_dims(cfg: Mapping[str, Any]) -> FlowDims:
    """``FlowDims`` from a loaded ``cosyvoice2.yaml`` (errors as :class:`CheckpointError`)."""
    try:
        return FlowDims.from_config(section(cfg, "flow"))
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(str(e).strip("'\"")) from None


def load_flow(model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Flow:
    """Build ``Flow`` from ``<model_dir>/cosyvoice2.yaml`` and load ``flow.pt`` (eval mode).

    Every key must map (:func:`flow_key`) and match in shape; tensors are read in whatever
    dtype the file holds (float16 in the parity directories), upcast to float32 on load, then
    the module is cast to ``dtype``.
    """
    d = Path(model_dir)
    model = Flow(flow_dims(load_yaml(d)))
    path = d / "flow.pt"
    state = {k: v.float() for k, v in load_state_dict(path).items()}
    strict_load(model, state, rename=flow_key, source=str(path))
    model.fuse_()
    return model.to(device=device, dtype=dtype).eval()


def init_random_flow_(model: Flow, seed: int = 0) -> Flow:
    """Fill ``model`` with seeded random weights whose activations stay O(1).

    Embedding ~ N(0, 1); weights ~ N(0, 1/fan_in) (residual-branch outputs further scaled by
    1/sqrt(2 n_blocks) per stack); norms 1; biases and the relative-position biases small.
    Drawn in float32 on the model's device (a full-size flow drawn on the CPU took 6 to 17 s of
    a GPU start-up), so the values depend on the seed and the device type.
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    enc_scale = 1.0 / math.sqrt(2 * (model.dims.enc_blocks + model.dims.enc_up_blocks))
    est_scale = 1.0 / math.sqrt(2 * (model.dims.n_est_blocks + model.dims.est_mid_blocks + 2))
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[0]
            if isinstance(model.get_submodule(leaf), torch.nn.LayerNorm):
                p.copy_(torch.ones_like(p) if name.endswith("weight") else torch.zeros_like(p))
                continue
            if name.endswith("bias") or "pos_bias" in name:
                t = 0.02 * torch.randn(p.shape, generator=gen, device=device)
            elif name == "input_embedding.weight":
                t = torch.randn(p.shape, generator=gen, device=device)
            else:
                t = torch.randn(p.shape, generator=gen, device=device) / math.sqrt(p[0].numel())
                if name.endswith(("linear_out.weight", "w_2.weight")):
                    t *= enc_scale
                elif name.endswith(("to_out.weight", "ff_out.weight", "block2.conv.weight")):
                    t *= est_scale
            p.copy_(t.to(p.dtype))
    return model


def random_flow(
    config: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Flow:
    """A ``Flow`` with seeded random weights, dims from a ``cosyvoice2.yaml`` (file or model dir).

    For speed measurements at full size without the real weights: same shapes and compute.
    """
    p = Path(config)
    cfg = load_yaml(p) if p.is_dir() else parse_yaml(p.read_text(encoding="utf-8"))
    # built on the CPU (its fixed noise comes from a CPU generator), drawn on the device
    model = init_random_flow_(Flow(flow_dims(cfg)).to(device), seed)
    model.fuse_()
    return model.to(device=device, dtype=dtype).eval()
