"""Choosing the device (--device), its refusals, the GPU memory budget's arithmetic and its profiling step,
on any machine: what needs a GPU itself is marked `gpu` (bench/gpu.py runs those first on one, where no HTTP
stack is installed: `loraplane serve`'s device checks are in test_device_serving.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import make_engine

from loraplane_server.config import CPU_KV_CACHE_BYTES, EngineConfig
from loraplane_server.executor.memory_profile import profile_blocks, profile_chunks, profile_step
from loraplane_server.executor.model_runner import ModelRunner, kv_block_bytes
from loraplane_server.executor.models.loader import checkpoint_bytes, load_model
from loraplane_server.platforms.device import (
    GIB,
    DeviceError,
    GPUMemoryError,
    check_weights_fit,
    cuda_unusable_reason,
    plan_gpu_memory,
    resolve_device,
)

HAS_CUDA = cuda_unusable_reason() is None


@pytest.mark.parametrize("name", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_device_names_accepted(name: str) -> None:
    assert EngineConfig(device=name).device == name


@pytest.mark.parametrize("name", ["gpu", "CUDA", "cuda:", "cuda:x", "cuda:0,1", "mps", ""])
def test_device_names_refused(name: str) -> None:
    with pytest.raises(ValueError, match="expected auto, cpu, cuda or cuda:N"):
        EngineConfig(device=name)


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.01])
def test_gpu_memory_utilization_bounds(fraction: float) -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=fraction)


def test_auto_follows_the_machine() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == (torch.device("cuda", 0) if HAS_CUDA else torch.device("cpu"))


@pytest.mark.skipif(HAS_CUDA, reason="a machine without a usable CUDA device")
@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_cuda_without_a_gpu_is_an_error_with_its_reason(name: str) -> None:
    reason = cuda_unusable_reason()
    assert reason is not None and ("CUDA" in reason or "torch" in reason)
    with pytest.raises(DeviceError) as info:
        resolve_device(name)
    assert str(info.value) == f"--device {name}: {reason}"


@pytest.mark.gpu
def test_cuda_index_past_the_last_gpu() -> None:
    count = torch.cuda.device_count()
    with pytest.raises(DeviceError, match=f"shows {count} CUDA device"):
        resolve_device(f"cuda:{count}")
    assert resolve_device("cuda") == torch.device("cuda", 0)


# the GPU memory budget (pure arithmetic)


def test_plan_gives_the_kv_cache_what_the_budget_leaves() -> None:
    plan = plan_gpu_memory(
        total_bytes=80 * GIB,
        free_at_start=79 * GIB,
        utilization=0.9,
        peak_step_bytes=20 * GIB,
        non_torch_bytes=1 * GIB,
        block_bytes=2 << 20,
        min_blocks=8192,
    )
    assert plan.budget_bytes == int(72 * GIB)
    assert plan.num_blocks == (72 - 20 - 1) * GIB // (2 << 20)
    assert plan.kv_cache_bytes <= plan.budget_bytes - 21 * GIB
    assert "blocks" in plan.describe()


def test_plan_refuses_a_budget_other_processes_hold() -> None:
    with pytest.raises(GPUMemoryError, match=r"asks for 72.00 GiB .* only 40.00 GiB were free"):
        plan_gpu_memory(80 * GIB, 40 * GIB, 0.9, GIB, 0, 1 << 20, 1)


def test_plan_refuses_a_model_whose_full_context_does_not_fit() -> None:
    with pytest.raises(GPUMemoryError) as info:
        plan_gpu_memory(80 * GIB, 80 * GIB, 0.5, 38 * GIB, GIB, 1 << 20, min_blocks=2048)
    text = str(info.value)
    assert "41.00 GiB needed, 40.00 GiB available" in text
    assert "--max-model-len" in text


def test_weights_that_cannot_fit_fail_before_the_load() -> None:
    check_weights_fit(16 * GIB, 80 * GIB, 80 * GIB, 0.9)
    with pytest.raises(GPUMemoryError, match=r"weights need 75.00 GiB, 72.00 GiB are available"):
        check_weights_fit(75 * GIB, 80 * GIB, 80 * GIB, 0.9)


def test_checkpoint_bytes_match_the_loaded_parameters(tiny_llama_dir: Path) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(tiny_llama_dir, dtype, torch.device("cpu"), 128)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        assert checkpoint_bytes(tiny_llama_dir, dtype, int8_projections=False) == params
    int8 = checkpoint_bytes(tiny_llama_dir, torch.bfloat16, int8_projections=True)
    assert int8 < checkpoint_bytes(tiny_llama_dir, torch.bfloat16, int8_projections=False)


# the profiling step


@pytest.mark.parametrize(
    ("tokens", "seqs", "max_len"), [(2048, 64, 4096), (2048, 256, 8192), (100, 64, 4096), (512, 4, 64), (7, 3, 100)]
)
def test_profile_chunks_form_the_largest_step(tokens: int, seqs: int, max_len: int) -> None:
    chunks = profile_chunks(tokens, seqs, max_len)
    assert sum(n for _, n in chunks) == min(tokens, seqs * max_len)
    assert len(chunks) == min(seqs, tokens)
    assert all(1 <= n <= max_len and ctx + n <= max_len for ctx, n in chunks)
    assert chunks[0][0] + chunks[0][1] == max_len  # one chunk reads a full-length context
    assert max(n for _, n in chunks) - min(n for _, n in chunks) <= 1


def test_profile_step_runs_through_the_runner(tiny_llama_dir: Path) -> None:
    """The step the budget measures is one the runner runs like any other: every sequence samples."""
    engine = make_engine(tiny_llama_dir, max_model_len=96, max_num_batched_tokens=160, max_num_seqs=8)
    chunks = profile_chunks(160, 8, engine.max_model_len)
    blocks = profile_blocks(chunks, engine.config.block_size)
    runner = ModelRunner(
        engine.runner.model, blocks, engine.config.block_size, engine.dtype, engine.device, engine.backends
    )
    scheduled = profile_step(chunks, engine.config.block_size)
    assert max(max(s.block_table) for s, _ in scheduled) == blocks - 1
    samplers, tokens, _ = runner.run(scheduled)
    assert [s.request_id for s in samplers] == [f"profile-{i}" for i in range(8)]
    assert all(len(t) == 1 and 0 <= t[0] < engine.runner.model.args.vocab_size for t in tokens)


def test_cpu_kv_cache_follows_kv_cache_bytes(tiny_llama_dir: Path) -> None:
    default = make_engine(tiny_llama_dir, device="cpu")
    block = kv_block_bytes(default.runner.model.args, default.config.block_size, default.dtype)
    assert default.memory_plan is None
    assert default.block_manager.num_blocks == CPU_KV_CACHE_BYTES // block
    assert make_engine(tiny_llama_dir, device="cpu", kv_cache_bytes=10 * block + 1).block_manager.num_blocks == 10
    assert make_engine(tiny_llama_dir, device="cpu", kv_cache_bytes=1).block_manager.num_blocks == 2  # the floor


@pytest.mark.gpu
def test_gpu_budget_is_profiled(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5)
    plan = engine.memory_plan
    assert plan is not None and plan.num_blocks == engine.block_manager.num_blocks
    assert torch.cuda.memory_reserved() <= plan.budget_bytes  # weights, slots and the KV cache within the budget
    assert plan.kv_cache_bytes > 0.5 * (plan.budget_bytes - plan.peak_step_bytes - plan.non_torch_bytes)
