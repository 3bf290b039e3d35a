// Linear layers over quantized weight blocks (engine/checkpoints/quant_formats.py holds the
// formats): out[m, n] = sum_k x[m, k] * w[n, k], w held in blocks of 32 along k,
//
//   bits 8: w = d * q (+ m), q int8         (GGUF Q8_0, Q5_0; int8 and Q5_1 with m)
//   bits 6: w = d * q, q in -32..31         (GGUF Q6_K)
//   bits 5: w = d * q, q in -16..15         (GGUF Q5_0)
//   bits 4: w = d * q + m, q in 0..15       (GGUF Q4_1, Q4_K, int4; GGUF Q4_0 is m = -8 d)
//
// with d and m float16 per block, or for the K-quants two levels: d = D * sc and m = Dmin' * mn,
// sc and mn a block's small integers (Q4_K: uint8 6-bit sc and mn per 32; Q6_K: int8 sc per 16)
// and D, Dmin' (= -Dmin) their 256-weight super-block's float16, the scales' dtype saying which.
// The loops form D * sc in float32, which holds it exactly (11 bits times at most 8), so the
// weights are the file's numbers while a Q4_K block costs 2 bytes of scales, not 8 as float32
// d and m. 8-, 6- and 5-bit weights may have no m, and may have two d per block, one for each 16
// weights (Q6_K): their halves' integer sums are then scaled apart. quant_repack
// (quant_repack.cpp) lays a checkpoint's blocks out once for these loops, kRows output rows
// interleaved (quant_layout.h), so that a block of 32 is 8 vectors of the same 4 consecutive k
// of kRows rows:
//
//   qweight [groups, blocks, group_bytes(bits)], scales [groups, blocks, halves, kRows],
//   mins [groups, blocks, kRows] (or empty), supers [groups, supers, parts, kRows] (K-quants)
//
// The activations are quantized per row and block of 32 (x = dx * qx, qx in -127..127, as
// llama.cpp's Q8 activations), with ``digits`` 2 a second int8 digit, the rounding left by the
// first in 254ths of a step (x = dx * (qx + qx2 / 254)): two vpdpbusd per product, for
// activations as exact as float's 16 bits (engine/worker/model/quant.py chooses per layer).
// A block's products for kRows outputs are 8 integer
// multiply-adds of the unpacked weights by one row's 4 bytes broadcast (AVX-512 VNNI: 64
// products in one vpdpbusd, which multiplies unsigned by signed bytes: 4-bit values are
// unsigned as stored, int8 ones are stored offset by 128, 6-bit ones by 32 and 5-bit ones by
// 16, whose excess offset * sum(qx) is taken off per block), scaled by d * dx into a float
// accumulator per output; the minimum adds m times the block's exact float sum of x. AVX2 (8 rows;
// vpmaddubsw, int8 weights signed with the sign trick, 6- and 5-bit ones unsigned) and the
// portable build (plain loops over the AVX-512 layout) compute the same.
// Up to kTile activation rows share each unpacked block. Outputs are split across threads by
// row group, so a row's result does not depend on the batch it rides in.
// Registered as torch.ops.radixserve.quant_linear / quant_linear_isa.

#include <ATen/Parallel.h>

#include <vector>

#include "quant_activations.h"

namespace {

using namespace radixserve::quant;
#if defined(RADIXSERVE_VNNI)
constexpr int kTile = 8;
#else
constexpr int kTile = 4;
#endif

// How far ahead of the block being multiplied its thread's stream of values is fetched into
// L1. A thread reads its row groups' blocks as one run of memory; the hardware prefetchers
// alone left a one-row product of a weight that is not in cache at 18.4 GB/s (Q4_K) and 13.7
// (Q6_K) where torch's sum reads 26; 2 KB ahead reached 22.3 and 16.8 (1 KB: 21.2 and -,
// 4 KB: 21.7 and 15.4), and with 8 rows 14.9 GB/s from 11.2 (Intel Xeon with AMX, 2 threads).
constexpr int64_t kPrefetch = 2048;

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
  // 6-bit (5-bit): each quarter (eighth) of the vector, 4 (2) rows, rotates its 2 bits (1 bit)
  // of the planes' byte into bits 4 and 5 (bit 4) (quant_layout.h)
  const __m512i high_bits = _mm512_set1_epi8(w.bits == 6 ? 0x30 : 0x10);
  const __m512i rotate = w.bits == 6 ? _mm512_setr_epi64(4, 4, 2, 2, 0, 0, 62, 62)
                                     : _mm512_setr_epi64(4, 3, 2, 1, 0, 63, 62, 61);
  constexpr int kHalfQuads = kQuads / Halves;
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* data = w.block(g, b);
    prefetch_ahead(w, data);
    __m512i wv[kQuads];
    for (int q = 0; q < kQuads; ++q) {
      if (w.bits != 8) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(data + q * 32));
        wv[q] = _mm512_and_si512(
            _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1), low);
        if (w.bits != 4) {
          __m512i planes;
          if (w.bits == 6) {
            planes = _mm512_broadcast_i32x4(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(data + kNibbleBytes + q * 16)));
          } else {
            int64_t eight;
            std::memcpy(&eight, data + kNibbleBytes + q * 8, 8);
            planes = _mm512_set1_epi64(eight);
          }
          // wv | (rotated & high_bits)
          wv[q] = _mm512_ternarylogic_epi32(wv[q], _mm512_rolv_epi64(planes, rotate), high_bits,
                                            0xF8);
        }
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
        if (w.bits != 4) {
          sum = _mm512_sub_epi32(sum,
                                 _mm512_set1_epi32(a.excess_of<Halves>(at, h, offset_of(w.bits))));
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
  const __m256i high_bits = _mm256_set1_epi8(w.bits == 6 ? 0x30 : 0x10);
  const __m256i ones16 = _mm256_set1_epi16(1);
  // 6-bit (5-bit): each quarter (eighth) of the vector, 2 rows (1 row), shifts its 2 bits
  // (1 bit) of the planes' byte down (quant_layout.h), then into bits 4 and 5 (bit 4)
  const __m256i shift6 = _mm256_setr_epi64x(0, 2, 4, 6);
  const __m256i shift5 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  constexpr int kHalfQuads = kQuads / Halves;
  const bool is_unsigned = w.bits != 8;  // 4-, 5- and 6-bit values are unsigned as stored
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* data = w.block(g, b);
    prefetch_ahead(w, data);
    __m256i wv[kQuads];
    for (int q = 0; q < kQuads; ++q) {
      if (w.bits != 8) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(data + q * 16));
        wv[q] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
        if (w.bits != 4) {
          __m256i high;
          if (w.bits == 6) {
            int64_t planes;
            std::memcpy(&planes, data + kNibbleBytes + q * 8, 8);
            high = _mm256_slli_epi64(_mm256_srlv_epi64(_mm256_set1_epi64x(planes), shift6), 4);
          } else {
            int32_t planes;
            std::memcpy(&planes, data + kNibbleBytes + q * 4, 4);
            high = _mm256_slli_epi32(_mm256_srlv_epi32(_mm256_set1_epi32(planes), shift5), 4);
          }
          wv[q] = _mm256_or_si256(wv[q], _mm256_and_si256(high, high_bits));
        }
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
          // pair sum overflows 16 bits; 4- to 6-bit weights are unsigned as stored (63 * 127
          // twice stays below 2^15).
          const __m256i unsigned_w = is_unsigned ? wv[q] : _mm256_sign_epi8(wv[q], wv[q]);
          const auto signed_x = [&](int32_t packed) {
            const __m256i xv = _mm256_set1_epi32(packed);
            return is_unsigned ? xv : _mm256_sign_epi8(xv, wv[q]);
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
        if (is_unsigned && w.bits != 4) {
          dot = _mm256_sub_epi32(
              dot, _mm256_set1_epi32(a.excess_of<Halves>(at, h, offset_of(w.bits))));
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

// Rows m0 .. m0 + rows (fewer than kTile) in one pass over the weight's row group: each block
// is read and unpacked once for all of them. A row's sums are the same whatever R (integer
// dot products, then the same float steps per block), so a row's result does not depend on
// the rows beside it.
template <typename T>
void write_tail(const Weights& w, const Activations& a, int64_t g, int64_t m0, int64_t rows,
                T* out) {
  switch (rows) {
    case 1: return write_rows<T, 1>(w, a, g, m0, out);
    case 2: return write_rows<T, 2>(w, a, g, m0, out);
    case 3: return write_rows<T, 3>(w, a, g, m0, out);
#if defined(RADIXSERVE_VNNI)
    case 4: return write_rows<T, 4>(w, a, g, m0, out);
    case 5: return write_rows<T, 5>(w, a, g, m0, out);
    case 6: return write_rows<T, 6>(w, a, g, m0, out);
    case 7: return write_rows<T, 7>(w, a, g, m0, out);
#endif
    default: TORCH_CHECK(false, "quant_linear: a tail of ", rows, " rows");
  }
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
      // the rest (a verify step's K + 1 rows, a decode step's few) in one more pass
      if (m < M) write_tail<T>(w, a, g, m, M - m, o);
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
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins, Tensor supers, "
        "int bits, int N, int digits) -> Tensor");
  m.def("quant_linear_isa() -> str", &quant_linear_isa);
}

RADIXSERVE_OPS_IMPL(m) {
  m.impl("quant_linear", &quant_linear);
}
