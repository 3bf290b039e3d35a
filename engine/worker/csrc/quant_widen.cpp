// The dense matrix of a repacked quantized weight (csrc/quant_linear.cpp's layout), written
// into a caller's buffer in bf16 or float32 at memory speed: the "widened" form of a linear
// layer (engine/worker/model/linear_forms.py), which hands it to oneDNN's GEMM (AMX tiles where
// the CPU has them) for prefill-sized row counts. dequantize_weight computes the same numbers
// for an embedding's few rows; this one streams every row group once, each group's blocks in
// L1, a row's 32 values at a time:
//
//   qweight [groups, blocks, 8 k-quads x rows x 4 x bits / 8]   (rows = scales.size(3): 16
//            in AVX-512 and portable builds, 8 in AVX2 ones; 4-bit: rows/2 per byte, low
//            nibbles first; 8-bit: stored + 128 where rows is 16, signed where 8; 6-bit: q + 32
//            and 5-bit: q + 16, its low 4 bits as a 4-bit block, then its high bits in planes,
//            quant_layout.h)
//   scales [groups, blocks, halves, rows], mins [groups, blocks, rows] or empty: float16 or
//            float32 d and m, or a K-quant's uint8 (Q4_K) / int8 (Q6_K) small integers, then
//   supers [groups, super-blocks, parts, rows] float16: their super-block's D (and Dmin'),
//            d = D * sc and m = Dmin' * mn formed in float32 (exact); a super-block is 8
//            blocks, or one where there are as many super-blocks as blocks
//
// Every shape is checked against that layout, so a weight laid out otherwise is refused with
// an error instead of widened wrongly (linear_forms.py then keeps it in blocks).
// Registered as torch.ops.radixserve.widen_weight.

#include <ATen/Parallel.h>

#include "ops.h"

namespace {
namespace widen {

constexpr int64_t kBlock = 32;

enum class Kind { kHalf, kFloat, kUnsigned, kSigned };

struct Layout {
  const uint8_t* q;
  const void* scales;
  const void* mins;              // or nullptr
  const c10::Half* supers;       // or nullptr
  int64_t N, blocks, groups, rows, halves, group_bytes, super_count, per_super, super_parts;
  int bits;
  Kind kind;

  float number(const void* p, int64_t i) const {
    switch (kind) {
      case Kind::kFloat: return static_cast<const float*>(p)[i];
      case Kind::kUnsigned: return static_cast<const uint8_t*>(p)[i];
      case Kind::kSigned: return static_cast<const int8_t*>(p)[i];
      default: return static_cast<float>(static_cast<const c10::Half*>(p)[i]);
    }
  }
  // Row lane r's super-block factor ``part`` (0: D, 1: Dmin') for block b of group g; 1 for
  // weights without super-blocks.
  float super(int64_t g, int64_t b, int part, int64_t r) const {
    if (!supers) return 1.f;
    const int64_t s = b / per_super;
    return static_cast<float>(supers[((g * super_count + s) * super_parts + part) * rows + r]);
  }
};

inline void store(const float* v, float* out) { std::memcpy(out, v, kBlock * sizeof(float)); }

inline void store(const float* v, c10::BFloat16* out) {
#if defined(RADIXSERVE_AVX512) && defined(__AVX512BF16__)
  const __m512bh packed = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(v + 16), _mm512_loadu_ps(v));
  _mm512_storeu_si512(out, reinterpret_cast<const __m512i&>(packed));
#else
  for (int64_t e = 0; e < kBlock; ++e) out[e] = c10::BFloat16(v[e]);  // nearest, ties to even
#endif
}

#if defined(RADIXSERVE_AVX512)
// The 32 integer values of row lane r in one block (``data``) as 2 x 16 floats: one gather
// takes the lane's 4 bytes from each of the 8 k-quads.
template <int Bits>
inline void block_values(const Layout& w, const uint8_t* data, int64_t r, __m512& low,
                         __m512& high) {
  const int64_t half = w.rows / 2;
  const int64_t lane = Bits == 8 ? r : r % half;
  const int32_t stride = static_cast<int32_t>((Bits == 8 ? w.rows : half) * 4);
  const __m256i k_quads = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i quads = _mm256_mullo_epi32(k_quads, _mm256_set1_epi32(stride));
  __m256i bytes = _mm256_i32gather_epi32(reinterpret_cast<const int*>(data + lane * 4), quads, 1);
  __m512i first, second;
  if (Bits != 8) {
    if (r >= half) bytes = _mm256_srli_epi16(bytes, 4);
    bytes = _mm256_and_si256(bytes, _mm256_set1_epi8(15));
    if constexpr (Bits != 4) {  // the high bits: the lane's 4 bytes of each k-quad's planes
      constexpr int kHigh = Bits - 4;
      const int64_t span = w.rows * kHigh / 8;
      const __m256i planes = _mm256_i32gather_epi32(
          reinterpret_cast<const int*>(data + w.rows * 16 + (r % span) * 4),
          _mm256_mullo_epi32(k_quads, _mm256_set1_epi32(static_cast<int32_t>(span * 4))), 1);
      const __m256i high = _mm256_and_si256(
          _mm256_srl_epi16(planes, _mm_cvtsi32_si128(static_cast<int>(kHigh * (r / span)))),
          _mm256_set1_epi8((1 << kHigh) - 1));
      bytes = _mm256_or_si256(bytes, _mm256_slli_epi16(high, 4));
    }
    first = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(bytes));
    second = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(bytes, 1));
    if (Bits != 4) {  // stored + 32 (6-bit) or + 16 (5-bit)
      first = _mm512_sub_epi32(first, _mm512_set1_epi32(1 << (Bits - 1)));
      second = _mm512_sub_epi32(second, _mm512_set1_epi32(1 << (Bits - 1)));
    }
  } else if (w.rows == 16) {  // stored + 128
    first = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(bytes)),
                             _mm512_set1_epi32(128));
    second = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(bytes, 1)),
                              _mm512_set1_epi32(128));
  } else {
    first = _mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes));
    second = _mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1));
  }
  low = _mm512_cvtepi32_ps(first);
  high = _mm512_cvtepi32_ps(second);
}

inline void store2(__m512 low, __m512 high, float* out) {
  _mm512_storeu_ps(out, low);
  _mm512_storeu_ps(out + 16, high);
}

inline void store2(__m512 low, __m512 high, c10::BFloat16* out) {
#if defined(__AVX512BF16__)
  const __m512bh packed = _mm512_cvtne2ps_pbh(high, low);
  _mm512_storeu_si512(out, reinterpret_cast<const __m512i&>(packed));
#else
  float values[kBlock];
  store2(low, high, values);
  store(values, out);
#endif
}
#endif

// Row lane r of group g, every block, into out (K values): d * q + m, as dequantize_weight.
template <int Bits, typename T>
void widen_row(const Layout& w, int64_t g, int64_t r, T* out) {
  const int64_t half = w.rows / 2;
  const int offset8 = w.rows == 16 ? 128 : 0;
  for (int64_t b = 0; b < w.blocks; ++b) {
    const int64_t at = g * w.blocks + b;
    const uint8_t* data = w.q + at * w.group_bytes;
    const float D = w.super(g, b, 0, r);
    const float m = w.mins ? w.super(g, b, 1, r) * w.number(w.mins, at * w.rows + r) : 0.f;
    const float d0 = D * w.number(w.scales, (at * w.halves) * w.rows + r);
    const float d1 =
        w.halves == 2 ? D * w.number(w.scales, (at * w.halves + 1) * w.rows + r) : d0;
#if defined(RADIXSERVE_AVX512)
    __m512 low, high;
    block_values<Bits>(w, data, r, low, high);
    const __m512 mv = _mm512_set1_ps(m);
    store2(_mm512_fmadd_ps(_mm512_set1_ps(d0), low, mv),
           _mm512_fmadd_ps(_mm512_set1_ps(d1), high, mv), out + b * kBlock);
#else
    float values[kBlock];
    for (int64_t quad = 0; quad < 8; ++quad) {
      const float d = quad < 4 ? d0 : d1;
      if (Bits == 8) {
        const uint8_t* p = data + (quad * w.rows + r) * 4;
        for (int j = 0; j < 4; ++j) {
          const int v = offset8 ? static_cast<int>(p[j]) - offset8 : static_cast<int8_t>(p[j]);
          values[quad * 4 + j] = d * static_cast<float>(v) + m;
        }
      } else {
        const uint8_t* p = data + (quad * half + r % half) * 4;
        const int shift = r < half ? 0 : 4;
        constexpr int kHigh = Bits - 4;
        const int64_t span = std::max<int64_t>(1, w.rows * kHigh / 8);  // 4-bit: unused
        const uint8_t* planes = data + w.rows * 16 + (quad * span + r % span) * 4;
        for (int j = 0; j < 4; ++j) {
          int v = (p[j] >> shift) & 15;
          if (Bits != 4) {
            v = (v | (((planes[j] >> (kHigh * (r / span))) & ((1 << kHigh) - 1)) << 4)) -
                (1 << (Bits - 1));
          }
          values[quad * 4 + j] = d * static_cast<float>(v) + m;
        }
      }
    }
    store(values, out + b * kBlock);
#endif
  }
}

template <typename T>
void widen_all(const Layout& w, T* out, int64_t row_stride) {
  at::parallel_for(0, w.groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t r = 0; r < w.rows && g * w.rows + r < w.N; ++r) {
        T* row = out + (g * w.rows + r) * row_stride;
        if (w.bits == 8) {
          widen_row<8>(w, g, r, row);
        } else if (w.bits == 6) {
          widen_row<6>(w, g, r, row);
        } else if (w.bits == 5) {
          widen_row<5>(w, g, r, row);
        } else {
          widen_row<4>(w, g, r, row);
        }
      }
    }
  });
}

}  // namespace widen

widen::Kind kind_of(at::ScalarType type) {
  switch (type) {
    case at::kHalf: return widen::Kind::kHalf;
    case at::kFloat: return widen::Kind::kFloat;
    case at::kByte: return widen::Kind::kUnsigned;
    case at::kChar: return widen::Kind::kSigned;
    default: TORCH_CHECK(false, "widen_weight: scales of dtype ", type, " are not quant_repack's");
  }
}

// out [N, K] (bf16 or float32, rows contiguous, any row stride) = the dense matrix of the
// repacked weight ``blocks`` (quant_repack's tensors: qweight, scales, mins and, for the
// K-quants, supers; bits 4, 5, 6 or 8; N rows).
void widen_weight(at::TensorList blocks_of, int64_t bits, int64_t N, at::Tensor out) {
  using widen::kBlock;
  TORCH_CHECK(blocks_of.size() == 3 || blocks_of.size() == 4,
              "widen_weight: quant_repack's 3 or 4 tensors expected, got ", blocks_of.size());
  const at::Tensor& qweight = blocks_of[0];
  const at::Tensor& scales = blocks_of[1];
  const at::Tensor& mins = blocks_of[2];
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8,
              "widen_weight: bits must be 4, 5, 6 or 8, got ", bits);
  TORCH_CHECK(scales.dim() == 4 && scales.is_contiguous(),
              "widen_weight: scales [groups, blocks, halves, rows] from quant_repack expected");
  const widen::Kind kind = kind_of(scales.scalar_type());
  const int64_t groups = scales.size(0), blocks = scales.size(1), halves = scales.size(2),
                rows = scales.size(3);
  TORCH_CHECK((rows == 16 || rows == 8) && (halves == 1 || (bits != 4 && halves == 2)),
              "widen_weight: scales of ", rows, " rows and ", halves,
              " halves are not quant_repack's layout");
  const int64_t group_bytes = 8 * rows * 4 * bits / 8;
  TORCH_CHECK(qweight.dim() == 3 && qweight.is_contiguous() &&
                  qweight.scalar_type() == at::kByte && qweight.size(0) == groups &&
                  qweight.size(1) == blocks && qweight.size(2) == group_bytes,
              "widen_weight: qweight [groups, blocks, ", group_bytes, "] expected");
  TORCH_CHECK(N > (groups - 1) * rows && N <= groups * rows, "widen_weight: N = ", N,
              " does not match ", groups, " row groups");
  const bool has_mins = mins.numel() > 0;
  TORCH_CHECK(!has_mins || (mins.is_contiguous() && mins.scalar_type() == scales.scalar_type() &&
                            mins.numel() == groups * blocks * rows && halves == 1),
              "widen_weight: mins [groups, blocks, rows] in the scales' dtype expected");
  TORCH_CHECK(bits != 4 || has_mins, "widen_weight: 4-bit weights need mins");
  const bool small = kind == widen::Kind::kUnsigned || kind == widen::Kind::kSigned;
  const at::Tensor supers = blocks_of.size() == 4 ? blocks_of[3] : at::Tensor();
  const bool has_supers = supers.defined() && supers.numel() > 0;
  TORCH_CHECK(small == has_supers, "widen_weight: integer scales need super-block ones, and "
              "only they");
  int64_t super_count = 1, per_super = 1, super_parts = 1;
  if (has_supers) {
    super_count = supers.size(1);
    super_parts = supers.size(2);
    TORCH_CHECK(supers.dim() == 4 && supers.is_contiguous() &&
                    supers.scalar_type() == at::kHalf && supers.size(0) == groups &&
                    (super_count == blocks || super_count == (blocks + 7) / 8) &&
                    super_parts == (has_mins ? 2 : 1) && supers.size(3) == rows,
                "widen_weight: supers [groups, super-blocks, parts, rows] float16 expected");
    per_super = super_count == blocks ? 1 : 8;
  }
  const int64_t K = blocks * kBlock;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == N && out.size(1) == K && out.stride(1) == 1 &&
                  out.stride(0) >= K,
              "widen_weight: out [", N, ", ", K, "] with contiguous rows expected, got ",
              out.sizes());
  const widen::Layout w{qweight.data_ptr<uint8_t>(), scales.data_ptr(),
                        has_mins ? mins.data_ptr() : nullptr,
                        has_supers ? supers.data_ptr<c10::Half>() : nullptr,
                        N, blocks, groups, rows, halves, group_bytes, super_count, per_super,
                        super_parts,
                        static_cast<int>(bits), kind};
  switch (out.scalar_type()) {
    case at::kFloat:
      widen::widen_all(w, out.data_ptr<float>(), out.stride(0));
      break;
    case at::kBFloat16:
      widen::widen_all(w, out.data_ptr<c10::BFloat16>(), out.stride(0));
      break;
    default:
      TORCH_CHECK(false, "widen_weight: out must be bfloat16 or float32, got ",
                  out.scalar_type());
  }
}

}  // namespace

RADIXSERVE_OPS_FRAGMENT(m) {
  m.def("widen_weight(Tensor[] blocks, int bits, int N, Tensor(a!) out) -> ()");
}

RADIXSERVE_OPS_IMPL(m) { m.impl("widen_weight", &widen_weight); }
