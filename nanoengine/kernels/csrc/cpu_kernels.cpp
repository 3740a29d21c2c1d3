// nanoengine's CPU kernels (chapter 06), built once by nanoengine/attention/cpu_backend.py.
//
// 1. Paged decode attention: one query token per sequence, K/V read in place from the block pool. The torch backend gathers every sequence's blocks into a padded copy and then runs two
// batched matmuls, so it moves the K/V bytes three times; this kernel reads each K/V row once, straight
// from its block, and keeps scores and the output accumulator in float32.
//
// Layout (the torch backend's, heads first): k_cache, v_cache [num_kv_heads, num_blocks, block_size, head_dim].
// q [B, num_heads, head_dim]; block_tables [B, max_blocks] int64; context_lens [B] int64 (incl. the new token).
// Work is split over (sequence, kv head) pairs; each pair serves its `group` query heads (GQA).
#include <torch/extension.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
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
      if (L == 0) {  // no context (a CUDA-graph padding row): reads nothing, writes zeros
        for (int64_t i = 0; i < group * D; ++i) op[(b * num_heads + h * group) * D + i] = static_cast<scalar_t>(0.f);
        continue;
      }
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

// 2. Fused glue. Between the matmuls a decoder layer runs ~40 small PyTorch ops (residual add, RMSNorm in
// float32, rotary, SiLU * up); at small batch each costs more in dispatch than in arithmetic. Each kernel
// below does one of those steps in one pass over the rows, rounding to the activation dtype exactly where
// the eager ops (and transformers) round, so its output equals the eager path's.

template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }  // float -> T (bf16: round to nearest even)

template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, const scalar_t* residual, const scalar_t* weight, scalar_t* out,
                   scalar_t* residual_out, int64_t rows, int64_t dim, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> r(dim);
    for (int64_t i = begin; i < end; ++i) {
      const scalar_t* xi = x + i * dim;
      float sum_sq = 0.f;
      for (int64_t d = 0; d < dim; ++d) {
        // residual stream: x + residual, rounded to the activation dtype as the eager add does
        const scalar_t sum = residual ? round_to<scalar_t>(to_float(xi[d]) + to_float(residual[i * dim + d])) : xi[d];
        if (residual_out) residual_out[i * dim + d] = sum;
        r[d] = to_float(sum);
        sum_sq += r[d] * r[d];
      }
      const float inv = 1.f / std::sqrt(sum_sq / dim + static_cast<float>(eps));
      for (int64_t d = 0; d < dim; ++d)  // normalize in float32, round, then scale by the weight and round
        out[i * dim + d] = round_to<scalar_t>(to_float(weight[d]) * to_float(round_to<scalar_t>(r[d] * inv)));
    }
  });
}

std::vector<at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                 const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && x.scalar_type() == weight.scalar_type(),
              "rms_norm: contiguous x and weight of one dtype");
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  auto out = at::empty_like(x);
  at::Tensor res_out;
  if (residual) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes(), "rms_norm: residual like x");
    res_out = at::empty_like(x);
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), residual ? residual->data_ptr<scalar_t>() : nullptr,
                            weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            residual ? res_out.data_ptr<scalar_t>() : nullptr, rows, dim, eps);
  });
  if (residual) return {out, res_out};
  return {out};
}

// Rotary embedding ("rotate half"): y = x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1];
// sin_table is stored signed ([-sin, sin]) so y[d] = x[d] * cos[d] + x[(d + D/2) % D] * sin[d].
// x [T, heads, D] with any row stride (a view into the fused qkv output); returns a contiguous copy.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_table,
                  const at::Tensor& sin_table) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rotary: x [T, heads, D], rows of heads");
  TORCH_CHECK(cos_table.scalar_type() == at::kFloat && cos_table.is_contiguous() && sin_table.is_contiguous(),
              "rotary: float32 tables");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2, row_stride = x.stride(0);
  auto out = at::empty({T, H, D}, x.options());
  auto pos = positions.to(at::kLong).contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  const float* ct = cos_table.data_ptr<float>();
  const float* st = sin_table.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rotary", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* c = ct + p[t] * D;
        const float* s = st + p[t] * D;
        for (int64_t h = 0; h < H; ++h) {
          const scalar_t* xi = xp + t * row_stride + h * D;
          scalar_t* oi = op + (t * H + h) * D;
          // as the eager ops round: cos/sin to dtype, each product, the sum; the partner of d is d + D/2
          // in the first half and d - D/2 in the second (two loops, so both vectorize)
          auto rot = [&](int64_t d, int64_t partner) {
            const float a = to_float(round_to<scalar_t>(to_float(xi[d]) * to_float(round_to<scalar_t>(c[d]))));
            const float b = to_float(round_to<scalar_t>(to_float(xi[partner]) * to_float(round_to<scalar_t>(s[d]))));
            oi[d] = round_to<scalar_t>(a + b);
          };
          for (int64_t d = 0; d < half; ++d) rot(d, d + half);
          for (int64_t d = half; d < D; ++d) rot(d, d - half);
        }
      }
    });
  });
  return out;
}

// SwiGLU on the fused gate_up output: silu(gate) * up, rounding after the SiLU as the eager ops do.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.dim() == 2, "silu_and_mul: contiguous [T, 2 * I]");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = at::empty({T, I}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* g = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t i = 0; i < I; ++i) {
          const float a = to_float(g[t * 2 * I + i]);
          const float silu = to_float(round_to<scalar_t>(a / (1.f + std::exp(-a))));
          o[t * I + i] = round_to<scalar_t>(silu * to_float(g[t * 2 * I + I + i]));
        }
    });
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention on CPU (reads K/V in place)");
  m.def("rms_norm", &rms_norm, "(residual +) RMSNorm: returns [normed] or [normed, residual sum]");
  m.def("rotary", &rotary, "rotary embedding of [T, heads, D] rows (a copy)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
}
