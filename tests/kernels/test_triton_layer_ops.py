"""The Triton layer ops (layer_backend triton) against the torch code they replace, under the Triton interpreter
on CPU (on CUDA where bench/gpu.py runs them): the residual add and rotary to the bit in bf16, the norm and
SiLU-and-multiply within the last bit of their fp32 reductions. The interpreter truncates fp32 to bf16 where a GPU
rounds to nearest even, so the bit-for-bit checks of bf16 hold on CUDA alone; here bf16 is within one step."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import pytest
import torch
import torch.nn.functional as F

from loraplane_server.executor.layers.norm import RMSNorm
from loraplane_server.executor.layers.rotary import apply_rotary
from loraplane_server.kernels.triton_layer_ops import add_rms_norm, rotary_, silu_mul
from loraplane_server.kernels.triton_lora import triton_available

pytestmark = [
    pytest.mark.skipif(not triton_available(), reason="needs triton with CUDA or TRITON_INTERPRET=1"),
    pytest.mark.triton,
]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
EXACT_BF16 = DEVICE == "cuda"  # fp32 -> bf16 rounds to nearest even there (the interpreter truncates)


def close(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1.6e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_delta", [True, False])
@pytest.mark.parametrize("cols", [64, 72])
def test_add_rms_norm_equals_the_torch_norm(dtype: torch.dtype, with_delta: bool, cols: int) -> None:
    gen = torch.Generator().manual_seed(cols)
    norm = RMSNorm(cols, 1e-5)
    norm.weight.data = (1 + 0.1 * torch.randn(cols, generator=gen)).to(dtype)
    norm = norm.to(DEVICE)
    residual = (3 * torch.randn(5, cols, generator=gen)).to(dtype).to(DEVICE)
    delta = torch.randn(5, cols, generator=gen).to(dtype).to(DEVICE) if with_delta else None
    ours_residual = residual.clone()
    got = add_rms_norm(ours_residual, delta, norm.weight, norm.eps)
    expected = norm.add_forward(residual, delta, kernels=False)  # residual updated in place as well
    if dtype == torch.float32 or EXACT_BF16:
        assert torch.equal(ours_residual, residual)  # the add, rounded as residual.add_(delta)
    torch.testing.assert_close(ours_residual, residual, **close(dtype))
    torch.testing.assert_close(got, expected, **close(dtype))
    if dtype == torch.bfloat16 and EXACT_BF16:  # the fp32 sums differ in order: a last-bit difference, rarely
        assert (got != expected).float().mean().item() <= 0.05


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_equals_apply_rotary_on_strided_views(dtype: torch.dtype) -> None:
    """q and k as the attention layer makes them: views into one qkv row (heads of 16, 4 query and 2 kv heads)."""
    gen = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, dim = 6, 4, 2, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype).to(DEVICE)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    angles = torch.rand(tokens, 1, dim // 2, generator=gen) * 6
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(dtype).to(DEVICE)
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1).to(dtype).to(DEVICE)
    expected_q, expected_k = apply_rotary(q, k, cos, sin)
    untouched = qkv[:, (heads + kv_heads) * dim :].clone()
    rotary_(q, k, cos, sin)
    if dtype == torch.bfloat16 and EXACT_BF16:  # each product and the sum rounded where torch rounds them
        assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    torch.testing.assert_close(q, expected_q, **close(dtype))
    torch.testing.assert_close(k, expected_k, **close(dtype))
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], untouched)  # v is not touched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [48, 1500])
def test_silu_mul_equals_torch(dtype: torch.dtype, inter: int) -> None:
    gen = torch.Generator().manual_seed(inter)
    gate_up = (4 * torch.randn(3, 2 * inter, generator=gen)).to(dtype).to(DEVICE)
    gate, up = gate_up.split(inter, dim=-1)
    got = silu_mul(gate_up)
    torch.testing.assert_close(got, F.silu(gate) * up, **close(dtype))


def test_bad_shapes_raise() -> None:
    x = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="unit stride"):
        add_rms_norm(x.t(), None, torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="whole heads"):
        rotary_(torch.zeros(2, 1, 8), torch.zeros(2, 1, 8), torch.zeros(2, 4), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="2I"):
        silu_mul(torch.zeros(2, 7, device=DEVICE))
