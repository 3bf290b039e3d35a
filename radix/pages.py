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

from collections.abc import Sequence

import numpy as np

PageList = Sequence[int] | np.ndarray


class PageError(RuntimeError):
    """A refcount bug: use of a free page, or a reference dropped below zero."""


class OutOfPages(RuntimeError):
    """Not enough free pages for an allocation (after eviction, where the caller evicts)."""


def _as_index(pages: PageList) -> np.ndarray:
    return np.asarray(pages, dtype=np.int64)


class PageAllocator:
    """``num_pages`` pages of ``page_size`` token slots; refcounts in numpy arrays.

    ``pages`` arguments may repeat a page (each occurrence is one reference).
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be at least 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.refcount = np.zeros(num_pages, dtype=np.int32)
        self.evictable_refs = np.zeros(num_pages, dtype=np.int32)
        # Free list as a stack: the top is free_stack[num_free - 1]. Lowest pages come out first.
        self._free_stack = np.arange(num_pages - 1, -1, -1, dtype=np.int32)
        self._num_free = num_pages
        self._num_evictable = 0

    # ----------------------------------------------------------------- counts
    @property
    def num_free_pages(self) -> int:
        return self._num_free

    @property
    def num_evictable_pages(self) -> int:
        return self._num_evictable

    @property
    def num_pinned_pages(self) -> int:
        return self.num_pages - self._num_free - self._num_evictable

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` position-aligned tokens starting at position 0."""
        return -(-num_tokens // self.page_size)

    # ------------------------------------------------------------- references
    def alloc(self, n: int) -> np.ndarray:
        """Take ``n`` free pages, each with refcount 1 (a non-evictable reference)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self._num_free:
            raise OutOfPages(f"asked for {n} pages but only {self._num_free} are free")
        top = self._num_free
        pages = self._free_stack[top - n : top][::-1].copy()
        self._num_free = top - n
        self.refcount[pages] = 1
        return pages

    def incref(self, pages: PageList, *, evictable: bool = False) -> None:
        """Add one reference per listed page; the pages must be in use."""
        idx = _as_index(pages)
        if idx.size == 0:
            return
        if (self.refcount[idx] <= 0).any():
            bad = idx[self.refcount[idx] <= 0].tolist()
            raise PageError(f"incref of free page(s) {bad}")
        self._shift(idx, 1, 1 if evictable else 0)

    def decref(self, pages: PageList, *, evictable: bool = False) -> int:
        """Drop one reference per listed page; returns how many pages became free."""
        idx = _as_index(pages)
        if idx.size == 0:
            return 0
        self._shift(idx, -1, -1 if evictable else 0)
        return self._release_zeroed(idx)

    def set_evictable(self, pages: PageList, evictable: bool) -> None:
        """Turn existing references of a tree node into evictable ones (unlock) or back (lock)."""
        idx = _as_index(pages)
        if idx.size:
            self._shift(idx, 0, 1 if evictable else -1)

    # ------------------------------------------------------------- internals
    def _shift(self, idx: np.ndarray, d_ref: int, d_evictable: int) -> None:
        rc, er = self.refcount, self.evictable_refs
        if idx.size > 1:
            uniq, counts = np.unique(idx, return_counts=True)
        else:
            uniq, counts = idx, 1
        before = np.count_nonzero((rc[uniq] == er[uniq]) & (rc[uniq] > 0))
        if d_ref:
            new_rc = rc[uniq] + d_ref * counts
            if (new_rc < 0).any():
                bad = uniq[new_rc < 0].tolist()
                raise PageError(f"decref below zero on page(s) {bad}")
            rc[uniq] = new_rc
        if d_evictable:
            new_er = er[uniq] + d_evictable * counts
            if (new_er < 0).any() or (new_er > rc[uniq]).any():
                raise PageError(f"evictable reference count out of range on pages {uniq.tolist()}")
            er[uniq] = new_er
        after = np.count_nonzero((rc[uniq] == er[uniq]) & (rc[uniq] > 0))
        self._num_evictable += int(after - before)

    def _release_zeroed(self, idx: np.ndarray) -> int:
        zeroed = np.unique(idx[self.refcount[idx] == 0])
        n = zeroed.size
        if n:
            self._free_stack[self._num_free : self._num_free + n] = zeroed
            self._num_free += n
        return n

    # --------------------------------------------------------------- checking
    def check(self) -> None:
        """Assert the allocator's own bookkeeping (the tree checks holders on top of this)."""
        rc, er = self.refcount, self.evictable_refs
        assert (rc >= 0).all(), "negative refcount"
        assert (er >= 0).all() and (er <= rc).all(), "evictable refs out of range"
        free = self._free_stack[: self._num_free]
        assert np.unique(free).size == free.size, "a page is on the free list twice"
        assert (rc[free] == 0).all(), "a page on the free list has references"
        assert np.count_nonzero(rc == 0) == self._num_free, "a page with no references is not free"
        evictable = int(np.count_nonzero((rc == er) & (rc > 0)))
        assert evictable == self._num_evictable, (
            f"evictable count drifted: counted {evictable}, tracked {self._num_evictable}"
        )
