"""SGMV shrink/expand kernels against a per-segment einsum reference, under the Triton interpreter on CPU."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import pytest
import torch

from loraplane_server.kernels.triton_lora import sgmv_expand, sgmv_shrink, shrink_split, triton_available

pytestmark = [
    pytest.mark.skipif(not triton_available(), reason="needs triton with CUDA or TRITON_INTERPRET=1"),
    pytest.mark.triton,
]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_TOL = dict(atol=1e-4, rtol=1e-4)
BF16_TOL = dict(atol=3e-2, rtol=3e-2)
FP16_TOL = dict(atol=1e-2, rtol=1e-2)
SENTINEL = -7.0

Segment = tuple[int, int, int]  # (start, length, slot)


# reference


def reference_shrink(x, a_stack, segments: list[Segment], ranks: list[int], out):
    for start, length, slot in segments:
        if slot < 0:
            continue
        rows = slice(start, start + length)
        rank = ranks[slot]
        out[rows] = 0.0
        out[rows, :rank] = torch.einsum("ti,ri->tr", x[rows].float(), a_stack[slot, :rank].float())


def reference_expand(h, b_stack, segments: list[Segment], ranks: list[int], y, col_offset: int):
    num_out = b_stack.shape[1]
    for start, length, slot in segments:
        if slot < 0:
            continue
        rows, cols = slice(start, start + length), slice(col_offset, col_offset + num_out)
        rank = ranks[slot]
        delta = torch.einsum("tr,or->to", h[rows, :rank].float(), b_stack[slot, :, :rank].float())
        y[rows, cols] = (y[rows, cols].float() + delta).to(y.dtype)


# fixtures


def make_stacks(
    ranks: list[int], max_rank: int, num_in: int, num_out: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A [S, R, IN], B [S, OUT, R]; the padding past each slot's rank is junk, so only rank masking hides it."""
    num_slots = len(ranks)
    a = torch.randn(num_slots, max_rank, num_in, generator=gen) * 0.1
    b = torch.randn(num_slots, num_out, max_rank, generator=gen) * 0.1
    for slot, rank in enumerate(ranks):
        a[slot, rank:] = 100.0
        b[slot, :, rank:] = 100.0
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype)


def segment_tensors(segments: list[Segment]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    def column(i: int) -> torch.Tensor:
        return torch.tensor([s[i] for s in segments], dtype=torch.int32, device=DEVICE)

    return column(0), column(1), column(2)


def int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def all_decode(num_tokens: int, num_slots: int, gen: torch.Generator) -> list[Segment]:
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen).tolist()
    return [(t, 1, s) for t, s in enumerate(slots)]


def mixed(num_slots: int) -> list[Segment]:
    # out of slot order, a slot repeated across prefill and decode, a -1 segment, uncovered rows 44 and 59..63
    prefill = [(0, 20, 1), (20, 6, -1), (45, 14, 1), (26, 3, 0)]
    decode = [(29 + i, 1, i % num_slots) for i in range(15)]
    return prefill[:2] + decode[::-1] + prefill[2:]


LAYOUTS = {
    "all_decode": lambda gen: all_decode(12, 3, gen),
    "one_prefill": lambda gen: [(3, 40, 2)],
    "mixed": lambda gen: mixed(3),
}
NUM_ROWS = 64


def run_shrink(
    x, a, segments: list[Segment], ranks: list[int], max_seg_len: int | None = None, split_k: int = 1
) -> torch.Tensor:
    """The shrink into a SENTINEL-filled out; split, the adapter rows zeroed first (the split's contract)."""
    out = torch.full((x.shape[0], a.shape[1]), SENTINEL, dtype=torch.float32, device=DEVICE)
    if split_k > 1:
        for start, length, slot in segments:
            if slot >= 0:
                out[start : start + length] = 0.0
    sgmv_shrink(x, a, *segment_tensors(segments), int32(ranks), out, max_seg_len=max_seg_len, split_k=split_k)
    return out


def expected_shrink(x, a, segments: list[Segment], ranks: list[int]) -> torch.Tensor:
    out = torch.full((x.shape[0], a.shape[1]), SENTINEL, dtype=torch.float32, device=DEVICE)
    reference_shrink(x, a, segments, ranks, out)
    return out


# shrink


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shrink_mixed_ranks(layout: str):
    gen = torch.Generator().manual_seed(0)
    ranks, num_in = [4, 8, 16], 72  # IN spans a full and a partial tile
    segments = LAYOUTS[layout](gen)
    a, _ = make_stacks(ranks, 16, num_in, 8, torch.float32, gen)
    x = torch.randn(NUM_ROWS, num_in, generator=gen).to(DEVICE)
    got = run_shrink(x, a, segments, ranks)
    torch.testing.assert_close(got, expected_shrink(x, a, segments, ranks), **FP32_TOL)


def test_shrink_rank_tiles_past_rank_write_zeros():
    gen = torch.Generator().manual_seed(1)
    ranks, max_rank, num_in = [8, 80, 66], 80, 40  # two rank tiles; slot 0's second tile is all padding
    segments = [(0, 5, 0), (5, 1, 1), (6, 17, 2), (23, 1, 0)]
    a, _ = make_stacks(ranks, max_rank, num_in, 8, torch.float32, gen)
    x = torch.randn(30, num_in, generator=gen).to(DEVICE)
    got = run_shrink(x, a, segments, ranks, max_seg_len=17)
    torch.testing.assert_close(got, expected_shrink(x, a, segments, ranks), **FP32_TOL)
    assert (got[:5, 8:] == 0).all()
    assert (got[24:] == SENTINEL).all()


@pytest.mark.parametrize("split_k", [2, 3, 5])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_shrink_split_over_in_sums_the_parts(layout: str, split_k: int):
    """IN split between programs whose partial sums meet in out: 200 columns are 4 chunks of 64 (the last 8
    wide), split 2, 3 (one split left empty) and 5 (more splits than chunks)."""
    gen = torch.Generator().manual_seed(5)
    ranks, num_in = [4, 8, 16], 200
    segments = LAYOUTS[layout](gen)
    a, _ = make_stacks(ranks, 16, num_in, 8, torch.float32, gen)
    x = torch.randn(NUM_ROWS, num_in, generator=gen).to(DEVICE)
    got = run_shrink(x, a, segments, ranks, split_k=split_k)
    torch.testing.assert_close(got, expected_shrink(x, a, segments, ranks), **FP32_TOL)


@pytest.mark.parametrize(
    ("programs", "chunks", "sms", "split"),
    [(1, 64, 132, 64), (256, 64, 132, 3), (4096, 64, 132, 1), (1, 2, 132, 2), (8, 64, 0, 1)],
)
def test_shrink_split_fills_the_multiprocessors(programs: int, chunks: int, sms: int, split: int):
    assert shrink_split(programs, chunks, sms) == split


# expand


@pytest.mark.parametrize("layout", LAYOUTS)
def test_expand_mixed_ranks_into_column_slice(layout: str):
    gen = torch.Generator().manual_seed(2)
    ranks, num_out, col_offset = [4, 8, 16], 90, 37  # OUT spans a full and a partial tile
    segments = LAYOUTS[layout](gen)
    _, b = make_stacks(ranks, 16, 8, num_out, torch.float32, gen)
    h = torch.randn(NUM_ROWS, 16, generator=gen).to(DEVICE)  # junk past each rank, so expand must mask it
    y = torch.randn(NUM_ROWS, col_offset + num_out + 5, generator=gen).to(DEVICE)
    want = y.clone()
    reference_expand(h, b, segments, ranks, want, col_offset)
    sgmv_expand(h, b, *segment_tensors(segments), int32(ranks), y, col_offset)
    torch.testing.assert_close(y, want, **FP32_TOL)


def test_expand_leaves_other_columns_and_rows_untouched():
    gen = torch.Generator().manual_seed(3)
    ranks, num_out, col_offset = [4, 16], 20, 11
    segments = [(2, 3, 1), (7, 1, 0), (8, 2, -1)]
    _, b = make_stacks(ranks, 16, 8, num_out, torch.float32, gen)
    h = torch.randn(12, 16, generator=gen).to(DEVICE)
    y = torch.randn(12, 40, generator=gen).to(DEVICE)
    before = y.clone()
    sgmv_expand(h, b, *segment_tensors(segments), int32(ranks), y, col_offset, max_seg_len=3)
    touched = torch.zeros_like(y, dtype=torch.bool)
    touched[2:5, col_offset : col_offset + num_out] = True
    touched[7, col_offset : col_offset + num_out] = True
    assert torch.equal(y[~touched], before[~touched])
    assert (y[touched] != before[touched]).all()


def test_slot_minus_one_reads_and_writes_nothing():
    # a junk slot sits just before slot 0 in memory, so a kernel that indexes slot -1 would pick it up
    gen = torch.Generator().manual_seed(5)
    a_buf, b_buf = make_stacks([16, 4, 8], 16, 24, 20, torch.float32, gen)
    a_buf[0], b_buf[0] = 1.0, 1.0
    a, b, ranks = a_buf[1:], b_buf[1:], int32([16, 4, 8])[1:]
    segments = [(0, 2, 0), (2, 18, -1), (20, 1, -1), (21, 1, 1)]
    x = torch.randn(24, 24, generator=gen).to(DEVICE)
    out = run_shrink(x, a, segments, [4, 8])
    torch.testing.assert_close(out, expected_shrink(x, a, segments, [4, 8]), **FP32_TOL)
    h = torch.randn(24, 16, generator=gen).to(DEVICE)
    y = torch.randn(24, 20, generator=gen).to(DEVICE)
    want = y.clone()
    reference_expand(h, b, segments, [4, 8], want, 0)
    sgmv_expand(h, b, *segment_tensors(segments), ranks, y, 0)
    torch.testing.assert_close(y, want, **FP32_TOL)


def test_expand_leaves_the_rows_of_a_rank_0_slot_bit_for_bit():
    """A slot whose adapter does not target the layer kind (rank 0 there, as a decode graph runs every kind) leaves
    its rows' y as they were, bit for bit: -0.0 stays -0.0 (y + 0.0 would give +0.0), where a rank-4 slot's rows
    change."""
    gen = torch.Generator().manual_seed(6)
    ranks, num_out = [0, 4], 40
    _, b = make_stacks(ranks, 16, 8, num_out, torch.float32, gen)
    h = torch.randn(8, 16, generator=gen).to(DEVICE)
    y = torch.randn(8, num_out, generator=gen).to(DEVICE)
    y[:4, ::2] = -0.0
    before = y.clone()
    sgmv_expand(h, b, *segment_tensors([(0, 1, 0), (1, 1, 0), (2, 2, 0), (4, 4, 1)]), int32(ranks), y, 0)
    assert torch.equal(y[:4].view(torch.int32), before[:4].view(torch.int32))
    assert (y[4:] != before[4:]).all()


# shrink then expand, as a LoRA layer runs them


@pytest.mark.parametrize(
    ("dtype", "tol"),
    [(torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL), (torch.float16, FP16_TOL)],
    ids=["fp32", "bf16", "fp16"],
)
def test_shrink_expand_chain(dtype: torch.dtype, tol: dict):
    gen = torch.Generator().manual_seed(4)
    ranks, num_in, num_out = [4, 8, 16], 96, 56
    segments = mixed(3)
    a, b = make_stacks(ranks, 16, num_in, num_out, dtype, gen)
    x = torch.randn(NUM_ROWS, num_in, generator=gen).to(DEVICE, dtype)
    y = torch.randn(NUM_ROWS, num_out, generator=gen).to(DEVICE, dtype)
    want_h = expected_shrink(x, a, segments, ranks)
    want_y = y.clone()
    reference_expand(want_h, b, segments, ranks, want_y, 0)

    h = run_shrink(x, a, segments, ranks)
    sgmv_expand(h, b, *segment_tensors(segments), int32(ranks), y, 0)
    torch.testing.assert_close(h, want_h, **tol)
    torch.testing.assert_close(y, want_y, **tol)


# edges


def test_no_segments_is_a_no_op():
    x = torch.randn(4, 8, device=DEVICE)
    a = torch.randn(2, 16, 8, device=DEVICE)
    out = torch.full((4, 16), SENTINEL, device=DEVICE)
    empty = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    sgmv_shrink(x, a, empty, empty, empty, int32([16, 16]), out)
    assert (out == SENTINEL).all()


def test_bad_shapes_raise():
    x = torch.randn(4, 8, device=DEVICE)
    a = torch.randn(2, 16, 9, device=DEVICE)
    seg = int32([0])
    with pytest.raises(ValueError, match="shrink shapes"):
        sgmv_shrink(x, a, seg, int32([4]), seg, int32([16, 16]), torch.zeros(4, 16, device=DEVICE))
    b = torch.randn(2, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="expand shapes"):
        sgmv_expand(torch.zeros(4, 16, device=DEVICE), b, seg, int32([4]), seg, int32([16, 16]), x, 1)
