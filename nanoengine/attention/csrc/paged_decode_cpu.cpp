// Paged decode attention on CPU: one query token per sequence, K/V read in place from the block pool.
// Chapter 06. The torch backend gathers every sequence's blocks into a padded copy and then runs two
// batched matmuls, so it moves the K/V bytes three times; this kernel reads each K/V row once, straight
// from its block, and keeps scores and the output accumulator in float32.
//
// Layout (the torch backend's, heads first): k_cache, v_cache [num_kv_heads, num_blocks, block_size, head_dim].
// q [B, num_heads, head_dim]; block_tables [B, max_blocks] int64; context_lens [B] int64 (incl. the new token).
// Work is split over (sequence, kv head) pairs; each pair serves its `group` query heads (GQA).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;  // bf16 is the top half of a float32
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename scalar_t, int kD>  // kD: head_dim known at compile time (0 = read it at run time)
void decode_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), num_heads = q.size(1), D = kD ? kD : q.size(2);
  const int64_t kvh = k_cache.size(0), num_blocks = k_cache.size(1), bs = k_cache.size(2);
  const int64_t group = num_heads / kvh, max_blocks = block_tables.size(1);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, B * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * D), row(D), acc(group * D), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kvh, h = task % kvh, L = lens[b];
      const int64_t* table = tables + b * max_blocks;
      for (int64_t g = 0; g < group; ++g)  // the group's query heads, pre-scaled, in float32
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = to_float(qp[(b * num_heads + h * group + g) * D + d]) * fscale;
      scores.assign(group * L, 0.f);
      const scalar_t* k_head = kp + h * num_blocks * bs * D;
      const scalar_t* v_head = vp + h * num_blocks * bs * D;
      // pass 1: scores[g, l] = q_g . k_l, reading each K row once
      for (int64_t l = 0; l < L; ++l) {
        const scalar_t* k_row = k_head + (table[l / bs] * bs + l % bs) * D;
        for (int64_t d = 0; d < D; ++d) row[d] = to_float(k_row[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * D;
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qg[d] * row[d];
          scores[g * L + l] = s;
        }
      }
      // softmax over the context, per query head
      std::vector<float> inv_sum(group);
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * L;
        float m = s[0];  // no infinities: the kernel is built with -ffast-math (vectorized exp and sums)
        for (int64_t l = 1; l < L; ++l) m = std::max(m, s[l]);
        float sum = 0.f;
        for (int64_t l = 0; l < L; ++l) { s[l] = std::exp(s[l] - m); sum += s[l]; }
        inv_sum[g] = 1.f / sum;
      }
      // pass 2: out_g = sum_l p[g, l] v_l, reading each V row once
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t l = 0; l < L; ++l) {
        const scalar_t* v_row = v_head + (table[l / bs] * bs + l % bs) * D;
        for (int64_t d = 0; d < D; ++d) row[d] = to_float(v_row[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * L + l];
          float* a = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * row[d];
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < D; ++d)
          op[(b * num_heads + h * group + g) * D + d] = static_cast<scalar_t>(acc[g * D + d] * inv_sum[g]);
    }
  });
}

}  // namespace

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_decode: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "paged_decode: q [B, H, D], cache [kvh, blocks, bs, D]");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "paged_decode: q and the caches must share a dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "paged_decode: num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: caches must be contiguous");
  auto qc = q.contiguous();
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens = context_lens.to(at::kLong).contiguous();
  auto out = at::empty_like(qc);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
              "paged_decode: bfloat16 or float32 only, got ", q.scalar_type());
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  switch (q.size(2)) {  // common head sizes get fully unrolled inner loops
#define NANOENGINE_CASE(HD)                                                                   \
    case HD:                                                                                  \
      if (bf16) decode_kernel<c10::BFloat16, HD>(qc, k_cache, v_cache, tables, lens, scale, out); \
      else decode_kernel<float, HD>(qc, k_cache, v_cache, tables, lens, scale, out);         \
      break;
    NANOENGINE_CASE(64)
    NANOENGINE_CASE(128)
#undef NANOENGINE_CASE
    default:
      if (bf16) decode_kernel<c10::BFloat16, 0>(qc, k_cache, v_cache, tables, lens, scale, out);
      else decode_kernel<float, 0>(qc, k_cache, v_cache, tables, lens, scale, out);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention on CPU (reads K/V in place)");
}
