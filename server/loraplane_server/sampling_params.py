"""Per-request generation options."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplane_server.errors import InvalidParameterError

GREEDY_BELOW = 1e-5  # a temperature this small is greedy (vLLM's rule): dividing logits by it overflows
MIN_REPETITION_PENALTY = 0.01  # a smaller penalty p overflows the seen tokens' logits (x / p) to inf, then NaN
# float32 rounds a smaller top_p to 0, which drops every token; any top_p this small keeps the top token alone
MIN_TOP_P = 1e-30


@dataclass
class SamplingParams:
    """How one request is decoded. Validated once at construction (InvalidParameterError, a ValueError).

    temperature 0 (or below GREEDY_BELOW) means greedy. seed makes sampling reproducible for this request alone,
    whatever batch it shares a step with.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    # off | ngram (prompt lookup) | draft (the server's draft model) speculative decoding; None: the server's default
    speculative: str | None = None

    def __post_init__(self) -> None:
        self._check()
        if 0.0 < self.top_p < MIN_TOP_P:
            self.top_p = MIN_TOP_P

    def _check(self) -> None:
        checks = [
            ("max_new_tokens", self.max_new_tokens >= 1, "must be >= 1"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 disables it)"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            (
                "repetition_penalty",
                MIN_REPETITION_PENALTY <= self.repetition_penalty <= 10.0,
                f"must be in [{MIN_REPETITION_PENALTY:g}, 10]",
            ),
        ]
        for name, ok, why in checks:
            if not ok:
                raise InvalidParameterError(f"{name}={getattr(self, name)!r} {why}", param=name)
        if self.speculative not in (None, "off", "ngram", "draft"):
            raise InvalidParameterError(
                f"speculative={self.speculative!r} must be off, ngram or draft", param="speculative"
            )
        if any(not s for s in self.stop):
            raise InvalidParameterError("stop strings must not be empty", param="stop")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
