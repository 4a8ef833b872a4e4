"""Continuous batching: which sequences run this step, and how many of their tokens. No torch here.

Each step has a token budget. Running sequences go first, oldest first (a decode costs one token,
an unfinished prefill continues with the next chunk), then waiting ones are admitted in arrival
order while budget, sequence slots and KV blocks last. When blocks run out, the newest running
sequence is preempted: its blocks are freed and it goes back to the front of the queue to be
recomputed later. Nobody waits behind a later arrival, so nobody starves.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from loraplane_server.block_manager import BlockManager
from loraplane_server.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        watermark: float = 0.01,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_blocks = int(watermark * block_manager.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
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
            n = min(seq.num_uncomputed_tokens, budget)
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

    # waiting: admit in arrival order; never skip ahead of the head of the queue
    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = bm.find_cached_blocks(seq)
            n = min(len(seq) - len(cached) * bm.block_size, budget)
            free_after = bm.num_free_blocks - bm.blocks_needed(len(cached) * bm.block_size + n)
            if not bm.can_allocate(seq, n, cached) or (self.running and free_after < self.watermark_blocks):
                break
            self.waiting.popleft()
            bm.allocate(seq, n, cached)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.block_manager.free_seq(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Take seq out of the queues and free its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free_seq(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
