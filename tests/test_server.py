"""The HTTP server as a real ``radixserve serve`` process (demo model), started once for the
module: the official openai client, sessions, a table of bad inputs, disconnects, concurrency
and metrics. ``tests/server_process.py`` starts and stops it."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.server_process import API_KEY, AUTH, metric_values, serve_module

pytestmark = pytest.mark.e2e

# The limits the table of bad inputs below expects of a server (test_hostile_inputs.py too).
TABLE_FLAGS = ("--api-key", API_KEY, "--max-request-bytes", str(1 << 20), "--max-sessions", "4",
               "--max-inflight-requests", "96")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_module(tmp_path_factory.mktemp("server"), "--num-pages", "2048",
                            *TABLE_FLAGS)


def http(server) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers=AUTH, timeout=120)


# ------------------------------------------------------------------------ openai client
def test_completion_with_the_openai_client_reports_cached_tokens(oai, model):
    prompt = "The radix tree keeps every prefix it has seen, so"
    first = oai.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    again = oai.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    assert first.object == "text_completion" and first.choices[0].finish_reason == "length"
    assert first.usage.completion_tokens == 6
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_chat_stream_with_usage_matches_the_whole_response(oai, model):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a prime number."}]
    whole = oai.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                        temperature=0)
    chunks = list(oai.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == whole.usage.prompt_tokens - 1


def test_completion_stream_and_parallel_samples(oai, model):
    stream = oai.completions.create(model=model, prompt=["one", "two"], max_tokens=5, n=2,
                                    temperature=1.0, seed=7, stream=True,
                                    stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
        usage = chunk.usage or usage
    assert sorted(texts) == [0, 1, 2, 3]  # prompt i, sample j → choice 2 * i + j
    assert usage.completion_tokens == 20
    whole = oai.completions.create(model=model, prompt="one", max_tokens=5, n=2,
                                   temperature=1.0, seed=7)
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.usage.completion_tokens == 10


def test_logprobs_in_openai_shapes(oai, model):
    chat = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].logprob <= 0 and content[0].bytes == list(content[0].token.encode())
    completion = oai.completions.create(model=model, prompt="x", max_tokens=3, temperature=0,
                                        logprobs=2)
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == completion.choices[0].text
    assert lp.text_offset[0] == 0


def test_stop_strings_and_seeds(oai, model):
    free = oai.completions.create(model=model, prompt="import os", max_tokens=12,
                                  temperature=0, extra_body={"ignore_eos": True})
    text = free.choices[0].text
    stop = text[len(text) // 2:][:3]
    cut = oai.completions.create(model=model, prompt="import os", max_tokens=12, temperature=0,
                                 stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    seeded = [oai.completions.create(model=model, prompt="import os", max_tokens=8, seed=11,
                                     temperature=1.0).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_beam_search_through_extra_body(oai, model):
    out = oai.completions.create(model=model, prompt="def main(", max_tokens=4, n=2,
                                 extra_body={"use_beam_search": True, "best_of": 3})
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text != out.choices[1].text


def test_native_generate_takes_and_returns_token_ids(server):
    with http(server) as client:
        body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_tokens": 4,
                                                              "temperature": 0}}
        whole = client.post("/generate", json=body).json()
        assert len(whole["choices"][0]["token_ids"]) == 4
        with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        ids = [t for e in events for c in e["choices"] for t in c["token_ids"]]
        assert ids == whole["choices"][0]["token_ids"]
        assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 3
        # logprobs = N: each token's N most likely alternatives by id, greedy's own the first.
        body["sampling_params"]["logprobs"] = 3
        choice = client.post("/generate", json=body).json()["choices"][0]
        assert choice["token_ids"] == whole["choices"][0]["token_ids"]
        assert len(choice["logprobs"]) == len(choice["top_logprobs"]) == 4
        for token, logprob, top in zip(choice["token_ids"], choice["logprobs"],
                                       choice["top_logprobs"], strict=True):
            assert len(top) == 3 and top[0] == {"token_id": token, "logprob": logprob}
            assert top[0]["logprob"] >= top[1]["logprob"] >= top[2]["logprob"]
        assert whole["choices"][0]["top_logprobs"] is None


# ---------------------------------------------------------------------------- sessions
def test_session_turns_hit_the_whole_history(server, oai, model):
    with http(server) as client:
        session = client.post("/v1/sessions").json()
        assert session["object"] == "session"
        history = 0
        for turn in range(5):
            response = oai.chat.completions.create(
                model=model, max_tokens=4, temperature=0,
                messages=[{"role": "user", "content": f"Turn {turn}: tell me more."}],
                extra_body={"session_id": session["id"]})
            usage = response.usage
            if turn:
                # Everything the server held (previous prompts and replies) was a cache hit.
                assert usage.prompt_tokens_details.cached_tokens == history
                assert usage.prompt_tokens > history
            history = usage.prompt_tokens + usage.completion_tokens
        # The pin lands one scheduler step after the reply, and the gauge with the next stats
        # message: wait for it rather than race it.
        deadline = time.monotonic() + 10
        while (pinned := metric_values(server)["radixserve_pinned_tokens"]) != history:
            assert time.monotonic() < deadline, f"pinned {pinned} tokens, history {history}"
            time.sleep(0.1)
        assert client.delete(f"/v1/sessions/{session['id']}").json()["deleted"] is True
        deadline = time.monotonic() + 10
        while metric_values(server)["radixserve_pinned_tokens"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric_values(server)["radixserve_pinned_tokens"] == 0


def test_session_limits_and_one_turn_at_a_time(server):
    with http(server) as client:
        opened = []
        while (response := client.post("/v1/sessions")).status_code == 200:
            opened.append(response.json()["id"])
        assert len(opened) == 4 and response.status_code == 429
        assert "4 open sessions" in response.json()["error"]["message"]
        turn = {"session_id": opened[0], "max_tokens": 200, "ignore_eos": True, "stream": True,
                "messages": [{"role": "user", "content": "a long answer, please"}]}
        with client.stream("POST", "/v1/chat/completions", json=turn) as running:
            lines = running.iter_lines()  # kept: dropping it would close the connection
            assert next(lines).startswith("data: ")
            busy = client.post("/v1/chat/completions", json={**turn, "stream": False})
            assert busy.status_code == 409
            assert "turn in progress" in busy.json()["error"]["message"]
            assert [line for line in lines if line][-1] == "data: [DONE]"
        for session_id in opened:
            assert client.delete(f"/v1/sessions/{session_id}").status_code == 200


# ------------------------------------------------------------------------- bad inputs
def _chat(**fields):
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def _completion(**fields):
    return {"prompt": "hi", "max_tokens": 2, **fields}


BAD_INPUTS = [
    # (id, method, path, body, headers, status, words in the message)
    ("not-json", "POST", "/v1/completions", b"{oops", None, 400, "not valid JSON"),
    ("wrong-type", "POST", "/v1/completions", _completion(max_tokens="5"), None, 400,
     "max_tokens"),
    ("unknown-field", "POST", "/v1/completions", _completion(temprature=0), None, 400,
     "unknown or unsupported field 'temprature'"),
    ("temperature", "POST", "/v1/completions", _completion(temperature=-1), None, 400,
     "temperature must be in [0, 100]"),
    ("top-p", "POST", "/v1/chat/completions", _chat(top_p=0), None, 400, "top_p"),
    ("n-zero", "POST", "/v1/completions", _completion(n=0), None, 400, "n must be at least 1"),
    ("max-tokens-zero", "POST", "/v1/completions", _completion(max_tokens=0), None, 400,
     "max_tokens must be at least 1"),
    ("penalty", "POST", "/v1/completions", _completion(frequency_penalty=3), None, 400,
     "frequency_penalty must be in [-2, 2]"),
    ("empty-prompt-list", "POST", "/v1/completions", _completion(prompt=[]), None, 400,
     "prompt must not be an empty list"),
    ("mixed-prompt", "POST", "/v1/completions", _completion(prompt=[1, "a"]), None, 400,
     "prompt must be a string"),
    ("bool-in-ids", "POST", "/v1/completions", _completion(prompt=[5, True]), None, 400,
     "prompt must be a string"),
    ("float-in-id-lists", "POST", "/v1/completions", _completion(prompt=[[5], [6, 1.0]]), None,
     400, "prompt must be a string"),
    ("empty-prompt", "POST", "/v1/completions", _completion(prompt=""), None, 400,
     "the prompt is empty"),
    ("token-out-of-vocab", "POST", "/v1/completions", _completion(prompt=[5, 999999]), None,
     400, "prompt token ids must be in [0, 4096)"),
    ("prompt-too-long", "POST", "/v1/completions", _completion(prompt=[5] * 5000), None, 400,
     "the prompt has 5,000 tokens and max_tokens is 2, but the model's context is 4,096"),
    ("max-tokens-past-context", "POST", "/v1/chat/completions", _chat(max_tokens=5000), None,
     400, "max_tokens is 5,000, but the model's context is 4,096"),
    ("logprobs", "POST", "/v1/completions", _completion(logprobs=21), None, 400,
     "logprobs must be between 0 and 20"),
    ("too-many-stops", "POST", "/v1/completions", _completion(stop=["x"] * 17), None, 400,
     "at most 16 stop strings"),
    ("best-of", "POST", "/v1/completions", _completion(best_of=3), None, 400,
     "best_of other than n needs use_beam_search"),
    ("suffix", "POST", "/v1/completions", _completion(suffix="x"), None, 400,
     "suffix is not supported"),
    ("prompt-logprobs", "POST", "/generate",
     {"input_ids": [1], "sampling_params": {"prompt_logprobs": 21}}, None, 400,
     "prompt_logprobs must be between 0 and 20"),
    ("no-messages", "POST", "/v1/chat/completions", _chat(messages=[]), None, 400,
     "at least one message"),
    ("bad-role", "POST", "/v1/chat/completions",
     _chat(messages=[{"role": "wizard", "content": "hi"}]), None, 400, "role must be one of"),
    ("top-logprobs-alone", "POST", "/v1/chat/completions", _chat(top_logprobs=2), None, 400,
     "top_logprobs needs logprobs: true"),
    ("stream-options-type", "POST", "/v1/chat/completions",
     _chat(stream_options={"include_usage": "yes"}), None, 400, "stream_options"),
    ("generate-two-prompts", "POST", "/generate", {"input_ids": [1], "text": "a"}, None, 400,
     "exactly one of input_ids"),
    ("generate-unknown-param", "POST", "/generate",
     {"input_ids": [1], "sampling_params": {"temp": 1}}, None, 400,
     "unknown sampling parameter 'temp'"),
    ("unknown-model", "POST", "/v1/completions", _completion(model="gpt-4"), None, 404,
     "the model 'gpt-4' does not exist"),
    ("unknown-session", "POST", "/v1/chat/completions", _chat(session_id="sess-nope"), None,
     404, "session 'sess-nope' does not exist"),
    ("delete-unknown-session", "DELETE", "/v1/sessions/sess-nope", None, None, 404,
     "does not exist"),
    ("unknown-route", "GET", "/v1/engines", None, None, 404, "not a route"),
    ("wrong-method", "GET", "/v1/completions", None, None, 405, "not a route"),
    ("no-key", "POST", "/v1/completions", _completion(), {}, 401, "API key"),
    ("wrong-key", "POST", "/v1/completions", _completion(), {"Authorization": "Bearer no"},
     401, "API key"),
    ("too-large", "POST", "/v1/completions", b"x" * (3 << 19), None, 413,
     "over the limit of 1,048,576 bytes"),
    ("over-pending-limit", "POST", "/v1/completions", _completion(prompt=["a"] * 97), None,
     400, "at most 96 requests in flight"),
]


@pytest.mark.parametrize(("method", "path", "body", "headers", "status", "words"),
                         [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_gets_its_status_and_a_sentence(server, method, path, body, headers, status,
                                                  words):
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    response = httpx.request(method, f"{server.url}{path}", content=content, timeout=60,
                             headers=AUTH if headers is None else headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"]
    assert "Traceback" not in response.text


def test_the_server_keeps_serving_after_bad_inputs(oai, model):
    out = oai.completions.create(model=model, prompt="still here", max_tokens=2)
    assert out.usage.completion_tokens == 2


def test_errors_reach_the_openai_client_as_its_exceptions(oai, model):
    import openai  # here, not above: every test process collects this module (a 0.4 s import)

    with pytest.raises(openai.BadRequestError, match="context is 4,096"):
        oai.completions.create(model=model, prompt=[5] * 5000, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-4", prompt="x", max_tokens=2)


# ----------------------------------------------------------------- load and lifetime
def test_a_client_leaving_mid_stream_frees_its_pages(server):
    idle = metric_values(server)
    assert idle["radixserve_num_requests_running"] == 0
    body = _completion(prompt="Tell a very long story:", max_tokens=3000, ignore_eos=True,
                       stream=True)
    with http(server) as client, client.stream("POST", "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        for _ in range(3):
            next(line for line in lines if line.startswith("data: "))
        # The scheduler's stats come at most every 0.25 s while it is busy.
        deadline = time.monotonic() + 5
        while (metric_values(server)["radixserve_kv_pages_used"]
               == idle["radixserve_kv_pages_used"] and time.monotonic() < deadline):
            time.sleep(0.05)
        assert metric_values(server)["radixserve_num_requests_running"] == 1
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        now = metric_values(server)
        if (now["radixserve_num_requests_running"] == 0
                and now["radixserve_kv_pages_used"] == idle["radixserve_kv_pages_used"]):
            break
        time.sleep(0.05)
    assert now["radixserve_num_requests_running"] == 0
    assert now["radixserve_kv_pages_used"] == idle["radixserve_kv_pages_used"]
    assert now['radixserve_requests_total{endpoint=completions,status=499}'] >= 1


def test_64_concurrent_streams_all_finish(server):
    async def one(client: httpx.AsyncClient, i: int) -> dict:
        body = _completion(prompt=f"Request {i} says", max_tokens=8, ignore_eos=True,
                           stream=True, stream_options={"include_usage": True})
        events = []
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        assert events[-1] == "[DONE]"
        return json.loads(events[-2])["usage"]

    async def main() -> list[dict]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=300,
                                     limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    usages = asyncio.run(main())
    assert [u["completion_tokens"] for u in usages] == [8] * 64


def test_metrics_parse_and_count_what_happened(server):
    values = metric_values(server)
    for name in ("radixserve_num_requests_running", "radixserve_num_requests_waiting",
                 "radixserve_kv_cache_usage_ratio", "radixserve_prefix_cache_hit_rate",
                 "radixserve_preemptions_total", "radixserve_engine_alive",
                 "radixserve_time_to_first_token_seconds_count",
                 "radixserve_inter_token_latency_seconds_count",
                 "radixserve_generation_tokens_total", "radixserve_cached_prompt_tokens_total"):
        assert name in values, name
    assert values["radixserve_requests_total{endpoint=completions,status=200}"] >= 64
    assert values["radixserve_requests_total{endpoint=completions,status=400}"] >= 10
    assert values["radixserve_time_to_first_token_seconds_count"] >= 64
    # Every token delivery is timed from the scheduler's step result, across processes.
    delivered = values["radixserve_token_delivery_seconds_count"]
    assert delivered >= 64
    assert 0 < values["radixserve_token_delivery_seconds_sum"] < delivered  # seconds, < 1 each
    assert 0 < values["radixserve_prefix_cache_hit_rate"] < 1
    assert values["radixserve_kv_pages_total"] == 2048
    # The pool's dtype, capacity and bytes (the model's dtype: no --kv-cache-dtype given).
    info = [key for key in values if key.startswith("radixserve_kv_cache_info{")]
    assert len(info) == 1 and "kv_cache_dtype=" in info[0] and values[info[0]] == 1
    page_size = int(info[0].split("page_size=")[1].split(",")[0].rstrip("}"))
    assert values["radixserve_kv_cache_capacity_tokens"] == 2048 * page_size
    assert values["radixserve_kv_cache_bytes"] > 0
    # The demo model's weights, dense in the model's dtype (no quantized blocks to keep).
    weights = [key for key in values if key.startswith("radixserve_model_weight_bytes{")]
    assert len(weights) == 1 and values[weights[0]] > 0


def test_health_models_and_openapi(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    models = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()
    assert models["data"][0]["max_model_len"] == 4096
    spec = httpx.get(f"{server.url}/openapi.json").json()
    assert spec["openapi"].startswith("3.")
    request = spec["components"]["schemas"]["ChatCompletionRequest"]
    assert "session_id" in request["properties"] and "messages" in request["required"]
    assert "/v1/sessions/{session_id}" in spec["paths"]


def test_return_token_ids_streams_each_chunks_ids(server):
    """vLLM's ``return_token_ids``: stream chunks carry their own output ids, the whole response
    all of them, equal to /generate's; without the flag the field is absent."""
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    client = http(server)
    whole = client.post("/v1/completions", json={**body, "return_token_ids": True}).json()
    ids = whole["choices"][0]["token_ids"]
    assert len(ids) == whole["usage"]["completion_tokens"] == 6
    native = client.post("/generate", json={"input_ids": [5, 6, 7, 8], "sampling_params": {
        "max_tokens": 6, "temperature": 0, "ignore_eos": True}}).json()
    assert native["choices"][0]["token_ids"] == ids
    streamed = []
    with client.stream("POST", "/v1/completions",
                       json={**body, "return_token_ids": True, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                streamed += json.loads(line[6:])["choices"][0]["token_ids"]
    assert streamed == ids
    plain = client.post("/v1/completions", json=body).json()
    assert "token_ids" not in plain["choices"][0]
