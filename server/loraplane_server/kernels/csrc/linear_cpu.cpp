// y = x W^T (+ b) in bf16 on the CPU, for any number of rows of x: the linear layers of decode
// steps (a few rows up to the batch size) and of prefill chunks.
//
// Two paths, chosen by the number of rows M:
//
// * M <= kFewRows: a linear layer reads its whole weight to do a few FLOPs per byte, so its speed
//   is the speed at which the weight streams in. This path walks W one row at a time (the whole
//   matrix in address order, one stream) and dots the row with up to 4 rows of x at once
//   (vdpbf16ps, horizontal sums). An odd
//   K (no whole pairs to pack) takes this path at any M, two W rows at a time from 5 rows of x.
//
// * more rows: a register-tiled GEMM. x is packed per call into 64-row chunks laid out as
//   [K/2][rows] pairs (one 16x16 transpose of 32-bit pairs at a time; x is small next to W), so
//   one zmm load holds the pair (k, k+1) of 16 rows. A tile of NR rows of W, read in place from
//   its usual [N, K] layout, broadcasts its pair (k, k+1) and feeds MT x NR accumulators (16 rows
//   of x each): 24 accumulators for MT = 4, NR = 6. No horizontal sums; the next tile of W
//   (contiguous after this one) is prefetched into L1 while this one computes. W is never packed
//   (torch's oneDNN GEMM packs it per call, which costs most when W streams from memory).
//
// Output rows are rounded to bf16 once, from the fp32 sum (round to nearest even), as torch's
// bf16 linear does; the summation order differs from torch's, so results agree to bf16
// rounding, not bitwise. Each output element is computed by one thread start to end in a fixed
// order, so the result does not depend on the thread count, and (within a path) a row's
// result does not depend on which other rows share the call. Rows of W are spread over torch's
// intra-op pool.
//
// The MLP's gate_up layer has a fused form, linear_silu_mul_: each GEMM tile takes gate rows with
// their up rows and writes silu(gate) * up, so the [M, 2I] product never goes to memory and no
// separate pass reads it back.
//
// The above is the AVX-512 BF16 build. The AVX2 build (x86-64-v3) has the same two paths over 8-lane
// fp32, each pair product two FMAs over its values widened by a shift and a mask: the few-rows path
// dots 16 values a step; the GEMM packs x into 24-row panels already widened and split into even
// and odd values ([K/2][2][rows] fp32), broadcasts a pair's even value of W and then its odd one into
// MT x NR = 3 x 4 accumulators of 8 rows (2 x 6 or 1 x 12 for a panel's last rows), and runs each
// block of 12 rows of W against the 3 panels of a 72-row chunk in turn. Its widening costs one op per
// value of W per panel, so a panel of one vector of x (8 rows) runs at a quarter of a full one's
// speed: a third path, for decode batches, takes 5-16 rows, and the last 1-8 rows of a larger call
// that is not a whole number of panels (gemm_head). It widens x once per call and reads W as vectors
// of 16 values, each widened once for 3 rows of x (dot_linear).
//
// Which path computes a row depends on the call's row count (linear_gemm_rows says), so a row's bits
// may change with the batch size; within one path they never depend on the other rows.
//
// What each choice measured: docs/kernels.md.
// Exposed (bindings.cpp) as torch.ops.loraplane.linear_ and linear_silu_mul_ (in-place on `out`). Builds with
// neither AVX512-BF16 nor AVX2, and other dtypes, run the same ops over at::linear, so callers never
// need to ask.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "cpu_common.h"
#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

namespace {

#if defined(LORAPLANE_AVX512_BF16) || defined(LORAPLANE_AVX2)
#define LORAPLANE_BF16_LINEAR 1  // this build has the bf16 paths below (one body per ISA)
using BF = c10::BFloat16;

constexpr int64_t kFewRows = 4;     // up to here the weight-streaming path wins (bench/linear.py)
#ifdef LORAPLANE_AVX512_BF16
constexpr int64_t kDecodeMaxRows = kFewRows;  // up to here no GEMM (bench/linear.py)
#else
constexpr int64_t kDecodeMaxRows = 16;
#endif
constexpr int64_t kGroupRows = 48;  // rows of W per unit of parallel work (a multiple of 4, 6, 8, 12)

inline uint32_t load_u32(const void* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
#endif

#ifdef LORAPLANE_AVX512_BF16
using loraplane_cpu::load32_bf16;
using loraplane_cpu::store_tile16;
using loraplane_cpu::transpose16;

// One 32-wide slice of K: R rows of W against MT rows of x.
template <int R, int MT>
__attribute__((always_inline)) inline void dot_step(__m512 (&acc)[R][MT], const BF* x, int64_t sx, const BF* w,
                                                    int64_t K, int64_t k, int64_t n) {
  __m512i wr[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) wr[r] = load32_bf16(w + r * K + k, n);
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m) {
    const __m512i xm = load32_bf16(x + m * sx + k, n);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], (__m512bh)wr[r], (__m512bh)xm);
  }
}

// out[m, r] = x[m] . w[r] (+ bias[r]) for R rows of W and MT rows of x.
template <int R, int MT>
inline void tile(BF* out, int64_t so, const BF* x, int64_t sx, const BF* w, int64_t K, const BF* bias) {
  __m512 acc[R][MT];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) dot_step<R, MT>(acc, x, sx, w, K, k, 32);
  if (k < K) dot_step<R, MT>(acc, x, sx, w, K, k, K - k);
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      float v = _mm512_reduce_add_ps(acc[r][m]);
      if (bias != nullptr) v += static_cast<float>(bias[r]);
      out[m * so + r] = BF(v);
    }
}

// ---- the GEMM path -------------------------------------------------------------------------

constexpr int64_t kChunkRows = 64;  // rows of x per packed chunk: up to 4 zmm of 16 rows

// One chunk of `rows` (<= 64) rows of x into xp [K2][width] 32-bit pairs, width = rows rounded up
// to 16; the padding rows are zero. K is even.
void pack_chunk(uint32_t* xp, const BF* x, int64_t sx, int64_t rows, int64_t K2, int64_t width) {
  for (int64_t g = 0; g < width; g += 16) {
    for (int64_t kp = 0; kp < K2; kp += 16) {
      const int64_t n = std::min<int64_t>(16, K2 - kp);
      const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
      __m512i r[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i)
        r[i] = g + i < rows ? _mm512_maskz_loadu_epi32(mask, x + (g + i) * sx + 2 * kp) : _mm512_setzero_si512();
      transpose16(r);
      for (int64_t j = 0; j < n; ++j) _mm512_storeu_si512(xp + (kp + j) * width + g, r[j]);
    }
  }
}

// out[m, n + r] = x[m] . w[n + r] (+ bias) for the chunk's rows m and r < nr (<= NR).
//
// GLU: the tile's first NR/2 rows of W are gate rows n.., its last NR/2 the matching up rows
// (`up` elements further on in w and bias), and out[m, n + p] = silu(gate) * up for p < nr (<=
// NR/2). Gate and up are rounded to bf16 first, as the separate linear_ and silu_mul_ round them,
// so fusing changes no bit of the result.
template <int MT, int NR, bool GLU = false>
inline void gemm_tile(BF* out, int64_t so, int64_t rows, const uint32_t* xp, const BF* w, int64_t K2, const BF* bias,
                      int64_t nr, int64_t up = 0) {
  constexpr int H = GLU ? NR / 2 : NR;  // rows of W per stream: one stream, or the gate and the up one
  __m512 acc[NR][MT];
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < MT; ++j) acc[r][j] = _mm512_setzero_ps();
  const char* next = reinterpret_cast<const char*>(w + H * 2 * K2);  // the tile after this one
  const char* next_up = reinterpret_cast<const char*>(w + up + H * 2 * K2);
  for (int64_t kp = 0; kp < K2; ++kp) {
    _mm_prefetch(next + kp * H * 4, _MM_HINT_T0);  // one tile's bytes over one tile's loop
    if (GLU) _mm_prefetch(next_up + kp * H * 4, _MM_HINT_T0);
    __m512i xv[MT];
#pragma GCC unroll 4
    for (int j = 0; j < MT; ++j) xv[j] = _mm512_loadu_si512(xp + kp * MT * 16 + j * 16);
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) {
      const BF* wr = GLU && r >= H ? w + up + (r - H) * 2 * K2 : w + r * 2 * K2;
      const __m512i b = _mm512_set1_epi32(static_cast<int>(load_u32(wr + kp * 2)));
#pragma GCC unroll 4
      for (int j = 0; j < MT; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)xv[j], (__m512bh)b);
    }
  }
  const auto rounded = [&](int r, int j) {  // acc + bias, rounded to bf16
    const BF* br = bias == nullptr ? nullptr : (GLU && r >= H ? bias + up / (2 * K2) + (r - H) : bias + r);
    const __m512 b = br != nullptr ? _mm512_set1_ps(static_cast<float>(*br)) : _mm512_setzero_ps();
    return (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][j], b));
  };
  store_tile16<H, MT, GLU>(rounded, out, so, rows, nr);
}

// Rows n0..n1 of W against one packed chunk, NR rows of W at a time (single rows for the tail).
// GLU: gate rows n0..n1 with their up rows, NR/2 of each at a time (single pairs for the tail).
template <int MT, int NR, bool GLU = false>
void gemm_rows(BF* out, int64_t so, int64_t rows, const uint32_t* xp, const BF* w, int64_t K2, const BF* bias,
               int64_t n0, int64_t n1, int64_t up = 0) {
  constexpr int H = GLU ? NR / 2 : NR;
  int64_t n = n0;
  for (; n + H <= n1; n += H)
    gemm_tile<MT, NR, GLU>(out + n, so, rows, xp, w + n * 2 * K2, K2, bias == nullptr ? nullptr : bias + n, H, up);
  for (; n < n1; ++n)
    gemm_tile<MT, GLU ? 2 : 1, GLU>(out + n, so, rows, xp, w + n * 2 * K2, K2, bias == nullptr ? nullptr : bias + n,
                                    1, up);
}

// N: rows of W, or, for GLU, gate rows (W holds N gate rows, then N up rows; out is [M, N]).
template <bool GLU = false>
void gemm_linear(BF* out, int64_t so, const BF* x, int64_t sx, const BF* w, const BF* bias, int64_t M, int64_t K,
                 int64_t N) {
  const int64_t K2 = K / 2, chunks = (M + kChunkRows - 1) / kChunkRows;
  const int64_t up = GLU ? N * K : 0;            // elements from a gate row of W to its up row
  const int64_t group = GLU ? kGroupRows / 2 : kGroupRows;  // output columns per unit of parallel work
  // uninitialized: pack_chunk writes every pair of every row up to the chunk's width
  std::unique_ptr<uint32_t[]> packed(new uint32_t[static_cast<size_t>(chunks * kChunkRows * K2)]);
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t rows = std::min(kChunkRows, M - c * kChunkRows);
      pack_chunk(packed.get() + c * kChunkRows * K2, x + c * kChunkRows * sx, sx, rows, K2, (rows + 15) / 16 * 16);
    }
  });
  // each thread takes whole groups of W rows and runs them against every chunk in turn
  at::parallel_for(0, (N + group - 1) / group, 1, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * group, n1 = std::min(N, end * group);
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t rows = std::min(kChunkRows, M - c * kChunkRows);
      const uint32_t* xp = packed.get() + c * kChunkRows * K2;
      BF* oc = out + c * kChunkRows * so;
      switch ((rows + 15) / 16) {
        case 4: gemm_rows<4, 6, GLU>(oc, so, rows, xp, w, K2, bias, n0, n1, up); break;
        case 3: gemm_rows<3, 8, GLU>(oc, so, rows, xp, w, K2, bias, n0, n1, up); break;
        case 2: gemm_rows<2, 12, GLU>(oc, so, rows, xp, w, K2, bias, n0, n1, up); break;
        default: gemm_rows<1, 12, GLU>(oc, so, rows, xp, w, K2, bias, n0, n1, up); break;
      }
    }
  });
}
#elif defined(LORAPLANE_AVX2)
// AVX2 + FMA (x86-64-v3): a bf16 pair (k, k + 1) is one 32-bit lane; its values widen to fp32 by a
// shift (the even one) and a mask (the odd one), and a pair product is two FMAs (avx2::dot_pairs).
// The same two paths as above over 8-lane fp32 vectors.
namespace v2 = loraplane_cpu::avx2;

// One 16-wide slice of K: R rows of W against MT rows of x. S = 2 sums the even and the odd
// products in accumulators of their own ([.][.][0] and [1]): twice the independent FMA chains, for
// the small tiles (M = 1 has one row of x, and each chain waits on its FMA's latency).
template <int R, int MT, int S>
__attribute__((always_inline)) inline void dot_step(__m256 (&acc)[R][MT][S], const BF* x, int64_t sx, const BF* w,
                                                    int64_t K, int64_t k, int64_t n) {
  __m256 we[R], wo[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m256i b = v2::load16_bf16(w + r * K + k, n);
    we[r] = v2::even_f32(b);
    wo[r] = v2::odd_f32(b);
  }
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m) {
    const __m256i xb = v2::load16_bf16(x + m * sx + k, n);
    const __m256 xe = v2::even_f32(xb), xo = v2::odd_f32(xb);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      if (S == 2) {
        acc[r][m][0] = _mm256_fmadd_ps(we[r], xe, acc[r][m][0]);
        acc[r][m][S - 1] = _mm256_fmadd_ps(wo[r], xo, acc[r][m][S - 1]);
      } else {
        acc[r][m][0] = v2::dot_pairs(acc[r][m][0], we[r], wo[r], xe, xo);
      }
    }
  }
}

// out[m, r] = x[m] . w[r] (+ bias[r]) for R rows of W and MT rows of x.
template <int R, int MT>
inline void tile(BF* out, int64_t so, const BF* x, int64_t sx, const BF* w, int64_t K, const BF* bias) {
  constexpr int S = R * MT <= 4 ? 2 : 1;  // 2 x 4 accumulators of 2 FMAs each already fill the FMA pipes
  __m256 acc[R][MT][S];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 2
      for (int s = 0; s < S; ++s) acc[r][m][s] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) dot_step<R, MT, S>(acc, x, sx, w, K, k, 16);
  if (k < K) dot_step<R, MT, S>(acc, x, sx, w, K, k, K - k);
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      float v = v2::hsum(S == 2 ? _mm256_add_ps(acc[r][m][0], acc[r][m][S - 1]) : acc[r][m][0]);
      if (bias != nullptr) v += static_cast<float>(bias[r]);
      out[m * so + r] = BF(v);
    }
}

// ---- the GEMM path -------------------------------------------------------------------------

constexpr int64_t kPanelRows = 24;  // rows of x per register tile: up to 3 ymm of 8 rows
constexpr int64_t kChunkRows = 72;  // rows of x per packed chunk: 3 panels, which share each block of W
constexpr int64_t kBlockRows = 12;  // rows of W run against every panel of a chunk in turn (a multiple of 4, 6)

// One panel of `rows` (<= 24) rows of x into xp, widened to fp32 and split by pair: for each pair
// kp, the rows' even values (width of them, width = rows rounded up to 8), then their odd values,
// [K2][2][width]. The padding rows are zero. K is even. Widening here, once per call, keeps the
// shifts and masks of x out of the GEMM's inner loop.
void pack_panel(float* xp, const BF* x, int64_t sx, int64_t rows, int64_t K2, int64_t width) {
  for (int64_t g = 0; g < width; g += 8) {
    for (int64_t kp = 0; kp < K2; kp += 8) {
      const int64_t n = std::min<int64_t>(8, K2 - kp);
      __m256 r[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i)
        r[i] = g + i < rows ? _mm256_castsi256_ps(v2::load16_bf16(x + (g + i) * sx + 2 * kp, 2 * n))
                            : _mm256_setzero_ps();
      v2::transpose8(r);
      for (int64_t j = 0; j < n; ++j) {
        const __m256i pairs = _mm256_castps_si256(r[j]);
        _mm256_storeu_ps(xp + (kp + j) * 2 * width + g, v2::even_f32(pairs));
        _mm256_storeu_ps(xp + (kp + j) * 2 * width + width + g, v2::odd_f32(pairs));
      }
    }
  }
}

// out[m, n + r] = x[m] . w[n + r] (+ bias) for the panel's rows m and r < nr (<= NR), as the
// AVX-512 gemm_tile (GLU included) with MT accumulators of 8 rows per row of W. Each pair step runs
// in two halves: the even values of x against each row's even value (broadcast), then the odd ones,
// so only MT vectors of x are live: MT x NR accumulators + MT + 1 registers of the 16. `prefetch`:
// bring the next tile of W into L1 (the first panel; the others find this block there).
template <int MT, int NR, bool GLU = false>
__attribute__((noinline)) void gemm_tile(BF* out, int64_t so, int64_t rows, const float* xp, const BF* w, int64_t K2,
                                         const BF* bias, int64_t nr, int64_t up, bool prefetch) {
  constexpr int H = GLU ? NR / 2 : NR;  // rows of W per stream: one stream, or the gate and the up one
  __m256 acc[NR][MT];
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < MT; ++j) acc[r][j] = _mm256_setzero_ps();
  const char* next = reinterpret_cast<const char*>(w + H * 2 * K2);  // the tile after this one
  const char* next_up = reinterpret_cast<const char*>(w + up + H * 2 * K2);
  // row r of the tile at pair kp, from wk = w + 2 kp
  const auto row = [&](const BF* wk, int r) { return GLU && r >= H ? wk + up + (r - H) * 2 * K2 : wk + r * 2 * K2; };
  for (int64_t kp = 0; kp < K2; ++kp) {
    if (prefetch) {
      _mm_prefetch(next + kp * H * 4, _MM_HINT_T0);  // one tile's bytes over one tile's loop
      if (GLU) _mm_prefetch(next_up + kp * H * 4, _MM_HINT_T0);
    }
    const float* xk = xp + kp * 2 * MT * 8;
    const BF* wk = w + 2 * kp;
    __m256 xv[MT];
#pragma GCC unroll 4
    for (int j = 0; j < MT; ++j) xv[j] = _mm256_loadu_ps(xk + j * 8);
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) {
      const __m256 b = v2::even_f32(_mm256_set1_epi32(static_cast<int>(load_u32(row(wk, r)))));
#pragma GCC unroll 4
      for (int j = 0; j < MT; ++j) acc[r][j] = _mm256_fmadd_ps(xv[j], b, acc[r][j]);
    }
    // the same pointer, hidden from the optimizer: else GCC keeps the first half's NR broadcasts
    // for the second, and the registers they take spill accumulators; a second broadcast is a load
    asm("" : "+r"(wk));
#pragma GCC unroll 4
    for (int j = 0; j < MT; ++j) xv[j] = _mm256_loadu_ps(xk + MT * 8 + j * 8);
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) {
      const __m256 b = v2::odd_f32(_mm256_set1_epi32(static_cast<int>(load_u32(row(wk, r)))));
#pragma GCC unroll 4
      for (int j = 0; j < MT; ++j) acc[r][j] = _mm256_fmadd_ps(xv[j], b, acc[r][j]);
    }
  }
  const auto with_bias = [&](int r, int j) {  // acc + bias, in fp32
    const BF* br = bias == nullptr ? nullptr : (GLU && r >= H ? bias + up / (2 * K2) + (r - H) : bias + r);
    return br != nullptr ? _mm256_add_ps(acc[r][j], _mm256_set1_ps(static_cast<float>(*br))) : acc[r][j];
  };
  v2::store_tile8<H, MT, GLU>(with_bias, out, so, rows, nr);
}

// Rows n..n + count of W (GLU: gate rows, with their up rows) against one panel, in tiles of NR rows
// (count a multiple of NR / 2 for GLU, of NR otherwise), or one row (pair) a tile where count is 1.
template <int MT, int NR, bool GLU>
inline void panel_rows(BF* out, int64_t so, int64_t rows, const float* xp, const BF* w, int64_t K2, const BF* bias,
                       int64_t n, int64_t count, int64_t up, bool prefetch) {
  constexpr int H = GLU ? NR / 2 : NR;
  const BF* b = bias == nullptr ? nullptr : bias + n;
  if (count == 1) {
    gemm_tile<MT, GLU ? 2 : 1, GLU>(out + n, so, rows, xp, w + n * 2 * K2, K2, b, 1, up, prefetch);
    return;
  }
  for (int64_t i = 0; i < count; i += H)
    gemm_tile<MT, NR, GLU>(out + n + i, so, rows, xp, w + (n + i) * 2 * K2, K2, b == nullptr ? nullptr : b + i, H, up,
                           prefetch);
}

// Rows n0..n1 of W (GLU: gate rows) against one packed chunk of `rows` rows: a block of kBlockRows
// rows of W (GLU: half of them gate rows, half their up rows) against each panel in turn, so the
// block is read from memory once and from L1 for the other panels; single rows for the tail. The
// tile's width (NR rows of W) suits the panel's MT: 3 x 4, 2 x 6 or 1 x 12 accumulators.
template <bool GLU = false>
void gemm_rows(BF* out, int64_t so, int64_t rows, const float* xp, const BF* w, int64_t K2, const BF* bias,
               int64_t n0, int64_t n1, int64_t up = 0) {
  constexpr int64_t block = GLU ? kBlockRows / 2 : kBlockRows;
  const auto run = [&](int64_t n, int64_t count) {
    for (int64_t p = 0; p * kPanelRows < rows; ++p) {
      const int64_t prow = std::min(kPanelRows, rows - p * kPanelRows);
      const float* pp = xp + p * kPanelRows * 2 * K2;
      BF* op = out + p * kPanelRows * so;
      switch ((prow + 7) / 8) {
        case 3: panel_rows<3, 4, GLU>(op, so, prow, pp, w, K2, bias, n, count, up, p == 0); break;
        case 2: panel_rows<2, 6, GLU>(op, so, prow, pp, w, K2, bias, n, count, up, p == 0); break;
        default: panel_rows<1, 12, GLU>(op, so, prow, pp, w, K2, bias, n, count, up, p == 0); break;
      }
    }
  };
  int64_t n = n0;
  for (; n + block <= n1; n += block) run(n, block);
  for (; n < n1; ++n) run(n, 1);
}

// N: rows of W, or, for GLU, gate rows (W holds N gate rows, then N up rows; out is [M, N]).
template <bool GLU = false>
void gemm_linear(BF* out, int64_t so, const BF* x, int64_t sx, const BF* w, const BF* bias, int64_t M, int64_t K,
                 int64_t N) {
  const int64_t K2 = K / 2, panels = (M + kPanelRows - 1) / kPanelRows;
  const int64_t up = GLU ? N * K : 0;            // elements from a gate row of W to its up row
  const int64_t group = GLU ? kGroupRows / 2 : kGroupRows;  // output columns per unit of parallel work
  const int64_t panel_floats = kPanelRows * 2 * K2;
  // uninitialized: pack_panel writes every value of every row up to the panel's width. Aligned to
  // 64 bytes, so each pair step's loads of x stay within cache lines (as new[] returned it, 16 bytes
  // into a fresh mapping, every other load spanned two lines: ~25% slower at K = 1536)
  std::unique_ptr<float[]> buffer(new float[static_cast<size_t>(panels * panel_floats + 16)]);
  float* const packed = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.get()) + 63) & ~uintptr_t{63});
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t rows = std::min(kPanelRows, M - p * kPanelRows);
      pack_panel(packed + p * panel_floats, x + p * kPanelRows * sx, sx, rows, K2, (rows + 7) / 8 * 8);
    }
  });
  // each thread takes whole groups of W rows and runs them against every chunk in turn
  at::parallel_for(0, (N + group - 1) / group, 1, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * group, n1 = std::min(N, end * group);
    for (int64_t c = 0; c * kChunkRows < M; ++c) {
      const int64_t rows = std::min(kChunkRows, M - c * kChunkRows);
      const float* xp = packed + c * (kChunkRows / kPanelRows) * panel_floats;
      gemm_rows<GLU>(out + c * kChunkRows * so, so, rows, xp, w, K2, bias, n0, n1, up);
    }
  });
}

// ---- the decode path: a few rows of x against the whole of W -------------------------------------
//
// At decode batch sizes (5-16 rows, and the 1-8 rows a larger call leaves past its whole panels) the
// GEMM above has one or two vectors of 8 rows of x per tile, so each broadcast value of W (widened by
// one shift or mask) feeds only one or two FMAs, and the widening binds before the FMAs do. Here W is
// read in its own row order as vectors of 16 values, widened once (two ops) and multiplied into MT
// rows of x, so one widening feeds MT FMAs (x is widened to fp32 once per call, widen_rows). Each (row of W, row of x) keeps an accumulator
// vector of 8 partial sums, summed across its lanes at the end, as tile<> does above. K runs in blocks
// whose rows of x stay in L1 while every row of the thread's W passes; the accumulators go to a scratch
// buffer between blocks (fp32, exactly), so the block size changes no bit of the result, and neither
// does the number of rows of x: a row's result is the same in any batch this path takes.
constexpr int kDotWRows = 3;  // rows of W per tile
constexpr int kDotXRows = 3;  // rows of x per tile: 9 accumulators + 3 widened rows of W + one of x

// x [M, K] into xw, widened, block by block: [K16 / block][M][block][2][8] fp32 (K16 = K rounded up
// to 16, / 16; a step s of 16 values holds 8 even values, then 8 odd ones), zero past K. A block's
// rows are one contiguous piece (M x block x 64 bytes): rows of x a multiple of 4 KB apart would
// fall in the same sets of L1, more of them than its 8 ways.
void widen_rows(float* xw, const BF* x, int64_t sx, int64_t M, int64_t K, int64_t K16, int64_t block) {
  for (int64_t s0 = 0; s0 < K16; s0 += block)
    for (int64_t m = 0; m < M; ++m) {
      float* o = xw + (s0 * M + m * block) * 16;
      for (int64_t s = s0; s < std::min(K16, s0 + block); ++s) {
        const __m256i b = v2::load16_bf16(x + m * sx + 16 * s, K - 16 * s);
        _mm256_storeu_ps(o + 16 * (s - s0), v2::even_f32(b));
        _mm256_storeu_ps(o + 16 * (s - s0) + 8, v2::odd_f32(b));
      }
    }
}

// acc[r][j] += w[r][16 s0 .. 16 s1) . x[j][same] for R rows of W (row stride K) and MT rows of x
// (widened: the block's rows from step s0 on, xs floats apart); acc_io[r * M + j] holds acc[r][j] in
// memory, loaded and stored once.
template <int R, int MT>
__attribute__((noinline)) void dot_tile(__m256* acc_io, int64_t M, const float* xw, int64_t xs, const BF* w, int64_t K,
                                        int64_t s0, int64_t s1) {
  __m256 acc[R][MT];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < MT; ++j) acc[r][j] = _mm256_loadu_ps(reinterpret_cast<const float*>(acc_io + r * M + j));
  const int64_t whole = std::min(s1, K / 16);  // steps with 16 values of W in the row
  for (int64_t s = s0; s < s1; ++s) {
    const BF* ws = w + 16 * s;
    const int64_t n = s < whole ? 16 : K - 16 * s;
    __m256 wv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) wv[r] = v2::even_f32(v2::load16_bf16(ws + r * K, n));
#pragma GCC unroll 4
    for (int j = 0; j < MT; ++j) {
      __m256 xv = _mm256_loadu_ps(xw + j * xs + 16 * (s - s0));
      asm("" : "+x"(xv));  // one load of x for its R FMAs (else GCC folds a load into each)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(wv[r], xv, acc[r][j]);
    }
    asm("" : "+r"(ws));  // reload W for the odd half rather than keep R more registers (as gemm_tile)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) wv[r] = v2::odd_f32(v2::load16_bf16(ws + r * K, n));
#pragma GCC unroll 4
    for (int j = 0; j < MT; ++j) {
      __m256 xv = _mm256_loadu_ps(xw + j * xs + 16 * (s - s0) + 8);
      asm("" : "+x"(xv));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(wv[r], xv, acc[r][j]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < MT; ++j) _mm256_storeu_ps(reinterpret_cast<float*>(acc_io + r * M + j), acc[r][j]);
}

// R rows of W against all M rows of x, kDotXRows (or fewer) at a time; acc [R][M] vectors.
// Rows of x per tile from row m on: kDotXRows, but a last row left alone (M = 3q + 1) goes with the
// three before it as 2 + 2 (a one-row tile widens W for a single FMA).
inline int64_t dot_x_rows(int64_t m, int64_t M) {
  const int64_t left = M - m;
  return left == kDotXRows + 1 || left == 2 ? 2 : std::min<int64_t>(kDotXRows, left);
}

template <int R>
void dot_rows(__m256* acc, const float* xw, int64_t xs, const BF* w, int64_t M, int64_t K, int64_t s0, int64_t s1) {
  for (int64_t m = 0; m < M;) {
    const int64_t mt = dot_x_rows(m, M);
    switch (mt) {
      case 3: dot_tile<R, 3>(acc + m, M, xw + m * xs, xs, w, K, s0, s1); break;
      case 2: dot_tile<R, 2>(acc + m, M, xw + m * xs, xs, w, K, s0, s1); break;
      default: dot_tile<R, 1>(acc + m, M, xw + m * xs, xs, w, K, s0, s1); break;
    }
    m += mt;
  }
}

void dot_linear(BF* out, int64_t so, const BF* x, int64_t sx, const BF* w, const BF* bias, int64_t M, int64_t K,
                int64_t N) {
  const int64_t K16 = (K + 15) / 16;
  // steps of 16 values of K per block: the block's rows of x take ~16 KB of L1
  const int64_t block = std::max<int64_t>(8, std::min(K16, 256 / M)), xs = block * 16;
  std::unique_ptr<float[]> widened(new float[static_cast<size_t>((K16 + block - 1) / block * block * M * 16)]);
  widen_rows(widened.get(), x, sx, M, K, K16, block);
  at::parallel_for(0, (N + kGroupRows - 1) / kGroupRows, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<__m256[]> acc(new __m256[static_cast<size_t>(kGroupRows * M)]);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * kGroupRows, rows = std::min(kGroupRows, N - n0);
      std::fill_n(reinterpret_cast<float*>(acc.get()), rows * M * 8, 0.0f);
      for (int64_t s0 = 0; s0 < K16; s0 += block) {
        const int64_t s1 = std::min(K16, s0 + block);
        const float* xb = widened.get() + s0 * M * 16;  // this block's rows of x
        int64_t r = 0;
        for (; r + kDotWRows <= rows; r += kDotWRows) {
          // the next tile's part of this block, on its way from memory while this tile computes
          const char* next = reinterpret_cast<const char*>(w + (n0 + r + kDotWRows) * K + 16 * s0);
          const int64_t bytes = std::min(16 * (s1 - s0), K - 16 * s0) * 2;
          if (r + 2 * kDotWRows <= rows)
            for (int64_t i = 0; i < kDotWRows; ++i)
              for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(next + i * K * 2 + b, _MM_HINT_T0);
          dot_rows<kDotWRows>(acc.get() + r * M, xb, xs, w + (n0 + r) * K, M, K, s0, s1);
        }
        for (; r < rows; ++r) dot_rows<1>(acc.get() + r * M, xb, xs, w + (n0 + r) * K, M, K, s0, s1);
      }
      for (int64_t r = 0; r < rows; ++r)  // acc [rows][M]: (row of W, row of x)
        for (int64_t m = 0; m < M; ++m) {
          float v = v2::hsum(acc[r * M + m]);
          if (bias != nullptr) v += static_cast<float>(bias[n0 + r]);
          out[m * so + n0 + r] = BF(v);
        }
    }
  });
}
#endif

#ifdef LORAPLANE_BF16_LINEAR
// R rows of W against all M rows of x, four at a time.
template <int R>
inline void w_rows(BF* out, int64_t so, const BF* x, int64_t sx, const BF* w, int64_t M, int64_t K, const BF* bias) {
  loraplane_cpu::by_four_rows(
      M, [&](auto mt, int64_t m) { tile<R, decltype(mt)::value>(out + m * so, so, x + m * sx, sx, w, K, bias); });
}

template <int R>
void few_rows_linear(BF* out, int64_t so, const BF* x, int64_t sx, const BF* w, const BF* bias, int64_t M,
                     int64_t K, int64_t N) {
  const int64_t groups = (N + R - 1) / R;
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n = g * R;
      if (n + R <= N) {
        w_rows<R>(out + n, so, x, sx, w + n * K, M, K, bias == nullptr ? nullptr : bias + n);
        continue;
      }
      for (int64_t j = n; j < N; ++j)
        w_rows<1>(out + j, so, x, sx, w + j * K, M, K, bias == nullptr ? nullptr : bias + j);
    }
  });
}

// How many of a call's M rows (the first ones) the GEMM takes; the rest run decode_linear. The GEMM
// needs whole pairs (even K) and rows enough to fill its tiles. In the AVX2 build a last panel of
// 1-8 rows (one vector of x against 12 broadcast rows of W) would run at a quarter of the speed of
// the full ones, so those rows go to the decode paths (bench/linear.py measured both).
inline int64_t gemm_head(int64_t M, int64_t K) {
  if (K % 2 != 0 || M <= kDecodeMaxRows) return 0;
#ifdef LORAPLANE_AVX512_BF16
  return M;
#else
  const int64_t tail = M % kPanelRows;
  return tail <= 8 ? M - tail : M;
#endif
}

// The rows the GEMM does not take: up to kFewRows by streaming W row by row; more (odd K) in
// two-row tiles (AVX-512) or on the decode path (AVX2, any K).
void decode_linear(BF* out, int64_t so, const BF* x, int64_t sx, const BF* w, const BF* bias, int64_t M, int64_t K,
                   int64_t N) {
  if (M <= kFewRows) {
    few_rows_linear<1>(out, so, x, sx, w, bias, M, K, N);
    return;
  }
#ifdef LORAPLANE_AVX512_BF16
  few_rows_linear<2>(out, so, x, sx, w, bias, M, K, N);
#else
  dot_linear(out, so, x, sx, w, bias, M, K, N);
#endif
}
#endif

}  // namespace

namespace loraplane_cpu {

int64_t linear_gemm_rows(int64_t rows, int64_t k) {
#ifdef LORAPLANE_BF16_LINEAR
  return gemm_head(rows, k);
#else
  (void)rows, (void)k;
  return 0;
#endif
}

// out: [M, N], x: [M, K] (rows may be strided), w: [N, K] contiguous, bias: [N] or none; one dtype.
void linear_(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && out.device().is_cpu(), "linear_: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2, "linear_: x [M, K], w [N, K], out [M, N]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "linear_: w has ", w.size(1), " columns, x has ", K);
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "linear_: out must be [", M, ", ", N, "]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && out.scalar_type() == x.scalar_type(),
              "linear_: x, w and out must share a dtype");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && w.is_contiguous(),
              "linear_: rows of x and out, and all of w, must be contiguous");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous(), "linear_: bias must be [N]");
    TORCH_CHECK(bias->scalar_type() == x.scalar_type(), "linear_: bias must share x's dtype");
  }
  if (M == 0 || N == 0) return;
#ifdef LORAPLANE_BF16_LINEAR
  if (x.scalar_type() == at::kBFloat16) {
    auto* po = out.data_ptr<BF>();
    const auto *px = x.data_ptr<BF>(), *pw = w.data_ptr<BF>();
    const BF* pb = bias.has_value() ? bias->data_ptr<BF>() : nullptr;
    const int64_t so = out.stride(0), sx = x.stride(0), head = gemm_head(M, K);
    if (head > 0) gemm_linear(po, so, px, sx, pw, pb, head, K, N);
    if (head < M) decode_linear(po + head * so, so, px + head * sx, sx, pw, pb, M - head, K, N);
    return;
  }
#endif
  out.copy_(at::linear(x, w, bias));
}

// out: [M, I] = silu(gate) * up for [gate | up] = x W^T (+ b); w: [2I, K], gate rows first (the
// MLP's merged gate_up layer). The GEMM path computes both halves in one tile and writes only
// out; fewer rows, odd K and other dtypes run linear_ and then silu * up. Same bits either way.
void linear_silu_mul_(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2 && w.size(0) % 2 == 0,
              "linear_silu_mul_: x [M, K], w [2I, K], out [M, I]");
  const int64_t M = x.size(0), K = x.size(1), I = w.size(0) / 2;
  TORCH_CHECK(out.size(0) == M && out.size(1) == I, "linear_silu_mul_: out must be [", M, ", ", I, "]");
#ifdef LORAPLANE_BF16_LINEAR
  const int64_t head = gemm_head(M, K);  // rows the fused GEMM takes; the rest run unfused (below)
  if (x.scalar_type() == at::kBFloat16 && head > 0) {
    TORCH_CHECK(w.size(1) == K, "linear_silu_mul_: w has ", w.size(1), " columns, x has ", K);
    TORCH_CHECK(w.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
                "linear_silu_mul_: x, w and out must share a dtype");
    TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && out.device().is_cpu(),
                "linear_silu_mul_: CPU tensors only");
    TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && w.is_contiguous(),
                "linear_silu_mul_: rows of x and out, and all of w, must be contiguous");
    if (bias.has_value())
      TORCH_CHECK(bias->dim() == 1 && bias->size(0) == 2 * I && bias->is_contiguous() &&
                      bias->scalar_type() == at::kBFloat16,
                  "linear_silu_mul_: bias must be a bf16 [2I]");
    if (I == 0) return;
    gemm_linear<true>(out.data_ptr<BF>(), out.stride(0), x.data_ptr<BF>(), x.stride(0), w.data_ptr<BF>(),
                      bias.has_value() ? bias->data_ptr<BF>() : nullptr, head, K, I);
    if (head == M) return;
    at::Tensor rest = out.narrow(0, head, M - head);  // the last rows, unfused (as below)
    linear_silu_mul_(rest, x.narrow(0, head, M - head), w, bias);
    return;
  }
#endif
  at::Tensor gate_up = at::empty({M, 2 * I}, x.options());
  linear_(gate_up, x, w, bias);
  if (x.scalar_type() == at::kBFloat16) {
    silu_mul_(out, gate_up);  // layer_ops_cpu.cpp
    return;
  }
  out.copy_(at::silu(gate_up.narrow(1, 0, I)) * gate_up.narrow(1, I, I));
}

}  // namespace loraplane_cpu
