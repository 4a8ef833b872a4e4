// The elementwise parts of a decoder layer, fused, for bf16 activations on the CPU.
//
// Written in torch ops, one layer runs ~30 small elementwise ops (RMSNorm alone is a cast, a
// square, a mean, an rsqrt, two products and a cast back; rotary is slices, a negation, a concat,
// four products and two sums). At decode batch sizes each op costs more in dispatch and thread
// wake-ups than in arithmetic. These three ops do the same work in one pass each:
//
//   add_rms_norm_(out, residual, delta?, weight, eps): residual += delta (rounded to bf16, as the
//       residual add in bf16 is), then out = weight * bf16(residual * rsqrt(mean(residual^2) + eps)),
//       computed in fp32 with the two roundings transformers' bf16 RMSNorm makes.
//   rotary_(q, k, cos, sin): q and k rotated in place (rotate-half convention) by the bf16 cos/sin
//       tables transformers uses, fp32 math, one rounding per element (transformers rounds after
//       each product and after the sum).
//   silu_mul(out, gate_up): out = silu(gate) * up for gate_up = [gate | up], fp32, one rounding.
//   argmax_rows_(out, logits): the greedy token of each row of bf16 logits.
//
// Rows are spread over torch's intra-op pool only when there are enough of them to pay for it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include "cpu_common.h"
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

inline float bf16_to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Round to nearest even, as c10::BFloat16(float) does; NaN stays NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline uint16_t* bits(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<c10::BFloat16>()); }
inline const uint16_t* bits(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<c10::BFloat16>());
}

// Rows per task: enough elements that a thread wake-up is worth it (~16K elements).
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems)); }

void check_bf16_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16, name, " must be a bf16 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, n] with contiguous rows");
}

#ifdef LORAPLANE_AVX512_BF16
// 16 bf16 (raw bits) from p widened to fp32.
__attribute__((always_inline)) inline __m512 bf16x16(const uint16_t* p) {
  return loraplane_cpu::load16_bf16_as_f32(reinterpret_cast<const c10::BFloat16*>(p), 16);
}
#endif

}  // namespace

namespace loraplane_cpu {

void add_rms_norm_(at::Tensor& out, at::Tensor& residual, const c10::optional<at::Tensor>& delta,
                   const at::Tensor& weight, double eps) {
  check_bf16_rows(out, "out");
  check_bf16_rows(residual, "residual");
  const int64_t rows = residual.size(0), n = residual.size(1);
  TORCH_CHECK(out.size(0) == rows && out.size(1) == n, "out must have residual's shape");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.is_contiguous() &&
                  weight.scalar_type() == at::kBFloat16,
              "weight must be a contiguous bf16 [n]");
  if (delta.has_value()) {
    check_bf16_rows(*delta, "delta");
    TORCH_CHECK(delta->size(0) == rows && delta->size(1) == n, "delta must have residual's shape");
  }
  uint16_t* o = bits(out);
  uint16_t* r = bits(residual);
  const uint16_t* d = delta.has_value() ? bits(*delta) : nullptr;
  const uint16_t* w = bits(weight);
  const int64_t so = out.stride(0), sr = residual.stride(0), sd = delta.has_value() ? delta->stride(0) : 0;
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      uint16_t* ri = r + i * sr;
#ifdef LORAPLANE_AVX512_BF16
      // two passes of 16 lanes: the add (rounded to bf16 as torch's) with the sum of squares,
      // then the normed row times the weight; the scalar passes below took ~2x as long
      if (n % 16 == 0) {
        const uint16_t* di = d != nullptr ? d + i * sd : nullptr;
        __m512 sq = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j += 16) {
          __m512 x = bf16x16(ri + j);
          if (di != nullptr) {
            const __m256i sum = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(x, bf16x16(di + j)));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(ri + j), sum);
            x = loraplane_cpu::bf16x16_to_f32(sum);
          }
          sq = _mm512_fmadd_ps(x, x, sq);
        }
        const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(n) + feps));
        uint16_t* oi = o + i * so;
        for (int64_t j = 0; j < n; j += 16) {
          const __m256i normed = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(bf16x16(ri + j), inv));
          const __m512 nf = loraplane_cpu::bf16x16_to_f32(normed);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(oi + j),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(bf16x16(w + j), nf)));
        }
        continue;
      }
#elif defined(LORAPLANE_AVX2)
      // the same two passes, 8 lanes at a time (the scalar passes below do not vectorize their
      // bf16 rounding as well)
      if (n % 8 == 0) {
        using namespace loraplane_cpu::avx2;
        const auto* rb = reinterpret_cast<const c10::BFloat16*>(ri);
        const uint16_t* di = d != nullptr ? d + i * sd : nullptr;
        __m256 sq = _mm256_setzero_ps(), sq2 = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j += 8) {
          __m256 x = load8_bf16_as_f32(rb + j, 8);
          if (di != nullptr) {
            const __m128i sum =
                f32x8_to_bf16(_mm256_add_ps(x, load8_bf16_as_f32(reinterpret_cast<const c10::BFloat16*>(di + j), 8)));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(ri + j), sum);
            x = bf16x8_to_f32(sum);
          }
          if ((j / 8) % 2 == 0)  // two chains for the FMA latency
            sq = _mm256_fmadd_ps(x, x, sq);
          else
            sq2 = _mm256_fmadd_ps(x, x, sq2);
        }
        const __m256 inv =
            _mm256_set1_ps(1.f / std::sqrt(hsum(_mm256_add_ps(sq, sq2)) / static_cast<float>(n) + feps));
        uint16_t* oi = o + i * so;
        const auto* wb = reinterpret_cast<const c10::BFloat16*>(w);
        for (int64_t j = 0; j < n; j += 8) {
          const __m256 normed = bf16x8_to_f32(f32x8_to_bf16(_mm256_mul_ps(load8_bf16_as_f32(rb + j, 8), inv)));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(oi + j),
                           f32x8_to_bf16(_mm256_mul_ps(load8_bf16_as_f32(wb + j, 8), normed)));
        }
        continue;
      }
#endif
      if (d != nullptr) {
        const uint16_t* di = d + i * sd;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) ri[j] = float_to_bf16(bf16_to_float(ri[j]) + bf16_to_float(di[j]));
      }
      float sq = 0.f;
#pragma omp simd reduction(+ : sq)
      for (int64_t j = 0; j < n; ++j) {
        const float x = bf16_to_float(ri[j]);
        sq += x * x;
      }
      const float inv = 1.f / std::sqrt(sq / static_cast<float>(n) + feps);
      uint16_t* oi = o + i * so;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        const float normed = bf16_to_float(float_to_bf16(bf16_to_float(ri[j]) * inv));
        oi[j] = float_to_bf16(bf16_to_float(w[j]) * normed);
      }
    }
  });
}

// q: [T, H, D], k: [T, KVH, D] (rows may be strided; heads and dims contiguous), cos/sin: [T, D] bf16.
void rotary_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  for (const at::Tensor* t : {&q, &k}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16, "q and k must be bf16 CPU tensors");
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->stride(1) == t->size(2), "q and k must be [T, H, D]");
  }
  const int64_t T = q.size(0), D = q.size(2), hq = q.size(1), hk = k.size(1);
  TORCH_CHECK(k.size(0) == T && k.size(2) == D && D % 2 == 0, "q and k must share T and an even head_dim");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 2 && t->size(0) == T && t->size(1) == D &&
                    t->is_contiguous(),
                "cos and sin must be contiguous bf16 [T, D]");
  }
  uint16_t* qp = bits(q);
  uint16_t* kp = bits(k);
  const uint16_t* cp = bits(cos);
  const uint16_t* sp = bits(sin);
  const int64_t sq = q.stride(0), sk = k.stride(0), half = D / 2;
  auto rotate = [half](uint16_t* x, const uint16_t* c, const uint16_t* s) {
#pragma omp simd
    for (int64_t j = 0; j < half; ++j) {
      const float a = bf16_to_float(x[j]), b = bf16_to_float(x[j + half]);
      x[j] = float_to_bf16(a * bf16_to_float(c[j]) - b * bf16_to_float(s[j]));
      x[j + half] = float_to_bf16(b * bf16_to_float(c[j + half]) + a * bf16_to_float(s[j + half]));
    }
  };
  at::parallel_for(0, T, grain((hq + hk) * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t *c = cp + t * D, *s = sp + t * D;
      for (int64_t h = 0; h < hq; ++h) rotate(qp + t * sq + h * D, c, s);
      for (int64_t h = 0; h < hk; ++h) rotate(kp + t * sk + h * D, c, s);
    }
  });
}

// gate_up: [T, 2I] (gate | up), out: [T, I].
void silu_mul_(at::Tensor& out, const at::Tensor& gate_up) {
  check_bf16_rows(out, "out");
  check_bf16_rows(gate_up, "gate_up");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * I && out.size(0) == T && out.size(1) == I, "out must be [T, I], gate_up [T, 2I]");
  uint16_t* o = bits(out);
  const uint16_t* g = bits(gate_up);
  const int64_t so = out.stride(0), sg = gate_up.stride(0);
  at::parallel_for(0, T, grain(I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* gt = g + t * sg;
      uint16_t* ot = o + t * so;
#ifdef LORAPLANE_AVX512_BF16
      // 16 lanes at a time with the same exp; left to `omp simd`, the loop ran ~2.5x slower
      using loraplane_cpu::load16_bf16_as_f32;
      for (int64_t j = 0; j < I; j += 16) {
        const int64_t n = std::min<int64_t>(16, I - j);
        const __m512 x = load16_bf16_as_f32(reinterpret_cast<const c10::BFloat16*>(gt + j), n);
        const __m512 up = load16_bf16_as_f32(reinterpret_cast<const c10::BFloat16*>(gt + I + j), n);
        _mm256_mask_storeu_epi16(ot + j, static_cast<__mmask16>((1u << n) - 1), loraplane_cpu::silu_mul16(x, up));
      }
#elif defined(LORAPLANE_AVX2)
      // 8 lanes at a time with silu_mul8, the same bits as linear_silu_mul_'s AVX2 epilogue
      using namespace loraplane_cpu::avx2;
      const auto* gb = reinterpret_cast<const c10::BFloat16*>(gt);
      for (int64_t j = 0; j < I; j += 8) {
        const int64_t n = std::min<int64_t>(8, I - j);
        store8_bf16(reinterpret_cast<c10::BFloat16*>(ot + j),
                    silu_mul8(load8_bf16_as_f32(gb + j, n), load8_bf16_as_f32(gb + I + j, n)), n);
      }
#else
#pragma omp simd
      for (int64_t j = 0; j < I; ++j) {
        const float x = bf16_to_float(gt[j]);
        ot[j] = float_to_bf16(x / (1.f + loraplane_cpu::exp_clamped(-x)) * bf16_to_float(gt[j + I]));
      }
#endif
    }
  });
}

// out[t] = argmax(logits[t]) for bf16 logits [T, V] -> int64 [T], as torch.argmax on the logits
// (or on their fp32 copy) returns it: the first index of the largest value, or of the first NaN.
// Two passes over the row (the max, then its first index); a greedy step no longer widens the
// whole [T, V] block to fp32 first.
void argmax_rows_(at::Tensor& out, const at::Tensor& logits) {
  check_bf16_rows(logits, "logits");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.dim() == 1 && out.size(0) == logits.size(0) &&
                  out.is_contiguous(),
              "out must be a contiguous int64 [T]");
  const int64_t T = logits.size(0), V = logits.size(1), sl = logits.stride(0);
  TORCH_CHECK(V > 0, "logits must have at least one column");
  const uint16_t* lp = bits(logits);
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, T, grain(V), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* row = lp + t * sl;
      float mx = -std::numeric_limits<float>::infinity();
      int nan = 0;
#pragma omp simd reduction(max : mx) reduction(| : nan)
      for (int64_t j = 0; j < V; ++j) {
        const float x = bf16_to_float(row[j]);
        mx = std::max(mx, x);
        nan |= x != x;
      }
      int64_t idx = 0;
      for (; idx < V; ++idx) {
        const float x = bf16_to_float(row[idx]);
        if (nan ? x != x : x == mx) break;
      }
      op[t] = idx;
    }
  });
}

}  // namespace loraplane_cpu
