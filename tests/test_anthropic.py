"""Anthropic's Messages API: the mapping onto chat (pure), and the HTTP door over a scripted
engine (no processes): the key as x-api-key, Anthropic's error body, the message and its
stream events."""

from __future__ import annotations

import json

import msgspec
import pytest
from starlette.testclient import TestClient

from engine.contracts.engine_config import EngineConfig
from engine.contracts.protocol import RequestOutput, pack_ids
from engine.server import anthropic
from engine.server.anthropic_schemas import MessagesRequest
from engine.server.app import build_app
from engine.server.errors import APIError
from engine.server.options import ServeOptions
from engine.server.service import Service
from tests.test_server_app import INFO, ScriptedClient

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Rome?"},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Rome"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "text", "text": "sunny"}]},
        {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "ephemeral"}}]},
]


def request(**fields) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 8, "messages": CONVERSATION, **fields}
    return msgspec.json.decode(json.dumps(body), type=MessagesRequest)


def test_blocks_become_the_chat_messages_they_mean() -> None:
    chat = anthropic.to_chat(request(system=[{"type": "text", "text": "Be brief."}],
                                     stop_sequences=["END"], top_k=5))
    assert chat.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert (chat.max_tokens, chat.stop, chat.top_k) == (8, ["END"], 5)


@pytest.mark.parametrize(("choice", "expected", "parallel"), [
    ({"type": "auto"}, "auto", True),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ({"type": "none"}, "none", True),
])
def test_tool_choices_map_onto_chats(choice, expected, parallel) -> None:
    tools = [{"name": "get_weather", "input_schema": WEATHER, "description": "d"}]
    chat = anthropic.to_chat(request(tools=tools, tool_choice=choice))
    assert chat.tool_choice == expected and chat.parallel_tool_calls is parallel
    assert chat.tools[0].function.parameters == WEATHER
    named = anthropic.to_chat(request(tools=tools, tool_choice={"type": "tool",
                                                                "name": "get_weather"}))
    assert named.tool_choice.function.name == "get_weather"


def test_a_tool_result_without_its_tool_use_is_a_400_naming_it() -> None:
    messages = [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]
    with pytest.raises(APIError) as caught:
        anthropic.to_chat(request(messages=messages))
    assert caught.value.param == "messages[0].content[0].tool_use_id"
    assert "toolu_9" in caught.value.message


def test_chat_errors_get_the_messages_api_names() -> None:
    error = anthropic.renamed(APIError(400, "tools[1].function.name repeats", param=
                                       "tools[1].function.name"))
    assert (error.param, error.message) == ("tools[1].name", "tools[1].name repeats")
    body = anthropic.error_body(APIError(400, "must be positive", param="max_tokens"))
    assert msgspec.to_builtins(body) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: must be positive"}}


# ------------------------------------------------------------- the app, scripted engine
class StopScriptedClient(ScriptedClient):
    """Answers "Hi", " there" and ends on a stop string; 10 prompt tokens, 6 cached."""

    async def stream(self, req):
        self.requests.append(req)
        yield RequestOutput(rid=req.rid, text="Hi", token_ids=pack_ids([5]), prompt_tokens=10,
                            cached_tokens=6)
        yield RequestOutput(rid=req.rid, text=" there", token_ids=pack_ids([6]),
                            finish_reason="stop", stop_reason="END")


def app(engine=None, api_key: str | None = "k") -> TestClient:
    service = Service(engine or StopScriptedClient(), INFO, EngineConfig(model="/models/tiny"),
                      ServeOptions(api_key=api_key))
    return TestClient(build_app(service))


BODY = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
        "stop_sequences": ["END"]}


def test_the_door_answers_a_message_with_anthropics_usage_and_stop() -> None:
    response = app().post("/v1/messages", json=BODY, headers={"x-api-key": "k"})
    assert response.status_code == 200, response.text
    message = response.json()
    assert message["id"].startswith("msg_") and message["type"] == "message"
    assert message["content"] == [{"type": "text", "text": "Hi there"}]
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "END")
    assert message["usage"] == {"input_tokens": 4, "output_tokens": 2,
                                "cache_read_input_tokens": 6,
                                "cache_creation_input_tokens": 0}


def test_the_stream_is_anthropics_event_sequence() -> None:
    response = app().post("/v1/messages", json={**BODY, "stream": True},
                          headers={"Authorization": "Bearer k"})
    names = [line[7:] for line in response.text.splitlines() if line.startswith("event: ")]
    assert names == ["message_start", "content_block_start", "content_block_delta",
                     "content_block_delta", "content_block_stop", "message_delta",
                     "message_stop"]
    data = [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ")]
    assert "".join(d["delta"]["text"] for d in data if d["type"] == "content_block_delta") \
        == "Hi there"
    assert data[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


@pytest.mark.parametrize(("headers", "body", "status", "kind", "says"), [
    ({"x-api-key": "wrong"}, BODY, 401, "authentication_error", "x-api-key"),
    ({"x-api-key": "k"}, {**BODY, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, 400, "invalid_request_error",
     "messages[0].content[0]"),
    ({"x-api-key": "k"}, {k: v for k, v in BODY.items() if k != "max_tokens"}, 400,
     "invalid_request_error", "max_tokens"),
    ({"x-api-key": "k"}, {**BODY, "model": "claude"}, 404, "not_found_error", "claude"),
])
def test_errors_have_anthropics_body(headers, body, status, kind, says) -> None:
    response = app().post("/v1/messages", json=body, headers=headers)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert says in error["error"]["message"]


def test_count_tokens_counts_the_chat_prompt_with_its_tools() -> None:
    class Counting(ScriptedClient):
        async def tokenize(self, msg):
            from engine.contracts.protocol import TokenizerReply
            self.asked = msg
            return TokenizerReply(rid=msg.rid, token_ids=pack_ids([1, 2, 3]))

    engine = Counting()
    body = {"model": "tiny", "messages": BODY["messages"], "system": "s",
            "tools": [{"name": "f", "input_schema": WEATHER}]}
    response = app(engine).post("/v1/messages/count_tokens", json=body,
                                headers={"x-api-key": "k"})
    assert response.json() == {"input_tokens": 3}
    assert engine.asked.messages[0] == {"role": "system", "content": "s"}
    assert engine.asked.tools[0]["function"]["parameters"] == WEATHER


def test_openapi_documents_the_messages_routes() -> None:
    spec = app().get("/openapi.json").json()
    post = spec["paths"]["/v1/messages"]["post"]
    assert post["requestBody"] and {"x-api-key": []} in post["security"]
    assert post["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/AnthropicError")
    assert "input_schema" in spec["components"]["schemas"]["Tool"]["properties"]
    assert "max_tokens" in spec["components"]["schemas"]["MessagesRequest"]["required"]
    assert spec["paths"]["/v1/messages/count_tokens"]["post"]["requestBody"]
