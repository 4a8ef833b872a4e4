"""One tenant cannot harm another through adapter management, over real HTTP against `loraplane serve`
on the built-in model: pins stop one short of --max-loras (so unpinned adapters keep a slot), only admins
register new adapters once an admin token is set (unless --allow-anonymous-adapter-load), and errors shown
to clients who are not admins name no adapter sources, allowlist entries or server paths."""

from __future__ import annotations

import argparse
import functools
import http.server
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from test_http_support import ADMIN_TOKEN, ServerProcess, admin_headers, make_adapter_set

from loraplane_server.serving import cli
from loraplane_server.serving.http.server_config import ServerConfig

PROMPT = "The capital of France is"
ADAPTERS = ["a00", "a01", "a02"]
WRONG = {"Authorization": "Bearer not-the-admin-token"}


@pytest.fixture(scope="module")
def adapter_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter_set(smollm2_dir, tmp_path_factory.getbasetemp() / "tenancy-adapters", ADAPTERS)


@pytest.fixture(scope="module")
def archive_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An allowed http(s) prefix whose archives are all missing (404): loads from it fail."""
    root = tmp_path_factory.mktemp("empty-site")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{site.server_address[1]}/secret-bucket/"
    finally:
        site.shutdown()
        site.server_close()


def start_server(
    adapter_dir: Path, tmp_path_factory: pytest.TempPathFactory, args: list[str], env: dict[str, str]
) -> ServerProcess:
    log = tmp_path_factory.mktemp("http-tenancy") / "server.log"
    flags = ["--max-model-len", "256", "--num-kv-blocks", "64", "--max-loras", "2", "--adapter-dir", str(adapter_dir)]
    flags += ["--disk-cache-dir", str(tmp_path_factory.mktemp("disk-cache")), *args]
    proc = ServerProcess(flags, log, env={"HF_HUB_OFFLINE": "1", **env})
    proc.wait_ready()
    return proc


@pytest.fixture(scope="module")
def server(adapter_dir: Path, archive_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """An admin token, the default hf:// allowlist plus the archive site: anonymous loading off."""
    allow = ["--adapter-source-allow", "hf://", "--adapter-source-allow", archive_url]
    proc = start_server(adapter_dir, tmp_path_factory, ["--admin-token", ADMIN_TOKEN, *allow], {})
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def open_server(adapter_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """An admin token from the environment, and anonymous loading turned on there too."""
    env = {"LORAPLANE_ADMIN_TOKEN": ADMIN_TOKEN, "LORAPLANE_ALLOW_ANONYMOUS_ADAPTER_LOAD": "1"}
    proc = start_server(adapter_dir, tmp_path_factory, [], env)
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


def generate(
    url: str, route: str = "/generate", headers: dict[str, str] | None = None, **parameters: object
) -> httpx.Response:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, **parameters}}
    return httpx.post(f"{url}{route}", json=body, headers=headers, timeout=120)


def adapter_ids(url: str) -> set[str]:
    return {row["id"] for row in httpx.get(f"{url}/v1/adapters", headers=admin_headers()).json()["data"]}


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["generated_text"]


# pinning


@pytest.mark.slow
def test_pins_stop_one_short_of_max_loras(server: ServerProcess, adapter_dir: Path) -> None:
    """--max-loras 2: one pin; a second or third is a 409 with the reason, and unpinned adapters keep
    being served (before, both slots could be pinned and their requests hung)."""
    url, auth = server.url, admin_headers()
    pin = {"tier": "device", "pinned": True, "wait": True, "timeout_s": 120}
    r = httpx.post(f"{url}/v1/adapters", json={"id": "a00", **pin}, headers=auth, timeout=150)
    assert r.status_code == 200 and r.json()["tier"] == "device" and r.json()["pinned"], r.text
    r = httpx.post(f"{url}/v1/adapters", json={"id": "a01", **pin}, headers=auth, timeout=150)
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["code"] == "pin_limit" and error["param"] == "pinned"
    assert "(a00)" in error["message"] and "--max-loras" in error["message"] and "at most 1" in error["message"]
    third = {"id": "p3", "source": str(adapter_dir / "a02"), **pin}
    r = httpx.post(f"{url}/v1/adapters", json=third, headers=auth, timeout=150)
    assert r.status_code == 409 and r.json()["error"]["code"] == "pin_limit", r.text
    assert "p3" not in adapter_ids(url)  # refused whole: not left registered either
    assert httpx.get(f"{url}/v1/adapters/a01", headers=auth).json()["pinned"] is False
    with ThreadPoolExecutor(4) as pool:  # the unpinned ones share the one free slot, the pinned one keeps its own
        responses = list(pool.map(lambda a: generate(url, adapter_id=a), ["a01", "a02", "a00", "a01", "a02"]))
    assert [r.status_code for r in responses] == [200] * 5, [r.text for r in responses]
    row = httpx.get(f"{url}/v1/adapters/a00", headers=auth).json()
    assert row["tier"] == "device" and row["pinned"]
    r = httpx.post(f"{url}/v1/adapters", json={"id": "a00", "pinned": False}, headers=auth)
    assert r.status_code == 200 and not r.json()["pinned"]
    r = httpx.post(f"{url}/v1/adapters", json={"id": "a01", "pinned": True}, headers=auth)  # the pin is free again
    assert r.status_code == 200 and r.json()["pinned"], r.text
    assert httpx.post(f"{url}/v1/adapters", json={"id": "a01", "pinned": False}, headers=auth).status_code == 200


# registration needs the admin token


@pytest.mark.slow
def test_anonymous_clients_cannot_register_adapters(server: ServerProcess, adapter_dir: Path) -> None:
    url = server.url
    fly = {"adapter_id": "fly", "adapter_source": str(adapter_dir / "a01")}
    attempts = [
        ("/generate", fly),
        ("/generate_stream", fly),
        ("/", fly),
        ("/generate", {"adapter_id": "some-org/some-repo"}),  # LoRAX's default: the hub, allowed by default
        ("/generate", {"adapter_id": "some-org/some-repo", "adapter_source": "hub"}),
        ("/generate", {"adapter_id": str(adapter_dir / "a02"), "adapter_source": "local"}),
        ("/generate", {"adapter_id": "bucket/prefix", "adapter_source": "s3"}),
    ]
    before = adapter_ids(url)
    for headers in (None, WRONG):
        for route, parameters in attempts:
            r = generate(url, route, headers, **parameters)
            assert r.status_code == 401, (route, parameters, r.status_code, r.text)
            assert "admin token" in r.json()["error"] and r.headers["www-authenticate"] == "Bearer"
        vllm = {"lora_name": "fly", "lora_path": str(adapter_dir / "a01")}
        assert httpx.post(f"{url}/v1/load_lora_adapter", json=vllm, headers=headers).status_code == 401
        ours = {"id": "fly", "source": str(adapter_dir / "a01")}
        assert httpx.post(f"{url}/v1/adapters", json=ours, headers=headers).status_code == 401
    r = httpx.post(f"{url}/v1/completions", json={"model": "fly", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404  # the OpenAI routes name adapters, they never register one
    assert adapter_ids(url) == before, "an anonymous request registered an adapter"
    # registered adapters stay open to everyone; the admin registers new ones from any route
    expected = text_of(generate(url, adapter_id="a01"))
    assert text_of(generate(url, headers=admin_headers(), **fly)) == expected
    assert text_of(generate(url, **fly)) == expected  # now registered with that very source
    assert text_of(generate(url, adapter_id="fly")) == expected
    r = generate(url, adapter_id="fly", adapter_source=str(adapter_dir / "a02"))  # re-pointing is registering
    assert r.status_code == 401, r.text
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "fly2", "lora_path": str(adapter_dir / "a02")})
    assert r.status_code == 401
    assert adapter_ids(url) == before | {"fly"}


@pytest.mark.slow
def test_the_flag_lets_anonymous_clients_register(open_server: ServerProcess, adapter_dir: Path) -> None:
    """LORAPLANE_ALLOW_ANONYMOUS_ADAPTER_LOAD=1 restores on-the-fly registration for everyone; a refusal
    still names neither the allowlist (the server's adapter directory) nor another tenant's source."""
    url = open_server.url
    expected = text_of(generate(url, adapter_id="a01"))
    assert text_of(generate(url, adapter_id="fly", adapter_source=str(adapter_dir / "a01"))) == expected
    assert "fly" in adapter_ids(url)
    assert httpx.get(f"{url}/v1/adapters").status_code == 401  # the admin routes still need the token
    r = generate(url, adapter_id="fly", adapter_source=str(adapter_dir / "a02"))
    assert r.status_code == 409 and str(adapter_dir) not in r.text, r.text
    r = generate(url, adapter_id="evil", adapter_source="/etc/secret-adapters/x")
    assert r.status_code == 403 and str(adapter_dir) not in r.text and "--adapter-source-allow" in r.text, r.text
    r = generate(url, headers=admin_headers(), adapter_id="evil", adapter_source="/etc/secret-adapters/x")
    assert r.status_code == 403 and str(adapter_dir) in r.text  # an admin sees the allowlist


def test_the_flag_is_off_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    def config(argv: list[str]) -> ServerConfig:
        parser = argparse.ArgumentParser()
        cli._engine_args(parser)
        cli._serve_args(parser)
        return cli._server_config(parser.parse_args(argv))

    monkeypatch.delenv("LORAPLANE_ALLOW_ANONYMOUS_ADAPTER_LOAD", raising=False)
    assert config([]).allow_anonymous_adapter_load is False
    assert config(["--allow-anonymous-adapter-load"]).allow_anonymous_adapter_load is True
    monkeypatch.setenv("LORAPLANE_ALLOW_ANONYMOUS_ADAPTER_LOAD", "1")
    assert config([]).allow_anonymous_adapter_load is True


# errors to anonymous clients


@pytest.mark.slow
def test_errors_to_anonymous_clients_name_no_sources_or_paths(
    server: ServerProcess, adapter_dir: Path, archive_url: str
) -> None:
    url, auth = server.url, admin_headers()
    (adapter_dir / "empty-dir").mkdir(exist_ok=True)  # exists (a missing one is refused at registration)
    sources = {"gone": str(adapter_dir / "empty-dir"), "remote": f"{archive_url}tenant-x.tar.gz"}
    for adapter_id, source in sources.items():  # both allowed, both fail to load
        r = httpx.post(f"{url}/v1/adapters", json={"id": adapter_id, "source": source, "wait": True}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["code"] == "adapter_load_failed", r.text
    missing = httpx.post(
        f"{url}/v1/adapters", json={"id": "nowhere", "source": str(adapter_dir / "gone")}, headers=auth
    )
    assert missing.status_code == 400 and missing.json()["error"]["code"] == "adapter_source_missing", missing.text
    assert httpx.get(f"{url}/v1/adapters/nowhere", headers=auth).status_code == 404  # refused, not registered
    secrets = [str(adapter_dir), "empty-dir", "secret-bucket", archive_url.split("/")[2]]
    for adapter_id in sources:
        answers = [
            generate(url, adapter_id=adapter_id),
            generate(url, "/generate_stream", adapter_id=adapter_id),
            httpx.post(f"{url}/v1/completions", json={"model": adapter_id, "prompt": PROMPT, "max_tokens": 2}),
            httpx.post(
                f"{url}/v1/chat/completions",
                json={"model": adapter_id, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            ),
        ]
        for r in answers:
            assert r.status_code == 400, r.text
            assert f"GET /v1/adapters/{adapter_id}" in r.text and "failed to load" in r.text
            assert not [s for s in secrets if s in r.text], r.text
        row = httpx.get(f"{url}/v1/adapters/{adapter_id}", headers=auth).json()  # admins keep the reason
        assert row["state"] == "failed" and row["last_error"] and row["source"] == sources[adapter_id]
    r = generate(url, adapter_id="evil", adapter_source="/etc/secret-adapters/x")
    assert r.status_code == 401 and str(adapter_dir) not in r.text and "secret-adapters" not in r.text, r.text
