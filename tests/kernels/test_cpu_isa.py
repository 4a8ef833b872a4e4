"""The engine's paths follow what the kernel library was built for, on every CPU of the project's kind:
the library reports its instruction set, `auto` takes the bf16 kernels only where they exist, an
explicit cpu_kernel that cannot run is refused at start, and LORAPLANE_CPU_ISA=avx2 makes an AVX-512
machine build and run exactly what an AVX2-only one does."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loraplane_server import cpu_features
from loraplane_server.config import EngineConfig
from loraplane_server.engine import LLMEngine, resolve_dtype
from loraplane_server.layers import cpu_kernels

CPU = torch.device("cpu")


@pytest.mark.requires_cpu_kernels
def test_the_library_reports_the_isa_of_this_cpu() -> None:
    bf16 = "avx512_bf16" in cpu_features.cpu_flags() and "avx512f" in cpu_features.cpu_flags()
    assert cpu_kernels.isa() == ("avx512_bf16" if bf16 else "avx2" if "avx2" in cpu_features.cpu_flags() else "generic")
    assert cpu_kernels.has_bf16_kernels() == bf16
    assert cpu_kernels.prefill_kernel_applies_to(torch.bfloat16, 64) == bf16


def test_an_unknown_isa_cap_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_features.ISA_ENV, "avx9000")
    with pytest.raises(ValueError, match="LORAPLANE_CPU_ISA='avx9000': expected one of native, avx2"):
        cpu_features.cpu_flags()


def test_the_avx2_cap_hides_every_flag_above_avx2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_features.ISA_ENV, raising=False)
    monkeypatch.setattr(
        cpu_features, "_cpuinfo", lambda: ("Zen 4", frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"}))
    )
    assert cpu_features.has_bf16_compute()
    assert cpu_features.march_flags() == ["-march=native"]
    monkeypatch.setenv(cpu_features.ISA_ENV, "avx2")
    assert cpu_features.cpu_flags() == {"avx2", "fma"}
    assert not cpu_features.has_bf16_compute()
    assert resolve_dtype("auto", CPU) == torch.float32
    assert cpu_features.march_flags()[0] == "-march=x86-64-v3"
    assert "capped by LORAPLANE_CPU_ISA=avx2" in cpu_features.describe()


def test_without_the_bf16_kernels_auto_takes_torch_and_cpu_kernel_is_refused_at_start(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What an AVX2-only CPU gets, whatever CPU runs this: the bf16 layer kernels are never called."""
    monkeypatch.setattr(cpu_kernels, "has_bf16_kernels", lambda: False)
    config = {"model": str(tiny_llama_dir), "dtype": "bfloat16", "num_kv_blocks": 16}
    engine = LLMEngine(EngineConfig(**config))
    assert engine.layer_backend == "torch"
    assert engine.runner.lora_slots.packed is None  # the torch LoRA layout, not the BGMV kernel's
    assert not cpu_kernels.prefill_kernel_applies_to(torch.bfloat16, 64)
    assert "; bfloat16; attention cpu_kernel, layers torch, LoRA torch" in engine.describe()
    with pytest.raises(
        RuntimeError, match="layer_backend=cpu_kernel needs AVX-512 BF16.*Use layer_backend auto or torch"
    ):
        LLMEngine(EngineConfig(**config, layer_backend="cpu_kernel"))


AVX2_PROBE = """
import json, torch
from loraplane_server import cpu_features
from loraplane_server.config import EngineConfig
from loraplane_server.engine import LLMEngine
from loraplane_server.layers import cpu_kernels
from loraplane_server.sampling_params import SamplingParams

report = {"isa": cpu_kernels.isa(), "flags": sorted(cpu_features.cpu_flags())}
x = torch.zeros(2, 8, dtype=torch.bfloat16)
try:
    cpu_kernels.bgmv_packed_(torch.zeros(2, 6, dtype=torch.bfloat16), x, torch.zeros(3, 40, dtype=torch.bfloat16),
                             torch.tensor([0, 1]), torch.zeros(3, 2, 2, dtype=torch.int64), torch.tensor([0, 4, 6]), 2)
except RuntimeError as error:
    report["bgmv_packed_"] = str(error).splitlines()[0]
engine = LLMEngine(EngineConfig(model=MODEL, num_kv_blocks=32))
report.update(dtype=str(engine.dtype), layer=engine.layer_backend, attention=engine.attention_backend)
report["paths"] = engine.describe()
out = engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
report["tokens"] = len(out.token_ids)
try:
    LLMEngine(EngineConfig(model=MODEL, dtype="bfloat16", num_kv_blocks=32, layer_backend="cpu_kernel"))
except RuntimeError as error:
    report["refused"] = str(error)
print(json.dumps(report))
"""


@pytest.mark.requires_cpu_kernels
def test_an_avx2_build_runs_what_an_avx2_cpu_runs(tiny_llama_dir: Path) -> None:
    """Under LORAPLANE_CPU_ISA=avx2 (a build for x86-64-v3, this machine's own where it has no
    AVX-512): no AVX-512 flag is seen, the library says avx2, its bf16-only kernels refuse with a clear
    error, dtype auto is fp32 on the torch layers with the decode-attention kernel, and an explicit
    layer_backend=cpu_kernel is refused at start."""
    code = f"MODEL = {str(tiny_llama_dir)!r}\n{AVX2_PROBE}"
    env = {**os.environ, cpu_features.ISA_ENV: "avx2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["isa"] == "avx2"
    assert not [f for f in report["flags"] if f.startswith(("avx512", "amx"))]
    assert report["bgmv_packed_"] == "bgmv_packed_: built without AVX512-BF16"
    assert (report["dtype"], report["layer"], report["attention"]) == ("torch.float32", "torch", "cpu_kernel")
    assert report["tokens"] == 4
    # what the start-up log line (and /v1/debug/engine) tells a user of such a machine
    assert "capped by LORAPLANE_CPU_ISA=avx2), kernels built for avx2; float32;" in report["paths"]
    assert report["paths"].endswith("attention cpu_kernel, layers torch, LoRA torch"), report["paths"]
    assert "needs AVX-512 BF16; the CPU kernels were built for avx2" in report["refused"]


@pytest.mark.requires_bf16_kernels
def test_the_engine_logs_the_paths_it_picked_at_start(tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One line at start says what runs where: the CPU and its flags, the kernels' ISA, dtype, every backend."""
    with caplog.at_level(logging.INFO, logger="loraplane.engine"):
        engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="bfloat16", num_kv_blocks=16))
    lines = [r.getMessage() for r in caplog.records if r.name == "loraplane.engine"]
    assert lines == [f"engine: {engine.describe()}"]
    assert cpu_features.cpu_model() in lines[0] and "kernels built for avx512_bf16; bfloat16;" in lines[0]
    assert lines[0].endswith("attention cpu_kernel, layers cpu_kernel (one call per decoder layer), LoRA cpu_kernel")
