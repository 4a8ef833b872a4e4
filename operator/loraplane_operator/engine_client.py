"""The one interface the operator talks to a server pod through, whichever engine runs in it: our admin API
(`admin_client.AdminClient`: tiers, pinning, registering without loading) or vLLM's LoRA routes
(`vllm_client.VLLMClient`: loaded or not). Both return rows in our admin API's shape (id, source, state, tier,
...), so adapter_status and reconcile hold one logic for both; `EngineTraits` says what a kind can do, and a
LoRAAdapter asking for more is refused with a message instead of being half served."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from loraplane_operator import constants as c
from loraplane_operator.admin_client import AdminClient
from loraplane_operator.vllm_client import VLLMClient


class EngineClient(Protocol):
    """The adapter routes of one server pod."""

    async def list_adapters(self) -> list[dict[str, Any]]:
        """Every adapter the pod knows, as rows."""
        ...

    async def prewarm(self, adapter_id: str, source: str | None, tier: str, pinned: bool | None = None) -> dict:
        """Register and load up to `tier`; the adapter's row."""
        ...

    async def set_tier(self, adapter_id: str, tier: str) -> dict:
        """Move a known adapter to exactly `tier`; its row."""
        ...

    async def unload(self, adapter_id: str) -> bool:
        """Forget it; False if the pod did not know it."""
        ...


@dataclass(frozen=True)
class EngineTraits:
    """What an engine kind can do with adapters."""

    tiers: tuple[str, ...]  # prewarm tiers it honours
    can_pin: bool
    registers_without_loading: bool  # tier none: known to the pod, loaded on its first request
    loaded_tier: str | None = None  # the one tier its rows report, when it has no tiers of its own

    def goal(self, tier: str) -> str:
        """The tier rows report once a prewarm to `tier` is done."""
        return self.loaded_tier or tier

    def refusal(self, tier: str, pinned: bool, kind: str) -> str | None:
        """Why a LoRAAdapter's spec cannot be honoured on this kind, None when it can."""
        if tier not in self.tiers:
            return (
                f"prewarm.tier {tier} is not available on engine kind {kind}, which loads an adapter or not "
                f"(tiers: {', '.join(self.tiers)}; vLLM keeps up to --max-loras on the GPU and --max-cpu-loras in "
                "host memory by its own LRU)"
            )
        if pinned and not self.can_pin:
            return f"pinned is not available on engine kind {kind}: it cannot keep an adapter from its LRU"
        return None


TRAITS = {
    c.ENGINE_LORAPLANE: EngineTraits(tiers=c.TIERS, can_pin=True, registers_without_loading=True),
    c.ENGINE_VLLM: EngineTraits(
        tiers=("device", "host"), can_pin=False, registers_without_loading=False, loaded_tier=c.LOADED_TIER
    ),
}


def engine_client(kind: str, http: httpx.AsyncClient, url: str, token: str | None) -> EngineClient:
    """The client for a pod of engine `kind` at `url`."""
    if kind == c.ENGINE_VLLM:
        return VLLMClient(http, url, token)
    return AdminClient(http, url, token)
