"""What the engine reports about a request after a step: the deltas, and everything at the end."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplane_server.errors import RequestFailedError


@dataclass
class RequestOutput:
    """A request's news from one step. Every output carries the deltas: the token sampled this step
    (delta_token_ids, none for an output without one), its logprob when asked for, and the new text
    that is safe to show (delta_text: a cut character or a possible stop string's start is held back
    until it settles). The deltas add up to the final output's text, token_ids and logprobs, which
    only the final (finished) output fills: per step the engine does O(new tokens) of work.
    prompt_token_ids is one list shared by every output of the request: read it, do not change it."""

    request_id: str
    prompt_token_ids: list[int]
    delta_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: str | None = None
    delta_logprobs: list[float] = field(default_factory=list)
    # top_logprobs > 0: per delta token its most likely tokens (id, logprob), best first
    delta_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # final output only
    text: str = ""  # final output only
    logprobs: list[float] = field(default_factory=list)  # final output only
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # final output only
    # prompt_logprobs: positions 1.. (token id, logprob, rank, top-k); on the first output with a token and the final
    prompt_logprobs: list[tuple[int, float, int, list[tuple[int, float]]]] | None = None
    num_cached_tokens: int = 0
    adapter_id: str | None = None
    error: str | None = None  # why finish_reason is "error": str(failure)
    failure: RequestFailedError | None = None
    arrival_time: float = 0.0  # time.monotonic() at add_request
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # speculative decoding so far: tokens proposed, of those accepted, and the passes that verified them
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0
    num_spec_steps: int = 0
