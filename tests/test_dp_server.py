"""``radixserve serve --dp-size 2`` end to end: requests sharing a prefix go to the replica that
cached it (the dispatcher learns it from that replica's KV events), /metrics reports each
replica, and killing one replica's scheduler fails or moves its requests at once while the
other replica keeps serving and the server still stops cleanly."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.server_process import AUTH, metric_values, serve_module

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_module(tmp_path_factory.mktemp("dp"), "--dp-size", "2", "--num-pages",
                            "512", "--api-key", "sk-radixserve-test")


def complete(server, prompt: list[int], max_tokens: int = 4) -> dict:
    reply = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=120, json={
        "model": "radixserve-demo", "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]


def per_replica(values: dict[str, float], name: str) -> list[float]:
    return [values[f"radixserve_dp_{name}{{replica={r}}}"] for r in (0, 1)]


def wait_for_metric(server, name: str, check, timeout: float = 5.0) -> list[float]:
    deadline = time.monotonic() + timeout
    while True:
        got = per_replica(metric_values(server), name)
        if check(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def test_shared_prefixes_go_where_they_are_cached(server):
    rng = random.Random(7)
    for group in range(4):
        head = rng.choices(range(3, 4000), k=200)
        usages = [complete(server, head + rng.choices(range(3, 4000), k=20)) for _ in range(3)]
        assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0, group
        for usage in usages[1:]:
            assert usage["prompt_tokens_details"]["cached_tokens"] >= 200, group
    routed = wait_for_metric(server, "requests_routed_total", lambda v: sum(v) >= 12)
    assert sum(routed) == 12 and min(routed) >= 3  # both replicas serve: groups spread
    loads = wait_for_metric(server, "requests_in_flight", lambda v: sum(v) == 0)
    assert loads == [0, 0]
    predicted = per_replica(metric_values(server), "predicted_cached_tokens_total")
    actual = per_replica(metric_values(server), "actual_cached_tokens_total")
    # whole 16-token blocks are predicted: at most a block short of what was found, per hit
    assert sum(actual) >= 8 * 200
    assert sum(actual) - 8 * 16 <= sum(predicted) <= sum(actual)
    values = metric_values(server)
    assert values["radixserve_prefix_cache_hit_tokens_total"] == sum(actual)
    assert values["radixserve_kv_pages_total"] == 2 * 512


def scheduler_pid(server, replica: int) -> int:
    for pid in server.children:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if cmdline[-2:] == [f"scheduler-{replica}".encode(), b""]:
            return pid
    raise AssertionError(f"no scheduler-{replica} among {server.children}")


def test_killing_a_replica_fails_its_requests_and_the_other_serves(server):
    rng = random.Random(11)

    async def one(client: httpx.AsyncClient) -> tuple[int, float]:
        reply = await client.post("/v1/completions", json={
            "model": "radixserve-demo", "prompt": rng.choices(range(3, 4000), k=40),
            "max_tokens": 1500, "temperature": 0, "ignore_eos": True})
        return reply.status_code, time.monotonic()

    async def run() -> list[tuple[int, float]]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as client:
            tasks = [asyncio.create_task(one(client)) for _ in range(4)]
            running = lambda v: v[0] >= 1 and v[1] >= 1  # noqa: E731
            await asyncio.to_thread(wait_for_metric, server, "num_requests_running", running)
            killed_at = time.monotonic()
            os.kill(scheduler_pid(server, 1), signal.SIGKILL)
            results = await asyncio.gather(*tasks)
            return [(status, done - killed_at) for status, done in results]

    results = asyncio.run(run())
    statuses = sorted(status for status, _ in results)
    assert 503 in statuses and 200 in statuses, results  # replica 1's fail, replica 0's finish
    for status, after_kill in results:
        if status == 503:
            assert after_kill < 5.0, results  # failed at once, not when the others finished
    alive = wait_for_metric(server, "replica_alive", lambda v: v == [1, 0])
    assert alive == [1, 0]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    for _ in range(3):  # every new request goes to the replica that is left
        complete(server, rng.choices(range(3, 4000), k=30))
    assert metric_values(server)["radixserve_engine_alive"] == 1.0
