"""Speculative decoding: prompt lookup (n-gram) proposals, each sequence's state, and how many proposals a
step may verify. No torch. The other proposer, a draft model, is draft.py.

A sequence in decode proposes up to k next tokens by matching its last n tokens (n from `MAX_NGRAM` down
to 1) against its prompt and output so far, and copying what followed the most recent match. The model
then checks the k proposals in one forward pass (k + 1 query rows for that sequence, a chunk over its own
cache) and keeps the longest correct run plus one token of its own (model_runner.py verifies, engine.py
accepts the tokens one by one through the usual finish checks).

k adapts per sequence: one more after a fully accepted run, one less after a rejection, within
1..max_k. Speculation pays while a step is bound by reading the weights: `plan` hands out proposals
only while the step's tokens stay under `max_step_tokens` (EngineConfig.speculative_max_step_tokens),
so a large batch switches it off by itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_NGRAM = 3  # the longest suffix matched
METHODS = ("off", "ngram", "draft")


@dataclass
class NgramIndex:
    """The most recent end position of every 1..MAX_NGRAM-gram of a sequence that has a token after it,
    extended incrementally as tokens are appended (a lookup is O(1), whatever the context length)."""

    last_end: dict[tuple[int, ...], int] = field(default_factory=dict)
    num_indexed: int = 0  # positions p < num_indexed have their n-grams ending at p in last_end

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier match of the longest matching suffix."""
        self._extend(tokens)
        size = len(tokens)
        for n in range(min(MAX_NGRAM, size - 1), 0, -1):
            end = self.last_end.get(tuple(tokens[size - n :]))
            if end is not None:
                return _copy_after(tokens, end, k)
        return []

    def _extend(self, tokens: list[int]) -> None:
        """Index the n-grams ending at every position but the last (the last has nothing after it yet)."""
        for p in range(self.num_indexed, len(tokens) - 1):
            for n in range(1, min(MAX_NGRAM, p + 1) + 1):
                self.last_end[tuple(tokens[p - n + 1 : p + 1])] = p
        self.num_indexed = max(self.num_indexed, len(tokens) - 1)


def _copy_after(tokens: list[int], end: int, k: int) -> list[int]:
    """The k tokens after position `end`; a copy running into the end of `tokens` goes on over itself
    (a period shorter than k repeats)."""
    out: list[int] = []
    size = len(tokens)
    for i in range(end + 1, end + 1 + k):
        out.append(tokens[i] if i < size else out[i - size])
    return out


@dataclass
class SpecState:
    """One sequence's speculation: its method, its n-gram index or the draft's progress, its current k, and
    the proposals of this step."""

    max_k: int
    method: str = "ngram"  # ngram | draft
    k: int = 0
    draft_computed: int = 0  # draft: leading positions whose K/V the draft model holds (draft.py)
    index: NgramIndex = field(default_factory=NgramIndex)
    proposed: list[int] = field(default_factory=list)  # this step's proposals, verified in this step's pass
    num_proposed: int = 0  # over the request's life, for its outputs and the metrics
    num_accepted: int = 0
    num_steps: int = 0  # passes that verified proposals

    def __post_init__(self) -> None:
        self.k = self.k or self.max_k

    def acceptance(self, prior: float, weight: int = 4) -> float:
        """The chance a proposal is accepted, from this sequence's own history (a new one starts at `prior`,
        worth `weight` proposals: the engine's recent acceptance for the method)."""
        return (self.num_accepted + prior * weight) / (self.num_proposed + weight)

    def adapt(self, num_proposed: int, num_accepted: int) -> None:
        """Count a verified run; grow k after a fully accepted one, shrink it after a rejection."""
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted
        self.num_steps += 1
        if num_accepted == num_proposed:
            self.k = min(self.k + 1, self.max_k)
        else:
            self.k = max(self.k - 1, 1)


def spare_tokens(num_step_tokens: int, max_step_tokens: int) -> int:
    """How many proposals a step whose ordinary tokens number num_step_tokens may add."""
    return max(0, max_step_tokens - num_step_tokens)


def cap_proposal(k: int, num_output: int, max_new_tokens: int, length: int, max_model_len: int) -> int:
    """k within what the request may still emit: k accepted tokens plus the model's own one must fit in
    max_new_tokens and in the context."""
    return max(0, min(k, max_new_tokens - num_output - 1, max_model_len - length - 1))


def expected_accepted(acceptance: float, k: int) -> float:
    """Proposals expected to be accepted of k, each accepted with chance `acceptance` after the ones before."""
    return sum(acceptance**j for j in range(1, k + 1))


def draft_k(proposals: list[tuple[float, int]], num_rows: int, cost_ratio: float) -> int:
    """How many tokens the draft should propose this step (0: none), for proposals (acceptance, k) of the
    sequences that would draft among num_rows sequences in the step. Every sequence waits for the draft's
    passes, each cost_ratio x a plain step: a plain step gives num_rows tokens; drafting k gives num_rows +
    the expected accepted tokens in (1 + k x cost_ratio) steps' time (verifying k + 1 rows costs what one
    row does while the step is bound by reading the weights, below the step-token cap). The k with the
    best rate, if it beats plain decoding."""
    best, best_rate = 0, 1.0
    for k in range(1, max((k for _, k in proposals), default=0) + 1):
        tokens = num_rows + sum(expected_accepted(a, min(k, ki)) for a, ki in proposals)
        rate = tokens / (num_rows * (1 + k * cost_ratio))
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def moving_average(old: float | None, new: float, weight: float = 0.1) -> float:
    """An exponential moving average (the first value as it is)."""
    return new if old is None else old + weight * (new - old)


@dataclass
class GateSize:
    """The gate's state for one step size."""

    rates: list[float | None] = field(default_factory=lambda: [None, None])  # [without, with] the draft, tokens/s
    decisions: int = 0
    faster: bool = False  # whether the draft is the faster side
    retry_until: int = 0  # decisions before this one keep retrying the slower side
    retry_at: int = 0  # the decision that retries the slower side next
    interval: int = 0  # decisions between retries, doubled each time


@dataclass
class DraftGate:
    """Whether the draft runs in a step, learnt per step size (its sequences, in powers of two): the tokens per
    second of decode steps with the draft and without (the draft's passes, its catch-ups, verification and all),
    moving averages; the faster is taken. The slower is retried now and then so that a change shows: after
    `explore` decisions, then twice as long each time it loses again (up to `max_explore`), since a retried
    draft pays to catch up with every sequence. Where a step is bound by compute, or sequences that do not
    draft would wait on the draft's passes, the draft loses and stays off."""

    explore: int = 16
    max_explore: int = 1024
    burst: int = 8  # decisions a retry of the draft lasts: its first step pays the catch-up, the rest show its rate
    burst_without: int = 2  # a retry without it (nothing to catch up: a step or two shows the plain rate)
    sizes: dict[int, GateSize] = field(default_factory=dict)  # by bucket

    @staticmethod
    def bucket(num_seqs: int) -> int:
        return num_seqs.bit_length()

    def size(self, num_seqs: int) -> GateSize:
        return self.sizes.setdefault(self.bucket(num_seqs), GateSize())

    def allow(self, num_seqs: int) -> bool:
        g = self.size(num_seqs)
        off, on = g.rates
        g.decisions += 1
        n = g.decisions
        if n < g.retry_until:
            return not g.faster
        if on is None or off is None:  # each side for a burst first, the draft's first
            g.faster = on is not None
            burst = self.burst if on is None else self.burst_without
            g.retry_until, g.interval, g.retry_at = n + burst, self.explore, n + burst + self.explore
            return on is None
        faster = on > off
        if g.faster != faster:  # a new winner: retry the other side soon
            g.faster, g.interval, g.retry_at = faster, self.explore, n + self.explore
        if n < g.retry_at:
            return faster
        g.interval = min(2 * g.interval, self.max_explore)
        burst = self.burst_without if faster else self.burst
        g.retry_until, g.retry_at = n + burst, n + burst + g.interval
        return not faster

    def retrying(self, num_seqs: int) -> bool:
        """Whether the last decision for this size retried the draft (its first try is not a retry)."""
        g = self.size(num_seqs)
        return g.rates[1] is not None and g.decisions < g.retry_until and not g.faster

    def record(self, num_seqs: int, drafted: bool, tokens: int, seconds: float) -> None:
        rates = self.size(num_seqs).rates
        rates[drafted] = moving_average(rates[drafted], tokens / max(seconds, 1e-9), weight=0.2)


@dataclass
class DraftPolicy:
    """When the draft proposes and how far, from what the engine measures: each step's plan (the gate's
    decision, the spare tokens shared among the drafting sequences, the catch-up allowed), the k that pays
    (draft_k, with the cost measured or fixed), and the measurements (decode steps' time, the draft pass's,
    verified runs' acceptance)."""

    fixed_cost: float | None  # EngineConfig.draft_cost_ratio: None measures
    bytes_ratio: float  # the draft's weight bytes over the model's: the cost until both are measured
    max_batched_tokens: int
    max_step_tokens: int
    gate: DraftGate = field(default_factory=DraftGate)
    acceptance: float = 0.9  # recent verified runs' acceptance, moving average: a new sequence's estimate
    decode_seconds: float | None = None  # a decode-only pass of the model, moving average
    skipped: int = 0  # steps the draft did not run in for not paying (tests and the bench read it)
    # this step's sequences when the gate decided (its measurement is recorded); the engine clears it each step
    gated: int | None = None

    def plan(self, num_running: int, num_drafting: int, spare: int) -> tuple[int, int, bool]:
        """This step: the most proposals a drafting sequence may get (0: the draft does not run; its passes
        cost the same however many sequences use them, so the spare tokens are shared evenly), the tokens the
        draft may catch up on first, and whether the gate is retrying the draft (a retry catches up an eighth
        of a step's tokens at most, on the sequences that fit: it is not worth reading every new prompt)."""
        if not num_drafting or spare <= 0:
            return 0, 0, False
        catch_up, retrying = self.max_batched_tokens, False
        if self.fixed_cost is None:
            self.gated = num_running
            if not self.gate.allow(num_running):
                self.skipped += 1
                return 0, 0, False
            retrying = self.gate.retrying(num_running)
            if retrying:
                catch_up = max(self.max_step_tokens, catch_up // 8)
        return max(1, spare // num_drafting), catch_up, retrying

    def choose_k(self, proposals: list[tuple[float, int]], num_running: int, pass_seconds: float | None) -> int:
        """draft_k over the drafting sequences' (acceptance, k); 0 counts as a skipped step."""
        k = draft_k(proposals, num_running, self.cost(pass_seconds))
        self.skipped += k == 0
        return k

    def cost(self, pass_seconds: float | None) -> float:
        """A draft pass's time over a decode step's: fixed, measured once both have run, else the bytes' ratio."""
        if self.fixed_cost is not None:
            return self.fixed_cost
        if pass_seconds is not None and self.decode_seconds is not None:
            return pass_seconds / self.decode_seconds
        return self.bytes_ratio

    def record_step(self, decode_seconds: float, drafted: bool, tokens: int, step_seconds: float) -> None:
        """A decode-only step: the model's pass time, and for the gate the step's tokens over its whole time."""
        self.decode_seconds = moving_average(self.decode_seconds, decode_seconds)
        if self.gated is not None:  # the draft's catch-ups count: what switching it on costs
            self.gate.record(self.gated, drafted, tokens, step_seconds)

    def record_run(self, proposed: int, accepted: int) -> None:
        self.acceptance = moving_average(self.acceptance, accepted / proposed, weight=0.05)
