"""Which adapter sits in which device slot, and who uses it. Plain Python, no torch.

A slot used by running sequences (refs > 0) or pinned is never evicted; the others are evicted
least recently released first when a new adapter needs a slot.
"""

from __future__ import annotations

from collections import OrderedDict


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

    def _victim(self) -> int | None:
        for slot in self.idle:
            adapter = self.adapter_in[slot]
            if adapter is None or adapter not in self.pinned:
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
