"""Adapter admin: /v1/adapters and /v1/adapters/{id}/tier (ours), /v1/load_lora_adapter and
/v1/unload_lora_adapter (vLLM's), and a debug view of the engine. Every route here needs the admin token when
one is set: the rows carry adapter sources (bucket paths, URLs) that are not for API clients, who see adapter
ids in /v1/models."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse

from loraplane_server.http import adapter_admin
from loraplane_server.http.errors import ApiError
from loraplane_server.http.protocol_admin import (
    AdapterCreate,
    AdapterTierSet,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
)
from loraplane_server.http.security import check_adapter_id, require_admin
from loraplane_server.http.state import get_state

router = APIRouter(tags=["admin"])
admin = [Depends(require_admin)]


@router.get("/v1/adapters", dependencies=admin)
async def list_adapters(request: Request) -> dict:
    """Every known adapter: tier, state, size, rank, pinned, last error."""
    return {"object": "list", "data": await adapter_admin.rows(get_state(request))}


@router.get("/v1/adapters/{adapter_id}", dependencies=admin)
async def get_adapter(adapter_id: str, request: Request) -> dict:
    return await adapter_admin.row(get_state(request), check_adapter_id(adapter_id, "adapter_id"))


@router.post("/v1/adapters", dependencies=admin)
async def create_adapter(body: AdapterCreate, request: Request) -> dict:
    """Register (with a source) and prewarm an adapter to a tier, optionally pinned; wait=true waits for it.
    At most max_loras - 1 adapters can be pinned (one device slot always serves the rest): 409 beyond."""
    state = get_state(request)
    adapter_id = check_adapter_id(body.id, "id")
    changed = body.source is not None and await adapter_admin.register(state, adapter_id, body.source, "source")
    try:
        await adapter_admin.prewarm(state, adapter_id, body.tier, body.pinned)
    except ApiError:
        if changed:  # refused (a pin beyond the limit): leave no half-made adapter behind
            await adapter_admin.unload(state, adapter_id)
        raise
    if body.wait:
        return await adapter_admin.wait_for(state, adapter_id, body.tier, body.timeout_s)
    return await adapter_admin.row(state, adapter_id)


@router.post("/v1/adapters/{adapter_id}/tier", dependencies=admin)
async def set_adapter_tier(adapter_id: str, body: AdapterTierSet, request: Request) -> dict:
    """Move a known adapter to exactly this tier: promote (load) or demote (free its device slot, once no
    running request uses it, and for disk its host memory too). Clears a pin below device. 404 if unknown."""
    return await adapter_admin.set_tier(get_state(request), check_adapter_id(adapter_id, "adapter_id"), body.tier)


@router.delete("/v1/adapters/{adapter_id}", dependencies=admin)
async def delete_adapter(adapter_id: str, request: Request) -> dict:
    """Forget an adapter on every tier (409 while requests use it)."""
    await adapter_admin.unload(get_state(request), check_adapter_id(adapter_id, "adapter_id"))
    return {"id": adapter_id, "object": "adapter", "deleted": True}


@router.post("/v1/load_lora_adapter", dependencies=admin, response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> PlainTextResponse:
    """vLLM's: register lora_path as lora_name and load it onto the device before answering."""
    state = get_state(request)
    name = check_adapter_id(body.lora_name, "lora_name")
    changed = await adapter_admin.register(state, name, body.lora_path, "lora_path")
    await adapter_admin.prewarm(state, name, "device", None)
    try:
        await adapter_admin.wait_for(state, name, "device", 120.0)
    except Exception:
        if changed:
            await adapter_admin.unload(state, name)
        raise
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", dependencies=admin, response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> PlainTextResponse:
    name = check_adapter_id(body.lora_name, "lora_name")
    await adapter_admin.unload(get_state(request), name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


@router.get("/v1/debug/engine", dependencies=admin)
async def debug_engine(request: Request) -> dict:
    """Engine bookkeeping for tests and operators: blocks, slots, queues, streams."""
    state = get_state(request)
    snap = await state.snapshot()
    life = state.lifecycle
    _, front = state.require_engine()
    return {
        **snap.to_dict(),
        "num_streams": front.num_streams,
        "phase": life.phase.value,
        "num_http_waiting": life.num_waiting,
        "num_http_inflight": life.num_inflight,
    }
