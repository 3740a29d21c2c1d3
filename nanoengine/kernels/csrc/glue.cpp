// nanoengine's CPU kernels, family 2 (chapter 06): the fused glue between the matmuls, `rms_norm`, `rotary`
// and `silu_and_mul`.
//
// Between the matmuls a decoder layer runs ~40 small PyTorch ops (residual add, RMSNorm in float32, rotary,
// SiLU * up); at small batch each costs more in dispatch than in arithmetic. Each kernel below does one of
// those steps in one pass over the rows, rounding to the activation dtype exactly where the eager ops (and
// transformers) round, so its output equals the eager path's.
#include "kernels.h"
#include "simd.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace nanoengine {
namespace {

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

}  // namespace

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

}  // namespace nanoengine
