// nanoengine's CPU kernels (chapter 06): what the family files define and module.cpp binds to Python.
// decode_attention.cpp: paged_decode; glue.cpp: rms_norm, rotary, silu_and_mul; bf16_linear.cpp: bf16_pack,
// bf16_linear (bf16_pairs.cpp: its AVX-512 layout); int8_linear.cpp: int8_pack, int8_linear (w8a8_linear.cpp:
// w8a8_pack and its int8-activation paths); decode_step.cpp: Linear, DecodeLayer, decode_layers,
// onednn_bf16_linear.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace nanoengine {

// 1. paged decode attention: q [B, H, D] against the K/V rows of each sequence's blocks -> [B, H, D]; the
// caches hold q's dtype or bf16; path: "auto", "avx2" or "plain" (the loops a CPU without AVX2 runs)
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                        const std::string& path = "auto");

// 2. fused glue: (residual +) RMSNorm -> [normed] or [normed, residual sum]; rotary; silu(gate) * up
std::vector<at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                 const at::Tensor& weight, double eps);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_table,
                  const at::Tensor& sin_table);
at::Tensor silu_and_mul(const at::Tensor& gate_up);

// 3. small-batch linear with bf16 weights: pack a weight [N, K] once, then x [M, K] @ W^T (+ bias); path:
// "auto" (the best this build has), "avx512bf16", "avx512", "avx2" or "plain" (bf16_linear.cpp)
at::Tensor bf16_pack(const at::Tensor& weight, const std::string& path = "auto");
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t N, const std::string& path = "auto");
std::string bf16_best_path();  // what "auto" runs for a weight packed with "auto"
// the pairs layout's paths (bf16_pairs.cpp): packed [ceil(N / 16), ceil(K / 2), 16, 2]; path already checked
at::Tensor bf16_pairs_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                             int64_t N, const std::string& path);

// 4. small-batch linear with int8 weights and per-group float32 scales: pack once, then x @ (q * s)^T (+ bias)
std::vector<at::Tensor> int8_pack(const at::Tensor& q, const at::Tensor& scales);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias, int64_t N, int64_t group_size,
                       const std::string& path = "auto");

// 4b. int8 weights x int8 activations (W8A8; w8a8_linear.cpp): int8_linear runs it for a w8a8_pack-ed weight;
// path: "auto", "avx512vnni", "avxvnni", "avx2" or "plain"
std::vector<at::Tensor> w8a8_pack(const at::Tensor& q, const at::Tensor& scales, int64_t group_size);
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias, int64_t N, int64_t group_size,
                       const std::string& path);

// 5. a decode step's decoder layers in one call
// float32 x [M, K] rounded to bf16 @ a oneDNN-packed bf16 weight (torch.ops.mkldnn._reorder_linear_weight;
// AMX tiles where the CPU has them; or a plain bf16 weight), the sums cast back to float32, + bias in float32:
// what layers.linear.PackableLinear runs above its bf16_min_rows (decode_step.cpp)
at::Tensor onednn_bf16_linear(const at::Tensor& x, const at::Tensor& onednn, const c10::optional<at::Tensor>& bias);

// one projection: an int8_pack-ed copy (int8_linear), else for batches of more than onednn_min_rows rows a
// oneDNN-packed bf16 copy (onednn_bf16_linear), else a bf16_pack-ed copy (bf16_linear), else the plain weight
// (at::linear)
struct Linear {
  c10::optional<at::Tensor> packed;
  at::Tensor weight;
  c10::optional<at::Tensor> bias;
  int64_t out_features = 0;
  c10::optional<at::Tensor> int8, int8_scales;  // int8_pack's two tensors
  int64_t group_size = 0;
  c10::optional<at::Tensor> onednn;  // oneDNN-packed bf16 weight for batches of more than onednn_min_rows rows
  int64_t onednn_min_rows = 0;
  at::Tensor operator()(const at::Tensor& x) const {
    if (int8) return int8_linear(x, *int8, *int8_scales, bias, out_features, group_size, "auto");
    if (onednn && x.size(0) > onednn_min_rows && x.scalar_type() == at::kFloat)
      return onednn_bf16_linear(x, *onednn, bias);
    return packed ? bf16_linear(x, *packed, bias, out_features, "auto") : at::linear(x, weight, bias);
  }
};

struct DecodeLayer {  // what one Llama/Qwen3 decoder layer needs for a decode step
  at::Tensor input_norm, post_norm;  // [hidden]
  c10::optional<at::Tensor> q_norm, k_norm;  // [head_dim]: Qwen3's per-head norms
  Linear qkv, o, gate_up, down;
  at::Tensor k_cache, v_cache;  // [kv_heads, blocks, block_size, head_dim]
};

at::Tensor decode_layers(const at::Tensor& x_in, const at::Tensor& positions, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& context_lens,
                         const std::vector<DecodeLayer>& layers, const at::Tensor& final_norm,
                         const at::Tensor& cos_table, const at::Tensor& sin_table, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, double eps, double scale, at::Tensor times);

}  // namespace nanoengine
