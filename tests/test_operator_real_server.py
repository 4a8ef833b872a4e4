"""The operator's adapter rounds against a real `loraplane serve` (built-in model, the example adapters):
residency follows spec.prewarm.tier both ways through the server's tier route, the status says what the pod
reports, and a refused source fails at once with attempts within the limit (issue 21)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_http_support import REPO, ServerProcess

from loraplane_operator import constants as c
from loraplane_operator import reconcile
from loraplane_operator.admin_client import make_http_client
from loraplane_operator.context import OperatorContext
from loraplane_operator.server_status import PodInfo, ServerRef

ADAPTERS = REPO / "server" / "examples" / "adapters"
POD = "smollm2-a"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("operator-real") / "server.log"
    proc = ServerProcess(["--max-loras", "2", "--adapter-source-allow", str(ADAPTERS)], log)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def run_round(server: ServerProcess, spec: dict[str, Any], status: dict[str, Any], generation: int) -> dict:
    """One adapter round over the single pod; the status it computes."""

    async def go() -> dict:
        async with make_http_client(timeout_s=30.0) as http:
            ctx = OperatorContext(api=None, http=http)
            ref = ServerRef("smollm2", "ml", server.port)
            pod = PodInfo(POD, "ml", "smollm2", "uid-a", "127.0.0.1", True, 0)
            out = await reconcile.adapter_round(ctx, "french", spec, status, generation, ref, [pod])
            return out.status

    return asyncio.run(go())


def pod_row(server: ServerProcess, adapter_id: str) -> dict | None:
    rows = httpx.get(f"{server.url}/v1/adapters", timeout=30).json()["data"]
    return next((r for r in rows if r["id"] == adapter_id), None)


def settle(server: ServerProcess, spec: dict[str, Any], status: dict[str, Any], generation: int) -> dict:
    """Rounds until Ready (a promotion loads in the background), at most 20."""
    for _ in range(20):
        status = {**status, **run_round(server, spec, status, generation)}
        if status["phase"] == c.PHASE_READY:
            return status
    raise AssertionError(f"not Ready: {status}")


def test_residency_follows_the_spec_tier_both_ways(server: ServerProcess) -> None:
    spec = {"baseModelServer": "smollm2", "source": str(ADAPTERS / "french"), "prewarm": {"tier": "device"}}
    status = settle(server, spec, {}, 1)
    assert pod_row(server, "french")["tier"] == "device"
    for generation, tier in enumerate(("host", "disk", "device"), start=2):
        spec = {**spec, "prewarm": {"tier": tier}}
        status = settle(server, spec, status, generation)
        row = pod_row(server, "french")
        assert row["tier"] == tier, row  # the pod holds it there, not only the status
        assert status["residency"][0]["tier"] == tier and status["pods"] == f"{POD}:{tier}"
        assert status["message"] == f"at tier {tier} on 1/1 pods"


def assert_fails_at_once_and_stays_failed(server: ServerProcess, source: str, reason: str) -> None:
    spec = {"baseModelServer": "smollm2", "source": source, "prewarm": {"tier": "host"}, "adapterId": "broken"}
    status = run_round(server, spec, {}, 1)
    assert status["phase"] == c.PHASE_FAILED, status
    assert status["attempts"] == 1 and reason in status["message"], status["message"]
    assert status["message"].endswith(
        "to retry: kubectl annotate lora french -n ml loraplane.dev/retry=$(date +%s) --overwrite"
    )
    for _ in range(3):  # later rounds (even with the backoff long past) only read the pod
        status = {**status, "lastAttemptTime": "2000-01-01T00:00:00Z"}
        status = {**status, **run_round(server, spec, status, 1)}
        assert status["phase"] == c.PHASE_FAILED and status["attempts"] == 1


def test_a_source_outside_the_allowlist_fails_at_once_and_stays_failed(server: ServerProcess) -> None:
    assert_fails_at_once_and_stays_failed(server, "/etc/loraplane-not-allowed", "403")


def test_a_missing_path_fails_at_once(server: ServerProcess) -> None:
    assert_fails_at_once_and_stays_failed(server, str(ADAPTERS / "no-such-adapter"), "does not exist")


def test_a_broken_adapter_fails_without_retries(
    server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The server accepts the source (it exists) and its load fails for good (error_transient False): the next
    round fails the adapter with attempts 1, no backoff and no second load."""
    broken = tmp_path_factory.mktemp("broken") / "adapter"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    (broken / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    tmp_server = ServerProcess(
        ["--max-loras", "2", "--adapter-source-allow", str(broken.parent)], broken.parent / "log"
    )
    try:
        tmp_server.wait_ready()
        spec = {"baseModelServer": "smollm2", "source": str(broken), "prewarm": {"tier": "host"}}
        status: dict[str, Any] = {}
        for _ in range(20):
            status = {**status, **run_round(tmp_server, spec, status, 1)}
            if status["phase"] == c.PHASE_FAILED:
                break
        assert status["phase"] == c.PHASE_FAILED and status["attempts"] == 1, status
        assert "not valid JSON" in status["message"], status["message"]
        assert pod_row(tmp_server, "french")["error_transient"] is False
        status = {**status, "lastAttemptTime": "2000-01-01T00:00:00Z"}  # the backoff long past
        status = {**status, **run_round(tmp_server, spec, status, 1)}
        assert status["phase"] == c.PHASE_FAILED and status["attempts"] == 1
    finally:
        tmp_server.stop()
