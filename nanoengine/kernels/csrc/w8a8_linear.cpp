// nanoengine's CPU kernels, family 5b (chapter 08): int8 weights times int8 activations (W8A8), `w8a8_pack`
// and `w8a8_linear` (called by `int8_linear` for a weight that `w8a8_pack` laid out; quantization="w8a8":
// `layers.quant`).
//
// y[M, N] = sum over groups g of sx[m, g] * s[n, g] * (sum over the group's columns k of xq[m, k] * q[n, k]):
// the weights as weight-only int8 has them (symmetric, q in [-127, 127], one scale per output row and group
// of `group_size` columns), and each row of x quantized the same way on the fly, per group (as llama.cpp's
// Q8_0 quantizes activations): sx = max |x| over the group / 127, xq = round-half-even(x * (127 / max |x|)),
// a group of zeros gives 0. The sums over a group are int32 and exact on every path; a group's sum is turned
// to float32 and multiplied by sx * s once, at the group's end, so the paths differ only in the order of the
// float32 additions over groups.
//
// Layout: `w8a8_pack` lays q out once as [ceil(N / 16), ceil(K / 4), 16, 4]: blocks of 16 rows, and for each
// 4 consecutive columns the 16 rows' 4 bytes side by side (64 bytes: one line, one register); the scales as
// [ceil(N / 16), groups, 2, 16]: the 16 rows' scales, then 128 times their group's sum of q (for the
// unsigned trick below, exact in float32). group_size must be a multiple of 4.
// `path` picks the code: "auto" (the best this build has), "avx512vnni", "avxvnni", "avx2" or "plain":
// - "avx512vnni": `vpdpbusd` multiplies 4 unsigned by 4 signed bytes and adds the 4 products into each int32
//   lane: x is made unsigned (xq + 128), and 128 * sum(q) is taken off at the group's end;
// - "avxvnni": the same on 256-bit registers (AVX-VNNI);
// - "avx2": `vpmaddubsw` on |xq| and q with xq's sign (at most 2 * 127 * 127: no saturation), `vpmaddwd`
//   by ones to int32;
// - "plain": int32 loops.
#include "kernels.h"
#include "linear_tiles.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace nanoengine {
namespace {

constexpr int64_t kRows16 = 16;
constexpr int64_t kChunk = 8;  // rows of x per pass over a block

enum class Path { kPlain, kAvx2, kAvxVnni, kVnni };

bool built(Path p) {
  switch (p) {
#ifdef NANOENGINE_AVX512VNNI
    case Path::kVnni: return true;
#endif
#ifdef NANOENGINE_AVXVNNI
    case Path::kAvxVnni: return true;
#endif
#ifdef NANOENGINE_AVX2
    case Path::kAvx2: return true;
#endif
    case Path::kPlain: return true;
    default: return false;
  }
}

Path pick(const std::string& path) {
  if (path == "auto") {
    for (Path p : {Path::kVnni, Path::kAvxVnni, Path::kAvx2})
      if (built(p)) return p;
    return Path::kPlain;
  }
  TORCH_CHECK(path == "avx512vnni" || path == "avxvnni" || path == "avx2" || path == "plain",
              "int8_linear (w8a8): path must be 'auto', 'avx512vnni', 'avxvnni', 'avx2' or 'plain', got '", path,
              "'");
  const Path want = path == "avx512vnni" ? Path::kVnni
                    : path == "avxvnni"  ? Path::kAvxVnni
                    : path == "avx2"     ? Path::kAvx2
                                         : Path::kPlain;
  TORCH_CHECK(built(want), "int8_linear (w8a8): path '", path, "' is not in this build (the compiler did not "
              "target it for this CPU): use path='auto'");
  return want;
}

// one group of n <= G values of x -> xq (and, for VNNI, xq + 128 as unsigned bytes), its scale
inline void quantize_group(const float* x, int64_t n, int8_t* q, uint8_t* u, float* s) {
#ifdef NANOENGINE_AVX512
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t k = 0; k < n; k += 16) {
    const __mmask16 mask = n - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - k)) - 1);
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_maskz_loadu_ps(mask, x + k)));
  }
  const float amax = _mm512_reduce_max_ps(vmax);
#else
  float amax = 0.f;
  for (int64_t k = 0; k < n; ++k) amax = std::max(amax, std::fabs(x[k]));
#endif
  *s = amax / 127.f;
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
#ifdef NANOENGINE_AVX512
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t k = 0; k < n; k += 16) {
    const __mmask16 mask = n - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - k)) - 1);
    // round half to even (the default rounding mode), as std::nearbyint; |x * inv| <= 127 (+ a rounding)
    const __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(mask, x + k), vinv));
    const __m128i b = _mm512_cvtsepi32_epi8(_mm512_max_epi32(i, _mm512_set1_epi32(-127)));
    _mm_mask_storeu_epi8(q + k, mask, b);
    if (u) _mm_mask_storeu_epi8(u + k, mask, _mm_xor_si128(b, _mm_set1_epi8(static_cast<char>(0x80))));
  }
#else
  for (int64_t k = 0; k < n; ++k) {
    q[k] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(x[k] * inv))));
    if (u) u[k] = static_cast<uint8_t>(q[k] ^ 0x80);
  }
#endif
}

// x [M, K] float32 -> xq [M, K4 * 4] int8 (zero-padded), xu (if not null) xq + 128, sx [M, groups]; rows
// split over the threads
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t K4, int64_t G, int8_t* xq, uint8_t* xu,
                   float* sx) {
  const int64_t groups = (K + G - 1) / G;
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      int8_t* qr = xq + m * K4 * 4;
      uint8_t* ur = xu ? xu + m * K4 * 4 : nullptr;
      for (int64_t k = K; k < K4 * 4; ++k) {  // padding: xq 0 (xq + 128 = 128)
        qr[k] = 0;
        if (ur) ur[k] = 0x80;
      }
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t k0 = g * G, n = std::min(K, k0 + G) - k0;
        quantize_group(x + m * K + k0, n, qr + k0, ur ? ur + k0 : nullptr, sx + m * groups + g);
      }
    }
  });
}

// One block (q: K4 * 64 bytes; s: groups * 32 floats) against kM rows of xq (row stride K4 * 4 bytes, their
// scales sx, row stride `groups`): sums [kM, 16]. j4: 4-column steps of a group.
void block_plain(const int8_t* xq, const float* sx, int64_t M, int64_t K4, int64_t G, int64_t groups,
                 const int8_t* q, const float* s, float* sums) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < kRows16; ++r) {
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t isum = 0;
        for (int64_t j = g * G / 4; j < std::min(K4, (g + 1) * G / 4); ++j)
          for (int t = 0; t < 4; ++t) isum += int32_t(xq[m * K4 * 4 + 4 * j + t]) * int32_t(q[(j * kRows16 + r) * 4 + t]);
        total += static_cast<float>(isum) * (s[g * 32 + r] * sx[m * groups + g]);
      }
      sums[m * kRows16 + r] = total;
    }
}

#ifdef NANOENGINE_AVX2
template <int kM>
void block_avx2(const int8_t* xq, const float* sx, int64_t K4, int64_t G, int64_t groups, const int8_t* q,
                const float* s, float* sums) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 total[kM][2];
#pragma GCC unroll 8
  for (int m = 0; m < kM; ++m) total[m][0] = total[m][1] = _mm256_setzero_ps();
  const int32_t* x32 = reinterpret_cast<const int32_t*>(xq);
  for (int64_t g = 0; g < groups; ++g) {
    __m256i acc[kM][2];
#pragma GCC unroll 8
    for (int m = 0; m < kM; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
    for (int64_t j = g * G / 4; j < std::min(K4, (g + 1) * G / 4); ++j) {
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * 64));
      const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * 64 + 32));
#pragma GCC unroll 8
      for (int m = 0; m < kM; ++m) {
        const __m256i xb = _mm256_set1_epi32(x32[m * K4 + j]);
        const __m256i ax = _mm256_abs_epi8(xb);
        acc[m][0] = _mm256_add_epi32(acc[m][0], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(lo, xb)), ones));
        acc[m][1] = _mm256_add_epi32(acc[m][1], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(hi, xb)), ones));
      }
    }
    const __m256 s_lo = _mm256_loadu_ps(s + g * 32), s_hi = _mm256_loadu_ps(s + g * 32 + 8);
#pragma GCC unroll 8
    for (int m = 0; m < kM; ++m) {
      const __m256 xs = _mm256_set1_ps(sx[m * groups + g]);
      total[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][0]), _mm256_mul_ps(s_lo, xs), total[m][0]);
      total[m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][1]), _mm256_mul_ps(s_hi, xs), total[m][1]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < kM; ++m) {
    _mm256_storeu_ps(sums + m * kRows16, total[m][0]);
    _mm256_storeu_ps(sums + m * kRows16 + 8, total[m][1]);
  }
}
#endif

#ifdef NANOENGINE_AVXVNNI
// xu: xq + 128 as unsigned bytes; 16 rows as two 8-lane registers
template <int kM>
void block_avxvnni(const uint8_t* xu, const float* sx, int64_t K4, int64_t G, int64_t groups, const int8_t* q,
                   const float* s, float* sums) {
  __m256 total[kM][2];
#pragma GCC unroll 8
  for (int m = 0; m < kM; ++m) total[m][0] = total[m][1] = _mm256_setzero_ps();
  const int32_t* x32 = reinterpret_cast<const int32_t*>(xu);
  for (int64_t g = 0; g < groups; ++g) {
    __m256i acc[kM][2];
#pragma GCC unroll 8
    for (int m = 0; m < kM; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
    for (int64_t j = g * G / 4; j < std::min(K4, (g + 1) * G / 4); ++j) {
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * 64));
      const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * 64 + 32));
#pragma GCC unroll 8
      for (int m = 0; m < kM; ++m) {
        const __m256i xb = _mm256_set1_epi32(x32[m * K4 + j]);
        acc[m][0] = _mm256_dpbusd_avx_epi32(acc[m][0], xb, lo);
        acc[m][1] = _mm256_dpbusd_avx_epi32(acc[m][1], xb, hi);
      }
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256 sw = _mm256_loadu_ps(s + g * 32 + 8 * h), corr = _mm256_loadu_ps(s + g * 32 + 16 + 8 * h);
#pragma GCC unroll 8
      for (int m = 0; m < kM; ++m) {
        const __m256 isum = _mm256_sub_ps(_mm256_cvtepi32_ps(acc[m][h]), corr);  // exact: |sums| < 2^24
        total[m][h] = _mm256_fmadd_ps(isum, _mm256_mul_ps(sw, _mm256_set1_ps(sx[m * groups + g])), total[m][h]);
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < kM; ++m) {
    _mm256_storeu_ps(sums + m * kRows16, total[m][0]);
    _mm256_storeu_ps(sums + m * kRows16 + 8, total[m][1]);
  }
}
#endif

#ifdef NANOENGINE_AVX512VNNI
// xu: xq + 128 as unsigned bytes; kC chains over the 4-column steps (latency at few rows)
template <int kM, int kC>
void block_vnni(const uint8_t* xu, const float* sx, int64_t K4, int64_t G, int64_t groups, const int8_t* q,
                const float* s, float* sums) {
  __m512 total[kM];
#pragma GCC unroll 8
  for (int m = 0; m < kM; ++m) total[m] = _mm512_setzero_ps();
  const int32_t* x32 = reinterpret_cast<const int32_t*>(xu);
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[kC][kM];
#pragma GCC unroll 4
    for (int c = 0; c < kC; ++c)
#pragma GCC unroll 8
      for (int m = 0; m < kM; ++m) acc[c][m] = _mm512_setzero_si512();
    const int64_t j1 = std::min(K4, (g + 1) * G / 4);
    int64_t j = g * G / 4;
    for (; j + kC <= j1; j += kC) {
#pragma GCC unroll 4
      for (int c = 0; c < kC; ++c) {
        const __m512i w = _mm512_loadu_si512(q + (j + c) * 64);
#pragma GCC unroll 8
        for (int m = 0; m < kM; ++m)
          acc[c][m] = _mm512_dpbusd_epi32(acc[c][m], _mm512_set1_epi32(x32[m * K4 + j + c]), w);
      }
    }
    for (; j < j1; ++j) {
      const __m512i w = _mm512_loadu_si512(q + j * 64);
#pragma GCC unroll 8
      for (int m = 0; m < kM; ++m) acc[0][m] = _mm512_dpbusd_epi32(acc[0][m], _mm512_set1_epi32(x32[m * K4 + j]), w);
    }
    const __m512 sw = _mm512_loadu_ps(s + g * 32), corr = _mm512_loadu_ps(s + g * 32 + 16);
#pragma GCC unroll 8
    for (int m = 0; m < kM; ++m) {
      __m512i a = acc[0][m];
#pragma GCC unroll 4
      for (int c = 1; c < kC; ++c) a = _mm512_add_epi32(a, acc[c][m]);
      const __m512 isum = _mm512_sub_ps(_mm512_cvtepi32_ps(a), corr);  // exact: |sums| < 2^24
      total[m] = _mm512_fmadd_ps(isum, _mm512_mul_ps(sw, _mm512_set1_ps(sx[m * groups + g])), total[m]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < kM; ++m) _mm512_storeu_ps(sums + m * kRows16, total[m]);
}
#endif

}  // namespace

// q [N, K] int8, scales [N, groups] float32 -> [q packed [ceil(N / 16), ceil(K / 4), 16, 4], scales packed
// [ceil(N / 16), groups, 2, 16] (the scales, then 128 x each group's sum of q)]; zero rows and columns pad.
std::vector<at::Tensor> w8a8_pack(const at::Tensor& q, const at::Tensor& scales, int64_t group_size) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "w8a8_pack: an int8 weight [N, K], got ",
              q.scalar_type(), " with ", q.dim(), " dimensions");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(group_size >= 4 && group_size % 4 == 0,
              "w8a8_pack: group_size must be a multiple of 4 (int8 dot products take 4 columns at a time), got ",
              group_size, "; use layers.quant.GROUP_SIZE (32)");
  const int64_t groups = (K + group_size - 1) / group_size;
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == groups,
              "w8a8_pack: scales [N, groups] with the weight's N rows and ", groups, " groups of ", group_size);
  const int64_t blocks = (N + kRows16 - 1) / kRows16, pad = blocks * kRows16 - N, K4 = (K + 3) / 4;
  auto qp = at::constant_pad_nd(q, {0, K4 * 4 - K, 0, pad});  // [blocks * 16, K4 * 4]
  auto packed = qp.view({blocks, kRows16, K4, 4}).transpose(1, 2).contiguous();  // [blocks, K4, 16, 4]
  auto gq = at::constant_pad_nd(qp.to(at::kFloat), {0, groups * group_size - K4 * 4}).view({blocks * kRows16, groups, group_size});
  auto corr = gq.sum(2) * 128.0;  // [blocks * 16, groups]
  auto s = at::constant_pad_nd(scales.to(at::kFloat), {0, 0, 0, pad});  // [blocks * 16, groups]
  auto both = at::stack({s, corr}, 2).view({blocks, kRows16, groups, 2}).permute({0, 2, 3, 1}).contiguous();
  return {packed, both};  // [blocks, K4, 16, 4], [blocks, groups, 2, 16]
}

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias, int64_t N, int64_t group_size,
                       const std::string& path) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.size(2) == kRows16 &&
                  packed.size(3) == 4, "int8_linear: an int8 weight packed by w8a8_pack");
  const int64_t blocks = packed.size(0), K4 = packed.size(1), M = x.size(0), K = x.size(1);
  TORCH_CHECK(x.dim() == 2 && (K + 3) / 4 == K4, "int8_linear: x [M, K] and a weight with the same K");
  TORCH_CHECK(N > (blocks - 1) * kRows16 && N <= blocks * kRows16,
              "int8_linear: N = ", N, " does not match the packed weight's ", blocks, " blocks");
  TORCH_CHECK(group_size >= 4 && group_size % 4 == 0, "int8_linear (w8a8): group_size must be a multiple of 4");
  const int64_t groups = (K + group_size - 1) / group_size;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 4 &&
                  scales.size(0) == blocks && scales.size(1) == groups && scales.size(2) == 2 &&
                  scales.size(3) == kRows16,
              "int8_linear: scales packed by w8a8_pack, ", groups, " groups of ", group_size, " columns");
  const Path p = pick(path);
  const FloatInputs in = float_inputs("int8_linear", x, bias);
  std::vector<int8_t> xq(M * K4 * 4);
  std::vector<float> sx(M * groups);
  // xq + 128, for vpdpbusd's unsigned side
  std::vector<uint8_t> xu(p == Path::kVnni || p == Path::kAvxVnni ? M * K4 * 4 : 0);
  quantize_rows(in.x_ptr(), M, K, K4, group_size, xq.data(), xu.empty() ? nullptr : xu.data(), sx.data());
  auto out = at::empty({M, N}, x.options());
  const float* bp = in.bias_ptr();
  const int8_t* qp = packed.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const int64_t G = group_size, row_bytes = K4 * 4;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "int8_linear", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {  // each thread streams its share of W
      alignas(64) float sums[kChunk * kRows16];
      for (int64_t b = begin; b < end; ++b) {
        const int8_t* q = qp + b * K4 * 64;
        const float* s = sp + b * groups * 32;
        for (int64_t m = 0; m < M;) {
          const int64_t rows = std::min<int64_t>(M - m, kChunk);
          const float* sxm = sx.data() + m * groups;
          int64_t done = rows;
#ifdef NANOENGINE_AVX512VNNI
          if (p == Path::kVnni) {
            const uint8_t* xm = xu.data() + m * row_bytes;
            if (rows >= 8) block_vnni<8, 1>(xm, sxm, K4, G, groups, q, s, sums), done = 8;
            else if (rows >= 4) block_vnni<4, 1>(xm, sxm, K4, G, groups, q, s, sums), done = 4;
            else if (rows >= 2) block_vnni<2, 2>(xm, sxm, K4, G, groups, q, s, sums), done = 2;
            else block_vnni<1, 4>(xm, sxm, K4, G, groups, q, s, sums), done = 1;
          } else
#endif
#ifdef NANOENGINE_AVXVNNI
          if (p == Path::kAvxVnni) {
            const uint8_t* xm = xu.data() + m * row_bytes;
            if (rows >= 4) block_avxvnni<4>(xm, sxm, K4, G, groups, q, s, sums), done = 4;
            else if (rows >= 2) block_avxvnni<2>(xm, sxm, K4, G, groups, q, s, sums), done = 2;
            else block_avxvnni<1>(xm, sxm, K4, G, groups, q, s, sums), done = 1;
          } else
#endif
#ifdef NANOENGINE_AVX2
          if (p == Path::kAvx2) {
            const int8_t* xm = xq.data() + m * row_bytes;
            if (rows >= 4) block_avx2<4>(xm, sxm, K4, G, groups, q, s, sums), done = 4;
            else if (rows >= 2) block_avx2<2>(xm, sxm, K4, G, groups, q, s, sums), done = 2;
            else block_avx2<1>(xm, sxm, K4, G, groups, q, s, sums), done = 1;
          } else
#endif
            block_plain(xq.data() + m * row_bytes, sxm, rows, K4, G, groups, q, s, sums);
          for (int64_t r = 0; r < done; ++r) {
            store_row(sums + r * kRows16, bp, b * kRows16, N, op + (m + r) * N);
            store_row(sums + r * kRows16 + kRows, bp, b * kRows16 + kRows, N, op + (m + r) * N);
          }
          m += done;
        }
      }
    });
  });
  return out;
}

}  // namespace nanoengine
