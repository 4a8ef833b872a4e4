"""Speculative decoding's draft-model proposer: a smaller model with the target's tokenizer guesses each
speculating sequence's next k tokens greedily; the target verifies them in its next pass (verifier.py).

The draft runs without adapters (adapters belong to the target: the verification applies each sequence's
own). Its KV cache is a second set of tensors indexed by the target's blocks: a sequence's block table
holds both models' keys and values, so the block manager's accounting, prefix sharing, preemption and
the rejected tail's trim cover the draft too, and each block costs the sum of both models' bytes
(model_runner.kv_block_bytes of each; the engine sizes the pool with the sum).

Per sequence the draft keeps `SpecState.draft_computed`: how many leading positions hold its K/V. A
proposal round first catches up on what it has not seen (the prompt after prefill or a preemption,
the target's own token after a verified run: usually one or two tokens, in one chunk whose last row
gives the first proposal), then runs k - 1 single-token passes, every speculating sequence of the
step batched in each. After verification the count falls back to the accepted length (engine.py), so
a rejected proposal's K/V is simply overwritten next round. A catch-up longer than the step allows
(`catch_up_budget` tokens a step, all sequences together) is spread over steps without proposals.

A greedy draft is a deterministic proposer: the verifier's point-mass rejection sampling (accept d
with the target's probability of d, else draw from the rest) keeps a sampled request's distribution
exactly that of plain sampling, as it does for prompt lookup.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loraplane_server.executor.backends import Backends
from loraplane_server.executor.forward_batch import ForwardBatch, PrefillChunk
from loraplane_server.executor.models.args import ModelArgs
from loraplane_server.executor.models.llama import LlamaForCausalLM
from loraplane_server.sequence import Sequence
from loraplane_server.spec.policy import moving_average

log = logging.getLogger("loraplane.draft")


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes a forward pass reads at least once: every parameter and buffer (int8 weights are buffers)."""
    return sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))


class DraftModelError(ValueError):
    """The draft model cannot propose for this target (another tokenizer, a vocabulary that differs)."""


def check_vocabulary(
    target_tokenizer: Any, draft_tokenizer: Any, target_args: ModelArgs, draft_args: ModelArgs
) -> None:
    """DraftModelError unless the draft reads and writes the target's token ids: the same token -> id map
    (the embedding rows past it, padding, may differ). Without a tokenizer on either side only the
    vocabulary sizes can be compared, and must be equal."""
    if target_tokenizer is None or draft_tokenizer is None:
        if target_args.vocab_size != draft_args.vocab_size:
            raise DraftModelError(
                f"the draft model's vocabulary has {draft_args.vocab_size} tokens, the model's "
                f"{target_args.vocab_size} (and a tokenizer is missing to compare them): a draft must share the "
                "model's tokenizer"
            )
        return
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        differ = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda kv: (kv[1], kv[0]))
        token, _ = differ[0]
        raise DraftModelError(
            f"the draft model's tokenizer differs from the model's ({len(target_vocab)} vs {len(draft_vocab)} "
            f"tokens; e.g. {token!r} is id {target_vocab.get(token)} in the model's, {draft_vocab.get(token)} in "
            "the draft's): a draft must share the model's tokenizer"
        )
    if draft_args.vocab_size < len(target_vocab):
        raise DraftModelError(
            f"the draft model's embedding has {draft_args.vocab_size} rows for a {len(target_vocab)}-token tokenizer"
        )


@dataclass
class DraftRun:
    """One sequence's draft work this step: catch up to `end` (exclusive), then propose k tokens (k > 0
    only when end is the sequence's length)."""

    seq: Sequence
    end: int
    k: int


class DraftModel:
    """The draft model, its KV caches over the target's blocks, and greedy proposals for a step."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        model_dir: Path,
        max_positions: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        backends: Backends,
        target_vocab_size: int,
    ) -> None:
        a = model.args
        self.model = model
        self.model_dir = model_dir
        self.max_positions = max_positions  # positions the draft has rotary tables and a context for
        self.block_size = block_size
        self.device = device
        self.backends = backends
        self.kv_caches = torch.zeros(
            a.num_layers, 2, num_blocks, block_size, a.num_kv_heads, a.head_dim, dtype=dtype, device=device
        )  # [L, 2, N, B, KVH, D], indexed by the target's block ids
        self.vocab_size = min(target_vocab_size, a.vocab_size)  # ids both models know
        model.use_backends(backends)
        self.weight_bytes = weight_bytes(model)
        self.pass_seconds: float | None = None  # a single-token pass's time, moving average (the engine's cost model)
        self.num_passes = 0  # forward passes, for tests and the bench
        self.num_tokens = 0  # tokens those passes computed

    def describe(self) -> str:
        a = self.model.args
        return f"draft {self.model_dir.name} ({a.num_layers} layers, hidden {a.hidden_size})"

    @torch.inference_mode()
    def propose(self, runs: list[DraftRun]) -> list[list[int]]:
        """Each run's proposals (k greedy tokens; none for a catch-up alone), its draft_computed moved on."""
        proposals: list[list[int]] = [[] for _ in runs]
        first: list[tuple[Sequence, list[int], int]] = []
        for run in runs:
            assert run.seq.spec is not None
            start = run.seq.spec.draft_computed
            first.append((run.seq, run.seq.token_ids[start : run.end], start))
        for i, token in enumerate(self._greedy(first)):
            if runs[i].k > 0:
                proposals[i].append(token)
        for j in range(1, max((r.k for r in runs), default=0)):
            live = [i for i, r in enumerate(runs) if r.k > j]
            items = [(runs[i].seq, [proposals[i][-1]], runs[i].end + j - 1) for i in live]
            for i, token in zip(live, self._greedy(items), strict=True):
                proposals[i].append(token)
        for run in runs:  # the passes above wrote K/V up to the last proposal's input
            assert run.seq.spec is not None
            run.seq.spec.draft_computed = run.end + max(0, run.k - 1)
        return proposals

    def _greedy(self, items: list[tuple[Sequence, list[int], int]]) -> list[int]:
        """One pass over items (sequence, tokens, first position), each reading its own cached context; the
        argmax after each item's last token, in item order."""
        start = time.perf_counter()
        ids, batch, order = self._batch(items)
        logits = self.model(ids, self.kv_caches, batch)  # [len(items), V], rows in `order`
        best = logits[:, : self.vocab_size].argmax(dim=-1).tolist()
        if len(ids) == len(items):  # single tokens: what each of a proposal's later passes costs
            self.pass_seconds = moving_average(self.pass_seconds, time.perf_counter() - start)
        self.num_passes += 1
        self.num_tokens += len(ids)
        out = [0] * len(items)
        for row, i in enumerate(order):
            out[i] = best[row]
        return out

    def _batch(self, items: list[tuple[Sequence, list[int], int]]) -> tuple[torch.Tensor, ForwardBatch, list[int]]:
        """The step's tensors: single tokens as decode rows first, longer runs as prefill chunks (the
        runner's order); the order in which the items' logits rows come."""
        bs = self.block_size
        order = sorted(range(len(items)), key=lambda i: len(items[i][1]) > 1)  # stable: decodes, then chunks
        num_decodes = sum(1 for it in items if len(it[1]) == 1)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        chunks: list[PrefillChunk] = []
        for i in order:
            seq, toks, start = items[i]
            end = start + len(toks)
            if len(toks) > 1:
                table = torch.tensor(seq.block_table[: -(-end // bs)], dtype=torch.int64)
                chunks.append(PrefillChunk(len(ids), len(toks), start, table.to(self.device)))
            ids.extend(toks)
            # its own rotary table's rows, LongRoPE's long ones where the target's are (proposals alone)
            positions.extend(self.model.rotary.rows(start, end, seq.rope_long))
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in range(start, end))
            rows.append(len(ids) - 1)
        tables, lens = None, None
        if num_decodes:
            decodes = [items[i] for i in order[:num_decodes]]
            width = max(len(s.block_table) for s, _, _ in decodes)
            tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s, _, _ in decodes])
            lens = torch.tensor([start + 1 for _, _, start in decodes])
        t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.device)  # noqa: E731
        batch = ForwardBatch(
            positions=t(positions),
            slot_mapping=t(slots),
            num_decode_tokens=num_decodes,
            decode_block_tables=None if tables is None else tables.to(self.device),
            decode_context_lens=None if lens is None else lens.to(self.device),
            prefills=chunks,
            logits_indices=t(rows),
        )
        self.backends.attention.prepare(batch, bs)
        # ids the draft's embedding lacks (a target vocabulary with more rows) read its last row: such a
        # proposal is merely wrong, and the target rejects it
        input_ids = t(ids).clamp_(max=self.model.args.vocab_size - 1)
        return input_ids, batch, order
