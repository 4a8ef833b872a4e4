// Causal attention for one prefill chunk, read from the paged KV cache, bf16 on AVX512-BF16 CPUs.
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
//     chunk sits at position ctx + i and sees keys 0..ctx + i.
// The chunk's own keys and values are read from the cache, where they were written before the
// call, so a chunk with cached context (a prefix-cache hit, a later chunk of a long prompt) and a
// fresh prompt take the same path. Work items are (kv head, tile of 32 queries), spread over
// torch's intra-op pool; the query heads of one kv group share each key tile, and a query
// position's heads go through it together, up to 4 at a time (`rows_step`), so that each key
// vector and value pair is loaded once for all of them, not once per head.
//
// Registered as torch.ops.loraplane.paged_prefill_attention_ (in place on `out`); shapes the
// kernel does not cover (other dtypes, head_dim not 64/128, a build without AVX512-BF16) are
// refused, and the caller (attention/cpu_kernel.py) keeps its SDPA path for them.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

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

#ifdef LORAPLANE_AVX512_BF16
using BF = c10::BFloat16;
constexpr int64_t kKeys = 64;       // keys per tile: four score vectors, one softmax update
constexpr int64_t kQueryTile = 32;  // query positions per work item

// One query position's `group` heads (rows r0 .. r0 + group - 1 of the work item) against one key
// tile, GB heads at a time: each key vector and each pair of value rows is loaded once for GB rows
// (one row at a time, every vdpbf16ps waited on a load of its own). VV: score vectors in use.
template <int64_t HD, int64_t GB, int64_t VV>
inline void rows_step(int64_t r0, int64_t group, int64_t visible, const uint32_t* qbuf, const __m512i* kt,
                      const __m512i* vp, float* acc, float* m, float* l, float scale) {
  constexpr int64_t P = HD / 2, C2 = HD / 32, C = HD / 16;
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 scale_v = _mm512_set1_ps(scale);
  const int64_t pairs = (visible + 1) / 2;
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
        const int64_t left = std::min<int64_t>(16, visible - 16 * v);
        const __mmask16 valid = left > 0 ? static_cast<__mmask16>((1u << left) - 1u) : 0;
        s[v][g] = _mm512_mask_blend_ps(valid, neg_inf, _mm512_mul_ps(s[v][g], scale_v));
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
    for (int64_t tp = 0; tp < pairs; ++tp) {
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

template <int64_t HD, int64_t GB>
void prefill_kernel(BF* out, int64_t out_stride, const BF* q, int64_t q_stride, const BF* k_cache, const BF* v_cache,
                    int64_t cache_block_stride, int64_t block_size, int64_t num_kv_heads, int64_t group,
                    const int64_t* table, int64_t n, int64_t ctx, float scale) {
  constexpr int64_t P = HD / 2;   // dim pairs: key-side vectors per key tile
  constexpr int64_t C2 = HD / 32; // 32-wide bf16 chunks of a value row
  const int64_t row_stride = num_kv_heads * HD;
  const int64_t tiles = (n + kQueryTile - 1) / kQueryTile;
  const auto cost = [&](int64_t item) {  // the keys a tile's queries see
    return ctx + std::min(n, (item % tiles + 1) * kQueryTile);
  };
  loraplane_cpu::parallel_by_cost(num_kv_heads * tiles, cost, [&](int64_t begin, int64_t end) {
    const int64_t rows_max = group * kQueryTile;
    std::vector<float> acc(rows_max * HD), m(rows_max), l(rows_max);
    std::vector<uint32_t> qbuf(rows_max * P);  // the tile's query rows as bf16 dim pairs
    __m512i kt[kKeys / 16 * P], vp[kKeys * C2];  // a key tile by dim pair; value rows by token pair, lo/hi
    alignas(64) uint32_t kbuf[kKeys / 16 * P][16];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kvh = item / tiles, tile = item % tiles;
      const int64_t i0 = tile * kQueryTile, i1 = std::min(n, i0 + kQueryTile);
      const int64_t rows = group * (i1 - i0);  // row r: query i0 + r / group, head kvh * group + r % group
      std::fill(acc.begin(), acc.begin() + rows * HD, 0.f);
      std::fill(m.begin(), m.begin() + rows, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + rows, 0.f);
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(qbuf.data() + r * P, q + (i0 + r / group) * q_stride + (kvh * group + r % group) * HD, HD * 2);
      const int64_t last_key = ctx + i1;  // keys [0, last_key) are visible to some query of the tile
      for (int64_t j0 = 0; j0 < last_key; j0 += kKeys) {
        const int64_t nk = std::min(kKeys, last_key - j0);
        const BF* krow[kKeys];
        const BF* vrow[kKeys];
        for (int64_t t = 0; t < kKeys; ++t) {
          const int64_t j = j0 + std::min(t, nk - 1);  // past nk: a repeat of the last row, masked below
          const int64_t off = table[j / block_size] * cache_block_stride + (j % block_size) * row_stride + kvh * HD;
          krow[t] = k_cache + off;
          vrow[t] = v_cache + off;
        }
        // keys -> (score vector, dim pair, token): kt[v * P + p] lane t = (k_16v+t[2p], k_16v+t[2p+1])
        for (int64_t t = 0; t < kKeys; ++t) {
          const uint32_t* src = reinterpret_cast<const uint32_t*>(krow[t]);
          for (int64_t p = 0; p < P; ++p) kbuf[(t / 16) * P + p][t % 16] = src[p];
        }
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
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t visible = std::min<int64_t>(nk, ctx + i + 1 - j0);  // keys of this tile query i sees
          if (visible <= 0) continue;
          const int64_t r0 = (i - i0) * group;
          switch ((visible + 15) / 16) {
            case 1: rows_step<HD, GB, 1>(r0, group, visible, qbuf.data(), kt, vp, acc.data(), m.data(), l.data(), scale); break;
            case 2: rows_step<HD, GB, 2>(r0, group, visible, qbuf.data(), kt, vp, acc.data(), m.data(), l.data(), scale); break;
            case 3: rows_step<HD, GB, 3>(r0, group, visible, qbuf.data(), kt, vp, acc.data(), m.data(), l.data(), scale); break;
            default: rows_step<HD, GB, 4>(r0, group, visible, qbuf.data(), kt, vp, acc.data(), m.data(), l.data(), scale); break;
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r / group, h = kvh * group + r % group;
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        const float* ar = acc.data() + r * HD;
        BF* o = out + i * out_stride + h * HD;
        // undo the interleave: accumulator 2c (2c+1) lane x holds dim 32c + 8(x/4) + x%4 (+4)
        const __m512 iv = _mm512_set1_ps(inv);
        for (int64_t c = 0; c < C2; ++c)
          loraplane_cpu::store_unpacked32_bf16(o + 32 * c, _mm512_mul_ps(_mm512_loadu_ps(ar + 32 * c), iv),
                                               _mm512_mul_ps(_mm512_loadu_ps(ar + 32 * c + 16), iv));
      }
    }
  });
}
#endif

}  // namespace

namespace loraplane_cpu {

// out, q: [n, H, D] (rows may be strided; heads and dims contiguous), bf16; caches [N, B, KVH, D];
// block_table: [W] int64 covering ctx + n tokens; ctx: tokens cached before the chunk.
void paged_prefill_attention_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& block_table, int64_t ctx, double scale) {
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
  if (n == 0) return;
#ifdef LORAPLANE_AVX512_BF16
  using BF = c10::BFloat16;
  auto run = [&](auto kernel) {
    kernel(out.data_ptr<BF>(), out.stride(0), q.data_ptr<BF>(), q.stride(0), k_cache.data_ptr<BF>(),
           v_cache.data_ptr<BF>(), k_cache.stride(0), block_size, kv_heads, heads / kv_heads,
           block_table.data_ptr<int64_t>(), n, ctx, static_cast<float>(scale));
  };
  // heads per register block: the largest that divides the group with GB x head_dim/16 accumulators <= 16
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
    if (group % 2 == 0) {
      run(prefill_kernel<128, 2>);
    } else {
      run(prefill_kernel<128, 1>);
    }
  }
#else
  TORCH_CHECK(false, "paged_prefill_attention_: built without AVX512-BF16");
#endif
}

}  // namespace loraplane_cpu

TORCH_LIBRARY_FRAGMENT(loraplane, m) {
  m.def(
      "paged_prefill_attention_(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "int ctx, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(loraplane, CPU, m) { m.impl("paged_prefill_attention_", loraplane_cpu::paged_prefill_attention_); }
