// The kernels' entry points (the bodies of the torch ops registered in each source), callable from
// C++ so that decoder_layer_cpu.cpp can run a whole decoder layer in one op call. Each checks its
// arguments as the op does; their contracts are the comments at their definitions.

#pragma once

#include <ATen/ATen.h>

namespace loraplane_cpu {

// linear_cpu.cpp
void linear_(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
void linear_silu_mul_(at::Tensor& out, const at::Tensor& x, const at::Tensor& w,
                      const c10::optional<at::Tensor>& bias);
// layer_ops_cpu.cpp
void add_rms_norm_(at::Tensor& out, at::Tensor& residual, const c10::optional<at::Tensor>& delta,
                   const at::Tensor& weight, double eps);
void rotary_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);
void silu_mul_(at::Tensor& out, const at::Tensor& gate_up);
// lora_cpu.cpp
void bgmv_packed_(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& slots,
                  const at::Tensor& proj, const at::Tensor& out_bounds, int64_t skip_slot);
// paged_attention_cpu.cpp
void paged_decode_attention_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& context_lens, double scale);
void write_kv_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& slot_mapping);
// prefill_attention_cpu.cpp
void paged_prefill_attention_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& block_table, int64_t ctx, double scale);

}  // namespace loraplane_cpu
