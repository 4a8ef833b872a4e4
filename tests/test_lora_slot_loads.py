"""An adapter's host weights in one buffer, and a slot load from it: load_lora puts every tensor in one `flat`
buffer (page-locked for an engine on CUDA), and LoRASlots moves that buffer to the slots' device in one
transfer, each tensor then the same view of the copy. On the CPU the views are checked on the meta device (the
same offsets, no data); on a GPU (`gpu`) a slot loaded from pinned weights equals the CPU slot bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lora_helpers import make_peft_adapter
from loraplane_server.adapters.weights import LoRAWeights, load_lora, pinned_block_bytes
from loraplane_server.executor.lora.slots import LoRASlots, on_device
from loraplane_server.executor.models.loader import load_model, read_config
from loraplane_server.executor.models.registry import model_args


@pytest.fixture(scope="module")
def adapter(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    out = tmp_path_factory.mktemp("slot-loads") / "a"
    return make_peft_adapter(tiny_llama_dir, out, seed=3, r=4, lora_alpha=8, target_modules=targets)


def _weights(tiny_llama_dir: Path, adapter: Path, pin: bool = False) -> LoRAWeights:
    args = model_args(read_config(tiny_llama_dir))
    return load_lora(adapter, "a", args, 8, torch.float32, pin)


def test_every_tensor_is_a_view_of_one_buffer_holding_the_files_values(tiny_llama_dir: Path, adapter: Path) -> None:
    weights = _weights(tiny_llama_dir, adapter)
    flat = weights.flat
    assert flat is not None and flat.dtype == torch.float32 and not flat.is_pinned()
    assert flat.numel() == sum(a.numel() + b.numel() for a, b in weights.tensors.values())  # nothing shared here
    raw = load_file(str(adapter / "adapter_model.safetensors"))
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]
    starts = set()
    for (layer, module), (a, b) in weights.tensors.items():
        for t in (a, b):
            assert t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() and t.is_contiguous()
            starts.add(t.storage_offset())
        part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        key = f"base_model.model.model.layers.{layer}.{part}.{module}.lora_%s.weight"
        assert torch.equal(a, raw[key % "A"])
        assert torch.equal(b, raw[key % "B"] * scale)
    assert len(starts) == 2 * len(weights.tensors)  # no two tensors share a place
    assert weights.nbytes == flat.numel() * 4  # pageable: what the tensors hold


def test_pinned_blocks_are_counted_as_the_allocator_rounds_them() -> None:
    assert [pinned_block_bytes(n) for n in (1, 4096, 4097, 27_000_000, 1 << 25)] == [1, 4096, 8192, 1 << 25, 1 << 25]


def test_a_moved_buffer_gives_each_tensor_its_own_place(tiny_llama_dir: Path, adapter: Path) -> None:
    weights = _weights(tiny_llama_dir, adapter)
    moved = on_device(weights, torch.device("meta"))  # the transfer's arithmetic, without the data
    assert moved.keys() == weights.tensors.keys()
    for key, pair in weights.tensors.items():
        for host, there in zip(pair, moved[key], strict=True):
            assert there.device.type == "meta"
            assert there.shape == host.shape and there.storage_offset() == host.storage_offset()
    assert on_device(weights, torch.device("cpu")) is weights.tensors  # already there: nothing moves


def test_a_tensor_outside_the_buffer_is_refused(tiny_llama_dir: Path, adapter: Path) -> None:
    weights = _weights(tiny_llama_dir, adapter)
    key = next(iter(weights.tensors))
    weights.tensors[key] = (weights.tensors[key][0].clone(), weights.tensors[key][1])
    with pytest.raises(ValueError, match="not a view of its flat buffer"):
        on_device(weights, torch.device("meta"))


def _slots(tiny_llama_dir: Path, device: torch.device) -> LoRASlots:
    model = load_model(tiny_llama_dir, torch.float32, torch.device("cpu"), 64)
    return LoRASlots(model.lora_shapes(), model.args.num_layers, 2, 8, torch.float32, device)


@pytest.mark.gpu
def test_a_slot_loaded_from_pinned_weights_equals_the_cpu_slot(tiny_llama_dir: Path, adapter: Path) -> None:
    pinned = _weights(tiny_llama_dir, adapter, pin=True)
    assert pinned.flat is not None and pinned.flat.is_pinned()
    assert pinned.nbytes == pinned_block_bytes(pinned.flat.numel() * 4)  # the host tier counts the pinned block
    on_gpu, on_cpu = _slots(tiny_llama_dir, torch.device("cuda")), _slots(tiny_llama_dir, torch.device("cpu"))
    on_gpu.load(1, pinned)
    on_cpu.load(1, _weights(tiny_llama_dir, adapter))
    torch.cuda.synchronize()
    for kind in on_cpu.a:
        assert torch.equal(on_gpu.a[kind].cpu(), on_cpu.a[kind]) and on_cpu.a[kind][:, 1].abs().sum() > 0
        assert torch.equal(on_gpu.bt[kind].cpu(), on_cpu.bt[kind]) and on_cpu.bt[kind][:, 1].abs().sum() > 0
        assert torch.equal(on_gpu.rows[kind], on_cpu.rows[kind])
