"""The HTTP API through the clients people use (openai, lorax-client) against a real server process on
the built-in model with real PEFT adapters: outputs agree across APIs and with streaming, the adapter
admin routes work, and /metrics agrees with the load just sent."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from lorax import Client
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from test_http_support import ADMIN_TOKEN, ServerProcess, admin_headers, make_adapter_set
from transformers import AutoTokenizer

pytestmark = pytest.mark.slow
ADAPTERS = ["a00", "a01", "a02", "a03"]
BASE = "smollm2-135m"
PROMPTS = ["The capital of France is", "List three colours:", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def adapter_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter_set(smollm2_dir, tmp_path_factory.getbasetemp() / "http-adapters", ADAPTERS)


@pytest.fixture(scope="module")
def server(adapter_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    log = tmp_path_factory.mktemp("http-api") / "server.log"
    flags = "--max-model-len 512 --num-kv-blocks 128 --max-loras 2"
    args = [*flags.split(), "--adapter-dir", str(adapter_dir)]
    proc = ServerProcess(args, log, env={"LORAPLANE_ADMIN_TOKEN": ADMIN_TOKEN})
    proc.wait_ready()  # on failure it kills the server and raises with its log
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def oai(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def lorax(server: ServerProcess) -> Client:
    return Client(server.url, timeout=120)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


@pytest.mark.parametrize("model", [BASE, "a01"])
def test_greedy_text_is_the_same_through_every_api(oai: OpenAI, lorax: Client, model: str) -> None:
    adapter = None if model == BASE else model
    for prompt in PROMPTS[:2]:
        lx = lorax.generate(prompt, adapter_id=adapter, max_new_tokens=8, details=True)
        lx_stream = [r for r in lorax.generate_stream(prompt, adapter_id=adapter, max_new_tokens=8)]
        cmp = oai.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
        cmp_stream = oai.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True)
        streamed = "".join(c.choices[0].text for c in cmp_stream if c.choices)
        assert lx.generated_text == cmp.choices[0].text == streamed
        assert "".join(r.token.text for r in lx_stream if not r.token.special) == lx.generated_text
        assert lx_stream[-1].generated_text == lx.generated_text
        assert [t.id for t in lx.details.tokens] == [r.token.id for r in lx_stream]
        assert lx.details.generated_tokens == cmp.usage.completion_tokens == len(lx.details.tokens)
        assert lx.details.prompt_tokens == cmp.usage.prompt_tokens


def test_adapters_change_the_output(lorax: Client) -> None:
    texts = {a: lorax.generate(PROMPTS[0], adapter_id=a, max_new_tokens=10).generated_text for a in [None, *ADAPTERS]}
    assert texts[None].startswith(" Paris")  # the real base model
    assert len(set(texts.values())) == len(texts), texts


def test_chat_uses_the_tokenizer_template(oai: OpenAI, smollm2_dir: Path) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    for model in (BASE, "a02"):
        chat = oai.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
        stream = oai.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        plain = oai.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0)
        assert chat.choices[0].message.content == streamed == plain.choices[0].text
        assert chat.usage.prompt_tokens == plain.usage.prompt_tokens == chunks[-1].usage.prompt_tokens
        assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert (
        "Paris"
        in oai.chat.completions.create(model=BASE, messages=messages, max_tokens=10, temperature=0)
        .choices[0]
        .message.content
    )


def test_finish_reasons_stop_sequences_and_full_text(lorax: Client, oai: OpenAI) -> None:
    full = lorax.generate(PROMPTS[0], max_new_tokens=12).generated_text  # " Paris.\n\nThe answer is..."
    stop = full[full.index(".") + 1 :][:2]
    r = lorax.generate(PROMPTS[0], max_new_tokens=12, stop_sequences=[stop], details=True)
    assert r.details.finish_reason.value == "stop_sequence"
    assert r.generated_text == full[: full.index(stop, full.index(".") + 1)]
    events = list(lorax.generate_stream(PROMPTS[0], max_new_tokens=12, stop_sequences=[stop]))
    assert "".join(e.token.text for e in events if not e.token.special) == r.generated_text
    assert events[-1].details.finish_reason.value == "stop_sequence"
    c = oai.completions.create(model=BASE, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop])
    assert c.choices[0].text == r.generated_text and c.choices[0].finish_reason == "stop"
    chat = [{"role": "user", "content": "Say hi."}]
    done = oai.chat.completions.create(model=BASE, messages=chat, max_tokens=200, temperature=0)
    assert done.choices[0].finish_reason == "stop" and done.usage.completion_tokens < 200  # eos
    r = lorax.generate(PROMPTS[0], max_new_tokens=3, return_full_text=True, details=True)
    assert r.generated_text.startswith(PROMPTS[0]) and r.details.finish_reason.value == "length"


def test_eos_is_reported_as_eos_token(server: ServerProcess, smollm2_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Say hi."}], add_generation_prompt=True, tokenize=False
    )
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 200, "details": True}}
    data = httpx.post(f"{server.url}/generate", json=body, timeout=120).json()
    assert data["details"]["finish_reason"] == "eos_token"
    assert data["details"]["tokens"][-1]["id"] == tok.eos_token_id


def test_response_headers(server: ServerProcess) -> None:
    r = httpx.post(
        f"{server.url}/generate", json={"inputs": "Hello", "parameters": {"adapter_id": "a03", "max_new_tokens": 4}}
    )
    assert r.status_code == 200
    h = r.headers
    assert h["x-adapter-id"] == "a03" and h["x-generated-tokens"] == "4" and int(h["x-prompt-tokens"]) >= 1
    assert 0 <= int(h["x-time-to-first-token"]) <= int(h["x-total-time"])
    assert int(h["x-queue-time"]) >= 0 and "x-request-id" in h


def test_models_and_adapter_admin(server: ServerProcess, oai: OpenAI, adapter_dir: Path) -> None:
    ids = [m.id for m in oai.models.list()]
    assert ids[0] == BASE and set(ADAPTERS) <= set(ids)
    url, auth = server.url, admin_headers()
    body = {"id": "copy-of-a00", "source": str(adapter_dir / "a00"), "tier": "device", "pinned": True, "wait": True}
    r = httpx.post(f"{url}/v1/adapters", json=body, headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["tier"] == "device" and r.json()["state"] == "ready" and r.json()["pinned"] is True
    assert r.json()["rank"] == 8 and r.json()["size_bytes"] > 0
    assert httpx.get(f"{url}/v1/adapters").status_code == 401  # rows name sources: admin only
    rows = {row["id"]: row for row in httpx.get(f"{url}/v1/adapters", headers=auth).json()["data"]}
    assert rows["copy-of-a00"]["tier"] == "device" and set(ADAPTERS) <= set(rows)
    same = [
        oai.completions.create(model=m, prompt=PROMPTS[1], max_tokens=8, temperature=0).choices[0].text
        for m in ("copy-of-a00", "a00")
    ]
    assert same[0] == same[1]  # the same weights under another id
    assert httpx.delete(f"{url}/v1/adapters/copy-of-a00", headers=auth).status_code == 200
    assert httpx.delete(f"{url}/v1/adapters/copy-of-a00", headers=auth).status_code == 404
    r = httpx.post(f"{url}/v1/completions", json={"model": "copy-of-a00", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "adapter_not_found"
    # vLLM's routes
    r = httpx.post(
        f"{url}/v1/load_lora_adapter",
        json={"lora_name": "vl", "lora_path": str(adapter_dir / "a01")},
        headers=auth,
        timeout=60,
    )
    assert r.status_code == 200 and "Success" in r.text
    assert "vl" in [m.id for m in oai.models.list()]
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "vl"}, headers=auth).status_code == 200
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "vl"}, headers=auth).status_code == 404


def test_metrics_agree_with_the_load(server: ServerProcess, lorax: Client, oai: OpenAI) -> None:
    before = scrape(server.url)
    prompt_tokens = generated = 0
    per_adapter: dict[str, list[int]] = {}
    for i in range(6):
        adapter = ADAPTERS[i % 2]
        r = lorax.generate(PROMPTS[i % 3], adapter_id=adapter, max_new_tokens=3 + i, details=True)
        prompt_tokens += r.details.prompt_tokens
        generated += r.details.generated_tokens
        per_adapter.setdefault(adapter, [0, 0])
        per_adapter[adapter][0] += r.details.prompt_tokens
        per_adapter[adapter][1] += r.details.generated_tokens
    c = oai.completions.create(model=BASE, prompt=PROMPTS[0], max_tokens=5, temperature=0)
    prompt_tokens += c.usage.prompt_tokens
    generated += c.usage.completion_tokens
    after = scrape(server.url)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("loraplane_requests_total", api="lorax", finish_reason="length") == 6
    assert delta("loraplane_requests_total", api="openai", finish_reason="length") == 1
    assert delta("loraplane_prompt_tokens_total") == prompt_tokens
    assert delta("loraplane_generation_tokens_total") == generated
    assert delta("loraplane_time_to_first_token_seconds_count") == 7
    assert delta("loraplane_request_latency_seconds_count") == 7
    assert delta("loraplane_inter_token_latency_seconds_count") == generated - 7
    for adapter, (p, g) in per_adapter.items():
        assert delta("loraplane_adapter_prompt_tokens_total", adapter=adapter) == p
        assert delta("loraplane_adapter_generation_tokens_total", adapter=adapter) == g
    assert delta("loraplane_adapter_generation_tokens_total", adapter=BASE) == c.usage.completion_tokens
    assert after[("loraplane_queue_depth", ())] == 0 and after[("vllm:num_requests_waiting", ())] == 0
    assert after[("vllm:num_requests_running", ())] == 0 and after[("vllm:kv_cache_usage_perc", ())] == 0
    info = [k for k in after if k[0] == "vllm:lora_requests_info"]
    assert len(info) == 1 and dict(info[0][1])["max_lora"] == "2" and after[info[0]] > 1.7e9
    assert after[("loraplane_adapters_resident", (("tier", "device"),))] <= 2
    assert sum(v for k, v in after.items() if k[0] == "loraplane_adapter_loads_total") >= 2


def test_choices_batches_logprobs_and_echo(oai: OpenAI, lorax: Client) -> None:
    batch = oai.completions.create(model="a00", prompt=PROMPTS[:2], n=2, max_tokens=4, temperature=0.8, seed=5)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.usage.completion_tokens == 16
    singles = [oai.completions.create(model="a00", prompt=p, max_tokens=4, temperature=0) for p in PROMPTS[:2]]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)  # each prompt once
    again = oai.completions.create(model="a00", prompt=PROMPTS[:2], n=2, max_tokens=4, temperature=0.8, seed=5)
    assert [c.text for c in again.choices] == [c.text for c in batch.choices]  # seeded: reproducible
    stream = oai.completions.create(model="a00", prompt=PROMPTS[0], n=3, max_tokens=4, temperature=0, stream=True)
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert set(texts.values()) == {singles[0].choices[0].text}  # greedy: three equal choices

    lp = oai.completions.create(model=BASE, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=0, echo=True)
    choice = lp.choices[0]
    # echo with logprobs (OpenAI's): the prompt's tokens first, the first with none, then the 5 generated
    n = lp.usage.prompt_tokens
    token_logprobs = choice.logprobs.token_logprobs
    assert choice.text.startswith(PROMPTS[0]) and len(token_logprobs) == n + 5 and token_logprobs[0] is None
    assert all(x <= 0 for x in token_logprobs[1:])
    assert "".join(choice.logprobs.tokens) == choice.text
    details = lorax.generate(PROMPTS[0], max_new_tokens=5, details=True, decoder_input_details=True).details
    assert [round(t.logprob, 4) for t in details.tokens] == [round(x, 4) for x in token_logprobs[n:]]
    assert [t.logprob for t in details.prefill[1:]] == pytest.approx(token_logprobs[1:n], abs=1e-4)
    chat = oai.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0, logprobs=True
    )
    assert len(chat.choices[0].logprobs.content) == 3 and chat.choices[0].logprobs.content[0].logprob <= 0


def test_lorax_registers_an_allowed_adapter_source_on_the_fly(
    server: ServerProcess, lorax: Client, adapter_dir: Path
) -> None:
    expected = lorax.generate(PROMPTS[2], adapter_id="a02", max_new_tokens=6).generated_text
    admin = Client(server.url, headers=admin_headers(), timeout=120)  # registering needs the admin token
    local = admin.generate(PROMPTS[2], adapter_id=str(adapter_dir / "a02"), adapter_source="local", max_new_tokens=6)
    assert local.generated_text == expected
    body = {
        "inputs": PROMPTS[2],
        "parameters": {"adapter_id": "fly-a02", "adapter_source": str(adapter_dir / "a02"), "max_new_tokens": 6},
    }
    r = httpx.post(f"{server.url}/generate", json=body, timeout=60, headers=admin_headers())
    assert r.status_code == 200 and r.json()["generated_text"] == expected and r.headers["x-adapter-id"] == "fly-a02"
    body["parameters"]["adapter_source"] = str(adapter_dir / "a01")  # the same id, another source
    r = httpx.post(f"{server.url}/generate", json=body, timeout=60, headers=admin_headers())
    assert r.status_code == 409 and r.json()["error_type"] == "validation"
    rows = httpx.get(f"{server.url}/v1/adapters", headers=admin_headers()).json()["data"]
    ids = [row["id"] for row in rows]
    assert "fly-a02" in ids and any(i.endswith("--a02") for i in ids)
