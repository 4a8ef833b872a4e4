// Batched LoRA for rows of many adapters (BGMV / SGMV in one), bf16, on the CPU.
//
// out[b] += (x[b] A_s^T) B_s for every row b with adapter slot s = slots[b], reading A_s and B_s^T
// straight from the stacked slot tensors. A merged layer (q|k|v, gate|up) stacks its projections'
// A rows and B columns block-diagonally (lora/slots.py), so `proj_rows[s, p]` = (first row, rows)
// names the A rows and B^T rows of projection p in slot s, and `out_bounds` its output columns:
// each projection multiplies only its own rows against only its own output columns. An adapter on
// q and v of q|k|v thus reads 16 rows of A and 8 x 576 + 8 x 192 values of B, not 24 and 24 x 960
// (a 64-row decode step with 64 adapters: ~2.5x fewer bytes, and it is bound by those bytes).
//
// Decode rows each carry their own slot; prefill rows come in runs of one slot, whose weights then
// stay in L1/L2 from row to row, so one call covers a whole step. The torch path gathers every
// row's A and B into per-row copies (decode) or runs two small matmuls per run (prefill), both over
// the zero blocks too. Rows are spread over torch's intra-op pool; when the next row's slot differs,
// its weights are prefetched while this row computes. h = x A^T stays in fp32 between the two
// products (torch rounds it to bf16), and each output row is rounded once, after the delta is added.
//
// Registered as torch.ops.loraplane.bgmv_ (in place on `out`). Rows on `skip_slot` (the base
// model's all-zero slot) are left alone.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_common.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <vector>

namespace {

#ifdef LORAPLANE_AVX512_BF16
using BF = c10::BFloat16;
using loraplane_cpu::load16_bf16_as_f32;
using loraplane_cpu::load32_bf16;

// x: [K], a: nr rows of [K] -> h[j] = a_j . x
inline void shrink(const BF* x, const BF* a, int64_t K, int64_t nr, float* h) {
  for (int64_t j = 0; j < nr; ++j) {
    const BF* aj = a + j * K;
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      s0 = _mm512_dpbf16_ps(s0, (__m512bh)_mm512_loadu_si512(aj + k), (__m512bh)_mm512_loadu_si512(x + k));
      s1 = _mm512_dpbf16_ps(s1, (__m512bh)_mm512_loadu_si512(aj + k + 32), (__m512bh)_mm512_loadu_si512(x + k + 32));
    }
    for (; k < K; k += 32)
      s0 = _mm512_dpbf16_ps(s0, (__m512bh)load32_bf16(aj + k, K - k), (__m512bh)load32_bf16(x + k, K - k));
    h[j] = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
  }
}

// out[n] += sum_j h[j] bt[j * ldb + n] for n < N, j < nr
inline void expand(BF* out, const float* h, const BF* bt, int64_t ldb, int64_t N, int64_t nr) {
  constexpr int64_t V = 8;  // 128 outputs per pass, accumulated in registers
  for (int64_t n0 = 0; n0 < N; n0 += 16 * V) {
    __m512 acc[V];
    const int64_t width = std::min<int64_t>(16 * V, N - n0);
    const int64_t nv = (width + 15) / 16;
    for (int64_t v = 0; v < V; ++v) acc[v] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nr; ++j) {
      const __m512 hj = _mm512_set1_ps(h[j]);
      const BF* row = bt + j * ldb + n0;
      for (int64_t v = 0; v < nv; ++v)
        acc[v] = _mm512_fmadd_ps(hj, load16_bf16_as_f32(row + 16 * v, width - 16 * v), acc[v]);
    }
    for (int64_t v = 0; v < nv; ++v) {
      const int64_t m = std::min<int64_t>(16, width - 16 * v);
      alignas(64) float tmp[16];
      _mm512_store_ps(tmp, _mm512_add_ps(acc[v], load16_bf16_as_f32(out + n0 + 16 * v, m)));
      for (int64_t i = 0; i < m; ++i) out[n0 + 16 * v + i] = BF(tmp[i]);
    }
  }
}

// The bytes of [rows] rows of `cols` bf16 values, `ld` apart, into L2.
inline void prefetch_rows(const BF* p, int64_t rows, int64_t ld, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const char* row = reinterpret_cast<const char*>(p + r * ld);
    for (int64_t byte = 0; byte < cols * 2; byte += 64) _mm_prefetch(row + byte, _MM_HINT_T1);
  }
}

// The rows of a step over the intra-op pool: rows on skip_slot are left alone, and when the next
// row's slot differs, its weights are prefetched (prefetch(slot)) while this row computes
// (row(b, slot, h): h a scratch of `rank` floats). The threads split the rows by cost: a row whose
// slot differs from the row before reads its adapter's weights from memory (decode rows: ~4x a
// row of a prefill chunk, whose adapter is in cache from the row before).
template <typename Prefetch, typename Row>
void for_each_row(int64_t B, const int64_t* sp, int64_t skip_slot, int64_t rank, Prefetch prefetch, Row row) {
  const auto cost = [&](int64_t b) -> int64_t {
    if (sp[b] == skip_slot) return 0;
    return b > 0 && sp[b - 1] == sp[b] ? 1 : 4;
  };
  loraplane_cpu::parallel_by_cost(B, cost, [&](int64_t begin, int64_t end) {
    std::vector<float> h(static_cast<size_t>(std::max<int64_t>(rank, 1)));
    for (int64_t b = begin; b < end; ++b) {
      const int64_t s = sp[b];
      if (b + 1 < end && sp[b + 1] != s && sp[b + 1] != skip_slot) prefetch(sp[b + 1]);
      if (s != skip_slot) row(b, s, h.data());
    }
  });
}
#endif

// The checks bgmv_ and bgmv_packed_ share: slots a contiguous int64 [B] of slots below S, and
// out_bounds a contiguous int64 [P + 1] of non-decreasing columns inside [0, N]; returns P.
int64_t check_slots_and_bounds(const char* op, const at::Tensor& slots, int64_t B, int64_t S,
                               const at::Tensor& out_bounds, int64_t N) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == B && slots.is_contiguous(),
              op, ": slots must be a contiguous int64 [B]");
  TORCH_CHECK(out_bounds.scalar_type() == at::kLong && out_bounds.dim() == 1 && out_bounds.is_contiguous() &&
                  out_bounds.size(0) >= 2,
              op, ": out_bounds must be a contiguous int64 [P + 1]");
  const int64_t P = out_bounds.size(0) - 1;
  const int64_t* bounds = out_bounds.data_ptr<int64_t>();
  TORCH_CHECK(bounds[0] >= 0 && bounds[P] <= N, op, ": out_bounds outside the output columns");
  for (int64_t p = 0; p < P; ++p) TORCH_CHECK(bounds[p] <= bounds[p + 1], op, ": out_bounds must not decrease");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(0 <= sp[b] && sp[b] < S, op, ": slot ", sp[b], " out of range");
  return P;
}

// out: [B, N] (rows may be strided), x: [B, K] (rows may be strided), a: [S, W, K], bt: [S, W, N]
// (contiguous per slot), slots: [B] int64, proj_rows: [S, P, 2] int64 (first rank row, rows) per
// slot and projection, out_bounds: [P + 1] int64 (projection p owns out columns [out_bounds[p], out_bounds[p+1])).
void bgmv_(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt, const at::Tensor& slots,
           const at::Tensor& proj_rows, const at::Tensor& out_bounds, int64_t skip_slot) {
  TORCH_CHECK(out.device().is_cpu(), "bgmv_: CPU tensors only");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &x, &a, &bt})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16, "bgmv_: bf16 tensors only");
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && a.dim() == 3 && bt.dim() == 3, "bgmv_: bad ranks");
  const int64_t B = x.size(0), K = x.size(1), N = out.size(1), S = a.size(0), W = a.size(1);
  TORCH_CHECK(out.size(0) == B && a.size(2) == K && bt.size(0) == S && bt.size(1) == W && bt.size(2) == N,
              "bgmv_: out [B, N], x [B, K], a [S, W, K], bt [S, W, N]");
  TORCH_CHECK(out.stride(1) == 1 && x.stride(1) == 1, "bgmv_: rows of out and x must be contiguous");
  TORCH_CHECK(a.stride(2) == 1 && a.stride(1) == K && bt.stride(2) == 1 && bt.stride(1) == N,
              "bgmv_: each slot of a and bt must be contiguous");
  const int64_t P = check_slots_and_bounds("bgmv_", slots, B, S, out_bounds, N);
  TORCH_CHECK(proj_rows.scalar_type() == at::kLong && proj_rows.is_contiguous() && proj_rows.dim() == 3 &&
                  proj_rows.size(0) == S && proj_rows.size(1) == P && proj_rows.size(2) == 2,
              "bgmv_: proj_rows must be a contiguous int64 [S, P, 2]");
  const int64_t *bounds = out_bounds.data_ptr<int64_t>(), *pr = proj_rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < S * P; ++i)
    TORCH_CHECK(pr[2 * i] >= 0 && pr[2 * i + 1] >= 0 && pr[2 * i] + pr[2 * i + 1] <= W,
                "bgmv_: proj_rows outside the slots' rank rows");
  const int64_t* sp = slots.data_ptr<int64_t>();
  if (B == 0) return;
#ifdef LORAPLANE_AVX512_BF16
  BF* po = out.data_ptr<BF>();
  const BF *px = x.data_ptr<BF>(), *pa = a.data_ptr<BF>(), *pb = bt.data_ptr<BF>();
  const int64_t so = out.stride(0), sx = x.stride(0), sa = a.stride(0), sb = bt.stride(0);
  auto prefetch_slot = [&](int64_t s) {
    for (int64_t p = 0; p < P; ++p) {
      const int64_t r0 = pr[2 * (s * P + p)], nr = pr[2 * (s * P + p) + 1];
      if (nr == 0) continue;
      prefetch_rows(pa + s * sa + r0 * K, nr, K, K);
      prefetch_rows(pb + s * sb + r0 * N + bounds[p], nr, N, bounds[p + 1] - bounds[p]);
    }
  };
  for_each_row(B, sp, skip_slot, W, prefetch_slot, [&](int64_t b, int64_t s, float* h) {
    for (int64_t p = 0; p < P; ++p) {
      const int64_t r0 = pr[2 * (s * P + p)], nr = pr[2 * (s * P + p) + 1];
      if (nr == 0 || bounds[p + 1] == bounds[p]) continue;
      shrink(px + b * sx, pa + s * sa + r0 * K, K, nr, h);
      expand(po + b * so + bounds[p], h, pb + s * sb + r0 * N + bounds[p], N, bounds[p + 1] - bounds[p], nr);
    }
  });
#else
  TORCH_CHECK(false, "bgmv_: built without AVX512-BF16");
#endif
}

// The same product over the packed layout (lora/slots.py, CPU kernels on): slot s is one run of
// `packed[s]` holding, for each projection p it targets, A_p [rank_p, K] and then B_p^T
// [rank_p, width_p], back to back; proj[s, p] = (element offset of A_p, rank_p). A decode row's
// adapter is then one contiguous read (~30 KB for q and v at rank 8) instead of the dense layout's
// 18 runs of 0.4-9 KB, and random reads of 32 KB run at ~25 GB/s here against ~12-15 for 1-4 KB.
void bgmv_packed_(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& slots,
                  const at::Tensor& proj, const at::Tensor& out_bounds, int64_t skip_slot) {
  TORCH_CHECK(out.device().is_cpu(), "bgmv_packed_: CPU tensors only");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &x, &packed})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16, "bgmv_packed_: bf16 tensors only");
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && packed.dim() == 2, "bgmv_packed_: out [B, N], x [B, K], packed [S, C]");
  const int64_t B = x.size(0), K = x.size(1), N = out.size(1), S = packed.size(0), C = packed.size(1);
  TORCH_CHECK(out.size(0) == B, "bgmv_packed_: out and x must have the same rows");
  TORCH_CHECK(out.stride(1) == 1 && x.stride(1) == 1 && packed.stride(1) == 1,
              "bgmv_packed_: rows of out and x, and each slot of packed, must be contiguous");
  const int64_t P = check_slots_and_bounds("bgmv_packed_", slots, B, S, out_bounds, N);
  TORCH_CHECK(proj.scalar_type() == at::kLong && proj.is_contiguous() && proj.dim() == 3 && proj.size(0) == S &&
                  proj.size(1) == P && proj.size(2) == 2,
              "bgmv_packed_: proj must be a contiguous int64 [S, P, 2]");
  const int64_t *bounds = out_bounds.data_ptr<int64_t>(), *pr = proj.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s)
    for (int64_t p = 0; p < P; ++p) {
      const int64_t off = pr[2 * (s * P + p)], nr = pr[2 * (s * P + p) + 1];
      TORCH_CHECK(off >= 0 && nr >= 0 && off + nr * (K + bounds[p + 1] - bounds[p]) <= C,
                  "bgmv_packed_: proj outside the slot's packed weights");
    }
  const int64_t* sp = slots.data_ptr<int64_t>();
  if (B == 0) return;
#ifdef LORAPLANE_AVX512_BF16
  BF* po = out.data_ptr<BF>();
  const BF *px = x.data_ptr<BF>(), *pw = packed.data_ptr<BF>();
  const int64_t so = out.stride(0), sx = x.stride(0), ss = packed.stride(0);
  auto prefetch_slot = [&](int64_t s) {
    for (int64_t p = 0; p < P; ++p) {
      const int64_t off = pr[2 * (s * P + p)], nr = pr[2 * (s * P + p) + 1];
      if (nr > 0) prefetch_rows(pw + s * ss + off, 1, 0, nr * (K + bounds[p + 1] - bounds[p]));
    }
  };
  int64_t rank = 0;
  for (int64_t i = 0; i < S * P; ++i) rank = std::max(rank, pr[2 * i + 1]);
  for_each_row(B, sp, skip_slot, rank, prefetch_slot, [&](int64_t b, int64_t s, float* h) {
    for (int64_t p = 0; p < P; ++p) {
      const int64_t off = pr[2 * (s * P + p)], nr = pr[2 * (s * P + p) + 1];
      const int64_t width = bounds[p + 1] - bounds[p];
      if (nr == 0 || width == 0) continue;
      const BF* ap = pw + s * ss + off;
      shrink(px + b * sx, ap, K, nr, h);
      expand(po + b * so + bounds[p], h, ap + nr * K, width, width, nr);
    }
  });
#else
  TORCH_CHECK(false, "bgmv_packed_: built without AVX512-BF16");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loraplane, m) {
  m.def(
      "bgmv_(Tensor(a!) out, Tensor x, Tensor a, Tensor bt, Tensor slots, Tensor proj_rows, Tensor out_bounds, "
      "int skip_slot) -> ()");
  m.def(
      "bgmv_packed_(Tensor(a!) out, Tensor x, Tensor packed, Tensor slots, Tensor proj, Tensor out_bounds, "
      "int skip_slot) -> ()");
}

TORCH_LIBRARY_IMPL(loraplane, CPU, m) {
  m.impl("bgmv_", bgmv_);
  m.impl("bgmv_packed_", bgmv_packed_);
}
