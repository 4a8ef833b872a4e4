"""Adapter admin, and who may do what: the admin token, adapter id validation and the adapter-source allowlist.

Routes: /v1/adapters and /v1/adapters/{id}/tier (ours), /v1/load_lora_adapter and /v1/unload_lora_adapter
(vLLM's), /v1/prewarm/complete (the operator opens the prewarm gate), and a debug view of the engine. Every route
here needs the admin token when one is set: the rows
carry adapter sources (bucket paths, URLs) that are not for API clients, who see adapter ids in /v1/models.
Each admin operation runs on the engine thread: register, prewarm, set an exact tier, wait, unload, describe.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import time
from typing import Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

from loraplane_server.errors import AdapterInUseError, EngineError, UnknownAdapterError
from loraplane_server.serving.http.errors import ApiError, api_error
from loraplane_server.serving.http.state import Phase, ServerState, get_state
from loraplane_server.store.sources import AdapterSource, AdapterSourceError, is_allowed, parse_source

# security
# a plain name: it can never name a path outside a directory
ADAPTER_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_ADAPTER_ID = re.compile(ADAPTER_ID_PATTERN)


def is_valid_adapter_id(adapter_id: str) -> bool:
    return bool(_ADAPTER_ID.fullmatch(adapter_id)) and ".." not in adapter_id


def check_adapter_id(adapter_id: str, param: str) -> str:
    """The id itself, or a 400 that says what an id may hold."""
    if not is_valid_adapter_id(adapter_id):
        raise ApiError(
            400,
            f"invalid adapter id {adapter_id[:200]!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, without '..'",
            param=param,
            code="invalid_adapter_id",
        )
    return adapter_id


def check_source(uri: str, allow: list[str], param: str) -> AdapterSource:
    """Parse an adapter source (400 if malformed) and check it against the allowlist (403)."""
    try:
        source = parse_source(uri)
    except AdapterSourceError as exc:
        raise ApiError(400, str(exc), param=param, code="invalid_adapter_source") from exc
    if not is_allowed(source, allow):
        raise ApiError(
            403,
            f"adapter source {source.uri!r} is not allowed on this server (allowed: "
            f"{', '.join(allow)}; see --adapter-source-allow)",
            param=param,
            code="source_not_allowed",
        )
    if source.kind == "local" and source.path is not None and not source.path.is_dir():
        # checked after the allowlist, so nobody learns what exists outside it; a source that cannot load
        # is refused now, not turned into a failed load that a caller (or the operator) must poll for
        raise ApiError(
            400,
            f"adapter directory {source.uri} does not exist on this server",
            param=param,
            code="adapter_source_missing",
        )
    return source


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def is_admin(request: Request) -> bool:
    """Whether the caller may use the admin routes: no admin token is set, or it sent the right one."""
    expected = request.app.state.server.config.admin_token
    if expected is None:
        return True
    given = bearer_token(request)
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def can_load_adapters(request: Request) -> bool:
    """Whether the caller may register a new adapter from a generation route (LoRAX adapter_source, an
    org/repo adapter_id): an admin, or anyone under --allow-anonymous-adapter-load."""
    return is_admin(request) or request.app.state.server.config.allow_anonymous_adapter_load


def unauthorized(message: str, param: str | None = None) -> ApiError:
    return ApiError(401, message, param=param, code="unauthorized", headers={"WWW-Authenticate": "Bearer"})


def require_admin(request: Request) -> None:
    """FastAPI dependency: a valid `Authorization: Bearer <token>` when the server has an admin token."""
    if not is_admin(request):
        raise unauthorized("this route needs the admin token: Authorization: Bearer <token>")


# bodies: ours (/v1/adapters) and vLLM's (/v1/load_lora_adapter, /v1/unload_lora_adapter)
class AdapterCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=ADAPTER_ID_PATTERN, description="a plain name: letters, digits, '.', '_', '-'")
    source: str | None = Field(
        default=None,
        min_length=1,
        max_length=2048,
        description="local path, file://, hf://org/repo[@rev], s3://bucket/prefix or an "
        "http(s) archive; omit to act on an adapter already known",
    )
    tier: Literal["device", "host", "disk", "none"] = Field(default="host", description="prewarm up to this tier")
    pinned: bool | None = Field(default=None, description="keep it resident (never evicted); omit to leave as is")
    wait: bool = Field(default=False, description="answer once the adapter reached the tier (or failed)")
    timeout_s: float = Field(default=60.0, gt=0.0, le=600.0, description="how long wait may take")


class AdapterTierSet(BaseModel):
    """POST /v1/adapters/{id}/tier: the exact tier (checked by the route, so that a bad one is a 400)."""

    model_config = ConfigDict(extra="forbid")

    tier: str | None = Field(default=None, max_length=64, description="device, host or disk: exactly this tier")


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # as every body here: an unknown field is a 400 naming it

    lora_name: str = Field(min_length=1, max_length=1024)
    lora_path: str = Field(min_length=1, max_length=2048)
    load_inplace: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=1024)
    lora_int_id: int | None = None


# operations
_TIER_RANK = {"device": 0, "host": 1, "disk": 2, "source": 3}
EXACT_TIERS = ("device", "host", "disk")  # what POST /v1/adapters/{id}/tier accepts


async def rows(state: ServerState) -> list[dict]:
    engine, _ = state.require_engine()
    return await state.call(engine.adapters.residency)


async def row(state: ServerState, adapter_id: str) -> dict:
    found = [r for r in await rows(state) if r["id"] == adapter_id]
    if not found:
        raise ApiError(404, f"unknown adapter {adapter_id!r}", code="adapter_not_found")
    return found[0]


async def register(state: ServerState, adapter_id: str, uri: str, param: str) -> bool:
    """Point adapter_id at a source (re-pointing an idle adapter unloads it first); True if anything changed."""
    source = check_source(uri, state.config.allowlist, param)
    engine, _ = state.require_engine()

    def _register() -> bool:
        return engine.adapters.replace(adapter_id, source.uri)  # AdapterInUseError while in use

    try:
        return await state.call(_register)
    except AdapterInUseError as exc:
        raise api_error(exc, param=param, prefix=f"cannot re-point adapter {adapter_id!r}") from exc


async def prewarm(state: ServerState, adapter_id: str, tier: str, pinned: bool | None) -> None:
    engine, _ = state.require_engine()

    def _prewarm() -> None:
        if engine.adapters.source_of(adapter_id) is None:
            raise UnknownAdapterError(adapter_id, "give a source to register it")
        engine.adapters.prewarm(adapter_id, tier, pinned)

    try:
        await state.call(_prewarm)
    except EngineError as exc:
        raise api_error(exc) from exc


async def set_tier(state: ServerState, adapter_id: str, tier: str | None) -> dict:
    """Move an adapter to exactly `tier` (promote or demote); its row, with "target_tier" until reached."""
    if tier not in EXACT_TIERS:
        raise ApiError(
            400, f"tier {tier!r}: expected one of {', '.join(EXACT_TIERS)}", param="tier", code="invalid_tier"
        )
    engine, _ = state.require_engine()
    try:
        return await state.call(lambda: engine.adapters.set_tier(adapter_id, tier))
    except EngineError as exc:
        raise api_error(exc) from exc


async def wait_for(state: ServerState, adapter_id: str, tier: str, timeout_s: float) -> dict:
    """Poll until the adapter reached `tier` (ready) or failed; 400 with its error if it failed."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = await row(state, adapter_id)
        if r["state"] == "failed":
            raise ApiError(400, f"adapter {adapter_id!r} failed to load: {r['last_error']}", code="adapter_load_failed")
        reached = tier == "none" or _TIER_RANK.get(r["tier"], 3) <= _TIER_RANK[tier]
        if (reached and r["state"] != "loading") or time.monotonic() >= deadline:
            return r
        await asyncio.sleep(0.05)


async def unload(state: ServerState, adapter_id: str) -> None:
    engine, _ = state.require_engine()
    try:
        found = await state.call(lambda: engine.adapters.unload(adapter_id))
    except EngineError as exc:
        raise api_error(exc) from exc
    if not found:
        raise ApiError(404, f"unknown adapter {adapter_id!r}", code="adapter_not_found")


# routes
router = APIRouter(tags=["admin"])
admin = [Depends(require_admin)]


def is_admin_path(path: str) -> bool:
    """One of this module's routes (what --admin-port serves)."""
    return any(route.path_regex.match(path) for route in router.routes if isinstance(route, APIRoute))


@router.get("/v1/adapters", dependencies=admin)
async def list_adapters(request: Request) -> dict:
    """Every known adapter: tier, state, size, rank, pinned, last error."""
    return {"object": "list", "data": await rows(get_state(request))}


@router.get("/v1/adapters/{adapter_id}", dependencies=admin)
async def get_adapter(adapter_id: str, request: Request) -> dict:
    return await row(get_state(request), check_adapter_id(adapter_id, "adapter_id"))


@router.post("/v1/adapters", dependencies=admin)
async def create_adapter(body: AdapterCreate, request: Request) -> dict:
    """Register (with a source) and prewarm an adapter to a tier, optionally pinned; wait=true waits for it.
    At most max_loras - 1 adapters can be pinned (one device slot always serves the rest): 409 beyond."""
    state = get_state(request)
    adapter_id = check_adapter_id(body.id, "id")
    changed = body.source is not None and await register(state, adapter_id, body.source, "source")
    try:
        await prewarm(state, adapter_id, body.tier, body.pinned)
    except ApiError:
        if changed:  # refused (a pin beyond the limit): leave no half-made adapter behind
            await unload(state, adapter_id)
        raise
    if body.wait:
        return await wait_for(state, adapter_id, body.tier, body.timeout_s)
    return await row(state, adapter_id)


@router.post("/v1/adapters/{adapter_id}/tier", dependencies=admin)
async def set_adapter_tier(adapter_id: str, body: AdapterTierSet, request: Request) -> dict:
    """Move a known adapter to exactly this tier: promote (load) or demote (free its device slot, once no
    running request uses it, and for disk its host memory too). Clears a pin below device. 404 if unknown."""
    return await set_tier(get_state(request), check_adapter_id(adapter_id, "adapter_id"), body.tier)


@router.delete("/v1/adapters/{adapter_id}", dependencies=admin)
async def delete_adapter(adapter_id: str, request: Request) -> dict:
    """Forget an adapter on every tier (409 while requests use it)."""
    await unload(get_state(request), check_adapter_id(adapter_id, "adapter_id"))
    return {"id": adapter_id, "object": "adapter", "deleted": True}


@router.post("/v1/load_lora_adapter", dependencies=admin, response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> PlainTextResponse:
    """vLLM's: register lora_path as lora_name and load it onto the device before answering."""
    state = get_state(request)
    name = check_adapter_id(body.lora_name, "lora_name")
    changed = await register(state, name, body.lora_path, "lora_path")
    await prewarm(state, name, "device", None)
    try:
        await wait_for(state, name, "device", 120.0)
    except Exception:
        if changed:
            await unload(state, name)
        raise
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", dependencies=admin, response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> PlainTextResponse:
    name = check_adapter_id(body.lora_name, "lora_name")
    await unload(get_state(request), name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


@router.post("/v1/prewarm/complete", dependencies=admin)
async def prewarm_complete(request: Request) -> dict:
    """The operator's word that the adapters placed on this pod are resident: /ready turns 200 (the pod joins
    the Service and the router). Idempotent: `opened` is False where the gate was already open (by the timeout,
    or --prewarm-timeout 0). 409 while the model loads or the server drains."""
    life = get_state(request).lifecycle
    if life.phase in (Phase.LOADING, Phase.DRAINING, Phase.FAILED):
        message = f"the server is {life.phase.value}; the prewarm gate opens once it is loaded"
        raise ApiError(409, message, code="not_loaded")
    opened = life.open_gate("operator")
    return {"status": life.phase.value, "opened": opened, "outcome": life.prewarm_outcome}


@router.get("/v1/debug/engine", dependencies=admin)
async def debug_engine(request: Request) -> dict:
    """Engine bookkeeping for tests and operators: blocks, slots, queues, streams."""
    state = get_state(request)
    snap = await state.snapshot()
    life = state.lifecycle
    engine, front = state.require_engine()
    return {
        **snap.to_dict(),
        "paths": engine.describe(),  # the CPU, dtype, kernels' ISA and backends it picked at start
        "device": engine.device_info.to_dict(),  # the GPU's name, memory, compute capability (or the CPU's name)
        "dtype": str(engine.dtype).removeprefix("torch."),
        "backends": engine.backends.to_dict(),
        "memory_plan": None if engine.memory_plan is None else engine.memory_plan.to_dict(),
        "num_streams": front.num_streams,
        "phase": life.phase.value,
        "num_http_waiting": life.num_waiting,
        "num_http_inflight": life.num_inflight,
    }
