"""Which adapter sits in which device slot, and who uses it. Plain Python, no torch.

A slot used by running sequences (refs > 0) or holding a protected pinned adapter is never evicted;
the others are evicted least recently released first when a new adapter needs a slot. Pins never
take every slot: `pin` refuses beyond `num_slots - 1` (so one slot always serves unpinned adapters),
and should every slot hold a pinned adapter anyway, none of them is protected.
"""

from __future__ import annotations

from collections import OrderedDict

from loraplane_server.errors import PinLimitError as PinLimitError  # raised here; importers also take it from here


class SlotTable:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.slot_of: dict[str, int] = {}
        self.adapter_in: list[str | None] = [None] * num_slots
        self.refs = [0] * num_slots
        self.pinned: set[str] = set()
        self.idle: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_slots))  # refs == 0

    def lookup(self, adapter_id: str) -> int | None:
        return self.slot_of.get(adapter_id)

    @property
    def num_busy(self) -> int:
        return sum(1 for r in self.refs if r > 0)

    @property
    def max_pinned(self) -> int:
        return self.num_slots - 1

    # pinning
    def pin(self, adapter_id: str) -> None:
        """Keep adapter_id's slot once it has one; PinLimitError if that would pin every slot."""
        self.check_pin(adapter_id)
        self.pinned.add(adapter_id)

    def check_pin(self, adapter_id: str) -> None:
        """PinLimitError if pinning adapter_id would leave no slot for unpinned adapters."""
        if adapter_id not in self.pinned and len(self.pinned) >= self.max_pinned:
            raise PinLimitError(
                f"cannot pin adapter {adapter_id!r}: {len(self.pinned)} adapters are pinned "
                f"({', '.join(sorted(self.pinned)) or 'none'}) and with {self.num_slots} device slots "
                f"(--max-loras) at most {self.max_pinned} can be, so that one slot always serves unpinned "
                "adapters; unpin one (pinned: false) or raise --max-loras"
            )

    def unpin(self, adapter_id: str) -> None:
        self.pinned.discard(adapter_id)

    def is_protected(self, adapter_id: str | None) -> bool:
        """Pinned and so kept in its slot, unless pinned adapters fill every slot."""
        if adapter_id is None or adapter_id not in self.pinned:
            return False
        return sum(1 for a in self.adapter_in if a in self.pinned) < self.num_slots

    # slots
    def _victim(self) -> int | None:
        for slot in self.idle:
            if not self.is_protected(self.adapter_in[slot]):
                return slot
        return None

    def can_acquire(self, adapter_id: str) -> bool:
        return adapter_id in self.slot_of or self._victim() is not None

    def acquire(self, adapter_id: str, ref: bool = True) -> tuple[int, bool]:
        """A slot for adapter_id (one more user if ref): (slot, whether its weights must be copied in)."""
        slot = self.slot_of.get(adapter_id)
        needs_load = slot is None
        if slot is None:
            slot = self._victim()
            if slot is None:
                raise RuntimeError("acquire() without can_acquire()")
            old = self.adapter_in[slot]
            if old is not None:
                del self.slot_of[old]
            self.adapter_in[slot], self.slot_of[adapter_id] = adapter_id, slot
        if ref:
            self.refs[slot] += 1
            self.idle.pop(slot, None)
        else:
            self.idle.move_to_end(slot)
        return slot, needs_load

    def release(self, adapter_id: str) -> None:
        slot = self.slot_of[adapter_id]
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            self.idle[slot] = None  # most recently released: evicted last

    def evict(self, adapter_id: str) -> bool:
        """Drop an idle adapter from its slot (unload); False if it is in use."""
        slot = self.slot_of.get(adapter_id)
        if slot is None or self.refs[slot] > 0:
            return slot is None
        del self.slot_of[adapter_id]
        self.adapter_in[slot] = None
        self.idle.move_to_end(slot, last=False)
        self.pinned.discard(adapter_id)
        return True
