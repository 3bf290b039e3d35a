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

Holders (the scheduler, the profiler, the tests) drive the tree through a ``Lease``
(radix/lease.py), the only caller of the tree's private mutators (``_match_prefix``,
``_insert``, ``_lock``, ``_unlock``, ``_alloc_pages``): each of those hands out or takes back
pages and locks that a holder must account for. What stays public cannot take a page from any
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

from radix.eviction import EvictionKey, lru
from radix.node import CacheStats, Node, PrefixMatch, TreeListener, page_array
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
    heap: list[tuple[int, int, Node]] = field(default_factory=list)
    counter: itertools.count = field(default_factory=itertools.count)


class RadixTree:
    """Longest-prefix matching at token granularity over paged KV, evicting unlocked leaves in
    ``eviction_key`` order (radix/eviction.py; LRU by default).

    ``namespace`` (tenant, LoRA, cache salt) selects a separate tree: different namespaces never
    share pages. A namespace whose nodes were all evicted is forgotten (clients may send a new
    salt with every request).
    """

    def __init__(self, allocator: PageAllocator, eviction_key: EvictionKey = lru) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.stats = CacheStats()
        self._roots: dict[Hashable, Node] = {}
        self._roots_limit = 64  # sweep empty roots when there are this many
        self._leaves = _LeafHeap()
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
        """Evict unlocked leaves, smallest eviction key first, until ``num_pages`` pages are
        freed or nothing evictable is left. Returns the pages freed.

        Leaves are unlinked in key order until their pages could cover what is still needed,
        then their references are dropped in one call (at page size 1 a leaf holds one page per
        token: one vectorised decref instead of one per leaf); pages still held elsewhere free
        nothing, and then the next leaves go."""
        freed = unlinked = 0
        heap = self._leaves.heap
        pop = heapq.heappop
        listeners = self.listeners
        while freed < num_pages and heap:
            pages = array("q")
            want = num_pages - freed
            while len(pages) < want and heap:
                key, _, node = pop(heap)
                if node.evicted or node.children or node.lock_ref or node.parent is None:
                    continue
                if key != node.eviction_key:
                    self._push_leaf(node)  # touched since it was queued: requeue at its real key
                    continue
                pages += node.pages
                # Unlink the leaf; its parent may become an evictable leaf itself.
                parent = node.parent
                del parent.children[node.key[:4]]
                node.evicted = True
                unlinked += 1
                for listener in listeners:
                    listener.evicted(node)
                if parent.parent is not None and not parent.children and not parent.lock_ref:
                    self._push_leaf(parent)
            freed += self.allocator.decref(pages, evictable=True, distinct=self._distinct_paths)
        self._num_nodes -= unlinked
        self.stats.evicted_nodes += unlinked
        self.stats.evicted_pages += freed
        return freed

    def reset(self) -> None:
        """Drop every unlocked node (all of them when nothing runs)."""
        self.evict(self.allocator.num_pages)
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
        if count:
            self.stats.queries += 1
            self.stats.queried_tokens += total
            self.stats.hit_tokens += length
        return PrefixMatch(length, pages, node, self.page_size)

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
        self._touch(node, used=False)
        if not node.children and node.parent is not None:
            self._push_leaf(node)
        return cached, node

    def _lock(self, node: Node) -> None:
        """Pin the path from ``node`` to its root against eviction."""
        newly_locked = array("q")
        while node.parent is not None:
            if node.lock_ref == 0:
                newly_locked += node.pages
            node.lock_ref += 1
            node = node.parent
        self.allocator.set_evictable(newly_locked, False, distinct=self._distinct_paths)

    def _unlock(self, node: Node) -> None:
        newly_unlocked = array("q")
        leaf = node
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                newly_unlocked += node.pages
            node = node.parent
        self.allocator.set_evictable(newly_unlocked, True, distinct=self._distinct_paths)
        if leaf.parent is not None and leaf.lock_ref == 0 and not leaf.children:
            self._push_leaf(leaf)

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
                pages += child.pages[: (pos + matched - 1) // page_size - first + 1]
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
        upper_pages = node.pages[: (split_pos - 1) // page_size - first_page + 1]
        lower_pages = node.pages[split_pos // page_size - first_page :]
        upper = Node(node.key[: 4 * at], node.start, upper_pages, node.parent)
        upper.lock_ref = node.lock_ref
        upper.eviction_key = node.eviction_key
        if split_pos % page_size:
            # The page holding the split point now has two holders.
            self.allocator.incref([lower_pages[0]], evictable=node.lock_ref == 0)
        node.parent.children[node.key[:4]] = upper
        node.key = node.key[4 * at :]
        node.start = split_pos
        node.num_tokens -= at
        node.pages = lower_pages
        node.parent = upper
        upper.children[node.key[:4]] = node
        self._num_nodes += 1
        return upper

    def _touch(self, node: Node, used: bool) -> None:
        """Re-key the path from ``node`` to its root: ``used`` for a match, not for an insert."""
        self._clock += 1
        clock, key = self._clock, self._eviction_key
        while node.parent is not None:
            node.eviction_key = key(node.eviction_key, clock, used)
            node = node.parent

    def _push_leaf(self, node: Node) -> None:
        leaves = self._leaves
        heapq.heappush(leaves.heap, (node.eviction_key, next(leaves.counter), node))
        if len(leaves.heap) > 4 * self._num_nodes + 64:
            # Lazy invalidation leaves stale entries behind; rebuild before they dominate.
            live = [e for e in leaves.heap
                    if not e[2].evicted and not e[2].children and e[0] == e[2].eviction_key]
            heapq.heapify(live)
            leaves.heap = live

    # --------------------------------------------------------------- checking
    def iter_nodes(self):
        stack = [root for root in self._roots.values()]
        while stack:
            node = stack.pop()
            if node.parent is not None:
                yield node
            stack.extend(node.children.values())

    def check(self, external_refs: np.ndarray | None = None) -> None:
        """Assert the accounting invariant from scratch.

        ``external_refs[p]``, when given, is how many references running sequences hold on page
        ``p``; then every page's refcount must equal its tree holders plus those exactly.
        """
        alloc = self.allocator
        alloc.check()
        page_size = self.page_size
        tree_refs = np.zeros(alloc.num_pages, dtype=np.int64)
        unlocked_refs = np.zeros(alloc.num_pages, dtype=np.int64)
        count = 0
        for node in self.iter_nodes():
            count += 1
            assert not node.evicted, f"evicted node still linked: {node!r}"
            parent = node.parent
            assert parent.children.get(node.key[:4]) is node, f"child key mismatch at {node!r}"
            assert node.start == parent.end, f"{node!r} does not start where its parent ends"
            assert node.num_tokens > 0, f"empty node {node!r}"
            expected = (node.end - 1) // page_size - node.start // page_size + 1
            assert len(node.pages) == expected, f"{node!r} should hold {expected} pages"
            assert node.lock_ref >= 0 and (parent.parent is None or parent.lock_ref >= node.lock_ref)
            np.add.at(tree_refs, node.pages, 1)
            if node.lock_ref == 0:
                np.add.at(unlocked_refs, node.pages, 1)
        assert count == self._num_nodes, f"node count drifted: {count} vs {self._num_nodes}"
        rc = alloc.refcount.astype(np.int64)
        assert (alloc.evictable_refs == unlocked_refs).all(), (
            "evictable references differ from the references unlocked nodes hold"
        )
        outside = rc - tree_refs
        assert (outside >= 0).all(), "the tree holds references the refcount does not count"
        if external_refs is not None:
            bad = np.flatnonzero(outside != external_refs)
            assert bad.size == 0, (
                f"pages {bad[:8].tolist()} have refcounts that differ from their holders"
            )
        assert alloc.num_free_pages + alloc.num_evictable_pages + alloc.num_pinned_pages == (
            alloc.num_pages
        )
