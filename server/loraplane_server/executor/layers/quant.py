"""int8 base weights (EngineConfig.quantization = int8): symmetric, one scale per output channel.

A linear layer's weight W [N, K] becomes q = round(W / s) in [-127, 127] with s[n] = max_k |W[n, k]| / 127, so
row n of W is s[n] * q[n] to within s[n] / 2 per element; wsum[n] = sum_k q[n, k] rides along for the CPU
kernel's int8 GEMM (it shifts activations to unsigned for VNNI and takes 128 * wsum back out). The embedding,
lm_head, norms, LoRA adapters, activations and the KV cache keep the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INT8_MAX = 127  # symmetric: -128 is never used, so |q| <= 127 and -q is always representable


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] (any float dtype) -> (q int8 [N, K], scale fp32 [N], wsum int32 [N]); a row of zeros gets
    scale 1 (and stays zeros). Computed in fp32, one row block at a time, so a large layer never needs a
    whole fp32 copy."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_int8: weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    n = weight.shape[0]
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(n, dtype=torch.float32, device=weight.device)
    step = max(1, (1 << 22) // max(1, weight.shape[1]))  # ~16 MiB of fp32 at a time
    for lo in range(0, n, step):
        w = weight[lo : lo + step].float()
        s = w.abs().amax(dim=1) / INT8_MAX
        s = torch.where(s > 0, s, torch.ones_like(s))
        q[lo : lo + step] = torch.round(w / s[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        scale[lo : lo + step] = s
    return q, scale, q.sum(dim=1, dtype=torch.int32)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """scale[:, None] * q in dtype (what the weight is, to within the quantization)."""
    return (q.float() * scale[:, None]).to(dtype)


def torch_int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ (scale * q)^T (+ bias) with torch alone: the path where no kernel runs (fp32 or fp16 on the CPU, a
    CPU build without the kernels). q's values are exact in any float dtype, so the product is x @ q^T with
    the scale applied per output column after it; costs a cast of q per call."""
    out = F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)
    return out if bias is None else out + bias
