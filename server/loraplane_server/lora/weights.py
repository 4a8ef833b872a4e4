"""PEFT LoRA adapters: read, validate against the base model, cast to the engine dtype.

A = lora_A [r, in], B = lora_B [out, r]; the delta is x @ A.T @ B.T * scale, and the scale is
folded into B here (lora_alpha / r, or lora_alpha / sqrt(r) for rsLoRA, per module patterns).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from loraplane_server.models.llama import TARGET_MODULES, ModelArgs

_KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class AdapterError(ValueError):
    """A broken, hostile or incompatible adapter; the message says what to fix."""


@dataclass
class LoRAWeights:
    adapter_id: str
    rank: int  # the largest rank over its modules
    target_modules: list[str]
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, module) -> (A, B * scale)
    config: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.tensors.values())


def module_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every target module."""
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    h, i = args.hidden_size, args.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def read_adapter_config(path: Path) -> dict:
    cfg_path = path / "adapter_config.json"
    if not path.is_dir():
        raise AdapterError(f"adapter directory {path} does not exist")
    if not cfg_path.is_file():
        raise AdapterError(f"{path} has no adapter_config.json (expected a PEFT LoRA adapter)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"adapter_config.json is not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise AdapterError("adapter_config.json must hold a JSON object")
    _check_config(cfg)
    return cfg


def _check_config(cfg: dict) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {cfg.get('peft_type')!r} is not supported (only LORA)")
    for flag, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D) layers")):
        if cfg.get(flag):
            raise AdapterError(f"{why} adapters are not supported")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"modules_to_save {cfg['modules_to_save']} is not supported (only LoRA deltas)")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"bias={cfg['bias']!r} is not supported (only 'none')")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGET_MODULES))
        if unknown:
            raise AdapterError(f"unknown target modules {unknown}; supported: {', '.join(TARGET_MODULES)}")
    r = cfg.get("r", 8)
    if not isinstance(r, int) or r < 1:
        raise AdapterError(f"r={r!r} must be a positive integer")


def _pattern_value(patterns: dict, module_path: str, default: float) -> float:
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_path):
            return value
    return default


def _scale(cfg: dict, module_path: str, rank: int) -> float:
    alpha = _pattern_value(cfg.get("alpha_pattern", {}), module_path, cfg.get("lora_alpha", 8))
    return alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        if (path / "adapter_model.bin").is_file():
            raise AdapterError("adapter_model.bin (pickle) is refused: convert the adapter to safetensors")
        raise AdapterError(f"{path} has no adapter_model.safetensors")
    try:
        return load_file(str(weights), device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"adapter_model.safetensors is unreadable or truncated: {exc}") from exc


def load_lora(path: Path, adapter_id: str, args: ModelArgs, max_rank: int, dtype: torch.dtype) -> LoRAWeights:
    """Read and validate a PEFT adapter directory. Raises AdapterError with the reason."""
    cfg = read_adapter_config(path)
    raw = _read_tensors(path)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in raw.items():
        m = _KEY.search(key)
        if m is None:
            raise AdapterError(f"unexpected tensor {key!r}: only lora_A/lora_B of {', '.join(TARGET_MODULES)}")
        layer, module, which = int(m[1]), m[3], m[4]
        if module not in TARGET_MODULES:
            raise AdapterError(f"unknown target module {module!r} in {key!r}")
        if layer >= args.num_layers:
            raise AdapterError(f"{key!r}: layer {layer} but the base model has {args.num_layers} layers")
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise AdapterError("the adapter holds no LoRA tensors")
    shapes = module_shapes(args)
    tensors = {}
    for (layer, module), ab in sorted(pairs.items()):
        tensors[(layer, module)] = _check_pair(cfg, layer, module, ab, shapes[module], max_rank, dtype)
    rank = max(a.shape[0] for a, _ in tensors.values())
    modules = sorted({m for _, m in tensors}, key=TARGET_MODULES.index)
    return LoRAWeights(adapter_id, rank, modules, tensors, cfg)


def _check_pair(
    cfg: dict,
    layer: int,
    module: str,
    ab: dict[str, torch.Tensor],
    shape: tuple[int, int],
    max_rank: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    where = f"layer {layer} {module}"
    if set(ab) != {"A", "B"}:
        raise AdapterError(f"{where}: lora_A and lora_B must come in pairs")
    a, b = ab["A"], ab["B"]
    in_f, out_f = shape
    rank = a.shape[0] if a.dim() == 2 else -1
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape[0] != out_f or b.shape[1] != rank:
        raise AdapterError(
            f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base "
            f"model (expected [r, {in_f}] and [{out_f}, r]); was it trained on another model?"
        )
    if rank > max_rank:
        raise AdapterError(f"{where}: rank {rank} exceeds --max-lora-rank {max_rank}")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise AdapterError(f"{where}: weights contain NaN or infinity")
    block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    path = f"model.layers.{layer}.{block}.{module}"
    expected = int(_pattern_value(cfg.get("rank_pattern", {}), path, cfg.get("r", rank)))
    if expected != rank:
        raise AdapterError(f"{where}: tensors have rank {rank} but adapter_config.json says {expected}")
    scale = _scale(cfg, path, rank)
    return a.to(dtype).contiguous(), (b.float() * scale).to(dtype).contiguous()
