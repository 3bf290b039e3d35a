"""End to end through the real processes (tokenizer, scheduler, worker over ZeroMQ)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import Engine, SamplingParams
from engine.runtime.offline import EngineDead
from tests.test_scheduler import hf_greedy, shared_prefix_prompts

pytestmark = pytest.mark.e2e

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    # fp32: outputs are compared with transformers' fp32 token for token.
    with Engine("demo", num_pages=1024, chunked_prefill_size=48, max_prefill_tokens=256,
                dtype="float32") as e:
        yield e


@pytest.fixture(scope="module")
def hf_model(engine):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(engine.config.model, dtype=torch.float32).eval()


def test_concurrent_requests_match_transformers_then_hit_the_cache(engine, hf_model):
    prompts = shared_prefix_prompts(32, seed=3)
    first = engine.generate(prompts, GREEDY)
    for prompt, result in zip(prompts, first, strict=True):
        assert result.error is None
        assert result.token_ids == hf_greedy(hf_model, prompt, 10)
    again = engine.generate(prompts, GREEDY)
    for prompt, a, b in zip(prompts, first, again, strict=True):
        assert b.cached_tokens == len(prompt) - 1
        assert b.token_ids == a.token_ids
    assert engine.alive  # the scheduler's idle accounting check passed in between


def test_seeded_parallel_sampling_is_reproducible(engine):
    params = SamplingParams(max_tokens=8, temperature=0.9, n=3, seed=11)
    a = engine.generate("The quick brown fox", params)[0]
    b = engine.generate("The quick brown fox", params)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3
    assert all(c.text for c in a.outputs)


def test_text_joins_to_decode_and_stop_strings_trim(engine):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(engine.config.model)
    full = engine.generate("def main():", SamplingParams(max_tokens=24, temperature=0.0,
                                                         ignore_eos=True))[0]
    assert full.text == tok.decode(full.token_ids, skip_special_tokens=True)
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    cut = engine.generate("def main():", SamplingParams(max_tokens=24, temperature=0.0,
                                                        ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]


def test_chat_messages_and_errors(engine):
    ok, bad = engine.generate(
        [[{"role": "user", "content": "hello"}], [{"role": "robot", "content": "x"}]],
        SamplingParams(max_tokens=4, temperature=0.0),
    )
    assert ok.error is None and ok.prompt_tokens > 3
    assert bad.status == 400 and "role" in bad.error
    too_long = engine.generate([5] * 5000, GREEDY)[0]
    assert too_long.status == 400 and "context is 4,096 tokens" in too_long.error


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_through_processes(hf_model, mode):
    prompts = shared_prefix_prompts(12, seed=0)
    # The swap run also spreads requests over two tokenizer workers.
    with Engine("demo", num_pages=16, chunked_prefill_size=64, preemption_mode=mode, dtype="float32",
                num_host_pages=64 if mode == "swap" else 0,
                tokenizer_workers=2 if mode == "swap" else 1) as small:
        results = small.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0,
                                                         ignore_eos=True))
        assert small.generate([5, 6, 7], GREEDY)[0].error is None  # alive after idle checks
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_greedy(hf_model, prompt, 12)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_killing_the_worker_fails_pending_requests_and_exits_nonzero(tmp_path):
    requests = tmp_path / "in.jsonl"
    requests.write_text("".join(
        json.dumps({"prompt_token_ids": [5 + i, 6, 7], "max_tokens": 3000, "ignore_eos": True})
        + "\n" for i in range(32)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "generate", "--input", str(requests), "--output",
         str(tmp_path / "out.jsonl"), "--no-progress", "--num-pages", "1024", "--model", "demo"],
        stderr=subprocess.PIPE, text=True,
    )
    seen = []
    for line in proc.stderr:  # the scheduler logs nothing per step; wait for the first batch
        seen.append(line)
        if "engine ready" in line:
            break
    children = _children(proc.pid)
    worker = next((c for c in children if "engine.runtime.child worker" in _cmdline(c)), None)
    assert worker is not None, "".join(seen)
    time.sleep(1.5)  # generating now: 32 requests x 3,000 tokens take far longer
    killed_at = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    stderr = proc.stderr.read()
    proc.wait(timeout=60)
    assert time.monotonic() - killed_at < 10
    assert proc.returncode != 0
    assert "worker process exited unexpectedly" in stderr
    time.sleep(0.5)
    assert [c for c in children if Path(f"/proc/{c}").exists()] == []


def check_killing_a_child_fails_generate(engine: Engine, child: str,
                                         prompts: list[list[int]]) -> None:
    """``engine``'s ``child`` process killed 2 s into a long generate of ``prompts``: the call
    raises within 5 s of the death, naming the process, the engine is dead, and once closed
    none of its processes runs."""
    try:
        pid = engine.launcher.children[child].pid
        start = time.monotonic()
        threading.Timer(2.0, os.kill, (pid, signal.SIGKILL)).start()
        with pytest.raises(EngineDead, match=f"{child} process exited"):
            engine.generate(prompts, SamplingParams(max_tokens=3000, ignore_eos=True))
        assert time.monotonic() - start < 2.0 + 5.0
        assert not engine.alive
    finally:
        engine.close()
    for proc in engine.launcher.children.values():
        assert proc.poll() is not None


def test_engine_api_raises_when_the_worker_dies():
    engine = Engine("demo", num_pages=256)
    check_killing_a_child_fails_generate(engine, "worker", [[5, 6, 7]] * 8)
    assert not engine.launcher.socket_dir.exists()


def test_async_stream_yields_deltas_that_join_to_the_blocking_result(engine):
    import asyncio

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    whole = engine.generate("Streaming works", params)[0]

    async def collect():
        return [out async for out in engine.stream("Streaming works", params)]

    deltas = asyncio.run(collect())
    assert len(deltas) > 1 and deltas[-1].finish_reason == "length"
    assert "".join(d.text for d in deltas) == whole.text
    ids = [t for d in deltas for t in np.frombuffer(d.token_ids, np.int32).tolist()]
    assert ids == whole.token_ids


def test_generate_command_writes_results_in_order(tmp_path):
    lines = [{"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True},
             {"prompt_token_ids": [5, 6, 7], "max_tokens": 3, "ignore_eos": True},
             {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2,
              "ignore_eos": True,
              "seed": 1}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = subprocess.run(
        [sys.executable, "-m", "engine.cli", "generate", "--input", str(tmp_path / "in.jsonl"),
         "--output", str(tmp_path / "out.jsonl"), "--no-progress", "--num-pages", "256",
         "--model", "demo"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    results = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [len(r["outputs"]) for r in results] == [1, 1, 2]
    assert [len(r["outputs"][0]["token_ids"]) for r in results] == [4, 3, 2]
    assert results[1]["prompt_tokens"] == 3 and all(r["error"] is None for r in results)
