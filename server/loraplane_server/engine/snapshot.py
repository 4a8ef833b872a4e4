"""`EngineSnapshot`: a consistent copy of the engine's state for the metrics (scheduler queues, KV blocks,
adapter slots, residency and the adapter cache's counters), taken on the engine thread by
`LLMEngine.snapshot`, so the HTTP layer reads one record instead of the engine's parts."""

from __future__ import annotations

import collections
from dataclasses import asdict, dataclass, field

from loraplane_server.adapters.manager import TIERS
from loraplane_server.adapters.orchestrator import AdapterOrchestrator
from loraplane_server.adapters.slot_table import SlotTable
from loraplane_server.engine.block_manager import BlockManager
from loraplane_server.engine.scheduler import Scheduler


@dataclass
class EngineSnapshot:
    """A consistent copy of the engine's state, taken on the engine thread (AsyncEngine.call)."""

    num_waiting: int = 0
    num_running: int = 0
    num_requests: int = 0  # known to the engine: waiting, running or finished but not yet reported
    num_blocks: int = 0
    num_free_blocks: int = 0
    kv_cache_usage: float = 0.0
    max_loras: int = 0
    num_busy_slots: int = 0
    running_adapters: list[str] = field(default_factory=list)
    waiting_adapters: list[str] = field(default_factory=list)
    resident: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    hits: dict[str, int] = field(default_factory=dict)
    misses: dict[str, int] = field(default_factory=dict)
    loads: dict[str, int] = field(default_factory=dict)
    evictions: dict[str, int] = field(default_factory=dict)
    load_failures: dict[str, int] = field(default_factory=dict)  # by kind: transient, permanent
    load_seconds: list[float] = field(default_factory=list)  # loads finished since the caller's last look
    num_loads_seen: int = 0  # for the next call's loads_seen
    num_adapters: int = 0

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("load_seconds")
        return out


def take_snapshot(
    scheduler: Scheduler,
    blocks: BlockManager,
    slots: SlotTable,
    adapters: AdapterOrchestrator,
    num_requests: int,
    loads_seen: int = 0,
) -> EngineSnapshot:
    """LLMEngine.snapshot's work, on the engine thread (engine state is not thread-safe)."""
    sched, stats = scheduler, adapters.manager.stats
    rows = adapters.residency()
    resident = dict.fromkeys(TIERS, 0) | collections.Counter(row["tier"] for row in rows)
    return EngineSnapshot(
        num_waiting=sched.num_waiting,
        num_running=len(sched.running),
        num_requests=num_requests,
        num_blocks=blocks.num_blocks,
        num_free_blocks=blocks.num_free_blocks,
        kv_cache_usage=blocks.usage,
        max_loras=slots.num_slots,
        num_busy_slots=slots.num_busy,
        running_adapters=sorted({s.adapter_id for s in sched.running if s.adapter_id}),
        waiting_adapters=sorted(k for k in sched.rr if k is not None and sched.queues.get(k)),
        resident=resident,
        hits=dict(stats.hits),
        misses=dict(stats.misses),
        loads=dict(stats.loads),
        evictions=dict(stats.evictions),
        load_failures=dict(stats.load_failures),
        load_seconds=list(stats.load_seconds[loads_seen:]),
        num_loads_seen=len(stats.load_seconds),
        num_adapters=len(rows),
    )
