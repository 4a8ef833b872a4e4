// Pieces shared by the CPU kernels in this directory.
//
// One library, one fast path per instruction set: LORAPLANE_AVX512_BF16 is defined when the build
// targets AVX-512 BF16 (vdpbf16ps: a bf16 pair product summed into fp32 in one instruction),
// LORAPLANE_AVX2 when it targets AVX2 + FMA alone (x86-64-v3: the same pair product as two FMAs
// over the pair's halves widened to fp32 by a 16-bit shift, avx2::dot_pairs). Each kernel's bf16
// path has one body per ISA over the primitives below, and a portable body (or torch) elsewhere.

#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define LORAPLANE_AVX512_BF16 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LORAPLANE_AVX2 1
#endif

// The instruction set the kernels were compiled for, as loraplane::isa reports it to Python
// (kernels/cpu_kernels.py): the engine calls the bf16 fast paths only where this says avx512_bf16.
#if defined(LORAPLANE_AVX512_BF16)
#define LORAPLANE_ISA "avx512_bf16"
#elif defined(LORAPLANE_AVX2)
#define LORAPLANE_ISA "avx2"
#else
#define LORAPLANE_ISA "generic"
#endif

namespace loraplane_cpu {

// M rows of x four at a time, then the 1-3 left: f(std::integral_constant<int, MT>{}, m) for the MT rows from
// row m (the few-rows linears' tiles are templates over MT).
template <class F>
__attribute__((always_inline)) inline void by_four_rows(int64_t M, const F& f) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) f(std::integral_constant<int, 4>{}, m);
  switch (M - m) {
    case 3: f(std::integral_constant<int, 3>{}, m); break;
    case 2: f(std::integral_constant<int, 2>{}, m); break;
    case 1: f(std::integral_constant<int, 1>{}, m); break;
    default: break;
  }
}

// body(begin, end) over [0, n) in one contiguous range per intra-op thread, the ranges of about
// equal total cost (cost(i) >= 0), where at::parallel_for would cut them by count: the work items
// of attention cost what their sequence's context does, and 2 threads cut by count idled one of
// them for the other's longer sequences.
template <typename Cost, typename Body>
void parallel_by_cost(int64_t n, Cost cost, Body body) {
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), n);
  if (parts <= 1) {
    if (n > 0) body(0, n);
    return;
  }
  std::vector<int64_t> prefix(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + cost(i);
  std::vector<int64_t> cut(parts + 1, n);
  cut[0] = 0;
  for (int64_t p = 1; p < parts; ++p)
    cut[p] = std::lower_bound(prefix.begin(), prefix.end(), prefix[n] * p / parts) - prefix.begin();
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      if (cut[p] < cut[p + 1]) body(cut[p], cut[p + 1]);
  });
}

// exp(x) that vectorizes (std::exp in a simd loop becomes one libm call per element): x clamped
// to [-87, 88] (the float range), x = n*ln2 + r with |r| <= ln2/2, e^r by a degree-6 Taylor
// polynomial (relative error < 2e-7 there), 2^n built in the exponent bits. Below -87 the
// result is ~1e-38 rather than a denormal or 0, as expf would give.
inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693145751953125f - n * 1.42860682030941723212e-6f;  // ln2 split hi + lo
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return p * scale;
}

#ifdef LORAPLANE_AVX512_BF16
// 32 bf16 from p; past n (< 32) the lanes are zero, so a partial last chunk adds nothing to a dot.
__attribute__((always_inline)) inline __m512i load32_bf16(const c10::BFloat16* p, int64_t n) {
  if (n >= 32) return _mm512_loadu_si512(p);
  return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1), p);
}

// 16 bf16 (their bits) widened to fp32: a 16-bit shift.
__attribute__((always_inline)) inline __m512 bf16x16_to_f32(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// 16 bf16 from p widened to fp32; past n (< 16) the lanes are zero.
__attribute__((always_inline)) inline __m512 load16_bf16_as_f32(const c10::BFloat16* p, int64_t n) {
  return bf16x16_to_f32(n >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p));
}

// 32 sums accumulated over pairs that unpacklo/hi_epi16 interleaved (lo's element e is value
// 8(e/4) + e%4, hi's element e value 8(e/4) + 4 + e%4), rounded to bf16 (nearest even) and stored
// in value order: one permute, where the scalar stores cost ~10 instructions a value.
__attribute__((always_inline)) inline void store_unpacked32_bf16(c10::BFloat16* out, __m512 lo, __m512 hi,
                                                                __mmask32 mask = ~__mmask32(0)) {
  const __m512i order = _mm512_set_epi32(0x1f001e, 0x1d001c, 0xf000e, 0xd000c, 0x1b001a, 0x190018, 0xb000a, 0x90008,
                                         0x170016, 0x150014, 0x70006, 0x50004, 0x130012, 0x110010, 0x30002, 0x10000);
  _mm512_mask_storeu_epi16(out, mask, _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(hi, lo)));
}

// 16x16 transpose of 32-bit lanes: in[i] row i -> out[j] holds column j (the GEMMs pack 16 rows of x
// into [k][rows] this way: bf16 pairs in linear_cpu.cpp, int8 quads in linear_int8_cpu.cpp).
__attribute__((always_inline)) inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16], u[16];
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += 4) {  // u[i + c]: in each 128-bit lane j, column 4j + c of rows i..i+3
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m512i lo_ab = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), hi_ab = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i lo_cd = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i hi_cd = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(lo_ab, lo_cd, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(lo_ab, lo_cd, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(hi_ab, hi_cd, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(hi_ab, hi_cd, 0xDD);
  }
}

// exp(x) for x <= 0 on 16 lanes (softmax weights): 2^n * e^r with |r| <= ln2/2 (degree-6 Taylor,
// rel. error < 2e-7); below -87 it gives ~1e-38, as exp_clamped does.
__attribute__((always_inline)) inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// exp_clamped on 16 lanes: exp_nonpositive's reduction and polynomial hold up to x = 88 as well.
__attribute__((always_inline)) inline __m512 exp_clamped16(__m512 x) {
  return exp_nonpositive(_mm512_min_ps(x, _mm512_set1_ps(88.f)));
}

// silu(gate) * up on 16 fp32 lanes (gate / (1 + e^-gate) * up, an exact divide), rounded to bf16
// once: silu_mul_ and linear_silu_mul_'s epilogue share it, so the two give the same bits.
__attribute__((always_inline)) inline __m256i silu_mul16(__m512 gate, __m512 up) {
  const __m512 e = exp_clamped16(_mm512_sub_ps(_mm512_setzero_ps(), gate));
  return (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.f), e)), up));
}

// The GEMMs' epilogue (linear_cpu.cpp, linear_int8_cpu.cpp): a tile of H rows of W by MT x 16 rows of x,
// rounded(r, j) giving W row r's outputs for x rows 16 j.. as bf16 (each kernel's own sums, scales and bias).
// GLU: rows H.. are the up rows of rows ..H, and the tile holds silu(gate) * up. Stored transposed, x row m
// to out + m * so, its first nr of the H values.
template <int H, int MT, bool GLU, class Rounded>
__attribute__((always_inline)) inline void store_tile16(const Rounded& rounded, c10::BFloat16* out, int64_t so,
                                                        int64_t rows, int64_t nr) {
  alignas(64) uint16_t tile[H][MT * 16];
#pragma GCC unroll 16
  for (int r = 0; r < H; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < MT; ++j) {
      __m256i v = rounded(r, j);
      if (GLU) v = silu_mul16(bf16x16_to_f32(v), bf16x16_to_f32(rounded(r + H, j)));
      _mm256_store_si256(reinterpret_cast<__m256i*>(&tile[r][j * 16]), v);
    }
  for (int64_t m = 0; m < rows; ++m) {
    uint16_t* o = reinterpret_cast<uint16_t*>(out + m * so);
    for (int64_t r = 0; r < nr; ++r) o[r] = tile[r][m];
  }
}
#endif

#ifdef LORAPLANE_AVX2
// The AVX2 vector layer: 8 fp32 lanes per __m256, bf16 as 16 values (8 pairs) per __m256i. AVX2
// has no 16-bit masked loads or stores, so a partial chunk goes through a small zeroed buffer.
namespace avx2 {

// 16 bf16 from p (their bits); past n (< 16) the lanes are zero, so a partial chunk adds nothing.
__attribute__((always_inline)) inline __m256i load16_bf16(const c10::BFloat16* p, int64_t n) {
  if (n >= 16) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  alignas(32) uint16_t buf[16] = {};
  std::memcpy(buf, p, static_cast<size_t>(std::max<int64_t>(n, 0)) * 2);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
}

// The even-indexed (0, 2, ..) and odd-indexed (1, 3, ..) values of 16 bf16 bits as 8 fp32 each: a
// pair (2i, 2i + 1) is one 32-bit lane, its low half the even value.
__attribute__((always_inline)) inline __m256 even_f32(__m256i bits) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
}
__attribute__((always_inline)) inline __m256 odd_f32(__m256i bits) {
  return _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// acc[i] += a[2i] b[2i] + a[2i+1] b[2i+1] with a, b given as their even and odd halves: what
// vdpbf16ps does in one instruction, as two FMAs (the products are exact in fp32; the sum rounds
// once per FMA where vdpbf16ps rounds once per pair).
__attribute__((always_inline)) inline __m256 dot_pairs(__m256 acc, __m256 a_even, __m256 a_odd, __m256 b_even,
                                                      __m256 b_odd) {
  return _mm256_fmadd_ps(a_odd, b_odd, _mm256_fmadd_ps(a_even, b_even, acc));
}

// 8 bf16 bits (a __m128i) widened to fp32.
__attribute__((always_inline)) inline __m256 bf16x8_to_f32(__m128i bits) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// 8 bf16 from p widened to fp32; past n (< 8) the lanes are zero.
__attribute__((always_inline)) inline __m256 load8_bf16_as_f32(const c10::BFloat16* p, int64_t n) {
  if (n >= 8) return bf16x8_to_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  alignas(16) uint16_t buf[8] = {};
  std::memcpy(buf, p, static_cast<size_t>(std::max<int64_t>(n, 0)) * 2);
  return bf16x8_to_f32(_mm_load_si128(reinterpret_cast<const __m128i*>(buf)));
}

// 8 fp32 rounded to bf16 (nearest even; NaN stays a quiet NaN), as c10::BFloat16(float) rounds,
// in the low 16 bits of each 32-bit lane.
__attribute__((always_inline)) inline __m256i round_to_bf16_lanes(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}

// 8 fp32 rounded to bf16, packed into 8 16-bit values in order.
__attribute__((always_inline)) inline __m128i f32x8_to_bf16(__m256 x) {
  const __m256i r = round_to_bf16_lanes(x);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// 16 fp32 (lo: values 0..7, hi: 8..15) rounded to 16 bf16 in order.
__attribute__((always_inline)) inline __m256i f32x16_to_bf16(__m256 lo, __m256 hi) {
  const __m256i packed = _mm256_packus_epi32(round_to_bf16_lanes(lo), round_to_bf16_lanes(hi));
  return _mm256_permute4x64_epi64(packed, 0xD8);  // packus works per 128-bit lane: restore the order
}

// The first n (<= 8) of 8 bf16 values to p.
__attribute__((always_inline)) inline void store8_bf16(c10::BFloat16* p, __m128i bits, int64_t n) {
  if (n >= 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bits);
    return;
  }
  alignas(16) uint16_t buf[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(buf), bits);
  std::memcpy(p, buf, static_cast<size_t>(std::max<int64_t>(n, 0)) * 2);
}

// The first n (<= 16) of 16 bf16 values (bits, in order) to p.
__attribute__((always_inline)) inline void store16_bf16(c10::BFloat16* p, __m256i bits, int64_t n) {
  if (n >= 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bits);
    return;
  }
  alignas(32) uint16_t buf[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(buf), bits);
  std::memcpy(p, buf, static_cast<size_t>(std::max<int64_t>(n, 0)) * 2);
}

// 16 dims held as their 8 even and 8 odd values in fp32 (the split even_f32 / odd_f32 make), rounded
// to bf16 and stored at o in order.
__attribute__((always_inline)) inline void store16_even_odd(c10::BFloat16* o, __m256 even, __m256 odd) {
  // 128-bit lane 0: dims 0..3 | 4..7, lane 1: 8..11 | 12..15, so packus leaves them in order
  const __m256i lo = round_to_bf16_lanes(_mm256_unpacklo_ps(even, odd));
  const __m256i hi = round_to_bf16_lanes(_mm256_unpackhi_ps(even, odd));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm256_packus_epi32(lo, hi));
}

// One value row's step of P.V for GB query heads over DT dims (a multiple of 16): acc[j] += w[j] *
// row, the accumulators holding each 16 dims as their even, then their odd values (decode and prefill
// attention both keep them so; store16_even_odd puts them back in order).
template <int64_t GB, int64_t DT>
__attribute__((always_inline)) inline void pv_row(__m256 (&acc)[GB][DT / 8], const c10::BFloat16* row,
                                                  const __m256 (&w)[GB]) {
#pragma GCC unroll 4
  for (int64_t c = 0; c < DT / 16; ++c) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * c));
    const __m256 even = even_f32(bits), odd = odd_f32(bits);
#pragma GCC unroll 4
    for (int64_t j = 0; j < GB; ++j) {
      acc[j][2 * c] = _mm256_fmadd_ps(even, w[j], acc[j][2 * c]);
      acc[j][2 * c + 1] = _mm256_fmadd_ps(odd, w[j], acc[j][2 * c + 1]);
    }
  }
}

// 8x8 transpose of 32-bit lanes: r[i] row i -> r[j] column j (packing 8 rows of x, as transpose16).
__attribute__((always_inline)) inline void transpose8(__m256 (&r)[8]) {
  __m256 t[8], u[8];
#pragma GCC unroll 4
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
#pragma GCC unroll 2
  for (int i = 0; i < 8; i += 4) {  // u[i + c]: in each 128-bit lane j, column 4j + c of rows i..i+3
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}

__attribute__((always_inline)) inline float hsum(__m256 x) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// The largest of 8 lanes.
__attribute__((always_inline)) inline float hmax(__m256 x) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

// exp(x) for x <= 88 on 8 lanes, as exp_clamped (the same reduction and polynomial, so the same
// bits as the AVX-512 exp_nonpositive): 2^n * e^r, |r| <= ln2/2; below -87 it gives ~1e-38.
__attribute__((always_inline)) inline __m256 exp_clamped8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f), r);
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  // 2^n in the exponent bits (n in [-126, 127] after the clamp): n + 127 shifted into place
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// silu(gate) * up on 8 fp32 lanes (an exact divide), rounded to bf16 once, as silu_mul16.
__attribute__((always_inline)) inline __m128i silu_mul8(__m256 gate, __m256 up) {
  const __m256 e = exp_clamped8(_mm256_sub_ps(_mm256_setzero_ps(), gate));
  return f32x8_to_bf16(_mm256_mul_ps(_mm256_div_ps(gate, _mm256_add_ps(_mm256_set1_ps(1.f), e)), up));
}

// store_tile16's AVX2 twin, 8 x rows a vector: value(r, j) gives W row r's fp32 outputs for x rows 8 j..;
// GLU: gate and up rounded to bf16 first (as the kernels leave them on their own), then silu(gate) * up.
template <int H, int MT, bool GLU, class Value>
__attribute__((always_inline)) inline void store_tile8(const Value& value, c10::BFloat16* out, int64_t so,
                                                       int64_t rows, int64_t nr) {
  alignas(32) uint16_t tile[H][MT * 8];
  const auto rounded = [&](int r, int j) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(round_to_bf16_lanes(value(r, j)), 16));
  };
#pragma GCC unroll 16
  for (int r = 0; r < H; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < MT; ++j) {
      const __m128i v = GLU ? silu_mul8(rounded(r, j), rounded(r + H, j)) : f32x8_to_bf16(value(r, j));
      _mm_store_si128(reinterpret_cast<__m128i*>(&tile[r][j * 8]), v);
    }
  for (int64_t m = 0; m < rows; ++m) {
    uint16_t* o = reinterpret_cast<uint16_t*>(out + m * so);
    for (int64_t r = 0; r < nr; ++r) o[r] = tile[r][m];
  }
}

}  // namespace avx2
#endif

}  // namespace loraplane_cpu
