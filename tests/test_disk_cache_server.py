"""``radixserve serve --disk-cache-dir`` end to end: a 2,000-token prompt survives a restart
(SIGTERM, then a new server on the same directory reports at least 1,984 cached tokens and the
same greedy output); two servers share one directory; a directory removed while serving, or a
``--disk-cache-gb`` limit smaller than the traffic, changes no output; a missing directory is
refused at start with a sentence."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.server_process import ServerProcess, metric_values

pytestmark = pytest.mark.e2e


def serve(tmp: Path, *args: str) -> ServerProcess:
    tmp.mkdir()
    return ServerProcess(tmp, *args)


def complete(server: ServerProcess, prompt: list[int], max_tokens: int = 8) -> dict:
    reply = httpx.post(f"{server.url}/v1/completions", timeout=300, json={
        "model": "radixserve-demo", "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    return {"text": body["choices"][0]["text"], **body["usage"]["prompt_tokens_details"]}


def long_prompt(seed: int, length: int = 2000) -> list[int]:
    return random.Random(seed).choices(range(3, 4000), k=length)


def test_a_prompt_survives_a_restart(tmp_path):
    """Serve, send a 2,000-token prompt, stop with SIGTERM, serve again on the same directory
    and send it again: the first request after the restart finds every whole block of the
    prompt on disk and answers the same."""
    cache = tmp_path / "kv"
    cache.mkdir(mode=0o700)
    prompt = long_prompt(1)
    first = serve(tmp_path / "a", "--disk-cache-dir", str(cache))
    try:
        before = complete(first, prompt)
    finally:
        assert first.stop() == 0
    assert before["cached_tokens"] == before["cached_tokens_disk"] == 0
    second = serve(tmp_path / "b", "--disk-cache-dir", str(cache))
    try:
        after = complete(second, prompt)
        values = metric_values(second)
    finally:
        assert second.stop() == 0
    assert after["cached_tokens"] >= 1984 and after["cached_tokens_disk"] >= 1984
    assert after["text"] == before["text"]
    assert values["radixserve_prefix_cache_tier_hit_tokens_total{tier=disk}"] >= 1984
    assert values["radixserve_disk_cache_bytes_moved_total{direction=read}"] > 0
    assert values["radixserve_disk_cache_on"] == 1


def test_two_servers_share_a_directory_and_survive_its_removal(tmp_path):
    """Two servers on one directory: what one computes, the other loads. The directory removed
    under both: they go on serving (recomputing) with the same outputs. Then a limit far below
    the traffic: the store stays within it, outputs unchanged."""
    cache = tmp_path / "kv"
    cache.mkdir(mode=0o700)
    prompts = [long_prompt(seed, 400) for seed in range(2, 5)]
    a = serve(tmp_path / "a", "--disk-cache-dir", str(cache))
    b = serve(tmp_path / "b", "--disk-cache-dir", str(cache))
    try:
        from_a = [complete(a, p) for p in prompts]
        from_b = [complete(b, p) for p in prompts]
        assert [r["text"] for r in from_b] == [r["text"] for r in from_a]
        assert all(r["cached_tokens_disk"] >= 384 for r in from_b)
        shutil.rmtree(cache)
        fresh = long_prompt(5, 400)
        assert complete(a, fresh)["text"] == complete(b, fresh)["text"]
        assert complete(b, fresh)["cached_tokens_disk"] == 0
    finally:
        assert a.stop() == 0
        assert b.stop() == 0
    cache.mkdir(mode=0o700)
    # 0.001 GiB holds about 40 blocks of the demo model in fp32: far fewer than 10 prompts'.
    small = serve(tmp_path / "c", "--disk-cache-dir", str(cache), "--disk-cache-gb", "0.001")
    try:
        many = [long_prompt(seed, 400) for seed in range(10, 20)]
        texts = [complete(small, p)["text"] for p in many]
    finally:
        assert small.stop() == 0
    assert sum(f.stat().st_size for f in cache.glob("*/*/*.kv")) <= 2**30 * 0.001
    plain = serve(tmp_path / "d")
    try:
        assert [complete(plain, p)["text"] for p in many] == texts
    finally:
        assert plain.stop() == 0


def test_a_missing_directory_is_refused_at_start(tmp_path):
    missing = tmp_path / "nowhere"
    done = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--model", "demo",
                           "--disk-cache-dir", str(missing)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"--disk-cache-dir {missing} does not exist" in done.stderr
