"""Profiler core: trace format, generators, offline replay against brute force, policies and
miss attribution."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.profiler.attribution import attribute, per_request
from engine.profiler.baselines import BlockHashCache, run_block_hash
from engine.profiler.replay import CacheTooSmall, min_pages
from engine.profiler.simulate import (
    replay_block_hash,
    replay_radix,
    replay_unlimited,
    run_profile,
    run_sweep,
    sweep_sizes,
)
from engine.profiler.trace import (
    ReplayRequest,
    TraceError,
    load_requests,
    parse_line,
    pseudo_output,
    read_trace,
    write_trace,
)
from engine.profiler.workload import KINDS, generate
from radix import Lease, PageAllocator, RadixTree
from radix.eviction import lfu, uses


def req(i: int, prompt: list[int], output: list[int] = (),
        namespace: str | None = None) -> ReplayRequest:
    return ReplayRequest(f"r{i}", float(i), np.array(prompt, dtype=np.int32),
                   np.array(output, dtype=np.int32), namespace)


def small_params(kind: str):
    sizes = {
        "shared-prefix": dict(groups=3, prompts_per_group=4, system_len=40, question_len=9,
                              output_len=5),
        "multi-turn": dict(conversations=3, turns=3, system_len=30, turn_len=8, output_len=10),
        "tree": dict(trees=2, depth=2, width=2, root_len=30, branch_len=5, thought_len=7),
        "few-shot": dict(tasks=2, pool=4, shots=2, instruction_len=10, example_len=12,
                         query_len=6, output_len=3, requests=10),
        "random": dict(requests=10, prompt_len=20, output_len=4),
    }
    return KINDS[kind].params(**sizes[kind])


# ------------------------------------------------------------------- trace
def test_trace_roundtrip_and_arrival_order(tmp_path):
    lines = [
        {"id": "b", "arrival": 2.0, "prompt_token_ids": [1, 2, 3], "max_tokens": 4,
         "namespace": "tenant-1"},
        {"id": 7, "arrival": 0.5, "messages": [{"role": "user", "content": "hi"}],
         "output_token_ids": [5, 6], "session_id": "s"},
        {"id": "c", "arrival": 1.0, "prompt": "hello", "max_tokens": 2},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    trace = read_trace(path)
    assert [r.id for r in trace] == ["7", "c", "b"]
    assert trace[0].output_len == 2 and trace[2].output_len == 4
    write_trace(tmp_path / "u.jsonl", trace)
    assert read_trace(tmp_path / "u.jsonl") == trace


@pytest.mark.parametrize("line, message", [
    ({"arrival": 0, "prompt": "x", "max_tokens": 1}, "needs an 'id'"),
    ({"id": "a", "arrival": -1, "prompt": "x", "max_tokens": 1}, "arrival"),
    ({"id": "a", "arrival": 0, "prompt": "x", "prompt_token_ids": [1], "max_tokens": 1},
     "exactly one of"),
    ({"id": "a", "arrival": 0, "prompt_token_ids": [1, -2], "max_tokens": 1}, "non-negative"),
    ({"id": "a", "arrival": 0, "prompt_token_ids": [1]}, "output_token_ids or max_tokens"),
    ({"id": "a", "arrival": 0, "prompt": "x", "max_tokens": 1, "temperature": 0}, "unknown"),
])
def test_trace_errors_name_the_problem(line, message):
    with pytest.raises(TraceError, match=message):
        parse_line(line, "t.jsonl:3")


def test_max_tokens_only_gives_outputs_fixed_by_the_request_id():
    trace = [parse_line({"id": "q", "arrival": 0, "prompt_token_ids": [1, 2], "max_tokens": 6},
                        "line")]
    first, second = load_requests(trace)[0].output, load_requests(trace)[0].output
    assert len(first) == 6 and np.array_equal(first, second)
    assert not np.array_equal(first, pseudo_output("other", 6))
    with pytest.raises(TraceError, match="--tokenizer"):
        load_requests([parse_line({"id": "t", "arrival": 0, "prompt": "hi", "max_tokens": 1},
                                  "line")])


# -------------------------------------------------------------- generators
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_generators_are_deterministic_for_a_seed(kind):
    params = small_params(kind)
    first = generate(kind, params, seed=3)
    assert first == generate(kind, params, seed=3)
    assert first != generate(kind, params, seed=4)
    arrivals = [r.arrival for r in first]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert len({r.id for r in first}) == len(first)


def test_generator_shapes():
    shared = generate("shared-prefix", small_params("shared-prefix"), seed=0)
    assert len(shared) == 12
    assert len({tuple(r.prompt_token_ids[:40]) for r in shared}) == 3
    assert all(len(r.prompt_token_ids) == 49 and r.output_len == 5 for r in shared)

    turns = generate("multi-turn", small_params("multi-turn"), seed=0)
    assert len(turns) == 9 and len({tuple(r.prompt_token_ids[:30]) for r in turns}) == 1
    by_session: dict[str, list] = {}
    for r in turns:
        by_session.setdefault(r.session_id, []).append(r)
    for history in by_session.values():
        for before, after in zip(history, history[1:], strict=False):
            sent = before.prompt_token_ids + before.output_token_ids
            assert after.prompt_token_ids[: len(sent)] == sent  # the whole history re-sent

    trees = generate("tree", small_params("tree"), seed=0)
    assert len(trees) == 2 * (2 + 4)
    zipf = dataclasses.replace(small_params("shared-prefix"), popularity="zipf", groups=6)
    assert len(generate("shared-prefix", zipf, seed=0)) == 6 * 4
    with pytest.raises(ValueError, match="more than the pool"):
        generate("few-shot", dataclasses.replace(small_params("few-shot"), shots=9), seed=0)


# -------------------------------------------------- replay vs brute force
def lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def brute_force(requests: list[ReplayRequest]) -> tuple[list[int], list[int]]:
    """Per request: longest common prefix of its prompt with any earlier prompt + output in
    its namespace, capped at len - 1; and the same counted in whole 16-token blocks."""
    tokens, blocks = [], []
    for i, r in enumerate(requests):
        common = max((lcp(np.concatenate([e.prompt, e.output]), r.prompt)
                      for e in requests[:i] if e.namespace == r.namespace), default=0)
        tokens.append(min(common, len(r.prompt) - 1))
        blocks.append(16 * min(common // 16, (len(r.prompt) - 1) // 16))
    return tokens, blocks


@st.composite
def traces(draw, alphabet: int = 3, max_requests: int = 10, max_tail: int = 40,
           max_output: int = 20) -> list[ReplayRequest]:
    """Requests over a tiny alphabet (3 tokens unless told), most of them extending an earlier
    sequence, so prefixes are shared at every length and boundaries fall anywhere in a page."""
    requests: list[ReplayRequest] = []
    for i in range(draw(st.integers(1, max_requests))):
        namespace = draw(st.sampled_from([None, "a"]))
        head: list[int] = []
        if requests and draw(st.booleans()):
            base = requests[draw(st.integers(0, len(requests) - 1))]
            full = np.concatenate([base.prompt, base.output]).tolist()
            head = full[: draw(st.integers(0, len(full)))]
        tail = draw(st.lists(st.integers(0, alphabet - 1), min_size=0 if head else 1,
                             max_size=max_tail))
        output = draw(st.lists(st.integers(0, alphabet - 1), max_size=max_output))
        requests.append(req(i, head + tail, output, namespace))
    return requests


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=traces(), page_size=st.sampled_from([1, 3, 16]))
def test_unlimited_replay_matches_brute_force_and_blocks_never_win(requests, page_size):
    tokens, blocks = brute_force(requests)
    unlimited = replay_unlimited(requests, page_size)
    assert unlimited.cached.tolist() == tokens
    block = replay_block_hash(requests, None)
    assert block.cached.tolist() == blocks
    assert (block.cached <= unlimited.cached).all()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=traces(), page_size=st.sampled_from([1, 4]), extra=st.integers(0, 12))
def test_limited_cache_attribution_sums_to_the_misses(requests, page_size, extra):
    num_pages = min_pages(requests, page_size) + extra
    profile = run_profile(requests, num_pages, page_size, "lru")  # checks the tree at the end
    parts = per_request(profile)
    prompt = profile.prompt_tokens
    assert (parts["cold"] + parts["evicted"] + profile.radix.cached == prompt).all()
    assert (parts["cold"] + parts["short_head"] + parts["block_granularity"]
            + parts["block_evicted"] + profile.block.cached == prompt).all()
    unlimited = profile.unlimited.cached
    assert (parts["short_head"] == np.where(unlimited < 16, unlimited, 0)).all()
    totals = attribute(profile)
    assert totals.missed == totals.prompt_tokens - totals.hit
    assert totals.block_missed == totals.prompt_tokens - totals.block_hit


def test_attribution_on_a_multi_turn_trace_with_eviction():
    requests = load_requests(generate("multi-turn", small_params("multi-turn"), seed=1))
    profile = run_profile(requests, min_pages(requests, 4) + 2, 4, "lru")
    totals = attribute(profile)
    assert totals.evicted > 0 and totals.cold > 0
    assert totals.cold + totals.evicted == totals.prompt_tokens - totals.hit
    assert profile.radix.evicted_tokens > 0 and profile.unlimited.evicted_tokens == 0
    assert profile.radix.peak_tokens <= profile.num_pages * 4


def test_a_shared_head_shorter_than_a_block_is_its_own_category():
    head = list(range(100, 150))
    requests = [req(0, head), req(1, head[:5] + list(range(900, 910))),
                req(2, head[:40] + [950, 951]), req(3, head[:16] + [960])]
    profile = run_profile(requests, 64, 4)
    assert profile.unlimited.cached.tolist() == [0, 5, 40, 16]
    assert profile.block_unlimited.cached.tolist() == [0, 0, 32, 16]
    parts = per_request(profile)
    # 5 shared tokens are no 16-token block; of 40, the 8 past block 2 are block granularity;
    # 16 is a whole block, which block hashing finds.
    assert parts["short_head"].tolist() == [0, 5, 0, 0]
    assert parts["block_granularity"].tolist() == [0, 0, 8, 0]
    totals = attribute(profile)
    assert (totals.short_head, totals.block_granularity, totals.cold) == (5, 8, 50 + 10 + 2 + 1)
    assert totals.block_missed == totals.prompt_tokens - totals.block_hit == 50 + 15 + 10 + 1


def test_namespaces_never_share():
    requests = [req(0, [1, 2, 3, 4], [5], "a"), req(1, [1, 2, 3, 4, 5], [], "b"),
                req(2, [1, 2, 3, 4, 5, 6], [], "a")]
    assert replay_unlimited(requests, 2).cached.tolist() == [0, 0, 5]


# ------------------------------------------------------------------ policies
A, B, C = ([k] * 8 for k in (1, 2, 3))


def policy_hits(prompts: list[list[int]], policy: str) -> list[int]:
    # 5 pages of 4 tokens: two 8-token prefixes (2 pages each) plus a running request's page.
    return replay_radix([req(i, p) for i, p in enumerate(prompts)], 5, 4, policy).cached.tolist()


def test_lfu_keeps_a_reused_prefix_that_lru_evicts():
    trace = [A, A, A, B, C, A]  # C's pages evict A (LRU: oldest) or B (LFU: never reused)
    assert policy_hits(trace, "lru") == [0, 7, 7, 0, 0, 0]
    assert policy_hits(trace, "lfu") == [0, 7, 7, 0, 0, 7]


def test_lfu_holds_on_to_a_prefix_that_went_cold():
    trace = [A, A, A, B, B, C, B]  # A was hot once; B is hot now
    assert policy_hits(trace, "lru") == [0, 7, 7, 0, 7, 0, 7]
    assert policy_hits(trace, "lfu") == [0, 7, 7, 0, 7, 0, 0]


def test_lfu_counts_matches_not_inserts():
    tree = RadixTree(PageAllocator(8, 4), eviction_key=lfu)

    def cache(tokens: list[int]) -> None:  # a request that matches nothing and caches tokens
        lease = Lease(tree, tokens, max_len=0)
        pages, _ = lease.acquire(len(tokens))
        lease.release(pages, tokens)

    def matched_node(tokens: list[int]):
        lease = Lease(tree, tokens, max_len=len(tokens) - 1)
        lease.unlock()
        return lease.match.node

    cache(A)
    node = matched_node(A)
    assert uses(node) == 1
    cache(A)  # a re-insert refreshes recency only
    assert uses(node) == 1
    assert uses(matched_node(A)) == 2
    tree.check()


def test_a_match_that_leaves_no_room_is_dropped_and_counted():
    requests = [req(0, [1] * 7), req(1, [1] * 7 + [9, 9])]  # 2 pages, then 3 of 4 tokens
    squeezed = replay_radix(requests, 3, 4)  # the locked partial page leaves 1 page free
    assert squeezed.cached.tolist() == [0, 0] and squeezed.dropped_matches == 1
    roomy = replay_radix(requests, 4, 4)
    assert roomy.cached.tolist() == [0, 7] and roomy.dropped_matches == 0


def test_cache_too_small_is_a_sentence():
    with pytest.raises(CacheTooSmall, match="needs 3 pages of 4 tokens"):
        replay_radix([req(0, list(range(10)), [1, 2])], 2, 4)


# ----------------------------------------------------------------- baselines
def test_block_hash_matches_whole_blocks_only():
    prefix = list(range(103))
    requests = [req(0, prefix + [900]), req(1, prefix + [901])]
    assert replay_block_hash(requests, None).cached.tolist() == [0, 96]
    assert replay_unlimited(requests, 16).cached.tolist() == [0, 103]


def test_block_hash_evicts_the_tail_of_a_sequence_first():
    cache = BlockHashCache(num_blocks=4)
    long = np.arange(64, dtype=np.int32)  # 4 blocks: fills the cache
    cache.serve(long, np.zeros(0, dtype=np.int32))
    other = np.arange(1000, 1017, dtype=np.int32)  # needs 2 blocks: evicts 2 tail blocks
    cache.serve(other, np.zeros(0, dtype=np.int32))
    assert cache.serve(long, np.zeros(0, dtype=np.int32)) == 32
    assert cache.evicted_blocks >= 2


def test_run_block_hash_keeps_the_benchmark_interface():
    prompt = np.arange(40, dtype=np.int32)
    full = np.concatenate([prompt, [7, 8]]).astype(np.int32)
    assert run_block_hash([(prompt, full), (prompt, full)], None) == 32


def test_sweep_sizes_reach_the_footprint():
    requests = load_requests(generate("shared-prefix", small_params("shared-prefix"), seed=0))
    footprint = replay_unlimited(requests, 4).peak_tokens
    sizes = sweep_sizes(requests, 4, footprint)
    assert sizes == sorted(sizes) and sizes[-1] >= footprint
    assert sizes[0] >= min_pages(requests, 4) * 4
    points = run_sweep(requests, sizes, 4)
    rates = [p.radix_hit_rate for p in points]
    assert rates[-1] == pytest.approx(replay_unlimited(requests, 4).hit_rate(
        np.array([len(r.prompt) for r in requests])))
    assert points[-1].radix_evicted_tokens == 0
