"""Weight-only int8 linear in Triton: y = x @ (scale[:, None] * w).T (+ bias), w never dequantized to memory.

w is int8 [N, K], symmetric per output channel (w_real[n] ~= scale[n] * w[n]). Each program loads a tile
of x and a tile of w, converts the int8 tile to x's compute type in registers (exact: |w| <= 127 fits
bf16's 8-bit significand), accumulates in fp32, and applies the scale and bias once in the epilogue
before one rounding to x's dtype. So a decode step streams 1 byte per weight instead of 2.

`int8_linear_silu_mul` runs the MLP's merged gate|up weight [2I, K]: a program holds the gate and the
up tile of the same I columns and writes silu(gate) * up, so the [M, 2I] product never reaches memory.

Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (set before triton is first imported).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from loraplane_server.kernels.triton_lora import _HAS_TRITON, _is_interpreting, _jit, triton_available

if _HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["int8_linear", "int8_linear_silu_mul", "triton_available"]


@dataclass(frozen=True)
class _Tiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Chosen on an H100 over Llama-3-8B's layer shapes (bench/gpu_check_int8.py). tl.dot needs >= 16 on
# every dim, so decode pads its few rows to 16 and is bound by streaming w: narrow N tiles give every SM
# programs with loads in flight, long K tiles amortise the loop (up to 32 rows, as fast as 1 row).
_DECODE = _Tiles(block_m=16, block_n=32, block_k=256, num_warps=4, num_stages=4)
_MEDIUM = _Tiles(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4)
# prefill is bound by the tensor cores: big tiles reuse each loaded tile across 128 rows or columns, but
# only pay once there are enough of them to fill the GPU
_PREFILL = _Tiles(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
_DECODE_MAX_ROWS = 32
_PREFILL_MIN_PROGRAMS = 128  # about one per SM of an H100 (132)


def _pick_tiles(num_rows: int, num_cols: int, is_silu_mul: bool) -> _Tiles:
    """The tiles for an [num_rows, num_cols] output (num_cols: I, not 2I, for silu_mul)."""
    num_big_tiles = triton.cdiv(num_rows, _PREFILL.block_m) * triton.cdiv(num_cols, _PREFILL.block_n)
    if num_rows <= _DECODE_MAX_ROWS:
        tiles = _DECODE
    elif num_big_tiles >= _PREFILL_MIN_PROGRAMS:
        tiles = _PREFILL
    else:
        tiles = _MEDIUM
    if is_silu_mul and tiles.block_n > 64:
        # two fp32 accumulators (gate, up) per program: halve the columns to keep them in registers
        tiles = replace(tiles, block_n=tiles.block_n // 2)
    return tiles


# kernel


@_jit
def _scale_bias(
    acc: tl.tensor,  # [BM, BN] fp32
    scale_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    offs_n: tl.tensor,  # [BN]
    n_mask: tl.tensor,  # [BN]
    HAS_BIAS: tl.constexpr,
) -> tl.tensor:
    scale = tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)
    out = acc * scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    return out


@_jit
def _int8_matmul_kernel(
    x_ptr: tl.tensor,  # [M, K], rows stride_xm apart
    w_ptr: tl.tensor,  # [N, K] int8, rows stride_wn apart; with SILU_MUL [2N, K]: N gate rows, then N up rows
    scale_ptr: tl.tensor,  # [N] fp32 ([2N] with SILU_MUL)
    bias_ptr: tl.tensor,  # like scale, in x's dtype; never read without HAS_BIAS
    y_ptr: tl.tensor,  # [M, N], rows stride_ym apart
    num_m: int,
    num_n: int,
    num_k: int,
    stride_xm: int,
    stride_wn: int,
    stride_ym: int,
    up_offset: int,  # SILU_MUL: elements from a gate row to its up row (a host int: int64 when large)
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    # m tiles vary fastest, so the programs resident together share one w tile (read from HBM once)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # the tile's corner as an int64 base (M * stride or N * K can pass 2**31 on big layers); the offsets
    # inside a tile stay int32 with K at unit stride, which is what lets triton vectorise the loads: a
    # runtime K stride made the kernel 5-10x slower on an H100
    x_ptr += pid_m.to(tl.int64) * BLOCK_M * stride_xm
    w_ptr += pid_n.to(tl.int64) * BLOCK_N * stride_wn
    y_ptr += pid_m.to(tl.int64) * BLOCK_M * stride_ym
    rows = tl.arange(0, BLOCK_M)  # [BM]
    cols = tl.arange(0, BLOCK_N)  # [BN]
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    m_mask = rows < num_m - pid_m * BLOCK_M
    offs_n = pid_n * BLOCK_N + cols
    n_mask = offs_n < num_n
    x_tile = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
    # w in its own [BN, BK] order, transposed only as a dot operand: loaded as [BK, BN] the int8
    # widening ran 2.5x (decode) to 10x (prefill) slower on an H100
    w_tile = w_ptr + cols[:, None] * stride_wn + offs_k[None, :]  # [BN, BK]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # dead code unless SILU_MUL
    for k0 in range(0, num_k, BLOCK_K):
        k_mask = offs_k < num_k - k0
        xv = tl.load(x_tile, mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(DOT_DTYPE)
        w_mask = n_mask[:, None] & k_mask[None, :]
        wv = tl.load(w_tile, mask=w_mask, other=0)
        acc = tl.dot(xv, tl.trans(wv.to(DOT_DTYPE)), acc, input_precision=DOT_PRECISION)
        if SILU_MUL:
            uv = tl.load(w_tile + up_offset, mask=w_mask, other=0)
            acc_up = tl.dot(xv, tl.trans(uv.to(DOT_DTYPE)), acc_up, input_precision=DOT_PRECISION)
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    out = _scale_bias(acc, scale_ptr, bias_ptr, offs_n, n_mask, HAS_BIAS)
    if SILU_MUL:
        up = _scale_bias(acc_up, scale_ptr + num_n, bias_ptr + num_n, offs_n, n_mask, HAS_BIAS)
        out = out * tl.sigmoid(out) * up
    y_tile = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_tile, out.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# launchers


def _dot_args(dtype: torch.dtype) -> dict[str, Any]:
    """Operand dtype and precision of tl.dot for activations of this dtype."""
    if dtype == torch.float32 or (dtype == torch.bfloat16 and _is_interpreting()):
        # fp32 keeps full precision (no tf32); the interpreter's dot cannot multiply bf16
        return {"DOT_DTYPE": tl.float32, "DOT_PRECISION": "ieee"}
    return {"DOT_DTYPE": tl.float16 if dtype == torch.float16 else tl.bfloat16, "DOT_PRECISION": None}


def _check(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if w.dtype != torch.int8 or scale.dtype != torch.float32:
        raise ValueError(f"w must be int8 and scale float32, got {w.dtype} and {scale.dtype}")
    num_n = w.shape[0] if w.dim() == 2 else -1
    if x.dim() != 2 or w.dim() != 2 or w.shape[1] != x.shape[1] or scale.shape != (num_n,):
        raise ValueError(f"int8 linear shapes: x {tuple(x.shape)}, w {tuple(w.shape)}, scale {tuple(scale.shape)}")
    if (x.stride(1) != 1 and x.shape[1] > 1) or (w.stride(1) != 1 and w.shape[1] > 1):
        raise ValueError(f"x and w need a contiguous last dim (rows may be strided), got {x.stride()} and {w.stride()}")
    if bias is not None and (bias.shape != (num_n,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{num_n}] in {x.dtype}, got {tuple(bias.shape)} in {bias.dtype}")
    if len({x.device, w.device, scale.device} | ({bias.device} if bias is not None else set())) != 1:
        raise ValueError("x, w, scale and bias must be on one device")


def _launch(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, num_out: int, is_silu_mul: bool
) -> torch.Tensor:
    num_m, num_k = x.shape
    y = torch.empty((num_m, num_out), dtype=x.dtype, device=x.device)
    if num_m == 0 or num_out == 0:
        return y
    tiles = _pick_tiles(num_m, num_out, is_silu_mul)
    scale = scale.contiguous()  # the kernel reads scale and bias at unit stride (a no-op when they are)
    bias = bias.contiguous() if bias is not None else None
    grid = (triton.cdiv(num_m, tiles.block_m), triton.cdiv(num_out, tiles.block_n))
    _int8_matmul_kernel[grid](
        x, w, scale, bias if bias is not None else scale, y,
        num_m, num_out, num_k,
        x.stride(0), w.stride(0), y.stride(0), num_out * w.stride(0),
        HAS_BIAS=bias is not None, SILU_MUL=is_silu_mul, **_dot_args(x.dtype),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return y


def int8_linear(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """y = x @ (scale[:, None] * w).T (+ bias), accumulated in fp32 and rounded once to x's dtype.

    x [M, K] bfloat16/float16/float32 and w [N, K] int8, each with a contiguous last dim (rows may be
    strided); scale [N] float32; bias [N] in x's dtype or None -> y [M, N] in x's dtype.
    """
    _check(x, w, scale, bias)
    return _launch(x, w, scale, bias, w.shape[0], is_silu_mul=False)


def int8_linear_silu_mul(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """silu(gate) * up for [gate; up] = int8_linear(x, w, scale, bias), without writing [gate; up].

    w [2I, K] int8: the I gate rows, then the I up rows; scale and bias [2I] alike -> [M, I] in x's dtype.
    """
    _check(x, w, scale, bias)
    if w.shape[0] % 2:
        raise ValueError(f"gate|up weight needs an even number of rows, got {w.shape[0]}")
    return _launch(x, w, scale, bias, w.shape[0] // 2, is_silu_mul=True)
