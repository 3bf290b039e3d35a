"""The radix tree's tiers and eviction (``RadixTree`` inherits ``Tiering``): which unlocked
leaves go, copies down to the host tier and back, and unlinking. radix/tree.py's docstring
says what the tiers are; this is how the tree moves a node between them.

``Tiering`` holds no state of its own: it works on the attributes ``RadixTree.__init__`` sets
(``allocator``, ``host``, ``page_size``, ``stats``, ``listeners``, the two leaf heaps, the node
count). Every method is private to the tree and its lease (radix/lease.py).
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from radix.node import DEVICE, HOST, Node, page_array


@dataclass
class _LeafHeap:
    """Eviction candidates by key, with lazy invalidation: an entry is checked when popped.
    ``live``: whether a node is a candidate (locked or not)."""

    live: Callable[[Node], bool]
    heap: list[tuple[int, int, Node]] = field(default_factory=list)
    counter: itertools.count = field(default_factory=itertools.count)


def _device_leaf(node: Node) -> bool:
    """On the device with no child there (unlocked or not): the device's eviction candidate."""
    return (node.parent is not None and not node.evicted and bool(node.pages)
            and not any(child.pages for child in node.children.values()))


def _host_candidate(node: Node) -> bool:
    """What the host tier may drop: an unlocked node's host copy, if it is on the device too or
    has no children (a host-only node's children are host-only and need its KV)."""
    return (bool(node.host_pages) and not node.lock_ref and not node.evicted
            and node.parent is not None and (bool(node.pages) or not node.children))


class Tiering:
    """Eviction and the moves between the device and the host tier (see the module)."""

    def _pages_to_load(self, node: Node, loading: set[Node] | None = None,
                       windows: bool = False) -> int:
        """Device pages that loading the host-only end of the path to ``node`` takes, not
        counting the nodes in ``loading`` (others will load them first), to which it adds its
        own. ``windows``: of them, those that take sliding pages (the window before the path's
        end, radix/windows.py ``_load_windows``)."""
        top = None
        deepest = node
        while not node.on_device and (loading is None or node not in loading):
            if loading is not None:
                loading.add(node)
            top, node = node, node.parent
        if top is None:
            return 0
        first = top.start // self.page_size
        if windows:
            first = max(first, self.sliding.window_start(deepest.end))
        return (deepest.end - 1) // self.page_size - first + 1

    def _load(self, node: Node, fresh: list[int]) -> array:
        """Give the host-only nodes of the (locked) path to ``node`` the device pages
        ``fresh`` (``_pages_to_load(node)`` of them, one reference each, which pass to the
        nodes) and plan their loads; they keep their host copies. Returns the path's device
        pages. Where two nodes cover one page index, the deeper one's host page is loaded: it
        holds the shallower one's slots of that page too."""
        path, sources = self._host_sources(node)
        if not path:
            return self._path_pages(node)
        page_size, first = self.page_size, path[0].start // self.page_size
        device = np.asarray(fresh, dtype=np.int64)
        held = array("q")
        for n in path:
            lo, hi = n.start // page_size - first, (n.end - 1) // page_size - first + 1
            n.pages = page_array(device[lo:hi])
            held += n.pages
            self._moved(n, DEVICE, stored=True)
        self.allocator.incref(held)  # the nodes' references (locked: not evictable) ...
        self.allocator.decref(fresh)  # ... replace the allocation's
        if self.sliding is not None:
            self._load_windows(path, device)  # (the last of ``fresh`` have sliding pages)
        self.host.plan_loads(sources.tolist(), fresh)
        self.stats.pages_loaded += len(fresh)
        return self._path_pages(path[-1])

    def _host_sources(self, node: Node) -> tuple[list[Node], np.ndarray]:
        """The host-only nodes of the path to ``node``, top-down, and the host page of each of
        their page indices in order (where two nodes cover one index, the deeper one's: it
        holds the shallower one's slots of that page too)."""
        page_size = self.page_size
        path = []
        while not node.on_device:
            path.append(node)
            node = node.parent
        path.reverse()
        if not path:
            return path, np.empty(0, dtype=np.int64)
        first = path[0].start // page_size
        sources = np.empty((path[-1].end - 1) // page_size - first + 1, dtype=np.int64)
        for n in path:  # top-down: a deeper node's page overwrites a shared index
            lo, hi = n.start // page_size - first, (n.end - 1) // page_size - first + 1
            sources[lo:hi] = n.host_pages
        return path, sources

    def _path_pages(self, node: Node) -> array:
        """The device pages of the path to ``node`` (all on the device), the deepest node's
        page at each index."""
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        pages = array("q")
        for n in reversed(path):
            del pages[n.start // self.page_size :]
            pages += n.pages
        return pages

    # ------------------------------------------------------------------ tiers
    def _device_end(self, node: Node) -> int:
        """Where the device part of the path to ``node`` ends (its tokens are on the device)."""
        while not node.on_device:
            node = node.parent
        return node.end

    def _adopt(self, node: Node, table: Sequence[int] | np.ndarray) -> None:
        """An insert crosses the host-only nodes of the path to ``node``: they take references
        on the inserting holder's device pages (``table``, from position 0), which hold the
        same KV, and live on both tiers."""
        page_size = self.page_size
        deepest = node
        while not node.on_device:
            pages = page_array(table[node.start // page_size : (node.end - 1) // page_size + 1])
            self.allocator.incref(pages, evictable=node.lock_ref == 0)
            node.pages = pages
            if self.sliding is not None:
                node.swa_pages = array("q", [-1]) * len(pages)
            self._moved(node, DEVICE, stored=True)
            self._push(self._host_leaves, node)
            node = node.parent
        self._push(self._leaves, deepest)

    def _write_hot(self, node: Node) -> None:
        """write_through_selective: copy down the nodes of the path to ``node`` that have been
        matched often enough and have no host copy yet."""
        hits = self.host.selective_hits
        while node.parent is not None:
            if node.pages and not node.host_pages and node.hits >= hits:
                self._write_down(node)
            node = node.parent

    def _evict(self, num_pages: int, keep: bool) -> int:
        """``evict``; ``keep``: copy a leaf with no host copy down before it leaves the device
        (when the host tier has or can make room)."""
        freed = 0
        while freed < num_pages:
            pages = array("q")
            want = num_pages - freed
            while len(pages) < want and (node := self._pop(self._leaves)) is not None:
                pages += node.pages
                parent = node.parent
                if node.host_pages and node.swa_pages:
                    self._write_windows(node)  # its host copy takes its windows first
                stored = bool(node.host_pages) or (keep and self._write_down(node))
                if node.swa_pages:
                    self._drop_kept(node, evictable=True)  # its windows go first
                if stored:
                    self._moved(node, DEVICE, stored=False)
                    node.pages = array("q")
                    if node.swa_pages:
                        node.swa_pages = array("q")
                    self._push(self._host_leaves, node)
                else:
                    self._unlink(node)
                # Its parent may become a device leaf itself.
                if not parent.lock_ref:
                    self._push(self._leaves, parent)
            if not pages:
                break
            freed += self.allocator.decref(pages, evictable=True, distinct=self._distinct_paths)
        self.stats.evicted_pages += freed
        return freed

    def _write_down(self, node: Node) -> bool:
        """Give ``node`` (on the device, no host copy) host pages and plan the copies into
        them, making room in the host tier if needed. False when it has none to give."""
        host = self.host
        count = len(node.pages)
        if count > host.allocator.num_free_pages and not self._make_host_room(count):
            return False
        pages = host.allocator.alloc(count)
        if not node.lock_ref:
            host.allocator.set_evictable(pages, True, distinct=True)
        host.plan_write_down(node.pages, pages)
        node.host_pages = page_array(pages)
        if self.sliding is not None:
            self._write_windows(node)
        self.stats.pages_written += count
        self._moved(node, HOST, stored=True)
        self._push(self._host_leaves, node)
        return True

    def _make_host_room(self, num_pages: int, num_windows: int = 0,
                        spare: Node | None = None) -> bool:
        """Drop host copies, least recently used first, until ``num_pages`` host pages (and
        ``num_windows`` of the windows' host pages) are free; False if the host tier runs out
        of candidates first. ``spare``: a node whose host copy stays (it is being written)."""
        alloc, swa = self.host.allocator, self.host.swa
        aside = []
        try:
            while alloc.num_free_pages < num_pages or (
                    num_windows and swa.num_free_pages < num_windows):
                node = self._pop(self._host_leaves)
                if node is None:
                    return False
                if node is spare:
                    aside.append(node)
                    continue
                self._drop_host_node(node)
        finally:
            for node in aside:
                self._push(self._host_leaves, node)
        return True

    def _drop_host_node(self, node: Node) -> None:
        """The host tier lets ``node`` go: its host copy, or the node where it has no other."""
        parent = node.parent
        if node.pages:
            self._moved(node, HOST, stored=False)
            self._drop_host_copy(node)  # it stays on the device
        else:
            self._unlink(node)
            self._push(self._host_leaves, parent)

    def _drop_host_copy(self, node: Node) -> None:
        host = self.host
        pages, node.host_pages = node.host_pages, array("q")
        if node.host_swa_pages:
            self._drop_host_windows(node)
        if host.allocator.decref(pages, evictable=not node.lock_ref) and host.has_moves:
            index = np.frombuffer(pages, dtype=np.int64)
            host.drop_write_downs(index[host.allocator.refcount[index] == 0].tolist())

    def _moved(self, node: Node, tier: str, stored: bool) -> None:
        for listener in self.listeners:
            listener.moved(node, tier, stored)

    def _unlink(self, node: Node) -> None:
        """Take ``node`` (unlocked) out of the tree with the host-only nodes below it, dropping
        their host copies; the caller drops ``node``'s device pages. Each is a leaf when its
        listeners hear of it."""
        order, stack = [], [node]
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        listeners = self.listeners
        for n in reversed(order):  # children before their parents
            del n.parent.children[n.key[:4]]
            n.evicted = True
            for listener in listeners:  # its page lists still say which tiers it leaves
                listener.evicted(n)
            if n.host_pages:
                self._drop_host_copy(n)
        self._num_nodes -= len(order)

    def _push(self, leaves: _LeafHeap, node: Node) -> None:
        """Queue ``node`` in ``leaves`` if it is a candidate there."""
        if not leaves.live(node):
            return
        heapq.heappush(leaves.heap, (node.eviction_key, next(leaves.counter), node))
        if len(leaves.heap) > 4 * self._num_nodes + 64:
            # Lazy invalidation leaves stale entries behind; rebuild before they dominate, one
            # entry per candidate at its current key.
            seen: set[int] = set()
            kept = []
            for _, order, n in leaves.heap:
                if id(n) not in seen and leaves.live(n):
                    seen.add(id(n))
                    kept.append((n.eviction_key, order, n))
            heapq.heapify(kept)
            leaves.heap = kept

    def _pop(self, leaves: _LeafHeap) -> Node | None:
        """The unlocked candidate of ``leaves`` with the smallest key; None when none is left.
        Entries of nodes that stopped being candidates are dropped, those of nodes touched since
        they were queued requeued at their real key."""
        while leaves.heap:
            key, _, node = heapq.heappop(leaves.heap)
            if node.lock_ref or not leaves.live(node):
                continue
            if key == node.eviction_key:
                return node
            self._push(leaves, node)
        return None
