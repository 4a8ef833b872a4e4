"""Which adapter a request names: the OpenAI `model` field, or LoRAX's adapter_id (+ adapter_source).

LoRAX's adapter_source may be one of its kinds (hub, s3, local), with the location in adapter_id, or a
source URI, with the adapter's name in adapter_id. Either way the source must pass the allowlist, and
an id that already names another source is a 409: a request never re-points someone else's adapter.

With an admin token set, only admins (or anyone under --allow-anonymous-adapter-load) may register a
new adapter this way; others may name an adapter that is already registered, with or without its
source. Errors for callers who are not admins never show sources, the allowlist or server paths.
"""

from __future__ import annotations

import re

from fastapi import Request

from loraplane_server.http.errors import ApiError
from loraplane_server.http.security import (
    can_load_adapters,
    check_adapter_id,
    check_source,
    is_admin,
    is_valid_adapter_id,
    unauthorized,
)
from loraplane_server.http.state import ServerState
from loraplane_server.sources import AdapterSourceError, parse_source

_HF_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w.-]+)?$")
_LORAX_KINDS = ("hub", "s3", "local")


def openai_adapter(state: ServerState, model: str) -> str | None:
    """None for the base model (its own name), else the adapter id (400 if it cannot be one)."""
    if model == state.config.model_name:
        return None
    return check_adapter_id(model, "model")


async def lorax_adapter(
    state: ServerState,
    request: Request,
    adapter_id: str | None,
    adapter_source: str | None,
    param: str = "parameters.adapter_id",
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
    name = check_adapter_id(name, param)
    if can_load_adapters(request):
        await register(state, name, uri, "parameters.adapter_source", is_admin(request))
    else:
        await require_registered(state, name, uri)
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


async def require_registered(state: ServerState, adapter_id: str, uri: str) -> None:
    """For callers who may not register: the id must already name this very source, else 401."""
    try:
        wanted = parse_source(uri).uri
    except AdapterSourceError:
        wanted = None  # cannot name a registered source
    engine, _ = state.require_engine()

    def _current() -> str | None:
        rec = engine.adapters.lookup(adapter_id)
        return None if rec is None else rec.source.uri

    if wanted is None or await state.call(_current) != wanted:
        raise unauthorized(
            f"adapter {adapter_id!r} is not registered on this server with that source, and registering or "
            "loading a new adapter needs the admin token (Authorization: Bearer <token>); ask an admin to "
            "register it (POST /v1/adapters), then name it by its id alone",
            param="parameters.adapter_source",
        )


async def register(state: ServerState, adapter_id: str, uri: str, param: str, admin: bool = True) -> None:
    """Register adapter_id -> uri unless it is already registered with that very source."""
    try:
        source = check_source(uri, state.config.allowlist, param)
    except ApiError as exc:
        if admin or exc.code != "source_not_allowed":
            raise
        raise ApiError(
            403,
            "this adapter source is not allowed on this server; an admin can see the allowed sources "
            "(--adapter-source-allow)",
            param=param,
            code="source_not_allowed",
        ) from None
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
