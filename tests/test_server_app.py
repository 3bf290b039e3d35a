"""The HTTP app over a scripted engine client (no processes): exact OpenAI chunk shapes, what
clients see once the engine died, a bug answered as a sentence, and session reclaiming."""

from __future__ import annotations

import json

import msgspec
import pytest
from starlette.testclient import TestClient

from engine.contracts.engine_config import EngineConfig
from engine.contracts.protocol import (
    GenerateRequest,
    RequestOutput,
    SchedulerStats,
    SessionClose,
    SessionOpen,
    pack_ids,
)
from engine.contracts.worker_messages import ModelInfo
from engine.server.app import build_app
from engine.server.options import ServeOptions
from engine.server.service import Service

INFO = ModelInfo(model="/models/tiny", architecture="LlamaForCausalLM", vocab_size=100,
                 context_len=64, eos_token_ids=[0], page_size=16, num_pages=32,
                 num_host_pages=0, device="cpu", dtype="float32", attention_backend="torch")


class ScriptedClient:
    """Stands in for EngineClient: every request answers "a", "b", "c" (ids 5, 6, 7)."""

    def __init__(self) -> None:
        self.stats = SchedulerStats()
        self.dead: str | None = None
        self.sessions: list[SessionOpen | SessionClose] = []
        self.pending = 0
        self.broken = False
        self.requests: list[GenerateRequest] = []  # every request streamed, in order

    @property
    def num_pending(self) -> int:
        return self.pending

    async def stream(self, req: GenerateRequest):
        if self.broken:
            raise RuntimeError("a bug")
        self.requests.append(req)
        self.pending += 1
        try:
            for i, (text, token) in enumerate(zip("abc", (5, 6, 7), strict=True)):
                yield RequestOutput(rid=req.rid, text=text, token_ids=pack_ids([token]),
                                    prompt_tokens=4, cached_tokens=3,
                                    finish_reason="length" if i == 2 else None)
        finally:
            self.pending -= 1

    async def send_session(self, msg: SessionOpen | SessionClose) -> None:
        self.sessions.append(msg)


@pytest.fixture
def engine() -> ScriptedClient:
    return ScriptedClient()


def make_app(engine: ScriptedClient, **config) -> TestClient:
    service = Service(engine, INFO, EngineConfig(model="/models/tiny", **config))
    return TestClient(build_app(service))


def events(response) -> list:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_chunks_have_exactly_openais_keys(engine):
    client = make_app(engine)
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    chunks = events(client.post("/v1/chat/completions", json=body))
    assert [set(c) for c in chunks] == [{"id", "object", "created", "model", "choices"}] * 5
    assert chunks[0]["choices"][0] == {"index": 0, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "abc"
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                        "finish_reason": "length"}
    with_usage = events(client.post("/v1/completions", json={
        "prompt": "x", "stream": True, "stream_options": {"include_usage": True}}))
    assert all(c["usage"] is None for c in with_usage[:-1])
    assert with_usage[-1]["choices"] == []
    assert with_usage[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 3,
                                       "total_tokens": 7,
                                       "prompt_tokens_details": {"cached_tokens": 3}}
    whole = client.post("/v1/completions", json={"prompt": "x"}).json()
    assert set(whole) == {"id", "object", "created", "model", "choices", "usage"}
    assert whole["choices"] == [{"index": 0, "text": "abc", "logprobs": None,
                                 "finish_reason": "length"}]


@pytest.mark.parametrize("salt_from_user", [False, True])
def test_salts_and_users_key_the_cache_namespace(engine, salt_from_user):
    """Requests share cached KV only within a namespace: the same cache_salt gives the same
    one on every endpoint, another salt another, no salt the shared one (None). Under
    --salt-from-user the user counts as well: each user's requests apart, with or without a
    salt, and a salt never reaching into another user's; without it, the user changes
    nothing."""
    service = Service(engine, INFO, EngineConfig(model="/models/tiny"),
                      ServeOptions(salt_from_user=salt_from_user))
    client = TestClient(build_app(service))

    def namespace(path: str, salt: str | None = None, user: str | None = None) -> str | None:
        body = {"/v1/completions": {"prompt": "x"},
                "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}]},
                "/generate": {"input_ids": [5, 6]}}[path]
        extra = {"cache_salt": salt, "user": user}
        body = {**body, **{k: v for k, v in extra.items() if v is not None}}
        assert client.post(path, json=body).status_code == 200, (path, body)
        return engine.requests[-1].namespace

    paths = ["/v1/completions", "/v1/chat/completions", "/generate"]
    assert {namespace(path) for path in paths} == {None}
    salted = {namespace(path, "tenant-a") for path in paths}
    assert len(salted) == 1 and None not in salted
    assert namespace("/v1/completions", "tenant-b") not in salted | {None}
    users = [namespace("/v1/chat/completions", salt, user)
             for user in ("alice", "bob") for salt in (None, "tenant-a")]
    if salt_from_user:
        assert len(set(users) | salted | {None}) == 6
    else:
        assert users == [None, *salted] * 2


def test_once_the_engine_died_health_and_requests_are_503(engine):
    client = make_app(engine)
    assert client.get("/health").status_code == 200
    engine.dead = "the scheduler process exited unexpectedly (exit code -9)"
    engine.stream = None  # nothing may reach the engine any more
    health = client.get("/health")
    assert health.status_code == 503 and "scheduler process" in health.json()["error"]["message"]
    assert client.post("/v1/sessions").status_code == 503
    refused = client.post("/v1/completions", json={"prompt": "x"})
    assert refused.status_code == 503 and "the engine stopped" in refused.text
    metrics = client.get("/metrics").text
    assert "radixserve_engine_alive 0.0" in metrics


def test_a_bug_is_a_500_sentence_and_the_app_keeps_serving(engine):
    client = make_app(engine)
    engine.broken = True
    response = client.post("/v1/completions", json={"prompt": "x"})
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "the server failed on this request; see its log"
    engine.broken = False
    assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200


def test_a_full_session_table_reclaims_the_longest_idle_expired_session(engine):
    client = make_app(engine, max_sessions=1, session_ttl=0.0)
    first = client.post("/v1/sessions").json()["id"]
    second = client.post("/v1/sessions").json()["id"]
    assert [type(m).__name__ for m in engine.sessions] == ["SessionOpen", "SessionClose",
                                                          "SessionOpen"]
    assert engine.sessions[1].session_id == first
    assert client.delete(f"/v1/sessions/{first}").status_code == 404
    assert client.delete(f"/v1/sessions/{second}").status_code == 200


def test_metrics_show_the_kv_caches_dtype_capacity_and_bytes() -> None:
    """The worker's ModelInfo names what the pool stores and the weights' formats; the gauges
    follow the engine-wide page count the scheduler reports (summed over data-parallel
    replicas)."""
    from engine.server.metrics import FrontendState, Metrics

    info = msgspec.structs.replace(INFO, kv_cache_dtype="int8", kv_cache_bytes=32 * 3000,
                                   weight_bytes={"q4_1": 70_000_000, "bfloat16": 60_000},
                                   linear_forms={"q4_1 960x576 bfloat16": {"1-2": "blocks",
                                                                           "257+": "widened"}})
    stats = SchedulerStats(kv_pages_total=64)
    text = Metrics(lambda: stats, lambda: FrontendState(0, 0, True), info).render().decode()
    assert 'radixserve_model_weight_bytes{format="q4_1"} 7e+07' in text
    assert 'radixserve_model_weight_bytes{format="bfloat16"} 60000.0' in text
    assert ('radixserve_linear_form_info{form="widened",rows="257+",'
            'weight="q4_1 960x576 bfloat16"} 1.0') in text
    assert 'form="blocks",rows="1-2"' in text
    assert ('radixserve_kv_cache_info{attention_backend="torch",kv_cache_dtype="int8",'
            'page_size="16"} 1.0') in text
    assert "radixserve_kv_cache_capacity_tokens 1024.0" in text
    assert "radixserve_kv_cache_bytes 192000.0" in text


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 10.0}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "logit_bias": {"5": -100.0}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "suffix": "bye"}, "suffix"),
])
def test_fields_openai_has_and_this_server_refuses_are_a_400_naming_them(engine, path, body,
                                                                         param):
    """docs/api.md lists them as refused: the schema accepts them so the error names the field
    (an unknown field would be refused too, but as unknown), and no engine request is made."""
    response = make_app(engine).post(path, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param
    assert error["message"] == f"{param} is not supported"
    assert engine.pending == 0 and not engine.sessions
