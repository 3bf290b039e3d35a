"""Page allocator: fixed-size KV pages with refcounts and an O(1) free list.

Contract
--------
Every page has ``refcount`` = number of holders. Holders are radix-tree nodes and running
sequences; each holds one reference per page it lists, taken with ``incref``/``alloc`` and
dropped with ``decref``. A page goes back to the free list exactly when its count reaches 0.

Some references are *evictable*: those held by unlocked tree nodes. The allocator keeps, per
page, how many of its references are evictable, so it knows at any time how many pages evicting
every unlocked tree node would really free (``num_evictable_pages``): a page whose every
reference is evictable. A page shared by two nodes (a split inside a page), or by a node and a
sequence, is counted once, and only when no locked holder remains.

    free + evictable + pinned == num_pages        (pinned: locked nodes or running sequences)

Misuse is loud: taking a reference on a free page or dropping one below zero raises
``PageError`` at once.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

PageList = Sequence[int] | np.ndarray


class PageError(RuntimeError):
    """A refcount bug: use of a free page, or a reference dropped below zero."""


class OutOfPages(RuntimeError):
    """Not enough free pages for an allocation (after eviction, where the caller evicts)."""


class PageAllocator:
    """``num_pages`` pages of ``page_size`` token slots.

    Refcounts live in ``array('i')`` buffers exposed as numpy views (``refcount``,
    ``evictable_refs``): per-page updates on the hot path are plain Python indexing (a tree node or
    a decode step touches a handful of pages, where numpy's per-call overhead would dominate), while
    ``check`` and callers that scan all pages get vectorised numpy. ``pages`` arguments may repeat a
    page: each occurrence is one reference.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be at least 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._rc = array("i", bytes(4 * num_pages))
        self._er = array("i", bytes(4 * num_pages))
        self.refcount = np.frombuffer(self._rc, dtype=np.int32)
        self.evictable_refs = np.frombuffer(self._er, dtype=np.int32)
        # Free list as a stack whose top is the end: lowest pages come out first.
        self._free = list(range(num_pages - 1, -1, -1))
        self._num_evictable = 0

    # ----------------------------------------------------------------- counts
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_evictable_pages(self) -> int:
        return self._num_evictable

    @property
    def num_pinned_pages(self) -> int:
        return self.num_pages - len(self._free) - self._num_evictable

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` position-aligned tokens starting at position 0."""
        return -(-num_tokens // self.page_size)

    # ------------------------------------------------------------- references
    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free pages, each with refcount 1 (a non-evictable reference)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        free = self._free
        if n > len(free):
            raise OutOfPages(f"asked for {n} pages but only {len(free)} are free")
        if n == 0:
            return []
        pages = free[-n:]
        del free[-n:]
        pages.reverse()
        rc = self._rc
        for p in pages:
            rc[p] = 1
        return pages

    def incref(self, pages: PageList, *, evictable: bool = False) -> None:
        """Add one reference per listed page; the pages must be in use."""
        self._shift(pages, 1, 1 if evictable else 0)

    def decref(self, pages: PageList, *, evictable: bool = False) -> int:
        """Drop one reference per listed page; returns how many pages became free."""
        before = len(self._free)
        self._shift(pages, -1, -1 if evictable else 0)
        return len(self._free) - before

    def set_evictable(self, pages: PageList, evictable: bool) -> None:
        """Turn existing references of tree nodes into evictable ones (unlock) or back (lock).

        The tree's lock and unlock walk long paths on every admission, so this is a plain loop:
        each occurrence moves one reference, and the counts stay within range by construction
        (a node only flips references it holds); a violation is a tree bug and raises."""
        rc, er = self._rc, self._er
        step = 1 if evictable else -1
        delta = 0
        for p in pages:
            ref, before = rc[p], er[p]
            after = before + step
            if ref <= 0 or after < 0 or after > ref:
                raise PageError(f"page {p}: cannot move an evictable reference "
                                f"(refs {ref}, evictable {before})")
            er[p] = after
            delta += (after == ref) - (before == ref)
        self._num_evictable += delta

    # ------------------------------------------------------------- internals
    def _shift(self, pages: PageList, d_ref: int, d_evictable: int) -> None:
        # Validate every occurrence before writing anything, so a caught error loses nothing.
        if isinstance(pages, np.ndarray):
            pages = pages.tolist()
        rc, er = self._rc, self._er
        after: dict[int, list[int]] = {}
        for p in pages:
            counts = after.get(p)
            if counts is None:
                if rc[p] <= 0 and d_ref >= 0:
                    raise PageError(f"use of free page {p}")
                counts = after[p] = [rc[p], er[p]]
            counts[0] += d_ref
            counts[1] += d_evictable
            if counts[0] < 0 or counts[1] < 0 or counts[1] > counts[0]:
                raise PageError(f"reference on page {p} dropped below zero "
                                f"(refs {rc[p]}, evictable {er[p]})")
        delta = 0
        for p, (ref, ev) in after.items():
            delta += (ref == ev and ref > 0) - (rc[p] == er[p] and rc[p] > 0)
            rc[p] = ref
            er[p] = ev
            if ref == 0:
                self._free.append(p)
        self._num_evictable += delta

    # --------------------------------------------------------------- checking
    def check(self) -> None:
        """Assert the allocator's own bookkeeping (the tree checks holders on top of this)."""
        rc, er = self.refcount, self.evictable_refs
        assert (rc >= 0).all(), "negative refcount"
        assert (er >= 0).all() and (er <= rc).all(), "evictable refs out of range"
        free = np.asarray(self._free, dtype=np.int64)
        assert np.unique(free).size == free.size, "a page is on the free list twice"
        assert (rc[free] == 0).all(), "a page on the free list has references"
        assert np.count_nonzero(rc == 0) == free.size, "a page with no references is not free"
        evictable = int(np.count_nonzero((rc == er) & (rc > 0)))
        assert evictable == self._num_evictable, (
            f"evictable count drifted: counted {evictable}, tracked {self._num_evictable}"
        )
