"""Build the engine's SamplingParams from an API's fields; an out-of-range value is a 422 naming the field."""

from __future__ import annotations

import random

from loraplane_server.errors import InvalidParameterError
from loraplane_server.http.errors import ApiError, api_error
from loraplane_server.sampling_params import SamplingParams


def make_params(names: dict[str, str], **fields: object) -> SamplingParams:
    """SamplingParams(**fields); `names` maps an engine field to the API's name for error messages."""
    try:
        return SamplingParams(**fields)  # type: ignore[arg-type]
    except InvalidParameterError as exc:
        raise api_error(exc, param=names.get(exc.param, exc.param)) from exc


def unsupported(param: str, what: str) -> ApiError:
    return ApiError(422, f"{param}: {what} is not supported by this server", param=param, code="unsupported_parameter")


def sampling_seed(seed: int | None, is_sampling: bool) -> int | None:
    """A sampled request without a seed gets a random one, reported back so it can be replayed."""
    if seed is None and is_sampling:
        return random.getrandbits(63)
    return seed
