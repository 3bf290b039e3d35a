// A measurement probe, not an engine kernel: scripts/bench_int8_linear.py builds it (with
// engine/worker/csrc/ops.h) to time a whole int8 form of the projections, quantization
// included, against the resident bf16 GEMM. A linear layer's product in int8 on oneDNN's brgemm
// micro-kernel (AMX int8 tiles where the CPU has them: torch's at::native::cpublas::brgemm).
// The weight is int8 per output row (its largest |w| over 127: `w_scales`), laid out
// [N / 64, K / 4, 64, 4] (blocks of 64 output rows, VNNI groups of 4 along K). Each call:
//
//   outliers > 0: the `outliers` columns of x with the largest |x| over the call's rows stay
//                 bf16 and multiply the weight's int8 values there (exact in bf16) in the
//                 epilogue (AVX-512 BF16 pair dot products, float32 sums)
//   the rest of each row quantized to int8 under its own scale (largest |x| over 127);
//   digits == 2: the row's rounding remainder quantized again under a second scale, and
//                multiplied too (x ~ s1 q1 + s2 q2)
//   out[m, n] = bf16((s1[m] C1[m, n] + s2[m] C2[m, n] + O[m, n]) w_scales[n])
//
// Work item = a tile of kRowTile rows and one block of kColTile output columns; its int32 sums
// stay in the thread's scratch and the epilogue writes the bf16 output once.

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "ops.h"  // engine/worker/csrc

namespace radixserve::int8 {

constexpr int64_t kRowTile = 128;
constexpr int64_t kColTile = 64;  // the weight's column block: [N / 64][K / 4][64][4]
constexpr int64_t kOutlierPad = 32;  // outlier columns at most (a row's bf16 values, 0 past)

#if defined(RADIXSERVE_AVX512) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(CPUBLAS_BRGEMM_I8I8I32)
#define RADIXSERVE_INT8_LINEAR 1
using Bf16 = c10::BFloat16;
using radixserve::load16;

// What one call computes before its products, kept by the calling thread between calls (a
// step's layers would otherwise take fresh pages for them every call).
struct Prepared {
  std::vector<int8_t> a;     // [digits][M][K], the outlier columns 0
  std::vector<float> scale;  // [digits][M]
  std::vector<Bf16> xo;      // [M][kOutlierPad], the outlier columns' values
  std::vector<float> colmax;
  std::vector<int64_t> columns;
};

struct Scratch {
  std::vector<int32_t> c1, c2;
  std::vector<Bf16> wo;  // the outlier columns' weights, [kOutlierPad / 2][kColTile][2]
  Scratch() : c1(kRowTile * kColTile), c2(kRowTile * kColTile), wo(kOutlierPad * kColTile) {}
};

inline void store16(Bf16* dst, __m512 v) {
  const __m256bh packed = _mm512_cvtneps_pbh(v);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), reinterpret_cast<const __m256i&>(packed));
}

inline float absmax(const float* v, int64_t n) {
  __m512 m = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(v + i)));
  return _mm512_reduce_max_ps(m);
}

// q = round(v * 127 / max) (to nearest, ties to even); returns the scale max / 127 (0: all 0).
inline float quantize(const float* v, int64_t n, int8_t* q) {
  const float top = absmax(v, n);
  if (top == 0.f) {
    std::fill(q, q + n, int8_t{0});
    return 0.f;
  }
  const __m512 inverse = _mm512_set1_ps(127.f / top);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512i r = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + i), inverse),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(r));
  }
  return top / 127.f;
}

void prepare(Prepared& p, const Bf16* x, const int8_t* w, int64_t M, int64_t N, int64_t K,
             int64_t outliers, int64_t digits) {
  p.a.resize(digits * M * K);
  p.scale.resize(digits * M);
  p.columns.clear();
  if (outliers > 0) {
    // each column's largest |x| over the rows, 16 columns a work item
    p.colmax.assign(K, 0.f);
    at::parallel_for(0, K / 16, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        __m512 m = _mm512_setzero_ps();
        for (int64_t r = 0; r < M; ++r)
          m = _mm512_max_ps(m, _mm512_abs_ps(load16(x + r * K + c * 16)));
        _mm512_storeu_ps(p.colmax.data() + c * 16, m);
      }
    });
    std::vector<int64_t> order(K);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + outliers, order.end(),
                      [&](int64_t a, int64_t b) {
                        return p.colmax[a] > p.colmax[b] || (p.colmax[a] == p.colmax[b] && a < b);
                      });
    p.columns.assign(order.begin(), order.begin() + outliers);
    std::sort(p.columns.begin(), p.columns.end());
    p.xo.assign(M * kOutlierPad, Bf16(0.f));
  }
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(K), rest(K);
    for (int64_t m = begin; m < end; ++m) {
      const Bf16* xr = x + m * K;
      for (int64_t i = 0; i < K; i += 16) _mm512_storeu_ps(row.data() + i, load16(xr + i));
      for (size_t j = 0; j < p.columns.size(); ++j) {
        p.xo[m * kOutlierPad + j] = xr[p.columns[j]];
        row[p.columns[j]] = 0.f;
      }
      int8_t* q1 = p.a.data() + m * K;
      const float s1 = quantize(row.data(), K, q1);
      p.scale[m] = s1;
      if (digits == 2) {
        const __m512 step = _mm512_set1_ps(s1);
        for (int64_t i = 0; i < K; i += 16) {
          const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(q1 + i))));
          _mm512_storeu_ps(rest.data() + i,
                           _mm512_fnmadd_ps(q, step, _mm512_loadu_ps(row.data() + i)));
        }
        p.scale[M + m] = quantize(rest.data(), K, p.a.data() + (M + m) * K);
      }
    }
  });
}

void tile(const Prepared& p, Scratch& s, const int8_t* w, const float* w_scales, Bf16* out,
          int64_t M, int64_t N, int64_t K, int64_t digits, int64_t m0, int64_t n0) {
  const int64_t rows = std::min(kRowTile, M - m0), cols = std::min(kColTile, N - n0);
  const bool outliers = !p.columns.empty();
  const int8_t* wb = w + n0 * K;  // the column block's, contiguous
  const int64_t npairs = (static_cast<int64_t>(p.columns.size()) + 1) / 2;
  if (outliers) {
    // the block's weights in the outlier columns, as bf16 pairs (exact: int8 values), pair j
    // of column n at wo[(j * kColTile + n) * 2]: column c's byte c % 4 of each 32-bit lane
    auto widened = [&](int64_t j, int64_t n) {
      if (j >= static_cast<int64_t>(p.columns.size())) return _mm512_setzero_si512();
      const int64_t c = p.columns[j];
      const __m512i v = _mm512_loadu_si512(wb + (c / 4) * kColTile * 4 + n * 4);
      const __m512i value = _mm512_srai_epi32(_mm512_slli_epi32(v, 8 * (3 - c % 4)), 24);
      return _mm512_castps_si512(_mm512_cvtepi32_ps(value));
    };
    for (int64_t j = 0; j < npairs; ++j)
      for (int64_t n = 0; n < kColTile; n += 16) {
        const __m512i pair = _mm512_or_si512(
            _mm512_and_si512(widened(2 * j + 1, n), _mm512_set1_epi32(0xFFFF0000)),
            _mm512_srli_epi32(widened(2 * j, n), 16));
        _mm512_storeu_si512(s.wo.data() + (j * kColTile + n) * 2, pair);
      }
  }
  at::native::cpublas::brgemm(rows, cols, K, K, kColTile, kColTile, false, p.a.data() + m0 * K,
                              wb, s.c1.data());
  if (digits == 2)
    at::native::cpublas::brgemm(rows, cols, K, K, kColTile, kColTile, false,
                                p.a.data() + (M + m0) * K, wb, s.c2.data());
  // kColTile / 16 accumulators a row, independent chains through the outlier products
  static_assert(kColTile == 64, "the epilogue holds a row's 64 columns in 4 registers");
  const float* ws = w_scales + n0;
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 s1 = _mm512_set1_ps(p.scale[m0 + r]);
    const __m512 s2 = _mm512_set1_ps(digits == 2 ? p.scale[M + m0 + r] : 0.f);
    const int32_t* c1 = s.c1.data() + r * kColTile;
    const int32_t* c2 = s.c2.data() + r * kColTile;
    __m512 acc[4];
    for (int64_t i = 0; i < 4; ++i) {
      acc[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(c1 + 16 * i)), s1);
      if (digits == 2)
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(c2 + 16 * i)), s2,
                                 acc[i]);
    }
    const Bf16* xo = p.xo.data() + (m0 + r) * kOutlierPad;
    for (int64_t j = 0; j < npairs; ++j) {
      uint32_t pair;
      std::memcpy(&pair, xo + 2 * j, 4);
      const __m512bh x2 = (__m512bh)_mm512_set1_epi32(pair);
      const Bf16* wo = s.wo.data() + j * kColTile * 2;
      for (int64_t i = 0; i < 4; ++i)
        acc[i] = _mm512_dpbf16_ps(acc[i], x2, (__m512bh)_mm512_loadu_si512(wo + 32 * i));
    }
    Bf16* dst = out + (m0 + r) * N + n0;
    for (int64_t i = 0; i < 4; ++i)
      store16(dst + 16 * i, _mm512_mul_ps(acc[i], _mm512_loadu_ps(ws + 16 * i)));
  }
}
#endif

bool int8_linear_available() {
#ifdef RADIXSERVE_INT8_LINEAR
  // the same check as extend_attention's: oneDNN's micro-kernel on AMX (int8 and bf16 tiles)
  return at::native::cpublas::could_pack(at::kBFloat16);
#else
  return false;
#endif
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& w_scales,
                       int64_t outliers, int64_t digits) {
  TORCH_CHECK(int8_linear_available(),
              "int8_linear: this build or CPU has no int8 brgemm on AMX (see "
              "int8_linear_available)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "int8_linear: contiguous bf16 rows expected");
  TORCH_CHECK(weight.dim() == 4 && weight.size(2) == kColTile && weight.size(3) == 4 &&
                  weight.scalar_type() == at::kChar && weight.is_contiguous(),
              "int8_linear: an int8 weight laid out [N / 64, K / 4, 64, 4] expected");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0) * kColTile;
  TORCH_CHECK(weight.size(1) * 4 == K, "int8_linear: the weight's K is ", weight.size(1) * 4,
              ", the rows' ", K);
  TORCH_CHECK(K % 16 == 0 && N % kColTile == 0, "int8_linear: K a multiple of 16 and N of ",
              kColTile, " expected");
  TORCH_CHECK(w_scales.scalar_type() == at::kFloat && w_scales.numel() == N &&
                  w_scales.is_contiguous(),
              "int8_linear: one float32 scale per output row expected");
  TORCH_CHECK(outliers >= 0 && outliers <= std::min<int64_t>(kOutlierPad, K),
              "int8_linear: outliers must lie in [0, ", kOutlierPad, "]");
  TORCH_CHECK(digits == 1 || digits == 2, "int8_linear: digits must be 1 or 2");
  auto out = at::empty({M, N}, x.options());
#ifdef RADIXSERVE_INT8_LINEAR
  if (M == 0) return out;
  // the calling thread's; the pool's threads read it through this reference (a thread_local
  // named in the lambda would be each pool thread's own)
  thread_local Prepared kept;
  Prepared& p = kept;
  const auto* w = weight.data_ptr<int8_t>();
  prepare(p, x.data_ptr<Bf16>(), w, M, N, K, outliers, digits);
  const int64_t row_tiles = (M + kRowTile - 1) / kRowTile;
  const int64_t items = row_tiles * ((N + kColTile - 1) / kColTile);
  // column tiles outermost: a thread's consecutive items share a weight tile
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch scratch;
    for (int64_t i = begin; i < end; ++i)
      tile(p, scratch, w, w_scales.data_ptr<float>(), out.data_ptr<Bf16>(), M, N, K, digits,
           (i % row_tiles) * kRowTile, (i / row_tiles) * kColTile);
    at::native::cpublas::brgemm_release();
  });
#endif
  return out;
}

}  // namespace radixserve::int8

RADIXSERVE_OPS_FRAGMENT(m) {
  m.def("int8_linear(Tensor x, Tensor weight, Tensor w_scales, int outliers, int digits) -> "
        "Tensor");
  m.def("int8_linear_available() -> bool", &radixserve::int8::int8_linear_available);
}

RADIXSERVE_OPS_IMPL(m) { m.impl("int8_linear", &radixserve::int8::int8_linear); }
