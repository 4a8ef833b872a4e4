// Decode attention straight from the paged KV cache, for the CPU.
//
// The torch path gathers every decode sequence's blocks into a padded copy and then runs SDPA
// on it: three passes over the KV bytes (read scattered, write the copy, read the copy) plus
// the padding. This kernel reads each sequence's keys and values once, block by block, with an
// online softmax, so the step costs one pass over the bytes the batch actually attends to.
//
// Work items are (sequence, kv head) pairs, spread over torch's intra-op thread pool in ranges of
// about equal context (parallel_by_cost), so torch.set_num_threads governs it like any other op. The query heads of
// one kv group (GQA) share each key/value row while it is in cache. While a thread works through
// one sequence's kv heads, it streams the whole blocks of the sequence two places later into L2,
// a few lines per 16 tokens (bf16 kernel, `Trickle`), which beats burst prefetches of a block.
//
// The bf16 kernel updates the softmax once per 128 tokens: the scores of a chunk of blocks first
// (16 keys at a time per query head, vdpbf16ps, then one interleave-and-add tree for the 16 sums),
// then one max/exp/rescale per head with a vectorized exp, then the values: the weights rounded
// to bf16 (as flash-attention kernels do for this product) multiply V with vdpbf16ps, two tokens
// per instruction, the accumulators of up to 4 heads in registers. What each choice measured, and
// the memory ceiling: docs/kernels.md. An AVX2 build runs the same kernel (one driver: partition,
// prefetches, chunks, softmax bookkeeping) with its vector parts as FMAs over bf16 widened to fp32
// (DecodeIsa): q . k as two FMAs per 16 dims over a key row's even and odd halves, two heads
// sharing each row's halves; P V a value row at a time, several heads by 16-64 dims a pass.
//
// Exposed as torch.ops.loraplane.paged_decode_attention_ (in-place on `out`; bindings.cpp); write_kv_ (at the
// end) puts a step's keys and values into the cache.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "cpu_common.h"
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace {

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// bf16 -> fp32 is a 16-bit shift; written out so the compiler vectorizes it.
template <>
inline void to_float<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

// One online-softmax step for one query head over one block: turns the scores sg[0..n) into
// exp(score - new max), folds them into the running max m and denominator l, and returns the
// factor exp(old max - new max) by which that head's output accumulator must be rescaled.
inline float online_softmax_block(float* sg, int64_t n, float& m, float& l) {
  float mx = m;
#pragma omp simd reduction(max : mx)
  for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sg[t]);
  const float correction = std::exp(m - mx);  // exp(-inf) = 0 on the first block
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    sg[t] = loraplane_cpu::exp_clamped(sg[t] - mx);  // vectorizes; x <= 0 here
    sum += sg[t];
  }
  l = l * correction + sum;
  m = mx;
  return correction;
}

// The blocks are scattered over the pool: fetch the next block's rows while this one computes.
template <typename T>
inline void prefetch_block(const T* k, const T* v, int64_t block_size, int64_t row_stride, int64_t head_dim) {
  for (int64_t t = 0; t < block_size; ++t) {
    for (int64_t byte = 0; byte < head_dim * static_cast<int64_t>(sizeof(T)); byte += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(k + t * row_stride) + byte);
      __builtin_prefetch(reinterpret_cast<const char*>(v + t * row_stride) + byte);
    }
  }
}

#if defined(LORAPLANE_AVX512_BF16) || defined(LORAPLANE_AVX2)
// Streams a sequence's whole KV blocks (every kv head's rows, K then V) into L2 a few cache lines
// per call, so that a later sequence arrives while this one computes. A work item reads only its
// own head's 128 bytes of each 384-byte token row, so the hardware prefetchers see a short strided
// run per scattered block. Issued in bursts (a block's 192 lines at a time), the prefetches filled
// the miss queues and stalled the loads of the block in hand; a trickle does not.
struct Trickle {
  const char* k = nullptr;
  const char* v = nullptr;
  const int64_t* table = nullptr;
  int64_t block_bytes = 0, stride_bytes = 0, num_blocks = 0, per_call = 0;
  int64_t blk = 0, off = 0;  // the cursor: block index, byte offset in K (< block_bytes) then V
  void start(const void* k_, const void* v_, const int64_t* table_, int64_t num_blocks_, int64_t block_bytes_,
             int64_t stride_bytes_, int64_t calls) {
    k = static_cast<const char*>(k_);
    v = static_cast<const char*>(v_);
    table = table_;
    num_blocks = num_blocks_;
    block_bytes = block_bytes_;
    stride_bytes = stride_bytes_;
    const int64_t lines = num_blocks * 2 * ((block_bytes + 63) / 64);
    per_call = (lines + std::max<int64_t>(1, calls) - 1) / std::max<int64_t>(1, calls);
    blk = off = 0;
  }
  void stop() { num_blocks = blk = 0; }
  inline void step() {
    for (int64_t i = 0; i < per_call && blk < num_blocks; ++i) {
      const char* base = (off < block_bytes ? k + off : v + (off - block_bytes)) + table[blk] * stride_bytes;
      _mm_prefetch(base, _MM_HINT_T1);
      off += 64;
      if (off >= 2 * block_bytes) {
        off = 0;
        ++blk;
      }
    }
  }
};
#endif

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// scores[g * stride + t] = scale * q_g . k_t for the n key rows of one block (rows row_stride apart).
template <typename T, int64_t HD>
struct BlockScores {
  std::vector<float> qf, row;
  int64_t group, D;
  BlockScores(int64_t group_, int64_t D_) : qf(group_ * D_), row(D_), group(group_), D(D_) {}
  void set_query(const T* q, float scale) {
    for (int64_t g = 0; g < group; ++g) {
      float* qg = qf.data() + g * D;
      to_float(q + g * D, qg, D);
      for (int64_t d = 0; d < D; ++d) qg[d] *= scale;
    }
  }
  void operator()(const T* k, int64_t n, int64_t row_stride, float* scores, int64_t stride) {
    for (int64_t t = 0; t < n; ++t) {
      to_float(k + t * row_stride, row.data(), D);
      for (int64_t g = 0; g < group; ++g) scores[g * stride + t] = dot(qf.data() + g * D, row.data(), D);
    }
  }
};


// acc[g] += sum_t p[g * stride + t] * v_t over the n value rows of one block.
template <typename T, int64_t HD>
inline void accumulate_values(const T* v, int64_t n, int64_t row_stride, const float* p, int64_t stride,
                              int64_t group, int64_t D, float* row, float* acc) {
#ifdef LORAPLANE_AVX512_BF16
  if constexpr (std::is_same_v<T, c10::BFloat16> && HD > 0 && HD % 16 == 0) {
    constexpr int64_t C = HD / 16;
    for (int64_t t = 0; t < n; ++t) {
      __m512 vr[C];
      for (int64_t c = 0; c < C; ++c) {
        vr[c] = loraplane_cpu::load16_bf16_as_f32(v + t * row_stride + c * 16, 16);
      }
      for (int64_t g = 0; g < group; ++g) {
        const __m512 pg = _mm512_set1_ps(p[g * stride + t]);
        float* ag = acc + g * HD;
        for (int64_t c = 0; c < C; ++c)
          _mm512_storeu_ps(ag + c * 16, _mm512_fmadd_ps(pg, vr[c], _mm512_loadu_ps(ag + c * 16)));
      }
    }
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t) {
    to_float(v + t * row_stride, row, D);
    for (int64_t g = 0; g < group; ++g) axpy(p[g * stride + t], row, acc + g * D, D);
  }
}

// HD > 0 fixes head_dim at compile time (the inner loops unroll); HD == 0 reads it at run time.
template <typename T, int64_t HD>
void decode_kernel(
    T* out, const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
    const int64_t* context_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, int64_t table_width, int64_t q_stride, int64_t out_stride,
    int64_t cache_block_stride, float scale, int64_t window) {
  const int64_t group = num_heads / num_kv_heads;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    const int64_t D = HD > 0 ? HD : head_dim;  // a constant inside the loops when HD > 0
    const int64_t row_stride = num_kv_heads * D;  // between tokens of one block
    BlockScores<T, HD> block_scores(group, D);
    std::vector<float> acc(group * D), row(D);
    std::vector<float> scores(group * block_size), m(group), l(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv_heads, kvh = item % num_kv_heads;
      const int64_t ctx = context_lens[s];
      const int64_t* table = block_tables + s * table_width;
      block_scores.set_query(q + s * q_stride + kvh * group * D, scale);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t num_blocks = (ctx + block_size - 1) / block_size;
      // a sliding window: the positions first .. ctx - 1 alone; the blocks before it are never read
      const int64_t first = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
      for (int64_t b = first / block_size; b < num_blocks; ++b) {
        const int64_t skip = std::max<int64_t>(0, first - b * block_size);  // rows of the block before it
        const int64_t n = std::min(block_size, ctx - b * block_size) - skip;
        const int64_t base = table[b] * cache_block_stride + kvh * D + skip * row_stride;
        if (b + 1 < num_blocks) {
          const int64_t next = table[b + 1] * cache_block_stride + kvh * D;
          prefetch_block(k_cache + next, v_cache + next, block_size, row_stride, D);
        }
        block_scores(k_cache + base, n, row_stride, scores.data(), block_size);
        for (int64_t g = 0; g < group; ++g) {
          const float correction = online_softmax_block(scores.data() + g * block_size, n, m[g], l[g]);
          if (correction != 1.f) {
            float* ag = acc.data() + g * D;
            for (int64_t d = 0; d < D; ++d) ag[d] *= correction;
          }
        }
        accumulate_values<T, HD>(v_cache + base, n, row_stride, scores.data(), block_size, group, D, row.data(),
                                 acc.data());
      }
      for (int64_t g = 0; g < group; ++g) {
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        T* o = out + s * out_stride + (kvh * group + g) * D;
        const float* ag = acc.data() + g * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(ag[d] * inv);
      }
    }
  });
}

#if defined(LORAPLANE_AVX512_BF16) || defined(LORAPLANE_AVX2)
constexpr int64_t kChunkTokens = 128;  // tokens per softmax update in the bf16 kernel

// The value rows of one chunk of one work item: blocks b0 .. b1 - 1 of a sequence of ctx tokens,
// each block's rows of kv head kvh.
struct ValueChunk {
  const c10::BFloat16* v_cache;
  const int64_t* table;
  int64_t cache_block_stride, head_offset, row_stride, block_size, ctx, b0, b1;
  const c10::BFloat16* block(int64_t b) const { return v_cache + table[b] * cache_block_stride + head_offset; }
  int64_t rows(int64_t b) const { return std::min(block_size, ctx - b * block_size); }
};
#endif

#ifdef LORAPLANE_AVX512_BF16
// 16 vectors in, one out: lane i of the result is the sum of x[i]'s 16 lanes. Four rounds of
// interleave-and-add (45 instructions for 16 dot products, no scalar sums).
__attribute__((always_inline)) inline __m512 sum_lanes16(const __m512 (&x)[16]) {
  __m512 a[8], b[4], c[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // a[i], 128-bit lane j: x[2i] and x[2i+1] summed over lane j's halves
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]), _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // b[i], 128-bit lane j: x[4i..4i+3], each summed over lane j
    const __m512d p = _mm512_castps_pd(a[2 * i]), r = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p, r)), _mm512_castpd_ps(_mm512_unpackhi_pd(p, r)));
  }
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)  // c[i]: b[2i] and b[2i+1], their 128-bit lanes summed in pairs
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// s[0..16) = scale * q . k_t for 16 key rows from k (rows row_stride apart); rows past n (< 16)
// repeat row 0, and their scores are for the caller to overwrite or mask.
template <int64_t C2>
__attribute__((always_inline)) inline void scores16(const c10::BFloat16* k, int64_t n, int64_t row_stride,
                                                    const __m512bh* q, __m512 scale, float* s) {
  __m512 x[16];
#pragma GCC unroll 16
  for (int64_t t = 0; t < 16; ++t) {
    const c10::BFloat16* row = k + (t < n ? t : 0) * row_stride;
    __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], (__m512bh)_mm512_loadu_si512(row));
#pragma GCC unroll 4
    for (int64_t c = 1; c < C2; ++c) acc = _mm512_dpbf16_ps(acc, q[c], (__m512bh)_mm512_loadu_si512(row + 32 * c));
    x[t] = acc;
  }
  _mm512_storeu_ps(s, _mm512_mul_ps(sum_lanes16(x), scale));
}

// The bf16 decode kernel's vector parts on AVX-512 BF16: q . k with vdpbf16ps (a head's query as
// HD/32 bf16 vectors, 16 keys at a time and sum_lanes16), the softmax weights rounded to bf16
// pairs (t, t+1), P V with vdpbf16ps, two value rows per instruction, the accumulators of up to
// GB heads in registers. Accumulator 2c (2c+1) lane i holds dim 32c + 8(i/4) + i%4 (+4).
template <int64_t HD>
struct DecodeIsa {
  static constexpr int64_t C = HD / 16;          // fp32 accumulator vectors per head row
  static constexpr int64_t C2 = HD / 32;         // 32-wide bf16 chunks per head row
  static constexpr int64_t GB = C >= 8 ? 2 : 4;  // heads whose accumulators share the registers (<= 16 zmm)
  static constexpr int64_t kQueryVecs = C2, kAccVecs = C;
  using QueryVec = __m512bh;
  using Acc = __m512;
  using Weight = uint16_t;  // bf16 bits, zero past the chunk's tokens

  static Acc zero() { return _mm512_setzero_ps(); }
  static void load_query(const c10::BFloat16* q, QueryVec* qv) {
    for (int64_t i = 0; i < C2; ++i) qv[i] = (__m512bh)_mm512_loadu_si512(q + i * 32);
  }
  // s[g * stride + t] = scale * q_g . k_t for 16 key rows (t < 16) and every head g of the group.
  __attribute__((always_inline)) static void scores16(const c10::BFloat16* k, int64_t n, int64_t row_stride,
                                                      const QueryVec* q, int64_t group, float scale, float* s,
                                                      int64_t stride) {
    for (int64_t g = 0; g < group; ++g) ::scores16<C2>(k, n, row_stride, q + g * C2, _mm512_set1_ps(scale), s + g * stride);
  }
  static __mmask16 tail(int64_t n, int64_t t) {
    return n - t >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - t)) - 1);
  }
  // The largest of m and s[0..n).
  static float chunk_max(const float* s, int64_t n, float m) {
    __m512 mx = _mm512_set1_ps(m);
    for (int64_t t = 0; t < n; t += 16) mx = _mm512_mask_max_ps(mx, tail(n, t), mx, _mm512_loadu_ps(s + t));
    return _mm512_reduce_max_ps(mx);
  }
  // p[t] = exp(s[t] - m) in bf16 for t < n, and 0 at n (a zero weight after an odd count); the
  // sum of the weights before rounding.
  static float weights(const float* s, Weight* p, int64_t n, float m) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n + 1; t += 16) {
      const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(s + t), _mm512_set1_ps(m));
      const __m512 e = _mm512_maskz_mov_ps(tail(n, std::min(t, n)), loraplane_cpu::exp_nonpositive(x));
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t), (__m256i)_mm512_cvtneps_pbh(e));
    }
    return _mm512_reduce_add_ps(sum);
  }
  // accbuf[g] = accbuf[g] * corr[g] + sum_t p[g * stride + t] v_t over the chunk's value rows.
  static void values(const ValueChunk& vc, const Weight* pbf, int64_t stride, int64_t group, const float* corr,
                     Acc* accbuf, Trickle& trickle) {
    using BF = c10::BFloat16;
    for (int64_t g0 = 0; g0 < group; g0 += GB) {  // P V for heads g0 .. g0 + gn - 1
      const int64_t gn = std::min(GB, group - g0);
      __m512 acc[GB][C];
#pragma GCC unroll 4
      for (int64_t j = 0; j < GB; ++j) {
        const __m512 cv = _mm512_set1_ps(j < gn ? corr[g0 + j] : 0.f);
#pragma GCC unroll 8
        for (int64_t c = 0; c < C; ++c)
          acc[j][c] = j < gn ? _mm512_mul_ps(accbuf[(g0 + j) * C + c], cv) : _mm512_setzero_ps();
      }
      for (int64_t b = vc.b0; b < vc.b1; ++b) {
        const int64_t n = vc.rows(b);
        const BF* vb = vc.block(b);
        const int64_t off = (b - vc.b0) * vc.block_size;
        for (int64_t t = 0; t < n; t += 2) {
          if (t % 16 == 0) trickle.step();
          // rows t and t+1 interleaved by unpacklo/hi give (v_t[d], v_t+1[d]) pairs; the
          // accumulators hold the dims in that order. A lone last row pairs with zeros, so
          // whatever weight sits next to its own multiplies zero.
          const bool pair = t + 1 < n;
          const BF* r0 = vb + t * vc.row_stride;
          __m512i lo[C2], hi[C2];
#pragma GCC unroll 4
          for (int64_t c = 0; c < C2; ++c) {
            const __m512i a = _mm512_loadu_si512(r0 + c * 32);
            const __m512i b2 = pair ? _mm512_loadu_si512(r0 + vc.row_stride + c * 32) : _mm512_setzero_si512();
            lo[c] = _mm512_unpacklo_epi16(a, b2);
            hi[c] = _mm512_unpackhi_epi16(a, b2);
          }
#pragma GCC unroll 4
          for (int64_t j = 0; j < GB; ++j) {
            if (j >= gn) break;
            uint32_t bits;
            std::memcpy(&bits, pbf + (g0 + j) * stride + off + t, sizeof(bits));
            const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(bits));
#pragma GCC unroll 4
            for (int64_t c = 0; c < C2; ++c) {
              acc[j][2 * c] = _mm512_dpbf16_ps(acc[j][2 * c], (__m512bh)lo[c], w);
              acc[j][2 * c + 1] = _mm512_dpbf16_ps(acc[j][2 * c + 1], (__m512bh)hi[c], w);
            }
          }
        }
      }
#pragma GCC unroll 4
      for (int64_t j = 0; j < GB; ++j)
        if (j < gn)
#pragma GCC unroll 8
          for (int64_t c = 0; c < C; ++c) accbuf[(g0 + j) * C + c] = acc[j][c];
    }
  }
  // o[0..HD) = acc * inv in bf16, the interleave undone.
  static void store(c10::BFloat16* o, const Acc* acc, float inv) {
    const __m512 iv = _mm512_set1_ps(inv);
    for (int64_t c = 0; c < C2; ++c)
      loraplane_cpu::store_unpacked32_bf16(o + 32 * c, _mm512_mul_ps(acc[2 * c], iv), _mm512_mul_ps(acc[2 * c + 1], iv));
  }
};

#elif defined(LORAPLANE_AVX2)
namespace avx2 = loraplane_cpu::avx2;

// 8 vectors in, one out: lane i of the result is the sum of x[i]'s 8 lanes. Three rounds of
// interleave-and-add (21 instructions for 8 dot products).
__attribute__((always_inline)) inline __m256 sum_lanes8(const __m256 (&x)[8]) {
  __m256 a[4], b[2];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // a[i], 128-bit lane j: x[2i] and x[2i+1] summed over lane j's halves
    a[i] = _mm256_add_ps(_mm256_unpacklo_ps(x[2 * i], x[2 * i + 1]), _mm256_unpackhi_ps(x[2 * i], x[2 * i + 1]));
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {  // b[i], 128-bit lane j: x[4i..4i+3], each summed over lane j
    const __m256d p = _mm256_castps_pd(a[2 * i]), r = _mm256_castps_pd(a[2 * i + 1]);
    b[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(p, r)), _mm256_castpd_ps(_mm256_unpackhi_pd(p, r)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
}

// s[0..8) = scale * q . k_t for 8 key rows from k (rows row_stride apart), q as its even and odd
// dims in fp32 (q[2c], q[2c + 1]: dims 16c + 2i and 16c + 2i + 1); rows past n (< 8) repeat row 0.
// The 8 rows go through each 16 dims together: 8 independent FMA chains, and each pair of query
// vectors is loaded once for all 8.
template <int64_t C16>
__attribute__((always_inline)) inline void scores8(const c10::BFloat16* k, int64_t n, int64_t row_stride,
                                                   const __m256* q, __m256 scale, float* s) {
  const c10::BFloat16* row[8];
#pragma GCC unroll 8
  for (int64_t t = 0; t < 8; ++t) row[t] = k + (t < n ? t : 0) * row_stride;
  __m256 x[8];
#pragma GCC unroll 8
  for (int64_t t = 0; t < 8; ++t) x[t] = _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int64_t c = 0; c < C16; ++c) {
    const __m256 qe = q[2 * c], qo = q[2 * c + 1];
#pragma GCC unroll 8
    for (int64_t t = 0; t < 8; ++t) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[t] + 16 * c));
      x[t] = avx2::dot_pairs(x[t], avx2::even_f32(bits), avx2::odd_f32(bits), qe, qo);
    }
  }
  _mm256_storeu_ps(s, _mm256_mul_ps(sum_lanes8(x), scale));
}

// scores8 for two heads (queries qa, qb) over 4 key rows: each row's even and odd halves, split
// once, feed both heads' FMAs; sa[0..4) and sb[0..4) from one sum_lanes8.
template <int64_t C16>
__attribute__((always_inline)) inline void scores4x2(const c10::BFloat16* k, int64_t n, int64_t row_stride,
                                                     const __m256* qa, const __m256* qb, __m256 scale, float* sa,
                                                     float* sb) {
  const c10::BFloat16* row[4];
#pragma GCC unroll 4
  for (int64_t t = 0; t < 4; ++t) row[t] = k + (t < n ? t : 0) * row_stride;
  __m256 x[8];  // x[t]: head a, row t; x[4 + t]: head b
#pragma GCC unroll 8
  for (int64_t t = 0; t < 8; ++t) x[t] = _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int64_t c = 0; c < C16; ++c) {
    const __m256 ae = qa[2 * c], ao = qa[2 * c + 1], be = qb[2 * c], bo = qb[2 * c + 1];
#pragma GCC unroll 4
    for (int64_t t = 0; t < 4; ++t) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[t] + 16 * c));
      const __m256 even = avx2::even_f32(bits), odd = avx2::odd_f32(bits);
      x[t] = avx2::dot_pairs(x[t], even, odd, ae, ao);
      x[4 + t] = avx2::dot_pairs(x[4 + t], even, odd, be, bo);
    }
  }
  const __m256 r = _mm256_mul_ps(sum_lanes8(x), scale);
  _mm_storeu_ps(sa, _mm256_castps256_ps128(r));
  _mm_storeu_ps(sb, _mm256_extractf128_ps(r, 1));
}

// The first min(n, 8) lanes set (all bits), the rest 0.
__attribute__((always_inline)) inline __m256 lanes_below(int64_t n) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8))), index));
}

// The bf16 decode kernel's vector parts on AVX2: q . k as two FMAs per 16 dims over the key row's
// even and odd halves (avx2::dot_pairs; the query split once per item), 8 keys at a time and
// sum_lanes8; the softmax weights rounded to bf16 (kept as fp32 for the broadcast); P V one value
// row at a time, its even and odd dims into separate accumulators (no interleave of two rows):
// a head's accumulator 2c (2c + 1) holds dims 16c + 2i (16c + 2i + 1), GB heads by DT dims in
// registers per pass over the chunk's rows.
template <int64_t HD>
struct DecodeIsa {
  static constexpr int64_t C16 = HD / 16;  // 16-dim bf16 chunks per head row
  static constexpr int64_t kQueryVecs = 2 * C16, kAccVecs = HD / 8;
  using QueryVec = __m256;
  using Acc = __m256;
  using Weight = float;  // exp(s - m) rounded to bf16, as fp32

  static Acc zero() { return _mm256_setzero_ps(); }
  static void load_query(const c10::BFloat16* q, QueryVec* qv) {
    for (int64_t c = 0; c < C16; ++c) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16 * c));
      qv[2 * c] = avx2::even_f32(bits);
      qv[2 * c + 1] = avx2::odd_f32(bits);
    }
  }
  // s[g * stride + t] = scale * q_g . k_t for the n (<= 16) key rows and every head g of the
  // group: two heads at a time 4 rows a pass (a key row's halves serve both), a last odd head 8
  // rows a pass. Rows past n repeat row 0 up to the pass's end; their scores are past n.
  __attribute__((always_inline)) static void scores16(const c10::BFloat16* k, int64_t n, int64_t row_stride,
                                                      const QueryVec* q, int64_t group, float scale, float* s,
                                                      int64_t stride) {
    const __m256 sv = _mm256_set1_ps(scale);
    int64_t g = 0;
    for (; g + 2 <= group; g += 2)
      for (int64_t t0 = 0; t0 < n; t0 += 4)
        scores4x2<C16>(k + t0 * row_stride, n - t0, row_stride, q + g * kQueryVecs, q + (g + 1) * kQueryVecs, sv,
                       s + g * stride + t0, s + (g + 1) * stride + t0);
    if (g < group)
      for (int64_t t0 = 0; t0 < n; t0 += 8)
        scores8<C16>(k + t0 * row_stride, n - t0, row_stride, q + g * kQueryVecs, sv, s + g * stride + t0);
  }
  static float chunk_max(const float* s, int64_t n, float m) {
    __m256 mx = _mm256_set1_ps(m);
    for (int64_t t = 0; t < n; t += 8)
      mx = _mm256_blendv_ps(mx, _mm256_max_ps(mx, _mm256_loadu_ps(s + t)), lanes_below(n - t));
    return avx2::hmax(mx);
  }
  // p[t] = exp(s[t] - m) rounded to bf16 for t < n (p past n is never read); the sum of the
  // weights before rounding.
  static float weights(const float* s, Weight* p, int64_t n, float m) {
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; t += 8) {
      const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(m));
      const __m256 e = _mm256_and_ps(avx2::exp_clamped8(x), lanes_below(n - t));
      sum = _mm256_add_ps(sum, e);
      _mm256_storeu_ps(p + t, _mm256_castsi256_ps(_mm256_slli_epi32(avx2::round_to_bf16_lanes(e), 16)));
    }
    return avx2::hsum(sum);
  }
  // accbuf[g] = accbuf[g] * corr[g] + sum_t p[g * stride + t] v_t over the chunk's value rows, for
  // heads g0 .. g0 + GB - 1 (GB divides group) and dims d0 .. d0 + DT - 1 per pass: GB * DT / 8
  // accumulators, GB weights and a row's halves in the 16 registers.
  template <int64_t GB, int64_t DT>
  static void values_blocked(const ValueChunk& vc, const Weight* pw, int64_t stride, int64_t group,
                             const float* corr, Acc* accbuf, Trickle& trickle) {
    constexpr int64_t A = DT / 8;  // accumulators per head in a pass
    for (int64_t g0 = 0; g0 < group; g0 += GB) {
      for (int64_t d0 = 0; d0 < HD; d0 += DT) {
        __m256 acc[GB][A];
#pragma GCC unroll 4
        for (int64_t j = 0; j < GB; ++j) {
          const __m256 cv = _mm256_set1_ps(corr[g0 + j]);
#pragma GCC unroll 8
          for (int64_t c = 0; c < A; ++c) acc[j][c] = _mm256_mul_ps(accbuf[(g0 + j) * kAccVecs + d0 / 8 + c], cv);
        }
        for (int64_t b = vc.b0; b < vc.b1; ++b) {
          const int64_t n = vc.rows(b);
          const c10::BFloat16* vb = vc.block(b) + d0;
          const Weight* pb = pw + g0 * stride + (b - vc.b0) * vc.block_size;
          for (int64_t t0 = 0; t0 < n; t0 += 16) {
            if (d0 == 0) trickle.step();
            const int64_t t1 = std::min<int64_t>(n, t0 + 16);
            for (int64_t t = t0; t < t1; ++t) {
              const c10::BFloat16* row = vb + t * vc.row_stride;
              __m256 w[GB];
#pragma GCC unroll 4
              for (int64_t j = 0; j < GB; ++j) w[j] = _mm256_set1_ps(pb[j * stride + t]);
              avx2::pv_row<GB, DT>(acc, row, w);
            }
          }
        }
#pragma GCC unroll 4
        for (int64_t j = 0; j < GB; ++j)
#pragma GCC unroll 8
          for (int64_t c = 0; c < A; ++c) accbuf[(g0 + j) * kAccVecs + d0 / 8 + c] = acc[j][c];
      }
    }
  }
  static void values(const ValueChunk& vc, const Weight* pw, int64_t stride, int64_t group, const float* corr,
                     Acc* accbuf, Trickle& trickle) {
    // the most heads that divide the group, each pass's dims as many as the registers hold
    if (group % 4 == 0) {
      values_blocked<4, 16>(vc, pw, stride, group, corr, accbuf, trickle);
    } else if (group % 3 == 0) {
      values_blocked<3, 16>(vc, pw, stride, group, corr, accbuf, trickle);
    } else if (group % 2 == 0) {
      values_blocked<2, 32>(vc, pw, stride, group, corr, accbuf, trickle);
    } else {
      values_blocked<1, 64>(vc, pw, stride, group, corr, accbuf, trickle);
    }
  }
  // o[0..HD) = acc * inv in bf16: each 16 dims' even and odd halves interleaved back in order.
  static void store(c10::BFloat16* o, const Acc* acc, float inv) {
    const __m256 iv = _mm256_set1_ps(inv);
    for (int64_t c = 0; c < C16; ++c)
      avx2::store16_even_odd(o + 16 * c, _mm256_mul_ps(acc[2 * c], iv), _mm256_mul_ps(acc[2 * c + 1], iv));
  }
};
#endif

#if defined(LORAPLANE_AVX512_BF16) || defined(LORAPLANE_AVX2)
// The hot case: a bf16 cache, head_dim 64 or 128, any number of query heads per kv head, on a CPU
// with AVX512-BF16 or AVX2 (DecodeIsa, the vector parts). Per chunk of up to 128 tokens: every
// head's scores (16 keys at a time), one online-softmax update per head (vectorized exp), the
// weights rounded to bf16, then P V with the accumulators of several heads in registers (they wait
// in L1 between chunks). The partition, the prefetches and the softmax bookkeeping are shared.
template <int64_t HD>
void decode_kernel_bf16(c10::BFloat16* out, const c10::BFloat16* q, const c10::BFloat16* k_cache,
                        const c10::BFloat16* v_cache, const int64_t* block_tables, const int64_t* context_lens,
                        int64_t num_seqs, int64_t num_kv_heads, int64_t group, int64_t block_size,
                        int64_t table_width, int64_t q_stride, int64_t out_stride, int64_t cache_block_stride,
                        float scale, int64_t window) {
  using BF = c10::BFloat16;
  using Isa = DecodeIsa<HD>;
  constexpr int64_t QV = Isa::kQueryVecs, AV = Isa::kAccVecs;
  constexpr int64_t kAhead = 2;             // sequences between the one computed and the one prefetched
  const int64_t chunk_blocks = std::max<int64_t>(1, kChunkTokens / block_size);
  const int64_t stride = chunk_blocks * block_size + 16;  // between heads' score rows (16 for a last partial store)
  const auto cost = [&](int64_t item) { return context_lens[item / num_kv_heads] + 16; };
  loraplane_cpu::parallel_by_cost(num_seqs * num_kv_heads, cost, [&](int64_t begin, int64_t end) {
    const int64_t row_stride = num_kv_heads * HD;  // between tokens of one block
    std::vector<float> scores(group * stride), m(group), l(group), corr(group);
    std::vector<typename Isa::Weight> weights(group * stride + 2);  // zero past the chunk's tokens
    std::vector<typename Isa::QueryVec> qv(group * QV);
    std::vector<typename Isa::Acc> accbuf(group * AV);  // output accumulators between chunks
    Trickle trickle;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / num_kv_heads, kvh = item % num_kv_heads;
      const int64_t ctx = context_lens[s];
      const int64_t* table = block_tables + s * table_width;
      const int64_t num_blocks = (ctx + block_size - 1) / block_size;
      if (kvh == 0 && (s + kAhead) * num_kv_heads < end) {  // over this sequence's heads: a later one's blocks
        const int64_t calls = num_kv_heads * 2 * ((ctx + 15) / 16);  // trickle.step() calls till then
        trickle.start(k_cache, v_cache, block_tables + (s + kAhead) * table_width,
                      (context_lens[s + kAhead] + block_size - 1) / block_size, block_size * row_stride * 2,
                      cache_block_stride * 2, calls);
      } else if (kvh == 0) {
        trickle.stop();
      }
      for (int64_t g = 0; g < group; ++g) Isa::load_query(q + s * q_stride + (kvh * group + g) * HD, qv.data() + g * QV);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      std::fill(accbuf.begin(), accbuf.end(), Isa::zero());
      // a sliding window: positions first .. ctx - 1 alone; the blocks wholly before it are never read, and the
      // rows of its first block before it get no weight (-inf scores)
      const int64_t first = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
      for (int64_t b0 = first / block_size; b0 < num_blocks; b0 += chunk_blocks) {
        const int64_t b1 = std::min(num_blocks, b0 + chunk_blocks);
        const int64_t n_chunk = std::min(ctx, b1 * block_size) - b0 * block_size;
        // scores: block b's rows at (b - b0) * block_size; a block's stores past its rows are
        // overwritten by the next block's, and past the chunk's end they are masked
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t n = std::min(block_size, ctx - b * block_size);
          if (b + 1 < num_blocks) {
            const int64_t next = table[b + 1] * cache_block_stride + kvh * HD;
            prefetch_block(k_cache + next, v_cache + next, block_size, row_stride, HD);
          }
          const BF* kb = k_cache + table[b] * cache_block_stride + kvh * HD;
          for (int64_t t0 = 0; t0 < n; t0 += 16) {
            trickle.step();
            Isa::scores16(kb + t0 * row_stride, std::min<int64_t>(16, n - t0), row_stride, qv.data(), group, scale,
                          scores.data() + (b - b0) * block_size + t0, stride);
          }
        }
        if (const int64_t skip = first - b0 * block_size; skip > 0) {
          for (int64_t g = 0; g < group; ++g)
            std::fill_n(scores.data() + g * stride, skip, -std::numeric_limits<float>::infinity());
        }
        for (int64_t g = 0; g < group; ++g) {  // online softmax over the chunk, weights to bf16
          const float* sg = scores.data() + g * stride;
          const float m_new = Isa::chunk_max(sg, n_chunk, m[g]);
          const bool first = m[g] == -std::numeric_limits<float>::infinity();
          corr[g] = first ? 0.f : loraplane_cpu::exp_clamped(m[g] - m_new);
          m[g] = m_new;
          l[g] = l[g] * corr[g] + Isa::weights(sg, weights.data() + g * stride, n_chunk, m_new);
        }
        const ValueChunk vc{v_cache, table, cache_block_stride, kvh * HD, row_stride, block_size, ctx, b0, b1};
        Isa::values(vc, weights.data(), stride, group, corr.data(), accbuf.data(), trickle);
      }
      for (int64_t g = 0; g < group; ++g)
        Isa::store(out + s * out_stride + (kvh * group + g) * HD, accbuf.data() + g * AV, l[g] > 0.f ? 1.f / l[g] : 0.f);
    }
  });
}
#endif

}  // namespace

namespace loraplane_cpu {

// out, q: [S, H, D] (rows may be strided, heads and dims contiguous); caches: [N, B, KVH, D]
// contiguous within a block; block_tables: [S, W] int64; context_lens: [S] int64 (>= 1); window > 0: each
// row attends its last `window` positions alone (a sliding-window layer), 0: all of them.
void paged_decode_attention_(
    at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, int64_t window) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode_attention_: CPU tensors only");
  TORCH_CHECK(window >= 0, "paged_decode_attention_: window must be >= 0 (0: none)");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [S, H, D] of one shape");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "caches must be [N, B, KVH, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type(),
              "q, out and the caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  TORCH_CHECK(block_tables.is_contiguous() && context_lens.is_contiguous(), "tables must be contiguous");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim, "cache head_dim differs from q's");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_tables.size(0) == num_seqs && context_lens.size(0) == num_seqs, "one table row per sequence");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == head_dim && out.stride(2) == 1 && out.stride(1) == head_dim,
              "q and out must be contiguous within a row");
  for (const at::Tensor* c : {&k_cache, &v_cache}) {
    TORCH_CHECK(c->stride(3) == 1 && c->stride(2) == head_dim && c->stride(1) == num_kv_heads * head_dim,
                "caches must be contiguous within a block");
  }
  TORCH_CHECK(k_cache.stride(0) == v_cache.stride(0), "k and v caches must share a layout");
  if (num_seqs == 0) return;
#if defined(LORAPLANE_AVX512_BF16) || defined(LORAPLANE_AVX2)
  if (q.scalar_type() == at::kBFloat16 && (head_dim == 64 || head_dim == 128)) {
    using BF = c10::BFloat16;
    auto* o = out.data_ptr<BF>();
    const auto *qp = q.data_ptr<BF>(), *kp = k_cache.data_ptr<BF>(), *vp = v_cache.data_ptr<BF>();
    const auto *tp = block_tables.data_ptr<int64_t>(), *lp = context_lens.data_ptr<int64_t>();
    const int64_t group = num_heads / num_kv_heads, w = block_tables.size(1);
    const int64_t cbs = k_cache.stride(0);
    const float sc = static_cast<float>(scale);
    if (head_dim == 64)
      decode_kernel_bf16<64>(o, qp, kp, vp, tp, lp, num_seqs, num_kv_heads, group, block_size, w, q.stride(0),
                             out.stride(0), cbs, sc, window);
    else
      decode_kernel_bf16<128>(o, qp, kp, vp, tp, lp, num_seqs, num_kv_heads, group, block_size, w, q.stride(0),
                              out.stride(0), cbs, sc, window);
    return;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention_", [&] {
    auto run = [&](auto kernel) {
      kernel(out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
             v_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
             num_seqs, num_heads, num_kv_heads, head_dim, block_size, block_tables.size(1), q.stride(0),
             out.stride(0), k_cache.stride(0), static_cast<float>(scale), window);
    };
    if (head_dim == 64) {
      run(decode_kernel<scalar_t, 64>);
    } else if (head_dim == 128) {
      run(decode_kernel<scalar_t, 128>);
    } else {
      run(decode_kernel<scalar_t, 0>);
    }
  });
}

// k_cache[slot] = k[t], v_cache[slot] = v[t] for slot = slot_mapping[t] (block * B + offset): this
// step's keys and values into the paged cache, one row copy per token. k and v are views into the
// fused q|k|v projection (rows strided), which made torch's index_copy_ take ~40 us a layer on a
// 64-row decode step for 48 KB; any dtype, the bytes are copied as they are.
// k, v: [T, KVH, D] (heads and dims contiguous); caches: [N, B, KVH, D] contiguous within a block.
void write_kv_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.device().is_cpu() && k_cache.device().is_cpu(), "write_kv_: CPU tensors only");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "write_kv_: caches must be [N, B, KVH, D] of one layout");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes(), "write_kv_: k and v must be [T, KVH, D] of one shape");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "write_kv_: k, v and the caches must share a dtype");
  const int64_t T = k.size(0), B = k_cache.size(1), KVH = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK(k.size(1) == KVH && k.size(2) == D, "write_kv_: k and v rows must match the cache's [KVH, D]");
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == D, "write_kv_: k and v must be contiguous within a row");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == D && k_cache.stride(1) == KVH * D,
              "write_kv_: caches must be contiguous within a block");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == T &&
                  slot_mapping.is_contiguous(),
              "write_kv_: slot_mapping must be a contiguous int64 [T]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * B;
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(0 <= slots[t] && slots[t] < num_slots, "write_kv_: slot ", slots[t], " outside the cache");
  if (T == 0) return;
  const int64_t item = k.element_size(), row = KVH * D * item;
  const int64_t block_bytes = k_cache.stride(0) * item, sk = k.stride(0) * item, sv = v.stride(0) * item;
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  at::parallel_for(0, T, std::max<int64_t>(1, (64 << 10) / row), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t dst = (slots[t] / B) * block_bytes + (slots[t] % B) * row;
      std::memcpy(kc + dst, kp + t * sk, row);
      std::memcpy(vc + dst, vp + t * sv, row);
    }
  });
}

}  // namespace loraplane_cpu
