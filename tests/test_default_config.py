"""The configuration users start with, end to end: a GGUF whose blocks the compiled kernels read
(``--quantization auto``), in the machine's default dtype (tests/conftest.py's
``default_model``, a tiny Q4_1 file on the default model's path). Each family of the server's
features runs on it: sessions and ``radixserve chat --url`` over several turns, streaming,
``n`` and beams, structured output and tool calls, speculation, LoRA, host and disk tiers, and
preemption with swap. The demo model's runs of these families test their behaviour in detail;
these show that the default path serves them at all (a session's second turn once killed the
default server, which the demo model's float weights never reached)."""

from __future__ import annotations

import json
import os
import pty
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch

from engine.checkpoints.gguf import gguf_checkpoint
from tests.server_process import API_KEY, AUTH, ServerProcess, metric_values, serve_module
from tests.test_chat_cli import STATS, expect

pytestmark = pytest.mark.e2e

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"enum": [1, 2, 3]}},
          "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                   "required": ["city"], "additionalProperties": False}}}


def ids(seed: int, length: int) -> list[int]:
    """Token ids of the byte-level vocabulary (its 256 byte symbols)."""
    return random.Random(seed).choices(range(256), k=length)


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model):
    yield from serve_module(tmp_path_factory.mktemp("default"), "--model", default_model,
                            "--api-key", API_KEY, machine_dtype=True)


def post(server: ServerProcess, path: str, body: dict) -> dict:
    reply = httpx.post(f"{server.url}{path}", headers=AUTH, json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def chat(server: ServerProcess, messages: list[dict], **fields) -> dict:
    return post(server, "/v1/chat/completions",
                {"messages": messages, "max_tokens": 12, "temperature": 0, **fields})


def test_the_server_runs_the_default_path(server):
    """What makes this the default path: the machine's default dtype (bf16 where the CPU has
    it) and the file's Q4_1 blocks read by the kernels."""
    from engine.worker.runner import resolve_dtype

    values = metric_values(server)
    assert values["radixserve_model_weight_bytes{format=q4_1}"] > 0
    dtype = str(resolve_dtype(None, torch.device("cpu"))).removeprefix("torch.")
    assert [key for key in values if key.startswith("radixserve_kv_cache_info")
            and f"kv_cache_dtype={dtype}" in key], values


def test_a_session_serves_turn_after_turn_from_the_cache(server):
    session = post(server, "/v1/sessions", {})["id"]
    history = 0
    for turn, words in enumerate(["Hi!", "What is 2 + 2?", "And 3 + 3?", "Thanks."]):
        answer = chat(server, [{"role": "user", "content": words}], session_id=session)
        usage = answer["usage"]
        assert answer["choices"][0]["finish_reason"] in ("stop", "length")
        if turn:  # every earlier turn, its reply included, came from the cache
            assert usage["prompt_tokens_details"]["cached_tokens"] >= history
        history = usage["prompt_tokens"] + usage["completion_tokens"]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_radixserve_chat_over_a_running_server(server, tmp_path):
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "chat", "--url", server.url, "--api-key", API_KEY,
         "--max-tokens", "6", "--temperature", "0"],
        stdin=slave, stdout=slave, stderr=slave, env={**os.environ, "TMPDIR": str(tmp_path)})
    os.close(slave)
    try:
        expect(master, "you> ")
        stats = []
        for words in (b"Hello there!\n", b"Tell me more.\n", b"And then?\n"):
            os.write(master, words)
            stats.append(STATS.search(expect(master, "you> ", 120)))
        assert all(stats)
        for before, after in zip(stats, stats[1:], strict=False):
            prompt, _, generated, _ = map(int, before.groups())
            assert int(after.group(2)) == prompt + generated
        os.write(master, b"\x04")
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


def test_a_stream_ends_with_its_finish_reason_and_usage(server):
    body = {"messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 10,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    chunks = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers=AUTH, json=body,
                      timeout=120) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
    assert not chunks[-1]["choices"] and 1 <= chunks[-1]["usage"]["completion_tokens"] <= 10


def test_n_samples_and_beams(server):
    prompt = ids(1, 40)
    sampled = post(server, "/generate", {"input_ids": prompt, "sampling_params": {
        "max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 7, "ignore_eos": True}})
    assert [len(c["token_ids"]) for c in sampled["choices"]] == [8, 8, 8]
    beams = post(server, "/generate", {"input_ids": prompt, "sampling_params": {
        "max_tokens": 6, "n": 2, "beam_width": 3, "ignore_eos": True}})
    first, second = (tuple(c["token_ids"]) for c in beams["choices"])
    assert first != second and len(first) == len(second) == 6


def test_structured_output_and_a_named_tool_call(server):
    answer = chat(server, [{"role": "user", "content": "A trip, as JSON."}], max_tokens=60,
                  response_format={"type": "json_schema",
                                   "json_schema": {"name": "trip", "schema": SCHEMA}})
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    called = chat(server, [{"role": "user", "content": "Weather in Oslo?"}], max_tokens=60,
                  tools=[WEATHER],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = called["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]),
                        WEATHER["function"]["parameters"])


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, default_model) -> dict[str, str]:
    from tests.lora_fixtures import make_adapters

    converted = str(gguf_checkpoint(default_model, tmp_path_factory.mktemp("converted")))
    return make_adapters(converted, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def features(tmp_path_factory, default_model, adapters):
    """Speculation from the request and the cache, and LoRA adapters, on the default path."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                       "prompt_lookup_max": 3})
    yield from serve_module(tmp_path_factory.mktemp("features"), "--model", default_model,
                            "--api-key", API_KEY, "--speculative-config", spec, "--enable-lora",
                            "--lora-modules", *(f"{n}={p}" for n, p in adapters.items()),
                            machine_dtype=True)


def test_speculation_drafts_and_answers(features):
    # a prompt that repeats itself: the n-gram drafter finds continuations in it
    prompt = ids(2, 12) * 8
    answer = post(features, "/v1/completions", {"prompt": prompt, "max_tokens": 24,
                                                 "temperature": 0, "ignore_eos": True})
    assert answer["usage"]["completion_tokens"] == 24
    values = metric_values(features)
    assert values["radixserve_spec_decode_num_draft_tokens_total{method=ngram}"] > 0


def test_lora_adapters_answer_under_their_own_names(features, adapters):
    prompt = ids(3, 30)
    body = {"input_ids": prompt, "sampling_params": {"max_tokens": 8, "temperature": 0,
                                                     "ignore_eos": True}}
    base = post(features, "/generate", body)
    for name in adapters:
        answer = post(features, "/generate", {**body, "model": name})
        assert answer["model"] == name and len(answer["choices"][0]["token_ids"]) == 8
        # an adapter's namespace never hits the base model's cache
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert base["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    values = metric_values(features)
    assert all(values[f"radixserve_lora_requests_total{{adapter={name},status=200}}"] >= 1
               for name in adapters)


@pytest.fixture(scope="module")
def tiered(tmp_path_factory, default_model):
    """A device pool of 16 pages over a host tier and a disk tier, preempting by swap."""
    cache = tmp_path_factory.mktemp("kv")
    cache.chmod(0o700)
    yield from serve_module(tmp_path_factory.mktemp("tiered"), "--model", default_model,
                            "--api-key", API_KEY, "--num-pages", "16", "--host-cache-gb", "0.01",
                            "--disk-cache-dir", str(cache), "--preemption-mode", "swap",
                            "--num-host-pages", "64", machine_dtype=True)


def usage_of(server: ServerProcess, prompt: list[int], max_tokens: int = 2) -> dict:
    answer = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                              "temperature": 0, "ignore_eos": True})
    assert answer["usage"]["completion_tokens"] == max_tokens
    return answer["usage"]["prompt_tokens_details"]


def test_an_evicted_prompt_comes_back_from_a_lower_tier(tiered):
    prompts = [ids(10 + i, 120) for i in range(4)]
    assert usage_of(tiered, prompts[0])["cached_tokens"] == 0
    for prompt in prompts[1:]:  # 3 x 8 pages: the first prompt's pages leave the device
        usage_of(tiered, prompt)
    again = usage_of(tiered, prompts[0])
    assert again["cached_tokens"] == 119
    assert again["cached_tokens_host"] + again["cached_tokens_disk"] >= 112


def test_a_full_pool_preempts_by_swap_and_every_request_finishes(tiered):
    """Six requests of 9 pages each at once on 16 pages: some wait, some are swapped out."""
    with ThreadPoolExecutor(6) as pool:
        usages = list(pool.map(lambda i: usage_of(tiered, ids(20 + i, 80), 60), range(6)))
    assert len(usages) == 6
    assert metric_values(tiered)["radixserve_preemptions_total"] > 0
    assert httpx.get(f"{tiered.url}/health", timeout=10).status_code == 200


def test_the_disk_tier_serves_a_prompt_after_a_restart(tmp_path, default_model):
    cache = tmp_path / "kv"
    cache.mkdir(mode=0o700)
    prompt = ids(30, 300)
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        srv = ServerProcess(tmp_path / name, "--model", default_model, "--api-key", API_KEY,
                            "--disk-cache-dir", str(cache), machine_dtype=True)
        try:
            usage = usage_of(srv, prompt)
        finally:
            assert srv.stop() == 0
    assert usage["cached_tokens_disk"] >= 288


def test_the_default_model_file_is_what_users_download(default_model):
    """The fixture is a GGUF of Q4_1 blocks, as SmolLM2-135M-Instruct's file is."""
    from gguf import GGUFReader

    kinds = {t.tensor_type.name for t in GGUFReader(default_model).tensors if len(t.shape) == 2}
    assert kinds == {"Q4_1"} and Path(default_model).suffix == ".gguf"


def test_the_session_example_of_docs_usage_runs_as_written(server):
    """docs/usage.md's "Sessions" commands, run by bash against this server (its port and API
    key put in): both turns answer, the second from the cache of the first."""
    text = (Path(__file__).parents[1] / "docs" / "usage.md").read_text()
    section = text[text.index("## Sessions"):]
    script = section[section.index("```bash\n") + 8:section.index("```\n", 8)]
    script = (script.replace("localhost:30000", server.url.removeprefix("http://"))
              .replace("curl -s", f"curl -s -H 'Authorization: Bearer {API_KEY}'"))
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    decoder, replies, at = json.JSONDecoder(), [], 0
    while at < len(result.stdout.rstrip()):
        reply, at = decoder.raw_decode(result.stdout, at)
        replies.append(reply)
    first, second = (r["usage"] for r in replies[:2])
    assert second["prompt_tokens_details"]["cached_tokens"] >= (
        first["prompt_tokens"] + first["completion_tokens"])
