"""BlockManager: allocation, reference counts, prefix caching and eviction order. Plain Python, no torch."""

from __future__ import annotations

import pytest

from loraplane_server.engine.block_manager import PLACEHOLDER, BlockManager, chain_hash, peak_blocks
from loraplane_server.engine.kv_groups import GroupHit, HybridBlocks, window_view
from loraplane_server.sampling_params import SamplingParams
from loraplane_server.sequence import Sequence

BS = 4


def make_seq(tokens: list[int], adapter_id: str | None = None) -> Sequence:
    return Sequence("r", tokens, SamplingParams(max_new_tokens=8), adapter_id)


def prefill(bm: BlockManager, seq: Sequence) -> list[int]:
    """Admit seq with whatever prefix the cache holds, compute all its tokens and commit; return the hit."""
    cached = bm.find_cached_blocks(seq)
    n = len(seq) - len(cached) * bm.block_size
    assert bm.can_allocate(seq, n, cached)
    bm.allocate(seq, n, cached)
    seq.num_computed_tokens += n
    bm.commit(seq)
    return cached


def take_one(bm: BlockManager, token: int) -> Sequence:
    """A one-token sequence that will not grow past its block: takes exactly the free list's head."""
    seq = Sequence("r", [token], SamplingParams(max_new_tokens=1))
    bm.allocate(seq, 1)
    assert seq.seq_id not in bm.seq_room
    return seq


def grow(bm: BlockManager, seq: Sequence, tokens: int) -> None:
    """Decode `tokens` more tokens into seq, one at a time, as the engine does."""
    for _ in range(tokens):
        seq.num_computed_tokens = len(seq)
        bm.allocate(seq, 1)
        seq.append_token(0)


def check_consistent(bm: BlockManager, live: list[Sequence]) -> None:
    refs = [0] * bm.num_blocks
    for seq in live:
        for block_id in seq.block_table[seq.num_released_blocks :]:  # a window's released entries are not its own
            refs[block_id] += 1
    assert [b.ref_count for b in bm.blocks] == refs
    assert not set(bm.free) & set(bm.room)
    assert set(bm.free) | set(bm.room) == {i for i, r in enumerate(refs) if r == 0}
    assert bm.num_free_blocks == refs.count(0)
    claimed = [(b, owner) for owner, room in bm.seq_room.items() for b in room]
    assert sorted(claimed) == sorted(bm.room.items()) and all(bm.seq_room.values())


A = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # two full blocks and a partial one


@pytest.mark.parametrize(("tokens", "blocks"), [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_blocks_needed(tokens: int, blocks: int) -> None:
    assert BlockManager(4, BS).blocks_needed(tokens) == blocks


def test_allocate_free_restores_free_count_and_ref_counts() -> None:
    bm = BlockManager(10, BS)
    seq = make_seq(A)
    bm.allocate(seq, len(seq))
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 7
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_table)
    check_consistent(bm, [seq])

    # decode: tokens 11 and 12 fit in the partial block, token 13 needs a new one
    seq.num_computed_tokens = len(seq)
    bm.allocate(seq, 2)
    assert len(seq.block_table) == 3
    bm.allocate(seq, 3)
    assert len(seq.block_table) == 4 and bm.num_free_blocks == 6
    check_consistent(bm, [seq])

    bm.free_seq(seq)
    assert seq.block_table == []
    assert bm.num_free_blocks == 10
    assert all(b.ref_count == 0 for b in bm.blocks)
    check_consistent(bm, [])


def test_allocate_without_room_raises_and_changes_nothing() -> None:
    bm = BlockManager(2, BS)
    seq = make_seq(list(range(9)))
    assert not bm.can_allocate(seq, 9)
    assert bm.can_allocate(seq, 8)
    with pytest.raises(RuntimeError):
        bm.allocate(seq, 9)
    assert bm.num_free_blocks == 2 and seq.block_table == []


def test_prefix_hit_shares_blocks_and_sets_computed() -> None:
    bm = BlockManager(10, BS)
    a = make_seq(A)
    prefill(bm, a)
    b = make_seq(A[:8] + [100, 101, 102])
    cached = bm.find_cached_blocks(b)
    assert cached == a.block_table[:2]
    bm.allocate(b, len(b) - 8, cached)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in b.block_table] == [2, 2, 1]
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert b.num_uncomputed_tokens == 3
    assert bm.num_free_blocks == 10 - 3 - 1
    assert bm.num_prefix_hits == 8
    check_consistent(bm, [a, b])

    bm.free_seq(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]
    bm.free_seq(b)
    assert bm.num_free_blocks == 10
    check_consistent(bm, [])


def test_at_least_one_token_is_left_to_compute() -> None:
    bm = BlockManager(10, BS)
    prefill(bm, make_seq(A[:8]))  # exactly two full blocks, both committed
    same = make_seq(A[:8])
    assert len(bm.find_cached_blocks(same)) == 1
    prefill(bm, same)
    assert same.num_cached_tokens == 4
    longer = make_seq(A[:9])
    assert len(bm.find_cached_blocks(longer)) == 2
    assert bm.find_cached_blocks(make_seq(A[:4])) == []


def test_chained_hash_needs_the_same_earlier_blocks() -> None:
    bm = BlockManager(12, BS)
    x, y, w, v = [1] * 4, [2] * 4, [3] * 4, [4] * 4
    prefill(bm, make_seq(x + y + [9]))
    c = make_seq(w + v + [9])
    prefill(bm, c)
    # block 0 hits (from c), block 1 has y's tokens but after w, not after x: no hit
    assert bm.find_cached_blocks(make_seq(w + y + [7])) == c.block_table[:1]
    assert len(bm.find_cached_blocks(make_seq(x + y + [7]))) == 2
    assert chain_hash(chain_hash(None, None, tuple(x)), None, tuple(y)) != chain_hash(
        chain_hash(None, None, tuple(w)), None, tuple(y)
    )


def test_adapters_never_share_blocks() -> None:
    bm = BlockManager(20, BS)
    base = make_seq(A)
    prefill(bm, base)
    a1 = make_seq(A, "a")
    assert prefill(bm, a1) == []
    b1 = make_seq(A, "b")
    assert prefill(bm, b1) == []
    assert not set(base.block_table) & set(a1.block_table)
    assert not set(a1.block_table) & set(b1.block_table)
    # same adapter, and base again, do hit their own blocks
    assert bm.find_cached_blocks(make_seq(A, "a")) == a1.block_table[:2]
    assert bm.find_cached_blocks(make_seq(A, "b")) == b1.block_table[:2]
    assert bm.find_cached_blocks(make_seq(A)) == base.block_table[:2]
    check_consistent(bm, [base, a1, b1])


def test_freed_blocks_keep_hash_and_are_revived() -> None:
    bm = BlockManager(10, BS)
    a = make_seq(A)
    prefill(bm, a)
    head = a.block_table[:2]
    bm.free_seq(a)
    assert bm.num_free_blocks == 10
    assert all(bm.blocks[i].ref_count == 0 and bm.blocks[i].block_hash is not None for i in head)

    b = make_seq(A)
    assert prefill(bm, b) == head
    assert all(bm.blocks[i].ref_count == 1 and i not in bm.free for i in head)
    assert bm.num_free_blocks == 7
    check_consistent(bm, [b])


def test_eviction_least_recently_freed_and_tail_first() -> None:
    bm = BlockManager(6, BS)
    a, b = make_seq(A), make_seq([t + 50 for t in A])
    prefill(bm, a)
    prefill(bm, b)
    a_head, b_head = a.block_table[:2], b.block_table[:2]
    assert bm.num_free_blocks == 0
    bm.free_seq(a)
    bm.free_seq(b)

    def hits(seq_tokens: list[int]) -> int:
        return len(bm.find_cached_blocks(make_seq(seq_tokens)))

    takers = [take_one(bm, 1000)]  # a's partial tail block: no prefix lost
    assert (hits(A), hits([t + 50 for t in A])) == (2, 2)
    takers.append(take_one(bm, 1001))  # a's second block goes before its first
    assert takers[-1].block_table == [a_head[1]]
    assert bm.blocks[a_head[1]].block_hash is None
    assert bm.find_cached_blocks(make_seq(A)) == a_head[:1]
    takers.append(take_one(bm, 1002))
    assert (hits(A), hits([t + 50 for t in A])) == (0, 2)
    takers.append(take_one(bm, 1003))  # only now b, freed later, starts to go
    assert takers[-1].block_table[0] not in b_head
    assert hits([t + 50 for t in A]) == 2
    takers.append(take_one(bm, 1004))
    assert bm.find_cached_blocks(make_seq([t + 50 for t in A])) == b_head[:1]
    check_consistent(bm, takers)


def test_revived_then_freed_blocks_become_most_recently_freed() -> None:
    bm = BlockManager(6, BS)
    b_tokens = [t + 50 for t in A]
    a, b = make_seq(A), make_seq(b_tokens)
    prefill(bm, a)
    prefill(bm, b)
    bm.free_seq(a)
    bm.free_seq(b)
    again = make_seq(A[:8] + [77])
    assert len(prefill(bm, again)) == 2
    bm.free_seq(again)
    takers = [take_one(bm, 1000 + i) for i in range(3)]  # b's three blocks, freed before `again`
    assert len(bm.find_cached_blocks(make_seq(A))) == 2
    assert bm.find_cached_blocks(make_seq(b_tokens)) == []
    check_consistent(bm, takers)


def test_can_allocate_counts_revived_blocks_from_the_free_list() -> None:
    bm = BlockManager(4, BS)
    a = make_seq(A[:9])
    prefill(bm, a)
    bm.free_seq(a)
    other = take_one(bm, 1000)  # takes the one block a never used
    assert other.block_table[0] not in a.block_table
    assert bm.num_free_blocks == 3

    big = make_seq(A[:8] + [20, 21, 22, 23, 24])  # 2 revived + 2 new = 4 > 3 free
    cached = bm.find_cached_blocks(big)
    assert len(cached) == 2
    assert not bm.can_allocate(big, len(big) - 8, cached)

    small = make_seq(A[:8] + [20])  # 2 revived + 1 new = 3
    cached = bm.find_cached_blocks(small)
    assert bm.can_allocate(small, 1, cached)
    bm.allocate(small, 1, cached)
    assert bm.num_free_blocks == 0
    check_consistent(bm, [other, small])


def test_can_allocate_shared_live_blocks_cost_nothing() -> None:
    bm = BlockManager(4, BS)
    a = make_seq(A[:9])
    prefill(bm, a)  # 3 blocks held, 1 free
    b = make_seq(A[:8] + [30, 31, 32, 33])  # 2 shared (live) + 1 new
    cached = bm.find_cached_blocks(b)
    assert bm.can_allocate(b, 4, cached)
    assert not bm.can_allocate(b, 5, cached)


def test_commit_registers_only_computed_full_blocks() -> None:
    bm = BlockManager(10, BS)
    seq = make_seq(A)
    bm.allocate(seq, len(seq))
    probe = make_seq(A + [0])
    seq.num_computed_tokens = 3
    bm.commit(seq)
    assert bm.find_cached_blocks(probe) == []
    assert all(bm.blocks[i].block_hash is None for i in seq.block_table)
    seq.num_computed_tokens = 6
    bm.commit(seq)
    assert bm.find_cached_blocks(probe) == seq.block_table[:1]
    assert bm.blocks[seq.block_table[1]].block_hash is None
    seq.num_computed_tokens = 10
    bm.commit(seq)
    assert bm.find_cached_blocks(probe) == seq.block_table[:2]
    assert bm.blocks[seq.block_table[2]].block_hash is None  # partial block never registered


def test_prefix_caching_disabled_finds_nothing() -> None:
    bm = BlockManager(10, BS, enable_prefix_caching=False)
    prefill(bm, make_seq(A))
    assert bm.find_cached_blocks(make_seq(A)) == []
    assert all(b.block_hash is None for b in bm.blocks)


# placement: a sequence's blocks stay next to each other


def test_prompt_and_growth_blocks_are_consecutive_and_room_is_free() -> None:
    bm = BlockManager(32, BS)
    a = Sequence("r", A, SamplingParams(max_new_tokens=10))  # 20 tokens in all: 5 blocks
    bm.allocate(a, len(a))
    assert a.block_table == [0, 1, 2]
    assert bm.seq_room[a.seq_id] == [3, 4]  # claimed for its growth, still free
    assert bm.num_free_blocks == 29
    b = Sequence("r", A, SamplingParams(max_new_tokens=100))  # wants more than ROOM_BLOCKS
    bm.allocate(b, len(b))
    assert b.block_table == [5, 6, 7] and bm.seq_room[b.seq_id] == list(range(8, 8 + bm.ROOM_BLOCKS))
    check_consistent(bm, [a, b])

    grow(bm, a, 10)
    assert a.block_table == [0, 1, 2, 3, 4] and a.seq_id not in bm.seq_room
    grow(bm, b, 40)  # past its room: it goes on along its run and claims more
    assert b.block_table == list(range(5, 18)) and bm.seq_room[b.seq_id] == list(range(18, 26))
    check_consistent(bm, [a, b])

    bm.free_seq(b)  # its room goes back to the head of the free list
    assert b.seq_id not in bm.seq_room and list(bm.free)[:8] == list(range(18, 26))
    bm.free_seq(a)
    assert bm.num_free_blocks == 32
    check_consistent(bm, [])


def test_a_freed_run_is_reused_as_a_run() -> None:
    bm = BlockManager(8, BS)
    a = Sequence("r", list(range(20)), SamplingParams(max_new_tokens=1))  # 5 blocks, no room
    prefill(bm, a)
    filler = Sequence("r", list(range(100, 112)), SamplingParams(max_new_tokens=1))
    prefill(bm, filler)  # the other 3 blocks
    assert a.block_table == [0, 1, 2, 3, 4] and bm.num_free_blocks == 0
    bm.free_seq(a)  # tail first: 4, 3, 2, 1, 0
    b = Sequence("r", list(range(200, 212)), SamplingParams(max_new_tokens=4))  # 3 blocks + 1 to grow
    bm.allocate(b, len(b))
    assert b.block_table == [4, 3, 2]  # the head of the free list, then downwards along a's run
    assert bm.seq_room[b.seq_id] == [1]
    grow(bm, b, 4)
    assert b.block_table == [4, 3, 2, 1]
    assert bm.find_cached_blocks(make_seq(list(range(20)))) == [0]  # a's first block, untouched
    check_consistent(bm, [filler, b])


def test_a_freshly_cached_neighbour_keeps_its_place_in_the_eviction_order() -> None:
    bm = BlockManager(64, BS)
    bm.ROOM_BLOCKS = 2
    s = Sequence("r", [90, 91, 92], SamplingParams(max_new_tokens=20))
    bm.allocate(s, len(s))
    assert s.block_table == [0] and bm.seq_room[s.seq_id] == [1, 2]
    f = Sequence("r", A[:8], SamplingParams(max_new_tokens=1))
    prefill(bm, f)
    assert f.block_table == [3, 4]
    bm.free_seq(f)  # 3 and 4: cached, and the most recently freed of the free list
    grow(bm, s, 10)  # through its room; then its neighbour 3 is free but fresh: a new run at the head
    assert s.block_table == [0, 1, 2, 5] and bm.seq_room[s.seq_id] == [6, 7]
    assert bm.find_cached_blocks(make_seq(A[:9])) == [3, 4]
    check_consistent(bm, [s])


def test_a_prefix_hit_revives_blocks_out_of_a_room() -> None:
    bm = BlockManager(8, BS)
    a = Sequence("r", A, SamplingParams(max_new_tokens=1))  # 3 blocks, no room
    prefill(bm, a)
    bm.free_seq(a)  # free list: 3 4 5 6 7, then a's 2 1 0
    others = [take_one(bm, 500 + i) for i in range(5)]
    b = Sequence("r", [1], SamplingParams(max_new_tokens=20))
    bm.allocate(b, 1)  # a's partial tail, then a's cached blocks as room: they are next in line anyway
    assert b.block_table == [2] and bm.seq_room[b.seq_id] == [1, 0]
    bm.free_seq(others[0])
    hit = make_seq(A[:8] + [99])
    assert prefill(bm, hit) == [0, 1]  # revived out of b's room, contents intact
    assert b.seq_id not in bm.seq_room and hit.block_table == [0, 1, 3]
    check_consistent(bm, [b, hit, *others[1:]])


def test_room_goes_to_whoever_needs_a_block_once_the_free_list_is_empty() -> None:
    bm = BlockManager(4, BS)
    c = Sequence("r", [7], SamplingParams(max_new_tokens=20))
    bm.allocate(c, 1)
    assert c.block_table == [0] and bm.seq_room[c.seq_id] == [1, 2, 3] and not bm.free
    assert bm.num_free_blocks == 3
    d = Sequence("r", [8] * 8, SamplingParams(max_new_tokens=1))
    assert bm.can_allocate(d, 8)
    bm.allocate(d, 8)  # two of c's room
    assert len(d.block_table) == 2 and bm.seq_room[c.seq_id] == [3]
    grow(bm, c, 4)
    assert c.block_table == [0, 3] and bm.num_free_blocks == 0
    assert not bm.can_allocate(Sequence("r", [9], SamplingParams(max_new_tokens=1)), 1)
    check_consistent(bm, [c, d])


# sliding windows: blocks no query reads again go back


@pytest.mark.parametrize(
    ("tokens", "window", "step", "peak"),
    [(100, 0, 16, 25), (100, 8, 16, 7), (100, 8, 1, 3), (10, 8, 16, 3), (100, 1, 1, 2), (100, 64, 16, 21)],
)
def test_peak_blocks(tokens: int, window: int, step: int, peak: int) -> None:
    assert peak_blocks(tokens, BS, window, step) == peak
    assert BlockManager(4, BS, window=window, step_tokens=step).peak_blocks(tokens) == peak


def test_a_window_releases_the_blocks_no_query_reads_and_holds_at_most_its_peak() -> None:
    window = 6
    bm = BlockManager(20, BS, window=window, step_tokens=4)
    seq = Sequence("r", list(range(1, 11)), SamplingParams(max_new_tokens=30))
    prefill(bm, seq)  # 10 computed: the next query (position 10) reads positions 5.. -> block 0 goes
    assert seq.num_released_blocks == 1 and seq.block_table[0] == PLACEHOLDER
    assert bm.blocks[0].ref_count == 0 and 0 in bm.free and bm.blocks[0].block_hash is not None  # still cached
    check_consistent(bm, [seq])
    for _ in range(30):
        seq.append_token(7)
        bm.allocate(seq, 1)
        seq.num_computed_tokens += 1
        bm.commit(seq)
        held = len(seq.block_table) - seq.num_released_blocks
        assert seq.num_released_blocks == max(0, seq.num_computed_tokens - window + 1) // BS
        assert held <= bm.peak_blocks(len(seq))
        check_consistent(bm, [seq])
    bm.free_seq(seq)
    assert seq.num_released_blocks == 0 and bm.num_free_blocks == 20
    check_consistent(bm, [])


def test_a_window_prefix_hit_needs_only_the_blocks_its_next_query_reads() -> None:
    bm = BlockManager(20, BS, window=6)
    tokens = list(range(1, 17))  # 4 full blocks
    first = make_seq(tokens)
    prefill(bm, first)
    owned = list(first.block_table)
    bm.free_seq(first)
    assert owned[:2] == [PLACEHOLDER] * 2  # released while it ran (the next query read 11..)
    evict = []
    while 0 in bm.free:  # block 0 (the first block's) evicted: a hit no longer finds it
        evict.append(take_one(bm, 99))
    probe = make_seq([*tokens, 0])
    hit = bm.find_cached_blocks(probe)
    assert len(hit) == 4 and hit[:2] == [-1, -1] and -1 not in hit[2:]  # position 16 reads from 11: blocks 2, 3
    assert BlockManager(20, BS).find_cached_blocks(probe) == []  # without the window the hit stops at block 0
    prefill(bm, probe)
    assert probe.num_cached_tokens == 16 and probe.num_released_blocks == 3  # 17 computed: position 17 reads 12..
    check_consistent(bm, [probe, *evict])
    again = make_seq([*tokens, 1])
    bm.free_seq(probe)
    held = bm.find_cached_blocks(again)
    assert hit[2] in bm.free
    while hit[2] in bm.free:  # a block the next query reads evicted: the hit shrinks to what it can use
        evict.append(take_one(bm, 98))
    assert bm.find_cached_blocks(again) == [] and len(held) == 4


def test_hybrid_pools_hit_with_the_global_prefix_and_the_window_alone() -> None:
    """Global and sliding layers (kv_groups.py): the global pool holds every block, the sliding pool a window;
    a hit takes the global prefix and the sliding blocks its next query reads; both pools come back whole."""
    hb = HybridBlocks(20, 12, BS, window=6)
    tokens = list(range(1, 17))
    first = make_seq(tokens)
    prefill(hb, first)
    assert len(first.block_table) == 4 and first.num_released_blocks == 0  # the global layers keep it all
    assert first.window_released == 2 and first.window_table[:2] == [PLACEHOLDER] * 2
    check_consistent(hb, [first])
    check_consistent(hb.windows, [window_view(first)])
    hb.free_seq(first)
    probe = make_seq([*tokens, 0])
    hit = hb.find_cached_blocks(probe)
    assert isinstance(hit, GroupHit) and len(hit) == 4 and -1 not in hit
    assert hit.window[:2] == [-1, -1] and -1 not in hit.window[2:]
    prefill(hb, probe)
    assert probe.num_cached_tokens == 16 and probe.window_released == 3
    check_consistent(hb, [probe])
    check_consistent(hb.windows, [window_view(probe)])
    hb.free_seq(probe)
    assert hb.num_free_blocks == 20 and hb.windows.num_free_blocks == 12
    assert probe.window_table == [] and probe.block_table == []
