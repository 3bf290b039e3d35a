"""The profiler at trace scale: the streaming reader gives what read_trace + load_requests give,
with the same messages for bad lines; the vectorised block hashes equal a chained reference and
the array LRU equals an OrderedDict one; a generated trace reads alike in token ids and in
Mooncake's hash ids."""

from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cli import main
from engine.profiler import baselines
from engine.profiler.baselines import BlockChains, BlockHashCache, chain_hashes
from engine.profiler.mooncake import read_mooncake
from engine.profiler.simulate import replay_block_hash, replay_unlimited
from engine.profiler.trace import (
    TraceError,
    load_requests,
    read_requests,
    read_trace,
    write_trace,
)
from engine.profiler.workload import KINDS, iter_trace
from tests.test_profiler import traces

MOD = 1 << 64


# -------------------------------------------------------------- streaming reader
def write_lines(path, lines: list) -> None:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n"
                            for line in lines))


def test_read_requests_equals_read_trace_then_load_requests(tmp_path):
    path = tmp_path / "t.jsonl"
    write_lines(path, [
        {"id": "b", "arrival": 2.0, "prompt_token_ids": [1, 2, 3], "max_tokens": 4,
         "namespace": "tenant-1"},
        {"id": 7, "arrival": 0.5, "prompt_token_ids": [5, 2**31 - 1], "output_token_ids": [0, 6],
         "session_id": "s"},
        {"id": "c", "arrival": 0.5, "prompt_token_ids": [9], "output_token_ids": [],
         "max_tokens": 3},
        "",
    ])
    streamed = read_requests(path)
    loaded = load_requests(read_trace(path))
    assert [r.id for r in streamed] == ["7", "c", "b"]  # by arrival, ties in file order
    for a, b in zip(streamed, loaded, strict=True):
        assert (a.id, a.arrival, a.namespace, a.session_id) == (
            b.id, b.arrival, b.namespace, b.session_id)
        assert a.prompt.dtype == a.output.dtype == np.int32
        assert np.array_equal(a.prompt, b.prompt) and np.array_equal(a.output, b.output)
    assert streamed[0].prompt.tolist() == [5, 2**31 - 1] and len(streamed[2].output) == 4


@pytest.mark.parametrize("line, message", [
    ('{"id": "a", "arrival": 0, "prompt_token_ids": [1, 2.5], "max_tokens": 1}',
     "prompt_token_ids must be a list of non-negative integers"),
    ('{"id": "a", "arrival": 0, "prompt_token_ids": [true, false], "max_tokens": 1}',
     "prompt_token_ids must be a list of non-negative integers"),
    ('{"id": "a", "arrival": 0, "prompt_token_ids": [2147483648], "max_tokens": 1}',
     "prompt_token_ids must be a list of non-negative integers"),
    ('{"id": "a", "arrival": 0, "prompt_token_ids": [1, [2]], "max_tokens": 1}',
     "prompt_token_ids must be a list of non-negative integers"),
    ('{"id": "a", "arrival": 0, "prompt_token_ids": [1], "output_token_ids": [-1]}',
     "output_token_ids must be a list of non-negative integers"),
    ('{"id": "a", "arrival": 0, "prompt_token_ids": [], "max_tokens": 1}',
     "prompt_token_ids is empty"),
    ('{"id": "a", "arrival": NaN, "prompt_token_ids": [1], "max_tokens": 1}',
     "'arrival' must be a number"),
    ('{"id": "a", "arrival": 1e400, "prompt_token_ids": [1], "max_tokens": 1}',
     "'arrival' must be a number"),
    ('{"id": "a", "arrival": 0, "prompt_token_ids": [1], "max_tokens": 1, "x": 1}',
     "unknown field"),
    ('{"id": "a", "arrival": 0, "prompt_token_ids": [1]', "not valid JSON"),
    ("[1, 2]", "a trace line must be a JSON object"),
])
def test_streaming_reader_keeps_every_check_and_message(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    write_lines(path, ['{"id": "ok", "arrival": 0, "prompt_token_ids": [1], "max_tokens": 1}',
                       line])
    for read in (read_trace, read_requests):
        with pytest.raises(TraceError, match=f"bad.jsonl:2: {message}".replace("[", r"\[")):
            read(path)


def test_streaming_reader_needs_a_tokenizer_for_text(tmp_path):
    path = tmp_path / "text.jsonl"
    write_lines(path, [{"id": "t", "arrival": 0, "prompt": "hello", "max_tokens": 2}])
    with pytest.raises(TraceError, match="pass --tokenizer DIR"):
        read_requests(path)
    write_lines(path, [])
    with pytest.raises(TraceError, match="no requests"):
        read_requests(path)


# ------------------------------------------------------------------ block hashes
def scramble(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) % MOD
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % MOD
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % MOD
    return x ^ (x >> 31)


def reference_chain(tokens: list[int], namespace, block_size: int) -> list[int]:
    """H_k = H_{k-1} * M + scramble(keyed sum of block k), one block at a time."""
    keys = [int(k) for k in baselines._KEYS[:block_size]]
    parent, chain = baselines._root(namespace), []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        content = sum(t * k for t, k in zip(tokens[start:start + block_size], keys, strict=True))
        parent = (parent * baselines._M + scramble(content % MOD)) % MOD
        chain.append(parent)
    return chain


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**31 - 1), max_size=80),
       block_size=st.sampled_from([1, 3, 16]), namespace=st.sampled_from([None, "a", 7]))
def test_vectorised_chain_equals_the_chained_reference(tokens, block_size, namespace):
    chain = chain_hashes(np.array(tokens, dtype=np.int32), namespace, block_size)
    assert chain.dtype == np.uint64
    assert chain.tolist() == reference_chain(tokens, namespace, block_size)


def test_chains_agree_exactly_up_to_the_first_differing_block():
    a = np.arange(64, dtype=np.int32)
    b = a.copy()
    b[40] = 999  # block 2 of 4
    ha, hb = chain_hashes(a), chain_hashes(b)
    assert (ha[:2] == hb[:2]).all() and (ha[2:] != hb[2:]).all()
    assert (chain_hashes(a, "tenant") != ha).all()


class OrderedDictBlockCache:
    """The LRU as it was written before vectorising, one block at a time."""

    def __init__(self, num_blocks: int | None, block_size: int = 16) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.evicted_blocks = self.peak_blocks = 0
        self.lru: OrderedDict[int, None] = OrderedDict()

    def serve(self, prompt: np.ndarray, output: np.ndarray, namespace=None) -> int:
        lru, size = self.lru, self.block_size
        full = np.concatenate([prompt, output]).tolist()
        chain = reference_chain(full, namespace, size)
        limit = min(len(chain), (len(prompt) - 1) // size)
        hits = 0
        while hits < limit and chain[hits] in lru:
            hits += 1
        for h in chain[:hits]:
            del lru[h]
        needed = -(-len(full) // size) - hits
        if self.num_blocks is not None:
            while lru and len(lru) + hits + needed > self.num_blocks:
                lru.popitem(last=False)
                self.evicted_blocks += 1
        self.peak_blocks = max(self.peak_blocks, len(lru) + hits + needed)
        for h in reversed(chain):
            lru[h] = None
            lru.move_to_end(h)
        if self.num_blocks is not None:
            while len(lru) > self.num_blocks:
                lru.popitem(last=False)
                self.evicted_blocks += 1
        return hits * size


# Over 2 tokens, in 4-token blocks, short traces fill and evict a small cache many times.
@settings(max_examples=200, deadline=None)
@given(requests=traces(alphabet=2, max_requests=14, max_tail=30, max_output=10),
       num_blocks=st.one_of(st.none(), st.integers(1, 16)))
def test_array_lru_equals_the_ordered_dict_lru(requests, num_blocks):
    reference, direct = OrderedDictBlockCache(num_blocks, 4), BlockHashCache(num_blocks, 4)
    expected, kv = [], []
    for r in requests:
        expected.append(reference.serve(r.prompt, r.output, r.namespace))
        assert direct.serve(r.prompt, r.output, r.namespace) == expected[-1]
        assert direct.num_cached_blocks == len(reference.lru)
        kv.append(4 * len(reference.lru))
    assert (direct.evicted_blocks, direct.peak_blocks) == (reference.evicted_blocks,
                                                           reference.peak_blocks)
    run = replay_block_hash(requests, num_blocks, 4, chains=BlockChains.of(requests, 4))
    assert run.cached.tolist() == expected and run.kv_tokens.tolist() == kv
    assert run.evicted_tokens == 4 * reference.evicted_blocks
    assert run.peak_tokens == 4 * reference.peak_blocks


# --------------------------------------------------- one draw, two formats
def brute_force_block_hits(prompts: list[np.ndarray], block: int) -> list[int]:
    """Per request: the leading blocks (the last may be partial) it shares whole with any
    earlier prompt, in tokens, capped at its length - 1: what Mooncake's hash ids keep."""
    hits = []
    for i, mine in enumerate(prompts):
        best = 0
        for theirs in prompts[:i]:
            shared = 0
            while (shared < min(len(mine), len(theirs))
                   and np.array_equal(mine[shared:shared + block], theirs[shared:shared + block])):
                shared += block
            best = max(best, min(shared, len(mine), len(theirs)))
        hits.append(min(best, len(mine) - 1))
    return hits


def test_a_generated_trace_reads_alike_in_token_ids_and_in_mooncake_format(tmp_path, capsys):
    flags = ["multi-turn", "--seed", "3", "--conversations", "4", "--turns", "3", "--systems",
             "2", "--system-len", "20", "--turn-len", "9", "--output-len", "5", "--sigma", "0.5"]
    tokens, blocks = tmp_path / "tokens.jsonl", tmp_path / "mooncake.jsonl"
    assert main(["workload", "gen", *flags, "--out", str(tokens)]) == 0
    assert main(["workload", "gen", *flags, "--format", "mooncake", "--block-tokens", "8",
                 "--out", str(blocks)]) == 0
    printed = capsys.readouterr().out
    assert "wrote 12 multi-turn requests" in printed and "in 8-token blocks" in printed

    by_ids, by_blocks = read_requests(tokens), read_mooncake(blocks, 8)
    assert [r.arrival for r in by_ids] == [r.arrival for r in by_blocks]
    assert [len(r.prompt) for r in by_ids] == [len(r.prompt) for r in by_blocks]
    assert [len(r.output) for r in by_ids] == [len(r.output) for r in by_blocks]
    expected = brute_force_block_hits([r.prompt for r in by_ids], 8)
    assert replay_unlimited(by_blocks, 1).cached.tolist() == expected
    # Token ids also match replies re-sent by the next turn, which the format does not hash.
    assert (replay_unlimited(by_ids, 1).cached >= np.array(expected)).all()

    assert main(["workload", "gen", *flags, "--format", "mooncake", "--tokenizer", "x",
                 "--out", str(blocks)]) == 2
    assert "drop --tokenizer" in capsys.readouterr().err


def test_multi_turn_systems_pick_among_several_system_prompts(tmp_path):
    params = KINDS["multi-turn"].params(conversations=12, turns=1, systems=3, system_len=10,
                                        turn_len=4, output_len=2)
    trace = list(iter_trace("multi-turn", params, seed=0))
    assert len({tuple(r.prompt_token_ids[:10]) for r in trace}) == 3
    single = KINDS["multi-turn"].params(conversations=12, turns=1, system_len=10, turn_len=4,
                                        output_len=2)
    assert len({tuple(r.prompt_token_ids[:10]) for r in iter_trace("multi-turn", single, 0)}) == 1
    assert write_trace(tmp_path / "t.jsonl", iter_trace("multi-turn", params, seed=0)) == 12
    assert read_trace(tmp_path / "t.jsonl") == trace
