"""Alibaba Bailian-format traces (chat_id / parent_chat_id sessions over hash_ids of 16-token
blocks) read natively: sessions from parent chains, an unlimited replay equal to the
brute-force count of shared leading blocks, bad lines as sentences naming the line, and the
report's note on the trace's block size and its per-session CSV."""

from __future__ import annotations

import csv
import json
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cli import main
from engine.profiler import command
from engine.profiler.bailian import BAILIAN_BLOCK_TOKENS, read_bailian
from engine.profiler.mooncake import MOONCAKE_BLOCK_TOKENS
from engine.profiler.report import trace_blocks
from engine.profiler.simulate import run_profile
from engine.profiler.trace import TraceError
from tests.test_profiler_mooncake import brute_force_hits, check_unlimited_replay, write


def bailian_trace(rng: np.random.Generator, sessions: int, turns: int, block: int = 16,
                  system_prompts: int = 2) -> list[dict]:
    """A small Bailian-like trace: each session opens with one of a few shared system prompts,
    and each next turn re-sends the previous prompt's whole blocks (its partial last block
    hashes differently once the reply fills it), then new blocks for the reply and the user's
    message. Chat ids are shuffled, some sessions' first turn is outside the trace (its
    parent_chat_id names no line), and the file is not in arrival order."""
    next_hash = 0

    def fresh(count: int) -> list[int]:
        nonlocal next_hash
        next_hash += count
        return list(range(next_hash - count, next_hash))

    systems = [fresh(int(rng.integers(1, 4))) for _ in range(system_prompts)]
    chat_ids = iter(rng.permutation(10 * sessions * turns).tolist())
    lines = []
    for s in range(sessions):
        parent = -1 if s % 3 else next(chat_ids)  # every third session began before the trace
        hashes = systems[s % system_prompts] + fresh(int(rng.integers(1, 4)))
        length = (len(hashes) - 1) * block + int(rng.integers(1, block + 1))
        clock = float(rng.uniform(0, 100))
        for turn in range(1, turns + 1):
            chat_id = next(chat_ids)
            lines.append({"chat_id": chat_id, "parent_chat_id": parent,
                          "timestamp": round(clock, 3), "input_length": length,
                          "output_length": int(rng.integers(1, 3 * block)), "type": "text",
                          "turn": turn, "hash_ids": hashes})
            whole = length // block
            hashes = hashes[:whole] + fresh(int(rng.integers(1, 4)))
            length = (len(hashes) - 1) * block + int(rng.integers(1, block + 1))
            parent, clock = chat_id, clock + float(rng.uniform(1, 30))
    return [lines[i] for i in rng.permutation(len(lines))]


def root_of(line: dict, by_chat: dict[int, dict]) -> int:
    while line["parent_chat_id"] in by_chat:
        line = by_chat[line["parent_chat_id"]]
    return line["chat_id"]


# ------------------------------------------------------------------- reading
def test_prompts_outputs_arrivals_and_ids(tmp_path):
    path = tmp_path / "t.jsonl"
    write(path, [
        {"chat_id": 9, "parent_chat_id": 4, "timestamp": 2.5, "input_length": 6,
         "output_length": 2, "type": "text", "turn": 2, "hash_ids": [7, 9]},
        {"chat_id": 4, "parent_chat_id": -1, "timestamp": 0.25, "input_length": 4,
         "output_length": 1, "type": "search", "turn": 1, "hash_ids": [7]},
    ])
    first, second = read_bailian(path, 4)
    assert (first.id, first.arrival, second.id, second.arrival) == ("4", 0.25, "9", 2.5)
    assert second.prompt.tolist() == [7, 7, 7, 7, 9, 9]
    assert len(second.output) == 2 and set(second.output.tolist()).isdisjoint({7, 9})
    assert first.output[0] != second.output[0]
    assert first.namespace is None and second.namespace is None
    assert first.session_id == second.session_id == "4"


def test_sessions_are_roots_of_parent_chains(tmp_path):
    lines = bailian_trace(np.random.default_rng(0), sessions=9, turns=4)
    path = tmp_path / "t.jsonl"
    write(path, lines)
    by_chat = {line["chat_id"]: line for line in lines}
    requests = read_bailian(path)
    assert {r.session_id for r in requests} == {
        str(root_of(line, by_chat)) for line in lines}
    assert len({r.session_id for r in requests}) == 9
    for r in requests:
        assert r.session_id == str(root_of(by_chat[int(r.id)], by_chat))
    # A parent outside the trace starts a session at its child, not at the missing parent.
    orphans = [line for line in lines
               if line["parent_chat_id"] != -1 and line["parent_chat_id"] not in by_chat]
    assert len(orphans) == 3
    assert {str(o["chat_id"]) for o in orphans} <= {r.session_id for r in requests}


@pytest.mark.parametrize("change, message", [
    ({"timestamp": -1}, "bad.jsonl:2: timestamp must be a number of seconds >= 0"),
    ({"timestamp": "soon"}, "bad.jsonl:2: timestamp must be a number of seconds >= 0"),
    ({"parent_chat_id": -2}, "bad.jsonl:2: parent_chat_id must be a chat_id or -1"),
    ({"parent_chat_id": None}, "bad.jsonl:2: parent_chat_id must be a chat_id or -1"),
    ({"chat_id": "x"}, "bad.jsonl:2: chat_id must be a non-negative integer"),
    ({"chat_id": 1}, "bad.jsonl:2: chat_id 1 was already used at .*bad.jsonl:1"),
    ({"output_length": 1.5}, "bad.jsonl:2: output_length must be a non-negative integer"),
    ({"hash_ids": [1, True]}, "bad.jsonl:2: hash_ids must be a list of integers"),
    ({"hash_ids": [1, 2.0]}, "bad.jsonl:2: hash_ids must be a list of integers"),
    ({"hash_ids": [1, 2, 3]}, "bad.jsonl:2: 3 hash_ids for input_length 20 does not fit "
                              "16-token blocks"),
    ({"hash_ids": [1, -5]}, r"bad.jsonl:2: hash_ids must lie in \[0, "),
])
def test_bad_lines_are_sentences_naming_the_line(tmp_path, change, message):
    good = {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 20,
            "output_length": 3, "hash_ids": [1, 2]}
    path = tmp_path / "bad.jsonl"
    write(path, [good, {**good, "chat_id": 2, **change}])
    with pytest.raises(TraceError, match=message):
        read_bailian(path)


def test_a_parent_chain_that_loops_is_an_error(tmp_path):
    path = tmp_path / "loop.jsonl"
    line = {"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [5]}
    write(path, [{**line, "chat_id": 1, "parent_chat_id": -1},
                 {**line, "chat_id": 2, "parent_chat_id": 3},
                 {**line, "chat_id": 3, "parent_chat_id": 2}])
    with pytest.raises(TraceError, match="loop.jsonl:2: the parent_chat_id chain of chat_id 2 "
                                         "loops back on itself"):
        read_bailian(path)
    write(path, [{**line, "chat_id": 1, "parent_chat_id": 1}])
    with pytest.raises(TraceError, match="chat_id 1 loops back"):
        read_bailian(path)


# ------------------------------------------------------ replay vs brute force
@st.composite
def bailian_traces(draw) -> tuple[list[dict], int]:
    block = draw(st.sampled_from([1, 4, 16]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    return bailian_trace(rng, draw(st.integers(1, 5)), draw(st.integers(1, 4)), block), block


@settings(max_examples=60, deadline=None)
@given(bailian_traces())
def test_unlimited_replay_equals_a_brute_force_leading_block_count(tmp_path_factory, trace):
    lines, block = trace
    check_unlimited_replay(read_bailian, tmp_path_factory.mktemp("bailian") / "trace.jsonl",
                           lines, block)


def test_partly_shared_blocks_bound_what_the_trace_hides(tmp_path):
    path = tmp_path / "t.jsonl"
    line = {"parent_chat_id": -1, "output_length": 1}
    write(path, [{**line, "chat_id": 1, "timestamp": 0, "input_length": 8, "hash_ids": [1, 2]},
                 {**line, "chat_id": 2, "timestamp": 1, "input_length": 6, "hash_ids": [1, 3]}])
    profile = run_profile(read_bailian(path, 4), 16, 4)
    assert profile.unlimited.cached.tolist() == [0, 4]
    # The first could share up to 3 tokens of a block with something unseen; the second, past
    # its 4 shared tokens, only 1 more before its always-recomputed last token.
    blocks = trace_blocks(profile, 4)
    assert blocks["hidden_tokens_at_most"] == 3 + 1
    assert blocks["unlimited_hit_rate_at_most"] == pytest.approx((4 + 4) / 14)
    assert blocks["note"].startswith("this trace hashes 4-token blocks: reuse shorter than")


# ------------------------------------------------------------------ command
def test_the_readers_defaults_are_the_commands(tmp_path, capsys):
    assert command.BLOCK_TOKENS == {"mooncake": MOONCAKE_BLOCK_TOKENS,
                                    "bailian": BAILIAN_BLOCK_TOKENS}
    path = tmp_path / "t.jsonl"
    write(path, bailian_trace(np.random.default_rng(1), sessions=2, turns=2))
    assert main(["profile", "--format", "bailian", str(path), "--url", "http://x"]) == 2
    assert "a Bailian trace's token ids are its block hashes" in capsys.readouterr().err
    assert main(["profile", str(path), "--block-tokens", "16"]) == 2
    assert "--block-tokens is for block-hash traces" in capsys.readouterr().err


def test_profile_command_writes_the_block_note_and_per_session_rows(tmp_path, capsys):
    lines = bailian_trace(np.random.default_rng(2), sessions=7, turns=3)
    path = tmp_path / "bailian.jsonl"
    write(path, lines)
    out = tmp_path / "out"
    # 16-token blocks by default: these lines do not fit Mooncake's 512.
    assert main(["profile", "--format", "bailian", str(path), "--cache-tokens", "1024",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "21 requests, 7 sessions" in printed
    assert ("this trace hashes 16-token blocks: reuse shorter than a block, or past the last "
            "shared block, is invisible to any cache here") in printed
    assert f"{sum(brute_force_hits(lines, 16)):,}" in printed  # the unlimited hit tokens

    summary = json.loads((out / "summary.json").read_text())
    assert summary["trace_blocks"]["block_tokens"] == 16
    blocks = summary["trace_blocks"]
    assert blocks["note"] in printed
    assert (f"lower bound: partly shared blocks could hide at most "
            f"{blocks['hidden_tokens_at_most']:,} more hit tokens") in printed
    assert 0 < blocks["hidden_tokens_at_most"] <= 15 * 21
    with open(out / "requests.csv") as f:
        requests = list(csv.DictReader(f))
    with open(out / "sessions.csv") as f:
        sessions = list(csv.DictReader(f))
    by_chat = {line["chat_id"]: line for line in lines}
    expected: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in requests:
        assert r["session_id"] == str(root_of(by_chat[int(r["id"])], by_chat))
        totals = expected[r["session_id"]]
        totals["requests"] += 1
        for column, source in (("prompt_tokens", "prompt_tokens"), ("hit_tokens", "cached_tokens"),
                               ("cold", "cold"), ("evicted", "evicted"),
                               ("block16_hit_tokens", "cached_block16")):
            totals[column] += int(r[source])
    # One row per session, in the order of its first request.
    assert [s["session_id"] for s in sessions] == list(dict.fromkeys(
        r["session_id"] for r in requests))
    for s in sessions:
        totals = expected[s["session_id"]]
        assert {c: int(s[c]) for c in totals} == totals
        assert float(s["hit_rate"]) == pytest.approx(totals["hit_tokens"]
                                                     / totals["prompt_tokens"])
    with open(out / "namespaces.csv") as f:
        (namespace,) = list(csv.DictReader(f))
    assert namespace["namespace"] == "" and int(namespace["requests"]) == 21
    assert int(namespace["hit_tokens"]) == summary["attribution"]["hit"]
