"""Build a model from a Hugging Face safetensors directory (single file or sharded)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from loraplane_server.models.llama import TARGET_MODULES, LlamaForCausalLM, ModelArgs

_LAYER = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.(weight|bias)$")
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


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
    args = ModelArgs.from_hf_config(read_config(model_dir))
    with torch.device(device):
        model = LlamaForCausalLM(args, max_positions)
    params = dict(model.named_parameters())
    missing = _expected_keys(args)
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                missing.discard(_load_one(model, params, name, f.get_tensor(name)))
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks {sorted(missing)[:5]}")
    return model.to(dtype=dtype)


def _expected_keys(args: ModelArgs) -> set[str]:
    keys = {"embed_tokens.weight", "norm.weight"} | (set() if args.tie_word_embeddings else {"lm_head.weight"})
    for i in range(args.num_layers):
        keys |= {f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight"}
        keys |= {f"layers.{i}.{p}.weight" for p in TARGET_MODULES}
        keys |= {f"layers.{i}.{p}.bias" for p in ("q_proj", "k_proj", "v_proj") if args.qkv_bias}
        keys |= {f"layers.{i}.{p}.bias" for p in ("gate_proj", "up_proj", "down_proj") if args.mlp_bias}
    return keys


def _load_one(
    model: LlamaForCausalLM, params: dict[str, torch.nn.Parameter], name: str, tensor: torch.Tensor
) -> str | None:
    """Copy one checkpoint tensor into place; returns the key it filled (None if ignored)."""
    m = _LAYER.match(name)
    if m:
        layer, proj, part = int(m[1]), m[3], m[4]
        model.projection(layer, proj).load(proj, part, tensor)
        return f"layers.{layer}.{proj}.{part}"
    if _IGNORED.match(name):
        return None
    key = name.removeprefix("model.")
    if key == "lm_head.weight" and model.lm_head is None:
        return None  # tied embeddings: the checkpoint may carry a copy
    if key not in params:
        raise ValueError(f"unexpected checkpoint tensor {name!r}")
    if params[key].shape != tensor.shape:
        raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(params[key].shape)}")
    params[key].data.copy_(tensor)
    return key
