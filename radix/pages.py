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

# Page lists at least this long take the vectorised path: below it numpy's per-call overhead
# costs more than a Python loop (a decode step or a page-16 node touches a few pages; at page
# size 1 a node or a sequence holds one page per token, hundreds of them).
VECTOR_MIN_PAGES = 32


class PageError(RuntimeError):
    """A refcount bug: use of a free page, or a reference dropped below zero."""


class OutOfPages(RuntimeError):
    """Not enough free pages for an allocation (after eviction, where the caller evicts)."""


class PageAllocator:
    """``num_pages`` pages of ``page_size`` token slots.

    Refcounts live in ``array('i')`` buffers exposed as numpy views (``refcount``,
    ``evictable_refs``): short page lists are updated by plain Python indexing (a decode step
    or a page-16 node touches a handful of pages, where numpy's per-call overhead would
    dominate), long ones (at page size 1, one page per token) by numpy over the same memory;
    ``check`` and callers that scan all pages are vectorised too. ``pages`` arguments may repeat
    a page: each occurrence is one reference.
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
        # Scratch for the vectorised path's duplicate check (see _shift_vectorised).
        self._mark = np.zeros(num_pages, dtype=np.intp)
        self._arange = np.arange(num_pages, dtype=np.intp)

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
        if n >= VECTOR_MIN_PAGES:
            self.refcount[pages] = 1
            return pages
        rc = self._rc
        for p in pages:
            rc[p] = 1
        return pages

    def incref(self, pages: PageList, *, evictable: bool = False) -> None:
        """Add one reference per listed page; the pages must be in use."""
        self._shift(pages, 1, 1 if evictable else 0)

    def decref(self, pages: PageList, *, evictable: bool = False, distinct: bool = False) -> int:
        """Drop one reference per listed page; returns how many pages became free.

        ``distinct``: the caller guarantees no page is listed twice (the tree's own page lists
        at page size 1), which spares the vectorised path its duplicate check."""
        before = len(self._free)
        self._shift(pages, -1, -1 if evictable else 0, distinct)
        return len(self._free) - before

    def set_evictable(self, pages: PageList, evictable: bool, *, distinct: bool = False) -> None:
        """Turn existing references of tree nodes into evictable ones (unlock) or back (lock).

        The tree's lock and unlock walk long paths on every admission, so this is a plain loop:
        each occurrence moves one reference, and the counts stay within range by construction
        (a node only flips references it holds); a violation is a tree bug and raises."""
        if len(pages) >= VECTOR_MIN_PAGES:
            self._shift_vectorised(pages, 0, 1 if evictable else -1, distinct)
            return
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
    def _shift(self, pages: PageList, d_ref: int, d_evictable: int,
               distinct: bool = False) -> None:
        # Validate every occurrence before writing anything, so a caught error loses nothing.
        if len(pages) >= VECTOR_MIN_PAGES:
            self._shift_vectorised(pages, d_ref, d_evictable, distinct)
            return
        if isinstance(pages, np.ndarray):
            pages = pages.tolist()
        if not distinct and len(set(pages)) != len(pages):
            self._shift_repeated(np.asarray(pages, dtype=np.intp), d_ref, d_evictable)
            return
        rc, er = self._rc, self._er
        for p in pages:
            ref, ev = rc[p] + d_ref, er[p] + d_evictable
            if (ref - d_ref <= 0 and d_ref >= 0) or ref < 0 or ev < 0 or ev > ref:
                index = np.asarray(pages, dtype=np.intp)
                self._raise_misuse(index, self.refcount[index], self.evictable_refs[index],
                                   d_ref, d_evictable)
        delta = 0
        for p in pages:
            ref, ev = rc[p], er[p]
            new_ref, new_ev = ref + d_ref, ev + d_evictable
            delta += (new_ref == new_ev and new_ref > 0) - (ref == ev and ref > 0)
            rc[p] = new_ref
            er[p] = new_ev
            if new_ref == 0:
                self._free.append(p)
        self._num_evictable += delta

    def _shift_vectorised(self, pages: PageList, d_ref: int, d_evictable: int,
                          distinct: bool = False) -> None:
        """``_shift`` over numpy, with the same checks before any write. Each (d_ref,
        d_evictable) the allocator uses moves one reference per page, so one comparison finds
        any misuse and one finds the pages whose every reference turns (or stops being)
        evictable; a list that repeats a page goes through ``_shift_repeated`` (unless the
        caller vouches for ``distinct``). An ``array('q')`` list is read without a copy."""
        index = np.asarray(pages, dtype=np.intp)
        if len(index) > self.num_pages:  # longer than the pool: it repeats a page
            self._shift_repeated(index, d_ref, d_evictable)
            return
        if not distinct:
            mark, arange = self._mark, self._arange[: len(index)]
            mark[index] = arange
            if (mark[index] != arange).any():
                self._shift_repeated(index, d_ref, d_evictable)
                return
        if d_ref < 0 and d_evictable < 0:  # a node's references dropped (eviction)
            self._drop_node_refs(index)
            return
        rc, er = self.refcount, self.evictable_refs
        ref, ev = rc[index], er[index]
        if d_ref > 0:  # incref: every page in use; evictable or not, no page changes state
            if (ref <= 0).any():
                self._raise_misuse(index, ref, ev, d_ref, d_evictable)
            changed = 0 if d_evictable else -int(np.count_nonzero(ref == ev))
        elif d_ref < 0:  # a sequence's references dropped
            if (ev >= ref).any():
                self._raise_misuse(index, ref, ev, d_ref, d_evictable)
            changed = int(np.count_nonzero((ev == ref - 1) & (ref > 1)))
        elif d_evictable > 0:  # unlock
            if (ev >= ref).any():
                self._raise_misuse(index, ref, ev, d_ref, d_evictable)
            changed = int(np.count_nonzero(ev == ref - 1))
        else:  # lock
            if (ev <= 0).any():
                self._raise_misuse(index, ref, ev, d_ref, d_evictable)
            changed = -int(np.count_nonzero(ref == ev))
        self._num_evictable += changed
        if d_ref:
            rc[index] = ref + d_ref
        if d_evictable:
            er[index] = ev + d_evictable
        if d_ref < 0:
            self._free.extend(index[ref == 1].tolist())

    def _drop_node_refs(self, index: np.ndarray) -> None:
        """Eviction's hot path: drop one evictable reference from each of ``index``'s distinct
        pages. With 0 < evictable <= refs, a page whose one reference goes was counted
        evictable and is freed; other pages keep their state."""
        rc, er = self.refcount, self.evictable_refs
        ref, ev = rc[index], er[index]
        if ev.min() <= 0:
            self._raise_misuse(index, ref, ev, -1, -1)
        ref -= 1
        ev -= 1
        rc[index] = ref
        er[index] = ev
        freed = index[ref == 0]
        self._num_evictable -= len(freed)
        self._free.extend(freed.tolist())

    def _shift_repeated(self, index: np.ndarray, d_ref: int, d_evictable: int) -> None:
        """``_shift_vectorised`` for a list that repeats pages: each occurrence is one move."""
        index, times = np.unique(index, return_counts=True)
        ref, ev = self.refcount[index], self.evictable_refs[index]
        new_ref, new_ev = ref + d_ref * times, ev + d_evictable * times
        if ((d_ref >= 0) & (ref <= 0)).any() or ((new_ref < 0) | (new_ev < 0)
                                                  | (new_ev > new_ref)).any():
            self._raise_misuse(index, ref, ev, d_ref, d_evictable, times)
        self._num_evictable += int(np.count_nonzero((new_ref == new_ev) & (new_ref > 0))) - int(
            np.count_nonzero((ref == ev) & (ref > 0)))
        self.refcount[index] = new_ref
        self.evictable_refs[index] = new_ev
        if d_ref < 0:
            self._free.extend(index[new_ref == 0].tolist())

    @staticmethod
    def _raise_misuse(index: np.ndarray, ref: np.ndarray, ev: np.ndarray, d_ref: int,
                      d_evictable: int, times: np.ndarray | int = 1) -> None:
        """The PageError the per-page loop would raise, for the first page that fails
        (``times``: how often each page is listed)."""
        times = np.broadcast_to(times, index.shape).tolist()
        for page, r, e, k in zip(index.tolist(), ref.tolist(), ev.tolist(), times, strict=True):
            if r <= 0 and d_ref >= 0:
                raise PageError(f"use of free page {page}")
            r_after, e_after = r + k * d_ref, e + k * d_evictable
            if r_after < 0 or e_after < 0 or e_after > r_after:
                if d_ref == 0:
                    raise PageError(f"page {page}: cannot move an evictable reference "
                                    f"(refs {r}, evictable {e})")
                raise PageError(f"reference on page {page} dropped below zero "
                                f"(refs {r}, evictable {e})")
        raise AssertionError("a misuse was detected but no page fails the per-page checks")

    # --------------------------------------------------------------- checking
    def check(self) -> None:
        """Assert the allocator's own bookkeeping (the tree checks holders on top of this)."""
        rc, er = self.refcount, self.evictable_refs
        assert (rc >= 0).all(), "negative refcount"
        assert (er >= 0).all() and (er <= rc).all(), "evictable refs out of range"
        free = np.asarray(self._free, dtype=np.int64)
        listed = np.zeros(self.num_pages, dtype=bool)  # a mark, not a sort: millions of pages
        listed[free] = True
        assert np.count_nonzero(listed) == free.size, "a page is on the free list twice"
        assert (rc[free] == 0).all(), "a page on the free list has references"
        assert np.count_nonzero(rc == 0) == free.size, "a page with no references is not free"
        evictable = int(np.count_nonzero((rc == er) & (rc > 0)))
        assert evictable == self._num_evictable, (
            f"evictable count drifted: counted {evictable}, tracked {self._num_evictable}"
        )
