"""LoRA backends (base.py), one module per implementation; `resolve` picks one once at engine start.

May import: executor.lora.layout, executor.lora.slots, kernels.
"""

from __future__ import annotations

import torch

from loraplane_server.executor.lora.backends.base import LoRABackend, LoRABatch
from loraplane_server.executor.lora.backends.cpu_kernel import CPUKernelBackend
from loraplane_server.executor.lora.backends.torch_ref import TorchBackend
from loraplane_server.executor.lora.backends.triton import TritonBackend

__all__ = ["CPUKernelBackend", "LoRABackend", "LoRABatch", "TorchBackend", "TritonBackend", "resolve"]


def resolve(requested: str, layer_backend: str, device: torch.device) -> LoRABackend:
    """The configured lora_backend (auto | torch | triton) as an object, from the resolved layer_backend.
    triton, or auto on CUDA: Triton SGMV (triton anywhere, for TRITON_INTERPRET=1). Otherwise the CPU
    paths: the CPU kernel where the layers run on it (layer_backend cpu_kernel: the CPU in bf16, the
    kernels built with AVX-512 BF16), torch matmuls elsewhere."""
    if requested == "triton" or (requested == "auto" and device.type == "cuda"):
        return TritonBackend(device)
    if layer_backend == "cpu_kernel":
        return CPUKernelBackend(device)
    return TorchBackend(device)
