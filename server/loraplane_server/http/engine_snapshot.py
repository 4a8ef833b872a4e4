"""A consistent copy of the engine's state, taken on the engine thread (AsyncEngine.call)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from loraplane_server.engine import LLMEngine
from loraplane_server.lora.manager import TIERS


@dataclass
class EngineSnapshot:
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
    load_seconds: list[float] = field(default_factory=list)  # loads finished since the caller's last look
    num_loads_seen: int = 0  # for the next call's loads_seen
    num_adapters: int = 0

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("load_seconds")
        return out


def take_snapshot(engine: LLMEngine, loads_seen: int = 0) -> EngineSnapshot:
    """Run on the engine thread: engine state is not thread-safe."""
    sched, stats = engine.scheduler, engine.adapters.stats
    rows = engine.adapter_residency()
    resident = dict.fromkeys(TIERS, 0) | Counter(row["tier"] for row in rows)
    return EngineSnapshot(
        num_waiting=sched.num_waiting,
        num_running=len(sched.running),
        num_requests=len(engine.requests),
        num_blocks=engine.block_manager.num_blocks,
        num_free_blocks=engine.block_manager.num_free_blocks,
        kv_cache_usage=engine.block_manager.usage,
        max_loras=engine.slots.num_slots,
        num_busy_slots=engine.slots.num_busy,
        running_adapters=sorted({s.adapter_id for s in sched.running if s.adapter_id}),
        waiting_adapters=sorted(k for k in sched.rr if k is not None and sched.queues.get(k)),
        resident=resident,
        hits=dict(stats.hits),
        misses=dict(stats.misses),
        loads=dict(stats.loads),
        evictions=dict(stats.evictions),
        load_seconds=list(stats.load_seconds[loads_seen:]),
        num_loads_seen=len(stats.load_seconds),
        num_adapters=len(rows),
    )
