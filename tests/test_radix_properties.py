"""Random operation sequences against the radix tree and allocator (hypothesis), driven through
the lease API (radix/lease.py) at page sizes 1, 4 and 16: admit, commit a prefix mid-life, grow,
fork, finish with or without caching, unlock early, pin without pages, evict, reset, and pages
held by a lease that matched nothing; without a host tier and with one (each write policy), so
nodes move down on eviction or when cached or hit, and back up when matched or inserted again.

After every step: the accounting invariant in both tiers (``check`` with the running
sequences' references), every running sequence's table holding its own tokens, every locked
path still in the tree, every node's KV holding its tokens in each tier it is in, and, on every
match, that each matched slot (device or host) holds the queried token at that position.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import radix.pages
from radix import WRITE_POLICIES, Lease, OutOfPages, PageAllocator, RadixTree
from tests.radix_sim import Sim

# A small alphabet makes shared prefixes, splits and divergences common.
token_lists = st.lists(st.integers(0, 3), min_size=1, max_size=40)


class RadixMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 16, 4]), num_pages=st.integers(4, 48),
                vector_min=st.sampled_from([radix.pages.VECTOR_MIN_PAGES, 1, 10**9]),
                host_pages=st.sampled_from([0, 0, 3, 12, 64]),
                policy=st.sampled_from(WRITE_POLICIES))
    def setup(self, page_size: int, num_pages: int, vector_min: int, host_pages: int,
              policy: str) -> None:
        scale = 16 // page_size  # same slot budget at every page size
        self.sim = Sim(num_pages * scale, page_size, host_pages * scale, policy)
        self.external: list[tuple[Lease, list[int]]] = []  # pages of leases that matched nothing
        self.pins: list[Lease] = []
        self.later: list[tuple[Lease, list[int]]] = []  # matched, not acquired yet
        # The allocator's per-page loop and its vectorised path must keep identical books.
        self.saved_vector_min = radix.pages.VECTOR_MIN_PAGES
        radix.pages.VECTOR_MIN_PAGES = vector_min

    def teardown(self) -> None:
        if hasattr(self, "saved_vector_min"):
            radix.pages.VECTOR_MIN_PAGES = self.saved_vector_min

    @rule(tokens=token_lists, namespace=st.sampled_from([None, None, "b"]))
    def admit(self, tokens: list[int], namespace) -> None:
        try:
            self.sim.admit(tokens, namespace)
        except OutOfPages:
            # Admission failure must leave every holder as it was (the invariant checks it);
            # what it evicted before giving up moved down all the same.
            self.sim.run_moves()

    @rule(tokens=token_lists)
    def match_for_later(self, tokens: list[int]) -> None:
        """A lease matched now and acquired later: others may load its host part first."""
        self.later.append((self.sim.match(tokens), tokens))

    @precondition(lambda self: self.later)
    @rule(index=st.integers(0, 1000), unloaded=st.booleans())
    def admit_matched(self, index: int, unloaded: bool) -> None:
        """... into the tree (``acquire``) or into its own pages, then committed
        (``acquire_unloaded``, the scheduler's loader-thread path)."""
        lease, tokens = self.later.pop(index % len(self.later))
        try:
            if unloaded:
                self.sim.take_unloaded(lease, tokens)
            else:
                self.sim.take(lease, tokens)
        except OutOfPages:
            lease.unlock()
            self.sim.run_moves()

    @rule(prompts=st.lists(token_lists, min_size=1, max_size=3))
    def admit_together(self, prompts: list[list[int]]) -> None:
        """Samples of one request admitted as one, as the planner does: when what they count
        together (host-tier loads they share counted once) fits, every acquire succeeds."""
        leases = [self.sim.match(tokens) for tokens in prompts]
        loading: set = set()
        need = sum(lease.pages_to_acquire(len(tokens), loading)
                   for lease, tokens in zip(leases, prompts, strict=True))
        if need > self.sim.available_pages():
            for lease in leases:
                lease.unlock()
            return
        for lease, tokens in zip(leases, prompts, strict=True):
            self.sim.take(lease, tokens)

    @precondition(lambda self: self.sim.running)
    @rule(index=st.integers(0, 1000), cache=st.booleans())
    def finish(self, index: int, cache: bool) -> None:
        self.sim.finish(self.sim.running[index % len(self.sim.running)], cache=cache)

    @precondition(lambda self: self.sim.running)
    @rule(index=st.integers(0, 1000))
    def fork(self, index: int) -> None:
        self.sim.fork(self.sim.running[index % len(self.sim.running)])

    @precondition(lambda self: self.sim.running)
    @rule(index=st.integers(0, 1000), upto=st.integers(0, 40))
    def commit(self, index: int, upto: int) -> None:
        """A prefilled chunk cached mid-life; the lock moves onto it."""
        seq = self.sim.running[index % len(self.sim.running)]
        upto = min(upto, len(seq.tokens))
        cached = self.sim.commit(seq, upto)
        assert cached <= upto
        assert self.sim.tree.peek_prefix(seq.tokens[:upto], seq.namespace) == upto

    @precondition(lambda self: self.sim.running)
    @rule(index=st.integers(0, 1000), tokens=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def grow(self, index: int, tokens: list[int]) -> None:
        """Decoding: more tokens in fresh pages (a fork copies its shared page first)."""
        seq = self.sim.running[index % len(self.sim.running)]
        before = (list(seq.pages), seq.shares_last_page)
        try:
            self.sim.grow(seq, tokens)
        except OutOfPages:
            assert (seq.pages, seq.shares_last_page) == before

    @precondition(lambda self: self.sim.running)
    @rule(index=st.integers(0, 1000))
    def unlock_early(self, index: int) -> None:
        """A holder lets its match go (a swap-out): its own table stays valid."""
        seq = self.sim.running[index % len(self.sim.running)]
        self.sim.unlock(seq)
        with pytest.raises(RuntimeError):
            seq.lease.acquire(len(seq.tokens))

    @rule(tokens=token_lists, namespace=st.sampled_from([None, "b"]))
    def pin(self, tokens: list[int], namespace) -> None:
        """A session pin: a lease that holds no pages, only the lock."""
        self.pins.append(Lease(self.sim.tree, tokens, namespace, count=False))
        self.sim.run_moves()

    @precondition(lambda self: self.pins)
    @rule()
    def unpin(self) -> None:
        self.pins.pop(0).unlock()

    @rule(tokens=token_lists, max_len=st.integers(0, 40))
    def match(self, tokens: list[int], max_len: int) -> None:
        lease = Lease(self.sim.tree, tokens, max_len=max_len)
        self.sim.run_moves()
        assert lease.length <= min(max_len, len(tokens))
        self.sim.verify_match(tokens, lease.match)
        lease.unlock()

    @rule(num_pages=st.integers(0, 20))
    def evict(self, num_pages: int) -> None:
        before = self.sim.alloc.num_free_pages
        freed = self.sim.tree.evict(num_pages)
        self.sim.run_moves()
        assert self.sim.alloc.num_free_pages == before + freed
        if freed < num_pages:
            assert self.sim.alloc.num_evictable_pages == 0

    @rule()
    def reset(self) -> None:
        """Everything unlocked leaves both tiers."""
        self.sim.tree.reset()
        self.sim.run_moves()
        assert self.sim.alloc.num_evictable_pages == 0
        if self.sim.host is not None:
            assert self.sim.host.allocator.num_evictable_pages == 0

    @rule(n=st.integers(1, 6))
    def alloc_external(self, n: int) -> None:
        holder = Lease(self.sim.tree, [], count=False)
        try:
            self.external.append((holder, holder.alloc_pages(n)))
            self.sim.run_moves()
        except OutOfPages:
            self.sim.run_moves()  # what it evicted before giving up moved down all the same
            assert self.sim.available_pages() < n
            holder.release([])

    @precondition(lambda self: self.external)
    @rule()
    def free_external(self) -> None:
        holder, pages = self.external.pop()
        holder.release(pages)

    @invariant()
    def accounting(self) -> None:
        refs = self.sim.external_refs()
        for _, pages in self.external:
            for p in pages:
                refs[p] += 1
        self.sim.tree.check(refs, self.sim.external_swa_refs(self.external))
        self.sim.check_holders()
        self.sim.check_nodes()


TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), token_lists), min_size=1, max_size=25))
def test_page_size_16_matches_exactly_like_page_size_1(ops):
    """Token granularity: the same inserts and queries match the same token counts."""
    trees = [RadixTree(PageAllocator(4096, page_size)) for page_size in (1, 16)]
    for is_insert, tokens in ops:
        lengths = []
        for tree in trees:
            lease = Lease(tree, tokens, max_len=0 if is_insert else None)
            if is_insert:
                pages, _ = lease.acquire(len(tokens))
                lengths.append(lease.release(pages, tokens))
            else:
                lease.unlock()
                lengths.append(lease.length)
        assert lengths[0] == lengths[1]
    for tree in trees:
        tree.check()
