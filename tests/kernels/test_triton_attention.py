"""The Triton paged decode-attention kernel against fp32 attention, under the Triton interpreter on CPU."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import pytest
import torch

from attention_cases import make_case, reference
from loraplane_server.layers.triton_attention import paged_decode_attention, triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton with CUDA or TRITON_INTERPRET=1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (4, 4, 16, 4), (6, 2, 80, 8)])
def test_matches_reference(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int) -> None:
    q, k_cache, v_cache, tables, lens = make_case(5, heads, kv_heads, head_dim, block_size, dtype, seed=head_dim)
    scale = head_dim**-0.5
    args = [x.to(DEVICE) for x in (q, k_cache, v_cache, tables, lens)]
    out = paged_decode_attention(*args, scale)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    expected = reference(q, k_cache, v_cache, tables, lens, scale)
    torch.testing.assert_close(out.float().cpu(), expected, atol=tol, rtol=tol)


def test_strided_query_rows() -> None:
    q, k_cache, v_cache, tables, lens = make_case(3, 4, 2, 16, 4, torch.float32, seed=2)
    fused = torch.cat([q.flatten(1), torch.randn(3, 32)], dim=1)
    q_view = fused[:, : 4 * 16].view(3, 4, 16)
    out = paged_decode_attention(*(x.to(DEVICE) for x in (q_view, k_cache, v_cache, tables, lens)), 0.5)
    torch.testing.assert_close(out.cpu(), reference(q_view, k_cache, v_cache, tables, lens, 0.5), atol=1e-5, rtol=1e-5)


def test_shape_mismatch_is_refused() -> None:
    q, k_cache, v_cache, tables, lens = make_case(2, 4, 2, 16, 4, torch.float32, seed=3)
    with pytest.raises(ValueError, match="does not fit"):
        paged_decode_attention(q[:, :3], k_cache, v_cache, tables, lens, 1.0)
