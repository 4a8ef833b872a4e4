"""Phi-3 (and Phi-3.5 / Phi-4-mini): the Llama layer, with q|k|v in one `qkv_proj` and gate|up in one
`gate_up_proj` in the checkpoint (split at load into our projections; adapters on the fused names are
mapped in adapters/weights.py), an optional partial rotary, and LongRoPE: short factors up to
original_max_position_embeddings, long ones past it, switched as transformers does (executor/layers/rotary.py)."""

from __future__ import annotations

from dataclasses import replace

from loraplane_server.executor.models.args import ModelArgs


def phi3_args(cfg: dict) -> ModelArgs:
    return replace(ModelArgs.from_hf_config(cfg), fused_projections=True)
