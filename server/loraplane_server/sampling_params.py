"""Per-request generation options."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplane_server.errors import InvalidParameterError

GREEDY_BELOW = 1e-5  # a temperature this small is greedy (vLLM's rule): dividing logits by it overflows
MIN_REPETITION_PENALTY = 0.01  # a smaller penalty p overflows the seen tokens' logits (x / p) to inf, then NaN
# float32 rounds a smaller top_p to 0, which drops every token; any top_p this small keeps the top token alone
MIN_TOP_P = 1e-30
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs (and on logprobs for completions)
MAX_LOGIT_BIAS = 100.0  # OpenAI's: a bias is in [-100, 100]
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text, compiled to a grammar (xgrammar) and enforced token by token.

    kind: json_object (any JSON object), json_schema (`spec`: the schema as JSON text), regex (`spec`: the
    pattern the whole output matches), choice (`choices`: the output is exactly one of them) or grammar (`spec`:
    an EBNF grammar with a `root` rule, as xgrammar and vLLM's guided_grammar read it)."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidParameterError(
                f"structured output kind {self.kind!r} must be one of {', '.join(STRUCTURED_KINDS)}", param="structured"
            )
        if self.kind in ("json_schema", "regex", "grammar") and not self.spec:
            raise InvalidParameterError(f"structured output {self.kind} needs its {self.kind}", param="structured")
        if self.kind == "choice" and (not self.choices or any(not c for c in self.choices)):
            raise InvalidParameterError("structured output choice needs non-empty choices", param="structured")


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
    presence_penalty: float = 0.0  # OpenAI's: subtracted from every token generated at least once
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time a token was generated
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_p: float = 0.0  # sampled rows keep the tokens with at least min_p x the top token's probability
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # this many most likely tokens per position, with their logprobs (implies logprobs)
    # the prompt tokens' logprobs (each given the tokens before it), with this many alternatives; None: off
    prompt_logprobs: int | None = None
    # off | ngram (prompt lookup) | draft (the server's draft model) speculative decoding; None: the server's default
    speculative: str | None = None
    # constrain the output (JSON, a schema, a regex, a choice, a grammar); None: free text
    structured: StructuredOutput | None = None

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
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("top_logprobs", 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, f"must be in [0, {MAX_TOP_LOGPROBS}]"),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
                f"must be in [0, {MAX_TOP_LOGPROBS}]",
            ),
        ]
        for name, ok, why in checks:
            if not ok:
                raise InvalidParameterError(f"{name}={getattr(self, name)!r} {why}", param=name)
        if self.speculative not in (None, "off", "ngram", "draft"):
            raise InvalidParameterError(
                f"speculative={self.speculative!r} must be off, ngram or draft", param="speculative"
            )
        for token_id, bias in self.logit_bias.items():
            if not isinstance(token_id, int) or token_id < 0:
                raise InvalidParameterError(f"logit_bias key {token_id!r} must be a token id >= 0", param="logit_bias")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidParameterError(
                    f"logit_bias[{token_id}]={bias!r} must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
                    param="logit_bias",
                )
        if any(not s for s in self.stop):
            raise InvalidParameterError("stop strings must not be empty", param="stop")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def is_unshaped(self) -> bool:
        """No bias or penalty changes the model's logits before the choice (min_p acts on sampling alone)."""
        return (
            self.repetition_penalty == 1.0
            and self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
            and not self.logit_bias
        )

    @property
    def speculates(self) -> bool:
        """Whether speculative decoding may serve this request: not when its output is constrained or its
        logits are shaped by its own output (presence, frequency), nor for top logprobs (the verifier reads
        one distribution per accepted token, not its alternatives)."""
        return (
            self.structured is None
            and self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
            and not self.logit_bias
            and self.min_p == 0.0
            and self.top_logprobs == 0
        )
