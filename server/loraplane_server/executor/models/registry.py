"""The supported architectures: model_type -> how its config is read and which model class serves it; the
context a model can be served at exactly.

A config.json is first normalized by transformers' own config class for its model_type (legacy rope keys,
layer_types, Qwen's use_sliding_window), so each family reads one current form. A multimodal model (Gemma 3
4B and up) is served as its language model: normalized() is then the language model's config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from loraplane_server.executor.layers.rotary import rope_kind
from loraplane_server.executor.models.args import ModelArgs
from loraplane_server.executor.models.gemma3 import Gemma3ForCausalLM, gemma3_args, gemma3_language_model
from loraplane_server.executor.models.llama import LlamaForCausalLM
from loraplane_server.executor.models.phi3 import phi3_args
from loraplane_server.executor.models.qwen3 import Qwen3ForCausalLM


@dataclass(frozen=True)
class Family:
    architectures: tuple[str, ...]
    parse: Callable[[dict], ModelArgs]
    model_class: type[LlamaForCausalLM]
    # a multimodal model's normalized config -> its language model's, which is served alone; None: a text model
    language_model: Callable[[dict], dict] | None = None


FAMILIES: dict[str, Family] = {
    "llama": Family(("LlamaForCausalLM",), ModelArgs.from_hf_config, LlamaForCausalLM),
    "mistral": Family(("MistralForCausalLM",), ModelArgs.from_hf_config, LlamaForCausalLM),
    "qwen2": Family(("Qwen2ForCausalLM",), ModelArgs.from_hf_config, LlamaForCausalLM),
    "qwen3": Family(("Qwen3ForCausalLM",), ModelArgs.from_hf_config, Qwen3ForCausalLM),
    "phi3": Family(("Phi3ForCausalLM",), phi3_args, LlamaForCausalLM),
    "gemma3_text": Family(("Gemma3ForCausalLM",), gemma3_args, Gemma3ForCausalLM),
    "gemma3": Family(("Gemma3ForConditionalGeneration",), gemma3_args, Gemma3ForCausalLM, gemma3_language_model),
}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one the engine implements; the message lists those it does."""


def supported() -> str:
    return ", ".join(
        f"{name} ({', '.join(f.architectures)}{', text only' if f.language_model else ''})"
        for name, f in FAMILIES.items()
    )


def family_of(cfg: dict) -> Family:
    model_type, archs = cfg.get("model_type"), cfg.get("architectures") or []
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None or (archs and not set(archs) & set(family.architectures)):
        named = f"model_type {model_type!r}" + (f" (architectures {', '.join(map(str, archs))})" if archs else "")
        raise UnsupportedModelError(f"{named} is not supported; supported model types: {supported()}")
    return family


def normalized(cfg: dict) -> dict:
    """cfg through transformers' config class for its (supported) model_type; a multimodal model's: the
    language model's config."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import CONFIG_MAPPING

    family = family_of(cfg)
    try:
        norm = CONFIG_MAPPING[cfg["model_type"]].from_dict(cfg).to_dict()
    except (StrictDataclassError, ValueError, TypeError, KeyError) as exc:  # transformers' own validation
        cause = str(exc.__cause__ or exc).strip().splitlines()[-1]
        raise ValueError(f"config.json is not a valid {cfg['model_type']} config: {cause}") from None
    return norm if family.language_model is None else family.language_model(norm)


def model_args(cfg: dict) -> ModelArgs:
    args = family_of(cfg).parse(normalized(cfg))
    layer_types = getattr(args, "layer_types", None)
    if layer_types is not None and len(layer_types) != args.num_layers:
        raise ValueError(f"layer_types lists {len(layer_types)} layers; the model has {args.num_layers}")
    return args


def build(args: ModelArgs, max_positions: int) -> LlamaForCausalLM:
    return FAMILIES[args.model_type].model_class(args, max_positions)  # type: ignore[arg-type]


def max_context(cfg: dict) -> int:
    """The longest sequence this engine serves the model at exactly: its max_position_embeddings. Sliding
    windows are attended as the model does (attention/base.py) and LongRoPE switches to its long factors past
    the original length as transformers does (layers/rotary.py), so neither caps it. YaRN's context is its
    factor times the original length where that is longer than max_position_embeddings (Qwen2.5's configs keep
    32,768 there and extend it 4x)."""
    norm = normalized(cfg)
    limit = int(norm.get("max_position_embeddings") or 4096)
    rope = norm.get("rope_parameters") or {}
    if rope_kind(rope) == "yarn" and rope.get("factor") and rope.get("original_max_position_embeddings"):
        limit = max(limit, int(rope["factor"] * rope["original_max_position_embeddings"]))
    return limit
