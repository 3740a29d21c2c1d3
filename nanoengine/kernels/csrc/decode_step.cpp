// nanoengine's CPU kernels, family 4 (chapter 06): a decode step's decoder layers in one call,
// `decode_layers` (its argument types, Linear and DecodeLayer, are in kernels.h).
//
// The CPU's analogue of replaying a CUDA graph. Op by op, a decode step of SmolLM2 makes ~20 calls from
// Python per layer (linears, norms, rotary, the K/V store, attention, views), each paying the interpreter and
// the dispatcher; at batch 1 that was a third of the step. `decode_layers` runs the same kernels, in the same
// order, on the same tensors, from C++: the result is bit for bit the layer-by-layer forward's
// (tests/test_kernels.py checks it), and Python is left with the embedding and the LM head.
// `nanoengine/models/fused_decode.py` builds its arguments once.
#include "kernels.h"
#include "simd.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <chrono>
#include <cstring>
#include <vector>

namespace nanoengine {
namespace {

// RMSNorm of per-head rows as nanoengine.layers.norm.RMSNorm runs it: the kernel on contiguous rows, else
// the eager ops (weight * rms_norm(x in float32), cast back)
at::Tensor head_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (x.is_contiguous()) return rms_norm(x, c10::nullopt, weight, eps)[0];
  return at::mul(weight, at::rms_norm(x.to(at::kFloat), {x.size(-1)}, c10::nullopt, eps).to(x.scalar_type()));
}

// k, v [B, kv_heads, D] (rows of D contiguous, any other strides) into the caches at their slots (-1: skip),
// the rows write_kv stores: copied as they are, or float32 rounded to a bf16 cache (kv_cache_dtype="bfloat16",
// to nearest even, as the torch backend's store rounds)
void store_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const int64_t* slots) {
  const bool rounded = k.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k.scalar_type() == v.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k.scalar_type() == k_cache.scalar_type() || rounded),
              "decode_layers: K/V rows and caches of one dtype (or float32 rows and bfloat16 caches)");
  const int64_t B = k.size(0), H = k.size(1), D = k.size(2);
  const int64_t rows_per_head = k_cache.size(1) * k_cache.size(2), row_bytes = D * k.element_size();
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t es = k.element_size(), cache_es = k_cache.element_size();
  for (int64_t t = 0; t < B; ++t) {
    if (slots[t] < 0) continue;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t row = (h * rows_per_head + slots[t]) * D * cache_es;
      const char* ks = kp + (t * k.stride(0) + h * k.stride(1)) * es;
      const char* vs = vp + (t * v.stride(0) + h * v.stride(1)) * es;
      if (rounded) {
        const float* kf = reinterpret_cast<const float*>(ks);
        const float* vf = reinterpret_cast<const float*>(vs);
        auto* kb = reinterpret_cast<c10::BFloat16*>(kc + row);
        auto* vb = reinterpret_cast<c10::BFloat16*>(vc + row);
        for (int64_t d = 0; d < D; ++d) {
          kb[d] = round_to<c10::BFloat16>(kf[d]);
          vb[d] = round_to<c10::BFloat16>(vf[d]);
        }
      } else {
        std::memcpy(kc + row, ks, row_bytes);
        std::memcpy(vc + row, vs, row_bytes);
      }
    }
  }
}

using Clock = std::chrono::steady_clock;
inline double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

}  // namespace

namespace {
// torch's own op for prepacked weights (the one layers.linear calls from Python), found at its first use
at::Tensor linear_pointwise(const at::Tensor& x, const at::Tensor& packed) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                            c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  return op.call(x, packed, c10::nullopt, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
}
}  // namespace

at::Tensor onednn_bf16_linear(const at::Tensor& x, const at::Tensor& onednn, const c10::optional<at::Tensor>& bias) {
  const auto xb = x.to(at::kBFloat16);  // [M, K]
  // a plain bf16 weight where this torch has no oneDNN bf16 (the same products: at::linear calls oneDNN too)
  auto y = (onednn.is_mkldnn() ? linear_pointwise(xb, onednn) : at::linear(xb, onednn)).to(at::kFloat);  // [M, N]
  return bias ? y.add_(*bias) : y;
}

// x [B, hidden]: the embeddings of one decode step's tokens (one per sequence) -> the final norm's output.
// times: float64 [2] or empty; when given, seconds in the linears and in attention (store + decode) are added.
at::Tensor decode_layers(const at::Tensor& x_in, const at::Tensor& positions, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& context_lens,
                         const std::vector<DecodeLayer>& layers, const at::Tensor& final_norm,
                         const at::Tensor& cos_table, const at::Tensor& sin_table, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, double eps, double scale, at::Tensor times) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.is_contiguous(), "decode_layers: contiguous x [B, hidden]");
  TORCH_CHECK(positions.size(0) == x_in.size(0) && slot_mapping.size(0) == x_in.size(0) &&
                  block_tables.size(0) == x_in.size(0) && context_lens.size(0) == x_in.size(0),
              "decode_layers: one position, slot, block table and context length per token");
  const bool timed = times.defined() && times.numel() == 2;
  double linear_s = 0, attention_s = 0;
  const int64_t B = x_in.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  auto linear = [&](const Linear& lin, const at::Tensor& x) {
    if (!timed) return lin(x);
    const auto t0 = Clock::now();
    auto y = lin(x);
    linear_s += since(t0);
    return y;
  };
  at::Tensor x = x_in, residual;
  for (size_t i = 0; i < layers.size(); ++i) {
    const DecodeLayer& L = layers[i];
    at::Tensor h;
    if (i == 0) {
      residual = x;
      h = rms_norm(x, c10::nullopt, L.input_norm, eps)[0];
    } else {
      auto r = rms_norm(x, residual, L.input_norm, eps);
      h = r[0];
      residual = r[1];
    }
    auto qkv = linear(L.qkv, h);  // [B, q_size + 2 * kv_size]
    auto q = qkv.narrow(1, 0, q_size).view({B, num_heads, head_dim});
    auto k = qkv.narrow(1, q_size, kv_size).view({B, num_kv_heads, head_dim});
    auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({B, num_kv_heads, head_dim});
    if (L.q_norm) {
      q = head_norm(q, *L.q_norm, eps);
      k = head_norm(k, *L.k_norm, eps);
    }
    q = rotary(q, positions, cos_table, sin_table);
    k = rotary(k, positions, cos_table, sin_table);
    const auto t0 = Clock::now();
    store_kv(k, v, L.k_cache, L.v_cache, slot);
    auto attn = paged_decode(q, L.k_cache, L.v_cache, block_tables, context_lens, scale);  // [B, H, D]
    if (timed) attention_s += since(t0);
    auto o = linear(L.o, attn.view({B, q_size}));
    auto r = rms_norm(o, residual, L.post_norm, eps);
    residual = r[1];
    auto gate_up = linear(L.gate_up, r[0]);  // [B, 2 * intermediate]
    x = linear(L.down, silu_and_mul(gate_up));
  }
  auto out = rms_norm(x, residual, final_norm, eps)[0];
  if (timed) {
    times[0] += linear_s;
    times[1] += attention_s;
  }
  return out;
}

}  // namespace nanoengine
