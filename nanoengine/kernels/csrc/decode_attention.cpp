// nanoengine's CPU kernels, family 1 (chapter 06): paged decode attention, `paged_decode` (the `cpu`
// attention backend).
//
// One query token per sequence, K/V read in place from the block pool. The torch backend gathers every
// sequence's blocks into a padded copy and then runs two batched matmuls, so it moves the K/V bytes three
// times; this kernel reads each K/V row once, straight from its block, and keeps scores and the output
// accumulator in float32.
//
// Layout (the torch backend's, heads first): k_cache, v_cache [num_kv_heads, num_blocks, block_size, head_dim].
// q [B, num_heads, head_dim]; block_tables [B, max_blocks] int64; context_lens [B] int64 (incl. the new token).
// The caches hold q's dtype, or bfloat16 under float32 queries (kv_cache_dtype="bfloat16": half the bytes to
// read); a bf16 row is widened to float32 as it is loaded (a bf16 is the top half of a float32).
// `path` picks the code: "auto" (AVX2 where the build has it), "avx2", or "plain" (the loops a CPU without
// AVX2 runs), so that one machine tests both (tests/test_kernels.py).
// Work is split over (sequence, kv head) pairs; each pair serves its `group` query heads (GQA): pass 1 scores
// four K rows at a time against every query head of the group, pass 2 keeps the group's output sums in
// registers, and both prefetch the scattered rows ahead.
#include "kernels.h"
#include "simd.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace nanoengine {
namespace {

// Ask for a K/V row's cache lines ahead of use. Rows sit in blocks scattered over the pool, and the hardware
// prefetcher stops at each 4 KiB page (a block of 16 rows of 64 floats is one page): without this, every block
// starts with a cold miss and the kernel waits on memory at a few GB/s.
template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t byte = 0; byte < D * static_cast<int64_t>(sizeof(scalar_t)); byte += 64) __builtin_prefetch(p + byte);
}

constexpr int64_t kPrefetchRows = 16;  // how far ahead pass 1 asks for K rows

// Pass 1 of decode attention: scores[g, l] = q_g . k_l for the group's query heads (qf [group, D], float32,
// pre-scaled) and the L rows of K at `rows` (offsets into the head's cache). With AVX2 and a head size that
// is a multiple of 16, four K rows at a time: each q vector is loaded once for four rows. It also prefetches
// K rows ahead, and the V rows pass 2 will read (so they wait in the cache).
#ifdef NANOENGINE_AVX2
// Pass 1 with AVX2 for a compile-time group of kG query heads: each chunk of 8 columns of four K rows is loaded
// (and widened) once for all kG heads, whose 4 * kG running sums stay in registers.
template <typename scalar_t, int kD, int kG>
int64_t attention_scores_avx2(const float* qf, const scalar_t* k_head, const scalar_t* v_head, const int64_t* rows,
                              int64_t L, float* scores) {
  int64_t l = 0;
  for (; l + 4 <= L; l += 4) {
    for (int64_t r = l; r < l + 4; ++r) {
      if (r + kPrefetchRows < L) prefetch_row(k_head + rows[r + kPrefetchRows], kD);
      prefetch_row(v_head + rows[r], kD);
    }
    const scalar_t* k[4] = {k_head + rows[l], k_head + rows[l + 1], k_head + rows[l + 2], k_head + rows[l + 3]};
    __m256 acc[kG][4];
#pragma GCC unroll 4
    for (int g = 0; g < kG; ++g)
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) acc[g][r] = _mm256_setzero_ps();
    for (int d = 0; d < kD; d += 8) {
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        const __m256 kv = load8(k[r] + d);
#pragma GCC unroll 4
        for (int g = 0; g < kG; ++g) acc[g][r] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * kD + d), kv, acc[g][r]);
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < kG; ++g) _mm_storeu_ps(scores + g * L + l, hsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
  }
  return l;
}
#endif

template <typename scalar_t, int kD>
void attention_scores(bool simd, const float* qf, int64_t group, int64_t D, const scalar_t* k_head,
                      const scalar_t* v_head, const int64_t* rows, int64_t L, float* scores) {
  int64_t l = 0;
#ifdef NANOENGINE_AVX2
  if constexpr (kD > 0 && kD % 16 == 0) {
    if (simd) switch (group) {  // the common GQA groups: K loaded once for the whole group
      case 2: l = attention_scores_avx2<scalar_t, kD, 2>(qf, k_head, v_head, rows, L, scores); break;
      case 3: l = attention_scores_avx2<scalar_t, kD, 3>(qf, k_head, v_head, rows, L, scores); break;
      case 4: l = attention_scores_avx2<scalar_t, kD, 4>(qf, k_head, v_head, rows, L, scores); break;
      default: break;
    }
  }
  if constexpr (kD > 0 && kD % 16 == 0) {
    for (; simd && l + 4 <= L; l += 4) {
      for (int64_t r = l; r < l + 4; ++r) {
        if (r + kPrefetchRows < L) prefetch_row(k_head + rows[r + kPrefetchRows], kD);
        prefetch_row(v_head + rows[r], kD);
      }
      const scalar_t* k[4] = {k_head + rows[l], k_head + rows[l + 1], k_head + rows[l + 2], k_head + rows[l + 3]};
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qf + g * kD;
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int d = 0; d < kD; d += 8) {
          const __m256 qv = _mm256_loadu_ps(qg + d);
          for (int r = 0; r < 4; ++r) acc[r] = _mm256_fmadd_ps(qv, load8(k[r] + d), acc[r]);
        }
        _mm_storeu_ps(scores + g * L + l, hsum4(acc[0], acc[1], acc[2], acc[3]));
      }
    }
  }
#endif
  for (; l < L; ++l) {  // the rest (and every row without AVX2)
    if (l + kPrefetchRows < L) prefetch_row(k_head + rows[l + kPrefetchRows], D);
    prefetch_row(v_head + rows[l], D);
    const scalar_t* k_row = k_head + rows[l];
    for (int64_t g = 0; g < group; ++g) {
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += qf[g * D + d] * to_float(k_row[d]);
      scores[g * L + l] = s;
    }
  }
}

#ifdef NANOENGINE_AVX2
// Pass 2 with AVX2, kG query heads (a compile-time group): acc[g, :] = sum_l p[g, l] v_l, kC columns at a time
// (32 for groups up to 3, else 16), so the kG * kC / 8 running sums stay in registers while the V rows stream by.
template <typename scalar_t, int kD, int kG>
void attention_values_avx2(const float* probs, const scalar_t* v_head, const int64_t* rows, int64_t L, float* acc) {
  constexpr int kC = (kG <= 3 && kD % 32 == 0) ? 32 : 16, kV = kC / 8;
  for (int c = 0; c < kD; c += kC) {
    __m256 a[kG][kV];
#pragma GCC unroll 4
    for (int g = 0; g < kG; ++g)
#pragma GCC unroll 4
      for (int j = 0; j < kV; ++j) a[g][j] = _mm256_setzero_ps();
    for (int64_t l = 0; l < L; ++l) {
      const scalar_t* v = v_head + rows[l] + c;
      __m256 vv[kV];
#pragma GCC unroll 4
      for (int j = 0; j < kV; ++j) vv[j] = load8(v + 8 * j);
#pragma GCC unroll 4
      for (int g = 0; g < kG; ++g) {
        const __m256 p = _mm256_set1_ps(probs[g * L + l]);
#pragma GCC unroll 4
        for (int j = 0; j < kV; ++j) a[g][j] = _mm256_fmadd_ps(p, vv[j], a[g][j]);
      }
    }
    for (int g = 0; g < kG; ++g)
      for (int j = 0; j < kV; ++j) _mm256_storeu_ps(acc + g * kD + c + 8 * j, a[g][j]);
  }
}
#endif

// Pass 2 of decode attention: acc[g, :] = sum_l p[g, l] v_l (acc [group, D], float32, zeroed here).
template <typename scalar_t, int kD>
void attention_values(bool simd, const float* probs, int64_t group, int64_t D, const scalar_t* v_head,
                      const int64_t* rows, int64_t L, float* acc) {
#ifdef NANOENGINE_AVX2
  if constexpr (kD > 0 && kD % 16 == 0) {
    if (simd) switch (group) {  // the common GQA groups
      case 1: return attention_values_avx2<scalar_t, kD, 1>(probs, v_head, rows, L, acc);
      case 2: return attention_values_avx2<scalar_t, kD, 2>(probs, v_head, rows, L, acc);
      case 3: return attention_values_avx2<scalar_t, kD, 3>(probs, v_head, rows, L, acc);
      case 4: return attention_values_avx2<scalar_t, kD, 4>(probs, v_head, rows, L, acc);
      default: break;
    }
  }
#endif
  std::fill(acc, acc + group * D, 0.f);
  for (int64_t l = 0; l < L; ++l) {
    const scalar_t* v_row = v_head + rows[l];
    for (int64_t g = 0; g < group; ++g) {
      const float p = probs[g * L + l];
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] += p * to_float(v_row[d]);
    }
  }
}

// q_t: the queries' and output's dtype; kv_t: the caches' (q_t, or bf16 under float32 queries); kD: head_dim
// known at compile time (0 = read it at run time); simd: the AVX2 code where built (false: the plain loops)
template <typename q_t, typename kv_t, int kD>
void decode_kernel(bool simd, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), num_heads = q.size(1), D = kD ? kD : q.size(2);
  const int64_t kvh = k_cache.size(0), num_blocks = k_cache.size(1), bs = k_cache.size(2);
  const int64_t group = num_heads / kvh, max_blocks = block_tables.size(1);
  const q_t* qp = q.data_ptr<q_t>();
  const kv_t* kp = k_cache.data_ptr<kv_t>();
  const kv_t* vp = v_cache.data_ptr<kv_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  q_t* op = out.data_ptr<q_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, B * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * D), acc(group * D), scores;
    std::vector<int64_t> rows;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kvh, h = task % kvh, L = lens[b];
      const int64_t* table = tables + b * max_blocks;
      if (L == 0) {  // no context (a CUDA-graph padding row): reads nothing, writes zeros
        for (int64_t i = 0; i < group * D; ++i) op[(b * num_heads + h * group) * D + i] = static_cast<q_t>(0.f);
        continue;
      }
      for (int64_t g = 0; g < group; ++g)  // the group's query heads, pre-scaled, in float32
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = to_float(qp[(b * num_heads + h * group + g) * D + d]) * fscale;
      scores.resize(group * L);
      rows.resize(L);  // where token l's row sits in this head's cache: block table[l / bs], offset l % bs
      for (int64_t blk = 0, l = 0; l < L; ++blk)
        for (int64_t j = 0; j < bs && l < L; ++j, ++l) rows[l] = (table[blk] * bs + j) * D;
      const kv_t* k_head = kp + h * num_blocks * bs * D;
      const kv_t* v_head = vp + h * num_blocks * bs * D;
      // pass 1: scores[g, l] = q_g . k_l, reading each K row once
      attention_scores<kv_t, kD>(simd, qf.data(), group, D, k_head, v_head, rows.data(), L, scores.data());
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
      attention_values<kv_t, kD>(simd, scores.data(), group, D, v_head, rows.data(), L, acc.data());
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < D; ++d)
          op[(b * num_heads + h * group + g) * D + d] = static_cast<q_t>(acc[g * D + d] * inv_sum[g]);
    }
  });
}

// the three (queries, caches) pairs: bf16 and bf16, float32 and float32, float32 and bf16
template <typename q_t, typename kv_t>
void decode_dispatch(bool simd, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& tables, const at::Tensor& lens, double scale, at::Tensor& out) {
  switch (q.size(2)) {  // common head sizes get fully unrolled inner loops
    case 64: return decode_kernel<q_t, kv_t, 64>(simd, q, k_cache, v_cache, tables, lens, scale, out);
    case 128: return decode_kernel<q_t, kv_t, 128>(simd, q, k_cache, v_cache, tables, lens, scale, out);
    default: return decode_kernel<q_t, kv_t, 0>(simd, q, k_cache, v_cache, tables, lens, scale, out);
  }
}

}  // namespace

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                        const std::string& path) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_decode: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "paged_decode: q [B, H, D], cache [kvh, blocks, bs, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
              "paged_decode: bfloat16 or float32 only, got ", q.scalar_type());
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() &&
                  (k_cache.scalar_type() == q.scalar_type() || k_cache.scalar_type() == at::kBFloat16),
              "paged_decode: the caches must share a dtype, q's or bfloat16 (under float32 queries)");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "paged_decode: num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: caches must be contiguous");
  TORCH_CHECK(path == "auto" || path == "avx2" || path == "plain",
              "paged_decode: path must be 'auto', 'avx2' or 'plain', got '", path, "'");
#ifdef NANOENGINE_AVX2
  const bool simd = path != "plain";
#else
  TORCH_CHECK(path != "avx2", "paged_decode: path 'avx2' is not in this build (built for plain loops)");
  const bool simd = false;
#endif
  auto qc = q.contiguous();
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens = context_lens.to(at::kLong).contiguous();
  auto out = at::empty_like(qc);
  if (q.scalar_type() == at::kBFloat16)
    decode_dispatch<c10::BFloat16, c10::BFloat16>(simd, qc, k_cache, v_cache, tables, lens, scale, out);
  else if (k_cache.scalar_type() == at::kBFloat16)
    decode_dispatch<float, c10::BFloat16>(simd, qc, k_cache, v_cache, tables, lens, scale, out);
  else
    decode_dispatch<float, float>(simd, qc, k_cache, v_cache, tables, lens, scale, out);
  return out;
}

}  // namespace nanoengine
