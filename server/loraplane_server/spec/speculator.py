"""Speculative decoding as the engine's step loop sees it: one object that owns the proposers (prompt lookup,
the draft model), the draft's policy and the counts, and gives the loop four calls:

    propose(running)           before scheduling: prompt lookup's proposals, the draft's placeholders
    fill(scheduled, proposals) after scheduling: the draft's tokens in place of the placeholders it kept
    accept(seq, num_tokens)    a verified run's bookkeeping (k adapts, the draft's progress, the counts)
    drop(proposals)            the proposals a step did not verify

The model runner verifies (executor/verifier.py); the engine takes the accepted tokens through its finish
checks one by one. The decisions (k, the step-token cap, the draft's gate and plan) are policy.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplane_server.config import EngineConfig
from loraplane_server.errors import InvalidRequestError
from loraplane_server.sequence import Sequence, SequenceStatus
from loraplane_server.spec.draft import DraftModel, DraftRun
from loraplane_server.spec.policy import DraftPolicy, SpecState, cap_proposal, spare_tokens


@dataclass
class Proposals:
    """One step's proposals: the sequences given some, and the draft sequences too far behind to propose,
    with the position their catch-up reaches this step."""

    proposing: list[Sequence] = field(default_factory=list)
    catching_up: list[tuple[Sequence, int]] = field(default_factory=list)


class Speculator:
    def __init__(
        self, config: EngineConfig, max_model_len: int, draft: DraftModel | None = None, draft_bytes_ratio: float = 0
    ) -> None:
        """draft: the draft model (--draft-model), loaded beside the model; draft_bytes_ratio: its weights'
        bytes over the model's, the policy's first cost estimate."""
        self.default_method = config.speculative
        self.max_k = config.speculative_k
        self.max_step_tokens = config.speculative_max_step_tokens
        self.max_model_len = max_model_len
        self.draft = draft
        self.draft_max_len = draft.max_positions if draft is not None else max_model_len  # within max_model_len
        self.draft_policy: DraftPolicy | None = None
        if draft is not None:
            self.draft_policy = DraftPolicy(
                config.draft_cost_ratio, draft_bytes_ratio, config.max_num_batched_tokens, self.max_step_tokens
            )
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.proposed_total = 0  # speculative tokens proposed and accepted, every request together
        self.accepted_total = 0

    def describe(self) -> str:
        return f"; {self.draft.describe()}" if self.draft is not None else ""

    # requests
    def method(self, requested: str | None) -> str:
        """The method a request runs (its own, else the server's); refused where it cannot run here."""
        method = requested or self.default_method
        if method == "draft" and self.draft is None:
            raise InvalidRequestError(
                "speculative='draft' needs a server started with a draft model (--draft-model)", param="speculative"
            )
        return method

    def start(self, seq: Sequence, method: str) -> None:
        """A new request's speculation state, where its method speculates. A constrained request (structured
        output) never speculates: the simplest correct choice, as every token it emits goes through its grammar's
        matcher before the next is masked (verifying proposals would need a mask per proposed position and the
        matcher rolled back past rejected ones). Nor do requests with logit_bias, presence or frequency penalties,
        min_p or top logprobs (SamplingParams.speculates): the verifier samples without them."""
        if method in ("ngram", "draft") and seq.params.speculates:
            seq.spec = SpecState(max_k=self.max_k, method=method)

    # a step
    def propose(self, running: list[Sequence]) -> Proposals:
        """Proposals for the decoding sequences that speculate, while the step's tokens stay under
        speculative_max_step_tokens (a larger step is compute-bound): prompt lookup's now; for the draft's,
        k placeholders the scheduler fits to the step before the draft fills them (`fill`), in the steps
        where the draft pays (DraftPolicy)."""
        policy = self.draft_policy
        if policy is not None:
            policy.gated = None  # a step the gate does not decide is none of its measurements
        if not any(s.spec is not None for s in running):
            return Proposals()
        num_tokens = min(sum(s.num_uncomputed_tokens for s in running), self.max_num_batched_tokens)
        spare = spare_tokens(num_tokens, self.max_step_tokens)
        draft_share, catch_up, retrying = 0, 0, False
        if policy is not None:
            num_drafting = sum(
                1 for s in running if s.spec and s.spec.method == "draft" and s.num_uncomputed_tokens == 1
            )
            draft_share, catch_up, retrying = policy.plan(len(running), num_drafting, spare)
        proposing: list[Sequence] = []
        catching_up: list[tuple[Sequence, int]] = []
        for seq in running:
            if spare <= 0:
                break
            if seq.spec is None or seq.num_uncomputed_tokens != 1:
                continue
            max_len = self.max_model_len if seq.spec.method == "ngram" else self.draft_max_len
            if seq.rope_switch_at is not None:  # LongRoPE's short factors: no proposal past the original length
                max_len = min(max_len, seq.rope_switch_at)
            k = min(
                spare,
                cap_proposal(seq.spec.k, seq.num_output_tokens, seq.params.max_new_tokens, len(seq), max_len),
            )
            if seq.spec.method == "draft":
                k = min(k, draft_share)
            if k <= 0:
                continue
            if seq.spec.method == "ngram":
                seq.spec.proposed = seq.spec.index.propose(seq.token_ids, k)
            elif (lag := len(seq) - seq.spec.draft_computed) <= catch_up:
                seq.spec.proposed = [0] * k  # placeholders until the draft runs
                catch_up -= lag
            elif catch_up > 0 and not retrying:  # a long catch-up (a prompt, a preemption) spread over steps
                catching_up.append((seq, seq.spec.draft_computed + catch_up))
                catch_up = 0
            if seq.spec.proposed:
                spare -= len(seq.spec.proposed)
                proposing.append(seq)
        drafting = [s for s in proposing if s.spec is not None and s.spec.method == "draft"]
        if drafting:
            assert self.draft is not None and policy is not None
            prior = policy.acceptance
            estimates = [(s.spec.acceptance(prior), len(s.spec.proposed)) for s in drafting if s.spec]
            k = policy.choose_k(estimates, len(running), self.draft.pass_seconds)
            for seq in drafting:
                assert seq.spec is not None
                del seq.spec.proposed[k:]
            if k == 0:  # nor catch-ups: the draft reads nothing in a step it does not propose in
                proposing = [s for s in proposing if s not in drafting]
                catching_up = []
        return Proposals(proposing, catching_up)

    def fill(self, scheduled: list[tuple[Sequence, int]], proposals: Proposals) -> bool:
        """The draft model's tokens in place of the placeholders the scheduler kept (k each, in one batched
        catch-up pass then k - 1 single-token passes), and the catch-ups of sequences too far behind. Whether
        the draft ran."""
        runs = [
            DraftRun(seq, len(seq), len(seq.spec.proposed))
            for seq, _ in scheduled
            if seq.spec is not None and seq.spec.method == "draft" and seq.spec.proposed
        ]
        runs += [DraftRun(seq, end, 0) for seq, end in proposals.catching_up if seq.status == SequenceStatus.RUNNING]
        if not runs:
            return False
        assert self.draft is not None
        for run, tokens in zip(runs, self.draft.propose(runs), strict=True):
            if run.k:
                assert run.seq.spec is not None
                run.seq.spec.proposed = tokens
        return True

    def record_step(
        self, scheduled: list[tuple[Sequence, int]], drafted: bool, run_seconds: float, tokens: int, step_seconds: float
    ) -> None:
        """A step's times for the draft's cost model, which times decode-only steps (nothing without a draft)."""
        if self.draft_policy is not None and all(s.num_computed_tokens == len(s) - 1 for s, _ in scheduled):
            self.draft_policy.record_step(run_seconds, drafted, tokens, step_seconds)

    def accept(self, seq: Sequence, num_tokens: int) -> None:
        """A verified run of `num_tokens` (the accepted proposals and the model's own token): k adapts, the
        draft's progress and the policy's acceptance follow, the proposals are spent."""
        assert seq.spec is not None
        # the draft's K/V holds after the last token only where its input was the token accepted there
        seq.spec.draft_computed = min(seq.spec.draft_computed, len(seq) + num_tokens - 1)
        seq.spec.adapt(len(seq.spec.proposed), num_tokens - 1)
        if self.draft_policy is not None and seq.spec.method == "draft":
            self.draft_policy.record_run(len(seq.spec.proposed), num_tokens - 1)
        self.proposed_total += len(seq.spec.proposed)
        self.accepted_total += num_tokens - 1
        seq.spec.proposed = []

    @staticmethod
    def drop(proposals: Proposals) -> None:
        """Proposals not verified this step (the sequence was not scheduled) are dropped."""
        for seq in proposals.proposing:
            if seq.spec is not None:
                seq.spec.proposed = []
