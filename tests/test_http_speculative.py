"""Speculative decoding over HTTP: the request field (OpenAI extra body, LoRAX parameters) turns it on for one
request on a server whose default is off (prompt lookup, or the --draft-model the server started with), the
text equals the plain request's, a bad value is a 422 naming the field, and /metrics counts proposed and
accepted tokens per adapter and method."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from test_http_support import ServerProcess, make_adapter_set

pytestmark = pytest.mark.slow

BASE = "smollm2-135m"
TEXT = (
    "The river town of Halden keeps its market on the north bank every Tuesday. Farmers bring apples, pears and "
    "goat cheese; the baker sells rye loaves until noon."
)
PROMPT = f"Repeat the following text exactly, word for word:\n\n{TEXT}\n\nRepeated text:\n"


@pytest.fixture(scope="module")
def server(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    adapters = make_adapter_set(smollm2_dir, tmp_path_factory.getbasetemp() / "spec-adapters", ["a00"])
    log = tmp_path_factory.mktemp("http-spec") / "server.log"
    # the built-in model drafting for itself, told it costs nothing (else it would measure that it never pays):
    # the draft path end to end (a real pairing needs a smaller model)
    args = ["--max-model-len", "512", "--num-kv-blocks", "128", "--adapter-dir", str(adapters)]
    args += ["--draft-model", BASE, "--draft-cost-ratio", "0"]
    proc = ServerProcess(args, log)
    proc.wait_ready()
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


def spec_metrics(url: str) -> dict[tuple[str, str, str], float]:
    """(metric, adapter, method) -> value of the loraplane_spec_* series."""
    text = httpx.get(f"{url}/metrics").text
    return {
        (s.name, s.labels["adapter"], s.labels["method"]): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith("loraplane_spec_")
    }


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("model", [BASE, "a00"])
def test_openai_extra_body_field_and_metrics(server: ServerProcess, model: str, method: str) -> None:
    oai = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    plain = oai.completions.create(model=model, prompt=PROMPT, max_tokens=32, temperature=0)
    assert not any(key[2] == method and key[1] == model for key in spec_metrics(server.url))
    spec = oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=32, temperature=0, extra_body={"speculative": method}
    )
    assert spec.choices[0].text == plain.choices[0].text
    metrics = spec_metrics(server.url)
    proposed = metrics[("loraplane_spec_proposed_tokens_total", model, method)]
    accepted = metrics[("loraplane_spec_accepted_tokens_total", model, method)]
    assert 0 < accepted <= proposed
    assert metrics[("loraplane_spec_mean_accepted_length", model, method)] > 0


def test_lorax_parameter_and_a_bad_value(server: ServerProcess) -> None:
    def generate(**extra: object) -> httpx.Response:
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 24, **extra}}
        return httpx.post(f"{server.url}/generate", json=body, timeout=300)

    plain, spec = generate(), generate(speculative="ngram")
    assert spec.status_code == 200 and spec.json()["generated_text"] == plain.json()["generated_text"]
    bad = generate(speculative="medusa")
    assert bad.status_code == 422 and "speculative" in bad.text
