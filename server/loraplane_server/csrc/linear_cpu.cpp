// y = x W^T (+ b) in bf16 for a few rows of x: the linear layers of a small decode step.
//
// With 1 to 16 rows of x, a linear layer reads its whole weight from memory to do a few FLOPs
// per byte, so its speed is the speed at which the weight streams in. Measured on this project's
// CPU (AMD EPYC, AVX512-BF16), torch's bf16 GEMM streams a weight at 7-13 GB/s there, while a
// plain sequential read runs at 20-27 GB/s. This kernel walks W one row at a time (the whole
// matrix in address order, one stream: walking several rows in step halved the read rate on
// this machine), dots the row with up to 4 rows of x at once (vdpbf16ps, fp32 accumulators,
// x stays in L1), and for 5 or more rows of x takes two W rows at a time, where the dot products
// rather than the reads set the pace.
//
// Output rows are rounded to bf16 once, from the fp32 sum (round to nearest even), as torch's
// bf16 linear does; the summation order differs from torch's, so results agree to bf16
// rounding, not bitwise. Each output element is computed by one thread start to end, so the
// result does not depend on the thread count. Rows of W are spread over torch's intra-op pool.
//
// Registered as torch.ops.loraplane.small_m_linear_ (in-place on `out`). Builds without
// AVX512-BF16 register the same op over at::linear, so callers never need to ask.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_common.h"

#include <algorithm>
#include <cstdint>

namespace {

#ifdef LORAPLANE_AVX512_BF16
using BF = c10::BFloat16;
using loraplane_cpu::load32_bf16;

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

// R rows of W against all M rows of x, four at a time.
template <int R>
inline void w_rows(BF* out, int64_t so, const BF* x, int64_t sx, const BF* w, int64_t M, int64_t K, const BF* bias) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile<R, 4>(out + m * so, so, x + m * sx, sx, w, K, bias);
  switch (M - m) {
    case 3: tile<R, 3>(out + m * so, so, x + m * sx, sx, w, K, bias); break;
    case 2: tile<R, 2>(out + m * so, so, x + m * sx, sx, w, K, bias); break;
    case 1: tile<R, 1>(out + m * so, so, x + m * sx, sx, w, K, bias); break;
    default: break;
  }
}

template <int R>
void linear_bf16(BF* out, int64_t so, const BF* x, int64_t sx, const BF* w, const BF* bias, int64_t M, int64_t K,
                 int64_t N) {
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
#endif

// out: [M, N], x: [M, K] (rows may be strided), w: [N, K] contiguous, bias: [N] or none; one dtype.
void small_m_linear_(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && out.device().is_cpu(), "small_m_linear_: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2, "small_m_linear_: x [M, K], w [N, K], out [M, N]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "small_m_linear_: w has ", w.size(1), " columns, x has ", K);
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "small_m_linear_: out must be [", M, ", ", N, "]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && out.scalar_type() == x.scalar_type(),
              "small_m_linear_: x, w and out must share a dtype");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && w.is_contiguous(),
              "small_m_linear_: rows of x and out, and all of w, must be contiguous");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous(), "small_m_linear_: bias must be [N]");
    TORCH_CHECK(bias->scalar_type() == x.scalar_type(), "small_m_linear_: bias must share x's dtype");
  }
  if (M == 0 || N == 0) return;
#ifdef LORAPLANE_AVX512_BF16
  if (x.scalar_type() == at::kBFloat16) {
    auto* po = out.data_ptr<BF>();
    const auto *px = x.data_ptr<BF>(), *pw = w.data_ptr<BF>();
    const BF* pb = bias.has_value() ? bias->data_ptr<BF>() : nullptr;
    if (M <= 4) {
      linear_bf16<1>(po, out.stride(0), px, x.stride(0), pw, pb, M, K, N);
    } else {
      linear_bf16<2>(po, out.stride(0), px, x.stride(0), pw, pb, M, K, N);
    }
    return;
  }
#endif
  out.copy_(at::linear(x, w, bias));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loraplane, m) {
  m.def("small_m_linear_(Tensor(a!) out, Tensor x, Tensor w, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(loraplane, CPU, m) { m.impl("small_m_linear_", small_m_linear_); }
