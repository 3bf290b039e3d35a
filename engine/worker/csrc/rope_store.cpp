// Rotary embedding of a step's queries and keys, and the keys' and values' store into the KV
// pool, in one op: torch takes a concatenation, two arithmetic ops and two scattered copies
// (~6 calls of ~8 us each per layer on CPU). The arithmetic is torch's, rounding for rounding
// (bit-identical on the CPUs tested; this file is compiled without implicit contraction):
//
//   rotated = rotate_half(x) * signed_sin      rounded to the dtype
//   out     = fma(x, cos, rotated)             in float32, rounded once to the dtype (torch's
//                                              vectorised addcmul compiles to a fused
//                                              multiply-add)
//
// which is engine/worker/attention/base.py's apply_rope (``signed_sin`` has rotate_half's sign folded
// into its first half). An int8 pool's rows (engine/worker/kv_quant.py) are quantized as they are
// stored: K after its rotation is rounded to the model's dtype, as the torch path quantizes it.
// Registered as torch.ops.radixserve.rope_store; built by engine/worker/cpu_kernels.py.

#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "ops.h"

// (pushed and popped: the kernels are compiled as one translation unit, cpu_kernels.py)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace {

using radixserve::to_float;

// One head of one token: out[d] for d < D, rotate-half pairs (d, d + D/2).
template <typename T>
inline void rotate_each(const T* x, const T* cos, const T* signed_sin, int64_t D, T* out) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const float partner = to_float(x[d < half ? d + half : d - half]);
    const T rotated = static_cast<T>(partner * to_float(signed_sin[d]));
    out[d] = static_cast<T>(std::fma(to_float(x[d]), to_float(cos[d]), to_float(rotated)));
  }
}

template <typename T>
inline void rotate(const T* x, const T* cos, const T* signed_sin, int64_t D, T* out) {
  rotate_each(x, cos, signed_sin, D, out);
}

#if defined(RADIXSERVE_AVX512) && defined(__AVX512BF16__)
inline __m512 widen16(__m256bh v) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(v)), 16));
}

// bf16 heads whose halves are whole vectors (head_dim 32, 64, 128, ...), 16 lanes at a time: the
// same two roundings to nearest even (vcvtneps2bf16) as the loop above, which a prefill's
// tokens x heads otherwise pay element by element (~9% of a 512-token prefill of SmolLM2).
template <>
inline void rotate<c10::BFloat16>(const c10::BFloat16* x, const c10::BFloat16* cos,
                                  const c10::BFloat16* signed_sin, int64_t D,
                                  c10::BFloat16* out) {
  const int64_t half = D / 2;
  if (half % 16) {
    rotate_each(x, cos, signed_sin, D, out);
    return;
  }
  using radixserve::load16;
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 partner = load16(x + (d < half ? d + half : d - half));
    const __m512 rotated =
        widen16(_mm512_cvtneps_pbh(_mm512_mul_ps(partner, load16(signed_sin + d))));
    const __m256bh result =
        _mm512_cvtneps_pbh(_mm512_fmadd_ps(load16(x + d), load16(cos + d), rotated));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d),
                        reinterpret_cast<const __m256i&>(result));
  }
}
#endif

template <>
inline void rotate<float>(const float* x, const float* cos, const float* signed_sin, int64_t D,
                          float* out) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const float rotated = x[d < half ? d + half : d - half] * signed_sin[d];
    out[d] = std::fma(x[d], cos[d], rotated);
  }
}

// KV = T: the pool holds the model's dtype; KV = int8_t: quantized rows of D + 2 bytes.
template <typename T, typename KV>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
         const at::Tensor& signed_sin, const at::Tensor& slots, at::Tensor& k_slots,
         at::Tensor& v_slots, at::Tensor& out) {
  constexpr bool quantized = std::is_same_v<KV, int8_t>;
  const int64_t tokens = q.size(0), heads = q.size(1), kv_heads = k.size(1), D = q.size(2);
  const int64_t row = k_slots.size(2);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = signed_sin.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  KV* ks = k_slots.data_ptr<KV>();
  KV* vs = v_slots.data_ptr<KV>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    std::vector<T> rotated(quantized ? D : 0);
    for (int64_t t = begin; t < end; ++t) {
      const T* ct = cp + t * D;
      const T* st = sp + t * D;
      for (int64_t h = 0; h < heads; ++h)
        rotate(qp + t * q.stride(0) + h * q.stride(1), ct, st, D, op + (t * heads + h) * D);
      KV* k_dst = ks + slot[t] * kv_heads * row;
      KV* v_dst = vs + slot[t] * kv_heads * row;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const T* kh = kp + t * k.stride(0) + h * k.stride(1);
        const T* vh = vp + t * v.stride(0) + h * v.stride(1);
        if constexpr (quantized) {
          rotate(kh, ct, st, D, rotated.data());
          radixserve::quantize_row(rotated.data(), D, k_dst + h * row);
          radixserve::quantize_row(vh, D, v_dst + h * row);
        } else {
          rotate(kh, ct, st, D, k_dst + h * row);
          for (int64_t d = 0; d < D; ++d) v_dst[h * row + d] = vh[d];
        }
      }
    }
  });
}

template <typename T>
void run_for_pool(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& cos, const at::Tensor& signed_sin, const at::Tensor& slots,
                  at::Tensor& k_slots, at::Tensor& v_slots, at::Tensor& out) {
  if (k_slots.scalar_type() == at::kChar)
    run<T, int8_t>(q, k, v, cos, signed_sin, slots, k_slots, v_slots, out);
  else
    run<T, T>(q, k, v, cos, signed_sin, slots, k_slots, v_slots, out);
}

// q [T, H, D], k and v [T, KVH, D] (rows may be strided, heads contiguous); cos, signed_sin
// [T, 1, D] contiguous; slots int64 [T]; k_slots, v_slots [num_slots, KVH, D] contiguous (one
// layer of the pool; int8 pools: [num_slots, KVH, D + 2]). Returns the rotated queries, [T, H, D]
// contiguous.
at::Tensor rope_store(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& cos, const at::Tensor& signed_sin,
                      const at::Tensor& slots, at::Tensor k_slots, at::Tensor v_slots) {
  const int64_t tokens = q.size(0), D = q.size(2);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && k.size(0) == tokens &&
                  k.size(2) == D && D % 2 == 0,
              "rope_store: q [T, H, D], k and v [T, KVH, D] expected");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && q.stride(1) == D &&
                  k.stride(1) == D && v.stride(1) == D,
              "rope_store: heads must be contiguous within each token");
  TORCH_CHECK(cos.is_contiguous() && signed_sin.is_contiguous() && cos.numel() == tokens * D &&
                  signed_sin.numel() == tokens * D,
              "rope_store: cos and signed_sin [T, 1, D] expected");
  const bool quantized = k_slots.scalar_type() == at::kChar;
  TORCH_CHECK(k_slots.is_contiguous() && v_slots.is_contiguous() &&
                  k_slots.sizes() == v_slots.sizes() && k_slots.dim() == 3 &&
                  k_slots.size(1) == k.size(1) &&
                  k_slots.size(2) == D + (quantized ? radixserve::kScaleBytes : 0),
              "rope_store: the pool's slots [num_slots, KVH, D] (int8: D + 2) expected");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.numel() == tokens,
              "rope_store: int64 slots [T] expected");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype &&
                  cos.scalar_type() == dtype && signed_sin.scalar_type() == dtype &&
                  (quantized || k_slots.scalar_type() == dtype) &&
                  v_slots.scalar_type() == k_slots.scalar_type(),
              "rope_store: every tensor in the model's dtype (the pool's: or int8) expected");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < k_slots.size(0), "rope_store: slot ", slot[t],
                " is outside the pool of ", k_slots.size(0));
  auto out = at::empty({tokens, q.size(1), D}, q.options());
  switch (dtype) {
    case at::kFloat:
      run_for_pool<float>(q, k, v, cos, signed_sin, slots, k_slots, v_slots, out);
      break;
    case at::kBFloat16:
      run_for_pool<c10::BFloat16>(q, k, v, cos, signed_sin, slots, k_slots, v_slots, out);
      break;
    case at::kHalf:
      run_for_pool<c10::Half>(q, k, v, cos, signed_sin, slots, k_slots, v_slots, out);
      break;
    default:
      TORCH_CHECK(false, "rope_store: unsupported dtype ", dtype);
  }
  return out;
}

}  // namespace

RADIXSERVE_OPS_FRAGMENT(m) {
  m.def(
      "rope_store(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor signed_sin, Tensor slots, "
      "Tensor(a!) k_slots, Tensor(b!) v_slots) -> Tensor");
}

RADIXSERVE_OPS_IMPL(m) { m.impl("rope_store", &rope_store); }

#pragma GCC pop_options
