// Batched LoRA for decode rows with many distinct adapters (BGMV), bf16, on the CPU.
//
// out[b] += (x[b] A_s^T) B_s for each decode row b with adapter slot s = slots[b], reading A_s and
// B_s^T straight from the stacked slot tensors. The torch path gathers every row's A and B into a
// per-row copy first (two copies of the adapter weights per layer per step, then two bmm); with 64
// adapters in a step, that was most of the LoRA cost. Rows are spread over torch's intra-op pool;
// h = x A^T stays in fp32 between the two products (torch rounds it to bf16), and each output row
// is rounded once, after the delta is added.
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

// x: [K], a: [W, K] rows of one slot -> h[j] = a_j . x for j < w
inline void shrink(const BF* x, const BF* a, int64_t K, int64_t w, float* h) {
  for (int64_t j = 0; j < w; ++j) {
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

// out[n] += sum_j h[j] bt[j, n] for n < N; bt: [W, N] rows of one slot
inline void expand(BF* out, const float* h, const BF* bt, int64_t N, int64_t w) {
  constexpr int64_t V = 8;  // 128 outputs per pass, accumulated in registers
  for (int64_t n0 = 0; n0 < N; n0 += 16 * V) {
    __m512 acc[V];
    const int64_t width = std::min<int64_t>(16 * V, N - n0);
    const int64_t nv = (width + 15) / 16;
    for (int64_t v = 0; v < V; ++v) acc[v] = _mm512_setzero_ps();
    for (int64_t j = 0; j < w; ++j) {
      const __m512 hj = _mm512_set1_ps(h[j]);
      const BF* row = bt + j * N + n0;
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
#endif

// out: [B, N] (rows may be strided), x: [B, K] (rows may be strided), a: [S, W, K], bt: [S, W, N]
// (contiguous per slot), slots: [B] int64; width: the rank columns used (<= W).
void bgmv_(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt, const at::Tensor& slots,
           int64_t width, int64_t skip_slot) {
  TORCH_CHECK(out.device().is_cpu(), "bgmv_: CPU tensors only");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &x, &a, &bt})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16, "bgmv_: bf16 tensors only");
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && a.dim() == 3 && bt.dim() == 3, "bgmv_: bad ranks");
  const int64_t B = x.size(0), K = x.size(1), N = out.size(1), S = a.size(0), W = a.size(1);
  TORCH_CHECK(out.size(0) == B && a.size(2) == K && bt.size(0) == S && bt.size(1) == W && bt.size(2) == N,
              "bgmv_: out [B, N], x [B, K], a [S, W, K], bt [S, W, N]");
  TORCH_CHECK(0 <= width && width <= W, "bgmv_: width must be within the slots' rank columns");
  TORCH_CHECK(out.stride(1) == 1 && x.stride(1) == 1, "bgmv_: rows of out and x must be contiguous");
  TORCH_CHECK(a.stride(2) == 1 && a.stride(1) == K && bt.stride(2) == 1 && bt.stride(1) == N,
              "bgmv_: each slot of a and bt must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == B && slots.is_contiguous(),
              "bgmv_: slots must be a contiguous int64 [B]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(0 <= sp[b] && sp[b] < S, "bgmv_: slot ", sp[b], " out of range");
  if (B == 0 || width == 0) return;
#ifdef LORAPLANE_AVX512_BF16
  BF* po = out.data_ptr<BF>();
  const BF *px = x.data_ptr<BF>(), *pa = a.data_ptr<BF>(), *pb = bt.data_ptr<BF>();
  const int64_t so = out.stride(0), sx = x.stride(0), sa = a.stride(0), sb = bt.stride(0);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h(width);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t s = sp[b];
      if (s == skip_slot) continue;
      shrink(px + b * sx, pa + s * sa, K, width, h.data());
      expand(po + b * so, h.data(), pb + s * sb, N, width);
    }
  });
#else
  TORCH_CHECK(false, "bgmv_: built without AVX512-BF16");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(loraplane, m) {
  m.def("bgmv_(Tensor(a!) out, Tensor x, Tensor a, Tensor bt, Tensor slots, int width, int skip_slot) -> ()");
}

TORCH_LIBRARY_IMPL(loraplane, CPU, m) { m.impl("bgmv_", bgmv_); }
