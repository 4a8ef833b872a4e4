"""The int8-weight linear kernels (csrc/linear_int8_cpu.cpp) and the quantizer they take their weights
from (executor/layers/quant.py): the few-rows path (weight-only, exact up to fp32 sums) against fp32 torch on the
dequantized weight; the GEMM path (x quantized per row, integer dot products) against the same
quantization done in torch, and within the error its quantization of x allows against fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraplane_server.executor.layers.quant import quantize_int8
from loraplane_server.kernels import cpu_kernels

pytestmark = pytest.mark.requires_bf16_kernels

FEW_ROWS = 4  # up to here the weight-only path; above, the W8A8 GEMM
SHAPES = [(k, n) for k in (32, 33, 100, 576, 1536) for n in (1, 37, 64, 960)]


def int8_weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return quantize_int8(torch.randn(n, k, generator=gen) / k**0.5)


def dequantized(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return scale[:, None] * w.float()


def fp32_sum_slack(x: torch.Tensor, real: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """How far two fp32 sums of the same K products, in different orders, may differ: (K + 2) rounding
    errors of 2^-24 each on the sum of the products' magnitudes, for each of the two."""
    k = x.shape[1]
    magnitude = x.float().abs() @ real.abs().T + (0 if bias is None else bias.float().abs())
    return 2 * (k + 2) * 2**-24 * magnitude


def within_bf16_rounding(out: torch.Tensor, ref: torch.Tensor, slack: torch.Tensor) -> bool:
    """out (bf16) is within `slack` of ref (fp32) before its one rounding to bf16 (half a bf16 ulp, at
    most 2^-8 relative)."""
    return bool(((out.float() - ref).abs() <= (ref.abs() + slack) * 2**-8 * 1.001 + slack).all())


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] bf16 quantized per row as the GEMM path does (the same fp32 operations): x_q [M, K]
    (integers in [-127, 127], as fp32) and s_x [M] = amax / 127."""
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    # a true division, as the kernel's: `127 / amax` would be torch's 127 * amax.reciprocal(), rounded twice
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    return (xf * inv[:, None]).round().clamp(-127, 127), amax / 127


def test_quantize_int8_round_trips_within_half_a_step() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(70, 333, generator=gen) * torch.rand(70, 1, generator=gen) * 3
    weight[5] = 0  # an all-zero row
    weight[9, 7] = -weight[9].abs().max() * 2  # a row whose extreme is negative
    w, scale, wsum = quantize_int8(weight.to(torch.bfloat16))
    assert (w.dtype, scale.dtype, wsum.dtype) == (torch.int8, torch.float32, torch.int32)
    assert w.shape == (70, 333) and scale.shape == wsum.shape == (70,) and w.is_contiguous()
    real = weight.to(torch.bfloat16).float()
    err = (dequantized(w, scale) - real).abs()
    assert bool((err <= scale[:, None] / 2 * (1 + 1e-5)).all())
    assert int(w.abs().max()) == 127 and int(w.min()) >= -127
    assert int(w[9].min()) == -127 and torch.equal(w[9].abs().amax(), torch.tensor(127, dtype=torch.int8))
    assert float(scale[5]) == 1.0 and not w[5].any()
    assert torch.equal(wsum, w.long().sum(dim=1).int())
    with pytest.raises(ValueError, match="2-D"):
        quantize_int8(torch.randn(3))


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_few_rows_are_exact_up_to_the_sums(rows: int, k: int, n: int, with_bias: bool) -> None:
    """Up to 4 rows, the weight-only path: x against the dequantized weight in fp32, rounded once."""
    gen = torch.Generator().manual_seed(rows * 1000 + k * 7 + n)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    w, scale, wsum = int8_weight(n, k, gen)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if with_bias else None
    real = dequantized(w, scale)
    ref = F.linear(x.float(), real, None if b is None else b.float())
    out = cpu_kernels.linear_int8(x, w, scale, wsum, b)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    assert within_bf16_rounding(out, ref, fp32_sum_slack(x, real, b))


def check_w8a8(
    out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, b: torch.Tensor | None
) -> None:
    """The GEMM path's result (i) is x's per-row quantization times w, exactly, scaled and rounded
    once; (ii) is within what that quantization allows of the fp32 product: per element
    |error| <= scale[n] s_x[m] / 2 sum_k |w[n, k]| (each x[m, k] moves by at most s_x[m] / 2) plus the
    bf16 rounding; (iii) is close as a whole (relative Frobenius error under 1%)."""
    bias = 0 if b is None else b.double()
    xq, sx = quantize_rows(x)
    acc = xq.double() @ w.double().T  # exact: integers
    ref_q = acc * (sx.double()[:, None] * scale.double()[None, :]) + bias
    slack = 1e-6 * (acc.abs() * (sx.double()[:, None] * scale.double()[None, :]) + abs(bias))
    assert bool(((out.double() - ref_q).abs() <= ref_q.abs() * 2**-8 * 1.001 + slack + 1e-30).all())
    real = dequantized(w, scale)
    ref = F.linear(x.float(), real, None if b is None else b.float())
    bound = (sx / 2)[:, None] * (scale * w.abs().sum(dim=1).float())[None, :] * (1 + 1e-5)
    assert within_bf16_rounding(out, ref, bound + fp32_sum_slack(x, real, b))
    if out.numel() >= 1000:  # fewer values make a noisy ratio
        assert float((out.float() - ref).norm() / ref.norm()) < 0.01


@pytest.mark.parametrize("rows", [5, 17, 64, 100, 257])
@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_more_rows_run_w8a8_within_the_quantization_error(rows: int, k: int, n: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + k * 7 + n + 1)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    x[rows // 2] = 0  # a zero row: s_x = 0
    w, scale, wsum = int8_weight(n, k, gen)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if with_bias else None
    out = cpu_kernels.linear_int8(x, w, scale, wsum, b)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    check_w8a8(out, x, w, scale, b)


@pytest.mark.parametrize("rows", [3, 6, 70])
def test_strided_rows_of_x_and_out(rows: int) -> None:
    """x may be a column slice of a wider tensor (rows strided, not 4-byte aligned), as a split of a
    merged projection is; out too."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 700, generator=gen).to(torch.bfloat16)[:, 51:627]  # [rows, 576], row stride 700
    w, scale, wsum = int8_weight(96, 576, gen)
    out = torch.full((rows, 130), 7.0, dtype=torch.bfloat16)
    torch.ops.loraplane.linear_int8_(out[:, 3:99], x, w, scale, wsum, None)
    assert bool((out[:, :3] == 7).all() and (out[:, 99:] == 7).all())
    assert torch.equal(out[:, 3:99], cpu_kernels.linear_int8(x.contiguous(), w, scale, wsum))
    if rows <= FEW_ROWS:
        real = dequantized(w, scale)
        assert within_bf16_rounding(out[:, 3:99], F.linear(x.float(), real), fp32_sum_slack(x, real, None))
    else:
        check_w8a8(out[:, 3:99], x, w, scale, None)


def test_a_row_does_not_depend_on_the_rows_beside_it() -> None:
    """On the GEMM path each row is quantized on its own and summed exactly in integers: the same bits
    whatever the batch around it and wherever it sits in the packed chunks."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(150, 576, generator=gen).to(torch.bfloat16)
    x[70] *= 100  # a row of a far larger scale must not move its neighbours
    w, scale, wsum = int8_weight(200, 576, gen)
    b = torch.randn(200, generator=gen).to(torch.bfloat16)
    full = cpu_kernels.linear_int8(x, w, scale, wsum, b)
    for lo, hi in [(0, 5), (10, 27), (60, 71), (63, 150), (70, 90)]:
        assert torch.equal(cpu_kernels.linear_int8(x[lo:hi], w, scale, wsum, b), full[lo:hi]), (lo, hi)


def test_thread_count_does_not_change_the_result() -> None:
    gen = torch.Generator().manual_seed(4)
    w, scale, wsum = int8_weight(3000, 576, gen)
    gate_up = int8_weight(1000, 576, gen)
    threads = torch.get_num_threads()
    for rows in (1, 3, 9, 64, 200, 700):
        x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
        try:
            torch.set_num_threads(1)
            one = cpu_kernels.linear_int8(x, w, scale, wsum), cpu_kernels.linear_int8_silu_mul(x, *gate_up)
            torch.set_num_threads(2)
            two = cpu_kernels.linear_int8(x, w, scale, wsum), cpu_kernels.linear_int8_silu_mul(x, *gate_up)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1]), rows


@pytest.mark.parametrize("rows", [1, 4, 5, 16, 17, 64, 65, 130])
@pytest.mark.parametrize(("k", "inter"), [(576, 1536), (576, 37), (100, 50), (33, 24), (17, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_silu_equals_the_two_ops(rows: int, k: int, inter: int, with_bias: bool) -> None:
    """linear_int8_silu_mul gives the bits of linear_int8 then silu_mul: on the GEMM path (tiles of
    gate rows with their up rows, a tail of single pairs) and below it."""
    gen = torch.Generator().manual_seed(rows * 7 + k + inter)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    w, scale, wsum = int8_weight(2 * inter, k, gen)
    b = torch.randn(2 * inter, generator=gen).to(torch.bfloat16) if with_bias else None
    fused = cpu_kernels.linear_int8_silu_mul(x, w, scale, wsum, b)
    assert fused.shape == (rows, inter)
    assert torch.equal(fused, cpu_kernels.silu_mul(cpu_kernels.linear_int8(x, w, scale, wsum, b)))


def test_rows_longer_than_the_gemm_takes_run_exact() -> None:
    """Past K = 65536 the int32 sums could overflow: every row count takes the weight-only path."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 65537, generator=gen).to(torch.bfloat16)
    w, scale, wsum = int8_weight(3, 65537, gen)
    real = dequantized(w, scale)
    out = cpu_kernels.linear_int8(x, w, scale, wsum)
    assert within_bf16_rounding(out, F.linear(x.float(), real), fp32_sum_slack(x, real, None))
    assert cpu_kernels.linear_int8(x[:0], w, scale, wsum).shape == (0, 3)


def test_bad_arguments_are_refused_with_the_reason() -> None:
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(8, 64, generator=gen).to(torch.bfloat16)
    w, scale, wsum = int8_weight(10, 64, gen)
    linear = cpu_kernels.linear_int8
    cases = [
        (lambda: linear(x, w.float(), scale, wsum), "w must be int8, got Float"),
        (lambda: linear(x.float(), w, scale, wsum), "x and out must be bf16"),
        (lambda: linear(x, w, scale.double(), wsum), "scale must be float32, got Double"),
        (lambda: linear(x, w, scale, wsum.long()), "wsum must be int32, got Long"),
        (lambda: linear(x, w[:, :32].contiguous(), scale, wsum), "w has 32 columns, x has 64"),
        (lambda: linear(x, w, scale[:9], wsum), r"scale must be a contiguous \[10\]"),
        (lambda: linear(x, w, scale, wsum[:9]), r"wsum must be a contiguous \[10\]"),
        (lambda: linear(x, w, scale, wsum, torch.zeros(9, dtype=torch.bfloat16)), r"bias must be a contiguous \[10\]"),
        (lambda: linear(x, w, scale, wsum, torch.zeros(10)), "bias must be bf16"),
        (lambda: linear(x, w.t().contiguous().t(), scale, wsum), "w must be contiguous"),
        (lambda: linear(x.t().contiguous().t(), w, scale, wsum), "rows of x and out must be contiguous"),
        (lambda: linear(x[0], w, scale, wsum), "2-D"),
        (lambda: cpu_kernels.linear_int8_silu_mul(x, w[:9], scale[:9], wsum[:9]), r"w must be \[2I, K\]"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()
    with pytest.raises(RuntimeError, match=r"out must be \[8, 5\]"):
        torch.ops.loraplane.linear_int8_silu_mul_(torch.empty(8, 10, dtype=torch.bfloat16), x, w, scale, wsum, None)
