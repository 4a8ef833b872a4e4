"""Issue 21's acceptance on the local control plane: residency follows spec.prewarm.tier both ways (device ->
host -> disk -> device, seen in both pods' /v1/adapters and in the status within 10 s), a refused source stays
Failed with bounded attempts, the retry annotation recovers an adapter fixed in place, and a missing path fails
fast with a Warning event. One operator (under the chart's RBAC), one 2-pod server and one namespace for the
module; the tests run in order (a: tiers ... d: missing path) and b's broken adapter fails while b holds."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster import LocalCluster
from e2e.kubectl import Kubectl, KubectlError, wait_until
from e2e.operator_fixtures import (
    OperatorProcess,
    adapter_manifest,
    adapter_rows,
    complete,
    diagnostics,
    install_crds,
    install_operator_rbac,
    local_server_sample,
    ready_server_pods,
    server_pods,
    snapshot_adapters,
)

pytestmark = pytest.mark.e2e

NAMESPACE = "e2e-residency"
SERVER = "residency"
REPLICAS = 2
POD_START_S = 480.0  # the model loads in 10-30 s on 2 shared cores; a first start may build the CPU kernels
STATUS_WITHIN_S = 10.0  # a tier change is on the pods and in the status this soon (the bound)
MISSING_WITHIN_S = 15.0  # a missing local path is Failed, with a Warning event, this soon
FAILED_HOLD_S = 60.0  # a Failed adapter stays Failed, attempts unchanged, this long
RETRY_ANNOTATION = "loraplane.dev/retry"
REFUSED, BROKEN, MISSING, MOVED = "refused", "broken", "missing", "french"


@dataclass
class Env:
    kubectl: Kubectl
    cluster: LocalCluster
    operator: OperatorProcess
    adapters_dir: Path  # allowed on the server (adapterSourceAllow)
    outside_dir: Path  # not allowed

    def lora(self, name: str) -> dict[str, Any]:
        return dict(self.kubectl.json("get", "lora", name, "-n", NAMESPACE))

    def pods(self) -> list[dict[str, Any]]:
        return ready_server_pods(self.kubectl, NAMESPACE, SERVER)

    def apply_adapter(self, name: str, source: Path, tier: str) -> None:
        self.kubectl.apply(adapter_manifest(name, SERVER, str(source), tier=tier), NAMESPACE)


@pytest.fixture(scope="module")
def env(kubectl: Kubectl, cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    install_crds(kubectl)
    kubeconfig = install_operator_rbac(kubectl, cluster)
    work = Path(tmp_path_factory.mktemp("residency"))
    adapters_dir = snapshot_adapters(work / "adapters")
    outside_dir = work / "outside"
    shutil.copytree(adapters_dir / "french", outside_dir / "french")
    operator = OperatorProcess(kubeconfig, work / "operator.log")
    kubectl("create", "namespace", NAMESPACE)
    environment = Env(kubectl, cluster, operator, adapters_dir, outside_dir)
    operator.start()
    try:
        operator.wait_started()
        server = local_server_sample(adapters_dir, replicas=REPLICAS)
        server["metadata"]["name"] = SERVER
        kubectl.apply(server, NAMESPACE)
        _wait_server_ready(environment)
        yield environment
    finally:
        _teardown(environment)


def _wait_server_ready(env: Env) -> None:
    try:
        wait_until(lambda: _server_ready(env), timeout=POD_START_S, what=f"{REPLICAS} Ready pods of {SERVER}")
    except TimeoutError as error:
        raise TimeoutError(f"{error}\n{diagnostics(env.kubectl, env.cluster, env.operator, NAMESPACE)}") from None


def _server_ready(env: Env) -> bool:
    pods = env.pods()
    return len(pods) == REPLICAS and len(server_pods(env.kubectl, NAMESPACE, SERVER)) == REPLICAS


def _teardown(env: Env) -> None:
    """Delete the adapters while the operator runs (it drops the finalizers), else drop them by hand."""
    try:
        env.kubectl("delete", "lora", "--all", "-n", NAMESPACE, "--wait=false")
        wait_until(lambda: not env.kubectl.json("get", "lora", "-n", NAMESPACE)["items"], timeout=60, what="no lora")
    except Exception:  # noqa: BLE001 - never leave the namespace stuck on our finalizers
        for item in env.kubectl.json("get", "lora", "-n", NAMESPACE)["items"]:
            patch = json.dumps({"metadata": {"finalizers": None}})
            try:
                env.kubectl("patch", "lora", item["metadata"]["name"], "-n", NAMESPACE, "--type=merge", "-p", patch)
            except KubectlError:
                pass
    finally:
        env.operator.stop()
        env.kubectl("delete", "namespace", NAMESPACE, "--wait=false")


@pytest.fixture(autouse=True)
def dump_on_failure(request: pytest.FixtureRequest, env: Env) -> Iterator[None]:
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed > failed_before:
        text = diagnostics(env.kubectl, env.cluster, env.operator, NAMESPACE)
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"\n===== diagnostics after {request.node.name} =====\n{text}")


# helpers


def seconds_until(check: Callable[[], Any], start: float, what: str) -> float:
    """Seconds from `start` until `check` holds (polled fast so the measure is close; 60 s at most)."""
    wait_until(check, timeout=60, what=what, interval=0.2)
    return time.monotonic() - start


def pods_at(env: Env, name: str, tier: str) -> bool:
    """Every Ready pod's own /v1/adapters row says ready at exactly `tier` (no move pending)."""
    pods = env.pods()
    if len(pods) != REPLICAS:
        return False
    rows = [adapter_rows(pod).get(name) or {} for pod in pods]
    return all(r.get("state") == "ready" and r.get("tier") == tier and not r.get("target_tier") for r in rows)


def status_at(env: Env, name: str, tier: str) -> bool:
    """The LoRAAdapter's status: Ready for the current generation, every pod's residency at exactly `tier`."""
    lora = env.lora(name)
    status = lora.get("status") or {}
    if status.get("phase") != "Ready" or status.get("observedGeneration") != lora["metadata"]["generation"]:
        return False
    residency = status.get("residency") or []
    pods = sorted(p["metadata"]["name"] for p in env.pods())
    return sorted(e["pod"] for e in residency) == pods and all(e.get("tier") == tier for e in residency)


def failed(env: Env, name: str) -> dict[str, Any] | None:
    lora = env.lora(name)
    return lora if (lora.get("status") or {}).get("phase") == "Failed" else None


def retry_hint(name: str) -> str:
    return f"; to retry: kubectl annotate lora {name} -n {NAMESPACE} {RETRY_ANNOTATION}=$(date +%s) --overwrite"


def max_attempts() -> int:
    from loraplane_operator.constants import MAX_ATTEMPTS

    return int(MAX_ATTEMPTS)


def warning_events(env: Env, name: str) -> list[dict[str, Any]]:
    selector = f"involvedObject.kind=LoRAAdapter,involvedObject.name={name},type=Warning"
    return list(env.kubectl.json("get", "events", "-n", NAMESPACE, "--field-selector", selector)["items"])


def assert_failed_message(lora: dict[str, Any], name: str, reason: str) -> None:
    message = lora["status"].get("message") or ""
    assert reason in message, message
    assert message.endswith(retry_hint(name)), message


# a. residency follows the spec both ways


def test_a_tier_demotes_and_promotes_within_10s(env: Env) -> None:
    env.apply_adapter(MOVED, env.adapters_dir / MOVED, tier="device")
    wait_until(lambda: pods_at(env, MOVED, "device") and status_at(env, MOVED, "device"), 180, "french at device")
    took: dict[str, tuple[float, float]] = {}
    for tier in ("host", "disk", "device"):
        patch = json.dumps({"spec": {"prewarm": {"tier": tier}}})
        env.kubectl("patch", "lora", MOVED, "-n", NAMESPACE, "--type=merge", "-p", patch)
        start = time.monotonic()
        on_pods = seconds_until(partial(pods_at, env, MOVED, tier), start, f"both pods report {MOVED} at {tier}")
        in_status = seconds_until(partial(status_at, env, MOVED, tier), start, f"status says {MOVED} at {tier}")
        took[tier] = (on_pods, in_status)
        # it stays there: the operator neither re-promotes nor reports the goal instead of the pods
        time.sleep(3)
        assert pods_at(env, MOVED, tier) and status_at(env, MOVED, tier), f"{MOVED} left {tier}"
        for pod in env.pods():
            assert adapter_rows(pod)[MOVED]["pinned"] is False
    print(f"seconds from the spec change to (both pods, status) at the tier: {took}")
    slow = {t: s for t, s in took.items() if max(s) > STATUS_WITHIN_S}
    assert not slow, f"(pods, status) seconds after the spec change, over {STATUS_WITHIN_S:.0f}s: {took}"


# b. a refused source: Failed at once, attempts within the limit, and it stays so


def test_b_refused_source_fails_and_stays_failed(env: Env) -> None:
    # the broken adapter of scenario c goes in now: it fails (and backs off, if it retries) during the hold
    broken_dir = env.adapters_dir / BROKEN
    shutil.copytree(env.adapters_dir / "french", broken_dir)
    (broken_dir / "adapter_config.json").write_text('{"peft_type": "LORA", "r": ')  # truncated JSON
    env.apply_adapter(BROKEN, broken_dir, tier="host")

    env.apply_adapter(REFUSED, env.outside_dir / "french", tier="host")
    lora = wait_until(lambda: failed(env, REFUSED), timeout=60, what=f"{REFUSED} Failed")
    status = lora["status"]
    assert status.get("attempts", 0) <= max_attempts(), status
    assert_failed_message(lora, REFUSED, "not allowed")
    held: list[tuple[str, int, str | None]] = []
    deadline = time.monotonic() + FAILED_HOLD_S
    while time.monotonic() < deadline:
        time.sleep(5)
        now = env.lora(REFUSED)["status"]
        held.append((now["phase"], now.get("attempts", 0), now.get("lastAttemptTime")))
    assert set(held) == {("Failed", status.get("attempts", 0), status.get("lastAttemptTime"))}, held
    for pod in env.pods():
        row = adapter_rows(pod).get(REFUSED)
        assert row is None or row["state"] != "ready", row


# c. a broken adapter, fixed in place, recovers through the retry annotation


def test_c_fixed_adapter_recovers_with_retry_annotation(env: Env) -> None:
    lora = wait_until(lambda: failed(env, BROKEN), timeout=150, what=f"{BROKEN} Failed", interval=1)
    attempts = lora["status"].get("attempts", 0)
    assert attempts <= max_attempts(), lora["status"]
    assert lora["status"]["message"].endswith(retry_hint(BROKEN)), lora["status"]["message"]
    time.sleep(20)  # longer than a residency round: a Failed adapter is not re-sent, nor recovered on its own
    assert failed(env, BROKEN) and env.lora(BROKEN)["status"].get("attempts", 0) == attempts

    shutil.copy2(env.adapters_dir / "french" / "adapter_config.json", env.adapters_dir / BROKEN)
    start = time.monotonic()
    env.kubectl("annotate", "lora", BROKEN, "-n", NAMESPACE, f"{RETRY_ANNOTATION}=fixed-1", "--overwrite")
    wait_until(lambda: pods_at(env, BROKEN, "host") and status_at(env, BROKEN, "host"), 60, f"{BROKEN} Ready")
    print(f"{BROKEN}: Ready on both pods {time.monotonic() - start:.1f}s after the retry annotation")
    status = env.lora(BROKEN)["status"]
    assert status["observedRetry"] == "fixed-1", status
    assert not status.get("attempts"), status
    for pod in env.pods():  # the same weights as french now: the same greedy answer
        assert complete(pod, BROKEN, "Hello, my name is") == complete(pod, MOVED, "Hello, my name is")


# d. a local path that does not exist fails fast, with a Warning event


def test_d_missing_path_fails_within_15s_with_warning(env: Env) -> None:
    start = time.monotonic()
    env.apply_adapter(MISSING, env.adapters_dir / "does-not-exist", tier="host")
    lora = wait_until(lambda: failed(env, MISSING), timeout=60, what=f"{MISSING} Failed", interval=0.2)
    failed_after = time.monotonic() - start
    events = wait_until(lambda: warning_events(env, MISSING), timeout=30, what=f"a Warning event on {MISSING}")
    warned_after = time.monotonic() - start
    print(f"{MISSING}: Failed after {failed_after:.1f}s, a Warning event after {warned_after:.1f}s")
    assert max(failed_after, warned_after) <= MISSING_WITHIN_S, (
        f"Failed {failed_after:.1f}s, Warning {warned_after:.1f}s"
    )
    assert_failed_message(lora, MISSING, "does not exist")
    assert lora["status"].get("attempts", 0) <= max_attempts(), lora["status"]
    assert any("does not exist" in (e.get("message") or "") for e in events), events
