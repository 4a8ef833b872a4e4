"""SGMV LoRA kernels: one launch per matmul for every segment of tokens, whatever its adapter.

A segment is a contiguous run of token rows sharing one device slot (a prefill chunk, or one decode
token). Each program loads its segment's slot and that slot's true rank and masks the rank axis with
it, so adapters of different ranks, zero-padded to one max rank R, share a launch.

    shrink: out[rows, :]                 = x[rows] @ A[slot, :rank].T   (fp32, columns >= rank are 0)
    expand: y[rows, off:off+OUT]        += h[rows, :rank] @ B[slot, :, :rank].T

Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (set before triton is first imported).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except ImportError:  # CPU-only installs use the torch path; triton_available() says so
    _HAS_TRITON = False

_BLOCK_T = 16  # token rows per program; tl.dot needs >= 16 on every dim
ROWS_PER_PROGRAM = _BLOCK_T  # a segment no longer than this runs as one program per tile of its other axis
_BLOCK_R = 64  # max shrink output columns (rank axis) per program
_BLOCK_IN = 64  # shrink reduction tile over IN
_BLOCK_OUT = 64  # expand output columns per program
_BLOCK_K = 16  # expand reduction tile over the rank axis


def triton_available() -> bool:
    """True if triton imports and can run here: a CUDA device, or the interpreter (TRITON_INTERPRET=1)."""
    return _HAS_TRITON and (torch.cuda.is_available() or _is_interpreting())


def _is_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on")


def _jit(fn: Callable[..., None]) -> Any:
    # a no-op without triton, so the module (and triton_available) still imports
    return triton.jit(fn) if _HAS_TRITON else fn


# kernels


@_jit
def _shrink_kernel(
    x_ptr: tl.tensor,  # [T, IN]
    a_ptr: tl.tensor,  # [S, R, IN]
    out_ptr: tl.tensor,  # [T, R] fp32
    starts_ptr: tl.tensor,  # [G]
    lens_ptr: tl.tensor,  # [G]
    slots_ptr: tl.tensor,  # [G]
    ranks_ptr: tl.tensor,  # [S]
    num_in: int,
    num_r: int,
    stride_xt: int,
    stride_xk: int,
    stride_as: int,
    stride_ar: int,
    stride_ak: int,
    stride_ot: int,
    stride_or: int,
    k_per_split: int,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_IN: tl.constexpr,
    SPLIT_K: tl.constexpr,
) -> None:
    seg = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK_T
    r0 = (tl.program_id(2) // SPLIT_K) * BLOCK_R
    k_start = (tl.program_id(2) % SPLIT_K) * k_per_split  # this program's share of the IN reduction
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    seg_len = tl.load(lens_ptr + seg)
    if (slot < 0) | (t0 >= seg_len):
        return
    rank = tl.load(ranks_ptr + slot)
    rows = tl.load(starts_ptr + seg).to(tl.int64) + t0 + tl.arange(0, BLOCK_T)  # [BT]
    row_mask = (t0 + tl.arange(0, BLOCK_T)) < seg_len
    offs_r = r0 + tl.arange(0, BLOCK_R)  # [BR]
    r_mask = offs_r < rank
    offs_k = k_start + tl.arange(0, BLOCK_IN)  # [BK]
    x_tile = x_ptr + rows[:, None] * stride_xt + offs_k[None, :] * stride_xk  # [BT, BK]
    a_tile = a_ptr + slot * stride_as + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak  # [BK, BR]
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    k_end = tl.minimum(k_start + k_per_split, num_in)
    k_end = tl.where(r0 < rank, k_end, k_start)  # a rank tile past the slot's rank only writes zeros
    for k0 in range(k_start, k_end, BLOCK_IN):
        k_mask = (k0 - k_start + offs_k) < k_end
        xv = tl.load(x_tile, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        av = tl.load(a_tile, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc = tl.dot(xv.to(DOT_DTYPE), av.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
        x_tile += BLOCK_IN * stride_xk
        a_tile += BLOCK_IN * stride_ak
    out_tile = out_ptr + rows[:, None] * stride_ot + offs_r[None, :] * stride_or
    out_mask = row_mask[:, None] & (offs_r < num_r)[None, :]
    if SPLIT_K == 1:
        tl.store(out_tile, acc, mask=out_mask)
    else:  # the splits' partial sums meet in out, which holds zeros in these rows
        tl.atomic_add(out_tile, acc, mask=out_mask)


@_jit
def _expand_kernel(
    h_ptr: tl.tensor,  # [T, R] fp32
    b_ptr: tl.tensor,  # [S, OUT, R]
    y_ptr: tl.tensor,  # [T, Y]
    starts_ptr: tl.tensor,  # [G]
    lens_ptr: tl.tensor,  # [G]
    slots_ptr: tl.tensor,  # [G]
    ranks_ptr: tl.tensor,  # [S]
    num_out: int,
    col_offset: int,
    stride_ht: int,
    stride_hr: int,
    stride_bs: int,
    stride_bo: int,
    stride_br: int,
    stride_yt: int,
    stride_yc: int,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    seg = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK_T
    o0 = tl.program_id(2) * BLOCK_OUT
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    seg_len = tl.load(lens_ptr + seg)
    if (slot < 0) | (t0 >= seg_len):
        return
    rank = tl.load(ranks_ptr + slot)
    if rank == 0:  # the slot's adapter does not target this layer kind (a decode graph runs every kind): y as it is
        return
    rows = tl.load(starts_ptr + seg).to(tl.int64) + t0 + tl.arange(0, BLOCK_T)  # [BT]
    row_mask = (t0 + tl.arange(0, BLOCK_T)) < seg_len
    offs_o = o0 + tl.arange(0, BLOCK_OUT)  # [BO]
    o_mask = offs_o < num_out
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    h_tile = h_ptr + rows[:, None] * stride_ht + offs_k[None, :] * stride_hr  # [BT, BK]
    b_tile = b_ptr + slot * stride_bs + offs_o[None, :] * stride_bo + offs_k[:, None] * stride_br  # [BK, BO]
    acc = tl.zeros((BLOCK_T, BLOCK_OUT), dtype=tl.float32)
    for k0 in range(0, rank, BLOCK_K):
        k_mask = (k0 + offs_k) < rank
        hv = tl.load(h_tile, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        bv = tl.load(b_tile, mask=k_mask[:, None] & o_mask[None, :], other=0.0)
        acc = tl.dot(hv.to(DOT_DTYPE), bv.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
        h_tile += BLOCK_K * stride_hr
        b_tile += BLOCK_K * stride_br
    y_tile = y_ptr + rows[:, None] * stride_yt + (col_offset + offs_o)[None, :] * stride_yc
    mask = row_mask[:, None] & o_mask[None, :]
    yv = tl.load(y_tile, mask=mask, other=0.0)
    tl.store(y_tile, (yv.to(tl.float32) + acc).to(yv.dtype), mask=mask)


# launchers


def _dot_args(dtype: torch.dtype) -> dict[str, Any]:
    """Operand dtype and precision of tl.dot for weights of this dtype."""
    if dtype == torch.float32 or (dtype == torch.bfloat16 and _is_interpreting()):
        # fp32 keeps full precision (no tf32); the interpreter's dot cannot multiply bf16
        return {"DOT_DTYPE": tl.float32, "DOT_PRECISION": "ieee"}
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"LoRA weights must be float32, float16 or bfloat16, got {dtype}")
    return {"DOT_DTYPE": tl.float16 if dtype == torch.float16 else tl.bfloat16, "DOT_PRECISION": None}


def _check_segments(seg_starts: torch.Tensor, seg_lens: torch.Tensor, seg_slots: torch.Tensor) -> None:
    shapes = {seg_starts.shape, seg_lens.shape, seg_slots.shape}
    if len(shapes) != 1 or seg_starts.dim() != 1:
        raise ValueError(f"segment tensors must be 1-D of one length, got {[tuple(s) for s in shapes]}")


def _num_token_tiles(num_rows: int, max_seg_len: int | None) -> int:
    # without a host-side bound, cover the whole batch: idle tiles return at once, and no device sync
    return triton.cdiv(max_seg_len if max_seg_len is not None else num_rows, _BLOCK_T)


def sgmv_shrink(
    x: torch.Tensor,
    a_stack: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_slots: torch.Tensor,
    ranks: torch.Tensor,
    out: torch.Tensor,
    max_seg_len: int | None = None,
    split_k: int | None = None,
) -> None:
    """out[rows of each segment] = x[rows] @ a_stack[slot, :rank].T, in fp32; columns >= rank get 0.

    x [T, IN]; a_stack [S, R, IN] zero-padded to the max rank R; seg_starts, seg_lens, seg_slots [G] int32
    (slot -1: no adapter, rows left untouched); ranks [S] int32; out [T, R] float32. Rows outside every
    segment are left untouched. max_seg_len, if the caller knows it, shrinks the grid.

    split_k: how many programs share each tile's IN reduction. A decode step has one row per segment, so
    without a split a batch of one runs a single program through all of IN (4,096 columns: 64 dependent loads)
    while the GPU's other multiprocessors idle; split, the programs add their partial sums into out with
    atomics, so out must hold zeros in the segments' rows (fp32 sums in any order: not bit-reproducible). None:
    enough splits for about four programs per multiprocessor on CUDA, 1 elsewhere (the interpreter).
    """
    _check_segments(seg_starts, seg_lens, seg_slots)
    num_rows, num_in = x.shape
    num_r = a_stack.shape[1]
    if a_stack.shape[2] != num_in or out.shape != (num_rows, num_r) or out.dtype != torch.float32:
        raise ValueError(f"shrink shapes: x {tuple(x.shape)}, a {tuple(a_stack.shape)}, out {tuple(out.shape)}")
    if seg_starts.numel() == 0 or num_rows == 0:
        return
    block_r = max(16, min(_BLOCK_R, triton.next_power_of_2(num_r)))
    tiles = (seg_starts.numel(), _num_token_tiles(num_rows, max_seg_len), triton.cdiv(num_r, block_r))
    chunks = triton.cdiv(num_in, _BLOCK_IN)
    split = split_k
    if split is None:
        split = shrink_split(tiles[0] * tiles[1] * tiles[2], chunks, multiprocessors(x.device))
    if split < 1:
        raise ValueError(f"split_k must be >= 1, got {split}")
    k_per_split = triton.cdiv(chunks, split) * _BLOCK_IN  # whole BLOCK_IN chunks: each split's loads stay aligned
    _shrink_kernel[(tiles[0], tiles[1], tiles[2] * split)](
        x, a_stack, out, seg_starts, seg_lens, seg_slots, ranks,
        num_in, num_r,
        x.stride(0), x.stride(1),
        a_stack.stride(0), a_stack.stride(1), a_stack.stride(2),
        out.stride(0), out.stride(1),
        k_per_split,
        **_dot_args(a_stack.dtype), BLOCK_T=_BLOCK_T, BLOCK_R=block_r, BLOCK_IN=_BLOCK_IN, SPLIT_K=split,
    )  # fmt: skip


def shrink_split(programs: int, chunks: int, multiprocessors: int) -> int:
    """The IN splits that give a shrink of `programs` tiles about four programs per multiprocessor, each split at
    least one BLOCK_IN chunk of the `chunks` (pure; 1 where `multiprocessors` is 0)."""
    return max(1, min(chunks, -(-4 * multiprocessors // max(programs, 1))))


def multiprocessors(device: torch.device) -> int:
    """The CUDA device's multiprocessors; 0 elsewhere (the interpreter runs programs one by one: no split)."""
    return _cuda_multiprocessors(device.index or 0) if device.type == "cuda" else 0


@functools.cache
def _cuda_multiprocessors(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def sgmv_expand(
    h: torch.Tensor,
    b_stack: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_slots: torch.Tensor,
    ranks: torch.Tensor,
    y: torch.Tensor,
    col_offset: int,
    max_seg_len: int | None = None,
) -> None:
    """y[rows, col_offset:col_offset+OUT] += h[rows, :rank] @ b_stack[slot, :, :rank].T for each segment.

    h [T, R] float32 (from sgmv_shrink); b_stack [S, OUT, R] with the scale folded in, zero-padded;
    segments and ranks as in sgmv_shrink; y [T, Y] any float dtype, accumulated in fp32. Other columns,
    rows outside every segment and rows of slot -1 or of a slot of rank 0 are left untouched (not read or
    written: a decode graph's layer kinds that no resident adapter targets cost their programs' start alone).
    """
    _check_segments(seg_starts, seg_lens, seg_slots)
    num_rows, num_r = h.shape
    num_out = b_stack.shape[1]
    if b_stack.shape[2] != num_r or y.shape[0] != num_rows or not 0 <= col_offset <= y.shape[1] - num_out:
        raise ValueError(
            f"expand shapes: h {tuple(h.shape)}, b {tuple(b_stack.shape)}, y {tuple(y.shape)}, col_offset {col_offset}"
        )
    if seg_starts.numel() == 0 or num_rows == 0:
        return
    grid = (seg_starts.numel(), _num_token_tiles(num_rows, max_seg_len), triton.cdiv(num_out, _BLOCK_OUT))
    _expand_kernel[grid](
        h, b_stack, y, seg_starts, seg_lens, seg_slots, ranks,
        num_out, col_offset,
        h.stride(0), h.stride(1),
        b_stack.stride(0), b_stack.stride(1), b_stack.stride(2),
        y.stride(0), y.stride(1),
        **_dot_args(b_stack.dtype), BLOCK_T=_BLOCK_T, BLOCK_OUT=_BLOCK_OUT, BLOCK_K=_BLOCK_K,
    )  # fmt: skip
