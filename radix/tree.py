"""Radix tree over token ids whose nodes hold refcounted KV pages.

A node holds a run of tokens at absolute positions ``[start, end)`` and the pages that cover it:
page indices ``start // P .. (end - 1) // P``. Splitting a node inside a page leaves that page
in both halves (each half holds its own reference). Where a child starts inside a page, its
first page is its own copy of that page (it holds the parent's slots too), so the page of index
``k`` on a path is always taken from the deepest node that covers ``k``::

    positions   0 ............ 16 .......... 32 ..... 40 | 41 ..... 50
    parent      [ page 7      ][ page 3     ][ page 9 .. )              (tokens 0..40)
    child                                   [ page 12 ..............)   (tokens 41..50,
                                                                         page 12 = copy of 9's
                                                                         slots 32..40 + its own)

References: every node holds one reference per page it lists (taken at insert or split,
dropped at eviction). Running sequences hold their own references to their page tables, so
inserting a duplicate prefix never invalidates a sequence's pages. ``_lock`` pins a matched path
(each node on it counts lockers); locked nodes are never evicted, and their page references
stop counting as evictable. Unlocked leaves are evicted smallest ``eviction_key`` first
(radix/eviction.py: LRU by default), through a heap with lazy invalidation (no scan over all
leaves per eviction).

Tiers: with a host tier (``host``, radix/host.py) a node's KV lives on the device
(``node.pages``), in host memory (``node.host_pages``) or both, and a node on the device has its
parent there too, so every path is device nodes first, then host-only ones::

    path        root ─ [A: device] ─ [B: device + host] ─ [C: host] ─ [D: host]
    match       [ device pages: shared       ][ host pages: loaded into fresh device pages ]

The device evicts its unlocked *device leaves* (no child on the device): one with a host copy
just drops its device pages; under ``write_back`` one without gets a copy first (host pages,
planned write-downs), evicting the host tier's own least recently used candidates when it has
no room; otherwise it leaves the tree with the host-only nodes below it. The host tier drops an
unlocked node's host copy (a node on both tiers) or unlinks an unlocked host-only leaf. A match
walks both tiers at token granularity; the lease's ``acquire`` loads the host-only nodes of its
path into fresh device pages (they then live on both tiers: evicting them again costs no copy),
and an insert whose path crosses host-only nodes gives them the inserting holder's device pages,
which hold the same KV.

Holders (the scheduler, the profiler, the tests) drive the tree through a ``Lease``
(radix/lease.py), the only caller of the tree's private mutators (``_match_prefix``,
``_insert``, ``_lock``, ``_unlock``, ``_alloc_pages``, ``_load``): each of those hands out or
takes back pages and locks that a holder must account for. What stays public cannot take a page from any
holder: the counts, ``peek_prefix``, ``evict`` and ``reset`` (they drop only unlocked nodes'
references), ``check``.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from radix.accounting import check_tree
from radix.eviction import EvictionKey, lru
from radix.host import HostTier  # noqa: TC001 (the constructor's annotation)
from radix.node import DEVICE, HOST, CacheStats, Node, PrefixMatch, TreeListener, page_array
from radix.pages import OutOfPages, PageAllocator

TokenIds = Sequence[int] | np.ndarray


def _as_key(tokens: TokenIds) -> bytes:
    return np.asarray(tokens, dtype=np.int32).tobytes()


def _common_tokens(key: bytes, query: bytes, offset: int, limit: int) -> int:
    """Tokens shared by ``key`` and ``query[offset:]``, at most ``limit``."""
    n = 4 * limit
    if key[:n] == query[offset : offset + n]:
        return limit
    a = np.frombuffer(key, dtype=np.int32, count=limit)
    b = np.frombuffer(query, dtype=np.int32, count=limit, offset=offset)
    return int(np.argmax(a != b))


@dataclass
class _LeafHeap:
    """Eviction candidates by key, with lazy invalidation: an entry is checked when popped."""

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


class RadixTree:
    """Longest-prefix matching at token granularity over paged KV, evicting unlocked leaves in
    ``eviction_key`` order (radix/eviction.py; LRU by default).

    ``namespace`` (tenant, LoRA, cache salt) selects a separate tree: different namespaces never
    share pages. A namespace whose nodes were all evicted is forgotten (clients may send a new
    salt with every request).
    """

    def __init__(self, allocator: PageAllocator, eviction_key: EvictionKey = lru,
                 host: HostTier | None = None) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        if host is not None and host.allocator.page_size != self.page_size:
            raise ValueError("the host tier's pages must hold as many tokens as the device's")
        self.host = host
        self.stats = CacheStats()
        self._roots: dict[Hashable, Node] = {}
        self._roots_limit = 64  # sweep empty roots when there are this many
        self._leaves = _LeafHeap()
        self._host_leaves = _LeafHeap()
        self._eviction_key = eviction_key
        self._clock = 0
        self._num_nodes = 0
        # At page size 1 no page is shared between nodes (nothing starts inside a page), so the
        # pages of distinct nodes never repeat and the allocator can skip its duplicate check.
        self._distinct_paths = self.page_size == 1
        # told of inserts and evictions (KV events, the suffix index); empty costs one loop
        # over nothing per insert / eviction
        self.listeners: list[TreeListener] = []

    # ---------------------------------------------------------------- queries
    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @property
    def num_namespaces(self) -> int:
        return len(self._roots)

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free_pages

    @property
    def num_evictable_pages(self) -> int:
        return self.allocator.num_evictable_pages

    @property
    def num_available_pages(self) -> int:
        """Pages an allocation could get now: free ones plus those eviction would free."""
        return self.allocator.num_free_pages + self.allocator.num_evictable_pages

    def peek_prefix(self, tokens: TokenIds, namespace: Hashable = None,
                    max_len: int | None = None) -> int:
        """Length of the cached prefix, without splitting, touching or counting (for policies)."""
        root = self._roots.get(namespace)
        if root is None:
            return 0
        query = _as_key(tokens)
        total = len(query) // 4
        limit = total if max_len is None else max(0, min(total, max_len))
        return self._walk(root, query, limit, collect=False, split=False)[1]

    def evict(self, num_pages: int) -> int:
        """Evict unlocked device leaves, smallest eviction key first, until ``num_pages`` device
        pages are freed or nothing evictable is left. Returns the pages freed. Under
        ``write_back`` a leaf moves to the host tier when it can (see the module's docstring).

        Leaves are taken in key order until their pages could cover what is still needed,
        then their references are dropped in one call (at page size 1 a leaf holds one page per
        token: one vectorised decref instead of one per leaf); pages still held elsewhere free
        nothing, and then the next leaves go."""
        keep = self.host is not None and self.host.write_back
        return self._evict(num_pages, keep)

    def reset(self) -> None:
        """Drop every unlocked node, from both tiers (all of them when nothing runs)."""
        self._evict(self.allocator.num_pages, keep=False)
        if self.host is not None:
            self._make_host_room(self.host.num_pages)
        if not self._num_nodes:
            for listener in self.listeners:
                listener.cleared()

    # --------------------------------------------- the lease's (radix/lease.py)
    def _match_prefix(self, tokens: TokenIds, namespace: Hashable = None,
                      max_len: int | None = None, *, count: bool = True) -> PrefixMatch:
        """Longest cached prefix of ``tokens`` (at most ``max_len`` tokens).

        Splits the last matched node where the match ends inside it, so ``node`` covers exactly
        the match and ``_lock(node)`` pins exactly it. Touches the path as a use. ``count=False``
        keeps the lookup out of the hit-rate stats (bookkeeping lookups, not requests').
        """
        query = _as_key(tokens)
        total = len(query) // 4
        limit = total if max_len is None else max(0, min(total, max_len))
        node, length, pages = self._walk(self._root(namespace), query, limit, collect=True)
        self._touch(node, used=True)
        host_length = length - self._device_end(node)
        if count:
            self.stats.queries += 1
            self.stats.queried_tokens += total
            self.stats.hit_tokens += length
            self.stats.host_hit_tokens += host_length
        return PrefixMatch(length, pages, node, self.page_size, host_length)

    def _insert(self, tokens: TokenIds, pages: Sequence[int] | np.ndarray,
                namespace: Hashable = None) -> tuple[int, Node]:
        """Cache ``tokens`` whose KV sits in ``pages`` (position-aligned, from position 0).

        Returns how many leading tokens were already cached, and the node that ends at the last
        of ``tokens`` (the one to lock to pin them). The tree keeps its own pages for the cached
        tokens and takes references only on the pages of the new suffix. The caller keeps its
        own references either way.
        """
        query = _as_key(tokens)
        total = len(query) // 4
        needed = self.allocator.pages_for(total)
        if len(pages) < needed:
            raise ValueError(f"{total} tokens need {needed} pages, got {len(pages)}")
        node, cached, _ = self._walk(self._root(namespace), query, total, collect=False)
        if not node.on_device:
            self._adopt(node, pages)
        if cached < total:
            new_pages = page_array(pages[cached // self.page_size : needed])
            self.allocator.incref(new_pages, evictable=True)
            leaf = Node(query[4 * cached :], cached, new_pages, node)
            node.children[query[4 * cached : 4 * cached + 4]] = leaf
            if cached % self.page_size and node.pages[-1] != new_pages[0]:
                # The leaf's first page holds the parent's slots of that page too: let the parent
                # use it and drop its own copy, so a chain of turns costs no extra page per turn.
                evictable = node.lock_ref == 0
                self.allocator.incref(new_pages[:1], evictable=evictable)
                self.allocator.decref(node.pages[-1:], evictable=evictable)
                node.pages[-1] = new_pages[0]
            self._num_nodes += 1
            node = leaf
            self.stats.inserted_tokens += total - cached
            for listener in self.listeners:
                listener.inserted(leaf, query, cached, namespace)
            if self.host is not None and self.host.policy == "write_through":
                self._write_down(leaf)
        self._touch(node, used=False)
        if _device_leaf(node):
            self._push_leaf(node)
        return cached, node

    def _lock(self, node: Node) -> None:
        """Pin the path from ``node`` to its root against eviction (under
        ``write_through_selective``, then copy down what matches made hot on it)."""
        locked = node
        newly_locked, newly_locked_host = array("q"), array("q")
        while node.parent is not None:
            if node.lock_ref == 0:
                newly_locked += node.pages
                newly_locked_host += node.host_pages
            node.lock_ref += 1
            node = node.parent
        self.allocator.set_evictable(newly_locked, False, distinct=self._distinct_paths)
        if newly_locked_host:
            self.host.allocator.set_evictable(newly_locked_host, False,
                                              distinct=self._distinct_paths)
        if self.host is not None and self.host.policy == "write_through_selective":
            # Once the path is locked: making room must not drop a node of it.
            self._write_hot(locked)

    def _unlock(self, node: Node) -> None:
        newly_unlocked, newly_unlocked_host = array("q"), array("q")
        deepest_on_device = None
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                newly_unlocked += node.pages
                if node.host_pages:
                    newly_unlocked_host += node.host_pages
                    if _host_candidate(node):
                        self._push_host_leaf(node)
                if deepest_on_device is None and node.pages:
                    deepest_on_device = node
            node = node.parent
        self.allocator.set_evictable(newly_unlocked, True, distinct=self._distinct_paths)
        if newly_unlocked_host:
            self.host.allocator.set_evictable(newly_unlocked_host, True,
                                              distinct=self._distinct_paths)
        # Only the deepest device node of the path can be a device leaf (the others have it as
        # a child on the device).
        if deepest_on_device is not None and _device_leaf(deepest_on_device):
            self._push_leaf(deepest_on_device)

    def _alloc_pages(self, n: int) -> list[int]:
        """Allocate ``n`` pages, evicting unlocked leaves when free pages run short."""
        short = n - self.allocator.num_free_pages
        if short > 0:
            self.evict(short)
        if n > self.allocator.num_free_pages:
            raise OutOfPages(
                f"asked for {n} pages: {self.allocator.num_free_pages} free and nothing more "
                f"evictable ({self.allocator.num_pinned_pages} pinned by running requests)"
            )
        return self.allocator.alloc(n)

    def _pages_to_load(self, node: Node, loading: set[Node] | None = None) -> int:
        """Device pages that loading the host-only end of the path to ``node`` takes, not
        counting the nodes in ``loading`` (others will load them first), to which it adds its
        own."""
        top = None
        deepest = node
        while not node.on_device and (loading is None or node not in loading):
            if loading is not None:
                loading.add(node)
            top, node = node, node.parent
        if top is None:
            return 0
        return (deepest.end - 1) // self.page_size - top.start // self.page_size + 1

    def _load(self, node: Node, fresh: list[int]) -> array:
        """Give the host-only nodes of the (locked) path to ``node`` the device pages
        ``fresh`` (``_pages_to_load(node)`` of them, one reference each, which pass to the
        nodes) and plan their loads; they keep their host copies. Returns the path's device
        pages. Where two nodes cover one page index, the deeper one's host page is loaded: it
        holds the shallower one's slots of that page too."""
        page_size = self.page_size
        path = []
        deepest = node
        while not node.on_device:
            path.append(node)
            node = node.parent
        if not path:
            return self._path_pages(deepest)
        path.reverse()
        first = path[0].start // page_size
        sources = np.empty(len(fresh), dtype=np.int64)
        device = np.asarray(fresh, dtype=np.int64)
        held = array("q")
        for n in path:  # top-down: a deeper node's page overwrites a shared index
            lo, hi = n.start // page_size - first, (n.end - 1) // page_size - first + 1
            sources[lo:hi] = n.host_pages
            n.pages = page_array(device[lo:hi])
            held += n.pages
            self._moved(n, DEVICE, stored=True)
        self.allocator.incref(held)  # the nodes' references (locked: not evictable) ...
        self.allocator.decref(fresh)  # ... replace the allocation's
        self.host.plan_loads(sources.tolist(), fresh)
        self.stats.pages_loaded += len(fresh)
        return self._path_pages(path[-1])

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
            self._moved(node, DEVICE, stored=True)
            if _host_candidate(node):
                self._push_host_leaf(node)
            node = node.parent
        if _device_leaf(deepest):
            self._push_leaf(deepest)

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
        heap = self._leaves.heap
        pop = heapq.heappop
        while freed < num_pages and heap:
            pages = array("q")
            want = num_pages - freed
            while len(pages) < want and heap:
                key, _, node = pop(heap)
                if node.lock_ref or not _device_leaf(node):
                    continue
                if key != node.eviction_key:
                    self._push_leaf(node)  # touched since it was queued: requeue at its real key
                    continue
                pages += node.pages
                parent = node.parent
                if node.host_pages or (keep and self._write_down(node)):
                    self._moved(node, DEVICE, stored=False)
                    node.pages = array("q")
                    if _host_candidate(node):
                        self._push_host_leaf(node)
                else:
                    self._unlink(node)
                # Its parent may become a device leaf itself.
                if not parent.lock_ref and _device_leaf(parent):
                    self._push_leaf(parent)
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
        self.stats.pages_written += count
        self._moved(node, HOST, stored=True)
        if _host_candidate(node):
            self._push_host_leaf(node)
        return True

    def _make_host_room(self, num_pages: int) -> bool:
        """Drop host copies, least recently used first, until ``num_pages`` host pages are
        free; False if the host tier runs out of candidates first."""
        alloc = self.host.allocator
        heap = self._host_leaves.heap
        while alloc.num_free_pages < num_pages:
            if not heap:
                return False
            key, _, node = heapq.heappop(heap)
            if not _host_candidate(node):
                continue
            if key != node.eviction_key:
                self._push_host_leaf(node)
                continue
            parent = node.parent
            if node.pages:
                self._moved(node, HOST, stored=False)
                self._drop_host_copy(node)  # it stays on the device
            else:
                self._unlink(node)
                if _host_candidate(parent):
                    self._push_host_leaf(parent)
        return True

    def _drop_host_copy(self, node: Node) -> None:
        host = self.host
        pages, node.host_pages = node.host_pages, array("q")
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
        self.stats.evicted_nodes += len(order)

    # -------------------------------------------------------------- internals
    def _root(self, namespace: Hashable) -> Node:
        root = self._roots.get(namespace)
        if root is None:
            if len(self._roots) >= self._roots_limit:
                # An empty root holds nothing (roots are never locked); sweeping only when the
                # count doubles keeps this O(1) amortised.
                self._roots = {ns: r for ns, r in self._roots.items() if r.children}
                self._roots_limit = 2 * len(self._roots) + 64
            root = self._roots[namespace] = Node(b"", 0, array("q"), None)
        return root

    def _walk(self, node: Node, query: bytes, limit: int, collect: bool,
              split: bool = True) -> tuple[Node, int, array]:
        """The deepest node matching ``query`` (split where the match ends inside it), the
        match's length and, with ``collect``, the device pages of its device part (a
        host-only node's first page index is its own, so the pages stop before it)."""
        page_size = self.page_size
        pages = array("q")
        pos = 0
        while pos < limit:
            child = node.children.get(query[4 * pos : 4 * pos + 4])
            if child is None:
                break
            matched = _common_tokens(child.key, query, 4 * pos, min(child.num_tokens, limit - pos))
            if collect:
                first = pos // page_size
                del pages[first:]  # the deeper node's copy of a shared boundary page wins
                if child.pages:
                    pages += child.pages[: (pos + matched - 1) // page_size - first + 1]
                else:
                    collect = False
            pos += matched
            if matched < child.num_tokens:
                node = self._split(child, matched) if split else node
                break
            node = child
        return node, pos, pages

    def _split(self, node: Node, at: int) -> Node:
        """Split ``node`` after ``at`` tokens; returns the new upper node."""
        page_size = self.page_size
        split_pos = node.start + at
        first_page = node.start // page_size
        upper_end = (split_pos - 1) // page_size - first_page + 1
        lower_start = split_pos // page_size - first_page
        upper = Node(node.key[: 4 * at], node.start, node.pages[:upper_end], node.parent,
                     node.host_pages[:upper_end])
        upper.lock_ref = node.lock_ref
        upper.eviction_key = node.eviction_key
        upper.hits = node.hits
        lower_pages, lower_host = node.pages[lower_start:], node.host_pages[lower_start:]
        if split_pos % page_size:
            # The page holding the split point now has two holders, in each tier.
            evictable = node.lock_ref == 0
            if lower_pages:
                self.allocator.incref(lower_pages[:1], evictable=evictable)
            if lower_host:
                self.host.allocator.incref(lower_host[:1], evictable=evictable)
        node.parent.children[node.key[:4]] = upper
        node.key = node.key[4 * at :]
        node.start = split_pos
        node.num_tokens -= at
        node.pages, node.host_pages = lower_pages, lower_host
        node.parent = upper
        upper.children[node.key[:4]] = node
        self._num_nodes += 1
        if _host_candidate(upper):
            self._push_host_leaf(upper)
        return upper

    def _touch(self, node: Node, used: bool) -> None:
        """Re-key the path from ``node`` to its root: ``used`` for a match, not for an insert."""
        self._clock += 1
        clock, key = self._clock, self._eviction_key
        while node.parent is not None:
            node.eviction_key = key(node.eviction_key, clock, used)
            node.hits += used
            node = node.parent

    def _push_leaf(self, node: Node) -> None:
        self._push(self._leaves, node, _device_leaf)

    def _push_host_leaf(self, node: Node) -> None:
        self._push(self._host_leaves, node, _host_candidate)

    def _push(self, leaves: _LeafHeap, node: Node, live) -> None:
        heapq.heappush(leaves.heap, (node.eviction_key, next(leaves.counter), node))
        if len(leaves.heap) > 4 * self._num_nodes + 64:
            # Lazy invalidation leaves stale entries behind; rebuild before they dominate, one
            # entry per candidate at its current key.
            seen: set[int] = set()
            kept = []
            for _, order, n in leaves.heap:
                if id(n) not in seen and live(n):
                    seen.add(id(n))
                    kept.append((n.eviction_key, order, n))
            heapq.heapify(kept)
            leaves.heap = kept

    # --------------------------------------------------------------- checking
    def iter_nodes(self):
        stack = [root for root in self._roots.values()]
        while stack:
            node = stack.pop()
            if node.parent is not None:
                yield node
            stack.extend(node.children.values())

    def check(self, external_refs: np.ndarray | None = None) -> None:
        """Assert the accounting invariant from scratch, in each tier (radix/accounting.py).

        ``external_refs[p]``, when given, is how many references running sequences hold on
        device page ``p``; then every page's refcount must equal its tree holders plus those
        exactly. Host pages have no holders but nodes."""
        check_tree(list(self.iter_nodes()), self._num_nodes, self.allocator, self.host,
                   external_refs)
