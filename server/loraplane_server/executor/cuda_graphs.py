"""Decode steps as CUDA graphs: the lever vLLM and SGLang use for small and medium models, where a decode step's
hundreds of small kernel launches cost more than its math.

At start, one graph is captured per batch-size bucket (1, 2, 4, 8, then every 8 up to --max-num-seqs) and per
LoRA variant (with the SGMV kernels, or the base model alone). A graph reads static input buffers: token ids,
positions, KV slots, block tables, context lengths and the adapters' row segments, so one graph serves any mix of
adapters; loading or evicting an adapter rewrites the slot weights in place (executor/lora/slots.py) and the per-slot
ranks buffer before the next replay, so no graph is ever invalidated. A step of n decode rows runs the
smallest bucket >= n; the padding rows write their K/V into a scratch block no sequence owns and attend to it
alone, and their logits are dropped. Steps with prefill chunks or speculative proposals run eagerly.

`capture=False` runs the same static-buffer step eagerly: how the tests check the buffers, padding and the
LoRA variant on the CPU (Triton under TRITON_INTERPRET), where no graph can be captured.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from loraplane_server.executor.forward_batch import ForwardBatch
from loraplane_server.executor.lora.backends.triton import TritonLoRABatch, slot_runs
from loraplane_server.kernels.triton_lora import ROWS_PER_PROGRAM

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from loraplane_server.executor.lora.slots import LoRASlots
    from loraplane_server.executor.models.llama import LlamaForCausalLM
    from loraplane_server.sequence import Sequence

log = logging.getLogger("loraplane.cuda_graphs")

MAX_GRAPH_BATCH = 512  # vLLM's cap too: past it a decode step is compute-bound and launches are amortised


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The buckets: 1, 2, 4, 8, then multiples of 8 up to max_num_seqs rounded up to 8 (at most
    MAX_GRAPH_BATCH), so no step pads by more than 7 rows past 8."""
    top = min(MAX_GRAPH_BATCH, -(-max_num_seqs // 8) * 8 if max_num_seqs > 8 else max_num_seqs)
    sizes = [s for s in (1, 2, 4, 8) if s < top] + list(range(16, top, 8))
    return sorted({*sizes, top})


def graph_bucket(num_rows: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds num_rows rows; None when none does (the step runs eagerly)."""
    return next((s for s in sizes if s >= num_rows), None)


def is_plain_decode(scheduled: list[tuple[Sequence, int]]) -> bool:
    """Whether every scheduled sequence decodes one token from a full cache (no prefill, no proposals)."""
    return all(n == 1 and not s.proposed and s.num_computed_tokens == len(s) - 1 for s, n in scheduled)


class GraphLoRABatch(TritonLoRABatch):
    """A decode step's adapters as static tensors a captured graph reads: the segments (first row, rows, slot) are
    the runs of one adapter's rows (the model runner orders the rows by slot), at most ROWS_PER_PROGRAM rows each so
    that one program covers a segment's rows; the entries past the step's runs have no rows (their programs return
    at once). Every layer kind an adapter could target runs (a slot of rank 0 there costs its programs' start),
    and the per-slot ranks are a buffer refreshed in place before each replay."""

    def __init__(
        self,
        slots: LoRASlots,
        starts: torch.Tensor,
        lens: torch.Tensor,
        seg_slots: torch.Tensor,
        ranks: dict[str, torch.Tensor],
    ) -> None:
        # not TritonLoRABatch.__init__: that one builds its tensors from one step's lists
        self.slots = slots
        self.kinds = set(slots.layouts)
        self.starts, self.lens, self.seg_slots = starts, lens, seg_slots
        self.ranks = ranks
        self.max_seg_len = ROWS_PER_PROGRAM


class DecodeGraphs:
    """The static buffers, the captured graphs (or, without capture, their eager twin) and a step's replay."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: torch.Tensor | list[torch.Tensor],
        kv_pools: list[torch.Tensor],
        lora_slots: LoRASlots | None,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
    ) -> None:
        """The model runner's model, KV cache (each pool's last block its scratch block; a second pool: the
        sliding layers', engine/kv_groups.py) and LoRA slots."""
        self.model, self.kv_caches, self.lora_slots, self.block_size = model, kv_caches, lora_slots, block_size
        self.device = device = kv_pools[0].device
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.scratch_block = scratch_block = kv_pools[0].shape[2] - 1
        self.window_scratch = kv_pools[1].shape[2] - 1 if len(kv_pools) > 1 else None
        self.scratch_slot = scratch_block * block_size  # padding rows' K/V land here, owned by no sequence
        rows, width = self.sizes[-1], -(-max_model_len // block_size)
        self.buffers = {  # [rows] (tables [rows, width]), int64 on the device
            "ids": torch.zeros(rows, dtype=torch.int64, device=device),
            "positions": torch.zeros(rows, dtype=torch.int64, device=device),
            "slots": torch.zeros(rows, dtype=torch.int64, device=device),
            "lens": torch.ones(rows, dtype=torch.int64, device=device),
            "tables": torch.full((rows, width), scratch_block, dtype=torch.int64, device=device),
            # the LoRA segments (at most one per row): first row, rows, slot; int32
            "seg_starts": torch.zeros(rows, dtype=torch.int32, device=device),
            "seg_lens": torch.zeros(rows, dtype=torch.int32, device=device),
            "seg_slots": torch.full((rows,), -1, dtype=torch.int32, device=device),
        }
        if self.window_scratch is not None:  # the sliding layers' slots and tables, in their pool
            self.buffers["wslots"] = torch.zeros(rows, dtype=torch.int64, device=device)
            self.buffers["wtables"] = torch.full((rows, width), self.window_scratch, dtype=torch.int64, device=device)
        # the host side of each step, filled then copied in one go per buffer
        pin = device.type == "cuda"
        self.staging = {
            k: torch.empty_like(v, device="cpu").pin_memory() if pin else v.cpu().clone()
            for k, v in self.buffers.items()
        }
        self.views = {k: t.numpy() for k, t in self.staging.items()}  # the same memory, for _fill
        self.ranks: dict[str, torch.Tensor] = {}
        self._ranks_key: tuple = ()
        slots = lora_slots
        if slots is not None:
            self.ranks = {k: torch.zeros(slots.num_slots + 1, dtype=torch.int32, device=device) for k in slots.layouts}
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}
        self.pool: _POOL_HANDLE | None = None  # the graphs' shared memory pool
        self.num_replays = 0  # steps through the static buffers, and of those the ones with adapter rows
        self.num_lora_replays = 0

    @property
    def max_rows(self) -> int:
        return self.sizes[-1]

    def applies(self, scheduled: list[tuple[Sequence, int]]) -> bool:
        return 0 < len(scheduled) <= self.max_rows and is_plain_decode(scheduled)

    # the static step
    def _batch(self, rows: int, lora: bool) -> ForwardBatch:
        b = self.buffers
        batch = ForwardBatch(
            positions=b["positions"][:rows],
            slot_mapping=b["slots"][:rows],
            num_decode_tokens=rows,
            decode_block_tables=b["tables"][:rows],
            decode_context_lens=b["lens"][:rows],
        )
        if lora and self.lora_slots is not None:
            segments = (b["seg_starts"][:rows], b["seg_lens"][:rows], b["seg_slots"][:rows])
            batch.lora = GraphLoRABatch(self.lora_slots, *segments, self.ranks)
        if self.window_scratch is not None:
            batch.window_batch = replace(
                batch, slot_mapping=b["wslots"][:rows], decode_block_tables=b["wtables"][:rows]
            )
        return batch

    def _forward(self, rows: int, lora: bool) -> torch.Tensor:
        return self.model(self.buffers["ids"][:rows], self.kv_caches, self._batch(rows, lora))

    def capture(self) -> None:
        """One graph per bucket and LoRA variant, largest first (the smaller ones reuse its memory pool), each
        after an eager warm-up (Triton compiles then, never inside a capture)."""
        start = time.monotonic()
        before = torch.cuda.memory_reserved(self.device)
        self._pad_from(0)
        variants = [False, True] if self.lora_slots is not None else [False]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for rows in reversed(self.sizes):
                for lora in variants:
                    self._forward(rows, lora)  # warm-up: kernels compiled, workspaces allocated
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                        out = self._forward(rows, lora)
                    self.pool = graph.pool()
                    self.graphs[(rows, lora)], self.outputs[(rows, lora)] = graph, out
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info(
            "CUDA graphs: %d decode graphs (batch sizes %s, with and without LoRA) in %.1f s, %.0f MiB",
            len(self.graphs),
            ",".join(map(str, self.sizes)),
            time.monotonic() - start,
            (torch.cuda.memory_reserved(self.device) - before) / 2**20,
        )

    def describe(self) -> str:
        mode = f"{len(self.graphs)} CUDA graphs" if self.graphs else "static buffers, eager"
        return f"decode as {mode} (batch sizes up to {self.max_rows})"

    # one step
    def forward(self, seqs: list[Sequence]) -> torch.Tensor:
        """Logits [n, V] of n plain decode rows (in this order), through the bucket's graph."""
        n = len(seqs)
        rows = graph_bucket(n, self.sizes)
        assert rows is not None, f"{n} rows: no bucket (applies() is False for this step)"
        lora = self._fill(seqs)
        self._pad_from(n, rows)
        for key, buf in self.buffers.items():
            buf[:rows].copy_(self.staging[key][:rows], non_blocking=True)
        if lora:
            self._refresh_ranks()
        self.num_replays += 1
        self.num_lora_replays += lora
        graph = self.graphs.get((rows, lora))
        if graph is None:  # capture=False, or a bucket not captured: the same static step, eagerly
            return self._forward(rows, lora)[:n]
        graph.replay()
        return self.outputs[(rows, lora)][:n]

    def _fill(self, seqs: list[Sequence]) -> bool:
        """The rows' inputs into the host staging buffers, a list per buffer through their numpy views (no torch
        call per row); whether some row has an adapter."""
        v, bs, n = self.views, self.block_size, len(seqs)
        last = [len(seq) - 1 for seq in seqs]
        v["ids"][:n] = [seq.token_ids[-1] for seq in seqs]
        v["positions"][:n] = last
        v["slots"][:n] = [seq.block_table[p // bs] * bs + p % bs for seq, p in zip(seqs, last, strict=True)]
        v["lens"][:n] = [p + 1 for p in last]
        for i, seq in enumerate(seqs):
            v["tables"][i, : len(seq.block_table)] = seq.block_table
        if self.window_scratch is not None:
            v["wslots"][:n] = [seq.window_table[p // bs] * bs + p % bs for seq, p in zip(seqs, last, strict=True)]
            for i, seq in enumerate(seqs):
                v["wtables"][i, : len(seq.window_table)] = seq.window_table
        with_slots = self.lora_slots is not None
        slots = [seq.lora_slot if with_slots and seq.lora_slot is not None else -1 for seq in seqs]
        runs = slot_runs(slots, -1, ROWS_PER_PROGRAM)
        k = len(runs)
        v["seg_starts"][:k] = [r[0] for r in runs]
        v["seg_lens"][:k] = [r[1] for r in runs]
        v["seg_slots"][:k] = [r[2] for r in runs]
        v["seg_lens"][k:n] = 0  # no rows: the buffer's rows past n are padding's, set by _pad_from
        v["seg_slots"][k:n] = -1
        return k > 0

    def _pad_from(self, first: int, rows: int | None = None) -> None:
        """Rows first..rows (all rows by default) as padding: the scratch slot, one token of context."""
        s, end = self.staging, self.max_rows if rows is None else rows
        s["ids"][first:end] = 0
        s["positions"][first:end] = 0
        s["slots"][first:end] = self.scratch_slot
        s["lens"][first:end] = 1
        s["tables"][first:end, 0] = self.scratch_block
        if self.window_scratch is not None:
            s["wslots"][first:end] = self.window_scratch * self.block_size
            s["wtables"][first:end, 0] = self.window_scratch
        s["seg_lens"][first:end] = 0
        s["seg_slots"][first:end] = -1
        if rows is None:  # at capture: every buffer row starts as padding
            for key, buf in self.buffers.items():
                buf.copy_(s[key])

    def _refresh_ranks(self) -> None:
        """The slots' ranks per layer kind into the static buffer, when an adapter came or went."""
        slots = self.lora_slots
        assert slots is not None
        key = tuple(tuple(sorted(w.items())) for w in slots.widths)
        if key == self._ranks_key:
            return
        for kind, buf in self.ranks.items():
            buf.copy_(torch.tensor([w.get(kind, 0) for w in slots.widths], dtype=torch.int32))
        self._ranks_key = key
