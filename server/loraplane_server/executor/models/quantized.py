"""Checkpoints whose linear weights are already int8 (issue 24): compressed-tensors, as llm-compressor writes
it, and GGUF Q8_0, which gguf_models.py converts into the same layout (one int8 byte per weight, the GGUF's
scale per 32 weights as a group scale).

What is served: symmetric int8 weights, a scale per output channel or per group of input columns. The kernels
take a scale per output channel (executor/layers/quant.py), so group scales are requantized at load: the row's weights,
q * group scale, quantized again per channel (logged once). Activations are always the engine's own: a W8A8
checkpoint's activation settings are ignored (the CPU kernels quantize activations per row where they pay).

Everything else a checkpoint may announce (GPTQ, AWQ, bitsandbytes, fp8, int4, asymmetric, a quantized KV
cache) is refused when config.json is read, before any weight is fetched, with what to serve instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where tensors are handled: the model cache reads configs without it
    import torch

log = logging.getLogger("loraplane.model")

SUPPORTED = (
    "compressed-tensors int8 weights (symmetric, a scale per output channel or per group; the pack-quantized, "
    "int-quantized and naive-quantized formats) and GGUF Q8_0"
)
FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
# the tensors compressed-tensors writes beside a quantized module's weight (weight_packed replaces weight)
QUANT_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
ACTIVATION_PARTS = ("input_scale", "input_zero_point", "output_scale", "output_zero_point")


class UnsupportedQuantizationError(ValueError):
    """config.json announces a quantization this engine does not load; says what to serve instead."""


@dataclass(frozen=True)
class Int8Checkpoint:
    """What a loadable int8 checkpoint announces."""

    method: str  # compressed-tensors
    formats: tuple[str, ...]
    strategies: tuple[str, ...]  # channel and/or group
    activations: bool  # a W8A8 checkpoint (its activation settings are not used)

    def describe(self) -> str:
        kind = "W8A8 (activations: the engine's own)" if self.activations else "W8A16"
        return f"{self.method} int8 {kind}, {'/'.join(self.strategies)} scales, {'/'.join(self.formats)}"


def _refuse(what: str) -> UnsupportedQuantizationError:
    return UnsupportedQuantizationError(
        f"config.json: {what} is not supported; loraplane loads {SUPPORTED}. Serve the unquantized checkpoint "
        "instead, with --quantization int8 to quantize it at load"
    )


def checkpoint_quantization(config: dict[str, Any]) -> Int8Checkpoint | None:
    """The quantization config.json announces (None: an ordinary float checkpoint); raises
    UnsupportedQuantizationError for one the engine cannot serve."""
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise _refuse(f"quantization_config {qc!r}")
    method = str(qc.get("quant_method", "")).lower()
    if method != "compressed-tensors":
        name = method or "a quantization_config without quant_method"
        if qc.get("load_in_4bit") or qc.get("load_in_8bit"):
            name = "bitsandbytes"
        raise _refuse(f"quant_method {name!r}")
    if qc.get("kv_cache_scheme"):
        raise _refuse("a quantized KV cache (kv_cache_scheme)")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise _refuse("compressed-tensors without config_groups")
    top_format = qc.get("format")
    formats: set[str] = set()
    strategies: set[str] = set()
    activations = False
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise _refuse(f"config group {name!r}")
        fmt = group.get("format") or top_format
        if fmt not in FORMATS:
            raise _refuse(f"compressed-tensors format {fmt!r} (group {name})")
        weights = group.get("weights")
        if not isinstance(weights, dict):
            raise _refuse(f"config group {name!r} without weight quantization")
        kind = (weights.get("type"), weights.get("num_bits"))
        if kind != ("int", 8):
            raise _refuse(f"{kind[0]}{kind[1]} weights (group {name})")
        if weights.get("symmetric") is False:
            raise _refuse(f"asymmetric int8 weights (group {name}, zero points)")
        if weights.get("actorder") not in (None, False, "static"):
            raise _refuse(f"activation-ordered groups (actorder={weights['actorder']!r}, group {name})")
        strategy = weights.get("strategy")
        if strategy not in ("channel", "group"):
            raise _refuse(f"int8 weights with a {strategy!r} scale (group {name}); per channel or group are")
        if strategy == "group" and not (isinstance(weights.get("group_size"), int) and weights["group_size"] > 0):
            raise _refuse(f"group scales without a positive group_size (group {name})")
        acts = group.get("input_activations")
        if acts:
            if not isinstance(acts, dict) or (acts.get("type"), acts.get("num_bits")) != ("int", 8):
                raise _refuse(f"activations quantized as {acts!r} (group {name})")
            activations = True
        formats.add(str(fmt))
        strategies.add(str(strategy))
    return Int8Checkpoint(method, tuple(sorted(formats)), tuple(sorted(strategies)), activations)


def compressed_tensors_config(group_size: int | None, ignore: list[str]) -> dict[str, Any]:
    """The quantization_config of a naive-quantized int8 W8A16 checkpoint (gguf_models.py writes Q8_0 so)."""
    weights: dict[str, Any] = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False}
    weights |= {"strategy": "group", "group_size": group_size} if group_size else {"strategy": "channel"}
    return {
        "quant_method": "compressed-tensors",
        "format": "naive-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
        "ignore": ignore,
    }


def is_quant_part(part: str) -> bool:
    return part in QUANT_PARTS or part in ACTIVATION_PARTS


def unpack_int8(packed: torch.Tensor, shape: torch.Tensor | None) -> torch.Tensor:
    """pack-quantized int8 -> int8 [N, K]. compressed-tensors packs each value as value + 128 into an int32, four
    to a word, element i at bits 8 * (i % 4) of word i // 4 (its pack_to_int32), so the words' little-endian
    bytes are the values in order. Done here rather than through compressed_tensors, which the server does not
    depend on: for 8 bits the layout is this one view."""
    import torch

    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"weight_packed: expected int32 [N, K/4], got {packed.dtype} {tuple(packed.shape)}")
    n = packed.shape[0]
    k = int(shape[-1]) if shape is not None else packed.shape[1] * 4
    if shape is not None and (int(shape[0]) != n or not 0 < k <= packed.shape[1] * 4):
        raise ValueError(f"weight_shape {shape.tolist()} does not match weight_packed {tuple(packed.shape)}")
    as_bytes = packed.contiguous().view(torch.uint8).reshape(n, -1)[:, :k]
    return (as_bytes.to(torch.int16) - 128).to(torch.int8)


def to_channel_int8(q: torch.Tensor, scale: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A checkpoint's int8 weight q [N, K] with scale [N], [N, 1] (per channel) or [N, K / g] (per group of g
    input columns) -> (q int8 [N, K], scale fp32 [N], how many weights were -128), what the kernels take.

    Group scales are requantized: a row block at a time, w = q * its group scale, quantized again per output
    channel. compressed-tensors' symmetric range is -128..127 (its scale is amax / 127.5), but the kernels'
    AVX2 GEMM flips the weight's sign (vpmaddubsw's sign trick), so -128 becomes -127: one step on the few
    weights that sit at a row's negative extreme (requantized group scales never give -128)."""
    import torch

    from loraplane_server.executor.layers.quant import INT8_MAX, quantize_int8

    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"{name}: expected an int8 [N, K] weight, got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    s = scale.float()
    if s.dim() == 1:
        s = s[:, None]
    if s.dim() != 2 or s.shape[0] != n or s.shape[1] == 0 or k % s.shape[1]:
        raise ValueError(f"{name}: weight_scale {tuple(scale.shape)} does not fit the weight {tuple(q.shape)}")
    if not bool(torch.isfinite(s).all()):
        raise ValueError(f"{name}: weight_scale holds non-finite values")
    if s.shape[1] == 1:
        low = q == -INT8_MAX - 1
        clamped = int(low.sum())
        return q.masked_fill(low, -INT8_MAX).contiguous(), s[:, 0].abs().contiguous(), clamped
    group = k // s.shape[1]
    out = torch.empty_like(q)
    channel = torch.empty(n, dtype=torch.float32)
    step = max(1, (1 << 22) // k)
    for lo in range(0, n, step):
        w = (q[lo : lo + step].float().view(-1, s.shape[1], group) * s[lo : lo + step, :, None]).view(-1, k)
        out[lo : lo + step], channel[lo : lo + step], _ = quantize_int8(w)
    return out, channel, 0


def dequantize_parts(parts: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """A quantized module's tensors (weight or weight_packed, weight_scale, weight_shape) -> its float weight,
    for a module the engine keeps in the compute dtype (an lm_head quantized in the checkpoint)."""
    q, scale, _ = int8_parts(parts, name)
    return q.float() * scale[:, None]


def int8_parts(parts: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A quantized module's tensors -> to_channel_int8's (q int8 [N, K], scale fp32 [N], weights at -128)."""
    if "weight_zero_point" in parts:
        raise ValueError(f"{name}: zero points (asymmetric int8) are not supported")
    if "weight_g_idx" in parts:
        raise ValueError(f"{name}: activation-ordered groups (weight_g_idx) are not supported")
    if "weight_packed" in parts:
        q = unpack_int8(parts["weight_packed"], parts.get("weight_shape"))
    elif "weight" in parts:
        q = parts["weight"]
    else:
        raise ValueError(f"{name}: weight_scale without an int8 weight")
    return to_channel_int8(q, parts["weight_scale"], name)


def log_load(model_name: str, checkpoint: Int8Checkpoint, modules: int, clamped: int) -> None:
    """One line for the whole load: what the checkpoint was and what became of it."""
    notes = []
    if "group" in checkpoint.strategies:
        notes.append("group scales requantized to one scale per output channel (the kernels' layout)")
    if clamped:
        notes.append(f"{clamped} weights at -128 taken to -127")
    extra = f"; {'; '.join(notes)}" if notes else ""
    log.info("%s: %d int8 projections from %s%s", model_name, modules, checkpoint.describe(), extra)
