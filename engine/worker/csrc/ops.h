// Shared by the compiled CPU kernels (engine/worker/cpu_kernels.py builds them into one library).
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && !defined(RADIXSERVE_PORTABLE)
#include <immintrin.h>
#define RADIXSERVE_AVX512 1
#endif

// The portable build (tests) registers its ops under a name of its own, so that both builds
// can load into one process.
#ifdef RADIXSERVE_PORTABLE
#define RADIXSERVE_OPS_FRAGMENT(m) TORCH_LIBRARY_FRAGMENT(radixserve_portable, m)
#define RADIXSERVE_OPS_IMPL(m) TORCH_LIBRARY_IMPL(radixserve_portable, CPU, m)
#else
#define RADIXSERVE_OPS_FRAGMENT(m) TORCH_LIBRARY_FRAGMENT(radixserve, m)
#define RADIXSERVE_OPS_IMPL(m) TORCH_LIBRARY_IMPL(radixserve, CPU, m)
#endif

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

// int8 KV rows (engine/worker/kv_quant.py): head_dim int8 values, then their float16 scale.
constexpr int64_t kScaleBytes = 2;

inline float row_scale(const int8_t* row, int64_t head_dim) {
  c10::Half scale;
  std::memcpy(&scale, row + head_dim, kScaleBytes);
  return static_cast<float>(scale);
}

// Symmetric quantization of one row x[0..D) into dst (D int8 values, then the scale), as
// kv_quant.quantize computes it: scale = fp16(max |x| / 127), q = round-half-even(x / scale).
template <typename T>
inline void quantize_row(const T* x, int64_t D, int8_t* dst) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(to_float(x[d])));
  const c10::Half scale(std::min(amax / 127.f, 65504.f));
  const float divisor = static_cast<float>(scale);
  for (int64_t d = 0; d < D; ++d) {
    const float q = divisor > 0.f ? std::nearbyint(to_float(x[d]) / divisor) : 0.f;
    dst[d] = static_cast<int8_t>(std::min(std::max(q, -127.f), 127.f));
  }
  std::memcpy(dst + D, &scale, kScaleBytes);
}

}  // namespace radixserve
