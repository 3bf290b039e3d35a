// Linear layers over quantized weight blocks (engine/checkpoints/quant_formats.py holds the
// formats): out[m, n] = sum_k x[m, k] * w[n, k], w held in blocks of 32 along k,
//
//   bits 8: w = d * q (+ m), q int8         (GGUF Q8_0, Q5_0, Q6_K; int8 and Q5_1 with m)
//   bits 4: w = d * q + m, q in 0..15       (GGUF Q4_1, Q4_K, int4; GGUF Q4_0 is m = -8 d)
//
// with d and m float16 per block, or for the K-quants two levels: d = D * sc and m = Dmin' * mn,
// sc and mn a block's small integers (Q4_K: uint8 6-bit sc and mn per 32; Q6_K: int8 sc per 16)
// and D, Dmin' (= -Dmin) their 256-weight super-block's float16, the scales' dtype saying which.
// The loops form D * sc in float32, which holds it exactly (11 bits times at most 8), so the
// weights are the file's numbers while a Q4_K block costs 2 bytes of scales, not 8 as float32
// d and m. 8-bit weights may have no m, and may have two d per block, one for each 16 weights
// (Q6_K): their halves' integer sums are then scaled apart. quant_repack lays a checkpoint's
// blocks out once for these loops: kRows output rows interleaved, so that one vector holds the
// same 4 consecutive k of kRows rows (a "k-quad"), and a block of 32 is 8 such vectors:
//
//   qweight [groups, blocks, 8 k-quads x kRows x 4 values]  (4-bit: two k-quads' rows
//            per byte: rows 0 .. kRows/2 - 1 in the low nibbles, the others in the high)
//   scales [groups, blocks, halves, kRows], mins [groups, blocks, kRows]: float16, or the
//            K-quants' uint8 (Q4_K) or int8 (Q6_K) sc and mn
//   supers [groups, supers, parts, kRows] float16: the K-quants' D (and Dmin', parts 2) of
//            each super-block of 8 blocks, or of each block where a tensor-parallel share of
//            the columns starts inside a super-block (supers = blocks); empty otherwise
//            (groups = ceil(N / kRows); the padding rows are zeros; mins empty for 8-bit
//            weights without m)
//
// The activations are quantized per row and block of 32 (x = dx * qx, qx in -127..127, as
// llama.cpp's Q8 activations), with ``digits`` 2 a second int8 digit, the rounding left by the
// first in 254ths of a step (x = dx * (qx + qx2 / 254)): two vpdpbusd per product, for
// activations as exact as float's 16 bits (engine/worker/model/quant.py chooses per layer).
// A block's products for kRows outputs are 8 integer
// multiply-adds of the unpacked weights by one row's 4 bytes broadcast (AVX-512 VNNI: 64
// products in one vpdpbusd, which multiplies unsigned by signed bytes: 4-bit values are
// unsigned as stored, int8 ones are stored offset by 128, whose excess 128 * sum(qx) is taken
// off per block), scaled by d * dx into a float accumulator per output; the minimum adds m
// times the block's exact float sum of x. AVX2 (8 rows; vpmaddubsw, int8 weights signed with
// the sign trick) and the portable build (plain loops over the AVX-512 layout) compute the same.
// Up to kTile activation rows share each unpacked block. Outputs are split across threads by
// row group, so a row's result does not depend on the batch it rides in.
// Registered as torch.ops.radixserve.quant_repack / quant_linear / dequantize_weight /
// quant_linear_isa.

#include <ATen/Parallel.h>

#include <tuple>
#include <vector>

#include "ops.h"

#if defined(RADIXSERVE_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define RADIXSERVE_VNNI 1
#endif

namespace {

using radixserve::to_float;
constexpr int64_t kBlock = 32;
constexpr int64_t kQuads = kBlock / 4;
#if defined(RADIXSERVE_VNNI)
constexpr int kTile = 8;
#else
constexpr int kTile = 4;
#endif
#if defined(RADIXSERVE_AVX2) && !defined(RADIXSERVE_VNNI)
constexpr int64_t kRows = 8;
constexpr int kOffset8 = 0;  // the sign trick needs int8 weights signed
#else
constexpr int64_t kRows = 16;
constexpr int kOffset8 = 128;
#endif

inline int64_t group_bytes(int bits) { return kQuads * kRows * 4 * bits / 8; }

// How far ahead of the block being multiplied its thread's stream of values is fetched into
// L1. A thread reads its row groups' blocks as one run of memory; the hardware prefetchers
// alone left a one-row product of a weight that is not in cache at 18.4 GB/s (Q4_K) and 13.7
// (Q6_K) where torch's sum reads 26; 2 KB ahead reached 22.3 and 16.8 (1 KB: 21.2 and -,
// 4 KB: 21.7 and 15.4), and with 8 rows 14.9 GB/s from 11.2 (Intel Xeon with AMX, 2 threads).
constexpr int64_t kPrefetch = 2048;

// How a weight's scales and minimums are held: float16, or a K-quant's small integers under
// its super-block's float16.
enum class Scales { kHalf, kUnsigned, kSigned };

// The repacked weight of one call.
struct Weights {
  const uint8_t* q;     // [groups, blocks, group_bytes]
  const void* scales;   // [groups, blocks, halves, kRows]
  const void* mins;     // [groups, blocks, kRows] as the scales, or nullptr (8-bit without m)
  const c10::Half* supers;  // [groups, super_count, super_parts, kRows], or nullptr
  int bits;
  Scales kind;
  int halves;           // scales per block: 2 = one for each 16 weights (8-bit only)
  int64_t N, K, blocks, groups;
  int64_t super_count = 0, per_super = 1, super_parts = 1;

  const uint8_t* block(int64_t g, int64_t b) const {
    return q + (g * blocks + b) * group_bytes(bits);
  }
  // Where block b's kRows minimums start, and its half h's scales.
  int64_t at(int64_t g, int64_t b) const { return (g * blocks + b) * kRows; }
  int64_t scale_at(int64_t g, int64_t b, int64_t h) const {
    return ((g * blocks + b) * halves + h) * kRows;
  }
  // Block b's super-block D (part 0) or Dmin' (part 1), kRows of them.
  const c10::Half* super(int64_t g, int64_t b, int part) const {
    return supers + ((g * super_count + b / per_super) * super_parts + part) * kRows;
  }
  float number(const void* p, int64_t i) const {
    switch (kind) {
      case Scales::kUnsigned: return static_cast<const uint8_t*>(p)[i];
      case Scales::kSigned: return static_cast<const int8_t*>(p)[i];
      default: return static_cast<float>(static_cast<const c10::Half*>(p)[i]);
    }
  }
  // Lane r's scale of half h of block b, and its minimum (exact products in float32).
  float scale(int64_t g, int64_t b, int64_t h, int64_t r) const {
    const float d = number(scales, scale_at(g, b, h) + r);
    return kind == Scales::kHalf ? d : static_cast<float>(super(g, b, 0)[r]) * d;
  }
  float min(int64_t g, int64_t b, int64_t r) const {
    if (!mins) return 0.f;
    const float m = number(mins, at(g, b) + r);
    return kind == Scales::kHalf ? m : static_cast<float>(super(g, b, 1)[r]) * m;
  }
};

// The integer q (offset removed) of element e of block b of row lane r in group g.
inline int32_t value_at(const Weights& w, int64_t g, int64_t b, int64_t r, int64_t e) {
  const uint8_t* data = w.block(g, b);
  const int64_t quad = e / 4, byte = e % 4;
  if (w.bits == 8) {
    const int32_t stored = data[(quad * kRows + r) * 4 + byte];
    return kOffset8 ? stored - kOffset8 : static_cast<int8_t>(stored);
  }
  const int64_t half = kRows / 2;
  const uint8_t packed = data[(quad * half + r % half) * 4 + byte];
  return r < half ? packed & 15 : packed >> 4;
}

// The second digit's weight: the first digit's step over kDigit2.
constexpr int32_t kDigit2 = 254;

// The activations, quantized once per call: per row K int8 values (and with two digits, K
// second digits), and per block the scale (two digits: over kDigit2), the exact float sum of x
// (the minimums) and 128 times the sum of qx (offset int8 weights; both digits, as the
// integer kDigit2 * qx + qx2 their products add up to).
struct Activations {
  std::vector<int8_t> q, q2;
  std::vector<float> scale, sum;
  std::vector<int32_t> excess, excess_low;  // excess_low: of the block's first 16 values
  int64_t K, blocks;
  bool two;  // the second digits are there

  // The excess of half h of block ``at`` (Halves 2), or of the whole block.
  template <int Halves>
  int32_t excess_of(int64_t at, int h) const {
    if (Halves == 1) return excess[at];
    return h == 0 ? excess_low[at] : excess[at] - excess_low[at];
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
  a.excess.resize(M * a.blocks);
  a.excess_low.resize(M * a.blocks);
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
        a.excess[m * a.blocks + b] = kOffset8 * qsum;
        a.excess_low[m * a.blocks + b] = kOffset8 * qlow;
      }
    }
  });
  return a;
}

#if defined(RADIXSERVE_VNNI) || defined(RADIXSERVE_AVX2)
inline void prefetch_ahead(const Weights& w, const uint8_t* data) {
  for (int64_t line = 0; line < group_bytes(w.bits); line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(data) + kPrefetch + line, _MM_HINT_T0);
  }
}
#endif

#if defined(RADIXSERVE_VNNI)
inline __m512 load_halves(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// kRows scales or minimums of ``w`` at ``at`` (times the super-block's part ``part``).
inline __m512 load_lanes(const Weights& w, const void* p, int64_t at, int64_t g, int64_t b,
                         int part) {
  if (w.kind == Scales::kHalf) return load_halves(static_cast<const c10::Half*>(p) + at);
  const __m128i small = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
      static_cast<const uint8_t*>(p) + at));
  const __m512i wide = w.kind == Scales::kUnsigned ? _mm512_cvtepu8_epi32(small)
                                                   : _mm512_cvtepi8_epi32(small);
  return _mm512_mul_ps(load_halves(w.super(g, b, part)), _mm512_cvtepi32_ps(wide));
}

// Output rows [16 g, 16 g + 16) for activation rows m0 .. m0 + R.
template <int R, int Halves>
void group_rows(const Weights& w, const Activations& a, int64_t g, int64_t m0, __m512* acc) {
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0f);
  constexpr int kHalfQuads = kQuads / Halves;
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* data = w.block(g, b);
    prefetch_ahead(w, data);
    __m512i wv[kQuads];
    for (int q = 0; q < kQuads; ++q) {
      if (w.bits == 4) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(data + q * 32));
        wv[q] = _mm512_and_si512(
            _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1), low);
      } else {
        wv[q] = _mm512_loadu_si512(data + q * 64);
      }
    }
    // Independent sums: a few rows' (or one row's several partial) vpdpbusd chains in flight
    // at once, since each waits for the previous one's result.
    constexpr int kChains = R >= 4 ? 1 : 4 / R;
    for (int h = 0; h < Halves; ++h) {
      __m512i dot[R][kChains];
      for (int r = 0; r < R; ++r) {
        for (int c = 0; c < kChains; ++c) dot[r][c] = _mm512_setzero_si512();
      }
      __m512i dot2[R][kChains];
      for (int q = h * kHalfQuads; q < (h + 1) * kHalfQuads; ++q) {
        for (int r = 0; r < R; ++r) {
          const int32_t* xq =
              reinterpret_cast<const int32_t*>(a.q.data() + (m0 + r) * a.K + b * kBlock);
          dot[r][q % kChains] =
              _mm512_dpbusd_epi32(dot[r][q % kChains], wv[q], _mm512_set1_epi32(xq[q]));
        }
      }
      if (a.two) {
        for (int r = 0; r < R; ++r) {
          for (int c = 0; c < kChains; ++c) dot2[r][c] = _mm512_setzero_si512();
        }
        for (int q = h * kHalfQuads; q < (h + 1) * kHalfQuads; ++q) {
          for (int r = 0; r < R; ++r) {
            const int32_t* xq =
                reinterpret_cast<const int32_t*>(a.q2.data() + (m0 + r) * a.K + b * kBlock);
            dot2[r][q % kChains] =
                _mm512_dpbusd_epi32(dot2[r][q % kChains], wv[q], _mm512_set1_epi32(xq[q]));
          }
        }
      }
      const __m512 ws = load_lanes(w, w.scales, w.scale_at(g, b, h), g, b, 0);
      for (int r = 0; r < R; ++r) {
        __m512i sum = dot[r][0];
        for (int c = 1; c < kChains; ++c) sum = _mm512_add_epi32(sum, dot[r][c]);
        if (a.two) {
          sum = _mm512_mullo_epi32(sum, _mm512_set1_epi32(kDigit2));
          for (int c = 0; c < kChains; ++c) sum = _mm512_add_epi32(sum, dot2[r][c]);
        }
        const int64_t at = (m0 + r) * a.blocks + b;
        if (w.bits == 8) {
          sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(a.excess_of<Halves>(at, h)));
        }
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum),
                                 _mm512_mul_ps(ws, _mm512_set1_ps(a.scale[at])), acc[r]);
      }
    }
    if (w.mins) {
      const __m512 wm = load_lanes(w, w.mins, w.at(g, b), g, b, 1);
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm512_fmadd_ps(wm, _mm512_set1_ps(a.sum[(m0 + r) * a.blocks + b]), acc[r]);
      }
    }
  }
}
using Accumulator = __m512;
inline void store_lanes(const __m512& v, float* out) { _mm512_storeu_ps(out, v); }
#elif defined(RADIXSERVE_AVX2)
inline __m256 load_halves(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 load_lanes(const Weights& w, const void* p, int64_t at, int64_t g, int64_t b,
                         int part) {
  if (w.kind == Scales::kHalf) return load_halves(static_cast<const c10::Half*>(p) + at);
  const __m128i small = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(
      static_cast<const uint8_t*>(p) + at));
  const __m256i wide = w.kind == Scales::kUnsigned ? _mm256_cvtepu8_epi32(small)
                                                   : _mm256_cvtepi8_epi32(small);
  return _mm256_mul_ps(load_halves(w.super(g, b, part)), _mm256_cvtepi32_ps(wide));
}

template <int R, int Halves>
void group_rows(const Weights& w, const Activations& a, int64_t g, int64_t m0, __m256* acc) {
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0f);
  const __m256i ones16 = _mm256_set1_epi16(1);
  constexpr int kHalfQuads = kQuads / Halves;
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* data = w.block(g, b);
    prefetch_ahead(w, data);
    __m256i wv[kQuads];
    for (int q = 0; q < kQuads; ++q) {
      if (w.bits == 4) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(data + q * 16));
        wv[q] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
      } else {
        wv[q] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(data + q * 32));
      }
    }
    __m256 ws[Halves];
    for (int h = 0; h < Halves; ++h) ws[h] = load_lanes(w, w.scales, w.scale_at(g, b, h), g, b, 0);
    const __m256 wm = w.mins ? load_lanes(w, w.mins, w.at(g, b), g, b, 1) : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const int32_t* xq = reinterpret_cast<const int32_t*>(a.q.data() + m * a.K + b * kBlock);
      const int32_t* xq2 =
          a.two ? reinterpret_cast<const int32_t*>(a.q2.data() + m * a.K + b * kBlock) : nullptr;
      const int64_t at = m * a.blocks + b;
      for (int h = 0; h < Halves; ++h) {
        __m256i dot = _mm256_setzero_si256(), dot2 = _mm256_setzero_si256();
        for (int q = h * kHalfQuads; q < (h + 1) * kHalfQuads; ++q) {
          // int8 weights: |w| (vpmaddubsw's unsigned side) times x with w's sign, so that no
          // pair sum overflows 16 bits; 4-bit weights are unsigned as stored.
          const __m256i unsigned_w = w.bits == 4 ? wv[q] : _mm256_sign_epi8(wv[q], wv[q]);
          const auto signed_x = [&](int32_t packed) {
            const __m256i xv = _mm256_set1_epi32(packed);
            return w.bits == 4 ? xv : _mm256_sign_epi8(xv, wv[q]);
          };
          dot = _mm256_add_epi32(dot, _mm256_madd_epi16(
              _mm256_maddubs_epi16(unsigned_w, signed_x(xq[q])), ones16));
          if (xq2) {
            dot2 = _mm256_add_epi32(dot2, _mm256_madd_epi16(
                _mm256_maddubs_epi16(unsigned_w, signed_x(xq2[q])), ones16));
          }
        }
        if (a.two) {
          dot = _mm256_add_epi32(_mm256_mullo_epi32(dot, _mm256_set1_epi32(kDigit2)), dot2);
        }
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                 _mm256_mul_ps(ws[h], _mm256_set1_ps(a.scale[at])), acc[r]);
      }
      if (w.mins) acc[r] = _mm256_fmadd_ps(wm, _mm256_set1_ps(a.sum[at]), acc[r]);
    }
  }
}
using Accumulator = __m256;
inline void store_lanes(const __m256& v, float* out) { _mm256_storeu_ps(out, v); }
#else
struct Accumulator {
  float lanes[kRows];
};
template <int R, int Halves>
void group_rows(const Weights& w, const Activations& a, int64_t g, int64_t m0, Accumulator* acc) {
  for (int r = 0; r < R; ++r) std::fill(acc[r].lanes, acc[r].lanes + kRows, 0.f);
  constexpr int64_t kHalf = kBlock / Halves;
  for (int64_t b = 0; b < w.blocks; ++b) {
    for (int64_t lane = 0; lane < kRows; ++lane) {
      const float mn = w.min(g, b, lane);
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r, at = m * a.blocks + b;
        const int8_t* xq = a.q.data() + m * a.K + b * kBlock;
        for (int h = 0; h < Halves; ++h) {
          const float d = w.scale(g, b, h, lane);
          int32_t dot = 0;
          for (int64_t e = h * kHalf; e < (h + 1) * kHalf; ++e) {
            const int32_t x = a.two ? xq[e] * kDigit2 + a.q2[m * a.K + b * kBlock + e] : xq[e];
            dot += value_at(w, g, b, lane, e) * x;
          }
          acc[r].lanes[lane] += static_cast<float>(dot) * d * a.scale[at];
        }
        acc[r].lanes[lane] += mn * a.sum[at];
      }
    }
  }
}
inline void store_lanes(const Accumulator& v, float* out) { std::copy(v.lanes, v.lanes + kRows, out); }
#endif

template <typename T, int R>
void write_rows(const Weights& w, const Activations& a, int64_t g, int64_t m0, T* out) {
  Accumulator acc[R];
  if (w.halves == 2) {
    group_rows<R, 2>(w, a, g, m0, acc);
  } else {
    group_rows<R, 1>(w, a, g, m0, acc);
  }
  float lanes[kRows];
  const int64_t n0 = g * kRows, count = std::min(kRows, w.N - n0);
  for (int r = 0; r < R; ++r) {
    store_lanes(acc[r], lanes);
    T* row = out + (m0 + r) * w.N + n0;
    for (int64_t i = 0; i < count; ++i) row[i] = static_cast<T>(lanes[i]);
  }
}

Scales scales_kind(at::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf: return Scales::kHalf;
    case at::kByte: return Scales::kUnsigned;
    case at::kChar: return Scales::kSigned;
    default:
      TORCH_CHECK(false, "quant_linear: scales float16, uint8 or int8 expected, got ", dtype);
  }
}

Weights describe(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins,
                 const at::Tensor& supers, int64_t bits, int64_t N) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_linear: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(qweight.dim() == 3 && qweight.is_contiguous() &&
                  qweight.scalar_type() == at::kByte && qweight.size(2) == group_bytes(bits),
              "quant_linear: qweight from quant_repack expected");
  const int64_t groups = qweight.size(0), blocks = qweight.size(1);
  TORCH_CHECK(N > (groups - 1) * kRows && N <= groups * kRows, "quant_linear: N = ", N,
              " does not match ", groups, " row groups");
  const Scales kind = scales_kind(scales.scalar_type());
  const int64_t per_group = groups * blocks * kRows;
  TORCH_CHECK(scales.is_contiguous() &&
                  (scales.numel() == per_group || (bits == 8 && scales.numel() == 2 * per_group)),
              "quant_linear: scales from quant_repack expected");
  Weights w{qweight.data_ptr<uint8_t>(), scales.data_ptr(), nullptr, nullptr,
            static_cast<int>(bits), kind,
            static_cast<int>(scales.numel() / std::max<int64_t>(per_group, 1)), N,
            blocks * kBlock, blocks, groups};
  if (per_group == 0) w.halves = 1;
  TORCH_CHECK(bits == 8 || mins.numel() > 0, "quant_linear: 4-bit weights need mins");
  if (mins.numel() > 0) {
    TORCH_CHECK(mins.is_contiguous() && mins.scalar_type() == scales.scalar_type() &&
                    mins.numel() == per_group && w.halves == 1,
                "quant_linear: mins from quant_repack expected");
    w.mins = mins.data_ptr();
  }
  if (kind != Scales::kHalf) {
    w.super_parts = w.mins ? 2 : 1;
    TORCH_CHECK(supers.scalar_type() == at::kHalf && supers.is_contiguous() &&
                    supers.dim() == 4 && supers.size(0) == groups &&
                    supers.size(2) == w.super_parts && supers.size(3) == kRows &&
                    (supers.size(1) == blocks || supers.size(1) == (blocks + 7) / 8),
                "quant_linear: supers from quant_repack expected");
    w.super_count = supers.size(1);
    w.per_super = w.super_count == blocks ? 1 : 8;
    w.supers = static_cast<const c10::Half*>(supers.data_ptr());
  } else {
    TORCH_CHECK(supers.numel() == 0, "quant_linear: float16 scales take no supers");
  }
  return w;
}

template <typename T>
void run(const at::Tensor& x, const Weights& w, bool two, at::Tensor& out) {
  const int64_t M = x.size(0);
  const Activations a = quantize_activations(x.data_ptr<T>(), x.stride(0), M, w.K, two);
  T* o = out.data_ptr<T>();
  // Enough work per task to pay for handing it to a thread: a few hundred KB of weights
  // streamed for one row, proportionally fewer groups as more rows share each unpacked block
  // (a 32-row step over a 960 x 576 weight would otherwise run on one thread).
  const int64_t grain = std::max<int64_t>(1, 2048 / (w.blocks * std::min<int64_t>(M, 16)));
  at::parallel_for(0, w.groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      int64_t m = 0;
      for (; m + kTile <= M; m += kTile) write_rows<T, kTile>(w, a, g, m, o);
      if (kTile > 4 && m + 4 <= M) {  // a verify step's K + 1 rows in as few passes as fit
        write_rows<T, 4>(w, a, g, m, o);
        m += 4;
      }
      for (; m + 2 <= M; m += 2) write_rows<T, 2>(w, a, g, m, o);
      if (m < M) write_rows<T, 1>(w, a, g, m, o);
    }
  });
}

// x [M, K] (float32, bf16 or fp16) @ the repacked weight's [N, K].T -> [M, N] in x's dtype,
// the activations quantized in ``digits`` (1 or 2) int8 digits.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const at::Tensor& mins, const at::Tensor& supers, int64_t bits, int64_t N,
                        int64_t digits) {
  const Weights w = describe(qweight, scales, mins, supers, bits, N);
  TORCH_CHECK(digits == 1 || digits == 2, "quant_linear: digits must be 1 or 2, got ", digits);
  const bool two = digits == 2;
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) == w.K,
              "quant_linear: x [M, ", w.K, "] with contiguous rows expected, got ", x.sizes());
  auto out = at::empty({x.size(0), w.N}, x.options());
  // A step may bring no rows (the LM head of a step whose sequences are all mid-prefill):
  // the work split below divides by the row count.
  if (x.size(0) == 0) return out;
  switch (x.scalar_type()) {
    case at::kFloat:
      run<float>(x, w, two, out);
      break;
    case at::kBFloat16:
      run<c10::BFloat16>(x, w, two, out);
      break;
    case at::kHalf:
      run<c10::Half>(x, w, two, out);
      break;
    default:
      TORCH_CHECK(false, "quant_linear: unsupported activation dtype ", x.scalar_type());
  }
  return out;
}

// Block b's scales (and half h's, Halves 2) and minimums of row n, from the checkpoint's
// [N, blocks * halves] and [N, blocks] into the interleaved [groups, blocks, halves, kRows]
// and [groups, blocks, kRows]; without source minimums a 4-bit weight (Q4_0) gets m = -8 d.
template <typename S>
void repack_scales(const S* scales, const S* mins, int64_t N, int64_t blocks, int64_t halves,
                   S* out_scales, S* out_mins) {
  for (int64_t n = 0; n < N; ++n) {
    const int64_t g = n / kRows, lane = n % kRows;
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t h = 0; h < halves; ++h) {
        out_scales[((g * blocks + b) * halves + h) * kRows + lane] =
            scales[(n * blocks + b) * halves + h];
      }
      if (out_mins) {
        out_mins[(g * blocks + b) * kRows + lane] =
            mins ? mins[n * blocks + b] : S(-8.f * static_cast<float>(scales[n * blocks + b]));
      }
    }
  }
}

// A K-quant's super-block D (and Dmin'), one per block in the checkpoint ([N, blocks] float16
// each), as [groups, supers, parts, kRows]: one per 8 blocks where every aligned run of 8 shares
// its values (a whole tensor's blocks, or a column share starting on a super-block), else one
// per block.
at::Tensor repack_supers(const at::Tensor& super_scales, const at::Tensor& super_mins,
                         int64_t N, int64_t blocks, int64_t groups) {
  std::vector<at::Tensor> parts{super_scales.contiguous()};
  if (super_mins.defined()) parts.push_back(super_mins.contiguous());
  for (const at::Tensor& part : parts) {
    TORCH_CHECK(part.scalar_type() == at::kHalf && part.dim() == 2 && part.size(0) == N &&
                    part.size(1) == blocks,
                "quant_repack: super_scales and super_mins [N, K / 32] float16");
  }
  bool shared = true;
  for (const at::Tensor& part : parts) {
    const uint16_t* v = reinterpret_cast<const uint16_t*>(part.data_ptr());
    for (int64_t i = 0; shared && i < N * blocks; ++i) shared = v[i] == v[i - i % blocks % 8];
  }
  const int64_t per = shared ? 8 : 1, count = (blocks + per - 1) / per;
  const int64_t n_parts = static_cast<int64_t>(parts.size());
  at::Tensor out = at::zeros({groups, count, n_parts, kRows}, super_scales.options());
  c10::Half* dst = out.data_ptr<c10::Half>();
  for (int64_t p = 0; p < n_parts; ++p) {
    const c10::Half* src = parts[p].data_ptr<c10::Half>();
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t s = 0; s < count; ++s) {
        dst[((n / kRows * count + s) * n_parts + p) * kRows + n % kRows] =
            src[n * blocks + s * per];
      }
    }
  }
  return out;
}

// A checkpoint's blocks (quant_formats.py: qweight uint8 [N, K / 2] or int8 [N, K]; scales
// [N, K / 32] float16, or the K-quants' uint8 (Q4_K) or int8 (Q6_K: [N, K / 16], one for each
// 16 weights, as any 8-bit weight may have), with any strides; mins [N, K / 32] in the scales'
// dtype, or undefined; for the K-quants super_scales (and Q4_K's super_mins) [N, K / 32]
// float16) in the interleaved layout above. A 4-bit weight without mins (Q4_0) gets m = -8 d;
// an 8-bit one keeps none.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quant_repack(
    const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
    const c10::optional<at::Tensor>& super_scales, const c10::optional<at::Tensor>& super_mins,
    int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_repack: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.element_size() == 1,
              "quant_repack: qweight [N, bytes] contiguous");
  const int64_t N = qweight.size(0), K = qweight.size(1) * 8 / bits;
  TORCH_CHECK(K % kBlock == 0, "quant_repack: K = ", K, " is not a multiple of 32");
  const int64_t blocks = K / kBlock, groups = (N + kRows - 1) / kRows;
  const Scales kind = scales_kind(scales.scalar_type());
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N &&
                  (scales.size(1) == blocks || (bits == 8 && scales.size(1) == 2 * blocks)),
              "quant_repack: scales [N, K / 32] (8-bit: or [N, K / 16])");
  const int64_t halves = blocks ? scales.size(1) / blocks : 1;
  const bool has_mins = mins.has_value() && mins->defined();
  const bool has_supers = super_scales.has_value() && super_scales->defined();
  const bool has_super_mins = super_mins.has_value() && super_mins->defined();
  TORCH_CHECK(has_supers == (kind != Scales::kHalf) && (!has_super_mins || has_mins) &&
                  has_super_mins == (kind != Scales::kHalf && has_mins),
              "quant_repack: integer scales (and minimums) come with super_scales (and "
              "super_mins), float16 ones without");
  TORCH_CHECK(kind == Scales::kHalf || bits == 8 || has_mins,
              "quant_repack: 4-bit weights with integer scales need mins");
  auto opts = qweight.options();
  at::Tensor packed = at::zeros({groups, blocks, group_bytes(bits)}, opts.dtype(at::kByte));
  at::Tensor out_scales = at::zeros({groups, blocks, halves, kRows}, scales.options());
  const bool keep_mins = bits == 4 || has_mins;
  at::Tensor out_mins = at::zeros({keep_mins ? groups : 0, blocks, kRows}, scales.options());
  at::Tensor out_supers =
      has_supers ? repack_supers(*super_scales, has_super_mins ? *super_mins : at::Tensor(), N,
                                 blocks, groups)
                 : at::zeros({0}, opts.dtype(at::kHalf));
  if (bits == 8 && kOffset8) packed.fill_(kOffset8);  // padding rows hold q = 0
  const uint8_t* src = static_cast<const uint8_t*>(qweight.data_ptr());
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const int64_t half = kRows / 2;
  const at::Tensor scale_rows = scales.contiguous();
  const at::Tensor mins_rows = has_mins ? mins->contiguous() : at::Tensor();
  TORCH_CHECK(!has_mins || (halves == 1 && mins_rows.scalar_type() == scales.scalar_type() &&
                            mins_rows.sizes() == scales.sizes()),
              "quant_repack: mins [N, K / 32] in the scales' dtype");
  switch (kind) {
    case Scales::kHalf:
      repack_scales(scale_rows.data_ptr<c10::Half>(),
                    has_mins ? mins_rows.data_ptr<c10::Half>() : nullptr, N, blocks, halves,
                    out_scales.data_ptr<c10::Half>(),
                    keep_mins ? out_mins.data_ptr<c10::Half>() : nullptr);
      break;
    case Scales::kUnsigned:
      repack_scales(scale_rows.data_ptr<uint8_t>(),
                    has_mins ? mins_rows.data_ptr<uint8_t>() : nullptr, N, blocks, halves,
                    out_scales.data_ptr<uint8_t>(),
                    keep_mins ? out_mins.data_ptr<uint8_t>() : nullptr);
      break;
    case Scales::kSigned:
      repack_scales(scale_rows.data_ptr<int8_t>(),
                    has_mins ? mins_rows.data_ptr<int8_t>() : nullptr, N, blocks, halves,
                    out_scales.data_ptr<int8_t>(),
                    keep_mins ? out_mins.data_ptr<int8_t>() : nullptr);
      break;
  }
  for (int64_t n = 0; n < N; ++n) {
    const int64_t g = n / kRows, lane = n % kRows;
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* block = dst + (g * blocks + b) * group_bytes(bits);
      for (int64_t e = 0; e < kBlock; ++e) {
        const int64_t quad = e / 4, byte = e % 4;
        if (bits == 8) {
          const int8_t q = reinterpret_cast<const int8_t*>(src)[n * K + b * kBlock + e];
          block[(quad * kRows + lane) * 4 + byte] = static_cast<uint8_t>(q + kOffset8);
        } else {
          const uint8_t stored = src[n * (K / 2) + b * 16 + e % 16];
          const uint8_t q = e < 16 ? stored & 15 : stored >> 4;
          uint8_t& slot = block[(quad * half + lane % half) * 4 + byte];
          slot |= lane < half ? q : static_cast<uint8_t>(q << 4);
        }
      }
    }
  }
  return {packed, out_scales, out_mins, out_supers};
}

template <typename T>
void dequantize_rows(const Weights& w, const int64_t* rows, int64_t count, T* out) {
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = rows[i], g = n / kRows, lane = n % kRows;
      for (int64_t b = 0; b < w.blocks; ++b) {
        const float mn = w.min(g, b, lane);
        for (int64_t e = 0; e < kBlock; ++e) {
          const float d = w.scale(g, b, e * w.halves / kBlock, lane);
          out[i * w.K + b * kBlock + e] =
              static_cast<T>(d * static_cast<float>(value_at(w, g, b, lane, e)) + mn);
        }
      }
    }
  });
}

// Rows ``rows`` (int64) of the dense matrix the repacked blocks stand for, in ``dtype``.
at::Tensor dequantize_weight(const at::Tensor& qweight, const at::Tensor& scales,
                             const at::Tensor& mins, const at::Tensor& supers, int64_t bits,
                             int64_t N, const at::Tensor& rows, at::ScalarType dtype) {
  const Weights w = describe(qweight, scales, mins, supers, bits, N);
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "dequantize_weight: rows int64 [count]");
  const int64_t count = rows.size(0);
  const int64_t* ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < N, "dequantize_weight: row ", ids[i], " out of ", N);
  }
  auto out = at::empty({count, w.K}, qweight.options().dtype(dtype));
  switch (dtype) {
    case at::kFloat:
      dequantize_rows(w, ids, count, out.data_ptr<float>());
      break;
    case at::kBFloat16:
      dequantize_rows(w, ids, count, out.data_ptr<c10::BFloat16>());
      break;
    case at::kHalf:
      dequantize_rows(w, ids, count, out.data_ptr<c10::Half>());
      break;
    default:
      TORCH_CHECK(false, "dequantize_weight: unsupported dtype ", dtype);
  }
  return out;
}

std::string quant_linear_isa() {
#if defined(RADIXSERVE_VNNI)
  return "avx512_vnni";
#elif defined(RADIXSERVE_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace

RADIXSERVE_OPS_FRAGMENT(m) {
  m.def("quant_repack(Tensor qweight, Tensor scales, Tensor? mins, Tensor? super_scales, "
        "Tensor? super_mins, int bits) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins, Tensor supers, "
        "int bits, int N, int digits) -> Tensor");
  m.def("dequantize_weight(Tensor qweight, Tensor scales, Tensor mins, Tensor supers, int bits, "
        "int N, Tensor rows, ScalarType dtype) -> Tensor");
  m.def("quant_linear_isa() -> str", &quant_linear_isa);
}

RADIXSERVE_OPS_IMPL(m) {
  m.impl("quant_repack", &quant_repack);
  m.impl("quant_linear", &quant_linear);
  m.impl("dequantize_weight", &dequantize_weight);
}
