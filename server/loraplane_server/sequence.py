"""A request's state: what the scheduler and block manager see, and the engine's per-request rest
(its text, its RNG, its failure). No torch here."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Hashable
from typing import TYPE_CHECKING

from loraplane_server.detokenizer import Detokenizer
from loraplane_server.errors import RequestFailedError
from loraplane_server.sampling_params import SamplingParams
from loraplane_server.spec.policy import SpecState

if TYPE_CHECKING:
    import torch


# a prompt position's logprob: (its token id, the logprob, its rank (1: the most likely), the top-k (id, logprob))
PromptLogprob = tuple[int, float, int, list[tuple[int, float]]]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    STOP = "stop"  # eos token, stop token id or stop string
    ABORT = "abort"
    ERROR = "error"


_ids = itertools.count()


class Sequence:
    """Prompt plus generated tokens, the KV blocks holding them, and progress through them."""

    generator: torch.Generator | None  # its own RNG when seeded (the model runner samples with it)

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        adapter_id: str | None = None,
        rope_original: int | None = None,
    ) -> None:
        """rope_original: the model's LongRoPE original_max_position_embeddings; None for any other rope."""
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)  # shared by every RequestOutput: never changed
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.adapter_id = adapter_id
        # LongRoPE: whether its K/V hold the long factors, which transformers computes a sequence longer than
        # the original length with (executor/layers/rotary.py); a prompt that long has them from its first token
        self.rope_original = rope_original
        self.rope_long = rope_original is not None and self.num_prompt_tokens > rope_original
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.block_table: list[int] = []
        self.num_released_blocks = 0  # leading block_table entries a sliding window no longer reads (not ours)
        self.window_table: list[int] = []  # a hybrid model's sliding layers' blocks (engine/kv_groups.py)
        self.window_released = 0  # its num_released_blocks
        self.lora_slot: int | None = None  # device slot while running with an adapter
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # of those, found in the prefix cache
        self.num_preemptions = 0
        self.logprobs: list[float] = []
        # top_logprobs > 0: each output position's most likely tokens (id, logprob), best first; the model
        # runner leaves this step's in step_top_logprobs for the engine to append
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.step_top_logprobs: list[tuple[int, float]] | None = None
        # prompt_logprobs: prompt positions 1.. as (token id, logprob, rank, top-k (id, logprob)), from the runner
        self.prompt_logprobs: list[PromptLogprob] = []
        self.detok = Detokenizer(self.num_prompt_tokens, params.stop)
        self.generator = None
        self.spec: SpecState | None = None  # speculation (prompt lookup or the draft), when this request uses it
        self.failure: RequestFailedError | None = None  # why it finished with FinishReason.ERROR
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def proposed(self) -> list[int]:
        """This step's speculative proposals (verified after the sequence's last token), if any."""
        return self.spec.proposed if self.spec is not None else []

    @property
    def prefix_key(self) -> Hashable:
        """What seeds its prefix-cache chain (block_manager.chain_hash): its adapter, and under LongRoPE which
        factors its K/V hold, so a block is only ever shared by sequences that computed it alike."""
        return (self.adapter_id, "longrope") if self.rope_long else self.adapter_id

    @property
    def rope_switch_at(self) -> int | None:
        """The length at which its K/V, computed with LongRoPE's short factors, are recomputed with the long
        ones (so no step feeds a token past the original length to the short ones); None where none is due."""
        return None if self.rope_long or self.rope_original is None else self.rope_original + 1

    @property
    def rope_switch_due(self) -> bool:
        switch_at = self.rope_switch_at
        return switch_at is not None and len(self) >= switch_at

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        return self.token_ids[i * block_size : (i + 1) * block_size]

    def append_token(self, token_id: int, logprob: float | None = None) -> None:
        self.token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)

    def reset_for_recompute(self) -> None:
        """Preempted: forget the KV blocks; prompt and output so far are recomputed later."""
        self.block_table = []
        self.num_released_blocks = 0
        self.window_table = []
        self.window_released = 0
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions += 1
        if self.spec is not None:
            self.spec.proposed = []
            self.spec.draft_computed = 0
        self.rope_long = self.rope_long or self.rope_switch_due  # recomputed as transformers computes it now
        self.status = SequenceStatus.WAITING
