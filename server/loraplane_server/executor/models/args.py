"""A model's arguments and the names of the modules an adapter may target, shared by the models
(models/*.py) and the adapter loader (adapters/weights.py); no torch."""

from __future__ import annotations

from dataclasses import dataclass

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# a checkpoint's (and its adapters') fused projections -> ours, in row order (Phi-3)
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

# a multimodal checkpoint's parts that text serving never runs (under "model." in transformers 5's naming)
VISION_MODULES = ("vision_tower.", "multi_modal_projector.")


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    mlp_bias: bool
    hidden_act: str = "silu"
    rotary_dim: int = 0  # the rotated dims of a head (a partial rotary's share); 0: all of them
    attention_scale: float = 0.0  # 0: head_dim ** -0.5
    fused_projections: bool = False  # the checkpoint holds FUSED_PROJECTIONS (Phi-3), split at load
    # each layer's sliding attention window (0: full attention); () when no layer has one
    sliding_windows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")

    def window(self, layer_idx: int) -> int:
        """The layer's sliding attention window, 0 for full attention."""
        return self.sliding_windows[layer_idx] if self.sliding_windows else 0

    @property
    def rotated_dims(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def is_llama_shaped(self) -> bool:
        """What the fused CPU decoder layer and the per-op rotary/SiLU kernels compute: SiLU MLP, full rotary."""
        return self.hidden_act == "silu" and self.rotated_dims == self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArgs:
        """The Llama-shaped part of a config.json (executor/models/registry.py checks the model type first)."""
        model_type = cfg.get("model_type", "")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rope_scaling=rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=cfg.get("hidden_act", "silu"),
            rotary_dim=int(head_dim * partial),  # as transformers rounds a partial rotary's dims
            sliding_windows=layer_windows(cfg),
        )


def layer_windows(cfg: dict) -> tuple[int, ...]:
    """Each layer's sliding window from a normalized config: `sliding_window` on the layers `layer_types` calls
    sliding_attention (Gemma 3's local layers, Qwen2/3's under max_window_layers), on every layer without
    layer_types (Mistral, Phi-3); () when the config has no window, or one no sequence can outgrow (Phi-3.5's
    262,144 over its 131,072 positions)."""
    window = int(cfg.get("sliding_window") or 0)
    layer_types = cfg.get("layer_types")
    if (
        not window
        or window >= cfg.get("max_position_embeddings", 4096)
        or (layer_types is not None and "sliding_attention" not in layer_types)
    ):
        return ()
    n = cfg["num_hidden_layers"]
    return tuple(window if layer_types is None or layer_types[i] == "sliding_attention" else 0 for i in range(n))
