"""`loraplane serve` and the device: a refused --device or GPU option ends the start with its one-line reason (what
a pod's termination message, and so BaseModelServer status.model, carries), and /v1/debug/engine reports the
device and every backend chosen."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from test_http_support import REPO, ServerProcess, admin_headers

from loraplane_server.platforms import cpu_features
from loraplane_server.platforms.device import cuda_unusable_reason

HAS_CUDA = cuda_unusable_reason() is None


def _serve_fails(args: list[str], tmp_path: Path) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "loraplane_server.serving.cli", "serve", "--port", "0", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.returncode, proc.stderr.strip().splitlines()[-1]


@pytest.mark.skipif(HAS_CUDA, reason="a machine without a usable CUDA device")
def test_serve_on_cuda_without_a_gpu_fails_its_start_with_the_reason(tmp_path: Path) -> None:
    """A pod given --device cuda (the operator's choice for a GPU pod) that cannot use CUDA ends with the
    one-line reason its termination message (and so BaseModelServer status.model) carries: no CPU fallback."""
    code, last = _serve_fails(["--device", "cuda", "--model", "smollm2-135m"], tmp_path)
    assert code == 1
    assert last == f"loraplane: failed to start: --device cuda: {cuda_unusable_reason()}"


def test_serve_refuses_gpu_options_on_the_cpu(tmp_path: Path) -> None:
    code, last = _serve_fails(["--device", "cpu", "--gpu-memory-utilization", "0.5"], tmp_path)
    assert code == 1
    assert (
        last
        == "loraplane: failed to start: --gpu-memory-utilization applies to CUDA devices; this engine runs on the cpu"
    )


def test_serve_refuses_a_bad_device_name() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "loraplane_server.serving.cli", "serve", "--device", "gpu0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "device='gpu0': expected auto, cpu, cuda or cuda:N" in proc.stderr


def test_debug_engine_reports_the_device_and_backends(smollm2_dir: Path, tmp_path: Path) -> None:
    server = ServerProcess(
        ["--model", str(smollm2_dir), "--device", "cpu", "--admin-token", "test-admin-token-0123"],
        tmp_path / "server.log",
    )
    try:
        server.wait_ready()
        state = httpx.get(f"{server.url}/v1/debug/engine", headers=admin_headers(), timeout=30).json()
    finally:
        server.stop()
    assert state["device"]["device"] == "cpu"
    assert state["device"]["name"] == cpu_features.describe()
    assert state["device"]["total_memory_bytes"] is None
    assert state["dtype"] == "float32"
    assert set(state["backends"]) == {"attention", "layers", "lora", "fuse_layers"}
    assert state["backends"]["lora"] in ("torch", "cpu_kernel")
    assert state["memory_plan"] is None  # the CPU's KV cache is --kv-cache-gib's
    assert state["paths"].startswith(cpu_features.describe())
