"""The engine's one adapter API (`LLMEngine.adapters`): what admin, LoRAX, /v1/models and the metrics call
(register, sources, prewarm / unload / set_tier and their goals, the residency report), and the moves
between the tiers in step with the scheduler (finished background loads, device prewarms, the slot loads
a schedule asks for). The engine calls it between steps; requests that cannot run fail through `fail`.
Every call runs on the engine thread."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

from loraplane_server.adapters.manager import AdapterManager, AdapterState
from loraplane_server.adapters.slot_table import SlotTable
from loraplane_server.errors import (
    AdapterError,
    AdapterInUseError,
    AdapterLoadError,
    InvalidRequestError,
    RequestFailedError,
    UnknownAdapterError,
)
from loraplane_server.request_output import RequestOutput
from loraplane_server.store.sources import parse_source

if TYPE_CHECKING:
    from loraplane_server.executor.lora.slots import LoRASlots
    from loraplane_server.sequence import Sequence

Fail = Callable[["Sequence", RequestFailedError], RequestOutput]


class Queues(Protocol):
    """The scheduler as the orchestrator sees it (engine/scheduler.py): its running sequences, the adapters
    with waiting requests (`rr`, None for the base model) and their requests taken out."""

    @property
    def running(self) -> list[Sequence]: ...

    @property
    def rr(self) -> Iterable[str | None]: ...

    def take_waiting(self, adapter_id: str) -> list[Sequence]: ...


class AdapterOrchestrator:
    def __init__(
        self,
        manager: AdapterManager,
        slots: SlotTable,
        lora_slots: LoRASlots,
        scheduler: Queues,
        requests: Mapping[str, Sequence],
        fail: Fail,
    ) -> None:
        """requests: the engine's unfinished requests; fail(seq, error): finish one with an error, its output."""
        self.manager = manager
        self.slots = slots
        self.lora_slots = lora_slots
        self.scheduler = scheduler
        self.requests = requests
        self.fail = fail
        self.device_prewarm: set[str] = set()
        self.tier_goals: dict[str, str] = {}  # adapter -> the exact tier set_tier asked for, until reached

    # the registry
    def request(self, adapter_id: str) -> None:
        """A request for `adapter_id` arrives: UnknownAdapterError where it is not known; a miss starts its
        background load (adapters/manager.py)."""
        self.manager.request(adapter_id)

    def register(self, adapter_id: str, source: str) -> None:
        """Know `adapter_id` by `source` (a different source replaces the old one's cached copies)."""
        self.manager.register(adapter_id, source)

    def source_of(self, adapter_id: str, look_in_dir: bool = True) -> str | None:
        """The source an adapter is known by; None when unknown. look_in_dir: an adapter of --adapter-dir
        not yet registered counts (and is registered now)."""
        rec = self.manager.lookup(adapter_id) if look_in_dir else self.manager.records.get(adapter_id)
        return None if rec is None else rec.source.uri

    def replace(self, adapter_id: str, source: str) -> bool:
        """Know `adapter_id` by `source`, unloading it first where it is known by another (refused with
        AdapterInUseError while requests use it). Whether anything changed."""
        known = self.source_of(adapter_id, look_in_dir=False)
        if known == parse_source(source).uri:
            return False
        if known is not None:
            self.unload(adapter_id)
        self.manager.register(adapter_id, source)
        return True

    def known_ids(self) -> list[str]:
        """Every adapter known here, --adapter-dir scanned again first."""
        self.manager.scan_adapter_dir()
        return sorted(self.manager.records)

    @property
    def num_known(self) -> int:
        return len(self.manager.records)

    def allow_sources(self, allowlist: list[str] | None) -> None:
        """The sources a load may fetch from (every redirect of a remote source checked too)."""
        self.manager.source_allow = allowlist

    def shutdown(self) -> None:
        """Stop the background loads."""
        self.manager.shutdown()

    # between steps
    def poll(self) -> list[RequestOutput]:
        """Apply finished background loads: fail the waiting requests of adapters that failed."""
        outputs = []
        for adapter_id, error in self.manager.drain_completions():
            if error is None or self.manager.is_loading(adapter_id):
                continue  # fine, or superseded by a retry that is in flight
            self.device_prewarm.discard(adapter_id)
            for seq in self.scheduler.take_waiting(adapter_id):
                outputs.append(self.fail(seq, AdapterLoadError(adapter_id, error)))
        for adapter_id in [k for k in self.scheduler.rr if k is not None]:
            if self.manager.was_evicted(adapter_id):
                self.manager.request(adapter_id)  # evicted from host while its requests waited
        for adapter_id in list(self.device_prewarm):
            if self.manager.is_ready(adapter_id) and self.slots.can_acquire(adapter_id):
                slot, needs_load = self.slots.acquire(adapter_id, ref=False)
                if needs_load:
                    self.lora_slots.load(slot, self.manager.weights(adapter_id))
                self.device_prewarm.discard(adapter_id)
        self._advance_tier_goals()
        return outputs

    def load_slots(self, slot_loads: list[tuple[int, str]]) -> list[RequestOutput]:
        """Copy the adapters a schedule placed into device slots; a copy that fails fails its running requests."""
        outputs = []
        stats = self.manager.stats
        for slot, adapter_id in slot_loads:
            stats.misses["device"] += 1
            stats.evictions["device"] += self.lora_slots.adapter_in[slot] is not None
            stats.loads["device"] += 1
            try:
                self.lora_slots.load(slot, self.manager.weights(adapter_id))
            except (AdapterError, OSError, ValueError) as exc:
                self.lora_slots.clear(slot)
                for seq in [s for s in self.scheduler.running if s.adapter_id == adapter_id]:
                    outputs.append(self.fail(seq, AdapterLoadError(adapter_id, str(exc))))
                self.slots.evict(adapter_id)  # after the failures: their refs held the slot
        return outputs

    # admin
    def prewarm(self, adapter_id: str, tier: str = "device", pinned: bool | None = None) -> None:
        """Move an adapter up to `tier` (device | host | disk) in the background; optionally pin it.

        A pin keeps the adapter on every tier it reaches, its device slot included, so at most
        max_loras - 1 adapters can be pinned: PinLimitError (before any change) beyond that."""
        if tier not in ("device", "host", "disk", "none"):
            raise InvalidRequestError(f"tier {tier!r}: expected device, host, disk or none", param="tier")
        if pinned:
            self.slots.check_pin(adapter_id)
        if tier != "none":
            self.manager.prewarm(adapter_id, tier)
        if tier == "device":
            self.device_prewarm.add(adapter_id)
        if pinned is not None:
            self.manager.set_pinned(adapter_id, pinned)
            (self.slots.pin if pinned else self.slots.unpin)(adapter_id)

    def unload(self, adapter_id: str) -> bool:
        """Forget an adapter on every tier. Refused (AdapterInUseError) while requests use or await it."""
        users = [s for s in self.requests.values() if s.adapter_id == adapter_id]
        if users:
            raise AdapterInUseError(adapter_id, len(users))
        slot = self.slots.lookup(adapter_id)
        if slot is not None:
            self.slots.evict(adapter_id)
            self.lora_slots.clear(slot)
        self.slots.unpin(adapter_id)  # also when it never reached a slot: a stale pin would count against the limit
        self.device_prewarm.discard(adapter_id)
        self.tier_goals.pop(adapter_id, None)
        return self.manager.unregister(adapter_id)

    # exact tiers
    def set_tier(self, adapter_id: str, tier: str) -> dict:
        """Move a known adapter to exactly `tier` (device | host | disk) and return its residency row.

        Promotion loads it as prewarm does. Demotion frees: the device slot at once, or once the running
        requests that use it finish (the row's tier stays "device" meanwhile, "target_tier" says the goal);
        to disk also the host copy. Demoting below device clears a pin. Later requests may promote it again.
        UnknownAdapterError for an unknown adapter, InvalidRequestError for another tier."""
        if tier not in ("device", "host", "disk"):
            raise InvalidRequestError(f"tier {tier!r}: expected device, host or disk", param="tier")
        if self.manager.lookup(adapter_id) is None:
            raise UnknownAdapterError(adapter_id)
        self.tier_goals[adapter_id] = tier
        if tier == "device":
            self.prewarm(adapter_id, "device")
        else:
            self.device_prewarm.discard(adapter_id)
            self.manager.set_pinned(adapter_id, False)
            self.slots.unpin(adapter_id)
        self._advance_tier_goal(adapter_id, tier)
        return next(r for r in self.residency() if r["id"] == adapter_id)

    def _advance_tier_goals(self) -> None:
        for adapter_id, tier in list(self.tier_goals.items()):
            rec = self.manager.records.get(adapter_id)
            if rec is None or rec.state == AdapterState.FAILED:
                del self.tier_goals[adapter_id]  # its load failed: the row's state and last_error say why
            else:
                self._advance_tier_goal(adapter_id, tier)

    def _advance_tier_goal(self, adapter_id: str, tier: str) -> None:
        if self._reach_tier(adapter_id, tier):
            del self.tier_goals[adapter_id]

    def _reach_tier(self, adapter_id: str, tier: str) -> bool:
        """One move towards `tier`; True once the adapter is there."""
        slot = self.slots.lookup(adapter_id)
        if tier == "device":
            return slot is not None
        if slot is not None:
            if not self.slots.evict(adapter_id):
                return False  # running requests use the slot: freed on a later step, after they finish
            self.lora_slots.clear(slot)
            self.manager.stats.evictions["device"] += 1
        return self.manager.settle(adapter_id, tier)

    def residency(self) -> list[dict]:
        """Every known adapter: tier, state, size, rank, errors, hits."""
        rows = []
        for rec in list(self.manager.records.values()):
            slot = self.slots.lookup(rec.adapter_id)
            rows.append(
                {
                    "id": rec.adapter_id,
                    "source": rec.source.uri,
                    "state": rec.state.value,
                    "tier": "device" if slot is not None else self.manager.tier_of(rec.adapter_id),
                    "slot": slot,
                    "rank": rec.rank,
                    "size_bytes": rec.size_bytes,
                    "target_modules": rec.target_modules,
                    "pinned": rec.pinned,
                    "last_error": rec.last_error,
                    "error_transient": rec.error_transient,  # a failed load: may trying again later succeed
                    "hits": rec.hits,
                    "loads": rec.loads,
                    "load_seconds": rec.load_seconds,
                    "running": 0 if slot is None else self.slots.refs[slot],
                    "target_tier": self.tier_goals.get(rec.adapter_id),
                }
            )
        return rows
