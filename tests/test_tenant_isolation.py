"""Tenants on one real ``radixserve serve --salt-from-user --api-key``: requests with different
``cache_salt`` (or, with the option, different ``user``) never share cached prompt tokens, the
same salt does; and ``/metrics`` sits behind the key, its pool gauges right from startup."""

from __future__ import annotations

import httpx
import pytest
from starlette.testclient import TestClient

from engine.contracts.engine_config import EngineConfig
from engine.server.app import build_app
from engine.server.options import ServeOptions
from engine.server.service import Service
from radix import Lease, PageAllocator, RadixTree
from tests.server_process import API_KEY, AUTH, ServerProcess, metric_values
from tests.test_server_app import INFO, ScriptedClient

NUM_PAGES = 1024
SECRET = ("The confidential merger plan of Example Corp: buy the rival at forty dollars a "
          "share, announce on the first Monday of the quarter, and tell nobody until then.")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("tenants"), "--num-pages", str(NUM_PAGES),
                        "--api-key", API_KEY, "--salt-from-user")
    yield srv
    assert srv.stop() == 0


def cached(server, path: str, body: dict) -> int:
    """Prompt tokens the request found in the cache; a hit is always the whole prompt but its
    last token (whose logits must be computed)."""
    if path != "/generate":
        body = {"max_tokens": 2, **body}
    response = httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    hit = usage["prompt_tokens_details"]["cached_tokens"]
    assert hit in (0, usage["prompt_tokens"] - 1)
    return hit


@pytest.mark.e2e
def test_metrics_need_the_key_and_count_the_pool_from_startup(server):
    # First in the module: no request has run yet, so the scheduler has reported nothing.
    refused = httpx.get(f"{server.url}/metrics", timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    values = metric_values(server)  # sends the key
    assert values["radixserve_kv_pages_total"] == NUM_PAGES
    assert values["radixserve_kv_pages_used"] == 0
    assert values["radixserve_engine_alive"] == 1


def test_metrics_open_serves_them_without_the_key():
    config = EngineConfig(model="/models/tiny")
    closed = TestClient(build_app(Service(ScriptedClient(), INFO, config,
                                          ServeOptions(api_key=API_KEY))))
    assert closed.get("/metrics").status_code == 401
    assert closed.get("/metrics", headers=AUTH).status_code == 200
    assert closed.get("/health").status_code == 200
    opened = TestClient(build_app(Service(ScriptedClient(), INFO, config,
                                          ServeOptions(api_key=API_KEY, metrics_open=True))))
    assert opened.get("/metrics").status_code == 200
    assert opened.post("/v1/completions", json={"prompt": "x"}).status_code == 401


@pytest.mark.e2e
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": SECRET}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SECRET}]}),
    ("/generate", {"input_ids": list(range(40, 140)), "sampling_params": {"max_tokens": 2}}),
], ids=["completions", "chat", "generate"])
def test_different_salts_never_share_cache(server, path, body):
    assert cached(server, path, {**body, "cache_salt": "tenant-a"}) == 0
    hit = cached(server, path, {**body, "cache_salt": "tenant-a"})
    assert hit > 0
    # Another tenant with the very same prompt learns nothing from the cache...
    assert cached(server, path, {**body, "cache_salt": "tenant-b"}) == 0
    # ...and neither does a request without a salt; they share with each other only.
    assert cached(server, path, body) == 0
    assert cached(server, path, body) == hit
    assert cached(server, path, {**body, "cache_salt": "tenant-b"}) == hit


@pytest.mark.e2e
def test_user_is_the_salt_with_salt_from_user(server):
    body = {"prompt": "user scoped: " + SECRET}
    assert cached(server, "/v1/completions", {**body, "user": "alice"}) == 0
    hit = cached(server, "/v1/completions", {**body, "user": "alice"})
    assert hit > 0
    assert cached(server, "/v1/completions", {**body, "user": "bob"}) == 0
    assert cached(server, "/v1/completions", body) == 0  # no user: the shared namespace


@pytest.mark.e2e
def test_a_salt_never_reaches_into_another_users_cache(server):
    body = {"prompt": "both: " + SECRET, "cache_salt": "shared-salt"}
    assert cached(server, "/v1/completions", {**body, "user": "alice"}) == 0
    assert cached(server, "/v1/completions", {**body, "user": "alice"}) > 0
    # Both count: bob naming alice's salt still gets his own namespace, as does alice alone.
    assert cached(server, "/v1/completions", {**body, "user": "bob"}) == 0
    assert cached(server, "/v1/completions", {"prompt": body["prompt"], "user": "alice"}) == 0


@pytest.mark.e2e
def test_an_empty_salt_is_refused(server):
    response = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                          json={"prompt": "x", "cache_salt": ""})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "cache_salt"


def test_a_new_salt_per_request_does_not_grow_the_tree_forever():
    tree = RadixTree(PageAllocator(8, 4))
    for i in range(10_000):
        tokens = [1, 2, 3, 4, 5, i]
        lease = Lease(tree, tokens, f"salt-{i}", max_len=len(tokens) - 1)
        assert lease.length == 0
        pages, _ = lease.acquire(len(tokens))  # evicts older salts' pages once the pool is full
        lease.release(pages, tokens)  # the request finished: only the tree holds them
        tree.check()
    assert tree.num_namespaces < 200
    assert tree.peek_prefix([1, 2, 3, 4, 5, 9_999], namespace="salt-9999") == 6
