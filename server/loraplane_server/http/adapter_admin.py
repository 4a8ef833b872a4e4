"""Adapter admin operations, each run on the engine thread: register, prewarm, set an exact tier, wait, unload,
describe."""

from __future__ import annotations

import asyncio
import time

from loraplane_server.errors import AdapterInUseError, EngineError, UnknownAdapterError
from loraplane_server.http.errors import ApiError, api_error
from loraplane_server.http.security import check_source
from loraplane_server.http.state import ServerState

_TIER_RANK = {"device": 0, "host": 1, "disk": 2, "source": 3}
EXACT_TIERS = ("device", "host", "disk")  # what POST /v1/adapters/{id}/tier accepts


async def rows(state: ServerState) -> list[dict]:
    engine, _ = state.require_engine()
    return await state.call(engine.adapter_residency)


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
        rec = engine.adapters.records.get(adapter_id)
        if rec is not None and rec.source.uri == source.uri:
            return False
        if rec is not None:
            engine.unload(adapter_id)  # AdapterInUseError while in use
        engine.adapters.register(adapter_id, source.uri)
        return True

    try:
        return await state.call(_register)
    except AdapterInUseError as exc:
        raise api_error(exc, param=param, prefix=f"cannot re-point adapter {adapter_id!r}") from exc


async def prewarm(state: ServerState, adapter_id: str, tier: str, pinned: bool | None) -> None:
    engine, _ = state.require_engine()

    def _prewarm() -> None:
        if engine.adapters.lookup(adapter_id) is None:
            raise UnknownAdapterError(adapter_id, "give a source to register it")
        engine.prewarm(adapter_id, tier, pinned)

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
        return await state.call(lambda: engine.set_tier(adapter_id, tier))
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
        found = await state.call(lambda: engine.unload(adapter_id))
    except EngineError as exc:
        raise api_error(exc) from exc
    if not found:
        raise ApiError(404, f"unknown adapter {adapter_id!r}", code="adapter_not_found")
