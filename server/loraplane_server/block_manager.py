"""Paged KV-cache bookkeeping: blocks, reference counts, prefix caching. No torch here.

A full block is identified by a chained hash: hash(previous block's hash, its tokens), where the
chain starts from the adapter id, so two adapters never share prefix blocks. A block whose
reference count drops to zero goes to the free list but keeps its hash and contents until the
free list hands it out again (least recently freed first), so a later request may revive it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from loraplane_server.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)


def chain_hash(prev: int | None, adapter_id: str | None, token_ids: tuple[int, ...]) -> int:
    return hash((prev, adapter_id if prev is None else None, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.block_hashes: dict[int, list[int]] = {}  # seq id -> hashes of its full blocks
        self.num_prefix_hits = 0  # tokens served from the prefix cache
        self.num_prefix_queries = 0  # tokens looked up

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # prefix cache
    def find_cached_blocks(self, seq: Sequence) -> list[int]:
        """Block ids holding a prefix of seq's tokens; always leaves at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        prev: int | None = None
        for i in range((len(seq) - 1) // self.block_size):
            tokens = tuple(seq.block_tokens(i, self.block_size))
            prev = chain_hash(prev, seq.adapter_id, tokens)
            block_id = self.cached.get(prev)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            found.append(block_id)
        return found

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] | None = None) -> bool:
        if seq.block_table or not cached:
            held, computed, revived = len(seq.block_table), seq.num_computed_tokens, 0
        else:
            held, computed = len(cached), len(cached) * self.block_size
            revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        return self.blocks_needed(computed + num_new_tokens) - held + revived <= len(self.free)

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] | None = None) -> None:
        """Give seq blocks for its next num_new_tokens tokens, taking the cached prefix first."""
        if cached and not seq.block_table:
            for block_id in cached:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.free[block_id]
                block.ref_count += 1
                seq.block_table.append(block_id)
            seq.num_computed_tokens = seq.num_cached_tokens = len(cached) * self.block_size
            self.block_hashes[seq.seq_id] = [self.blocks[b].block_hash for b in cached]  # type: ignore[misc]
        if cached is not None:  # admission: count the prefix-cache lookup
            self.num_prefix_queries += len(seq)
            self.num_prefix_hits += seq.num_cached_tokens
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > len(self.free):
            raise RuntimeError("allocate() without can_allocate()")
        for _ in range(needed):
            seq.block_table.append(self._take_free())

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None and self.cached.get(block.block_hash) == block_id:
            del self.cached[block.block_hash]
        block.block_hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def commit(self, seq: Sequence) -> None:
        """Register seq's newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        hashes = self.block_hashes.setdefault(seq.seq_id, [])
        for i in range(len(hashes), seq.num_computed_tokens // self.block_size):
            tokens = tuple(seq.block_tokens(i, self.block_size))
            h = chain_hash(hashes[-1] if hashes else None, seq.adapter_id, tokens)
            hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None:
                block.block_hash, block.token_ids = h, tokens
                self.cached.setdefault(h, block.block_id)

    def free_seq(self, seq: Sequence) -> None:
        """Drop seq's references; tail blocks go to the free list first so they are evicted first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        self.block_hashes.pop(seq.seq_id, None)
