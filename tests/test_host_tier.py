"""The radix tree's host tier (radix/host.py) through leases, with the simulator's shadow of
slot contents in both tiers (tests/radix_sim.py): which tier each node is in after evictions,
loads, inserts and resets, and that every table and node holds its tokens' KV."""

from __future__ import annotations

import pytest

from radix import HostTier, Lease, PageAllocator, RadixTree
from tests.radix_sim import Sim

PROMPT = list(range(10, 50))  # 40 tokens: 2 full pages of 16 and a partial one


def cached_then_evicted(sim: Sim, tokens: list[int]) -> None:
    sim.finish(sim.admit(tokens))
    sim.tree.evict(sim.alloc.num_pages)
    sim.run_moves()


def test_write_back_moves_an_evicted_prefix_down_and_a_match_loads_it():
    sim = Sim(num_pages=8, page_size=16, host_pages=8)
    cached_then_evicted(sim, PROMPT)
    (node,) = sim.tree.iter_nodes()
    assert not node.pages and len(node.host_pages) == 3
    assert sim.alloc.num_free_pages == 8 and sim.moved == [3, 0]
    assert sim.tree.stats.pages_written == 3
    sim.check()
    seq = sim.admit(PROMPT + [7])
    assert seq.lease.length == 40 and seq.lease.match.host_length == 40
    assert sim.moved == [3, 3]
    assert len(node.pages) == 3 and len(node.host_pages) == 3  # on both tiers now
    sim.check()
    sim.finish(seq)  # caches its 41st token in a leaf of its own (the last page)
    sim.tree.evict(sim.alloc.num_pages)  # the prefix has a host copy: only the leaf is written
    sim.run_moves()
    assert sim.moved == [4, 3] and sim.tree.stats.host_hit_tokens == 40
    sim.check()


def test_a_match_ending_inside_a_host_page_loads_it_and_copies_the_head():
    sim = Sim(num_pages=8, page_size=16, host_pages=8)
    cached_then_evicted(sim, PROMPT)
    seq = sim.admit(PROMPT[:20] + [99, 98])  # diverges inside the second page
    assert seq.lease.length == 20 and seq.lease.match.host_length == 20
    sim.check()


def test_a_lease_matched_before_another_loads_its_host_part_gets_the_loaded_pages():
    sim = Sim(num_pages=12, page_size=16, host_pages=8)
    cached_then_evicted(sim, PROMPT)
    early = sim.match(PROMPT + [1])
    assert early.match.host_length == 40
    sim.admit(PROMPT + [2])  # loads the prefix first
    assert early.pages_to_acquire(41) == 1  # nothing left to load
    sim.take(early, PROMPT + [1])
    assert sim.moved[1] == 3
    sim.check()


@pytest.mark.parametrize("cut", [40, 20, 16])
def test_a_load_into_the_holders_own_pages_then_a_commit_caches_it(cut):
    """``acquire_unloaded``: the tree stays as it is while the holder's loader copies the host
    part into pages of its own (a match ending inside a page included); the commit then gives
    the host-only nodes those pages. Every table and node holds its tokens' KV."""
    sim = Sim(num_pages=12, page_size=16, host_pages=8)
    cached_then_evicted(sim, PROMPT)
    lease = sim.match(PROMPT[:cut] + [99, 98])
    assert lease.match.host_length == cut
    (node,) = (n for n in sim.tree.iter_nodes() if n.end == cut)
    seq = sim.take_unloaded(lease, PROMPT[:cut] + [99, 98])
    assert sim.moved[1] == -(-cut // 16) and node.pages and node.host_pages
    assert sim.tree.stats.pages_loaded == sim.moved[1]
    sim.check()
    sim.finish(seq)
    sim.check()


def test_an_unloaded_acquire_after_another_holder_loaded_part_of_the_path():
    """A lease matched before another holder loaded the top of its host part: its table takes
    the loaded pages and loads only what is still host-only."""
    sim = Sim(num_pages=12, page_size=16, host_pages=8)
    cached_then_evicted(sim, PROMPT)
    late = sim.match(PROMPT + [1])
    sim.admit(PROMPT[:20] + [2])  # loads the first 20 tokens' pages (a split at 20)
    seq = sim.take_unloaded(late, PROMPT + [1])
    assert seq.lease.length == 40
    sim.check()
    whole = sim.match(PROMPT + [3])
    assert whole.match.host_length == 0 and whole.acquire_unloaded(41) is None
    whole.unlock()
    sim.check()


def test_samples_admitted_together_count_their_shared_loads_once():
    sim = Sim(num_pages=6, page_size=16, host_pages=8)
    cached_then_evicted(sim, PROMPT)
    leases = [sim.match(PROMPT + [i]) for i in range(2)]
    loading: set = set()
    need = [lease.pages_to_acquire(41, loading) for lease in leases]
    assert need == [4, 1]  # three loaded pages and a fresh one, then a fresh one
    assert sum(need) <= sim.tree.num_available_pages
    for i, lease in enumerate(leases):
        sim.take(lease, PROMPT + [i])
    assert sim.moved[1] == 3
    sim.check()


def test_a_leaf_the_host_tier_has_no_room_for_leaves_the_tree():
    sim = Sim(num_pages=8, page_size=4, host_pages=3)
    cached_then_evicted(sim, PROMPT[:12])  # three host pages: the tier is full ...
    pin = Lease(sim.tree, PROMPT[:12], count=False)  # ... and what it holds is locked
    sim.finish(sim.admit(list(range(100, 108))))
    assert sim.tree.num_nodes == 2
    sim.tree.evict(sim.alloc.num_pages)
    sim.run_moves()
    assert sim.tree.num_nodes == 1 and sim.moved == [3, 0]
    sim.check()
    pin.unlock()
    sim.tree.reset()
    assert sim.tree.num_nodes == 0
    assert sim.host.allocator.num_free_pages == 3 and sim.alloc.num_free_pages == 8
    sim.check()


def test_an_insert_across_host_only_nodes_adopts_the_holders_pages():
    sim = Sim(num_pages=8, page_size=4, host_pages=16)
    cached_then_evicted(sim, PROMPT[:10])
    lease = Lease(sim.tree, PROMPT[:16], max_len=0)  # recomputes everything
    pages, _ = lease.acquire(16)
    sim.shadow[[p * 4 + i for p in pages for i in range(4)]] = [
        (t, pos) for pos, t in enumerate(PROMPT[:16])]
    assert lease.release(pages, PROMPT[:16]) == 10
    nodes = sorted(sim.tree.iter_nodes(), key=lambda n: n.start)
    assert [bool(n.pages) for n in nodes] == [True, True]
    assert nodes[0].host_pages and not nodes[1].host_pages
    sim.check()


@pytest.mark.parametrize(("policy", "written_after"), [("write_through", (3, 3)),
                                                       ("write_through_selective", (0, 3))])
def test_write_through_policies_copy_down_when_cached_or_once_hot(policy, written_after):
    sim = Sim(num_pages=8, page_size=16, host_pages=8, policy=policy)
    sim.finish(sim.admit(PROMPT))
    sim.run_moves()
    assert sim.moved[0] == written_after[0]
    for _ in range(2):  # two hits make it hot
        sim.finish(sim.admit(PROMPT + [5]), cache=False)
    assert sim.moved[0] == written_after[1]
    sim.tree.evict(sim.alloc.num_pages)  # a host copy exists: dropped from the device alone
    sim.run_moves()
    assert sim.moved[0] == written_after[1]
    assert sim.admit(PROMPT + [6]).lease.match.host_length == 40
    sim.check()


def test_the_host_tier_must_match_the_page_size():
    with pytest.raises(ValueError, match="as many tokens"):
        RadixTree(PageAllocator(4, 16), host=HostTier(4, 8))
    with pytest.raises(ValueError, match="write policy"):
        HostTier(4, 16, "write_around")
