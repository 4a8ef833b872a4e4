"""The server's configuration: one frozen dataclass, built once at the entry point, validated once."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from loraplane_server.config import EngineConfig

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5G', '1000' -> bytes."""
    m = _SIZE.match(text)
    unit = (m.group(2) or "").lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size (examples: 1000, 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class ServerConfig:
    """Everything `loraplane serve` needs: the engine's config plus the HTTP layer's own settings."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8080
    admin_port: int | None = None  # the admin routes on this port alone (None: on `port`, beside the API)
    served_model_name: str | None = None  # None: the --model argument (a path's last component)
    max_queue: int = 256  # waiting requests beyond this get 429
    admin_token: str | None = None  # None: admin routes are open, and anyone may register adapters
    # with an admin token: whether clients without it may still register new adapters from generation routes
    allow_anonymous_adapter_load: bool = False
    adapter_source_allow: tuple[str, ...] = ()  # empty: ("hf://",); --adapter-dir is always allowed
    max_body_bytes: int = 4 << 20
    shutdown_grace_s: float = 30.0
    # > 0: once loaded, /ready says 503 "prewarming" until POST /v1/prewarm/complete or this many seconds pass
    prewarm_timeout_s: float = 0.0
    metrics_top_adapters: int = 100  # adapters with their own usage label; the rest are "__other__"
    max_choices: int = 16  # OpenAI n * number of prompts
    torch_threads: int = 0  # intra-op threads for the engine; 0: torch_threads.DEFAULT_THREADS (cgroup-capped)
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} must be in [0, 65535]")
        if self.admin_port is not None and not (0 < self.admin_port <= 65535 and self.admin_port != self.port):
            raise ValueError(f"admin_port={self.admin_port} must be in [1, 65535] and differ from port={self.port}")
        for name in ("max_queue", "max_body_bytes", "metrics_top_adapters", "max_choices"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.torch_threads < 0:
            raise ValueError("torch_threads must be >= 0")
        if self.shutdown_grace_s < 0:
            raise ValueError("shutdown_grace_s must be >= 0")
        if not 0 <= self.prewarm_timeout_s <= 86400:
            raise ValueError("prewarm_timeout_s must be between 0 (no gate) and 86400")
        if self.admin_token is not None and len(self.admin_token) < 8:
            raise ValueError("the admin token must be at least 8 characters")

    @property
    def model_name(self) -> str:
        """The base model's name in the OpenAI `model` field and /v1/models."""
        if self.served_model_name:
            return self.served_model_name
        model = self.engine.model.strip().rstrip("/")
        if model.startswith("hf://"):  # the repo id, as vLLM names a Hub model: hf://org/repo@rev/sub -> org/repo
            org, _, rest = model[len("hf://") :].partition("/")
            return f"{org}/{rest.split('/')[0].split('@')[0]}"
        return Path(model).name or model

    @property
    def allowlist(self) -> list[str]:
        allow = list(self.adapter_source_allow) or ["hf://"]
        if self.engine.adapter_dir:
            allow.insert(0, self.engine.adapter_dir)
        return allow
