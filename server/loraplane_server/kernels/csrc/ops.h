// The kernels' entry points: the bodies of the torch ops (bindings.cpp registers every one), callable
// from C++ too, so that decoder_layer_cpu.cpp runs a whole decoder layer in one op call. Each checks
// its arguments; their contracts are the comments at their definitions.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>
#include <string>

#include "cpu_common.h"

namespace loraplane_cpu {

// Rows of x up to which the layers call linear_ rather than torch's GEMM (decoder_layer_cpu.cpp here,
// executor/layers/linear.py through linear_max_rows()); bench/linear.py measured it. With AVX-512 BF16, oneDNN's
// bf16 GEMM wins above 1024 rows; on AVX2, torch has no fast bf16 GEMM (3.6x slower than linear_ at
// 64-256 rows), so linear_ takes every size.
#if defined(LORAPLANE_AVX512_BF16)
constexpr int64_t kLinearMaxRows = 1024;
#else
constexpr int64_t kLinearMaxRows = std::numeric_limits<int64_t>::max();
#endif

// The instruction set this build targets (cpu_common.h): the library's own word on which fast
// paths it holds; every source is compiled with the same flags.
inline std::string isa() { return LORAPLANE_ISA; }
inline int64_t linear_max_rows() { return kLinearMaxRows; }

// linear_cpu.cpp
void linear_(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
void linear_silu_mul_(at::Tensor& out, const at::Tensor& x, const at::Tensor& w,
                      const c10::optional<at::Tensor>& bias);
// Of a bf16 linear_ of `rows` rows of x with `k` columns, how many (the first ones) the register-tiled
// GEMM computes; the others run a decode path (0 where the build has no bf16 paths). A row's result
// depends on which of the two computes it, never on the values of the other rows.
int64_t linear_gemm_rows(int64_t rows, int64_t k);
// linear_int8_cpu.cpp: y = x (scale * w)^T (+ bias) with w int8 [N, K] (symmetric, per output channel:
// row n of the real weight is scale[n] * w[n]), scale fp32 [N], wsum int32 [N] = sum_k w[n, k]
void linear_int8_(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                  const at::Tensor& wsum, const c10::optional<at::Tensor>& bias);
// silu(gate) * up of the same product for w = [gate; up] ([2I, K]) -> out [M, I], as linear_silu_mul_
void linear_int8_silu_mul_(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                           const at::Tensor& wsum, const c10::optional<at::Tensor>& bias);
// layer_ops_cpu.cpp
void add_rms_norm_(at::Tensor& out, at::Tensor& residual, const c10::optional<at::Tensor>& delta,
                   const at::Tensor& weight, double eps);
void rotary_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);
void silu_mul_(at::Tensor& out, const at::Tensor& gate_up);
void argmax_rows_(at::Tensor& out, const at::Tensor& logits);
// lora_cpu.cpp
void bgmv_(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt, const at::Tensor& slots,
           const at::Tensor& proj_rows, const at::Tensor& out_bounds, int64_t skip_slot);
void bgmv_packed_(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& slots,
                  const at::Tensor& proj, const at::Tensor& out_bounds, int64_t skip_slot);
// paged_attention_cpu.cpp
void paged_decode_attention_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& context_lens, double scale, int64_t window);
void write_kv_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& slot_mapping);
// prefill_attention_cpu.cpp
void paged_prefill_attention_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& block_table, int64_t ctx, double scale,
                              int64_t window);

// decoder_layer_cpu.cpp (w: layer_weights.h)
struct LayerWeights;
at::Tensor decoder_layer_(at::Tensor& x, const at::Tensor& h, const c10::intrusive_ptr<LayerWeights>& w,
                          at::Tensor& k_cache, at::Tensor& v_cache, const c10::List<c10::optional<at::Tensor>>& step,
                          at::TensorList chunk_tables, at::IntArrayRef chunks,
                          const c10::List<c10::optional<at::Tensor>>& lora, int64_t num_decode, int64_t skip_slot);

}  // namespace loraplane_cpu
