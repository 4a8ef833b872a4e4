"""Paged KV-cache bookkeeping: blocks, reference counts, prefix caching. No torch here.

A full block is identified by a chained hash: hash(previous block's hash, its tokens), where the
chain starts from the adapter id, so two adapters never share prefix blocks (Sequence.prefix_key: under
LongRoPE, with the factors the block was computed with). A block whose
reference count drops to zero goes to the free list but keeps its hash and contents until the
free list hands it out again (least recently freed first), so a later request may revive it.

Placement. The CPU decode-attention kernel reads a sequence's blocks in table order, and reads
consecutive blocks of the pool at ~1.7x the rate of scattered ones (bench/attention.py: 392 against
662 us a layer for 64 sequences). So a sequence's blocks are kept next to each other where that
costs the prefix cache nothing that matters:
- a sequence that needs a block first tries the neighbour of its last block (in the direction its
  run already goes; a new run tries downwards first, which is the order in which a finished
  sequence's blocks reach the free list, tail first);
- a new run starts at the head of the free list, as before;
- after an allocation, a sequence claims up to ROOM_BLOCKS further neighbours for the blocks it is
  still expected to grow into (prompt + max_new_tokens). Claimed blocks leave the free list but
  stay free: they keep their cached contents until used, count as free, are revived by a prefix
  hit like any free block, and are taken by anyone once the free list itself is empty.
A neighbour is taken ahead of its turn only if it is free and unclaimed, and either holds no cached
prefix or would be evicted soon anyway: at most 1/8 of the free list was freed before it
(`freed_at` ticks). So a freed sequence's run is reused as a run, and a block whose cached prefix
is fresher than that keeps its place in the eviction order.

Sliding windows. When every layer attends only the last `window` positions (Mistral v0.1, Phi-3-mini-4k,
Qwen with every layer under max_window_layers), a block wholly before the window of a sequence's next query
is never read again: `commit` releases it (the sequence's first `num_released_blocks` table entries are then
not its own, kept as placeholders that every attention backend skips or masks). A released block keeps its
prefix-cache hash like any freed block. A prefix hit needs only the blocks its next query's window reads, so
the blocks before them may have been evicted. A long request then holds about window + step tokens of KV,
not its whole context. A hybrid model (Gemma 3's global layers) reads every block and releases none.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

from loraplane_server.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)


PLACEHOLDER = 0  # the table entry of a released block: a valid index, never read unmasked


def peak_blocks(num_tokens: int, block_size: int, window: int = 0, step_tokens: int = 0) -> int:
    """The most blocks a sequence of num_tokens tokens holds at once: all of them, or with a window (and
    steps of at most step_tokens) the blocks from its window's first to its step's last."""
    blocks = -(-num_tokens // block_size)
    if not window:
        return blocks
    return min(blocks, -(-(window - 1 + max(1, step_tokens)) // block_size) + 1)


def chain_hash(prev: int | None, prefix_key: Hashable, token_ids: tuple[int, ...]) -> int:
    return hash((prev, prefix_key if prev is None else None, token_ids))


class BlockManager:
    ROOM_BLOCKS = 8  # most blocks a sequence holds claimed ahead of its growth
    EARLY_FRACTION = 8  # a cached free block may be taken early if at most 1/8 of the free list precedes it

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        window: int = 0,
        step_tokens: int = 0,
    ) -> None:
        """window > 0: no layer attends further back than `window` positions (see the module's docstring);
        step_tokens: the most tokens a sequence computes in one step (its peak blocks with a window)."""
        self.block_size = block_size
        self.window = window
        self.step_tokens = step_tokens
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # unclaimed
        self.room: dict[int, int] = {}  # claimed free block -> seq id
        self.seq_room: dict[int, list[int]] = {}  # seq id -> its claimed blocks, in the order it will use them
        self.direction: dict[int, int] = {}  # seq id -> +1 or -1, the way its current run goes
        self.freed_at = list(range(num_blocks))  # tick of each block's last free (its place in the LRU order)
        self.clock = num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.block_hashes: dict[int, list[int]] = {}  # seq id -> hashes of its full blocks
        self.num_prefix_hits = 0  # tokens served from the prefix cache
        self.num_prefix_queries = 0  # tokens looked up

    @property
    def num_free_blocks(self) -> int:
        return len(self.free) + len(self.room)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def peak_blocks(self, num_tokens: int) -> int:
        """The most blocks a sequence of num_tokens tokens holds at once."""
        return peak_blocks(num_tokens, self.block_size, self.window, self.step_tokens)

    def first_read_block(self, num_computed: int) -> int:
        """The first block that queries at positions >= num_computed read (0 without a window)."""
        return max(0, num_computed - self.window + 1) // self.block_size if self.window else 0

    # prefix cache
    def find_cached_blocks(self, seq: Sequence, at_most: int | None = None) -> list[int]:
        """Block ids holding a prefix of seq's tokens; always leaves at least one token to compute. None for a
        request that wants its prompt's logprobs: every prompt position is computed for them. With a window,
        the entries before the blocks the next query reads are -1 (not needed, maybe evicted). at_most: the
        longest hit wanted, in blocks."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        found: list[int] = []
        prev: int | None = None
        for i in range((len(seq) - 1) // self.block_size):
            tokens = tuple(seq.block_tokens(i, self.block_size))
            prev = chain_hash(prev, seq.prefix_key, tokens)
            block_id = self.cached.get(prev)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                if not self.window:
                    break
                block_id = -1
            found.append(block_id)
        hit = len(found) if at_most is None else min(len(found), at_most)  # the longest prefix whose next
        # query finds every block it reads
        while hit and -1 in found[self.first_read_block(hit * self.block_size) : hit]:
            hit -= 1
        first = self.first_read_block(hit * self.block_size)
        return [-1] * first + found[first:hit]

    def blocks_to_take(self, seq: Sequence, num_new_tokens: int, cached: list[int] | None = None) -> int:
        """Free blocks that allocating seq's next num_new_tokens tokens takes (revived cached ones included)."""
        if seq.block_table or not cached:
            held, computed, revived = len(seq.block_table), seq.num_computed_tokens, 0
        else:
            held, computed = len(cached), len(cached) * self.block_size
            revived = sum(1 for b in cached if b >= 0 and self.blocks[b].ref_count == 0)
        return self.blocks_needed(computed + num_new_tokens) - held + revived

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] | None = None) -> bool:
        return self.blocks_to_take(seq, num_new_tokens, cached) <= self.num_free_blocks

    def spare_after(self, seq: Sequence, num_new_tokens: int, cached: list[int] | None = None) -> int:
        """Free blocks left once seq's next num_new_tokens tokens have theirs."""
        return self.num_free_blocks - self.blocks_to_take(seq, num_new_tokens, cached)

    def fits(self, num_tokens: int) -> bool:
        """Whether one sequence of num_tokens tokens fits in the whole cache."""
        return self.peak_blocks(num_tokens) <= self.num_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] | None = None) -> None:
        """Give seq blocks for its next num_new_tokens tokens, taking the cached prefix first."""
        if cached and not seq.block_table:
            seq.num_released_blocks = cached.count(-1)  # the leading entries a window no longer reads
            seq.block_table = [PLACEHOLDER] * seq.num_released_blocks
            for block_id in cached[seq.num_released_blocks :]:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    self._unfree(block_id)
                block.ref_count += 1
                seq.block_table.append(block_id)
            seq.num_computed_tokens = seq.num_cached_tokens = len(cached) * self.block_size
            self.block_hashes[seq.seq_id] = self._hashes(seq, len(cached))
        if cached is not None:  # admission: count the prefix-cache lookup
            self.num_prefix_queries += len(seq)
            self.num_prefix_hits += seq.num_cached_tokens
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            raise RuntimeError("allocate() without can_allocate()")
        for _ in range(needed):
            seq.block_table.append(self._take(self._next_block(seq)))
        if needed > 0:
            self._claim_room(seq)

    # placement
    def _next_block(self, seq: Sequence) -> int:
        """The block seq grows into: its own room, its run's neighbour, the free list's head, or anyone's room."""
        room = self.seq_room.get(seq.seq_id)
        if room:
            return room[0]
        if seq.block_table:
            last = seq.block_table[-1]
            way = self._way_on(seq, last)
            if way:
                return last + way
        self.direction.pop(seq.seq_id, None)  # a new run
        if self.free:
            return next(iter(self.free))
        return next(iter(self.room))

    def _may_take(self, block_id: int) -> bool:
        """Free, unclaimed, and holding no cached prefix or near the head of the eviction order anyway."""
        if not 0 <= block_id < self.num_blocks or block_id not in self.free:
            return False
        if self.blocks[block_id].block_hash is None:
            return True
        head = next(iter(self.free))
        return self.freed_at[block_id] - self.freed_at[head] <= len(self.free) // self.EARLY_FRACTION

    def _way_on(self, seq: Sequence, last: int) -> int:
        """The way (+1 or -1) seq's run can go on from block `last`, fixing it for a new run; 0 if neither."""
        ways = self.direction.get(seq.seq_id)
        for way in (ways,) if ways else (-1, 1):
            if self._may_take(last + way):
                self.direction[seq.seq_id] = way
                return way
        return 0

    def _claim_room(self, seq: Sequence) -> None:
        """Claim the neighbours seq is expected to grow into, up to ROOM_BLOCKS, along its run."""
        have = len(self.seq_room.get(seq.seq_id, ()))
        expected = self.blocks_needed(seq.num_prompt_tokens + seq.params.max_new_tokens) - len(seq.block_table)
        want = min(self.ROOM_BLOCKS, expected) - have
        if want <= 0:
            return
        room = self.seq_room.get(seq.seq_id, [])
        last = room[-1] if room else seq.block_table[-1]
        way = self._way_on(seq, last)
        while way and want > 0 and self._may_take(last + way):
            last += way
            del self.free[last]
            self.room[last] = seq.seq_id
            room.append(last)
            want -= 1
        if room:
            self.seq_room[seq.seq_id] = room

    def _unfree(self, block_id: int) -> None:
        """Take a free block off the free list, or out of whoever's room holds it."""
        owner = self.room.pop(block_id, None)
        if owner is None:
            del self.free[block_id]
            return
        room = self.seq_room[owner]
        room.remove(block_id)
        if not room:
            del self.seq_room[owner]

    def _take(self, block_id: int) -> int:
        """A free block for new contents: off the free list or a room, its cached prefix forgotten."""
        self._unfree(block_id)
        block = self.blocks[block_id]
        if block.block_hash is not None and self.cached.get(block.block_hash) == block_id:
            del self.cached[block.block_hash]
        block.block_hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The chained hashes of seq's first num_blocks blocks."""
        hashes: list[int] = []
        for i in range(num_blocks):
            hashes.append(
                chain_hash(hashes[-1] if hashes else None, seq.prefix_key, tuple(seq.block_tokens(i, self.block_size)))
            )
        return hashes

    def commit(self, seq: Sequence) -> None:
        """Register seq's newly completed full blocks in the prefix cache; with a window, release the blocks
        its next queries no longer read."""
        if self.enable_prefix_caching:
            self._register(seq)
        if self.window:
            upto = min(self.first_read_block(seq.num_computed_tokens), len(seq.block_table))
            for i in range(seq.num_released_blocks, upto):
                self._drop(seq.block_table[i])
                seq.block_table[i] = PLACEHOLDER
            seq.num_released_blocks = max(seq.num_released_blocks, upto)

    def _register(self, seq: Sequence) -> None:
        hashes = self.block_hashes.setdefault(seq.seq_id, [])
        for i in range(len(hashes), seq.num_computed_tokens // self.block_size):
            tokens = tuple(seq.block_tokens(i, self.block_size))
            h = chain_hash(hashes[-1] if hashes else None, seq.prefix_key, tokens)
            hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None:
                block.block_hash, block.token_ids = h, tokens
                self.cached.setdefault(h, block.block_id)

    def trim(self, seq: Sequence) -> None:
        """Give back the tail blocks past seq's tokens (rejected speculative tokens' KV slots). They were taken
        for this step alone and never registered in the prefix cache (only blocks of computed tokens are);
        they go back to the front of seq's room, the blocks it grows into next."""
        keep = self.blocks_needed(len(seq))
        tail = seq.block_table[keep:]
        if not tail:
            return
        del seq.block_table[keep:]
        for block_id in tail:
            block = self.blocks[block_id]
            assert block.ref_count == 1 and block.block_hash is None, "a trimmed block was shared or cached"
            block.ref_count = 0
            self.room[block_id] = seq.seq_id
        self.seq_room[seq.seq_id] = tail + self.seq_room.get(seq.seq_id, [])

    def free_seq(self, seq: Sequence) -> None:
        """Drop seq's references; tail blocks go to the free list first so they are evicted first.

        Its unused room goes back to the head of the free list, where it was claimed from."""
        for block_id in reversed(self.seq_room.pop(seq.seq_id, [])):
            del self.room[block_id]
            self.free[block_id] = None
            self.free.move_to_end(block_id, last=False)
        self.direction.pop(seq.seq_id, None)
        for block_id in reversed(seq.block_table[seq.num_released_blocks :]):
            self._drop(block_id)
        seq.block_table = []
        seq.num_released_blocks = 0
        self.block_hashes.pop(seq.seq_id, None)

    def _drop(self, block_id: int) -> None:
        """One reference fewer; the last one frees the block (its cached contents kept, newest in the LRU)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None
            self.freed_at[block_id] = self.clock
            self.clock += 1
