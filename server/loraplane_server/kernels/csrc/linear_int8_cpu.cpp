// y = x (scale * w)^T (+ bias) on the CPU for an int8 weight: x and y bf16, w int8 [N, K] quantized
// symmetrically per output channel (row n of the real weight is scale[n] * w[n], |w| <= 127;
// executor/layers/quant.py quantize_int8), wsum[n] = sum_k w[n, k]. Half the bytes of a bf16 weight, and a
// decode step's linear layers are bound by the bytes of their weights.
//
// Two paths, chosen by the number of rows M, as in linear_cpu.cpp:
//
// * M <= kFewRows (decode): weight-only, exact up to the fp32 sums. W streams once in address order,
//   one row at a time, prefetched 4 KB ahead; its int8 values are widened to fp32 in registers
//   (vpmovsxbd + vcvtdq2ps, 16 a vector; 8 on AVX2) and FMA'd with up to 4 rows of x, widened to
//   fp32 once per call. A row's dot is scaled by scale[n] at the end, the bias added and the sum
//   rounded to bf16 once. Where the CPU has AVX-512 VBMI (checked at run time; every AVX-512 BF16 CPU
//   but Cooper Lake), the int8 values become bf16 instead, exactly (|w| <= 127 needs 7 bits), by a
//   byte-table lookup (vpermi2b), and vdpbf16ps takes them against x in bf16: the products are the
//   same exact values, in half the vector operations (few_rows_bf16).
//
// * more rows (prefill, batched decode): W8A8. Each row of x is quantized as it is packed (symmetric,
//   s_x = amax|row| / 127, x_q = round(x * 127 / amax) to nearest even), the dot products run in int32
//   (exact, so the tile shape and the order never change a bit), and out = acc * (s_x[m] * scale[n])
//   (+ bias), rounded to bf16 once. Each element's error is that of x's quantization:
//   |out - exact| <= scale[n] * s_x[m] / 2 * sum_k |w[n, k]|, plus the bf16 rounding.
//   AVX-512: vpdpbusd (VNNI) multiplies unsigned bytes by signed ones, 4 products into each int32
//   lane, so x goes in as x_q + 128 (u8) and 128 * wsum[n] comes off each sum. x is packed per call
//   into 64-row chunks of 4-byte quads laid out [K/4][rows] (one zmm: quad k of 16 rows); a tile of
//   NR rows of W, read in place, broadcasts its quad k into MT x NR accumulators of 16 rows, with the
//   register tiling, grouping and prefetch of linear_cpu.cpp's bf16 GEMM.
//   AVX2 (x86-64-v3 has no VNNI, nor have Zen 3 and Intel before Alder Lake): vpmaddubsw of |x_q|
//   (u8) with sign(w, x_q) (s8, vpsignb) makes pair sums of at most 2 * 127 * 127 < 32767, so the
//   int16 never saturates, and vpmaddwd with ones sums the pairs into int32 quads (no wsum needed).
//   x is packed into 16-row panels [K/4][|x_q|, x_q][rows], so the sign source is a memory operand.
//
// Each output element is computed by one thread in a fixed order: results do not depend on the
// thread count, and on the GEMM path a row's result does not depend on the other rows of the call.
// Rows of W are spread over torch's intra-op pool. linear_int8_silu_mul_ is the MLP's gate_up with
// silu(gate) * up in the GEMM's epilogue (gate and up rounded to bf16 first, as linear_int8_ leaves
// them), so it gives the bits of linear_int8_ then silu_mul_.
//
// Builds with neither AVX-512 BF16 nor AVX2 dequantize W to fp32 and run at::linear (exact, slow),
// so callers never need to ask. What each choice measured: docs/kernels.md.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "cpu_common.h"
#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(LORAPLANE_AVX512_BF16) && !defined(__AVX512VNNI__)
#error "the avx512_bf16 target compiles with -mavx512vnni (cpu_features.KERNEL_TARGETS): the int8 GEMM needs vpdpbusd"
#endif

namespace {

#if defined(LORAPLANE_AVX512_BF16) || defined(LORAPLANE_AVX2)
#define LORAPLANE_INT8_LINEAR 1  // this build has the int8 paths below (one vector body per ISA)
using BF = c10::BFloat16;

constexpr int64_t kFewRows = 4;     // up to here W streams once against every row of x
constexpr int64_t kGroupRows = 48;  // rows of W per unit of parallel work (a multiple of every NR)
// Longer rows take the few-rows path at any M: the int32 sums of u8 x s8 products stay exact up to
// K * 255 * 127 < 2^31.
constexpr int64_t kMaxGemmK = 65536;

inline uint32_t load_u32(const void* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The partial last quad of a W row: its n (< 4) bytes at p, zero above (never read past the row: W
// may end at a page's end).
inline uint32_t partial_quad(const int8_t* p, int64_t n) {
  uint32_t v = 0;
  for (int64_t b = 0; b < n; ++b) v |= static_cast<uint32_t>(static_cast<uint8_t>(p[b])) << (8 * b);
  return v;
}

// What a GEMM tile reads of W: rows n.. of w, their scales, sums and biases; for GLU, gate row n's
// up row is up_rows further on.
struct Int8Rows {
  const int8_t* w;
  const float* scale;
  const int32_t* wsum;
  const BF* bias;  // or null
  int64_t K, up_rows;
};
#endif

#ifdef LORAPLANE_AVX512_BF16
using loraplane_cpu::load16_bf16_as_f32;
using loraplane_cpu::store_tile16;
using loraplane_cpu::transpose16;

// ---- the few-rows path's vector layer: 16 fp32 lanes ----
using VF = __m512;
constexpr int64_t kLanes = 16;
__attribute__((always_inline)) inline VF widen_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
__attribute__((always_inline)) inline VF fmadd(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
__attribute__((always_inline)) inline VF loadf(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((always_inline)) inline VF zerof() { return _mm512_setzero_ps(); }
__attribute__((always_inline)) inline VF addf(VF a, VF b) { return _mm512_add_ps(a, b); }
__attribute__((always_inline)) inline float hsumf(VF a) { return _mm512_reduce_add_ps(a); }

// ---- the GEMM path ----
constexpr int64_t kChunkRows = 64;  // rows of x per packed chunk: up to 4 zmm of 16 rows
constexpr int64_t kPlanes = 1;      // quads per row and k in the packed x: x_q + 128

// Row x (K bf16) quantized into q (K bytes, x_q + 128 as u8: 1..255); returns s_x = amax / 127 (0 for
// a zero row, whose bytes are all 128, i.e. x_q = 0).
float quantize_row(uint8_t* q, const BF* x, int64_t K) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load16_bf16_as_f32(x + k, K - k)));
  const float a = _mm512_reduce_max_ps(amax);
  const __m512 inv = _mm512_set1_ps(a > 0.f ? 127.f / a : 0.f);
  for (int64_t k = 0; k < K; k += 16) {
    const int64_t n = std::min<int64_t>(16, K - k);
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load16_bf16_as_f32(x + k, n), inv));  // nearest even
    v = _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
    v = _mm512_add_epi32(v, _mm512_set1_epi32(128));
    _mm_mask_storeu_epi8(q + k, static_cast<__mmask16>((1u << n) - 1), _mm512_cvtepi32_epi8(v));
  }
  return a / 127.f;
}

// One chunk of `rows` (<= 64) rows of x, quantized, into xp [K4][width] quads (width = rows rounded
// up to 16) and their s_x into sx [width]. Bytes past K and the padding rows are 0: a u8 0 adds
// nothing to a sum, whatever W holds there.
void pack_chunk(uint32_t* xp, float* sx, const BF* x, int64_t stride, int64_t rows, int64_t K, int64_t K4,
                int64_t width) {
  std::vector<uint32_t> q(static_cast<size_t>(16 * K4));  // 16 quantized rows, row-major
  for (int64_t g = 0; g < width; g += 16) {
    std::fill(q.begin(), q.end(), 0u);
    for (int64_t i = 0; i < 16; ++i) {
      sx[g + i] = g + i < rows ? quantize_row(reinterpret_cast<uint8_t*>(q.data() + i * K4), x + (g + i) * stride, K)
                               : 0.f;
    }
    for (int64_t kq = 0; kq < K4; kq += 16) {
      const int64_t n = std::min<int64_t>(16, K4 - kq);
      const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
      __m512i r[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) r[i] = _mm512_maskz_loadu_epi32(mask, q.data() + i * K4 + kq);
      transpose16(r);
      for (int64_t j = 0; j < n; ++j) _mm512_storeu_si512(xp + (kq + j) * width + g, r[j]);
    }
  }
}

// One quad k of MT x 16 rows of x (xk: packed, u8) against quad k of NR rows of W (q, s8), into the
// tile's accumulators.
template <int MT, int NR>
__attribute__((always_inline)) inline void vnni_step(__m512i (&acc)[NR][MT], const uint32_t* xk,
                                                     const uint32_t (&q)[NR]) {
  __m512i xv[MT];
#pragma GCC unroll 4
  for (int j = 0; j < MT; ++j) xv[j] = _mm512_loadu_si512(xk + j * 16);
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r) {
    const __m512i b = _mm512_set1_epi32(static_cast<int>(q[r]));
#pragma GCC unroll 4
    for (int j = 0; j < MT; ++j) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], xv[j], b);
  }
}

// out[m, n + r] = s_x[m] scale[n + r] (x_q[m] . w[n + r]) (+ bias) for the chunk's rows m and r < nr
// (<= NR); w etc. of W point at row n.
//
// GLU: the tile's first NR/2 rows of W are gate rows, its last NR/2 their up rows, and out[m, n + p] =
// silu(gate) * up for p < nr (<= NR/2), gate and up rounded to bf16 first.
template <int MT, int NR, bool GLU = false>
inline void gemm_tile(BF* out, int64_t so, int64_t rows, const uint32_t* xp, const float* sx, const Int8Rows& W,
                      int64_t nr) {
  constexpr int H = GLU ? NR / 2 : NR;  // rows of W per stream: one stream, or the gate and the up one
  const int64_t K = W.K, full = K / 4, up = W.up_rows * K;
  __m512i acc[NR][MT];
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < MT; ++j) acc[r][j] = _mm512_setzero_si512();
  const auto row = [&](int r) { return GLU && r >= H ? W.w + up + (r - H) * K : W.w + r * K; };
  const char* next = reinterpret_cast<const char*>(W.w + H * K);  // the tile after this one
  const char* next_up = reinterpret_cast<const char*>(W.w + up + H * K);
  uint32_t q[NR];  // quad kq of each row of the tile
  if (full * 4 < K) {  // the partial last quad first: integer sums do not care about order, and the
    // register allocator keeps the accumulators in registers only with nothing after the loop
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) q[r] = partial_quad(row(r) + 4 * full, K - 4 * full);
    vnni_step<MT, NR>(acc, xp + full * MT * 16, q);
  }
  for (int64_t kq = 0; kq < full; ++kq) {
    _mm_prefetch(next + kq * H * 4, _MM_HINT_T0);  // one tile's bytes over one tile's loop
    if (GLU) _mm_prefetch(next_up + kq * H * 4, _MM_HINT_T0);
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) q[r] = load_u32(row(r) + 4 * kq);
    vnni_step<MT, NR>(acc, xp + kq * MT * 16, q);
  }
  const auto rounded = [&](int r, int j) {  // (acc - 128 wsum) s_x scale + bias, rounded to bf16
    const int64_t i = GLU && r >= H ? W.up_rows + r - H : r;
    const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(sx + j * 16), _mm512_set1_ps(W.scale[i]));
    const __m512 b = _mm512_set1_ps(W.bias != nullptr ? static_cast<float>(W.bias[i]) : 0.f);
    const __m512i a = _mm512_sub_epi32(acc[r][j], _mm512_set1_epi32(128 * W.wsum[i]));
    return (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(_mm512_cvtepi32_ps(a), s, b));
  };
  store_tile16<H, MT, GLU>(rounded, out, so, rows, nr);
}

// The tile shapes per chunk height: MT zmm of 16 rows of x by NR rows of W (MT x NR + MT + 1 of 32
// registers).
template <int MT>
constexpr int kTileW = MT == 4 ? 6 : MT == 3 ? 8 : 12;
#elif defined(LORAPLANE_AVX2)
namespace v2 = loraplane_cpu::avx2;

// ---- the few-rows path's vector layer: 8 fp32 lanes ----
using VF = __m256;
constexpr int64_t kLanes = 8;
__attribute__((always_inline)) inline VF widen_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
__attribute__((always_inline)) inline VF fmadd(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
__attribute__((always_inline)) inline VF loadf(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((always_inline)) inline VF zerof() { return _mm256_setzero_ps(); }
__attribute__((always_inline)) inline VF addf(VF a, VF b) { return _mm256_add_ps(a, b); }
__attribute__((always_inline)) inline float hsumf(VF a) { return v2::hsum(a); }

// ---- the GEMM path ----
constexpr int64_t kChunkRows = 16;  // rows of x per packed panel: up to 2 ymm of 8 rows
constexpr int64_t kPlanes = 2;      // quads per row and k in the packed x: |x_q|, then x_q

// Row x (K bf16) quantized into q (K signed bytes in [-127, 127]); returns s_x = amax / 127 (0 for a
// zero row, whose bytes are all 0). The same arithmetic as the AVX-512 quantize_row.
float quantize_row(int8_t* q, const BF* x, int64_t K) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 amax = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8)
    amax = _mm256_max_ps(amax, _mm256_and_ps(abs_mask, v2::load8_bf16_as_f32(x + k, K - k)));
  const float a = v2::hmax(amax);
  const __m256 inv = _mm256_set1_ps(a > 0.f ? 127.f / a : 0.f);
  for (int64_t k = 0; k < K; k += 8) {
    const int64_t n = std::min<int64_t>(8, K - k);
    __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(v2::load8_bf16_as_f32(x + k, n), inv));  // nearest even
    v = _mm256_max_epi32(_mm256_min_epi32(v, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
    const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    const __m128i b8 = _mm_packs_epi16(w16, w16);  // values in range: the saturating packs are exact
    if (n == 8) {
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), b8);
    } else {
      alignas(16) int8_t buf[16];
      _mm_store_si128(reinterpret_cast<__m128i*>(buf), b8);
      std::memcpy(q + k, buf, static_cast<size_t>(n));
    }
  }
  return a / 127.f;
}

// One panel of `rows` (<= 16) rows of x, quantized, into xp: for each quad k, |x_q| of the panel's
// rows (width of them, rows rounded up to 8), then x_q: [K4][2][width]; s_x into sx [width]. Bytes
// past K and the padding rows are 0, which adds nothing (vpsignb zeroes W where x_q is 0).
void pack_chunk(uint32_t* xp, float* sx, const BF* x, int64_t stride, int64_t rows, int64_t K, int64_t K4,
                int64_t width) {
  std::vector<uint32_t> q(static_cast<size_t>(8 * K4 + 8));  // 8 quantized rows, row-major (+ a tail load's slack)
  for (int64_t g = 0; g < width; g += 8) {
    std::fill(q.begin(), q.end(), 0u);
    for (int64_t i = 0; i < 8; ++i) {
      sx[g + i] = g + i < rows ? quantize_row(reinterpret_cast<int8_t*>(q.data() + i * K4), x + (g + i) * stride, K)
                               : 0.f;
    }
    for (int64_t kq = 0; kq < K4; kq += 8) {
      const int64_t n = std::min<int64_t>(8, K4 - kq);
      __m256 r[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        alignas(32) uint32_t buf[8] = {};
        std::memcpy(buf, q.data() + i * K4 + kq, static_cast<size_t>(n) * 4);
        r[i] = _mm256_load_ps(reinterpret_cast<const float*>(buf));
      }
      v2::transpose8(r);
      for (int64_t j = 0; j < n; ++j) {
        const __m256i quads = _mm256_castps_si256(r[j]);
        uint32_t* dst = xp + (kq + j) * 2 * width + g;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_abs_epi8(quads));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + width), quads);
      }
    }
  }
}

// One quad k of MT x 8 rows of x (xk: |x_q| of the rows, then x_q) against quad k of NR rows of W (q),
// into the tile's accumulators.
template <int MT, int NR>
__attribute__((always_inline)) inline void madd_step(__m256i (&acc)[NR][MT], const uint32_t* xk,
                                                     const uint32_t (&q)[NR]) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i ax[MT];
#pragma GCC unroll 4
  for (int j = 0; j < MT; ++j) ax[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xk + j * 8));
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r) {
    const __m256i b = _mm256_set1_epi32(static_cast<int>(q[r]));
#pragma GCC unroll 4
    for (int j = 0; j < MT; ++j) {
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xk + MT * 8 + j * 8));
      const __m256i pairs = _mm256_maddubs_epi16(ax[j], _mm256_sign_epi8(b, xq));  // |x_q| w sign(x_q)
      acc[r][j] = _mm256_add_epi32(acc[r][j], _mm256_madd_epi16(pairs, ones));
    }
  }
}

// out[m, n + r] = s_x[m] scale[n + r] (x_q[m] . w[n + r]) (+ bias) for the panel's rows m and r < nr
// (<= NR), as the AVX-512 gemm_tile (GLU included) with MT accumulators of 8 rows per row of W:
// MT x NR + MT (|x_q|) + 4 (a row's quad, its signed copy, a product, ones) of 16 registers.
template <int MT, int NR, bool GLU = false>
__attribute__((noinline)) void gemm_tile(BF* out, int64_t so, int64_t rows, const uint32_t* xp, const float* sx,
                                         const Int8Rows& W, int64_t nr) {
  constexpr int H = GLU ? NR / 2 : NR;
  const int64_t K = W.K, full = K / 4, up = W.up_rows * K;
  __m256i acc[NR][MT];
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < MT; ++j) acc[r][j] = _mm256_setzero_si256();
  const auto row = [&](int r) { return GLU && r >= H ? W.w + up + (r - H) * K : W.w + r * K; };
  const char* next = reinterpret_cast<const char*>(W.w + H * K);
  const char* next_up = reinterpret_cast<const char*>(W.w + up + H * K);
  uint32_t q[NR];  // quad kq of each row of the tile
  if (full * 4 < K) {  // the partial last quad first: integer sums do not care about order, and the
    // register allocator keeps the accumulators in registers only with nothing after the loop
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) q[r] = partial_quad(row(r) + 4 * full, K - 4 * full);
    madd_step<MT, NR>(acc, xp + full * 2 * MT * 8, q);
  }
  for (int64_t kq = 0; kq < full; ++kq) {
    _mm_prefetch(next + kq * H * 4, _MM_HINT_T0);
    if (GLU) _mm_prefetch(next_up + kq * H * 4, _MM_HINT_T0);
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) q[r] = load_u32(row(r) + 4 * kq);
    madd_step<MT, NR>(acc, xp + kq * 2 * MT * 8, q);
  }
  const auto value = [&](int r, int j) {  // acc s_x scale + bias, in fp32
    const int64_t i = GLU && r >= H ? W.up_rows + r - H : r;
    const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(sx + j * 8), _mm256_set1_ps(W.scale[i]));
    const __m256 b = _mm256_set1_ps(W.bias != nullptr ? static_cast<float>(W.bias[i]) : 0.f);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][j]), s, b);
  };
  v2::store_tile8<H, MT, GLU>(value, out, so, rows, nr);
}

template <int MT>
constexpr int kTileW = MT == 2 ? 4 : 8;
#endif

#ifdef LORAPLANE_INT8_LINEAR
// ---- few rows: W streamed once, widened to fp32 in registers ----
constexpr int64_t kStep = 4 * kLanes;  // bytes of a W row per step: 4 vectors
// How far ahead of the row being read W is prefetched: with W streaming from memory the hardware
// prefetcher alone left the few-rows path ~15-25% short of the read rate (bench: docs/kernels.md).
constexpr int64_t kPrefetchBytes = 4096;

// One step of a W row (kStep int8 at w) against MT rows of x (fp32, x + m * stride), into S sums per row.
template <int MT, int S>
__attribute__((always_inline)) inline void few_step(VF (&acc)[MT][S], const int8_t* w, const float* x,
                                                    int64_t stride) {
  _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const VF wv = widen_i8(w + c * kLanes);
#pragma GCC unroll 4
    for (int m = 0; m < MT; ++m) acc[m][c % S] = fmadd(wv, loadf(x + m * stride + c * kLanes), acc[m][c % S]);
  }
}

// out[m * so] = scale (x[m] . w) + bias for one row w of W and MT rows of x (fp32 [MT][stride], zero
// from K to the next multiple of kStep).
template <int MT>
__attribute__((always_inline)) inline void few_tile(BF* out, int64_t so, const float* x, int64_t stride,
                                                    const int8_t* w, int64_t K, float scale, float bias) {
  constexpr int S = MT == 1 ? 4 : 2;  // sums per row of x: enough FMA chains in flight for one row too
  VF acc[MT][S];
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) acc[m][s] = zerof();
  int64_t k = 0;
  for (; k + kStep <= K; k += kStep) few_step<MT, S>(acc, w + k, x + k, stride);
  if (k < K) {  // the row's last bytes, never read past: W may end at a page's end
    alignas(64) int8_t tail[kStep] = {};
    std::memcpy(tail, w + k, static_cast<size_t>(K - k));
    few_step<MT, S>(acc, tail, x + k, stride);
  }
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m) {
    VF sum = acc[m][0];
#pragma GCC unroll 4
    for (int s = 1; s < S; ++s) sum = addf(sum, acc[m][s]);
    out[m * so] = BF(hsumf(sum) * scale + bias);
  }
}

#ifdef LORAPLANE_AVX512_BF16
// ---- few rows on AVX-512 VBMI: int8 to bf16 by table, then vdpbf16ps ----
// |w| <= 127 fits bf16's 8 significant bits, so bf16(w) is exact and so is each product with x (bf16):
// the same sums as above, in half the vector operations. Two vpermi2b look up the low and the high
// byte of bf16(|w|) in 128-entry tables, one vpternlogd ORs w's sign into the high byte, and two
// vpunpck[lh]bw pair the bytes: 6 operations and 2 vdpbf16ps per 64 weights and row of x, where the
// widening to fp32 takes 8 and 4 FMAs. x is laid out to match the unpacks' order (widen_x_bf16).
#define LORAPLANE_VBMI __attribute__((target("avx512vbmi")))

struct Bf16Bytes {  // the low and the high byte of bf16(t), t = 0..127
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
};

const Bf16Bytes& bf16_bytes() {
  static const Bf16Bytes table = [] {
    Bf16Bytes t{};
    for (int v = 0; v < 128; ++v) {
      const uint16_t bits = BF(static_cast<float>(v)).x;
      t.lo[v] = static_cast<uint8_t>(bits & 0xff);
      t.hi[v] = static_cast<uint8_t>(bits >> 8);
    }
    return t;
  }();
  return table;
}

// Whether this CPU has AVX-512 VBMI (vpermi2b): Zen 4 and later, Ice Lake and later; not Cooper Lake,
// the one AVX-512 BF16 CPU without it.
bool has_vbmi() {
  static const bool has = __builtin_cpu_supports("avx512vbmi");
  return has;
}

// x's row (K bf16) into dst (stride values, zeroed by the caller) in the order of the unpacks: in each
// block of 64, the first 32 values are elements 16 L + j (L = 0..3, j = 0..7), the next 32 16 L + 8 + j.
void widen_x_bf16(uint16_t* dst, const BF* x, int64_t K) {
  for (int64_t e = 0; e < K; e += 8) {  // 8 consecutive elements from e stay together
    const int64_t block = e / 64, L = (e % 64) / 16, half = (e % 16) / 8;
    std::memcpy(dst + block * 64 + half * 32 + L * 8, x + e, static_cast<size_t>(std::min<int64_t>(8, K - e)) * 2);
  }
}

// One block of 64 weights at w against MT rows of x (x + m * stride, in widen_x_bf16's order).
template <int MT>
LORAPLANE_VBMI __attribute__((always_inline)) inline void few_step_bf16(__m512 (&acc)[MT][2], const int8_t* w,
                                                                         const uint16_t* x, int64_t stride,
                                                                         const Bf16Bytes& t) {
  _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
  const __m512i wv = _mm512_loadu_si512(w), a = _mm512_abs_epi8(wv);
  const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(t.lo), a, _mm512_load_si512(t.lo + 64));
  __m512i hi = _mm512_permutex2var_epi8(_mm512_load_si512(t.hi), a, _mm512_load_si512(t.hi + 64));
  hi = _mm512_ternarylogic_epi32(hi, wv, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // hi | (w & 0x80)
  const __m512i w0 = _mm512_unpacklo_epi8(lo, hi), w1 = _mm512_unpackhi_epi8(lo, hi);
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m) {
    acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)w0, (__m512bh)_mm512_loadu_si512(x + m * stride));
    acc[m][1] = _mm512_dpbf16_ps(acc[m][1], (__m512bh)w1, (__m512bh)_mm512_loadu_si512(x + m * stride + 32));
  }
}

// few_tile over the bf16 tables (x: MT rows of widen_x_bf16, stride a multiple of 64). Two sets of
// sums, for alternate blocks: one row of x has 4 vdpbf16ps chains in flight, not 2 that wait on
// each other's latency.
template <int MT>
LORAPLANE_VBMI __attribute__((always_inline)) inline void few_tile_bf16(BF* out, int64_t so, const uint16_t* x,
                                                                         int64_t stride, const int8_t* w, int64_t K,
                                                                         float scale, float bias, const Bf16Bytes& t) {
  __m512 a0[MT][2], a1[MT][2];
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m) a0[m][0] = a0[m][1] = a1[m][0] = a1[m][1] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 128 <= K; k += 128) {
    few_step_bf16<MT>(a0, w + k, x + k, stride, t);
    few_step_bf16<MT>(a1, w + k + 64, x + k + 64, stride, t);
  }
  if (k + 64 <= K) {
    few_step_bf16<MT>(a0, w + k, x + k, stride, t);
    k += 64;
  }
  if (k < K) {  // the row's last bytes, never read past: W may end at a page's end
    alignas(64) int8_t tail[64] = {};
    std::memcpy(tail, w + k, static_cast<size_t>(K - k));
    few_step_bf16<MT>(a1, tail, x + k, stride, t);
  }
#pragma GCC unroll 4
  for (int m = 0; m < MT; ++m) {
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(a0[m][0], a0[m][1]), _mm512_add_ps(a1[m][0], a1[m][1]));
    out[m * so] = BF(_mm512_reduce_add_ps(sum) * scale + bias);
  }
}

// Rows n0..n1 of W against MT rows of x, in one function: the tables stay in registers across rows.
template <int MT>
LORAPLANE_VBMI void few_range_bf16(BF* out, int64_t so, const uint16_t* x, int64_t stride, const Int8Rows& W,
                                   int64_t n0, int64_t n1) {
  const Bf16Bytes& t = bf16_bytes();
  for (int64_t n = n0; n < n1; ++n) {
    const float bias = W.bias != nullptr ? static_cast<float>(W.bias[n]) : 0.f;
    few_tile_bf16<MT>(out + n, so, x, stride, W.w + n * W.K, W.K, W.scale[n], bias, t);
  }
}

void few_rows_bf16(BF* out, int64_t so, const BF* x, int64_t sx, const Int8Rows& W, int64_t M, int64_t N) {
  const int64_t K = W.K, stride = (K + 63) / 64 * 64;
  std::vector<uint16_t> xb(static_cast<size_t>(M * stride), 0);
  for (int64_t m = 0; m < M; ++m) widen_x_bf16(xb.data() + m * stride, x + m * sx, K);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    loraplane_cpu::by_four_rows(M, [&](auto mt, int64_t m) {
      few_range_bf16<decltype(mt)::value>(out + m * so, so, xb.data() + m * stride, stride, W, begin, end);
    });
  });
}
#endif

// Rows n0..n1 of W against MT rows of x (fp32 [MT][stride]), in one function.
template <int MT>
void few_range(BF* out, int64_t so, const float* x, int64_t stride, const Int8Rows& W, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float bias = W.bias != nullptr ? static_cast<float>(W.bias[n]) : 0.f;
    few_tile<MT>(out + n, so, x, stride, W.w + n * W.K, W.K, W.scale[n], bias);
  }
}

// Every row of W against every row of x, four rows of x at a time (M > 4 only for K past kMaxGemmK,
// where a thread's rows of W are read once per four rows of x).
void few_rows_linear(BF* out, int64_t so, const BF* x, int64_t sx, const Int8Rows& W, int64_t M, int64_t N) {
#ifdef LORAPLANE_AVX512_BF16
  if (has_vbmi()) {
    few_rows_bf16(out, so, x, sx, W, M, N);
    return;
  }
#endif
  const int64_t K = W.K, stride = (K + kStep - 1) / kStep * kStep;
  std::vector<float> xf(static_cast<size_t>(M * stride), 0.f);  // x widened once, zero past K
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xf[m * stride + k] = static_cast<float>(x[m * sx + k]);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    loraplane_cpu::by_four_rows(M, [&](auto mt, int64_t m) {
      few_range<decltype(mt)::value>(out + m * so, so, xf.data() + m * stride, stride, W, begin, end);
    });
  });
}

// ---- the GEMM: rows of W against packed chunks of quantized x ----

// Rows n0..n1 of W (GLU: gate rows, with their up rows) against one chunk, NR rows of W a tile (NR/2
// pairs for GLU), single rows (pairs) for the tail.
template <int MT, bool GLU>
void gemm_rows(BF* out, int64_t so, int64_t rows, const uint32_t* xp, const float* sx, const Int8Rows& W, int64_t n0,
               int64_t n1) {
  constexpr int NR = kTileW<MT>, H = GLU ? NR / 2 : NR;
  const auto at_row = [&](int64_t n) {
    return Int8Rows{W.w + n * W.K, W.scale + n, W.wsum + n, W.bias == nullptr ? nullptr : W.bias + n, W.K, W.up_rows};
  };
  int64_t n = n0;
  for (; n + H <= n1; n += H) gemm_tile<MT, NR, GLU>(out + n, so, rows, xp, sx, at_row(n), H);
  for (; n < n1; ++n) gemm_tile<MT, GLU ? 2 : 1, GLU>(out + n, so, rows, xp, sx, at_row(n), 1);
}

// N: rows of W, or for GLU gate rows (W holds N gate rows, then N up rows; out is [M, N]).
template <bool GLU>
void gemm_linear(BF* out, int64_t so, const BF* x, int64_t stride, const Int8Rows& W, int64_t M, int64_t N) {
  const int64_t K4 = (W.K + 3) / 4, chunks = (M + kChunkRows - 1) / kChunkRows;
  const int64_t chunk_words = kChunkRows * kPlanes * K4;
  const int64_t group = GLU ? kGroupRows / 2 : kGroupRows;  // output columns per unit of parallel work
  // uninitialized (pack_chunk writes every quad up to each chunk's width), aligned to 64 bytes so that
  // a step's loads of x never span two cache lines
  std::unique_ptr<uint32_t[]> buffer(new uint32_t[static_cast<size_t>(chunks * chunk_words + 16)]);
  uint32_t* const packed =
      reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(buffer.get()) + 63) & ~uintptr_t{63});
  std::vector<float> sx(static_cast<size_t>(chunks * kChunkRows));
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t rows = std::min(kChunkRows, M - c * kChunkRows);
      pack_chunk(packed + c * chunk_words, sx.data() + c * kChunkRows, x + c * kChunkRows * stride, stride, rows, W.K,
                 K4, (rows + kLanes - 1) / kLanes * kLanes);
    }
  });
  // each thread takes whole groups of W rows and runs them against every chunk in turn
  at::parallel_for(0, (N + group - 1) / group, 1, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * group, n1 = std::min(N, end * group);
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t rows = std::min(kChunkRows, M - c * kChunkRows);
      const uint32_t* xp = packed + c * chunk_words;
      const float* sc = sx.data() + c * kChunkRows;
      BF* oc = out + c * kChunkRows * so;
      switch ((rows + kLanes - 1) / kLanes) {
#ifdef LORAPLANE_AVX512_BF16
        case 4: gemm_rows<4, GLU>(oc, so, rows, xp, sc, W, n0, n1); break;
        case 3: gemm_rows<3, GLU>(oc, so, rows, xp, sc, W, n0, n1); break;
#endif
        case 2: gemm_rows<2, GLU>(oc, so, rows, xp, sc, W, n0, n1); break;
        default: gemm_rows<1, GLU>(oc, so, rows, xp, sc, W, n0, n1); break;
      }
    }
  });
}
#endif

// Every argument of linear_int8_ / linear_int8_silu_mul_ (`op`) checked: w int8 [rows, K] with
// rows = out's columns (x 2 for the GLU), scale fp32 and wsum int32 [rows], bias bf16 [rows].
void check_args(const char* op, const at::Tensor& out, const at::Tensor& x, const at::Tensor& w,
                const at::Tensor& scale, const at::Tensor& wsum, const c10::optional<at::Tensor>& bias, bool glu) {
  const bool cpu = x.device().is_cpu() && w.device().is_cpu() && out.device().is_cpu() && scale.device().is_cpu() &&
                   wsum.device().is_cpu() && (!bias.has_value() || bias->device().is_cpu());
  TORCH_CHECK(cpu, op, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2, op, ": x [M, K], w [N, K], out [M, N] (2-D), got ",
              x.dim(), "-D, ", w.dim(), "-D, ", out.dim(), "-D");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16, op,
              ": x and out must be bf16, got ", x.scalar_type(), " and ", out.scalar_type());
  TORCH_CHECK(w.scalar_type() == at::kChar, op, ": w must be int8, got ", w.scalar_type());
  TORCH_CHECK(scale.scalar_type() == at::kFloat, op, ": scale must be float32, got ", scale.scalar_type());
  TORCH_CHECK(wsum.scalar_type() == at::kInt, op, ": wsum must be int32, got ", wsum.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, op, ": w has ", w.size(1), " columns, x has ", K);
  TORCH_CHECK(!glu || N % 2 == 0, op, ": w must be [2I, K] (gate rows, then up rows), got ", N, " rows");
  const int64_t cols = glu ? N / 2 : N;
  TORCH_CHECK(out.size(0) == M && out.size(1) == cols, op, ": out must be [", M, ", ", cols, "], got ", out.sizes());
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, op, ": rows of x and out must be contiguous");
  TORCH_CHECK(w.is_contiguous(), op, ": w must be contiguous");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N && scale.is_contiguous(), op, ": scale must be a contiguous [",
              N, "], got ", scale.sizes());
  TORCH_CHECK(wsum.dim() == 1 && wsum.size(0) == N && wsum.is_contiguous(), op, ": wsum must be a contiguous [", N,
              "], got ", wsum.sizes());
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16, op, ": bias must be bf16, got ", bias->scalar_type());
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous(), op, ": bias must be a contiguous [",
                N, "], got ", bias->sizes());
  }
}

}  // namespace

namespace loraplane_cpu {

// out [M, N] = x (scale * w)^T (+ bias); x [M, K] bf16 (rows may be strided), w int8 [N, K], scale fp32
// [N], wsum int32 [N] (the sum of each row of w: the AVX-512 GEMM relies on it), bias bf16 [N] or none.
void linear_int8_(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                  const at::Tensor& wsum, const c10::optional<at::Tensor>& bias) {
  check_args("linear_int8_", out, x, w, scale, wsum, bias, false);
  if (x.size(0) == 0 || w.size(0) == 0) return;
#ifdef LORAPLANE_INT8_LINEAR
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const Int8Rows W{w.data_ptr<int8_t>(), scale.data_ptr<float>(), wsum.data_ptr<int32_t>(),
                   bias.has_value() ? bias->data_ptr<BF>() : nullptr, K, 0};
  auto* po = out.data_ptr<BF>();
  const auto* px = x.data_ptr<BF>();
  if (M <= kFewRows || K > kMaxGemmK || K == 0)
    few_rows_linear(po, out.stride(0), px, x.stride(0), W, M, N);
  else
    gemm_linear<false>(po, out.stride(0), px, x.stride(0), W, M, N);
#else
  const at::Tensor real = w.to(at::kFloat) * scale.unsqueeze(1);  // the dequantized weight, exact in fp32
  out.copy_(at::linear(x.to(at::kFloat), real, bias.has_value() ? c10::optional<at::Tensor>(bias->to(at::kFloat))
                                                                 : c10::optional<at::Tensor>()));
#endif
}

// out [M, I] = silu(gate) * up for [gate | up] = linear_int8_(x, w, ...) with w [2I, K] (gate rows
// first), scale, wsum and bias [2I]. The GEMM path computes both halves in one tile and writes only
// out; fewer rows (and the generic build) run linear_int8_ and then silu_mul_. The same bits either way.
void linear_int8_silu_mul_(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                           const at::Tensor& wsum, const c10::optional<at::Tensor>& bias) {
  check_args("linear_int8_silu_mul_", out, x, w, scale, wsum, bias, true);
  const int64_t M = x.size(0), I = w.size(0) / 2;
  if (M == 0 || I == 0) return;
#ifdef LORAPLANE_INT8_LINEAR
  if (const int64_t K = x.size(1); M > kFewRows && K <= kMaxGemmK && K > 0) {
    const Int8Rows W{w.data_ptr<int8_t>(), scale.data_ptr<float>(), wsum.data_ptr<int32_t>(),
                     bias.has_value() ? bias->data_ptr<BF>() : nullptr, K, I};
    gemm_linear<true>(out.data_ptr<BF>(), out.stride(0), x.data_ptr<BF>(), x.stride(0), W, M, I);
    return;
  }
#endif
  at::Tensor gate_up = at::empty({M, 2 * I}, x.options());
  linear_int8_(gate_up, x, w, scale, wsum, bias);
  silu_mul_(out, gate_up);  // layer_ops_cpu.cpp
}

}  // namespace loraplane_cpu
