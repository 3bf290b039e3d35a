// The arguments the paged attention kernels share (paged_decode.cpp, extend_attention.cpp):
// q [T, H, D], one layer's K and V pages [N, P, KVH, D] (or int8 rows of D + 2), each
// sequence's pages as int32 CSR (indptr, indices), its keys (seq_lens), optional starts and
// query rows per sequence (q_indptr). Every read a kernel makes is checked here, once: a bad
// table is an error, never a read outside the pool.
#pragma once

#include <optional>

#include "ops.h"

namespace radixserve {

struct PagedLimits {
  int64_t sequences;  // B
  int64_t max_rows;   // the most query rows of one sequence
  const int32_t* starts;    // nullptr: none given
  const int32_t* q_indptr;  // nullptr: one row per sequence
};

inline PagedLimits check_paged_args(const char* op, const at::Tensor& q,
                                    const at::Tensor& k_pages, const at::Tensor& v_pages,
                                    const at::Tensor& indptr, const at::Tensor& indices,
                                    const at::Tensor& seq_lens,
                                    const std::optional<at::Tensor>& starts,
                                    const std::optional<at::Tensor>& q_indptr) {
  TORCH_CHECK(q.dim() == 3 && k_pages.dim() == 4 && v_pages.sizes() == k_pages.sizes(), op,
              ": q [T, H, D] and pages [N, P, KVH, D] expected");
  TORCH_CHECK(q.is_contiguous() && k_pages.stride(3) == 1 &&
                  k_pages.stride(2) == k_pages.size(3) && v_pages.strides() == k_pages.strides(),
              op, ": q contiguous, pages with contiguous heads expected");
  const bool quantized = k_pages.scalar_type() == at::kChar;
  TORCH_CHECK(k_pages.scalar_type() == q.scalar_type() || quantized, op,
              ": KV pages in q's dtype or int8 expected");
  TORCH_CHECK(v_pages.scalar_type() == k_pages.scalar_type(), op, ": K and V dtypes differ");
  TORCH_CHECK(q.size(2) + (quantized ? kScaleBytes : 0) == k_pages.size(3) &&
                  q.size(1) % k_pages.size(2) == 0,
              op, ": head sizes disagree (int8 rows hold D values and a 2-byte scale)");
  TORCH_CHECK(!q_indptr.has_value() ||
                  (q_indptr->scalar_type() == at::kInt && q_indptr->is_contiguous() &&
                   q_indptr->dim() == 1 && q_indptr->numel() >= 1),
              op, ": int32 q_indptr [B + 1] expected");
  // Sequences: one per query row, or as q_indptr says.
  const int64_t B = q_indptr.has_value() ? q_indptr->numel() - 1 : q.size(0);
  TORCH_CHECK(indptr.scalar_type() == at::kInt && indices.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt && indptr.numel() == B + 1 &&
                  seq_lens.numel() == B && indptr.is_contiguous() &&
                  indices.is_contiguous() && seq_lens.is_contiguous(),
              op, ": int32 indptr [B + 1], indices and seq_lens [B] expected");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* ptr = indptr.data_ptr<int32_t>();
  const int32_t* pages = indices.data_ptr<int32_t>();
  const int64_t num_pages = k_pages.size(0), page_size = k_pages.size(1);
  TORCH_CHECK(ptr[0] == 0 && ptr[B] <= indices.numel(), op,
              ": indptr must start at 0 and stay within indices");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens[b] >= 1 && ptr[b + 1] >= ptr[b] &&
                    (ptr[b + 1] - ptr[b]) * page_size >= lens[b],
                op, ": sequence ", b, " has ", lens[b], " keys but ", ptr[b + 1] - ptr[b],
                " pages of ", page_size);
  for (int64_t i = 0; i < ptr[B]; ++i)
    TORCH_CHECK(pages[i] >= 0 && pages[i] < num_pages, op, ": page ", pages[i],
                " is outside the pool of ", num_pages);
  const int32_t* rows_ptr = nullptr;
  int64_t max_rows = 1;
  if (q_indptr.has_value()) {
    rows_ptr = q_indptr->data_ptr<int32_t>();
    TORCH_CHECK(rows_ptr[0] == 0 && rows_ptr[B] == q.size(0), op,
                ": q_indptr must start at 0 and end at q's ", q.size(0), " rows");
    for (int64_t b = 0; b < B; ++b) {
      const int64_t rows = rows_ptr[b + 1] - rows_ptr[b];
      TORCH_CHECK(rows >= 1 && rows <= lens[b], op, ": sequence ", b, " has ", rows,
                  " query rows for ", lens[b], " keys");
      max_rows = std::max(max_rows, rows);
    }
  }
  const int32_t* start_ptr = nullptr;
  if (starts.has_value()) {
    TORCH_CHECK(starts->scalar_type() == at::kInt && starts->numel() == B &&
                    starts->is_contiguous(),
                op, ": int32 starts [B] expected");
    start_ptr = starts->data_ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t rows = rows_ptr != nullptr ? rows_ptr[b + 1] - rows_ptr[b] : 1;
      TORCH_CHECK(start_ptr[b] >= 0 && start_ptr[b] <= lens[b] - rows, op,
                  ": each start must leave its sequence a key to attend");
    }
  }
  return {B, max_rows, start_ptr, rows_ptr};
}

}  // namespace radixserve
