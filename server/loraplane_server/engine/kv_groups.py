"""KV blocks for a model with global and sliding-window layers (Gemma 3's 1 in 6 global, Qwen2 past
max_window_layers): two pools of blocks, each with its own table per sequence. No torch here.

The global layers read a sequence's whole context, so their pool holds it all, as for any model. The sliding
layers read the last `window` positions alone, so their pool (a BlockManager with a window) releases the blocks
behind the window: a 32k-token Gemma 3 request holds 32k tokens of KV on its global layers and a window plus a
step on the others, not 32k on every layer. The sliding pool is sized for every running sequence's window
(engine.py); both pools must have room for a step, so the scheduler asks both (can_allocate, spare_after).

Prefix caching: both pools register a sequence's full blocks under the same chained hashes. A hit of k blocks
needs the global pool to hold all k and the sliding pool the ones that the next query's window reads; blocks
before that are placeholders in the sliding table (released, or evicted since).
"""

from __future__ import annotations

from typing import cast

from loraplane_server.engine.block_manager import BlockManager
from loraplane_server.sequence import Sequence


class GroupHit(list[int]):
    """A prefix hit: the global pool's blocks, with the sliding pool's for the same prefix."""

    def __init__(self, blocks: list[int], window: list[int]) -> None:
        super().__init__(blocks)
        self.window = window


class WindowView:
    """A sequence as the sliding pool's manager sees it: its window table and released count in place of the
    global ones; everything else (tokens, computed count, id, parameters) is the sequence's own."""

    seq: Sequence

    def __init__(self, seq: Sequence) -> None:
        object.__setattr__(self, "seq", seq)

    @property
    def block_table(self) -> list[int]:
        return self.seq.window_table

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.seq.window_table = table

    @property
    def num_released_blocks(self) -> int:
        return self.seq.window_released

    @num_released_blocks.setter
    def num_released_blocks(self, n: int) -> None:
        self.seq.window_released = n

    def __getattr__(self, name: str) -> object:
        return getattr(self.seq, name)

    def __setattr__(self, name: str, value: object) -> None:
        if name in ("block_table", "num_released_blocks"):
            object.__setattr__(self, name, value)  # the properties above
        else:
            setattr(self.seq, name, value)  # num_computed_tokens, num_cached_tokens: the sequence's

    def __len__(self) -> int:
        return len(self.seq)


def window_view(seq: Sequence) -> Sequence:
    """seq for the sliding pool (duck-typed: BlockManager reads and writes only what WindowView forwards)."""
    return cast(Sequence, WindowView(seq))


class HybridBlocks(BlockManager):
    """The global layers' pool (this BlockManager itself, so the scheduler's counts and metrics are its) and
    the sliding layers' pool beside it."""

    def __init__(
        self,
        num_blocks: int,
        num_window_blocks: int,
        block_size: int,
        window: int,
        enable_prefix_caching: bool = True,
        step_tokens: int = 0,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching, step_tokens=step_tokens)
        self.windows = BlockManager(num_window_blocks, block_size, enable_prefix_caching, window, step_tokens)

    @property
    def usage(self) -> float:
        return max(super().usage, self.windows.usage)

    def fits(self, num_tokens: int) -> bool:
        return super().fits(num_tokens) and self.windows.fits(num_tokens)

    def find_cached_blocks(self, seq: Sequence, at_most: int | None = None) -> list[int]:
        blocks = super().find_cached_blocks(seq, at_most)
        window = self.windows.find_cached_blocks(window_view(seq), len(blocks))
        return GroupHit(blocks[: len(window)], window)

    @staticmethod
    def _window_hit(cached: list[int] | None) -> list[int] | None:
        if cached is None:
            return None
        return cached.window if isinstance(cached, GroupHit) else []

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] | None = None) -> bool:
        window_hit = self._window_hit(cached)
        return super().can_allocate(seq, num_new_tokens, cached) and self.windows.can_allocate(
            window_view(seq), num_new_tokens, window_hit
        )

    def spare_after(self, seq: Sequence, num_new_tokens: int, cached: list[int] | None = None) -> int:
        window_hit = self._window_hit(cached)
        return min(
            super().spare_after(seq, num_new_tokens, cached),
            self.windows.spare_after(window_view(seq), num_new_tokens, window_hit),
        )

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] | None = None) -> None:
        window_hit = self._window_hit(cached)
        super().allocate(seq, num_new_tokens, cached)
        self.windows.allocate(window_view(seq), num_new_tokens, window_hit)

    def commit(self, seq: Sequence) -> None:
        super().commit(seq)
        self.windows.commit(window_view(seq))

    def trim(self, seq: Sequence) -> None:
        super().trim(seq)
        self.windows.trim(window_view(seq))

    def free_seq(self, seq: Sequence) -> None:
        self.windows.free_seq(window_view(seq))
        super().free_seq(seq)
