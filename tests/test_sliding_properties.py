"""The radix machine of tests/test_radix_properties.py over a tree with sliding-window layers
(radix/sliding.py, radix/windows.py): the same operations, plus holders sliding their window
forward and prompts committed with their last window kept, at page sizes 1, 4 and 16 and
windows of 2 to 12 positions, with sliding pools from tight to roomy.

After every step, besides the radix machine's checks: both pools' accounting (every sliding
page's count equal to the windows holders hold plus the nodes' kept pages, evictable exactly
where no holder or locked node needs it, the two maps each other's inverse), every holder's
window holding its tokens' sliding KV, every node's kept pages holding its tokens, and every
match ending where the window before it is live. Then the match rule itself against a direct
reading of it, and a kept window surviving sliding eviction while a holder locks it.
"""

from __future__ import annotations

from array import array

import hypothesis.strategies as st
import numpy as np
from hypothesis import given, settings
from hypothesis.stateful import initialize, precondition, rule

import radix.pages
from radix import WRITE_POLICIES, Lease, OutOfPages, PageAllocator, RadixTree
from radix.sliding import SlidingKV
from radix.windows import usable_length
from tests.radix_sim import Sim
from tests.test_radix_properties import RadixMachine, TestRadixMachine, token_lists


class SlidingRadixMachine(RadixMachine):
    @initialize(page_size=st.sampled_from([1, 16, 4]), num_pages=st.integers(4, 48),
                vector_min=st.sampled_from([radix.pages.VECTOR_MIN_PAGES, 1, 10**9]),
                window=st.integers(2, 12), sliding_share=st.sampled_from([0.3, 0.6, 1.0]),
                host_pages=st.sampled_from([0, 0, 3, 12, 64]),
                host_share=st.sampled_from([0.0, 0.3, 1.0]),
                policy=st.sampled_from(WRITE_POLICIES))
    def setup(self, page_size: int, num_pages: int, vector_min: int, window: int,
              sliding_share: float, host_pages: int, host_share: float, policy: str) -> None:
        scale = 16 // page_size
        num_pages *= scale
        host_pages *= scale
        self.sim = Sim(num_pages, page_size, host_pages, policy, window=window,
                       sliding_pages=max(1, int(sliding_share * num_pages)),
                       host_sliding_pages=int(host_share * host_pages))
        self.external = []
        self.pins = []
        self.later = []
        self.finished = []  # (tokens, namespace) of sequences finished and cached
        self.saved_vector_min = radix.pages.VECTOR_MIN_PAGES
        radix.pages.VECTOR_MIN_PAGES = vector_min

    @precondition(lambda self: self.sim.running)
    @rule(index=st.integers(0, 1000), upto=st.integers(0, 40), keep=st.booleans())
    def commit(self, index: int, upto: int, keep: bool) -> None:
        """A prefilled chunk cached mid-life, or a whole prompt with its window kept."""
        seq = self.sim.running[index % len(self.sim.running)]
        upto = min(upto, len(seq.tokens))
        assert self.sim.commit(seq, upto, keep) <= upto
        assert self.sim.cached_len(seq.tokens[:upto], seq.namespace) == upto

    @precondition(lambda self: self.sim.running)
    @rule(index=st.integers(0, 1000))
    def slide(self, index: int) -> None:
        """A holder's next query is at its end: what its window left behind goes."""
        seq = self.sim.running[index % len(self.sim.running)]
        self.sim.slide(seq)
        sliding = self.sim.sliding
        assert seq.lease.swa_from == sliding.window_start(len(seq.tokens))
        # a holder's window: the pages of its last W positions, at most one more than W needs
        assert len(seq.pages) - seq.lease.swa_from <= -(-sliding.window // sliding.page_size) + 1

    @rule(num_pages=st.integers(0, 20))
    def evict_windows(self, num_pages: int) -> None:
        """Sliding eviction drops unlocked nodes' windows only, never a full page."""
        full_free = self.sim.alloc.num_free_pages
        freed = self.sim.tree._evict_sliding(num_pages)
        self.sim.run_moves()  # windows copied down to their nodes' host copies first
        assert self.sim.alloc.num_free_pages == full_free
        if freed < num_pages:
            assert self.sim.sliding.allocator.num_evictable_pages == 0

    @precondition(lambda self: self.sim.running)
    @rule(index=st.integers(0, 1000), cache=st.booleans())
    def finish(self, index: int, cache: bool) -> None:
        seq = self.sim.running[index % len(self.sim.running)]
        if cache:
            self.finished.append((list(seq.tokens), seq.namespace))
        self.sim.finish(seq, cache=cache)

    @precondition(lambda self: self.finished)
    @rule(index=st.integers(0, 1000), evict=st.booleans())
    def resend(self, index: int, evict: bool) -> None:
        """A finished sequence's tokens asked again, maybe after the sliding pool let every
        unlocked window go: the match may read windows that only the host tier kept for nodes
        on the device (``acquire`` loads them back)."""
        tokens, namespace = self.finished[index % len(self.finished)]
        if evict:
            self.sim.tree._evict_sliding(self.sim.sliding.allocator.num_pages)
            self.sim.run_moves()
        self.admit(tokens, namespace)

    @rule(prompts=st.lists(token_lists, min_size=1, max_size=3))
    def admit_together(self, prompts: list[list[int]]) -> None:
        """As the radix machine's, counting the sliding pages apart, as the planner does
        (windows loaded back from the host tier included): when both fit, every acquire
        succeeds."""
        leases = [self.sim.match(tokens) for tokens in prompts]
        loading: set = set()
        need = windows = 0
        for lease, tokens in zip(leases, prompts, strict=True):
            before = set(loading)
            need += lease.pages_to_acquire(len(tokens), loading)
            windows += lease.pages_to_acquire(len(tokens), before, windows=True)
        if (need > self.sim.tree.num_available_pages
                or windows > self.sim.sliding.num_available_pages):
            for lease in leases:
                lease.unlock()
            return
        for lease, tokens in zip(leases, prompts, strict=True):
            self.sim.take(lease, tokens)


TestSlidingRadixMachine = SlidingRadixMachine.TestCase
TestSlidingRadixMachine.settings = TestRadixMachine.settings


@settings(max_examples=300, deadline=None)
@given(live=st.lists(st.booleans(), max_size=30), page_size=st.sampled_from([1, 3, 16]),
       window=st.integers(2, 40), cut=st.integers(0, 40))
def test_a_match_ends_at_the_last_point_whose_window_is_live(live, page_size, window, cut):
    """``usable_length`` against a direct reading of the rule: a match of m tokens needs the
    sliding KV of positions [m + 1 - W, m)."""
    length = min(cut, len(live) * page_size)
    kept = array("q", [7 if x else -1 for x in live])

    def usable(m: int) -> bool:
        return all(live[p // page_size] for p in range(max(0, m + 1 - window), m))

    expected = max(m for m in range(length + 1) if usable(m))
    assert usable_length(kept, length, page_size, window) == expected


def test_a_resend_and_a_next_turn_hit_in_full_and_a_locked_window_survives():
    for page_size in (1, 4, 16):
        sim = Sim(64, page_size, window=10, sliding_pages=40)
        prompt = list(range(50, 90))
        seq = sim.admit(prompt)
        sim.slide(seq, retain_end=len(prompt))  # as the scheduler: the prompt's window stays
        sim.commit(seq, len(prompt), keep=True)  # until the tree keeps it
        sim.grow(seq, [1, 2, 3])
        sim.slide(seq)
        sim.finish(seq)
        sim.check()
        resend = sim.match(prompt)
        assert resend.length == len(prompt) - 1  # the window before the last token is kept
        turn = Lease(sim.tree, prompt + [1, 2, 3, 9])
        assert turn.length == len(prompt) + 3  # its whole history: the window at its end
        turn.unlock()
        sim.tree._evict_sliding(1000)  # the resend's lease locks its window
        again = sim.take(resend, prompt)
        sim.check()
        sim.finish(again)
        sim.tree._evict_sliding(1000)
        sim.check()
        assert sim.match(prompt).length == 0  # its window gone, nothing before it is usable
        sim.tree.reset()
        assert sim.sliding.allocator.num_free_pages == 40
        assert sim.alloc.num_free_pages == 64


def _serve_a_prompt_and_its_turn(sim: Sim) -> list[int]:
    """A 40-token prompt served as the scheduler serves it (its window kept until the tree
    keeps it), three tokens decoded and the sequence cached; returns the prompt."""
    prompt = list(range(50, 90))
    seq = sim.admit(prompt)
    sim.slide(seq, retain_end=len(prompt))
    sim.commit(seq, len(prompt), keep=True)
    sim.grow(seq, [1, 2, 3])
    sim.slide(seq)
    sim.finish(seq)
    return prompt


def _next_turn_then_reset(sim: Sim, prompt: list[int]) -> None:
    """The next turn of ``prompt`` (served with three more tokens) hits its whole history;
    then a reset leaves all four pools free."""
    turn = sim.take(sim.match(prompt + [1, 2, 3, 9]), prompt + [1, 2, 3, 9])
    assert turn.lease.length == len(prompt) + 3
    sim.check()
    sim.finish(turn)
    sim.tree.reset()
    sim.check()
    for alloc in (sim.alloc, sim.sliding.allocator, sim.host.allocator, sim.host.swa):
        assert alloc.num_free_pages == alloc.num_pages


def test_windows_go_down_to_the_host_tier_and_come_back_with_their_nodes():
    """Under each write policy: a prompt and its turn's windows leave the device with their
    nodes (the host tier's sliding pages), so the resend and the next turn still hit in full
    through host-only nodes, and loading them gives the holder the window's KV (the sim checks
    every slot); with no host sliding pages, no match reaches into the host part."""
    for page_size, policy, host_windows in ((1, "write_back", 40), (4, "write_through", 40),
                                            (16, "write_through_selective", 40),
                                            (4, "write_back", 0)):
        sim = Sim(64, page_size, 64, policy, window=10, sliding_pages=40,
                  host_sliding_pages=host_windows)
        prompt = _serve_a_prompt_and_its_turn(sim)
        for _ in range(2):  # write_through_selective copies down what was matched twice
            Lease(sim.tree, prompt + [1, 2, 3]).unlock()
            sim.run_moves()
        sim.tree.evict(1000)
        sim.run_moves()
        sim.check()
        assert sim.alloc.num_free_pages == 64 and sim.sliding.allocator.num_free_pages == 40
        resend = sim.match(prompt)
        if not host_windows:
            assert resend.length == 0 and resend.match.host_length == 0
            resend.unlock()
            continue
        assert resend.length == len(prompt) - 1 and resend.match.host_length == resend.length
        turn = Lease(sim.tree, prompt + [1, 2, 3, 9])
        assert turn.length == len(prompt) + 3 and turn.match.host_length == turn.length
        turn.unlock()
        again = sim.take(resend, prompt)  # loads the path and its window
        sim.check()
        sim.finish(again)
        sim.tree.evict(1000)  # back down: the loaded window is on the host already
        sim.run_moves()
        _next_turn_then_reset(sim, prompt)


def test_sliding_pages_run_out_apart_from_full_ones():
    """A holder asking for more sliding pages than exist gets OutOfPages, having changed
    nothing; the full pool's pages stay free."""
    alloc = PageAllocator(32, 4)
    tree = RadixTree(alloc, sliding=SlidingKV(3, 32, 4, 8))
    lease = Lease(tree, list(range(20)))
    try:
        lease.acquire(20)
    except OutOfPages as exc:
        assert "sliding-window pages" in str(exc)
    else:
        raise AssertionError("five pages fit a sliding pool of three")
    lease.release([])
    assert alloc.num_free_pages == 32
    tree.check(np.zeros(32, np.int64), np.zeros(3, np.int64))


def test_a_running_sequence_holds_its_window_and_a_pin_holds_the_kept_one():
    """The window a running sequence kept where its prompt ends costs nothing it cannot give
    back: its lock holds its full pages, and the kept window goes first when sliding pages run
    short; a session pin (a lease that never acquires) holds the windows it matched."""
    for page_size in (1, 4):
        sim = Sim(64, page_size, window=8, sliding_pages=48)
        prompt = list(range(100, 140))
        seq = sim.admit(prompt)
        sim.slide(seq, retain_end=len(prompt))
        sim.commit(seq, len(prompt), keep=True)
        sim.grow(seq, list(range(10)))
        sim.slide(seq)
        kept = sim.sliding.allocator.num_evictable_pages
        assert kept > 0 and sim.tree._evict_sliding(1000) == kept  # the prompt's window
        sim.check()
        sim.finish(seq)
        pin = Lease(sim.tree, prompt + list(range(10)), count=False)
        assert pin.length == len(prompt) + 10
        assert sim.tree._evict_sliding(1000) == 0  # the pin holds the window it matched
        pin.unlock()
        assert sim.tree._evict_sliding(1000) > 0
        sim.check()


def test_a_device_nodes_window_the_sliding_pool_evicted_comes_back_from_the_host_tier():
    """The sliding pool evicts a prompt's kept window while its full KV stays on the device:
    the window goes down to the host tier (under write_back with a host copy of the node made
    then), a resend and a next turn still hit in full, and acquiring loads the window into
    fresh sliding pages (the sim checks every slot), counted by ``pages_to_acquire``."""
    for page_size in (1, 4, 16):
        for policy in ("write_back", "write_through"):
            sim = Sim(64, page_size, 64, policy, window=10, sliding_pages=40,
                      host_sliding_pages=40)
            prompt = _serve_a_prompt_and_its_turn(sim)
            full_free = sim.alloc.num_free_pages
            assert sim.tree._evict_sliding(1000) > 0
            sim.run_moves()
            sim.check()
            assert sim.alloc.num_free_pages == full_free  # the full KV stayed on the device
            assert sim.sliding.allocator.num_free_pages == 40
            resend = sim.match(prompt)
            assert resend.length == len(prompt) - 1 and resend.match.host_length == 0
            window = -(-10 // page_size) + 1
            needs = resend.pages_to_acquire(len(prompt), windows=True)
            assert 0 < needs - resend.pages_to_acquire(len(prompt)) <= window
            loaded = sim.tree.stats.sliding_loaded_pages
            again = sim.take(resend, prompt)
            assert sim.tree.stats.sliding_loaded_pages > loaded
            sim.check()
            sim.finish(again)
            sim.tree._evict_sliding(1000)  # down again: its host copy has it already
            sim.run_moves()
            _next_turn_then_reset(sim, prompt)
