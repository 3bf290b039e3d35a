"""The sliding-window layers' KV: a second page pool whose pages hang off the full pool's.

A model whose layers come in two kinds (Gemma 3: five of every six attend to the last ``W``
positions only) keeps the full layers' KV in the tree's pages as before, and the sliding
layers' KV in pages of their own, one per full page while anyone needs it::

    full page p  ──of[p]──▶  sliding page s  (or -1: the sliding layers' KV of p is gone)
    sliding page s ──owner[s]──▶ p

A page's sliding KV is written with its full KV (the same step, the same slots) and is a
property of that full page: every holder of ``p`` that needs it reads ``of[p]``. It is
refcounted on its own allocator (``allocator``), by those who need it:

- a holder (a running sequence's lease) on each page of its table from ``Lease.swa_from`` on:
  the pages its next step's queries can still see (``window_start``), and on each copy source
  it has planned until the copy ran;
- a tree node on each page it *keeps* (``Node.swa_pages``, -1 where it keeps none): the window
  that ends where a prompt, or a finished sequence, ends (``keep_from``), so an exact resend and
  a next turn find it. Kept pages of unlocked nodes are evictable (least recently used first,
  before any full page), those of locked nodes are not.

When the last of them lets go the sliding page returns to the free list and ``of[p]`` becomes
-1, while ``p`` itself may stay cached: a match then ends where a whole window of live sliding
KV precedes it (``RadixTree._sliding_limit``). A full page is freed only after everyone who
needed its sliding KV let go, so ``of[p] >= 0`` implies ``p`` is in use.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from radix.pages import PageAllocator


class SlidingKV:
    """``num_pages`` sliding pages of ``page_size`` slots beside a full pool of
    ``num_full_pages``, for layers that see the last ``window`` positions."""

    def __init__(self, num_pages: int, num_full_pages: int, page_size: int, window: int,
                 align: int = 1) -> None:
        """``align``: a kept window also covers the window before the last multiple of
        ``align`` at or before its end, from that block's start (the disk tier's blocks: a
        disk match ends at a block's end, scheduler/disk.py)."""
        if window < 2:
            raise ValueError(f"a sliding window to keep apart sees at least 2 positions, got "
                             f"{window}")
        self.allocator = PageAllocator(num_pages, page_size)
        self.page_size, self.window, self.align = page_size, window, align
        self.of = np.full(num_full_pages, -1, dtype=np.int64)
        self.owner = np.full(num_pages, -1, dtype=np.int64)

    @property
    def num_available_pages(self) -> int:
        return self.allocator.num_free_pages + self.allocator.num_evictable_pages

    def window_start(self, position: int) -> int:
        """The first page a query at ``position`` (or any later one) reads."""
        return max(0, position + 1 - self.window) // self.page_size

    def keep_from(self, end: int) -> int:
        """The first page of the window a cache keeps where a prompt of ``end`` tokens ends:
        positions ``[end - W, end)``, what both a resend (matched to ``end - 1``) and a next turn
        (matched to ``end``) read; with ``align``, from the start of the aligned block that
        holds the window before the last aligned point at or before ``end`` (the blocks a
        disk load ending there reads windows of, whole)."""
        start = end - self.window
        if self.align > 1:
            aligned = end - end % self.align + 1 - self.window
            start = min(start, aligned - aligned % self.align)
        return max(0, start) // self.page_size

    def attach(self, full_pages: Sequence[int]) -> None:
        """Fresh sliding pages for fresh full pages, one reference each (the allocating
        holder's). The caller made sure enough are free."""
        sliding = self.allocator.alloc(len(full_pages))
        index = np.asarray(full_pages, dtype=np.int64)
        assert (self.of[index] < 0).all(), "a fresh full page still had sliding KV"
        self.of[index] = sliding
        self.owner[sliding] = index

    def live(self, full_pages: Sequence[int] | np.ndarray) -> np.ndarray:
        """The sliding pages of ``full_pages`` (-1 where gone)."""
        return self.of[np.asarray(full_pages, dtype=np.int64)]

    def incref(self, full_pages: Sequence[int] | np.ndarray, *, evictable: bool = False) -> None:
        """A holder's reference on the sliding KV of each of ``full_pages`` (all live)."""
        if len(full_pages):
            sliding = self.live(full_pages)
            if (sliding < 0).any():
                raise RuntimeError("a holder asked for sliding KV that is gone")
            self.allocator.incref(sliding, evictable=evictable)

    def decref(self, full_pages: Sequence[int] | np.ndarray) -> int:
        """Drop a holder's reference on the sliding KV of each of ``full_pages``."""
        if not len(full_pages):
            return 0
        return self.drop(self.live(full_pages))

    def drop(self, sliding: Sequence[int] | np.ndarray, *, evictable: bool = False) -> int:
        """Drop one reference per listed sliding page; those freed leave their full page."""
        sliding = np.asarray(sliding, dtype=np.int64)
        if not len(sliding):
            return 0
        freed = self.allocator.decref(sliding, evictable=evictable)
        if freed:
            gone = sliding[self.allocator.refcount[sliding] == 0]
            self.of[self.owner[gone]] = -1
            self.owner[gone] = -1
        return freed

    def step_tables(self, page_indices: np.ndarray, out_slots: np.ndarray,
                    copies: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A step's sliding page table, slots and copies from its full ones. A page whose
        sliding KV is gone reads as sliding page 0: it lies before every window of the step,
        where the kernels read nothing (the compiled kernel) or mask every key (the gathered
        path). Every written slot and copied page must be live."""
        page_size = self.page_size
        indices = np.maximum(self.of[page_indices.astype(np.int64)], 0).astype(np.int32)
        out_pages = self.of[out_slots.astype(np.int64) // page_size]
        if (out_pages < 0).any():
            raise RuntimeError("a step writes a page whose sliding KV is gone")
        slots = (out_pages * page_size + out_slots % page_size).astype(np.int32)
        swa_copies = copies.astype(np.int64).copy()
        if len(copies):
            swa_copies[:, :2] = self.of[swa_copies[:, :2]]
            if (swa_copies[:, :2] < 0).any():
                raise RuntimeError("a step copies a page whose sliding KV is gone")
        return indices, slots, swa_copies.astype(np.int32)

    def check(self, full: PageAllocator) -> None:
        """The two maps are each other's inverse over the pages in use, and a page with sliding
        KV is in use in the full pool."""
        used = np.flatnonzero(self.allocator.refcount > 0)
        assert (self.owner[used] >= 0).all(), "a sliding page in use has no full page"
        assert (self.of[self.owner[used]] == used).all(), "the sliding maps disagree"
        free = np.flatnonzero(self.allocator.refcount == 0)
        assert (self.owner[free] < 0).all(), "a free sliding page still has a full page"
        with_kv = np.flatnonzero(self.of >= 0)
        assert len(with_kv) == len(used), "full pages with sliding KV differ from those in use"
        assert (full.refcount[with_kv] > 0).all(), "a free full page still has sliding KV"
