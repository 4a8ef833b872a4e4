// Causal attention for one prefill chunk, read from the paged KV cache, bf16 on AVX512-BF16 or AVX2 CPUs.
//
// The flash-attention algorithm with the dot products laid out for vdpbf16ps, so that no score
// needs a horizontal sum (torch's CPU flash attention does not; what that measured:
// docs/kernels.md):
//   - keys go 64 at a time (one softmax update per query row per tile): transposed into (dim
//     pair, token) order, one instruction multiplies a query's dim pair by 16 keys' dim pairs, and
//     head_dim/2 of them give 16 scores in one vector;
//   - values go two tokens per instruction (rows interleaved by unpacklo/hi, as in the decode
//     kernel), the softmax weights rounded to bf16 for that product;
//   - the softmax is online per query row (running max and sum), masked causally: query i of the
//     chunk sits at position ctx + i and sees keys 0..ctx + i; with a sliding window W > 0 those
//     past ctx + i - W alone (as transformers masks them). A query tile's key tiles then start at
//     its first query's window, so the blocks before it are never read (the block manager may have
//     released them: their table entries and rows are anyone's), and a row masks the keys of a
//     tile before its own window (`start`) as it masks those past its position (`visible`).
// The chunk's own keys and values are read from the cache, where they were written before the
// call, so a chunk with cached context (a prefix-cache hit, a later chunk of a long prompt) and a
// fresh prompt take the same path. Work items are (kv head, tile of 32 queries), spread over
// torch's intra-op pool; the query heads of one kv group share each key tile, and a query
// position's heads go through it together, up to 4 at a time (`rows_step`), so that each key
// vector and value pair is loaded once for all of them, not once per head.
//
// On AVX2 (x86-64-v3) the same loop (prefill_kernel) runs PrefillIsa's AVX2 parts: 8 keys a score
// vector, each key dim pair split into its even and odd dims in fp32 (two FMAs, avx2::dot_pairs)
// against the query dims broadcast, the scores held a few heads by a few vectors at a time in the
// 16 registers, and P V a value row at a time straight from the cache, several heads by 16-64
// dims a pass; the same numerics (fp32 scores and softmax, weights rounded to bf16 for P V).
//
// Exposed (bindings.cpp) as torch.ops.loraplane.paged_prefill_attention_ (in place on `out`); shapes the
// kernel does not cover (other dtypes, head_dim not 64/128, a build with neither AVX512-BF16 nor
// AVX2) are refused, and the caller (executor/attention/cpu_kernel.py) keeps its SDPA path for them.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include "cpu_common.h"
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <vector>

namespace {

#if defined(LORAPLANE_AVX512_BF16) || defined(LORAPLANE_AVX2)
using BF = c10::BFloat16;
constexpr int64_t kKeys = 64;       // keys per tile: one softmax update per query row
constexpr int64_t kQueryTile = 32;  // query positions per work item

// keys -> (score vector, dim pair, token), L tokens a vector: kbuf[v * P + p][t] = (k_Lv+t[2p],
// k_Lv+t[2p+1]) for the tile's key rows krow[0 .. kKeys).
template <int64_t HD, int64_t L>
inline void transpose_keys(const BF* const* krow, uint32_t (*kbuf)[L]) {
  constexpr int64_t P = HD / 2;
  for (int64_t t = 0; t < kKeys; ++t) {
    const uint32_t* src = reinterpret_cast<const uint32_t*>(krow[t]);
    for (int64_t p = 0; p < P; ++p) kbuf[(t / L) * P + p][t % L] = src[p];
  }
}
#endif

#ifdef LORAPLANE_AVX512_BF16
// The lanes lo .. hi - 1 of 16 set (each bound clamped to [0, 16]).
inline __mmask16 lanes16(int64_t lo, int64_t hi) {
  const auto below = [](int64_t k) { return k <= 0 ? 0u : k >= 16 ? 0xffffu : (1u << k) - 1u; };
  return static_cast<__mmask16>(below(hi) & ~below(lo));
}

// One query position's `group` heads (rows r0 .. r0 + group - 1 of the work item) against one key
// tile, GB heads at a time: each key vector and each pair of value rows is loaded once for GB rows
// (one row at a time, every vdpbf16ps waited on a load of its own). VV: score vectors in use. The
// row sees the tile's keys start .. visible - 1 (start > 0 only before a sliding window's edge).
template <int64_t HD, int64_t GB, int64_t VV>
inline void rows_step(int64_t r0, int64_t group, int64_t start, int64_t visible, const uint32_t* qbuf,
                      const __m512i* kt, const __m512i* vp, float* acc, float* m, float* l, float scale) {
  constexpr int64_t P = HD / 2, C2 = HD / 32, C = HD / 16;
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 scale_v = _mm512_set1_ps(scale);
  const int64_t pairs = (visible + 1) / 2;
  __mmask16 valid[VV];  // the keys of each score vector the row sees
#pragma GCC unroll 4
  for (int64_t v = 0; v < VV; ++v) valid[v] = lanes16(start - 16 * v, visible - 16 * v);
  for (int64_t g0 = 0; g0 < group; g0 += GB) {
    const int64_t r = r0 + g0;
    __m512 s[VV][GB];
#pragma GCC unroll 4
    for (int64_t v = 0; v < VV; ++v)
#pragma GCC unroll 8
      for (int64_t g = 0; g < GB; ++g) s[v][g] = _mm512_setzero_ps();
    for (int64_t p = 0; p < P; ++p) {
      __m512bh qb[GB];
#pragma GCC unroll 8
      for (int64_t g = 0; g < GB; ++g)
        qb[g] = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(qbuf[(r + g) * P + p]));
#pragma GCC unroll 4
      for (int64_t v = 0; v < VV; ++v) {
        const __m512bh k = (__m512bh)kt[v * P + p];
#pragma GCC unroll 8
        for (int64_t g = 0; g < GB; ++g) s[v][g] = _mm512_dpbf16_ps(s[v][g], k, qb[g]);
      }
    }
    alignas(64) uint32_t pbits[GB][kKeys / 2];
    float corr[GB];
#pragma GCC unroll 8
    for (int64_t g = 0; g < GB; ++g) {
      __m512 smax = neg_inf;
#pragma GCC unroll 4
      for (int64_t v = 0; v < VV; ++v) {
        s[v][g] = _mm512_mask_blend_ps(valid[v], neg_inf, _mm512_mul_ps(s[v][g], scale_v));
        smax = _mm512_max_ps(smax, s[v][g]);
      }
      const float mx = std::max(m[r + g], _mm512_reduce_max_ps(smax));
      corr[g] = std::exp(m[r + g] - mx);  // 0 on the first tile (m = -inf)
      const __m512 mxv = _mm512_set1_ps(mx);
      __m512 psum = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int64_t v = 0; v < VV; ++v) {
        const __mmask16 seen = _mm512_cmp_ps_mask(s[v][g], neg_inf, _CMP_NEQ_OQ);  // masked keys weigh exactly 0
        const __m512 pr = _mm512_maskz_mov_ps(seen, loraplane_cpu::exp_nonpositive(_mm512_sub_ps(s[v][g], mxv)));
        psum = _mm512_add_ps(psum, pr);
        _mm256_store_si256(reinterpret_cast<__m256i*>(pbits[g] + 8 * v), (__m256i)_mm512_cvtneps_pbh(pr));
      }
      l[r + g] = l[r + g] * corr[g] + _mm512_reduce_add_ps(psum);
      m[r + g] = mx;
    }
    __m512 a[GB][C];
#pragma GCC unroll 8
    for (int64_t g = 0; g < GB; ++g) {
      const __m512 cv = _mm512_set1_ps(corr[g]);
#pragma GCC unroll 8
      for (int64_t c = 0; c < C; ++c) a[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r + g) * HD + c * 16), cv);
    }
    for (int64_t tp = start / 2; tp < pairs; ++tp) {  // the pairs before start weigh 0
      __m512bh vlo[C2], vhi[C2];
#pragma GCC unroll 4
      for (int64_t c = 0; c < C2; ++c) {
        vlo[c] = (__m512bh)vp[(tp * C2 + c) * 2];
        vhi[c] = (__m512bh)vp[(tp * C2 + c) * 2 + 1];
      }
#pragma GCC unroll 8
      for (int64_t g = 0; g < GB; ++g) {
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pbits[g][tp]));
#pragma GCC unroll 4
        for (int64_t c = 0; c < C2; ++c) {
          a[g][2 * c] = _mm512_dpbf16_ps(a[g][2 * c], vlo[c], pp);
          a[g][2 * c + 1] = _mm512_dpbf16_ps(a[g][2 * c + 1], vhi[c], pp);
        }
      }
    }
#pragma GCC unroll 8
    for (int64_t g = 0; g < GB; ++g)
#pragma GCC unroll 8
      for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(acc + (r + g) * HD + c * 16, a[g][c]);
  }
}

// The prefill kernel's vector parts on AVX-512 BF16: 16 keys a score vector, a query row kept as
// its bf16 dim pairs (broadcast one pair at a time), the values two tokens per vdpbf16ps (rows
// interleaved); a row's accumulator vector 2c (2c+1) lane x holds dim 32c + 8(x/4) + x%4 (+4).
struct PrefillIsa {
  using QueryElem = uint32_t;  // a query row as HD / 2 bf16 dim pairs
  template <int64_t HD>
  static constexpr int64_t kQueryElems = HD / 2;
  template <int64_t HD>
  static void load_query(QueryElem* dst, const BF* src) {
    std::memcpy(dst, src, HD * 2);
  }
  template <int64_t HD>
  struct Tile {
    static constexpr int64_t P = HD / 2, C2 = HD / 32;
    __m512i kt[kKeys / 16 * P], vp[kKeys * C2];  // a key tile by dim pair; value rows by token pair, lo/hi
    alignas(64) uint32_t kbuf[kKeys / 16 * P][16];
    void load(const BF* const* krow, const BF* const* vrow, int64_t nk) {
      transpose_keys<HD, 16>(krow, kbuf);
      const int64_t nv = (nk + 15) / 16;  // score vectors in use
      for (int64_t x = 0; x < nv * P; ++x) kt[x] = _mm512_load_si512(kbuf[x]);
      // values -> token pairs interleaved; rows past nk get weight 0 (and are real, finite rows)
      for (int64_t tp = 0; tp < (nk + 1) / 2; ++tp)
        for (int64_t c = 0; c < C2; ++c) {
          const __m512i a = _mm512_loadu_si512(vrow[2 * tp] + c * 32);
          const __m512i b = _mm512_loadu_si512(vrow[2 * tp + 1] + c * 32);
          vp[(tp * C2 + c) * 2] = _mm512_unpacklo_epi16(a, b);
          vp[(tp * C2 + c) * 2 + 1] = _mm512_unpackhi_epi16(a, b);
        }
    }
  };
  template <int64_t HD, int64_t GB>
  static void rows(const Tile<HD>& tile, const BF* const* /*vrow*/, int64_t r0, int64_t group, int64_t start,
                   int64_t visible, const QueryElem* qbuf, float* acc, float* m, float* l, float scale) {
    const __m512i* kt = tile.kt;
    const __m512i* vp = tile.vp;
    switch ((visible + 15) / 16) {
      case 1: rows_step<HD, GB, 1>(r0, group, start, visible, qbuf, kt, vp, acc, m, l, scale); break;
      case 2: rows_step<HD, GB, 2>(r0, group, start, visible, qbuf, kt, vp, acc, m, l, scale); break;
      case 3: rows_step<HD, GB, 3>(r0, group, start, visible, qbuf, kt, vp, acc, m, l, scale); break;
      default: rows_step<HD, GB, 4>(r0, group, start, visible, qbuf, kt, vp, acc, m, l, scale); break;
    }
  }
  // o[0..HD) = ar * inv in bf16, the interleave undone.
  template <int64_t HD>
  static void store_row(BF* o, const float* ar, float inv) {
    const __m512 iv = _mm512_set1_ps(inv);
    for (int64_t c = 0; c < HD / 32; ++c)
      loraplane_cpu::store_unpacked32_bf16(o + 32 * c, _mm512_mul_ps(_mm512_loadu_ps(ar + 32 * c), iv),
                                           _mm512_mul_ps(_mm512_loadu_ps(ar + 32 * c + 16), iv));
  }
};

#elif defined(LORAPLANE_AVX2)
namespace avx2 = loraplane_cpu::avx2;

// The first min(n, 8) lanes set (all bits), the rest 0.
__attribute__((always_inline)) inline __m256 lanes_below(int64_t n) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8))), index));
}

// s[g][8 v0 .. 8 (v0 + VB)) = q_g . k over score vectors v0 .. v0 + VB - 1 of the tile, for SG
// query rows qf + g * HD (fp32): per dim pair, VB key vectors split into their even and odd dims
// (two bit operations each), then two FMAs per head and vector, the SG x VB sums in registers.
template <int64_t HD, int64_t SG, int64_t VB>
__attribute__((always_inline)) inline void scores_block(const uint32_t (*kbuf)[8], int64_t v0, const float* qf,
                                                        float (*s)[kKeys]) {
  constexpr int64_t P = HD / 2;
  __m256 acc[SG][VB];
#pragma GCC unroll 4
  for (int64_t g = 0; g < SG; ++g)
#pragma GCC unroll 8
    for (int64_t v = 0; v < VB; ++v) acc[g][v] = _mm256_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    __m256 qe[SG], qo[SG];
#pragma GCC unroll 4
    for (int64_t g = 0; g < SG; ++g) {
      qe[g] = _mm256_broadcast_ss(qf + g * HD + 2 * p);
      qo[g] = _mm256_broadcast_ss(qf + g * HD + 2 * p + 1);
    }
#pragma GCC unroll 8
    for (int64_t v = 0; v < VB; ++v) {
      const __m256i bits = _mm256_load_si256(reinterpret_cast<const __m256i*>(kbuf[(v0 + v) * P + p]));
      const __m256 ke = avx2::even_f32(bits), ko = avx2::odd_f32(bits);
#pragma GCC unroll 4
      for (int64_t g = 0; g < SG; ++g) acc[g][v] = avx2::dot_pairs(acc[g][v], ke, ko, qe[g], qo[g]);
    }
  }
#pragma GCC unroll 4
  for (int64_t g = 0; g < SG; ++g)
#pragma GCC unroll 8
    for (int64_t v = 0; v < VB; ++v) _mm256_store_ps(s[g] + 8 * (v0 + v), acc[g][v]);
}

// One query position's `group` heads (rows r0 .. r0 + group - 1 of the work item) against one key
// tile, GB heads at a time, as rows_step on AVX-512: the scores (SG heads by VB key vectors a
// pass, as the 16 registers hold them), one online-softmax update per row, the weights rounded to
// bf16, then P V one value row at a time straight from the cache, GB heads by DT dims a pass. The
// row sees the tile's keys start .. visible - 1: score vectors wholly before start (a sliding
// window's edge) are neither computed nor read, and P V begins at start.
template <int64_t HD, int64_t GB>
inline void rows_step(int64_t r0, int64_t group, int64_t start, int64_t visible, const uint32_t (*kbuf)[8],
                      const BF* const* vrow, const float* qf, float* acc, float* m, float* l, float scale) {
  constexpr int64_t SG = GB == 4 ? 2 : GB;                   // heads per scores pass
  constexpr int64_t VB = SG == 1 ? 8 : SG == 2 ? 4 : 2;      // key vectors per scores pass (divides 8)
  constexpr int64_t DT = GB == 1 ? 64 : GB == 2 ? 32 : 16;   // dims per P V pass
  constexpr int64_t A = DT / 8;
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 scale_v = _mm256_set1_ps(scale);
  const int64_t nv = (visible + 7) / 8;  // score vectors in use
  const int64_t v1 = start / 8;          // the first of them: those before hold keys the row does not see
  // the first vector's keys before start (none without a window) get no weight, as those past visible
  const __m256 first_keys = _mm256_andnot_ps(lanes_below(start - 8 * v1), lanes_below(visible - 8 * v1));
  for (int64_t g0 = 0; g0 < group; g0 += GB) {
    const int64_t r = r0 + g0;
    alignas(32) float s[GB][kKeys];  // the scores, then the weights (bf16 values as fp32)
#pragma GCC unroll 2
    for (int64_t h = 0; h < GB; h += SG)
      for (int64_t v0 = v1 / VB * VB; v0 < nv; v0 += VB) scores_block<HD, SG, VB>(kbuf, v0, qf + (r + h) * HD, s + h);
    float corr[GB];
#pragma GCC unroll 4
    for (int64_t g = 0; g < GB; ++g) {
      __m256 smax = neg_inf;
      for (int64_t v = v1; v < nv; ++v) {
        const __m256 seen = v == v1 ? first_keys : lanes_below(visible - 8 * v);
        const __m256 x = _mm256_blendv_ps(neg_inf, _mm256_mul_ps(_mm256_load_ps(s[g] + 8 * v), scale_v), seen);
        _mm256_store_ps(s[g] + 8 * v, x);
        smax = _mm256_max_ps(smax, x);
      }
      const float mx = std::max(m[r + g], avx2::hmax(smax));
      corr[g] = std::exp(m[r + g] - mx);  // 0 on the first tile (m = -inf)
      const __m256 mxv = _mm256_set1_ps(mx);
      __m256 psum = _mm256_setzero_ps();
      for (int64_t v = v1; v < nv; ++v) {
        const __m256 x = _mm256_load_ps(s[g] + 8 * v);
        const __m256 seen = _mm256_cmp_ps(x, neg_inf, _CMP_NEQ_OQ);  // masked keys weigh exactly 0
        const __m256 pr = _mm256_and_ps(seen, avx2::exp_clamped8(_mm256_sub_ps(x, mxv)));
        psum = _mm256_add_ps(psum, pr);
        _mm256_store_ps(s[g] + 8 * v, _mm256_castsi256_ps(_mm256_slli_epi32(avx2::round_to_bf16_lanes(pr), 16)));
      }
      l[r + g] = l[r + g] * corr[g] + avx2::hsum(psum);
      m[r + g] = mx;
    }
    for (int64_t d0 = 0; d0 < HD; d0 += DT) {
      __m256 a[GB][A];
#pragma GCC unroll 4
      for (int64_t g = 0; g < GB; ++g) {
        const __m256 cv = _mm256_set1_ps(corr[g]);
#pragma GCC unroll 8
        for (int64_t c = 0; c < A; ++c) a[g][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + (r + g) * HD + d0 + 8 * c), cv);
      }
      for (int64_t t = start; t < visible; ++t) {
        const BF* row = vrow[t] + d0;
        __m256 w[GB];
#pragma GCC unroll 4
        for (int64_t g = 0; g < GB; ++g) w[g] = _mm256_broadcast_ss(s[g] + t);
        avx2::pv_row<GB, DT>(a, row, w);
      }
#pragma GCC unroll 4
      for (int64_t g = 0; g < GB; ++g)
#pragma GCC unroll 8
        for (int64_t c = 0; c < A; ++c) _mm256_storeu_ps(acc + (r + g) * HD + d0 + 8 * c, a[g][c]);
    }
  }
}

// The prefill kernel's vector parts on AVX2: 8 keys a score vector, a query row kept in fp32
// (broadcast one dim at a time), the keys' dim pairs split into even and odd dims at use
// (avx2::dot_pairs), the value rows read from the cache as they are; a row's accumulator holds
// each 16 dims as its 8 even dims, then its 8 odd dims.
struct PrefillIsa {
  using QueryElem = float;  // a query row in fp32
  template <int64_t HD>
  static constexpr int64_t kQueryElems = HD;
  template <int64_t HD>
  static void load_query(QueryElem* dst, const BF* src) {
    for (int64_t c = 0; c < HD / 8; ++c) _mm256_storeu_ps(dst + 8 * c, avx2::load8_bf16_as_f32(src + 8 * c, 8));
  }
  template <int64_t HD>
  struct Tile {
    alignas(32) uint32_t kbuf[kKeys / 8 * HD / 2][8];
    void load(const BF* const* krow, const BF* const* /*vrow*/, int64_t /*nk*/) { transpose_keys<HD, 8>(krow, kbuf); }
  };
  template <int64_t HD, int64_t GB>
  static void rows(const Tile<HD>& tile, const BF* const* vrow, int64_t r0, int64_t group, int64_t start,
                   int64_t visible, const QueryElem* qf, float* acc, float* m, float* l, float scale) {
    rows_step<HD, GB>(r0, group, start, visible, tile.kbuf, vrow, qf, acc, m, l, scale);
  }
  // o[0..HD) = ar * inv in bf16: each 16 dims' even and odd halves interleaved back in order.
  template <int64_t HD>
  static void store_row(BF* o, const float* ar, float inv) {
    const __m256 iv = _mm256_set1_ps(inv);
    for (int64_t c = 0; c < HD / 16; ++c)
      avx2::store16_even_odd(o + 16 * c, _mm256_mul_ps(_mm256_loadu_ps(ar + 16 * c), iv),
                             _mm256_mul_ps(_mm256_loadu_ps(ar + 16 * c + 8), iv));
  }
};
#endif

#if defined(LORAPLANE_AVX512_BF16) || defined(LORAPLANE_AVX2)
// The flash-attention loop over (kv head, query tile) work items, shared by both instruction sets
// (PrefillIsa: the vector parts). GB: heads per register block, a divisor of the group. window > 0:
// query i sees keys ctx + i - window + 1 .. ctx + i alone.
template <int64_t HD, int64_t GB>
void prefill_kernel(BF* out, int64_t out_stride, const BF* q, int64_t q_stride, const BF* k_cache, const BF* v_cache,
                    int64_t cache_block_stride, int64_t block_size, int64_t num_kv_heads, int64_t group,
                    const int64_t* table, int64_t n, int64_t ctx, float scale, int64_t window) {
  using Isa = PrefillIsa;
  constexpr int64_t QE = Isa::kQueryElems<HD>;
  const int64_t row_stride = num_kv_heads * HD;
  const int64_t tiles = (n + kQueryTile - 1) / kQueryTile;
  // the first key query i sees (0 without a window); a query tile's keys start at its first query's
  const auto first_key = [&](int64_t i) { return window > 0 ? std::max<int64_t>(0, ctx + i - window + 1) : 0; };
  const auto cost = [&](int64_t item) {  // the keys a tile's queries see
    const int64_t i0 = item % tiles * kQueryTile;
    return ctx + std::min(n, i0 + kQueryTile) - first_key(i0);
  };
  loraplane_cpu::parallel_by_cost(num_kv_heads * tiles, cost, [&](int64_t begin, int64_t end) {
    const int64_t rows_max = group * kQueryTile;
    std::vector<float> acc(rows_max * HD), m(rows_max), l(rows_max);
    std::vector<Isa::QueryElem> qbuf(rows_max * QE);  // the tile's query rows
    typename Isa::template Tile<HD> tile;  // the key tile (and value tile) in the kernel's layout
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kvh = item / tiles, t = item % tiles;
      const int64_t i0 = t * kQueryTile, i1 = std::min(n, i0 + kQueryTile);
      const int64_t rows = group * (i1 - i0);  // row r: query i0 + r / group, head kvh * group + r % group
      std::fill(acc.begin(), acc.begin() + rows * HD, 0.f);
      std::fill(m.begin(), m.begin() + rows, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + rows, 0.f);
      for (int64_t r = 0; r < rows; ++r)
        Isa::load_query<HD>(qbuf.data() + r * QE, q + (i0 + r / group) * q_stride + (kvh * group + r % group) * HD);
      // keys [first_key(i0), last_key) are visible to some query of the tile; those before it are never read
      const int64_t last_key = ctx + i1;
      for (int64_t j0 = first_key(i0); j0 < last_key; j0 += kKeys) {
        const int64_t nk = std::min(kKeys, last_key - j0);
        const BF* krow[kKeys];
        const BF* vrow[kKeys];
        for (int64_t k = 0; k < kKeys; ++k) {
          const int64_t j = j0 + std::min(k, nk - 1);  // past nk: a repeat of the last row, masked
          const int64_t off = table[j / block_size] * cache_block_stride + (j % block_size) * row_stride + kvh * HD;
          krow[k] = k_cache + off;
          vrow[k] = v_cache + off;
        }
        tile.load(krow, vrow, nk);
        for (int64_t i = i0; i < i1; ++i) {
          // keys start .. visible - 1 of this tile are query i's: past its position, or before its window, none
          const int64_t visible = std::min<int64_t>(nk, ctx + i + 1 - j0);
          const int64_t start = std::max<int64_t>(0, first_key(i) - j0);
          // no key to see: no softmax update at all (a row's m is -inf till its first key; -inf - -inf is NaN)
          if (visible <= start) continue;
          Isa::rows<HD, GB>(tile, vrow, (i - i0) * group, group, start, visible, qbuf.data(), acc.data(), m.data(),
                            l.data(), scale);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r / group, h = kvh * group + r % group;
        Isa::store_row<HD>(out + i * out_stride + h * HD, acc.data() + r * HD, l[r] > 0.f ? 1.f / l[r] : 0.f);
      }
    }
  });
}
#endif

}  // namespace

namespace loraplane_cpu {

// out, q: [n, H, D] (rows may be strided; heads and dims contiguous), bf16; caches [N, B, KVH, D];
// block_table: [W] int64 covering ctx + n tokens; ctx: tokens cached before the chunk; window > 0: query i
// attends positions ctx + i - window + 1 .. ctx + i alone (a sliding-window layer), and the table's entries
// for blocks wholly before the first query's window are never read; 0: all of 0 .. ctx + i.
void paged_prefill_attention_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& block_table, int64_t ctx, double scale,
                              int64_t window) {
  TORCH_CHECK(q.device().is_cpu(), "paged_prefill_attention_: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [n, H, D] of one shape");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "caches must be [N, B, KVH, D]");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &q, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16, "paged_prefill_attention_: bf16 tensors only");
  const int64_t n = q.size(0), heads = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && (D == 64 || D == 128), "head_dim must be 64 or 128 and match the cache");
  TORCH_CHECK(heads % kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D && out.stride(2) == 1 && out.stride(1) == D,
              "q and out must be contiguous within a row");
  for (const at::Tensor* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->stride(3) == 1 && c->stride(2) == D && c->stride(1) == kv_heads * D,
                "caches must be contiguous within a block");
  TORCH_CHECK(k_cache.stride(0) == v_cache.stride(0), "k and v caches must share a layout");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 1 && block_table.is_contiguous(),
              "block_table must be a contiguous int64 [W]");
  TORCH_CHECK(ctx >= 0 && block_table.size(0) * block_size >= ctx + n, "block_table must cover ctx + n tokens");
  TORCH_CHECK(window >= 0, "paged_prefill_attention_: window must be >= 0 (0: none)");
  if (n == 0) return;
#if defined(LORAPLANE_AVX512_BF16) || defined(LORAPLANE_AVX2)
  auto run = [&](auto kernel) {
    kernel(out.data_ptr<BF>(), out.stride(0), q.data_ptr<BF>(), q.stride(0), k_cache.data_ptr<BF>(),
           v_cache.data_ptr<BF>(), k_cache.stride(0), block_size, kv_heads, heads / kv_heads,
           block_table.data_ptr<int64_t>(), n, ctx, static_cast<float>(scale), window);
  };
  // heads per register block: the largest that divides the group with GB x head_dim/16 accumulators
  // <= 16 (AVX-512); AVX2 passes over the dims in parts, so head_dim 128 takes head_dim 64's blocks
  const int64_t group = heads / kv_heads;
  if (D == 64) {
    if (group % 4 == 0) {
      run(prefill_kernel<64, 4>);
    } else if (group % 3 == 0) {
      run(prefill_kernel<64, 3>);
    } else if (group % 2 == 0) {
      run(prefill_kernel<64, 2>);
    } else {
      run(prefill_kernel<64, 1>);
    }
  } else {
#ifdef LORAPLANE_AVX2
    if (group % 4 == 0) {
      run(prefill_kernel<128, 4>);
      return;
    }
    if (group % 3 == 0) {
      run(prefill_kernel<128, 3>);
      return;
    }
#endif
    if (group % 2 == 0) {
      run(prefill_kernel<128, 2>);
    } else {
      run(prefill_kernel<128, 1>);
    }
  }
#else
  TORCH_CHECK(false, "paged_prefill_attention_: built without the bf16 kernels (AVX-512 BF16 or AVX2)");
#endif
}

}  // namespace loraplane_cpu
