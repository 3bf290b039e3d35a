"""Mooncake-format traces (hash_ids of fixed-size token blocks) read natively: an unlimited
replay finds exactly the brute-force count of shared leading blocks, and bad lines are
sentences naming the line."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cli import main
from engine.profiler.mooncake import read_mooncake
from engine.profiler.simulate import replay_unlimited
from engine.profiler.trace import ReplayRequest, TraceError


def write(path, lines) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def brute_force_hits(lines: list[dict], block: int) -> list[int]:
    """Per request in arrival order: the longest run of leading blocks (the last may be
    partial) it shares with any earlier prompt, capped at input_length - 1."""
    order = sorted(range(len(lines)), key=lambda i: lines[i]["timestamp"])
    hits = []
    for n, i in enumerate(order):
        mine, length = lines[i]["hash_ids"], lines[i]["input_length"]
        best = 0
        for j in order[:n]:
            theirs, their_length = lines[j]["hash_ids"], lines[j]["input_length"]
            same = 0
            while same < min(len(mine), len(theirs)) and mine[same] == theirs[same]:
                same += 1
            best = max(best, min(same * block, length, their_length))
        hits.append(min(best, length - 1))
    return hits


def check_unlimited_replay(read: Callable[[Path, int], list[ReplayRequest]], path: Path,
                           lines: list[dict], block: int) -> None:
    """``lines`` written to ``path`` and read back with ``read`` (a format's reader): an
    unlimited replay, at page sizes 1 and 16, finds the brute-force count of each request."""
    write(path, lines)
    requests = read(path, block)
    for page_size in (1, 16):
        run = replay_unlimited(requests, page_size)
        assert run.cached.tolist() == brute_force_hits(lines, block)


@st.composite
def mooncake_traces(draw) -> tuple[list[dict], int]:
    """Prompts drawn as paths in a small tree of block ids (so they share leading blocks)."""
    block = draw(st.sampled_from([1, 4, 16]))
    lines = []
    for _ in range(draw(st.integers(1, 12))):
        blocks = draw(st.lists(st.integers(0, 2), min_size=1, max_size=5))
        hash_ids = [hash(tuple(blocks[: k + 1])) % 1000 for k in range(len(blocks))]
        length = (len(blocks) - 1) * block + draw(st.integers(1, block))
        lines.append({"timestamp": draw(st.integers(0, 50)), "input_length": length,
                      "output_length": draw(st.integers(0, 5)), "hash_ids": hash_ids})
    return lines, block


@settings(max_examples=80, deadline=None)
@given(mooncake_traces())
def test_unlimited_replay_equals_a_brute_force_leading_block_count(tmp_path_factory, trace):
    lines, block = trace
    check_unlimited_replay(read_mooncake, tmp_path_factory.mktemp("mooncake") / "trace.jsonl",
                           lines, block)


def test_prompts_are_blocks_of_their_hash_ids_and_outputs_match_nothing(tmp_path):
    path = tmp_path / "t.jsonl"
    write(path, [{"timestamp": 5, "input_length": 6, "output_length": 2, "hash_ids": [7, 9]},
                 {"timestamp": 1, "input_length": 4, "output_length": 1, "hash_ids": [7]}])
    early, late = read_mooncake(path, 4)
    assert (early.arrival, late.arrival) == (0.001, 0.005)  # milliseconds, sorted
    assert late.prompt.tolist() == [7, 7, 7, 7, 9, 9]
    assert set(early.output.tolist()).isdisjoint({7, 9}) and late.output[0] != early.output[0]


def test_bad_lines_are_sentences(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    write(path, [{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1]}])
    with pytest.raises(TraceError, match="bad.jsonl:1: 1 hash_ids for input_length 1000"):
        read_mooncake(path)
    write(path, [{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": ["a"]}])
    with pytest.raises(TraceError, match="hash_ids must be a list of integers"):
        read_mooncake(path)
    assert main(["profile", "--format", "mooncake", str(path), "--url", "http://x"]) == 2
    assert "replay it offline" in capsys.readouterr().err


def test_profile_command_reads_the_format(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    rng = np.random.default_rng(0)
    lines = [{"timestamp": 10 * i, "input_length": int(rng.integers(600, 1500)),
              "output_length": 8, "hash_ids": []} for i in range(6)]
    for i, line in enumerate(lines):
        count = -(-line["input_length"] // 512)
        line["hash_ids"] = [0, 1, *range(100 * i, 100 * i + count - 2)][:count]
    write(path, lines)
    assert main(["profile", "--format", "mooncake", str(path), "--cache-tokens", "8192"]) == 0
    out = capsys.readouterr().out
    assert "6 requests" in out and "unlimited (upper bound)" in out
    expected = sum(brute_force_hits(lines, 512))
    assert f"{expected:,}" in out
