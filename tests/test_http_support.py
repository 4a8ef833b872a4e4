"""Shared by the tests/test_http_*.py modules (no tests here): a real `loraplane serve` subprocess on
127.0.0.1, a set of real PEFT adapters for the built-in model, and an in-process app whose engine only
records what it is handed (`recording_app`: what an HTTP request becomes, checked without running a model)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from lora_helpers import make_peft_adapter
from loraplane_server.config import EngineConfig
from loraplane_server.engine.block_manager import BlockManager
from loraplane_server.engine.input_processor import CheckedPrompt, InputProcessor
from loraplane_server.executor.structured import Grammars
from loraplane_server.request_output import RequestOutput
from loraplane_server.sampling_params import SamplingParams
from loraplane_server.serving.http.app import create_app
from loraplane_server.serving.http.server_config import ServerConfig
from loraplane_server.spec.speculator import Speculator

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

    def __init__(
        self, args: list[str], log_path: Path, env: dict[str, str] | None = None, port: int | None = None
    ) -> None:
        self.port = free_port() if port is None else port
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


# in process: a recording engine
@dataclass
class Recorded:
    """One request as the engine received it."""

    prompt_ids: list[int]
    params: SamplingParams
    adapter_id: str | None


class RecordingEngine:
    """What the HTTP routes use of an LLMEngine and its AsyncEngine, with a real tokenizer and input processor;
    every request is recorded and answered at once with one token (`answer`, finish reason "length")."""

    def __init__(self, tokenizer: Any, model_dir: Path, max_model_len: int = 512) -> None:
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        self.eos_token_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        self.inputs = InputProcessor(
            tokenizer,
            model_dir,
            max_model_len,
            len(tokenizer),
            BlockManager(1024, 16, False),
            Speculator(EngineConfig(), max_model_len).method,
            Grammars(tokenizer, len(tokenizer), self.eos_token_ids),  # the routes compile a constraint ahead
        )
        self.answer = tokenizer.encode("ok", add_special_tokens=False)[0]
        self.recorded: list[Recorded] = []

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    async def generate(
        self,
        prompt: str | list[int] | CheckedPrompt,
        params: SamplingParams,
        request_id: str | None = None,
        adapter_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        # the constraint is recorded, not compiled: what the HTTP layer hands the engine is checked here, and
        # compiling it is the engine's (tests/test_structured.py)
        checked = self.inputs.process(prompt, dataclasses.replace(params, structured=None))
        self.recorded.append(Recorded(checked.token_ids, params, adapter_id))
        token = self.answer
        # top logprobs: the answer, then the next token ids, each half as likely
        top = [(token + i, -0.5 - i * 0.693) for i in range(params.top_logprobs)]
        yield RequestOutput(
            request_id or "r",
            checked.token_ids,
            [token],
            self.decode([token]),
            finished=True,
            finish_reason="length",
            delta_logprobs=[-0.5],
            token_ids=[token],
            text=self.decode([token]),
            logprobs=[-0.5],
            delta_top_logprobs=[top] if top else [],
            top_logprobs=[top] if top else [],
        )

    def abort(self, request_id: str) -> None:
        pass

    def shutdown(self) -> None:
        pass


@dataclass
class RecordingApp:
    client: TestClient
    engine: RecordingEngine
    model: str = "base"
    extra: dict[str, Any] = field(default_factory=dict)

    def last(self) -> Recorded:
        return self.engine.recorded[-1]


def recording_app(tokenizer: Any, model_dir: Path, max_model_len: int = 512) -> RecordingApp:
    """The real app (routes, validation, error handlers) on a RecordingEngine, ready at once; the served model's
    name is "base". No lifespan runs: nothing loads."""
    app = create_app(ServerConfig(engine=EngineConfig(model=str(model_dir)), served_model_name="base"))
    engine = RecordingEngine(tokenizer, model_dir, max_model_len)
    state = app.state.server
    state.engine = engine
    state.front = engine
    state.special_ids = frozenset(tokenizer.all_special_ids)
    state.lifecycle.mark_ready()
    return RecordingApp(TestClient(app), engine)
