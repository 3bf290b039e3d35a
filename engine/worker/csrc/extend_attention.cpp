// Extend attention straight over the KV pages, on CPU with bf16 matrix units: the query rows a
// step adds to each sequence (a question over a cached head, a prefill chunk) attend the keys
// of their sequence up to their own (or the last `window` of them) with both products on
// oneDNN's brgemm micro-kernel (AMX tiles where the CPU has them: torch's
// at::native::cpublas::brgemm, which torch's own flash attention uses), in place of gathering
// the pages dense and calling SDPA. Built by engine/worker/cpu_kernels.py; registered as
// torch.ops.radixserve.extend_attention, with paged_decode's arguments and results
// (csrc/paged_decode.cpp says what each one means; q_indptr is required here).
//
// Work item = a tile of up to kRowTile of a sequence's query rows and one KV head. The
// tile's rows of the H / KVH query heads sharing that KV head are folded into one matrix
// (row r * group + i: tile row r, head i of the group), so each key block is packed once for
// all of them and the products have group times more rows:
//
//   for each block of kKeyBlock keys from the tile's first visible key to its last row's:
//     K^T packed to VNNI pairs  ->  S = Q K^T        (float32, brgemm)
//     online softmax over S: scale, causal / window / start mask by position (no mask tensor),
//     running max and sum in float32, weights rounded to bf16, the output rows rescaled
//     V packed to VNNI pairs    ->  O += P V         (float32, brgemm)
//   out = O / sum (bf16, rounded once), lse = max + log(sum)
//
// Scores, the softmax's sums and the output accumulate in float32; the weights enter the
// second product as bf16, as in torch's flash attention. A block's keys outside the tile's
// range (before its first row's window or start, past its last row) are packed as zeros, never
// read (a masked weight 0 times a stale NaN would poison the sum). Row results
// depend on the block boundaries, so --deterministic never takes this path (paged_decode's
// 16-key blocks aligned to position 0 are what it builds on).

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <array>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "ops.h"
#include "paged_args.h"

// A named namespace: every source is one translation unit, whose anonymous namespace
// paged_decode.cpp's names (kRowTile, kKeyBlock) share.
namespace radixserve::extend {

constexpr int64_t kRowTile = 32;   // query rows of one sequence per work item
constexpr int64_t kKeyBlock = 256;  // keys per block at most: N of Q K^T, K of P V
constexpr int64_t kKeyAlign = 32;   // blocks start and end at multiples of this
constexpr int64_t kMaxHeadDim = 256;

#if defined(RADIXSERVE_AVX512) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define RADIXSERVE_EXTEND_ATTENTION 1
using radixserve::load16;
using Bf16 = c10::BFloat16;

struct Problem {
  const Bf16* q;
  const Bf16* k;
  const Bf16* v;
  Bf16* out;
  float* lse;
  const int32_t* indptr;
  const int32_t* indices;
  const int32_t* seq_lens;
  const int32_t* starts;  // nullptr: from position 0
  const int32_t* q_indptr;
  int64_t heads, kv_heads, head_dim, page_size, window;
  int64_t page_stride, slot_stride;  // elements between pages, between a page's slots
  float scale;
};

// One scratch set per thread, kept between calls (allocated each call, its ~250 KB came
// from fresh zeroed pages every layer): the folded queries, a block's packed keys, values,
// scores and weights, and the running output, maximum and sum of each folded row.
struct Scratch {
  std::vector<Bf16> q, k, v, p;
  std::vector<float> s, o, max, sum;
  void fit(int64_t rows, int64_t D) {
    q.resize(rows * D), k.resize(kKeyBlock * D), v.resize(kKeyBlock * D);
    p.resize(rows * kKeyBlock), s.resize(rows * kKeyBlock), o.resize(rows * D);
    max.resize(rows), sum.resize(16 * rows);
  }
};

// Where keys [k0, k0 + N) of KV head kv sit in the pools (the same offset in K's and V's), -1
// for those outside [k0 + skip, k0 + n): walked page by page, one division a block.
void key_offsets(const Problem& pr, int64_t b, int64_t kv, int64_t k0, int64_t skip, int64_t n,
                 int64_t N, int64_t* offsets) {
  const int32_t* pages = pr.indices + pr.indptr[b];
  int64_t t = 0;
  for (; t < std::min(skip, N); ++t) offsets[t] = -1;
  int64_t page = (k0 + t) / pr.page_size, slot = (k0 + t) - page * pr.page_size;
  for (; t < n; ++t) {
    offsets[t] = pages[page] * pr.page_stride + slot * pr.slot_stride + kv * pr.head_dim;
    if (++slot == pr.page_size) slot = 0, ++page;
  }
  for (; t < N; ++t) offsets[t] = -1;
}

// A 16 x 16 matrix of 32-bit words, transposed in registers.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes: rows 4i..4i+3 hold lane L of rows 4L..
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

// Keys at `offsets` (N of them, a multiple of 16; -1: a zero key) as brgemm's B operand of
// Q K^T: [D / 2][N][2], i.e. each key's pairs of bf16 values as one 32-bit word, transposed 16
// keys by 16 words at a time. The keys before a block's first visible one are zeros, never read
// (a sliding layer's pages there may be gone).
void pack_keys(const Problem& pr, const int64_t* offsets, int64_t N, Bf16* dst) {
  const int64_t pairs = pr.head_dim / 2;
  auto* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t t0 = 0; t0 < N; t0 += 16) {
    for (int64_t j0 = 0; j0 < pairs; j0 += 16) {
      __m512i r[16];
      for (int t = 0; t < 16; ++t)
        r[t] = offsets[t0 + t] >= 0 ? _mm512_loadu_si512(pr.k + offsets[t0 + t] + 2 * j0)
                                    : _mm512_setzero_si512();
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(out + (j0 + j) * N + t0, r[j]);
    }
  }
}

// Values at `offsets` (N of them, N even) as B of P V: [N / 2][D][2], the rows of each pair of
// keys interleaved; a -1 offset gives zeros (a weight 0 times a stale NaN would poison the sum).
void pack_values(const Problem& pr, const int64_t* offsets, int64_t N, Bf16* dst) {
  const int64_t D = pr.head_dim;
  // Lanes of one output vector: (x[i], y[i]) pairs from x's first or second 16 values (an
  // index of 32 + i picks y's i).
  alignas(64) int16_t low_index[32], high_index[32];
  for (int i = 0; i < 16; ++i) {
    low_index[2 * i] = i, low_index[2 * i + 1] = 32 + i;
    high_index[2 * i] = 16 + i, high_index[2 * i + 1] = 48 + i;
  }
  const __m512i low = _mm512_load_si512(low_index), high = _mm512_load_si512(high_index);
  for (int64_t t = 0; t < N; t += 2) {
    Bf16* pair = dst + t * D;
    const Bf16* x = offsets[t] >= 0 ? pr.v + offsets[t] : nullptr;
    const Bf16* y = offsets[t + 1] >= 0 ? pr.v + offsets[t + 1] : nullptr;
    if (x == nullptr && y == nullptr) {
      std::memset(pair, 0, 2 * D * sizeof(Bf16));
      continue;
    }
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i xs = x != nullptr ? _mm512_loadu_si512(x + d) : _mm512_setzero_si512();
      const __m512i ys = y != nullptr ? _mm512_loadu_si512(y + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(pair + 2 * d, _mm512_permutex2var_epi16(xs, low, ys));
      _mm512_storeu_si512(pair + 2 * d + 32, _mm512_permutex2var_epi16(xs, high, ys));
    }
  }
}

// 2^x for x <= 0, 16 lanes: x = n + f with f in [-0.5, 0.5], 2^f by a degree-4 polynomial
// fitted over that range (relative error below 3e-6, far below the weights' bf16 rounding of
// 2e-3), scaled by 2^n. Lanes below -150 give 0.
inline __m512 exp2_weights(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 y = _mm512_set1_ps(9.5605105e-3f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5917040e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4024981e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9312197e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.9999917e-1f));
  return _mm512_scalef_ps(y, n);
}

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The online softmax over one block's scores of a folded row (N of them, a multiple of 32,
// the block's first key at position k0): keys outside [lo, hi] weigh 0, the rest
// exp(scale * s - max); the row's running max and its 16 partial sums are updated (the max of
// scaled scores) and its output rescaled by exp(old max - new max). Writes the row's bf16
// weights. A block inside [lo, hi] (all but a tile's last and, under a window or start, first)
// takes no masks.
inline void softmax_row(const float* s, int64_t k0, int64_t N, int64_t lo, int64_t hi,
                        float scale, float& row_max, float* row_sum, float* o, int64_t D,
                        Bf16* p) {
  const bool whole = lo <= k0 && k0 + N - 1 <= hi;
  __mmask16 valid[kKeyBlock / 16];
  __m512 block_max;
  if (whole) {
    // two vectors a turn: N is a multiple of 32, not always of 64 (past N: the next row's)
    __m512 m0 = _mm512_loadu_ps(s), m1 = _mm512_loadu_ps(s + 16);
    for (int64_t c = 2; c < N / 16; c += 2) {
      m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + 16 * c));
      m1 = _mm512_max_ps(m1, _mm512_loadu_ps(s + 16 * c + 16));
    }
    block_max = _mm512_max_ps(m0, m1);
  } else {
    block_max = _mm512_set1_ps(kNegInf);
    const __m512i first = _mm512_add_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(static_cast<int32_t>(k0)));
    const __m512i low = _mm512_set1_epi32(static_cast<int32_t>(lo));
    const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(hi));
    for (int64_t c = 0; c < N / 16; ++c) {
      const __m512i pos = _mm512_add_epi32(first, _mm512_set1_epi32(static_cast<int32_t>(16 * c)));
      valid[c] = _mm512_cmpge_epi32_mask(pos, low) & _mm512_cmple_epi32_mask(pos, high);
      block_max = _mm512_mask_max_ps(block_max, valid[c], block_max, _mm512_loadu_ps(s + 16 * c));
    }
  }
  // scale > 0: the max of the scaled scores is the scaled max.
  const float new_max = std::max(row_max, _mm512_reduce_max_ps(block_max) * scale);
  if (new_max == kNegInf) {  // nothing visible yet: weights 0, nothing to rescale
    std::memset(p, 0, N * sizeof(Bf16));
    return;
  }
  __m512 total = _mm512_setzero_ps();
  if (row_max != new_max) {
    // exp(old - new), 0 where nothing was visible (the sums and output are 0 there too)
    const __m512 alpha = row_max == kNegInf
        ? _mm512_setzero_ps()
        : exp2_weights(_mm512_set1_ps((row_max - new_max) * kLog2e));
    total = _mm512_mul_ps(_mm512_loadu_ps(row_sum), alpha);
    for (int64_t d = 0; d < D; d += 16)
      _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), alpha));
    row_max = new_max;
  } else {
    total = _mm512_loadu_ps(row_sum);
  }
  // exp(scale * s - max) = 2^(scale * log2(e) * s - log2(e) * max)
  const __m512 factor = _mm512_set1_ps(scale * kLog2e), shift = _mm512_set1_ps(-new_max * kLog2e);
  for (int64_t c = 0; c < N / 16; c += 2) {
    const __m512 xa = _mm512_fmadd_ps(_mm512_loadu_ps(s + 16 * c), factor, shift);
    const __m512 xb = _mm512_fmadd_ps(_mm512_loadu_ps(s + 16 * c + 16), factor, shift);
    __m512 a, b;
    if (whole) {
      a = exp2_weights(xa), b = exp2_weights(xb);
    } else if ((valid[c] | valid[c + 1]) != 0) {
      a = _mm512_maskz_mov_ps(valid[c], exp2_weights(xa));
      b = _mm512_maskz_mov_ps(valid[c + 1], exp2_weights(xb));
    } else {
      _mm512_storeu_si512(p + 16 * c, _mm512_setzero_si512());
      continue;
    }
    total = _mm512_add_ps(total, _mm512_add_ps(a, b));
    const __m512bh weights = _mm512_cvtne2ps_pbh(b, a);
    _mm512_storeu_si512(p + 16 * c, reinterpret_cast<const __m512i&>(weights));
  }
  _mm512_storeu_ps(row_sum, total);
}

// One work item: rows [r0, r0 + R) of sequence b (its rows' first at q row `first`), KV head kv.
void attend_tile(const Problem& pr, Scratch& w, int64_t b, int64_t kv, int64_t first,
                 int64_t rows, int64_t r0, int64_t R) {
  const int64_t D = pr.head_dim, group = pr.heads / pr.kv_heads, M = R * group;
  const int64_t seq_len = pr.seq_lens[b];
  const int64_t start = pr.starts != nullptr ? pr.starts[b] : 0;
  const int64_t pos0 = seq_len - rows + r0;  // position of the tile's first row
  for (int64_t r = 0; r < R; ++r)
    std::memcpy(w.q.data() + r * group * D,
                pr.q + ((first + r0 + r) * pr.heads + kv * group) * D, group * D * sizeof(Bf16));
  std::fill(w.o.begin(), w.o.begin() + M * D, 0.f);
  std::fill(w.max.begin(), w.max.begin() + M, -std::numeric_limits<float>::infinity());
  std::fill(w.sum.begin(), w.sum.begin() + 16 * M, 0.f);
  // The tile's keys: from its first row's earliest visible one to its last row's position,
  // in blocks that start at multiples of kKeyAlign and hold a multiple of it (few product
  // shapes for oneDNN to generate; the keys outside a row's range weigh 0).
  int64_t key_lo = start;
  if (pr.window > 0) key_lo = std::max(key_lo, pos0 - pr.window + 1);
  const int64_t key_hi = pos0 + R - 1;
  for (int64_t k0 = key_lo / kKeyAlign * kKeyAlign; k0 <= key_hi; k0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, key_hi + 1 - k0);
    const int64_t N = (n + kKeyAlign - 1) / kKeyAlign * kKeyAlign;
    const int64_t skip = std::max<int64_t>(key_lo - k0, 0);
    int64_t offsets[kKeyBlock];
    key_offsets(pr, b, kv, k0, skip, n, N, offsets);
    pack_keys(pr, offsets, N, w.k.data());
    at::native::cpublas::brgemm(M, N, D, D, N, N, false, w.q.data(), w.k.data(), w.s.data());
    for (int64_t m = 0; m < M; ++m) {
      const int64_t pos = pos0 + m / group;
      const int64_t lo = pr.window > 0 ? std::max(start, pos - pr.window + 1) : start;
      softmax_row(w.s.data() + m * N, k0, N, lo, pos, pr.scale, w.max[m], &w.sum[16 * m],
                  w.o.data() + m * D, D, w.p.data() + m * N);
    }
    pack_values(pr, offsets, N, w.v.data());
    at::native::cpublas::brgemm(M, D, N, N, D, D, true, w.p.data(), w.v.data(), w.o.data());
  }
  for (int64_t m = 0; m < M; ++m) {
    const int64_t row = first + r0 + m / group, head = kv * group + m % group;
    // Every row sees at least its own key, so its sum is positive.
    const float sum = _mm512_reduce_add_ps(_mm512_loadu_ps(&w.sum[16 * m]));
    const __m512 inverse = _mm512_set1_ps(1.f / sum);
    Bf16* dst = pr.out + (row * pr.heads + head) * D;
    for (int64_t d = 0; d < D; d += 16) {
      const __m256bh packed = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(&w.o[m * D + d]),
                                                               inverse));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                          reinterpret_cast<const __m256i&>(packed));
    }
    pr.lse[row * pr.heads + head] = w.max[m] + std::log(sum);
  }
}

void run(const Problem& pr, int64_t B) {
  // Work items: (sequence, KV head, tile of rows), listed once so threads split them evenly.
  std::vector<std::array<int64_t, 3>> items;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t rows = pr.q_indptr[b + 1] - pr.q_indptr[b];
    for (int64_t kv = 0; kv < pr.kv_heads; ++kv)
      for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) items.push_back({b, kv, r0});
  }
  const int64_t group = pr.heads / pr.kv_heads;
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch scratch;
    scratch.fit(kRowTile * group, pr.head_dim);
    for (int64_t i = begin; i < end; ++i) {
      const auto [b, kv, r0] = items[i];
      const int64_t first = pr.q_indptr[b], rows = pr.q_indptr[b + 1] - first;
      attend_tile(pr, scratch, b, kv, first, rows, r0, std::min(kRowTile, rows - r0));
    }
    at::native::cpublas::brgemm_release();
  });
}
#endif

bool extend_attention_available() {
#ifdef RADIXSERVE_EXTEND_ATTENTION
  return at::native::cpublas::could_pack(at::kBFloat16);
#else
  return false;
#endif
}

std::tuple<at::Tensor, at::Tensor> extend_attention(
    const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages,
    const at::Tensor& indptr, const at::Tensor& indices, const at::Tensor& seq_lens,
    int64_t window, double scale, const std::optional<at::Tensor>& starts,
    const at::Tensor& q_indptr) {
  TORCH_CHECK(extend_attention_available(),
              "extend_attention: this build or CPU has no bf16 brgemm (see "
              "extend_attention_available)");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_pages.scalar_type() == at::kBFloat16,
              "extend_attention: bf16 queries and pages expected");
  TORCH_CHECK(q.size(2) % 32 == 0 && q.size(2) <= kMaxHeadDim,
              "extend_attention: head size a multiple of 32 up to ", kMaxHeadDim, " expected");
  const auto limits = radixserve::check_paged_args("extend_attention", q, k_pages, v_pages,
                                                   indptr, indices, seq_lens, starts, q_indptr);
  auto out = at::empty_like(q);
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
#ifdef RADIXSERVE_EXTEND_ATTENTION
  const Problem pr{q.data_ptr<c10::BFloat16>(), k_pages.data_ptr<c10::BFloat16>(),
                   v_pages.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(),
                   lse.data_ptr<float>(), indptr.data_ptr<int32_t>(),
                   indices.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                   starts.has_value() ? starts->data_ptr<int32_t>() : nullptr,
                   q_indptr.data_ptr<int32_t>(), q.size(1), k_pages.size(2), q.size(2),
                   k_pages.size(1), window, k_pages.stride(0), k_pages.stride(1),
                   static_cast<float>(scale)};
  if (limits.sequences > 0) run(pr, limits.sequences);
#endif
  return {out, lse};
}

}  // namespace radixserve::extend

RADIXSERVE_OPS_FRAGMENT(m) {
  m.def(
      "extend_attention(Tensor q, Tensor k_pages, Tensor v_pages, Tensor indptr, "
      "Tensor indices, Tensor seq_lens, int window, float scale, Tensor? starts, "
      "Tensor q_indptr) -> (Tensor, Tensor)");
  m.def("extend_attention_available() -> bool", &radixserve::extend::extend_attention_available);
}

RADIXSERVE_OPS_IMPL(m) { m.impl("extend_attention", &radixserve::extend::extend_attention); }
