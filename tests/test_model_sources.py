"""Issue 19's acceptance for the server: real `loraplane serve` processes whose --model is s3:// (on MinIO),
a GGUF file, or a source that cannot be used; the built-in model answers the same, token for token."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from s3_server import MinioServer, minio_server  # noqa: F401 - the session fixture
from test_http_support import COMMON_FLAGS, REPO, ServerProcess, free_port

from loraplane_server.store.builtin import find_gguf

pytestmark = pytest.mark.slow

ADAPTERS = REPO / "server" / "examples" / "adapters"
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]


def answers(url: str) -> list[dict]:
    """Greedy answers (text and token ids) for every prompt, on the base model and the french adapter, through
    the LoRAX route and the OpenAI one."""
    out = []
    for prompt in PROMPTS:
        for adapter in (None, "french"):
            params = {"max_new_tokens": 16, "details": True, **({"adapter_id": adapter} if adapter else {})}
            r = httpx.post(f"{url}/generate", json={"inputs": prompt, "parameters": params}, timeout=120)
            assert r.status_code == 200, r.text
            body = r.json()
            out.append({"text": body["generated_text"], "ids": [t["id"] for t in body["details"]["tokens"]]})
        r = httpx.post(
            f"{url}/v1/completions",
            json={"model": "french", "prompt": prompt, "max_tokens": 16, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        out.append({"text": r.json()["choices"][0]["text"]})
    return out


@pytest.fixture(scope="module")
def builtin_answers(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    log = tmp_path_factory.mktemp("builtin") / "server.log"
    server = ServerProcess(["--model", "smollm2-135m", "--adapter-dir", str(ADAPTERS)], log)
    try:
        server.wait_ready()
        return answers(server.url)
    finally:
        server.stop()


def ready_bodies_until_ready(server: ServerProcess, timeout_s: float = 600) -> list[dict]:
    """Every /ready body from start to 200 (polled every 20 ms)."""
    bodies, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, server.log()
        try:
            r = httpx.get(f"{server.url}/ready", timeout=5)
            bodies.append(r.json())
            if r.status_code == 200:
                return bodies
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    raise TimeoutError(server.log())


def test_s3_model_answers_as_the_builtin_token_for_token(
    minio_server: MinioServer,  # noqa: F811
    smollm2_dir: Path,
    builtin_answers: list[dict],
    tmp_path: Path,
) -> None:
    minio_server.upload_dir(smollm2_dir, "models", "smollm2")
    total = sum(p.stat().st_size for p in smollm2_dir.iterdir() if p.is_file())
    gets = minio_server.get_object_count()
    env = {**minio_server.env(), "LORAPLANE_TEST_DOWNLOAD_DELAY_S": "0.01"}  # ~5 s: /ready is seen downloading
    args = ["--model", "s3://models/smollm2", "--model-cache", str(tmp_path / "cache"), "--adapter-dir", str(ADAPTERS)]
    server = ServerProcess(args, tmp_path / "server.log", env=env)
    try:
        bodies = ready_bodies_until_ready(server)
        downloading = [b["model"] for b in bodies if b.get("model", {}).get("phase") == "downloading"]
        assert downloading, bodies[:5]
        assert all(m["source"] == "s3://models/smollm2" for m in downloading)
        # the total is unknown (null) only while the prefix is listed, before any byte
        assert all(m["bytes_total"] in (total, None) for m in downloading)
        assert all(m["bytes_done"] == 0 for m in downloading if m["bytes_total"] is None)
        assert 0 < downloading[len(downloading) // 2]["bytes_done"] < total
        assert bodies[-1]["model"] == {"source": "s3://models/smollm2", "phase": "ready", "bytes_done": total,
                                       "bytes_total": total}  # fmt: skip
        assert minio_server.get_object_count() - gets == len([p for p in smollm2_dir.iterdir() if p.is_file()])
        assert answers(server.url) == builtin_answers
    finally:
        server.stop()


def test_a_draft_from_s3_reports_its_own_download(
    minio_server: MinioServer,  # noqa: F811
    smollm2_dir: Path,
    tmp_path: Path,
) -> None:
    """--draft-model s3://...: /ready's draft_model is the draft's own progress (pending while the model's files
    are resolved, then its download's bytes); the model's report never shows the draft's bytes or restarts."""
    minio_server.upload_dir(smollm2_dir, "models", "draft")
    total = sum(p.stat().st_size for p in smollm2_dir.iterdir() if p.is_file())
    env = {**minio_server.env(), "LORAPLANE_TEST_DOWNLOAD_DELAY_S": "0.01"}  # ~5 s: /ready is seen downloading
    args = ["--speculative", "draft", "--draft-model", "s3://models/draft", "--model-cache", str(tmp_path / "cache")]
    server = ServerProcess(args, tmp_path / "server.log", env=env)
    try:
        bodies = ready_bodies_until_ready(server)
        models = [b["model"] for b in bodies if "model" in b]
        drafts = [b["draft_model"] for b in bodies if "draft_model" in b]
        assert len(models) == len(drafts) > 0, bodies[:3]
        assert {m["source"] for m in models} == {"smollm2-135m"} and {d["source"] for d in drafts} == {
            "s3://models/draft"
        }
        assert "downloading" not in {m["phase"] for m in models}  # the built-in model is converted, not fetched
        phases = [d["phase"] for d in drafts]
        assert phases[0] == "pending" and phases[-1] == "ready", phases
        downloading = [d for d in drafts if d["phase"] == "downloading"]
        assert downloading and 0 < downloading[len(downloading) // 2]["bytes_done"] < total
        # the draft starts only once the model's files are in place
        first = next(i for i, d in enumerate(drafts) if d["phase"] != "pending")
        assert models[first]["phase"] == "loading", models[first]
        assert bodies[-1]["draft_model"] == {"source": "s3://models/draft", "phase": "ready", "bytes_done": total,
                                             "bytes_total": total}  # fmt: skip
        r = httpx.post(
            f"{server.url}/generate",
            json={"inputs": "1, 2, 3, 4,", "parameters": {"max_new_tokens": 8, "speculative": "draft"}},
            timeout=120,
        )
        assert r.status_code == 200 and r.json()["generated_text"], r.text
    finally:
        server.stop()


def test_gguf_file_answers_as_the_builtin(builtin_answers: list[dict], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    args = ["--model", str(find_gguf("smollm2-135m")), "--model-cache", str(cache), "--adapter-dir", str(ADAPTERS)]
    server = ServerProcess(args, tmp_path / "server.log")
    try:
        phases = {b.get("model", {}).get("phase") for b in ready_bodies_until_ready(server)}
        assert "converting" in phases
        assert len(list((cache / "gguf").glob("SmolLM2-135M-Instruct.Q4_1-*/model.safetensors"))) == 1
        assert answers(server.url) == builtin_answers
    finally:
        server.stop()


def failed_start(args: list[str], env: dict[str, str], tmp_path: Path) -> tuple[list[dict], str, int]:
    """A server that must fail to start: the /ready bodies it answered, its stderr, its exit status."""
    port = free_port()
    cmd = [sys.executable, "-m", "loraplane_server.serving.cli", "serve", "--port", str(port), *COMMON_FLAGS, *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "HF_"))} | env
    with open(tmp_path / "stderr.log", "w+") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
        bodies = []
        while proc.poll() is None:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2)
                bodies.append({"status_code": r.status_code, **r.json()})
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        err.seek(0)
        return bodies, err.read(), proc.returncode


@pytest.mark.parametrize(
    ("model", "extra_env", "reason"),
    [
        ("s3://models/smollm2", {}, "s3://models/smollm2: not in the model cache"),
        ("hf://org/model", {"HF_HUB_OFFLINE": "1"}, "hf://org/model: not in the model cache"),
        ("s3://models/does-not-exist", {"ONLINE": "1"}, "s3://models/does-not-exist: no objects under this prefix"),
    ],
)
def test_a_model_that_cannot_be_had_fails_clearly(
    minio_server: MinioServer,  # noqa: F811
    tmp_path: Path,
    model: str,
    extra_env: dict[str, str],
    reason: str,
) -> None:
    online = extra_env.pop("ONLINE", None) is not None
    s3 = minio_server.client()
    if "models" not in [b["Name"] for b in s3.list_buckets()["Buckets"]]:
        s3.create_bucket(Bucket="models")
    args = ["--model", model, "--model-cache", str(tmp_path / "empty-cache")] + ([] if online else ["--offline"])
    if "HF_HUB_OFFLINE" in extra_env:
        args.remove("--offline")  # the environment alone makes it offline
    bodies, stderr, status = failed_start(args, {**minio_server.env(), **extra_env}, tmp_path)
    assert status == 1, stderr
    last = stderr.rstrip("\n").splitlines()[-1]
    assert last.startswith(f"loraplane: failed to start: {reason}"), stderr[-3000:]
    failed = [b for b in bodies if b.get("status") == "failed"]
    assert failed and failed[-1] == {"status_code": 503, "status": "failed", "error": last.split(": ", 2)[2]}
    assert "Traceback" not in stderr
    assert minio_server.secret_key not in stderr and minio_server.secret_key not in str(bodies)
