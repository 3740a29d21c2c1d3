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
//
// Where the build has AVX-512, `bf16_pack` lays W out in pairs instead: [ceil(N / 16), ceil(K / 2), 16, 2]:
// blocks of 16 rows, and for each pair of input columns (k, k + 1) the 16 rows' two weights side by side
// (64 bytes: one cache line, one register). Two paths read it:
// - "avx512bf16" (AVX512-BF16): `vdpbf16ps` multiplies the 16 rows' bf16 pairs by the pair (x[k], x[k+1]) and
//   adds both products into float32 sums, with no widening. It multiplies bf16 by bf16, so a float32 x is
//   split first into two bf16 parts, x = hi + lo (hi = bf16(x), lo = bf16(x - hi)), each multiplied: what
//   that leaves out of x is under 2^-16 of |x| (relative), against float32's 2^-24; a bf16 x is one part,
//   exact. The instruction rounds its sums to nearest even and flushes denormals (bf16 weights of a model
//   have none that matter).
// - "avx512" (AVX-512 F without BF16): each pair widened to float32 by one shift and one mask, then two FMAs
//   of 16 lanes: the float32 linear up to the order of the sums.
// `path` picks the code: "auto" (the widening paths: see best_path for why), or one of "avx512bf16",
// "avx512" (pairs layout), "avx2" ([blocks, K, 8] layout), "plain" (either layout), so one machine tests
// every path it can run (tests/test_kernels.py).
#include "kernels.h"
#include "linear_tiles.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <string>

namespace nanoengine {
namespace {

constexpr int64_t kPrefetchBytes = 2048;  // how far ahead of its reads a block's stream is prefetched
constexpr int64_t kGroup = 4;  // consecutive blocks a thread multiplies at a time
constexpr int64_t kRows16 = 16;  // weight rows per block of the pairs layout (bf16_pairs.cpp)

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
                 int64_t n0, int64_t N, out_t* out, bool plain) {
#ifdef NANOENGINE_AVX2
  if (!plain && M == 1) {
    for (int64_t b = 0; b < nb; ++b) block_1row(x, K, w + b * K * kRows, bias, n0 + b * kRows, N, out);
    return;
  }
  if (!plain) {
    few_rows(x, M, K, w, nb, bias, n0, N, out);
    return;
  }
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

// The paths: which layout a path reads, and the best of each this build has.
bool pairs_path(const std::string& path) { return path == "avx512bf16" || path == "avx512"; }

// "auto" never picks "avx512bf16": on a Xeon with AVX512-BF16 (Emerald Rapids, 1 thread, SmolLM2's four
// linears of a layer) `vdpbf16ps` ran at a third of the FMAs' rate: 0.17 / 0.76 / 3.9 ms at 1 / 8 / 32 rows
// against the widening path's 0.12 / 0.43 / 0.92 (and 0.21 / 0.67 / 1.6 for AVX2's 8 lanes); with a bf16 x
// (one part) 1.5 against 0.95 ms at 32 rows. It runs where asked (path="avx512bf16").
bool has_bf16_dot() {
#ifdef NANOENGINE_AVX512BF16
  return true;
#else
  return false;
#endif
}

std::string best_path(bool pairs) {
#ifdef NANOENGINE_AVX512
  if (pairs) return "avx512";
#endif
#ifdef NANOENGINE_AVX2
  if (!pairs) return "avx2";
#endif
  return "plain";
}

void check_path(const std::string& path, bool pairs) {
  TORCH_CHECK(path == "auto" || path == "avx512bf16" || path == "avx512" || path == "avx2" || path == "plain",
              "bf16: path must be 'auto', 'avx512bf16', 'avx512', 'avx2' or 'plain', got '", path, "'");
  if (path == "auto" || path == "plain") return;
  TORCH_CHECK(pairs_path(path) == pairs, "bf16_linear: path '", path, "' reads the ",
              pairs_path(path) ? "pairs" : "[blocks, K, 8]", " layout: pack the weight with bf16_pack(weight, '",
              path, "')");
  const std::string best = best_path(pairs);
  const bool built = path == best || (path == "avx512bf16" && best == "avx512" && has_bf16_dot());
  TORCH_CHECK(built, "bf16_linear: path '", path, "' is not in this build (built for this CPU's '", best,
              has_bf16_dot() ? "' and 'avx512bf16" : "", "'): use path='auto'");
}

}  // namespace

std::string bf16_best_path() { return best_path(best_path(true) != "plain"); }

// weight [N, K] -> the packed bf16 layout of `path` (see above): pairs [ceil(N / 16), ceil(K / 2), 16, 2]
// for "avx512bf16" / "avx512" ("auto" where the build has AVX-512), else [ceil(N / 8), K, 8]; zero rows
// (and a zero column) pad.
at::Tensor bf16_pack(const at::Tensor& weight, const std::string& path) {
  TORCH_CHECK(weight.dim() == 2, "bf16_pack: a weight [N, K], got ", weight.dim(), " dimensions");
  const bool pairs = path == "auto" ? best_path(true) != "plain" : pairs_path(path);
  check_path(path, pairs);
  const int64_t N = weight.size(0), K = weight.size(1);
  if (pairs) {
    const int64_t blocks = (N + kRows16 - 1) / kRows16, K2 = (K + 1) / 2;
    auto padded = at::constant_pad_nd(weight.to(at::kBFloat16), {0, 2 * K2 - K, 0, blocks * kRows16 - N});
    return padded.view({blocks, kRows16, K2, 2}).transpose(1, 2).contiguous();  // [blocks, K2, 16, 2]
  }
  const int64_t blocks = (N + kRows - 1) / kRows;
  auto padded = at::constant_pad_nd(weight.to(at::kBFloat16), {0, 0, 0, blocks * kRows - N});
  return padded.view({blocks, kRows, K}).transpose(1, 2).contiguous();  // [blocks, K, 8]
}

// x [M, K] float32 or bfloat16, packed weight (bf16_pack of a [N, K] weight), bias [N] or None -> [M, N] in
// x's dtype.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t N, const std::string& path) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "bf16_linear: CPU tensors only");
  const bool pairs = packed.dim() == 4;
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  ((packed.dim() == 3 && packed.size(2) == kRows) ||
                   (pairs && packed.size(2) == kRows16 && packed.size(3) == 2)),
              "bf16_linear: a bf16 weight packed by bf16_pack");
  const int64_t K_packed = pairs ? 2 * packed.size(1) : packed.size(1);
  TORCH_CHECK(x.dim() == 2 && (x.size(1) == K_packed || (pairs && x.size(1) == K_packed - 1)),
              "bf16_linear: x [M, K] and a weight with the same K");
  const int64_t rows_per_block = pairs ? kRows16 : kRows;
  const int64_t blocks = packed.size(0);
  TORCH_CHECK(N > (blocks - 1) * rows_per_block && N <= blocks * rows_per_block,
              "bf16_linear: N = ", N, " does not match the packed weight's ", blocks, " blocks");
  check_path(path, pairs);
  if (pairs) return bf16_pairs_linear(x, packed, bias, N, path == "auto" ? best_path(true) : path);
  const int64_t M = x.size(0), K = x.size(1);
  const FloatInputs in = float_inputs("bf16_linear", x, bias);
  auto out = at::empty({M, N}, x.options());
  const float* xp = in.x_ptr();
  const float* bp = in.bias_ptr();
  const c10::BFloat16* wp = packed.data_ptr<c10::BFloat16>();
  const int64_t groups = (blocks + kGroup - 1) / kGroup;
  const bool plain = path == "plain";
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "bf16_linear", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, groups, 2, [&](int64_t begin, int64_t end) {  // each thread streams its share of W
      for (int64_t g = begin; g < end; ++g) {
        const int64_t b = kGroup * g, nb = std::min<int64_t>(kGroup, blocks - b);
        gemv_blocks<scalar_t>(xp, M, K, wp + b * K * kRows, nb, bp, b * kRows, N, op, plain);
      }
    });
  });
  return out;
}

}  // namespace nanoengine
