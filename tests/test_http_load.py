"""200 concurrent streams over 20 adapters against a real server, 50 of them hanging up mid-stream:
every other stream completes with the same text as the in-process engine, and KV blocks, adapter
slots and the queue all return to idle; a hung-up stream is aborted at once, not run to its end."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_http_support import ADMIN_TOKEN, ServerProcess, engine_state, make_adapter_set, wait_idle

pytestmark = pytest.mark.slow
ADAPTERS = [f"a{i:02d}" for i in range(20)]
PROMPTS = ["Tell me a joke.", "The weather today is", "Once upon a time", "My favourite food is"]
MAX_NEW = 8
MAX_LORAS = 8


@pytest.fixture(scope="module")
def adapter_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter_set(smollm2_dir, tmp_path_factory.getbasetemp() / "http-adapters", ADAPTERS)


@pytest.fixture(scope="module")
def server(adapter_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    log = tmp_path_factory.mktemp("http-load") / "server.log"
    flags = f"--max-model-len 512 --num-kv-blocks 256 --max-loras {MAX_LORAS} --max-num-seqs 256 --max-queue 1000"
    args = [*flags.split(), "--adapter-dir", str(adapter_dir), "--admin-token", ADMIN_TOKEN]
    proc = ServerProcess(args, log)
    proc.wait_ready()  # on failure it kills the server and raises with its log
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


async def reference_texts(url: str, combos: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """A non-streamed greedy run of each (adapter, prompt), all at once."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def one(adapter: str, prompt: str) -> str:
            body = {"inputs": prompt, "parameters": {"adapter_id": adapter, "max_new_tokens": MAX_NEW}}
            r = await client.post("/generate", json=body)
            assert r.status_code == 200, r.text
            return r.json()["generated_text"]

        texts = await asyncio.gather(*(one(a, p) for a, p in combos))
    return dict(zip(combos, texts, strict=True))


async def stream_one(
    client: httpx.AsyncClient, adapter: str, prompt: str, hang_up_after: int | None, max_new: int = MAX_NEW
) -> dict:
    body = {"inputs": prompt, "parameters": {"adapter_id": adapter, "max_new_tokens": max_new}}
    if hang_up_after is not None:
        body["parameters"]["ignore_eos_token"] = True  # cannot finish before the hang-up
    events = []
    async with client.stream("POST", "/generate_stream", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
                if hang_up_after is not None and len(events) >= hang_up_after:
                    break  # leaving the block closes the connection mid-stream
    return {"adapter": adapter, "prompt": prompt, "events": events}


async def run_load(url: str, work: list[tuple[str, str, int | None]]) -> list[dict]:
    limits = httpx.Limits(max_connections=len(work), max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        return await asyncio.gather(*(stream_one(client, a, p, h, 400 if h else MAX_NEW) for a, p, h in work))


def test_200_streams_over_20_adapters_with_50_hang_ups(server: ServerProcess) -> None:
    idle = engine_state(server.url)
    assert idle["num_free_blocks"] == idle["num_blocks"] and idle["num_busy_slots"] == 0
    work: list[tuple[str, str, int | None]] = []
    for i in range(200):
        adapter = ADAPTERS[i % 20]
        work.append((adapter, PROMPTS[(i % 20) % len(PROMPTS)], 2 if i < 50 else None))
    random.Random(7).shuffle(work)
    results = asyncio.run(run_load(server.url, work))

    combos = sorted({(a, p) for a, p, h in work if h is None})
    expected = asyncio.run(reference_texts(server.url, combos))
    complete = [r for r, (_, _, h) in zip(results, work, strict=True) if h is None]
    assert len(complete) == 150
    for r in complete:
        last = r["events"][-1]
        assert last["details"] is not None, r
        assert last["generated_text"] == expected[(r["adapter"], r["prompt"])], r
        assert "".join(e["token"]["text"] for e in r["events"] if not e["token"]["special"]) == last["generated_text"]
    assert len(combos) == 20 and len(set(expected.values())) > 10  # the adapters matter

    state = wait_idle(server.url)
    assert state["num_free_blocks"] == idle["num_free_blocks"] == state["num_blocks"]
    assert state["num_busy_slots"] == 0 and state["num_waiting"] == 0 and state["num_running"] == 0
    assert state["num_http_waiting"] == 0 and state["num_http_inflight"] == 0
    metrics = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
        for s in f.samples
    }
    assert metrics[("loraplane_queue_depth", ())] == 0 and metrics[("loraplane_requests_running", ())] == 0
    assert metrics[("loraplane_kv_cache_blocks_free", ())] == state["num_blocks"]
    assert metrics[("loraplane_requests_total", (("api", "lorax"), ("finish_reason", "abort")))] == 50
    finished = sum(
        v
        for (name, labels), v in metrics.items()
        if name == "loraplane_requests_total" and ("finish_reason", "abort") not in labels
    )
    assert finished == 150 + len(combos)  # the streams, and the non-streamed references
    used = {dict(labels)["adapter"] for (name, labels) in metrics if name == "loraplane_adapter_prompt_tokens_total"}
    assert set(ADAPTERS) <= used


def test_a_hang_up_aborts_at_once(server: ServerProcess) -> None:
    async def hang_up() -> float:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            result = await stream_one(client, "a05", PROMPTS[0], hang_up_after=2, max_new=400)
            assert len(result["events"]) == 2
            return time.monotonic()

    hung_up_at = asyncio.run(hang_up())
    state = wait_idle(server.url, timeout=10)
    freed_after = time.monotonic() - hung_up_at
    assert state["num_requests"] == 0 and state["num_free_blocks"] == state["num_blocks"]
    assert freed_after < 5, freed_after  # 398 more tokens would take far longer


def test_a_non_streaming_client_that_gives_up_is_aborted(server: ServerProcess) -> None:
    body = {"inputs": PROMPTS[1], "parameters": {"adapter_id": "a06", "max_new_tokens": 400, "ignore_eos_token": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/generate", json=body, timeout=1.5)
    gave_up_at = time.monotonic()
    state = wait_idle(server.url, timeout=10)
    assert state["num_requests"] == 0 and state["num_free_blocks"] == state["num_blocks"]
    assert time.monotonic() - gave_up_at < 5
