"""KV events with sliding-window layers in pages of their own (``--sliding-kv-ratio``): group 0
follows the tree's blocks, group 1 the windows its nodes keep, so a consumer's longest usable
match (tokenizer_worker/replica_cache.py) is the engine's exactly, under random inserts,
slides, commits and evictions of both pools; and the data-parallel dispatcher sends a prompt
to the replica whose usable match is longer, not the one with the longer full KV, served in
process with greedy tokens equal to transformers'."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest

from engine.contracts.engine_config import EngineConfig
from engine.contracts.kv_events import (
    SLIDING_WINDOW,
    BlockStored,
    KVEventBatch,
    chain_hashes,
)
from engine.contracts.protocol import TokenizedRequest, pack_ids
from engine.contracts.sampling_params import SamplingParams
from radix import OutOfPages
from radix.tree import _as_key
from scheduler.kv_events import BlockEvents
from tests.radix_sim import Sim
from tests.test_kv_events_tree import tree_blocks
from tests.test_scheduler import Harness, hf_greedy
from tests.test_sliding_kv import gemma_dir, hf_gemma  # noqa: F401 (fixtures)
from tokenizer_worker.dispatch import Dispatcher
from tokenizer_worker.replica_cache import ReplicaCache


def kept_blocks(tree, block_size: int, host: bool = False) -> set[int]:
    """Every block whose sliding KV the node holding its last token keeps (``host``: in its
    host copy), from scratch."""
    kept = set()
    for namespace, root in tree._roots.items():
        stack = [(root, [])]
        while stack:
            node, prefix = stack.pop()
            path = prefix + np.frombuffer(node.key, dtype=np.int32).tolist()
            hashes = chain_hashes(namespace, np.asarray(path), block_size)
            first = node.start // block_size
            held = node.host_swa_pages if host else node.swa_pages
            for k in range(first, node.end // block_size):
                if held and held[k - first] >= 0:
                    kept.add(hashes[k])
            stack.extend((child, path) for child in node.children.values())
    return kept


class Feed:
    """A replica's events on their way to a consumer, through the wire format."""

    def __init__(self, events: BlockEvents, consumer) -> None:
        self.events, self.consumer, self.sequence = events, consumer, 0

    def __call__(self) -> list:
        taken = self.events.take()
        if taken:
            self.consumer(self.sequence, msgspec.msgpack.encode(KVEventBatch(0.0, taken)))
            self.sequence += 1
        return taken


@pytest.mark.parametrize("page_size,window,host", [(1, 6, False), (4, 8, False), (4, 6, False),
                                                   (1, 6, True), (4, 6, True)])
def test_a_consumer_computes_the_engines_usable_match(page_size, window, host):
    """``host``: beside a host tier (write-back) whose copies carry windows: a match through
    host-only nodes reads their host copies' windows, and the consumer, told of them by
    group 1's ``CPU`` events, agrees."""
    rng = random.Random(page_size * 10 + window + host)
    sim = Sim(num_pages=320 // page_size, page_size=page_size, window=window,
              sliding_pages=140 // page_size, host_pages=(400 // page_size) * host,
              host_sliding_pages=(200 // page_size) * host)
    events = BlockEvents(page_size)
    events.attach(sim.tree)
    cache = ReplicaCache(page_size)
    feed = Feed(events, cache.apply)
    heads = [[rng.randrange(30) for _ in range(rng.randrange(8, 40))] for _ in range(5)]
    asked: list[tuple[list[int], str | None]] = []
    dropped = hits_through_host = 0
    for step in range(400):
        op = rng.random()
        if op < 0.45 or not sim.running:
            tokens = rng.choice(heads) + [rng.randrange(30) for _ in range(rng.randrange(1, 30))]
            namespace = rng.choice([None, "tenant-a"])
            asked.append((tokens, namespace))
            try:
                sim.admit(tokens, namespace)
            except OutOfPages:
                pass
        elif op < 0.55:
            sim.slide(rng.choice(sim.running))
        elif op < 0.65:  # a prompt committed whole, then decoded on
            seq = rng.choice(sim.running)
            sim.commit(seq, len(seq.tokens), keep=True)
            sim.slide(seq)
            try:
                sim.grow(seq, [rng.randrange(30) for _ in range(rng.randrange(1, 3 * window))])
            except OutOfPages:
                pass
        elif op < 0.9:
            seq = rng.choice(sim.running)
            asked.append((list(seq.tokens), seq.namespace))
            sim.finish(seq, cache=rng.random() < 0.9)
        else:
            sim.tree.evict(rng.randrange(1, 12))
            if host:
                sim.run_moves()
        for event in feed():
            if isinstance(event, BlockStored) and event.group_idx == 1:
                assert event.kv_cache_spec_kind == SLIDING_WINDOW
                assert event.kv_cache_spec_sliding_window == window
            dropped += type(event).__name__ == "BlockRemoved" and event.group_idx == 1
        assert set(cache.held) == set(tree_blocks(sim.tree, page_size)), f"step {step}"
        assert cache.windows == kept_blocks(sim.tree, page_size), f"step {step}"
        assert cache.host_windows == kept_blocks(sim.tree, page_size, host=True), f"step {step}"
        for tokens, namespace in rng.sample(asked, min(len(asked), 6)):
            # a resend, a next turn (windows are kept where prompts end) or a shorter prompt
            query = rng.choice([tokens, tokens + [99],
                                tokens[: rng.randrange(1, len(tokens) + 1)] + [99]])
            root = sim.tree._roots.get(namespace)
            full = 0 if root is None else sim.tree._walk(
                root, _as_key(query), len(query), collect=False, split=False)[1]
            whole = full - full % page_size
            expected = sim.tree.peek_prefix(query, namespace, max_len=whole)
            got = cache.match(chain_hashes(namespace, np.asarray(query), page_size))
            assert got * page_size == expected, f"step {step}: {query}"
            hits_through_host += expected > sim.tree._device_end(
                sim.tree._walk(root, _as_key(query), expected, collect=False,
                               split=False)[0]) if expected else 0
        sim.check()
    assert dropped, "no window was dropped"
    assert cache.window == window
    if host:
        assert hits_through_host, "no match read windows from the host tier"


def test_events_name_their_group_only_with_sliding_pages():
    plain = Sim(num_pages=64, page_size=4)
    events = BlockEvents(4)
    events.attach(plain.tree)
    plain.finish(plain.admit(list(range(1, 14))))
    (stored,) = events.take()
    assert stored.group_idx is None and stored.kv_cache_spec_kind is None
    assert b"group_idx" not in msgspec.msgpack.encode(stored)  # vLLM's schema, unchanged
    sliding = Sim(num_pages=64, page_size=4, window=8, sliding_pages=32)
    with pytest.raises(ValueError, match="--kv-events-block-size must be --page-size"):
        BlockEvents(8).attach(sliding.tree)
    events = BlockEvents(4)
    events.attach(sliding.tree)
    sliding.finish(sliding.admit(list(range(1, 14))))
    full, window = events.take()
    assert (full.group_idx, full.kv_cache_spec_kind) == (0, "full_attention")
    assert len(full.block_hashes) == 3
    # the window where the 13 tokens end: positions 5-12, pages 1-3, of which 1 and 2 are blocks
    assert (window.group_idx, window.kv_cache_spec_sliding_window) == (1, 8)
    assert window.block_hashes == full.block_hashes[1:]
    assert window.parent_block_hash == full.block_hashes[0]


def test_configs_with_kv_events_and_replicas_are_accepted(gemma_dir):  # noqa: F811
    for option in ({"kv_events_endpoint": "tcp://*:5557"}, {"dp_size": 2}):
        EngineConfig(model=gemma_dir, sliding_kv_ratio=0.5, **option).validate()
    with pytest.raises(ValueError, match="--kv-events-block-size must be --page-size"):
        EngineConfig(model=gemma_dir, sliding_kv_ratio=0.5, dp_size=2, page_size=16,
                     kv_events_block_size=32).validate()


GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


class Replica:
    """A scheduler and worker in process, its events feeding the dispatcher."""

    def __init__(self, model: str, index: int, dispatcher: Dispatcher) -> None:
        self.h = Harness(model, page_size=4, num_pages=512, sliding_kv_ratio=0.5,
                         chunked_prefill_size=24, max_prefill_tokens=64)
        events = BlockEvents(4)
        events.attach(self.h.sched.tree)
        self.feed = Feed(events, lambda seq, payload: dispatcher.on_events(index, seq, payload))


def serve(dispatcher: Dispatcher, replicas: list[Replica], rid: str, prompt: list[int]) -> int:
    """Route ``prompt``, run it on its replica, tell the dispatcher; the replica's index."""
    request = TokenizedRequest(rid=rid, prompt_ids=pack_ids(prompt), params=GREEDY, reply_to=0)
    index, _ = dispatcher.route(request)
    replica = replicas[index]
    replica.h.sched.add_request(request)
    replica.h.run()
    (final,) = replica.h.finals[rid]
    dispatcher.on_output(final)
    dispatcher.finish(rid)
    replica.feed()
    return index


def test_dispatch_goes_to_the_longer_usable_match(gemma_dir, hf_gemma):  # noqa: F811
    """Replica 0 caches a long prompt sharing 48 tokens with the query, but keeps windows only
    where that prompt and its reply end; replica 1 caches the query's first 32 tokens as a
    prompt of their own, with the window where they end. The query's full KV match is 48 tokens
    on replica 0 and its usable match 0; on replica 1 both are 32: it goes there and hits the
    32 tokens the dispatcher predicted."""
    dispatcher = Dispatcher(2, 4)
    replicas = [Replica(gemma_dir, i, dispatcher) for i in range(2)]
    rng = np.random.default_rng(4)
    head = rng.integers(3, 90, 64).tolist()
    long, short = head + rng.integers(3, 90, 24).tolist(), head[:32]
    query = head[:48] + rng.integers(3, 90, 8).tolist()
    assert serve(dispatcher, replicas, "long", long) == 0  # both empty: the lower index
    assert serve(dispatcher, replicas, "short", short) == 1  # no usable match: fewer blocks
    hashes = chain_hashes(None, np.asarray(query), 4)
    caches = [r.cache for r in dispatcher.replicas]
    full = [next((k for k, h in enumerate(hashes) if h not in c.held), len(hashes))
            for c in caches]
    assert full == [12, 8]  # by full KV alone replica 0 would win
    assert [c.match(hashes) for c in caches] == [0, 8]
    # the engines' own usable matches
    assert [r.h.sched.tree.peek_prefix(query, max_len=len(query) - 1)
            for r in replicas] == [0, 32]
    assert serve(dispatcher, replicas, "query", query) == 1
    assert replicas[1].h.finals["query"][0].cached_tokens == 32
    assert dispatcher.replicas[1].predicted_cached_tokens == 32
    assert dispatcher.replicas[1].actual_cached_tokens == 32
    for rid, prompt, r in (("long", long, 0), ("short", short, 1), ("query", query, 1)):
        assert replicas[r].h.outputs[rid][0] == hf_greedy(hf_gemma, prompt, 20), rid
    for r in replicas:
        sliding = r.h.sched.tree.sliding.allocator
        assert sliding.num_pinned_pages == 0
        r.h.sched.tree.reset()
        assert sliding.num_free_pages == sliding.num_pages
        assert r.h.sched.alloc.num_free_pages == r.h.sched.alloc.num_pages
