"""The fused decoder layer (csrc/decoder_layer_cpu.cpp) against the Python layer it replaces: the same
kernels in the same order, so every step's logits must be the same bits, with decode rows, prefill
chunks over cached context, base rows and adapters on every kind of projection in one step."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from conftest import save_tiny
from engine_helpers import make_engine, run_all

from lora_helpers import ADAPTER_SPECS, make_peft_adapter
from loraplane_server.kernels import cpu_kernels
from loraplane_server.sampling_params import SamplingParams

pytestmark = pytest.mark.requires_cpu_kernels


def run_engine(
    model_dir: Path, adapters: dict[str, Path], fused: bool, quantization: str = "none"
) -> tuple[list[torch.Tensor], int]:
    """Every step's logits, and the fused layer calls, for one workload: 5 requests (4 adapters, base),
    prompts longer than the step's token budget so later chunks attend to cached context."""
    engine = make_engine(
        model_dir,
        dtype="bfloat16",
        max_loras=4,
        max_lora_rank=16,
        max_num_seqs=8,
        max_num_batched_tokens=48,
        enable_prefix_caching=False,
        fuse_layers=fused,
        quantization=quantization,
    )
    assert engine.layer_backend == "cpu_kernel" and engine.attention_backend == "cpu_kernel"
    for name, path in adapters.items():
        engine.adapters.register(name, str(path))
        engine.adapters.prewarm(name, "device")
    deadline = time.monotonic() + 120
    while not set(adapters) <= {a["id"] for a in engine.adapters.residency() if a["tier"] == "device"}:
        assert time.monotonic() < deadline, engine.adapters.residency()
        engine.adapters.manager.wait_for_completion(0.05)
        engine.poll_adapters()  # both runs then schedule the same steps (no load finishes mid-run)
    model = engine.runner.model
    steps: list[torch.Tensor] = []
    calls = 0
    forward, layer_call = model.forward, cpu_kernels.decoder_layer

    def recording_forward(*args: object) -> torch.Tensor:
        logits = forward(*args)
        steps.append(logits.clone())
        return logits

    def counting_layer(*args: object) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return layer_call(*args)  # type: ignore[arg-type]

    model.forward = recording_forward  # type: ignore[method-assign]
    cpu_kernels.decoder_layer = counting_layer  # type: ignore[assignment]
    try:
        gen = torch.Generator().manual_seed(3)
        names: list[str | None] = [*adapters, None]
        for i, name in enumerate(names):
            prompt = torch.randint(0, 384, (20 + 17 * i,), generator=gen).tolist()
            engine.add_request(prompt, SamplingParams(max_new_tokens=6 + i, ignore_eos=True), adapter_id=name)
        run_all(engine, check_errors=True)
    finally:
        cpu_kernels.decoder_layer = layer_call  # type: ignore[assignment]
    return steps, calls


@pytest.mark.requires_bf16_kernels
@pytest.mark.parametrize("quantization", ["none", "int8"])  # int8: the projections through linear_int8_
@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: biases on q, k, v
def test_fused_layer_equals_the_python_layer(kind: str, quantization: str, tmp_path: Path) -> None:
    # head_dim 64 (the prefill kernel's), 4 query heads on 2 kv heads
    model_dir = save_tiny(tmp_path / kind, kind, 3.0, 7, vocab_size=384, hidden_size=256, intermediate_size=352)
    adapters = {
        name: make_peft_adapter(model_dir, tmp_path / name, seed=i, b_scale=20.0, **spec)
        for i, (name, spec) in enumerate(ADAPTER_SPECS.items())
    }
    with torch.inference_mode():
        fused, calls = run_engine(model_dir, adapters, fused=True, quantization=quantization)
        python, none = run_engine(model_dir, adapters, fused=False, quantization=quantization)
    assert none == 0
    # every layer of every step, fused: the last one too, on the logits rows alone where the step prunes
    layers = 3
    assert calls == layers * len(fused) and len(fused) == len(python) > 10
    for i, (a, b) in enumerate(zip(fused, python, strict=True)):
        assert torch.equal(a, b), f"step {i}: max |diff| {(a.float() - b.float()).abs().max().item()}"


def test_fused_layer_refuses_malformed_arguments() -> None:
    """Weights that do not fit together are refused when gathered (at load); wrong list lengths, decode rows
    without their tables, LoRA without row slots, pruning before the last layer: a clear error, and neither
    the residual stream nor the KV cache written."""
    bf = torch.bfloat16
    t, hidden, heads, kv_heads, d, inter = 2, 128, 2, 1, 64, 96
    x = torch.randn(t, hidden).to(bf)
    weights: list[torch.Tensor | None] = [
        torch.randn((heads + 2 * kv_heads) * d, hidden).to(bf),
        None,
        torch.randn(hidden, heads * d).to(bf),
        torch.ones(hidden, dtype=bf),
        torch.randn(2 * inter, hidden).to(bf),
        None,
        torch.randn(hidden, inter).to(bf),
        None,
        torch.ones(hidden, dtype=bf),
    ]
    with pytest.raises(RuntimeError, match="qkv is not"):
        cpu_kernels.layer_weights([torch.randn(7, hidden).to(bf), *weights[1:]], (heads, kv_heads), 0.125, (1e-5, 1e-5))
    with pytest.raises(RuntimeError, match="gate_up .* and down .* do not match"):
        bad = [*weights[:6], torch.randn(hidden, inter + 1).to(bf), *weights[7:]]
        cpu_kernels.layer_weights(bad, (heads, kv_heads), 0.125, (1e-5, 1e-5))
    with pytest.raises(RuntimeError, match="positive multiple of num_kv_heads"):
        cpu_kernels.layer_weights(weights, (3, 2), 0.125, (1e-5, 1e-5))
    with pytest.raises(RuntimeError, match="all bf16 or all int8"):
        cpu_kernels.layer_weights([weights[0].float(), *weights[1:]], (heads, kv_heads), 0.125, (1e-5, 1e-5))
    # int8 projections: each needs its scales and row sums, of the right shapes
    q8 = [w.to(torch.int8) if i in (0, 2, 4, 6) else w for i, w in enumerate(weights)]
    with pytest.raises(RuntimeError, match="all bf16 or all int8"):
        cpu_kernels.layer_weights([*q8[:2], weights[2], *q8[3:]], (heads, kv_heads), 0.125, (1e-5, 1e-5))
    int8_layer = cpu_kernels.layer_weights(q8, (heads, kv_heads), 0.125, (1e-5, 1e-5))
    parts = [
        t for i in (0, 2, 4, 6) for t in (torch.ones(q8[i].shape[0]), torch.zeros(q8[i].shape[0], dtype=torch.int32))
    ]
    with pytest.raises(RuntimeError, match="a scale and a sum for each of 4"):
        int8_layer.set_int8(parts[:6])
    with pytest.raises(RuntimeError, match="scale must be fp32"):
        int8_layer.set_int8([torch.ones(3), *parts[1:]])
    with pytest.raises(RuntimeError, match="not int8"):
        cpu_kernels.layer_weights(weights, (heads, kv_heads), 0.125, (1e-5, 1e-5)).set_int8(parts)
    int8_layer.set_int8(parts)
    layer = cpu_kernels.layer_weights(weights, (heads, kv_heads), 0.125, (1e-5, 1e-5))
    caches = torch.zeros(2, 4, 16, kv_heads, d, dtype=bf)
    cos, sin = torch.ones(t, d, dtype=bf), torch.zeros(t, d, dtype=bf)
    step = [cos, sin, torch.tensor([0, 1]), None, None, None, None, None]

    def call(s: list, lora: list, num_decode: int) -> torch.Tensor:
        return cpu_kernels.decoder_layer(x, x.clone(), layer, caches[0], caches[1], s, [], [], lora, num_decode, -1)

    before = x.clone()
    with pytest.raises(RuntimeError, match="8 step tensors"):
        call(step[:6], [None] * 12, 0)
    with pytest.raises(RuntimeError, match="block tables"):
        call(step, [None] * 12, 2)
    with pytest.raises(RuntimeError, match="row slots"):
        call(step, [weights[0], weights[0], weights[0]] + [None] * 9, 0)
    with pytest.raises(RuntimeError, match="only the last layer prunes"):
        call([*step[:6], torch.tensor([1]), None], [None] * 12, 0)
    assert torch.equal(x, before) and not caches.any()  # refused before anything was written
