// RMSNorm of rows, one op: out = weight * normalize(x), the normalisation in float32 (sum of
// squares, 1 / sqrt(mean + eps)). With a float32 weight the product is float32; with a bf16 or
// fp16 weight the normalised row is rounded to the weight's dtype first and the product taken
// there, as transformers' LlamaRMSNorm does (weight * hidden.to(input_dtype)). In torch that is
// four to six ops of ~10 us each on CPU; here ~1 us for a decode step's rows.
// add_rms_norm adds a projection's rows (any dtype) into the float32 residual stream in place
// and returns that sum's RMSNorm: torch's mixed-dtype add_ and this op's norm, in one pass and
// with the same arithmetic (a float32 sum, then normalize_row), bit for bit.
// Registered as torch.ops.radixserve.rms_norm and add_rms_norm; built by
// engine/worker/cpu_kernels.py.

#include <ATen/Parallel.h>

#include <cmath>

#include "ops.h"

namespace {

using radixserve::to_float;

// A float32 row's sum of squares in one order whatever the row's address or the caller it would
// be inlined into (one body, no alignment peeling), so that rms_norm over a sum and add_rms_norm
// agree bit for bit: 16 (AVX-512) or 8 (AVX2) partial sums, a fixed horizontal sum, the tail in
// order.
__attribute__((noinline)) float sum_of_squares(const float* xr, int64_t hidden) {
  int64_t d = 0;
  float squares = 0.f;
#if defined(RADIXSERVE_AVX512)
  __m512 squares16 = _mm512_setzero_ps();
  for (; d + 16 <= hidden; d += 16) {
    const __m512 v = _mm512_loadu_ps(xr + d);
    squares16 = _mm512_fmadd_ps(v, v, squares16);
  }
  squares = _mm512_reduce_add_ps(squares16);
#elif defined(RADIXSERVE_AVX2)
  __m256 squares8 = _mm256_setzero_ps();
  for (; d + 8 <= hidden; d += 8) {
    const __m256 v = _mm256_loadu_ps(xr + d);
    squares8 = _mm256_fmadd_ps(v, v, squares8);
  }
  __m128 four = _mm_add_ps(_mm256_castps256_ps128(squares8), _mm256_extractf128_ps(squares8, 1));
  four = _mm_add_ps(four, _mm_movehl_ps(four, four));
  squares = _mm_cvtss_f32(_mm_add_ss(four, _mm_movehdup_ps(four)));
#endif
  for (; d < hidden; ++d) squares += xr[d] * xr[d];
  return squares;
}

template <typename X, typename W>
inline void normalize_row(const X* xr, const W* weight, W* outr, int64_t hidden, float eps) {
  float squares = 0.f;
  if constexpr (std::is_same_v<X, float>) {
    squares = sum_of_squares(xr, hidden);
  } else {
#pragma omp simd reduction(+ : squares)
    for (int64_t d = 0; d < hidden; ++d) {
      const float v = to_float(xr[d]);
      squares += v * v;
    }
  }
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
  for (int64_t d = 0; d < hidden; ++d) {
    const float normed = to_float(xr[d]) * inv;
    if constexpr (std::is_same_v<W, float>) {
      outr[d] = weight[d] * normed;
    } else {
      outr[d] = static_cast<W>(to_float(weight[d]) * to_float(static_cast<W>(normed)));
    }
  }
}

#if defined(RADIXSERVE_AVX512) && defined(__AVX512BF16__)
// bf16 weights over float32 rows (the residual stream's norms), 16 lanes at a time: the same
// sum of squares and the same two roundings to nearest even (vcvtneps2bf16) as the loop above.
template <>
inline void normalize_row<float, c10::BFloat16>(const float* xr, const c10::BFloat16* weight,
                                                c10::BFloat16* outr, int64_t hidden,
                                                float eps) {
  const float squares = sum_of_squares(xr, hidden);
  int64_t d = 0;
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
  const __m512 inv16 = _mm512_set1_ps(inv);
  d = 0;
  for (; d + 16 <= hidden; d += 16) {
    const __m256bh normed = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(xr + d), inv16));
    const __m512 widened = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(normed)), 16));
    const __m256bh out = _mm512_cvtneps_pbh(_mm512_mul_ps(radixserve::load16(weight + d), widened));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(outr + d),
                        reinterpret_cast<const __m256i&>(out));
  }
  for (; d < hidden; ++d) {
    const float normed = xr[d] * inv;
    outr[d] = static_cast<c10::BFloat16>(to_float(weight[d]) *
                                         to_float(static_cast<c10::BFloat16>(normed)));
  }
}
#endif

template <typename X, typename W>
void rms_norm_rows(const X* x, int64_t row_stride, const W* weight, W* out, int64_t rows,
                   int64_t hidden, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      normalize_row(x + r * row_stride, weight, out + r * hidden, hidden, eps);
    }
  });
}

template <typename X>
inline void add_row(float* row, const X* xr, int64_t hidden) {
  int64_t d = 0;
#ifdef RADIXSERVE_AVX512
  for (; d + 16 <= hidden; d += 16) {
    _mm512_storeu_ps(row + d, _mm512_add_ps(_mm512_loadu_ps(row + d), radixserve::load16(xr + d)));
  }
#endif
  for (; d < hidden; ++d) row[d] += to_float(xr[d]);
}

template <typename X, typename W>
void add_rms_norm_rows(float* residual, int64_t residual_stride, const X* x, int64_t x_stride,
                       const W* weight, W* out, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = residual + r * residual_stride;
      add_row(row, x + r * x_stride, hidden);
      normalize_row(row, weight, out + r * hidden, hidden, eps);
    }
  });
}

template <typename X>
void dispatch_weight(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, float eps) {
  const X* xp = x.data_ptr<X>();
  const int64_t rows = x.size(0), hidden = x.size(1), stride = x.stride(0);
  switch (weight.scalar_type()) {
    case at::kFloat:
      return rms_norm_rows(xp, stride, weight.data_ptr<float>(), out.data_ptr<float>(), rows,
                           hidden, eps);
    case at::kBFloat16:
      return rms_norm_rows(xp, stride, weight.data_ptr<c10::BFloat16>(),
                           out.data_ptr<c10::BFloat16>(), rows, hidden, eps);
    case at::kHalf:
      return rms_norm_rows(xp, stride, weight.data_ptr<c10::Half>(), out.data_ptr<c10::Half>(),
                           rows, hidden, eps);
    default:
      TORCH_CHECK(false, "rms_norm: unsupported weight dtype ", weight.scalar_type());
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && (x.stride(1) == 1 || x.size(1) == 1), "rms_norm: rows [N, hidden] with contiguous "
              "rows expected");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1),
              "rms_norm: weight [hidden] expected");
  auto out = at::empty(x.sizes(), weight.options());
  const float eps_f = static_cast<float>(eps);
  switch (x.scalar_type()) {
    case at::kFloat:
      dispatch_weight<float>(x, weight, out, eps_f);
      break;
    case at::kBFloat16:
      dispatch_weight<c10::BFloat16>(x, weight, out, eps_f);
      break;
    case at::kHalf:
      dispatch_weight<c10::Half>(x, weight, out, eps_f);
      break;
    default:
      TORCH_CHECK(false, "rms_norm: unsupported input dtype ", x.scalar_type());
  }
  return out;
}

template <typename X, typename W>
void add_rms_norm_typed(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight,
                        at::Tensor& out, float eps) {
  add_rms_norm_rows(residual.data_ptr<float>(), residual.stride(0), x.data_ptr<X>(),
                    x.stride(0), weight.data_ptr<W>(), out.data_ptr<W>(), residual.size(0),
                    residual.size(1), eps);
}

template <typename X>
void add_rms_norm_weight(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight,
                         at::Tensor& out, float eps) {
  switch (weight.scalar_type()) {
    case at::kFloat:
      return add_rms_norm_typed<X, float>(residual, x, weight, out, eps);
    case at::kBFloat16:
      return add_rms_norm_typed<X, c10::BFloat16>(residual, x, weight, out, eps);
    case at::kHalf:
      return add_rms_norm_typed<X, c10::Half>(residual, x, weight, out, eps);
    default:
      TORCH_CHECK(false, "add_rms_norm: unsupported weight dtype ", weight.scalar_type());
  }
}

at::Tensor add_rms_norm(at::Tensor residual, const at::Tensor& x, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(residual.dim() == 2 && residual.scalar_type() == at::kFloat &&
                  (residual.stride(1) == 1 || residual.size(1) <= 1),
              "add_rms_norm: a float32 residual [N, hidden] with contiguous rows expected");
  TORCH_CHECK(x.sizes() == residual.sizes() && (x.stride(1) == 1 || x.size(1) <= 1),
              "add_rms_norm: x ", x.sizes(), " must match the residual ", residual.sizes(),
              " with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1),
              "add_rms_norm: weight [hidden] expected");
  auto out = at::empty(x.sizes(), weight.options());
  const float eps_f = static_cast<float>(eps);
  switch (x.scalar_type()) {
    case at::kFloat:
      add_rms_norm_weight<float>(residual, x, weight, out, eps_f);
      break;
    case at::kBFloat16:
      add_rms_norm_weight<c10::BFloat16>(residual, x, weight, out, eps_f);
      break;
    case at::kHalf:
      add_rms_norm_weight<c10::Half>(residual, x, weight, out, eps_f);
      break;
    default:
      TORCH_CHECK(false, "add_rms_norm: unsupported input dtype ", x.scalar_type());
  }
  return out;
}

}  // namespace

RADIXSERVE_OPS_FRAGMENT(m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
}

RADIXSERVE_OPS_IMPL(m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
