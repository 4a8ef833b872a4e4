"""The router's choice of pod (serving/router/choice.py) and its reading of requests, with no server: residency first
within an adapter's home, the load bound, the fallback, spilling a hot adapter and narrowing it back."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest

from loraplane_server.serving.router.app import Router, RouterConfig, adapter_of, tier_name
from loraplane_server.serving.router.choice import PodView, Spill, choose, load_bound
from loraplane_server.serving.router.hold import Hold, HoldFull
from loraplane_server.serving.router.metrics import OTHER, POD_SERIES_TTL_S, AdapterCount, AdapterCounts, RouterMetrics
from loraplane_server.serving.router.pool import KubePods, _load, static_targets, with_port
from loraplane_server.serving.router.ranking import rank

NAMES = ["pod-a", "pod-b", "pod-c", "pod-d"]


def pods(**residency: dict[str, str]) -> list[PodView]:
    return [PodView(n, f"http://{n}", residency.get(n.replace("-", "_"), {})) for n in NAMES]


def test_cold_adapter_goes_to_its_first_ranked_pod() -> None:
    order = choose("french", pods(), width=1, epsilon=0.25)
    assert [p.name for p in order] == rank("french", NAMES)


def test_resident_home_pod_first_then_any_resident_pod() -> None:
    first, second, third, fourth = rank("french", NAMES)
    view = pods(**{second.replace("-", "_"): {"french": "host"}, fourth.replace("-", "_"): {"french": "device"}})
    assert choose("french", view, width=2, epsilon=0.25)[0].name == second  # in its home and resident
    order = [p.name for p in choose("french", view, width=1, epsilon=0.25)]
    assert order[0] == fourth and order[1] == second  # resident elsewhere beats a cold home (device before host)
    assert order[2:] == [first, third]


def test_tiers_order_resident_home_pods() -> None:
    first, second, *_ = rank("french", NAMES)
    view = pods(**{first.replace("-", "_"): {"french": "disk"}, second.replace("-", "_"): {"french": "device"}})
    assert choose("french", view, width=2, epsilon=0.25)[0].name == second


def test_a_pod_over_the_load_bound_is_skipped() -> None:
    view = pods()
    first, second, *_ = rank("french", NAMES)
    by_name = {p.name: p for p in view}
    by_name[first].others = 10  # mean with this request (11 / 4) x 1.25 -> bound 3.44
    assert load_bound(view, 0.25) == pytest.approx(1.25 * 11 / 4)
    order = choose("french", view, width=1, epsilon=0.25)
    assert order[0].name == second and order[-1].name == first


def test_some_pod_always_takes_the_request_the_least_loaded_when_all_are_over() -> None:
    view = pods()
    for loads in ([10, 11, 12, 13], [40, 39, 41, 40], [0, 0, 0, 50], [7, 7, 7, 7], [2, 2, 2, 1]):
        for p, load in zip(view, loads, strict=True):
            p.in_flight = load
        bound = load_bound(view, 0.0)
        order = choose("french", view, width=1, epsilon=0.0)
        under = [p for p in order if p.load + 1 <= bound]
        assert order[: len(under)] == under  # those under the bound first
        if not under:  # all over (equal loads): the least loaded first, the ranking among equals
            assert [p.load for p in order] == sorted(loads)
        assert order[0].load <= min(loads) + 1
    assert load_bound(view, 0.0) == 2.0  # (7 + 1) / 4


def test_with_three_pods_and_six_requests_no_pod_holds_more_than_two() -> None:
    view = pods()[:3]
    first, *_ = rank("hot", [p.name for p in view])
    by_name = {p.name: p for p in view}
    for _ in range(6):  # every request for one hot adapter; each stays in flight
        by_name[choose("hot", view, width=1, epsilon=0.25)[0].name].in_flight += 1
    assert sorted(p.load for p in view) == [2, 2, 2] and by_name[first].load == 2


def test_base_model_requests_go_to_the_least_loaded() -> None:
    view = pods()
    view[0].others, view[1].others, view[2].others, view[3].others = 3, 1, 2, 1
    assert [p.name for p in choose(None, view, 1, 0.25)] == ["pod-b", "pod-d", "pod-c", "pod-a"]
    assert choose("x", [], 1, 0.25) == []


def test_spill_widens_a_hot_adapter_and_narrows_it_back() -> None:
    view = pods()
    spill = Spill(queue_threshold=4, step_s=2.0, settle_s=10.0)
    ranked = {p.name: p for p in view}
    first, second, third, _ = rank("hot", NAMES)
    ranked[first].others = 6
    assert spill.observe("hot", view, now=0.0) == 2 and spill.spills == 1
    assert spill.observe("hot", view, now=1.0) == 2  # the second pod is not busy: no wider
    ranked[second].others = 5
    assert spill.observe("hot", view, now=1.5) == 2  # busy, but one step per 2 s
    assert spill.observe("hot", view, now=2.0) == 3
    assert [p.name for p in choose("hot", view, spill.width("hot"), 10.0)][:3] == [third, second, first]
    for p in view:
        p.others = 1  # calm: under half the threshold
    assert spill.observe("hot", view, now=3.0) == 3
    assert spill.observe("hot", view, now=12.9) == 3
    assert spill.observe("hot", view, now=13.0) == 2  # 10 s calm: one step back
    assert spill.observe("hot", view, now=23.0) == 1 and "hot" not in spill.widths
    assert spill.observe("cold", view, now=30.0) == 1 and spill.widths == {}


def test_adapter_of_reads_openai_and_lorax_bodies() -> None:
    base = {"smollm2-135m"}
    assert adapter_of("/v1/completions", json.dumps({"model": "french"}).encode(), base) == "french"
    assert adapter_of("/v1/chat/completions", json.dumps({"model": "smollm2-135m"}).encode(), base) is None
    assert adapter_of("/generate", json.dumps({"inputs": "x", "parameters": {"adapter_id": "pirate"}}).encode(), base)
    assert adapter_of("/generate", json.dumps({"inputs": "x"}).encode(), base) is None
    for bad in (b"{", b"[1]", json.dumps({"model": 3}).encode(), json.dumps({"parameters": "x"}).encode()):
        assert adapter_of("/v1/completions", bad, base) is None and adapter_of("/generate", bad, base) is None


def test_load_is_waiting_plus_running_from_the_metrics_text() -> None:
    text = (
        "# HELP loraplane_queue_depth Requests waiting\n# TYPE loraplane_queue_depth gauge\nloraplane_queue_depth 3.0\n"
        "# HELP loraplane_requests_running Running\n# TYPE loraplane_requests_running gauge\n"
        "loraplane_requests_running 5.0\n# HELP other x\n# TYPE other gauge\nother 100.0\n"
    )
    assert _load(text) == 8


def test_config_and_targets_refuse_what_cannot_work() -> None:
    with pytest.raises(ValueError, match="either"):
        RouterConfig()
    with pytest.raises(ValueError, match="either"):
        RouterConfig(pods=("http://a:1",), selector="x=y", namespace="ml")
    with pytest.raises(ValueError, match="needs --namespace"):
        RouterConfig(selector="x=y")
    with pytest.raises(ValueError, match="epsilon"):
        RouterConfig(pods=("http://a:1",), epsilon=-1)
    assert [t.name for t in static_targets(["http://127.0.0.1:8001/", "http://127.0.0.2:8001"])] == [
        "127.0.0.1:8001",
        "127.0.0.2:8001",
    ]
    with pytest.raises(ValueError, match="host:port"):
        static_targets(["127.0.0.1:8001"])
    named = static_targets(["pod-a=http://127.0.0.1:8001", "http://x=y@127.0.0.2:8001/"])
    assert [(t.name, t.url) for t in named] == [
        ("pod-a", "http://127.0.0.1:8001"),
        ("127.0.0.2:8001", "http://x=y@127.0.0.2:8001"),
    ]
    with pytest.raises(ValueError, match="one name"):
        static_targets(["a=http://127.0.0.1:1", "a=http://127.0.0.1:2"])
    (plain,) = static_targets(["pod-a=http://127.0.0.1:8001"])
    assert plain.rows_url == "http://127.0.0.1:8001"  # residency beside the API without --pod-admin-port
    (split,) = static_targets(["pod-a=http://127.0.0.1:8001"], admin_port=9001)
    assert (split.url, split.rows_url) == ("http://127.0.0.1:8001", "http://127.0.0.1:9001")
    assert (
        with_port("http://10.0.0.7:8080", 8081) == "http://10.0.0.7:8081"
        and with_port("http://a:1", None) == "http://a:1"
        and with_port("http://[fd00::7]:8080", 8081) == "http://[fd00::7]:8081"
    )


def kube_pod(ip: str, ports: list[tuple[str, int]], ready: bool = True) -> Any:
    from kubernetes_asyncio import client

    container = client.V1Container(name="server", ports=[client.V1ContainerPort(p, name=n) for n, p in ports])
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=f"pod-{ip}"),
        spec=client.V1PodSpec(containers=[container]),
        status=client.V1PodStatus(pod_ip=ip, conditions=[client.V1PodCondition(type="Ready", status=str(ready))]),
    )


def test_each_pod_says_where_its_admin_routes_are() -> None:
    pool = KubePods("ml", "app=x", 8080, admin_port=9001)
    new = pool._target(kube_pod("10.0.0.1", [("http", 8080), ("admin", 8081)]))
    assert new is not None and (new.url, new.rows_url) == ("http://10.0.0.1:8080", "http://10.0.0.1:8081")
    old = pool._target(kube_pod("10.0.0.2", [("http", 8080)]))  # made before it had one: the flag's port
    assert old is not None and old.rows_url == "http://10.0.0.2:9001"
    bare = KubePods("ml", "app=x", 8080)._target(kube_pod("10.0.0.3", [("http", 8080)]))
    assert bare is not None and bare.rows_url == "http://10.0.0.3:8080"  # beside the API
    assert pool._target(kube_pod("10.0.0.4", [("admin", 8081)], ready=False)) is None


def test_adapter_series_are_bounded_and_only_grow() -> None:
    counts = AdapterCounts(max_labels=2)
    for adapter, resident in [("a", True), ("a", True), ("b", False), ("c", True)]:
        counts.record(adapter, resident)
    assert dict(counts.series()) == {"a": AdapterCount(2, 2), "b": AdapterCount(1, 0), OTHER: AdapterCount(1, 1)}
    for _ in range(2):  # c outgrows b (lifetime 2 > 1): b's series stops, c's starts from zero
        counts.record("c", False)
    assert dict(counts.series()) == {"a": AdapterCount(2, 2), "c": AdapterCount(2, 0), OTHER: AdapterCount(1, 1)}
    for _ in range(3):  # b passes a (lifetime 3 > 2): resumes from its last value, a goes stale
        counts.record("b", True)
    assert dict(counts.series()) == {"b": AdapterCount(3, 2), "c": AdapterCount(2, 0), OTHER: AdapterCount(2, 2)}


def test_router_metrics_count_tiers_and_forget_pods_gone_for_long() -> None:
    metrics = RouterMetrics(max_adapter_labels=4)
    view = PodView("pod-a", "http://a", {"french": "host", "json": "loading"})
    for adapter in ("french", "json", None):
        metrics.routed("pod-a", adapter, tier_name(view, adapter))
    metrics.watch_pool(lambda: 1, lambda: {"hot": 3})
    text = generate_latest(metrics.registry).decode()
    for line in (
        'loraplane_router_requests_total{pod="pod-a",tier="host"} 1.0',
        'loraplane_router_requests_total{pod="pod-a",tier="none"} 1.0',
        'loraplane_router_requests_total{pod="pod-a",tier="base"} 1.0',
        'loraplane_router_adapter_resident_requests_total{adapter="french"} 1.0',
        'loraplane_router_adapter_resident_requests_total{adapter="json"} 0.0',
        'loraplane_router_adapter_home_width{adapter="hot"} 3.0',
        "loraplane_router_resident_ratio 0.5",
        "loraplane_router_pods 1.0",
    ):
        assert line in text, line
    now = metrics.pod_seen["pod-a"]
    metrics.pods_now(["pod-b"], now=now + POD_SERIES_TTL_S / 2)
    assert 'pod="pod-a"' in generate_latest(metrics.registry).decode()
    metrics.pods_now(["pod-b"], now=now + POD_SERIES_TTL_S + 1)
    assert 'pod="pod-a"' not in generate_latest(metrics.registry).decode()


def test_a_spilled_adapter_narrows_back_with_no_request_for_it() -> None:
    config = RouterConfig(pods=tuple(f"{n}=http://{n}:8080" for n in NAMES), spill_queue=2)
    router = Router(config, httpx.AsyncClient())
    router.pool.pods = {p.name: p for p in pods()}
    first, *_ = rank("hot", NAMES)
    router.pool.pods[first].others = 5
    router.order("hot")
    assert router.spill.widths == {"hot": 2}
    router.pool.pods[first].others = 0
    router.spill.settle_s = 0.0  # calm at once: the next poll narrows it
    router.after_poll()
    router.after_poll()
    assert router.spill.widths == {}
    text = generate_latest(router.metrics.registry).decode()
    assert "loraplane_router_spills_total 1.0" in text and "loraplane_router_adapter_home_width{" not in text


def test_a_pod_loading_the_adapter_for_an_earlier_request_comes_before_a_cold_one() -> None:
    view = pods()
    first, second, third, _ = rank("french", NAMES)
    by_name = {p.name: p for p in view}
    by_name[first].others = 10  # the home is over the bound: the request overflows
    assert choose("french", view, width=1, epsilon=0.25)[0].name == second
    by_name[third].pending["french"] = 0.0  # an earlier overflow went to the third: it is loading it
    assert choose("french", view, width=1, epsilon=0.25)[0].name == third
    by_name[second].residency = {"french": "disk"}  # loading it (to memory) beats holding it on disk
    assert choose("french", view, width=1, epsilon=0.25)[0].name == third
    by_name[second].residency = {"french": "device"}  # on the device beats loading
    assert choose("french", view, width=1, epsilon=0.25)[0].name == second


def test_at_a_low_load_the_home_pod_keeps_its_adapter() -> None:
    view = pods()
    first, second, *_ = rank("french", NAMES)
    {p.name: p for p in view}[first].others = 1  # the request before, as the last poll saw it
    assert load_bound(view, 0.25, floor=1) == 1  # the bare bound would send this one elsewhere
    assert load_bound(view, 0.25) == 2
    assert choose("french", view, width=1, epsilon=0.25)[0].name == first
    assert choose("french", view, width=1, epsilon=0.25, floor=1)[0].name == second


def test_the_floor_holds_only_while_the_pool_has_fewer_requests_than_pods() -> None:
    view = pods()
    for p, load in zip(view, [1, 1, 1, 0], strict=True):
        p.others = load
    assert load_bound(view, 0.25) == 2.0  # 4 with this one, 4 pods: the floor
    view[3].others = 1
    assert load_bound(view, 0.25) == pytest.approx(1.25 * 5 / 4)  # 5 on 4 pods: the bare bound


def test_a_pod_sent_an_adapter_it_had_on_disk_counts_as_holding_it_in_memory() -> None:
    view = pods(**{n.replace("-", "_"): {"french": "disk"} for n in NAMES})
    first, second, third, _ = rank("french", NAMES)
    by_name = {p.name: p for p in view}
    by_name[first].others = 10
    assert choose("french", view, width=1, epsilon=0.25)[0].name == second
    by_name[third].pending["french"] = 0.0
    assert choose("french", view, width=1, epsilon=0.25)[0].name == third


def test_an_answer_in_full_tells_the_pool_the_pod_holds_the_adapter() -> None:
    router = Router(RouterConfig(pods=("pod-a=http://pod-a:8080",)), httpx.AsyncClient())
    router.pool.pods = {"pod-a": PodView("pod-a", "http://pod-a:8080", {"french": "disk"}, in_flight=2)}
    router.pool.sent("pod-a", "french")
    assert "french" in router.pool.pods["pod-a"].pending
    router.pool.release("pod-a")  # a failed or cut-off answer says nothing about residency
    assert router.pool.pods["pod-a"].tier_of("french") == 2 and router.pool.pods["pod-a"].in_flight == 1
    router.pool.release("pod-a", served="french")
    pod = router.pool.pods["pod-a"]
    assert pod.tier_of("french") == 1 and not pod.pending and pod.in_flight == 0


def test_a_spilled_adapter_goes_to_its_least_loaded_home_pod_holding_it_or_not() -> None:
    view = pods()
    first, second, third, fourth = rank("hot", NAMES)
    by_name = {p.name: p for p in view}
    by_name[first].residency = {"hot": "device"}
    by_name[first].others, by_name[second].others, by_name[third].others = 4, 1, 0
    # (epsilon 3: the load bound out of the way) 4 requests; 1 + MISS_COST; 0 + MISS_COST
    assert [p.name for p in choose("hot", view, width=3, epsilon=3.0)][:3] == [third, second, first]
    by_name[first].others = 2  # 2 in memory against 0 + MISS_COST: a tie, the pod holding it first
    assert [p.name for p in choose("hot", view, width=3, epsilon=3.0)][:3] == [first, third, second]


# the hold: requests wait for a Ready pod (a pool scaled to zero wakes on their count)


def test_the_hold_returns_what_appears_once_woken_and_counts_its_waiters() -> None:
    async def scenario() -> None:
        hold = Hold(max_held=2, timeout_s=5.0)
        found: list[str] = []
        waiter = asyncio.ensure_future(hold.wait(lambda: found[0] if found else None))
        await asyncio.sleep(0.05)
        assert hold.held == 1 and not waiter.done()
        hold.wake()  # a poll that found nothing: the waiter looks again and keeps waiting
        await asyncio.sleep(0.05)
        assert not waiter.done()
        found.append("pod-a")
        hold.wake()
        value, waited = await asyncio.wait_for(waiter, 1.0)
        assert value == "pod-a" and 0.05 < waited < 1.0 and hold.held == 0

    asyncio.run(scenario())


def test_the_hold_is_bounded_in_time_and_in_number() -> None:
    async def scenario() -> None:
        hold = Hold(max_held=1, timeout_s=0.2)
        first = asyncio.ensure_future(hold.wait(lambda: None))
        await asyncio.sleep(0.01)
        with pytest.raises(HoldFull):
            await hold.wait(lambda: None)
        value, waited = await first
        assert value is None and waited >= 0.2 and hold.held == 0
        assert await hold.wait(lambda: "now") == ("now", pytest.approx(0.0, abs=0.05))  # no wait when found

    asyncio.run(scenario())
    assert not Hold(0, 60).enabled and not Hold(8, 0).enabled and Hold(8, 60).enabled
    with pytest.raises(ValueError, match="hold"):
        Hold(-1, 1)
    with pytest.raises(ValueError, match="hold"):
        RouterConfig(pods=("http://127.0.0.1:1",), hold_timeout_s=-1)


def test_a_router_without_ready_pods_exports_what_it_holds() -> None:
    async def scenario() -> None:
        async with httpx.AsyncClient() as http:
            router = Router(RouterConfig(pods=("cold=http://127.0.0.1:9",), hold_max=4, hold_timeout_s=5.0), http)
            waiter = asyncio.ensure_future(router._hold(None))
            await asyncio.sleep(0.05)
            text = generate_latest(router.metrics.registry).decode()
            assert "loraplane_router_held_requests 1.0" in text
            router.pool.pods = {"cold": PodView("cold", "http://127.0.0.1:9", {})}
            router.after_poll()  # a poll that found a Ready pod wakes the held requests
            order = await asyncio.wait_for(waiter, 1.0)
            assert [p.name for p in order] == ["cold"]  # type: ignore[union-attr]
            text = generate_latest(router.metrics.registry).decode()
            assert "loraplane_router_held_requests 0.0" in text and "loraplane_router_held_seconds_count 1.0" in text

    asyncio.run(scenario())
