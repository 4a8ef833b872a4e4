"""The weight-only int8 Triton linear against an fp32 reference: on CUDA when present, else under the
Triton interpreter on CPU (small shapes there; the CUDA run adds float16 and model-sized shapes)."""

import os
from pathlib import Path

# the interpreter on CPU only: with a GPU the kernels compile for it (conftest.py decides the same way)
os.environ.setdefault("TRITON_INTERPRET", "0" if Path("/dev/nvidia0").exists() else "1")

import pytest
import torch
import torch.nn.functional as F

from loraplane_server.kernels import triton_int8
from loraplane_server.kernels.triton_int8 import int8_linear, int8_linear_silu_mul, triton_available
from loraplane_server.kernels.triton_lora import _is_interpreting

pytestmark = [
    pytest.mark.skipif(not triton_available(), reason="needs triton with CUDA or TRITON_INTERPRET=1"),
    pytest.mark.triton,
]

IS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if IS_CUDA else "cpu"
FP32_EPS = 2.0**-24  # unit roundoff of the fp32 accumulator
# one rounding to the output dtype: half an ulp, to nearest, on a GPU; triton's interpreter casts fp32 to bf16
# by dropping the low bits, a whole ulp
BF16_ROUNDOFF = 2.0**-7 if _is_interpreting() else 2.0**-8
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: BF16_ROUNDOFF}
DTYPES = [torch.bfloat16, torch.float32] + ([torch.float16] if IS_CUDA else [])

# (M, K, N): every M, K and N of the issue at least once. Up to 32 rows take the decode tiles, more the medium
# ones here; the prefill tiles need a big output (BIG_SHAPES' last on CUDA, test_every_tile_config everywhere)
SHAPES = [
    (1, 32, 1),
    (1, 576, 960),
    (3, 100, 37),
    (3, 576, 64),
    (16, 32, 960),
    (16, 100, 64),
    (33, 576, 37),
    (33, 100, 1),
    (128, 100, 960),
    (128, 576, 37),
]
BIG_SHAPES = [(1, 4096, 4096), (7, 4096, 1000), (300, 1000, 2048), (1024, 520, 2100)]  # CUDA only
SHAPES_HERE = SHAPES + (BIG_SHAPES if IS_CUDA else [])


# reference


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: weight ~= scale[:, None] * w."""
    scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127
    w = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return w, scale


def make_case(
    m: int, k: int, n: int, dtype: torch.dtype, has_bias: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w, scale = quantize(torch.randn(n, k, generator=gen) / k**0.5)  # outputs of order 1
    bias = torch.randn(n, generator=gen).to(dtype) if has_bias else None
    return x, w, scale, bias


def reference(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ (scale * w).T + bias in fp32 on CPU, the bound on the fp32 accumulation error of each output)."""
    x, w, scale = x.cpu().float(), w.cpu().float(), scale.cpu()
    bias = bias.cpu().float() if bias is not None else torch.zeros(w.shape[0])
    w_real = scale[:, None] * w  # [N, K]
    # each of the K products and sums (and the scale, the bias) rounds once in fp32, in any order
    magnitude = x.abs() @ w_real.abs().T + bias.abs()  # [M, N]
    return x @ w_real.T + bias, 2 * (x.shape[1] + 3) * FP32_EPS * magnitude


def silu_mul_reference(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(gate) * up of the fp32 reference, the bound on each output's error)."""
    gate_up, acc_bound = reference(x, w, scale, bias)
    i = gate_up.shape[1] // 2
    gate, up = gate_up[:, :i], gate_up[:, i:]
    gate_err, up_err = acc_bound[:, :i], acc_bound[:, i:]
    want = F.silu(gate) * up
    # the gate's and up's errors through silu(g) * u (|silu'| <= 1.1), the fp32 epilogue (sigmoid's exp
    # is approximate on GPUs: a few ulp), then one rounding to the output dtype
    err = 1.1 * gate_err * (up.abs() + up_err) + (F.silu(gate).abs() + 1.1 * gate_err) * up_err
    err += 32 * FP32_EPS * want.abs()
    return want, err + UNIT_ROUNDOFF[dtype] * (want.abs() + err)


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    err = (got.cpu().float() - want).abs()
    bad = err > bound + torch.finfo(torch.float32).tiny
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} outside the bound; worst err {err[bad].max():.3g}"


def linear_bound(want: torch.Tensor, acc_bound: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # the fp32 accumulation's error, then one rounding of the result to the output dtype
    return acc_bound + UNIT_ROUNDOFF[dtype] * (want.abs() + acc_bound)


def to_device(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [t.to(DEVICE) if t is not None else None for t in tensors]


# int8_linear


@pytest.mark.parametrize("has_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(("m", "k", "n"), SHAPES_HERE)
def test_matches_reference(m: int, k: int, n: int, dtype: torch.dtype, has_bias: bool):
    x, w, scale, bias = make_case(m, k, n, dtype, has_bias, seed=m * 1000 + k + n)
    got = int8_linear(*to_device(x, w, scale, bias))
    assert got.dtype == dtype and got.shape == (m, n) and got.device.type == DEVICE
    want, acc_bound = reference(x, w, scale, bias)
    assert_within(got, want, linear_bound(want, acc_bound, dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_strided_rows(dtype: torch.dtype):
    # a column slice of a wider buffer, every other row: x.stride(0) is neither K nor the buffer's width
    x_full, w, scale, bias = make_case(20, 150, 45, dtype, has_bias=True, seed=7)
    buf = torch.randn(40, 170).to(dtype)
    buf[::2, 9:159] = x_full
    x = buf.to(DEVICE)[::2, 9:159]
    assert x.stride() == (340, 1)
    got = int8_linear(x, *to_device(w, scale, bias))
    want, acc_bound = reference(x_full, w, scale, bias)
    assert_within(got, want, linear_bound(want, acc_bound, dtype))


def test_unaligned_k_tail_reads_no_junk():
    # x's rows sit inside a buffer whose columns past K are NaN: a k tile that reads past K without its
    # mask would turn every output NaN
    x_full, w, scale, _ = make_case(5, 300, 50, torch.float32, has_bias=False, seed=8)
    buf = torch.full((5, 512), float("nan"))
    buf[:, :300] = x_full
    got = int8_linear(buf.to(DEVICE)[:, :300], *to_device(w, scale))
    want, acc_bound = reference(x_full, w, scale, None)
    assert_within(got, want, linear_bound(want, acc_bound, torch.float32))


@pytest.mark.parametrize("tiles", ["_DECODE", "_MEDIUM", "_PREFILL"])
@pytest.mark.parametrize("is_silu_mul", [False, True], ids=["linear", "silu_mul"])
def test_every_tile_config(tiles: str, is_silu_mul: bool, monkeypatch: pytest.MonkeyPatch):
    # each config on one unaligned shape, whatever the rows would pick: partial tiles on every axis
    chosen = getattr(triton_int8, tiles)
    monkeypatch.setattr(triton_int8, "_pick_tiles", lambda *_: chosen)
    m, k, i = 130, 100, 70
    x, w, scale, bias = make_case(m, k, 2 * i, torch.float32, has_bias=True, seed=12)
    if is_silu_mul:
        want, bound = silu_mul_reference(x, w, scale, bias, torch.float32)
        assert_within(int8_linear_silu_mul(*to_device(x, w, scale, bias)), want, bound)
    else:
        want, acc_bound = reference(x, w, scale, bias)
        assert_within(int8_linear(*to_device(x, w, scale, bias)), want, linear_bound(want, acc_bound, torch.float32))


def test_tiles_by_shape():
    # decode rows stream w; big tiles only where there are enough of them to fill the GPU
    assert triton_int8._pick_tiles(32, 4096, False) == triton_int8._DECODE
    assert triton_int8._pick_tiles(256, 4096, False) == triton_int8._MEDIUM  # 64 big tiles
    assert triton_int8._pick_tiles(256, 14336, False) == triton_int8._PREFILL  # 224 big tiles
    assert triton_int8._pick_tiles(2048, 14336, True).block_n == 64  # gate and up accumulators


def test_deterministic():
    x, w, scale, bias = to_device(*make_case(33, 100, 37, torch.bfloat16, has_bias=True, seed=9))
    assert torch.equal(int8_linear(x, w, scale, bias), int8_linear(x, w, scale, bias))


# int8_linear_silu_mul


@pytest.mark.parametrize("has_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(
    ("m", "k", "i"),
    [(1, 100, 37), (3, 576, 64), (16, 32, 1), (33, 100, 96), (128, 576, 37)]
    + ([(1, 4096, 4096), (300, 1024, 1500), (520, 300, 4100)] if IS_CUDA else []),
)
def test_silu_mul_matches_reference(m: int, k: int, i: int, dtype: torch.dtype, has_bias: bool):
    x, w, scale, bias = make_case(m, k, 2 * i, dtype, has_bias, seed=m * 1000 + k + i)
    got = int8_linear_silu_mul(*to_device(x, w, scale, bias))
    assert got.dtype == dtype and got.shape == (m, i)
    want, bound = silu_mul_reference(x, w, scale, bias, dtype)
    assert_within(got, want, bound)


# edges


def test_no_rows_gives_empty():
    _, w, scale, _ = to_device(*make_case(1, 32, 8, torch.float32, has_bias=False, seed=10))
    assert int8_linear(torch.zeros(0, 32, device=DEVICE), w, scale).shape == (0, 8)
    assert int8_linear_silu_mul(torch.zeros(0, 32, device=DEVICE), w, scale).shape == (0, 4)


def test_bad_arguments_raise():
    x, w, scale, bias = to_device(*make_case(2, 32, 8, torch.float32, has_bias=True, seed=11))
    with pytest.raises(ValueError, match="shapes"):
        int8_linear(x[:, :16], w, scale)
    with pytest.raises(ValueError, match="contiguous last dim"):
        int8_linear(x.t().contiguous().t(), w, scale)
    with pytest.raises(ValueError, match="int8"):
        int8_linear(x, w.float(), scale)
    with pytest.raises(ValueError, match="bias"):
        int8_linear(x, w, scale, bias.half())
    with pytest.raises(ValueError, match="even"):
        int8_linear_silu_mul(x, w[:7], scale[:7])
