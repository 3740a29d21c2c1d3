// nanoengine's CPU kernels, family 5 (chapter 08): the small-batch linear with int8 weights, `int8_pack` and
// `int8_linear` (for decode steps with quantization="int8": `layers.quant.quantize_weights`).
//
// y[M, N] = x[M, K] @ (q[N, K] * s)^T (+ bias): weight-only symmetric int8, q in [-127, 127], one float32
// scale s per output row and group of `group_size` input columns (the last group of a row may be shorter).
// A decode step streams every weight once, so its time is the weights' bytes over the memory's bandwidth:
// int8 is half of bf16's bytes (plus 4 / group_size bytes of scales). The int8 values are widened to float32
// in registers, the sums are float32; a group's sum is multiplied by its scale once, at the group's end.
//
// Layout: `int8_pack` lays q out once as [ceil(N / 16), K, 16]: blocks of 16 weight rows, and in a block, for
// each input column k, the 16 rows' weights side by side (16 bytes: 4 columns are one cache line), so a block
// is one sequential stream, prefetched ahead as bf16_linear's is; the scales as [ceil(N / 16), groups, 16].
// - one row of x (M = 1): a block's 16 outputs are one AVX-512 register (two AVX2 registers); per column,
//   x[k] (broadcast) * widen(q[block, k]) is added into the group's sums, 4 chains over k (FMA latency);
// - a few rows: the same, for up to 8 rows of x (AVX-512; AVX2: 6) per pass over the block (which then sits
//   in the cache), one chain per row (AVX2 at 2 rows: two columns at a time, 8 chains): a column's weights are
//   widened once for all of them, and the rows are split into as few passes as that allows (7 = 4 + 3);
// - AVX2 from 64 rows on: the block is first widened and scaled to float32 once, as two 8-row blocks of
//   bf16_linear's layout, and the float register tiles (linear_tiles.h `few_rows`) multiply every row of x by
//   it (measured on an AVX2 EPYC: the passes above were faster up to 32 rows, about even at 64-128; with
//   AVX-512 the passes stay faster up to 32 rows).
// A weight laid out by `w8a8_pack` (4 dimensions) is multiplied with int8 activations instead (w8a8_linear.cpp).
// `path` picks the code: "auto" (the widest this build has), "avx512", "avx2" (where the build has them) or
// "plain" (the loops a CPU without AVX2 runs), so that one machine tests every path (tests/test_kernels.py).
#include "kernels.h"
#include "linear_tiles.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <string>
#include <vector>

namespace nanoengine {
namespace {

constexpr int64_t kRows16 = 16;  // weight rows per int8 block: one AVX-512 register of outputs
constexpr int64_t kPrefetchBytes = 2048;  // how far ahead of its reads a block's stream is prefetched
constexpr int64_t kRowChunk = 8;  // rows of x that share one pass over a block (AVX-512; AVX2: 6)
constexpr int64_t kWidenRows = 64;  // AVX2: from this many rows of x on, a block is widened to float32 once

enum class Path { kPlain, kAvx2, kAvx512 };

Path pick_path(const std::string& path) {
#if defined(__AVX512F__) && defined(NANOENGINE_AVX2)
  const Path best = Path::kAvx512;
#elif defined(NANOENGINE_AVX2)
  const Path best = Path::kAvx2;
#else
  const Path best = Path::kPlain;
#endif
  if (path == "auto") return best;
  const Path want = path == "avx512" ? Path::kAvx512 : path == "avx2" ? Path::kAvx2 : Path::kPlain;
  TORCH_CHECK(path == "avx512" || path == "avx2" || path == "plain",
              "int8_linear: path must be 'auto', 'avx512', 'avx2' or 'plain', got '", path, "'");
  TORCH_CHECK(want <= best, "int8_linear: path '", path, "' is not in this build (built for this CPU's ",
              best == Path::kAvx2 ? "AVX2" : "plain loops", ")");
  return want;
}

// q: one block, K * 16 int8; s: its groups * 16 scales; sums: the 16 outputs (no bias yet)
void block_1row_plain(const float* x, int64_t K, int64_t G, const int8_t* q, const float* s, float* sums) {
  for (int64_t r = 0; r < kRows16; ++r) sums[r] = 0.f;
  for (int64_t g = 0, k0 = 0; k0 < K; ++g, k0 += G) {
    float part[kRows16] = {};
    for (int64_t k = k0; k < std::min(K, k0 + G); ++k)
      for (int64_t r = 0; r < kRows16; ++r) part[r] += x[k] * static_cast<float>(q[k * kRows16 + r]);
    for (int64_t r = 0; r < kRows16; ++r) sums[r] += part[r] * s[g * kRows16 + r];
  }
}

#ifdef NANOENGINE_AVX2
inline __m256 load_i8x8(const int8_t* p) {  // 8 int8 -> 8 float32 (exact)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

void block_1row_avx2(const float* x, int64_t K, int64_t G, const int8_t* q, const float* s, float* sums) {
  const char* pf = reinterpret_cast<const char*>(q) + kPrefetchBytes;
  __m256 total[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0, k0 = 0; k0 < K; ++g, k0 += G) {
    const int64_t end = std::min(K, k0 + G);
    __m256 acc[2][2] = {{_mm256_setzero_ps(), _mm256_setzero_ps()}, {_mm256_setzero_ps(), _mm256_setzero_ps()}};
    int64_t k = k0;
    for (; k + 2 <= end; k += 2) {  // chains: even and odd columns, low and high 8 rows
      if (k % 4 == 0) _mm_prefetch(pf + k * kRows16, _MM_HINT_T0);
      for (int j = 0; j < 2; ++j) {
        const __m256 xb = _mm256_set1_ps(x[k + j]);
        acc[j][0] = _mm256_fmadd_ps(xb, load_i8x8(q + (k + j) * kRows16), acc[j][0]);
        acc[j][1] = _mm256_fmadd_ps(xb, load_i8x8(q + (k + j) * kRows16 + 8), acc[j][1]);
      }
    }
    for (; k < end; ++k) {
      const __m256 xb = _mm256_set1_ps(x[k]);
      acc[0][0] = _mm256_fmadd_ps(xb, load_i8x8(q + k * kRows16), acc[0][0]);
      acc[0][1] = _mm256_fmadd_ps(xb, load_i8x8(q + k * kRows16 + 8), acc[0][1]);
    }
    for (int h = 0; h < 2; ++h)
      total[h] = _mm256_fmadd_ps(_mm256_add_ps(acc[0][h], acc[1][h]), _mm256_loadu_ps(s + g * kRows16 + 8 * h),
                                 total[h]);
  }
  _mm256_storeu_ps(sums, total[0]);
  _mm256_storeu_ps(sums + 8, total[1]);
}

// kM rows of x (row stride K) against one block: sums [kM, 16]. kJ columns at a time, each into sums of its
// own (kJ * kM * 2 chains: 8 or more keep both FMA units busy), added at the group's end and scaled.
template <int kM, int kJ>
void block_rows_avx2(const float* x, int64_t K, int64_t G, const int8_t* q, const float* s, float* sums) {
  __m256 total[kM][2];
#pragma GCC unroll 8
  for (int m = 0; m < kM; ++m) total[m][0] = total[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0, k0 = 0; k0 < K; ++g, k0 += G) {
    const int64_t end = std::min(K, k0 + G);
    __m256 acc[kJ][kM][2];
#pragma GCC unroll 4
    for (int j = 0; j < kJ; ++j)
#pragma GCC unroll 8
      for (int m = 0; m < kM; ++m) acc[j][m][0] = acc[j][m][1] = _mm256_setzero_ps();
    int64_t k = k0;
    for (; k + kJ <= end; k += kJ) {
#pragma GCC unroll 4
      for (int j = 0; j < kJ; ++j) {
        const __m256 lo = load_i8x8(q + (k + j) * kRows16), hi = load_i8x8(q + (k + j) * kRows16 + 8);
#pragma GCC unroll 8
        for (int m = 0; m < kM; ++m) {
          const __m256 xb = _mm256_broadcast_ss(x + m * K + k + j);
          acc[j][m][0] = _mm256_fmadd_ps(xb, lo, acc[j][m][0]);
          acc[j][m][1] = _mm256_fmadd_ps(xb, hi, acc[j][m][1]);
        }
      }
    }
    for (; k < end; ++k) {
      const __m256 lo = load_i8x8(q + k * kRows16), hi = load_i8x8(q + k * kRows16 + 8);
#pragma GCC unroll 8
      for (int m = 0; m < kM; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
        acc[0][m][0] = _mm256_fmadd_ps(xb, lo, acc[0][m][0]);
        acc[0][m][1] = _mm256_fmadd_ps(xb, hi, acc[0][m][1]);
      }
    }
    const __m256 s_lo = _mm256_loadu_ps(s + g * kRows16), s_hi = _mm256_loadu_ps(s + g * kRows16 + 8);
#pragma GCC unroll 8
    for (int m = 0; m < kM; ++m) {
      __m256 lo = acc[0][m][0], hi = acc[0][m][1];
#pragma GCC unroll 4
      for (int j = 1; j < kJ; ++j) lo = _mm256_add_ps(lo, acc[j][m][0]), hi = _mm256_add_ps(hi, acc[j][m][1]);
      total[m][0] = _mm256_fmadd_ps(lo, s_lo, total[m][0]);
      total[m][1] = _mm256_fmadd_ps(hi, s_hi, total[m][1]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < kM; ++m) {
    _mm256_storeu_ps(sums + m * kRows16, total[m][0]);
    _mm256_storeu_ps(sums + m * kRows16 + 8, total[m][1]);
  }
}

// the block widened and scaled to float32 as two 8-row blocks of bf16_linear's layout: wide [2, K, 8]
void widen_block(int64_t K, int64_t G, const int8_t* q, const float* s, float* wide) {
  const char* pf = reinterpret_cast<const char*>(q) + kPrefetchBytes;
  for (int64_t k = 0; k < K; ++k) {
    if (k % 4 == 0) _mm_prefetch(pf + k * kRows16, _MM_HINT_T0);
    const float* sk = s + (k / G) * kRows16;
    for (int h = 0; h < 2; ++h)
      _mm256_storeu_ps(wide + (h * K + k) * kRows,
                       _mm256_mul_ps(load_i8x8(q + k * kRows16 + 8 * h), _mm256_loadu_ps(sk + 8 * h)));
  }
}
#endif

#if defined(__AVX512F__) && defined(NANOENGINE_AVX2)
inline __m512 load_i8x16(const int8_t* p) {  // 16 int8 -> 16 float32 (exact)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

void block_1row_avx512(const float* x, int64_t K, int64_t G, const int8_t* q, const float* s, float* sums) {
  const char* pf = reinterpret_cast<const char*>(q) + kPrefetchBytes;
  __m512 total = _mm512_setzero_ps();
  for (int64_t g = 0, k0 = 0; k0 < K; ++g, k0 += G) {
    const int64_t end = std::min(K, k0 + G);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t k = k0;
    for (; k + 4 <= end; k += 4) {  // 4 columns = 64 bytes of the block: one cache line
      _mm_prefetch(pf + k * kRows16, _MM_HINT_T0);
      for (int j = 0; j < 4; ++j)
        acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(x[k + j]), load_i8x16(q + (k + j) * kRows16), acc[j]);
    }
    for (; k < end; ++k) acc[0] = _mm512_fmadd_ps(_mm512_set1_ps(x[k]), load_i8x16(q + k * kRows16), acc[0]);
    const __m512 part = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    total = _mm512_fmadd_ps(part, _mm512_loadu_ps(s + g * kRows16), total);
  }
  _mm512_storeu_ps(sums, total);
}

// kM rows of x (row stride K) against one block: sums [kM, 16]; one chain per row
template <int kM>
void block_rows_avx512(const float* x, int64_t K, int64_t G, const int8_t* q, const float* s, float* sums) {
  __m512 total[kM];
#pragma GCC unroll 8
  for (int m = 0; m < kM; ++m) total[m] = _mm512_setzero_ps();
  for (int64_t g = 0, k0 = 0; k0 < K; ++g, k0 += G) {
    const int64_t end = std::min(K, k0 + G);
    __m512 acc[kM];
#pragma GCC unroll 8
    for (int m = 0; m < kM; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t k = k0; k < end; ++k) {
      const __m512 w = load_i8x16(q + k * kRows16);
#pragma GCC unroll 8
      for (int m = 0; m < kM; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + k]), w, acc[m]);
    }
    const __m512 sv = _mm512_loadu_ps(s + g * kRows16);
#pragma GCC unroll 8
    for (int m = 0; m < kM; ++m) total[m] = _mm512_fmadd_ps(acc[m], sv, total[m]);
  }
#pragma GCC unroll 8
  for (int m = 0; m < kM; ++m) _mm512_storeu_ps(sums + m * kRows16, total[m]);
}
#endif

// one 16-row block (from output row n0) against all M rows of x; wide: scratch of 2 * K * 8 floats (AVX2, M >=
// kWidenRows)
template <typename out_t>
void int8_block(Path path, const float* x, int64_t M, int64_t K, int64_t G, const int8_t* q, const float* s,
                const float* bias, int64_t n0, int64_t N, out_t* out, float* wide) {
  alignas(64) float sums[kRowChunk * kRows16];
  int64_t m = 0;
#ifdef NANOENGINE_AVX2
  if (path == Path::kAvx2 && M >= kWidenRows) {
    widen_block(K, G, q, s, wide);
    few_rows(x, M, K, static_cast<const float*>(wide), 2, bias, n0, N, out);
    return;
  }
#endif
  while (m < M) {
    const float* xm = x + m * K;
    int64_t rows = 1;
#if defined(__AVX512F__) && defined(NANOENGINE_AVX2)
    if (path == Path::kAvx512) {
      if (M - m >= 8) block_rows_avx512<8>(xm, K, G, q, s, sums), rows = 8;
      else if (M - m >= 4) block_rows_avx512<4>(xm, K, G, q, s, sums), rows = 4;
      else if (M - m >= 2) block_rows_avx512<2>(xm, K, G, q, s, sums), rows = 2;
      else block_1row_avx512(xm, K, G, q, s, sums);
    } else
#endif
#ifdef NANOENGINE_AVX2
    if (path == Path::kAvx2) {  // as few passes as 2-6 rows a pass allow (7 = 4 + 3, 8 = 4 + 4, ...)
      const int64_t left = M - m;
      rows = left <= 6 ? left : left == 7 ? 4 : left <= 12 ? (left + 1) / 2 : 5;
      switch (rows) {
        case 1: block_1row_avx2(xm, K, G, q, s, sums); break;
        case 2: block_rows_avx2<2, 2>(xm, K, G, q, s, sums); break;
        case 3: block_rows_avx2<3, 1>(xm, K, G, q, s, sums); break;
        case 4: block_rows_avx2<4, 1>(xm, K, G, q, s, sums); break;
        case 5: block_rows_avx2<5, 1>(xm, K, G, q, s, sums); break;
        default: block_rows_avx2<6, 1>(xm, K, G, q, s, sums); break;
      }
    } else
#endif
      block_1row_plain(xm, K, G, q, s, sums);
    for (int64_t r = 0; r < rows; ++r) {
      store_row(sums + r * kRows16, bias, n0, N, out + (m + r) * N);
      store_row(sums + r * kRows16 + kRows, bias, n0 + kRows, N, out + (m + r) * N);
    }
    m += rows;
  }
}

}  // namespace

// q [N, K] int8, scales [N, groups] float32 -> [q packed [ceil(N / 16), K, 16], scales [ceil(N / 16),
// groups, 16]] (zero rows, with scale 0, pad N to a multiple of 16)
std::vector<at::Tensor> int8_pack(const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "int8_pack: an int8 weight [N, K], got ",
              q.scalar_type(), " with ", q.dim(), " dimensions");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == q.size(0) && scales.size(1) >= 1 &&
                  scales.size(1) <= q.size(1),
              "int8_pack: scales [N, groups] with the weight's N rows and 1..K groups");
  const int64_t N = q.size(0), K = q.size(1), groups = scales.size(1);
  const int64_t blocks = (N + kRows16 - 1) / kRows16, pad = blocks * kRows16 - N;
  auto packed = at::constant_pad_nd(q, {0, 0, 0, pad}).view({blocks, kRows16, K}).transpose(1, 2).contiguous();
  auto s = at::constant_pad_nd(scales.to(at::kFloat), {0, 0, 0, pad}).view({blocks, kRows16, groups});
  return {packed, s.transpose(1, 2).contiguous()};  // [blocks, K, 16], [blocks, groups, 16]
}

// x [M, K] float32 or bfloat16, int8_pack's packed weight and scales, bias [N] or None -> [M, N] in x's dtype.
// group_size: input columns per scale (the scales' groups = ceil(K / group_size)).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias, int64_t N, int64_t group_size,
                       const std::string& path) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && scales.device().is_cpu(),
              "int8_linear: CPU tensors only");
  if (packed.dim() == 4) return w8a8_linear(x, packed, scales, bias, N, group_size, path);  // w8a8_pack-ed
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(2) == kRows16,
              "int8_linear: an int8 weight packed by int8_pack");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == packed.size(1), "int8_linear: x [M, K] and a weight with the same K");
  const int64_t blocks = packed.size(0), M = x.size(0), K = x.size(1);
  TORCH_CHECK(N > (blocks - 1) * kRows16 && N <= blocks * kRows16,
              "int8_linear: N = ", N, " does not match the packed weight's ", blocks, " blocks");
  TORCH_CHECK(group_size >= 1, "int8_linear: group_size must be >= 1, got ", group_size);
  const int64_t groups = (K + group_size - 1) / group_size;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == blocks && scales.size(1) == groups && scales.size(2) == kRows16,
              "int8_linear: scales packed by int8_pack, ", groups, " groups of ", group_size, " columns");
  const Path p = pick_path(path);
  const FloatInputs in = float_inputs("int8_linear", x, bias);
  auto out = at::empty({M, N}, x.options());
  const float* xp = in.x_ptr();
  const float* bp = in.bias_ptr();
  const int8_t* qp = packed.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "int8_linear", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {  // each thread streams its share of W
      std::vector<float> wide(p == Path::kAvx2 && M >= kWidenRows ? 2 * K * kRows : 0);
      for (int64_t b = begin; b < end; ++b)
        int8_block<scalar_t>(p, xp, M, K, group_size, qp + b * K * kRows16, sp + b * groups * kRows16, bp,
                             b * kRows16, N, op, wide.data());
    });
  });
  return out;
}

}  // namespace nanoengine
