// The activations of a quantized linear layer (quant_linear.cpp), quantized per row and block
// of 32 as x = dx * qx, qx in -127..127 (llama.cpp's Q8 activations), with two digits the
// rounding left by the first in 254ths of a step as a second int8 digit.
#pragma once

#include <ATen/Parallel.h>

#include <vector>

#include "quant_layout.h"

namespace radixserve::quant {

using radixserve::to_float;

// The second digit's weight: the first digit's step over kDigit2.
constexpr int32_t kDigit2 = 254;

// The activations, quantized once per call: per row K int8 values (and with two digits, K
// second digits), and per block the scale (two digits: over kDigit2), the exact float sum of x
// (the minimums) and the sum of qx (what offset weights' products exceed the true ones by,
// over their offset; both digits, as the integer kDigit2 * qx + qx2 their products add up to).
struct Activations {
  std::vector<int8_t> q, q2;
  std::vector<float> scale, sum;
  std::vector<int32_t> qsum, qsum_low;  // qsum_low: of the block's first 16 values
  int64_t K, blocks;
  bool two;  // the second digits are there

  // What offset-``offset`` weights' integer sum of half h of block ``at`` (Halves 2), or of
  // the whole block, exceeds the true one by.
  template <int Halves>
  int32_t excess_of(int64_t at, int h, int offset) const {
    if (Halves == 1) return offset * qsum[at];
    return offset * (h == 0 ? qsum_low[at] : qsum[at] - qsum_low[at]);
  }
};

template <typename T>
Activations quantize_activations(const T* x, int64_t x_row, int64_t M, int64_t K, bool two) {
  Activations a;
  a.K = K;
  a.blocks = K / kBlock;
  a.two = two;
  a.q.resize(M * K);
  if (two) a.q2.resize(M * K);
  a.scale.resize(M * a.blocks);
  a.sum.resize(M * a.blocks);
  a.qsum.resize(M * a.blocks);
  a.qsum_low.resize(M * a.blocks);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    float values[kBlock];
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < a.blocks; ++b) {
        const T* xb = x + m * x_row + b * kBlock;
        float amax = 0.f, sum = 0.f;
#pragma omp simd reduction(max : amax) reduction(+ : sum)
        for (int64_t e = 0; e < kBlock; ++e) {
          values[e] = to_float(xb[e]);
          amax = std::max(amax, std::fabs(values[e]));
          sum += values[e];
        }
        const float inverse = amax > 0.f ? 127.f / amax : 0.f, step = amax / 127.f;
        int8_t* qb = a.q.data() + m * K + b * kBlock;
        int32_t qsum = 0, qlow = 0;
#pragma omp simd reduction(+ : qsum)
        for (int64_t e = 0; e < kBlock; ++e) {
          qb[e] = static_cast<int8_t>(std::nearbyint(values[e] * inverse));
          qsum += qb[e];
        }
        for (int64_t e = 0; e < kBlock / 2; ++e) qlow += qb[e];
        if (two) {
          int8_t* q2 = a.q2.data() + m * K + b * kBlock;
          const float inverse2 = inverse * kDigit2;
          int32_t qsum2 = 0, qlow2 = 0;
          for (int64_t e = 0; e < kBlock; ++e) {
            const float left = std::fma(-static_cast<float>(qb[e]), step, values[e]);
            q2[e] = static_cast<int8_t>(
                std::clamp(std::nearbyint(left * inverse2), -127.f, 127.f));
            qsum2 += q2[e];
            if (e < kBlock / 2) qlow2 += q2[e];
          }
          qsum = qsum * kDigit2 + qsum2;
          qlow = qlow * kDigit2 + qlow2;
        }
        a.scale[m * a.blocks + b] = two ? step / kDigit2 : step;
        a.sum[m * a.blocks + b] = sum;
        a.qsum[m * a.blocks + b] = qsum;
        a.qsum_low[m * a.blocks + b] = qlow;
      }
    }
  });
  return a;
}

}  // namespace radixserve::quant
