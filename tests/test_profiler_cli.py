"""`radixserve workload gen` and `radixserve profile` end to end through ``engine.cli.main``,
text traces through a tokenizer, and the no-torch guarantee."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import textwrap

import pytest

from engine.cli import main
from engine.profiler.trace import encode_chat, load_tokenizer, read_trace

SMALL_SHARED = ["--groups", "3", "--prompts-per-group", "5", "--system-len", "70",
                "--question-len", "9", "--output-len", "6"]
SMALL_MULTI_TURN = ["--conversations", "3", "--turns", "3", "--system-len", "40",
                    "--turn-len", "12", "--output-len", "10"]


def test_workload_gen_then_profile_writes_tables_csv_json_and_png(tmp_path, capsys):
    trace = tmp_path / "shared.jsonl"
    assert main(["workload", "gen", "shared-prefix", "--seed", "5", "--out", str(trace),
                 *SMALL_SHARED]) == 0
    assert "wrote 15 shared-prefix requests" in capsys.readouterr().out
    out = tmp_path / "report"
    assert main(["profile", str(trace), "--cache-tokens", "256", "--page-size", "4",
                 "--sweep", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for heading in ("unlimited (upper bound)", "block hash 16", "no cache", "misses of radix",
                    "hit rate over time", "hit rate vs cache size"):
        assert heading in printed

    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == 15 and summary["config"]["cache_tokens"] == 256
    caches = {c["cache"]: c for c in summary["caches"]}
    assert caches["unlimited"]["hit_rate"] >= caches["radix p4 lru"]["hit_rate"] > 0
    assert caches["no cache"]["hit_tokens"] == 0
    att = summary["attribution"]
    assert att["cold"] + att["evicted"] == att["prompt_tokens"] - att["hit"]
    assert summary["sweep"] and summary["timeline"]
    with open(out / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 15 and all(
        int(r["cached_tokens"]) + int(r["cold"]) + int(r["evicted"]) == int(r["prompt_tokens"])
        for r in rows)
    for name in ("timeline.csv", "sweep.csv", "hit_rate_over_time.png", "cached_tokens_hist.png",
                 "hit_rate_vs_cache_size.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "hit_rate_over_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_policy_and_explicit_sweep_sizes(tmp_path, capsys):
    trace = tmp_path / "mt.jsonl"
    main(["workload", "gen", "multi-turn", "--seed", "2", "--out", str(trace), *SMALL_MULTI_TURN])
    assert main(["profile", str(trace), "--num-pages", "80", "--page-size", "4", "--policy",
                 "lfu", "--sweep", "512,1_024"]) == 0
    printed = capsys.readouterr().out
    assert "radix p4 lfu" in printed and "1,024" in printed


def test_sessions_and_namespaces_csv_sum_their_requests(tmp_path, capsys):
    lines = [  # (session, namespace, prompt)
        ("s1", None, [1, 2, 3, 4]), (None, "t", [1, 2, 3, 4]), ("s2", None, [1, 2, 3, 9]),
        (None, "t", [1, 2, 3, 4, 5]), ("s1", "t", [1, 2, 3, 4, 5, 6, 7])]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({
        "id": f"r{i}", "arrival": i, "prompt_token_ids": prompt, "output_token_ids": [],
        **({"session_id": session} if session else {}),
        **({"namespace": namespace} if namespace else {})}) + "\n"
        for i, (session, namespace, prompt) in enumerate(lines)))
    out = tmp_path / "out"
    assert main(["profile", str(trace), "--page-size", "1", "--out", str(out)]) == 0
    assert "invisible to any cache" not in capsys.readouterr().out  # a trace of tokens
    assert json.loads((out / "summary.json").read_text())["trace_blocks"] is None

    def table(name: str, key: str) -> list[tuple]:
        with open(out / name) as f:
            return [(r[key], int(r["requests"]), int(r["prompt_tokens"]), int(r["hit_tokens"]),
                     int(r["cold"]), int(r["evicted"])) for r in csv.DictReader(f)]

    # Hits: r2 3 (r0's head), r3 4 (r1's prompt), r4 5 (r3's, in namespace t). One row per
    # key in the order of its first request; no session / the default namespace is "".
    assert table("sessions.csv", "session_id") == [
        ("s1", 2, 11, 5, 6, 0), ("", 2, 9, 4, 5, 0), ("s2", 1, 4, 3, 1, 0)]
    assert table("namespaces.csv", "namespace") == [("", 2, 8, 3, 5, 0), ("t", 3, 16, 9, 7, 0)]


def test_profile_errors_are_sentences(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "arrival": 0, "prompt_token_ids": [1]}\n')
    assert main(["profile", str(bad)]) == 2
    assert "bad.jsonl:1: give output_token_ids or max_tokens" in capsys.readouterr().err

    text = tmp_path / "text.jsonl"
    text.write_text('{"id": "a", "arrival": 0, "prompt": "hello", "max_tokens": 3}\n')
    assert main(["profile", str(text)]) == 2
    assert "pass --tokenizer DIR" in capsys.readouterr().err

    big = tmp_path / "big.jsonl"
    big.write_text('{"id": "a", "arrival": 0, "prompt_token_ids": [1, 2, 3], "max_tokens": 90}\n')
    assert main(["profile", str(big), "--cache-tokens", "32"]) == 2
    assert "give at least 96 cache tokens" in capsys.readouterr().err

    assert main(["profile", str(big), "--cache-tokens", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err
    assert main(["profile", str(big), "--sweep", "lots"]) == 2
    assert "--sweep takes token counts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["workload", "gen", "random", "--out", str(tmp_path / "r"), "--requests", "0"])


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tests.tokenizer_fixtures import byte_level_tokenizer

    directory = tmp_path_factory.mktemp("tokenizer")
    byte_level_tokenizer().save_pretrained(directory)
    return directory


def test_text_traces_through_a_tokenizer(tmp_path, tokenizer_dir, capsys):
    trace = tmp_path / "chat.jsonl"
    args = ["workload", "gen", "multi-turn", "--seed", "4", "--tokenizer", str(tokenizer_dir),
            *SMALL_MULTI_TURN]
    assert main([*args, "--out", str(trace)]) == 0
    assert main([*args, "--out", str(tmp_path / "again.jsonl")]) == 0
    assert trace.read_bytes() == (tmp_path / "again.jsonl").read_bytes()
    requests = read_trace(trace)
    assert all(r.messages and r.output_token_ids for r in requests)

    # The output recorded for a turn is exactly what the next turn's template re-sends.
    tokenizer = load_tokenizer(tokenizer_dir)
    conversation = [r for r in requests if r.session_id == requests[0].session_id]
    first, second = conversation[0], conversation[1]
    sent = encode_chat(tokenizer, first.messages) + first.output_token_ids
    assert encode_chat(tokenizer, second.messages)[: len(sent)] == sent

    assert main(["profile", str(trace), "--tokenizer", str(tokenizer_dir), "--out",
                 str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["caches"][1]["hit_rate"] > 0.5  # history + shared system prompt hit
    capsys.readouterr()

    few_shot = tmp_path / "few.jsonl"
    assert main(["workload", "gen", "few-shot", "--seed", "1", "--tokenizer", str(tokenizer_dir),
                 "--requests", "6", "--out", str(few_shot)]) == 0
    assert all(r.prompt and r.output_token_ids for r in read_trace(few_shot))


@pytest.mark.e2e
def test_profiler_never_imports_torch(tmp_path):
    trace = tmp_path / "t.jsonl"
    main(["workload", "gen", "tree", "--seed", "1", "--out", str(trace), "--trees", "2",
          "--depth", "2"])
    script = textwrap.dedent(f"""
        import argparse, pkgutil, importlib, sys
        import engine.profiler
        for module in pkgutil.iter_modules(engine.profiler.__path__):
            importlib.import_module("engine.profiler." + module.name)
        from engine.profiler import command
        parser = argparse.ArgumentParser()
        command.add_arguments(parser)
        assert command.run(parser.parse_args(
            [{str(trace)!r}, "--sweep", "--out", {str(tmp_path / "out")!r}])) == 0
        heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
        assert not heavy, heavy
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr


def test_tokenizer_from_a_gguf_file_or_a_sentence(tmp_path, default_model, capsys):
    """--tokenizer takes a .gguf as --model does (its tokenizer, converted once); a folder with
    no tokenizer is refused with a sentence, not a traceback."""
    trace = tmp_path / "chat.jsonl"
    args = ["workload", "gen", "multi-turn", "--seed", "4", *SMALL_MULTI_TURN]
    assert main([*args, "--tokenizer", default_model, "--out", str(trace)]) == 0
    assert all(r.messages for r in read_trace(trace))
    assert main(["profile", str(trace), "--tokenizer", default_model, "--out",
                 str(tmp_path / "out")]) == 0
    capsys.readouterr()

    empty = tmp_path / "empty"
    empty.mkdir()
    for command in (["profile", str(trace)], [*args, "--out", str(tmp_path / "x.jsonl")]):
        assert main([*command, "--tokenizer", str(empty)]) == 2
        err = capsys.readouterr().err
        assert f"--tokenizer {empty} holds no tokenizer" in err and "Traceback" not in err
    assert main(["profile", str(trace), "--tokenizer", str(tmp_path / "missing")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
