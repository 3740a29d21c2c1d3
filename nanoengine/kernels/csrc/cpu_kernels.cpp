// nanoengine's CPU kernels (chapter 06), built once by nanoengine/attention/cpu_backend.py.
//
// 1. Paged decode attention: one query token per sequence, K/V read in place from the block pool. The torch backend gathers every sequence's blocks into a padded copy and then runs two
// batched matmuls, so it moves the K/V bytes three times; this kernel reads each K/V row once, straight
// from its block, and keeps scores and the output accumulator in float32.
//
// Layout (the torch backend's, heads first): k_cache, v_cache [num_kv_heads, num_blocks, block_size, head_dim].
// q [B, num_heads, head_dim]; block_tables [B, max_blocks] int64; context_lens [B] int64 (incl. the new token).
// Work is split over (sequence, kv head) pairs; each pair serves its `group` query heads (GQA): pass 1 scores
// four K rows at a time against every query head of the group, pass 2 keeps the group's output sums in
// registers, and both prefetch the scattered rows ahead (2x faster than plain loops on an AVX2 EPYC in bf16).
#include <torch/extension.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

// AVX2 + FMA (8 floats per register) where the compiler targets them (-march=native); plain loops otherwise.
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define NANOENGINE_AVX2 1
#endif

namespace {

inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;  // bf16 is the top half of a float32
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

#ifdef NANOENGINE_AVX2
inline __m256 load_bf16x8(const c10::BFloat16* p) {  // 8 bf16 -> 8 float32: widen to 32 bits, shift up 16
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) { return load_bf16x8(p); }

inline float hsum(__m256 v) {  // the 8 lanes' sum
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {  // [sum(a), sum(b), sum(c), sum(d)]
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // per 128-bit half
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#endif

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
void attention_scores(const float* qf, int64_t group, int64_t D, const scalar_t* k_head, const scalar_t* v_head,
                      const int64_t* rows, int64_t L, float* scores) {
  int64_t l = 0;
#ifdef NANOENGINE_AVX2
  if constexpr (kD > 0 && kD % 16 == 0) {
    switch (group) {  // the common GQA groups: K loaded once for the whole group
      case 2: l = attention_scores_avx2<scalar_t, kD, 2>(qf, k_head, v_head, rows, L, scores); break;
      case 3: l = attention_scores_avx2<scalar_t, kD, 3>(qf, k_head, v_head, rows, L, scores); break;
      case 4: l = attention_scores_avx2<scalar_t, kD, 4>(qf, k_head, v_head, rows, L, scores); break;
      default: break;
    }
  }
  if constexpr (kD > 0 && kD % 16 == 0) {
    for (; l + 4 <= L; l += 4) {
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
void attention_values(const float* probs, int64_t group, int64_t D, const scalar_t* v_head, const int64_t* rows,
                      int64_t L, float* acc) {
#ifdef NANOENGINE_AVX2
  if constexpr (kD > 0 && kD % 16 == 0) {
    switch (group) {  // the common GQA groups
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
    std::vector<float> qf(group * D), acc(group * D), scores;
    std::vector<int64_t> rows;
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
      scores.resize(group * L);
      rows.resize(L);  // where token l's row sits in this head's cache: block table[l / bs], offset l % bs
      for (int64_t blk = 0, l = 0; l < L; ++blk)
        for (int64_t j = 0; j < bs && l < L; ++j, ++l) rows[l] = (table[blk] * bs + j) * D;
      const scalar_t* k_head = kp + h * num_blocks * bs * D;
      const scalar_t* v_head = vp + h * num_blocks * bs * D;
      // pass 1: scores[g, l] = q_g . k_l, reading each K row once
      attention_scores<scalar_t, kD>(qf.data(), group, D, k_head, v_head, rows.data(), L, scores.data());
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
      attention_values<scalar_t, kD>(scores.data(), group, D, v_head, rows.data(), L, acc.data());
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


// 3. Small-batch linear with bfloat16 weights: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), for decode steps.
// A decode step multiplies a few rows (M = the batch) by every weight matrix, so its time is the time to
// stream the weights from memory: half the bytes is twice the speed. The weights are kept in bfloat16 and
// widened to float32 in registers (exact: a bf16 value is the top half of a float32), the sums are float32.
// For a bf16 checkpoint run in float32 the result is the float32 linear's (up to the order of the sums).
//
// Layout: `bf16_pack` lays W out once as [ceil(N / 8), K, 8]: blocks of 8 weight rows, and in a block, for
// each input column k, the 8 rows' weights side by side (one register once widened). Then
// - a block is one sequential stream, read front to back and prefetched 2 KiB ahead (1 KiB was ~15% slower).
//   Read row by row from the plain [N, K] layout, the same sums streamed at ~10 GB/s on an AVX2 EPYC; packed,
//   at ~14-18 GB/s, about what a plain float32 sum reads there;
// - 8 outputs are one register: out[m, block] += x[m, k] (broadcast) * W[block, k], with no horizontal sums.
// Work: blocks split over the threads; each block is read from memory once and multiplied with every row of
// x (x stays in the cache). One row of x: four chains of sums over k (FMA latency), added at the end. More
// rows: two blocks (16 outputs) times 6 rows of x at a time (12 sums in registers); from 16 rows of x on, the
// two blocks are first widened to float32 once, and the tiles read floats from the cache (at 4-8 rows the
// widening cost more than it saved).
namespace {

constexpr int64_t kRows = 8;  // weight rows per block (one register of outputs)
constexpr int64_t kPrefetchBytes = 2048;  // how far ahead of its reads a block's stream is prefetched
constexpr int64_t kWidenRows = 16;  // from this many rows of x on, blocks are widened to float32 once

// out[m, n0 + r] = sums[r] + bias (rows past N are padding: skipped)
template <typename out_t>
inline void store_row(const float* sums, const float* bias, int64_t n0, int64_t N, out_t* out_row) {
  for (int64_t r = 0; r < kRows && n0 + r < N; ++r)
    out_row[n0 + r] = static_cast<out_t>(sums[r] + (bias ? bias[n0 + r] : 0.f));
}

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

// every row of x against kB consecutive blocks: 6 rows at a time, then 3, then 1
template <int kB, typename W_t, typename out_t>
inline void tiles(const float* x, int64_t M, int64_t K, const W_t* w, const float* bias, int64_t n0, int64_t N,
                  out_t* out) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) tile<6, kB>(x, m, K, w, bias, n0, N, out);
  for (; m + 3 <= M; m += 3) tile<3, kB>(x, m, K, w, bias, n0, N, out);
  for (; m < M; ++m) tile<1, kB>(x, m, K, w, bias, n0, N, out);
}
#endif

// Blocks [b, b + nb) (nb = 1 or 2; w: their nb * K * 8 bf16) against all M rows of x.
// wide: scratch for the blocks widened to float32 (2 * K * 8), used when enough rows of x share them.
template <typename out_t>
void gemv_blocks(const float* x, int64_t M, int64_t K, const c10::BFloat16* w, int64_t nb, const float* bias,
                 int64_t n0, int64_t N, out_t* out, float* wide) {
#ifdef NANOENGINE_AVX2
  if (M == 1) {
    for (int64_t b = 0; b < nb; ++b) block_1row(x, K, w + b * K * kRows, bias, n0 + b * kRows, N, out);
  } else if (M < kWidenRows) {
    if (nb == 2) tiles<2>(x, M, K, w, bias, n0, N, out);
    else tiles<1>(x, M, K, w, bias, n0, N, out);
  } else {  // widen once (streaming the blocks in with prefetch), then every tile reads floats
    const char* pf = reinterpret_cast<const char*>(w) + kPrefetchBytes;
    for (int64_t i = 0; i < nb * K * kRows; i += 8) {
      if (i % 32 == 0) _mm_prefetch(pf + i * 2, _MM_HINT_T0);
      _mm256_storeu_ps(wide + i, load_bf16x8(w + i));
    }
    if (nb == 2) tiles<2>(x, M, K, static_cast<const float*>(wide), bias, n0, N, out);
    else tiles<1>(x, M, K, static_cast<const float*>(wide), bias, n0, N, out);
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
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "bf16_linear: float32 or bfloat16 x, got ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1);
  const auto xf = x.to(at::kFloat).contiguous();  // a copy only for bf16 x (a few rows)
  at::Tensor bf;
  if (bias) bf = bias->to(at::kFloat).contiguous();
  auto out = at::empty({M, N}, x.options());
  const float* xp = xf.data_ptr<float>();
  const float* bp = bias ? bf.data_ptr<float>() : nullptr;
  const c10::BFloat16* wp = packed.data_ptr<c10::BFloat16>();
  const int64_t pairs = (blocks + 1) / 2;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "bf16_linear", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, pairs, 4, [&](int64_t begin, int64_t end) {  // each thread streams its share of W
      std::vector<float> wide(M >= kWidenRows ? 2 * K * kRows : 0);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t b = 2 * p, nb = std::min<int64_t>(2, blocks - b);
        gemv_blocks<scalar_t>(xp, M, K, wp + b * K * kRows, nb, bp, b * kRows, N, op, wide.data());
      }
    });
  });
  return out;
}

// 4. A decode step's decoder layers in one call: the CPU's analogue of replaying a CUDA graph (chapter 06).
// Op by op, a decode step of SmolLM2 makes ~20 calls from Python per layer (linears, norms, rotary, the
// K/V store, attention, views), each paying the interpreter and the dispatcher; at batch 1 that was a third
// of the step. `decode_layers` runs the same kernels, in the same order, on the same tensors, from C++: the
// result is bit for bit the layer-by-layer forward's (tests/test_kernels.py checks it), and Python is left
// with the embedding and the LM head. `nanoengine/models/fused_decode.py` builds its arguments once.
namespace {

struct Linear {  // one projection: a bf16_pack-ed copy (bf16_linear), else the plain weight (at::linear)
  c10::optional<at::Tensor> packed;
  at::Tensor weight;
  c10::optional<at::Tensor> bias;
  int64_t out_features = 0;
  at::Tensor operator()(const at::Tensor& x) const {
    return packed ? bf16_linear(x, *packed, bias, out_features) : at::linear(x, weight, bias);
  }
};

struct DecodeLayer {  // what one Llama/Qwen3 decoder layer needs for a decode step
  at::Tensor input_norm, post_norm;  // [hidden]
  c10::optional<at::Tensor> q_norm, k_norm;  // [head_dim]: Qwen3's per-head norms
  Linear qkv, o, gate_up, down;
  at::Tensor k_cache, v_cache;  // [kv_heads, blocks, block_size, head_dim]
};

// RMSNorm of per-head rows as nanoengine.layers.norm.RMSNorm runs it: the kernel on contiguous rows, else
// the eager ops (weight * rms_norm(x in float32), cast back)
at::Tensor head_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (x.is_contiguous()) return rms_norm(x, c10::nullopt, weight, eps)[0];
  return at::mul(weight, at::rms_norm(x.to(at::kFloat), {x.size(-1)}, c10::nullopt, eps).to(x.scalar_type()));
}

// k, v [B, kv_heads, D] (rows of D contiguous, any other strides) into the caches at their slots (-1: skip),
// the rows write_kv stores
void store_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const int64_t* slots) {
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
              "decode_layers: K/V rows and caches of one dtype");
  const int64_t B = k.size(0), H = k.size(1), D = k.size(2);
  const int64_t rows_per_head = k_cache.size(1) * k_cache.size(2), row_bytes = D * k.element_size();
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t es = k.element_size();
  for (int64_t t = 0; t < B; ++t) {
    if (slots[t] < 0) continue;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t row = (h * rows_per_head + slots[t]) * row_bytes;
      std::memcpy(kc + row, kp + (t * k.stride(0) + h * k.stride(1)) * es, row_bytes);
      std::memcpy(vc + row, vp + (t * v.stride(0) + h * v.stride(1)) * es, row_bytes);
    }
  }
}

using Clock = std::chrono::steady_clock;
inline double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

}  // namespace

// x [B, hidden]: the embeddings of one decode step's tokens (one per sequence) -> the final norm's output.
// times: float64 [2] or empty; when given, seconds in the linears and in attention (store + decode) are added.
at::Tensor decode_layers(const at::Tensor& x_in, const at::Tensor& positions, const at::Tensor& slot_mapping,
                         const at::Tensor& block_tables, const at::Tensor& context_lens,
                         const std::vector<DecodeLayer>& layers, const at::Tensor& final_norm,
                         const at::Tensor& cos_table, const at::Tensor& sin_table, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, double eps, double scale, at::Tensor times) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.is_contiguous(), "decode_layers: contiguous x [B, hidden]");
  TORCH_CHECK(positions.size(0) == x_in.size(0) && slot_mapping.size(0) == x_in.size(0) &&
                  block_tables.size(0) == x_in.size(0) && context_lens.size(0) == x_in.size(0),
              "decode_layers: one position, slot, block table and context length per token");
  const bool timed = times.defined() && times.numel() == 2;
  double linear_s = 0, attention_s = 0;
  const int64_t B = x_in.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  auto linear = [&](const Linear& lin, const at::Tensor& x) {
    if (!timed) return lin(x);
    const auto t0 = Clock::now();
    auto y = lin(x);
    linear_s += since(t0);
    return y;
  };
  at::Tensor x = x_in, residual;
  for (size_t i = 0; i < layers.size(); ++i) {
    const DecodeLayer& L = layers[i];
    at::Tensor h;
    if (i == 0) {
      residual = x;
      h = rms_norm(x, c10::nullopt, L.input_norm, eps)[0];
    } else {
      auto r = rms_norm(x, residual, L.input_norm, eps);
      h = r[0];
      residual = r[1];
    }
    auto qkv = linear(L.qkv, h);  // [B, q_size + 2 * kv_size]
    auto q = qkv.narrow(1, 0, q_size).view({B, num_heads, head_dim});
    auto k = qkv.narrow(1, q_size, kv_size).view({B, num_kv_heads, head_dim});
    auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({B, num_kv_heads, head_dim});
    if (L.q_norm) {
      q = head_norm(q, *L.q_norm, eps);
      k = head_norm(k, *L.k_norm, eps);
    }
    q = rotary(q, positions, cos_table, sin_table);
    k = rotary(k, positions, cos_table, sin_table);
    const auto t0 = Clock::now();
    store_kv(k, v, L.k_cache, L.v_cache, slot);
    auto attn = paged_decode(q, L.k_cache, L.v_cache, block_tables, context_lens, scale);  // [B, H, D]
    if (timed) attention_s += since(t0);
    auto o = linear(L.o, attn.view({B, q_size}));
    auto r = rms_norm(o, residual, L.post_norm, eps);
    residual = r[1];
    auto gate_up = linear(L.gate_up, r[0]);  // [B, 2 * intermediate]
    x = linear(L.down, silu_and_mul(gate_up));
  }
  auto out = rms_norm(x, residual, final_norm, eps)[0];
  if (timed) {
    times[0] += linear_s;
    times[1] += attention_s;
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention on CPU (reads K/V in place)");
  m.def("rms_norm", &rms_norm, "(residual +) RMSNorm: returns [normed] or [normed, residual sum]");
  m.def("rotary", &rotary, "rotary embedding of [T, heads, D] rows (a copy)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("bf16_pack", &bf16_pack, "lay a weight out for bf16_linear (bf16 blocks of 8 rows, column-major in a block)");
  m.def("bf16_linear", &bf16_linear, "x @ W^T (+ bias) with a bf16_pack-ed weight, float32 sums (small batches)");
  pybind11::class_<Linear>(m, "Linear")
      .def(pybind11::init<c10::optional<at::Tensor>, at::Tensor, c10::optional<at::Tensor>, int64_t>(), pybind11::arg("packed"),
           pybind11::arg("weight"), pybind11::arg("bias"), pybind11::arg("out_features"));
  pybind11::class_<DecodeLayer>(m, "DecodeLayer")
      .def(pybind11::init<at::Tensor, at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>, Linear,
                          Linear, Linear, Linear, at::Tensor, at::Tensor>(),
           pybind11::arg("input_norm"), pybind11::arg("post_norm"), pybind11::arg("q_norm"), pybind11::arg("k_norm"),
           pybind11::arg("qkv"), pybind11::arg("o"), pybind11::arg("gate_up"), pybind11::arg("down"),
           pybind11::arg("k_cache"), pybind11::arg("v_cache"));
  m.def("decode_layers", &decode_layers, "a decode step's decoder layers in one call (the same kernels, in order)");
}
