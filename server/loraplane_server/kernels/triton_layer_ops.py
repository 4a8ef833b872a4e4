"""The decoder layer's elementwise work on CUDA as one Triton kernel each (layer_backend triton): the residual add
with RMSNorm, rotary on q and k in place, and SiLU-and-multiply.

In torch these are 5, about 8 and 2 kernels a layer (casts, concatenations and products each their own launch):
on an H200 a SmolLM2 batch-1 decode step was ~1,000 launches, 2.3 ms of GPU time for 0.07 ms of weights
(docs/gpu/). Each kernel rounds where the torch code rounds (to the model's dtype after each product and sum),
so rotary and the residual add give the same bits; the norm and SiLU differ from torch's only by the last bit of
their fp32 reductions and exponentials.

Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (set before triton is first imported).
"""

from __future__ import annotations

import torch

from loraplane_server.kernels.triton_lora import _HAS_TRITON, _jit

if _HAS_TRITON:
    import triton
    import triton.language as tl


@_jit
def _add_rms_norm_kernel(
    res_ptr: tl.tensor,  # [T, N], updated in place with delta
    delta_ptr: tl.tensor,  # [T, N] (unused when HAS_DELTA is false)
    weight_ptr: tl.tensor,  # [N]
    out_ptr: tl.tensor,  # [T, N]
    num_cols: int,
    stride_res: int,
    stride_delta: int,
    stride_out: int,
    eps: float,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0)
        r = (r.to(tl.float32) + d.to(tl.float32)).to(r.dtype)  # residual.add_(delta): rounded to the dtype
        tl.store(res_ptr + row * stride_res + cols, r, mask=mask)
    x = r.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / num_cols
    normed = (x * tl.math.rsqrt(variance + eps)).to(r.dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(r.dtype), mask=mask)


@_jit
def _rotary_kernel(
    x_ptr: tl.tensor,  # [T, H, D], rotated in place
    cos_ptr: tl.tensor,  # [T, D]
    sin_ptr: tl.tensor,  # [T, D]
    stride_xt: int,
    stride_xh: int,
    stride_ct: int,
    half: int,
    BLOCK_H: tl.constexpr,
) -> None:
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < half
    base = x_ptr + t * stride_xt + head * stride_xh
    x1 = tl.load(base + offs, mask=mask, other=0.0)
    x2 = tl.load(base + half + offs, mask=mask, other=0.0)
    dtype = x1.dtype
    c1 = tl.load(cos_ptr + t * stride_ct + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + half + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_ct + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_ct + half + offs, mask=mask, other=0.0).to(tl.float32)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1], each product and the sum rounded as torch does
    lo = ((f1 * c1).to(dtype).to(tl.float32) + (-f2 * s1).to(dtype).to(tl.float32)).to(dtype)
    hi = ((f2 * c2).to(dtype).to(tl.float32) + (f1 * s2).to(dtype).to(tl.float32)).to(dtype)
    tl.store(base + offs, lo, mask=mask)
    tl.store(base + half + offs, hi, mask=mask)


@_jit
def _silu_mul_kernel(
    gu_ptr: tl.tensor,  # [T, 2I]: gate then up
    out_ptr: tl.tensor,  # [T, I]
    inter: int,
    stride_gu: int,
    stride_out: int,
    BLOCK: tl.constexpr,
) -> None:
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # F.silu(gate), rounded to the dtype, then * up
    tl.store(out_ptr + row * stride_out + cols, (silu.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += delta in place (when given), then weight * rms_norm(residual) in fp32, rounded to the dtype.
    residual, delta [T, N] with unit column stride; weight [N]."""
    num_rows, num_cols = residual.shape
    if residual.stride(1) != 1 or (delta is not None and (delta.shape != residual.shape or delta.stride(1) != 1)):
        raise ValueError(f"add_rms_norm: rows of unit stride expected, got {tuple(residual.stride())}")
    out = torch.empty_like(residual)
    if num_rows == 0:
        return out
    block = triton.next_power_of_2(num_cols)
    _add_rms_norm_kernel[(num_rows,)](
        residual, residual if delta is None else delta, weight, out,
        num_cols, residual.stride(0), 0 if delta is None else delta.stride(0), out.stride(0), eps,
        HAS_DELTA=delta is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip
    return out


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """q [T, H, D] and k [T, KVH, D] rotated in place (unit stride over D; rows and heads any stride) by
    cos, sin [T, D] or [T, 1, D] (whole heads rotated: the half-split form of Llama's rotary)."""
    cos, sin = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)
    head_dim = q.shape[-1]
    if cos.shape[-1] != head_dim or head_dim % 2 or cos.stride(1) != 1 or cos.stride() != sin.stride():
        raise ValueError(f"rotary_: cos {tuple(cos.shape)} for heads of {head_dim} (whole heads, unit stride)")
    half = head_dim // 2
    for x in (q, k):
        if x.shape[0] == 0:
            continue
        if x.stride(-1) != 1:
            raise ValueError("rotary_: unit stride over the head dimension expected")
        _rotary_kernel[(x.shape[0], x.shape[1])](
            x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), half, BLOCK_H=triton.next_power_of_2(half)
        )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up) -> silu(gate) * up [T, I], each rounded to the dtype as F.silu(gate) * up."""
    num_rows, width = gate_up.shape
    if width % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_mul: [T, 2I] with unit column stride expected, got {tuple(gate_up.shape)}")
    inter = width // 2
    out = torch.empty(num_rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if num_rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(num_rows, triton.cdiv(inter, block))](
        gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block
    )
    return out
