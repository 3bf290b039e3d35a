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

from array import array
from collections.abc import Hashable, Sequence

import numpy as np

from radix.accounting import check_tree
from radix.eviction import EvictionKey, lru
from radix.host import HostTier  # noqa: TC001 (the constructor's annotation)
from radix.node import CacheStats, Node, PrefixMatch, TreeListener, page_array
from radix.pages import OutOfPages, PageAllocator
from radix.sliding import SlidingKV  # noqa: TC001 (the constructor's annotation)
from radix.tiering import Tiering, _device_leaf, _host_candidate, _LeafHeap
from radix.windows import Windows, _keeps_sliding, check_host_windows, check_sliding

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


class RadixTree(Tiering, Windows):
    """Longest-prefix matching at token granularity over paged KV, evicting unlocked leaves in
    ``eviction_key`` order (radix/eviction.py; LRU by default).

    ``sliding``: the sliding-window layers' pages (radix/sliding.py, radix/windows.py): a match
    then ends where a window of their KV is live, and inserts keep the window at their end.

    ``namespace`` (tenant, LoRA, cache salt) selects a separate tree: different namespaces never
    share pages. A namespace whose nodes were all evicted is forgotten (clients may send a new
    salt with every request).
    """

    def __init__(self, allocator: PageAllocator, eviction_key: EvictionKey = lru,
                 host: HostTier | None = None, sliding: SlidingKV | None = None) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        if host is not None and host.allocator.page_size != self.page_size:
            raise ValueError("the host tier's pages must hold as many tokens as the device's")
        self.host = host
        self.sliding = sliding
        self._swa_nodes = _LeafHeap(_keeps_sliding)
        self.stats = CacheStats()
        self._roots: dict[Hashable, Node] = {}
        self._roots_limit = 64  # sweep empty roots when there are this many
        self._leaves = _LeafHeap(_device_leaf)
        self._host_leaves = _LeafHeap(_host_candidate)
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
        if self.sliding is not None:
            return self._sliding_limit(root, query, limit)
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
        root = self._root(namespace)
        if self.sliding is not None:
            limit = self._sliding_limit(root, query, limit)
        node, length, pages = self._walk(root, query, limit, collect=True)
        self._touch(node, used=True)
        host_length = length - self._device_end(node)
        if count:
            self.stats.queries += 1
            self.stats.queried_tokens += total
            self.stats.hit_tokens += length
            self.stats.host_hit_tokens += host_length
        return PrefixMatch(length, pages, node, self.page_size, host_length)

    def _insert(self, tokens: TokenIds, pages: Sequence[int] | np.ndarray,
                namespace: Hashable = None, *, keep: bool = False) -> tuple[int, Node]:
        """Cache ``tokens`` whose KV sits in ``pages`` (position-aligned, from position 0).

        Returns how many leading tokens were already cached, and the node that ends at the last
        of ``tokens`` (the one to lock to pin them). The tree keeps its own pages for the cached
        tokens and takes references only on the pages of the new suffix. The caller keeps its
        own references either way. With sliding-window layers, ``keep``: the path keeps the
        sliding KV of the window that ends with ``tokens`` (where it is still live).
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
            if self.sliding is not None:
                leaf.swa_pages = array("q", [-1]) * len(new_pages)
            node.children[query[4 * cached : 4 * cached + 4]] = leaf
            if (cached % self.page_size and node.pages[-1] != new_pages[0]
                    and self._swap_kept(node, new_pages[0])):
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
        if keep and self.sliding is not None:
            self._keep_window(node, total)
        self._touch(node, used=False)
        self._push(self._leaves, node)
        return cached, node

    def _lock(self, node: Node) -> None:
        """Pin the path from ``node`` to its root against eviction (under
        ``write_through_selective``, then copy down what matches made hot on it)."""
        locked = node
        newly_locked, newly_locked_host, newly_locked_windows = array("q"), array("q"), array("q")
        while node.parent is not None:
            if node.lock_ref == 0:
                newly_locked += node.pages
                newly_locked_host += node.host_pages
                newly_locked_windows += node.host_swa_pages
            node.lock_ref += 1
            node = node.parent
        self.allocator.set_evictable(newly_locked, False, distinct=self._distinct_paths)
        if newly_locked_host:
            self.host.allocator.set_evictable(newly_locked_host, False,
                                              distinct=self._distinct_paths)
            self._host_windows_evictable(newly_locked_windows, False)
        if self.host is not None and self.host.policy == "write_through_selective":
            # Once the path is locked: making room must not drop a node of it.
            self._write_hot(locked)

    def _unlock(self, node: Node) -> None:
        newly_unlocked, newly_unlocked_host, newly_unlocked_windows = (array("q"), array("q"),
                                                                       array("q"))
        deepest_on_device = None
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                newly_unlocked += node.pages
                newly_unlocked_host += node.host_pages
                newly_unlocked_windows += node.host_swa_pages
                self._push(self._host_leaves, node)
                if deepest_on_device is None and node.pages:
                    deepest_on_device = node
            node = node.parent
        self.allocator.set_evictable(newly_unlocked, True, distinct=self._distinct_paths)
        if newly_unlocked_host:
            self.host.allocator.set_evictable(newly_unlocked_host, True,
                                              distinct=self._distinct_paths)
            self._host_windows_evictable(newly_unlocked_windows, True)
        # Only the deepest device node of the path can be a device leaf (the others have it as
        # a child on the device).
        if deepest_on_device is not None:
            self._push(self._leaves, deepest_on_device)

    def _alloc_pages(self, n: int, windows: int | np.ndarray | None = None,
                     spare: int = 0) -> list[int]:
        """Allocate ``n`` pages, evicting unlocked leaves when free pages run short; with
        sliding-window layers, each with a sliding page (``Windows._alloc_sliding``), or only
        the last ``windows`` of them (or those at the positions it lists), leaving ``spare``
        more sliding pages free (windows to load under device pages the caller holds)."""
        short = n - self.allocator.num_free_pages
        if short > 0:
            self.evict(short)
        if n > self.allocator.num_free_pages:
            raise OutOfPages(
                f"asked for {n} pages: {self.allocator.num_free_pages} free and nothing more "
                f"evictable ({self.allocator.num_pinned_pages} pinned by running requests)"
            )
        if self.sliding is not None:
            return self._alloc_sliding(n, n if windows is None else windows, spare)
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
              split: bool = True, swa: array | None = None) -> tuple[Node, int, array]:
        """The deepest node matching ``query`` (split where the match ends inside it), the
        match's length and, with ``collect``, the device pages of its device part (a
        host-only node's first page index is its own, so the pages stop before it). ``swa``
        (an empty array) receives, at each page index, whether the path keeps that page's
        window, on the device or in the host tier (``Windows._kept_windows``: >= 0 where it
        does)."""
        page_size = self.page_size
        pages = array("q")
        pos = 0
        while pos < limit:
            child = node.children.get(query[4 * pos : 4 * pos + 4])
            if child is None:
                break
            matched = _common_tokens(child.key, query, 4 * pos, min(child.num_tokens, limit - pos))
            if swa is not None:
                first = pos // page_size
                del swa[first:]  # as for pages: the deeper node's keep of a shared page wins
                kept = self._kept_windows(child)
                swa += kept[: (pos + matched - 1) // page_size - first + 1]
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
        upper.lock_ref, upper.swa_lock = node.lock_ref, node.swa_lock
        upper.eviction_key = node.eviction_key
        upper.hits = node.hits
        lower_pages, lower_host = node.pages[lower_start:], node.host_pages[lower_start:]
        if node.swa_pages:
            upper.swa_pages = node.swa_pages[:upper_end]
            node.swa_pages = node.swa_pages[lower_start:]
        if node.host_swa_pages:
            upper.host_swa_pages = node.host_swa_pages[:upper_end]
            node.host_swa_pages = node.host_swa_pages[lower_start:]
        if split_pos % page_size:
            # The page holding the split point now has two holders, in each tier.
            evictable = node.lock_ref == 0
            if lower_pages:
                self.allocator.incref(lower_pages[:1], evictable=evictable)
            if lower_host:
                self.host.allocator.incref(lower_host[:1], evictable=evictable)
            if node.swa_pages and node.swa_pages[0] >= 0:
                self.sliding.allocator.incref(node.swa_pages[:1], evictable=not node.swa_lock)
            if node.host_swa_pages and node.host_swa_pages[0] >= 0:
                self.host.swa.incref(node.host_swa_pages[:1], evictable=evictable)
        node.parent.children[node.key[:4]] = upper
        node.key = node.key[4 * at :]
        node.start = split_pos
        node.num_tokens -= at
        node.pages, node.host_pages = lower_pages, lower_host
        node.parent = upper
        upper.children[node.key[:4]] = node
        self._num_nodes += 1
        self._push(self._host_leaves, upper)
        self._push(self._swa_nodes, upper)
        return upper

    def _touch(self, node: Node, used: bool) -> None:
        """Re-key the path from ``node`` to its root: ``used`` for a match, not for an insert."""
        self._clock += 1
        clock, key = self._clock, self._eviction_key
        while node.parent is not None:
            node.eviction_key = key(node.eviction_key, clock, used)
            node.hits += used
            node = node.parent

    # --------------------------------------------------------------- checking
    def iter_nodes(self):
        stack = [root for root in self._roots.values()]
        while stack:
            node = stack.pop()
            if node.parent is not None:
                yield node
            stack.extend(node.children.values())

    def check(self, external_refs: np.ndarray | None = None,
              external_swa_refs: np.ndarray | None = None) -> None:
        """Assert the accounting invariant from scratch, in each tier (radix/accounting.py).

        ``external_refs[p]``, when given, is how many references running sequences hold on
        device page ``p``; then every page's refcount must equal its tree holders plus those
        exactly. Host pages have no holders but nodes. With sliding-window layers, the same
        over their pages (``external_swa_refs``, by sliding page: radix/windows.py)."""
        nodes = list(self.iter_nodes())
        check_tree(nodes, self._num_nodes, self.allocator, self.host, external_refs)
        if self.sliding is not None:
            check_sliding(nodes, self.sliding, self.allocator, external_swa_refs)
            if self.host is not None:
                check_host_windows(nodes, self.host, self.sliding, self.allocator.refcount)
