// nanoengine's CPU kernels, family 3b (chapters 06 and 08): the bf16 small-batch linear on the pairs layout,
// `bf16_pairs_linear` (called by `bf16_linear` for a weight that `bf16_pack` laid out in pairs; see
// bf16_linear.cpp for the layout and what each path computes).
//
// packed [blocks, K2, 16, 2] bf16: for block b, pair j and row r, (W[16 b + r, 2 j], W[16 b + r, 2 j + 1]),
// one 32-bit lane per row, one 64-byte line per pair. x is read as pairs too: a float32 x as two bf16 parts
// (hi, lo) for "avx512bf16", as float32 for "avx512" and "plain". Work: blocks split over the threads; a
// block is multiplied by up to kChunk rows of x per pass (it then sits in the cache for the next pass).
#include "kernels.h"
#include "linear_tiles.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <string>
#include <vector>

namespace nanoengine {
namespace {

constexpr int64_t kRows16 = 16;
constexpr int64_t kChunk = 8;  // rows of x per pass over a block
constexpr int64_t kPrefetchLines = 32;  // how far ahead (in 64-byte pairs) a block's stream is prefetched

// the bf16 bits of x (round to nearest even, as c10 rounds), its part left over, as bits
inline uint16_t bf16_bits(float v) { return c10::BFloat16(v).x; }

// x [M, K] float32 -> hi and lo parts as pairs [M, K2] (uint32: bf16 of column 2 j low, of 2 j + 1 high)
void split_pairs(const float* x, int64_t M, int64_t K, int64_t K2, uint32_t* hi, uint32_t* lo) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < K2; ++j) {
      uint32_t h = 0, l = 0;
      for (int64_t t = 0; t < 2; ++t) {
        const int64_t k = 2 * j + t;
        const float v = k < K ? x[m * K + k] : 0.f;
        const uint16_t hb = bf16_bits(v);
        const uint16_t lb = bf16_bits(v - to_float(c10::BFloat16(hb, c10::BFloat16::from_bits())));
        h |= static_cast<uint32_t>(hb) << (16 * t);
        l |= static_cast<uint32_t>(lb) << (16 * t);
      }
      hi[m * K2 + j] = h;
      lo[m * K2 + j] = l;
    }
}

// plain loops: kM rows of float32 x (row stride K) against one block -> sums [kM, 16]
void block_plain(const float* x, int64_t M, int64_t K, int64_t K2, const c10::BFloat16* w, float* sums) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < kRows16; ++r) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * to_float(w[((k / 2) * kRows16 + r) * 2 + k % 2]);
      sums[m * kRows16 + r] = s;
    }
  (void)K2;
}

#ifdef NANOENGINE_AVX512
// kM rows of float32 x against one block: each pair widened by a shift (column 2 j) and a mask (2 j + 1),
// two FMAs per row; kC chains over the pairs (FMA latency at few rows)
template <int kM, int kC>
void block_avx512(const float* x, int64_t K, int64_t K2, const c10::BFloat16* w, float* sums) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const char* wb = reinterpret_cast<const char*>(w);
  __m512 acc[kC][kM];
#pragma GCC unroll 4
  for (int c = 0; c < kC; ++c)
#pragma GCC unroll 8
    for (int m = 0; m < kM; ++m) acc[c][m] = _mm512_setzero_ps();
  const int64_t full = K / 2;  // pairs with both columns in x
  int64_t j = 0;
  for (; j + kC <= full; j += kC) {
#pragma GCC unroll 4
    for (int c = 0; c < kC; ++c) {
      _mm_prefetch(wb + (j + c + kPrefetchLines) * 64, _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(wb + (j + c) * 64);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(v, high));
#pragma GCC unroll 8
      for (int m = 0; m < kM; ++m) {
        acc[c][m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + 2 * (j + c)]), even, acc[c][m]);
        acc[c][m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + 2 * (j + c) + 1]), odd, acc[c][m]);
      }
    }
  }
  for (; j < K2; ++j) {
    const __m512i v = _mm512_loadu_si512(wb + j * 64);
    const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(v, high));
#pragma GCC unroll 8
    for (int m = 0; m < kM; ++m) {
      acc[0][m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + 2 * j]), even, acc[0][m]);
      if (2 * j + 1 < K) acc[0][m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + 2 * j + 1]), odd, acc[0][m]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < kM; ++m) {
    __m512 s = acc[0][m];
#pragma GCC unroll 4
    for (int c = 1; c < kC; ++c) s = _mm512_add_ps(s, acc[c][m]);
    _mm512_storeu_ps(sums + m * kRows16, s);
  }
}
#endif

#ifdef NANOENGINE_AVX512BF16
// kM rows of x as bf16 pairs (kParts = 2: hi and lo; 1: a bf16 x) against one block: `vdpbf16ps` adds the two
// products of each lane's pair into its float32 sum; kC chains over the pairs
template <int kM, int kC, int kParts>
void block_bf16dp(const uint32_t* hi, const uint32_t* lo, int64_t K2, const c10::BFloat16* w, float* sums) {
  const char* wb = reinterpret_cast<const char*>(w);
  __m512 acc[kC][kParts][kM];
#pragma GCC unroll 4
  for (int c = 0; c < kC; ++c)
#pragma GCC unroll 2
    for (int p = 0; p < kParts; ++p)
#pragma GCC unroll 8
      for (int m = 0; m < kM; ++m) acc[c][p][m] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + kC <= K2; j += kC) {
#pragma GCC unroll 4
    for (int c = 0; c < kC; ++c) {
      _mm_prefetch(wb + (j + c + kPrefetchLines) * 64, _MM_HINT_T0);
      const __m512bh v = (__m512bh)_mm512_loadu_si512(wb + (j + c) * 64);
#pragma GCC unroll 8
      for (int m = 0; m < kM; ++m) {
        acc[c][0][m] = _mm512_dpbf16_ps(acc[c][0][m], (__m512bh)_mm512_set1_epi32(hi[m * K2 + j + c]), v);
        if (kParts == 2)
          acc[c][kParts - 1][m] =
              _mm512_dpbf16_ps(acc[c][kParts - 1][m], (__m512bh)_mm512_set1_epi32(lo[m * K2 + j + c]), v);
      }
    }
  }
  for (; j < K2; ++j) {
    const __m512bh v = (__m512bh)_mm512_loadu_si512(wb + j * 64);
#pragma GCC unroll 8
    for (int m = 0; m < kM; ++m) {
      acc[0][0][m] = _mm512_dpbf16_ps(acc[0][0][m], (__m512bh)_mm512_set1_epi32(hi[m * K2 + j]), v);
      if (kParts == 2)
        acc[0][kParts - 1][m] =
            _mm512_dpbf16_ps(acc[0][kParts - 1][m], (__m512bh)_mm512_set1_epi32(lo[m * K2 + j]), v);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < kM; ++m) {
    __m512 s = acc[0][0][m];
#pragma GCC unroll 4
    for (int c = 1; c < kC; ++c) s = _mm512_add_ps(s, acc[c][0][m]);
    if (kParts == 2) {
      __m512 l = acc[0][kParts - 1][m];
#pragma GCC unroll 4
      for (int c = 1; c < kC; ++c) l = _mm512_add_ps(l, acc[c][kParts - 1][m]);
      s = _mm512_add_ps(s, l);
    }
    _mm512_storeu_ps(sums + m * kRows16, s);
  }
}

template <int kParts>
int64_t bf16dp_pass(const uint32_t* hi, const uint32_t* lo, int64_t left, int64_t K2, const c10::BFloat16* w,
                    float* sums) {
  switch (std::min<int64_t>(left, kChunk)) {  // chains x rows x parts: 4 or more sums in flight
    case 1: block_bf16dp<1, 4, kParts>(hi, lo, K2, w, sums); return 1;
    case 2: block_bf16dp<2, 2, kParts>(hi, lo, K2, w, sums); return 2;
    case 3: block_bf16dp<3, 2, kParts>(hi, lo, K2, w, sums); return 3;
    case 4: case 5: block_bf16dp<4, 1, kParts>(hi, lo, K2, w, sums); return 4;
    case 6: case 7: block_bf16dp<6, 1, kParts>(hi, lo, K2, w, sums); return 6;
    default: block_bf16dp<8, 1, kParts>(hi, lo, K2, w, sums); return 8;
  }
}
#endif

}  // namespace

at::Tensor bf16_pairs_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                             int64_t N, const std::string& path) {
  const int64_t M = x.size(0), K = x.size(1), K2 = packed.size(1), blocks = packed.size(0);
  const bool dp = path == "avx512bf16", simd = path == "avx512";
  const bool bf16_x = x.scalar_type() == at::kBFloat16;
  const FloatInputs in = float_inputs("bf16_linear", x, bias);
  std::vector<uint32_t> hi(dp ? M * K2 : 0), lo(dp ? M * K2 : 0);
  if (dp) split_pairs(in.x_ptr(), M, K, K2, hi.data(), lo.data());  // a bf16 x: lo is all zero
  auto out = at::empty({M, N}, x.options());
  const float* xp = in.x_ptr();
  const float* bp = in.bias_ptr();
  const c10::BFloat16* wp = packed.data_ptr<c10::BFloat16>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "bf16_linear", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {  // each thread streams its share of W
      alignas(64) float sums[kChunk * kRows16];
      for (int64_t b = begin; b < end; ++b) {
        const c10::BFloat16* w = wp + b * K2 * kRows16 * 2;
        for (int64_t m = 0; m < M;) {
          int64_t rows = std::min<int64_t>(M - m, kChunk);
#ifdef NANOENGINE_AVX512BF16
          if (dp) {
            rows = bf16_x ? bf16dp_pass<1>(hi.data() + m * K2, nullptr, M - m, K2, w, sums)
                          : bf16dp_pass<2>(hi.data() + m * K2, lo.data() + m * K2, M - m, K2, w, sums);
          } else
#endif
#ifdef NANOENGINE_AVX512
          if (simd) {
            const float* xm = xp + m * K;
            switch (rows) {
              case 1: block_avx512<1, 4>(xm, K, K2, w, sums); break;
              case 2: block_avx512<2, 2>(xm, K, K2, w, sums); break;
              case 3: block_avx512<3, 2>(xm, K, K2, w, sums); break;
              case 4: case 5: block_avx512<4, 1>(xm, K, K2, w, sums), rows = 4; break;
              case 6: case 7: block_avx512<6, 1>(xm, K, K2, w, sums), rows = 6; break;
              default: block_avx512<8, 1>(xm, K, K2, w, sums); break;
            }
          } else
#endif
            block_plain(xp + m * K, rows, K, K2, w, sums);
          for (int64_t r = 0; r < rows; ++r) {
            store_row(sums + r * kRows16, bp, b * kRows16, N, op + (m + r) * N);
            store_row(sums + r * kRows16 + kRows, bp, b * kRows16 + kRows, N, op + (m + r) * N);
          }
          m += rows;
        }
      }
    });
  });
  (void)dp, (void)simd, (void)bf16_x;
  return out;
}

}  // namespace nanoengine
