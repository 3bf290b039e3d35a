// The low-rank (LoRA) updates of rows under different adapters, one op (Punica's BGMV form):
//
//   out[i] += B[s] (A[s] x[i])   for each row i whose slot s = row_slots[i] is not -1,
//
// A[s] the first widths[s] rows of a_slots[s] ([R, in]) and B[s] held transposed, the first
// widths[s] rows of b_slots[s] ([R, out]), so that the second product reads contiguous tiles of
// outputs; spans[s, r] = [begin, end): the columns of B[s]'s row r outside it are zeros and not
// read (the parts of a fused projection that an adapter's rank row does not reach: two thirds
// of q/k/v's B, half of gate/up's). Weights float32 or bf16 (widened in registers: decode steps
// are bound by reading them), products and sums in float32; each row's delta is added to out
// once, rounded to out's dtype there. Rows of one slot go in blocks of kLoraRows that share each load of its weights:
// first t = A[s] x[i] (threads split the blocks), then out[i] += B[s] t (threads split slot x
// tile of kLoraTile outputs; a slot's blocks take the tile in turn while it is in L1). A row's sums
// run in the same order whatever its block, and the AVX-512, AVX2 and portable loops compute
// the same sums, in their own order.
// In torch the same takes a pair of small matmuls per adapter (lora_pool.LoraStep).
// Registered as torch.ops.radixserve.lora_bgmv; built by engine/worker/cpu_kernels.py.

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "ops.h"

namespace {

using radixserve::to_float;

constexpr int64_t kLoraTile = 256;
// Rows of one slot that share each load of its weights.
constexpr int kLoraRows = 4;

// t[q][r] = sum_d a[r * in + d] * x[q][d] for r < width, q < Rows: each row of A read once
// for the Rows rows of x.
template <int Rows, typename W, typename X>
void shrink(const W* a, int64_t width, int64_t in, const X* const* x, float* const* t) {
  for (int64_t r = 0; r < width; ++r) {
    const W* ar = a + r * in;
    float sum[Rows] = {};
    int64_t d = 0;
#if defined(RADIXSERVE_AVX512)
    __m512 acc[Rows];
    for (int q = 0; q < Rows; ++q) acc[q] = _mm512_setzero_ps();
    for (; d + 16 <= in; d += 16) {
      const __m512 w = radixserve::load16(ar + d);
      for (int q = 0; q < Rows; ++q) acc[q] = _mm512_fmadd_ps(w, radixserve::load16(x[q] + d), acc[q]);
    }
    for (int q = 0; q < Rows; ++q) sum[q] = _mm512_reduce_add_ps(acc[q]);
#elif defined(RADIXSERVE_AVX2)
    __m256 acc[Rows];
    for (int q = 0; q < Rows; ++q) acc[q] = _mm256_setzero_ps();
    for (; d + 8 <= in; d += 8) {
      const __m256 w = radixserve::load8(ar + d);
      for (int q = 0; q < Rows; ++q) acc[q] = _mm256_fmadd_ps(w, radixserve::load8(x[q] + d), acc[q]);
    }
    for (int q = 0; q < Rows; ++q) sum[q] = radixserve::sum_lanes8(acc[q]);
#endif
    for (; d < in; ++d) {
      const float w = to_float(ar[d]);
      for (int q = 0; q < Rows; ++q) sum[q] += w * to_float(x[q][d]);
    }
    for (int q = 0; q < Rows; ++q) t[q][r] = sum[q];
  }
}

template <typename O>
void add_delta(O* out, const float* delta, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<O>(to_float(out[j]) + delta[j]);
}

// out[q][j] += sum_r t[q][r] * bt[r * stride + j] for j in [0, len), len <= kLoraTile, q < Rows,
// r over the ``used`` rows listed in ``rows``: each load of B serves the Rows rows.
template <int Rows, typename W, typename O>
void expand(const float* const* t, const int64_t* rows, int64_t used, const W* bt,
            int64_t stride, O* const* out, int64_t len) {
  float delta[Rows][kLoraTile];
  int64_t j = 0;
#if defined(RADIXSERVE_AVX512)
  constexpr int64_t kStep = Rows == 1 ? 64 : 32;  // Rows x kStep / 16 accumulators
  constexpr int kVecs = kStep / 16;
  for (; j + kStep <= len; j += kStep) {
    __m512 acc[Rows][kVecs];
    for (int q = 0; q < Rows; ++q) {
      for (int v = 0; v < kVecs; ++v) acc[q][v] = _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < used; ++k) {
      const int64_t r = rows[k];
      const W* b = bt + r * stride + j;
      __m512 bv[kVecs];
      for (int v = 0; v < kVecs; ++v) bv[v] = radixserve::load16(b + 16 * v);
      for (int q = 0; q < Rows; ++q) {
        const __m512 tq = _mm512_set1_ps(t[q][r]);
        for (int v = 0; v < kVecs; ++v) acc[q][v] = _mm512_fmadd_ps(tq, bv[v], acc[q][v]);
      }
    }
    for (int q = 0; q < Rows; ++q) {
      for (int v = 0; v < kVecs; ++v) _mm512_storeu_ps(delta[q] + j + 16 * v, acc[q][v]);
    }
  }
  for (; j + 16 <= len; j += 16) {
    __m512 acc[Rows];
    for (int q = 0; q < Rows; ++q) acc[q] = _mm512_setzero_ps();
    for (int64_t k = 0; k < used; ++k) {
      const int64_t r = rows[k];
      const __m512 b = radixserve::load16(bt + r * stride + j);
      for (int q = 0; q < Rows; ++q) acc[q] = _mm512_fmadd_ps(_mm512_set1_ps(t[q][r]), b, acc[q]);
    }
    for (int q = 0; q < Rows; ++q) _mm512_storeu_ps(delta[q] + j, acc[q]);
  }
#elif defined(RADIXSERVE_AVX2)
  constexpr int64_t kStep = Rows == 1 ? 32 : 16;  // AVX2 has 16 registers
  constexpr int kVecs = kStep / 8;
  for (; j + kStep <= len; j += kStep) {
    __m256 acc[Rows][kVecs];
    for (int q = 0; q < Rows; ++q) {
      for (int v = 0; v < kVecs; ++v) acc[q][v] = _mm256_setzero_ps();
    }
    for (int64_t k = 0; k < used; ++k) {
      const int64_t r = rows[k];
      const W* b = bt + r * stride + j;
      __m256 bv[kVecs];
      for (int v = 0; v < kVecs; ++v) bv[v] = radixserve::load8(b + 8 * v);
      for (int q = 0; q < Rows; ++q) {
        const __m256 tq = _mm256_set1_ps(t[q][r]);
        for (int v = 0; v < kVecs; ++v) acc[q][v] = _mm256_fmadd_ps(tq, bv[v], acc[q][v]);
      }
    }
    for (int q = 0; q < Rows; ++q) {
      for (int v = 0; v < kVecs; ++v) _mm256_storeu_ps(delta[q] + j + 8 * v, acc[q][v]);
    }
  }
  for (; j + 8 <= len; j += 8) {
    __m256 acc[Rows];
    for (int q = 0; q < Rows; ++q) acc[q] = _mm256_setzero_ps();
    for (int64_t k = 0; k < used; ++k) {
      const int64_t r = rows[k];
      const __m256 b = radixserve::load8(bt + r * stride + j);
      for (int q = 0; q < Rows; ++q) acc[q] = _mm256_fmadd_ps(_mm256_set1_ps(t[q][r]), b, acc[q]);
    }
    for (int q = 0; q < Rows; ++q) _mm256_storeu_ps(delta[q] + j, acc[q]);
  }
#endif
  const int64_t vectorized = j;
  for (int q = 0; q < Rows; ++q) std::fill(delta[q] + vectorized, delta[q] + len, 0.f);
  for (int64_t k = 0; k < used; ++k) {
    const int64_t r = rows[k];
    const W* b = bt + r * stride;
    for (int q = 0; q < Rows; ++q) {
      for (j = vectorized; j < len; ++j) delta[q][j] += t[q][r] * to_float(b[j]);
    }
  }
  for (int q = 0; q < Rows; ++q) add_delta(out[q], delta[q], len);
}

template <typename X, typename W>
void bgmv(const at::Tensor& x, const at::Tensor& a_slots, const at::Tensor& b_slots,
          const int64_t* slot_of, const int64_t* widths, const int64_t* spans,
          at::Tensor& out) {
  const int64_t rows = x.size(0), in = x.size(1), rank = a_slots.size(1), outs = b_slots.size(2);
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  const X* xp = x.data_ptr<X>();
  X* outp = out.data_ptr<X>();
  const W* ap = a_slots.data_ptr<W>();
  const W* bp = b_slots.data_ptr<W>();

  // The adapted rows in slot order, cut into blocks of at most kLoraRows rows of one slot.
  std::vector<int64_t> order;
  for (int64_t i = 0; i < rows; ++i) {
    if (slot_of[i] >= 0 && widths[slot_of[i]] > 0) order.push_back(i);
  }
  if (order.empty()) return;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t p, int64_t q) { return slot_of[p] < slot_of[q]; });
  const int64_t adapted = static_cast<int64_t>(order.size());
  std::vector<int64_t> block_starts, group_starts;  // into order; groups: into block_starts
  for (int64_t k = 0; k < adapted; ++k) {
    const bool new_group = k == 0 || slot_of[order[k]] != slot_of[order[k - 1]];
    if (new_group) group_starts.push_back(static_cast<int64_t>(block_starts.size()));
    if (new_group || k - block_starts.back() == kLoraRows) block_starts.push_back(k);
  }
  const int64_t blocks = static_cast<int64_t>(block_starts.size());
  const int64_t groups = static_cast<int64_t>(group_starts.size());
  block_starts.push_back(adapted);
  group_starts.push_back(blocks);

  std::vector<float> shrunk(rows * rank);  // t = A[s] x[i], row i at i * rank
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t lo = block_starts[block], count = block_starts[block + 1] - lo;
      const int64_t s = slot_of[order[lo]];
      const X* x_rows[kLoraRows];
      float* t_rows[kLoraRows];
      for (int64_t q = 0; q < count; ++q) {
        x_rows[q] = xp + order[lo + q] * x_stride;
        t_rows[q] = shrunk.data() + order[lo + q] * rank;
      }
      const W* a = ap + s * rank * in;
      if (count == kLoraRows) {
        shrink<kLoraRows>(a, widths[s], in, x_rows, t_rows);
      } else {
        for (int64_t q = 0; q < count; ++q) shrink<1>(a, widths[s], in, x_rows + q, t_rows + q);
      }
    }
  });

  const int64_t tiles = (outs + kLoraTile - 1) / kLoraTile;
  at::parallel_for(0, groups * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> used_rows(rank);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t group = item / tiles, first = (item % tiles) * kLoraTile;
      const int64_t len = std::min(kLoraTile, outs - first);
      const int64_t s = slot_of[order[block_starts[group_starts[group]]]];
      const W* bt = bp + s * rank * outs + first;
      // The rows of B^T with nonzero columns in this tile: the rest are not read.
      int64_t used = 0;
      for (int64_t r = 0; r < widths[s]; ++r) {
        const int64_t* span = spans + (s * rank + r) * 2;
        if (span[0] < first + len && span[1] > first) used_rows[used++] = r;
      }
      if (used == 0) continue;
      for (int64_t block = group_starts[group]; block < group_starts[group + 1]; ++block) {
        const int64_t lo = block_starts[block], count = block_starts[block + 1] - lo;
        const float* t_rows[kLoraRows];
        X* out_rows[kLoraRows];
        for (int64_t q = 0; q < count; ++q) {
          t_rows[q] = shrunk.data() + order[lo + q] * rank;
          out_rows[q] = outp + order[lo + q] * out_stride + first;
        }
        if (count == kLoraRows) {
          expand<kLoraRows>(t_rows, used_rows.data(), used, bt, outs, out_rows, len);
        } else {
          for (int64_t q = 0; q < count; ++q) {
            expand<1>(t_rows + q, used_rows.data(), used, bt, outs, out_rows + q, len);
          }
        }
      }
    }
  });
}

template <typename X>
void dispatch_weights(const at::Tensor& x, const at::Tensor& a_slots, const at::Tensor& b_slots,
                      const int64_t* slot_of, const int64_t* widths, const int64_t* spans,
                      at::Tensor& out) {
  switch (a_slots.scalar_type()) {
    case at::kFloat:
      return bgmv<X, float>(x, a_slots, b_slots, slot_of, widths, spans, out);
    case at::kBFloat16:
      return bgmv<X, c10::BFloat16>(x, a_slots, b_slots, slot_of, widths, spans, out);
    default:
      TORCH_CHECK(false, "lora_bgmv: adapter slots in float32 or bf16 expected, not ",
                  a_slots.scalar_type());
  }
}

void lora_bgmv(const at::Tensor& x, const at::Tensor& a_slots, const at::Tensor& b_slots,
               const at::Tensor& row_slots, const at::Tensor& widths, const at::Tensor& spans,
               at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "lora_bgmv: x [n, in] with contiguous rows "
              "expected");
  TORCH_CHECK(a_slots.dim() == 3 && a_slots.is_contiguous() && a_slots.size(2) == x.size(1),
              "lora_bgmv: a_slots [L, R, in] contiguous expected");
  TORCH_CHECK(b_slots.dim() == 3 && b_slots.is_contiguous() &&
                  b_slots.size(0) == a_slots.size(0) && b_slots.size(1) == a_slots.size(1) &&
                  b_slots.scalar_type() == a_slots.scalar_type(),
              "lora_bgmv: b_slots [L, R, out] contiguous, of a_slots' dtype, expected");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) &&
                  out.size(1) == b_slots.size(2) && out.scalar_type() == x.scalar_type(),
              "lora_bgmv: out [n, out] of x's dtype with contiguous rows expected");
  TORCH_CHECK(row_slots.dim() == 1 && row_slots.is_contiguous() &&
                  row_slots.scalar_type() == at::kLong && row_slots.size(0) == x.size(0),
              "lora_bgmv: row_slots int64 [n] expected");
  TORCH_CHECK(widths.dim() == 1 && widths.is_contiguous() && widths.scalar_type() == at::kLong &&
                  widths.size(0) == a_slots.size(0),
              "lora_bgmv: widths int64 [L] expected");
  TORCH_CHECK(spans.dim() == 3 && spans.is_contiguous() && spans.scalar_type() == at::kLong &&
                  spans.size(0) == a_slots.size(0) && spans.size(1) == a_slots.size(1) &&
                  spans.size(2) == 2,
              "lora_bgmv: spans int64 [L, R, 2] expected");
  const int64_t* slot_of = row_slots.data_ptr<int64_t>();
  const int64_t* width_of = widths.data_ptr<int64_t>();
  const int64_t* span_of = spans.data_ptr<int64_t>();
  for (int64_t i = 0; i < x.size(0); ++i) {
    TORCH_CHECK(slot_of[i] >= -1 && slot_of[i] < a_slots.size(0), "lora_bgmv: row ", i,
                " names slot ", slot_of[i], " of ", a_slots.size(0));
  }
  for (int64_t s = 0; s < a_slots.size(0); ++s) {
    TORCH_CHECK(width_of[s] >= 0 && width_of[s] <= a_slots.size(1), "lora_bgmv: slot ", s,
                " has width ", width_of[s], " of at most ", a_slots.size(1));
  }
  switch (x.scalar_type()) {
    case at::kFloat:
      return dispatch_weights<float>(x, a_slots, b_slots, slot_of, width_of, span_of, out);
    case at::kBFloat16:
      return dispatch_weights<c10::BFloat16>(x, a_slots, b_slots, slot_of, width_of, span_of, out);
    case at::kHalf:
      return dispatch_weights<c10::Half>(x, a_slots, b_slots, slot_of, width_of, span_of, out);
    default:
      TORCH_CHECK(false, "lora_bgmv: unsupported input dtype ", x.scalar_type());
  }
}

}  // namespace

RADIXSERVE_OPS_FRAGMENT(m) {
  m.def("lora_bgmv(Tensor x, Tensor a_slots, Tensor b_slots, Tensor row_slots, Tensor widths, "
        "Tensor spans, Tensor(a!) out) -> ()");
}

RADIXSERVE_OPS_IMPL(m) { m.impl("lora_bgmv", &lora_bgmv); }
