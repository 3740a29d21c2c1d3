// nanoengine's CPU kernels (chapter 06): the helpers every kernel family shares, included by each csrc/*.cpp.
// Reading an element as float32 and rounding back (to_float, round_to), and, where the compiler targets AVX2 +
// FMA, loading 8 floats (or 8 bf16 widened to floats) into one register and summing a register's lanes. All
// inline in namespace nanoengine: every file is compiled with the same flags, so each helper has one definition.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

// AVX2 + FMA (8 floats per register) where the compiler targets them (-march=native); plain loops otherwise.
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define NANOENGINE_AVX2 1
#endif
// AVX-512 (16 floats per register; F + BW), and its dot-product extensions where the compiler targets them:
// AVX512-BF16 (`vdpbf16ps`: pairs of bf16 products summed into float32) and AVX512-VNNI (`vpdpbusd`: four
// u8 x s8 products summed into int32). Each kernel that uses them also keeps a plain path (and, where it has
// one, an AVX2 path) that a `path` argument can force, so one machine tests every path it can run.
// AVX-VNNI: `vpdpbusd` on 256-bit registers (CPUs with it but without AVX-512's: Alder Lake, for one).
#if defined(NANOENGINE_AVX2) && defined(__AVXVNNI__)
#define NANOENGINE_AVXVNNI 1
#endif
#if defined(NANOENGINE_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__)
#define NANOENGINE_AVX512 1
#if defined(__AVX512BF16__)
#define NANOENGINE_AVX512BF16 1
#endif
#if defined(__AVX512VNNI__)
#define NANOENGINE_AVX512VNNI 1
#endif
#endif

namespace nanoengine {

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

template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }  // float -> T (bf16: round to nearest even)

}  // namespace nanoengine
