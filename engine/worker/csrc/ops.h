// Shared by the compiled CPU kernels (engine/worker/cpu_kernels.py builds them into one library).
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

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

}  // namespace radixserve
