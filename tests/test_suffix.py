"""The ``suffix`` speculative method: the suffix index over the radix cache against a
brute-force search of what the tree holds (random inserts, evictions and resets, three
namespaces), its memory bound, the own-token search and the vote, the option's keys, and
greedy outputs through the in-process scheduler (tests/test_speculation.py's harness) equal to
decoding without drafts, with repeated outputs drafted from the cache where ngram cannot."""

from __future__ import annotations

import json
import random

import msgspec
import numpy as np
import pytest

from engine.checkpoints.demo_model import build_demo_model
from engine.contracts.engine_config import EngineConfig
from engine.contracts.protocol import SchedulerStats
from engine.contracts.sampling_params import SamplingParams
from engine.contracts.speculative import MIN_SUFFIX_MATCH, SpeculativeConfig
from engine.server.metrics import FrontendState, Metrics
from radix import OutOfPages
from scheduler import speculation, suffix_index
from scheduler.request import Status
from scheduler.scheduler import Scheduler
from scheduler.suffix import own_matches, vote
from scheduler.suffix_index import SuffixIndex
from tests.radix_sim import Sim
from tests.test_scheduler import Harness
from tests.test_speculation import assert_same_outputs, run, spec, workload

DEPTH = 12  # max_depth in the index tests


@pytest.fixture(scope="module")
def model_dir() -> str:
    # the demo model, not the scheduler tests' smaller one (harness_model_dir): how much is
    # drafted follows the steps' measured times (StepCosts), and the smaller model's steps are
    # a third as long, so a pause on a busy machine weighs three times as much (with it,
    # tests/test_suffix.py's retries test failed once in six runs on a busy 2-core machine)
    return str(build_demo_model())


def suffix_spec(k: int = 6, **extra) -> str:
    return json.dumps({"method": "suffix", "num_speculative_tokens": k, **extra})


class Recorder:
    """A second listener on the tree: every insert as a run of the path, its own tokens alive
    while the tree still holds them (the path's cached prefix, which evictions only shorten)."""

    def __init__(self, tree) -> None:
        self.tree = tree
        self.runs: list[dict] = []
        tree.listeners.append(self)

    def inserted(self, leaf, key: bytes, cached: int, namespace) -> None:
        path = np.frombuffer(key, dtype=np.int32).tolist()
        self.runs.append(dict(path=path, own=cached, end=len(path), namespace=namespace))

    def evicted(self, node) -> None:
        for r in self.runs:
            if r["end"] > r["own"]:
                r["end"] = min(r["end"], self.tree.peek_prefix(r["path"][: r["end"]],
                                                               r["namespace"]))

    def cleared(self) -> None:
        for r in self.runs:
            r["end"] = r["own"]


def brute_force(runs: list[dict], context: list[int], namespace, k: int) -> tuple[int, list]:
    """The longest match (<= DEPTH, >= MIN_SUFFIX_MATCH) of the context's end before an own
    position of a live run of ``namespace``; the continuations, newest run and position first."""
    context = context[-DEPTH:]
    found = []
    for order, r in enumerate(runs):
        if r["namespace"] != namespace:
            continue
        path = r["path"]
        for p in range(r["own"], r["end"]):
            n = 0
            while n < len(context) and p - n - 1 >= 0 and path[p - n - 1] == context[-n - 1]:
                n += 1
            cont = path[p : min(p + k, r["end"])]
            found.append((n, order, p, cont + [-1] * (k - len(cont))))
    best = max((f[0] for f in found), default=0)
    if best < MIN_SUFFIX_MATCH:
        return 0, []
    rows = sorted((f for f in found if f[0] == best), key=lambda f: (-f[1], -f[2]))
    return best, [f[3] for f in rows]


# --------------------------------------------------------------------------- the index
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_the_index_finds_what_a_brute_force_search_of_the_tree_finds(page_size, monkeypatch):
    """Random admissions, prefill commits, finishes (cached or not), evictions and resets
    over shared heads in three namespaces; after every operation, lookups of contexts taken
    from cached paths and of random ones give the brute force's match and continuations."""
    monkeypatch.setattr(suffix_index, "MAX_CANDIDATES", 10**6)  # exact: no chain cut short
    rng = random.Random(page_size)
    sim = Sim(num_pages=max(8, 480 // page_size), page_size=page_size)
    index = SuffixIndex.attached(sim.tree, max_runs=10**6, max_depth=DEPTH)
    recorder = Recorder(sim.tree)
    heads = [[rng.randrange(30) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
    namespaces = [None, None, "tenant-a", "tenant-b"]
    found = 0
    for step in range(300):
        op = rng.random()
        if op < 0.45 or not sim.running:
            tokens = rng.choice(heads) + [rng.randrange(30) for _ in range(rng.randrange(1, 40))]
            try:
                seq = sim.admit(tokens[: rng.randrange(2, len(tokens) + 1)],
                                rng.choice(namespaces))
            except OutOfPages:
                continue
            if rng.random() < 0.3 and len(seq.tokens) > 2:
                sim.commit(seq, rng.randrange(1, len(seq.tokens)))
        elif op < 0.85:
            sim.finish(rng.choice(sim.running), cache=rng.random() < 0.9)
        elif op < 0.98:
            sim.tree.evict(rng.randrange(1, 40 // page_size + 2))
        else:
            for seq in list(sim.running):
                sim.finish(seq)
            sim.tree.reset()
        index.check()
        sim.check()
        live = [r for r in recorder.runs if r["end"] > r["own"]]
        assert index.num_runs == len(live), f"step {step}"
        for _ in range(6):
            namespace = rng.choice(namespaces)
            if live and rng.random() < 0.7:
                r = rng.choice(live)
                cut = rng.randrange(1, r["end"] + 1)
                context = [rng.randrange(30)] * rng.randrange(2) + r["path"][:cut]
            else:
                context = [rng.randrange(30) for _ in range(rng.randrange(1, 10))]
            k = rng.randrange(1, 7)
            length, rows = index.matches(np.array(context, dtype=np.int64), namespace, k)
            want = brute_force(recorder.runs, context, namespace, k)
            assert (length, rows.tolist()) == want, (step, context, namespace)
            found += length > 0
    assert found > 300


def test_namespaces_never_see_each_others_tokens():
    sim = Sim(num_pages=64, page_size=4)
    index = SuffixIndex.attached(sim.tree, max_runs=100, max_depth=DEPTH)
    secret = list(range(100, 140))
    sim.finish(sim.admit(secret, "tenant-a"))
    context = np.array(secret[:20], dtype=np.int64)
    length, rows = index.matches(context, "tenant-a", 4)
    assert length == DEPTH and rows.tolist() == [secret[20:24]]
    for other in (None, "tenant-b"):
        assert index.matches(context, other, 4)[0] == 0
    sim.finish(sim.admit(secret[:20] + [7, 8, 9], "tenant-b"))
    assert index.matches(context, "tenant-b", 4)[1].tolist() == [[7, 8, 9, -1]]
    assert index.matches(context, "tenant-a", 4)[1].tolist() == [secret[20:24]]
    sim.tree.evict(64)  # the last run of a namespace gone: the namespace is forgotten
    assert index.num_runs == 0 and not index._namespaces
    index.check()


def test_memory_is_bounded_and_the_oldest_runs_go_first():
    """A ring of 64 slots under a tree that holds far more: the arrays never grow, at most 64
    live tokens (context included) and ``max_runs`` runs stay indexed, the newest ones."""
    sim = Sim(num_pages=256, page_size=1)
    index = SuffixIndex(64, max_runs=3, max_depth=DEPTH)
    sim.tree.listeners.append(index)
    size = sum(a.nbytes for a in (index.tokens, index.run_ids, index.heads, index.links))
    assert size == 64 * (4 + 8 + 16 * len(index.widths))  # 60 bytes a slot with three widths
    rng = np.random.default_rng(0)
    paths = [rng.integers(1000 * i, 1000 * i + 999, 20).tolist() for i in range(12)]
    for i, path in enumerate(paths):
        sim.finish(sim.admit(path))
        index.check()
        assert index.indexed_tokens <= 64 and index.num_runs <= 3
        assert sum(a.nbytes for a in (index.tokens, index.run_ids, index.heads,
                                      index.links)) == size
        newest = index.matches(np.array(path[:10]), None, 2)
        assert newest[1].tolist() == [path[10:12]]
        if i >= 3:
            assert index.matches(np.array(paths[i - 3][:10]), None, 2)[0] == 0
    # one path longer than the ring keeps its last 64 tokens
    long = rng.integers(50_000, 60_000, 200).tolist()
    sim.finish(sim.admit(long))
    index.check()
    assert index.num_runs == 1 and index.indexed_tokens == 64
    assert index.matches(np.array(long[:150]), None, 2)[1].tolist() == [long[150:152]]
    assert index.matches(np.array(long[:100]), None, 2)[0] == 0


# ------------------------------------------------------------------------ own tokens, vote
def brute_own(tokens: list[int], max_depth: int, k: int) -> tuple[int, list]:
    found = []
    for end in range(1, len(tokens)):
        n = 0
        while n < max_depth and end - n - 1 >= 0 and tokens[end - n - 1] == tokens[-n - 1]:
            n += 1
        found.append((n, end))
    best = max((n for n, _ in found), default=0)
    if best < MIN_SUFFIX_MATCH:
        return 0, []
    ends = sorted((end for n, end in found if n == best), reverse=True)[
        : suffix_index.MAX_CANDIDATES]
    return best, [(tokens[e : e + k] + [-1] * k)[:k] for e in ends]


def test_own_token_matches_are_those_of_a_brute_force_search():
    rng = np.random.default_rng(1)
    found = 0
    for _ in range(400):
        tokens = rng.integers(0, int(rng.integers(2, 8)), int(rng.integers(1, 80))).tolist()
        depth, k = int(rng.integers(2, 10)), int(rng.integers(1, 6))
        length, rows = own_matches(np.array(tokens, dtype=np.int64), depth, k)
        assert (length, rows.tolist()) == brute_own(tokens, depth, k), (tokens, depth, k)
        found += length > 0
    assert found > 200


def test_the_vote_takes_the_most_frequent_continuation_while_it_is_likely_enough():
    rows = np.array([[4, 5, 6], [4, 5, 7], [4, 8, -1], [9, -1, -1]])  # newest first
    assert vote(rows, 3, 0.1) == ([4, 5, 6], 0.75 + 0.5 + 0.25)
    assert vote(rows, 3, 0.3) == ([4, 5], 0.75 + 0.5)
    assert vote(rows, 1, 0.1) == ([4], 0.75)
    assert vote(rows[2:], 3, 0.1) == ([4, 8], 0.5 + 0.5)  # a tie: the newest
    assert vote(rows[:0], 3, 0.1) == ([], 0.0)


# --------------------------------------------------------------------------- the option
def test_the_option_takes_vllms_suffix_keys_and_refuses_the_other_methods():
    config = SpeculativeConfig.parse(suffix_spec(8))
    assert (config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
            config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob) == (
        24, 10000, 1.0, 0.1)  # vLLM's defaults
    assert config.prompt_lookup_min is None
    set_all = SpeculativeConfig.parse(suffix_spec(
        4, suffix_decoding_max_tree_depth=16, suffix_decoding_max_cached_requests=0,
        suffix_decoding_max_spec_factor=2.5, suffix_decoding_min_token_prob=0.5))
    assert set_all.suffix_decoding_max_spec_factor == 2.5
    for bad, words in [(suffix_spec(4, prompt_lookup_min=2), "'suffix' method does not take "
                        "prompt_lookup_min"),
                       (spec(4, suffix_decoding_max_tree_depth=8), "'ngram' method does not "
                        "take suffix_decoding_max_tree_depth"),
                       (suffix_spec(4, suffix_decoding_max_depth=8),
                        "unknown field `suffix_decoding_max_depth`"),
                       (suffix_spec(4, suffix_decoding_max_tree_depth=1), "max_tree_depth"),
                       (suffix_spec(4, suffix_decoding_min_token_prob=1.5), "min_token_prob"),
                       (suffix_spec(4, suffix_decoding_max_spec_factor=0), "max_spec_factor"),
                       (suffix_spec(4, suffix_decoding_max_cached_requests=-1),
                        "max_cached_requests")]:
        with pytest.raises(ValueError, match="--speculative-config") as caught:
            EngineConfig(model="demo", speculative_config=bad).validate()
        assert words in str(caught.value)


# ------------------------------------------------------------------ through the scheduler
def waves(model_dir: str, first: dict, *later, **options):
    """Waves of requests through one harness, each after the last has finished (``later``:
    functions of the outputs so far giving the next wave); the speculator's drafted and
    accepted tokens and the steps of each later wave."""
    h = run(model_dir, first, **options)
    s = h.sched.speculator

    def counts() -> tuple[int, int, int]:
        return (s.drafted_tokens, s.accepted_tokens, h.steps) if s else (0, 0, h.steps)

    deltas = []
    for wave in later:
        before = counts()
        for rid, (prompt, params) in wave(h.outputs).items():
            h.add(rid, prompt, params)
        h.run()
        deltas.append(tuple(b - a for a, b in zip(before, counts(), strict=True)))
    return h, deltas


@pytest.mark.parametrize("page_size", [1, 16])
def test_repeated_outputs_are_drafted_from_the_cache_with_greedy_outputs_unchanged(
        model_dir, page_size):
    """Three conversations; then each first message again (a retry: its output repeats the
    first one's, which the cache holds and ngram's own-token lookup cannot see); then each
    conversation's next turn (the first turn, its output, a new message)."""
    options = dict(page_size=page_size, num_pages=4096 // page_size, chunked_prefill_size=16,
                   max_prefill_tokens=48)
    rng = np.random.default_rng(7)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    first = {f"a{i}": (rng.integers(3, 4000, int(rng.integers(20, 50))).tolist(), greedy)
             for i in range(3)}
    messages = {rid: rng.integers(3, 4000, 8).tolist() for rid in first}

    def retries(_outputs: dict) -> dict:
        return {f"again-{rid}": request for rid, request in first.items()}

    def next_turns(outputs: dict) -> dict:
        return {f"next-{rid}": (prompt + outputs[rid][0] + messages[rid], params)
                for rid, (prompt, params) in first.items()}

    base, [(_, _, base_steps), _] = waves(model_dir, first, retries, next_turns, **options)
    ngram, [(n_drafted, n_accepted, n_steps), _] = waves(
        model_dir, first, retries, next_turns, speculative_config=spec(k=6), **options)
    suffix, [(s_drafted, s_accepted, s_steps), _] = waves(
        model_dir, first, retries, next_turns, speculative_config=suffix_spec(k=6), **options)
    assert_same_outputs(base, ngram)
    assert_same_outputs(base, suffix)
    for rid in first:
        assert suffix.outputs[f"again-{rid}"] == base.outputs[rid]
    print(f"page size {page_size}, retries: suffix drafted {s_drafted}, accepted "
          f"{s_accepted}, {s_steps} steps; ngram drafted {n_drafted}, accepted {n_accepted}, "
          f"{n_steps} steps; no drafts {base_steps} steps")
    assert s_accepted >= 3 * 15 and s_accepted > 3 * n_accepted
    assert 2 * s_steps < n_steps <= base_steps
    stats = SchedulerStats(**suffix.sched.stats())
    text = Metrics(lambda: stats, lambda: FrontendState(0, 0, True)).render().decode()
    assert f'radixserve_spec_decode_num_accepted_tokens_total{{method="suffix"}} ' \
           f'{float(suffix.sched.speculator.accepted_tokens)}' in text


def test_wrong_drafts_from_the_cache_roll_back_with_the_accounting_clean(model_dir,
                                                                         monkeypatch):
    """The cache holds each prompt, its first two output tokens, then tokens the model would
    not produce (a longer prompt that ran for one token): a draft from there is accepted up to
    the junk, the rest rolls back (the harness checks the accounting after every step, and
    pages past the kept tokens return), and the outputs are those without drafts. (Draft rows
    taken as nearly free: each sequence's first verification drafts all 6.)"""
    monkeypatch.setattr(speculation.StepCosts, "share", lambda self, batch_size: 0.0)
    accounting = Scheduler.check

    def check_with_pages(sched: Scheduler) -> None:
        """The accounting, and no running sequence with no step in flight holding a page past
        its computed tokens and the next one (its sampled token's): a verification's rejected
        drafts gave theirs back."""
        accounting(sched)
        for req in sched.requests.values():
            for seq in req.live_seqs():
                if seq.status is Status.RUNNING and seq.settled == seq.computed:
                    assert len(seq.pages) <= sched.alloc.pages_for(seq.computed + 1), seq.req.rid

    monkeypatch.setattr(Scheduler, "check", check_with_pages)
    rng = np.random.default_rng(11)
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    asks = {f"ask{i}": (rng.integers(3, 4000, 30).tolist(), greedy) for i in range(3)}
    options = dict(page_size=2, num_pages=512)
    alone = run(model_dir, asks, **options)
    decoys = {f"decoy{i}": (prompt + alone.outputs[rid][0][:2] + rng.integers(3, 4000, 30).tolist(),
                            msgspec.structs.replace(greedy, max_tokens=1))
              for i, (rid, (prompt, _)) in enumerate(asks.items())}
    base, _ = waves(model_dir, decoys, lambda _: asks, **options)
    h, [(drafted, accepted, _)] = waves(model_dir, decoys, lambda _: asks,
                                        speculative_config=suffix_spec(k=6), **options)
    assert_same_outputs(base, h)
    assert all(h.outputs[rid] == alone.outputs[rid] for rid in asks)
    assert drafted >= 3 * 6 and 3 <= accepted < drafted / 2
    assert h.sched.speculator.suffix.index.num_runs > 0  # checked with the accounting


def test_drafts_from_the_cache_stay_in_the_requests_namespace(model_dir, monkeypatch):
    """Three prompts answered for requests without a cache_salt, then the same prompts under a
    salt: those draft exactly what they draft on an engine that never saw the first answers
    (their own tokens only). Another tenant's cached output proposed and accepted would show in
    the step times it saves, a side channel between tenants, though outputs stay right. The
    same prompts in the first namespace draft its cached answers. (Draft rows taken as nearly
    free: how much is drafted follows acceptance alone, not the machine's timings.)"""
    monkeypatch.setattr(speculation.StepCosts, "share", lambda self, batch_size: 0.0)
    rng = np.random.default_rng(5)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    asks = {f"ask{i}": (rng.integers(3, 4000, int(rng.integers(20, 40))).tolist(), greedy)
            for i in range(3)}
    options = dict(page_size=4, num_pages=1024, speculative_config=suffix_spec(k=6))

    def counts(h) -> tuple[int, int]:
        return h.sched.speculator.drafted_tokens, h.sched.speculator.accepted_tokens

    def again(h, namespace: str | None) -> tuple[int, int]:
        before = counts(h)
        for rid, (prompt, params) in asks.items():
            h.add(f"{rid}-{namespace}", prompt, params, namespace=namespace)
        h.run()
        return tuple(b - a for a, b in zip(before, counts(h), strict=True))

    h = run(model_dir, asks, **options)
    salted = again(h, "tenant-b")
    fresh = Harness(model_dir, **options)
    assert again(fresh, "tenant-b") == salted
    shared = again(h, None)
    assert shared[1] >= 3 * 15 and shared[1] > 3 * salted[1]
    for rid in asks:
        assert h.outputs[f"{rid}-tenant-b"] == h.outputs[f"{rid}-None"] == h.outputs[rid]


@pytest.mark.parametrize("options", [
    dict(page_size=16, num_pages=128, chunked_prefill_size=8, max_prefill_tokens=24),
    dict(num_pages=16, preemption_mode="recompute", chunked_prefill_size=64),
    dict(num_pages=16, preemption_mode="swap", chunked_prefill_size=64, num_host_pages=64),
], ids=["chunked", "recompute", "swap"])
def test_greedy_outputs_on_a_mixed_workload_are_those_without_drafts(model_dir, options):
    """tests/test_speculation.py's workload (prompts with and without repeats), chunked, and
    short of pages (preempted sequences' KV goes into the tree, and so into the index, whose
    ring is then small)."""
    requests = workload(seed=3, count=8 if "preemption_mode" in options else 6)
    base = run(model_dir, requests, **options)
    drafted = run(model_dir, requests, speculative_config=suffix_spec(k=4), **options)
    assert_same_outputs(base, drafted)
    assert drafted.sched.speculator.drafted_tokens > 0
    if "preemption_mode" in options:
        assert drafted.sched.num_preemptions > 0
