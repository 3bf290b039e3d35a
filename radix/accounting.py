"""The accounting invariant, rebuilt from scratch over a tree's nodes: in each tier,
``free + evictable + pinned == total``, every page's refcount equal to the nodes listing it
plus the references others hold, evictable references exactly those of unlocked nodes; and the
tree's shape (keys, positions, page counts, a node on the device having its parent there)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from radix.pages import PageAllocator

if TYPE_CHECKING:
    from radix.host import HostTier
    from radix.node import Node


def check_tree(nodes: list[Node], num_nodes: int, alloc: PageAllocator, host: HostTier | None,
               external_refs: np.ndarray | None) -> None:
    """``RadixTree.check``: ``nodes`` are every linked node, ``num_nodes`` the tree's count,
    ``alloc`` its device pages and ``host`` its host tier."""
    page_size = alloc.page_size
    tree_refs = np.zeros(alloc.num_pages, dtype=np.int64)
    unlocked_refs = np.zeros(alloc.num_pages, dtype=np.int64)
    host_pages = host.num_pages if host is not None else 0
    host_refs = np.zeros(host_pages, dtype=np.int64)
    host_unlocked = np.zeros(host_pages, dtype=np.int64)
    assert len(nodes) == num_nodes, f"node count drifted: {len(nodes)} vs {num_nodes}"
    for node in nodes:
        assert not node.evicted, f"evicted node still linked: {node!r}"
        parent = node.parent
        assert parent.children.get(node.key[:4]) is node, f"child key mismatch at {node!r}"
        assert node.start == parent.end, f"{node!r} does not start where its parent ends"
        assert node.num_tokens > 0, f"empty node {node!r}"
        expected = (node.end - 1) // page_size - node.start // page_size + 1
        assert len(node.pages) in (0, expected), f"{node!r} should hold {expected} pages"
        assert len(node.host_pages) in (0, expected), (
            f"{node!r} should hold {expected} host pages")
        assert node.pages or node.host_pages, f"{node!r} is in no tier"
        assert not node.pages or parent.on_device, f"{node!r} is on the device, its parent not"
        assert host is not None or not node.host_pages, f"{node!r} has host pages, no tier"
        assert node.lock_ref >= 0 and (parent.parent is None or parent.lock_ref >= node.lock_ref)
        np.add.at(tree_refs, node.pages, 1)
        np.add.at(host_refs, node.host_pages, 1)
        if node.lock_ref == 0:
            np.add.at(unlocked_refs, node.pages, 1)
            np.add.at(host_unlocked, node.host_pages, 1)
    _check_tier(alloc, tree_refs, unlocked_refs, external_refs)
    if host is not None:
        _check_tier(host.allocator, host_refs, host_unlocked, np.zeros_like(host_refs))
        host.check(alloc.refcount)


def _check_tier(alloc: PageAllocator, tree_refs: np.ndarray, unlocked_refs: np.ndarray,
                external_refs: np.ndarray | None) -> None:
    """One tier's pages against the references its nodes (and, when given, others) hold."""
    alloc.check()
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
