// One decoder layer's weights and constants for decoder_layer_, gathered once at load
// (torch.classes.loraplane.LayerWeights, built by kernels/cpu_kernels.py:layer_weights): a step's call
// then passes one object per layer, not nine tensors and five numbers, and the shapes are checked
// once, at load, rather than on every call. With int8 base weights (EngineConfig.quantization) the four
// projections are int8 [out, in] and set_int8 adds each one's per-channel scales and row sums
// (linear_int8_'s arguments).

#pragma once

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <vector>

namespace loraplane_cpu {

struct LayerWeights : torch::CustomClassHolder {
  at::Tensor qkv_w, o_w, post_norm_w, gate_up_w, down_w;
  c10::optional<at::Tensor> qkv_b, gate_up_b, down_b;
  c10::optional<at::Tensor> next_norm_w;  // the next layer's input norm; none for the last layer
  // int8 projections: scale fp32 [out] and wsum int32 [out] of qkv, o, gate_up, down (set_int8)
  c10::optional<at::Tensor> qkv_s, qkv_sum, o_s, o_sum, gate_up_s, gate_up_sum, down_s, down_sum;
  int64_t num_heads, num_kv_heads, head_dim;
  double scale, eps, next_eps;
  int64_t window;  // the layer's sliding attention window (decode and prefill attention's), 0: full attention

  LayerWeights(at::Tensor qkv_w_, c10::optional<at::Tensor> qkv_b_, at::Tensor o_w_, at::Tensor post_norm_w_,
               at::Tensor gate_up_w_, c10::optional<at::Tensor> gate_up_b_, at::Tensor down_w_,
               c10::optional<at::Tensor> down_b_, c10::optional<at::Tensor> next_norm_w_, int64_t num_heads_,
               int64_t num_kv_heads_, double scale_, double eps_, double next_eps_, int64_t window_)
      : qkv_w(std::move(qkv_w_)), o_w(std::move(o_w_)), post_norm_w(std::move(post_norm_w_)),
        gate_up_w(std::move(gate_up_w_)), down_w(std::move(down_w_)), qkv_b(std::move(qkv_b_)),
        gate_up_b(std::move(gate_up_b_)), down_b(std::move(down_b_)), next_norm_w(std::move(next_norm_w_)),
        num_heads(num_heads_), num_kv_heads(num_kv_heads_), head_dim(0), scale(scale_), eps(eps_),
        next_eps(next_eps_), window(window_) {
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
                "LayerWeights: num_heads must be a positive multiple of num_kv_heads");
    TORCH_CHECK(window >= 0, "LayerWeights: window must be >= 0 (0: none)");
    const bool int8 = qkv_w.scalar_type() == at::kChar;
    for (const at::Tensor* w : {&qkv_w, &o_w, &gate_up_w, &down_w})
      TORCH_CHECK(w->dim() == 2 && w->is_contiguous() && w->scalar_type() == (int8 ? at::kChar : at::kBFloat16),
                  "LayerWeights: the projections must be contiguous [out, in], all bf16 or all int8");
    const int64_t hidden = o_w.size(0), heads = num_heads + 2 * num_kv_heads;
    TORCH_CHECK(qkv_w.size(1) == hidden && qkv_w.size(0) % heads == 0, "LayerWeights: qkv is not [(H + 2 KVH) D, hidden]");
    head_dim = qkv_w.size(0) / heads;
    TORCH_CHECK(o_w.size(1) == num_heads * head_dim, "LayerWeights: o is not [hidden, H D]");
    TORCH_CHECK(gate_up_w.size(1) == hidden && gate_up_w.size(0) % 2 == 0 && down_w.size(1) == gate_up_w.size(0) / 2 &&
                    down_w.size(0) == hidden,
                "LayerWeights: gate_up [2I, hidden] and down [hidden, I] do not match");
    for (const at::Tensor* norm : {&post_norm_w, next_norm_w.has_value() ? &*next_norm_w : &post_norm_w})
      TORCH_CHECK(norm->dim() == 1 && norm->size(0) == hidden && norm->is_contiguous() && norm->scalar_type() == at::kBFloat16,
                  "LayerWeights: the norms' weights must be bf16 [hidden]");
  }

  bool int8() const { return qkv_w.scalar_type() == at::kChar; }

  // The int8 projections' scales and row sums: qkv, o, gate_up, down (each a scale and a sum).
  void set_int8(const std::vector<at::Tensor>& parts) {
    TORCH_CHECK(int8(), "LayerWeights.set_int8: the projections are not int8");
    TORCH_CHECK(parts.size() == 8, "LayerWeights.set_int8: expected a scale and a sum for each of 4 projections");
    const at::Tensor* weights[4] = {&qkv_w, &o_w, &gate_up_w, &down_w};
    for (size_t i = 0; i < 4; ++i) {
      const at::Tensor &s = parts[2 * i], &sum = parts[2 * i + 1];
      const int64_t n = weights[i]->size(0);
      TORCH_CHECK(s.dim() == 1 && s.size(0) == n && s.is_contiguous() && s.scalar_type() == at::kFloat,
                  "LayerWeights.set_int8: a scale must be fp32 [out]");
      TORCH_CHECK(sum.dim() == 1 && sum.size(0) == n && sum.is_contiguous() && sum.scalar_type() == at::kInt,
                  "LayerWeights.set_int8: a row sum must be int32 [out]");
    }
    qkv_s = parts[0], qkv_sum = parts[1], o_s = parts[2], o_sum = parts[3];
    gate_up_s = parts[4], gate_up_sum = parts[5], down_s = parts[6], down_sum = parts[7];
  }
};

}  // namespace loraplane_cpu
