"""``radixserve serve --host-cache-gb`` end to end: a prompt that later prompts evicted from a
16-page device pool comes back from host memory, and says so in its usage
(``prompt_tokens_details.cached_tokens_host``, radixserve's extension) and in /metrics."""

from __future__ import annotations

import random

import httpx
import pytest

from tests.server_process import API_KEY, AUTH, metric_values, serve_module

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # 16 pages of 16 tokens on the device; 0.01 GiB of host memory is about 160 such pages of
    # the demo model in fp32.
    yield from serve_module(tmp_path_factory.mktemp("host-cache"), "--num-pages", "16",
                            "--host-cache-gb", "0.01", "--api-key", API_KEY)


def usage_of(server, prompt: list[int]) -> dict:
    reply = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=120, json={
        "model": "radixserve-demo", "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens_details"]


def test_an_evicted_prompt_comes_back_from_host_memory(server):
    rng = random.Random(3)
    prompts = [rng.choices(range(3, 4000), k=120) for _ in range(4)]
    first = usage_of(server, prompts[0])
    assert first == {"cached_tokens": 0, "cached_tokens_host": 0}
    for prompt in prompts[1:]:  # 3 x 8 pages: the first prompt's pages leave the device
        usage_of(server, prompt)
    again = usage_of(server, prompts[0])
    assert again["cached_tokens"] == 119
    assert again["cached_tokens_host"] >= 112  # at least its first 7 pages were on the host
    values = metric_values(server)
    assert values["radixserve_prefix_cache_tier_hit_tokens_total{tier=host}"] >= 112
    assert values["radixserve_host_cache_pages_moved_total{direction=load}"] >= 7
    assert values["radixserve_host_cache_pages_moved_total{direction=write}"] >= 7
    assert values["radixserve_host_cache_pages_total"] > 100
