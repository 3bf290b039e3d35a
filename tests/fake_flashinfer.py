"""A stand-in for the parts of flashinfer-python 0.6.1 the flashinfer backend calls, computing
in plain torch on any device from exactly the arguments FlashInfer would receive.

It follows FlashInfer's documented contract, so that a wrong argument from our side gives a
wrong answer (or the error FlashInfer would raise) on CPU:

- page tables as CSR: ``indptr`` [B+1] into ``indices``, ``last_page_len`` [B] tokens in each
  sequence's last page; KV as ``(k_cache, v_cache)``, each [pages, page_size, kv_heads, dim]
  (NHD);
- decode: one query per sequence, at the last position; prefill: ``qo_indptr`` [B+1] rows of
  queries per sequence, query j of an extend of n at position kv_len - n + j, causal;
- ``window_left`` w >= 0: a query at position i sees keys i - w .. i; -1: no window;
- CUDA-graph mode (decode): the constructor takes fixed buffers; ``plan`` checks the batch size
  and copies the page table into them; ``run`` reads only those buffers;
- workspace: CUDA-graph decode always splits KV, and ``plan`` fails as FlashInfer's allocator
  does when the float workspace cannot hold the split's partial outputs (``graph_split_bytes``,
  FlashInfer's scheduler arithmetic on an H200: 132 SMs, 2 CTAs each);
- ``run`` checks q's dtype and the pages' against the ones planned (KV in fp8 with q in
  fp16/bf16 is FlashInfer's mixed-precision path; the scale is 1.0);
- jit: specs name their arguments, ``build_jit_specs`` records what it was asked to build.
"""

from __future__ import annotations

import types

import torch

built: list[list[str]] = []  # the spec names of each build_jit_specs call
NUM_SMS, CTAS_PER_SM = 132, 2


def graph_split_bytes(batch_size: int, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                      tensor_cores: bool) -> int:
    """Float workspace a CUDA-graph decode plan takes (include/flashinfer/attention/
    scheduler.cuh, v0.6.1): float32 partial outputs and log-sum-exps of every work item. On
    tensor cores (the prefill scheduler) one work item per 16-row query tile of each sequence
    (packed with its query group) plus one per sequence; on CUDA cores one per resident CTA."""
    resident = NUM_SMS * CTAS_PER_SM // num_kv_heads
    if not tensor_cores:
        return num_qo_heads * max(resident, batch_size) * (head_dim + 1) * 4
    group = num_qo_heads // num_kv_heads
    tile = 16 if group <= 16 else 64 if group <= 64 else 128
    items = max(-(-batch_size * group // tile) + batch_size - 1, resident)
    return num_qo_heads * items * tile * (head_dim + 1) * 4


class Spec:
    def __init__(self, *args) -> None:
        self.name = "_".join(str(a).replace("torch.", "") for a in args)

    @property
    def is_compiled(self) -> bool:
        return any(self.name in names for names in built)


def gen_batch_decode_module(*args) -> Spec:
    assert len(args) == 9, args  # dtypes q/kv/o/idx, head dims, pos encoding, window, soft cap
    return Spec("decode", *args)


def gen_batch_prefill_module(backend: str, *args) -> Spec:
    assert len(args) == 10, args  # ... and fp16 qk reduction
    return Spec("prefill", backend, *args)


def build_jit_specs(specs: list[Spec], verbose: bool = False) -> None:
    built.append([spec.name for spec in specs])


def determine_attention_backend(device, pos_encoding_mode, use_fp16_qk_reduction,
                                use_custom_mask, dtype_q, dtype_kv) -> str:
    return "fa2"


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, qo_indptr,
            kv_indptr, kv_indices, last_page_len, window_left: int,
            sm_scale: float | None) -> torch.Tensor:
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    out = torch.empty_like(q)
    qo_indptr, kv_indptr = qo_indptr.tolist(), kv_indptr.tolist()
    for b in range(len(kv_indptr) - 1):
        pages = kv_indices[kv_indptr[b] : kv_indptr[b + 1]].long()
        kv_len = (len(pages) - 1) * page_size + int(last_page_len[b])
        k = k_cache[pages].reshape(-1, kv_heads, k_cache.shape[-1])[:kv_len].float()
        v = v_cache[pages].reshape(-1, kv_heads, v_cache.shape[-1])[:kv_len].float()
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        rows = slice(qo_indptr[b], qo_indptr[b + 1])
        qb = q[rows].float()
        n = qb.shape[0]
        scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
        scores = torch.einsum("thd,shd->hts", qb, k) * scale
        q_pos = torch.arange(kv_len - n, kv_len)[:, None]
        k_pos = torch.arange(kv_len)[None, :]
        allowed = k_pos <= q_pos
        if window_left >= 0:
            allowed &= k_pos >= q_pos - window_left
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        out[rows] = torch.einsum("hts,shd->thd", scores.softmax(-1), v).to(q.dtype)
    return out


class _Wrapper:
    def __init__(self, workspace: torch.Tensor, kv_layout: str) -> None:
        assert kv_layout == "NHD"
        self.device = workspace.device
        self.workspace_bytes = workspace.numel() * workspace.element_size()
        self.planned = None

    def _plan(self, heads: int, kv_heads: int, head_dim: int, window_left: int,
              q_data_type, kv_data_type, sm_scale: float | None) -> None:
        assert heads % kv_heads == 0
        self.planned = dict(head_dim=head_dim, window_left=window_left, q_dtype=q_data_type,
                            kv_dtype=kv_data_type or q_data_type, sm_scale=sm_scale)

    def _check_q(self, q: torch.Tensor, paged_kv_cache) -> None:
        assert self.planned is not None, "run() before plan()"
        if q.dtype != self.planned["q_dtype"]:
            raise ValueError(f"q is {q.dtype} but the plan said {self.planned['q_dtype']}")
        for pages in paged_kv_cache:
            if pages.dtype != self.planned["kv_dtype"]:
                raise ValueError(f"the KV cache is {pages.dtype} but the plan said "
                                 f"{self.planned['kv_dtype']}")
        assert q.shape[-1] == self.planned["head_dim"]


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    instances: list[BatchDecodeWithPagedKVCacheWrapper] = []

    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend="auto") -> None:
        super().__init__(workspace, kv_layout)
        assert backend in ("auto", "fa2", "fa3")
        self.use_tensor_cores, self.backend = use_tensor_cores, backend
        self.use_cuda_graph = use_cuda_graph
        if use_cuda_graph:
            for buffer in (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                           paged_kv_last_page_len_buffer):
                if not torch.is_tensor(buffer):
                    raise ValueError("a buffer should be a torch.Tensor in cudagraph mode")
            if len(paged_kv_indptr_buffer) != len(paged_kv_last_page_len_buffer) + 1:
                raise ValueError("The size of paged_kv_indptr_buffer should be batch_size + 1")
        self.indptr, self.indices = paged_kv_indptr_buffer, paged_kv_indices_buffer
        self.last_page_len = paged_kv_last_page_len_buffer
        BatchDecodeWithPagedKVCacheWrapper.instances.append(self)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, pos_encoding_mode="NONE", window_left=-1, q_data_type="float16",
             kv_data_type=None, sm_scale=None) -> None:
        assert pos_encoding_mode == "NONE"
        if self.use_cuda_graph:
            if len(last_page_len) != len(self.last_page_len):
                raise ValueError("The batch size should be fixed in cudagraph mode")
            need = graph_split_bytes(len(last_page_len), num_qo_heads, num_kv_heads, head_dim,
                                     self.use_tensor_cores)
            if need > self.workspace_bytes:
                raise RuntimeError(f"Failed to allocate memory for batch_prefill_tmp_v with size "
                                   f"{need} and alignment 16 in AlignedAllocator")
            if len(indices) > len(self.indices):
                raise ValueError("The size of indices should be less than or equal to the "
                                 "allocated buffer")
            self.indptr.copy_(indptr)
            self.last_page_len.copy_(last_page_len)
            self.indices[: len(indices)].copy_(indices)
        else:
            self.indptr, self.indices = indptr.to(self.device), indices.to(self.device)
            self.last_page_len = last_page_len.to(self.device)
        self._plan(num_qo_heads, num_kv_heads, head_dim, window_left, q_data_type,
                   kv_data_type, sm_scale)

    def run(self, q, paged_kv_cache) -> torch.Tensor:
        self._check_q(q, paged_kv_cache)
        qo_indptr = torch.arange(len(self.indptr))
        return _attend(q, *paged_kv_cache, qo_indptr, self.indptr, self.indices,
                       self.last_page_len, self.planned["window_left"],
                       self.planned["sm_scale"])


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    def __init__(self, workspace, kv_layout="NHD", backend="auto") -> None:
        super().__init__(workspace, kv_layout)
        assert backend in ("auto", "fa2", "fa3")
        self.backend = backend

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal=False,
             pos_encoding_mode="NONE", window_left=-1, q_data_type="float16",
             kv_data_type=None, sm_scale=None) -> None:
        assert causal and pos_encoding_mode == "NONE"
        self.tables = (qo_indptr.to(self.device), paged_kv_indptr.to(self.device),
                       paged_kv_indices.to(self.device), paged_kv_last_page_len.to(self.device))
        self._plan(num_qo_heads, num_kv_heads, head_dim_qk, window_left, q_data_type,
                   kv_data_type, sm_scale)

    def run(self, q, paged_kv_cache) -> torch.Tensor:
        self._check_q(q, paged_kv_cache)
        return _attend(q, *paged_kv_cache, *self.tables, self.planned["window_left"],
                       self.planned["sm_scale"])


def module() -> types.ModuleType:
    """The fake as the ``flashinfer`` package with its ``jit`` and ``utils`` submodules."""
    package = types.ModuleType("flashinfer")
    package.__version__ = "0.6.1-fake"
    package.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    package.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    package.jit = types.ModuleType("flashinfer.jit")
    package.jit.gen_batch_decode_module = gen_batch_decode_module
    package.jit.gen_batch_prefill_module = gen_batch_prefill_module
    package.jit.build_jit_specs = build_jit_specs
    package.jit.env = types.SimpleNamespace(FLASHINFER_JIT_DIR="(the fake builds nothing)")
    package.utils = types.ModuleType("flashinfer.utils")
    package.utils.determine_attention_backend = determine_attention_backend
    return package
