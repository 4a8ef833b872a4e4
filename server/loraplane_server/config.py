"""Engine configuration: one dataclass, built once at the entry point, validated once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start. Paths are resolved by the caller."""

    model: str = "smollm2-135m"
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: derived from kv_cache_bytes
    kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's own context length
    enable_prefix_caching: bool = True
    max_loras: int = 8
    max_lora_rank: int = 64

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"dtype={self.dtype!r}: expected auto, bfloat16, float16 or float32")
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_loras", "max_lora_rank")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError("num_kv_blocks must be >= 2")
