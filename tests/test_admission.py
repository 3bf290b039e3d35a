"""The frontend's pending limit under concurrency: ``--max-inflight-requests`` counts a call the
moment it is made, so simultaneous arrivals cannot all slip in before any reaches the engine;
a request that could never fit is a 400, not a "retry later"."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.server_process import ServerProcess, metric_values

pytestmark = pytest.mark.e2e

LIMIT = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("admission"), "--num-pages", "512",
                        "--max-inflight-requests", str(LIMIT))
    yield srv
    assert srv.stop() == 0


def test_exactly_the_limit_gets_in_when_twelve_arrive_at_once(server):
    body = {"prompt": "def main():", "max_tokens": 3000, "temperature": 0, "ignore_eos": True,
            "stream": True}

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            async def one() -> int:
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    return resp.status_code  # leaving here closes the stream: an abort
            return await asyncio.gather(*(one() for _ in range(12)))

    statuses = asyncio.run(main())
    assert sorted(statuses) == [200] * LIMIT + [503] * (12 - LIMIT)
    # The aborted streams give their places (and pages) back.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        values = metric_values(server)
        if values["radixserve_kv_pages_used"] == 0 and values["radixserve_num_requests_pending"] == 0:
            break
        time.sleep(0.2)
    assert values["radixserve_kv_pages_used"] == 0
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200


def test_more_prompts_than_the_limit_is_a_400(server):
    resp = httpx.post(f"{server.url}/v1/completions",
                      json={"prompt": ["a"] * (LIMIT + 1), "max_tokens": 2}, timeout=60)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "prompt"
    assert f"at most {LIMIT}" in resp.json()["error"]["message"]
