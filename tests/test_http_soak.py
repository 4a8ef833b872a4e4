"""A soak through real HTTP on the built-in model: 4,000 requests over 20 adapters, two of them hostile
(a non-finite scale, a pathological alpha_pattern), a quarter of them streams that hang up mid-stream,
spread over the LoRAX and OpenAI routes. It must end with no 5xx, every well-behaved request's greedy
text equal to the same request's on the idle server, and the KV blocks, adapter slots and queues back
to where they started."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from test_http_support import ADMIN_TOKEN, ServerProcess, engine_state, make_adapter_set, wait_idle

pytestmark = pytest.mark.slow
GOOD = [f"s{i:02d}" for i in range(18)]
NONFINITE, PATTERN = "hostile-nan", "hostile-pattern"
PROMPTS = ["Tell me a joke.", "The weather today is", "Once upon a time", "My favourite food is"]
# 10,000 took 729 s of CI's 90 minutes on a Zen 3 (308 s when written); each request's checks hold at 4,000
NUM_REQUESTS = 4_000
CONCURRENCY = 48
MAX_NEW = 3
SOAK_LIMIT_S = 1500.0  # the whole soak, hang-ups and references included; ~4-6 min on 2 quiet cores


def make_hostile(good: Path, root: Path) -> None:
    """Two copies of a good adapter: lora_alpha NaN (a non-finite folded scale), and an alpha_pattern
    whose key, as a backtracking regex, takes exponential time on every module name."""
    for name, change in (
        (NONFINITE, {"lora_alpha": float("nan")}),
        (PATTERN, {"alpha_pattern": {".*" * 12 + "z": 16}}),
    ):
        shutil.copytree(good, root / name)
        config_path = root / name / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config.update(change)
        config_path.write_text(json.dumps(config))  # NaN as JSON's common extension, as PEFT reads it


@pytest.fixture(scope="module")
def server(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    root = tmp_path_factory.getbasetemp() / "soak-adapters"
    make_adapter_set(smollm2_dir, root, GOOD)
    if not (root / NONFINITE).is_dir():
        make_hostile(root / GOOD[0], root)
    log = tmp_path_factory.mktemp("http-soak") / "server.log"
    flags = "--max-model-len 256 --num-kv-blocks 256 --max-loras 8 --max-num-seqs 64 --max-queue 10000"
    proc = ServerProcess([*flags.split(), "--adapter-dir", str(root), "--admin-token", ADMIN_TOKEN], log)
    proc.wait_ready()  # on failure it kills the server and raises with its log
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


async def lorax(client: httpx.AsyncClient, adapter: str, prompt: str, stream: bool, hang_up: bool) -> tuple[int, str]:
    params: dict[str, object] = {"adapter_id": adapter, "max_new_tokens": 64 if hang_up else MAX_NEW}
    if hang_up:
        params["ignore_eos_token"] = True  # still running when the client leaves
    body = {"inputs": prompt, "parameters": params}
    if not stream:
        r = await client.post("/generate", json=body)
        return r.status_code, r.json().get("generated_text", "") if r.status_code == 200 else r.text
    async with client.stream("POST", "/generate_stream", json=body) as r:
        if r.status_code != 200:
            return r.status_code, (await r.aread()).decode()
        last: dict = {}
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                last = json.loads(line[5:])
                if hang_up:
                    return 200, ""  # leaving the block hangs up mid-stream
        return 200, last.get("generated_text") or ""


async def completions(client: httpx.AsyncClient, adapter: str, prompt: str, stream: bool) -> tuple[int, str]:
    body = {"model": adapter, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "stream": stream}
    if not stream:
        r = await client.post("/v1/completions", json=body)
        return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
    text = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, (await r.aread()).decode()
        async for line in r.aiter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                text += [c.get("text", "") for c in json.loads(line[5:])["choices"]]
    return 200, "".join(text)


# by i % 8: a quarter hang up mid-stream, the rest spread over the LoRAX and OpenAI routes
KINDS = ("hang-up", "hang-up", "lorax-stream", "lorax-stream", "lorax", "completions", "completions-stream", "chat")


async def one(client: httpx.AsyncClient, i: int, adapter: str, prompt: str) -> tuple[str, int, str]:
    kind = KINDS[i % len(KINDS)]
    if kind == "chat":  # another prompt (the chat template): only its status is compared
        body = {"model": adapter, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_NEW}
        r = await client.post("/v1/chat/completions", json={**body, "temperature": 0})
        return kind, r.status_code, ""
    if kind in ("hang-up", "lorax-stream", "lorax"):
        return kind, *await lorax(client, adapter, prompt, stream=kind != "lorax", hang_up=kind == "hang-up")
    return kind, *await completions(client, adapter, prompt, stream=kind == "completions-stream")


async def soak(url: str, work: list[tuple[str, str]]) -> list[tuple[str, int, str]]:
    gate = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

        async def gated(i: int, adapter: str, prompt: str) -> tuple[str, int, str]:
            async with gate:
                return await one(client, i, adapter, prompt)

        return await asyncio.gather(*(gated(i, a, p) for i, (a, p) in enumerate(work)))


async def references(url: str, combos: list[tuple[str, str]]) -> dict[tuple[str, str], tuple[int, str]]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        found = [await lorax(client, a, p, stream=False, hang_up=False) for a, p in combos]  # one at a time: idle
    return dict(zip(combos, found, strict=True))


def test_thousands_of_requests_with_hostile_adapters_and_hang_ups(server: ServerProcess) -> None:
    idle = engine_state(server.url)
    assert idle["num_free_blocks"] == idle["num_blocks"] and idle["num_busy_slots"] == 0
    adapters = [*GOOD, NONFINITE, PATTERN]
    combos = sorted({(a, p) for a in adapters for p in PROMPTS})
    expected = asyncio.run(references(server.url, combos))
    rng = random.Random(18)
    work = [(rng.choice(adapters), rng.choice(PROMPTS)) for _ in range(NUM_REQUESTS)]

    started = time.monotonic()
    results = asyncio.run(asyncio.wait_for(soak(server.url, work), SOAK_LIMIT_S))
    elapsed = time.monotonic() - started

    statuses = Counter(status for _, status, _ in results)
    assert not [s for s in statuses if s >= 500], (statuses, server.log())
    hung_up = sum(kind == "hang-up" for kind, _, _ in results)
    assert hung_up == NUM_REQUESTS // 4
    for (kind, status, text), (adapter, prompt) in zip(results, work, strict=True):
        ref_status, ref_text = expected[(adapter, prompt)]
        if ref_status != 200:  # the refused adapter: refused on every route, with a 4xx
            assert 400 <= status < 500, (kind, adapter, prompt, status, text)
            continue
        assert status == 200, (kind, adapter, prompt, status, text)
        if kind not in ("hang-up", "chat"):
            assert text == ref_text, (kind, adapter, prompt, text, ref_text)
    assert all(expected[(a, p)][0] == 200 for a in GOOD for p in PROMPTS)
    assert expected[(NONFINITE, PROMPTS[0])][0] in range(400, 500)  # refused, never served
    assert len({expected[(a, PROMPTS[0])][1] for a in GOOD}) > 6  # the adapters matter

    state = wait_idle(server.url, timeout=60)
    assert state["num_free_blocks"] == idle["num_free_blocks"] == state["num_blocks"], state
    assert state["num_busy_slots"] == 0 and state["num_waiting"] == 0 and state["num_running"] == 0, state
    assert state["num_http_waiting"] == 0 and state["num_http_inflight"] == 0, state
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    print(f"soak: {NUM_REQUESTS} requests in {elapsed:.0f} s, statuses {dict(statuses)}")
