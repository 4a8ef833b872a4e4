"""Gemma 3 (text): (1 + w) RMSNorms, also on q and k per head; the embedding scaled by sqrt(hidden); a
gelu-tanh MLP between pre- and post-feed-forward norms, attention output normed before the residual add;
query_pre_attn_scalar as the attention scale; two rope bases (local for sliding-window layers, global for
full-attention ones); optional final logit softcapping. The local layers attend within their sliding window
(ModelArgs.sliding_windows, attention/base.py).

Gemma 3 4B/12B/27B (Gemma3ForConditionalGeneration) are served as their language model: its text_config, its
weights (executor/models/loader.py skips VISION_MODULES unread; adapters/weights.py refuses adapters on them)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from loraplane_server.executor.forward_batch import ForwardBatch
from loraplane_server.executor.layers.norm import OffsetRMSNorm, RMSNorm
from loraplane_server.executor.layers.rotary import RotaryEmbedding
from loraplane_server.executor.models.args import ModelArgs
from loraplane_server.executor.models.llama import DecoderLayer, LlamaForCausalLM

SLIDING = "sliding_attention"


@dataclass(frozen=True)
class Gemma3Args(ModelArgs):
    layer_types: tuple[str, ...] = ()
    local_rope_theta: float = 10000.0
    local_rope_scaling: dict | None = None
    final_logit_softcapping: float | None = None


def gemma3_args(cfg: dict) -> Gemma3Args:
    """cfg: normalized by transformers' Gemma3TextConfig (rope_parameters per layer type, layer_types)."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported (the paged attention kernels do not softcap)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported (a causal language model is served)")
    rope = cfg["rope_parameters"]
    local = ModelArgs.from_hf_config({**cfg, "rope_parameters": rope[SLIDING]})
    base = ModelArgs.from_hf_config(
        {**cfg, "rope_parameters": rope["full_attention"], "hidden_act": cfg.get("hidden_activation")}
    )
    return Gemma3Args(
        **{f.name: getattr(base, f.name) for f in fields(ModelArgs)}
        | {"attention_scale": cfg["query_pre_attn_scalar"] ** -0.5},
        layer_types=tuple(cfg["layer_types"]),
        local_rope_theta=local.rope_theta,
        local_rope_scaling=local.rope_scaling,
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
    )


def gemma3_language_model(cfg: dict) -> dict:
    """A normalized Gemma3ForConditionalGeneration config -> its language model's, as that class runs it: the
    top-level tie_word_embeddings, and no final logit softcapping (its forward applies none)."""
    return {**cfg["text_config"], "tie_word_embeddings": cfg["tie_word_embeddings"], "final_logit_softcapping": None}


class Gemma3DecoderLayer(DecoderLayer):
    norm_class = OffsetRMSNorm
    qk_norm = OffsetRMSNorm

    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__(args, layer_idx)
        self.pre_feedforward_layernorm = OffsetRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        batch: ForwardBatch,
        next_norm: RMSNorm | None,
        rows: ForwardBatch | None = None,
    ) -> torch.Tensor:
        """DecoderLayer.forward's contract, with Gemma's norms around attention and the MLP."""
        a = self.post_attention_layernorm(self.self_attn(h, cos_sin, kv_cache, batch, rows))
        if rows is not None and batch.logits_indices is not None:
            x, batch = x[batch.logits_indices], rows
        h = self.pre_feedforward_layernorm.add_forward(x, a, False)
        m = self.post_feedforward_layernorm(self.mlp(h, batch))
        if next_norm is None:
            return x.add_(m)
        return next_norm.add_forward(x, m, False)


class Gemma3ForCausalLM(LlamaForCausalLM):
    can_fuse_layers = False  # norms, activation and ropes the fused CPU decoder layer does not compute
    layer_class = Gemma3DecoderLayer
    args: Gemma3Args

    def __init__(self, args: Gemma3Args, max_positions: int) -> None:
        super().__init__(args, max_positions)
        self.local_rotary = RotaryEmbedding(
            args.head_dim, max_positions, args.local_rope_theta, args.local_rope_scaling
        )

    def forward(
        self, input_ids: torch.Tensor, kv_caches: torch.Tensor | list[torch.Tensor], batch: ForwardBatch
    ) -> torch.Tensor:
        logits = super().forward(input_ids, kv_caches, batch)
        cap = self.args.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.args.hidden_size**0.5).to(x.dtype)  # rounded to the dtype, as Gemma does

    def cos_sins(
        self, positions: torch.Tensor, dtype: torch.dtype, kernels: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        full, local = self.rotary.cos_sin(positions, dtype), self.local_rotary.cos_sin(positions, dtype)
        return [local if kind == SLIDING else full for kind in self.args.layer_types]
