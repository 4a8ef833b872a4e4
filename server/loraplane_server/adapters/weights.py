"""PEFT LoRA adapters: read, validate against the base model, cast to the engine dtype.

A = lora_A [r, in], B = lora_B [out, r]; the delta is x @ A.T @ B.T * scale, and the scale is
folded into B here (lora_alpha / r, or lora_alpha / sqrt(r) for rsLoRA, per module patterns).

Adapter files are untrusted (any client may name a source). What is validated is the effective
adapter, the tensors the engine will multiply: the config's numbers are typed and finite, the folded
scale is within MAX_ABS_SCALE, and every stored tensor (A, and B with the scale folded in, in the
engine dtype) is finite and within MAX_ABS_WEIGHT. Pattern keys (alpha_pattern, rank_pattern) are
matched as PEFT does in practice, a module-name suffix, by string comparison: no user regex is run.

On a base model whose checkpoint fuses projections (Phi-3: qkv_proj, gate_up_proj), PEFT adapters target the
fused names; such a pair (A [r, in], B [sum of outs, r]) is exactly one pair per projection we hold, the same A
with B's rows split by projection, since x A^T B^T is the concatenation of x A^T B_p^T.

A module is named by its tensors' PEFT path, whatever wraps the layers (model.layers.N, or a multimodal Gemma 3's
model.language_model.layers.N / language_model.model.layers.N); tensors on a vision tower are left out (text
prompts never run it, so the served text is the same), and an adapter with nothing else is refused.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from loraplane_server.errors import AdapterError as AdapterError  # raised here; importers also take it from here
from loraplane_server.executor.models.args import FUSED_PROJECTIONS, TARGET_MODULES, VISION_MODULES, ModelArgs

log = logging.getLogger("loraplane.adapters")

_KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")

# Bounds no trained adapter comes near: the example adapters fold to |B * scale| <= 0.2 and |A| <= 0.16
# (scales 2-4); the tests' stress adapters to 20. Beyond them a bf16/fp16 activation overflows within
# a few layers, so such an adapter is refused at load instead of producing inf at run time.
MAX_ABS_SCALE = 1e4
MAX_ABS_WEIGHT = 1e3
MAX_CONFIG_BYTES = 1 << 20
MAX_PATTERNS = 4096  # entries per alpha_pattern / rank_pattern; one per module of an 80-layer model is 560
MAX_PATTERN_KEY = 512
_PATTERN_KEY_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


@dataclass
class LoRAWeights:
    adapter_id: str
    rank: int  # the largest rank over its modules
    target_modules: list[str]
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, module) -> (A, B * scale)
    config: dict = field(default_factory=dict)
    # every tensor above is a view into this one buffer (load_lora's `flat`), so that a device slot takes the
    # adapter in one host-to-device transfer (executor/lora/slots.py); None: separate tensors
    flat: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """The host memory it holds, as the host tier counts it: its buffer (a tensor shared by several modules
        once), a page-locked one as torch's pinned allocator sizes its block (rounded up to a power of two, the
        default of its pinned_max_round_threshold)."""
        if self.flat is not None:
            size = self.flat.numel() * self.flat.element_size()
            return pinned_block_bytes(size) if self.flat.is_pinned() else size
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.tensors.values())


def pinned_block_bytes(size: int) -> int:
    """The block torch's caching host allocator takes for `size` page-locked bytes: the next power of two."""
    return 1 << max(0, size - 1).bit_length()


def module_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every target module."""
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    h, i = args.hidden_size, args.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
        "qkv_proj": (h, q + 2 * kv),
        "gate_up_proj": (h, 2 * i),
    }


def read_adapter_config(path: Path) -> dict:
    cfg_path = path / "adapter_config.json"
    if not path.is_dir():
        raise AdapterError(f"adapter directory {path} does not exist")
    if not cfg_path.is_file():
        raise AdapterError(f"{path} has no adapter_config.json (expected a PEFT LoRA adapter)")
    if cfg_path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError(f"adapter_config.json is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as exc:  # bad JSON, bad UTF-8, or an integer beyond Python's digit limit
        raise AdapterError(f"adapter_config.json is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise AdapterError("adapter_config.json nests too deeply") from exc
    if not isinstance(cfg, dict):
        raise AdapterError("adapter_config.json must hold a JSON object")
    _check_config(cfg)
    return cfg


def _check_config(cfg: dict) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {cfg.get('peft_type')!r} is not supported (only LORA)")
    for flag, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D) layers")):
        if cfg.get(flag):
            raise AdapterError(f"{why} adapters are not supported")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"modules_to_save {cfg['modules_to_save']} is not supported (only LoRA deltas)")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"bias={cfg['bias']!r} is not supported (only 'none')")
    _check_targets(cfg.get("target_modules"))
    r = cfg.get("r", 8)
    if not _is_int(r) or r < 1:
        raise AdapterError(f"r={repr(r)[:40]} must be a positive integer")
    _check_alpha("lora_alpha", cfg.get("lora_alpha", 8))
    if not isinstance(cfg.get("use_rslora", False), bool | None):
        raise AdapterError(f"use_rslora={cfg['use_rslora']!r} must be true or false")
    for key, value in _patterns(cfg, "alpha_pattern").items():
        _check_alpha(f"alpha_pattern[{key!r}]", value)
    for key, value in _patterns(cfg, "rank_pattern").items():
        if not _is_int(value) or value < 1:
            raise AdapterError(f"rank_pattern[{key!r}]={repr(value)[:40]} must be a positive integer")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_alpha(name: str, value: object) -> None:
    try:
        finite = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # a JSON integer too large for a float
        finite = False
    if not finite:
        raise AdapterError(f"{name}={repr(value)[:40]} must be a finite number")


def _check_targets(targets: object) -> None:
    """A list of module names, or a string (PEFT: a regex over module names, never compiled here: which
    modules an adapter changes comes from its tensors)."""
    if targets is None or (isinstance(targets, str) and len(targets) <= MAX_PATTERN_KEY):
        return
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"target_modules must be a list of module names (or a string of at most {MAX_PATTERN_KEY})")
    unknown = sorted(set(targets) - set(TARGET_MODULES) - set(FUSED_PROJECTIONS))
    if unknown:
        known = ", ".join((*TARGET_MODULES, *FUSED_PROJECTIONS))
        raise AdapterError(f"unknown target modules {unknown}; supported: {known}")


def _patterns(cfg: dict, name: str) -> dict:
    """alpha_pattern / rank_pattern, checked: an object of at most MAX_PATTERNS module-name keys."""
    patterns = cfg.get(name) or {}
    if not isinstance(patterns, dict):
        raise AdapterError(f"{name} must be an object mapping module names to values")
    if len(patterns) > MAX_PATTERNS:
        raise AdapterError(f"{name} has {len(patterns)} entries; at most {MAX_PATTERNS} are supported")
    for key in patterns:
        body = key.removeprefix("^")
        if not body or len(body) > MAX_PATTERN_KEY or not set(body) <= _PATTERN_KEY_CHARS:
            raise AdapterError(
                f"{name} key {key[:80]!r}: expected a module name or suffix such as 'q_proj' or "
                "'layers.3.self_attn.q_proj' (optionally with a leading '^'); regular expressions are not supported"
            )
    return patterns


def _pattern_value(patterns: dict, module_path: str, default: float) -> float:
    """The value of the first key naming module_path, as PEFT's (.*\\.)?(key)$: the whole name, or a suffix
    after a dot; a leading '^' asks for the whole name. String comparison, linear in the key's length."""
    for key, value in patterns.items():
        if key.startswith("^"):
            if module_path == key[1:]:
                return value
        elif module_path == key or module_path.endswith("." + key):
            return value
    return default


def _scale(cfg: dict, module_path: str, rank: int) -> float:
    """alpha / r (or / sqrt(r) for rsLoRA) of one module; cfg as read_adapter_config checked it."""
    alpha = _pattern_value(cfg.get("alpha_pattern") or {}, module_path, cfg.get("lora_alpha", 8))
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    if not abs(scale) <= MAX_ABS_SCALE:
        raise AdapterError(
            f"{module_path}: lora_alpha {alpha!r} over rank {rank} gives scale {scale:g}; "
            f"at most {MAX_ABS_SCALE:g} in magnitude is supported"
        )
    return scale


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        if (path / "adapter_model.bin").is_file():
            raise AdapterError("adapter_model.bin (pickle) is refused: convert the adapter to safetensors")
        raise AdapterError(f"{path} has no adapter_model.safetensors")
    try:
        return load_file(str(weights), device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"adapter_model.safetensors is unreadable or truncated: {exc}") from exc


def load_lora(
    path: Path, adapter_id: str, args: ModelArgs, max_rank: int, dtype: torch.dtype, pin: bool = False
) -> LoRAWeights:
    """Read and validate a PEFT adapter directory. Raises AdapterError with the reason. The tensors end up as
    views into one buffer (`flat`), in page-locked memory with `pin` (an engine on CUDA)."""
    cfg = read_adapter_config(path)
    raw = _read_tensors(path)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    paths: dict[tuple[int, str], str] = {}  # PEFT's module name, as alpha_pattern / rank_pattern match it
    vision = {key for key in raw if any(part in key for part in VISION_MODULES)}
    if vision:  # text prompts never run the vision tower: its LoRA changes nothing this server serves
        log.info(
            "adapter %s: %d tensors on the vision tower left out (only the language model is served)",
            adapter_id,
            len(vision),
        )
    for key, tensor in raw.items():
        if key in vision:
            continue
        m = _KEY.search(key)
        if m is None:
            raise AdapterError(f"unexpected tensor {key!r}: only lora_A/lora_B of {', '.join(TARGET_MODULES)}")
        layer, module, which = int(m[1]), m[3], m[4]
        if module not in TARGET_MODULES:
            _check_fused(module, key, args)
        if layer >= args.num_layers:
            raise AdapterError(f"{key!r}: layer {layer} but the base model has {args.num_layers} layers")
        module_path = key[: m.end(3)].removeprefix("base_model.model.")
        if paths.setdefault((layer, module), module_path) != module_path or which in pairs.get((layer, module), {}):
            raise AdapterError(
                f"layer {layer} {module}: lora_{which} under two names ({paths[(layer, module)]!r}, {key!r})"
            )
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        only = "; it adapts only the vision tower, and only the language model is served" if vision else ""
        raise AdapterError(f"the adapter holds no LoRA tensors{only}")
    shapes = module_shapes(args)
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in sorted(pairs.items()):
        a, b = _check_pair(cfg, paths[(layer, module)], ab, shapes[module], max_rank, dtype)
        for sub, sub_b in _split_fused(module, b, shapes):
            if (layer, sub) in tensors:
                raise AdapterError(f"layer {layer} {sub}: targeted both alone and through {module}")
            tensors[(layer, sub)] = (a, sub_b)
    rank = max(a.shape[0] for a, _ in tensors.values())
    modules = sorted({m for _, m in tensors}, key=TARGET_MODULES.index)
    flat, tensors = _in_one_buffer(tensors, dtype, pin)
    return LoRAWeights(adapter_id, rank, modules, tensors, cfg, flat)


def _in_one_buffer(
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype, pin: bool
) -> tuple[torch.Tensor, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]]:
    """The pairs copied into one buffer, each now a view of it. On CUDA a slot load then makes one transfer of
    the buffer, from page-locked memory (`pin`) so that it neither waits for the GPU's queued work (a copy from
    pageable memory synchronizes its stream first) nor stages through a bounce buffer, instead of one
    synchronous copy per layer and module (256 for q, k, v and o on 32 layers). torch's pinned allocator
    keeps the buffer's block until such a copy has completed, so evicting the adapter meanwhile is safe."""
    unique = {id(t): t for pair in tensors.values() for t in pair}  # a fused module's projections share one A
    flat = torch.empty(sum(t.numel() for t in unique.values()), dtype=dtype, pin_memory=pin)
    placed: dict[int, torch.Tensor] = {}
    offset = 0
    for key, t in unique.items():
        placed[key] = flat[offset : offset + t.numel()].view(t.shape)
        placed[key].copy_(t)
        offset += t.numel()
    return flat, {key: (placed[id(a)], placed[id(b)]) for key, (a, b) in tensors.items()}


def _check_fused(module: str, key: str, args: ModelArgs) -> None:
    if module not in FUSED_PROJECTIONS:
        raise AdapterError(f"unknown target module {module!r} in {key!r}")
    if not args.fused_projections:
        parts = ", ".join(FUSED_PROJECTIONS[module])
        raise AdapterError(
            f"target module {module!r} is a fused projection (Phi-3); this {args.model_type} base model has "
            f"{parts} apart: was the adapter trained on another model?"
        )


def _split_fused(module: str, b: torch.Tensor, shapes: dict[str, tuple[int, int]]) -> list[tuple[str, torch.Tensor]]:
    """(projection, B rows) pairs: a fused module's B split by its projections' widths; else (module, B)."""
    if module not in FUSED_PROJECTIONS:
        return [(module, b)]
    names = FUSED_PROJECTIONS[module]
    return list(zip(names, (p.contiguous() for p in b.split([shapes[n][1] for n in names])), strict=True))


def _check_pair(
    cfg: dict,
    path: str,
    ab: dict[str, torch.Tensor],
    shape: tuple[int, int],
    max_rank: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """path: the module's PEFT name (model.layers.3.self_attn.q_proj)."""
    where = path
    if set(ab) != {"A", "B"}:
        raise AdapterError(f"{where}: lora_A and lora_B must come in pairs")
    a, b = ab["A"], ab["B"]
    in_f, out_f = shape
    rank = a.shape[0] if a.dim() == 2 else -1
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape[0] != out_f or b.shape[1] != rank:
        raise AdapterError(
            f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base "
            f"model (expected [r, {in_f}] and [{out_f}, r]); was it trained on another model?"
        )
    if rank > max_rank:
        raise AdapterError(f"{where}: rank {rank} exceeds --max-lora-rank {max_rank}")
    expected = _pattern_value(cfg.get("rank_pattern") or {}, path, cfg.get("r", rank))
    if expected != rank:
        raise AdapterError(f"{where}: tensors have rank {rank} but adapter_config.json says {expected}")
    folded_a, folded_b = a.to(dtype).contiguous(), (b.float() * _scale(cfg, path, rank)).to(dtype).contiguous()
    _check_magnitude(f"{where}: lora_A", folded_a)
    _check_magnitude(f"{where}: lora_B times its scale", folded_b)
    return folded_a, folded_b


def _check_magnitude(what: str, tensor: torch.Tensor) -> None:
    """Finite and within MAX_ABS_WEIGHT, in the dtype the engine multiplies (a cast may overflow)."""
    peak = tensor.abs().max().item() if tensor.numel() else 0.0  # max propagates NaN
    if not math.isfinite(peak):
        raise AdapterError(f"{what} holds NaN or infinity in {str(tensor.dtype).removeprefix('torch.')}")
    if peak > MAX_ABS_WEIGHT:
        raise AdapterError(f"{what} reaches {peak:g}; at most {MAX_ABS_WEIGHT:g} in magnitude is supported")
