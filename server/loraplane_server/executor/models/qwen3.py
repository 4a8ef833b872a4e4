"""Qwen3: the Llama layer plus a per-head RMSNorm on q and k before rotary; no qkv bias, head_dim from the
config (it may differ from hidden / heads), tied or untied head. Parsed by ModelArgs.from_hf_config."""

from __future__ import annotations

from loraplane_server.executor.layers.norm import RMSNorm
from loraplane_server.executor.models.llama import DecoderLayer, LlamaForCausalLM


class Qwen3DecoderLayer(DecoderLayer):
    qk_norm = RMSNorm


class Qwen3ForCausalLM(LlamaForCausalLM):
    can_fuse_layers = False  # the fused CPU decoder layer has no q/k norms: the Python layers run
    layer_class = Qwen3DecoderLayer
