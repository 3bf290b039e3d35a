"""The one way to drive the tree: a lease is a holder's use of its longest cached prefix.

Every user of the tree (the scheduler, the profiler's replay, the tests' simulator) goes
through these steps, in this order::

    lease = Lease(tree, tokens, namespace, max_len)  # match the longest prefix and lock it
    table, copy = lease.acquire(num_tokens)          # share its full pages, allocate the rest;
                                                     # a match ending inside a page plans the
                                                     # copy of that page's matched slots
    ... run ``copy`` (if any), then drop its source reference ...
    ... compute KV for positions [lease.length, n) into ``table`` ...
    lease.commit(table, tokens[:n])                  # mid-life (a prefilled chunk): cache what
                                                     # is computed, move the lock onto it
    copy = lease.grow(table, more_tokens)            # more pages for decoding (and a fork's
                                                     # own copy of the page it shares)
    child, child_table = lease.fork(table)           # another holder of the same prefix
    lease.release(table, tokens)                     # insert, unlock, drop the table's references

Who holds what::

    positions  0 ...... length ........... committed ............ len(table) * P
    tree       [ matched | committed chunks ]                       (locked while the lease is)
    table      [ a reference of the holder's own on every page ......................... ]

A match may reach into the host tier (radix/host.py): ``acquire`` then loads that part into
fresh device pages, and the host tier holds the planned loads until the holder's next step
carries them (``HostTier.take_moves``), with the write-downs that evictions planned.

**Matched pages are valid only while the match is locked,** and ``acquire`` reads them again:
``lease.match.pages`` may be evicted and reused once the lease is unlocked (``acquire`` refuses
to run on an unlocked lease), and an insert extending the matched node from inside its last
page swaps that page for the inserter's copy of it.
The table holds its own references (one per page), so it stays valid after ``unlock``: a holder
that lets its lock go early (a sequence swapped out to host) keeps what it shares, and may
still grow, commit and release. A copy's source page carries one more reference, the holder's,
until the copy has run (``allocator.decref([copy.src])``): a freed source could be reused
before the copy reads it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from radix.node import Node, PrefixMatch
    from radix.tree import RadixTree, TokenIds


class PageCopy(NamedTuple):
    """Copy the first ``num_slots`` slots of page ``src`` into page ``dst`` before writing it
    (a tuple, as the step message carries it)."""

    src: int
    dst: int
    num_slots: int


class Lease:
    """A locked path in ``tree``, and the steps that turn it into a page table and back.

    ``match`` is what the cache held when the lease began (``length`` tokens of it); the lock
    sits on ``match.node`` until ``commit`` moves it onto a longer path the holder cached."""

    __slots__ = ("tree", "match", "namespace", "_node", "_locked", "swa_from", "_windows")

    def __init__(self, tree: RadixTree, tokens: TokenIds, namespace: Hashable = None,
                 max_len: int | None = None, *, count: bool = True) -> None:
        """Match the longest cached prefix of ``tokens`` (at most ``max_len``) and lock it.
        ``count=False`` keeps the lookup out of the hit-rate stats (a session pin, not a
        request)."""
        self.tree = tree
        self.namespace = namespace
        self.match: PrefixMatch = tree._match_prefix(tokens, namespace, max_len, count=count)
        self._node: Node = self.match.node
        tree._lock(self._node)
        self._locked = True
        # With sliding-window layers: the first page of the table on which this holder holds
        # the sliding KV (``acquire``, ``slide``); whether its lock holds the path's windows
        # too (until it has its own references to what it reads: radix/windows.py)
        self.swa_from = 0
        self._windows = tree.sliding is not None
        if self._windows:
            tree._lock_windows(self._node, 1)

    @property
    def length(self) -> int:
        """Tokens of the prefix found in the cache."""
        return self.match.length

    @property
    def locked(self) -> bool:
        return self._locked

    def pages_to_acquire(self, num_tokens: int, loading: set[Node] | None = None, *,
                         windows: bool = False, reads_from: int | None = None) -> int:
        """Fresh pages ``acquire(num_tokens)`` allocates: the match's full pages are shared,
        and its part in the host tier takes device pages to load into. ``loading``: host-only
        nodes that holders acquiring before this one will load (samples of one request share
        their prompt's); this one's are added to it. ``windows``: of them, those that take
        sliding pages (of the loaded part, only the window before the match's end; of the
        rest, those from the window of ``reads_from`` on, as ``acquire``), and the sliding
        pages that the windows of the match's device part kept only in the host tier take
        (``acquire`` loads them back; their nodes join ``loading`` too)."""
        tree = self.tree
        first = self.match.length // tree.page_size
        if windows and reads_from is not None:
            first = max(first, tree.sliding.window_start(reads_from))
        count = (tree.allocator.pages_for(num_tokens) - first
                 + tree._pages_to_load(self.match.node, loading, windows))
        if tree.sliding is not None and tree.host is not None:
            reads = self.match.length if reads_from is None else reads_from
            device = tree._device_window_loads(self.match.node, reads, loading)
            if windows:
                count += sum(len(index) for _, index in device)
        return count

    def acquire(self, num_tokens: int, *,
                reads_from: int | None = None) -> tuple[list[int], PageCopy | None]:
        """A page table for positions ``[0, num_tokens)``: the match's full pages (a new reference
        each), then fresh pages, evicting unlocked leaves when short. A match that reaches into
        the host tier first gets device pages for that part, whose loads the host tier plans
        (they run before the copy below); its nodes then live on the device too. When the match
        ends inside a page, the first fresh page is to receive that page's matched slots: the
        returned copy, whose source holds one more reference for the holder. Windows of the
        match's device part that only the host tier kept (the sliding pool evicted them) are
        loaded into fresh sliding pages, and their nodes keep them again. ``reads_from``:
        the holder's first query is there, not at the match's end (a disk load fills the
        fresh pages up to it): with sliding-window layers, only the fresh pages of that
        query's window take sliding pages, and the holder holds the sliding KV from that
        window on. Raises ``OutOfPages`` having changed nothing."""
        self._check_acquire(num_tokens)
        tree = self.tree
        loads = tree._pages_to_load(self.match.node)
        reads = self.match.length if reads_from is None else reads_from
        windows = None
        if tree.sliding is not None and (loads or reads > self.match.length):
            if reads > self.match.length and self.match.partial_len:
                raise ValueError("a holder that reads past its match starts at a page's start")
            # the loaded window's pages (the last of the loads), then the fresh pages of the
            # first query's window
            total = self.pages_to_acquire(num_tokens)
            skip = max(tree.sliding.window_start(reads) - self.match.length // tree.page_size, 0)
            host = tree._pages_to_load(self.match.node, windows=True)
            windows = np.concatenate((np.arange(loads - host, loads),
                                      np.arange(loads + skip, total)))
        device_windows = (tree._device_window_loads(self.match.node, reads)
                          if tree.sliding is not None and tree.host is not None else [])
        fresh = tree._alloc_pages(self.pages_to_acquire(num_tokens), windows,
                                  sum(len(index) for _, index in device_windows))
        if device_windows:
            tree._load_device_windows(device_windows)
        if self.match.host_length:
            # What another holder loaded since this one matched is on the device already.
            self.match.pages = tree._load(self.match.node, fresh[:loads])
            del fresh[:loads]
        elif self.match.partial_len:
            # An insert that extended the matched node since may have given it the inserter's
            # copy of its last page and freed the one matched: read the page it holds now.
            self.match.pages[-1] = self.match.node.pages[-1]
        full = self.match.full_pages
        alloc = tree.allocator
        alloc.incref(full)
        copy = None
        if self.match.partial_len:
            copy = PageCopy(self.match.partial_page, fresh[0], self.match.partial_len)
            alloc.incref([copy.src])
        if tree.sliding is not None:
            # The matched pages the holder's first query sees, and the copy's source, are
            # live (the match ended where they are, and the lock keeps them).
            self.swa_from = tree.sliding.window_start(reads)
            tree.sliding.incref(full[self.swa_from :])
            if copy is not None:
                tree.sliding.incref([copy.src])
            self._let_windows_go()
        return full.tolist() + fresh, copy

    def acquire_unloaded(self, num_tokens: int) -> tuple[list[int], list[tuple[int, int]]] | None:
        """``acquire`` for a match that reaches into the host tier, leaving the tree as it is:
        the match's device pages are shared (a new reference each) and fresh pages take every
        position after them; the returned (host page, device page) pairs are the copies that
        give the first fresh pages the host part's KV. The holder runs them (the worker's
        loader thread) and reads nothing past the device part before they have run; the lock
        keeps their host pages. Then ``commit`` of the matched tokens caches them: the host-only
        nodes take the holder's device pages (an insert crossing them does). A match ending
        inside a page needs no copy-on-write here: that page is one of the holder's own.
        None when no part of the match is in the host tier only any more (another holder
        loaded it since this one matched), or with sliding-window layers (a load gives the
        host-only nodes their windows back): ``acquire`` then. Raises ``OutOfPages`` having
        changed nothing."""
        self._check_acquire(num_tokens)
        tree = self.tree
        path, sources = tree._host_sources(self.match.node)
        if not path or tree.sliding is not None:
            return None
        # the device part's pages now (another holder may have loaded the top of the host
        # part since this one matched), up to the first host-only node's first page index
        device = tree._path_pages(path[0].parent)[: path[0].start // tree.page_size]
        fresh = tree._alloc_pages(tree.allocator.pages_for(num_tokens) - len(device))
        tree.allocator.incref(device)
        tree.stats.pages_loaded += len(sources)
        return device.tolist() + fresh, list(zip(sources.tolist(), fresh[: len(sources)],
                                                  strict=False))

    def _check_acquire(self, num_tokens: int) -> None:
        if not self._locked:
            raise RuntimeError("acquire on an unlocked lease: its matched pages may be gone")
        if num_tokens < self.match.length:
            raise ValueError(f"a table for {num_tokens} tokens cannot hold the "
                             f"{self.match.length}-token match")

    def alloc_pages(self, num_pages: int, windows: int | None = None) -> list[int]:
        """``num_pages`` fresh pages for the holder's table (a swap-in's), one reference each,
        evicting unlocked leaves when short; with sliding-window layers, the last ``windows``
        of them (all by default) with sliding pages. Raises ``OutOfPages`` having changed
        nothing."""
        return self.tree._alloc_pages(num_pages, windows)

    def grow(self, table: list[int], num_tokens: int, *,
             unshare_at: int | None = None) -> PageCopy | None:
        """Extend ``table`` (in place) with fresh pages to cover ``[0, num_tokens)``.

        ``unshare_at=pos``: the page holding position ``pos`` is one the holder shares with a
        fork and must not write: it is first replaced by a fresh page, which the returned copy
        fills with its first ``pos % page_size`` slots; the holder's reference on the shared
        page becomes the copy source's. Raises ``OutOfPages`` having changed nothing."""
        need = max(self.tree.allocator.pages_for(num_tokens) - len(table), 0)
        need += unshare_at is not None
        if need == 0:
            return None
        fresh = self.tree._alloc_pages(need)
        copy = None
        if unshare_at is not None:
            last = unshare_at // self.tree.page_size
            copy = PageCopy(table[last], fresh.pop(0), unshare_at % self.tree.page_size)
            table[last] = copy.dst
        table.extend(fresh)
        return copy

    def slide(self, table: Sequence[int], position: int, retain_end: int | None = None) -> None:
        """Sliding-window layers: the holder's next query is at ``position``, so it lets go of
        the sliding KV of its pages before that query's window; with ``retain_end``, not of
        the window a cache keeps where ``retain_end`` tokens end (a prompt not yet committed
        to its end). Only ever moves forward."""
        sliding = self.tree.sliding
        start = sliding.window_start(position)
        if retain_end is not None:
            start = min(start, sliding.keep_from(retain_end))
        if start > self.swa_from:
            sliding.decref(table[self.swa_from : start])
            self.swa_from = start

    def commit(self, table: Sequence[int] | np.ndarray, tokens: TokenIds, *,
               keep: bool = False) -> int:
        """Cache ``tokens`` mid-life (a prefilled chunk): their KV sits in ``table`` from
        position 0, and they begin with the tokens this lease matched. A locked lease then moves
        its lock onto the longer path (locking it before letting the shorter one go), so what it
        committed stays cached for others to hit until it is released. The table keeps its
        references. ``keep``: the tree keeps the sliding-window layers' last window of
        ``tokens`` (a whole prompt's). Returns how many of ``tokens`` were cached already."""
        cached, node = self.tree._insert(tokens, table, self.namespace, keep=keep)
        if self._locked and node.end > self._node.end:
            self.tree._lock(node)
            self._let_windows_go()
            self.tree._unlock(self._node)
            self._node = node
        return cached

    def fork(self, table: Sequence[int]) -> tuple[Lease, list[int]]:
        """Another holder of the same prefix (a parallel sample, a beam): a lease on the same
        path (locked if this one is, so either may release first) and a copy of ``table`` with
        a reference of its own on each page. A partial last page stays shared: the fork takes its
        own copy before writing into it (``grow(..., unshare_at=...)``), while this holder
        writes only past the slots they share."""
        child = Lease.__new__(Lease)
        child.tree, child.match, child.namespace = self.tree, self.match, self.namespace
        child._node, child._locked = self._node, self._locked
        child.swa_from, child._windows = self.swa_from, self._windows
        if self._locked:
            self.tree._lock(self._node)
            if self._windows:
                self.tree._lock_windows(self._node, 1)
        child_table = list(table)
        self.tree.allocator.incref(child_table)
        if self.tree.sliding is not None:
            self.tree.sliding.incref(child_table[self.swa_from :])
        return child, child_table

    def unlock(self) -> None:
        """Let the locked path be evicted again (idempotent). The table stays valid."""
        if self._locked:
            self._let_windows_go()
            self.tree._unlock(self._node)
            self._locked = False

    def _let_windows_go(self) -> None:
        """The path's windows may be evicted again: this holder has its own references to what
        it reads, or lets the path go."""
        if self._windows:
            self.tree._lock_windows(self._node, -1)
            self._windows = False

    def release(self, table: Sequence[int] | np.ndarray,
                tokens: TokenIds | None = None) -> int:
        """End the lease: with ``tokens``, first cache them (their KV sits in ``table``, from
        position 0, and the sliding-window layers' last window of them stays where it is
        live); then unlock and drop the table's references. Returns how many of ``tokens``
        were cached already."""
        cached = 0
        if tokens is not None and len(tokens):
            cached, _ = self.tree._insert(tokens, table, self.namespace, keep=True)
        self.unlock()
        if self.tree.sliding is not None:
            self.tree.sliding.decref(table[self.swa_from :])
        self.tree.allocator.decref(table)
        return cached
