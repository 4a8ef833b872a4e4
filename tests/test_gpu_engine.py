"""The engine's CUDA step: Triton decode attention and Triton SGMV LoRA, mixed adapters and ranks with base
requests in one batch, chunked prefill over a cached prefix, sampling on the device. On a GPU (marker `gpu`,
run first by bench/gpu.py) against the CPU engine and PEFT; here, the same Triton step on CPU tensors under
TRITON_INTERPRET=1, so the tests themselves are known to run before a GPU ever sees them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import make_engine, run_all

from lora_helpers import peft_greedy
from loraplane_server.config import EngineConfig
from loraplane_server.engine.llm_engine import LLMEngine
from loraplane_server.kernels.triton_lora import triton_available
from loraplane_server.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not importable")

# (device, the backends the CUDA path picks by itself, spelled out where the CPU must be told)
TRITON_ON_CPU = {"device": "cpu", "attention_backend": "triton", "lora_backend": "triton", "layer_backend": "triton"}
ON_CUDA = {"device": "cuda"}
CPU_TORCH = {"device": "cpu", "attention_backend": "torch", "lora_backend": "torch"}  # the reference
DEVICES = [
    pytest.param(TRITON_ON_CPU, id="triton-interpreted"),
    pytest.param(ON_CUDA, id="cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(scope="module")
def adapters(spec_adapters: dict[str, Path]) -> dict[str, Path]:
    return spec_adapters


def _engine(model_dir: Path, tmp_path: Path, where: dict[str, str], **overrides: object) -> LLMEngine:
    fields: dict = {
        "block_size": 4,
        "num_kv_blocks": 96,
        "max_loras": 4,
        "max_lora_rank": 16,
        "disk_cache_dir": str(tmp_path / "dc"),
        **where,
        **overrides,
    }
    return make_engine(model_dir, **fields)


def _greedy(engine: LLMEngine, adapters: dict[str, Path], work: list[tuple[str | None, list[int], int]]) -> list:
    for name, path in adapters.items():
        engine.adapters.register(name, str(path))
        engine.adapters.prewarm(name, "host")
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=n), adapter_id=a) for a, p, n in work]
    done = run_all(engine, check_errors=True)
    return [done[i].token_ids for i in ids]


def _mixed_work(adapters: dict[str, Path]) -> list[tuple[str | None, list[int], int]]:
    """Each adapter and the base model twice, prompts of 2-6 tokens, 4 new tokens each."""
    return [(name, [3 + i, 9, 27, 40 + i, 5, 11][: 2 + i % 5], 4) for i, name in enumerate([*adapters, None] * 2)]


@pytest.mark.parametrize("where", DEVICES)
def test_mixed_adapters_and_base_equal_peft(
    where: dict[str, str], tiny_llama_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """fp32, greedy: four adapters of ranks 2-16 on different targets and base requests in one batch, token for
    token the CPU engine's and PEFT's."""
    work = _mixed_work(adapters)
    engine = _engine(tiny_llama_dir, tmp_path, where)
    if where is ON_CUDA:
        assert engine.device.type == "cuda" and engine.runner.kv_caches.is_cuda
    assert (engine.attention_backend, engine.lora_backend.name, engine.layer_backend) == ("triton", "triton", "triton")
    got = _greedy(engine, adapters, work)
    reference = _engine(
        tiny_llama_dir, tmp_path, {"device": "cpu", "attention_backend": "torch", "lora_backend": "torch"}
    )
    assert got == _greedy(reference, adapters, work)
    for (name, prompt, n), tokens in list(zip(work, got, strict=True))[:5]:
        assert tokens == peft_greedy(tiny_llama_dir, adapters.get(name) if name else None, [prompt], [n])[0]


def test_split_shrinks_equal_the_torch_path(
    tiny_llama_dir: Path, adapters: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The split IN reduction the shrink takes on a GPU (partial sums added atomically), forced under the
    interpreter: 16-column chunks (the tiny model's 64 are one chunk otherwise) and a GPU's 132 multiprocessors."""
    from loraplane_server.kernels import triton_lora

    calls: list[int] = []
    split = triton_lora.shrink_split
    monkeypatch.setattr(triton_lora, "_BLOCK_IN", 16)
    monkeypatch.setattr(triton_lora, "multiprocessors", lambda device: 132)
    monkeypatch.setattr(triton_lora, "shrink_split", lambda *a: calls.append(split(*a)) or calls[-1])
    work = _mixed_work(adapters)
    got = _greedy(_engine(tiny_llama_dir, tmp_path, TRITON_ON_CPU), adapters, work)
    assert calls and min(calls) > 1  # every shrink split
    assert got == _greedy(_engine(tiny_llama_dir, tmp_path, CPU_TORCH), adapters, work)


@pytest.mark.parametrize("where", DEVICES)
def test_chunked_prefill_over_a_cached_prefix(where: dict[str, str], tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Prompts longer than a step's token budget prefill in chunks over their own cached context, and a second
    request reuses the first's prefix blocks: the same tokens as the CPU engine."""
    shared = [(7 * i + 3) % 50 for i in range(40)]
    work = [(None, shared + [1, 2], 5), (None, shared + [4], 5), (None, [9, 8, 7], 3)]
    outs = []
    for w in (where, CPU_TORCH):
        engine = _engine(tiny_llama_dir, tmp_path, w, max_num_batched_tokens=16)
        first = _greedy(engine, {}, work[:1])
        rest = _greedy(engine, {}, work[1:])
        assert engine.block_manager.num_prefix_hits >= 40 // 4 * 4  # the shared prompt's whole blocks, twice over
        outs.append(first + rest)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("where", DEVICES)
def test_seeded_sampling_on_the_device(where: dict[str, str], tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Sampled requests draw from their own generator on the engine's device: the same seed, the same tokens;
    another seed, other tokens."""
    engine = _engine(tiny_llama_dir, tmp_path, where)
    params = [SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=s) for s in (5, 5, 6)]
    ids = [engine.add_request([3, 9, 27], p) for p in params]
    done = run_all(engine, check_errors=True)
    a, b, c = (done[i].token_ids for i in ids)
    assert a == b and a != c
    assert all(0 <= t < engine.runner.model.args.vocab_size for t in a + c)


@pytest.mark.gpu
def test_cuda_engine_describes_its_gpu(tiny_llama_dir: Path, tmp_path: Path) -> None:
    engine = _engine(tiny_llama_dir, tmp_path, ON_CUDA, dtype="auto")
    info = engine.device_info
    assert info.device == "cuda:0" and info.name == torch.cuda.get_device_name(0)
    assert info.total_memory_bytes == torch.cuda.get_device_properties(0).total_memory
    assert engine.dtype == torch.bfloat16
    assert engine.describe().startswith(f"cuda:0 ({info.name}")


def test_layer_backend_triton_is_chosen_on_cuda_and_asked_for_elsewhere(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """auto: the Triton layer ops on CUDA only (the CPU keeps its kernels or torch); triton: them under the
    interpreter too, every norm, attention and MLP of the model switched, and the engine says so."""
    from loraplane_server.executor.backends import resolve_backends
    from loraplane_server.executor.layers.norm import RMSNorm

    assert not resolve_backends(EngineConfig(), torch.device("cpu"), torch.float32).layer_triton
    engine = _engine(tiny_llama_dir, tmp_path, TRITON_ON_CPU)
    assert engine.backends.layer_triton and engine.backends.to_dict()["layers"] == "triton"
    assert "layers triton" in engine.describe()
    modules = [m for m in engine.runner.model.modules() if isinstance(m, RMSNorm)]
    assert modules and all(m.triton for m in modules)
    with pytest.raises(ValueError, match="layer_backend"):
        EngineConfig(layer_backend="cuda_kernel")
