// quant_repack: a checkpoint's quantized blocks (engine/checkpoints/quant_formats.py) laid out
// once for the loops of quant_linear.cpp, in the layout quant_layout.h describes:
//
//   qweight [groups, blocks, group_bytes(bits)] (the padding rows are zeros)
//   scales [groups, blocks, halves, kRows], mins [groups, blocks, kRows]: float16, or the
//            K-quants' uint8 (Q4_K) or int8 (Q6_K) sc and mn
//   supers [groups, supers, parts, kRows] float16: the K-quants' D (and Dmin', parts 2) of
//            each super-block of 8 blocks, or of each block where a tensor-parallel share of
//            the columns starts inside a super-block (supers = blocks); empty otherwise
//            (groups = ceil(N / kRows); mins empty for 8-, 6- and 5-bit weights without m)
//
// dequantize_weight reads rows of the layout back as the dense matrix they stand for.
// Registered as torch.ops.radixserve.quant_repack and dequantize_weight.

#include <ATen/Parallel.h>

#include <tuple>
#include <vector>

#include "quant_layout.h"

namespace {

using namespace radixserve::quant;

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
// float16) in the interleaved layout above. ``bits`` 6 (Q6_K) and 5 (Q5_0) read int8 [N, K]
// values in -32..31 and -16..15 and keep them in 6 and 5 bits. A 4-bit weight without mins
// (Q4_0) gets m = -8 d; an 8-, 6- or 5-bit one keeps none.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quant_repack(
    const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
    const c10::optional<at::Tensor>& super_scales, const c10::optional<at::Tensor>& super_mins,
    int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8,
              "quant_repack: bits must be 4, 5, 6 or 8, got ", bits);
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.element_size() == 1,
              "quant_repack: qweight [N, bytes] contiguous");
  const int64_t N = qweight.size(0), K = qweight.size(1) * (bits == 4 ? 2 : 1);
  if (bits == 5 || bits == 6) {
    const int offset = offset_of(static_cast<int>(bits));
    const at::Tensor values = qweight.view(at::kChar);
    TORCH_CHECK(values.numel() == 0 || (values.min().item<int>() >= -offset &&
                                        values.max().item<int>() < offset),
                "quant_repack: ", bits, "-bit values must lie in ", -offset, "..", offset - 1);
  }
  TORCH_CHECK(K % kBlock == 0, "quant_repack: K = ", K, " is not a multiple of 32");
  const int64_t blocks = K / kBlock, groups = (N + kRows - 1) / kRows;
  const Scales kind = scales_kind(scales.scalar_type());
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N &&
                  (scales.size(1) == blocks || (bits != 4 && scales.size(1) == 2 * blocks)),
              "quant_repack: scales [N, K / 32] (8-, 6- and 5-bit: or [N, K / 16])");
  const int64_t halves = blocks ? scales.size(1) / blocks : 1;
  const bool has_mins = mins.has_value() && mins->defined();
  const bool has_supers = super_scales.has_value() && super_scales->defined();
  const bool has_super_mins = super_mins.has_value() && super_mins->defined();
  TORCH_CHECK(has_supers == (kind != Scales::kHalf) && (!has_super_mins || has_mins) &&
                  has_super_mins == (kind != Scales::kHalf && has_mins),
              "quant_repack: integer scales (and minimums) come with super_scales (and "
              "super_mins), float16 ones without");
  TORCH_CHECK(kind == Scales::kHalf || bits != 4 || has_mins,
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
  const int64_t row_bytes = qweight.size(1);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t g = n / kRows, lane = n % kRows;
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* block = dst + (g * blocks + b) * group_bytes(bits);
      const uint8_t* row = src + n * row_bytes;
      for (int64_t e = 0; e < kBlock; ++e) {
        int32_t q;
        if (bits == 4) {
          const uint8_t stored = row[b * 16 + e % 16];
          q = e < 16 ? stored & 15 : stored >> 4;
        } else {
          q = static_cast<int8_t>(row[b * kBlock + e]);
        }
        put_value(block, static_cast<int>(bits), lane, e, q);
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

}  // namespace

RADIXSERVE_OPS_FRAGMENT(m) {
  m.def("quant_repack(Tensor qweight, Tensor scales, Tensor? mins, Tensor? super_scales, "
        "Tensor? super_mins, int bits) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("dequantize_weight(Tensor qweight, Tensor scales, Tensor mins, Tensor supers, int bits, "
        "int N, Tensor rows, ScalarType dtype) -> Tensor");
}

RADIXSERVE_OPS_IMPL(m) {
  m.impl("quant_repack", &quant_repack);
  m.impl("dequantize_weight", &dequantize_weight);
}
