"""Which adapter a request names: the OpenAI `model` field, or LoRAX's adapter_id (+ adapter_source).

LoRAX's adapter_source may be one of its kinds (hub, s3, local), with the location in adapter_id, or a
source URI, with the adapter's name in adapter_id. Either way the source must pass the allowlist, and
an id that already names another source is a 409: a request never re-points someone else's adapter.
"""

from __future__ import annotations

import re

from loraplane_server.http.errors import ApiError
from loraplane_server.http.security import check_adapter_id, check_source, is_valid_adapter_id
from loraplane_server.http.state import ServerState

_HF_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w.-]+)?$")
_LORAX_KINDS = ("hub", "s3", "local")


def openai_adapter(state: ServerState, model: str) -> str | None:
    """None for the base model (its own name), else the adapter id (400 if it cannot be one)."""
    if model == state.config.model_name:
        return None
    return check_adapter_id(model, "model")


async def lorax_adapter(
    state: ServerState, adapter_id: str | None, adapter_source: str | None, param: str = "parameters.adapter_id"
) -> str | None:
    if not adapter_id or adapter_id == state.config.model_name:
        if adapter_source:
            raise ApiError(422, "adapter_source needs an adapter_id", param="parameters.adapter_source")
        return None
    if adapter_source is None:
        if is_valid_adapter_id(adapter_id):
            return adapter_id
        if ".." not in adapter_id and _HF_REPO.match(adapter_id):
            adapter_source = "hub"  # LoRAX's default: an org/repo on the Hugging Face hub
        else:
            return check_adapter_id(adapter_id, param)
    name, uri = _name_and_uri(adapter_id, adapter_source)
    await register(state, check_adapter_id(name, param), uri, "parameters.adapter_source")
    return name


def _name_and_uri(adapter_id: str, source: str) -> tuple[str, str]:
    if source == "pbase":
        raise ApiError(
            422,
            "adapter_source 'pbase' is not supported; use hub, s3, local or a source URI",
            param="parameters.adapter_source",
            code="unsupported_parameter",
        )
    if source not in _LORAX_KINDS:
        return adapter_id, source  # a URI; adapter_id is the name
    if ".." in adapter_id:
        raise ApiError(
            400, "adapter_id must not contain '..'", param="parameters.adapter_id", code="invalid_adapter_id"
        )
    if source == "hub":
        uri = f"hf://{adapter_id}"
    elif source == "s3":
        uri = adapter_id if adapter_id.startswith("s3://") else f"s3://{adapter_id}"
    else:
        uri = adapter_id
    name = adapter_id.split("://", 1)[-1].strip("/").replace("/", "--").replace("@", "--")
    return re.sub(r"[^A-Za-z0-9._-]", "-", name), uri


async def register(state: ServerState, adapter_id: str, uri: str, param: str) -> None:
    """Register adapter_id -> uri unless it is already registered with that very source."""
    source = check_source(uri, state.config.allowlist, param)
    engine, _ = state.require_engine()

    def _register() -> str | None:
        rec = engine.adapters.lookup(adapter_id)
        if rec is None:
            engine.adapters.register(adapter_id, source.uri)
            return None
        return None if rec.source.uri == source.uri else rec.source.uri

    other = await state.call(_register)
    if other is not None:
        raise ApiError(
            409,
            f"adapter {adapter_id!r} is already registered with another source; use its id alone, or another id",
            param=param,
            code="adapter_conflict",
        )
