"""The fused bf16 layer kernels (csrc/layer_ops_cpu.cpp) against the torch code they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraplane_server.executor.layers.norm import RMSNorm
from loraplane_server.executor.layers.rotary import RotaryEmbedding, apply_rotary
from loraplane_server.executor.sampler import Sampler
from loraplane_server.kernels import cpu_kernels
from loraplane_server.sampling_params import SamplingParams

pytestmark = pytest.mark.requires_cpu_kernels
BF16_ULP = 2**-7  # relative spacing of bf16 numbers


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of b's bf16 spacing (elementwise)."""
    return (a.float() - b.float()).abs() / (b.float().abs() * BF16_ULP).clamp_min(1e-30)


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_torch(rows: int, with_delta: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-5).to(torch.bfloat16).requires_grad_(False)
    norm.weight.data = (torch.rand(576, generator=gen) * 2).to(torch.bfloat16)
    residual = (torch.randn(rows, 576, generator=gen) * 3).to(torch.bfloat16)
    delta = torch.randn(rows, 576, generator=gen).to(torch.bfloat16) if with_delta else None
    expected_residual = residual + delta if delta is not None else residual.clone()
    expected = norm(expected_residual)  # the torch path: fp32 norm, two bf16 roundings
    ours_residual = residual.clone()
    out = cpu_kernels.add_rms_norm(ours_residual, delta, norm.weight, norm.eps)
    assert torch.equal(ours_residual, expected_residual)  # the residual add rounds exactly as torch's
    # only the fp32 mean's summation order differs: a rare last-bit difference in the normed value,
    # which the bf16 product with the weight can turn into two steps
    assert float(ulps_apart(out, expected).max()) <= 2.5
    assert float((out != expected).float().mean()) < 0.01


def test_rotary_matches_torch_in_place_on_strided_views() -> None:
    gen = torch.Generator().manual_seed(3)
    rotary = RotaryEmbedding(64, 4096, 10000.0, None).to(torch.bfloat16)
    positions = torch.randint(0, 4000, (37,), generator=gen)
    cos, sin = rotary.cos_sin(positions, torch.bfloat16)  # [T, 1, D]
    qkv = torch.randn(37, 9 * 64 + 2 * 3 * 64, generator=gen).to(torch.bfloat16)
    q = qkv[:, : 9 * 64].view(37, 9, 64)  # views into the merged projection output, as in the model
    k = qkv[:, 9 * 64 : 12 * 64].view(37, 3, 64)
    v_before = qkv[:, 12 * 64 :].clone()
    eq, ek = apply_rotary(q.float(), k.float(), cos.float(), sin.float())  # fp32 reference
    tq, tk = apply_rotary(q, k, cos, sin)  # the torch bf16 path
    cpu_kernels.rotary_(q, k, cos.squeeze(1), sin.squeeze(1))
    for ours, exact, torch_bf16 in ((q, eq, tq), (k, ek, tk)):
        assert float((ours.float() - exact).abs().max()) <= float((torch_bf16.float() - exact).abs().max())
        assert float(ulps_apart(ours, exact.to(torch.bfloat16)).max()) <= 1.0
    assert torch.equal(qkv[:, 12 * 64 :], v_before)  # v untouched


@pytest.mark.parametrize("rows", [1, 7, 200])
def test_silu_mul_matches_fp32(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536, generator=gen) * 4).to(torch.bfloat16)
    gate_up[0, :6] = torch.tensor([-100.0, -30.0, -1e-3, 0.0, 30.0, 100.0])  # the exp's clamped range
    gate, up = gate_up.float().split(1536, dim=-1)
    exact = F.silu(gate) * up
    out = cpu_kernels.silu_mul(gate_up)
    assert out.shape == (rows, 1536) and out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), exact, rtol=BF16_ULP, atol=1e-6)  # one rounding of the fp32 result


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_argmax_rows_matches_torch(rows: int) -> None:
    """Ties go to the first index, NaN wins (torch's rule), -0.0 equals 0.0; rows may be strided."""
    gen = torch.Generator().manual_seed(rows)
    wide = (torch.randn(rows, 49152 + 8, generator=gen) * 5).to(torch.bfloat16)
    logits = wide[:, 3 : 3 + 49152]
    logits[0, 100] = logits[0, 40000] = 50.0  # a tie: the first one
    if rows > 1:
        logits[1, 7], logits[1, 9] = float("nan"), float("inf")
        logits[1, 30000] = float("nan")
    if rows > 2:
        logits[2] = -float("inf")
        logits[3] = 0.0
        logits[3, 5:] = -0.0
        logits[4, :10] = 1e30
    assert torch.equal(cpu_kernels.argmax_rows(logits), logits.float().argmax(dim=-1))
    assert torch.equal(cpu_kernels.argmax_rows(logits), logits.argmax(dim=-1))


def test_greedy_sampler_takes_the_kernel_unless_logprobs_are_asked() -> None:
    logits = (torch.randn(6, 1000) * 3).to(torch.bfloat16)
    greedy = [SamplingParams(max_new_tokens=1)] * 6
    tokens, logprobs = Sampler(kernels=True)(logits, greedy, [None] * 6, [[]] * 6)
    expected, _ = Sampler()(logits, greedy, [None] * 6, [[]] * 6)
    assert torch.equal(tokens, expected) and bool(logprobs.isnan().all())
    asked = [*greedy[:5], SamplingParams(max_new_tokens=1, logprobs=True)]
    tokens, logprobs = Sampler(kernels=True)(logits, asked, [None] * 6, [[]] * 6)
    assert torch.equal(tokens, expected) and bool(logprobs[-1].isfinite()) and bool(logprobs[:5].isnan().all())


def test_bad_inputs_are_refused() -> None:
    x = torch.randn(4, 64).to(torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_kernels.add_rms_norm(x.float(), None, w, 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        cpu_kernels.add_rms_norm(x, None, w[:32], 1e-5)
    with pytest.raises(RuntimeError, match="delta"):
        cpu_kernels.add_rms_norm(x, x[:2], w, 1e-5)
    with pytest.raises(RuntimeError, match="gate_up"):
        cpu_kernels.silu_mul(torch.randn(4, 7).to(torch.bfloat16))
    q, k = torch.randn(4, 2, 8).to(torch.bfloat16), torch.randn(4, 1, 8).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="cos and sin"):
        cpu_kernels.rotary_(q, k, torch.ones(4, 8), torch.ones(4, 8))
    with pytest.raises(RuntimeError, match="logits"):
        cpu_kernels.argmax_rows(torch.randn(4, 9))
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.loraplane.argmax_rows_(torch.empty(3, dtype=torch.int64), x)
