"""Exact adapter tiers (issue 21): `LLMEngine.set_tier` and POST /v1/adapters/{id}/tier move an adapter to
exactly the tier asked for. Demotion frees what the tier says (device -> host: the slot, and a new adapter
can take it; -> disk: the host copy's bytes), waits for the requests running on the slot (their output
unchanged), and clears a pin; promotion loads. Engine-level on a tiny model, then over real HTTP against
`loraplane serve` on the built-in model (admin token, 404, 400)."""

from __future__ import annotations

import functools
import http.server
import shutil
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from engine_helpers import run_all
from test_adapters import GOOD, new_engine
from test_http_support import ADMIN_TOKEN, ServerProcess, admin_headers, engine_state, make_adapter_set

from lora_helpers import make_peft_adapter
from loraplane_server.adapters.weights import AdapterError
from loraplane_server.engine.llm_engine import LLMEngine
from loraplane_server.sampling_params import SamplingParams

# engine level


@pytest.fixture
def engine(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[LLMEngine]:
    """Two device slots, adapters a, b, c (the same weights, so outputs can be compared across them)."""
    good = make_peft_adapter(tiny_llama_dir, tmp_path / "good", seed=5, **GOOD)
    for name in ("a", "b", "c"):
        shutil.copytree(good, tmp_path / "adapters" / name)
    eng = new_engine(tiny_llama_dir, tmp_path, adapter_dir=str(tmp_path / "adapters"), max_loras=2)
    yield eng
    eng.adapters.shutdown()


def row(engine: LLMEngine, adapter_id: str) -> dict:
    return next(r for r in engine.adapters.residency() if r["id"] == adapter_id)


def settle(engine: LLMEngine, adapter_id: str, timeout_s: float = 60.0) -> dict:
    """Poll (as the idle engine thread does) until the adapter's tier goal is reached."""
    deadline = time.monotonic() + timeout_s
    while (r := row(engine, adapter_id))["target_tier"] is not None or r["state"] == "loading":
        assert time.monotonic() < deadline, r
        engine.poll_adapters()
        time.sleep(0.005)
    return r


def to_device(engine: LLMEngine, adapter_id: str, pinned: bool | None = None) -> dict:
    engine.adapters.prewarm(adapter_id, "device", pinned)
    deadline = time.monotonic() + 60
    while (r := row(engine, adapter_id))["tier"] != "device":
        assert time.monotonic() < deadline, r
        engine.poll_adapters()
        time.sleep(0.005)
    return r


def test_device_to_host_frees_the_slot_for_a_new_adapter(engine: LLMEngine) -> None:
    to_device(engine, "a", pinned=True)
    to_device(engine, "b")
    engine.slots.acquire("b")  # b in use, a pinned: no slot for c
    assert not engine.slots.can_acquire("c")
    r = engine.adapters.set_tier("a", "host")
    assert r["tier"] == "host" and r["slot"] is None and r["target_tier"] is None and not r["pinned"], r
    assert engine.slots.adapter_in.count(None) == 1 and engine.adapters.manager.stats.evictions["device"] == 1
    assert engine.adapters.manager.is_ready("a")  # its host copy is kept
    assert engine.slots.can_acquire("c")
    r = to_device(engine, "c")  # the freed slot takes a new adapter
    assert r["slot"] is not None and row(engine, "b")["tier"] == "device"


def test_host_to_disk_frees_host_memory(engine: LLMEngine) -> None:
    engine.adapters.prewarm("a", "host")
    engine.adapters.prewarm("b", "host")
    run_all(engine)
    assert row(engine, "a")["tier"] == "host" and row(engine, "b")["tier"] == "host"
    before, size = engine.adapters.manager.host_bytes, row(engine, "a")["size_bytes"]
    assert size > 0
    r = engine.adapters.set_tier("a", "disk")
    assert r["tier"] == "disk" and r["target_tier"] is None, r
    assert engine.adapters.manager.host_bytes == before - size and "a" not in engine.adapters.manager.host
    assert row(engine, "b")["tier"] == "host"  # the others stay


def test_device_to_disk_then_back_to_device(engine: LLMEngine) -> None:
    to_device(engine, "a")
    r = engine.adapters.set_tier("a", "disk")
    assert r["tier"] == "disk" and engine.slots.lookup("a") is None and engine.adapters.manager.host_bytes == 0, r
    r = engine.adapters.set_tier("a", "device")  # promotion: loads in the background, the row says where it goes
    assert r["tier"] == "disk" and r["target_tier"] == "device", r
    r = settle(engine, "a")
    assert r["tier"] == "device" and r["slot"] is not None and r["state"] == "ready", r
    r = engine.adapters.set_tier("a", "host")
    assert r["tier"] == "host" and engine.slots.lookup("a") is None
    r = engine.adapters.set_tier("a", "host")  # already there: nothing to do
    assert r["tier"] == "host" and r["target_tier"] is None


def test_demotion_to_disk_fetches_a_remote_adapter_the_disk_cache_dropped(engine: LLMEngine, tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    with tarfile.open(site / "remote.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "adapters" / "a", arcname="remote")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        engine.adapters.register("remote", f"http://127.0.0.1:{web.server_address[1]}/remote.tar.gz")
        engine.adapters.prewarm("remote", "host")
        run_all(engine)
        assert row(engine, "remote")["tier"] == "host"
        engine.adapters.manager.disk.remove("remote")  # the disk cache let it go meanwhile
        r = engine.adapters.set_tier("remote", "disk")
        assert r["tier"] == "source" and r["target_tier"] == "disk" and "remote" not in engine.adapters.manager.host, r
        r = settle(engine, "remote")
        assert (
            r["tier"] == "disk" and r["state"] == "ready" and engine.adapters.manager.disk.size_of("remote") is not None
        )
    finally:
        web.shutdown()
        web.server_close()


def test_demotion_waits_for_the_running_request_and_leaves_its_output_alone(engine: LLMEngine) -> None:
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    rid = engine.add_request([3, 4, 5, 6], params, adapter_id="b")
    reference = run_all(engine)[rid].token_ids  # b: the same weights as a, never demoted
    rid = engine.add_request([3, 4, 5, 6], params, adapter_id="a")
    first = []
    while row(engine, "a")["running"] == 0:
        first += engine.step()
    assert not any(o.finished for o in first)
    r = engine.adapters.set_tier("a", "host")
    assert r["tier"] == "device" and r["target_tier"] == "host" and r["running"] == 1, r
    outputs = run_all(engine)
    assert outputs[rid].error is None and outputs[rid].token_ids == reference
    r = settle(engine, "a")
    assert r["tier"] == "host" and r["slot"] is None and r["target_tier"] is None, r


def test_demoting_a_pinned_adapter_unpins_it(engine: LLMEngine) -> None:
    assert to_device(engine, "a", pinned=True)["pinned"]
    r = engine.adapters.set_tier("a", "host")
    assert r["tier"] == "host" and r["pinned"] is False and "a" not in engine.slots.pinned, r
    engine.adapters.prewarm("b", "device", pinned=True)  # the one pin --max-loras 2 allows is free again
    assert engine.slots.pinned == {"b"}


def test_unknown_adapter_and_bad_tier_are_refused(engine: LLMEngine) -> None:
    with pytest.raises(AdapterError, match="unknown adapter 'nope'"):
        engine.adapters.set_tier("nope", "host")
    for tier in ("none", "source", "gpu"):
        with pytest.raises(ValueError, match="expected device, host or disk"):
            engine.adapters.set_tier("a", tier)


# over real HTTP

ADAPTERS = ["t00", "t01", "t02"]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    adapter_dir = make_adapter_set(smollm2_dir, tmp_path_factory.getbasetemp() / "tier-adapters", ADAPTERS)
    flags = ["--max-model-len", "256", "--num-kv-blocks", "64", "--max-loras", "2", "--adapter-dir", str(adapter_dir)]
    flags += ["--disk-cache-dir", str(tmp_path_factory.mktemp("disk-cache")), "--admin-token", ADMIN_TOKEN]
    proc = ServerProcess(flags, tmp_path_factory.mktemp("http-tiers") / "server.log", env={"HF_HUB_OFFLINE": "1"})
    proc.wait_ready()
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


def set_tier(url: str, adapter_id: str, body: object, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{url}/v1/adapters/{adapter_id}/tier", json=body, headers=headers or admin_headers(), timeout=60)


def listed(url: str, adapter_id: str) -> dict:
    rows = httpx.get(f"{url}/v1/adapters", headers=admin_headers(), timeout=30).json()["data"]
    return next(r for r in rows if r["id"] == adapter_id)


def wait_tier(url: str, adapter_id: str, tier: str, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not ((r := listed(url, adapter_id))["tier"] == tier and r["target_tier"] is None):
        assert time.monotonic() < deadline, r
        time.sleep(0.05)
    return r


def generate(url: str, adapter_id: str, max_new_tokens: int) -> httpx.Response:
    body = {"inputs": PROMPT, "parameters": {"adapter_id": adapter_id, "max_new_tokens": max_new_tokens}}
    return httpx.post(f"{url}/generate", json=body, timeout=300)


@pytest.mark.slow
def test_http_tier_route_needs_the_admin_token(server: ServerProcess) -> None:
    for headers in ({}, {"Authorization": "Bearer not-the-admin-token"}):
        r = httpx.post(f"{server.url}/v1/adapters/t00/tier", json={"tier": "host"}, headers=headers, timeout=30)
        assert r.status_code == 401, r.text
    assert listed(server.url, "t00")["tier"] == "disk"  # nothing moved


@pytest.mark.slow
def test_http_unknown_adapter_404_and_bad_tier_400(server: ServerProcess) -> None:
    r = set_tier(server.url, "no-such-adapter", {"tier": "host"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "adapter_not_found", r.text
    for body in ({"tier": "gpu"}, {"tier": "none"}, {}):
        r = set_tier(server.url, "t00", body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "tier" and error["code"] == "invalid_tier" and "device, host, disk" in error["message"]


@pytest.mark.slow
def test_http_device_host_disk_device(server: ServerProcess) -> None:
    url = server.url
    r = set_tier(url, "t01", {"tier": "device"})
    assert r.status_code == 200 and r.json()["target_tier"] in ("device", None), r.text
    wait_tier(url, "t01", "device")
    before = engine_state(url)["evictions"]
    r = set_tier(url, "t01", {"tier": "host"})
    assert r.status_code == 200 and r.json()["tier"] == "host" and r.json()["slot"] is None, r.text
    assert engine_state(url)["evictions"]["device"] == before["device"] + 1
    r = set_tier(url, "t01", {"tier": "disk"})
    assert r.status_code == 200 and r.json()["tier"] == "disk" and r.json()["target_tier"] is None, r.text
    assert engine_state(url)["evictions"]["host"] == before["host"] + 1
    assert listed(url, "t01")["tier"] == "disk"
    assert set_tier(url, "t01", {"tier": "device"}).status_code == 200
    assert wait_tier(url, "t01", "device", timeout_s=10)["slot"] is not None


@pytest.mark.slow
def test_http_demotion_during_a_request(server: ServerProcess) -> None:
    """t02 pinned on the device, a long request running on it: the demotion answers at once (tier still
    device, target host), the request's text equals an undisturbed run's, then the slot goes."""
    url = server.url
    reference = generate(url, "t02", 48)
    assert reference.status_code == 200, reference.text
    pin = {"id": "t02", "tier": "device", "pinned": True, "wait": True, "timeout_s": 120}
    assert httpx.post(f"{url}/v1/adapters", json=pin, headers=admin_headers(), timeout=150).json()["pinned"]
    result: dict[str, httpx.Response] = {}
    worker = threading.Thread(target=lambda: result.setdefault("r", generate(url, "t02", 48)))
    worker.start()
    deadline = time.monotonic() + 60
    while listed(url, "t02")["running"] == 0:
        assert time.monotonic() < deadline and worker.is_alive(), "the request never ran"
        time.sleep(0.01)
    r = set_tier(url, "t02", {"tier": "host"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tier"] == "device" and body["target_tier"] == "host" and body["pinned"] is False, body
    worker.join(300)
    assert result["r"].status_code == 200 and result["r"].json() == reference.json()
    r = wait_tier(url, "t02", "host", timeout_s=10)
    assert r["slot"] is None and r["pinned"] is False
