"""scripts/bench_serving.py: its prompts (pure functions) and one tiny run of every workload
against a live demo-model server given as both A and B."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.checkpoints.demo_model import build_demo_model
from tests.server_process import ServerProcess

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_serving.py"
_spec = importlib.util.spec_from_file_location("bench_serving", SCRIPT)
bench_serving = importlib.util.module_from_spec(_spec)
sys.modules["bench_serving"] = bench_serving  # dataclasses look their module up there
_spec.loader.exec_module(bench_serving)

# One in flight: two prompts of a group sent at once would both prefill their 16-token head
# (too short to wait for the other), and the cache check below would depend on timing.
TINY = ["--repeats", "1", "--groups", "2", "--per-group", "2", "--head", "16",
        "--output-len", "4", "--conversations", "2", "--turns", "2", "--concurrency", "1",
        "--pause", "0"]


def sizes(**overrides) -> argparse.Namespace:
    return argparse.Namespace(**{"head": 16, "question": 8, "turns": 3, "conversations": 2,
                                 **overrides})


def test_prompts_share_exactly_the_head_and_repeat_with_the_seed():
    shared = bench_serving.grouped_prompts(np.random.default_rng(1), 3, 4, sizes(), 4096, True)
    fresh = bench_serving.grouped_prompts(np.random.default_rng(1), 3, 4, sizes(), 4096, False)
    assert len(shared) == len(fresh) == 12 and all(len(p) == 24 for p in shared + fresh)
    assert len({tuple(p[:16]) for p in shared}) == 3
    assert len({tuple(p[:16]) for p in fresh}) == 12
    assert len({tuple(p) for p in shared}) == 12
    again = bench_serving.grouped_prompts(np.random.default_rng(1), 3, 4, sizes(), 4096, True)
    assert again == shared
    ids = np.array(shared + fresh)
    assert ids.min() >= bench_serving.LOW_IDS and ids.max() < 4096 - bench_serving.HIGH_IDS
    turns = bench_serving.user_turns(np.random.default_rng(2), sizes(), 4096)
    assert [[len(t) for t in c] for c in turns] == [[24, 8, 8], [24, 8, 8]]


def test_a_chunk_without_text_still_marks_the_first_token():
    result = bench_serving.RequestResult()
    bench_serving.read_chunk({"choices": [{"text": "", "finish_reason": None}]}, result, 0.25)
    bench_serving.read_chunk({"choices": [{"text": "ab", "finish_reason": "length"}]}, result, 0.5)
    bench_serving.read_chunk({"choices": [], "usage": {
        "prompt_tokens": 10, "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 4}}}, result, 0.6)
    assert (result.ttft, result.text, result.prompt_tokens, result.cached_tokens,
            result.completion_tokens) == (0.25, "ab", 10, 4, 2)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # The demo model's directory, not a name: it also gives the bench its tokenizer.
    srv = ServerProcess(tmp_path_factory.mktemp("bench"), "--model", str(build_demo_model()),
                        "--num-pages", "512")
    yield srv
    assert srv.stop() == 0


@pytest.mark.e2e
def test_tiny_run_of_every_workload_against_one_server_twice(server, tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--url", server.url, "--name", "a", "--url", server.url,
         "--name", "b", *TINY, "--tokenizer", str(build_demo_model()), "--json", str(out)],
        capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    for workload in bench_serving.WORKLOADS:
        assert f"### {workload}:" in run.stdout
    assert "| metric | a | b | a / b |" in run.stdout
    report = json.loads(out.read_text())
    assert [s["name"] for s in report["servers"]] == ["a", "b"]
    assert [s["workload"] for s in report["summary"]] == list(bench_serving.WORKLOADS)
    for summary in report["summary"]:
        for name in ("a", "b"):
            assert set(summary["medians"][name]) == set(bench_serving.METRICS)
            assert summary["medians"][name]["failed"] == 0
    assert len(report["runs"]) == 3 * 2  # workloads x servers, one repeat
    for run_ in report["runs"]:
        assert len(run_["requests"]) == 4  # 2 groups x 2 prompts, or 2 conversations x 2 turns
        assert all(r["error"] is None and r["completion_tokens"] == 4 for r in run_["requests"])
        assert all(r["ttft"] > 0 and r["latency"] >= r["ttft"] for r in run_["requests"])
        if run_["workload"] == "shared-prefix":
            assert run_["metrics"]["cached_tokens"] > 0
    turns = [r for r in report["runs"] if r["workload"] == "multi-turn"][0]["requests"]
    assert max(r["prompt_tokens"] for r in turns) >= 16 + 32 + 32  # the history was re-sent
