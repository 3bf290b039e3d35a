// Decode attention straight over the KV pages, on CPU: each sequence's query rows attend every
// key of their sequence up to their own (or the last `window` of them) without gathering the
// pages into a dense copy first. A decode step has one query row per sequence; a step that
// verifies draft tokens (scheduler/speculation.py) gives a sequence several, its last tokens,
// causal among themselves, as does a prefill chunk under --deterministic. Built by engine/worker/cpu_kernels.py; registered as
// torch.ops.radixserve.paged_decode.
//
//   q        [T, H, D]                    the step's queries: one per sequence (T = B), or
//                                         as q_indptr says
//   k, v     [num_pages, P, KVH, D]       one layer's pages, in q's dtype or int8 rows of D + 2
//                                         (D values and their float16 scale: kv_quant.py)
//   indptr   int32 [B + 1], indices       each sequence's pages, in position order (CSR)
//   seq_lens int32 [B]                    keys per sequence, the new tokens' included
//   starts   int32 [B], optional          attend keys from this position on (the cascade's
//                                         own part, after the pages a group shares)
//   q_indptr int32 [B + 1], optional      sequence b's query rows are q[q_indptr[b] ..
//                                         q_indptr[b + 1]]: its last n_b tokens, row j at
//                                         position seq_len - n_b + j seeing keys up to it
// Returns the output [T, H, D] and the log-sum-exp of each row's scaled scores, float32
// [T, H], which merges it with an attention over other keys (engine/worker/attention/cascade.py).
//
// Work item = a tile of up to 32 of a sequence's query rows and a run of its KV heads (all of
// them unless a small batch must be split further to keep every thread busy); the H / KVH query
// heads sharing a KV head, of all the tile's rows, read each key once. Keys go in blocks of 16
// that start at multiples of 16; a row's keys past its own position (a later draft's or
// prefill token's) and before its window or start take weight 0 in the blocks they share with
// its other keys, so each row's sums are taken in the order a one-row decode of that token
// takes them: a prefill, extend or verify row's output is that decode's, bit for bit, whatever
// the tile, the page size and the rows beside it (--deterministic runs every row here). Keys
// go with an online softmax (running max and sum in float32); scores, weights and sums are float32 whatever the KV dtype. int8 keys and values
// are widened in registers and their scales folded into the block's scores (score = scale_k *
// q.k) and weights (p * scale_v): no page is ever dequantized into memory. The loops run on
// 16-wide registers on CPUs with AVX-512 (head sizes that are multiples of 16, up to 256), on
// 8-wide ones on CPUs with AVX2, FMA and F16C (head sizes that are multiples of 8, and in AVX-512
// builds the multiples of 8 that are not of 16), and are plain C++ elsewhere (the build with
// RADIXSERVE_PORTABLE, which the tests also run, as they run the AVX2 build on AVX-512 CPUs).

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "paged_args.h"

namespace {

using radixserve::bits_to_float;
using radixserve::to_float;
#ifdef RADIXSERVE_AVX2
using radixserve::exp8;
using radixserve::load8;
#endif
#ifdef RADIXSERVE_AVX512
using radixserve::exp16;
using radixserve::load16;
#endif

constexpr int64_t kKeyBlock = 16;  // keys per block of scores
// Query rows of one sequence per work item: a prefill's rows spread over the threads, and
// each tile reads only the keys up to its last row's (a causal prefill's later keys unread).
constexpr int64_t kRowTile = 32;

// exp(x) over a block, vectorisable: Cephes' expf (range reduction by ln 2, degree-6
// polynomial, ~1 ulp on the range that matters here; ops.h's exp16 and exp8 are the same, 16
// and 8 lanes at a time). Inputs are <= 0 (scores minus their max).
inline void exp_block(float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::min(std::max(x[i], -87.3f), 88.3f);
    const float fx = __builtin_floorf(v * 1.44269504088896341f + 0.5f);
    const float r = v - fx * 0.693359375f + fx * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    x[i] = y * bits_to_float(static_cast<uint32_t>(static_cast<int32_t>(fx) + 127) << 23);
  }
}

#ifdef RADIXSERVE_AVX512
// The 16 lane sums of v[0..15] as one vector: out[t] = sum of v[t]'s lanes. A transposing
// tree (45 instructions for 16 keys) in place of one horizontal reduction per key.
inline __m512 lane_sums16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // 128-bit lane L of a[i]: (v[2i], v[2i+1]) partly summed
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 4; ++j) {  // lane L of b[j]: lane L's sums of v[4j .. 4j+3]
    const __m512d x = _mm512_castps_pd(a[2 * j]), y = _mm512_castps_pd(a[2 * j + 1]);
    b[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int k = 0; k < 2; ++k)  // the four 128-bit lanes added pairwise, then again
    c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// Scores of G query rows (G known at compile time: the partial dot products stay in
// registers) against the block's n keys, each key read and widened once for all G rows.
template <int G, typename T>
inline void score_keys_g(const float* q, const T* const* keys, int64_t n, int64_t D, float* s) {
  __m512 dots[G][kKeyBlock];
  for (int64_t t = 0; t < kKeyBlock; ++t) {
    __m512 acc[G];
    for (int i = 0; i < G; ++i) acc[i] = _mm512_setzero_ps();
    if (t < n) {
      for (int64_t c = 0; c < D; c += 16) {
        const __m512 key = load16(keys[t] + c);
        for (int i = 0; i < G; ++i)
          acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + i * D + c), key, acc[i]);
      }
    }
    for (int i = 0; i < G; ++i) dots[i][t] = acc[i];
  }
  for (int i = 0; i < G; ++i) _mm512_storeu_ps(s + i * kKeyBlock, lane_sums16(dots[i]));
}

// acc[i] += sum over the block's n keys of p[i * kKeyBlock + t] * values[t]: each value row read
// and widened once for all G rows, whose 16-wide output slices stay in registers.
template <int G, typename T>
inline void add_values_g(const float* p, const T* const* values, int64_t n, int64_t D,
                         float* acc) {
  for (int64_t c = 0; c < D; c += 16) {
    __m512 sum[G];
    for (int i = 0; i < G; ++i) sum[i] = _mm512_loadu_ps(acc + i * D + c);
    for (int64_t t = 0; t < n; ++t) {
      const __m512 value = load16(values[t] + c);
      for (int i = 0; i < G; ++i)
        sum[i] = _mm512_fmadd_ps(_mm512_set1_ps(p[i * kKeyBlock + t]), value, sum[i]);
    }
    for (int i = 0; i < G; ++i) _mm512_storeu_ps(acc + i * D + c, sum[i]);
  }
}
#endif

#ifdef RADIXSERVE_AVX2
// The 8 lane sums of v[0..7] as one vector (lane_sums16's tree, 21 instructions for 8 keys).
inline __m256 lane_sums8(const __m256* v) {
  __m256 a[4], b[2];
  for (int i = 0; i < 4; ++i)  // 128-bit lane L of a[i]: (v[2i], v[2i+1]) partly summed
    a[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 2; ++j) {  // lane L of b[j]: lane L's sums of v[4j .. 4j+3]
    const __m256d x = _mm256_castps_pd(a[2 * j]), y = _mm256_castps_pd(a[2 * j + 1]);
    b[j] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                         _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20),
                       _mm256_permute2f128_ps(b[0], b[1], 0x31));
}

// With 16 ymm registers, G rows (up to 8) take K keys or C column slices at once so that about
// 8 independent FMA chains are in flight (FMA's latency is 4 cycles, 2 issue per cycle), and
// accumulators, widened keys and one query slice still fit: K * G + K + 1 <= 13. Against one
// key or slice at a time (batch 8, head_dim 64, one thread): 1.5x at G = 3 over 2,048 bf16
// keys, 1.1-1.3x at G = 1 and 2 over 256; over 2,048 bf16 keys with G = 1 and 2, where memory
// bounds the step, 0.85-0.95x.
template <int G>
constexpr int kLanesAtOnce = G <= 2 ? 4 : G <= 4 ? 2 : 1;

// dots[i * 8 + j] = the 8 partial sums of query row i against keys[j], for K keys at once;
// each key slice is widened once for all G rows.
template <int G, int K, typename T>
inline void dot_keys8(const float* q, const T* const* keys, int64_t D, __m256* dots) {
  __m256 acc[K][G];
  for (int j = 0; j < K; ++j)
    for (int i = 0; i < G; ++i) acc[j][i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 8) {
    __m256 key[K];
    for (int j = 0; j < K; ++j) key[j] = load8(keys[j] + c);
    for (int i = 0; i < G; ++i) {
      const __m256 query = _mm256_loadu_ps(q + i * D + c);
      for (int j = 0; j < K; ++j) acc[j][i] = _mm256_fmadd_ps(query, key[j], acc[j][i]);
    }
  }
  for (int j = 0; j < K; ++j)
    for (int i = 0; i < G; ++i) dots[i * 8 + j] = acc[j][i];
}

// score_keys_g on 8-wide registers: the block's keys in two runs of 8, each run's 8 x G partial
// sums reduced by one lane_sums8 per row.
template <int G, typename T>
inline void score_keys8_g(const float* q, const T* const* keys, int64_t n, int64_t D, float* s) {
  constexpr int K = kLanesAtOnce<G>;
  for (int64_t run = 0; run < n; run += 8) {
    const int64_t m = std::min<int64_t>(8, n - run);
    __m256 dots[G * 8];
    int64_t t = 0;
    for (; t + K <= m; t += K) dot_keys8<G, K>(q, keys + run + t, D, dots + t);
    for (; t < m; ++t) dot_keys8<G, 1>(q, keys + run + t, D, dots + t);
    for (; t < 8; ++t)
      for (int i = 0; i < G; ++i) dots[i * 8 + t] = _mm256_setzero_ps();
    for (int i = 0; i < G; ++i) _mm256_storeu_ps(s + i * kKeyBlock + run, lane_sums8(dots + i * 8));
  }
}

// acc[i][c .. c + 8C) += sum over the block's n keys of p[i * kKeyBlock + t] * values[t][c ..]:
// C slices of each of the G rows' output in registers, each value slice widened once.
template <int G, int C, typename T>
inline void add_value_slices8(const float* p, const T* const* values, int64_t n, int64_t D,
                              int64_t c, float* acc) {
  __m256 sum[G][C];
  for (int i = 0; i < G; ++i)
    for (int k = 0; k < C; ++k) sum[i][k] = _mm256_loadu_ps(acc + i * D + c + 8 * k);
  for (int64_t t = 0; t < n; ++t) {
    __m256 value[C];
    for (int k = 0; k < C; ++k) value[k] = load8(values[t] + c + 8 * k);
    for (int i = 0; i < G; ++i) {
      const __m256 weight = _mm256_broadcast_ss(p + i * kKeyBlock + t);
      for (int k = 0; k < C; ++k) sum[i][k] = _mm256_fmadd_ps(weight, value[k], sum[i][k]);
    }
  }
  for (int i = 0; i < G; ++i)
    for (int k = 0; k < C; ++k) _mm256_storeu_ps(acc + i * D + c + 8 * k, sum[i][k]);
}

template <int G, typename T>
inline void add_values8_g(const float* p, const T* const* values, int64_t n, int64_t D,
                          float* acc) {
  constexpr int C = kLanesAtOnce<G>;
  int64_t c = 0;
  for (; c + 8 * C <= D; c += 8 * C) add_value_slices8<G, C>(p, values, n, D, c, acc);
  for (; c < D; c += 8) add_value_slices8<G, 1>(p, values, n, D, c, acc);
}
#endif

#if defined(RADIXSERVE_AVX512) || defined(RADIXSERVE_AVX2)
// Calls f with G as a compile-time constant for the group sizes models use (1 to 8); false for
// other sizes.
template <typename F>
inline bool with_group(int64_t G, F&& f) {
  switch (G) {
    case 1: f(std::integral_constant<int, 1>{}); return true;
    case 2: f(std::integral_constant<int, 2>{}); return true;
    case 3: f(std::integral_constant<int, 3>{}); return true;
    case 4: f(std::integral_constant<int, 4>{}); return true;
    case 5: f(std::integral_constant<int, 5>{}); return true;
    case 6: f(std::integral_constant<int, 6>{}); return true;
    case 7: f(std::integral_constant<int, 7>{}); return true;
    case 8: f(std::integral_constant<int, 8>{}); return true;
    default: return false;
  }
}
#endif

// Scores of the G query rows `q` (float, pre-scaled, [G, D]) against the block's n keys:
// s[i * kKeyBlock + t].
template <typename T>
inline void score_keys(const float* q, const T* const* keys, int64_t n, int64_t G, int64_t D,
                       float* s) {
#ifdef RADIXSERVE_AVX512
  if (D % 16 == 0 && D <= 256) {
    if (with_group(G, [&](auto g) { score_keys_g<decltype(g)::value>(q, keys, n, D, s); }))
      return;
    for (int64_t t = 0; t < n; ++t) {
      __m512 key[16];
      for (int64_t c = 0; c < D / 16; ++c) key[c] = load16(keys[t] + c * 16);
      for (int64_t i = 0; i < G; ++i) {
        const float* qi = q + i * D;
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qi), key[0]);
        for (int64_t c = 1; c < D / 16; ++c)
          acc = _mm512_fmadd_ps(_mm512_loadu_ps(qi + c * 16), key[c], acc);
        s[i * kKeyBlock + t] = _mm512_reduce_add_ps(acc);
      }
    }
    return;
  }
#endif
#ifdef RADIXSERVE_AVX2
  if (D % 8 == 0) {
    // Groups past 8 in runs of up to 8 rows: each run's accumulators must fit the registers.
    for (int64_t row = 0; row < G; row += 8)
      with_group(std::min<int64_t>(8, G - row), [&](auto g) {
        score_keys8_g<decltype(g)::value>(q + row * D, keys, n, D, s + row * kKeyBlock);
      });
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t) {
    const T* key = keys[t];
    for (int64_t i = 0; i < G; ++i) {
      const float* qi = q + i * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qi[d] * to_float(key[d]);
      s[i * kKeyBlock + t] = dot;
    }
  }
}

// acc[i] += sum over the block's n keys of p[i * kKeyBlock + t] * values[t], for the G heads.
template <typename T>
inline void add_values(const float* p, const T* const* values, int64_t n, int64_t G, int64_t D,
                       float* acc) {
#ifdef RADIXSERVE_AVX512
  if (D % 16 == 0 && D <= 256) {
    if (with_group(G, [&](auto g) { add_values_g<decltype(g)::value>(p, values, n, D, acc); }))
      return;
    // Each 16-wide slice of a head's output stays in a register across the block's keys.
    for (int64_t i = 0; i < G; ++i) {
      for (int64_t c = 0; c < D; c += 16) {
        __m512 sum = _mm512_loadu_ps(acc + i * D + c);
        for (int64_t t = 0; t < n; ++t)
          sum = _mm512_fmadd_ps(_mm512_set1_ps(p[i * kKeyBlock + t]), load16(values[t] + c), sum);
        _mm512_storeu_ps(acc + i * D + c, sum);
      }
    }
    return;
  }
#endif
#ifdef RADIXSERVE_AVX2
  if (D % 8 == 0) {
    for (int64_t row = 0; row < G; row += 8)
      with_group(std::min<int64_t>(8, G - row), [&](auto g) {
        add_values8_g<decltype(g)::value>(p + row * kKeyBlock, values, n, D, acc + row * D);
      });
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t) {
    const T* value = values[t];
    for (int64_t i = 0; i < G; ++i) {
      const float w = p[i * kKeyBlock + t];
      float* a = acc + i * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += w * to_float(value[d]);
    }
  }
}

// One block's softmax step for one query head: scores s[lo..hi) become weights exp(s - new
// max), the running sum and max absorb them; the block's other lanes (s[0..lo) and s[hi..n)
// with n <= kKeyBlock: keys this row must not see) get weight 0. Returns the factor the head's
// output rescales by. A decode row takes lo = 0, hi = n: every key of the block.
inline float softmax_block(float* s, int64_t lo, int64_t hi, int64_t n, float& run_max,
                           float& run_sum) {
#ifdef RADIXSERVE_AVX512
  (void)n;
  const __mmask16 valid = static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
  const __m512 scores = _mm512_maskz_loadu_ps(valid, s);
  const float block_max = std::max(
      run_max, _mm512_mask_reduce_max_ps(valid, scores));
  const __m512 weights = exp16(_mm512_sub_ps(scores, _mm512_set1_ps(block_max)));
  _mm512_storeu_ps(s, _mm512_maskz_mov_ps(valid, weights));
  const float rescale = _mm512_cvtss_f32(exp16(_mm512_set1_ps(run_max - block_max)));
  run_sum = run_sum * rescale + _mm512_mask_reduce_add_ps(valid, weights);
#elif defined(RADIXSERVE_AVX2)
  (void)n;
  // The block's scores as two runs of 8; lanes outside [lo, hi) take no part in the maximum
  // and get weight 0 (the scores' slots past n are in bounds: each row has kKeyBlock of them).
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lane_hi = _mm256_add_epi32(lane, _mm256_set1_epi32(8));
  const __m256i below = _mm256_set1_epi32(lo - 1), above = _mm256_set1_epi32(hi);
  const __m256 valid_lo = _mm256_castsi256_ps(_mm256_and_si256(
      _mm256_cmpgt_epi32(above, lane), _mm256_cmpgt_epi32(lane, below)));
  const __m256 valid_hi = _mm256_castsi256_ps(_mm256_and_si256(
      _mm256_cmpgt_epi32(above, lane_hi), _mm256_cmpgt_epi32(lane_hi, below)));
  const __m256 lowest = _mm256_set1_ps(-3.0e38f);
  const __m256 lo8 = _mm256_blendv_ps(lowest, _mm256_loadu_ps(s), valid_lo);
  const __m256 hi8 = _mm256_blendv_ps(lowest, _mm256_loadu_ps(s + 8), valid_hi);
  const float block_max = std::max(run_max, radixserve::max_lanes8(_mm256_max_ps(lo8, hi8)));
  const __m256 top = _mm256_set1_ps(block_max);
  const __m256 weights_lo = _mm256_and_ps(exp8(_mm256_sub_ps(lo8, top)), valid_lo);
  const __m256 weights_hi = _mm256_and_ps(exp8(_mm256_sub_ps(hi8, top)), valid_hi);
  _mm256_storeu_ps(s, weights_lo);
  _mm256_storeu_ps(s + 8, weights_hi);
  const float rescale = _mm256_cvtss_f32(exp8(_mm256_set1_ps(run_max - block_max)));
  run_sum = run_sum * rescale + radixserve::sum_lanes8(_mm256_add_ps(weights_lo, weights_hi));
#else
  float block_max = run_max;
  for (int64_t t = lo; t < hi; ++t) block_max = std::max(block_max, s[t]);
  float rescale = run_max - block_max;
  exp_block(&rescale, 1);
  for (int64_t t = lo; t < hi; ++t) s[t] -= block_max;
  exp_block(s + lo, hi - lo);
  float total = run_sum * rescale;
  for (int64_t t = lo; t < hi; ++t) total += s[t];
  run_sum = total;
  std::fill(s, s + lo, 0.f);
  std::fill(s + hi, s + n, 0.f);
#endif
  run_max = block_max;
  return rescale;
}

// Query rows of one work item sharing KV head h, scored (or weighted) together: a multiple of
// G of at most 8 (the fixed-size loops), or G alone past 8. Each row's sums are then taken in
// the order a decode of that row alone takes them, so a verify row is a decode row, bit for
// bit (see decode).
inline int64_t rows_at_once(int64_t G) { return G <= 8 ? G * (8 / G) : G; }

// T: q's dtype; KV: the pages' (T, or int8_t for quantized rows of D + 2). ``q_indptr``
// (nullptr: one query row per sequence, row b) gives sequence b the query rows
// q_indptr[b] .. q_indptr[b + 1]: its last n_b tokens, row j at position len - n_b + j, which
// sees the keys up to its own (causal within the sequence's new tokens). ``max_rows``: the
// largest n_b.
//
// Every row's keys go in blocks that start at multiples of kKeyBlock, whatever the row's first
// key (its window's, or the cascade's start), and a block's keys the row must not see take
// weight 0: so a row's sums are taken in one order whichever rows share its work item, whether
// it is a decode, a verify or a prefill row, whatever the page size. A sequence's rows are
// split into tiles of kRowTile rows, each tile a work item reading keys up to its last row's.
template <typename T, typename KV>
void decode(const T* q, const KV* k, const KV* v, T* out, float* lse, const int32_t* indptr,
            const int32_t* indices, const int32_t* seq_lens, const int32_t* starts,
            const int32_t* q_indptr, int64_t max_rows, int64_t B, int64_t H, int64_t KVH,
            int64_t D, int64_t P, int64_t window, float scale, int64_t page_stride,
            int64_t token_stride) {
  constexpr bool quantized = std::is_same_v<KV, int8_t>;
  const int64_t row_len = quantized ? D + radixserve::kScaleBytes : D;  // a head's row
  const int64_t G = H / KVH;
  const int64_t at_once = rows_at_once(G);
  // Tiles: (sequence, its first query row in the tile).
  std::vector<int64_t> tile_seq, tile_row;
  tile_seq.reserve(B), tile_row.reserve(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nq = q_indptr != nullptr ? q_indptr[b + 1] - q_indptr[b] : 1;
    for (int64_t j = 0; j < nq; j += kRowTile) tile_seq.push_back(b), tile_row.push_back(j);
  }
  const int64_t tiles = static_cast<int64_t>(tile_seq.size());
  // Threads take contiguous runs of items; a causal prefill's later tiles read more keys, so
  // the tiles go in the order first, last, second, second-to-last, ... to even the runs out.
  std::vector<int64_t> order(tiles);
  for (int64_t i = 0; i < tiles; ++i) order[i] = i % 2 == 0 ? i / 2 : tiles - 1 - i / 2;
  // A work item is a tile's keys for a run of its KV heads: all of them when there are
  // enough tiles to keep every thread busy (a token's heads are adjacent in its page, so
  // one item reads each page front to back), fewer when a small batch must be split further.
  const int64_t threads = at::get_num_threads();
  const int64_t chunks = std::min(KVH, std::max<int64_t>(1, (2 * threads + tiles - 1) / tiles));
  const int64_t heads_per_chunk = (KVH + chunks - 1) / chunks;
  at::parallel_for(0, tiles * chunks, 1, [&](int64_t begin, int64_t end) {
    // Query rows of one item, [KV head][token][group member]: those of one KV head adjacent.
    const int64_t rows = heads_per_chunk * std::min(max_rows, kRowTile) * G;
    std::vector<float> qf(rows * D), acc(rows * D), run_max(rows), run_sum(rows),
        s(rows * kKeyBlock), weighted(quantized ? rows * kKeyBlock : 0), scales(kKeyBlock);
    std::vector<int64_t> row_at(kKeyBlock), lo(rows), hi(rows);
    std::vector<const KV*> key_rows(kKeyBlock), value_rows(kKeyBlock);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t tile = order[item / chunks];
      const int64_t b = tile_seq[tile];
      const int64_t h0 = (item % chunks) * heads_per_chunk;
      const int64_t h1 = std::min(KVH, h0 + heads_per_chunk);
      const int64_t len = seq_lens[b];
      const int64_t q0 = q_indptr != nullptr ? q_indptr[b] : b;
      const int64_t nq_all = q_indptr != nullptr ? q_indptr[b + 1] - q0 : 1;
      const int64_t j0 = tile_row[tile];
      const int64_t nq = std::min(kRowTile, nq_all - j0);  // this tile's rows: j0 + j
      const int64_t per_head = nq * G;  // query rows sharing one KV head
      const int64_t used = (h1 - h0) * per_head;
      const int64_t from = starts != nullptr ? starts[b] : 0;
      // Row j's keys: [lo_j, last_j], the window's last keys at most.
      const int64_t keys_end = len - nq_all + j0 + nq;  // past the tile's last row's key
      int64_t first = keys_end;
      for (int64_t j = 0; j < nq; ++j) {
        const int64_t last = len - nq_all + j0 + j;
        const int64_t first_j = std::max<int64_t>(window > 0 ? last + 1 - window : 0, from);
        first = std::min(first, first_j);
        for (int64_t hh = 0; hh < h1 - h0; ++hh)
          for (int64_t i = 0; i < G; ++i) {
            const int64_t row = hh * per_head + j * G + i;
            lo[row] = first_j, hi[row] = last + 1;
            const T* qr = q + ((q0 + j0 + j) * H + (h0 + hh) * G + i) * D;
            for (int64_t d = 0; d < D; ++d) qf[row * D + d] = to_float(qr[d]) * scale;
          }
      }
      first -= first % kKeyBlock;
      std::fill(run_max.begin(), run_max.begin() + used, -3.0e38f);
      std::fill(run_sum.begin(), run_sum.begin() + used, 0.f);
      std::fill(acc.begin(), acc.begin() + used * D, 0.f);
      const int32_t* pages = indices + indptr[b];
      for (int64_t start = first; start < keys_end; start += kKeyBlock) {
        const int64_t n = std::min(kKeyBlock, keys_end - start);
        // Row of each key: page `page` of the sequence, slot `slot` in it (no division per key).
        for (int64_t t = 0, page = start / P, slot = start % P; t < n; ++t) {
          row_at[t] = pages[page] * page_stride + slot * token_stride;
          if (++slot == P) slot = 0, ++page;
        }
        // The next block's keys and values, fetched while this one computes: pages lie at
        // random in the pool, so the hardware cannot guess the next one, and in a model's step
        // (every layer's KV, the weights streaming between) they come from memory.
        const int64_t ahead = std::min(kKeyBlock, keys_end - start - kKeyBlock);
        for (int64_t t = 0, page = (start + kKeyBlock) / P, slot = (start + kKeyBlock) % P; t < ahead;
             ++t) {
          const int64_t row = pages[page] * page_stride + slot * token_stride + h0 * row_len;
          for (int64_t byte = 0; byte < (h1 - h0) * row_len * int64_t(sizeof(KV)); byte += 64) {
            __builtin_prefetch(reinterpret_cast<const char*>(k + row) + byte);
            __builtin_prefetch(reinterpret_cast<const char*>(v + row) + byte);
          }
          if (++slot == P) slot = 0, ++page;
        }
        // Scores: s[row * kKeyBlock + t] for query row `row` (head h, token j, group member i).
        for (int64_t h = h0; h < h1; ++h) {
          for (int64_t t = 0; t < n; ++t) key_rows[t] = k + row_at[t] + h * row_len;
          const int64_t row0 = (h - h0) * per_head;
          for (int64_t r = row0; r < row0 + per_head; r += at_once)
            score_keys(qf.data() + r * D, key_rows.data(), n,
                       std::min(at_once, row0 + per_head - r), D, s.data() + r * kKeyBlock);
          if constexpr (quantized) {
            for (int64_t t = 0; t < n; ++t) scales[t] = radixserve::row_scale(key_rows[t], D);
            for (int64_t i = row0; i < row0 + per_head; ++i)
              for (int64_t t = 0; t < n; ++t) s[i * kKeyBlock + t] *= scales[t];
          }
        }
        for (int64_t row = 0; row < used; ++row) {
          // The keys of this block the row sees; none (a later token's own keys, or keys
          // before its window): its weights are 0 and its sums stay as they are.
          const int64_t a = std::max<int64_t>(lo[row] - start, 0);
          const int64_t z = std::min<int64_t>(hi[row] - start, n);
          float* w = s.data() + row * kKeyBlock;
          if (z <= a) {
            std::fill(w, w + n, 0.f);
            continue;
          }
          const float rescale = softmax_block(w, a, z, n, run_max[row], run_sum[row]);
          float* acc_row = acc.data() + row * D;
          for (int64_t d = 0; d < D; ++d) acc_row[d] *= rescale;
        }
        for (int64_t h = h0; h < h1; ++h) {
          for (int64_t t = 0; t < n; ++t) value_rows[t] = v + row_at[t] + h * row_len;
          const int64_t row0 = (h - h0) * per_head;
          const float* weights = s.data();
          if constexpr (quantized) {
            // The softmax's sums took the weights as they are; the values take them scaled.
            for (int64_t t = 0; t < n; ++t) scales[t] = radixserve::row_scale(value_rows[t], D);
            for (int64_t i = row0; i < row0 + per_head; ++i)
              for (int64_t t = 0; t < n; ++t)
                weighted[i * kKeyBlock + t] = s[i * kKeyBlock + t] * scales[t];
            weights = weighted.data();
          }
          for (int64_t r = row0; r < row0 + per_head; r += at_once)
            add_values(weights + r * kKeyBlock, value_rows.data(), n,
                       std::min(at_once, row0 + per_head - r), D, acc.data() + r * D);
        }
      }
      for (int64_t row = 0; row < used; ++row) {
        const int64_t hh = row / per_head, j = row % per_head / G, i = row % G;
        const int64_t at = (q0 + j0 + j) * H + (h0 + hh) * G + i;
        const float inv = 1.f / run_sum[row];
        T* o = out + at * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[row * D + d] * inv);
        lse[at] = run_max[row] + std::log(run_sum[row]);
      }
    }
  });
}

template <typename T, typename KV>
void run_kv(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages,
            at::Tensor& out, at::Tensor& lse, const at::Tensor& indptr, const at::Tensor& indices,
            const at::Tensor& seq_lens, const int32_t* starts, const int32_t* q_indptr,
            int64_t max_rows, int64_t window, double scale) {
  decode<T, KV>(q.data_ptr<T>(), k_pages.data_ptr<KV>(), v_pages.data_ptr<KV>(),
                out.data_ptr<T>(), lse.data_ptr<float>(), indptr.data_ptr<int32_t>(),
                indices.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), starts, q_indptr,
                max_rows, seq_lens.numel(), q.size(1), k_pages.size(2), q.size(2),
                k_pages.size(1), window, static_cast<float>(scale), k_pages.stride(0),
                k_pages.stride(1));
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages,
         at::Tensor& out, at::Tensor& lse, const at::Tensor& indptr, const at::Tensor& indices,
         const at::Tensor& seq_lens, const int32_t* starts, const int32_t* q_indptr,
         int64_t max_rows, int64_t window, double scale) {
  if (k_pages.scalar_type() == at::kChar)
    run_kv<T, int8_t>(q, k_pages, v_pages, out, lse, indptr, indices, seq_lens, starts,
                      q_indptr, max_rows, window, scale);
  else
    run_kv<T, T>(q, k_pages, v_pages, out, lse, indptr, indices, seq_lens, starts, q_indptr,
                 max_rows, window, scale);
}

std::tuple<at::Tensor, at::Tensor> paged_decode(
    const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages,
    const at::Tensor& indptr, const at::Tensor& indices, const at::Tensor& seq_lens,
    int64_t window, double scale, const std::optional<at::Tensor>& starts,
    const std::optional<at::Tensor>& q_indptr) {
  const auto limits = radixserve::check_paged_args("paged_decode", q, k_pages, v_pages, indptr,
                                                   indices, seq_lens, starts, q_indptr);
  const int64_t B = limits.sequences, max_rows = limits.max_rows;
  const int32_t *start_ptr = limits.starts, *rows_ptr = limits.q_indptr;
  auto out = at::empty_like(q);
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  if (B == 0) return {out, lse};  // no sequence: nothing to split among the threads
  switch (q.scalar_type()) {
    case at::kFloat:
      run<float>(q, k_pages, v_pages, out, lse, indptr, indices, seq_lens, start_ptr, rows_ptr,
                 max_rows, window, scale);
      break;
    case at::kBFloat16:
      run<c10::BFloat16>(q, k_pages, v_pages, out, lse, indptr, indices, seq_lens, start_ptr,
                         rows_ptr, max_rows, window, scale);
      break;
    case at::kHalf:
      run<c10::Half>(q, k_pages, v_pages, out, lse, indptr, indices, seq_lens, start_ptr,
                     rows_ptr, max_rows, window, scale);
      break;
    default:
      TORCH_CHECK(false, "paged_decode: unsupported dtype ", q.scalar_type());
  }
  return {out, lse};
}

// Whether this build has vectorised loops (AVX-512, or AVX2 with FMA and F16C). Without them
// (the plain C++ build, on CPUs with neither) the kernel measured no faster than gathering the
// pages for torch's SDPA, so the engine uses it only where this is true.
bool paged_decode_vectorized() {
#if defined(RADIXSERVE_AVX512) || defined(RADIXSERVE_AVX2)
  return true;
#else
  return false;
#endif
}

}  // namespace

RADIXSERVE_OPS_FRAGMENT(m) {
  m.def(
      "paged_decode(Tensor q, Tensor k_pages, Tensor v_pages, Tensor indptr, Tensor indices, "
      "Tensor seq_lens, int window, float scale, Tensor? starts=None, Tensor? q_indptr=None) "
      "-> (Tensor, Tensor)");
  m.def("paged_decode_vectorized() -> bool", &paged_decode_vectorized);
}

RADIXSERVE_OPS_IMPL(m) { m.impl("paged_decode", &paged_decode); }
