"""Attention over paged KV with FlashInfer's paged kernels (CUDA, fp16/bf16, KV in the model's
dtype or fp8).

The page tables go to FlashInfer unchanged: ``kv_indptr`` = ``batch.page_indptr``,
``kv_indices`` = ``batch.page_indices``, ``kv_last_page_len`` = tokens in each sequence's last
page; the KV of a layer is the pool's ``(k_pages, v_pages)`` pair in NHD layout. A step whose
sequences all add one token runs ``BatchDecodeWithPagedKVCacheWrapper``; any other step (prefill,
chunked prefill, mixed prefill + decode) runs ``BatchPrefillWithPagedKVCacheWrapper`` with a
causal mask, which FlashInfer aligns to the end of each sequence (query j of an extend of n
sits at position seq_len - n + j), exactly the position convention of ``BatchInput``.

A wrapper is planned once per step and per distinct sliding window (FlashInfer fixes
``window_left`` at plan time), then run by every layer with that window. A pool whose sliding
layers have pages of their own (``--sliding-kv-ratio``) is planned once per layer kind (base.py):
the full layers' wrappers over the step's page tables, the sliding layers' over its sliding
page tables (``BatchInput.swa_page_indices``) cut to each sequence's window, as the torch
backend gathers them: pages before ``(seq_len - extend + 1 - window) // page_size`` are left
out of ``kv_indices`` (those read as sliding page 0 once freed), which shortens every
sequence's KV by whole pages and so leaves the end-aligned causal mask and ``window_left``
relative to the same keys; each layer runs its kind's wrappers over its own pool tensor
(``KVPool.layer``: ``swa`` for the sliding layers). ``plan`` gets every
index array staged with the step's others (engine/worker/staging.py): the page indices on the
device, the page-table offsets and last page lengths (and the query offsets of a prefill) as
pinned host views, which FlashInfer reads on the host and copies to the device without waiting.
Nothing in a step reads back from the device until the sampler's one copy at its end, so a
``plan()`` never overwrites FlashInfer's pinned plan buffer while the previous step's copy of it
is still in flight.

Workspace: FlashInfer's float scratch space holds the partial outputs of KV split into chunks
(float32 [work items x query tile, query heads, head_dim] and their log-sum-exps). CUDA-graph
decode always splits, with one work item per query tile of every sequence plus one per
sequence, so the space grows with the largest captured batch, the query heads and head_dim
(``workspace_bytes``): 64 query heads of 128 at batch 256 need about 201 MB. It is sized from
the model at start-up and checked against the graphs' largest batch before any is captured.

Kernels: FlashInfer 0.6 compiles each kernel module on first use. ``prebuild`` builds the exact
modules this backend will load (``jit_specs``), in parallel in one ninja run, before the warm-up;
they stay in FlashInfer's cache (``FLASHINFER_WORKSPACE_BASE``, default ``~``), so a later start
compiles nothing. FA3 (Hopper's kernels, FlashInfer's own choice there for prefill) is taken only
where its modules are already built (scripts/gpu_phase.py builds them when time allows): its
sm90a files take several times FA2's build, so a start never waits for them; FA2 serves
otherwise, with a log line. Decode on tensor cores (query groups of 4 or more) takes
``decode_backend``: ``fa2`` by default, because FA3 is slower for decode; ``auto`` leaves it to
FlashInfer (FA3 again only if built); ``fa3`` asks for it, built if need be.

fp8 KV (``--kv-cache-dtype fp8_e4m3|fp8_e5m2``): the pages hold fp8 values with one scale of
1.0 for the cache (engine/worker/kv_quant.py); the plans name fp8 as the KV dtype and the
model's as the query's, the kernels read the pages as fp8 views of the pool's bytes, and both
prefill and decode take FA2 (FA3's fp8 kernels want fp8 queries too).

CUDA graphs (engine/worker/cuda_graphs.py): each captured batch size gets its own decode wrappers in
CUDA-graph mode, all over one set of fixed index buffers sized for the largest batch;
``plan(batch, graph=True)`` fills them before the replay. With sliding pages of their own, each
layer kind has its own set of fixed buffers (the sliding one sized from the sliding pool) and
its own wrappers per batch size, so a step's two plans fill two sets.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from types import ModuleType

import numpy as np
import torch

from engine.contracts.step import BatchInput
from engine.worker.attention.base import AttentionBackend
from engine.worker.kv_pool import KVPool
from engine.worker.kv_quant import FP8_DTYPES
from engine.worker.staging import Staged

logger = logging.getLogger("radixserve.attention")

INSTALL_HINT = (
    "the flashinfer backend needs CUDA and the flashinfer-python package: "
    "pip install 'radixserve[gpu]'"
)
# FlashInfer's examples' size; more when the model needs it (``workspace_bytes``).
MIN_WORKSPACE_BYTES = 128 << 20
# Upper bounds on FlashInfer's scheduler (include/flashinfer/attention/scheduler.cuh, v0.6.1):
# CTAs it keeps resident per SM (it asks the occupancy API; 1-2 for these kernels on Hopper),
# and the largest query tile a split prefill uses.
_CTAS_PER_SM = 4
_LARGEST_QUERY_TILE = 128
# SMs assumed where the pool is not on CUDA (the fake's tests): an H100's or H200's.
_DEFAULT_NUM_SMS = 132
# FlashInfer 0.6 builds its prefill kernels for these head sizes only.
FLASHINFER_HEAD_DIMS = (64, 128, 256)
DECODE_BACKENDS = ("fa2", "fa3", "auto")
# Page indices a graph step may list, per page of the pool (pages shared by several sequences
# are listed once per sequence); a step past it runs eagerly.
_GRAPH_INDICES_PER_PAGE = 4


def import_flashinfer() -> ModuleType:
    """Import flashinfer, or raise RuntimeError with the install hint."""
    if not torch.cuda.is_available():
        raise RuntimeError(INSTALL_HINT + " (CUDA is not available)")
    try:
        import flashinfer
    except ImportError as exc:
        raise RuntimeError(f"{INSTALL_HINT} (import failed: {exc})") from exc
    return flashinfer


def check_pool(pool: KVPool) -> None:
    """Raise unless FlashInfer can run over this pool: CUDA, a float16 or bfloat16 model, KV in
    its dtype or fp8."""
    if pool.device.type != "cuda":
        raise RuntimeError(f"{INSTALL_HINT} (the KV pool is on {pool.device}, not CUDA)")
    if pool.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"the flashinfer backend runs float16 or bfloat16, not {pool.dtype}; "
            "pass dtype='bfloat16' or attention_backend='torch'"
        )
    if pool.kv_dtype not in (pool.dtype, *FP8_DTYPES):
        raise ValueError(f"the flashinfer backend reads KV in the model's dtype or fp8, not "
                         f"{pool.kv_dtype}: use --kv-cache-dtype auto, fp8_e4m3 or fp8_e5m2")


def decode_query_tile(group: int) -> int:
    """FlashInfer's query tile for a decode row packing ``group`` query heads (FA2)."""
    return 16 if group <= 16 else 64 if group <= 64 else 128


def workspace_bytes(*, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                    graph_max_batch: int, num_sms: int) -> int:
    """Bytes of float workspace FlashInfer may use for this model, at least
    ``MIN_WORKSPACE_BYTES``: float32 partial outputs and log-sum-exps of every work item's
    query tile, for every query head::

        rows  = work items x query tile
        bytes = num_qo_heads x rows x (head_dim + 1) x 4

    Eager plans split KV only while the work items are fewer than the CTAs that fit
    (``num_sms x _CTAS_PER_SM / num_kv_heads``), at most ``_LARGEST_QUERY_TILE`` rows each.
    CUDA-graph decode always splits: ceil(batch x group / tile) + batch - 1 work items of
    ``decode_query_tile(group)`` rows, at the largest captured batch (0: no graphs)."""
    group = num_qo_heads // num_kv_heads
    resident = max(num_sms * _CTAS_PER_SM // num_kv_heads, 1)
    rows = resident * _LARGEST_QUERY_TILE
    if graph_max_batch > 0:
        tile = decode_query_tile(group)
        items = -(-graph_max_batch * group // tile) + graph_max_batch - 1
        rows = max(rows, max(items, resident) * tile)
    needed = num_qo_heads * rows * (head_dim + 1) * 4
    return max(MIN_WORKSPACE_BYTES, -(-needed // (1 << 20)) * (1 << 20))


def jit_specs(dtype: torch.dtype, head_dim: int, windowed_kinds: Sequence[bool],
              tensor_cores: bool, prefill_backend: str, decode_backend: str,
              kv_dtype: torch.dtype | None = None) -> list:
    """The kernel modules a backend of these shapes loads: per kind of layer (with or without
    a sliding window), a paged prefill module and a decode module (on tensor cores, a prefill
    module of ``decode_backend``), for queries and outputs in ``dtype``, KV in ``kv_dtype``
    (default the same), this head size, int32 page indices and no positional encoding inside
    the kernel (RoPE is applied before attention)."""
    from flashinfer.jit import gen_batch_decode_module, gen_batch_prefill_module

    specs = {}
    kv_dtype = kv_dtype or dtype
    for windowed in sorted(set(windowed_kinds)):
        args = (dtype, kv_dtype, dtype, torch.int32, head_dim, head_dim, 0, windowed, False)
        prefill = gen_batch_prefill_module(prefill_backend, *args, False)
        specs[prefill.name] = prefill
        spec = (gen_batch_prefill_module(decode_backend, *args, False) if tensor_cores
                else gen_batch_decode_module(*args))
        specs[spec.name] = spec
    return list(specs.values())


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graph = True
    _step_state = ("_out_slots", "_active")

    def __init__(self, pool: KVPool, *, decode_backend: str = "fa2", graph_max_batch: int = 0,
                 **shape) -> None:
        """``shape``: ``AttentionBackend``'s; ``graph_max_batch``: the largest batch CUDA graphs
        will be captured for (0: none), which sizes the workspace."""
        super().__init__(pool, **shape)
        num_heads, num_kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        if head_dim not in FLASHINFER_HEAD_DIMS:
            raise ValueError(f"the flashinfer backend's kernels are built for head_dim "
                             f"{', '.join(map(str, FLASHINFER_HEAD_DIMS))}; this model's is "
                             f"{head_dim}: use attention_backend='torch' (auto picks it by itself)")
        if decode_backend not in DECODE_BACKENDS:
            raise ValueError(f"decode_backend must be one of {', '.join(DECODE_BACKENDS)}, "
                             f"got {decode_backend!r}")
        self.flashinfer = import_flashinfer()
        check_pool(pool)
        self.decode_backend = decode_backend
        # CUDA-core decode kernels cover small query groups only; tensor cores cover any.
        self.tensor_cores = num_heads // num_kv_heads >= 4
        self.prefill_kernel, self.decode_kernel = self._choose_kernels()
        num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                   if self.device.type == "cuda" else _DEFAULT_NUM_SMS)
        self.graph_max_batch = graph_max_batch
        self.workspace_bytes = workspace_bytes(
            num_qo_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            graph_max_batch=graph_max_batch, num_sms=num_sms)
        # Wrappers run one after another on one stream, so they can share the scratch space.
        self._workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8,
                                      device=self.device)
        logger.info("flashinfer: %.0f MiB workspace (%d query heads of %d, CUDA graphs up to "
                    "batch %d, %d SMs)", self.workspace_bytes / 2**20, num_heads, head_dim,
                    graph_max_batch, num_sms)
        windows = set(self.sliding_windows)
        self._decode = {w: self._decode_wrapper() for w in windows}
        self._prefill = {w: self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, "NHD", backend=self.prefill_kernel) for w in windows}
        # per (batch size, layer kind (sliding: True), window): CUDA-graph decode wrappers; per
        # layer kind: their fixed (indptr, indices, last page lengths) buffers
        self._graph_decode: dict[tuple[int, bool, int | None], object] = {}
        self._graph_buffers: dict[bool, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._active: dict[int | None, object] = {}
        # Each layer's (K, V) pages as the kernels read them: fp8 views of an fp8 pool's bytes.
        self._kv = [tuple(t.view(pool.kv_dtype) for t in pool.layer(i))
                    for i in range(pool.num_layers)]

    def _decode_wrapper(self, batch_size: int | None = None, sliding: bool = False):
        """A decode wrapper; with ``batch_size``, in CUDA-graph mode over the first
        ``batch_size`` rows of the fixed buffers its layer kind (``sliding``) shares."""
        graph = {}
        if batch_size is not None:
            indptr, indices, last_page_len = self._graph_buffers[sliding]
            graph = dict(use_cuda_graph=True, paged_kv_indptr_buffer=indptr[: batch_size + 1],
                         paged_kv_indices_buffer=indices,
                         paged_kv_last_page_len_buffer=last_page_len[:batch_size])
        return self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=self.tensor_cores,
            backend=self.decode_kernel, **graph)

    def _choose_kernels(self) -> tuple[str, str]:
        """(prefill, decode) kernel families: FlashInfer's choice for this device, FA3 only
        where its modules are built (``decode_backend="fa3"`` is honoured regardless)."""
        from flashinfer.utils import determine_attention_backend

        dtype, kv_dtype = self.pool.dtype, self.pool.kv_dtype
        if kv_dtype in FP8_DTYPES:
            if self.decode_backend == "fa3":
                logger.info("flashinfer: fp8 KV decodes on FA2 (FA3's fp8 wants fp8 queries)")
            return "fa2", "fa2"
        chosen = determine_attention_backend(self.device, 0, False, False, dtype, kv_dtype)
        if chosen == "fa3" and not all(spec.is_compiled for spec in self.jit_specs("fa3", "fa3")):
            logger.info("flashinfer: FA3 modules are not built; FA2 serves (build them "
                        "beforehand: scripts/gpu_phase.py, docs/gpu.md)")
            chosen = "fa2"
        decode = chosen if self.decode_backend == "auto" else self.decode_backend
        return chosen, decode

    def jit_specs(self, prefill: str | None = None, decode: str | None = None) -> list:
        """The kernel modules this backend loads (module-level ``jit_specs``), or would load with
        the kernel families ``prefill`` and ``decode``."""
        return jit_specs(self.pool.dtype, self.head_dim,
                         [w is not None for w in self.sliding_windows], self.tensor_cores,
                         prefill or self.prefill_kernel, decode or self.decode_kernel,
                         self.pool.kv_dtype)

    def prebuild(self) -> float:
        """Compile (or find in the cache) every module ``jit_specs`` names, in parallel; the
        seconds it took."""
        from flashinfer.jit import build_jit_specs

        start = time.perf_counter()
        specs = self.jit_specs()
        build_jit_specs(specs, verbose=False)
        seconds = time.perf_counter() - start
        logger.info("flashinfer: %d kernel modules ready in %.1f s (prefill %s, decode %s on "
                    "%s)", len(specs), seconds, self.prefill_kernel, self.decode_kernel,
                    "tensor cores" if self.tensor_cores else "CUDA cores")
        return seconds

    def staged_arrays(self, batch: BatchInput) -> list[np.ndarray]:
        """Page indices (read on the device), then page-table offsets, last page lengths and
        query offsets (read on the host by ``plan``), all int32. Planning the sliding layers
        (``_plan_window`` set), each sequence's pages start at its first query's window."""
        qo_indptr = np.zeros(batch.num_seqs + 1, dtype=np.int32)
        np.cumsum(batch.extend_lens, out=qo_indptr[1:])
        indptr, indices = batch.page_indptr, batch.page_indices
        if self._plan_window is not None:
            # never past a sequence's last page: a window holds at least its query
            first = np.maximum(batch.seq_lens - batch.extend_lens + 1 - self._plan_window,
                               0) // self.pool.page_size
            counts = np.diff(indptr) - first
            indptr = np.zeros(batch.num_seqs + 1, dtype=np.int64)
            np.cumsum(counts, out=indptr[1:])
            starts = batch.page_indptr[:-1].astype(np.int64) + first
            indices = indices[np.repeat(starts - indptr[:-1], counts) + np.arange(indptr[-1])]
        return [indices.astype(np.int32, copy=False), indptr.astype(np.int32, copy=False),
                batch.last_page_lens(self.pool.page_size).astype(np.int32, copy=False),
                qo_indptr]

    def prepare_graphs(self, max_batch: int) -> None:
        """One set of fixed index buffers for every captured batch size (each uses a prefix),
        per layer kind, once the workspace is known to hold the largest batch's split partial
        outputs."""
        if max_batch > self.graph_max_batch:
            raise ValueError(
                f"the flashinfer workspace ({self.workspace_bytes / 2**20:.0f} MiB) was sized "
                f"for CUDA graphs up to batch {self.graph_max_batch}, not {max_batch}: build "
                "the backend with graph_max_batch set to the largest batch")
        kinds = {False: self.pool.num_pages}
        if self.pool.num_sliding_pages:
            kinds[True] = self.pool.num_sliding_pages
        for sliding, num_pages in kinds.items():
            self._graph_buffers[sliding] = (
                torch.zeros(max_batch + 1, dtype=torch.int32, device=self.device),
                torch.zeros(_GRAPH_INDICES_PER_PAGE * num_pages + max_batch, dtype=torch.int32,
                            device=self.device),
                torch.zeros(max_batch, dtype=torch.int32, device=self.device),
            )

    def graph_fits(self, batch: BatchInput) -> bool:
        if not self._graph_buffers:
            return False
        tables = {False: batch.page_indices}
        if batch.has_sliding_pages:  # the sliding plan lists at most these (cut to windows)
            tables[True] = batch.swa_page_indices
        for sliding, indices in tables.items():
            _, buffer, last_page_len = self._graph_buffers[sliding]
            if len(indices) + len(last_page_len) - batch.num_seqs > len(buffer):
                return False
        return True

    def _plan(self, batch: BatchInput, graph: bool, staged: Sequence[Staged]) -> None:
        page_size = self.pool.page_size
        indices, indptr, last_page_lens, qo_offsets = staged
        kv_indices = indices.on_device
        kv_indptr, last_page_len = indptr.pinned, last_page_lens.pinned
        common = dict(pos_encoding_mode="NONE", q_data_type=self.pool.dtype,
                      kv_data_type=self.pool.kv_dtype, sm_scale=self.scale)
        windows = self._windows_planned(batch)
        if graph or batch.is_decode:
            wrappers = ({w: self._graph_wrapper(batch.num_seqs, w) for w in windows} if graph
                        else {w: self._decode[w] for w in windows})
            for window, wrapper in wrappers.items():
                wrapper.plan(kv_indptr, kv_indices, last_page_len, self.num_heads,
                             self.num_kv_heads, self.head_dim, page_size,
                             window_left=_window_left(window), **common)
            self._active = dict(wrappers)
            return
        wrappers = {w: self._prefill[w] for w in windows}
        for window, wrapper in wrappers.items():
            wrapper.plan(qo_offsets.pinned, kv_indptr, kv_indices, last_page_len, self.num_heads,
                         self.num_kv_heads, self.head_dim, page_size, causal=True,
                         window_left=_window_left(window), **common)
        self._active = wrappers

    def _windows_planned(self, batch: BatchInput) -> set[int | None]:
        """The windows this plan serves: the sliding layers' while planning their own pages,
        the other layers' beside them, every layer's otherwise."""
        if self._plan_window is not None:
            return {self._plan_window}
        if batch.has_sliding_pages:
            return {w for w, sliding in zip(self.sliding_windows, self.pool.sliding_layers,
                                            strict=True) if not sliding}
        return set(self.sliding_windows)

    def _graph_wrapper(self, batch_size: int, window: int | None):
        """Batch size ``batch_size``'s CUDA-graph decode wrapper for ``window``, made at its
        capture, over the fixed buffers of the layer kind being planned."""
        key = (batch_size, self._plan_window is not None, window)
        wrapper = self._graph_decode.get(key)
        if wrapper is None:
            wrapper = self._decode_wrapper(batch_size, sliding=key[1])
            self._graph_decode[key] = wrapper
        return wrapper

    def warm_up(self) -> None:
        """Build the kernels, then plan and run a prefill and a decode over the first pages, for
        every sliding window, before the server reports ready: FlashInfer 0.6 compiles each
        kernel on first use (so that is now, not inside the first request), and a broken install
        fails here. Only reads the pool (``_attend``, not ``forward``), which holds no one's KV
        yet."""
        self.prebuild()
        page_size = self.pool.page_size
        pages = list(range(-(-2 // page_size)))  # room for two tokens
        first_layer = {w: self.sliding_windows.index(w) for w in set(self.sliding_windows)}
        for batch in (BatchInput.build([(pages, 0, [0, 0])], page_size, "all"),
                      BatchInput.build([(pages, 1, [0])], page_size)):
            self.plan(batch)
            q = torch.zeros(batch.num_tokens, self.num_heads, self.head_dim,
                            dtype=self.pool.dtype, device=self.device)
            for layer in first_layer.values():
                self._attend(layer, q)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        wrapper = self._active[self.sliding_windows[layer]]
        return wrapper.run(q.contiguous(), self._kv[layer])


def _window_left(window: int | None) -> int:
    # transformers lets a query see keys at distance < window; FlashInfer counts keys to the
    # left of the query (inclusive window of window_left + 1 tokens).
    return -1 if window is None else window - 1
