"""Probes and scrapes: /health (alive), /ready (serving), /metrics (Prometheus), /v1/models."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from loraplane_server.serving.http.errors import ApiError
from loraplane_server.serving.http.openai import created
from loraplane_server.serving.http.state import Phase, get_state

router = APIRouter(tags=["health"])


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while the process is alive and has not failed to start."""
    life = get_state(request).lifecycle
    status = 503 if life.phase == Phase.FAILED else 200
    return JSONResponse({"status": "failed" if status == 503 else "ok", "error": life.error}, status_code=status)


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """200 once the model is loaded, 503 while loading (with the start-up step and its seconds, and the
    model's phase and bytes, and the draft model's apart) and from SIGTERM on."""
    state = get_state(request)
    life, body = state.lifecycle, state.lifecycle.progress()
    if life.phase != Phase.FAILED:  # the failed body stays {"status", "error"}
        body["model"] = state.model_progress.as_dict()
        if state.draft_progress is not None:
            body["draft_model"] = state.draft_progress.as_dict()
    return JSONResponse(body, status_code=200 if life.is_ready else 503)


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def metrics(request: Request) -> Response:
    state = get_state(request)
    if state.engine is not None:
        try:
            state.metrics.update(await state.snapshot())
        except ApiError:
            pass  # shut down: the last snapshot stands
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models", tags=["openai"])
async def models(request: Request) -> dict:
    """The base model by its own name, then every known adapter (each usable as `model`)."""
    state = get_state(request)
    engine, _ = state.require_engine()

    def _adapters() -> list[str]:
        return engine.adapters.known_ids()

    ts, base = created(), state.config.model_name
    data = [
        {
            "id": base,
            "object": "model",
            "created": ts,
            "owned_by": "loraplane",
            "root": base,
            "parent": None,
            "max_model_len": engine.max_model_len,
        }
    ]
    data += [
        {
            "id": a,
            "object": "model",
            "created": ts,
            "owned_by": "loraplane",
            "root": a,
            "parent": base,
            "max_model_len": engine.max_model_len,
        }
        for a in await state.call(_adapters)
    ]
    return {"object": "list", "data": data}
