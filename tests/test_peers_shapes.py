"""bench/peers.py --shape (issue 42): the CPU record's model sizes are the published configs, and on the 1B shape
(its real widths and 128,256-row vocabulary, cut to 2 layers so CI stays fast) one continuous batch that mixes
adapters of two ranks and target sets with base-model requests gives, in fp32, the greedy tokens transformers +
PEFT give each request alone; the Qwen2 shape's q/k/v biases load and agree too. Plus the bench's own
arithmetic: the matmul shapes its ceiling is measured on, its targets, its int8 pairing."""

from __future__ import annotations

import json
import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from loraplane_server.config import EngineConfig
from loraplane_server.engine.llm_engine import LLMEngine

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import gpu  # noqa: E402
import gpu_models  # noqa: E402
import peers  # noqa: E402
from multi_lora import Workload  # noqa: E402

CPU = torch.device("cpu")


def test_cpu_record_shapes_are_the_published_models() -> None:
    shapes = gpu_models.REAL_SHAPES
    assert shapes["smollm2-1.7b"].num_params() == 1_711_376_384
    assert shapes["qwen2.5-3b"].num_params() == 3_085_938_688
    qwen = shapes["qwen2.5-3b"].config()
    assert qwen["architectures"] == ["Qwen2ForCausalLM"] and qwen["use_sliding_window"] is False
    assert shapes["smollm2-1.7b"].config()["num_key_value_heads"] == 32  # SmolLM2-1.7B has no GQA
    assert set(peers.PEER_SHAPES) <= set(shapes)  # --shape's names are written by gpu_models


def test_model_sizes_count_what_the_shape_counts(tmp_path: Path) -> None:
    """peers.model_sizes (from a config.json) against gpu_models' own count of the same shape: the linears and
    the lm_head are the parameters less the embedding (tied here), norms and biases."""
    shape = gpu_models.REAL_SHAPES["smollm2-1.7b"]
    (tmp_path / "config.json").write_text(json.dumps(shape.config()))
    sizes = peers.model_sizes(tmp_path)
    norms = shape.num_layers * 2 * shape.hidden_size + shape.hidden_size
    assert sizes["linear_params"] + sizes["lm_head_params"] + norms == shape.num_params()


def tokenizer_dir() -> Path:
    from loraplane_server.store.builtin import resolve_model

    return resolve_model("smollm2-135m")


def engine_on(model: Path, adapters: Path, tmp: Path) -> LLMEngine:
    config = EngineConfig(
        model=str(model),
        dtype="float32",
        device="cpu",
        adapter_dir=str(adapters),
        max_lora_rank=16,
        kv_cache_bytes=64 << 20,
        disk_cache_dir=str(tmp / "disk"),
    )
    return LLMEngine(config)


def mixed_batch_matches_peft(shape: gpu_models.Shape, tmp: Path, specs: list[gpu_models.AdapterSpec]) -> None:
    """Every request (each adapter twice, the base model twice, prompts of several lengths) in one continuous
    batch; each one's greedy tokens equal PEFT's for that request alone; every adapter moves the logits."""
    gpu_models.write_model(shape, tmp / "model", CPU, torch.float32, tokenizer_dir(), std=0.05)
    paths = gpu_models.write_adapters(shape, tmp / "adapters", specs, CPU, torch.float32)
    engine = engine_on(tmp / "model", tmp / "adapters", tmp)
    rng = random.Random(42)
    work = [(a, [rng.randrange(100, 49_000) for _ in range(rng.randrange(5, 40))]) for a in [*paths, None] * 2]
    ours = gpu.ours_tokens(engine, [(prompt, adapter) for adapter, prompt in work], 5)
    reference = gpu_models.load_reference(tmp / "model", paths, torch.float32, CPU)
    for tokens, (adapter, prompt) in zip(ours, work, strict=True):
        assert tokens == gpu_models.reference_greedy(reference, prompt, adapter, 5), adapter
    for adapter in paths:
        assert gpu_models.adapter_effect(reference, work[0][1], adapter) > 0.1, adapter


@pytest.mark.isa_agnostic
def test_llama_1b_shape_two_layers_mixed_batch_matches_peft(tmp_path: Path) -> None:
    """The acceptance's check: Llama-3.2-1B's widths (2,048 hidden, 8,192 intermediate, 32 heads over 8 KV
    heads, tied 128,256-row vocabulary, llama3 rope), 2 layers, fp32."""
    shape = replace(gpu_models.LLAMA_32_1B, num_layers=2, source="Llama-3.2-1B, 2 of its 16 layers")
    specs = [
        gpu_models.AdapterSpec("qkvo-r16", 16),
        gpu_models.AdapterSpec("all-r16", 16, gpu_models.EVERY_LINEAR),
        gpu_models.AdapterSpec("qkvo-r8", 8),
    ]
    mixed_batch_matches_peft(shape, tmp_path, specs)


def test_qwen2_shape_with_qkv_bias_matches_peft(tmp_path: Path) -> None:
    """The Qwen2.5 shape's q/k/v biases (narrowed to 2 layers of 256; its real 151,936-row vocabulary)."""
    shape = replace(
        gpu_models.QWEN25_3B, num_layers=2, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
        head_dim=64, source="narrowed",
    )  # fmt: skip
    assert shape.qkv_bias
    mixed_batch_matches_peft(shape, tmp_path, [gpu_models.AdapterSpec("all-r16", 16, gpu_models.EVERY_LINEAR)])


def test_bench_shape_helpers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ceiling's GEMM shapes come from the model's config; a shape's adapters are the workload's names with
    the rank and targets asked; targets and the int8 pairing are issue 42's."""
    shape = gpu_models.LLAMA_32_1B
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(shape.config()))
    assert peers.matmul_shapes(tmp_path / "model") == [((32 + 2 * 8) * 64, 2048), (2 * 8192, 2048)]
    small = replace(shape, num_layers=1, hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=1)
    monkeypatch.setitem(gpu_models.REAL_SHAPES, "tiny-test", small)
    w = replace(Workload(), num_adapters=3, max_lora_rank=16)
    paths = peers.shape_adapters("tiny-test", tmp_path / "model", tmp_path / "a", w, "all", torch.float32)
    assert [p.name for p in paths] == ["a0000", "a0001", "a0002"]
    cfg = json.loads((paths[1] / "adapter_config.json").read_text())
    assert cfg["r"] == 16 and set(cfg["target_modules"]) == set(gpu_models.EVERY_LINEAR)
    assert cfg["base_model_name_or_path"] == str(tmp_path / "model")
    assert peers.targets_for("llama-3.2-1b").throughput == {"vllm": 3.0, "llama.cpp": 4.0}
    assert peers.targets_for(peers.BUILTIN).throughput["llama.cpp"] == 5.0
    setup = peers.Setup(
        tmp_path, [], "bfloat16", Workload(), tmp_path, tmp_path, 2, shape="llama-3.2-1b", precision="int8"
    )
    assert peers.llama_outtype(setup) == "q8_0" and setup.model_arg == str(tmp_path)
    assert peers.llama_outtype(replace(setup, precision="bf16")) == "bf16"
    results = {"ours": {"summary": {"lora_tokens_per_s": 30.0}}}
    goals: dict = {}
    peers.ceiling_goal(goals, results, {"throughput": {"tokens_per_s": 60.0}}, peers.SHAPE_TARGETS)
    assert goals["ours_fraction_of_ceiling"] == {"target": ">= 0.6", "value": 0.5, "met": False}
