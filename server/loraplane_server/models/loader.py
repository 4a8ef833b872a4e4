"""Build a model from a Hugging Face safetensors directory (single file or sharded); of a multimodal checkpoint,
the language model alone."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from loraplane_server.layers.linear import ProjectionLinear
from loraplane_server.models import registry
from loraplane_server.models.args import FUSED_PROJECTIONS, VISION_MODULES
from loraplane_server.models.llama import LlamaForCausalLM

_LAYER = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.(weight|bias)$")
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
# a multimodal checkpoint's language model -> the text model's names (transformers 5's naming, then older)
_LANGUAGE_MODEL = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


def read_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir} (pickle checkpoints are not loaded)")
    return files


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device, max_positions: int) -> LlamaForCausalLM:
    cfg = read_config(model_dir)
    args = registry.model_args(cfg)
    is_multimodal = registry.family_of(cfg).language_model is not None
    with torch.device(device):
        model = registry.build(args, max_positions)
    params = dict(model.named_parameters())
    missing = _expected_keys(model)
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                key = _language_model_name(name) if is_multimodal else name
                if key is not None:
                    missing -= _load_one(model, params, key, f.get_tensor(name))
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks {sorted(missing)[:5]}")
    return model.to(dtype=dtype)


def _language_model_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor name as the text model's; None for the vision parts (never read)."""
    if name.removeprefix("model.").startswith(VISION_MODULES):
        return None
    for prefix, ours in _LANGUAGE_MODEL:
        if name.startswith(prefix):
            return ours + name.removeprefix(prefix)
    return name


def _expected_keys(model: LlamaForCausalLM) -> set[str]:
    """Every tensor the checkpoint must fill: each projection by its own name, every other parameter."""
    keys: set[str] = set()
    owned: set[str] = set()
    for path, module in model.named_modules():
        if isinstance(module, ProjectionLinear):
            parts = ["weight"] if module.bias is None else ["weight", "bias"]
            keys |= {f"layers.{module.layer_idx}.{name}.{part}" for name in module.names for part in parts}
            owned |= {f"{path}.{part}" for part in parts}
    return keys | {name for name, _ in model.named_parameters() if name not in owned}


def _load_one(
    model: LlamaForCausalLM, params: dict[str, torch.nn.Parameter], name: str, tensor: torch.Tensor
) -> set[str]:
    """Copy one checkpoint tensor into place; returns the keys it filled (none if ignored)."""
    m = _LAYER.match(name)
    if m:
        layer, proj, part = int(m[1]), m[3], m[4]
        if model.args.fused_projections and proj in FUSED_PROJECTIONS:
            return _load_fused(model, layer, proj, part, tensor)
        model.projection(layer, proj).load(proj, part, tensor)
        return {f"layers.{layer}.{proj}.{part}"}
    if _IGNORED.match(name):
        return set()
    key = name.removeprefix("model.")
    if key == "lm_head.weight" and model.lm_head is None:
        return set()  # tied embeddings: the checkpoint may carry a copy
    if key not in params:
        raise ValueError(f"unexpected checkpoint tensor {name!r}")
    if params[key].shape != tensor.shape:
        raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(params[key].shape)}")
    params[key].data.copy_(tensor)
    return {key}


def _load_fused(model: LlamaForCausalLM, layer: int, proj: str, part: str, tensor: torch.Tensor) -> set[str]:
    """A fused checkpoint projection (Phi-3's qkv_proj, gate_up_proj), split by rows into ours."""
    names = FUSED_PROJECTIONS[proj]
    target = model.projection(layer, names[0])
    sizes = [target.slices[n][1] - target.slices[n][0] for n in names]
    if tensor.shape[0] != sum(sizes):
        raise ValueError(f"layers.{layer}.{proj}.{part}: {tensor.shape[0]} rows, expected {sum(sizes)} ({sizes})")
    for sub, piece in zip(names, tensor.split(sizes), strict=True):
        target.load(sub, part, piece)
    return {f"layers.{layer}.{sub}.{part}" for sub in names}
