"""Physical KV memory: the device page pool and the host swap pool.

Contract: the scheduler owns page *numbers* (which pages exist, who holds them, when they are
free); this pool owns page *contents* and decides nothing. Every method does exactly the writes,
copies or swaps it is told, vectorised (one indexed op per call, across all layers where the
layout allows).

Layout, one tensor for everything (a layer's K and V are contiguous, which is what FlashInfer's
paged kernels take as ``(k_cache, v_cache)`` in NHD layout)::

    kv   [num_layers, 2 (K, V), num_pages,      page_size, num_kv_heads, row]  device
    host [num_layers, 2 (K, V), num_host_pages, page_size, num_kv_heads, row]  cpu, pinned
                                                                               when on CUDA
    slot s of a layer = page s // page_size, offset s % page_size

``row`` is ``head_dim`` values in the KV dtype (``kv_dtype``: the model's by default); for
int8, ``head_dim`` int8 values and their float16 scale, a page's scales being bytes of the page,
so every copy, swap and shard below carries them with the values; for fp8, ``head_dim`` fp8
values kept as their bytes (uint8: engine/worker/kv_quant.py says why). ``dtype`` is the
model's: what attention computes in and what ``write`` is given; ``layer`` hands out the stored
form, which ``kv_quant.decode`` turns back into values.

Sliding-window layers with pages of their own (``num_sliding_pages``: radix/sliding.py says who
holds them) keep their KV in a second tensor, ``swa`` [sliding layers, 2, num_sliding_pages,
page_size, num_kv_heads, row]; ``kv`` then holds the other layers only. ``layer``, ``slots`` and
``write`` take the model's layer index either way; a step's sliding layers write and read the
sliding pages its ``swa_*`` arrays name (``copy_sliding`` for its copies). Swap preemption
moves a sequence's sliding pages with its full ones (``sliding=True``), into ``host_swa``
[sliding layers, 2, num_host_sliding_pages, ...], whose page ``h`` is the sliding part of swap
page ``h`` of ``host``.

The device pool starts zeroed: attention kernels may read (and mask) slots no token was ever
written to, and zeros keep those reads finite.

Swaps on CUDA go through one pinned staging buffer (made on the first swap, grown when a swap
needs more pages): a copy between the device and pageable memory is synchronous and bounces
through a driver buffer, one from pinned memory is a direct, non-blocking DMA. The rule that
keeps the buffer safe: the host touches it only after the last copy that used it has finished
(an event recorded after each copy). On CPU there is nothing to stage; pages are copied
directly between the two tensors.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.worker.kv_quant import encode, row_width, storage_dtype
from engine.worker.staging import to_device, to_device_many


class KVPool:
    def __init__(self, *, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 num_host_pages: int = 0, kv_dtype: torch.dtype | None = None,
                 sliding_layers: tuple[bool, ...] = (), num_sliding_pages: int = 0,
                 num_host_sliding_pages: int = 0) -> None:
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_sliding_pages = num_sliding_pages
        # per layer: whether its KV is in ``swa`` (only with sliding pages of their own)
        self.sliding_layers = (tuple(sliding_layers) if num_sliding_pages
                               else (False,) * num_layers)
        num_sliding = sum(self.sliding_layers)
        self.num_host_pages = num_host_pages
        self.device = torch.device(device)
        self.dtype, self.kv_dtype = dtype, kv_dtype or dtype
        self.quantized = self.kv_dtype == torch.int8
        # Stored in another form than the model's values (int8 rows, fp8 bytes, or a full
        # precision other than the model's): readers decode what they gather.
        self.encoded = self.kv_dtype != dtype
        self.head_dim = head_dim
        row = row_width(head_dim, self.kv_dtype)
        page = (page_size, num_kv_heads, row)
        stored = storage_dtype(self.kv_dtype)
        num_full = num_layers - num_sliding
        self.kv = _zeros((num_full, 2, num_pages, *page), stored, self.device)
        self.swa = _zeros((num_sliding, 2, num_sliding_pages, *page), stored, self.device)
        self.host = _zeros((num_full, 2, num_host_pages, *page), stored, torch.device("cpu"),
                           pin=self.device.type == "cuda" and num_host_pages > 0)
        self.host_swa = _zeros((num_sliding, 2, num_host_sliding_pages, *page), stored,
                               torch.device("cpu"),
                               pin=self.device.type == "cuda" and num_host_sliding_pages > 0)
        # All layers, slot-major: [num_layers, 2, num_pages * page_size, heads, row].
        self._all_slots = self.kv.view(num_full, 2, num_pages * page_size, num_kv_heads, row)
        self._swa_slots = self.swa.view(num_sliding, 2, num_sliding_pages * page_size,
                                        num_kv_heads, row)
        # Per layer: its tensor's index and (K, V) slot-major views [pages * page_size, heads,
        # row] for token writes.
        full, sliding = iter(range(num_full)), iter(range(num_sliding))
        self._where = [(self.swa, next(sliding)) if s else (self.kv, next(full))
                       for s in self.sliding_layers]
        self._slot_views = [tuple((self._swa_slots if s else self._all_slots)[i])
                            for s, (_, i) in zip(self.sliding_layers, self._where, strict=True)]
        # (K, V) pages of each layer (``layer``): made once, not two selects a layer a step
        self._layer_views = [(pages[i, 0], pages[i, 1]) for pages, i in self._where]
        # CUDA swaps: a flat pinned buffer and the event after the last copy that used it.
        self._staging = torch.empty(0, dtype=stored)
        self._staging_used = torch.cuda.Event() if self.device.type == "cuda" else None

    @staticmethod
    def bytes_per_page(*, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        """Bytes of one page in every layer, K and V, for a pool storing ``dtype`` (int8: with
        its scales)."""
        row_bytes = row_width(head_dim, dtype) * dtype.itemsize
        return num_layers * 2 * page_size * num_kv_heads * row_bytes

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) pages of one layer, each [num_pages, page_size, num_kv_heads, row], in the
        stored form (fp8 as uint8: ``kv_quant.decode``, or ``.view(kv_dtype)``)."""
        return self._layer_views[layer]

    def slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer by slot, each [num_pages * page_size, num_kv_heads, row]:
        views of the pages, for writing new tokens' K and V in place."""
        return self._slot_views[layer]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K and V ([T, num_kv_heads, head_dim]) at ``slots`` (int64, device),
        encoded in the pool's form (``kv_quant.encode``)."""
        k_slots, v_slots = self._slot_views[layer]
        if self.encoded:
            k, v = encode(k, self.kv_dtype), encode(v, self.kv_dtype)
        k_slots.index_copy_(0, slots, k)
        v_slots.index_copy_(0, slots, v)

    def copy_pages(self, copies: np.ndarray) -> None:
        """For each (src_page, dst_page, num_slots): copy the first num_slots slots of src into
        dst, in every layer (copy-on-write of a partially matched page)."""
        _copy_slots(self._all_slots, copies, self.page_size)

    def copy_sliding(self, copies: np.ndarray) -> None:
        """``copy_pages`` for the sliding layers' pages (a step's ``swa_copies``)."""
        _copy_slots(self._swa_slots, copies, self.page_size)

    def swap_out(self, pairs: np.ndarray, *, sliding: bool = False) -> None:
        """Copy whole device pages to host pages, (device_page, host_page) per row (with
        ``sliding``: sliding pages to ``host_swa``).

        Synchronous: when it returns the host pages hold the data and every read of the device
        pages has finished, so later work on any stream may overwrite them."""
        if len(pairs) == 0:
            return
        pairs = np.asarray(pairs, dtype=np.int64)
        device_pages = to_device(pairs[:, 0], self.device)
        host_pages = torch.from_numpy(pairs[:, 1])
        kv, host = (self.swa, self.host_swa) if sliding else (self.kv, self.host)
        pages = kv.index_select(2, device_pages)
        if self._staging_used is not None:
            staged = self._staging_for(pages.shape)
            staged.copy_(pages, non_blocking=True)
            self._staging_used.record()
            self._staging_used.synchronize()  # the host reads the buffer next
            pages = staged
        host.index_copy_(2, host_pages, pages)

    def swap_in(self, pairs: np.ndarray, *, sliding: bool = False) -> None:
        """Copy whole host pages back to device pages, (host_page, device_page) per row (with
        ``sliding``: from ``host_swa`` to sliding pages).

        The host pages are read before it returns, so they may be reused at once. On CUDA the
        copy to the device is queued on the current stream, not waited for: the device pages
        hold the data for work queued after it on that stream (another stream must wait on it
        first)."""
        if len(pairs) == 0:
            return
        pairs = np.asarray(pairs, dtype=np.int64)
        host_pages = torch.from_numpy(pairs[:, 0])
        device_pages = to_device(pairs[:, 1], self.device)
        kv, host = (self.swa, self.host_swa) if sliding else (self.kv, self.host)
        if self._staging_used is None:
            kv.index_copy_(2, device_pages, host.index_select(2, host_pages))
            return
        shape = (*host.shape[:2], len(pairs), *host.shape[3:])
        staged = self._staging_for(shape)
        torch.index_select(host, 2, host_pages, out=staged)
        pages = staged.to(self.device, non_blocking=True)
        self._staging_used.record()
        kv.index_copy_(2, device_pages, pages)

    def _staging_for(self, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """A contiguous ``shape`` view of the pinned staging buffer (CUDA only), once the last
        copy that used the buffer has finished: the caller may write it from the host."""
        self._staging_used.synchronize()
        numel = int(np.prod(shape))
        if self._staging.numel() < numel:
            # Not an inference tensor, though the runner swaps under inference mode: those
            # cannot be written outside it.
            with torch.inference_mode(False):
                self._staging = torch.empty(numel, dtype=self.kv.dtype, pin_memory=True)
        return self._staging[:numel].view(shape)


def _copy_slots(all_slots: torch.Tensor, copies: np.ndarray, page_size: int) -> None:
    """(src_page, dst_page, num_slots) copies over every layer of ``all_slots`` [layers, 2,
    slots, heads, row]."""
    if len(copies) == 0:
        return
    copies = np.asarray(copies, dtype=np.int64)
    counts = copies[:, 2]
    offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    src = np.repeat(copies[:, 0] * page_size, counts) + offsets
    dst = np.repeat(copies[:, 1] * page_size, counts) + offsets
    src_t, dst_t = to_device_many([src, dst], all_slots.device)  # queued, not waited for
    all_slots.index_copy_(2, dst_t, all_slots.index_select(2, src_t))


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           pin: bool = False) -> torch.Tensor:
    if device.type != "cpu" or pin or 0 in shape:
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
    # numpy's zeros is calloc: the OS hands out zero pages on first touch, so a large CPU
    # buffer costs neither time nor resident memory until written. The served worker writes
    # its device pool once before it reports ready (process.prefault_pool); the host tier's
    # pages stay lazy.
    raw = torch.from_numpy(np.zeros(int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8))
    return raw.view(dtype).view(shape)


def sliding_layers(windows: tuple[int | None, ...], ratio: float) -> tuple[tuple[bool, ...], int]:
    """Which layers keep their KV in sliding pages of their own under ``--sliding-kv-ratio
    ratio`` (none at 0), and the window they share (ValueError with a sentence when the model
    has no sliding layers or windows of several sizes)."""
    if not ratio:
        return (False,) * len(windows), 0
    sizes = {w for w in windows if w is not None}
    if not sizes:
        raise ValueError("--sliding-kv-ratio needs a model with sliding-window layers; this "
                         "one attends to its whole context in every layer")
    if len(sizes) > 1:
        raise ValueError(f"--sliding-kv-ratio needs one window for every sliding layer; this "
                         f"model's are {sorted(sizes)}")
    return tuple(w is not None for w in windows), sizes.pop()
