"""Hostile and heavy use of a real server: property-based fuzzing of every route in /openapi.json,
backpressure (429), limits (400, 413), validation (422), auth (401), the source allowlist (403),
path-escaping ids, and a graceful SIGTERM (runs last: it stops this module's server)."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from hypothesis.strategies import SearchStrategy
from schemathesis import GenerationMode
from test_http_support import ADMIN_TOKEN, ServerProcess, admin_headers, make_adapter_set

from loraplane_server.platforms import cpu_features

pytestmark = pytest.mark.slow
CONTEXT = 32
BODY_LIMIT = 64 * 1024
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def adapter_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter_set(smollm2_dir, tmp_path_factory.getbasetemp() / "http-adapters", ["a00", "a01"])


@pytest.fixture(scope="module")
def server(adapter_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    log = tmp_path_factory.mktemp("http-hardening") / "server.log"
    flags = f"--max-model-len {CONTEXT} --num-kv-blocks 32 --max-loras 1 --max-num-seqs 2 --max-queue 2"
    args = [*flags.split(), "--max-body-bytes", str(BODY_LIMIT), "--shutdown-grace", "120"]
    args += ["--adapter-dir", str(adapter_dir), "--admin-token", ADMIN_TOKEN]
    args += ["--disk-cache-dir", str(tmp_path_factory.mktemp("disk-cache"))]
    proc = ServerProcess(args, log, env={"HF_HUB_OFFLINE": "1"})
    proc.wait_ready()  # on failure it kills the server and raises with its log
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


def generate(
    url: str, prompt: str = PROMPT, headers: dict[str, str] | None = None, **parameters: object
) -> httpx.Response:
    return httpx.post(
        f"{url}/generate", json={"inputs": prompt, "parameters": parameters}, headers=headers, timeout=120
    )


def _bounded(case: schemathesis.Case) -> schemathesis.Case:
    """At most 4 new tokens per generated generation request, so the fuzzing stays cheap on a CPU."""
    body = case.body
    if not isinstance(body, dict):
        return case
    if case.operation.path in ("/", "/generate", "/generate_stream"):
        if not isinstance(body.get("parameters"), dict):
            body["parameters"] = {}
        body, keys = body["parameters"], ["max_new_tokens"]
    elif case.operation.path in ("/v1/completions", "/v1/chat/completions"):
        keys = ["max_tokens", "max_completion_tokens"] if "max_completion_tokens" in body else ["max_tokens"]
    else:
        return case
    for key in keys:
        value = body.get(key, 4)
        if isinstance(value, int) and not isinstance(value, bool):
            body[key] = min(value, 4)  # an invalid value (negative testing) stays as it is
    return case


def fuzz_operation(
    op: schemathesis.APIOperation,
    url: str,
    seen: dict[str, set[int]],
    headers: dict[str, str] | None = None,
    examples: tuple[int, int] = (20, 10),
    mutate: Callable[[schemathesis.Case], SearchStrategy[schemathesis.Case]] | None = None,
) -> None:
    """Generated requests to one operation (with the admin token unless `headers` say otherwise), `examples`
    valid ones and invalid ones, each optionally drawn through `mutate`: never a 5xx."""
    label = f"{op.method.upper()} {op.path}"
    headers = admin_headers() if headers is None else headers
    for mode, num_examples in zip((GenerationMode.POSITIVE, GenerationMode.NEGATIVE), examples, strict=True):
        cases = op.as_strategy(generation_mode=mode).map(_bounded)

        @given(case=cases if mutate is None else cases.flatmap(mutate))
        @settings(max_examples=num_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def check(case: schemathesis.Case) -> None:
            response = case.call(base_url=url, headers=headers, timeout=120)
            seen.setdefault(label, set()).add(response.status_code)
            assert response.status_code < 500, f"{label}: {response.status_code} {response.text[:500]}"

        try:
            check()
        except Unsatisfiable:
            assert mode == GenerationMode.NEGATIVE  # nothing invalid to send (no body, no parameters)


def test_fuzz_every_route(server: ServerProcess) -> None:
    before = generate(server.url, max_new_tokens=6, adapter_id="a01")
    assert before.status_code == 200
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15
    seen: dict[str, set[int]] = {}
    for op in operations:
        fuzz_operation(op, server.url, seen)
    assert set(seen) == {f"{op.method.upper()} {op.path}" for op in operations}
    assert any(200 in codes for codes in seen.values()) and any(422 in codes for codes in seen.values())
    # still healthy, and still right
    assert httpx.get(f"{server.url}/ready").status_code == 200
    after = generate(server.url, max_new_tokens=6, adapter_id="a01")
    assert after.status_code == 200 and after.json() == before.json()
    state = httpx.get(f"{server.url}/v1/debug/engine", headers=admin_headers()).json()
    assert state["num_requests"] == 0 and state["num_free_blocks"] == state["num_blocks"]
    assert cpu_features.cpu_model() in state["paths"] and "; float32; attention " in state["paths"]  # fp32 server


def test_queue_full_gets_429_with_retry_after(server: ServerProcess) -> None:
    results: list[httpx.Response] = []

    def send(i: int) -> None:
        results.append(generate(server.url, f"Count to ten, try {i}:", max_new_tokens=24))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in results)
    assert set(codes) == {200, 429}, codes
    refused = next(r for r in results if r.status_code == 429)
    assert refused.headers["retry-after"] == "1" and refused.json()["error_type"] == "overloaded"
    assert "--max-queue 2" in refused.json()["error"]


def test_over_long_prompt_gets_400_with_the_limits(server: ServerProcess) -> None:
    r = generate(server.url, "hello " * 100, max_new_tokens=4)
    assert r.status_code == 400 and f"context is {CONTEXT} tokens" in r.json()["error"]
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "smollm2-135m", "prompt": PROMPT, "max_tokens": 80})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert str(CONTEXT) in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body", "code"),
    [  # cases the fuzzer found answering 500 (a ValueError, an OverflowError)
        ("/v1/completions", {"model": "smollm2-135m", "prompt": [-1], "max_tokens": 4}, "invalid_token_id"),
        (
            "/v1/completions",
            {"model": "smollm2-135m", "prompt": [[1, 2], [10**9]], "max_tokens": 4},
            "invalid_token_id",
        ),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "\x00"}, "invalid_adapter_source"),
        ("/v1/adapters", {"id": "x", "source": "/tmp/a\x00b"}, "invalid_adapter_source"),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "~0"}, "invalid_adapter_source"),
    ],
)
def test_hostile_values_get_400_and_the_server_keeps_serving(
    server: ServerProcess, path: str, body: dict, code: str
) -> None:
    r = httpx.post(f"{server.url}{path}", json=body, headers=admin_headers(), timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == code
    assert generate(server.url, max_new_tokens=2).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/generate", {"inputs": PROMPT, "parameters": {"temperature": -1}}, "parameters.temperature"),
        ("/generate", {"inputs": PROMPT, "parameters": {"top_p": 1.5}}, "parameters.top_p"),
        ("/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 0}}, "parameters.max_new_tokens"),
        ("/generate", {"inputs": ""}, "inputs"),
        ("/v1/completions", {"model": "smollm2-135m", "prompt": PROMPT, "temperature": 3}, "temperature"),
        ("/v1/completions", {"model": "smollm2-135m", "prompt": PROMPT, "n": 0}, "n"),
        ("/v1/completions", {"model": "smollm2-135m", "prompt": PROMPT, "stop": [""]}, "stop"),
        ("/v1/chat/completions", {"model": "smollm2-135m", "messages": [], "max_tokens": 4}, "messages"),
        (
            "/v1/chat/completions",
            {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 2.5},
            "presence_penalty",
        ),
    ],
)
def test_out_of_range_gets_422_naming_the_field(server: ServerProcess, path: str, body: dict, field: str) -> None:
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    if path == "/generate":
        assert field in error and r.json()["error_type"] == "validation"
    else:
        assert error["param"] == field and field in error["message"]


def test_admin_routes_need_the_token(server: ServerProcess, adapter_dir: Path) -> None:
    url = server.url
    calls = [
        ("POST", "/v1/adapters", {"id": "x1", "source": str(adapter_dir / "a00")}),
        ("DELETE", "/v1/adapters/a00", None),
        ("POST", "/v1/load_lora_adapter", {"lora_name": "x1", "lora_path": str(adapter_dir / "a00")}),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "a00"}),
        ("GET", "/v1/debug/engine", None),
        ("GET", "/v1/adapters", None),
        ("GET", "/v1/adapters/a00", None),
    ]
    for headers in ({}, {"Authorization": "Bearer wrong-token-123"}, {"Authorization": ADMIN_TOKEN}):
        for method, path, body in calls:
            r = httpx.request(method, f"{url}{path}", json=body, headers=headers)
            assert r.status_code == 401, (method, path, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
    rows = httpx.get(f"{url}/v1/adapters", headers=admin_headers()).json()["data"]
    assert "a00" in [row["id"] for row in rows]  # nothing changed
    assert httpx.get(f"{url}/v1/debug/engine", headers=admin_headers()).status_code == 200


def test_sources_outside_the_allowlist_get_403(server: ServerProcess, tmp_path: Path, adapter_dir: Path) -> None:
    outside = tmp_path / "evil"
    outside.mkdir()
    for f in (adapter_dir / "a00").iterdir():
        (outside / f.name).write_bytes(f.read_bytes())
    auth, url = admin_headers(), server.url
    for source in (
        str(outside),
        "/etc",
        "s3://bucket/adapter",
        "https://example.com/a.tar.gz",
        f"{adapter_dir}/../{adapter_dir.name}-x",
    ):
        r = httpx.post(f"{url}/v1/adapters", json={"id": "evil", "source": source}, headers=auth)
        assert r.status_code in (403,), (source, r.text)
        assert r.json()["error"]["code"] == "source_not_allowed"
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "evil", "lora_path": str(outside)}, headers=auth)
    assert r.status_code == 403
    r = generate(url, max_new_tokens=2, adapter_id="evil", adapter_source=str(outside), headers=auth)
    assert r.status_code == 403 and r.json()["error_type"] == "validation"
    r = generate(url, max_new_tokens=2, adapter_id=str(outside), adapter_source="local", headers=auth)
    assert r.status_code == 403
    assert "evil" not in [row["id"] for row in httpx.get(f"{url}/v1/adapters", headers=auth).json()["data"]]


def test_huge_bodies_get_413(server: ServerProcess) -> None:
    big = {"inputs": "x" * (BODY_LIMIT + 1)}
    r = httpx.post(f"{server.url}/generate", json=big)
    assert r.status_code == 413 and str(BODY_LIMIT) in r.json()["error"]

    def chunks():  # no Content-Length: the limit applies while reading
        yield b'{"model": "smollm2-135m", "prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 1):
            yield b"y" * 1024
        yield b'"}'

    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_ids_that_could_escape_a_directory_are_refused(server: ServerProcess, adapter_dir: Path) -> None:
    url, auth = server.url, admin_headers()
    source = str(adapter_dir / "a00")
    assert httpx.post(f"{url}/v1/adapters", json={"id": "../a00", "source": source}, headers=auth).status_code == 422
    assert httpx.post(f"{url}/v1/adapters", json={"id": "a..b", "source": source}, headers=auth).status_code == 400
    assert httpx.post(f"{url}/v1/adapters", json={"id": "/abs", "source": source}, headers=auth).status_code == 422
    assert httpx.delete(f"{url}/v1/adapters/a..b", headers=auth).status_code == 400
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "../x", "lora_path": source}, headers=auth)
    assert r.status_code == 400
    r = httpx.post(f"{url}/v1/completions", json={"model": "../a00", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_adapter_id"
    for adapter_id, adapter_source in (("../a00", None), ("org/../../etc", "hub"), ("a/../../x", None)):
        r = generate(url, max_new_tokens=2, adapter_id=adapter_id, adapter_source=adapter_source)
        assert r.status_code == 400, (adapter_id, r.text)


def test_sigterm_drains_in_flight_requests_then_exits_0(server: ServerProcess) -> None:
    """Last in this module: it stops the server."""
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 24, "ignore_eos_token": True}}
    events = []
    with httpx.Client(base_url=server.url, timeout=120) as client:
        with client.stream("POST", "/generate_stream", json=body) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data:"):
                    events.append(json.loads(line[5:]))
                    break
            server.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while httpx.get(f"{server.url}/ready").status_code != 503:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            refused = generate(server.url, max_new_tokens=2)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert server.proc.poll() is None  # still draining
            events += [json.loads(line[5:]) for line in lines if line.startswith("data:")]
    assert len(events) == 24 and events[-1]["details"]["finish_reason"] == "length"
    assert server.proc.wait(60) == 0
