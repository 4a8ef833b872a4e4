// Batched LoRA for rows of many adapters (BGMV / SGMV in one), bf16, on the CPU.
//
// out[b] += (x[b] A_s^T) B_s for every row b with adapter slot s = slots[b], reading A_s and B_s^T
// straight from the stacked slot tensors. A merged layer (q|k|v, gate|up) stacks its projections'
// A rows and B columns block-diagonally (executor/lora/slots.py), so `proj_rows[s, p]` = (first row, rows)
// names the A rows and B^T rows of projection p in slot s, and `out_bounds` its output columns:
// each projection multiplies only its own rows against only its own output columns. An adapter on
// q and v of q|k|v thus reads 16 rows of A and 8 x 576 + 8 x 192 values of B, not 24 and 24 x 960.
//
// Decode rows each carry their own slot; prefill rows come in runs of one slot, whose weights then
// stay in L1/L2 from row to row, so one call covers a whole step. The torch path gathers every
// row's A and B into per-row copies (decode) or runs two small matmuls per run (prefill), both over
// the zero blocks too. Rows are spread over torch's intra-op pool; when the next row's slot differs,
// its weights are prefetched while this row computes. h = x A^T is rounded to bf16 between the
// two products, as torch's bf16 matmuls round it, and each output row is rounded once, after the
// delta is added. The expand takes B^T rows in pairs, the shrink 8 rank rows per pass (what that
// measured: docs/kernels.md). An AVX2 build (x86-64-v3) has the same shrink and expand with bf16
// widened to fp32 for FMAs (cpu_common.h's avx2 layer) and shares the scheduling and prefetch.
//
// Exposed (bindings.cpp) as torch.ops.loraplane.bgmv_ (in place on `out`). Rows on `skip_slot` (the base
// model's all-zero slot) are left alone.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include "cpu_common.h"
#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

#if defined(LORAPLANE_AVX512_BF16) || defined(LORAPLANE_AVX2)
#define LORAPLANE_LORA_KERNELS 1  // shrink/expand below for this ISA; the scheduling after them is shared
#endif

namespace {

#ifdef LORAPLANE_LORA_KERNELS
using BF = c10::BFloat16;
#endif

#ifdef LORAPLANE_AVX512_BF16
using loraplane_cpu::load32_bf16;

// x: [K], a: J rows of [K] -> h[j] = a_j . x: the J dot products side by side (J independent
// chains for the vdpbf16ps latency, each slice of x loaded once for all of them).
template <int J>
__attribute__((always_inline)) inline void shrink_rows(const BF* x, const BF* a, int64_t K, float* h) {
  __m512 s[J];
#pragma GCC unroll 8
  for (int j = 0; j < J; ++j) s[j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __m512bh xv = (__m512bh)load32_bf16(x + k, K - k);
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) s[j] = _mm512_dpbf16_ps(s[j], (__m512bh)load32_bf16(a + j * K + k, K - k), xv);
  }
#pragma GCC unroll 8
  for (int j = 0; j < J; ++j) h[j] = _mm512_reduce_add_ps(s[j]);
}

// x: [K], a: nr rows of [K] -> h[j] = a_j . x
inline void shrink(const BF* x, const BF* a, int64_t K, int64_t nr, float* h) {
  int64_t j = 0;
  for (; j + 8 <= nr; j += 8) shrink_rows<8>(x, a + j * K, K, h + j);
  for (; j + 4 <= nr; j += 4) shrink_rows<4>(x, a + j * K, K, h + j);
  for (; j < nr; ++j) shrink_rows<1>(x, a + j * K, K, h + j);
}

// out[n] += sum_j h[j] bt[j * ldb + n] for n < N, j < nr. Rank rows go two at a time: their values
// interleaved into (row j, row j + 1) pairs by unpacklo/hi_epi16, one vdpbf16ps multiplies 16
// columns by the pair (h[j], h[j + 1]) rounded to bf16 (as torch's bf16 matmuls round h): 2
// instructions per 32 products, where widening B to fp32 for an FMA took 4 per 16. The output's
// bits go through the same unpack, so they line up with the accumulators; one permute restores
// the column order (store_unpacked32_bf16), and each sum is rounded once. Each pass keeps its 2 NV accumulators in
// registers (a pass width known at compile time; with a runtime one they lived on the stack).
template <int NV>  // NV vectors of 32 columns from n0: width = columns left (the last vector may be partial)
__attribute__((always_inline)) inline void expand_pass(BF* out, const float* h, const BF* bt, int64_t ldb, int64_t width,
                                                       int64_t nr) {
  const __m512i zero = _mm512_setzero_si512();
  __m512 lo[NV], hi[NV];
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) lo[v] = hi[v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < nr; j += 2) {
    const bool both = j + 1 < nr;  // an odd rank's last row pairs with zeros (the row after is not its own)
    const uint32_t pair = static_cast<uint32_t>(BF(h[j]).x) | (both ? static_cast<uint32_t>(BF(h[j + 1]).x) << 16 : 0u);
    const __m512bh hp = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair));
    const BF* r0 = bt + j * ldb;
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const int64_t left = width - 32 * v;
      const __m512i a = load32_bf16(r0 + 32 * v, left);
      const __m512i b = both ? load32_bf16(r0 + ldb + 32 * v, left) : zero;
      lo[v] = _mm512_dpbf16_ps(lo[v], (__m512bh)_mm512_unpacklo_epi16(a, b), hp);
      hi[v] = _mm512_dpbf16_ps(hi[v], (__m512bh)_mm512_unpackhi_epi16(a, b), hp);
    }
  }
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    const int64_t left = std::min<int64_t>(32, width - 32 * v);
    BF* o = out + 32 * v;
    const __m512i bits = load32_bf16(o, left);  // as fp32: each bf16 in the high half of a 32-bit lane
    const __m512 sum_lo = _mm512_add_ps(lo[v], _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, bits)));
    const __m512 sum_hi = _mm512_add_ps(hi[v], _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, bits)));
    loraplane_cpu::store_unpacked32_bf16(o, sum_lo, sum_hi, static_cast<__mmask32>((1ull << left) - 1));
  }
}

inline void expand(BF* out, const float* h, const BF* bt, int64_t ldb, int64_t N, int64_t nr) {
  int64_t n0 = 0;
  for (; n0 + 128 <= N; n0 += 128) expand_pass<4>(out + n0, h, bt + n0, ldb, 128, nr);
  switch ((N - n0 + 31) / 32) {  // 97..127 columns left need all 4 vectors, the last partial
    case 4: expand_pass<4>(out + n0, h, bt + n0, ldb, N - n0, nr); break;
    case 3: expand_pass<3>(out + n0, h, bt + n0, ldb, N - n0, nr); break;
    case 2: expand_pass<2>(out + n0, h, bt + n0, ldb, N - n0, nr); break;
    case 1: expand_pass<1>(out + n0, h, bt + n0, ldb, N - n0, nr); break;
    default: break;
  }
}

#elif defined(LORAPLANE_AVX2)
// The AVX2 twin: the same products, bf16 widened to fp32 by a 16-bit shift and multiplied by FMAs.
// 16 bf16 (8 pairs, one 32-bit lane each) split into their even and odd values (avx2::even_f32 /
// odd_f32: a shift, an and) give 16 products for 2 FMAs, where widening 8 at a time costs a
// zero-extend, a shift and an FMA per 8.
namespace av = loraplane_cpu::avx2;

// 16 bf16 bits from p, without the tail check (the caller knows 16 are there).
__attribute__((always_inline)) inline __m256i load16_full(const BF* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// x: [K], a: J rows of [K] -> h[j] = a_j . x: J independent chains (each an FMA pair per 16 values
// of K), each slice of x split once for all of them; a last partial slice reads zeros past K.
template <int J>
__attribute__((always_inline)) inline void shrink_rows(const BF* x, const BF* a, int64_t K, float* h) {
  __m256 s[J];
#pragma GCC unroll 8
  for (int j = 0; j < J; ++j) s[j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256i xb = load16_full(x + k);
    const __m256 xe = av::even_f32(xb), xo = av::odd_f32(xb);
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) {
      const __m256i ab = load16_full(a + j * K + k);
      s[j] = av::dot_pairs(s[j], av::even_f32(ab), av::odd_f32(ab), xe, xo);
    }
  }
  if (k < K) {
    const __m256i xb = av::load16_bf16(x + k, K - k);
    const __m256 xe = av::even_f32(xb), xo = av::odd_f32(xb);
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) {
      const __m256i ab = av::load16_bf16(a + j * K + k, K - k);
      s[j] = av::dot_pairs(s[j], av::even_f32(ab), av::odd_f32(ab), xe, xo);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < J; ++j) h[j] = av::hsum(s[j]);
}

// x: [K], a: nr rows of [K] -> h[j] = a_j . x
inline void shrink(const BF* x, const BF* a, int64_t K, int64_t nr, float* h) {
  int64_t j = 0;
  for (; j + 8 <= nr; j += 8) shrink_rows<8>(x, a + j * K, K, h + j);
  for (; j + 4 <= nr; j += 4) shrink_rows<4>(x, a + j * K, K, h + j);
  for (; j < nr; ++j) shrink_rows<1>(x, a + j * K, K, h + j);
}

// out[n] += sum_j h[j] bt[j * ldb + n] for n < N, j < nr: h[j] rounded to bf16 (as torch's bf16
// matmuls round h) and broadcast, each B^T row's 16 values split into even and odd columns, one FMA
// each, so a pass of NV x 16 columns keeps 2 NV accumulators in registers (even and odd columns
// apart). Out's bits split the same way are added, each sum rounded once to bf16 in the low half of
// its lane, and even | odd << 16 puts the 16 values back in order: no permute. kTail: one vector of
// width (< 16) columns, through avx2::load16_bf16's zeroed buffer and store16_bf16.
template <int NV, bool kTail = false>
__attribute__((always_inline)) inline void expand_pass(BF* out, const float* h, const BF* bt, int64_t ldb, int64_t width,
                                                       int64_t nr) {
  static_assert(!kTail || NV == 1, "a tail pass is one partial vector");
  __m256 ev[NV], od[NV];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) ev[v] = od[v] = _mm256_setzero_ps();
  for (int64_t j = 0; j < nr; ++j) {
    const __m256 hj = _mm256_set1_ps(static_cast<float>(BF(h[j])));
    const BF* row = bt + j * ldb;
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      const __m256i b = kTail ? av::load16_bf16(row, width) : load16_full(row + 16 * v);
      ev[v] = _mm256_fmadd_ps(hj, av::even_f32(b), ev[v]);
      od[v] = _mm256_fmadd_ps(hj, av::odd_f32(b), od[v]);
    }
  }
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) {
    BF* o = out + 16 * v;
    const __m256i bits = kTail ? av::load16_bf16(o, width) : load16_full(o);
    const __m256i re = av::round_to_bf16_lanes(_mm256_add_ps(ev[v], av::even_f32(bits)));
    const __m256i ro = av::round_to_bf16_lanes(_mm256_add_ps(od[v], av::odd_f32(bits)));
    const __m256i sum = _mm256_or_si256(re, _mm256_slli_epi32(ro, 16));
    if (kTail)
      av::store16_bf16(o, sum, width);
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), sum);
  }
}

inline void expand(BF* out, const float* h, const BF* bt, int64_t ldb, int64_t N, int64_t nr) {
  constexpr int64_t kPass = 16 * 5;  // 10 accumulators + h, the loaded bits and their halves: 16 ymm
  int64_t n0 = 0;
  for (; n0 + kPass <= N; n0 += kPass) expand_pass<5>(out + n0, h, bt + n0, ldb, kPass, nr);
  switch ((N - n0) / 16) {  // the whole vectors left
    case 4: expand_pass<4>(out + n0, h, bt + n0, ldb, 64, nr); break;
    case 3: expand_pass<3>(out + n0, h, bt + n0, ldb, 48, nr); break;
    case 2: expand_pass<2>(out + n0, h, bt + n0, ldb, 32, nr); break;
    case 1: expand_pass<1>(out + n0, h, bt + n0, ldb, 16, nr); break;
    default: break;
  }
  n0 += (N - n0) / 16 * 16;
  if (n0 < N) expand_pass<1, true>(out + n0, h, bt + n0, ldb, N - n0, nr);
}
#endif

#ifdef LORAPLANE_LORA_KERNELS
// The bytes of [rows] rows of `cols` bf16 values, `ld` apart, into L2.
inline void prefetch_rows(const BF* p, int64_t rows, int64_t ld, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const char* row = reinterpret_cast<const char*>(p + r * ld);
    for (int64_t byte = 0; byte < cols * 2; byte += 64) _mm_prefetch(row + byte, _MM_HINT_T1);
  }
}

// The rows of a step over the intra-op pool, in the order of their slots (stable: a prefill run
// stays in order), so that each adapter's weights are read once per call however its rows are
// spread over the batch (a decode batch of 64 rows on ~40 adapters read 64 adapters' weights).
// Rows on skip_slot are left alone, and when the next row's slot differs, its weights are
// prefetched (prefetch(slot)) while this row computes (row(b, slot, h): h a scratch of `rank`
// floats). The threads split the rows by cost: a row whose slot differs from the row before reads
// its adapter's weights from memory (~4x a row whose adapter is in cache from the row before).
template <typename Prefetch, typename Row>
void for_each_row(int64_t B, const int64_t* sp, int64_t skip_slot, int64_t rank, Prefetch prefetch, Row row) {
  std::vector<int64_t> order;
  order.reserve(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b)
    if (sp[b] != skip_slot) order.push_back(b);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return sp[x] < sp[y]; });
  const int64_t n = static_cast<int64_t>(order.size());
  const auto cost = [&](int64_t i) -> int64_t { return i > 0 && sp[order[i - 1]] == sp[order[i]] ? 1 : 4; };
  loraplane_cpu::parallel_by_cost(n, cost, [&](int64_t begin, int64_t end) {
    std::vector<float> h(static_cast<size_t>(std::max<int64_t>(rank, 1)));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = sp[order[i]];
      if (i + 1 < end && sp[order[i + 1]] != s) prefetch(sp[order[i + 1]]);
      row(order[i], s, h.data());
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

}  // namespace

namespace loraplane_cpu {

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
#ifdef LORAPLANE_LORA_KERNELS
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
  TORCH_CHECK(false, "bgmv_: built without the bf16 kernels (AVX-512 BF16 or AVX2)");
#endif
}

// The same product over the packed layout (executor/lora/slots.py, CPU kernels on): slot s is one run of
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
#ifdef LORAPLANE_LORA_KERNELS
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
  TORCH_CHECK(false, "bgmv_packed_: built without the bf16 kernels (AVX-512 BF16 or AVX2)");
#endif
}

}  // namespace loraplane_cpu
