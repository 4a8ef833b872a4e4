"""The `speculative` request field accepts draft over LoRAX and OpenAI, and anything else is a 422 naming the
field; checked in process on an app whose engine never loads (validation comes first)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from loraplane_server.config import EngineConfig
from loraplane_server.serving.http.app import create_app
from loraplane_server.serving.http.lorax import LoraxParameters
from loraplane_server.serving.http.openai_protocol import ChatCompletionRequest, CompletionRequest
from loraplane_server.serving.http.server_config import ServerConfig

ROUTES = {
    "/generate": lambda spec: {"inputs": "Hi", "parameters": {"max_new_tokens": 2, "speculative": spec}},
    "/v1/completions": lambda spec: {"model": "m", "prompt": "Hi", "max_tokens": 2, "speculative": spec},
    "/v1/chat/completions": lambda spec: {
        "model": "m",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "speculative": spec,
    },
}


@pytest.fixture(scope="module")
def client() -> TestClient:
    config = ServerConfig(engine=EngineConfig(model="/nonexistent/model"))
    return TestClient(create_app(config))  # no `with`: the lifespan, and so the engine's load, never runs


@pytest.mark.parametrize("method", ["off", "ngram", "draft", None])
def test_protocol_models_accept_every_method(method: str | None) -> None:
    assert LoraxParameters(speculative=method).speculative == method
    assert CompletionRequest(model="m", prompt="Hi", speculative=method).speculative == method
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}], speculative=method)
    assert chat.speculative == method


@pytest.mark.parametrize("route", ROUTES)
def test_draft_passes_validation(client: TestClient, route: str) -> None:
    r = client.post(route, json=ROUTES[route]("draft"))
    assert r.status_code == 503 and "still loading" in r.text, r.text  # past validation, to the engine


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("method", ["medusa", "DRAFT", ""])
def test_an_unknown_method_is_a_422_naming_the_field(client: TestClient, route: str, method: str) -> None:
    r = client.post(route, json=ROUTES[route](method))
    assert r.status_code == 422 and "speculative" in r.text, r.text
    assert "draft" in r.text  # the message lists what is accepted
