"""The engine client of a vLLM server pod: its runtime LoRA routes, seen through the same interface as our admin
API (`engine_client.EngineClient`), so residency, placement, retries and status are one code path for both kinds.

vLLM's routes (with VLLM_ALLOW_RUNTIME_LORA_UPDATING set): POST /v1/load_lora_adapter {lora_name, lora_path,
load_inplace}, POST /v1/unload_lora_adapter {lora_name}, and GET /v1/models, which lists every loaded adapter
(`parent`: the base model, `root`: its path). What vLLM can tell is whether an adapter is loaded, not where:
it keeps up to --max-loras on the GPU and --max-cpu-loras in host memory by its own LRU. So each row says
tier "loaded"; there are no tiers to move between, no pinning and no registered-but-not-loaded state.

vLLM loads an adapter from a directory in the pod or, given a Hub repo id, downloads it itself (into
HF_HUB_CACHE, with HF_TOKEN); `lora_path` is the source mapped to one of those (`vllm_lora_path`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from loraplane_operator import constants as c
from loraplane_operator.admin_client import (
    AdminError,
    PermanentAdminError,
    RetryableAdminError,
    classify,
    error_message,
)


def vllm_lora_path(source: str) -> str:
    """The `lora_path` vLLM can load for an adapter source, or PermanentAdminError saying why it cannot: vLLM
    reads a directory in the pod, or downloads a Hub repo at its default revision (no revision, no subfolder);
    s3:// and http(s):// sources need our engine, which fetches them itself."""
    source = source.strip()
    if source.startswith("file://"):
        source = source[len("file://") :]
    if source.startswith("/"):
        return source
    if source.startswith("hf://"):
        repo = source[len("hf://") :].rstrip("/")
        if "@" in repo or repo.count("/") != 1:
            raise PermanentAdminError(
                f"{source}: vLLM downloads an adapter from the Hub as org/repo at its default revision only; "
                "a revision or subfolder needs engine kind loraplane (or the adapter copied into a volume)"
            )
        return repo
    raise PermanentAdminError(
        f"{source}: vLLM loads adapters from a directory in the pod or hf://org/repo; s3:// and http(s):// "
        "sources need engine kind loraplane (or the adapter copied into a volume the pods mount)"
    )


@dataclass(frozen=True)
class VLLMClient:
    """The LoRA routes of one vLLM pod at `base_url`, with its --api-key (VLLM_API_KEY) as the token."""

    http: httpx.AsyncClient
    base_url: str
    token: str | None = None

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            return await self.http.request(method, self.base_url + path, json=body, headers=headers)
        except httpx.TransportError as exc:
            raise RetryableAdminError(f"{method} {self.base_url}{path}: {type(exc).__name__}: {exc}") from exc

    async def list_adapters(self) -> list[dict[str, Any]]:
        """Every adapter the pod has loaded, as rows in our admin API's shape (tier "loaded")."""
        response = await self._call("GET", "/v1/models")
        if response.status_code != 200:
            raise classify(response)
        try:
            cards = response.json()["data"]
        except (ValueError, KeyError, TypeError) as exc:
            raise RetryableAdminError(f"GET {self.base_url}/v1/models: not a model list: {exc}") from exc
        return [_row(card) for card in cards if isinstance(card, dict) and card.get("parent")]

    async def prewarm(self, adapter_id: str, source: str | None, tier: str, pinned: bool | None = None) -> dict:
        """Load the adapter (unless it is loaded from the same path already); its row. A new source for a loaded
        name is loaded in place."""
        if pinned:
            raise PermanentAdminError("vLLM cannot pin an adapter: pinned needs engine kind loraplane")
        if tier not in (c.LOADED_TIER, "device", "host"):
            raise PermanentAdminError(f"vLLM has no tier {tier!r}: an adapter is loaded (device or host) or not")
        loaded = {r["id"]: r for r in await self.list_adapters()}
        old = loaded.get(adapter_id)
        if source is None:
            if old is None:
                raise PermanentAdminError(f"{adapter_id}: not loaded on this vLLM pod and no source to load it from")
            return old
        path = vllm_lora_path(source)
        if old is not None and old.get("source") == path:
            return old
        body = {"lora_name": adapter_id, "lora_path": path, "load_inplace": old is not None}
        response = await self._call("POST", "/v1/load_lora_adapter", body)
        if response.status_code == 400 and ALREADY_LOADED in error_message(response):
            # loaded since the list above (a concurrent call): fine if from the same path, else try again later
            again = {r["id"]: r for r in await self.list_adapters()}.get(adapter_id)
            if again is not None and again.get("source") == path:
                return again
            raise RetryableAdminError(f"{adapter_id}: being loaded by another call from {again and again['source']}")
        if response.status_code != 200:
            raise _load_error(response)
        return {"id": adapter_id, "source": path, "state": "ready", "tier": c.LOADED_TIER}

    async def set_tier(self, adapter_id: str, tier: str) -> dict:
        """vLLM has no tiers to move an adapter between (the operator never asks: its rows say "loaded")."""
        raise PermanentAdminError(f"vLLM cannot move {adapter_id} to tier {tier}: it has no adapter tiers")

    async def unload(self, adapter_id: str) -> bool:
        """Unload it; False if the pod did not have it."""
        response = await self._call("POST", "/v1/unload_lora_adapter", {"lora_name": adapter_id})
        if response.status_code == 404:
            return False
        if response.status_code != 200:
            raise classify(response)
        return True


def _row(card: dict[str, Any]) -> dict[str, Any]:
    return {"id": str(card["id"]), "source": card.get("root"), "state": "ready", "tier": c.LOADED_TIER}


ALREADY_LOADED = "has already been loaded"  # vLLM's 400 for a name it holds, without load_inplace
# vLLM's 500 when its worker raised while reading the adapter (a rank over --max-lora-rank, a module it cannot
# target, a broken file): the same files fail the same way, unlike a 500 from an engine that is busy or dying
WORKER_LOAD_FAILURE = "add_lora method failed"


def _load_error(response: httpx.Response) -> AdminError:
    """A failed load: 404 (nothing at lora_path), 400 (a name taken by the base model, a bad request) and a
    worker's failure to read the adapter are refusals; any other error is retried within the attempt budget."""
    message = error_message(response)
    if response.status_code in (400, 404) or (response.status_code == 500 and WORKER_LOAD_FAILURE in message):
        return PermanentAdminError(f"POST /v1/load_lora_adapter: {response.status_code} {message}")
    return classify(response)
