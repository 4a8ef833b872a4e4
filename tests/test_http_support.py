"""Shared by the tests/test_http_*.py modules (no tests here): a real `loraplane serve` subprocess on
127.0.0.1, and a set of real PEFT adapters for the built-in model."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save_file

from lora_helpers import make_peft_adapter

ADMIN_TOKEN = "test-admin-token-0123"
REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# every test server: float32 (batch-invariant greedy outputs), one intra-op thread (a shared 2-core machine)
COMMON_FLAGS = ["--dtype", "float32", "--torch-threads", "1", "--log-level", "warning"]


# how long one start-up step may run before a test server counts as stuck: a machine's first kernel
# build takes minutes on a busy 2-core machine; any other step takes seconds when all is well
STEP_BUDGET_S = {"building the CPU kernels": 1800.0}
DEFAULT_STEP_BUDGET_S = 300.0


class ServerProcess:
    """`python -m loraplane_server.serving.cli serve ...` on a free port; output goes to a log file."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [
            sys.executable,
            "-m",
            "loraplane_server.serving.cli",
            "serve",
            "--port",
            str(self.port),
            *COMMON_FLAGS,
            *args,
        ]
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **(env or {})}
        )

    def wait_ready(self) -> None:
        """Polls /ready until 200, waiting on progress rather than a fixed time: each start-up step the
        server reports (/ready's `step`) has its own budget from when it began. A process that exits,
        or a step that overruns its budget, kills the server and raises with its log."""
        step, since = "", time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} while {step!r}:\n{self.log()}")
            try:
                response = httpx.get(f"{self.url}/ready", timeout=5)
                if response.status_code == 200:
                    return
                now = str(response.json().get("step", "starting"))
            except (httpx.HTTPError, ValueError):
                now = "starting the process"  # not listening yet: imports, argument checks
            if now != step:
                step, since = now, time.monotonic()
            budget = STEP_BUDGET_S.get(step, DEFAULT_STEP_BUDGET_S)
            if time.monotonic() - since > budget:
                self.proc.kill()
                self.proc.wait()
                raise TimeoutError(f"server stuck in start-up step {step!r} for over {budget:.0f} s:\n{self.log()}")
            time.sleep(0.25)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def engine_state(url: str) -> dict:
    """The server's admin debug view of its engine: requests, streams, KV blocks, slots, queues."""
    r = httpx.get(f"{url}/v1/debug/engine", headers=admin_headers(), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(url: str, timeout: float = 30.0) -> dict:
    """engine_state once no request, stream or HTTP call is in flight (or at the timeout, as it is then)."""
    deadline = time.monotonic() + timeout
    while True:
        state = engine_state(url)
        idle = state["num_requests"] == 0 and state["num_streams"] == 0 and state["num_http_inflight"] == 0
        if idle or time.monotonic() > deadline:
            return state
        time.sleep(0.1)


def make_adapter_set(base_dir: Path, root: Path, names: list[str]) -> Path:
    """Real PEFT adapters in root/<name>: one made by PEFT itself, the others the same modules with
    lora_B re-drawn from another seed (same config, so each is a valid, distinct PEFT adapter).
    Cached in root across test modules of one session."""
    done = root / ".complete.json"
    if done.is_file() and set(json.loads(done.read_text())) >= set(names):
        return root
    root.mkdir(parents=True, exist_ok=True)
    template = root.parent / f"{root.name}.template"  # outside root: --adapter-dir serves every subdirectory
    if not (template / "adapter_model.safetensors").is_file():
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        make_peft_adapter(base_dir, template, seed=0, r=8, lora_alpha=16, target_modules=targets)
    tensors = load_file(str(template / "adapter_model.safetensors"))
    for i, name in enumerate(names):
        out = root / name
        if (out / "adapter_model.safetensors").is_file():
            continue
        gen = torch.Generator().manual_seed(1000 + i)
        redrawn = {
            k: (torch.randn(v.shape, generator=gen) * v.float().std()).to(v.dtype) if "lora_B" in k else v
            for k, v in tensors.items()
        }
        out.mkdir(exist_ok=True)
        shutil.copy(template / "adapter_config.json", out / "adapter_config.json")
        save_file(redrawn, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    done.write_text(json.dumps(names))
    return root
