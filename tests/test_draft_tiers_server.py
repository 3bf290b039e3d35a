"""``radixserve serve`` with a draft model (the demo model drafting for itself) over the host
and disk tiers, end to end: a prompt that later prompts evicted from a 16-page device pool comes
back from host memory, a restart (SIGTERM, then a new server on the same directory) reads it
from disk, and the greedy output is the same every time. Which steps draft depends on measured
step times (scheduler/draft_model.py), so the draft's part is checked in-process
(tests/test_draft_tiers.py); here, that the processes serve it."""

from __future__ import annotations

import json
import random

import pytest

from tests.server_process import metric_values
from tests.test_disk_cache_server import complete, serve

pytestmark = pytest.mark.e2e


def test_a_draft_models_server_uses_host_memory_and_a_restart_reads_its_disk(tmp_path):
    cache = tmp_path / "kv"
    cache.mkdir(mode=0o700)
    draft = json.dumps({"model": "demo", "num_speculative_tokens": 4})
    # 16 pages of 16 tokens on the device; 0.01 GiB of host memory is about 80 pages of both
    # demo models' KV in fp32
    args = ("--num-pages", "16", "--host-cache-gb", "0.01", "--disk-cache-dir", str(cache),
            "--speculative-config", draft)
    prompts = [random.Random(seed).choices(range(3, 4000), k=120) for seed in range(4)]
    first = serve(tmp_path / "a", *args)
    try:
        before = complete(first, prompts[0], max_tokens=16)
        for prompt in prompts[1:]:  # 3 x 8 pages: the first prompt's pages leave the device
            complete(first, prompt)
        again = complete(first, prompts[0], max_tokens=16)
        values = metric_values(first)
    finally:
        assert first.stop() == 0
    assert again["cached_tokens"] == 119 and again["cached_tokens_host"] >= 112
    assert again["text"] == before["text"]
    assert values["radixserve_host_cache_pages_total"] > 50
    second = serve(tmp_path / "b", *args)
    try:
        after = complete(second, prompts[0], max_tokens=16)
    finally:
        assert second.stop() == 0
    assert after["cached_tokens_disk"] >= 112
    assert after["text"] == before["text"]
