"""``radixserve serve --dp-size 2 --sliding-kv-ratio 0.5`` end to end, on the small
Gemma-3-shaped model of tests/test_sliding_kv.py (with the demo model's tokenizer beside it):
each replica publishes its windows in its KV events, and the dispatcher sends a prompt to the
replica whose cache can serve it (a kept window before the match's end), not the one holding
more of its full KV; greedy tokens equal transformers'; /metrics shows no page left in use."""

from __future__ import annotations

import shutil
import time

import httpx
import numpy as np
import pytest

from engine.checkpoints.demo_model import build_demo_model
from tests.conftest_models import load_reference, write_checkpoint
from tests.server_process import AUTH, metric_values, serve_module
from tests.test_scheduler import hf_greedy

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    model = write_checkpoint(
        tmp_path_factory.mktemp("gemma3_dp") / "model", "gemma3", sliding_window=16,
        num_hidden_layers=3, max_position_embeddings=512,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    demo = build_demo_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(demo / name, model / name)
    return str(model)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    yield from serve_module(tmp_path_factory.mktemp("sliding_dp"), "--model", model_dir,
                            "--dp-size", "2", "--sliding-kv-ratio", "0.5", "--page-size", "4",
                            "--num-pages", "512", "--chunked-prefill-size", "24",
                            "--quantization", "none", "--api-key", "sk-radixserve-test")


def complete(server, prompt: list[int]) -> dict:
    reply = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=120, json={
        "model": "model", "prompt": prompt, "max_tokens": 20, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert reply.status_code == 200, reply.text
    return reply.json()


def routed(server) -> list[float]:
    values = metric_values(server)
    return [values[f"radixserve_dp_requests_routed_total{{replica={r}}}"] for r in (0, 1)]


def wait_for_events(server, count: int) -> None:
    """The replicas' events reach the dispatcher a moment after their outputs: wait until
    ``count`` requests have finished there (none in flight), then a little for the events."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        values = metric_values(server)
        if sum(values[f"radixserve_dp_requests_in_flight{{replica={r}}}"] for r in (0, 1)) == 0:
            break
        time.sleep(0.1)
    time.sleep(0.5)
    assert sum(routed(server)) == count


def test_a_prompt_goes_where_a_kept_window_serves_it(server, model_dir):
    rng = np.random.default_rng(4)
    head = rng.integers(3, 90, 64).tolist()
    long, short = head + rng.integers(3, 90, 24).tolist(), head[:32]
    query = head[:48] + rng.integers(3, 90, 8).tolist()
    answers = {}
    for count, (name, prompt) in enumerate((("long", long), ("short", short), ("query", query),
                                            ("again", query)), 1):
        answers[name] = complete(server, prompt)
        wait_for_events(server, count)
    cached = {name: a["usage"]["prompt_tokens_details"]["cached_tokens"]
              for name, a in answers.items()}
    # "long" went to replica 0, "short" to the other (no usable match anywhere: the one
    # caching less); "query" shares 48 tokens' full KV with "long" but no window before their
    # end, and 32 tokens with "short" whose window is kept where it ends: it hits those 32
    assert cached == {"long": 0, "short": 0, "query": 32, "again": len(query) - 1}
    assert routed(server) == [1, 3]
    reference = load_reference(model_dir)
    for name, prompt in (("long", long), ("short", short), ("query", query), ("again", query)):
        assert answers[name]["choices"][0]["token_ids"] == hf_greedy(reference, prompt, 20), name
    # every replica's stats come back to 0 pages in use, in both pools
    names = ("radixserve_kv_pages_used", "radixserve_sliding_kv_pages_used")
    deadline = time.monotonic() + 10
    while (used := [metric_values(server).get(n) for n in names]) != [0, 0]:
        assert time.monotonic() < deadline, used
        time.sleep(0.2)
    assert metric_values(server)["radixserve_sliding_kv_pages_total"] == 2 * 256
