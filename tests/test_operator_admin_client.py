"""The operator's admin API client against a real HTTP server on 127.0.0.1 (a scripted stand-in for a
server pod's /v1/adapters routes: it tests our client, not the product)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loraplane_operator.admin_client import (
    AdminClient,
    PermanentAdminError,
    RetryableAdminError,
    is_permanent_status,
    make_http_client,
)

ROW = {"id": "french", "source": "/opt/a/french", "state": "loading", "tier": "disk", "rank": 8, "size_bytes": 10}


class Pod:
    """Scripted answers by (method, path); every request recorded."""

    def __init__(self) -> None:
        self.answers: dict[tuple[str, str], tuple[int, object, dict]] = {}
        self.requests: list[dict] = []

    def answer(self, method: str, path: str, status: int, body: object, headers: dict | None = None) -> None:
        self.answers[(method, path)] = (status, body, headers or {})


@pytest.fixture
def pod():
    state = Pod()

    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(length) if length else b""
            state.requests.append(
                {
                    "method": self.command,
                    "path": self.path,
                    "auth": self.headers.get("authorization"),
                    "body": json.loads(raw) if raw else None,
                }
            )
            status, body, headers = state.answers.get((self.command, self.path), (404, {"detail": "no route"}, {}))
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "text/plain" if isinstance(body, str) else "application/json")
            self.send_header("content-length", str(len(data)))
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = _serve

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield state
    server.shutdown()
    server.server_close()


def call(url: str, token: str | None, method: str, *args):
    async def go():
        async with make_http_client(timeout_s=5.0) as http:
            return await getattr(AdminClient(http, url, token), method)(*args)

    return asyncio.run(go())


def test_list_adapters_sends_the_bearer_token(pod):
    pod.answer("GET", "/v1/adapters", 200, {"object": "list", "data": [ROW]})
    assert call(pod.url, "s3cret", "list_adapters") == [ROW]
    assert pod.requests[-1]["auth"] == "Bearer s3cret"


def test_no_token_no_header(pod):
    pod.answer("GET", "/v1/adapters", 200, {"object": "list", "data": []})
    assert call(pod.url, None, "list_adapters") == []
    assert pod.requests[-1]["auth"] is None


def test_prewarm_posts_the_body_and_returns_the_row(pod):
    pod.answer("POST", "/v1/adapters", 200, ROW)
    assert call(pod.url, "t", "prewarm", "french", "/opt/a/french", "device", True) == ROW
    req = pod.requests[-1]
    assert req["body"] == {"id": "french", "source": "/opt/a/french", "tier": "device", "pinned": True}
    assert req["auth"] == "Bearer t"
    call(pod.url, "t", "prewarm", "french", None, "host")
    assert pod.requests[-1]["body"] == {"id": "french", "tier": "host"}


def test_unload(pod):
    pod.answer("DELETE", "/v1/adapters/french", 200, {"id": "french", "deleted": True})
    assert call(pod.url, "t", "unload", "french") is True
    assert pod.requests[-1]["method"] == "DELETE" and pod.requests[-1]["auth"] == "Bearer t"
    pod.answer("DELETE", "/v1/adapters/gone", 404, {"error": {"message": "unknown adapter 'gone'"}})
    assert call(pod.url, "t", "unload", "gone") is False


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (400, {"error": {"message": "unsupported adapter source scheme 'ftp'", "code": "invalid_adapter_source"}}),
        (403, {"error": {"message": "adapter source '/x' is not allowed on this server"}}),
        (401, {"error": {"message": "this route needs the admin token"}}),
        (422, {"error": {"message": "tier: Input should be 'device', 'host', 'disk' or 'none'"}}),
    ],
)
def test_4xx_is_permanent_with_the_servers_message(pod, status, body):
    pod.answer("POST", "/v1/adapters", status, body)
    with pytest.raises(PermanentAdminError) as info:
        call(pod.url, "t", "prewarm", "french", "/x", "host")
    assert info.value.status == status
    assert body["error"]["message"] in info.value.message
    assert not isinstance(info.value, RetryableAdminError)


def test_set_tier_posts_the_tier_and_returns_the_row(pod):
    moving = {**ROW, "state": "ready", "tier": "device", "target_tier": "host"}
    pod.answer("POST", "/v1/adapters/fr%2Fx/tier", 200, moving)
    assert call(pod.url, "t", "set_tier", "fr/x", "host") == moving
    assert pod.requests[-1] == {"method": "POST", "path": "/v1/adapters/fr%2Fx/tier", "auth": "Bearer t",
                                "body": {"tier": "host"}}  # fmt: skip


def test_set_tier_on_an_unknown_adapter_is_retryable(pod):
    """404: the pod restarted and lost it; the next round registers it again."""
    pod.answer("POST", "/v1/adapters/french/tier", 404, {"error": {"message": "unknown adapter 'french'"}})
    with pytest.raises(RetryableAdminError, match="unknown adapter"):
        call(pod.url, "t", "set_tier", "french", "disk")


@pytest.mark.parametrize(
    ("status", "permanent"),
    [(400, True), (401, True), (403, True), (413, True), (422, True), (404, False), (408, False),
     (409, False), (425, False), (429, False), (500, False), (503, False), (200, False)],
)  # fmt: skip
def test_retry_classification(status, permanent):
    assert is_permanent_status(status) is permanent


@pytest.mark.parametrize("status", [500, 502, 503, 429, 409])
def test_5xx_429_and_409_are_retryable(pod, status):
    pod.answer("POST", "/v1/adapters", status, {"error": {"message": "busy"}}, {"Retry-After": "2"})
    with pytest.raises(RetryableAdminError) as info:
        call(pod.url, "t", "prewarm", "french", "/x", "host")
    assert info.value.status == status and "busy" in info.value.message
    assert info.value.retry_after == 2.0


def test_lorax_style_and_plain_error_bodies(pod):
    pod.answer("GET", "/v1/adapters", 400, {"error": "bad thing", "error_type": "validation"})
    with pytest.raises(PermanentAdminError, match="bad thing"):
        call(pod.url, None, "list_adapters")
    pod.answer("GET", "/v1/adapters", 500, "plain text crash")
    with pytest.raises(RetryableAdminError, match="plain text crash"):
        call(pod.url, None, "list_adapters")


def test_connection_refused_is_retryable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RetryableAdminError) as info:
        call(f"http://127.0.0.1:{port}", "t", "list_adapters")
    assert info.value.status is None
    assert "ConnectError" in info.value.message


def test_timeout_is_retryable():
    # a listening socket that never answers
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        url = f"http://127.0.0.1:{s.getsockname()[1]}"

        async def go():
            async with make_http_client(timeout_s=0.3) as http:
                return await AdminClient(http, url).list_adapters()

        with pytest.raises(RetryableAdminError, match="Timeout"):
            asyncio.run(go())
