"""Every configured backend resolved once at engine start, from the config and the machine: the model
runner and the model's layers read them from here, never from a step's batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplane_server.config import EngineConfig
from loraplane_server.executor.attention import AttentionBackend
from loraplane_server.executor.attention import resolve as resolve_attention
from loraplane_server.executor.lora.backends import LoRABackend
from loraplane_server.executor.lora.backends import resolve as resolve_lora
from loraplane_server.kernels import cpu_kernels


@dataclass(frozen=True)
class Backends:
    attention: AttentionBackend
    # bf16 on the CPU: the compiled linear, fused norm/rotary/activation and BGMV kernels (layers/*.py)
    layer_kernels: bool
    lora: LoRABackend
    # layers before the last through cpu_kernels.decoder_layer where the model and the step allow it
    # (executor/models/llama.py); off: the Python layers, the same kernels one by one
    fuse_layers: bool
    # CUDA (or the Triton interpreter): the norm with the residual add, rotary and SiLU-and-multiply as one Triton
    # kernel each (kernels/triton_layer_ops.py); the linear layers stay torch's
    layer_triton: bool = False

    @property
    def layer_backend(self) -> str:
        """The resolved layer_backend: cpu_kernel, triton or torch."""
        return "cpu_kernel" if self.layer_kernels else "triton" if self.layer_triton else "torch"

    def to_dict(self) -> dict[str, str | bool]:
        """Every backend chosen, by concern, for /v1/debug/engine."""
        return {
            "attention": self.attention.name,
            "layers": self.layer_backend,
            "lora": self.lora.name,
            "fuse_layers": self.fuse_layers,
        }

    def describe(self, fused: bool) -> str:
        """The paths this engine runs, for its start-up log line and /v1/debug/engine; fused: whether the
        model's layers run as the one-call CPU layer (the switch and the model family both allow it)."""
        return (
            f"attention {self.attention.name}, layers {self.layer_backend}"
            f"{' (one call per decoder layer)' if fused else ''}, LoRA {self.lora.name}"
        )


def resolve_backends(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> Backends:
    """The attention, layer and LoRA backends the config asks for, as they run on `device` in `dtype`.
    An explicit backend that cannot run here fails now, not at the first step."""
    attention = resolve_attention(config.attention_backend, device)
    layer_kernels = _layer_kernels(config.layer_backend, device, dtype)
    attention.kernel_kv_write = layer_kernels
    lora = resolve_lora(config.lora_backend, "cpu_kernel" if layer_kernels else "torch", device)
    return Backends(attention, layer_kernels, lora, config.fuse_layers, _layer_triton(config.layer_backend, device))


def _layer_triton(requested: str, device: torch.device) -> bool:
    """auto: the Triton layer ops on CUDA where triton imports; triton: them wherever triton runs (CUDA, or the
    interpreter), else an error now."""
    from loraplane_server.kernels.triton_lora import triton_available

    if requested == "triton":
        if not triton_available():
            raise ValueError("layer_backend=triton needs triton and a CUDA device (or TRITON_INTERPRET=1)")
        return True
    return requested == "auto" and device.type == "cuda" and triton_available()


def _layer_kernels(requested: str, device: torch.device, dtype: torch.dtype) -> bool:
    """auto: the compiled bf16 layer kernels (linear, fused norm/rotary/activation, BGMV, the one-call
    decoder layer) on the CPU in bf16 when the library holds them (built for AVX-512 BF16 or AVX2);
    torch otherwise."""
    if requested == "cpu_kernel":
        if device.type != "cpu":
            raise ValueError("layer_backend=cpu_kernel runs on the CPU only")
        if dtype != torch.bfloat16:
            raise ValueError("layer_backend=cpu_kernel needs dtype bfloat16 (its kernels are bf16)")
        if not cpu_kernels.load():
            raise RuntimeError(f"layer_backend=cpu_kernel: the kernel did not build: {cpu_kernels.load_error()}")
        if not cpu_kernels.has_bf16_kernels():
            raise RuntimeError(
                f"layer_backend=cpu_kernel needs the kernels' bf16 paths; {cpu_kernels.missing_bf16_kernels()}. "
                "Use layer_backend auto or torch."
            )
        return True
    return requested == "auto" and device.type == "cpu" and dtype == torch.bfloat16 and cpu_kernels.has_bf16_kernels()
