// The kernel layout of a quantized weight: what quant_repack (quant_repack.cpp) writes and
// quant_linear / dequantize_weight (quant_linear.cpp) read. kRows output rows are interleaved
// so that one vector holds the same 4 consecutive k of kRows rows (a "k-quad"); a block of 32
// is 8 k-quads, group_bytes(bits) bytes:
//
//   bits 8: [8 k-quads][kRows][4] bytes, q + 128 where kRows is 16 (VNNI multiplies unsigned
//           by signed bytes), q as int8 where it is 8 (AVX2)
//   bits 4: [8 k-quads][kRows / 2][4] bytes: rows 0 .. kRows/2 - 1 in the low nibbles, the
//           others in the high
//   bits 6, 5: q + 32 (0..63) or q + 16 (0..31): its low 4 bits as a 4-bit block, then its
//           h = bits - 4 high bits in planes, [8 k-quads][kRows h / 8][4] bytes: with
//           span = kRows h / 8 rows, row r's h bits of element 4 quad + k are bits
//           h (r / span) .. h (r / span) + h - 1 of byte ((quad * span + r % span) * 4 + k)
//
// so that one k-quad's vector of kRows x 4 bytes is, for 4-bit values, its bytes and their
// high nibbles side by side, and for 6- and 5-bit ones the planes' bytes repeated once per
// 8 / h parts of the vector, each part shifting its own h bits into place.
#pragma once

#include "ops.h"

#if defined(RADIXSERVE_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define RADIXSERVE_VNNI 1
#endif

namespace radixserve::quant {

constexpr int64_t kBlock = 32;
constexpr int64_t kQuads = kBlock / 4;
#if defined(RADIXSERVE_AVX2) && !defined(RADIXSERVE_VNNI)
constexpr int64_t kRows = 8;
constexpr int kOffset8 = 0;  // the sign trick needs int8 weights signed
#else
constexpr int64_t kRows = 16;
constexpr int kOffset8 = 128;
#endif
constexpr int kOffset6 = 32;  // 6- and 5-bit values are stored unsigned in every build
constexpr int kOffset5 = 16;

inline int64_t group_bytes(int bits) { return kQuads * kRows * 4 * bits / 8; }
// Where a 6- or 5-bit block's planes start: after its low 4 bits, laid out as a 4-bit block.
constexpr int64_t kNibbleBytes = kQuads * kRows * 2;

// What a stored value's offset is: the integer q is stored - offset_of(bits).
inline int offset_of(int bits) {
  return bits == 8 ? kOffset8 : bits == 6 ? kOffset6 : bits == 5 ? kOffset5 : 0;
}

// How a weight's scales and minimums are held: float16, or a K-quant's small integers under
// its super-block's float16.
enum class Scales { kHalf, kUnsigned, kSigned };

inline Scales scales_kind(at::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf: return Scales::kHalf;
    case at::kByte: return Scales::kUnsigned;
    case at::kChar: return Scales::kSigned;
    default:
      TORCH_CHECK(false, "quant_linear: scales float16, uint8 or int8 expected, got ", dtype);
  }
}

// The integer q of element e of row lane r in one block of the layout.
inline int32_t value_in(const uint8_t* block, int bits, int64_t r, int64_t e) {
  const int64_t quad = e / 4, byte = e % 4;
  if (bits == 8) {
    const int32_t stored = block[(quad * kRows + r) * 4 + byte];
    return kOffset8 ? stored - kOffset8 : static_cast<int8_t>(stored);
  }
  const int64_t half = kRows / 2;
  int32_t stored = (block[(quad * half + r % half) * 4 + byte] >> (r < half ? 0 : 4)) & 15;
  if (bits == 4) return stored;
  const int high = bits - 4;
  const int64_t span = kRows * high / 8;
  const uint8_t planes = block[kNibbleBytes + (quad * span + r % span) * 4 + byte];
  stored |= ((planes >> (high * (r / span))) & ((1 << high) - 1)) << 4;
  return stored - offset_of(bits);
}

// Writes q (in range for ``bits``) as element e of row lane r into a zeroed block.
inline void put_value(uint8_t* block, int bits, int64_t r, int64_t e, int32_t q) {
  const int64_t quad = e / 4, byte = e % 4;
  if (bits == 8) {
    block[(quad * kRows + r) * 4 + byte] = static_cast<uint8_t>(q + kOffset8);
    return;
  }
  const int32_t stored = q + offset_of(bits);
  const int64_t half = kRows / 2;
  block[(quad * half + r % half) * 4 + byte] |=
      static_cast<uint8_t>((stored & 15) << (r < half ? 0 : 4));
  if (bits != 4) {
    const int high = bits - 4;
    const int64_t span = kRows * high / 8;
    block[kNibbleBytes + (quad * span + r % span) * 4 + byte] |=
        static_cast<uint8_t>((stored >> 4) << (high * (r / span)));
  }
}

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

// The integer q of element e of block b of row lane r in group g.
inline int32_t value_at(const Weights& w, int64_t g, int64_t b, int64_t r, int64_t e) {
  return value_in(w.block(g, b), w.bits, r, e);
}

// The repacked weight quant_repack returned, checked against the layout.
inline Weights describe(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins,
                 const at::Tensor& supers, int64_t bits, int64_t N) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8,
              "quant_linear: bits must be 4, 5, 6 or 8, got ", bits);
  TORCH_CHECK(qweight.dim() == 3 && qweight.is_contiguous() &&
                  qweight.scalar_type() == at::kByte && qweight.size(2) == group_bytes(bits),
              "quant_linear: qweight from quant_repack expected");
  const int64_t groups = qweight.size(0), blocks = qweight.size(1);
  TORCH_CHECK(N > (groups - 1) * kRows && N <= groups * kRows, "quant_linear: N = ", N,
              " does not match ", groups, " row groups");
  const Scales kind = scales_kind(scales.scalar_type());
  const int64_t per_group = groups * blocks * kRows;
  TORCH_CHECK(scales.is_contiguous() &&
                  (scales.numel() == per_group || (bits != 4 && scales.numel() == 2 * per_group)),
              "quant_linear: scales from quant_repack expected");
  Weights w{qweight.data_ptr<uint8_t>(), scales.data_ptr(), nullptr, nullptr,
            static_cast<int>(bits), kind,
            static_cast<int>(scales.numel() / std::max<int64_t>(per_group, 1)), N,
            blocks * kBlock, blocks, groups};
  if (per_group == 0) w.halves = 1;
  TORCH_CHECK(bits != 4 || mins.numel() > 0, "quant_linear: 4-bit weights need mins");
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

}  // namespace radixserve::quant
