"""Data-parallel dispatch (tokenizer_worker/dispatch.py, replica_cache.py): the dispatcher's copy
of each replica's cache, built from real KV event batches of a real radix tree, matches what
that tree holds; and the routing rule (longest match, threshold, load imbalance, sessions,
dead replicas, round robin) on replicas fed that way."""

from __future__ import annotations

import random
import time

import msgspec
import numpy as np
import pytest

from engine.contracts.engine_config import EngineConfig
from engine.contracts.kv_events import KVEventBatch, chain_hashes
from engine.contracts.protocol import SeqOutput, TokenizedRequest, pack_ids
from engine.contracts.sampling_params import SamplingParams
from engine.server.dp_monitor import DispatchReports
from radix import OutOfPages
from scheduler.kv_events import BlockEvents
from tests.radix_sim import Sim
from tokenizer_worker.dispatch import Dispatcher, NoReplica, choose
from tokenizer_worker.replica_cache import ReplicaCache

PARAMS = SamplingParams()


class Engine:
    """One replica's radix tree publishing its events as the scheduler process does: one
    batch per step that changed the tree, sequence numbers from 0."""

    def __init__(self, page_size: int = 4, block_size: int = 4, num_pages: int = 256,
                 host_pages: int = 0) -> None:
        self.sim = Sim(num_pages=num_pages, page_size=page_size, host_pages=host_pages)
        self.events = BlockEvents(block_size)
        self.events.attach(self.sim.tree)
        self.sequence = 0

    def cache(self, tokens: list[int], namespace=None) -> None:
        self.sim.finish(self.sim.admit(tokens, namespace))

    def batches(self) -> list[tuple[int, bytes]]:
        """The batches published since the last call (at most one: one step)."""
        events = self.events.take()
        if not events:
            return []
        payload = msgspec.msgpack.encode(KVEventBatch(time.time(), events, 0))
        self.sequence += 1
        return [(self.sequence - 1, payload)]


def feed(dispatcher: Dispatcher, replica: int, engine: Engine) -> None:
    for sequence, payload in engine.batches():
        dispatcher.on_events(replica, sequence, payload)


def request(rid: str, ids: list[int], namespace=None, session_id=None) -> TokenizedRequest:
    return TokenizedRequest(rid=rid, prompt_ids=pack_ids(ids), params=PARAMS, reply_to=0,
                            namespace=namespace, session_id=session_id)


def ids(seed: int, n: int) -> list[int]:
    return random.Random(seed).choices(range(3, 4000), k=n)


# ---------------------------------------------------------------- the replica cache copy
@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("page_size,block_size", [(1, 1), (4, 4), (16, 16), (16, 8), (4, 6)])
def test_the_copy_matches_what_the_tree_caches(page_size, block_size, host):
    """Under random caching, eviction and resets, a prompt's match in the copy is the tree's
    own longest cached prefix, in whole blocks; with a host tier, blocks moving between the
    tiers ("GPU" and "CPU" events) stay matched while either holds them."""
    rng = random.Random(page_size * 31 + block_size)
    engine = Engine(page_size, block_size, num_pages=max(8, 400 // page_size),
                    host_pages=max(8, 600 // page_size) if host else 0)
    copy = ReplicaCache(block_size)
    heads = [[rng.randrange(40) for _ in range(rng.randrange(1, 50))] for _ in range(6)]
    for step in range(300):
        op = rng.random()
        if op < 0.7:
            tokens = rng.choice(heads) + [rng.randrange(40) for _ in range(rng.randrange(1, 30))]
            try:
                engine.cache(tokens, rng.choice([None, "tenant"]))
            except OutOfPages:
                pass
        elif op < 0.97:
            engine.sim.tree.evict(rng.randrange(1, 10))
            engine.sim.run_moves()
        elif sum(len(node.pages) for node in engine.sim.tree.iter_nodes()) <= engine.sim.alloc.num_pages:
            # (radix/pages.py refuses one eviction whose page lists, with the pages split
            # nodes share, add up to more than the pool: reported, not ours to change)
            engine.sim.tree.reset()
        for sequence, payload in engine.batches():
            copy.apply(sequence, payload)
        assert copy.num_blocks == len(set().union(*copy.media.values())), f"step {step}"
        for head in heads:
            probe = head + [rng.randrange(40) for _ in range(20)]
            for namespace in (None, "tenant"):
                cached = engine.sim.tree.peek_prefix(probe, namespace)
                blocks = copy.match(chain_hashes(namespace, np.array(probe), block_size))
                assert blocks == cached // block_size, f"step {step}"
    assert copy.resets == 0


def test_a_gap_in_the_events_drops_the_copy_and_starts_over():
    engine, copy = Engine(), ReplicaCache(4)
    a, b = ids(1, 16), ids(2, 16)
    engine.cache(a)
    (seq0, batch0), = engine.batches()
    copy.apply(seq0, batch0)
    engine.cache(b)
    engine.batches()  # lost on the way
    engine.cache(a + ids(3, 8))
    (seq2, batch2), = engine.batches()
    copy.apply(seq2, batch2)
    assert copy.resets == 1
    # a's first blocks were stored before the gap: forgotten, so its extension cannot be reached
    assert copy.match(chain_hashes(None, np.array(a + ids(3, 8)), 4)) == 0
    assert copy.match(chain_hashes(None, np.array(b), 4)) == 0
    # a restarted replica numbers its batches from 0 again: a fresh copy
    fresh = Engine()
    fresh.cache(b)
    (seq, batch), = fresh.batches()
    copy.apply(seq, batch)
    assert copy.resets == 2 and copy.match(chain_hashes(None, np.array(b), 4)) == 4


# ------------------------------------------------------------------------- routing
def two_replicas(**options) -> tuple[Dispatcher, list[Engine]]:
    return Dispatcher(2, 4, **options), [Engine(), Engine()]


def test_a_prompt_goes_where_its_longest_prefix_is_cached():
    dispatcher, engines = two_replicas()
    head_a, head_b = ids(10, 40), ids(11, 40)
    engines[0].cache(head_b)
    engines[1].cache(head_a[:24])
    engines[0].cache(head_a[:12])
    for r in (0, 1):
        feed(dispatcher, r, engines[r])
    assert dispatcher.route(request("x", head_a + ids(12, 8)))[0] == 1  # 24 cached beats 12
    assert dispatcher.route(request("y", head_b + ids(13, 8)))[0] == 0
    assert dispatcher.requests["x"].predicted == 24 and dispatcher.requests["y"].predicted == 40
    # the namespace is part of the match: the same tokens under a salt are cached nowhere
    assert dispatcher.route(request("z", head_b + ids(13, 8), namespace="salt"))[0] == 1


def test_a_match_below_the_threshold_goes_to_the_least_loaded_replica():
    prompt = ids(20, 64)
    for threshold, expected in ((0.5, 1), (0.2, 0)):
        dispatcher, engines = two_replicas(cache_threshold=threshold)
        engines[0].cache(prompt[:16])  # a quarter of the prompt
        feed(dispatcher, 0, engines[0])
        # 16 of 20 tokens cached: to replica 0, which is now the more loaded one
        assert dispatcher.route(request("busy", prompt[:16] + ids(21, 4)))[0] == 0
        assert dispatcher.route(request("p", prompt))[0] == expected  # 16 / 64 = 0.25


def test_imbalanced_loads_override_the_cache():
    dispatcher, engines = two_replicas(balance_abs=4, balance_rel=1.5)
    prompt = ids(30, 40)
    engines[0].cache(prompt)
    feed(dispatcher, 0, engines[0])
    for k in range(5):  # all to replica 0: it caches their head
        assert dispatcher.route(request(f"r{k}", prompt[:32] + ids(31 + k, 8)))[0] == 0
    # loads 5 vs 0: 5 - 0 > 4 and 5 > 0 * 1.5, imbalanced
    assert dispatcher.route(request("over", prompt[:32] + ids(39, 8)))[0] == 1
    # loads 5 vs 1: 4 is not > 4: the longest prefix again (40 tokens there, 32 coming on 1)
    assert dispatcher.route(request("back", prompt))[0] == 0
    # the rule itself: both limits must be passed
    facts = dict(matches=[10, 0], cached=[10, 0], alive=[True, True], block_size=4,
                 prompt_len=40, threshold=0.5, balance_abs=4)
    assert choose(loads=[20, 14], balance_rel=1.5, **facts) == 0  # 20 < 14 * 1.5
    assert choose(loads=[22, 14], balance_rel=1.5, **facts) == 1
    assert choose(loads=[22, 14], balance_rel=2.0, **facts) == 0


def test_a_burst_of_one_group_follows_its_first_request():
    """Before the first prompt's events arrive, the prompts in flight count as coming."""
    dispatcher, _ = two_replicas()
    head = ids(40, 64)
    first = dispatcher.route(request("first", head + ids(41, 8)))[0]
    dispatcher.route(request("other", ids(42, 64)))  # the other replica: least loaded
    assert dispatcher.route(request("second", head + ids(43, 8)))[0] == first
    dispatcher.finish("first")
    dispatcher.finish("second")
    assert not dispatcher.replicas[first].cache.coming


def test_a_session_stays_on_its_replica_and_moves_when_it_dies():
    dispatcher, engines = two_replicas()
    home = dispatcher.open_session("s", 30.0)
    elsewhere = 1 - home
    turn = ids(50, 40)
    engines[elsewhere].cache(turn)
    feed(dispatcher, elsewhere, engines[elsewhere])
    assert dispatcher.route(request("t1", turn, session_id="s")) == (home, None)
    lost, again = dispatcher.replica_down(home)
    assert lost == [] and [r.rid for r in again] == ["t1"]  # no output yet: can go elsewhere
    assert dispatcher.route(request("t2", turn, session_id="s")) == (elsewhere, 30.0)
    assert dispatcher.route(request("t3", turn, session_id="s")) == (elsewhere, None)
    assert dispatcher.close_session("s") == elsewhere


def test_a_dead_replica_gets_nothing_and_its_requests_fail_or_move():
    dispatcher, engines = two_replicas()
    prompt = ids(60, 40)
    engines[1].cache(prompt)
    feed(dispatcher, 1, engines[1])
    assert dispatcher.route(request("answered", prompt))[0] == 1
    assert dispatcher.route(request("waiting", prompt))[0] == 1
    dispatcher.on_output(SeqOutput("answered", 0, pack_ids([5]), prompt_tokens=40,
                                   cached_tokens=39))
    lost, again = dispatcher.replica_down(1)
    assert lost == ["answered"] and [r.rid for r in again] == ["waiting"]
    rep = dispatcher.replicas[1]
    assert rep.in_flight == 0 and rep.cache.num_blocks == 0 and rep.cache.resets == 1
    feed(dispatcher, 1, engines[1])  # late events of a dead replica change nothing
    assert dispatcher.route(request("next", prompt))[0] == 0
    assert dispatcher.replica_down(1) == ([], [])
    dispatcher.replica_down(0)
    with pytest.raises(NoReplica):
        dispatcher.route(request("none", prompt))
    rr = Dispatcher(2, 4, policy="round_robin")
    rr.replica_down(0)
    rr.replica_down(1)
    with pytest.raises(NoReplica):
        rr.route(request("none", prompt))


def test_round_robin_cycles_over_live_replicas():
    dispatcher = Dispatcher(3, 4, policy="round_robin")
    prompt = ids(70, 40)
    assert [dispatcher.route(request(f"a{k}", prompt))[0] for k in range(4)] == [0, 1, 2, 0]
    dispatcher.replica_down(1)
    assert [dispatcher.route(request(f"b{k}", prompt))[0] for k in range(3)] == [2, 0, 2]


def test_predicted_and_actual_cached_tokens_are_counted_per_replica():
    dispatcher, engines = two_replicas()
    prompt = ids(80, 42)
    engines[0].cache(prompt[:40])
    feed(dispatcher, 0, engines[0])
    assert dispatcher.route(request("a", prompt))[0] == 0
    dispatcher.on_output(SeqOutput("a", 0, pack_ids([5]), prompt_tokens=42, cached_tokens=40))
    assert dispatcher.route(request("never-admitted", prompt))[0] == 0
    dispatcher.finish("a")
    dispatcher.finish("never-admitted")  # aborted before admission: not counted
    stats = dispatcher.snapshot(0)
    assert (stats.replicas[0].predicted_cached_tokens, stats.replicas[0].actual_cached_tokens,
            stats.replicas[0].routed, stats.replicas[0].in_flight) == (40, 40, 2, 0)
    # the frontend sums the tokenizer workers' reports per replica
    reports = DispatchReports(2, num_pages=100)
    reports.add(stats)
    reports.add(msgspec.structs.replace(stats, tokenizer=1))
    view = reports.replicas()[0]
    assert (view.routed, view.predicted_cached_tokens, view.actual_cached_tokens) == (4, 80, 80)
    assert reports.total_stats().kv_pages_total == 200  # no replica has reported stats yet


@pytest.mark.parametrize("values,message", [
    (dict(dp_size=0), "--dp-size must be at least 1"),
    (dict(dp_size=2, dp_policy="random"), "--dp-policy must be"),
    (dict(dp_size=2, dp_cache_threshold=1.5), "--dp-cache-threshold must be at most 1"),
    (dict(dp_size=2, dp_balance_rel=0.5), "--dp-balance-rel must be at least 1"),
    (dict(dp_size=2, kv_events_endpoint="tcp://*:5557"), "publishes one engine's events"),
    (dict(kv_events_block_size=8), "needs --kv-events-endpoint"),
])
def test_bad_dp_flags_are_refused(values, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **values).validate()
    EngineConfig(model="m", dp_size=2, kv_events_block_size=8).validate()  # the dispatcher's
