"""The engine's typed errors: what a caller can tell apart without reading a message.

Plain Python, no HTTP: the HTTP layer maps each type to a status code in one place (serving/http/errors.py).
Each subclasses the built-in its callers caught before these types existed (ValueError, RuntimeError).
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of the engine's errors; the message says what to fix. `param` names the offending argument, if any."""

    param: str | None = None


# requests
class InvalidRequestError(EngineError, ValueError):
    """A request (or an admin call) the engine refuses as sent."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def naming(self, name: str) -> str:
        """The message with the parameter called `name` (an API's own name for it)."""
        message = str(self)
        return message if self.param is None else message.replace(self.param, name, 1)


class InvalidParameterError(InvalidRequestError):
    """A decoding option out of range (SamplingParams); `param` is the field's name."""

    param: str

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message, param)


class InvalidPromptError(InvalidRequestError):
    """A prompt the engine cannot serve (no tokenizer for text, more tokens than the KV cache holds)."""


class EmptyPromptError(InvalidPromptError):
    def __init__(self) -> None:
        super().__init__("the prompt is empty")


class PromptTooLongError(InvalidPromptError):
    """No room left in the context to generate a single token."""

    def __init__(self, num_tokens: int, max_model_len: int) -> None:
        super().__init__(
            f"the prompt has {num_tokens} tokens; this model's context is {max_model_len} tokens and at "
            "least one must be left to generate: shorten the prompt"
        )
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len


class InvalidTokenIdError(InvalidPromptError):
    def __init__(self, token_id: int, vocab_size: int) -> None:
        super().__init__(
            f"prompt token id {token_id} is outside the vocabulary: token ids must be in [0, {vocab_size})",
            param="prompt",
        )
        self.token_id = token_id
        self.vocab_size = vocab_size


# adapters
class AdapterError(EngineError, ValueError):
    """A broken, hostile or incompatible adapter; the message says what to fix."""


class UnknownAdapterError(AdapterError):
    def __init__(self, adapter_id: str, hint: str | None = None) -> None:
        super().__init__(f"unknown adapter {adapter_id!r}" + (f": {hint}" if hint else ""))
        self.adapter_id = adapter_id


class AdapterInUseError(EngineError, ValueError):
    """Refused while requests use or await the adapter (unload, re-pointing)."""

    def __init__(self, adapter_id: str, num_users: int) -> None:
        super().__init__(f"adapter {adapter_id!r} is in use by {num_users} requests")
        self.adapter_id = adapter_id
        self.num_users = num_users


class PinLimitError(EngineError):
    """Pinning one more adapter would leave no device slot for the unpinned ones."""

    param = "pinned"


# a request failed part-way: carried by its final RequestOutput, not raised
class RequestFailedError(EngineError):
    """The engine failed this request alone (its values went NaN, its adapter did not load)."""


class AdapterLoadError(RequestFailedError):
    def __init__(self, adapter_id: str, reason: str) -> None:
        super().__init__(f"adapter {adapter_id!r} failed to load: {reason}")
        self.adapter_id = adapter_id
        self.reason = reason


# the engine itself
class EngineShutdownError(EngineError, RuntimeError):
    def __init__(self) -> None:
        super().__init__("the engine is shut down")


class InternalEngineError(EngineError, RuntimeError):
    """The engine failed, not the request (a step raised, or adding the request did); the cause is chained."""
