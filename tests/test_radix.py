from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from radix import Lease, OutOfPages, PageAllocator, PageCopy, PrefixMatch, RadixTree
from tests.radix_sim import Sim


def make(num_pages: int = 64, page_size: int = 4) -> tuple[PageAllocator, RadixTree]:
    alloc = PageAllocator(num_pages, page_size)
    return alloc, RadixTree(alloc)


def cache(tree: RadixTree, tokens: list[int], namespace=None) -> list[int]:
    """Cache ``tokens`` on fresh pages, as a request that matched nothing and finished."""
    lease = Lease(tree, tokens, namespace, max_len=0, count=False)
    pages, _ = lease.acquire(len(tokens))
    lease.release(pages, tokens)
    return pages


def match(tree: RadixTree, tokens: list[int], namespace=None, max_len: int | None = None,
          count: bool = True) -> PrefixMatch:
    """What a lease matches, let go at once (its pages are only good for looking at)."""
    lease = Lease(tree, tokens, namespace, max_len, count=count)
    lease.unlock()
    return lease.match


# ---------------------------------------------------------------- matching
def test_match_at_token_granularity_inside_a_page():
    alloc, tree = make(page_size=4)
    pages = cache(tree, list(range(10)))  # pages cover 0-3, 4-7, 8-9
    m = match(tree, list(range(7)) + [99])
    assert m.length == 7
    assert m.full_pages.tolist() == pages[:1]
    assert m.partial_page == pages[1] and m.partial_len == 3
    assert m.pages.tolist() == pages[:2]
    tree.check()


def test_match_respects_max_len_and_returns_exact_node():
    alloc, tree = make(page_size=4)
    cache(tree, list(range(8)))
    m = match(tree, list(range(8)), max_len=7)
    assert m.length == 7 and m.node.end == 7
    assert match(tree, [5, 6]).length == 0
    assert match(tree, []).length == 0
    tree.check()


def test_split_inside_page_shares_the_page():
    alloc, tree = make(page_size=4)
    pages = cache(tree, list(range(8)))
    match(tree, list(range(6)) + [50])  # splits at 6, inside page pages[1]
    assert tree.num_nodes == 2
    assert alloc.refcount[pages[1]] == 2  # both halves hold it
    assert alloc.num_evictable_pages == 2  # counted once
    tree.check()
    assert tree.evict(100) == 2
    assert alloc.num_free_pages == 64
    tree.check()


def test_insert_returns_cached_length_and_keeps_tree_pages():
    alloc, tree = make(page_size=4)
    first = cache(tree, list(range(6)))
    tokens = list(range(6)) + [40, 41, 42, 43]
    lease = Lease(tree, tokens, max_len=0)
    seq_pages = lease.alloc_pages(3)
    assert lease.commit(seq_pages, tokens) == 6
    # The tree keeps its own pages for 0..5 and references the sequence's page for 4..9.
    m = match(tree, tokens)
    assert m.length == 10
    assert m.pages.tolist() == [first[0], seq_pages[1], seq_pages[2]]
    assert alloc.refcount[seq_pages[0]] == 1  # only the sequence: the tree took no reference
    lease.release(seq_pages)
    tree.check()


def test_duplicate_insert_never_invalidates_running_sequence():
    sim = Sim(num_pages=32, page_size=4)
    a = sim.admit([1, 2, 3, 4, 5, 6, 7])
    b = sim.admit([1, 2, 3, 4, 5, 6, 7])  # nothing cached yet: its own pages
    sim.finish(a)
    sim.check()
    assert sim.commit(b, 7) == 7  # already cached: tree keeps a's pages
    sim.tree.evict(100)
    sim.verify_match(b.tokens, type(b.lease.match)(7, b.pages, b.lease.match.node, 4))  # b's pages intact
    sim.finish(b)
    sim.check()


def test_full_hit_recomputes_last_token_and_copies_partial_page():
    sim = Sim(num_pages=32, page_size=4)
    tokens = list(range(10))
    sim.finish(sim.admit(tokens))
    seq = sim.admit(tokens)
    assert seq.lease.length == 9 and seq.lease.match.partial_len == 1
    assert seq.pages[2] != seq.lease.match.partial_page  # a fresh page, copied into
    sim.check()
    sim.finish(seq)
    sim.check()


def test_a_waiting_lease_copies_the_page_its_node_holds_now():
    """A lease matched a prefix ending inside a page and has not acquired yet; meanwhile another
    holder extends that node from inside the page, which hands the node the holder's copy of
    the page and frees the matched one (anyone may take it). The copy on acquire reads the
    node's page as it is now, never the freed one."""
    alloc, tree = make(num_pages=8, page_size=4)
    cache(tree, [1, 2, 3, 4, 5, 6])  # two pages, the second holding two slots
    waiting = Lease(tree, [1, 2, 3, 4, 5, 6, 9])
    matched = waiting.match.partial_page
    other = Lease(tree, [1, 2, 3, 4, 5, 6, 7, 8])
    table, copy = other.acquire(8)
    alloc.decref([copy.src])  # the copy ran
    other.commit(table, [1, 2, 3, 4, 5, 6, 7, 8])
    taken = alloc.alloc(alloc.num_free_pages)
    assert matched in taken  # the page the waiting lease matched belongs to someone else now
    alloc.decref(taken)
    pages, copy = waiting.acquire(7)
    assert copy == PageCopy(table[1], pages[1], 2)
    alloc.decref([copy.src])
    waiting.release(pages)
    other.release(table)
    tree.check()
    alloc.check()


# ---------------------------------------------------------------- eviction
def test_eviction_is_lru_over_leaves():
    alloc, tree = make(num_pages=16, page_size=4)
    cache(tree, [1] * 4)
    cache(tree, [2] * 4)
    cache(tree, [3] * 4)
    match(tree, [1] * 4)  # touch: now 2 is least recent
    assert tree.evict(1) == 1
    assert match(tree, [2] * 4).length == 0
    assert match(tree, [1] * 4).length == 4
    assert match(tree, [3] * 4).length == 4
    tree.check()


def test_evicting_a_leaf_makes_its_parent_evictable():
    alloc, tree = make(num_pages=16, page_size=4)
    cache(tree, [1, 2, 3, 4, 5, 6, 7, 8])
    cache(tree, [1, 2, 3, 4, 9, 9, 9, 9])  # splits at 4: parent [1..4], two leaves
    assert tree.num_nodes == 3
    assert tree.evict(16) == 3
    assert tree.num_nodes == 0 and alloc.num_free_pages == 16
    tree.check()


def test_locks_block_eviction():
    alloc, tree = make(num_pages=16, page_size=4)
    cache(tree, list(range(8)))
    lease = Lease(tree, list(range(8)))
    assert alloc.num_evictable_pages == 0
    assert tree.evict(10) == 0
    tree.check()
    lease.unlock()
    lease.unlock()  # idempotent
    assert alloc.num_evictable_pages == 2
    assert tree.evict(10) == 2
    tree.check()
    with pytest.raises(RuntimeError, match="unlock of an unlocked"):
        tree._unlock(lease.match.node)


def test_alloc_pages_evicts_on_demand_and_reports_shortfall():
    alloc, tree = make(num_pages=4, page_size=4)
    cache(tree, list(range(16)))  # all 4 pages cached, none free
    assert alloc.num_free_pages == 0 and alloc.num_evictable_pages == 4
    holder = Lease(tree, [], count=False)  # matched nothing: a swap-in's pages, say
    pages = holder.alloc_pages(2)
    assert len(pages) == 2
    with pytest.raises(OutOfPages, match="pinned by running requests"):
        holder.alloc_pages(3)
    holder.release(pages)
    tree.check()


def test_pages_shared_with_running_sequence_are_not_evictable():
    sim = Sim(num_pages=16, page_size=4)
    sim.finish(sim.admit(list(range(12))))
    seq = sim.admit(list(range(12)) + [7, 7])  # shares 2 full pages, copies into a third
    # Shared pages are pinned (locked node and running sequence); nothing else is cached.
    assert sim.alloc.num_evictable_pages == 0
    sim.check()
    sim.finish(seq)
    sim.check()


# --------------------------------------------------------------- namespaces
def test_namespaces_never_share():
    alloc, tree = make()
    cache(tree, [1, 2, 3, 4, 5], namespace="tenant-a")
    assert match(tree, [1, 2, 3, 4, 5], namespace="tenant-b").length == 0
    assert match(tree, [1, 2, 3, 4, 5]).length == 0
    assert match(tree, [1, 2, 3, 4, 5], namespace="tenant-a").length == 5
    tree.check()


# ------------------------------------------------------------ stats & check
def test_stats_count_queries_hits_inserts_evictions():
    alloc, tree = make(page_size=4)
    cache(tree, list(range(8)))
    match(tree, list(range(8)) + [1, 1])
    tree.evict(1)
    s = tree.stats
    assert (s.queries, s.queried_tokens, s.hit_tokens, s.inserted_tokens) == (1, 10, 8, 8)
    assert s.evicted_pages == 2 and s.hit_rate == pytest.approx(0.8)
    cache(tree, list(range(8)))
    before = (s.queries, s.queried_tokens, s.hit_tokens)
    assert match(tree, list(range(8)), count=False).length == 8
    assert (s.queries, s.queried_tokens, s.hit_tokens) == before


def test_check_catches_a_leaked_reference():
    alloc, tree = make()
    cache(tree, [1, 2, 3])
    leaked = alloc.alloc(1)
    tree.check()  # without holders given, the extra reference counts as external
    with pytest.raises(AssertionError, match="differ from their holders"):
        tree.check(np.zeros(alloc.num_pages, dtype=np.int64))
    alloc.decref(leaked)


def test_insert_needs_enough_pages():
    alloc, tree = make(page_size=4)
    lease = Lease(tree, list(range(5)))
    with pytest.raises(ValueError, match="need 2 pages"):
        lease.commit([0], list(range(5)))


@pytest.mark.e2e
def test_radix_does_not_import_torch():
    code = "import sys, radix; assert 'torch' not in sys.modules; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_chained_insert_gives_parent_the_childs_boundary_page():
    sim = Sim(num_pages=16, page_size=4)
    tree, alloc = sim.tree, sim.alloc
    first = sim.admit(list(range(6)))
    sim.finish(first)  # node [0, 6) on pages a0, a1 (a1 half full)
    a1 = first.pages[1]
    seq = sim.admit(list(range(10)))  # matches 6 inside a1: copies into a fresh page
    sim.finish(seq)
    sim.check()
    # The parent now references the child's copy; its own half page went back to the free list.
    assert alloc.refcount[a1] == 0
    m = match(tree, list(range(10)))
    assert m.length == 10 and m.pages.tolist() == seq.pages
    sim.verify_match(list(range(10)), m)


def test_peek_prefix_changes_nothing():
    alloc, tree = make(page_size=4)
    cache(tree, list(range(10)))
    stats_before = (tree.stats.queries, tree.num_nodes)
    assert tree.peek_prefix(list(range(7)) + [99]) == 7
    assert tree.peek_prefix(list(range(10)), max_len=9) == 9
    assert tree.peek_prefix([1, 2], namespace="other") == 0
    assert (tree.stats.queries, tree.num_nodes) == stats_before
    tree.check()


# ------------------------------------------------------------------- leases
def test_commit_caches_a_chunk_and_moves_the_lock_onto_it():
    sim = Sim(num_pages=16, page_size=4)
    sim.finish(sim.admit(list(range(6))))
    seq = sim.admit(list(range(14)))  # matches the first request's 6, computes the rest
    assert seq.lease.length == 6
    assert sim.commit(seq, 10) == 6
    assert match(sim.tree, list(range(14)), count=False).length == 10  # others hit the chunk
    sim.tree.evict(16)  # the lock holds the committed path; only unlocked leaves go
    sim.check()
    assert sim.tree.peek_prefix(list(range(10))) == 10
    assert sim.commit(seq, 8) == 8  # a shorter commit leaves the lock where it is
    sim.check()
    assert sim.finish(seq) == 10
    sim.check()
    assert sim.alloc.num_pinned_pages == 0


def test_commit_on_an_unlocked_lease_caches_without_locking():
    sim = Sim(num_pages=16, page_size=4)
    seq = sim.admit(list(range(12)))
    sim.unlock(seq)  # swapped out: its table stays, its lock goes
    sim.commit(seq, 12)
    assert sim.alloc.num_evictable_pages == 0  # the sequence still holds every page
    sim.finish(seq)
    assert sim.alloc.num_evictable_pages == 3 and sim.tree.evict(16) == 3
    sim.check()


def test_fork_shares_the_table_and_grow_unshares_the_partial_page():
    sim = Sim(num_pages=8, page_size=4)
    parent = sim.admit(list(range(6)))
    child = sim.fork(parent)
    assert child.pages == parent.pages and child.shares_last_page
    assert sim.alloc.refcount[parent.pages[1]] == 2
    sim.check()
    sim.grow(parent, [60, 61])  # the parent writes past the slots they share
    copy = child.lease.grow(child.pages, 7, unshare_at=6)
    assert copy == PageCopy(parent.pages[1], child.pages[1], 2) == (parent.pages[1],
                                                                     child.pages[1], 2)
    assert child.pages[0] == parent.pages[0] and child.pages[1] != parent.pages[1]
    sim._run_copy(copy)
    child.shares_last_page = False
    sim.check()
    sim.finish(parent)
    sim.finish(child)
    sim.check()
    assert sim.alloc.num_pinned_pages == 0


def test_grow_short_of_pages_changes_nothing():
    sim = Sim(num_pages=3, page_size=4)
    parent = sim.admit(list(range(6)))
    child = sim.fork(parent)
    hog = sim.admit([9])
    before = list(child.pages)
    with pytest.raises(OutOfPages):
        child.lease.grow(child.pages, 7, unshare_at=6)
    assert child.pages == before
    sim.check()
    sim.finish(hog, cache=False)
    sim.grow(child, [70])
    sim.check()


def test_only_the_lease_calls_the_trees_mutators():
    """Production code holds pages only through a lease (docs/design.md, KV memory)."""
    root = Path(__file__).resolve().parents[1]
    private = ("._match_prefix(", "._insert(", "._lock(", "._unlock(", "._alloc_pages(",
               "._load(", "._pages_to_load(")
    callers = []
    for folder in ("engine", "radix", "scheduler", "tokenizer_worker", "scripts"):
        for path in (root / folder).rglob("*.py"):
            if path.relative_to(root).as_posix() in ("radix/lease.py", "radix/tree.py",
                                                         "radix/tiering.py"):
                continue
            text = path.read_text()
            callers += [f"{path.relative_to(root)}: {call}" for call in private if call in text]
    assert not callers, callers
