"""The kopf handlers called directly (no cluster): kopf's indexes are plain dicts of lists here, the pods
are real HTTP servers on 127.0.0.1, and the Kubernetes API calls and events are recorded stand-ins."""

from __future__ import annotations

import asyncio

import kopf
import pytest
from test_operator_status import CRASHING, DOWNLOADING, NOPE, SPEC, FakePod, FakeReady, model_pod, pod_body

from loraplane_operator import adapter_status as st
from loraplane_operator import constants as c
from loraplane_operator import handlers, kube, metrics
from loraplane_operator.admin_client import make_http_client
from loraplane_operator.context import OperatorContext
from loraplane_operator.server_status import PodInfo, ServerRef, pod_info

KEY = ("ml", "smollm2")


@pytest.fixture
def pod():
    p = FakePod()
    yield p
    p.close()


@pytest.fixture
def events(monkeypatch):
    seen: list[tuple[str, str, str]] = []
    monkeypatch.setattr(kopf, "info", lambda body, *, reason, message="": seen.append(("info", reason, message)))
    monkeypatch.setattr(kopf, "warn", lambda body, *, reason, message="": seen.append(("warn", reason, message)))
    return seen


def with_ctx(coro_fn):
    async def go():
        async with make_http_client(timeout_s=3.0) as http:
            memo = kopf.Memo(ctx=OperatorContext(api=None, http=http))
            return await coro_fn(memo)

    return asyncio.run(go())


class Stopped:
    """Stands in for kopf.DaemonStopped."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def __bool__(self) -> bool:
        return self.event.is_set()

    async def wait(self) -> None:
        await self.event.wait()


def test_indexes():
    body = {"metadata": {"name": "smollm2", "namespace": "ml"}, "spec": {"port": 9000}}
    assert handlers.servers(body=body) == {KEY: ServerRef("smollm2", "ml", 9000, "smollm2-admin-token", is_gated=True)}
    assert handlers.server_pods(body=pod_body("smollm2-a")) == {KEY: pod_info(pod_body("smollm2-a"))}
    spec = {"baseModelServer": "smollm2", "source": "/s"}
    want = {KEY: ("fr", st.AdapterWant("fr", "/s"))}
    assert handlers.adapters(name="fr", namespace="ml", spec=spec, meta={}, status={}) == want
    assert handlers.adapters(name="fr", namespace="ml", spec=spec, meta={"deletionTimestamp": "x"}, status={}) == {}
    # a Failed adapter is not re-sent to a restarted pod until retried
    assert handlers.adapters(name="fr", namespace="ml", spec=spec, meta={}, status={"phase": "Failed"}) == {}
    assert handlers.adapters(name="fr", namespace="ml", spec=spec, meta={}, status={"phase": "Loading"}) == want


def test_daemon_prewarms_and_writes_status(pod, events, monkeypatch):
    patches: list[dict] = []
    stopped = Stopped()

    async def patch_status(api, kind, namespace, name, status):
        patches.append(status)
        stopped.event.set()

    monkeypatch.setattr(kube, "patch_status", patch_status)

    async def run(memo):
        await handlers.adapter_daemon(
            stopped=stopped,
            body={},
            name="french",
            namespace="ml",
            spec=SPEC,
            meta={"generation": 1},
            status={},
            memo=memo,
            logger=kopf.LocalObjectLogger(body={"metadata": {"name": "french"}}, settings=kopf.OperatorSettings()),
            servers={KEY: [ServerRef("smollm2", "ml", pod.port)]},
            server_pods={KEY: [pod.info("smollm2-a")]},
        )

    with_ctx(run)
    (status,) = patches
    assert status["phase"] == "Ready" and status["ready"] == "1/1" and status["observedGeneration"] == 1
    assert pod.posts[0]["tier"] == "device" and pod.posts[0]["pinned"] is True
    assert events == [("info", "Ready", status["message"])]


def run_daemon(pod: FakePod, monkeypatch, meta: dict, status: dict) -> list[dict]:
    """One daemon round (stopped after its status patch); the patches it wrote."""
    patches: list[dict] = []
    stopped = Stopped()

    async def patch_status(api, kind, namespace, name, status):
        patches.append(status)
        stopped.event.set()

    monkeypatch.setattr(kube, "patch_status", patch_status)

    async def run(memo):
        await handlers.adapter_daemon(
            stopped=stopped,
            body={},
            name="french",
            namespace="ml",
            spec=SPEC,
            meta=meta,
            status=status,
            memo=memo,
            logger=kopf.LocalObjectLogger(body={"metadata": {"name": "french"}}, settings=kopf.OperatorSettings()),
            servers={KEY: [ServerRef("smollm2", "ml", pod.port)]},
            server_pods={KEY: [pod.info("smollm2-a")]},
        )

    with_ctx(run)
    return patches


def test_a_refused_source_is_one_warning_then_the_retry_annotation_recovers_it(pod, events, monkeypatch):
    """Issue 21: a refusal (403/400) is Failed at once with a Warning event, never Loading with Normal events;
    a new loraplane.dev/retry value sends it again and is recorded in status.observedRetry."""
    pod.refuse = 400
    (failed,) = run_daemon(pod, monkeypatch, {"generation": 1}, {})
    assert failed["phase"] == "Failed" and failed["attempts"] == 1 and "400" in failed["message"]
    assert events == [("warn", "Failed", failed["message"])]
    pod.refuse = None
    annotations = {c.RETRY_ANNOTATION: "1700000000"}
    (fixed,) = run_daemon(pod, monkeypatch, {"generation": 1, "annotations": annotations}, failed)
    assert fixed["phase"] == "Ready" and fixed["observedRetry"] == "1700000000" and fixed["attempts"] == 0
    assert len(pod.posts) == 2 and events[-1] == ("info", "Ready", fixed["message"])


def test_a_new_retry_annotation_wakes_the_daemon():
    ctx = OperatorContext(api=None, http=None)
    memo = kopf.Memo(ctx=ctx)

    def woken(event_type: str, retry: str | None, observed: str | None) -> bool:
        ctx.wakeups.clear()
        annotations = {} if retry is None else {c.RETRY_ANNOTATION: retry}
        asyncio.run(handlers.adapter_retry_asked(
            event={"type": event_type}, name="fr", namespace="ml", meta={"annotations": annotations},
            status={"observedRetry": observed} if observed else {}, memo=memo,
        ))  # fmt: skip
        return ctx.wakeup("ml", "fr").is_set()

    assert woken("MODIFIED", "2", "1") and woken("MODIFIED", "1", None) and woken(None, "2", "1")
    assert not woken("MODIFIED", "1", "1")  # already acted on
    assert not woken("MODIFIED", None, "1") and not woken("DELETED", "2", "1")


def test_pod_turning_ready_gets_every_adapter(pod, events):
    wants = [
        ("french", st.AdapterWant("french", "/a/french", "host")),
        ("json", st.AdapterWant("json", "/a/json", "disk", replicas=1)),
    ]
    indexes = {"servers": {KEY: [ServerRef("smollm2", "ml", pod.port)]}, "adapters": {KEY: wants}, "server_pods": {}}
    logger = kopf.LocalObjectLogger(body={"metadata": {"name": "p"}}, settings=kopf.OperatorSettings())

    def body(ready: bool, restarts: int = 0) -> dict:
        return pod_body("smollm2-a", ready=ready, ip="127.0.0.1", restarts=restarts)

    async def run(memo):
        async def event(kind, b):
            await handlers.server_pod_event(event={"type": kind}, body=b, memo=memo, logger=logger, **indexes)

        await event(None, body(False))  # initial listing: remembered only
        await event("MODIFIED", body(True))  # turned Ready
        first = [(p["id"], p["tier"]) for p in pod.posts]
        await event("MODIFIED", body(True))  # nothing changed
        second = len(pod.posts)
        await event("MODIFIED", body(True, restarts=1))  # restarted (a fresh process knows nothing)
        woken = {k for k, e in memo["ctx"].wakeups.items() if e.is_set()}
        await event("DELETED", body(False, restarts=1))
        return first, second, woken, memo["ctx"].pod_marks

    first, second, woken, marks = with_ctx(run)
    assert first == [("french", "host"), ("json", "none")] or first == [("json", "none"), ("french", "host")]
    assert second == 2 and len(pod.posts) == 4
    assert woken == {("ml", "french"), ("ml", "json")}
    assert marks == {}


def test_initial_listing_of_a_ready_pod_sends_nothing(pod, events):
    async def run(memo):
        await handlers.server_pod_event(
            event={"type": None},
            body=pod_body("smollm2-a", ip="127.0.0.1"),
            memo=memo,
            logger=kopf.LocalObjectLogger(body={}, settings=kopf.OperatorSettings()),
            servers={KEY: [ServerRef("smollm2", "ml", pod.port)]},
            adapters={KEY: [("french", st.AdapterWant("french", "/a/french"))]},
            server_pods={},
        )

    with_ctx(run)
    assert pod.posts == []


def test_a_gated_servers_starting_pod_gets_one_warmer_per_run_and_loses_it_when_deleted(events):
    server = ServerRef("smollm2", "ml", 1, is_gated=True)  # port 1: nothing listens, the warmer keeps polling
    logger = kopf.LocalObjectLogger(body={"metadata": {"name": "p"}}, settings=kopf.OperatorSettings())

    def body(restarts: int = 0) -> dict:
        b = pod_body("smollm2-a", ready=False, ip="127.0.0.1", restarts=restarts)
        b["status"]["containerStatuses"][0]["state"] = {"running": {}}
        return b

    async def run(memo):
        ctx = memo["ctx"]

        async def event(kind, b, srv=server):
            indexes = {"servers": {KEY: [srv]}, "adapters": {KEY: []}, "server_pods": {KEY: [pod_info(b)]}}
            await handlers.server_pod_event(event={"type": kind}, body=b, memo=memo, logger=logger, **indexes)

        await event(None, body())  # the initial listing starts one too (the operator restarted mid-start)
        first = ctx.warmers["uid-smollm2-a"][1]
        await event("MODIFIED", body())
        same = ctx.warmers["uid-smollm2-a"][1] is first
        await event("MODIFIED", body(restarts=1))  # a new run of the server: a new warmer, the old one stopped
        second = ctx.warmers["uid-smollm2-a"][1]
        await asyncio.sleep(0)
        await event("DELETED", body(restarts=1))
        await asyncio.sleep(0)
        ungated = pod_body("smollm2-b", ready=False, ip="127.0.0.1")
        ungated["status"]["containerStatuses"][0]["state"] = {"running": {}}
        await event("MODIFIED", ungated, ServerRef("smollm2", "ml", 1))
        return same, first.cancelled(), second.cancelled(), dict(ctx.warmers)

    same, first_cancelled, second_cancelled, left = with_ctx(run)
    assert same and first_cancelled and second_cancelled
    assert left == {}  # deleted, and an ungated server's pods get none


def unload(memo, pod, retry: int) -> None:
    return handlers.unload_adapter(
        body={},
        name="french",
        namespace="ml",
        spec=SPEC,
        memo=memo,
        retry=retry,
        servers={KEY: [ServerRef("smollm2", "ml", pod.port)]},
        server_pods={KEY: [pod.info("smollm2-a")]},
    )


def test_delete_unloads_from_every_pod(pod, events):
    pod.adapters["french"] = {"id": "french"}
    with_ctx(lambda memo: unload(memo, pod, 0))
    assert pod.deletes == ["french"] and pod.adapters == {}
    with_ctx(lambda memo: unload(memo, pod, 0))  # unknown there now: fine


def test_delete_retries_while_the_adapter_is_busy_then_lets_go(pod, events):
    pod.delete_status = 409
    with pytest.raises(kopf.TemporaryError, match="in use"):
        with_ctx(lambda memo: unload(memo, pod, 0))
    with_ctx(lambda memo: unload(memo, pod, c.UNLOAD_RETRIES))
    assert events and events[-1][:2] == ("warn", "UnloadIncomplete")


def test_delete_without_server_is_a_no_op(events):
    async def run(memo):
        await handlers.unload_adapter(
            body={}, name="french", namespace="ml", spec=SPEC, memo=memo, retry=0, servers={}, server_pods={}
        )

    with_ctx(run)


# BaseModelServer: the model cache claim and the model's status
def server_body(**spec) -> dict:
    meta = {"name": "smollm2", "namespace": "ml", "uid": "uid-bms", "generation": 1}
    return {"apiVersion": "loraplane.dev/v1alpha1", "kind": "BaseModelServer", "metadata": meta, "spec": spec}


@pytest.fixture
def api_calls(monkeypatch):
    """Recorded stand-ins for the Kubernetes API: applies, and gets answered from `existing`."""
    calls = {"applied": [], "existing": {}, "created": []}

    async def apply(api, obj):
        calls["applied"].append(obj)
        return obj

    async def create_if_absent(api, obj):
        key = (obj["kind"], obj["metadata"]["name"])
        if key in calls["existing"]:
            return False
        calls["created"].append(obj)
        calls["existing"][key] = obj
        return True

    async def get(api, api_version, kind, namespace, name):
        return calls["existing"].get((kind, name))

    async def delete_if_exists(api, api_version, kind, namespace, name):
        return False

    monkeypatch.setattr(kube, "apply", apply)
    monkeypatch.setattr(kube, "create_if_absent", create_if_absent)
    monkeypatch.setattr(kube, "get", get)
    monkeypatch.setattr(kube, "delete_if_exists", delete_if_exists)
    return calls


def test_apply_server_creates_the_cache_claim_once_and_owned(api_calls, events):
    body = server_body(model="s3://models/smollm2", modelCache={"volume": "PersistentVolumeClaim", "size": "40Gi"})

    async def run(memo):
        kwargs = {"name": "smollm2", "namespace": "ml", "spec": body["spec"], "meta": body["metadata"], "memo": memo}
        await handlers.apply_server(body=body, patch=kopf.Patch(), **kwargs)
        first = [o["kind"] for o in api_calls["applied"]]
        claim = api_calls["applied"][0]
        api_calls["existing"][("PersistentVolumeClaim", "smollm2-model-cache")] = claim
        api_calls["applied"].clear()
        await handlers.apply_server(body=body, patch=kopf.Patch(), **kwargs)
        return first, claim, [o["kind"] for o in api_calls["applied"]]

    first, claim, second = with_ctx(run)
    assert first == ["PersistentVolumeClaim", "Deployment", "Service", "PodDisruptionBudget"]  # the claim first
    (owner,) = claim["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("BaseModelServer", "uid-bms", True)
    assert claim["spec"]["resources"]["requests"]["storage"] == "40Gi"
    assert second == ["Deployment", "Service", "PodDisruptionBudget"]  # an existing claim is left as it is (immutable)
    assert events[0][:2] == ("info", "Applied") and "PersistentVolumeClaim/smollm2" in events[0][2]


def test_apply_server_makes_the_admin_token_once_and_owned(api_calls, events):
    """No adminTokenSecretRef: a random token in an owned Secret, created before the Deployment and never replaced
    by later reconciles; with a ref, or on a vLLM server, none."""

    async def run(memo, body):
        kwargs = {"name": "smollm2", "namespace": "ml", "spec": body["spec"], "meta": body["metadata"], "memo": memo}
        for _ in range(2):
            await handlers.apply_server(body=body, patch=kopf.Patch(), **kwargs)

    ok = metrics.REGISTRY.get_sample_value(
        "loraplane_operator_reconciles_total", {"kind": "BaseModelServer", "result": "ok"}
    )
    with_ctx(lambda memo: run(memo, server_body()))
    counted = metrics.REGISTRY.get_sample_value(
        "loraplane_operator_reconciles_total", {"kind": "BaseModelServer", "result": "ok"}
    )
    assert counted == ok + 2  # /metrics counts each apply
    (secret,) = api_calls["created"]
    assert secret["metadata"]["name"] == "smollm2-admin-token" and secret["kind"] == "Secret"
    assert [(o["kind"], o["uid"]) for o in secret["metadata"]["ownerReferences"]] == [("BaseModelServer", "uid-bms")]
    assert len(secret["stringData"]["token"]) >= 40
    deployment = next(o for o in api_calls["applied"] if o["kind"] == "Deployment")
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    ref = {"name": "smollm2-admin-token", "key": "token"}
    assert env["LORAPLANE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == ref
    api_calls["created"].clear()
    with_ctx(lambda memo: run(memo, server_body(adminTokenSecretRef={"name": "mine"})))
    with_ctx(lambda memo: run(memo, server_body(engine={"kind": "vllm"})))
    assert api_calls["created"] == []


def test_status_timer_reports_the_model_with_events_on_changes_only(api_calls, events):
    fake = FakeReady(DOWNLOADING)
    body = server_body(model="s3://models/x", port=fake.port)
    api_calls["existing"][("Deployment", "smollm2")] = {"spec": {"replicas": 1}, "status": {"replicas": 1}}
    starting = PodInfo("smollm2-a", "ml", "smollm2", "uid-a", "127.0.0.1", False, 0)

    async def tick(memo, status: dict, pods: list) -> dict:
        patch = kopf.Patch()
        await handlers.server_status_timer(
            body=body,
            name="smollm2",
            namespace="ml",
            spec=body["spec"],
            status=status,
            memo=memo,
            patch=patch,
            server_pods={KEY: pods},
        )
        return {k: v for k, v in {**status, **dict(patch).get("status", {})}.items() if v is not None}

    async def run(memo):
        first = await tick(memo, {}, [starting])
        again = await tick(memo, first, [starting])
        failed = await tick(memo, again, [model_pod("smollm2-a", containers=CRASHING)])
        return first, again, failed

    try:
        first, again, failed = with_ctx(run)
    finally:
        fake.close()
    assert first["model"]["phase"] == "Downloading" and first["model"]["progress"] == "312.4 MiB/512.0 MiB (61%)"
    assert first["phase"] == "Pending" and again["model"] == first["model"]
    assert failed["model"]["phase"] == "Failed" and failed["model"]["reason"] == NOPE and failed["phase"] == "Failed"
    assert [e[:2] for e in events] == [("info", "ModelDownloading"), ("warn", "ModelFailed")]  # one per change
    assert events[1][2] == f"s3://models/x: smollm2-a: the server failed to start: {NOPE}"
