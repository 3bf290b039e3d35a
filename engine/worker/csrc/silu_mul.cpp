// SiLU(gate) * up of a gated MLP's fused gate/up product, one op: out[t, i] =
// silu(x[t, i]) * x[t, I + i] in float32, rounded once to x's dtype. torch takes two ops (silu,
// then mul_) of a pass each, and rounds the SiLU to bf16 before the product; this rounds only the
// result, so it is nearer the exact product, not bit for bit torch's.
// silu(g) = g * sigmoid(g). The plain loop takes sigmoid from e = exp(-|g|) (1 / (1 + e), or
// e / (1 + e) for g < 0) with std::exp. The vectorised loops take g / (1 + exp(-g)), with exp
// Cephes' polynomial (ops.h's exp16 and exp8, ~1 ulp), whose argument is held at 88.3, so
// 1 + e stays finite (256 x 1536 bf16 on 2 threads of a Xeon with AMX: 99 -> 79 us against
// exp(-|g|)'s form); the division is a reciprocal estimate refined by Newton steps (vdivps
// would take most of the loop's time). Below g = -88.3 the SiLU is ~0 (under 4e-37): the
// AVX-512 loop holds g there too (its reciprocal of 1 + e^88.3 is 2^-127, not 0: g 2^-127
// was -0.45 at g = -1e38), AVX2's vrcpps gives 0 past 2^126. Each element is computed by the
// same instructions whatever its row (a row's tail past the last whole vector runs masked in
// the AVX-512 loop, element by element in the AVX2 one, at the same columns in every row), so
// a row's result does not depend on the rows beside it (--deterministic).
// Registered as torch.ops.radixserve.silu_mul; built by engine/worker/cpu_kernels.py.

#include <ATen/Parallel.h>

#include <cmath>

#include "ops.h"

namespace {

using radixserve::to_float;

inline float silu_times(float g, float u) {
  const float e = std::exp(-std::fabs(g));
  return g * ((g >= 0.f ? 1.f : e) / (1.f + e)) * u;
}

template <typename T>
void silu_mul_row_each(const T* gate, const T* up, T* out, int64_t from, int64_t width) {
  for (int64_t i = from; i < width; ++i) {
    out[i] = static_cast<T>(silu_times(to_float(gate[i]), to_float(up[i])));
  }
}

#if defined(RADIXSERVE_AVX512) && defined(__AVX512BW__) && defined(__AVX512VL__)
// 1 / d for d in [1, 2^128): vrcp14ps and one Newton step (within 2 ulp), where vdivps would
// take most of the loop's time (one per 16 cycles).
inline __m512 reciprocal16(__m512 d) {
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
}

inline __m512 silu_times16(__m512 g, __m512 u) {
  // g held at -88.3 (a NaN kept: max_ps returns its second operand then): g / (1 + e^-g) of a
  // g far below would be g 2^-127, not ~0 (-0.45 at -1e38)
  g = _mm512_max_ps(_mm512_set1_ps(-88.3f), g);
  const __m512 e = radixserve::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_mul_ps(
      _mm512_mul_ps(g, reciprocal16(_mm512_add_ps(e, _mm512_set1_ps(1.f)))), u);
}

inline __m512 load16_masked(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16_masked(const c10::BFloat16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16_masked(const c10::Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

inline void store16_masked(__m512 v, float* p, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16_masked(__m512 v, c10::BFloat16* p, __mmask16 m) {
#if defined(__AVX512BF16__)
  const __m256bh packed = _mm512_cvtneps_pbh(v);
  _mm256_mask_storeu_epi16(p, m, reinterpret_cast<const __m256i&>(packed));
#else
  // nearest, ties to even, as c10::BFloat16 rounds (a NaN stays a NaN)
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc00000));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
#endif
}
inline void store16_masked(__m512 v, c10::Half* p, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t width) {
  const __mmask16 all = 0xffff;
  int64_t i = 0;
  for (; i + 32 <= width; i += 32) {  // two vectors a turn: their exp chains overlap
    const __m512 a = silu_times16(load16_masked(gate + i, all), load16_masked(up + i, all));
    const __m512 b =
        silu_times16(load16_masked(gate + i + 16, all), load16_masked(up + i + 16, all));
    store16_masked(a, out + i, all);
    store16_masked(b, out + i + 16, all);
  }
  for (; i < width; i += 16) {
    const __mmask16 m = width - i >= 16 ? __mmask16(0xffff)
                                        : __mmask16((1u << (width - i)) - 1u);
    store16_masked(silu_times16(load16_masked(gate + i, m), load16_masked(up + i, m)), out + i,
                   m);
  }
}
#elif defined(RADIXSERVE_AVX2)
// 1 / d for d in [1, 2^128): vrcpps (12 bits) and two Newton steps, where vdivps would take
// most of the loop's time (past 2^126 vrcpps gives 0, which the SiLU's ~0 takes as it is).
inline __m256 reciprocal8(__m256 d) {
  __m256 r = _mm256_rcp_ps(d);
  r = _mm256_mul_ps(r, _mm256_fnmadd_ps(d, r, _mm256_set1_ps(2.f)));
  return _mm256_mul_ps(r, _mm256_fnmadd_ps(d, r, _mm256_set1_ps(2.f)));
}

inline void store8(__m256 v, float* p) { _mm256_storeu_ps(p, v); }
inline void store8(__m256 v, c10::BFloat16* p) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  rounded = _mm256_castps_si256(_mm256_blendv_ps(
      _mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan));
  const __m256i high = _mm256_srli_epi32(rounded, 16);
  const __m128i packed =
      _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline void store8(__m256 v, c10::Half* p) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t width) {
  using radixserve::load8;
  int64_t i = 0;
  for (; i + 8 <= width; i += 8) {
    const __m256 g = load8(gate + i);
    const __m256 e = radixserve::exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 sigmoid = reciprocal8(_mm256_add_ps(e, _mm256_set1_ps(1.f)));
    store8(_mm256_mul_ps(_mm256_mul_ps(g, sigmoid), load8(up + i)), out + i);
  }
  silu_mul_row_each(gate, up, out, i, width);
}
#else
template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t width) {
  silu_mul_row_each(gate, up, out, 0, width);
}
#endif

template <typename T>
void run(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), width = out.size(1), stride = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // a grain of rows whose elements fill a few pages: a decode step's rows stay on one thread
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      silu_mul_row(xp + r * stride, xp + r * stride + width, op + r * width, width);
    }
  });
}

at::Tensor silu_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && (x.stride(1) == 1 || x.size(1) <= 1),
              "silu_mul: rows [N, 2 * width] with contiguous rows expected, got ", x.sizes());
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat:
      run<float>(x, out);
      break;
    case at::kBFloat16:
      run<c10::BFloat16>(x, out);
      break;
    case at::kHalf:
      run<c10::Half>(x, out);
      break;
    default:
      TORCH_CHECK(false, "silu_mul: unsupported dtype ", x.scalar_type());
  }
  return out;
}

}  // namespace

RADIXSERVE_OPS_FRAGMENT(m) { m.def("silu_mul(Tensor x) -> Tensor"); }

RADIXSERVE_OPS_IMPL(m) { m.impl("silu_mul", &silu_mul); }
