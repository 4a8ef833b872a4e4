"""Status logic of the operator: per-pod plans, phase and residency aggregation from mixed admin API rows,
retries and backoff, the BaseModelServer status with its model's phase (start-up failures, /ready reports read
over real HTTP), and one full adapter round against real HTTP pods."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loraplane_operator import adapter_status as st
from loraplane_operator import builders, reconcile
from loraplane_operator import constants as c
from loraplane_operator.admin_client import make_http_client
from loraplane_operator.context import OperatorContext, ResidencyCache
from loraplane_operator.server_status import (
    ModelReport,
    PodInfo,
    ServerRef,
    current_pods,
    draft_model_status,
    failure_line,
    is_starting,
    last_start_failure,
    model_phase,
    model_report,
    model_status,
    pod_info,
    progress_text,
    ready_pods,
    server_phase,
    server_ref,
    server_status,
    start_failure,
)
from loraplane_server.serving.router.ranking import rank

NOW = "2025-01-01T00:00:10Z"
WANT = st.AdapterWant("french", "/opt/a/french", "host")


def row(state: str = "ready", tier: str = "host", **extra) -> dict:
    return {"id": "french", "source": "/opt/a/french", "state": state, "tier": tier, **extra}


def result(pod: str, r: dict | None, tier: str = "host", error: str | None = None) -> st.PodResult:
    return st.PodResult(pod, tier, r, error)


# spec
def test_adapter_want_defaults():
    want = st.adapter_want("french", {"source": "/s"})
    assert want == st.AdapterWant("french", "/s", "host", False, None)
    spec = {"source": "hf://o/r", "adapterId": "fr", "prewarm": {"tier": "device", "replicas": 2}, "pinned": True}
    assert st.adapter_want("french", spec) == st.AdapterWant("fr", "hf://o/r", "device", True, 2)
    assert st.adapter_want("x", {"source": "/s", "prewarm": {"tier": "none", "replicas": 2}}).replicas is None


# per pod
@pytest.mark.parametrize(
    ("r", "tier", "expected"),
    [
        (None, "host", "missing"),
        (row("loading", "disk"), "host", "loading"),
        (row("failed", "disk", last_error="bad shapes"), "host", "failed"),
        (row("ready", "host"), "host", "ready"),
        (row("ready", "device"), "host", "off"),  # warmer than the goal: demoted, not "reached"
        (row("ready", "disk"), "host", "off"),  # colder (moved down by the LRU): promoted again
        (row("ready", "device", target_tier="host"), "host", "moving"),  # demotion waits for requests
        (row("ready", "device", target_tier="disk"), "host", "off"),  # moving elsewhere: not the goal
        (row("registered", "disk"), "host", "off"),
        (row("registered", "disk"), "disk", "ready"),
        (row("registered", "source"), "none", "ready"),
        (row("registered", "source"), "disk", "off"),
    ],
)
def test_pod_condition(r, tier, expected):
    assert st.pod_condition(r, tier) == expected


def test_needs_prewarm():
    assert st.needs_prewarm(None, "host", force=False, can_retry=True)
    assert not st.needs_prewarm(None, "host", force=False, can_retry=False)  # out of attempts or Failed: not re-sent
    assert not st.needs_prewarm(row("registered", "disk"), "host", force=False, can_retry=True)  # a tier call
    assert not st.needs_prewarm(row("ready", "host"), "host", force=False, can_retry=True)
    assert st.needs_prewarm(row("ready", "host"), "host", force=True, can_retry=True)
    assert not st.needs_prewarm(row("loading", "disk"), "host", force=False, can_retry=True)
    assert st.needs_prewarm(row("failed"), "host", force=False, can_retry=True)
    assert not st.needs_prewarm(row("failed"), "host", force=True, can_retry=False)
    refused = row("failed", "source", error_transient=False)  # the server says only a new source can fix it
    assert not st.needs_prewarm(refused, "host", force=False, can_retry=True)
    assert st.needs_prewarm(refused, "host", force=True, can_retry=True)  # a spec change or a retry re-sends it


@pytest.mark.parametrize(
    ("r", "tier", "exact", "relaxed"),
    [
        (row("ready", "device"), "host", True, False),  # warmer: demote until settled, then a floor
        (row("ready", "device"), "disk", True, False),
        (row("ready", "host"), "device", True, True),  # colder: promote, always
        (row("ready", "disk"), "device", True, True),
        (row("registered", "source"), "disk", True, True),
        (row("ready", "host"), "host", False, False),
        (row("ready", "device", target_tier="host"), "host", False, False),  # already moving there
        (row("ready", "device", target_tier="disk"), "host", True, True),  # moving past the goal
        (row("ready", "device"), "none", True, False),  # registered only: demoted to disk at most
        (row("ready", "host"), "none", True, False),
        (row("ready", "disk"), "none", False, False),
        (row("registered", "source"), "none", False, False),
        (row("loading", "disk"), "host", False, False),
        (row("failed", "source"), "host", False, False),  # a failed load is registered again, not moved
        (None, "host", False, False),
    ],
)
def test_tier_goal_exact_until_settled_then_a_floor(r, tier, exact, relaxed):
    assert st.needs_tier_call(r, tier) is exact
    assert st.needs_tier_call(r, tier, exact=False) is relaxed


def test_reached_and_goal_tier():
    assert st.reached(row("ready", "host"), "host") and st.reached(row("ready", "device"), "host", exact=False)
    assert not st.reached(row("ready", "device"), "host") and not st.reached(row("ready", "disk"), "host", exact=False)
    moving = row("ready", "device", target_tier="host")  # a demotion waiting for running requests
    assert st.pod_condition(moving, "host") == "moving" and st.pod_condition(moving, "host", exact=False) == "ready"
    assert st.reached(row("ready", "device"), "none", exact=False) and not st.reached(row("ready", "device"), "none")
    assert st.goal_tier("none") == "disk" and st.goal_tier("device") == "device"
    assert st.is_moving(row("ready", "device", target_tier="disk"), "none")


def test_choose_tiers_all_or_the_first_n_of_the_ranking():
    pods = ["p-a", "p-b", "p-c"]
    assert st.choose_tiers(pods, WANT) == {p: "host" for p in pods}
    two = st.AdapterWant("french", "/s", "host", replicas=2)
    chosen = st.choose_tiers(pods, two)
    assert [p for p in rank("french", pods) if chosen[p] == "host"] == rank("french", pods)[:2]
    assert sorted(chosen.values()) == ["host", "host", "none"]
    other = st.AdapterWant("german", "/s", "disk", replicas=1)
    assert [p for p, t in st.choose_tiers(pods, other).items() if t == "disk"] == rank("german", pods)[:1]
    assert st.choose_tiers(pods[:1], two) == {"p-a": "host"}


def test_a_gated_pod_waits_for_the_adapters_placed_on_it_at_their_tier_or_warmer():
    pods = ["p-a", "p-b", "p-c"]
    everywhere = st.AdapterWant("french", "/s", "host")
    one = [st.AdapterWant(f"t-{i}", "/s", "device", replicas=1) for i in range(12)]
    mine = sorted(w.adapter_id for w in one if rank(w.adapter_id, pods)[0] == "p-b")
    assert mine and len(mine) < len(one)  # the ranking puts some here, the rest elsewhere
    wants = [everywhere, *one]
    assert st.prewarm_pending("p-b", pods, wants, {}) == sorted(["french", *mine])
    rows = {"french": row("ready", "device")} | {a: row("ready", "device") for a in mine[1:]}
    rows[mine[0]] = row("loading", "host")
    assert st.prewarm_pending("p-b", pods, wants, rows) == [mine[0]]  # french warmer than host counts
    rows[mine[0]] = {**row("failed", "source"), "last_error": "broken"}  # its own status says why
    assert st.prewarm_pending("p-b", pods, wants, rows) == []
    colder = {**rows, "french": row("ready", "disk")}
    assert st.prewarm_pending("p-b", pods, wants, colder) == ["french"]
    registered_only = {w.adapter_id: row("registered", "source") for w in one}
    assert st.prewarm_pending("p-a", pods, one, registered_only) == sorted(
        w.adapter_id for w in one if rank(w.adapter_id, pods)[0] == "p-a"
    )


def test_backoff_and_retry_budget():
    assert [st.backoff_s(n) for n in range(1, 6)] == [5, 10, 20, 40, 80]
    assert st.backoff_s(50) == c.BACKOFF_MAX_S
    assert st.can_retry(0, None) and st.can_retry(2, 10.0)
    assert not st.can_retry(2, 9.0)
    assert not st.can_retry(c.MAX_ATTEMPTS, 10_000.0)
    assert st.next_attempts(3, has_failure=False, retried=True) == 0
    assert st.next_attempts(3, has_failure=True, retried=True) == 4
    assert st.next_attempts(3, has_failure=True, retried=False) == 3
    assert st.next_attempts(c.MAX_ATTEMPTS, has_failure=True, retried=True) == c.MAX_ATTEMPTS  # never past it
    assert st.next_attempts(3, has_failure=False, retried=False, is_loading=True) == 3  # a re-sent load runs
    failed, refused = row("failed", "source"), row("failed", "source", error_transient=False)
    assert st.failed_load_action(refused, 0, True) == "refused"
    assert st.failed_load_action(failed, 0, True) == "retry"
    assert st.failed_load_action(failed, 2, False) == "wait"
    assert st.failed_load_action(failed, c.MAX_ATTEMPTS - 1, True) == "give_up"  # this one uses the last attempt
    assert not st.can_retry(0, None, is_failed=True)


# aggregation
def status_of(results, want=WANT, attempts=0, previous=None, generation=2, **extra):
    return st.adapter_status(
        results,
        want,
        previous or {},
        name="french",
        attempts=attempts,
        last_attempt=None,
        generation=generation,
        now=NOW,
        **extra,
    )


def test_all_ready():
    s = status_of([result("p-a", row(rank=8, size_bytes=1234)), result("p-b", row(tier="host"))])
    assert s["phase"] == "Ready"
    assert (s["readyReplicas"], s["desiredReplicas"], s["ready"]) == (2, 2, "2/2")
    assert s["rank"] == 8 and s["sizeBytes"] == 1234
    assert s["observedGeneration"] == 2 and s["attempts"] == 0
    assert [e["pod"] for e in s["residency"]] == ["p-a", "p-b"]
    assert s["residency"][1] == {"pod": "p-b", "tier": "host", "state": "ready", "since": NOW}
    assert s["pods"] == "p-a:host,p-b:host" and s["message"] == "at tier host on 2/2 pods"
    (cond,) = s["conditions"]
    assert cond["type"] == "Ready" and cond["status"] == "True" and cond["reason"] == "Ready"


def test_status_reports_what_the_pods_report_never_the_goal():
    """Issue 21: a pod still at device after the spec asked for host is not counted at host."""
    s = status_of([result("p-a", row(tier="host")), result("p-b", row("ready", "device", target_tier="host"))])
    assert s["phase"] == "Loading" and s["ready"] == "1/2" and "at tier host" not in s["message"]
    assert [e["tier"] for e in s["residency"]] == ["host", "device"]
    assert s["pods"] == "p-a:host,p-b:device"


def test_mixed_loading():
    s = status_of([result("p-a", row()), result("p-b", row("loading", "disk"))])
    assert s["phase"] == "Loading" and s["ready"] == "1/2"
    assert s["conditions"][0]["status"] == "False"


def test_mixed_ready_and_failed_is_degraded():
    results = [
        result("p-a", row()),
        result("p-b", row("failed", "source", last_error="rank 128 > max 64")),
        result("p-c", None, error="GET http://10.0.0.3:8080/v1/adapters: ConnectError"),
    ]
    s = status_of(results, attempts=1)
    assert s["phase"] == "Degraded" and s["ready"] == "1/3"
    assert "rank 128 > max 64" in s["message"] and "2/3 pods" in s["message"]
    by_pod = {e["pod"]: e for e in s["residency"]}
    assert by_pod["p-b"]["lastError"] == "rank 128 > max 64" and by_pod["p-b"]["state"] == "failed"
    assert by_pod["p-c"]["state"] == "error" and by_pod["p-c"]["tier"] == "none"


def test_all_failed_retries_then_fails():
    results = [result("p-a", row("failed", "source", last_error="not a PEFT adapter"))]
    retrying = status_of(results, attempts=2)
    assert retrying["phase"] == "Loading" and "retrying (attempt 2/5)" in retrying["message"]
    failed = status_of(results, attempts=c.MAX_ATTEMPTS)
    assert failed["phase"] == "Failed"
    assert "not a PEFT adapter" in failed["message"] and "after 5 attempts" in failed["message"]
    assert failed["message"].endswith(
        "; to retry: kubectl annotate lora french loraplane.dev/retry=$(date +%s) --overwrite"
    )
    assert failed["conditions"][0]["reason"] == "Failed"


def test_out_of_attempts_is_not_failed_while_a_pod_still_loads():
    """A pod that joined after the retries ran out (or is still loading) keeps the adapter out of Failed."""
    broken = result("p-a", row("failed", "source", last_error="not a PEFT adapter"))
    for late in (result("p-b", row("loading", "disk")), result("p-b", None)):
        s = status_of([broken, late], attempts=c.MAX_ATTEMPTS)
        assert s["phase"] == "Loading" and "not a PEFT adapter" in s["message"]
    both_failed = [broken, result("p-b", row("failed", "source", last_error="not a PEFT adapter"))]
    assert status_of(both_failed, attempts=c.MAX_ATTEMPTS)["phase"] == "Failed"


def test_a_permanent_refusal_fails_at_once_with_the_reason():
    refused = st.PodResult("p-a", "host", None, "POST /v1/adapters: 403 source not allowed", True, permanent=True)
    s = status_of([refused, result("p-b", row("loading", "disk"))], attempts=1)
    assert s["phase"] == "Failed" and s["attempts"] == 1
    assert "refused on 1/2 pods: POST /v1/adapters: 403 source not allowed" in s["message"]
    assert s["message"].endswith("--overwrite")
    transient = st.PodResult("p-a", "host", None, "POST /v1/adapters: 503 busy", True)
    assert status_of([transient], attempts=1)["phase"] == "Loading"


def test_a_failed_adapter_stays_failed_and_records_the_retry():
    previous = {"phase": "Failed", "message": "refused on 1/1 pods: 403; to retry: ..."}
    s = status_of([result("p-a", None)], previous=previous, attempts=1, stay_failed=True, retry="7")
    assert (s["phase"], s["message"], s["attempts"]) == ("Failed", previous["message"], 1)
    assert s["observedRetry"] == "7" and s["conditions"][0]["reason"] == "Failed"
    assert "observedRetry" not in status_of([result("p-a", row())])


def test_replicas_counts_only_the_chosen_pods():
    want = st.AdapterWant("french", "/s", "device", replicas=1)
    results = [result("p-a", row(tier="device"), "device"), result("p-b", row("registered", "source"), "none")]
    s = status_of(results, want)
    assert s["phase"] == "Ready" and s["ready"] == "1/1"
    assert len(s["residency"]) == 2


def test_since_and_transition_time_are_kept_while_unchanged():
    earlier = "2025-01-01T00:00:00Z"
    previous = status_of([result("p-a", row())])
    previous["residency"][0]["since"] = earlier
    previous["conditions"][0]["lastTransitionTime"] = earlier
    again = status_of([result("p-a", row()), result("p-b", row("loading", "disk"))], previous=previous)
    assert again["residency"][0]["since"] == earlier and again["residency"][1]["since"] == NOW
    assert again["conditions"][0]["lastTransitionTime"] == NOW  # Ready flipped to False
    device = st.AdapterWant("french", "/opt/a/french", "device")
    moved = status_of([result("p-a", row(tier="device"), "device")], want=device, previous=previous)
    assert moved["residency"][0]["since"] == NOW
    assert moved["conditions"][0]["lastTransitionTime"] == earlier  # still Ready


def test_pending_status():
    s = st.pending_status("no Ready pod of BaseModelServer 'smollm2' yet", {}, 1, NOW)
    assert s["phase"] == "Pending" and s["ready"] == "0/0" and s["residency"] == []


def test_status_patch_sends_only_changes_and_removals():
    current = {"phase": "Loading", "message": "loading", "attempts": 1, "kopf": {"progress": {}}}
    desired = {"phase": "Ready", "message": "loading"}
    assert st.status_patch(current, desired, st.ADAPTER_STATUS_KEYS) == {"phase": "Ready", "attempts": None}
    maps = st.status_patch({"endpoints": {"a": "u1", "b": "u2"}}, {"endpoints": {"a": "u1"}}, frozenset())
    assert maps == {"endpoints": {"a": "u1", "b": None}}
    assert st.status_patch(desired, desired, st.ADAPTER_STATUS_KEYS) == {}


# BaseModelServer
def pod_body(name: str, ready: bool = True, ip: str | None = "10.0.0.1", restarts: int = 0) -> dict:
    return {
        "metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}", "labels": {c.SERVER_LABEL: "smollm2"}},
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [{"name": "server", "restartCount": restarts}],
        },
    }


def test_warming_pods_count_for_placement_and_starting_pods_are_found():
    ready, starting = pod_info(pod_body("p-a")), pod_info(pod_body("p-b", ready=False))
    assert [p.name for p in ready_pods([ready, starting])] == ["p-a"]
    assert [p.name for p in ready_pods([ready, starting], [starting])] == ["p-a", "p-b"]
    assert [p.name for p in ready_pods([ready], [replace(ready, is_ready=False)])] == ["p-a"]  # one per name
    running = pod_body("p-c", ready=False)
    running["status"]["containerStatuses"][0]["state"] = {"running": {}}
    assert is_starting(pod_info(running))
    assert not is_starting(pod_info(pod_body("p-d", ready=False)))  # no container running yet
    running["metadata"]["deletionTimestamp"] = NOW
    assert not is_starting(pod_info(running))  # terminating


def test_pod_info():
    info = pod_info(pod_body("smollm2-a", restarts=2))
    assert info == PodInfo("smollm2-a", "ml", "smollm2", "uid-smollm2-a", "10.0.0.1", True, 2)
    assert info.url(8080) == "http://10.0.0.1:8080"
    assert not pod_info(pod_body("b", ready=False)).is_ready
    assert not pod_info(pod_body("c", ip=None)).is_ready
    terminating = pod_body("d")
    terminating["metadata"]["deletionTimestamp"] = NOW
    assert not pod_info(terminating).is_ready
    assert pod_info({"metadata": {"name": "other", "labels": {}}}) is None


def deployment(replicas: int, ready: int, updated: int | None = None, conditions: list | None = None) -> dict:
    status = {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": replicas if updated is None else updated}
    return {"spec": {"replicas": replicas}, "status": {**status, "conditions": conditions or []}}


@pytest.mark.parametrize(
    ("dep", "phase"),
    [
        (None, "Pending"),
        (deployment(2, 0), "Pending"),
        (deployment(2, 2), "Ready"),
        (deployment(2, 1, updated=1), "Progressing"),
        (deployment(2, 1), "Degraded"),
        (deployment(2, 1, conditions=[{"type": "Progressing", "reason": "ProgressDeadlineExceeded"}]), "Failed"),
        (deployment(0, 0), "Ready"),
    ],
)
def test_server_phase(dep, phase):
    desired = (dep or {}).get("spec", {}).get("replicas", 2)
    assert server_phase(dep, desired)[0] == phase


def test_server_status():
    bms = {"metadata": {"name": "smollm2", "namespace": "ml", "generation": 4}, "spec": {"port": 9000}}
    pods = [pod_info(pod_body("smollm2-b", ip="10.0.0.2")), pod_info(pod_body("smollm2-a", ready=False))]
    s = server_status(bms, deployment(2, 1), pods, {}, NOW)
    assert s["phase"] == "Degraded" and (s["replicas"], s["readyReplicas"]) == (2, 1)
    assert s["endpoints"] == {"smollm2-b": "http://10.0.0.2:9000"}
    assert s["selector"] == f"{c.NAME_LABEL}=loraplane-server,{c.SERVER_LABEL}=smollm2"
    assert s["conditions"][0]["status"] == "False" and s["conditions"][0]["observedGeneration"] == 4
    assert s["autoscaling"] == "off"  # the AUTOSCALING column: not the defaulted spec.autoscaling.kind


@pytest.mark.parametrize(
    ("autoscaling", "expected"),
    [
        (None, "off"),
        ({"enabled": False, "kind": "hpa", "minReplicas": 6}, "off"),
        ({"enabled": True, "kind": "hpa"}, "hpa"),
        ({"enabled": True, "kind": "keda"}, "keda"),
        ({"enabled": True}, "hpa"),
    ],
)
def test_autoscaling_column(autoscaling, expected):
    bms = {"metadata": {"name": "smollm2", "namespace": "ml"}, "spec": {"autoscaling": autoscaling}}
    assert server_status(bms, deployment(1, 1), [], {}, NOW)["autoscaling"] == expected
    ref = server_ref({**bms, "spec": {"adminTokenSecretRef": {"name": "admin"}}})
    assert ref == ServerRef("smollm2", "ml", 8080, "admin", "token", is_gated=True)


# caches
def test_residency_cache_single_flight_and_ttl():
    clock = [0.0]
    cache = ResidencyCache(ttl_s=5.0, clock=lambda: clock[0])
    calls = []

    async def fetch():
        calls.append(1)
        await asyncio.sleep(0.01)
        return [row()]

    async def go():
        many = await asyncio.gather(*(cache.rows("http://p", fetch) for _ in range(20)))
        assert all(m == {"french": row()} for m in many)
        clock[0] = 4.0
        await cache.rows("http://p", fetch)
        assert len(calls) == 1
        cache.put("http://p", row("loading", "disk"))
        assert (await cache.rows("http://p", fetch))["french"]["state"] == "loading"
        clock[0] = 6.0
        await cache.rows("http://p", fetch)
        assert len(calls) == 2
        cache.drop("http://p")
        await cache.rows("http://p", fetch)
        assert len(calls) == 3

    asyncio.run(go())


# one round against real HTTP pods
class FakePod:
    """A scripted pod admin API: POST registers the adapter at the asked tier, or fails it when told to."""

    def __init__(self, fail_with: str | None = None) -> None:
        self.fail_with = fail_with
        self.background = False  # with fail_with: POST answers "loading", the failed row shows on the next read
        self.transient: bool | None = None  # the failed row's error_transient (None: absent)
        self.refuse: int | None = None  # answer POST /v1/adapters with this 4xx/5xx (e.g. 403 not allowed)
        self.tier_calls: list[tuple[str, str]] = []
        self.delete_status: int | None = None  # e.g. 409 while "requests use it"
        self.deletes: list[str] = []
        self.adapters: dict[str, dict] = {}
        self.posts: list[dict] = []
        handler = self._handler()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.port = self.server.server_address[1]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        pod = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send(200, {"object": "list", "data": list(pod.adapters.values())})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                if self.path.endswith("/tier"):  # exactly that tier (the server's demotion path)
                    adapter_id = self.path.split("/")[3]
                    pod.tier_calls.append((adapter_id, body["tier"]))
                    pod.adapters[adapter_id]["tier"] = body["tier"]
                    self._send(200, {**pod.adapters[adapter_id], "target_tier": None})
                    return
                pod.posts.append(body)
                if pod.refuse:
                    self._send(pod.refuse, {"error": {"message": f"adapter source {body.get('source')!r} refused"}})
                    return
                tier = body["tier"] if body["tier"] != "none" else "source"
                state = "registered" if body["tier"] == "none" else "ready"
                r = {"id": body["id"], "source": body.get("source"), "state": state, "tier": tier, "rank": 8}
                if pod.fail_with:
                    r.update(state="failed", tier="source", last_error=pod.fail_with)
                    if pod.transient is not None:
                        r["error_transient"] = pod.transient
                old = pod.adapters.get(body["id"]) or {}
                if c.TIER_RANK.get(old.get("tier", "none"), 3) < c.TIER_RANK[body["tier"]]:
                    r["tier"] = old["tier"]  # POST /v1/adapters loads to at least the tier: it never demotes
                pod.adapters[body["id"]] = r
                answer = {**r, "state": "loading", "tier": "source"} if pod.fail_with and pod.background else r
                self._send(200, {k: v for k, v in answer.items() if not (pod.background and k == "last_error")})

            def do_DELETE(self) -> None:
                adapter_id = self.path.rsplit("/", 1)[-1]
                pod.deletes.append(adapter_id)
                if pod.delete_status:
                    self._send(pod.delete_status, {"error": {"message": f"adapter {adapter_id!r} is in use"}})
                    return
                found = pod.adapters.pop(adapter_id, None)
                self._send(200 if found else 404, {"deleted": bool(found)})

            def log_message(self, *args) -> None:
                pass

        return Handler

    def info(self, name: str) -> PodInfo:
        return PodInfo(name, "ml", "smollm2", f"uid-{name}", "127.0.0.1", True, 0)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_pods():
    pods: list[FakePod] = []

    def make(fail_with: str | None = None) -> FakePod:
        pods.append(FakePod(fail_with))
        return pods[-1]

    yield make
    for p in pods:
        p.close()


def run_round(pods: list[tuple[str, FakePod]], spec: dict, status: dict, generation: int = 1, retry: str | None = None):
    """adapter_round with each pod on its own port (the port is per server, so one server per pod here)."""

    async def go():
        async with make_http_client(timeout_s=5.0) as http:
            ctx = OperatorContext(api=None, http=http)
            outs = []
            for name, pod in pods:
                server = ServerRef("smollm2", "ml", pod.port)
                outs.append(
                    await reconcile.adapter_round(
                        ctx, "french", spec, status, generation, server, [pod.info(name)], retry
                    )
                )
            return outs

    return asyncio.run(go())


SPEC = {"baseModelServer": "smollm2", "source": "/opt/a/french", "prewarm": {"tier": "device"}, "pinned": True}


def test_round_prewarms_a_fresh_pod_then_settles(fake_pods):
    pod = fake_pods()
    (out,) = run_round([("smollm2-a", pod)], SPEC, {})
    assert pod.posts == [{"id": "french", "source": "/opt/a/french", "tier": "device", "pinned": True}]
    assert out.status["phase"] == "Ready" and out.status["ready"] == "1/1"
    assert out.status["residency"][0]["tier"] == "device" and out.status["rank"] == 8
    assert out.delay_s == c.ADAPTER_RESYNC_S
    (again,) = run_round([("smollm2-a", pod)], SPEC, out.status)
    assert len(pod.posts) == 1  # same generation, already resident: no second POST
    assert again.status["phase"] == "Ready"
    run_round([("smollm2-a", pod)], SPEC, out.status, generation=2)
    assert len(pod.posts) == 2  # a spec change re-sends it


def test_round_counts_failures_and_stops_retrying(fake_pods):
    pod = fake_pods(fail_with="adapter rank 128 exceeds --max-lora-rank 64")
    status: dict = {}
    for attempt in range(1, c.MAX_ATTEMPTS + 1):
        status = {**status, "lastAttemptTime": "2000-01-01T00:00:00Z"} if status else status
        (out,) = run_round([("smollm2-a", pod)], SPEC, status)
        status = out.status
        assert status["attempts"] == attempt
    assert status["phase"] == "Failed" and "exceeds --max-lora-rank" in status["message"]
    posts = len(pod.posts)
    (out,) = run_round([("smollm2-a", pod)], SPEC, {**status, "lastAttemptTime": "2000-01-01T00:00:00Z"})
    assert len(pod.posts) == posts and out.status["phase"] == "Failed"  # retries stopped
    (fresh,) = run_round([("smollm2-a", pod)], SPEC, status, generation=2)
    assert len(pod.posts) == posts + 1 and fresh.status["attempts"] == 1  # a new spec starts over


def test_round_demotes_and_promotes_to_exactly_the_spec_tier(fake_pods):
    """Issue 21: device -> host -> disk -> device, each a tier call, the status what the pod then reports."""
    pod = fake_pods()
    (out,) = run_round([("smollm2-a", pod)], SPEC, {})
    for generation, tier in enumerate(("host", "disk", "device"), start=2):
        spec = {**SPEC, "prewarm": {"tier": tier}}
        (out,) = run_round([("smollm2-a", pod)], spec, out.status, generation=generation)
        assert pod.adapters["french"]["tier"] == tier  # a demotion by the tier call, a promotion by either
        assert out.status["residency"][0]["tier"] == tier and out.status["pods"] == f"smollm2-a:{tier}"
        assert out.status["phase"] == "Ready" and out.status["message"] == f"at tier {tier} on 1/1 pods"
    assert pod.tier_calls == [("french", "host"), ("french", "disk")]
    pod.adapters["french"]["tier"] = "host"  # the LRU moved it down: the next timer round promotes it
    (out,) = run_round([("smollm2-a", pod)], {**SPEC, "prewarm": {"tier": "device"}}, out.status, generation=4)
    assert pod.tier_calls[-1] == ("french", "device") and out.status["residency"][0]["tier"] == "device"


def test_a_refused_source_fails_at_once_and_is_not_resent(fake_pods):
    pod = fake_pods()
    pod.refuse = 403
    (out,) = run_round([("smollm2-a", pod)], SPEC, {})
    assert out.status["phase"] == "Failed" and out.status["attempts"] == 1
    assert "403" in out.status["message"] and "refused" in out.status["message"]
    assert out.status["message"].endswith("loraplane.dev/retry=$(date +%s) --overwrite")
    for _ in range(3):  # later rounds only read: attempts stay, nothing is re-sent
        (out,) = run_round([("smollm2-a", pod)], SPEC, {**out.status, "lastAttemptTime": "2000-01-01T00:00:00Z"})
    assert len(pod.posts) == 1 and out.status["phase"] == "Failed" and out.status["attempts"] == 1


def test_transient_refusals_retry_up_to_the_limit(fake_pods):
    pod = fake_pods()
    pod.refuse = 503
    status: dict = {}
    for _ in range(c.MAX_ATTEMPTS + 3):
        (out,) = run_round([("smollm2-a", pod)], SPEC, {**status, "lastAttemptTime": "2000-01-01T00:00:00Z"})
        status = out.status
        assert status["attempts"] <= c.MAX_ATTEMPTS
    assert status["phase"] == "Failed" and len(pod.posts) == c.MAX_ATTEMPTS


def test_background_load_failures_are_counted_and_retries_stop(fake_pods):
    """The server answers a prewarm with "loading" and the load fails later: each failure read is an attempt,
    re-sent after the backoff, until the limit; then Failed and never re-sent."""
    pod = fake_pods(fail_with="adapter_model.safetensors: connection reset")
    pod.background = True
    status: dict = {}
    for _ in range(2 * c.MAX_ATTEMPTS + 2):
        (out,) = run_round([("smollm2-a", pod)], SPEC, {**status, "lastAttemptTime": "2000-01-01T00:00:00Z"})
        status = out.status
        assert status["attempts"] <= c.MAX_ATTEMPTS
    assert status["phase"] == "Failed" and status["attempts"] == c.MAX_ATTEMPTS, status
    assert "connection reset" in status["message"] and len(pod.posts) == c.MAX_ATTEMPTS


def test_background_failures_wait_for_the_backoff(fake_pods):
    pod = fake_pods(fail_with="503 from the store")
    pod.background = True
    (first,) = run_round([("smollm2-a", pod)], SPEC, {})
    (second,) = run_round([("smollm2-a", pod)], SPEC, first.status)  # failed: counted and re-sent at once
    assert second.status["attempts"] == 1 and len(pod.posts) == 2
    (third,) = run_round([("smollm2-a", pod)], SPEC, second.status)  # failed again, within the backoff
    assert len(pod.posts) == 2 and third.status["attempts"] == 1
    assert third.status["phase"] == "Loading" and "retrying (attempt 1/5)" in third.status["message"]


def test_a_permanent_background_failure_fails_at_once(fake_pods):
    pod = fake_pods(fail_with="adapter_config.json: not valid JSON")
    pod.background, pod.transient = True, False
    (first,) = run_round([("smollm2-a", pod)], SPEC, {})
    assert first.status["phase"] == "Loading" and first.status["attempts"] == 0
    (out,) = run_round([("smollm2-a", pod)], SPEC, first.status)
    assert out.status["phase"] == "Failed" and out.status["attempts"] == 1 and "not valid JSON" in out.status["message"]
    for _ in range(3):
        (out,) = run_round([("smollm2-a", pod)], SPEC, {**out.status, "lastAttemptTime": "2000-01-01T00:00:00Z"})
    assert len(pod.posts) == 1 and out.status["phase"] == "Failed"


def test_once_settled_the_tier_is_a_floor(fake_pods):
    """Traffic warmed the adapter past the spec's tier: left so; fallen below it: promoted back; a new tier in
    the spec: exactly that tier again."""
    pod = fake_pods()
    spec = {**SPEC, "prewarm": {"tier": "host"}}
    (out,) = run_round([("smollm2-a", pod)], spec, {})
    assert out.status["phase"] == "Ready" and out.status["settledGeneration"] == 1
    pod.adapters["french"]["tier"] = "device"  # a request promoted it
    (out,) = run_round([("smollm2-a", pod)], spec, out.status)
    assert pod.tier_calls == [] and out.status["phase"] == "Ready"
    assert out.status["message"] == "at tier host or warmer on 1/1 pods" and out.status["pods"] == "smollm2-a:device"
    pod.adapters["french"]["tier"] = "disk"  # the host cache's LRU let it fall
    (out,) = run_round([("smollm2-a", pod)], spec, out.status)
    assert pod.tier_calls == [("french", "host")] and out.status["residency"][0]["tier"] == "host"
    pod.adapters["french"]["tier"] = "device"
    (out,) = run_round([("smollm2-a", pod)], {**SPEC, "prewarm": {"tier": "disk"}}, out.status, generation=2)
    assert pod.tier_calls[-1] == ("french", "disk") and out.status["settledGeneration"] == 2
    assert out.status["message"] == "at tier disk on 1/1 pods"


def test_a_failed_adapter_stays_failed_while_no_pod_is_ready():
    failed = {
        "phase": "Failed",
        "message": "refused: 403",
        "attempts": 1,
        "observedRetry": "7",
        "observedGeneration": 3,
    }
    status = st.pending_status("no Ready pod of BaseModelServer 'smollm2' yet", failed, 3, NOW)
    assert status["phase"] == "Failed" and status["message"] == "refused: 403"
    assert status["attempts"] == 1 and status["observedRetry"] == "7"
    assert st.pending_status("no Ready pod", failed, 4, NOW)["phase"] == "Pending"  # a new spec: not failed yet


def test_the_retry_annotation_resets_a_failed_adapter(fake_pods):
    pod = fake_pods()
    pod.refuse = 403
    (failed,) = run_round([("smollm2-a", pod)], SPEC, {})
    (still,) = run_round([("smollm2-a", pod)], SPEC, failed.status)  # no annotation yet: nothing sent
    assert len(pod.posts) == 1 and still.status["phase"] == "Failed"
    pod.refuse = None  # the admin fixed the source
    (out,) = run_round([("smollm2-a", pod)], SPEC, still.status, retry="1700000000")
    assert len(pod.posts) == 2 and out.status["phase"] == "Ready" and out.status["attempts"] == 0
    assert out.status["observedRetry"] == "1700000000"
    (again,) = run_round([("smollm2-a", pod)], SPEC, out.status, retry="1700000000")
    assert len(pod.posts) == 2 and again.status["phase"] == "Ready"  # the same value acts once


def test_round_without_pods_or_server_is_pending():
    async def go():
        async with make_http_client() as http:
            ctx = OperatorContext(api=None, http=http)
            none = await reconcile.adapter_round(ctx, "french", SPEC, {}, 1, None, [])
            empty = await reconcile.adapter_round(ctx, "french", SPEC, {}, 1, ServerRef("smollm2", "ml", 1), [])
            return none, empty

    none, empty = asyncio.run(go())
    assert none.status["phase"] == "Pending" and "not found" in none.status["message"]
    assert empty.status["phase"] == "Pending" and "no Ready pod" in empty.status["message"]


def test_unreachable_pod_is_an_error_entry():
    async def go():
        async with make_http_client(timeout_s=2.0) as http:
            ctx = OperatorContext(api=None, http=http)
            gone = PodInfo("smollm2-x", "ml", "smollm2", "u", "127.0.0.1", True, 0)
            return await reconcile.adapter_round(ctx, "french", SPEC, {}, 1, ServerRef("smollm2", "ml", 9), [gone])

    out = asyncio.run(go())
    assert out.status["residency"][0]["state"] == "error"
    assert out.status["phase"] == "Loading" and out.status["attempts"] == 1
    assert out.delay_s == st.backoff_s(1)


def test_unload_everywhere_tolerates_gone_pods(fake_pods):
    pod = fake_pods()
    run_round([("smollm2-a", pod)], SPEC, {})

    async def go():
        async with make_http_client(timeout_s=2.0) as http:
            ctx = OperatorContext(api=None, http=http)
            gone = PodInfo("smollm2-x", "ml", "smollm2", "u", "127.0.0.2", False, 0)  # nothing listens there
            server = ServerRef("smollm2", "ml", pod.port)
            first = await reconcile.unload_everywhere(ctx, server, [pod.info("smollm2-a"), gone], "french")
            again = await reconcile.unload_everywhere(ctx, server, [pod.info("smollm2-a")], "french")
            return first, again

    assert asyncio.run(go()) == ([], [])
    assert pod.adapters == {}


# the model's phase (status.model)
TRACEBACK_THEN_LINE = (
    "INFO loading s3://models/nope\n"
    "Traceback (most recent call last):\n"
    '  File "/app/loraplane_server/store/models.py", line 88, in resolve\n'
    "    raise ModelSourceError(...)\n"
    "loraplane_server.store.sources.ModelSourceError: no objects\n"
    "loraplane: failed to start: s3://models/nope: no objects under this prefix (expected config.json and "
    "*.safetensors)\n"
)
NOPE = "s3://models/nope: no objects under this prefix (expected config.json and *.safetensors)"


def terminated(message: str | None = None, reason: str = "Error", exit_code: int = 1) -> dict:
    t = {"exitCode": exit_code, "reason": reason}
    return {**t, "message": message} if message is not None else t


def server_container(state: dict, last: dict | None = None, restarts: int = 0) -> dict:
    status = {"name": "server", "restartCount": restarts, "state": state, "ready": False}
    return {**status, "lastState": last} if last is not None else status


def test_failure_line_after_a_traceback():
    assert failure_line(TRACEBACK_THEN_LINE) == NOPE
    assert failure_line("Traceback ...\nKeyError: 'x'\n") is None
    assert failure_line(None) is None
    twice = "loraplane: failed to start: first\nloraplane: failed to start: second  \n"
    assert failure_line(twice) == "second"  # the last one is the process's own end
    leaky = "loraplane: failed to start: https://user:s3cr3t@hub.example.com/api/models/x: 401\n"
    assert failure_line(leaky) == "https://***@hub.example.com/api/models/x: 401"  # defence in depth


@pytest.mark.parametrize(
    ("container", "expected"),
    [
        (server_container({"terminated": terminated(TRACEBACK_THEN_LINE)}), NOPE),
        (
            server_container(
                {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}},
                last={"terminated": terminated(TRACEBACK_THEN_LINE)},
                restarts=3,
            ),
            NOPE,
        ),
        (server_container({"terminated": terminated("Segmentation fault")}), None),  # not the server's line
        (server_container({"running": {}}, last={"terminated": terminated(TRACEBACK_THEN_LINE)}, restarts=1), None),
        (server_container({"waiting": {"reason": "ContainerCreating"}}), None),
        (
            server_container({"terminated": terminated(None, "OOMKilled", 137)}),
            "the server ran out of memory while starting (OOMKilled): raise resources.limits.memory",
        ),
    ],
)
def test_start_failure(container, expected):
    assert start_failure(container) == expected


def test_missing_secret_is_a_start_failure():
    waiting = {"reason": "CreateContainerConfigError", "message": 'secret "hf-token" not found'}
    failure = start_failure(server_container({"waiting": waiting}))
    assert failure is not None and 'secret "hf-token" not found' in failure and "spec.credentials" in failure


def test_last_failure_only_while_running_again():
    last = {"terminated": terminated(TRACEBACK_THEN_LINE)}
    assert last_start_failure(server_container({"running": {}}, last=last, restarts=1)) == NOPE
    crash = server_container({"waiting": {"reason": "CrashLoopBackOff"}}, last=last, restarts=1)
    assert last_start_failure(crash) is None  # start_failure reports that one


def model_pod(
    name: str,
    *,
    ready: bool = False,
    containers: list | None = None,
    conditions: list | None = None,
    config_hash: str | None = None,
) -> PodInfo:
    body = pod_body(name, ready=ready)
    body["status"]["containerStatuses"] = containers or [server_container({"running": {}})]
    body["status"]["conditions"] += conditions or []
    if config_hash is not None:
        body["metadata"]["annotations"] = {c.CONFIG_HASH_ANNOTATION: config_hash}
    info = pod_info(body)
    assert info is not None
    return info


CRASHING = [
    server_container(
        {"waiting": {"reason": "CrashLoopBackOff"}}, last={"terminated": terminated(TRACEBACK_THEN_LINE)}, restarts=2
    )
]


def test_pod_info_carries_the_start_up_state():
    info = model_pod("smollm2-a", containers=CRASHING, config_hash="abc")
    assert (info.failure, info.last_failure, info.config_hash) == (NOPE, None, "abc")
    unscheduled = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
    unscheduled["message"] = 'persistentvolumeclaim "smollm2-model-cache" not found'
    info = model_pod("smollm2-b", conditions=[unscheduled])
    assert info.note == 'Unschedulable: persistentvolumeclaim "smollm2-model-cache" not found'
    pulling = [server_container({"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}})]
    assert model_pod("smollm2-c", containers=pulling).note == "ImagePullBackOff: no such image"


def test_model_report_from_ready_bodies():
    loading = {
        "status": "loading",
        "step": "resolving the model",
        "model": {"source": "s3://m/x", "phase": "downloading", "bytes_done": 10, "bytes_total": 40},
    }
    assert model_report("p", loading) == ModelReport("p", "downloading", 10, 40)
    unknown_total = {"status": "loading", "model": {"phase": "downloading", "bytes_done": 5, "bytes_total": None}}
    assert model_report("p", unknown_total) == ModelReport("p", "downloading", 5, None)
    assert model_report("p", {"status": "failed", "error": NOPE}) == ModelReport("p", "failed", error=NOPE)
    assert model_report("p", {"status": "loading", "step": "building the engine"}) is None  # nothing about it
    assert model_report("p", {"status": "loading", "model": {"phase": "exploding"}}) is None
    assert model_report("p", {"model": {"phase": "downloading", "bytes_done": True}}) == ModelReport("p", "downloading")
    assert model_report("p", ["not", "a", "dict"]) is None
    with_draft = {**loading, "draft_model": {"source": "hf://o/d", "phase": "pending", "bytes_done": 0}}
    assert model_report("p", with_draft) == ModelReport("p", "downloading", 10, 40, draft=ModelReport("p", "pending"))
    broken_draft = {**loading, "draft_model": {"phase": "exploding"}}
    assert model_report("p", broken_draft) == ModelReport("p", "downloading", 10, 40)  # the model's report stands


def draft_report(pod: str, model_phase: str, phase: str, done: int = 0, total: int | None = None) -> ModelReport:
    return ModelReport(pod, model_phase, 10, 10, draft=ModelReport(pod, phase, done, total))


def test_draft_model_status_is_the_drafts_own_progress():
    """status.draftModel follows the draft's report in /ready, never the model's: Pending while the pod works on
    the model, then its own download and load; Ready with the pod; absent without spec.engine.draftModel."""
    spec = {"model": "s3://models/x", "engine": {"speculative": "draft", "draftModel": "s3://models/d"}}
    pods = [model_pod("a"), model_pod("b")]
    assert draft_model_status({"model": "s3://models/x"}, pods, [report("a", "downloading", 1, 10)], {}, NOW) is None

    waiting = draft_model_status(spec, pods, [draft_report("a", "downloading", "pending")], {}, NOW)
    assert waiting is not None and (waiting["source"], waiting["phase"]) == ("s3://models/d", "Pending")
    assert waiting["message"] == "a: the draft model is fetched once the model's files are"
    assert "bytesDone" not in waiting  # the model's 10 bytes are not the draft's

    reports = [draft_report("a", "loading", "downloading", 3, 8), draft_report("b", "loading", "pending")]
    fetching = draft_model_status(spec, pods, reports, waiting, NOW)
    model = model_status(spec, pods, reports, {}, NOW)
    assert fetching is not None and (fetching["phase"], fetching["bytesDone"], fetching["bytesTotal"]) == (
        "Downloading",
        3,
        8,
    )
    assert (model["phase"], model["bytesDone"]) == ("Loading", 10)  # each its own
    loading = draft_model_status(spec, pods, [draft_report("a", "loading", "loading", 8, 8)], fetching, NOW)
    assert loading is not None and loading["phase"] == "Loading"
    ready = draft_model_status(spec, [model_pod("a", ready=True)], [], loading, NOW)
    assert ready is not None and ready["phase"] == "Ready"


def test_a_server_that_cannot_start_fails_the_draft_too():
    spec = {"model": "smollm2-135m", "engine": {"speculative": "draft", "draftModel": "hf://org/other"}}
    error = "--draft-model hf://org/other: its tokenizer differs from the model's"
    failed = draft_model_status(spec, [model_pod("a")], [report("a", "failed", error=error)], {}, NOW)
    assert failed is not None and (failed["phase"], failed["reason"]) == ("Failed", error)
    bms = {"metadata": {"name": "smollm2", "namespace": "ml"}, "spec": spec}
    s = server_status(bms, deployment(1, 0), [model_pod("a")], {}, NOW, [report("a", "failed", error=error)])
    assert s["draftModel"]["phase"] == s["model"]["phase"] == "Failed"
    assert "draftModel" not in server_status({**bms, "spec": {"model": "smollm2-135m"}}, deployment(1, 1), [], {}, NOW)


@pytest.mark.parametrize(
    ("done", "total", "text"),
    [
        (327576781, 536870912, "312.4 MiB/512.0 MiB (61%)"),
        (0, 16 * 1024**3, "0 B/16.0 GiB (0%)"),
        (16 * 1024**3, 16 * 1024**3, "16.0 GiB/16.0 GiB (100%)"),
        (327576781, None, "312.4 MiB"),
        (512, None, "512 B"),
    ],
)
def test_progress_text(done, total, text):
    assert progress_text(done, total) == text


def report(pod: str, phase: str, done: int = 0, total: int | None = None, error: str | None = None):
    return ModelReport(pod, phase, done, total, error)


def phase_of(pods, reports=(), previous=None) -> dict:
    return model_phase(pods, list(reports), previous or {})


def test_model_ready_when_any_pod_is_ready():
    pods = [model_pod("a", ready=True), model_pod("b", containers=CRASHING)]
    model = phase_of(pods, previous={"bytesTotal": 536870912})
    assert model["phase"] == "Ready" and model["progress"] == "512.0 MiB/512.0 MiB (100%)"


def test_model_failed_from_a_crash_looping_pod_with_the_reason():
    model = phase_of([model_pod("a"), model_pod("b", containers=CRASHING)], [report("a", "downloading", 5, 10)])
    assert model["phase"] == "Failed" and model["reason"] == NOPE
    assert model["message"] == f"b: the server failed to start: {NOPE}"


def test_model_failed_from_a_failed_ready_body():
    model = phase_of([model_pod("a")], [report("a", "failed", error="hf://org/repo@v9: revision v9 not found")])
    assert (model["phase"], model["reason"]) == ("Failed", "hf://org/repo@v9: revision v9 not found")


@pytest.mark.parametrize(
    ("reports", "phase", "message"),
    [
        ([report("a", "resolving")], "Downloading", "a: resolving the model source"),
        ([report("a", "resolving"), report("b", "waiting")], "Downloading", "b: waiting for another pod's download"),
        ([report("a", "waiting")], "Downloading", "a: waiting for another pod's download into the shared cache"),
        (
            [report("a", "waiting"), report("b", "downloading", 327576781, 536870912)],
            "Downloading",
            "b: downloading, 312.4 MiB/512.0 MiB (61%)",
        ),
        ([report("a", "verifying", 10, 10)], "Downloading", "a: verifying the model files"),
        ([report("a", "converting", 10, None)], "Downloading", "a: converting the model files"),
        ([report("a", "downloading", 9, 10), report("b", "loading", 10, 10)], "Loading", "b: loading the weights"),
    ],
)
def test_model_progress_from_the_most_advanced_pod(reports, phase, message):
    model = phase_of([model_pod("a"), model_pod("b")], reports)
    assert model["phase"] == phase and model["message"].startswith(message)


def test_download_bytes_come_from_the_most_advanced_pod():
    model = phase_of(
        [model_pod("a"), model_pod("b")], [report("a", "downloading", 3, 10), report("b", "downloading", 7, 10)]
    )
    assert (model["bytesDone"], model["bytesTotal"], model["progress"]) == (7, 10, "7 B/10 B (70%)")


def test_model_pending_with_what_kubernetes_says():
    unscheduled = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "claim unbound"}
    model = phase_of([model_pod("a", conditions=[unscheduled])])
    assert model == {"phase": "Pending", "message": "a: Unschedulable: claim unbound"}
    assert phase_of([])["phase"] == "Pending"


def test_a_restarted_pod_stays_failed_until_it_makes_progress():
    """Between CrashLoopBackOff restarts the container runs again for a moment: the phase holds at Failed
    (no Failed/Pending flapping, no event per restart) until the new run shows bytes or a later phase."""
    again = [server_container({"running": {}}, last={"terminated": terminated(TRACEBACK_THEN_LINE)}, restarts=3)]
    pod = model_pod("a", containers=again)
    assert phase_of([pod])["phase"] == "Failed"
    assert phase_of([pod], [report("a", "downloading", 0, None)])["phase"] == "Failed"
    assert phase_of([pod], [report("a", "downloading", 1024, 2048)])["phase"] == "Downloading"
    assert phase_of([pod], [report("a", "loading", 0, None)])["phase"] == "Loading"


def test_model_status_keeps_the_transition_time_while_the_phase_holds():
    spec = {"model": "s3://models/x"}
    first = model_status(spec, [model_pod("a")], [report("a", "downloading", 1, 10)], {}, NOW)
    assert first["source"] == "s3://models/x" and first["lastTransitionTime"] == NOW
    later = model_status(spec, [model_pod("a")], [report("a", "downloading", 5, 10)], first, "2025-01-01T00:01:00Z")
    assert later["lastTransitionTime"] == NOW and later["bytesDone"] == 5
    ready = model_status(spec, [model_pod("a", ready=True)], [], later, "2025-01-01T00:02:00Z")
    assert ready["lastTransitionTime"] == "2025-01-01T00:02:00Z" and ready["bytesTotal"] == 10
    moved = model_status({"model": "s3://models/y"}, [model_pod("a", ready=True)], [], ready, "2025-01-01T00:03:00Z")
    assert moved["lastTransitionTime"] == "2025-01-01T00:03:00Z" and "bytesTotal" not in moved  # another model


def test_only_the_current_specs_pods_speak_for_the_model():
    spec = {"model": "s3://models/new"}
    now_hash = builders.config_hash(spec)
    pods = [
        model_pod("old", ready=True, config_hash="0ld"),
        model_pod("new", containers=CRASHING, config_hash=now_hash),
    ]
    assert [p.name for p in current_pods(pods, spec)] == ["new"]
    bms = {"metadata": {"name": "smollm2", "namespace": "ml"}, "spec": spec}
    s = server_status(bms, deployment(1, 1, updated=0), pods, {}, NOW)
    assert s["model"]["phase"] == "Failed"  # the old pod still serves the old model, not this one
    assert s["phase"] == "Progressing"  # ... so the server itself still answers


def test_server_status_failed_model_in_phase_and_conditions():
    bms = {"metadata": {"name": "smollm2", "namespace": "ml", "generation": 2}, "spec": {"model": "s3://models/nope"}}
    s = server_status(bms, deployment(2, 0), [model_pod("a", containers=CRASHING)], {}, NOW)
    assert s["phase"] == "Failed" and NOPE in s["message"]
    assert (
        s["model"]["phase"] == "Failed" and s["model"]["reason"] == NOPE and s["model"]["source"] == "s3://models/nope"
    )
    conditions = {x["type"]: x for x in s["conditions"]}
    assert conditions["Ready"]["status"] == "False" and NOPE in conditions["Ready"]["message"]
    model_ready = conditions["ModelReady"]
    assert (model_ready["status"], model_ready["reason"]) == ("False", "Failed") and NOPE in model_ready["message"]
    assert model_ready["observedGeneration"] == 2
    fixed = server_status(bms, deployment(2, 2), [model_pod("a", ready=True), model_pod("b", ready=True)], s, NOW)
    conditions = {x["type"]: x for x in fixed["conditions"]}
    assert fixed["phase"] == "Ready" and conditions["ModelReady"]["status"] == "True"


NO_GPU = "--device cuda: no CUDA device is visible (torch.cuda.is_available() is False: no NVIDIA driver found)"
NO_GPU_LOG = (
    "INFO loraplane serve --model smollm2-135m --device cuda\n"
    "/app/torch/cuda/__init__.py:129: UserWarning: CUDA initialization: Found no NVIDIA driver on your system.\n"
    f"loraplane: failed to start: {NO_GPU}\n"
)


@pytest.mark.parametrize(
    "container",
    [
        server_container({"terminated": terminated(NO_GPU_LOG)}),
        server_container(
            {"waiting": {"reason": "CrashLoopBackOff"}}, last={"terminated": terminated(NO_GPU_LOG)}, restarts=4
        ),
    ],
    ids=["terminated", "crash-loop"],
)
def test_a_gpu_server_without_a_usable_gpu_fails_the_model_with_the_reason(container):
    """Issue 35: resources.gpus 1 makes the pod `--device cuda`; on a node where it cannot use the GPU the server
    exits at start with its failure line (never loading the model on the CPU), and status.model, the phase and
    ModelReady say why."""
    spec = {"model": "smollm2-135m", "resources": {"gpus": 1}}
    assert builders.server_args(spec)[2:4] == ["--device", "cuda"]
    pod = model_pod("smollm2-a", containers=[container], config_hash=builders.config_hash(spec))
    assert pod.failure == NO_GPU
    bms = {"metadata": {"name": "smollm2", "namespace": "ml", "generation": 1}, "spec": spec}
    s = server_status(bms, deployment(1, 0), [pod], {}, NOW)
    model = s["model"]
    assert (model["phase"], model["reason"], model["source"]) == ("Failed", NO_GPU, "smollm2-135m")
    assert model["message"] == f"smollm2-a: the server failed to start: {NO_GPU}"
    assert s["phase"] == "Failed" and s["message"] == f"the model failed to load: {NO_GPU}"
    model_ready = {x["type"]: x for x in s["conditions"]}["ModelReady"]
    assert (model_ready["status"], model_ready["reason"]) == ("False", "Failed") and NO_GPU in model_ready["message"]


class FakeReady:
    """A starting server's /ready on 127.0.0.1: 503 with the model object; records the headers it got."""

    def __init__(self, body: dict, status: int = 503) -> None:
        self.body, self.status = body, status
        self.headers: list[dict[str, str]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                fake.headers.append(dict(self.headers))
                data = json.dumps(fake.body).encode() if self.path == "/ready" else b"{}"
                self.send_response(fake.status if self.path == "/ready" else 404)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.port = self.server.server_address[1]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


DOWNLOADING = {
    "status": "loading",
    "step": "resolving the model",
    "step_seconds": 3.0,
    "loading_seconds": 3.0,
    "model": {"source": "s3://models/x", "phase": "downloading", "bytes_done": 327576781, "bytes_total": 536870912},
}


def test_model_reports_read_the_starting_pods_ready_over_http():
    fake = FakeReady(DOWNLOADING)
    try:

        async def go():
            async with make_http_client(timeout_s=2.0) as http:
                ctx = OperatorContext(api=None, http=http)
                starting = PodInfo("a", "ml", "smollm2", "u-a", "127.0.0.1", False, 0)
                ready = PodInfo("b", "ml", "smollm2", "u-b", "127.0.0.1", True, 0)  # serves: not asked
                no_ip = PodInfo("c", "ml", "smollm2", "u-c", None, False, 0)
                silent = PodInfo("d", "ml", "smollm2", "u-d", "127.0.0.2", False, 0)  # nothing listens there
                return await reconcile.model_reports(ctx, [starting, ready, no_ip, silent], fake.port)

        reports = asyncio.run(go())
    finally:
        fake.close()
    assert reports == [ModelReport("a", "downloading", 327576781, 536870912)]
    (headers,) = fake.headers  # one GET: the ready pod was not asked
    assert "authorization" not in {k.lower() for k in headers}  # /ready is open: no admin token sent
