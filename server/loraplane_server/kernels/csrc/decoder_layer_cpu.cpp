// One decoder layer of the Llama family in one op call, for bf16 on the CPU: the same kernels the
// Python layer calls (ops.h), in the same order on the same intermediate tensors, so the result is
// bit-for-bit the Python path's (tests/kernels/test_cpu_decoder_layer.py). What it saves is the
// Python between them: ~12 op calls a layer, their argument parsing and the module glue
// (docs/kernels.md).
//
//   a  = attention(rotary(qkv(h) + lora_qkv), paged KV cache)   write this step's k, v; decode rows
//        first (one batched call), then each prefill chunk over its cached context; both over the
//        layer's sliding window where it has one (LayerWeights::window)
//   h2 = rmsnorm(x += o(a) + lora_o)
//   m  = down(silu(gate) * up) + lora_down, (gate | up) = gate_up(h2) + lora_gate_up; with no
//        LoRA on gate_up the activation runs in the GEMM's epilogue (linear_silu_mul_)
//   returns next_norm(x += m): the next layer's h; the last layer returns x += m, on the logits rows
//   alone where the step prunes to them (o, the norm and the MLP run on those rows only)

#include <ATen/ATen.h>

#include "layer_weights.h"
#include "ops.h"

namespace {

using at::Tensor;
using OptTensor = c10::optional<at::Tensor>;

// base_linear (executor/layers/linear.py): the kernel for up to kLinearMaxRows rows (ops.h), torch's GEMM above;
// int8 weights (scale and wsum given) through linear_int8_ at every size
Tensor project(const Tensor& x, const Tensor& w, const OptTensor& scale, const OptTensor& wsum, const OptTensor& bias) {
  if (w.scalar_type() == at::kChar) {
    TORCH_CHECK(scale.has_value() && wsum.has_value(), "decoder_layer_: int8 weights without their scales (set_int8)");
    Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
    loraplane_cpu::linear_int8_(out, x, w, *scale, *wsum, bias);
    return out;
  }
  if (x.size(0) <= loraplane_cpu::kLinearMaxRows && x.stride(1) == 1 && w.is_contiguous()) {
    Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
    loraplane_cpu::linear_(out, x, w, bias);
    return out;
  }
  return at::linear(x, w, bias);
}

}  // namespace

namespace loraplane_cpu {

// x: the residual stream [T, hidden] (updated in place); h: input_layernorm(x); w: this layer's weights
// (LayerWeights, built at load).
// step: cos [T, D], sin [T, D], slot_mapping [T], decode_block_tables?, decode_context_lens?, row_slots?,
// logits_rows?, logits_row_slots?
// chunk_tables / chunks: each prefill chunk's block table and (query_start, query_tokens, context_tokens)
// lora: (packed, proj, out_bounds) for qkv, o, gate_up, down, each None where no adapter of the step
// targets that layer (bgmv_packed_'s arguments; row_slots then required).
// Returns next_norm(x) with the next layer's norm; for the last layer (no next norm) x itself, and with
// logits_rows, everything after attention runs on those rows alone (their LoRA slots logits_row_slots)
// and x's rows there come back: the Python layer's `rows`.
Tensor decoder_layer_(Tensor& x, const Tensor& h, const c10::intrusive_ptr<LayerWeights>& w, Tensor& k_cache,
                      Tensor& v_cache, const c10::List<OptTensor>& step, at::TensorList chunk_tables,
                      at::IntArrayRef chunks, const c10::List<OptTensor>& lora, int64_t num_decode, int64_t skip_slot) {
  TORCH_CHECK(step.size() == 8 && lora.size() == 12, "decoder_layer_: 8 step tensors and 12 LoRA entries expected");
  TORCH_CHECK(chunks.size() == 3 * chunk_tables.size(), "decoder_layer_: one (start, tokens, context) per chunk");
  TORCH_CHECK(x.dim() == 2 && h.sizes() == x.sizes() && x.is_contiguous(), "decoder_layer_: x and h must be [T, hidden]");
  const int64_t T = x.size(0), D = k_cache.size(3), num_heads = w->num_heads, num_kv_heads = w->num_kv_heads;
  TORCH_CHECK(D == w->head_dim && x.size(1) == w->o_w.size(0), "decoder_layer_: the weights do not fit x or the cache");
  const int64_t q_size = num_heads * D, kv_size = num_kv_heads * D;
  const OptTensor row_slots = step.get(5), logits_rows = step.get(6);
  const bool prune = logits_rows.has_value();
  TORCH_CHECK(!prune || !w->next_norm_w.has_value(), "decoder_layer_: only the last layer prunes to the logits rows");
  // the rows after attention, and their LoRA slots
  const OptTensor tail_slots = prune ? step.get(7) : row_slots;
  auto add_lora = [&](Tensor& out, const Tensor& in, int64_t kind, const OptTensor& slots) {
    const OptTensor packed = lora.get(3 * kind);
    if (!packed.has_value()) return;  // slots checked below, before anything is written
    const OptTensor proj = lora.get(3 * kind + 1), bounds = lora.get(3 * kind + 2);
    TORCH_CHECK(proj.has_value() && bounds.has_value(), "decoder_layer_: LoRA entry without its rows or bounds");
    bgmv_packed_(out, in, *packed, *slots, *proj, *bounds, skip_slot);
  };
  const OptTensor cos = step.get(0), sin = step.get(1), slot_mapping = step.get(2);
  TORCH_CHECK(cos && sin && slot_mapping, "decoder_layer_: cos, sin and slot_mapping are required");
  TORCH_CHECK(num_decode >= 0 && num_decode <= T, "decoder_layer_: num_decode outside [0, T]");
  TORCH_CHECK(num_decode == 0 || (step.get(3).has_value() && step.get(4).has_value()),
              "decoder_layer_: decode rows need their block tables and context lengths");
  for (int64_t kind = 0; kind < 4; ++kind)  // checked before anything is written
    TORCH_CHECK(!lora.get(3 * kind).has_value() || (row_slots.has_value() && tail_slots.has_value()),
                "decoder_layer_: LoRA needs the step's row slots");

  // attention, over every row
  Tensor qkv = project(h, w->qkv_w, w->qkv_s, w->qkv_sum, w->qkv_b);
  add_lora(qkv, h, 0, row_slots);
  Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, D});
  Tensor k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, D});
  Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, D});
  rotary_(q, k, *cos, *sin);
  write_kv_(k_cache, v_cache, k, v, *slot_mapping);
  Tensor attn = at::empty({T, num_heads, D}, x.options());
  if (num_decode > 0) {
    const OptTensor tables = step.get(3), lens = step.get(4);  // present: checked above
    Tensor out = attn.narrow(0, 0, num_decode);
    paged_decode_attention_(out, q.narrow(0, 0, num_decode), k_cache, v_cache, *tables, *lens, w->scale, w->window);
  }
  for (size_t c = 0; c < chunk_tables.size(); ++c) {
    const int64_t start = chunks[3 * c], n = chunks[3 * c + 1], ctx = chunks[3 * c + 2];
    Tensor out = attn.narrow(0, start, n);
    paged_prefill_attention_(out, q.narrow(0, start, n), k_cache, v_cache, chunk_tables[c], ctx, w->scale, w->window);
  }
  Tensor a = attn.view({T, q_size});
  Tensor r = x;  // the residual rows from here on: all of x, or (last layer) a copy of the logits rows
  if (prune) {
    a = a.index_select(0, *logits_rows);
    r = x.index_select(0, *logits_rows);
  }
  Tensor o = project(a, w->o_w, w->o_s, w->o_sum, c10::nullopt);
  add_lora(o, a, 1, tail_slots);
  Tensor h2 = at::empty_like(r);
  add_rms_norm_(h2, r, o, w->post_norm_w, w->eps);

  // MLP
  const int64_t inter = w->gate_up_w.size(0) / 2, rows = r.size(0);
  Tensor act;
  if (!lora.get(6).has_value()) {
    act = at::empty({rows, inter}, x.options());
    if (w->int8())
      linear_int8_silu_mul_(act, h2, w->gate_up_w, *w->gate_up_s, *w->gate_up_sum, w->gate_up_b);
    else
      linear_silu_mul_(act, h2, w->gate_up_w, w->gate_up_b);
  } else {
    Tensor gate_up = project(h2, w->gate_up_w, w->gate_up_s, w->gate_up_sum, w->gate_up_b);
    add_lora(gate_up, h2, 2, tail_slots);
    act = at::empty({rows, inter}, x.options());
    silu_mul_(act, gate_up);
  }
  Tensor m = project(act, w->down_w, w->down_s, w->down_sum, w->down_b);
  add_lora(m, act, 3, tail_slots);
  if (!w->next_norm_w.has_value()) return r.add_(m);
  Tensor next = at::empty_like(r);
  add_rms_norm_(next, r, m, *w->next_norm_w, w->next_eps);
  return next;
}

}  // namespace loraplane_cpu
