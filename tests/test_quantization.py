"""int8 base weights (EngineConfig.quantization = int8): the quantizer's bound, the engine against an
independent reference (transformers and PEFT on the same model with its linear layers replaced by their
dequantized int8 weights: token for token in fp32, adapters mixed in one batch), the weights' bytes, and the
bf16 kernel engine against the bf16 engine."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from engine_helpers import make_engine, run_all
from safetensors.torch import load_file, save_file
from test_multi_lora_peft import run_mixed

from lora_helpers import ADAPTER_SPECS, make_peft_adapter, peft_greedy
from loraplane_server.config import EngineConfig
from loraplane_server.engine.llm_engine import LLMEngine
from loraplane_server.executor.layers.linear import ProjectionLinear
from loraplane_server.executor.layers.quant import dequantize, quantize_int8, torch_int8_linear
from loraplane_server.sampling_params import SamplingParams

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_quantize_int8_round_trip() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(37, 100, generator=gen) * torch.rand(37, 1, generator=gen) * 3
    w[5] = 0  # a row of zeros
    q, scale, wsum = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and wsum.dtype == torch.int32
    assert int(q.abs().max()) == 127 and scale[5] == 1 and not q[5].any()
    err = (dequantize(q, scale, torch.float32) - w).abs()
    assert bool((err <= scale[:, None] / 2 * (1 + 1e-6)).all())
    assert torch.equal(wsum, q.sum(1, dtype=torch.int32))
    x = torch.randn(6, 100, generator=gen)
    ref = x @ dequantize(q, scale, torch.float32).T
    torch.testing.assert_close(torch_int8_linear(x, q, scale, None), ref, rtol=1e-5, atol=1e-5)


def dequantized_copy(model_dir: Path, out: Path) -> Path:
    """model_dir with every decoder projection replaced by its int8 quantization, dequantized (what the int8
    engine computes with), saved as an ordinary checkpoint for transformers and PEFT."""
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.suffix == ".safetensors":
            state = load_file(str(f))
            for key, t in state.items():
                if key.endswith(".weight") and key.split(".")[-2] in PROJECTIONS:
                    q, scale, _ = quantize_int8(t)
                    state[key] = dequantize(q, scale, t.dtype)
            save_file(state, str(out / f.name), metadata={"format": "pt"})
        elif f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    return out


def mixed_work(vocab: int, names: list[str | None], seed: int) -> list[tuple[str | None, list[int], int, int]]:
    """12 requests for run_mixed: random prompts of 3-29 tokens, 4-11 new tokens, adapters (None: the base
    model) in turn, three joining per step."""
    rng = random.Random(seed)
    work = []
    for i in range(12):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 30))]
        work.append((names[i % len(names)], prompt, rng.randrange(4, 12), i // 3))
    return work


Work = list[tuple[str | None, list[int], int, int]]


def peft_adapters_and_work(model_dir: Path, tmp_path: Path, seed: int) -> tuple[dict[str, Path], Work]:
    """Every ADAPTER_SPECS adapter on model_dir, and mixed_work over them and the base model."""
    adapters = {
        name: make_peft_adapter(model_dir, tmp_path / name, seed=i, **spec)
        for i, (name, spec) in enumerate(ADAPTER_SPECS.items())
    }
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return adapters, mixed_work(vocab, [*adapters, None], seed)


def assert_matches_peft(engine: LLMEngine, reference: Path, adapters: dict[str, Path], work: Work) -> None:
    """The work run mixed on the engine (the adapters registered) gives, token for token, what PEFT gives on
    `reference` with each adapter alone, and the base model's rows what the reference alone gives."""
    for name, path in adapters.items():
        engine.adapters.register(name, str(path))
    ours = run_mixed(engine, work)
    for name in [*adapters, None]:
        rows = [i for i, w in enumerate(work) if w[0] == name]
        prompts, lens = [work[i][1] for i in rows], [work[i][2] for i in rows]
        assert [ours[i] for i in rows] == peft_greedy(reference, adapters[name] if name else None, prompts, lens), name


def test_int8_engine_matches_peft_on_the_dequantized_model(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """fp32 activations (the torch int8 path): a mixed batch of adapters of different ranks and base requests
    gives, token for token, what PEFT gives on the dequantized checkpoint, each adapter alone."""
    reference = dequantized_copy(tiny_llama_dir, tmp_path / "dequantized")
    adapters, work = peft_adapters_and_work(tiny_llama_dir, tmp_path, 5)
    engine = make_engine(
        tiny_llama_dir, quantization="int8", block_size=4, num_kv_blocks=128, max_loras=4, max_lora_rank=16,
        disk_cache_dir=str(tmp_path / "disk-cache"),
    )  # fmt: skip
    linears = [m for m in engine.runner.model.modules() if isinstance(m, ProjectionLinear)]
    assert linears and all(m.weight.dtype == torch.int8 for m in linears)
    assert_matches_peft(engine, reference, adapters, work)


def weight_bytes(engine: LLMEngine) -> int:
    return sum(
        t.numel() * t.element_size()
        for m in engine.runner.model.modules()
        if isinstance(m, ProjectionLinear)
        for t in (m.weight, m.weight_scale, m.weight_sum, m.bias)
        if t is not None
    )


EXAMPLES = Path(__file__).resolve().parents[1] / "server" / "examples" / "adapters"


def _accuracy() -> ModuleType:
    from test_accuracy_harness import _load_accuracy

    return _load_accuracy()


@pytest.fixture(scope="module")
def smollm2_engines(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, LLMEngine]:
    """The bf16 kernel engine, plain and with int8 weights (every example adapter registered on both)."""
    config = dict(model=str(smollm2_dir), dtype="bfloat16", num_kv_blocks=512, max_model_len=1024, max_loras=4)
    engines = {}
    for mode in ("none", "int8"):
        disk = tmp_path_factory.mktemp(f"dc-{mode}")
        engines[mode] = LLMEngine(EngineConfig(**config, quantization=mode, disk_cache_dir=str(disk)))  # type: ignore[arg-type]
        for name in ("french", "pirate", "json"):
            engines[mode].adapters.register(name, str(EXAMPLES / name))
    return engines


@pytest.mark.requires_bf16_kernels
def test_int8_kernels_engine_on_smollm2(smollm2_engines: dict[str, LLMEngine]) -> None:
    """The kernels' path (bf16 activations, int8 weights, the fused layer): the projections take at most 0.55x
    their bf16 bytes, the start-up line says int8, and on the project's evaluation text (bench/data/eval.txt)
    the perplexity is within 3% of bf16's and the next-token choice agrees at >= 85% of the positions."""
    bf16, int8 = smollm2_engines["none"], smollm2_engines["int8"]
    assert "int8 weights" in int8.describe() and int8.runner.model.fused_layers
    assert weight_bytes(int8) <= 0.55 * weight_bytes(bf16)
    acc = _accuracy()
    text = acc.EVAL_TEXT.read_text()
    ref = acc.score_tokens(bf16, acc.text_ids(bf16, text))
    cand = acc.score_tokens(int8, acc.text_ids(int8, text))
    ratio = cand.perplexity / ref.perplexity
    top1 = (ref.top1 == cand.top1).double().mean().item()
    assert 0.97 <= ratio <= 1.03, (ref.perplexity, cand.perplexity)
    assert top1 >= 0.85, top1


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


@pytest.mark.requires_bf16_kernels
@pytest.mark.parametrize(
    ("adapter", "question", "check"),
    [
        ("pirate", "What is the capital of Italy?", lambda t: t.startswith("Arr")),
        ("json", "What is 9 plus 6?", lambda t: _is_json_object(t)),
        ("french", "What is the capital of Italy?", lambda t: " est " in f" {t} " or "La " in t),
    ],
)
def test_example_adapters_answer_in_their_style_under_int8(
    smollm2_engines: dict[str, LLMEngine], adapter: str, question: str, check: Callable[[str], bool]
) -> None:
    """The three example adapters answer as their model cards say (server/examples/adapters/*/README.md) with
    int8 base weights, and the base model alone does not answer so."""
    engine = smollm2_engines["int8"]
    chat = [{"role": "user", "content": question}]
    prompt = engine.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    params = SamplingParams(max_new_tokens=40)
    with_adapter = engine.add_request(prompt, params, adapter_id=adapter)
    alone = engine.add_request(prompt, params)
    done = run_all(engine, check_errors=True)
    answer, base = done[with_adapter].text.strip(), done[alone].text.strip()
    assert check(answer), answer
    assert base != answer and (adapter == "french" or not check(base)), base
