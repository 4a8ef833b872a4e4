"""Scheduler with a real BlockManager and SlotTable, driven by a fake engine loop. Plain Python, no torch."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from loraplane_server.adapters.slot_table import PinLimitError, SlotTable
from loraplane_server.engine.block_manager import BlockManager
from loraplane_server.engine.scheduler import Scheduler, SchedulerOutput
from loraplane_server.sampling_params import SamplingParams
from loraplane_server.sequence import FinishReason, Sequence, SequenceStatus

BS = 4


class Sim:
    """The engine's step loop without a model; checks scheduler and block-manager invariants every step.

    A fake KV cache records which token each slot was computed from: every scheduled chunk first
    checks that its already-computed prefix is still intact in its blocks (nobody overwrote a shared
    or cached block), then writes its own tokens into blocks that only it holds.
    """

    def __init__(
        self,
        num_blocks: int,
        max_num_seqs: int = 8,
        budget: int = 64,
        prefix_caching: bool = True,
        next_token: Callable[[Sequence], int] = lambda seq: 0,
        num_slots: int = 8,
        is_ready: Callable[[str], bool] | None = None,
        quantum: int = 256,
    ) -> None:
        self.bm = BlockManager(num_blocks, BS, prefix_caching)
        self.slots = SlotTable(num_slots)
        self.sched = Scheduler(self.bm, max_num_seqs, budget, self.slots, is_ready, quantum)
        self.budget = budget
        self.max_num_seqs = max_num_seqs
        self.next_token = next_token
        self.kv: dict[int, list[int | None]] = {i: [None] * BS for i in range(num_blocks)}
        self.step_no = 0
        self.added_at: dict[int, int] = {}
        self.adapter_of: dict[int, str | None] = {}
        self.admitted_at: dict[int, int] = {}
        self.finished_at: dict[int, int] = {}

    def add(self, prompt: list[int], max_new_tokens: int, adapter_id: str | None = None) -> Sequence:
        seq = Sequence(f"r{len(self.added_at)}", prompt, SamplingParams(max_new_tokens=max_new_tokens), adapter_id)
        self.sched.add(seq)
        self.added_at[seq.seq_id] = self.step_no
        self.adapter_of[seq.seq_id] = adapter_id
        return seq

    def step(self) -> SchedulerOutput:
        running_before = list(self.sched.running)
        out = self.sched.schedule()
        self.step_no += 1
        assert 0 < out.num_tokens <= self.budget or not out.scheduled
        assert len(self.sched.running) <= self.max_num_seqs
        assert len({s.seq_id for s, _ in out.scheduled}) == len(out.scheduled)
        if out.preempted:  # no admissions in a step that had to preempt
            assert all(any(s is r for r in running_before) for s, _ in out.scheduled)
        for seq, n in out.scheduled:
            assert n > 0 and seq.status == SequenceStatus.RUNNING
            self.admitted_at.setdefault(seq.seq_id, self.step_no)
            self._compute(seq, n)
            seq.num_computed_tokens += n
            self.bm.commit(seq)
            if seq.num_computed_tokens == len(seq):
                seq.append_token(self.next_token(seq))
                if seq.num_output_tokens >= seq.params.max_new_tokens:
                    self.sched.finish(seq, FinishReason.LENGTH)
                    self.finished_at[seq.seq_id] = self.step_no
        self.check_invariants()
        return out

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.num_unfinished:
                return
            self.step()
        raise AssertionError(f"not done after {max_steps} steps")

    def _compute(self, seq: Sequence, n: int) -> None:
        start = seq.num_computed_tokens
        assert len(seq.block_table) >= self.bm.blocks_needed(start + n)
        for pos in range(start):
            assert self.kv[seq.block_table[pos // BS]][pos % BS] == seq.token_ids[pos], "KV prefix corrupted"
        for pos in range(start, start + n):
            block_id = seq.block_table[pos // BS]
            assert self.bm.blocks[block_id].ref_count == 1, "writing into a shared block"
            self.kv[block_id][pos % BS] = seq.token_ids[pos]

    def check_invariants(self) -> None:
        bm, sched, slots = self.bm, self.sched, self.slots
        assert len(sched.running) <= self.max_num_seqs
        assert len(set(sched.rr)) == len(sched.rr) and set(sched.rr) == set(sched.queues)
        assert all(sched.queues[key] for key in sched.rr)
        assert sched.num_waiting == len(sched.waiting)
        refs = [0] * bm.num_blocks
        slot_refs = [0] * slots.num_slots
        for seq in sched.running:
            assert seq.status == SequenceStatus.RUNNING
            for block_id in seq.block_table:
                refs[block_id] += 1
            if seq.adapter_id is not None:
                slot = slots.lookup(seq.adapter_id)
                assert slot is not None and seq.lora_slot == slot
                slot_refs[slot] += 1
        for seq in sched.waiting:
            assert seq.status == SequenceStatus.WAITING and seq.block_table == [] and seq.lora_slot is None
        assert [b.ref_count for b in bm.blocks] == refs
        assert set(bm.free) | set(bm.room) == {i for i, r in enumerate(refs) if r == 0}
        assert all(owner in {s.seq_id for s in sched.running} for owner in bm.seq_room)  # room dies with its seq
        assert slots.refs == slot_refs
        # FCFS within an adapter: its running ones arrived before its waiting ones, all in arrival order
        for key in {s.adapter_id for s in sched.running} | set(sched.queues):
            order = [s.seq_id for s in sched.running if s.adapter_id == key]
            order += [s.seq_id for s in sched.queues.get(key, ())]
            assert order == sorted(order), f"adapter {key!r} out of arrival order"

    def assert_all_done(self) -> None:
        assert self.sched.num_unfinished == 0
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(b.ref_count == 0 for b in self.bm.blocks)
        assert set(self.finished_at) == set(self.added_at)


def prompt(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def test_budget_and_max_num_seqs_are_respected() -> None:
    sim = Sim(num_blocks=64, max_num_seqs=3, budget=10)
    seqs = [sim.add(prompt(3 + 2 * i, 100 * i), 5) for i in range(8)]
    max_running = max_tokens = 0
    while sim.sched.num_unfinished:
        out = sim.step()
        max_running = max(max_running, len(sim.sched.running))
        max_tokens = max(max_tokens, out.num_tokens)
    assert max_running == 3
    assert max_tokens == 10
    assert all(s.num_output_tokens == 5 and s.finish_reason == FinishReason.LENGTH for s in seqs)
    sim.assert_all_done()


def test_chunked_prefill_spreads_a_long_prompt() -> None:
    sim = Sim(num_blocks=16, budget=8)
    seq = sim.add(prompt(20), 2)
    for n in (8, 8):
        assert sim.step().scheduled == [(seq, n)]
        assert seq.num_output_tokens == 0
    assert sim.step().scheduled == [(seq, 4)]
    assert seq.num_output_tokens == 1
    assert sim.step().scheduled == [(seq, 1)]
    assert seq.is_finished
    sim.assert_all_done()


def test_decode_and_prefill_chunk_share_a_step() -> None:
    sim = Sim(num_blocks=16, budget=8)
    a = sim.add(prompt(3), 10)
    sim.step()
    b = sim.add(prompt(20, 100), 2)
    assert sim.step().scheduled == [(a, 1), (b, 7)]
    assert sim.step().scheduled == [(a, 1), (b, 7)]
    assert sim.step().scheduled == [(a, 1), (b, 6)]
    assert b.num_output_tokens == 1
    sim.run()
    sim.assert_all_done()


def test_running_decodes_go_before_new_prefills() -> None:
    sim = Sim(num_blocks=16, budget=2)
    a, b = sim.add(prompt(1), 6), sim.add(prompt(1, 10), 6)
    sim.step()
    c = sim.add(prompt(1, 20), 1)
    for _ in range(5):  # a and b take the whole budget until they finish
        assert sim.step().scheduled == [(a, 1), (b, 1)]
        assert c.status == SequenceStatus.WAITING
    assert a.is_finished and b.is_finished
    assert sim.step().scheduled == [(c, 1)]
    sim.assert_all_done()


def test_arrival_joins_next_step_and_finished_leaves_at_once() -> None:
    sim = Sim(num_blocks=16, budget=64)
    a = sim.add(prompt(4), 3)
    assert sim.step().scheduled == [(a, 4)]
    b = sim.add(prompt(6, 100), 3)
    assert sim.step().scheduled == [(a, 1), (b, 6)]
    assert sim.step().scheduled == [(a, 1), (b, 1)]
    assert a.is_finished and a.finish_reason == FinishReason.LENGTH
    assert a not in sim.sched.running and a.block_table == []
    assert sim.bm.num_free_blocks == 16 - len(b.block_table)
    assert sim.step().scheduled == [(b, 1)]
    sim.assert_all_done()


def test_preemption_frees_blocks_requeues_at_front_and_everyone_finishes() -> None:
    sim = Sim(num_blocks=6, budget=64)
    seqs = [sim.add(prompt(4, 100 * i), 12) for i in range(3)]
    saw_preemption = False
    while sim.sched.num_unfinished:
        running_before = list(sim.sched.running)
        out = sim.step()
        if not out.preempted:
            continue
        saw_preemption = True
        newest_first = sorted(running_before, key=lambda s: s.seq_id, reverse=True)
        assert out.preempted == newest_first[: len(out.preempted)]
        assert list(sim.sched.waiting)[: len(out.preempted)] == out.preempted[::-1]
        for victim in out.preempted:
            assert victim.block_table == [] and victim.num_computed_tokens == 0
            assert victim.status == SequenceStatus.WAITING and victim not in sim.sched.running
    assert saw_preemption and sim.sched.num_preemptions > 0
    assert sum(s.num_preemptions for s in seqs) == sim.sched.num_preemptions
    assert all(s.num_output_tokens == 12 for s in seqs)
    sim.assert_all_done()


def test_preempted_sequence_revives_its_cached_blocks() -> None:
    sim = Sim(num_blocks=6, budget=64)
    seqs = [sim.add(prompt(8, 100 * i), 12) for i in range(2)]
    sim.run()
    assert sim.sched.num_preemptions > 0
    assert sim.bm.num_prefix_hits > 0  # the victim's committed full blocks came back from the cache
    assert all(s.num_output_tokens == 12 for s in seqs)
    sim.assert_all_done()


def test_fcfs_head_is_not_overtaken_by_a_later_small_request() -> None:
    sim = Sim(num_blocks=8, budget=64)
    a = sim.add(prompt(20), 8)  # 5 blocks now, 7 at the end
    b = sim.add(prompt(16, 100), 2)  # 4 blocks: does not fit next to a
    c = sim.add(prompt(1, 200), 2)  # 1 block: would fit, but arrived after b
    assert sim.step().scheduled == [(a, 20)]
    while a.status != SequenceStatus.FINISHED:
        out = sim.step()
        assert [s for s, _ in out.scheduled] == [a]
        assert list(sim.sched.waiting) == [b, c]
    sim.run()
    assert sim.admitted_at[a.seq_id] < sim.admitted_at[b.seq_id] <= sim.admitted_at[c.seq_id]
    sim.assert_all_done()


def random_workload(sim: Sim, seed: int, adapters: list[str | None], num_requests: int = 80, span: int = 600) -> None:
    """Run num_requests mixed requests arriving at random steps (prompts share some prefixes) to the end."""
    rng = random.Random(seed)
    shared = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    arrivals: dict[int, list[tuple[list[int], int, str | None]]] = {}
    for _ in range(num_requests):
        head = rng.choice(shared)[: rng.randrange(0, 13)]
        tail = [rng.randrange(50) for _ in range(rng.randint(1, 30))]
        request = (head + tail, rng.randint(1, 24), rng.choice(adapters))
        arrivals.setdefault(rng.randrange(span), []).append(request)
    assert all(sim.bm.blocks_needed(len(p) + m) <= sim.bm.num_blocks for rs in arrivals.values() for p, m, _ in rs)
    while sim.step_no < 5000 and (sim.sched.num_unfinished or sim.step_no <= max(arrivals)):
        for p, m, adapter in arrivals.get(sim.step_no, []):
            sim.add(p, m, adapter)
        sim.step()
    sim.assert_all_done()
    assert len(sim.finished_at) == num_requests


def position_token(seq: Sequence) -> int:
    """A fake sampled token fixed by request and position (a recomputed sequence sees the same ones)."""
    return (int(seq.request_id[1:]) * 31 + len(seq) * 7) % 50


@pytest.mark.parametrize(
    ("seed", "prefix_caching", "num_blocks"),
    [(0, True, 18), (1, True, 24), (2, False, 18), (3, True, 40)],
)
def test_random_workload_fcfs_no_starvation(seed: int, prefix_caching: bool, num_blocks: int) -> None:
    sim = Sim(num_blocks, max_num_seqs=5, budget=16, prefix_caching=prefix_caching, next_token=position_token)
    random_workload(sim, seed, [None])
    latency = max(sim.finished_at[i] - sim.added_at[i] for i in sim.added_at)
    assert latency <= 150  # bounded wait, far below the run's ~600 steps: nobody starves
    admitted_order = sorted(sim.admitted_at, key=lambda i: sim.admitted_at[i])
    assert admitted_order == sorted(sim.admitted_at)  # first admissions in arrival order
    if num_blocks < 30:
        assert sim.sched.num_preemptions > 0
    if prefix_caching:
        assert sim.bm.num_prefix_hits > 0


@pytest.mark.parametrize(("seed", "num_blocks", "num_slots"), [(4, 18, 8), (5, 24, 2), (6, 40, 1)])
def test_random_workload_mixed_adapters_all_finish(seed: int, num_blocks: int, num_slots: int) -> None:
    sim = Sim(num_blocks, max_num_seqs=5, budget=16, next_token=position_token, num_slots=num_slots)
    random_workload(sim, seed, [None, None, "a", "b", "c"])
    assert sim.slots.refs == [0] * num_slots
    assert sim.sched.num_preemptions > 0 or num_blocks >= 30
    for adapter in (None, "a", "b", "c"):  # within an adapter, first admissions in arrival order
        ids = [i for i, key in sim.adapter_of.items() if key == adapter]
        assert sorted(ids, key=lambda i: sim.admitted_at[i]) == sorted(ids)


def test_abort_waiting_and_running_frees_blocks() -> None:
    sim = Sim(num_blocks=8, budget=64)
    a = sim.add(prompt(9), 20)
    sim.step()
    b = sim.add(prompt(9) + [50, 51], 20)  # shares a's two committed full blocks
    c = sim.add(prompt(30, 100), 20)  # 8 blocks: waits
    sim.step()
    assert b.num_cached_tokens == 8
    assert a.status == b.status == SequenceStatus.RUNNING and c.status == SequenceStatus.WAITING
    assert sim.bm.num_free_blocks < 8

    sim.sched.finish(c, FinishReason.ABORT)
    assert c not in sim.sched.waiting and c.is_finished and c.finish_reason == FinishReason.ABORT
    shared, own = a.block_table[:2], len(a.block_table) - 2
    free_before = sim.bm.num_free_blocks
    sim.sched.finish(a, FinishReason.ABORT)
    assert sim.bm.num_free_blocks == free_before + own
    assert a not in sim.sched.running and a.block_table == [] and a.finish_reason == FinishReason.ABORT
    assert [sim.bm.blocks[i].ref_count for i in shared] == [1, 1]  # still b's
    sim.check_invariants()
    sim.step()  # b carries on over the shared blocks
    sim.sched.finish(b, FinishReason.ABORT)
    assert sim.bm.num_free_blocks == 8
    assert sim.sched.num_unfinished == 0
    assert sim.sched.schedule().scheduled == []


def test_abort_preempted_waiting_sequence() -> None:
    sim = Sim(num_blocks=6, budget=64)
    seqs = [sim.add(prompt(4, 100 * i), 12) for i in range(3)]
    while not sim.step().preempted:
        pass
    victim = sim.sched.waiting[0]
    sim.sched.finish(victim, FinishReason.ABORT)
    assert victim not in sim.sched.waiting and victim.finish_reason == FinishReason.ABORT
    sim.check_invariants()
    sim.finished_at[victim.seq_id] = sim.step_no
    sim.run()
    assert all(s.num_output_tokens == 12 for s in seqs if s is not victim)
    sim.assert_all_done()


# adapters: slots, readiness, deficit round robin


def test_adapters_run_together_and_load_their_slot_once() -> None:
    sim = Sim(num_blocks=32, num_slots=4)
    a1, b1, base = sim.add(prompt(4), 3, "a"), sim.add(prompt(4, 10), 3, "b"), sim.add(prompt(4, 20), 3)
    out = sim.step()
    assert {s.seq_id for s, _ in out.scheduled} == {a1.seq_id, b1.seq_id, base.seq_id}
    assert sorted(adapter for _, adapter in out.slot_loads) == ["a", "b"]
    assert a1.lora_slot != b1.lora_slot and base.lora_slot is None
    a2 = sim.add(prompt(4, 30), 3, "a")
    out = sim.step()
    assert any(s is a2 for s, _ in out.scheduled) and out.slot_loads == []
    assert a2.lora_slot == a1.lora_slot == sim.slots.lookup("a")
    assert sim.slots.refs[sim.slots.slot_of["a"]] == 2
    sim.run()
    sim.assert_all_done()
    assert sim.slots.refs == [0] * 4


def test_num_slots_caps_distinct_running_adapters() -> None:
    sim = Sim(num_blocks=32, num_slots=1)
    a = sim.add(prompt(4), 3, "a")
    b = sim.add(prompt(4, 10), 3, "b")
    base = sim.add(prompt(4, 20), 3)
    out = sim.step()
    assert [s for s, _ in out.scheduled] == [a, base]
    assert b.status == SequenceStatus.WAITING
    while not a.is_finished:
        sim.step()
        assert b.status == SequenceStatus.WAITING
    out = sim.step()
    assert any(s is b for s, _ in out.scheduled)
    assert out.slot_loads == [(0, "b")] and b.lora_slot == 0
    sim.run()
    sim.assert_all_done()


def test_adapter_still_loading_does_not_block_others() -> None:
    ready: set[str] = {"b"}
    sim = Sim(num_blocks=32, is_ready=lambda adapter: adapter in ready)
    a = sim.add(prompt(4), 3, "a")
    b = sim.add(prompt(4, 10), 3, "b")
    base = sim.add(prompt(4, 20), 3)
    out = sim.step()
    assert {s.seq_id for s, _ in out.scheduled} == {b.seq_id, base.seq_id}
    sim.step()
    assert a.status == SequenceStatus.WAITING and a.lora_slot is None
    ready.add("a")
    out = sim.step()
    assert any(s is a for s, _ in out.scheduled) and ("a" in {adapter for _, adapter in out.slot_loads})
    sim.run()
    sim.assert_all_done()


def test_deficit_round_robin_interleaves_adapters() -> None:
    sim = Sim(num_blocks=64, max_num_seqs=16, budget=256, quantum=8)
    for i in range(3):
        sim.add(prompt(8, 100 * i), 2, "a")
    for i in range(3):
        sim.add(prompt(8, 1000 + 100 * i), 2, "b")
    out = sim.step()
    assert [s.adapter_id for s, _ in out.scheduled] == ["a", "b", "a", "b", "a", "b"]
    sim.run()
    sim.assert_all_done()


def test_take_waiting_removes_an_adapters_queue() -> None:
    sim = Sim(num_blocks=32, is_ready=lambda adapter: adapter != "a")
    a1, a2 = sim.add(prompt(4), 3, "a"), sim.add(prompt(4, 10), 3, "a")
    sim.add(prompt(4, 20), 3)
    sim.step()
    assert sim.sched.take_waiting("a") == [a1, a2]
    assert "a" not in sim.sched.queues and "a" not in sim.sched.rr
    assert sim.sched.take_waiting("a") == []
    for seq in (a1, a2):  # the engine fails them; they never held blocks
        sim.sched.finish(seq, FinishReason.ERROR)
        sim.finished_at[seq.seq_id] = sim.step_no
    sim.check_invariants()
    sim.run()
    sim.assert_all_done()


def keep_queued(sim: Sim, adapter: str, n: int = 8) -> None:
    while len(sim.sched.queues.get(adapter, ())) < n:
        sim.add(prompt(4, 100 + sim.step_no), 3, adapter)


@pytest.mark.parametrize(
    ("other", "max_num_seqs", "budget", "num_blocks"),
    [(None, 2, 64, 200), ("b", 2, 64, 200), (None, 16, 64, 4), ("b", 16, 6, 400)],
    ids=["base-seqs", "adapter-seqs", "base-kv", "adapter-budget"],
)
def test_hot_adapter_does_not_starve_another_queue(
    other: str | None, max_num_seqs: int, budget: int, num_blocks: int
) -> None:
    sim = Sim(num_blocks=num_blocks, max_num_seqs=max_num_seqs, budget=budget, num_slots=4)
    late: Sequence | None = None
    for step in range(60):  # adapter "a" always has 8 requests queued
        keep_queued(sim, "a")
        if step == 3:
            late = sim.add(prompt(4, 9000), 3, other)
        sim.step()
    assert late is not None
    assert late.status != SequenceStatus.WAITING, "a later request of another queue was never admitted"


def test_drained_slot_goes_to_the_adapter_waiting_for_it() -> None:
    sim = Sim(num_blocks=200, max_num_seqs=2, num_slots=1)
    keep_queued(sim, "a")
    sim.step()
    b = sim.add(prompt(4, 9000), 3, "b")  # arrives while "a" holds the only slot
    for _ in range(10):
        keep_queued(sim, "a")
        sim.step()
        assert sim.sched.draining == "a"  # no new "a" admissions while b waits
        if sim.slots.refs == [0]:
            break
    assert sim.slots.refs == [0]
    keep_queued(sim, "a")
    out = sim.step()
    assert out.slot_loads == [(0, "b")], "the drained slot went back to the drained adapter"
    assert [s for s, _ in out.scheduled] == [b]


# pinning: one slot always serves the unpinned


def test_pins_stop_one_short_of_the_slot_count() -> None:
    slots = SlotTable(3)
    slots.pin("a")
    slots.pin("b")
    slots.pin("a")  # already pinned: no change, no error
    with pytest.raises(PinLimitError, match=r"at most 2 can be.*--max-loras"):
        slots.pin("c")
    assert slots.pinned == {"a", "b"}
    slots.unpin("a")
    slots.pin("c")
    with pytest.raises(PinLimitError):
        SlotTable(1).pin("a")  # one slot: nothing can be pinned


def test_pinned_adapters_keep_their_slots_but_never_all_of_them() -> None:
    slots = SlotTable(2)
    slots.pin("a")
    slots.acquire("a", ref=False)
    slots.acquire("b", ref=False)
    assert slots.acquire("c", ref=False) == (1, True)  # b, not the pinned a, makes room
    assert slots.lookup("a") == 0 and slots.is_protected("a")
    slots.pinned.add("c")  # bypassing pin(): every slot now holds a pinned adapter
    assert not slots.is_protected("a") and slots.can_acquire("d")


def test_hot_pinned_adapters_cannot_starve_an_unpinned_one() -> None:
    """Both slots held by pinned adapters with requests always queued (what pinning 2 of 2 did): a
    request for a third adapter still gets a slot, by draining one of them."""
    sim = Sim(num_blocks=400, max_num_seqs=4, num_slots=2)
    sim.slots.pinned.update({"a", "b"})  # as the engine did before pins were bounded
    late: Sequence | None = None
    for step in range(60):
        keep_queued(sim, "a")
        keep_queued(sim, "b")
        if step == 3:
            late = sim.add(prompt(4, 9000), 3, "c")
        sim.step()
    assert late is not None and late.status != SequenceStatus.WAITING, "the unpinned adapter never got a slot"


def test_one_pinned_hot_adapter_keeps_its_slot_while_others_rotate() -> None:
    sim = Sim(num_blocks=400, max_num_seqs=4, num_slots=2)
    sim.slots.pin("a")
    late: list[Sequence] = []
    for step in range(80):
        keep_queued(sim, "a")
        if step % 10 == 3:
            late.append(sim.add(prompt(4, 9000 + step), 3, f"u{step}"))
        sim.step()
        if step > 0:
            assert sim.slots.lookup("a") == 0, "the pinned adapter lost its slot"
    assert all(s.status != SequenceStatus.WAITING for s in late[:-1]), "an unpinned adapter never got the free slot"
