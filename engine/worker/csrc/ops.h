// Shared by the compiled CPU kernels (engine/worker/cpu_kernels.py builds them into one library).
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// The vectorised loops a build has: AVX-512 (16 lanes) where the compiler targets it, AVX2 with
// FMA and F16C (8 lanes) on the CPUs without it (AMD before Zen 4, Intel client cores), plain
// C++ in the portable build. An AVX-512 build has the AVX2 loops too, for what runs 8-wide on
// both (quantize_row) and for head sizes that are multiples of 8 but not of 16.
#if !defined(RADIXSERVE_PORTABLE)
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RADIXSERVE_AVX2 1
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#define RADIXSERVE_AVX512 1
#endif
#endif

// Each build registers its ops under a name of its own (cpu_kernels.ops_namespace: radixserve
// for the engine's, e.g. radixserve_portable for those the tests load beside it), so that all of
// them can load into one process.
#ifndef RADIXSERVE_OPS_NAMESPACE
#define RADIXSERVE_OPS_NAMESPACE radixserve
#endif
#define RADIXSERVE_OPS_FRAGMENT(m) TORCH_LIBRARY_FRAGMENT(RADIXSERVE_OPS_NAMESPACE, m)
#define RADIXSERVE_OPS_IMPL(m) TORCH_LIBRARY_IMPL(RADIXSERVE_OPS_NAMESPACE, CPU, m)

namespace radixserve {

inline float bits_to_float(uint32_t bits) {
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}
inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return bits_to_float(static_cast<uint32_t>(x.x) << 16); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(int8_t x) { return static_cast<float>(x); }

#ifdef RADIXSERVE_AVX2
// to_float, 8 values at a time.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline float max_lanes8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
inline float sum_lanes8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// exp(x), 8 lanes at a time: Cephes' expf (range reduction by ln 2, degree-6 polynomial,
// ~1 ulp), x clamped to [-87.3, 88.3] (paged_decode.cpp's exp_block, vectorised).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 fx = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(fx, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(_mm256_mul_ps(y, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i pow2 = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2));
}
#endif

#ifdef RADIXSERVE_AVX512
// to_float, 16 values at a time.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// exp(x) as exp8 above, 16 lanes at a time.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 fx = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(fx, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(_mm512_mul_ps(y, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i pow2 = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(pow2));
}
#endif

// int8 KV rows (engine/worker/kv_quant.py): head_dim int8 values, then their float16 scale.
constexpr int64_t kScaleBytes = 2;

inline float row_scale(const int8_t* row, int64_t head_dim) {
  c10::Half scale;
  std::memcpy(&scale, row + head_dim, kScaleBytes);
  return static_cast<float>(scale);
}

// Symmetric quantization of one row x[0..D) into dst (D int8 values, then the scale), as
// kv_quant.quantize computes it: scale = fp16(max |x| / 127), q = round-half-even(x / scale).
// The AVX2 loops (8 values at a time, in AVX-512 builds too) round as the plain ones do: the
// same division, ties to even; a maximum does not depend on its order.
template <typename T>
inline void quantize_row(const T* x, int64_t D, int8_t* dst) {
  float amax = 0.f;
  int64_t d = 0;
#ifdef RADIXSERVE_AVX2
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 amax8 = _mm256_setzero_ps();
  for (; d + 8 <= D; d += 8) amax8 = _mm256_max_ps(_mm256_and_ps(load8(x + d), magnitude), amax8);
  amax = max_lanes8(amax8);
#endif
  for (; d < D; ++d) amax = std::max(amax, std::fabs(to_float(x[d])));
  const c10::Half scale(std::min(amax / 127.f, 65504.f));
  const float divisor = static_cast<float>(scale);
  d = 0;
#ifdef RADIXSERVE_AVX2
  if (divisor > 0.f) {
    const __m256 divisor8 = _mm256_set1_ps(divisor);
    for (; d + 8 <= D; d += 8) {
      __m256 q = _mm256_round_ps(_mm256_div_ps(load8(x + d), divisor8),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q = _mm256_min_ps(_mm256_max_ps(q, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f));
      const __m256i q32 = _mm256_cvtps_epi32(q);
      const __m128i q16 =
          _mm_packs_epi32(_mm256_castsi256_si128(q32), _mm256_extracti128_si256(q32, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + d), _mm_packs_epi16(q16, q16));
    }
  }
#endif
  for (; d < D; ++d) {
    const float q = divisor > 0.f ? std::nearbyint(to_float(x[d]) / divisor) : 0.f;
    dst[d] = static_cast<int8_t>(std::min(std::max(q, -127.f), 127.f));
  }
  std::memcpy(dst + D, &scale, kScaleBytes);
}

}  // namespace radixserve
