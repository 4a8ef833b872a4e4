// Every op of the library, its schema and its CPU body, in one place: torch.ops.loraplane.<name>.
// The bodies live in the sources named beside each group (declared in ops.h); kernels/cpu_kernels.py
// wraps each for Python. An op whose fast path this build lacks (cpu_common.h: the ISA it targets)
// still runs, over torch or a portable loop, or refuses with the reason where it has no other body.

#include <torch/library.h>

#include "layer_weights.h"
#include "ops.h"

TORCH_LIBRARY(loraplane, m) {
  // what this build is: the instruction set it targets (avx512_bf16, avx2, generic) and the rows of x
  // up to which the layers take linear_ over torch's GEMM
  m.def("isa", &loraplane_cpu::isa);
  m.def("linear_max_rows", &loraplane_cpu::linear_max_rows);
  // how many of a bf16 linear_'s rows its GEMM takes (the first ones; the rest run the decode paths)
  m.def("linear_gemm_rows", &loraplane_cpu::linear_gemm_rows);

  // paged_attention_cpu.cpp: decode attention over the paged KV cache, and the cache writes
  m.def(
      "paged_decode_attention_(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor context_lens, float scale, int window=0) -> ()");
  m.def("write_kv_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  // prefill_attention_cpu.cpp: causal attention of one prefill chunk over its cached context
  m.def(
      "paged_prefill_attention_(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "int ctx, float scale, int window=0) -> ()");
  // linear_cpu.cpp: y = x W^T (+ b), and the MLP's gate_up with SiLU-and-multiply in its epilogue
  m.def("linear_(Tensor(a!) out, Tensor x, Tensor w, Tensor? bias) -> ()");
  m.def("linear_silu_mul_(Tensor(a!) out, Tensor x, Tensor w, Tensor? bias) -> ()");
  // linear_int8_cpu.cpp: the same two for an int8 weight quantized per output channel (scale, row sums)
  m.def("linear_int8_(Tensor(a!) out, Tensor x, Tensor w, Tensor scale, Tensor wsum, Tensor? bias) -> ()");
  m.def("linear_int8_silu_mul_(Tensor(a!) out, Tensor x, Tensor w, Tensor scale, Tensor wsum, Tensor? bias) -> ()");
  // layer_ops_cpu.cpp: the fused elementwise parts of a layer, and the greedy token per row
  m.def("add_rms_norm_(Tensor(a!) out, Tensor(b!) residual, Tensor? delta, Tensor weight, float eps) -> ()");
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul_(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("argmax_rows_(Tensor(a!) out, Tensor logits) -> ()");
  // lora_cpu.cpp: LoRA for rows of many adapters, over the dense and the packed slot layouts
  m.def(
      "bgmv_(Tensor(a!) out, Tensor x, Tensor a, Tensor bt, Tensor slots, Tensor proj_rows, Tensor out_bounds, "
      "int skip_slot) -> ()");
  m.def(
      "bgmv_packed_(Tensor(a!) out, Tensor x, Tensor packed, Tensor slots, Tensor proj, Tensor out_bounds, "
      "int skip_slot) -> ()");
  // decoder_layer_cpu.cpp: one decoder layer in one call, over the ops above, its weights gathered at load
  m.class_<loraplane_cpu::LayerWeights>("LayerWeights")
      .def(torch::init<at::Tensor, c10::optional<at::Tensor>, at::Tensor, at::Tensor, at::Tensor,
                       c10::optional<at::Tensor>, at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                       int64_t, int64_t, double, double, double, int64_t>())
      .def("set_int8", &loraplane_cpu::LayerWeights::set_int8);
  m.def(
      "decoder_layer_(Tensor(a!) x, Tensor h, __torch__.torch.classes.loraplane.LayerWeights w, Tensor(b!) k_cache, "
      "Tensor(c!) v_cache, Tensor?[] step, Tensor[] chunk_tables, int[] chunks, Tensor?[] lora, int num_decode, "
      "int skip_slot) -> Tensor");
}

TORCH_LIBRARY_IMPL(loraplane, CPU, m) {
  m.impl("paged_decode_attention_", loraplane_cpu::paged_decode_attention_);
  m.impl("write_kv_", loraplane_cpu::write_kv_);
  m.impl("paged_prefill_attention_", loraplane_cpu::paged_prefill_attention_);
  m.impl("linear_", loraplane_cpu::linear_);
  m.impl("linear_silu_mul_", loraplane_cpu::linear_silu_mul_);
  m.impl("linear_int8_", loraplane_cpu::linear_int8_);
  m.impl("linear_int8_silu_mul_", loraplane_cpu::linear_int8_silu_mul_);
  m.impl("add_rms_norm_", loraplane_cpu::add_rms_norm_);
  m.impl("rotary_", loraplane_cpu::rotary_);
  m.impl("silu_mul_", loraplane_cpu::silu_mul_);
  m.impl("argmax_rows_", loraplane_cpu::argmax_rows_);
  m.impl("bgmv_", loraplane_cpu::bgmv_);
  m.impl("bgmv_packed_", loraplane_cpu::bgmv_packed_);
  m.impl("decoder_layer_", loraplane_cpu::decoder_layer_);
}
