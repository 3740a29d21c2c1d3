// nanoengine's CPU kernels (chapter 06): the register tiles the small-batch linears share (bf16_linear.cpp,
// int8_linear.cpp). Weights in blocks of kRows = 8 rows laid out [K, 8] (for each input column k, the 8 rows'
// weights side by side: one register of outputs); a tile multiplies kM rows of x by kB consecutive blocks,
// kM x kB sums in registers, reading the weights as bf16 (widened in registers) or float32.
#pragma once

#include "simd.h"

#include <ATen/ATen.h>

namespace nanoengine {

// x [M, K] (float32 or bfloat16) and bias [N] (or none) as the kernels read them: contiguous float32 (a copy
// only for bf16 ones: a few rows)
struct FloatInputs {
  at::Tensor x, bias;
  const float* x_ptr() const { return x.data_ptr<float>(); }
  const float* bias_ptr() const { return bias.defined() ? bias.data_ptr<float>() : nullptr; }
};

inline FloatInputs float_inputs(const char* kernel, const at::Tensor& x, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, kernel,
              ": float32 or bfloat16 x, got ", x.scalar_type());
  return {x.to(at::kFloat).contiguous(), bias ? bias->to(at::kFloat).contiguous() : at::Tensor()};
}

constexpr int64_t kRows = 8;  // weight rows per block (one register of outputs)

// out[m, n0 + r] = sums[r] + bias (rows past N are padding: skipped)
template <typename out_t>
inline void store_row(const float* sums, const float* bias, int64_t n0, int64_t N, out_t* out_row) {
  for (int64_t r = 0; r < kRows && n0 + r < N; ++r)
    out_row[n0 + r] = static_cast<out_t>(sums[r] + (bias ? bias[n0 + r] : 0.f));
}

#ifdef NANOENGINE_AVX2
// kM rows of x (from m0) against kB consecutive blocks (w: kB * K * 8, bf16 or widened float)
template <int kM, int kB, typename W_t, typename out_t>
inline void tile(const float* x, int64_t m0, int64_t K, const W_t* w, const float* bias, int64_t n0, int64_t N,
                 out_t* out) {
  // (the unroll pragmas let the compiler keep acc in registers: without them GCC kept it on the stack)
  __m256 acc[kM][kB];
#pragma GCC unroll 16
  for (int m = 0; m < kM; ++m)
#pragma GCC unroll 4
    for (int b = 0; b < kB; ++b) acc[m][b] = _mm256_setzero_ps();
  const float* xr = x + m0 * K;
  for (int64_t k = 0; k < K; ++k) {
    __m256 wv[kB];
#pragma GCC unroll 4
    for (int b = 0; b < kB; ++b) wv[b] = load8(w + (b * K + k) * kRows);
#pragma GCC unroll 16
    for (int m = 0; m < kM; ++m) {
      const __m256 xb = _mm256_broadcast_ss(xr + m * K + k);
#pragma GCC unroll 4
      for (int b = 0; b < kB; ++b) acc[m][b] = _mm256_fmadd_ps(xb, wv[b], acc[m][b]);
    }
  }
  alignas(32) float sums[kM][kB][kRows];
#pragma GCC unroll 16
  for (int m = 0; m < kM; ++m)
#pragma GCC unroll 4
    for (int b = 0; b < kB; ++b) _mm256_store_ps(sums[m][b], acc[m][b]);
  for (int m = 0; m < kM; ++m)
    for (int b = 0; b < kB; ++b) store_row(sums[m][b], bias, n0 + b * kRows, N, out + (m0 + m) * N);
}


// kM rows of x (from m0) against the nb blocks of w: kB blocks per tile, then one at a time
template <int kM, int kB, typename W_t, typename out_t>
inline void tile_blocks(const float* x, int64_t m0, int64_t K, const W_t* w, int64_t nb, const float* bias,
                        int64_t n0, int64_t N, out_t* out) {
  int64_t b = 0;
  for (; b + kB <= nb; b += kB) tile<kM, kB>(x, m0, K, w + b * K * kRows, bias, n0 + b * kRows, N, out);
  for (; b < nb; ++b) tile<kM, 1>(x, m0, K, w + b * K * kRows, bias, n0 + b * kRows, N, out);
}

// Every row of x against nb consecutive blocks, in register tiles that keep 8-12 independent sums (FMA
// latency x throughput: 8 in flight keep both FMA units busy): 1 or 2 rows x 4 blocks, 3 to 6 rows x 2
// blocks. The rows are split into as few tiles of <= 6 rows as can be, as even as can be (7 = 4 + 3,
// 32 = 6 + 6 + 5 + 5 + 5 + 5), each a pass over the blocks (which then sit in the cache). (2 rows x 2
// blocks, 4 sums, ran at half the speed; 1-row tiles left over after 6-row ones at a third.)
template <typename W_t, typename out_t>
inline void few_rows(const float* x, int64_t M, int64_t K, const W_t* w, int64_t nb, const float* bias,
                     int64_t n0, int64_t N, out_t* out) {
  for (int64_t m = 0; m < M;) {
    const int64_t left = M - m, passes = (left + 5) / 6;
    const int64_t rows = (left + passes - 1) / passes;  // the rest in tiles of <= 6 rows, as even as can be
    switch (rows) {
      case 1: tile_blocks<1, 4>(x, m, K, w, nb, bias, n0, N, out); break;
      case 2: tile_blocks<2, 4>(x, m, K, w, nb, bias, n0, N, out); break;
      case 3: tile_blocks<3, 2>(x, m, K, w, nb, bias, n0, N, out); break;
      case 4: tile_blocks<4, 2>(x, m, K, w, nb, bias, n0, N, out); break;
      case 5: tile_blocks<5, 2>(x, m, K, w, nb, bias, n0, N, out); break;
      default: tile_blocks<6, 2>(x, m, K, w, nb, bias, n0, N, out); break;
    }
    m += rows;
  }
}
#endif

}  // namespace nanoengine
