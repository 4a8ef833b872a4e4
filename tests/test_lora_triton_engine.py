"""The engine's Triton LoRA path (as on CUDA) gives the same tokens as the torch path, and both
equal PEFT, here on CPU tensors under TRITON_INTERPRET=1."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import make_engine

from lora_helpers import ADAPTER_SPECS, make_peft_adapter, peft_greedy
from loraplane_server.kernels.triton_lora import triton_available
from loraplane_server.sampling_params import SamplingParams


@pytest.mark.skipif(not triton_available(), reason="triton is not importable")
def test_triton_backend_matches_torch_and_peft(tiny_llama_dir: Path, tmp_path: Path) -> None:
    adapters = {
        name: make_peft_adapter(tiny_llama_dir, tmp_path / name, seed=i, **spec)
        for i, (name, spec) in enumerate(ADAPTER_SPECS.items())
    }
    work = [
        (name, [3 + i, 9, 27, 81 % 50 + i, 5][: 2 + i % 4], 3) for i, name in enumerate([*adapters, None, *adapters])
    ]
    outputs = {}
    for backend in ("torch", "triton"):
        engine = make_engine(
            tiny_llama_dir,
            block_size=4,
            num_kv_blocks=64,
            max_loras=4,
            max_lora_rank=16,
            lora_backend=backend,
            disk_cache_dir=str(tmp_path / "dc"),
        )
        assert engine.runner.use_triton == (backend == "triton")
        for name, path in adapters.items():
            engine.adapters.register(name, str(path))
            engine.adapters.prewarm(name, "host")
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=n), adapter_id=a) for a, p, n in work]
        done = {}
        while len(done) < len(ids):
            done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        outputs[backend] = [done[i] for i in ids]
    assert outputs["triton"] == outputs["torch"]
    for i, (name, prompt, n) in enumerate(work[:5]):
        assert (
            outputs["triton"][i] == peft_greedy(tiny_llama_dir, adapters.get(name) if name else None, [prompt], [n])[0]
        )
