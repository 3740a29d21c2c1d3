// nanoengine's CPU kernels, family 3 (chapter 06): the small-batch linear with bfloat16 weights, `bf16_pack`
// and `bf16_linear` (for decode steps: `layers.linear.use_bf16_weights`).
//
// y[M, N] = x[M, K] @ W[N, K]^T (+ bias). A decode step multiplies a few rows (M = the batch) by every weight
// matrix, so its time is the time to stream the weights from memory: half the bytes is twice the speed. The
// weights are kept in bfloat16 and widened to float32 in registers (exact: a bf16 value is the top half of a
// float32), the sums are float32. For a bf16 checkpoint run in float32 the result is the float32 linear's
// (up to the order of the sums).
//
// Layout: `bf16_pack` lays W out once as [ceil(N / 8), K, 8]: blocks of 8 weight rows, and in a block, for
// each input column k, the 8 rows' weights side by side (one register once widened). Then
// - a block is one sequential stream, read front to back and prefetched 2 KiB ahead (1 KiB was slower).
//   Read row by row from the plain [N, K] layout, the same sums streamed the weights markedly slower; packed,
//   about as fast as a plain float32 sum reads memory;
// - 8 outputs are one register: out[m, block] += x[m, k] (broadcast) * W[block, k], with no horizontal sums.
// Work: groups of 4 blocks split over the threads; each block is read from memory once and multiplied with
// every row of x (x stays in the cache). One row of x: four chains of sums over k (FMA latency), added at the
// end. More rows: register tiles with 8-12 sums each (linear_tiles.h `few_rows`: 2 rows x 4 blocks, 3-6 rows
// x 2 blocks), the rows split into as few tiles as that allows, each a pass over the group (which then sits
// in the cache). A step of 5 rows then costs the FMAs of 5 rows and little more than one pass over the
// weights, and at 32-512 rows the kernel ran at ~80 G multiply-adds/s on 2 AVX2 cores, faster than float32
// GEMM on the same shapes (SmolLM2's linears, AMD EPYC: 42 against 76 ms at 32 rows, 330 against 418 at
// 256). Tried and dropped: widening blocks to float32 once from 16 rows on (slower than the tiles at 16-32
// rows), and pairs of bf16 columns interleaved so that one shift or mask widens each (slower at 1 and 6+ rows).
#include "kernels.h"
#include "linear_tiles.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>

namespace nanoengine {
namespace {

constexpr int64_t kPrefetchBytes = 2048;  // how far ahead of its reads a block's stream is prefetched
constexpr int64_t kGroup = 4;  // consecutive blocks a thread multiplies at a time

#ifdef NANOENGINE_AVX2
// one row of x against one block (w: K * 8 bf16), streamed once with prefetch; 4 chains over k
template <typename out_t>
inline void block_1row(const float* x, int64_t K, const c10::BFloat16* w, const float* bias, int64_t n0,
                       int64_t N, out_t* out) {
  const char* pf = reinterpret_cast<const char*>(w) + kPrefetchBytes;
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {  // 4 columns = 64 bytes of the block: one cache line
    _mm_prefetch(pf + k * kRows * 2, _MM_HINT_T0);
    for (int j = 0; j < 4; ++j)
      acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(x[k + j]), load_bf16x8(w + (k + j) * kRows), acc[j]);
  }
  for (; k < K; ++k) acc[0] = _mm256_fmadd_ps(_mm256_set1_ps(x[k]), load_bf16x8(w + k * kRows), acc[0]);
  alignas(32) float sums[kRows];
  _mm256_store_ps(sums, _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  store_row(sums, bias, n0, N, out);
}

#endif

// Blocks [b, b + nb) (nb <= kGroup; w: their nb * K * 8 bf16) against all M rows of x.
template <typename out_t>
void gemv_blocks(const float* x, int64_t M, int64_t K, const c10::BFloat16* w, int64_t nb, const float* bias,
                 int64_t n0, int64_t N, out_t* out) {
#ifdef NANOENGINE_AVX2
  if (M == 1) {
    for (int64_t b = 0; b < nb; ++b) block_1row(x, K, w + b * K * kRows, bias, n0 + b * kRows, N, out);
  } else {
    few_rows(x, M, K, w, nb, bias, n0, N, out);
  }
  return;
#endif
  float sums[kRows];
  for (int64_t b = 0; b < nb; ++b)  // plain loops: a CPU without AVX2
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t r = 0; r < kRows; ++r) {
        sums[r] = 0.f;
        for (int64_t k = 0; k < K; ++k) sums[r] += x[m * K + k] * to_float(w[(b * K + k) * kRows + r]);
      }
      store_row(sums, bias, n0 + b * kRows, N, out + m * N);
    }
}

}  // namespace

// weight [N, K] -> the packed bf16 layout above, [ceil(N / 8), K, 8] (zero rows pad N to a multiple of 8)
at::Tensor bf16_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "bf16_pack: a weight [N, K], got ", weight.dim(), " dimensions");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t blocks = (N + kRows - 1) / kRows;
  auto padded = at::constant_pad_nd(weight.to(at::kBFloat16), {0, 0, 0, blocks * kRows - N});
  return padded.view({blocks, kRows, K}).transpose(1, 2).contiguous();  // [blocks, K, 8]
}

// x [M, K] float32 or bfloat16, packed weight (bf16_pack of a [N, K] weight), bias [N] or None -> [M, N] in x's dtype.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "bf16_linear: CPU tensors only");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(2) == kRows,
              "bf16_linear: a bf16 weight packed by bf16_pack");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == packed.size(1), "bf16_linear: x [M, K] and a weight with the same K");
  const int64_t blocks = packed.size(0);
  TORCH_CHECK(N > (blocks - 1) * kRows && N <= blocks * kRows,
              "bf16_linear: N = ", N, " does not match the packed weight's ", blocks, " blocks");
  const int64_t M = x.size(0), K = x.size(1);
  const FloatInputs in = float_inputs("bf16_linear", x, bias);
  auto out = at::empty({M, N}, x.options());
  const float* xp = in.x_ptr();
  const float* bp = in.bias_ptr();
  const c10::BFloat16* wp = packed.data_ptr<c10::BFloat16>();
  const int64_t groups = (blocks + kGroup - 1) / kGroup;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "bf16_linear", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, groups, 2, [&](int64_t begin, int64_t end) {  // each thread streams its share of W
      for (int64_t g = begin; g < end; ++g) {
        const int64_t b = kGroup * g, nb = std::min<int64_t>(kGroup, blocks - b);
        gemv_blocks<scalar_t>(xp, M, K, wp + b * K * kRows, nb, bp, b * kRows, N, op);
      }
    });
  });
  return out;
}

}  // namespace nanoengine
