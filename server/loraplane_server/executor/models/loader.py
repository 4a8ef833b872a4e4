"""Build a model from a Hugging Face safetensors directory (single file or sharded); of a multimodal checkpoint,
the language model alone; a pre-quantized int8 checkpoint's projections as int8 (executor/models/quantized.py)."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from loraplane_server.executor.layers.linear import ProjectionLinear
from loraplane_server.executor.models import registry
from loraplane_server.executor.models.args import FUSED_PROJECTIONS, VISION_MODULES
from loraplane_server.executor.models.llama import LlamaForCausalLM
from loraplane_server.executor.models.quantized import (
    ACTIVATION_PARTS,
    QUANT_PARTS,
    Int8Checkpoint,
    checkpoint_quantization,
    dequantize_parts,
    int8_parts,
    log_load,
)

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


def checkpoint_bytes(model_dir: Path, dtype: torch.dtype, int8_projections: bool) -> int:
    """The bytes the checkpoint's weights take once loaded in `dtype` (int8_projections: the decoder's
    projections as int8), read from the safetensors headers alone: for the GPU budget's check before the load.
    Tensors stored as integers (a pre-quantized checkpoint) count as stored; a multimodal checkpoint's vision
    tensors not at all."""
    is_multimodal = registry.family_of(read_config(model_dir)).language_model is not None
    total = 0
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if is_multimodal and _language_model_name(name) is None:
                    continue
                part = f.get_slice(name)
                numel = 1
                for n in part.get_shape():
                    numel *= n
                stored = part.get_dtype()
                if stored.startswith(("I", "U")):
                    total += numel * int(re.sub(r"\D", "", stored) or 8) // 8
                elif int8_projections and name.endswith("_proj.weight"):
                    total += numel
                else:
                    total += numel * dtype.itemsize
    return total


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device, max_positions: int) -> LlamaForCausalLM:
    cfg = read_config(model_dir)
    args = registry.model_args(cfg)
    is_multimodal = registry.family_of(cfg).language_model is not None
    with torch.device(device), _default_dtype(dtype):  # never a float32 copy of a bf16 model: half the peak
        model = registry.build(args, max_positions)
    params = dict(model.named_parameters())
    missing = _expected_keys(model)
    quantized = _Int8Modules(checkpoint_quantization(cfg))
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                key = _language_model_name(name) if is_multimodal else name
                if key is None:
                    continue
                tensor = f.get_tensor(name)
                if not quantized.take(key, tensor):
                    missing -= _load_one(model, params, key, tensor)
        missing -= quantized.load_complete(model, params)  # a module's parts share a shard, as writers save them
    missing -= quantized.load_complete(model, params, last=True)
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks {sorted(missing)[:5]}")
    for module in model.modules():
        if isinstance(module, ProjectionLinear):
            module.finish_load()
    if model.int8:  # projections the checkpoint left in float (a mixed GGUF) join them: one path per layer
        model.quantize_int8()
    quantized.log(model_dir.name)
    return model.to(dtype=dtype)  # floating tensors only: int8 weights stay int8


class _Int8Modules:
    """A pre-quantized checkpoint's quantized modules: their tensors gathered by module, then loaded as int8
    projections (or, for a module the engine keeps in the compute dtype, dequantized)."""

    def __init__(self, checkpoint: Int8Checkpoint | None) -> None:
        self.checkpoint = checkpoint
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.modules = 0
        self.clamped = 0

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether name is part of a quantized module (kept for load_complete) or an activation setting the
        engine does not use (dropped); False for every tensor of a float checkpoint."""
        if self.checkpoint is None:
            return False
        module, _, part = name.rpartition(".")
        if part in ACTIVATION_PARTS:
            return True
        if part in QUANT_PARTS or (part == "weight" and tensor.dtype == torch.int8):
            self.pending.setdefault(module, {})[part] = tensor
            return True
        return False

    def load_complete(
        self, model: LlamaForCausalLM, params: dict[str, torch.nn.Parameter], last: bool = False
    ) -> set[str]:
        filled: set[str] = set()
        for module in list(self.pending):
            parts = self.pending[module]
            if "weight_scale" not in parts or not ({"weight", "weight_packed"} & parts.keys()):
                if last:
                    raise ValueError(f"{module}: quantized tensors {sorted(parts)} without a weight and its scale")
                continue
            del self.pending[module]
            m = _LAYER.match(module + ".weight")
            if m is None:  # not a decoder projection: the engine keeps it in the compute dtype
                filled |= _load_one(model, params, module + ".weight", dequantize_parts(parts, module))
                continue
            q, scale, clamped = int8_parts(parts, module)
            self.modules += 1
            self.clamped += clamped
            layer, proj = int(m[1]), m[3]
            if model.args.fused_projections and proj in FUSED_PROJECTIONS:
                filled |= _load_fused_int8(model, layer, proj, q, scale)
            else:
                model.projection(layer, proj).load_int8(proj, q, scale)
                filled.add(f"layers.{layer}.{proj}.weight")
        return filled

    def log(self, model_name: str) -> None:
        if self.checkpoint is not None:
            log_load(model_name, self.checkpoint, self.modules, self.clamped)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters created in dtype while the model is built (the rotary tables are computed in float32
    whatever the default; the checkpoint's tensors are copied in, cast once)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


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


def _load_fused_int8(model: LlamaForCausalLM, layer: int, proj: str, q: torch.Tensor, scale: torch.Tensor) -> set[str]:
    """A fused int8 projection split by rows, each row's scale with it."""
    names = FUSED_PROJECTIONS[proj]
    target = model.projection(layer, names[0])
    sizes = [target.slices[n][1] - target.slices[n][0] for n in names]
    if q.shape[0] != sum(sizes):
        raise ValueError(f"layers.{layer}.{proj}: {q.shape[0]} int8 rows, expected {sum(sizes)} ({sizes})")
    for sub, rows, s in zip(names, q.split(sizes), scale.split(sizes), strict=True):
        target.load_int8(sub, rows, s)
    return {f"layers.{layer}.{sub}.weight" for sub in names}
