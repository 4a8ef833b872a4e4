"""The architectures beyond Llama (Qwen3, Phi-3, Gemma 3 text and multimodal; Mistral's window), each on a tiny
random model built from transformers' own config class: greedy token-for-token parity with transformers under
continuous batching (joins, prefix hits, preemption), a mixed batch of PEFT adapters (different ranks and
targets, Phi-3's fused ones included) equal to PEFT per adapter, bf16 runs scored by the fp32 model, LongRoPE
past its original length, each model's context, and unsupported architectures refused at start."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import save_tiny
from test_engine_hf import hf_greedy, run_staggered
from test_multi_lora_peft import run_mixed

from lora_helpers import make_peft_adapter, peft_greedy, teacher_forced
from loraplane_server.adapters.weights import AdapterError, load_lora
from loraplane_server.config import EngineConfig
from loraplane_server.engine.kv_groups import HybridBlocks
from loraplane_server.engine.llm_engine import LLMEngine
from loraplane_server.executor.layers.rotary import rope_kind
from loraplane_server.executor.models import loader, registry
from loraplane_server.executor.models.llama import ModelArgs
from loraplane_server.kernels import cpu_kernels
from loraplane_server.kernels.triton_attention import triton_available
from loraplane_server.sampling_params import SamplingParams
from loraplane_server.store.sources import ModelSourceError

needs_triton = pytest.mark.skipif(not triton_available(), reason="needs triton with CUDA or TRITON_INTERPRET=1")

VOCAB = 512
# variants: the tiny kind and its config overrides
VARIANTS: dict[str, tuple[str, dict]] = {
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", dict(tie_word_embeddings=True, head_dim=16)),
    "phi3": ("phi3", {}),
    # LongRoPE (attention factor != 1) on a partial rotary, as Phi-3.5 / Phi-4-mini configs have
    "phi3-longrope": (
        "phi3",
        dict(
            partial_rotary_factor=0.5,
            original_max_position_embeddings=128,
            rope_scaling=dict(type="longrope", short_factor=[1.0, 1.5, 2.0, 4.0], long_factor=[8.0] * 4),
        ),
    ),
    # a full rotary under LongRoPE, as Phi-3.5-mini has (the fused bf16 decoder layer applies)
    "phi3-longrope-full": (
        "phi3",
        dict(
            original_max_position_embeddings=128,
            rope_scaling=dict(
                type="longrope", short_factor=[1.0, 1.1, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0], long_factor=[8.0] * 8
            ),
        ),
    ),
    # YaRN, as Qwen2.5 / Qwen3 configs extend their context (factor 4 over an original 32 tokens: the prompts
    # run past it; mscale's attention factor != 1)
    "qwen3-yarn": (
        "qwen3",
        dict(rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, rope_theta=1e4)),
    ),
    "gemma3": ("gemma3", {}),
    # windows far shorter than the prompts: Gemma 3's local layers beside its global one, Mistral's every layer
    "gemma3-window": ("gemma3", dict(sliding_window=8)),
    "mistral-window": ("mistral", dict(sliding_window=8)),
    # linear rope scaling on the global layers alone, as every Gemma 3 from 4B up; sqrt(80) is not exact in any
    # dtype, so the embedding scale's rounding counts
    "gemma3-linear": (
        "gemma3",
        dict(
            hidden_size=80,
            rope_parameters=dict(
                full_attention=dict(rope_type="linear", factor=8.0, rope_theta=20000.0),
                sliding_attention=dict(rope_type="default", rope_theta=1000.0),
            ),
        ),
    ),
    # Gemma3ForConditionalGeneration (4B and up) served as its language model: untied, linear global rope
    "gemma3-mm": ("gemma3-mm", dict(hidden_size=96, rope_scaling=dict(rope_type="linear", factor=8.0))),
}
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS: dict[str, dict] = {  # three ranks, three target sets, one rsLoRA
    "qv-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all-r8": dict(r=8, lora_alpha=16, target_modules=list(ALL)),
    "mlp-rs16": dict(r=16, lora_alpha=4, use_rslora=True, target_modules=["o_proj", "gate_proj", "down_proj"]),
}
_MM = ".*language_model.*\\."  # PEFT target regexes on the language model alone (SigLIP has q/k/v too)
MM_ADAPTERS: dict[str, dict] = {  # as ADAPTERS; one alpha_pattern by the full module name PEFT sees
    "qv-r4": dict(r=4, lora_alpha=8, target_modules=_MM + "(q_proj|v_proj)"),
    "all-r8": dict(
        r=8,
        lora_alpha=16,
        target_modules=_MM + f"({'|'.join(ALL)})",
        alpha_pattern={"model.language_model.layers.1.self_attn.q_proj": 64},
    ),
    "mlp-rs16": dict(r=16, lora_alpha=4, use_rslora=True, target_modules=_MM + "(o_proj|gate_proj|down_proj)"),
}
PHI3_ADAPTERS: dict[str, dict] = {  # PEFT on Phi-3 sees only the fused projections
    "qkv-r4": dict(r=4, lora_alpha=8, target_modules=["qkv_proj"]),
    "all-r8": dict(r=8, lora_alpha=16, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "mlp-rs16": dict(r=16, lora_alpha=4, use_rslora=True, target_modules=["o_proj", "gate_up_proj", "down_proj"]),
}


def save_tiny_gemma3_multimodal(path: Path, **text_overrides: Any) -> Path:
    """A Gemma3ForConditionalGeneration with a tiny SigLIP tower; its language model is conftest's tiny gemma3
    (with text_overrides) and its lm_head untied (the top-level tie_word_embeddings rules, not text_config's)."""
    import transformers

    text_dir = save_tiny(path.with_name(f"{path.name}-text"), "gemma3", **text_overrides)
    text = transformers.Gemma3ForCausalLM.from_pretrained(str(text_dir), dtype=torch.float32)
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=16,
        patch_size=4,
    )
    config = transformers.Gemma3Config(
        text_config=text.config.to_dict(), vision_config=vision, mm_tokens_per_image=4, tie_word_embeddings=False
    )
    torch.manual_seed(5)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        model.model.language_model.load_state_dict(text.model.state_dict())
        embed = text.model.embed_tokens.weight
        model.lm_head.weight.copy_(torch.randn_like(embed) * embed.std())
    model.save_pretrained(str(path), safe_serialization=True)
    shutil.rmtree(text_dir)
    return path


def save_variant(path: Path, kind: str, **overrides: Any) -> Path:
    if kind == "gemma3-mm":
        return save_tiny_gemma3_multimodal(path, **overrides)
    return save_tiny(path, kind, **overrides)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: save_variant(tmp_path_factory.mktemp(name), kind, **overrides)
        for name, (kind, overrides) in VARIANTS.items()
    }


def prompts_within(limit: int, seed: int) -> tuple[list[list[int]], list[int], list[int]]:
    """Prompts of different lengths with shared prefixes and a repeat, their max_new (all within `limit`
    tokens) and join steps."""
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(30)]
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 17, 33, 50, 8, 41)]
    prompts += [shared + [rng.randrange(VOCAB) for _ in range(k)] for k in (5, 21, 2)]
    prompts.append(list(prompts[3]))
    max_new = [min(rng.randrange(6, 30), limit - len(p) - 1) for p in prompts]
    return prompts, max_new, [0, 0, 1, 2, 2, 5, 6, 9, 12, 13]


def engine_for(model_dir: Path, tmp: Path, **overrides: object) -> LLMEngine:
    config: dict = dict(
        model=str(model_dir),
        dtype="float32",
        block_size=4,
        num_kv_blocks=40,
        max_num_batched_tokens=48,
        max_num_seqs=6,
        max_loras=3,
        max_lora_rank=16,
        disk_cache_dir=str(tmp / "disk-cache"),
    )
    return LLMEngine(EngineConfig(**(config | overrides)))


@pytest.mark.parametrize("attention", ["cpu_kernel", "torch"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers(variant: str, attention: str, model_dirs: dict[str, Path], tmp_path: Path) -> None:
    model_dir = model_dirs[variant]
    # a model windowed on every layer holds a window's blocks, not a context's (16-token steps: at most 7 blocks
    # of 4 each), so 10 blocks still preempt
    windowed = variant == "mistral-window"
    sizes = dict(num_kv_blocks=10, max_num_batched_tokens=16) if windowed else {}
    engine = engine_for(model_dir, tmp_path, attention_backend=attention, **sizes)
    assert (engine.block_manager.window > 0) == windowed
    # Gemma 3's sliding layers keep their K/V in a pool of their own, which releases what the window passed
    windows = engine.runner.model.args.sliding_windows
    assert isinstance(engine.block_manager, HybridBlocks) == (any(windows) and not all(windows))
    prompts, max_new, join = prompts_within(min(engine.max_model_len, 96), seed=7)
    if windowed:  # requests longer than the whole KV cache
        assert max(len(p) + n for p, n in zip(prompts, max_new, strict=True)) > 10 * 4
    free0 = engine.block_manager.num_free_blocks
    assert run_staggered(engine, prompts, max_new, join) == hf_greedy(model_dir, prompts, max_new)
    assert engine.block_manager.num_free_blocks == free0
    assert engine.block_manager.num_prefix_hits > 0
    assert engine.scheduler.num_preemptions > 0  # 40 blocks of 4 tokens for up to 6 sequences
    if isinstance(engine.block_manager, HybridBlocks):  # every window block back
        assert engine.block_manager.windows.num_free_blocks == engine.block_manager.windows.num_blocks


def test_gemma3_sliding_layers_hold_a_window_of_kv(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A long request on Gemma 3 (local layers windowed at 8 tokens beside a global one): its global layers
    hold the whole context, its sliding layers' pool a window and a step (blocks of 4), and the tokens are
    transformers'."""
    model_dir = model_dirs["gemma3-window"]
    engine = engine_for(model_dir, tmp_path, num_kv_blocks=40, max_num_batched_tokens=16)
    blocks = engine.block_manager
    assert isinstance(blocks, HybridBlocks)
    prompt = [random.Random(3).randrange(VOCAB) for _ in range(70)]
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=40))
    seq = engine.requests[rid]
    held: list[tuple[int, int]] = []  # (global, window) blocks held after each step
    tokens: list[int] = []
    while not tokens:
        for out in engine.step():
            tokens = out.token_ids if out.finished else tokens
        if not seq.is_finished:
            held.append((len(seq.block_table), len(seq.window_table) - seq.window_released))
    assert tokens == hf_greedy(model_dir, [prompt], [40])[0]
    assert max(g for g, _ in held) == 27  # the global layers: the whole context (108 positions before the end)
    assert max(w for _, w in held) <= blocks.windows.peak_blocks(110) == 7  # (8 - 1 + 16) / 4 + 1
    assert held[-1][1] <= 3  # decoding: the window's 8 positions span at most 3 blocks


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logprobs_match_transformers(variant: str, model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Every chosen token's logprob equals transformers' fp32 one: what greedy tokens cannot show (Gemma's
    final logit softcapping keeps the argmax)."""
    from transformers import AutoModelForCausalLM

    model_dir = model_dirs[variant]
    engine = engine_for(model_dir, tmp_path)
    prompts, max_new, _ = prompts_within(min(engine.max_model_len, 96), seed=17)
    outs = engine.generate(prompts[:4], [SamplingParams(max_new_tokens=n, logprobs=True) for n in max_new[:4]])
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    for prompt, out in zip(prompts[:4], outs, strict=True):
        chosen, best = teacher_forced(hf, prompt, out.token_ids)
        torch.testing.assert_close(torch.tensor(out.logprobs), chosen, atol=2e-4, rtol=0)
        assert torch.equal(chosen, best)


@pytest.mark.parametrize("variant", ["qwen3", "phi3", "gemma3", "gemma3-mm", "gemma3-window"])
def test_mixed_adapter_batch_matches_peft(variant: str, model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Three PEFT adapters (ranks 4, 8, 16; q/v, every projection, o/MLP with rsLoRA) and base rows in one
    continuous batch; each adapter's greedy tokens equal PEFT's with that adapter alone (on the multimodal
    Gemma 3: adapters on its language model, named model.language_model.layers.N)."""
    base = model_dirs[variant]
    specs = {"phi3": PHI3_ADAPTERS, "gemma3-mm": MM_ADAPTERS}.get(variant, ADAPTERS)
    adapters = {
        name: make_peft_adapter(base, tmp_path / name, seed=i, **spec) for i, (name, spec) in enumerate(specs.items())
    }
    engine = engine_for(base, tmp_path, num_kv_blocks=128)
    for name, path in adapters.items():
        engine.adapters.register(name, str(path))
    rng = random.Random(3)
    names: list[str | None] = [*adapters, None]
    work = [
        (names[i % 4], [rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 40))], rng.randrange(4, 14), i // 3)
        for i in range(12)
    ]
    ours = run_mixed(engine, work)
    for who in names:
        rows = [i for i, w in enumerate(work) if w[0] == who]
        prompts, max_new = [work[i][1] for i in rows], [work[i][2] for i in rows]
        ref = peft_greedy(base, adapters[who] if who else None, prompts, max_new)
        assert [ours[i] for i in rows] == ref, f"adapter {who} differs from PEFT"
        if who is not None:
            assert peft_greedy(base, None, prompts, max_new) != ref, f"adapter {who} has no visible effect"
    assert engine.slots.num_busy == 0


def test_fused_targets_split_exactly_and_are_refused_elsewhere(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A qkv_proj / gate_up_proj LoRA becomes one pair per projection: the same A, B's rows split. The same
    adapter on a model whose checkpoint keeps the projections apart is refused with the reason."""
    phi3 = model_dirs["phi3"]
    path = make_peft_adapter(phi3, tmp_path / "a", seed=0, **PHI3_ADAPTERS["all-r8"])
    args = registry.model_args(json.loads((phi3 / "config.json").read_text()))
    weights = load_lora(path, "a", args, 16, torch.float32)
    assert weights.target_modules == list(ALL)
    q, kv, inter = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim, args.intermediate_size
    assert [weights.tensors[(0, m)][1].shape[0] for m in ("q_proj", "k_proj", "v_proj")] == [q, kv, kv]
    assert [weights.tensors[(0, m)][1].shape[0] for m in ("gate_proj", "up_proj")] == [inter, inter]
    assert weights.tensors[(1, "q_proj")][0] is weights.tensors[(1, "v_proj")][0]
    llama_args = ModelArgs(**{**args.__dict__, "model_type": "llama", "fused_projections": False})
    with pytest.raises(AdapterError, match="is a fused projection .* this llama base model has .* apart"):
        load_lora(path, "a", llama_args, 16, torch.float32)


def test_a_multimodal_gemma3_loads_its_language_model_alone(
    model_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The language model's tensors under either naming (transformers 5's model.language_model.*, older
    checkpoints' language_model.model.* and language_model.lm_head) load the same model; the vision tower's and
    the projector's tensors are never read."""
    from safetensors.torch import load_file, save_file

    src = model_dirs["gemma3-mm"]
    tensors = load_file(str(src / "model.safetensors"))
    namings = (  # (transformers 5's, older): transformers 5.24 still saves the older
        ("model.language_model.", "language_model.model."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("lm_head.", "language_model.lm_head."),
    )
    renamed = {}
    for key, tensor in tensors.items():
        this, other = next((a, b) for pair in namings for a, b in (pair, pair[::-1]) if key.startswith(a))
        renamed[other + key.removeprefix(this)] = tensor
    assert {k.split(".")[0] for k in renamed | tensors} >= {"model", "language_model", "vision_tower"}
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    shutil.copy(src / "config.json", other_dir / "config.json")
    save_file(renamed, str(other_dir / "model.safetensors"))
    read: list[str] = []
    safe_open = loader.safe_open

    @contextlib.contextmanager
    def recording(*args: Any, **kwargs: Any) -> Iterator[SimpleNamespace]:
        with safe_open(*args, **kwargs) as f:

            def get_tensor(name: str) -> torch.Tensor:
                read.append(name)
                return f.get_tensor(name)

            yield SimpleNamespace(keys=f.keys, get_tensor=get_tensor)

    monkeypatch.setattr(loader, "safe_open", recording)
    models = [loader.load_model(d, torch.float32, torch.device("cpu"), 64) for d in (src, other_dir)]
    assert read and not any("vision_tower" in n or "multi_modal_projector" in n for n in read)
    assert len(read) == sum(1 for k in renamed | tensors if "language_model" in k or k.startswith("lm_head"))
    assert models[0].lm_head is not None and models[0].args.model_type == "gemma3_text"
    ours = models[0].state_dict()
    assert ours.keys() == models[1].state_dict().keys()
    assert all(torch.equal(t, models[1].state_dict()[k]) for k, t in ours.items())


def test_gemma3_embedding_scale_is_rounded_to_the_dtype(model_dirs: dict[str, Path]) -> None:
    """sqrt(80) is multiplied in bf16 (8.9375), bit for bit as transformers does; the unrounded factor differs."""
    from transformers import AutoModelForCausalLM

    model_dir = model_dirs["gemma3-linear"]
    ours = loader.load_model(model_dir, torch.bfloat16, torch.device("cpu"), 64)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    ids = torch.arange(VOCAB)
    with torch.no_grad():
        scaled = ours.embed(ids)
        assert torch.equal(scaled, hf.model.embed_tokens(ids))
        assert not torch.equal(scaled, ours.embed_tokens(ids) * 80**0.5)


def test_multimodal_gemma3_adapters_map_to_the_language_model(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A PEFT adapter on the language model maps its layers under either naming; one whose targets also match
    SigLIP's q_proj / v_proj (a plain list of names does) loads as its language-model part (text prompts never
    run the vision tower); one on the vision tower alone is refused."""
    from safetensors.torch import load_file, save_file

    base = model_dirs["gemma3-mm"]
    args = registry.model_args(json.loads((base / "config.json").read_text()))
    path = make_peft_adapter(base, tmp_path / "new", seed=0, **MM_ADAPTERS["qv-r4"])
    new = load_lora(path, "new", args, 16, torch.float32)
    assert sorted(new.tensors) == [(i, m) for i in range(3) for m in ("q_proj", "v_proj")]
    other = tmp_path / "other"
    shutil.copytree(path, other)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    this, that = "base_model.model.model.language_model.", "base_model.model.language_model.model."
    if not next(iter(tensors)).startswith(this):
        this, that = that, this
    assert all(k.startswith(this) for k in tensors)
    save_file({that + k.removeprefix(this): t for k, t in tensors.items()}, str(other / "adapter_model.safetensors"))
    loaded = load_lora(other, "other", args, 16, torch.float32)
    assert all(torch.equal(a, b) for k in new.tensors for a, b in zip(new.tensors[k], loaded.tensors[k], strict=True))
    both = make_peft_adapter(base, tmp_path / "both", seed=0, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    both_tensors = load_file(str(both / "adapter_model.safetensors"))
    assert any("vision_tower" in k for k in both_tensors)  # a plain list of names adapts SigLIP too
    text_only = {k: t for k, t in both_tensors.items() if "vision_tower" not in k}
    loaded_both = load_lora(both, "both", args, 16, torch.float32)
    shutil.copytree(both, tmp_path / "text-only")
    save_file(text_only, str(tmp_path / "text-only" / "adapter_model.safetensors"))
    loaded_text = load_lora(tmp_path / "text-only", "text-only", args, 16, torch.float32)
    assert sorted(loaded_both.tensors) == sorted(loaded_text.tensors)  # the vision tower's tensors left out
    for k in loaded_text.tensors:
        assert all(torch.equal(a, b) for a, b in zip(loaded_both.tensors[k], loaded_text.tensors[k], strict=True))
    vision_only = {k: t for k, t in both_tensors.items() if "vision_tower" in k}
    save_file(vision_only, str(tmp_path / "text-only" / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="adapts only the vision tower"):
        load_lora(tmp_path / "text-only", "vision", args, 16, torch.float32)


@pytest.mark.requires_bf16_kernels
@pytest.mark.parametrize("variant", ["qwen3", "phi3-longrope", "phi3-longrope-full", "gemma3", "gemma3-linear", "phi3"])
def test_bf16_follows_the_fp32_model(
    variant: str, model_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 on the CPU layer kernels: the one-call decoder layer runs for Llama-shaped Phi-3 only, LongRoPE's
    scaled cos/sin included (never for q/k norms, gelu, extra norms or a partial rotary), and the engine's greedy
    tokens, scored by transformers in fp32 (teacher forcing), are the fp32 model's top token or within bf16 noise
    of it."""
    from transformers import AutoModelForCausalLM

    fused_calls: list[int] = []
    layer = cpu_kernels.decoder_layer

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        fused_calls.append(1)
        return layer(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_kernels, "decoder_layer", counted)
    model_dir = model_dirs[variant]
    engine = engine_for(model_dir, tmp_path, dtype="bfloat16", layer_backend="cpu_kernel", num_kv_blocks=256)
    prompts, max_new, _ = prompts_within(min(engine.max_model_len, 96), seed=11)
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=True) for n in max_new])
    assert bool(fused_calls) == (variant in ("phi3", "phi3-longrope-full"))
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    gaps, drifts = [], []
    for prompt, out in zip(prompts, outs, strict=True):
        chosen, best = teacher_forced(hf, prompt, out.token_ids)
        gaps.append(best - chosen)
        drifts.append((torch.tensor(out.logprobs) - chosen).abs())
    gap, drift = torch.cat(gaps), torch.cat(drifts)
    assert float((gap < 1e-4).float().mean()) >= 0.9, gap.topk(3).values  # a lost feature flips far more
    # bf16 moves a logprob by up to ~0.25 (tests/kernels/test_cpu_linear.py); these tiny models stay under 0.04
    assert gap.max() < 0.5 and drift.max() < 0.25, (gap.topk(3).values, drift.topk(3).values)


def write_checkpoint(path: Path, **cfg: object) -> Path:
    """A config.json and a (valid, one-tensor) safetensors file: a checkpoint of some other architecture."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({"wte.weight": torch.zeros(4, 4)}, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize(
    ("cfg", "named"),
    [
        (
            dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]),
            "model_type 'gpt2' (architectures GPT2LMHeadModel)",
        ),
        (dict(model_type="gemma3n", architectures=["Gemma3nForConditionalGeneration"]), "model_type 'gemma3n'"),
        (dict(model_type="gemma3", architectures=["Gemma3ForSequenceClassification"]), "model_type 'gemma3'"),
        (dict(model_type="llama", architectures=["LlamaForSequenceClassification"]), "LlamaForSequenceClassification"),
    ],
)
def test_unsupported_architectures_fail_at_start_with_the_supported_list(cfg: dict, named: str, tmp_path: Path) -> None:
    model_dir = write_checkpoint(tmp_path / "m", **cfg)
    with pytest.raises(registry.UnsupportedModelError) as err:
        registry.family_of(json.loads((model_dir / "config.json").read_text()))
    with pytest.raises(ModelSourceError) as at_start:  # the model store checks config.json before any weight
        LLMEngine(EngineConfig(model=str(model_dir), dtype="float32"))
    assert str(at_start.value) == f"config.json: {err.value}"
    message = str(err.value)
    assert named in message and "is not supported" in message
    for listed in ("llama (LlamaForCausalLM)", "qwen3 (Qwen3ForCausalLM)", "phi3 (Phi3ForCausalLM)"):
        assert listed in message
    assert "gemma3_text (Gemma3ForCausalLM)" in message
    assert "gemma3 (Gemma3ForConditionalGeneration, text only)" in message


@pytest.mark.parametrize(
    ("kind", "overrides", "backend"),
    [
        ("mistral", dict(sliding_window=8), "auto"),  # every layer windowed
        ("gemma3", dict(sliding_window=8), "auto"),  # local (windowed) and global layers
        ("gemma3", dict(sliding_window=8), "torch"),
        # the Triton kernels' window, decodes through the graphs' static buffers (both pools' tables)
        pytest.param("gemma3", dict(sliding_window=8), "triton", marks=needs_triton),
        ("qwen3", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1), "auto"),  # past the first
    ],
)
def test_sliding_windows_match_transformers_far_past_the_window(
    kind: str,
    overrides: dict,
    backend: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Windowed layers attend the last W positions alone, as transformers masks them: prompts and generations
    several windows long, chunked prefill (48-token steps) over a cached context, staggered joins, and a repeated
    prompt whose cached prefix crosses the window, equal transformers token for token; the context is the
    model's own (nothing capped, nothing logged)."""
    model_dir = save_tiny(tmp_path / kind, kind, **overrides)
    sizes: dict = dict(num_kv_blocks=160, attention_backend=backend)
    if backend == "triton":  # as on CUDA: Triton LoRA, decode steps through the graphs' static buffers
        sizes |= dict(lora_backend="triton", layer_backend="triton")
        monkeypatch.setattr(LLMEngine, "_graphs_mode", lambda self: "eager")
    with caplog.at_level(logging.WARNING, logger="loraplane_server.executor.models.registry"):
        engine = engine_for(model_dir, tmp_path, **sizes)
    assert backend == "auto" or engine.attention_backend == backend
    assert engine.max_model_len == 1024 and "serving at most" not in caplog.text
    windows = engine.runner.model.args.sliding_windows
    assert windows and 0 < min(w for w in windows if w) < 10  # the test's window, on the layers that have one
    rng = random.Random(5)
    lengths, max_new, join = (3, 12, 60, 21, 7), [40, 30, 20, 35, 25, 20], [0, 0, 1, 3, 4, 30]
    if backend == "triton":  # the interpreter is slow: fewer, shorter
        lengths, max_new, join = (12, 60), [24, 12, 12], [0, 0, 8]
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]
    prompts.append(list(prompts[lengths.index(60)]))  # a prefix-cache hit longer than the window
    assert run_staggered(engine, prompts, max_new, join) == hf_greedy(model_dir, prompts, max_new)
    graphs = engine.runner.graphs
    assert (graphs is not None and graphs.num_replays > 10) == (backend == "triton")


@pytest.mark.requires_bf16_kernels
def test_windowed_layers_fuse_in_bf16(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on the CPU kernels, a model windowed on every layer (Mistral, an 8-token window; head_dim 64, so the
    prefill kernel applies): the one-call decoder layer runs, the layer's window in its decode and prefill
    attention, over chunks of a cached context whose blocks before the window were released (their table entries
    placeholders: block 0, someone else's); its tokens are the unfused layers' (the same kernels one by one) and
    follow the fp32 model."""
    from transformers import AutoModelForCausalLM

    model_dir = save_tiny(tmp_path / "mistral", "mistral", sliding_window=8, head_dim=64)
    seen = {"decode": False, "context": False, "released": False}
    layer = cpu_kernels.decoder_layer

    def counted(*args: Any) -> torch.Tensor:
        step, tables, chunks, num_decode = args[5], args[6], args[7], args[9]
        seen["decode"] |= num_decode > 0
        seen["context"] |= any(ctx > 0 for ctx in chunks[2::3])
        # a table holds each of its own blocks once: block 0 twice or more is released blocks' placeholders
        rows = [*tables, *(step[3] if num_decode else [])]
        seen["released"] |= any(int((row == 0).sum()) > 1 for row in rows)
        return layer(*args)

    monkeypatch.setattr(cpu_kernels, "decoder_layer", counted)
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 12, 60, 21, 7)]
    prompts.append(list(prompts[2]))  # a prefix-cache hit longer than the window
    max_new = [40, 30, 20, 35, 25, 20]
    tokens = {}
    for fuse in (True, False):
        engine = engine_for(
            model_dir, tmp_path / f"fuse-{fuse}", dtype="bfloat16", layer_backend="cpu_kernel", fuse_layers=fuse
        )
        assert engine.attention_backend == "cpu_kernel" and engine.runner.model.fused_layers == fuse
        tokens[fuse] = run_staggered(engine, prompts, max_new, [0, 0, 1, 3, 4, 30])
        if fuse:
            assert all(seen.values()), seen
    assert tokens[True] == tokens[False]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    gaps = []
    for prompt, out in zip(prompts, tokens[True], strict=True):
        chosen, best = teacher_forced(hf, prompt, out)
        gaps.append(best - chosen)
    gap = torch.cat(gaps)
    assert float((gap < 1e-4).float().mean()) >= 0.9 and gap.max() < 0.5, gap.topk(3).values


@pytest.mark.parametrize(
    ("kind", "overrides", "expected"),
    [
        ("mistral", dict(sliding_window=None), 1024),
        ("qwen3", dict(use_sliding_window=True, sliding_window=48, max_window_layers=1), 1024),  # windows cap nothing
        ("qwen3", dict(use_sliding_window=True, sliding_window=48, max_window_layers=3), 1024),  # no window layer
        ("qwen3", dict(use_sliding_window=False, sliding_window=48), 1024),
        ("gemma3", {}, 1024),
        ("phi3", dict(sliding_window=200), 1024),
        # YaRN past max_position_embeddings, as Qwen2.5 configs state it (32,768 x 4); without a factor, the config's
        (
            "qwen3",
            dict(
                rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=512, rope_theta=1e4)
            ),
            2048,
        ),
        (
            "qwen3",
            dict(
                rope_parameters=dict(
                    rope_type="yarn", factor=None, original_max_position_embeddings=256, rope_theta=1e4
                )
            ),
            1024,
        ),
        # LongRoPE: its long factors past the original 128 positions
        (
            "phi3",
            dict(VARIANTS["phi3-longrope"][1], rope_scaling=dict(VARIANTS["phi3-longrope"][1]["rope_scaling"])),
            1024,
        ),
    ],
)
def test_context_limits(kind: str, overrides: dict, expected: int, tmp_path: Path) -> None:
    model_dir = save_tiny(tmp_path / kind, kind, **overrides)
    assert registry.max_context(json.loads((model_dir / "config.json").read_text())) == expected


# LongRoPE over an original length of 32 in a 256-token context, as Phi-4-mini (a partial rotary): long factors far
# from the short ones, so a token computed with the wrong set changes the greedy tokens
LONGROPE_PAST_ORIGINAL = dict(
    partial_rotary_factor=0.75,
    max_position_embeddings=256,
    original_max_position_embeddings=32,
    rope_scaling=dict(type="longrope", short_factor=[1.0, 1.2, 1.5, 2.0, 3.0, 4.0], long_factor=[24.0] * 6),
)
Requests = tuple[Path, list[list[int]], list[int], list[list[int]]]  # model, prompts, max_new, transformers' tokens


@pytest.fixture(scope="module")
def longrope_requests(tmp_path_factory: pytest.TempPathFactory) -> Requests:
    """The model, prompts within and past the original length (a repeat of one of each), their max_new and
    transformers' greedy tokens."""
    model_dir = save_tiny(tmp_path_factory.mktemp("phi3-longrope-32"), "phi3", **LONGROPE_PAST_ORIGINAL)
    rng = random.Random(11)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (9, 25, 32, 40, 70)]
    prompts += [list(prompts[1]), list(prompts[4])]
    max_new = [40, 30, 20, 25, 30, 30, 10]
    return model_dir, prompts, max_new, hf_greedy(model_dir, prompts, max_new)


@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_longrope_past_the_original_length(
    speculative: str,
    longrope_requests: Requests,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LongRoPE served past original_max_position_embeddings equals transformers' generate token for token:
    prompts within it that generate past it (generate recomputes the whole sequence with the long factors when it
    outgrows the original length, and so does the engine), prompts longer than it in 16-token chunks, a repeat of
    each that hits the prefix cache under its own factors, staggered joins, preemptions (40 blocks of 4 tokens);
    with prompt lookup's proposals, none past the short factors' last position."""
    model_dir, prompts, max_new, expected = longrope_requests
    engine = engine_for(model_dir, tmp_path, max_num_batched_tokens=16, speculative=speculative)
    assert engine.max_model_len == 256 and engine.runner.model.rotary.original == 32
    lookups: list[tuple[bool, int]] = []  # each prefix-cache lookup: (long factors, blocks found)
    find = engine.block_manager.find_cached_blocks

    def find_spied(seq: Any, *args: Any) -> list[int]:
        found = find(seq, *args)
        lookups.append((seq.rope_long, len(found)))
        return found

    monkeypatch.setattr(engine.block_manager, "find_cached_blocks", find_spied)
    assert run_staggered(engine, prompts, max_new, [0, 0, 2, 3, 5, 3, 12]) == expected
    assert any(long and n for long, n in lookups) and any(not long and n for long, n in lookups)
    assert engine.scheduler.num_preemptions > 0
    assert (engine.speculator.proposed_total > 0) == (speculative == "ngram")


@pytest.mark.requires_cpu_kernels
def test_qwen3_under_an_avx2_build(model_dirs: dict[str, Path]) -> None:
    """What an AVX2-only CPU runs in fp32 (the decode-attention kernel's portable path, torch's layers) still equals
    transformers token for token; its default there is bf16 on the kernels (test_bf16_follows_the_fp32_model
    covers that in the AVX2 pass of make test)."""
    model_dir = model_dirs["qwen3"]
    prompts, max_new, _ = prompts_within(96, seed=13)
    code = (
        "import json, sys\n"
        "from loraplane_server.config import EngineConfig\n"
        "import torch\n"
        "from loraplane_server.engine.llm_engine import LLMEngine, resolve_dtype\n"
        "from loraplane_server.kernels import cpu_kernels\n"
        "from loraplane_server.sampling_params import SamplingParams\n"
        f"config = EngineConfig(model={str(model_dir)!r}, dtype='float32', block_size=4, num_kv_blocks=256)\n"
        "engine = LLMEngine(config)\n"
        f"prompts, max_new = {prompts!r}, {max_new!r}\n"
        "outs = engine.generate(prompts, [SamplingParams(max_new_tokens=n) for n in max_new])\n"
        "print(json.dumps(dict(isa=cpu_kernels.isa(), dtype=str(engine.dtype), attention=engine.attention_backend,"
        " auto=str(resolve_dtype('auto', torch.device('cpu'))), tokens=[o.token_ids for o in outs])))\n"
    )
    env = {**os.environ, "LORAPLANE_CPU_ISA": "avx2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert (report["isa"], report["dtype"], report["attention"]) == ("avx2", "torch.float32", "cpu_kernel")
    assert report["auto"] == "torch.bfloat16"
    assert report["tokens"] == hf_greedy(model_dir, prompts, max_new)


def hub_configs() -> dict[str, dict]:
    """The shapes of config.json files as published (older transformers' keys: rope_scaling, rope_local_base_freq,
    sliding_window_pattern, a top-level partial_rotary_factor), trimmed to what the engine reads."""
    llama = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_hidden_layers=32)
    gemma = dict(
        model_type="gemma3_text",
        architectures=["Gemma3ForCausalLM"],
        hidden_size=1152,
        intermediate_size=6912,
        num_attention_heads=4,
        num_key_value_heads=1,
        num_hidden_layers=26,
        head_dim=256,
        query_pre_attn_scalar=256,
        max_position_embeddings=32768,
        rope_theta=1000000,
        rope_local_base_freq=10000,
        rope_scaling=None,
        sliding_window=512,
        sliding_window_pattern=6,
        vocab_size=262144,
    )
    phi: dict[str, Any] = dict(
        model_type="phi3",
        architectures=["Phi3ForCausalLM"],
        hidden_size=3072,
        intermediate_size=8192,
        num_attention_heads=32,
        num_hidden_layers=32,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_scaling=dict(type="longrope", short_factor=[1.0] * 48, long_factor=[2.0] * 48),
        sliding_window=262144,
        vocab_size=32064,
    )
    return {
        "llama-3.1": dict(
            llama,
            model_type="llama",
            num_key_value_heads=8,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
        ),
        "mistral-v0.1": dict(llama, model_type="mistral", max_position_embeddings=32768, sliding_window=4096),
        "mistral-v0.3": dict(llama, model_type="mistral", max_position_embeddings=32768, sliding_window=None),
        "qwen2.5": dict(
            llama, model_type="qwen2", max_position_embeddings=32768, use_sliding_window=False, sliding_window=131072
        ),
        "qwen3": dict(llama, model_type="qwen3", head_dim=128, max_position_embeddings=40960, sliding_window=None),
        "gemma-3-1b": gemma,
        "gemma-3-4b": dict(
            gemma,
            rope_scaling=dict(rope_type="linear", factor=8.0),
            sliding_window=1024,
            max_position_embeddings=131072,
        ),
        # as published: a sparse text_config (the rest Gemma3TextConfig's defaults), a SigLIP vision_config
        "gemma-3-4b-it": dict(
            model_type="gemma3",
            architectures=["Gemma3ForConditionalGeneration"],
            eos_token_id=[1, 106],
            mm_tokens_per_image=256,
            text_config=dict(
                model_type="gemma3_text",
                hidden_size=2560,
                intermediate_size=10240,
                num_hidden_layers=34,
                rope_scaling=dict(rope_type="linear", factor=8.0),
                sliding_window=1024,
            ),
            vision_config=dict(
                model_type="siglip_vision_model",
                hidden_size=1152,
                image_size=896,
                intermediate_size=4304,
                num_attention_heads=16,
                num_hidden_layers=27,
                patch_size=14,
                vision_use_head=False,
            ),
        ),
        "phi-3.5-mini": phi,
        "phi-3-mini-4k": dict(phi, max_position_embeddings=4096, rope_scaling=None, sliding_window=2047),
        "phi-4-mini": dict(
            phi,
            partial_rotary_factor=0.75,
            rope_scaling=dict(phi["rope_scaling"], short_factor=[1.0] * 36, long_factor=[2.0] * 36),
        ),
    }


@pytest.mark.parametrize(
    ("name", "context", "features"),
    [
        ("llama-3.1", 131072, dict(rope_theta=500000.0, is_llama_shaped=True)),
        ("mistral-v0.1", 32768, dict(is_llama_shaped=True, sliding_windows=(4096,) * 32)),
        ("mistral-v0.3", 32768, dict(is_llama_shaped=True)),
        ("qwen2.5", 32768, dict(qkv_bias=True)),
        ("qwen3", 40960, dict(head_dim=128, qkv_bias=False)),
        ("gemma-3-1b", 32768, dict(attention_scale=1 / 16, local_rope_theta=10000.0, rope_scaling=None)),
        ("gemma-3-4b", 131072, dict(rope_theta=1e6, local_rope_scaling=None)),
        (
            "gemma-3-4b-it",
            131072,
            dict(model_type="gemma3_text", num_layers=34, head_dim=256, tie_word_embeddings=True, rope_theta=1e6),
        ),
        ("phi-3.5-mini", 131072, dict(fused_projections=True, is_llama_shaped=True, sliding_windows=())),  # 262,144
        ("phi-3-mini-4k", 4096, dict(fused_projections=True, sliding_windows=(2047,) * 32)),
        ("phi-4-mini", 131072, dict(head_dim=96, rotated_dims=72, is_llama_shaped=False)),
    ],
)
def test_published_config_shapes(name: str, context: int, features: dict) -> None:
    cfg = hub_configs()[name]
    args = registry.model_args(cfg)
    assert registry.max_context(cfg) == context
    assert {key: getattr(args, key) for key in features} == features
    if name.startswith("gemma"):
        assert "".join(kind[0] for kind in args.layer_types)[:12] == "sssssfsssssf"  # type: ignore[attr-defined]
        window = cfg.get("sliding_window") or cfg["text_config"]["sliding_window"]
        kinds = args.layer_types  # type: ignore[attr-defined]
        assert args.sliding_windows == tuple(window if kind[0] == "s" else 0 for kind in kinds)
    if name.startswith("gemma-3-4b"):
        assert rope_kind(args.rope_scaling) == "linear" and args.rope_scaling["factor"] == 8.0  # type: ignore[index]


def test_an_invalid_config_is_a_clear_error() -> None:
    cfg = hub_configs()["phi-4-mini"]
    cfg["rope_scaling"] = hub_configs()["phi-3.5-mini"]["rope_scaling"]  # 48 factors for 36 rotated pairs
    with pytest.raises(
        ValueError, match=r"^config.json is not a valid phi3 config: .*short_factor.* length 36, got 48"
    ):
        registry.model_args(cfg)


@pytest.mark.skipif(not triton_available(), reason="needs triton with CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("variant", ["qwen3", "gemma3"])
def test_triton_decode_attention_matches_transformers(
    variant: str, model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """The CUDA decode-attention kernel (run by the Triton interpreter here) on head dims 24 and 32."""
    model_dir = model_dirs[variant]
    engine = engine_for(model_dir, tmp_path, attention_backend="triton")
    assert engine.attention_backend == "triton"
    prompts, max_new, join = prompts_within(96, seed=19)
    prompts, max_new, join = prompts[:4], [min(n, 8) for n in max_new[:4]], join[:4]
    assert run_staggered(engine, prompts, max_new, join) == hf_greedy(model_dir, prompts, max_new)


@pytest.mark.parametrize(
    "yarn",
    [
        dict(factor=4.0, original_max_position_embeddings=32),
        dict(factor=8.0, original_max_position_embeddings=64, beta_fast=16, beta_slow=2, truncate=False),
        dict(factor=None, original_max_position_embeddings=256, mscale=0.707, mscale_all_dim=0.707),  # from the lengths
        dict(factor=2.0, original_max_position_embeddings=4096, attention_factor=1.25),
    ],
)
def test_yarn_frequencies_and_attention_factor_are_transformers(yarn: dict) -> None:
    """YaRN's inverse frequencies and cos/sin factor equal transformers' for each way a config states them."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from loraplane_server.executor.layers.rotary import rope_attention_scaling, rope_inv_freq

    params = {"rope_type": "yarn", "rope_theta": 10000.0, **yarn}
    config = Qwen3Config(head_dim=64, max_position_embeddings=1024, rope_parameters=params)
    expected, factor = ROPE_INIT_FUNCTIONS["yarn"](config, torch.device("cpu"))
    torch.testing.assert_close(rope_inv_freq(64, 10000.0, params, 1024), expected, atol=0, rtol=1e-6)
    assert rope_attention_scaling(params, 1024) == pytest.approx(factor, rel=1e-12)


def test_dynamic_ntk_is_refused_with_the_supported_list() -> None:
    """Dynamic NTK rescales with each forward's length in transformers (cached keys keep their old rotation),
    which a continuous batch cannot reproduce per request: refused, naming what is supported."""
    from loraplane_server.executor.layers.rotary import rope_inv_freq

    with pytest.raises(ValueError, match="'dynamic'.*yarn"):
        rope_inv_freq(64, 1e4, {"rope_type": "dynamic", "factor": 2.0})


@pytest.mark.parametrize(("kind", "overrides", "longest"), [("qwen3", {}, 40), ("mistral", dict(sliding_window=8), 0)])
def test_the_log_says_when_the_kv_cache_holds_less_than_the_context(
    kind: str, overrides: dict, longest: int, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """10 blocks of 4 tokens hold one 40-token request of a full-attention model, and any request of a model
    windowed (8 tokens) on every layer: the log names the bound (0: none below the context)."""
    model_dir = save_tiny(tmp_path / kind, kind, **overrides)
    with caplog.at_level(logging.INFO, logger="loraplane.engine"):
        engine = engine_for(model_dir, tmp_path, num_kv_blocks=10, max_num_batched_tokens=16, max_model_len=512)
    assert engine.max_model_len == 512
    if longest:
        assert f"holds one request of at most {longest} tokens" in caplog.text and "(--max-model-len)" in caplog.text
    else:
        assert "context: 512 tokens (--max-model-len); one request of it fits the KV cache" in caplog.text
