"""The engine's paths follow what the kernel library was built for, on every CPU of the project's kind:
the build target is picked at run time from the CPU's flags, the library reports its instruction set,
`auto` takes the bf16 kernels where they exist (AVX-512 BF16 and AVX2 builds), an explicit cpu_kernel
that cannot run is refused at start, LORAPLANE_CPU_ISA=avx2 makes an AVX-512 machine load and run
exactly what an AVX2-only one does, and a prebuilt directory of targets is used before the cache."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loraplane_server.config import EngineConfig
from loraplane_server.engine.llm_engine import LLMEngine, resolve_dtype
from loraplane_server.kernels import cpu_kernels
from loraplane_server.platforms import cpu_features

CPU = torch.device("cpu")


@pytest.mark.requires_cpu_kernels
def test_the_library_reports_the_isa_of_this_cpu() -> None:
    flags = cpu_features.cpu_flags()
    avx512 = {"avx512_bf16", "avx512bw", "avx512_vnni"} <= flags
    expected = "avx512_bf16" if avx512 else "avx2" if "avx2" in flags else "generic"
    assert cpu_features.kernel_target() == expected
    assert cpu_kernels.isa() == expected  # what the loaded library itself was compiled for
    assert f"loraplane_cpu-{expected}-" in cpu_kernels.build_dir().name
    bf16 = expected != "generic"
    assert cpu_kernels.has_bf16_kernels() == bf16
    # above 1024 rows oneDNN's bf16 GEMM wins with AVX-512 BF16; elsewhere the kernel takes every size
    assert cpu_kernels.linear_max_rows() == (1024 if expected == "avx512_bf16" else 2**63 - 1)
    assert cpu_kernels.prefill_kernel_applies_to(torch.bfloat16, 64) == bf16


def test_targets_are_picked_from_the_flags_and_never_built_for_native(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_features.ISA_ENV, raising=False)
    zen3 = frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
    avx512 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    for flags, target in [
        (zen3 | avx512 | {"avx512_bf16", "avx512_vnni"}, "avx512_bf16"),
        (zen3 | avx512 | {"avx512_vnni"}, "avx2"),  # Cascade Lake: VNNI, no BF16
        (zen3 | avx512 | {"avx512_bf16"}, "avx2"),  # BF16 without VNNI: no such CPU, and the int8 GEMM needs it
        (zen3, "avx2"),
        (frozenset({"sse4_2", "avx"}), "generic"),
    ]:
        monkeypatch.setattr(cpu_features, "_cpuinfo", lambda flags=flags: ("a CPU", flags))
        assert cpu_features.kernel_target() == target
        assert not [f for f in cpu_kernels.cflags() if "native" in f]
    # the build key holds the target's flags, not the CPU's: two CPUs of one target share a build
    monkeypatch.setattr(cpu_features, "_cpuinfo", lambda: ("Zen 3", zen3))
    one = cpu_kernels.build_dir()
    monkeypatch.setattr(cpu_features, "_cpuinfo", lambda: ("Haswell", zen3 | {"erms", "rdrand"}))
    assert cpu_kernels.build_dir() == one and one.name.startswith("loraplane_cpu-avx2-")


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
    assert cpu_features.march_flags("avx512_bf16")[:3] == ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"]
    monkeypatch.setenv(cpu_features.ISA_ENV, "avx2")
    assert cpu_features.cpu_flags() == {"avx2", "fma"}
    assert not cpu_features.has_bf16_compute()
    # auto: bf16 where the kernels' bf16 paths loaded (an AVX2 build), fp32 where they did not
    monkeypatch.setattr(cpu_kernels, "has_bf16_kernels", lambda: True)
    assert resolve_dtype("auto", CPU) == torch.bfloat16
    monkeypatch.setattr(cpu_kernels, "has_bf16_kernels", lambda: False)
    assert resolve_dtype("auto", CPU) == torch.float32
    assert cpu_features.march_flags("avx2")[0] == "-march=x86-64-v3"
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
        RuntimeError, match="layer_backend=cpu_kernel needs the kernels' bf16 paths.*Use layer_backend auto or torch"
    ):
        LLMEngine(EngineConfig(**config, layer_backend="cpu_kernel"))


AVX2_PROBE = """
import json, torch
from loraplane_server.platforms import cpu_features
from loraplane_server.config import EngineConfig
from loraplane_server.engine.llm_engine import LLMEngine
from loraplane_server.kernels import cpu_kernels
from loraplane_server.sampling_params import SamplingParams

report = {"isa": cpu_kernels.isa(), "flags": sorted(cpu_features.cpu_flags()), "build": cpu_kernels.build_dir().name}
engine = LLMEngine(EngineConfig(model=MODEL, num_kv_blocks=32))
report.update(dtype=str(engine.dtype), layer=engine.layer_backend, attention=engine.attention_backend)
report["paths"] = engine.describe()
prompts = [[1, 2, 3, 4, 5], list(range(7, 40))]
params = SamplingParams(max_new_tokens=6, ignore_eos=True)
report["tokens"] = [out.token_ids for out in engine.generate(prompts, params)]
torch_engine = LLMEngine(EngineConfig(model=MODEL, dtype="bfloat16", num_kv_blocks=32, layer_backend="torch"))
report["torch_tokens"] = [out.token_ids for out in torch_engine.generate(prompts, params)]
print(json.dumps(report))
"""


@pytest.mark.requires_cpu_kernels
def test_an_avx2_build_runs_what_an_avx2_cpu_runs(tiny_llama_dir: Path) -> None:
    """Under LORAPLANE_CPU_ISA=avx2 (a build for x86-64-v3, this machine's own where it has no
    AVX-512): no AVX-512 flag is seen, the avx2 target loads and says so, dtype auto is bf16 with every
    layer on the kernels, and its greedy tokens are the torch layers' in the same dtype."""
    code = f"MODEL = {str(tiny_llama_dir)!r}\n{AVX2_PROBE}"
    env = {**os.environ, cpu_features.ISA_ENV: "avx2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["isa"] == "avx2" and report["build"].startswith("loraplane_cpu-avx2-")
    assert not [f for f in report["flags"] if f.startswith(("avx512", "amx"))]
    assert (report["dtype"], report["layer"], report["attention"]) == ("torch.bfloat16", "cpu_kernel", "cpu_kernel")
    assert [len(tokens) for tokens in report["tokens"]] == [6, 6]
    assert report["tokens"] == report["torch_tokens"]
    # what the start-up log line (and /v1/debug/engine) tells a user of such a machine
    assert "capped by LORAPLANE_CPU_ISA=avx2), kernels built for avx2; bfloat16;" in report["paths"]
    expected = "attention cpu_kernel, layers cpu_kernel (one call per decoder layer), LoRA cpu_kernel"
    assert report["paths"].endswith(expected), report["paths"]


@pytest.mark.requires_bf16_kernels
def test_the_engine_logs_the_paths_it_picked_at_start(tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One line at start says what runs where: the CPU and its flags, the kernels' ISA, dtype, every backend."""
    with caplog.at_level(logging.INFO, logger="loraplane.engine"):
        engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="bfloat16", num_kv_blocks=16))
    lines = [r.getMessage() for r in caplog.records if r.name == "loraplane.engine" and r.msg.startswith("engine:")]
    assert lines == [f"engine: {engine.describe()}"]  # beside it, the context line (test_architectures)
    assert cpu_features.cpu_model() in lines[0] and f"kernels built for {cpu_kernels.isa()}; bfloat16;" in lines[0]
    assert lines[0].endswith("attention cpu_kernel, layers cpu_kernel (one call per decoder layer), LoRA cpu_kernel")


@pytest.mark.requires_cpu_kernels
def test_a_prebuilt_target_is_loaded_before_the_cache_and_build_reuses_it(tmp_path: Path) -> None:
    """LORAPLANE_KERNELS_DIR (the server image's prebuilt targets) is looked in first: a process whose
    user cache is empty loads the library from there and builds nothing; the build command finds the
    target already built there."""
    cpu_kernels.load()
    prebuilt_root = tmp_path / "prebuilt"
    prebuilt_root.mkdir()
    target = cpu_features.kernel_target()
    (prebuilt_root / cpu_kernels.build_dir().name).symlink_to(cpu_kernels.build_dir())
    assert cpu_kernels.prebuilt(target) is None  # not without the variable
    env = {**os.environ, cpu_kernels.PREBUILT_ENV: str(prebuilt_root), "LORAPLANE_CACHE": str(tmp_path / "cache")}
    code = (
        "from loraplane_server.kernels import cpu_kernels as k; "
        "from loraplane_server.platforms import cpu_features as c; "
        "print(k.load(), k.isa(), k.prebuilt(c.kernel_target()))"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ok, isa, library = done.stdout.split()
    assert (ok, isa) == ("True", cpu_kernels.isa())
    assert library == str(prebuilt_root / cpu_kernels.build_dir().name / cpu_kernels.LIBRARY)
    assert not (tmp_path / "cache").exists()  # nothing built into the cache
    command = [sys.executable, "-m", "loraplane_server.kernels.cpu_kernels", "build", "--target", target]
    done = subprocess.run(
        [*command, "--into", str(prebuilt_root)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"{target}: {prebuilt_root / cpu_kernels.build_dir().name} (")
