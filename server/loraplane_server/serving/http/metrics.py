"""Prometheus metrics: one CollectorRegistry per app, no global state.

Request-path metrics (latencies, token counters, per-adapter usage) are recorded as requests finish.
Engine gauges and adapter-cache counters are read at scrape time from an EngineSnapshot taken on the
engine thread, including the gauges of the Gateway API Inference Extension's model-server protocol.

Token usage per adapter, for billing-style metrics, has a bounded label set (loraplane_server.serving.bounded_labels):
the busiest adapters by lifetime tokens have their own series, the rest count under `__other__`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraplane_server.engine.snapshot import EngineSnapshot
from loraplane_server.serving.bounded_labels import BoundedLabels

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
LOAD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


@dataclass
class Usage:
    prompt_tokens: int = 0
    generated_tokens: int = 0


class AdapterUsage(BoundedLabels[Usage]):
    """Prompt and generated tokens per adapter, `max_labels` adapters at most (ranked by all their tokens)."""

    def __init__(self, max_labels: int) -> None:
        super().__init__(max_labels, Usage)

    def record(self, adapter: str, prompt_tokens: int, generated_tokens: int) -> None:
        usage = self.value(adapter, prompt_tokens + generated_tokens)
        usage.prompt_tokens += prompt_tokens
        usage.generated_tokens += generated_tokens


@dataclass
class SpecCounts:
    proposed: int = 0
    accepted: int = 0
    steps: int = 0  # verification passes


class AdapterSpeculation(BoundedLabels[dict[str, SpecCounts]]):
    """Speculative tokens proposed and accepted per adapter and method, `max_labels` adapters at most
    (ranked by proposed tokens)."""

    def __init__(self, max_labels: int) -> None:
        super().__init__(max_labels, dict)

    def record(self, adapter: str, method: str, proposed: int, accepted: int, steps: int) -> None:
        counts = self.value(adapter, proposed).setdefault(method, SpecCounts())
        counts.proposed += proposed
        counts.accepted += accepted
        counts.steps += steps


class Metrics:
    def __init__(self, base_label: str, max_adapter_labels: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.base_label = base_label
        r = self.registry
        self.ttft = Histogram(
            "loraplane_time_to_first_token_seconds",
            "Arrival to first generated token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "loraplane_inter_token_latency_seconds",
            "Time between two generated tokens",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "loraplane_request_latency_seconds",
            "Arrival to last token, per finished request",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("loraplane_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter(
            "loraplane_generation_tokens", "Generated tokens of finished requests", registry=r
        )
        self.requests = Counter(
            "loraplane_requests", "Finished generation requests", ["api", "finish_reason"], registry=r
        )
        self.rejected = Counter(
            "loraplane_requests_rejected", "Generation requests refused before the engine", ["reason"], registry=r
        )
        for reason in REJECT_REASONS:  # every series from the start, at 0: a rate() alert sees the first one
            self.rejected.labels(reason)
        self.adapter_load = Histogram(
            "loraplane_adapter_load_seconds", "Adapter loads into host memory", buckets=LOAD_BUCKETS, registry=r
        )
        self.usage = AdapterUsage(max_adapter_labels)
        self.speculation = AdapterSpeculation(max_adapter_labels)
        self.engine = EngineCollector(self)
        r.register(self.engine)

    def record_request(
        self,
        api: str,
        adapter_id: str | None,
        finish_reason: str,
        num_prompt: int,
        num_generated: int,
        ttft: float | None,
        e2e: float,
    ) -> None:
        self.requests.labels(api, finish_reason).inc()
        self.prompt_tokens.inc(num_prompt)
        self.generated_tokens.inc(num_generated)
        if ttft is not None:
            self.ttft.observe(ttft)
        self.e2e.observe(e2e)
        self.usage.record(adapter_id or self.base_label, num_prompt, num_generated)

    def record_speculation(self, adapter_id: str | None, method: str, proposed: int, accepted: int, steps: int) -> None:
        """A finished request's speculative decoding (nothing when it never verified a proposal)."""
        if steps:
            self.speculation.record(adapter_id or self.base_label, method, proposed, accepted, steps)

    def update(self, snap: EngineSnapshot) -> None:
        self.engine.snapshot = snap
        for seconds in snap.load_seconds:
            self.adapter_load.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


REJECT_REASONS = ("loading", "draining", "failed", "queue_full")  # serving/http/state.py's Rejected reasons


class EngineCollector(Collector):
    """Gauges and counters read from the latest EngineSnapshot, and per-adapter usage."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.snapshot = EngineSnapshot()

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        yield _gauge(
            "loraplane_queue_depth", "Requests waiting to be scheduled (the autoscaling signal)", s.num_waiting
        )
        yield _gauge("loraplane_requests_running", "Requests in the running batch", s.num_running)
        yield _gauge("loraplane_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use", s.kv_cache_usage)
        yield _gauge("loraplane_kv_cache_blocks_free", "Free KV-cache blocks", s.num_free_blocks)
        yield _gauge("loraplane_kv_cache_blocks", "KV-cache blocks in all", s.num_blocks)
        yield _gauge("loraplane_adapter_slots_busy", "Device adapter slots used by running requests", s.num_busy_slots)
        yield _gauge("loraplane_adapter_slots", "Device adapter slots (--max-loras)", s.max_loras)
        resident = GaugeMetricFamily(
            "loraplane_adapters_resident", "Known adapters by highest tier held", labels=["tier"]
        )
        for tier, n in sorted(s.resident.items()):
            resident.add_metric([tier], n)
        yield resident
        for name, values in (("hits", s.hits), ("misses", s.misses), ("loads", s.loads), ("evictions", s.evictions)):
            family = CounterMetricFamily(f"loraplane_adapter_{name}", f"Adapter cache {name} by tier", labels=["tier"])
            for tier, n in sorted(values.items()):
                family.add_metric([tier], n)
            yield family
        failures = CounterMetricFamily(
            "loraplane_adapter_load_failures",
            "Adapter loads that failed, by kind (transient: the source or the disk, a retry may help; permanent: "
            "the adapter itself)",
            labels=["kind"],
        )
        for kind, n in sorted(s.load_failures.items()):
            failures.add_metric([kind], n)
        yield failures
        yield from self._usage()
        yield from _vllm(s)

    def _usage(self) -> Iterator[Metric]:
        prompt = CounterMetricFamily(
            "loraplane_adapter_prompt_tokens",
            "Prompt tokens by adapter (top adapters by usage; the rest under __other__)",
            labels=["adapter"],
        )
        generated = CounterMetricFamily(
            "loraplane_adapter_generation_tokens",
            "Generated tokens by adapter (top adapters by usage; the rest under __other__)",
            labels=["adapter"],
        )
        for label, usage in self.metrics.usage.series():
            prompt.add_metric([label], usage.prompt_tokens)
            generated.add_metric([label], usage.generated_tokens)
        yield prompt
        yield generated
        yield from self._speculation()

    def _speculation(self) -> Iterator[Metric]:
        labels = ["adapter", "method"]
        proposed = CounterMetricFamily(
            "loraplane_spec_proposed_tokens", "Speculative tokens proposed, by adapter and method", labels=labels
        )
        accepted = CounterMetricFamily(
            "loraplane_spec_accepted_tokens", "Speculative tokens accepted, by adapter and method", labels=labels
        )
        steps = CounterMetricFamily(
            "loraplane_spec_verify_steps", "Passes that verified proposals, by adapter and method", labels=labels
        )
        mean = GaugeMetricFamily(
            "loraplane_spec_mean_accepted_length",
            "Proposals accepted per verifying pass (each pass also emits the model's own token)",
            labels=labels,
        )
        for label, by_method in self.metrics.speculation.series():
            for method, c in sorted(by_method.items()):
                proposed.add_metric([label, method], c.proposed)
                accepted.add_metric([label, method], c.accepted)
                steps.add_metric([label, method], c.steps)
                mean.add_metric([label, method], c.accepted / c.steps if c.steps else 0.0)
        yield from (proposed, accepted, steps, mean)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _vllm(s: EngineSnapshot) -> Iterator[Metric]:
    """The model-server protocol of the Gateway API Inference Extension (vLLM's names and meanings)."""
    yield _gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", s.num_waiting)
    yield _gauge("vllm:num_requests_running", "Requests in the running batch", s.num_running)
    yield _gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full)", s.kv_cache_usage)
    info = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running and waiting adapters; the value is a timestamp",
        labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    info.add_metric([",".join(s.running_adapters), ",".join(s.waiting_adapters), str(s.max_loras)], time.time())
    yield info
