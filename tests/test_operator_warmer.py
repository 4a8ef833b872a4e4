"""The prewarm gate (issue 39: no cold pod in rotation) against a real `loraplane serve --prewarm-timeout`:
the loaded server stays out of rotation (/ready 503 "prewarming") while it serves requests sent to it, the
operator's warmer prewarms every adapter placed on it (those on all pods, and those the ranking puts on it among
the Ready and warming pods, through the adapter rounds it wakes) and only then opens the gate; a server that
hears nothing opens the gate itself at its timeout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_http_support import REPO, ServerProcess, free_port

from loraplane_operator import adapter_status as st
from loraplane_operator import constants as c
from loraplane_operator import reconcile, warmer
from loraplane_operator.admin_client import make_http_client
from loraplane_operator.context import OperatorContext
from loraplane_operator.server_status import PodInfo, ServerRef
from loraplane_server.serving.router.ranking import rank

ADAPTERS = REPO / "server" / "examples" / "adapters"
POD, OTHER = "smollm2-new", "smollm2-old"  # a Ready pod of the same server, for the ranking (never called)
ADMIN_PORT = free_port()


def start(tmp: Path, name: str, timeout_s: float, *flags: str) -> ServerProcess:
    args = ["--prewarm-timeout", str(timeout_s), "--max-loras", "4", "--adapter-source-allow", str(ADAPTERS)]
    proc = ServerProcess([*args, *flags], tmp / f"{name}.log")
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:  # loaded: /ready 503 "prewarming" (or 200 once a short gate opened)
        assert proc.proc.poll() is None, proc.log()
        try:
            if httpx.get(f"{proc.url}/ready", timeout=5).json().get("status") in ("prewarming", "ready"):
                return proc
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.25)
    proc.stop()
    raise TimeoutError(proc.log())


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start(tmp_path_factory.mktemp("warmer"), "gated", 600, "--admin-port", str(ADMIN_PORT))
    try:
        yield proc
    finally:
        proc.stop()


def wants_split() -> tuple[list[st.AdapterWant], set[str], set[str]]:
    """french on every pod; ten ids over pirate and json on one pod each: some ranked here, the rest on OTHER."""
    ids = [f"t-{i}" for i in range(10)]
    mine = {a for a in ids if rank(a, [OTHER, POD])[0] == POD}
    assert mine and len(mine) < len(ids)
    wants = [st.AdapterWant("french", str(ADAPTERS / "french"), "host")]
    sources = [str(ADAPTERS / ("pirate" if i % 2 else "json")) for i in range(len(ids))]
    wants += [st.AdapterWant(a, source, "host", replicas=1) for a, source in zip(ids, sources, strict=True)]
    return wants, mine, set(ids) - mine


def test_the_warmer_opens_the_gate_only_once_the_adapters_placed_here_are_resident(
    gated: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(c, "READY_AFTER_GATE_S", 0.0)  # no kubelet here to call it Ready
    ready = httpx.get(f"{gated.url}/ready", timeout=5)
    assert ready.status_code == 503 and ready.json()["status"] == "prewarming", ready.text
    assert ready.json()["model"]["phase"] == "ready" and ready.json()["prewarm_timeout_seconds"] == 600
    body = {"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    assert httpx.post(f"{gated.url}/v1/completions", json=body, timeout=120).status_code == 200  # served meanwhile

    wants, mine, elsewhere = wants_split()
    server = ServerRef("smollm2", "ml", gated.port, is_gated=True)
    pod = PodInfo(POD, "ml", "smollm2", "uid-new", "127.0.0.1", False, 0, stage="starting", admin_port=ADMIN_PORT)
    other = PodInfo(OTHER, "ml", "smollm2", "uid-old", "127.0.0.2", True, 0)
    seen: dict[str, object] = {}

    async def go() -> str:
        async with make_http_client(timeout_s=30.0) as http:
            ctx = OperatorContext(api=None, http=http)
            rounds: list[asyncio.Task] = []

            def wake() -> None:  # what the woken daemons do: a round of each adapter over the server's pods
                seen["warming"] = sorted(p.name for p in ctx.warming_pods("ml", "smollm2"))
                # only this pod answers here: the rounds run over it alone, placed as among both pods
                for want in wants:
                    spec = {"baseModelServer": "smollm2", "source": want.source, "prewarm": {"tier": want.tier}}
                    if want.replicas and want.adapter_id in mine:
                        spec["prewarm"]["replicas"] = 1
                        one = reconcile.adapter_round(ctx, want.adapter_id, spec, {}, 1, server, [])
                        rounds.append(asyncio.create_task(one))

            inputs = warmer.WarmInputs(wants=lambda: wants, pods=lambda: [pod, other], wake=wake)
            outcome = await warmer.warm_pod(ctx, server, pod, inputs)
            await asyncio.gather(*rounds)
            seen["warming_after"] = dict(ctx.warming)
            seen["warmed"] = dict(ctx.warmed)
            seen["again"] = await warmer.warm_pod(ctx, server, pod, inputs)  # the gate is open: nothing to do
            return outcome

    assert asyncio.run(go()) == "opened"
    assert seen["warming"] == [POD] and seen["warming_after"] == {} and seen["warmed"] == {"uid-new": 0}
    assert seen["again"] == "ready"
    admin_url = f"http://127.0.0.1:{ADMIN_PORT}"
    ready = httpx.get(f"{gated.url}/ready", timeout=5)
    assert ready.status_code == 200 and ready.json() == {**ready.json(), "status": "ready", "prewarm": "operator"}
    rows = {r["id"]: r for r in httpx.get(f"{admin_url}/v1/adapters", timeout=30).json()["data"]}
    in_memory = {a for a, r in rows.items() if r["tier"] in ("device", "host") and r["state"] != "loading"}
    assert {"french", *mine} <= in_memory, rows  # every adapter placed here, before the pod took traffic
    assert not (elsewhere & in_memory) and elsewhere <= set(rows)  # the others registered only, loaded on demand
    again = httpx.post(f"{admin_url}/v1/prewarm/complete", timeout=5).json()
    assert again == {"status": "ready", "opened": False, "outcome": "operator"}  # idempotent


def test_the_admin_routes_answer_on_the_admin_port_alone(gated: ServerProcess) -> None:
    admin_url = f"http://127.0.0.1:{ADMIN_PORT}"
    on_api = httpx.get(f"{gated.url}/v1/adapters", timeout=10)
    assert on_api.status_code == 404 and on_api.json()["error"]["code"] == "wrong_port", on_api.text
    assert f"admin port ({ADMIN_PORT})" in on_api.json()["error"]["message"]
    assert httpx.post(f"{gated.url}/v1/prewarm/complete", timeout=10).status_code == 404
    assert httpx.get(f"{admin_url}/v1/adapters", timeout=10).status_code == 200
    assert httpx.get(f"{admin_url}/v1/debug/engine", timeout=10).status_code == 200
    body = {"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 1}
    refused = httpx.post(f"{admin_url}/v1/completions", json=body, timeout=10)
    assert refused.status_code == 404 and "API port" in refused.json()["error"]["message"]
    assert httpx.post(f"{gated.url}/v1/completions", json=body, timeout=120).status_code == 200
    for probe in ("/health", "/metrics"):  # probes on both
        assert httpx.get(gated.url + probe, timeout=10).status_code == 200
        assert httpx.get(admin_url + probe, timeout=10).status_code == 200


def test_a_server_that_hears_nothing_opens_its_gate_at_the_timeout(tmp_path: Path) -> None:
    proc = start(tmp_path, "timeout", 2)
    try:
        deadline = time.monotonic() + 30
        while httpx.get(f"{proc.url}/ready", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, proc.log()
            time.sleep(0.2)
        assert httpx.get(f"{proc.url}/ready", timeout=5).json()["prewarm"] == "timeout"
        assert "no word that the prewarm is done in 2s" in proc.log()
    finally:
        proc.stop()
