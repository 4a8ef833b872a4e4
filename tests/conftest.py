"""Shared fixtures: tiny random models built from a config, and the real built-in model."""

from __future__ import annotations

import os
from pathlib import Path

# Triton kernels run on CPU tensors in the interpreter; it must be chosen before triton is imported.
if not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from loraplane_server.kernels import cpu_kernels
from loraplane_server.platforms import cpu_features
from loraplane_server.platforms.device import cuda_unusable_reason
from loraplane_server.store.builtin import resolve_model

# kind -> (transformers config class, model class, what the kind adds to the common config)
TINY_KINDS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=None)),
    # head_dim 24: not hidden / heads (16), as Qwen3's head_dim need not be
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False, head_dim=24)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=False)),
    # local and global layers with their own rope bases; a window past the prompts the tests send
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            tie_word_embeddings=True,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=96,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            final_logit_softcapping=30.0,
        ),
    ),
}


def save_tiny(path: Path, kind: str, scale: float = 4.0, seed: int = 1234, **overrides: object) -> Path:
    """A random model of one of TINY_KINDS (llama untied; qwen2 tied with q/k/v biases; ...); `overrides`
    change the config. The newer kinds also get random norm weights, so every norm's weight matters."""
    import transformers

    config_name, model_name, extra = TINY_KINDS[kind]
    common: dict[str, object] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    common.update(extra)
    common.update(overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**common))
    # random init is near-uniform; widen the weights so greedy choices are far from ties
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
            elif kind not in ("llama", "qwen2"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two PEFT adapters on tiny_llama_dir (q/v rank 4; every projection rank 8), for the speculative tests."""
    from lora_helpers import ADAPTER_SPECS, make_peft_adapter

    tmp = tmp_path_factory.mktemp("spec-adapters")
    names = ["qv-r4", "all-r8"]
    return {n: make_peft_adapter(tiny_llama_dir, tmp / n, seed=i, **ADAPTER_SPECS[n]) for i, n in enumerate(names)}


@pytest.fixture(scope="session")
def spec_adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every ADAPTER_SPECS adapter on tiny_llama_dir (ranks 2-16, different targets, one rsLoRA), seeded by order."""
    from lora_helpers import ADAPTER_SPECS, make_peft_adapter

    tmp = tmp_path_factory.mktemp("spec-set")
    return {
        n: make_peft_adapter(tiny_llama_dir, tmp / n, seed=i, **s) for i, (n, s) in enumerate(ADAPTER_SPECS.items())
    }


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return resolve_model("smollm2-135m")


def pytest_report_header() -> str:
    return f"cpu: {cpu_features.describe()}; torch kernels: {torch.backends.cpu.get_cpu_capability()}"


def pytest_runtest_setup(item: pytest.Item) -> None:
    """The instruction-set markers, asked of the kernel library itself (what it was built for, which
    LORAPLANE_CPU_ISA=avx2 caps), so a test runs exactly where the engine would take its path."""
    if item.get_closest_marker("gpu") and (reason := cuda_unusable_reason()) is not None:
        pytest.skip(f"needs a CUDA GPU: {reason}")
    needs_kernels = item.get_closest_marker("requires_cpu_kernels") or item.get_closest_marker("requires_bf16_kernels")
    if needs_kernels and not cpu_kernels.load():
        pytest.skip(f"the CPU kernels did not build: {cpu_kernels.load_error()}")
    if item.get_closest_marker("requires_bf16_kernels") and not cpu_kernels.has_bf16_kernels():
        pytest.skip(cpu_kernels.missing_bf16_kernels())
