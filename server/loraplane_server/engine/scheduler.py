"""Continuous batching across adapters: which sequences run this step, and how many tokens each.

Each step has a token budget. Running sequences go first, oldest first (a decode costs one token,
an unfinished prefill continues with its next chunk). Then waiting sequences are admitted from
per-adapter queues by deficit round robin over tokens: every visit adds a quantum to a queue's
deficit, and it admits while its head's prompt fits in the deficit, so one hot adapter cannot
starve the others. Within a queue, arrival order. A queue whose adapter is still loading is
skipped without blocking anyone. At most `num_slots` distinct adapters run at once; when an
adapter waits for a slot, the longest-held busy slot that is not pinned is drained (no new
admissions) until it frees, so no adapter waits forever (the slot table never lets pins hold every
slot). When KV blocks run out, the newest running sequence is preempted (blocks freed, recomputed
later from the front of its queue). No torch here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from loraplane_server.adapters.slot_table import SlotTable
from loraplane_server.engine.block_manager import BlockManager
from loraplane_server.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    preempted: list[Sequence] = field(default_factory=list)
    slot_loads: list[tuple[int, str]] = field(default_factory=list)  # (slot, adapter) to copy in first
    slot_hits: int = 0  # admissions whose adapter was already in a device slot

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        slots: SlotTable | None = None,
        is_ready: Callable[[str], bool] | None = None,
        quantum: int = 32,
        watermark: float = 0.01,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.slots = slots or SlotTable(8)
        self.is_ready = is_ready or (lambda _: True)
        self.quantum = quantum
        self.watermark_blocks = int(watermark * block_manager.num_blocks)
        self.queues: dict[str | None, deque[Sequence]] = {}
        self.rr: deque[str | None] = deque()  # keys of non-empty queues, next to serve first
        self.deficit: dict[str | None, int] = {}
        self.running: list[Sequence] = []
        self.draining: str | None = None
        self._slot_since: dict[str, int] = {}
        self.num_steps = 0
        self.num_preemptions = 0

    @property
    def waiting(self) -> list[Sequence]:
        return [s for key in self.rr for s in self.queues[key]]

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.queues.values())

    @property
    def num_unfinished(self) -> int:
        return self.num_waiting + len(self.running)

    def add(self, seq: Sequence, front: bool = False) -> None:
        key = seq.adapter_id
        queue = self.queues.setdefault(key, deque())
        queue.appendleft(seq) if front else queue.append(seq)
        if key not in self.rr:
            self.rr.append(key)
            self.deficit[key] = 0

    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    # running: decodes and unfinished prefills
    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.rope_switch_due:  # past LongRoPE's original length: recomputed with the long factors
                self._requeue(self.running.pop(i))
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            if seq.proposed:  # speculative: verify the proposals that fit, none when blocks run short
                n = self._fit_proposals(seq, budget)
            while not bm.can_allocate(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break
            bm.allocate(seq, n)
            out.scheduled.append((seq, n))
            budget -= n
            i += 1
        return budget

    def _fit_proposals(self, seq: Sequence, budget: int) -> int:
        """Trim a decoding sequence's proposals to the budget; none unless the blocks they take leave one
        for every running sequence (a proposal never costs anyone a preemption). Its tokens this step."""
        assert seq.spec is not None and seq.num_uncomputed_tokens == 1
        bm = self.block_manager
        del seq.spec.proposed[max(0, budget - 1) :]
        if bm.spare_after(seq, 1 + len(seq.spec.proposed)) < len(self.running):
            seq.spec.proposed = []
        return 1 + len(seq.spec.proposed)

    # waiting: deficit round robin over adapter queues
    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        self._update_draining()
        while self.rr and budget > 0 and len(self.running) < self.max_num_seqs:
            eligible = {k for k in self.rr if self._is_eligible(k)}
            if not eligible:
                return
            # every pass is at least one round; the rounds in which nobody could admit are granted at once
            rounds = max(1, min(-(-(len(self.queues[k][0]) - self.deficit[k]) // self.quantum) for k in eligible))
            for _ in range(len(self.rr)):
                key = self.rr[0]
                if key in eligible:
                    self.deficit[key] += rounds * self.quantum
                    budget = self._serve(key, out, budget)
                self._next_queue(key)  # the next step starts with the next queue, even when full
                if budget < 0:
                    return

    def _serve(self, key: str | None, out: SchedulerOutput, budget: int) -> int:
        """Admit from one queue while its deficit lasts; -1 when a shared resource ran out."""
        bm = self.block_manager
        queue = self.queues[key]
        while queue and self.deficit[key] >= len(queue[0]):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                return -1
            if key is not None and not self.slots.can_acquire(key):
                return budget
            seq = queue[0]
            cached = bm.find_cached_blocks(seq)
            n = min(len(seq) - len(cached) * bm.block_size, budget)
            spare = bm.spare_after(seq, n, cached)  # the blocks a hit shares are not taken
            if spare < 0 or (self.running and spare < self.watermark_blocks):
                return -1
            queue.popleft()
            self.deficit[key] -= len(seq)
            self._admit(seq, n, cached, out)
            budget -= n
        return budget

    def _admit(self, seq: Sequence, n: int, cached: list[int], out: SchedulerOutput) -> None:
        if seq.adapter_id is not None:
            slot, needs_load = self.slots.acquire(seq.adapter_id)
            seq.lora_slot = slot
            if needs_load:
                out.slot_loads.append((slot, seq.adapter_id))
                self._slot_since[seq.adapter_id] = self.num_steps
            else:
                out.slot_hits += 1
        self.block_manager.allocate(seq, n, cached)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        out.scheduled.append((seq, n))

    def _is_eligible(self, key: str | None) -> bool:
        if key is None:
            return True
        if key == self.draining or not self.is_ready(key):
            return False
        return self.slots.can_acquire(key)

    def _update_draining(self) -> None:
        """While ready adapters wait for a slot and none is free, drain the longest-held busy one.

        The drained adapter admits nothing until it has lost its slot or nobody waits any more.
        """
        wanting = [
            k
            for k in self.rr
            if k is not None and k != self.draining and self.is_ready(k) and self.slots.lookup(k) is None
        ]
        if self.draining is not None:
            if self.slots.lookup(self.draining) is not None and wanting:
                return
            self.draining = None
        if wanting and not self.slots.can_acquire(wanting[0]):
            busy = [a for a in self.slots.slot_of if not self.slots.is_protected(a)]
            if busy:
                self.draining = min(busy, key=lambda a: self._slot_since.get(a, 0))

    def _next_queue(self, key: str | None) -> None:
        if self.queues.get(key):
            self.rr.rotate(-1)
        else:
            self._drop_queue(key)

    def _drop_queue(self, key: str | None) -> None:
        self.rr.remove(key)
        self.queues.pop(key, None)
        self.deficit.pop(key, None)

    def _release(self, seq: Sequence) -> None:
        if seq.lora_slot is not None and seq.adapter_id is not None:
            self.slots.release(seq.adapter_id)
            seq.lora_slot = None

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self._requeue(seq)

    def _requeue(self, seq: Sequence) -> None:
        """Its blocks and slot freed, to be recomputed from the front of its queue: a preempted sequence, or one
        whose K/V hold LongRoPE's short factors grown past the original length, which transformers' generate
        recomputes whole with the long ones at that step (Phi3ForCausalLM.prepare_inputs_for_generation drops
        its cache); readmitted, it finds its prefix hits under the long factors' key (Sequence.prefix_key)."""
        self._release(seq)
        self.block_manager.free_seq(seq)
        seq.reset_for_recompute()
        self.add(seq, front=True)

    def take_waiting(self, adapter_id: str) -> list[Sequence]:
        """Remove and return every waiting sequence of an adapter (its load failed)."""
        queue = self.queues.get(adapter_id)
        if not queue:
            return []
        seqs = list(queue)
        self._drop_queue(adapter_id)
        return seqs

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Take seq out of the queues and free its blocks and slot."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status == SequenceStatus.WAITING:
            queue = self.queues.get(seq.adapter_id)
            if queue is not None and seq in queue:
                queue.remove(seq)
                if not queue:
                    self._drop_queue(seq.adapter_id)
        self.block_manager.free_seq(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
