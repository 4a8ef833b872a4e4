"""Speculative verification: one step's logits rows -> each sequence's tokens (speculative.py proposes).

A speculative sequence has k + 1 logits rows: row j predicts the token after its last token and its
first j proposals. Greedy: the proposals equal to the row's argmax are accepted up to the first that
is not, then the argmax of the next row is the model's own token, so the output is token for token
what decoding one token a step gives. Sampled: the proposer is deterministic (a point mass at x), so
rejection sampling accepts x with probability p(x) under the row's distribution as the sampler
processes it (repetition penalty, temperature, top-k, top-p); on rejection it draws from p with x
removed, renormalised; after k acceptances it draws the bonus token from the last row. Every draw
comes from the request's own generator. Each output token is distributed as plain sampling's.
Row j's repetition penalty sees the tokens before it (the proposals 0..j-1 included).
"""

from __future__ import annotations

import torch

from loraplane_server.executor.sampler import Sampler, apply_repetition_penalty, sampling_probs
from loraplane_server.sequence import Sequence


def verify(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[list[int]], list[list[float]]]:
    """logits [R, V] (1 row per sequence, 1 + len(proposed) for a speculative one) -> per sequence the
    tokens it emits and their logprobs (NaN where not asked)."""
    counts = [1 + len(s.proposed) for s in seqs]
    starts = [sum(counts[:i]) for i in range(len(seqs))]
    by_rejection = [bool(s.proposed) and not s.params.is_greedy for s in seqs]
    plain = _sample_plain(sampler, logits, seqs, counts, starts, by_rejection)
    tokens: list[list[int]] = []
    logprobs: list[list[float]] = []
    for i, seq in enumerate(seqs):
        if by_rejection[i]:
            toks, lps = _rejection_sample(logits[starts[i] : starts[i] + counts[i]], seq)
        else:
            targets, target_lps = plain[i]
            m = _num_matching(seq.proposed, targets)
            toks, lps = targets[: m + 1], target_lps[: m + 1]
        tokens.append(toks)
        logprobs.append(lps)
    return tokens, logprobs


def _sample_plain(
    sampler: Sampler,
    logits: torch.Tensor,
    seqs: list[Sequence],
    counts: list[int],
    starts: list[int],
    by_rejection: list[bool],
) -> dict[int, tuple[list[int], list[float]]]:
    """The sampler's tokens for every row but those of sampled speculative sequences: the ordinary
    sequences' next tokens and the greedy speculative ones' argmax per row."""
    rows: list[int] = []
    params, gens, seen = [], [], []
    owners: list[int] = []
    for i, seq in enumerate(seqs):
        if by_rejection[i]:
            continue
        for j in range(counts[i]):
            rows.append(starts[i] + j)
            owners.append(i)
            params.append(seq.params)
            gens.append(seq.generator)
            seen.append(_seen(seq, j))
    out: dict[int, tuple[list[int], list[float]]] = {}
    if not rows:
        return out
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    toks, lps = sampler(logits.index_select(0, index), params, gens, seen)
    for i, tok, lp in zip(owners, toks.tolist(), lps.tolist(), strict=True):
        out.setdefault(i, ([], []))
        out[i][0].append(tok)
        out[i][1].append(lp)
    return out


def _seen(seq: Sequence, j: int) -> list[int]:
    """The tokens row j's repetition penalty sees: the sequence's and its first j proposals."""
    if seq.params.repetition_penalty == 1.0:
        return []
    return seq.token_ids + seq.proposed[:j]


def _num_matching(proposed: list[int], targets: list[int]) -> int:
    m = 0
    while m < len(proposed) and proposed[m] == targets[m]:
        m += 1
    return m


def _rejection_sample(logits: torch.Tensor, seq: Sequence) -> tuple[list[int], list[float]]:
    """One sampled speculative sequence: logits [k + 1, V] -> its accepted proposals and one drawn token."""
    proposed, gen, params = seq.proposed, seq.generator, seq.params
    rows = len(proposed) + 1
    penalised = apply_repetition_penalty(logits.float(), [params] * rows, [_seen(seq, j) for j in range(rows)])
    probs = sampling_probs(penalised, [params] * rows)  # [k + 1, V]
    picked = probs[torch.arange(len(proposed), device=probs.device), torch.tensor(proposed, device=probs.device)]
    coins = torch.rand(len(proposed), generator=gen, device=probs.device).tolist()
    out: list[int] = []
    for j, (x, p_x, u) in enumerate(zip(proposed, picked.tolist(), coins, strict=True)):
        if u < p_x:
            out.append(x)
            continue
        residual = probs[j].clone()
        residual[x] = 0.0
        out.append(_draw(residual, gen))
        break
    else:
        out.append(_draw(probs[-1], gen))
    if not params.logprobs:
        return out, [float("nan")] * len(out)
    chosen = torch.tensor(out, device=probs.device)[:, None]
    return out, penalised[: len(out)].log_softmax(dim=-1).gather(1, chosen).squeeze(1).tolist()


def _draw(weights: torch.Tensor, gen: torch.Generator | None) -> int:
    """A token drawn with probability proportional to weights [V] (the exponential race the sampler runs)."""
    noise = torch.empty_like(weights).exponential_(generator=gen)
    return int((weights / noise).argmax())
