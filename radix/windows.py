"""The radix tree's side of sliding-window layers (``RadixTree`` inherits ``Windows``): where a
match may end, which windows the tree keeps, and evicting them (radix/sliding.py has the pages).

A match of ``m`` tokens is usable only when the sliding KV of positions
``[m + 1 - W, m)`` is live (the first computed token, at ``m``, attends to them), so a match
ends at the last such point at or before where the tokens stop matching, token-granular::

    positions   0 ................................... e-W ...... e
    full KV     [ every page cached ................................ ]
    sliding KV  [ -1  -1  -1  -1  -1  -1  -1  -1  -1 ][ kept window  ]
    match       may end at e - 1 (a resend) or e (a next turn); nowhere before e - W + 1
                but at 0 (or inside a first window still live from position 0)

Nodes keep a window's pages where an insert asked for it (``keep``: the end of a prompt, of a
finished or preempted sequence). Their kept pages are evictable, least recently used first and
before any full page, unless a lock holds the node's windows (``Node.swa_lock``): a lease from
its match until it has taken its own references to what it reads (``acquire``), and a session
pin (which never does). A running sequence's lock on its own committed prompt holds its full
pages only: its window has moved on, and the window it kept for later goes first when sliding
pages run short, leaving the full KV cached (a later window may still make a longer match
through it).

Every method is private to the tree and its lease (radix/lease.py).
"""

from __future__ import annotations

import heapq
from array import array
from typing import TYPE_CHECKING

import numpy as np

from radix.node import HOST, page_array
from radix.pages import OutOfPages

if TYPE_CHECKING:
    from radix.host import HostTier
    from radix.node import Node
    from radix.pages import PageAllocator
    from radix.sliding import SlidingKV


def _keeps_sliding(node: Node) -> bool:
    """A candidate for sliding eviction: linked, its windows not held, keeping some page."""
    return (node.parent is not None and not node.evicted and not node.swa_lock
            and bool(node.swa_pages) and max(node.swa_pages) >= 0)


def usable_length(kept: array, length: int, page_size: int, window: int) -> int:
    """The longest match at most ``length`` tokens long whose last window is live, given the
    sliding page each page index of the path keeps (``kept``, -1: none)."""
    if length == 0:
        return 0
    live = np.flatnonzero(np.frombuffer(kept, dtype=np.int64) >= 0) if kept else np.empty(0)
    if not len(live):
        return 0
    breaks = np.flatnonzero(np.diff(live) != 1)
    starts = np.concatenate(([live[0]], live[breaks + 1]))
    ends = np.concatenate((live[breaks], [live[-1]]))
    # The longest match a run of live pages allows ends at its last page (or at ``length``),
    # and is usable when its window starts inside the run (or the run starts at page 0).
    lengths = np.minimum(length, (ends + 1) * page_size)
    usable = (starts == 0) | (np.maximum(lengths + 1 - window, 0) // page_size >= starts)
    good = np.flatnonzero(usable)
    return int(lengths[good[-1]]) if len(good) else 0


class Windows:
    """Sliding-window layers in the tree (see the module)."""

    sliding: SlidingKV | None

    def _sliding_limit(self, root: Node, query: bytes, limit: int) -> int:
        """How far a match of ``query`` (at most ``limit`` tokens) may reach."""
        kept = array("q")
        length = self._walk(root, query, limit, collect=False, split=False, swa=kept)[1]
        return usable_length(kept, length, self.page_size, self.sliding.window)

    def _keep_window(self, node: Node, end: int) -> None:
        """The path to ``node`` (ending at ``end``) keeps the live sliding KV of its pages from
        ``keep_from(end)`` on."""
        sliding, page_size = self.sliding, self.page_size
        first = sliding.keep_from(end)
        while node.parent is not None and (node.end - 1) // page_size >= first:
            lo = max(first - node.start // page_size, 0)
            have = np.frombuffer(node.swa_pages, dtype=np.int64)[lo:]
            live = sliding.live(node.pages[lo:])
            take = np.flatnonzero((have < 0) & (live >= 0))
            if len(take):
                sliding.allocator.incref(live[take], evictable=not node.swa_lock)
                for i in take.tolist():
                    node.swa_pages[lo + i] = int(live[i])
                self._push(self._swa_nodes, node)
                for listener in self.listeners:
                    listener.windows(node, lo + take, kept=True)
            node = node.parent

    def _swap_kept(self, node: Node, page: int) -> bool:
        """An insert gives ``node`` (a parent whose last page a new child shares) the child's
        ``page`` in place of its own: its kept window moves to that page's sliding KV, or, when
        that is gone, the node keeps its own page (True: the swap goes ahead)."""
        if self.sliding is None or not node.swa_pages or node.swa_pages[-1] < 0:
            return True
        moved = int(self.sliding.of[page])
        if moved < 0:
            return False
        evictable = not node.swa_lock
        self.sliding.allocator.incref([moved], evictable=evictable)
        self.sliding.drop([node.swa_pages[-1]], evictable=evictable)
        node.swa_pages[-1] = moved
        return True

    def _lock_windows(self, node: Node, step: int) -> None:
        """Hold (``step`` 1) or let go (-1) the windows of the path to ``node`` (locked)."""
        changed = array("q")
        while node.parent is not None:
            node.swa_lock += step
            if node.swa_lock < 0 or node.swa_lock > node.lock_ref:
                raise RuntimeError(f"window lock {node.swa_lock} of {node!r}")
            if node.swa_lock == (step > 0):  # 0 -> 1 or 1 -> 0
                changed += node.swa_pages
                if step < 0:
                    self._push(self._swa_nodes, node)
            node = node.parent
        index = np.frombuffer(changed, dtype=np.int64)
        if len(index):
            self.sliding.allocator.set_evictable(index[index >= 0], step < 0)

    def _alloc_sliding(self, n: int, windows: int | np.ndarray, spare: int = 0) -> list[int]:
        """``n`` full pages (free: ``_alloc_pages`` made sure), the last ``windows`` of them
        (or those at the positions ``windows`` lists) each with a fresh sliding page, evicting
        unlocked nodes' windows when sliding pages run short; ``spare`` more stay free."""
        sliding = self.sliding.allocator
        at = np.arange(n - windows, n) if isinstance(windows, int) else windows
        short = len(at) + spare - sliding.num_free_pages
        if short > 0:
            self._evict_sliding(short)
        if len(at) + spare > sliding.num_free_pages:
            raise OutOfPages(
                f"asked for {len(at) + spare} sliding-window pages: {sliding.num_free_pages} "
                f"free and nothing more evictable ({sliding.num_pinned_pages} held by running "
                f"requests)")
        pages = self.allocator.alloc(n)
        if len(at):
            self.sliding.attach(np.asarray(pages, dtype=np.int64)[at])
        return pages

    def _evict_sliding(self, num_pages: int) -> int:
        """Drop unlocked nodes' kept windows, least recently used first, until ``num_pages``
        sliding pages are free or none is left; their full KV stays cached. A node with a host
        copy first copies them into it (``_write_windows``); under ``write_back`` one without
        gets a host copy first (``_write_down``: its pages and these windows), as when the
        device evicts it, so a later match reads the windows back (``_load_device_windows``)."""
        freed = 0
        host = self.host
        while freed < num_pages and (node := self._pop_window()) is not None:
            if node.host_pages:
                self._write_windows(node)
            elif host is not None and host.write_back and host.swa is not None:
                self._write_down(node)  # (which copies its windows too, where there is room)
            freed += self._drop_kept(node, evictable=True)
        self.stats.sliding_evicted_pages += freed
        return freed

    def _pop_window(self) -> Node | None:
        """The node whose windows go next (``_pop`` over windows' holds, not path locks)."""
        heap = self._swa_nodes
        while heap.heap:
            key, _, node = heapq.heappop(heap.heap)
            if not heap.live(node):
                continue
            if key == node.eviction_key:
                return node
            self._push(heap, node)
        return None

    # ------------------------------------------------------- the host tier's windows
    @staticmethod
    def _kept_windows(node: Node) -> array:
        """Beside each page of ``node``, >= 0 where its window is kept: on the device, or in
        its host copy (a host-only node's, or a device node's whose window the sliding pool
        evicted: a lease loads it back, ``_load_device_windows``)."""
        if not node.pages or not node.host_swa_pages:
            return node.swa_pages if node.pages else node.host_swa_pages
        device = np.frombuffer(node.swa_pages, dtype=np.int64)
        return page_array(np.maximum(device, np.frombuffer(node.host_swa_pages,
                                                           dtype=np.int64)))

    def _device_window_loads(self, node: Node, reads: int,
                             loading: set[Node] | None = None) -> list[tuple[Node, np.ndarray]]:
        """The device nodes of the (matched) path to ``node`` whose windows a query at
        ``reads`` sees are kept only by their host copies: each with the positions in its
        pages of those windows (at each page index, the deepest node's, as ``_walk`` reads
        them). ``loading``: nodes another holder loads first, left out; these are added."""
        page_size = self.page_size
        first = self.sliding.window_start(reads)
        out = []
        limit = None  # the first page index a deeper node covers
        while node.parent is not None and (node.end - 1) // page_size >= first:
            lo = node.start // page_size
            hi = (node.end - 1) // page_size + 1 if limit is None else min(
                limit, (node.end - 1) // page_size + 1)
            limit = lo
            if (node.pages and node.host_swa_pages
                    and (loading is None or node not in loading)):
                index = np.arange(max(first, lo), hi) - lo
                device = np.frombuffer(node.swa_pages, dtype=np.int64)[index]
                host = np.frombuffer(node.host_swa_pages, dtype=np.int64)[index]
                index = index[(device < 0) & (host >= 0)]
                if len(index):
                    out.append((node, index))
                    if loading is not None:
                        loading.add(node)
            node = node.parent
        return out

    def _load_device_windows(self, loads: list[tuple[Node, np.ndarray]]) -> None:
        """The nodes (on a locked path) keep the windows ``_device_window_loads`` listed
        again: a page whose sliding KV is still live (a running holder's) as it is, the others
        from fresh sliding pages (``_alloc_pages(..., spare=...)`` left them free) into which
        their host copies are loaded."""
        sliding = self.sliding
        for node, index in loads:
            pages = np.frombuffer(node.pages, dtype=np.int64)[index]
            gone = sliding.live(pages) < 0
            if gone.any():
                sliding.attach(pages[gone])  # one reference each, the allocation's
                host = np.frombuffer(node.host_swa_pages, dtype=np.int64)[index[gone]]
                self.host.plan_window_loads(host.tolist(), sliding.live(pages[gone]).tolist())
            live = sliding.live(pages)
            sliding.allocator.incref(live, evictable=not node.swa_lock)
            sliding.drop(live[gone])  # the allocation's references go
            for i, page in zip(index.tolist(), live.tolist(), strict=True):
                node.swa_pages[i] = page
            self._push(self._swa_nodes, node)
            for listener in self.listeners:
                listener.windows(node, index, kept=True)
            self.stats.sliding_loaded_pages += int(gone.sum())

    def _host_windows_evictable(self, pages: array, evictable: bool) -> None:
        """The host copies of windows of nodes (un)locked: as their host pages."""
        index = np.frombuffer(pages, dtype=np.int64)
        if len(index) and self.host.swa is not None:
            self.host.swa.set_evictable(index[index >= 0], evictable)

    def _write_windows(self, node: Node) -> None:
        """``node`` (on the device, with a host copy) is about to leave the device or was just
        written down: its host copy takes the windows it keeps on the device and lacks, as far
        as the host tier has or can make room (dropping other nodes' host copies)."""
        host = self.host
        if not node.host_swa_pages:
            node.host_swa_pages = array("q", [-1]) * len(node.host_pages)
        if host.swa is None:
            return
        kept = np.frombuffer(node.swa_pages, dtype=np.int64)
        have = np.frombuffer(node.host_swa_pages, dtype=np.int64)
        index = np.flatnonzero((kept >= 0) & (have < 0))
        if not len(index) or not self._make_host_room(0, len(index), node):
            return
        pages = host.swa.alloc(len(index))
        if not node.lock_ref:
            host.swa.set_evictable(pages, True)
        host.plan_window_write_down(kept[index].tolist(), pages)
        for i, page in zip(index.tolist(), pages, strict=True):
            node.host_swa_pages[i] = page
        for listener in self.listeners:
            listener.windows(node, index, kept=True, tier=HOST)

    def _load_windows(self, path: list[Node], fresh: np.ndarray) -> None:
        """``_load`` of the host-only ``path`` into device pages ``fresh``, of which those of
        the window before the path's end (which the match reached through the host tier's
        copies: ``_pages_to_load(..., windows=True)`` of them, the last) have sliding pages
        (the allocation's references): that window is loaded into them and kept by the
        nodes; the allocation's references go."""
        sliding, page_size = self.sliding, self.page_size
        first = path[0].start // page_size
        sources = np.full(len(fresh), -1, dtype=np.int64)
        for n in path:  # top-down: the deeper node's copy of a shared index wins, as in _walk
            sources[n.start // page_size - first : (n.end - 1) // page_size - first + 1] = (
                np.frombuffer(n.host_swa_pages, dtype=np.int64))
        window = max(sliding.window_start(path[-1].end) - first, 0)
        if (sources[window:] < 0).any():
            raise RuntimeError("a match reached into the host tier past a window it lacks")
        device = np.full(len(fresh), -1, dtype=np.int64)
        device[window:] = sliding.live(fresh[window:])
        assert (device[window:] >= 0).all(), "a page of the loaded window has no sliding page"
        for n in path:
            lo, hi = n.start // page_size - first, (n.end - 1) // page_size - first + 1
            n.swa_pages = array("q", [-1]) * (hi - lo)
            index = np.arange(max(lo, window), hi) - lo
            if len(index):
                sliding.allocator.incref(device[lo + index], evictable=not n.swa_lock)
                for i in index.tolist():
                    n.swa_pages[i] = int(device[lo + i])
                self._push(self._swa_nodes, n)
                for listener in self.listeners:
                    listener.windows(n, index, kept=True)
        self.host.plan_window_loads(sources[window:].tolist(), device[window:].tolist())
        sliding.decref(fresh[window:])

    def _drop_host_windows(self, node: Node) -> None:
        """``node``'s host copy goes: so do its windows' host pages."""
        pages, node.host_swa_pages = node.host_swa_pages, array("q")
        index = np.frombuffer(pages, dtype=np.int64)
        if (index >= 0).any():
            for listener in self.listeners:
                listener.windows(node, np.flatnonzero(index >= 0), kept=False, tier=HOST)
        index = index[index >= 0]
        swa = self.host.swa
        if len(index) and swa.decref(index, evictable=not node.lock_ref):
            self.host.drop_window_write_downs(index[swa.refcount[index] == 0].tolist())

    def _drop_kept(self, node: Node, evictable: bool) -> int:
        """``node`` lets every window page it keeps go (evicted, or its window evicted)."""
        kept = np.frombuffer(node.swa_pages, dtype=np.int64)
        index = np.flatnonzero(kept >= 0)
        dropped = kept[index]
        node.swa_pages = array("q", [-1]) * len(node.swa_pages)
        if len(index):
            for listener in self.listeners:
                listener.windows(node, index, kept=False)
        return self.sliding.drop(dropped, evictable=evictable)


def check_sliding(nodes: list[Node], sliding: SlidingKV, full: PageAllocator,
                  external_refs: np.ndarray | None) -> None:
    """``RadixTree.check`` for the sliding pages: each node keeps, beside each of its full
    pages, nothing or that page's sliding KV; every sliding page's count is its keepers plus
    what holders hold (``external_refs``, by sliding page), unlocked keepers' references
    exactly its evictable ones."""
    from radix.accounting import _check_tier

    alloc = sliding.allocator
    kept = np.zeros(alloc.num_pages, dtype=np.int64)
    unlocked = np.zeros(alloc.num_pages, dtype=np.int64)
    for node in nodes:
        assert len(node.swa_pages) == len(node.pages), f"{node!r} keeps a misaligned window"
        swa = np.frombuffer(node.swa_pages, dtype=np.int64)
        mine = swa >= 0
        assert (sliding.live(node.pages)[mine] == swa[mine]).all(), (
            f"{node!r} keeps sliding pages that are not its pages' sliding KV")
        np.add.at(kept, swa[mine], 1)
        assert 0 <= node.swa_lock <= node.lock_ref, f"{node!r} holds windows it has not locked"
        if not node.swa_lock:
            np.add.at(unlocked, swa[mine], 1)
    _check_tier(alloc, kept, unlocked, external_refs)
    sliding.check(full)


def check_host_windows(nodes: list[Node], host: HostTier, sliding: SlidingKV,
                       device_refcount: np.ndarray) -> None:
    """``RadixTree.check`` for the host tier's windows: a node with a host copy lists a window
    page (or -1) beside each host page; every host sliding page's count is the nodes listing
    it, unlocked nodes' references exactly its evictable ones; planned moves name pages in
    use."""
    from radix.accounting import _check_tier

    size = host.swa.num_pages if host.swa is not None else 0
    refs, unlocked = np.zeros(size, dtype=np.int64), np.zeros(size, dtype=np.int64)
    for node in nodes:
        assert len(node.host_swa_pages) == len(node.host_pages), (
            f"{node!r} keeps a misaligned host window")
        swa = np.frombuffer(node.host_swa_pages, dtype=np.int64)
        swa = swa[swa >= 0]
        assert host.swa is not None or not len(swa), f"{node!r} has host windows, no pages"
        np.add.at(refs, swa, 1)
        if not node.lock_ref:
            np.add.at(unlocked, swa, 1)
    if host.swa is not None:
        _check_tier(host.swa, refs, unlocked, np.zeros_like(refs))
        host.check(device_refcount, sliding.allocator.refcount)
