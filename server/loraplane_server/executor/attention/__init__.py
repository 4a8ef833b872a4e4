"""Attention backends (base.py), one module per implementation; `resolve` picks one once at engine start.

May import: executor.forward_batch, kernels.
"""

from __future__ import annotations

import torch

from loraplane_server.executor.attention.base import AttentionBackend
from loraplane_server.executor.attention.cpu_kernel import CPUKernelAttention
from loraplane_server.executor.attention.torch_ref import TorchAttention
from loraplane_server.executor.attention.triton import TritonAttention
from loraplane_server.kernels import cpu_kernels, triton_attention

__all__ = ["AttentionBackend", "CPUKernelAttention", "TorchAttention", "TritonAttention", "resolve"]


def resolve(requested: str, device: torch.device) -> AttentionBackend:
    """The configured attention_backend (auto | torch | cpu_kernel | triton) as an object. auto: Triton on
    CUDA, the compiled CPU kernel on the CPU when it builds here, torch otherwise. An explicit backend that
    cannot run here fails now, not at the first step."""
    if requested == "triton" or (requested == "auto" and device.type == "cuda"):
        if triton_attention.triton_available():
            return TritonAttention()
        if requested == "triton":
            raise RuntimeError("attention_backend=triton: triton is not usable here (needs CUDA or TRITON_INTERPRET=1)")
        return TorchAttention()
    if requested == "cpu_kernel":
        if device.type != "cpu":
            raise ValueError("attention_backend=cpu_kernel runs on the CPU only")
        if not cpu_kernels.load():
            raise RuntimeError(f"attention_backend=cpu_kernel: the kernel did not build: {cpu_kernels.load_error()}")
        return CPUKernelAttention()
    if requested == "auto" and device.type == "cpu" and cpu_kernels.load():
        return CPUKernelAttention()
    return TorchAttention()
