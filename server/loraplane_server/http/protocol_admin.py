"""Adapter admin bodies: ours (/v1/adapters) and vLLM's (/v1/load_lora_adapter, /v1/unload_lora_adapter)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from loraplane_server.http.security import ADAPTER_ID_PATTERN


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
    lora_name: str = Field(min_length=1, max_length=1024)
    lora_path: str = Field(min_length=1, max_length=2048)
    load_inplace: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1, max_length=1024)
    lora_int_id: int | None = None
