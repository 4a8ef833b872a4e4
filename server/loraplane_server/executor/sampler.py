"""Turns one step's logits into next tokens: logit bias, penalties, greedy, temperature, min-p, top-k, top-p.

Order per row (vLLM's): logit_bias added -> repetition penalty (HF's, over prompt and output) -> presence
and frequency penalties (OpenAI's, over the output) -> greedy rows take the argmax -> sampled rows divide by
the temperature, drop the tokens under min_p x the top token's probability, keep the top-k, keep the top-p
nucleus, then sample with the exponential race argmax(p / q), q ~ Exp(1). The chosen token's logprob and a
row's top logprobs are read from the logits after the bias and penalties (and a grammar's mask), before the
temperature: the model's distribution as this request shaped it. A row with a generator draws its q from that
generator alone, so a seeded request picks the same tokens whatever batch it shares a step with. A constrained
row arrives with the tokens its grammar forbids at -inf (structured.py masks it first); every step above keeps
them there.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from loraplane_server.kernels import cpu_kernels
from loraplane_server.sampling_params import SamplingParams


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A generator seeded for one request, or None when the request has no seed."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


# repetition penalty
def apply_repetition_penalty(
    logits: torch.Tensor, params: list[SamplingParams], seen_token_ids: list[list[int]]
) -> torch.Tensor:
    """Penalise seen tokens as HF's RepetitionPenaltyLogitsProcessor does; returns a new tensor."""
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0 and seen_token_ids[i]]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[-1]
    max_len = max(len(seen_token_ids[i]) for i in rows)
    # pad (and clamp ids past the vocab) to an extra column that is dropped afterwards
    padded = [seen_token_ids[i] + [vocab] * (max_len - len(seen_token_ids[i])) for i in rows]
    ids = torch.tensor(padded, dtype=torch.long, device=device).clamp(max=vocab)  # [R, L]
    penalty = torch.tensor([params[i].repetition_penalty for i in rows], device=device)[:, None]  # [R, 1]
    row_idx = torch.tensor(rows, dtype=torch.long, device=device)
    sub = torch.nn.functional.pad(logits[row_idx], (0, 1))  # [R, V + 1]
    score = sub.gather(1, ids)  # [R, L]
    score = torch.where(score < 0, score * penalty, score / penalty)
    logits = logits.clone()
    logits[row_idx] = sub.scatter(1, ids, score)[:, :vocab]
    return logits


# logit bias, presence and frequency penalties
def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's logit_bias added to its tokens' logits (OpenAI's: -100 bans a token, 100 all but forces it)."""
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        bias = params[i].logit_bias
        ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
        logits[i].index_add_(0, ids, torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device))
    return logits


def apply_presence_frequency(
    logits: torch.Tensor, params: list[SamplingParams], output_token_ids: list[list[int]]
) -> torch.Tensor:
    """OpenAI's penalties over the tokens generated so far: logit -= frequency x count + presence x (count > 0)."""
    rows = [
        i
        for i, p in enumerate(params)
        if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and output_token_ids[i]
    ]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[-1]
    counts = torch.zeros(len(rows), vocab + 1, dtype=logits.dtype, device=device)  # the extra column: ids past V
    for r, i in enumerate(rows):
        ids = torch.tensor(output_token_ids[i], dtype=torch.long, device=device).clamp(max=vocab)
        counts[r].index_add_(0, ids, torch.ones(len(ids), dtype=logits.dtype, device=device))
    counts = counts[:, :vocab]
    frequency = torch.tensor([params[i].frequency_penalty for i in rows], dtype=logits.dtype, device=device)
    presence = torch.tensor([params[i].presence_penalty for i in rows], dtype=logits.dtype, device=device)
    penalty = frequency[:, None] * counts + presence[:, None] * (counts > 0).to(logits.dtype)
    row_idx = torch.tensor(rows, dtype=torch.long, device=device)
    logits = logits.clone()
    logits[row_idx] -= penalty
    return logits


# min-p / top-k / top-p
def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set logits whose probability is under min_p [B] x their row's top probability to -inf (0 = off)."""
    probs = logits.softmax(dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < floor, float("-inf"))


# top-k / top-p
def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p nucleus to -inf. top_k [B] (0 = off), top_p [B]."""
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True, stable=True)  # [B, V]
    rank = torch.arange(vocab, device=logits.device)[None, :]  # [1, V]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)[:, None]  # [B, 1]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token; 0 for the top token
    drop = (before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


# sample
def draw_exponential(vocab_size: int, generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """Exp(1) noise [B, V]: seeded rows from their own generator, the rest from one global draw."""
    noise = torch.empty(len(generators), vocab_size, device=device)
    unseeded = [i for i, gen in enumerate(generators) if gen is None]
    if unseeded:
        idx = torch.tensor(unseeded, dtype=torch.long, device=device)
        noise[idx] = torch.empty(len(unseeded), vocab_size, device=device).exponential_()
    for i, gen in enumerate(generators):
        if gen is not None:
            noise[i] = torch.empty(vocab_size, device=device).exponential_(generator=gen)
    return noise


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each sampled row draws from [B, V]: logits [B, V] after temperature, top-k and top-p."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    logits = logits / temperature[:, None]
    if any(p.min_p > 0.0 for p in params):
        logits = apply_min_p(logits, torch.tensor([p.min_p for p in params], device=device))
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        logits = apply_top_k_top_p(logits, top_k, top_p)
    return logits.softmax(dim=-1)


def sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Sampled token ids [B] from logits [B, V] after temperature, top-k and top-p."""
    probs = sampling_probs(logits, params)  # [B, V]
    noise = draw_exponential(probs.shape[-1], generators, logits.device)
    return (probs / noise).argmax(dim=-1)


class Sampled(NamedTuple):
    """One step's choice per row: token ids [B] int64, their logprobs [B] float32 (NaN where not asked), and
    the rows' top logprobs when some row asked (ids and logprobs [B, K], K the most any row asked; None else)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    top: tuple[torch.Tensor, torch.Tensor] | None = None


class Sampler:
    """Picks one token per row of logits and returns it with its log-probability."""

    def __init__(self, kernels: bool = False) -> None:
        """kernels: bf16 logits of an all-greedy step without logprobs go to the CPU argmax kernel
        (no fp32 copy of the [B, V] logits)."""
        self.kernels = kernels

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        seen_token_ids: list[list[int]],
        output_token_ids: list[list[int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, V] -> (token ids [B] int64, logprobs [B] float32 of the chosen tokens, NaN where not asked)."""
        sampled = self.sample(logits, params, generators, seen_token_ids, output_token_ids)
        return sampled.token_ids, sampled.logprobs

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        seen_token_ids: list[list[int]],
        output_token_ids: list[list[int]] | None = None,
    ) -> Sampled:
        """As __call__, with the top logprobs of the rows that ask for them. seen_token_ids: each row's prompt
        and output (the repetition penalty's); output_token_ids: its output alone (presence and frequency)."""
        plain = all(p.is_unshaped for p in params)
        greedy = plain and all(p.is_greedy for p in params)
        wants = any(p.logprobs or p.top_logprobs for p in params)
        if greedy and self.kernels and logits.dtype == torch.bfloat16 and not wants:
            nan = torch.full((len(params),), float("nan"), device=logits.device)
            return Sampled(cpu_kernels.argmax_rows(logits), nan)
        logits = logits.float()
        if not plain:
            logits = apply_logit_bias(logits, params)
            logits = apply_repetition_penalty(logits, params, seen_token_ids)
            outputs = output_token_ids if output_token_ids is not None else [[] for _ in params]
            logits = apply_presence_frequency(logits, params, outputs)
        token_ids = logits.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        if sampled:
            idx = torch.tensor(sampled, dtype=torch.long, device=logits.device)
            sub_params = [params[i] for i in sampled]
            sub_gens = [generators[i] for i in sampled]
            token_ids[idx] = sample_rows(logits[idx], sub_params, sub_gens)
        return Sampled(token_ids, *self._logprobs(logits, token_ids, params))

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Log-probability of each chosen token, for the rows that asked for logprobs (NaN for the rest), and
        the top-K of the rows that asked for top logprobs (a log_softmax over the vocabulary is ~3% of a 64-row
        decode step, so it is skipped when unwanted)."""
        rows = [i for i, p in enumerate(params) if p.logprobs or p.top_logprobs]
        k = max((p.top_logprobs for p in params), default=0)
        chosen = torch.full((len(params),), float("nan"), device=logits.device)
        if not rows:
            return chosen, None
        # the asking rows alone: a mixed step (LoRAX asks for logprobs, OpenAI's default does not) pays for them only
        idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
        asking = logits if len(rows) == len(params) else logits.index_select(0, idx)
        logp = asking.log_softmax(dim=-1)  # [R, V]
        chosen[idx] = logp.gather(1, token_ids[idx, None]).squeeze(1)
        if k == 0:
            return chosen, None
        sub_lps, sub_ids = logp.topk(k, dim=-1)  # [R, K], best first
        top_ids = torch.zeros(len(params), k, dtype=torch.long, device=logits.device)
        top_lps = torch.full((len(params), k), float("-inf"), device=logits.device)
        top_ids[idx], top_lps[idx] = sub_ids, sub_lps
        return chosen, (top_ids, top_lps)
