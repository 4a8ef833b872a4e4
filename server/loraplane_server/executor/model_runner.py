"""Owns the model, the KV cache tensors, the sampler and the constrained sequences' grammar matchers; turns a
scheduled step into tokens."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import torch

from loraplane_server.executor.backends import Backends
from loraplane_server.executor.cuda_graphs import DecodeGraphs
from loraplane_server.executor.forward_batch import ForwardBatch, PrefillChunk
from loraplane_server.executor.lora.backends import LoRABatch, TritonBackend
from loraplane_server.executor.lora.slots import LoRASlots
from loraplane_server.executor.models.args import ModelArgs
from loraplane_server.executor.models.llama import LlamaForCausalLM
from loraplane_server.executor.sampler import Sampler
from loraplane_server.executor.structured import Fill, Matchers
from loraplane_server.executor.verifier import verify
from loraplane_server.sequence import Sequence


def decode_tables(tables: list[list[int]]) -> torch.Tensor:
    """The decode rows' block tables as one [rows, widest] int64 tensor, zero-padded: filled row by row through
    numpy (torch.tensor of a list of lists converts each element: ~4x the time for 256 rows)."""
    out = np.zeros((len(tables), max(map(len, tables))), dtype=np.int64)
    for i, table in enumerate(tables):
        out[i, : len(table)] = table
    return torch.from_numpy(out)


def kv_block_bytes(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
    """One KV block's bytes for a model of this shape (keys and values of every layer)."""
    return 2 * args.num_layers * block_size * args.num_kv_heads * args.head_dim * dtype.itemsize


def first_rows(samplers: list[Sequence]) -> list[tuple[int, Sequence]]:
    """Each sampling sequence's first logits row, with it: one row each, 1 + k for a speculative one."""
    starts = itertools.accumulate((1 + len(s.proposed) for s in samplers), initial=0)
    return list(zip(starts, samplers, strict=False))  # starts has one more: where the last one's rows end


class WindowStep:
    """A step's slots and block tables in the window pool (a model with global and sliding layers)."""

    def __init__(self) -> None:
        self.slots: list[int] = []
        self.tables: list[list[int]] = []  # the decodes'
        self.chunk_tables: list[list[int]] = []  # the prefill chunks'

    def add(self, seq: Sequence, start: int, end: int, bs: int, prefill: bool) -> None:
        table = seq.window_table
        self.slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        (self.chunk_tables if prefill else self.tables).append(table[: -(-end // bs)])

    def batch(self, batch: ForwardBatch, device: torch.device) -> ForwardBatch:
        """The step as the sliding layers see it: batch with the window pool's slots and tables."""
        t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
        width = max(map(len, self.tables), default=0)
        return replace(
            batch,
            slot_mapping=t(self.slots),
            decode_block_tables=t([row + [0] * (width - len(row)) for row in self.tables]) if self.tables else None,
            prefills=[replace(c, block_table=t(tb)) for c, tb in zip(batch.prefills, self.chunk_tables, strict=True)],
            decode_mask=None,
            decode_window_masks={},
        )


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        backends: Backends,
        lora_slots: LoRASlots | None = None,
        scratch_block: bool = False,
        window_blocks: int = 0,
    ) -> None:
        """scratch_block: one more KV block than the block manager hands out, at index num_blocks, for the
        padding rows of decode graphs (cuda_graphs.py) to write into. window_blocks > 0 (a model with global and
        sliding layers, engine/kv_groups.py): the sliding layers' K/V in a pool of their own, that many blocks."""
        a = model.args
        self.model = model
        self.block_size = block_size
        self.device = device
        windowed = [i for i, w in enumerate(a.sliding_windows) if w] if window_blocks else []
        self.window_layers = windowed  # the layers whose K/V lives in the window pool
        shape = (2, block_size, a.num_kv_heads, a.head_dim)

        def pool(layers: int, blocks: int) -> torch.Tensor:  # [layers, 2, N, B, KVH, D]
            return torch.zeros(layers, 2, blocks + scratch_block, *shape[1:], dtype=dtype, device=device)

        # the global pool, [L, 2, N, B, KVH, D] (every layer's for a model without a window pool)
        self.kv_pools = [pool(a.num_layers - len(windowed), num_blocks)]
        if windowed:
            self.kv_pools.append(pool(len(windowed), window_blocks))
        self.kv_caches: torch.Tensor | list[torch.Tensor] = self.kv_pools[0]  # what the model's layers read
        if windowed:  # each layer's view, in layer order
            counters = [iter(self.kv_pools[0]), iter(self.kv_pools[1])]
            self.kv_caches = [next(counters[i in windowed]) for i in range(a.num_layers)]
        self.graphs: DecodeGraphs | None = None  # plain decode steps through static buffers (and CUDA graphs)
        self.sampler = Sampler(kernels=backends.layer_kernels)
        self.matchers = Matchers(model.args.vocab_size)  # structured output's, one per constrained sequence
        self.lora_slots = lora_slots
        self.use_backends(backends)
        self.nonfinite: list[Sequence] = []  # sequences whose logits were NaN or inf, for the engine to fail
        self.prompt_rows: list[tuple[Sequence, int]] = []  # this step's prompt_logprobs rows: (sequence, position)

    def use_backends(self, backends: Backends) -> None:
        """The backends resolved once at engine start (backends.py), handed to the model's layers too."""
        self.backends = backends
        self.model.use_backends(backends)

    def use_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool) -> DecodeGraphs:
        """Plain decode steps through static buffers from now on, captured as CUDA graphs with `capture` (the
        runner was made with its scratch block)."""
        self.graphs = DecodeGraphs(
            self.model, self.kv_caches, self.kv_pools, self.lora_slots, self.block_size, max_num_seqs, max_model_len
        )
        if capture:
            self.graphs.capture()
        return self.graphs

    @property
    def use_triton(self) -> bool:
        """Whether LoRA runs on the Triton backend."""
        return isinstance(self.backends.lora, TritonBackend)

    def prepare(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, ForwardBatch, list[Sequence]]:
        """Flatten a step into input ids and a ForwardBatch; decodes first, then prefill chunks."""
        is_decode = [n == 1 and s.num_computed_tokens == len(s) - 1 for s, n in scheduled]
        decodes = [sn for sn, d in zip(scheduled, is_decode, strict=True) if d]
        prefills = [sn for sn, d in zip(scheduled, is_decode, strict=True) if not d]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        samplers: list[Sequence] = []
        row_seqs: list[Sequence] = []  # the sequence of each logits row
        chunks: list[PrefillChunk] = []
        prompt_rows: list[tuple[int, Sequence, int]] = []  # prompt_logprobs: (input row, sequence, position)
        bs = self.block_size
        rotary = self.model.rotary  # once: a module attribute read costs a __getattr__ call
        window = WindowStep() if self.window_layers else None
        for i, (seq, n) in enumerate(decodes + prefills):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            if i >= len(decodes):
                table = torch.tensor(seq.block_table[: -(-end // bs)], dtype=torch.int64)
                chunks.append(PrefillChunk(len(ids), n, start, table.to(self.device)))
            if window:
                window.add(seq, start, end, bs, i >= len(decodes))
            if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                # each prompt position's row predicts the next prompt token (the last one's is the sampler's)
                last = min(end, seq.num_prompt_tokens - 1)
                prompt_rows += [(len(ids) + p - start, seq, p) for p in range(start, last)]
            ids.extend(seq.token_ids[start:end] if not seq.proposed else seq.token_ids[start:] + seq.proposed)
            positions.extend(rotary.rows(start, end, seq.rope_long))  # rotary table rows
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in range(start, end))
            if end == len(seq):  # the step reaches the last token: sample the next one
                logits_rows.append(len(ids) - 1)
                samplers.append(seq)
                row_seqs.append(seq)
            elif seq.proposed:  # speculative: every row is checked, the last token's and each proposal's
                logits_rows.extend(range(len(ids) - n, len(ids)))
                samplers.append(seq)
                row_seqs.extend([seq] * n)
        logits_rows += [row for row, _, _ in prompt_rows]  # after the samplers' rows: run() splits them off
        row_seqs += [seq for _, seq, _ in prompt_rows]
        self.prompt_rows = [(seq, p) for _, seq, p in prompt_rows]
        tables, lens = None, None
        if decodes:
            tables = decode_tables([s.block_table for s, _ in decodes])
            lens = torch.tensor([len(s) for s, _ in decodes])
        t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.device)  # noqa: E731
        batch = ForwardBatch(
            positions=t(positions),
            slot_mapping=t(slots),
            num_decode_tokens=len(decodes),
            decode_block_tables=None if tables is None else tables.to(self.device),
            decode_context_lens=None if lens is None else lens.to(self.device),
            prefills=chunks,
            logits_indices=t(logits_rows),
        )
        self.backends.attention.prepare(batch, bs)
        batch.lora = self._lora_batch(decodes, prefills, chunks, len(ids))
        if batch.lora is not None and batch.prunes_last_layer:
            batch.logits_lora = self._rows_lora_batch(row_seqs)
        if window:
            batch.window_batch = window.batch(batch, self.device)
            self.backends.attention.prepare(batch.window_batch, bs)
        return t(ids), batch, samplers

    def _by_adapter(self, scheduled: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """The step's sequences in adapter-slot order (stable; base rows first) where LoRA runs on Triton, whose batch
        makes each run of one slot a single segment (an adapter's A and B read once for its rows); as they came
        elsewhere."""
        if self.lora_slots is None or not self.use_triton:
            return scheduled
        return sorted(scheduled, key=lambda sn: -1 if sn[0].lora_slot is None else sn[0].lora_slot)

    def _lora_batch(
        self,
        decodes: list[tuple[Sequence, int]],
        prefills: list[tuple[Sequence, int]],
        chunks: list[PrefillChunk],
        num_tokens: int,
    ) -> LoRABatch | None:
        if self.lora_slots is None or all(s.lora_slot is None for s, _ in decodes + prefills):
            return None
        decode_slots = self._row_slots([s for s, _ in decodes])
        segments: list[tuple[int, int, int]] = []
        for (seq, _), chunk in zip(prefills, chunks, strict=True):
            if seq.lora_slot is None:
                continue
            start, end = chunk.query_start, chunk.query_start + chunk.num_query_tokens
            if segments and segments[-1][1] == start and segments[-1][2] == seq.lora_slot:
                segments[-1] = (segments[-1][0], end, seq.lora_slot)  # merge runs of one adapter
            else:
                segments.append((start, end, seq.lora_slot))
        lora = self.backends.lora.prepare(self.lora_slots, decode_slots, segments, num_tokens)
        return None if lora.is_empty else lora

    def _row_slots(self, seqs: list[Sequence]) -> list[int]:
        """Each sequence's adapter slot, the slots' none_slot for the base model."""
        assert self.lora_slots is not None
        none = self.lora_slots.none_slot
        return [none if s.lora_slot is None else s.lora_slot for s in seqs]

    def _rows_lora_batch(self, row_seqs: list[Sequence]) -> LoRABatch | None:
        """The adapters of the logits rows (one per sampling sequence, k + 1 for a speculative one), each
        row on its own."""
        assert self.lora_slots is not None
        rows = self._row_slots(row_seqs)
        lora = self.backends.lora.prepare(self.lora_slots, rows, [], len(rows))
        return None if lora.is_empty else lora

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]]) -> tuple[list[Sequence], list[list[int]], list[list[float]]]:
        """One forward pass; returns the sequences that sampled, their tokens and logprobs: one each, or for a
        speculative sequence its accepted proposals and the model's own next token (verifier.py)."""
        scheduled = self._by_adapter(scheduled)
        if self.graphs is not None and self.graphs.applies(scheduled):
            samplers = [s for s, _ in scheduled]
            self.prompt_rows = []
            fill = self.matchers.fill(first_rows(samplers))  # structured output's masks, filled during the forward
            logits = self.graphs.forward(samplers)  # [S, V]
        else:
            input_ids, batch, samplers = self.prepare(scheduled)
            fill = self.matchers.fill(first_rows(samplers))
            logits = self.model(input_ids, self.kv_caches, batch)  # [R, V]
        if self.prompt_rows:
            logits = self._record_prompt_logprobs(logits)
        if not samplers:
            return [], [], []
        if len(logits) > len(samplers):  # speculative rows: the verifier reads every row of a sequence
            logits, samplers = self._drop_nonfinite(logits, samplers)
            # a constrained sequence has no proposals (the speculator gives it none): its one row
            self.matchers.mask(logits, first_rows(samplers), fill)
            return (samplers, *verify(self.sampler, logits, samplers)) if samplers else ([], [], [])
        return self._sample(logits, samplers, fill)

    def _sample(
        self, logits: torch.Tensor, samplers: list[Sequence], fill: Fill | None = None
    ) -> tuple[list[Sequence], list[list[int]], list[list[float]]]:
        """One token per row, with one device-to-host copy a step: the ids, their logprobs and whether each row's
        logits were finite come back together (rows sample independently, so a NaN row harms no other; it is
        set aside afterwards, as _drop_nonfinite does)."""
        # a row's sum is non-finite whenever one of its logits is (NaN, inf, or inf - inf): one reduction,
        # ~0.2 ms for 64 x 49,152 where isfinite().all() over every logit took ~4 ms a step
        finite = torch.isfinite(logits.sum(dim=-1))
        self.matchers.mask(logits, enumerate(samplers), fill)  # after the check: a masked row holds -inf
        gens = [s.generator for s in samplers]
        seen = [s.token_ids if s.params.repetition_penalty != 1.0 else [] for s in samplers]
        shaped = [s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0 for s in samplers]
        outputs = [s.output_token_ids if wants else [] for s, wants in zip(samplers, shaped, strict=True)]
        tokens, logprobs, top = self.sampler.sample(logits, [s.params for s in samplers], gens, seen, outputs)
        ids, lps, ok = torch.stack((tokens.double(), logprobs.double(), finite.double())).tolist()
        if top is not None:  # the rows that asked: their top-k (token id, logprob), best first
            top_ids, top_lps = (t.tolist() for t in top)
            for seq, row_ids, row_lps in zip(samplers, top_ids, top_lps, strict=True):
                k = seq.params.top_logprobs
                seq.step_top_logprobs = list(zip(row_ids[:k], row_lps[:k], strict=True)) if k else None
        if not all(ok):  # some row is suspect: the exact rows (rare), and theirs set aside
            suspect = [i for i, v in enumerate(ok) if not v]
            rows = torch.tensor(suspect, dtype=torch.int64, device=logits.device)
            exact = torch.isfinite(logits.index_select(0, rows)).all(dim=-1).tolist()
            for i, row_ok in zip(suspect, exact, strict=True):
                ok[i] = float(row_ok)
                if not row_ok:
                    self._set_aside(samplers[i])
        keep = [i for i, v in enumerate(ok) if v]
        return [samplers[i] for i in keep], [[int(ids[i])] for i in keep], [[lps[i]] for i in keep]

    def _record_prompt_logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """The prompt rows' logprobs (the last rows of logits) onto their sequences: each prompt token's logprob
        under the model given the tokens before it, its rank, and the top-k when asked; the samplers' rows back.
        A position already recorded (a sequence recomputed after preemption) is not recorded again."""
        n = len(self.prompt_rows)
        rows, logits = logits[-n:].float(), logits[:-n]
        logp = rows.log_softmax(dim=-1)  # [n, V]
        targets = torch.tensor([seq.token_ids[p + 1] for seq, p in self.prompt_rows], device=logits.device)
        chosen = logp.gather(1, targets[:, None])  # [n, 1]
        ranks = (logp > chosen).sum(dim=-1) + 1  # 1: the most likely token
        k = max(seq.params.prompt_logprobs or 0 for seq, _ in self.prompt_rows)
        top_lps, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], targets[:, None][:, :0])
        values = torch.stack((chosen[:, 0].double(), ranks.double()), dim=1).tolist()
        top = list(zip(top_ids.tolist(), top_lps.tolist(), strict=True))
        for (seq, p), (lp, rank), (ids, lps) in zip(self.prompt_rows, values, top, strict=True):
            if p == len(seq.prompt_logprobs):  # position p + 1 is the next one this sequence lacks
                want = seq.params.prompt_logprobs or 0
                alternatives = list(zip(ids[:want], lps[:want], strict=True))
                seq.prompt_logprobs.append((seq.token_ids[p + 1], lp, int(rank), alternatives))
        self.prompt_rows = []
        return logits

    def _drop_nonfinite(self, logits: torch.Tensor, samplers: list[Sequence]) -> tuple[torch.Tensor, list[Sequence]]:
        """Set aside the sequences whose logits rows hold NaN or inf (validation keeps them out, this is the
        backstop): they go to `nonfinite` and their KV blocks are zeroed, so a block's next owner never
        reads a stale NaN; the other rows sample as usual."""
        # the row sums' check, as in _sample
        if not samplers or bool(torch.isfinite(logits.sum(dim=-1)).all()):
            return logits, samplers
        row_ok = torch.isfinite(logits).all(dim=-1).tolist()  # the exact rows, only when some row is suspect
        counts = [1 + len(s.proposed) for s in samplers]
        starts = [sum(counts[:i]) for i in range(len(counts))]
        keep = [all(row_ok[a : a + c]) for a, c in zip(starts, counts, strict=True)]
        for seq in (s for s, ok in zip(samplers, keep, strict=True) if not ok):
            self._set_aside(seq)
        rows = [r for a, c, ok in zip(starts, counts, keep, strict=True) if ok for r in range(a, a + c)]
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        return logits.index_select(0, index), [s for s, ok in zip(samplers, keep, strict=True) if ok]

    def _set_aside(self, seq: Sequence) -> None:
        """A sequence whose logits went non-finite: its KV blocks zeroed (a block's next owner never reads a
        stale NaN), the sequence handed to the engine to fail alone."""
        self.kv_pools[0][:, :, seq.block_table[seq.num_released_blocks :]] = 0  # its own blocks alone
        if self.window_layers:
            self.kv_pools[1][:, :, seq.window_table[seq.window_released :]] = 0
        self.nonfinite.append(seq)

    def take_nonfinite(self) -> list[Sequence]:
        """The sequences set aside since the last call (see _drop_nonfinite)."""
        seqs, self.nonfinite = self.nonfinite, []
        return seqs
