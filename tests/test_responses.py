"""OpenAI's Responses API without processes: input items to chat messages (pure), the chat
stream's chunks assembled into output items and events, and the store over a scripted engine
(a chain forks its parent's session; another key is told the response does not exist)."""

from __future__ import annotations

import json

import msgspec
import pytest
from starlette.testclient import TestClient

from engine.contracts.engine_config import EngineConfig
from engine.contracts.protocol import SessionOpen
from engine.server import responses
from engine.server.app import build_app
from engine.server.errors import APIError
from engine.server.responses_schemas import ResponseObject, ResponsesRequest
from engine.server.schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    FunctionCallDelta,
    ToolCallDelta,
)
from engine.server.service import Service
from tests.test_server_app import INFO, ScriptedClient


def request(**fields) -> ResponsesRequest:
    return msgspec.json.decode(json.dumps({"input": "Hi", **fields}), type=ResponsesRequest)


def test_input_items_become_chat_messages() -> None:
    body = request(instructions="Be brief.", input=[
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "w", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_0", "output": "rain"}])
    assert responses.input_messages(body, {"call_0"}) == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_0", "content": "rain"}]


@pytest.mark.parametrize(("item", "param"), [
    ({"type": "function_call_output", "call_id": "c", "output": "x"}, "input[0].call_id"),
    ({"type": "image"}, "input[0].type"),
    ({"role": "robot", "content": "x"}, "input[0].role"),
])
def test_bad_items_are_400s_naming_them(item, param) -> None:
    with pytest.raises(APIError) as caught:
        responses.input_messages(request(input=[item]), set())
    assert caught.value.param == param


def test_fields_map_onto_chat_and_its_errors_get_their_names() -> None:
    chat = responses.to_chat(request(
        max_output_tokens=9, tools=[{"type": "function", "name": "w"}],
        tool_choice={"type": "function", "name": "w"},
        text={"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}}),
        [], "sess-1")
    assert (chat.max_tokens, chat.session_id, chat.tool_choice.function.name) == (
        9, "sess-1", "w")
    assert chat.response_format.json_schema.schema == {"type": "object"}
    error = responses.renamed(APIError(400, "max_tokens is too big", param="max_tokens"))
    assert (error.param, error.message) == ("max_output_tokens", "max_output_tokens is too big")


def chunk(delta: ChatDelta, finish: str | None = None) -> ChatCompletionChunk:
    return ChatCompletionChunk("c", 0, "m", [ChatChunkChoice(0, delta, finish_reason=finish)])


def test_chunks_assemble_into_items_and_events() -> None:
    response = responses.new_response(request(), "m", 0, "resp_1")
    assembly = responses.Assembly(response, None)
    events = assembly.start()
    events += assembly.feed(chunk(ChatDelta(content="Hi ")))
    events += assembly.feed(chunk(ChatDelta(content="there")))
    events += assembly.feed(chunk(ChatDelta(tool_calls=[ToolCallDelta(
        0, "call_9", "function", FunctionCallDelta("w", '{"a":'))])))
    events += assembly.feed(chunk(ChatDelta(tool_calls=[ToolCallDelta(
        0, function=FunctionCallDelta(arguments=" 1}"))]), "tool_calls"))

    class FakeCall:
        class choices:  # noqa: N801
            prompt_tokens, cached_tokens, completion_tokens = [7], [5], 4

    events += assembly.end(FakeCall)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    message, call = response.output
    assert message.content[0].text == "Hi there"
    assert (call.call_id, call.name, call.arguments) == ("call_9", "w", '{"a": 1}')
    assert response.usage.input_tokens_details.cached_tokens == 5
    assert response.status == "completed"


def test_a_chain_forks_the_parents_session_and_belongs_to_its_key() -> None:
    engine = ScriptedClient()
    client = TestClient(build_app(Service(engine, INFO, EngineConfig(model="/models/tiny"))))
    mine = {"Authorization": "Bearer mine"}
    first = client.post("/v1/responses", json={"input": "Hi"}, headers=mine).json()
    assert first["status"] == "incomplete" and first["output"][0]["content"][0]["text"] == "abc"
    second = client.post("/v1/responses", headers=mine, json={
        "input": "More", "previous_response_id": first["id"]}).json()
    opened = [m for m in engine.sessions if isinstance(m, SessionOpen)]
    assert opened[1].parent == opened[0].session_id
    assert engine.requests[1].session_id == opened[1].session_id
    assert engine.requests[1].messages == [{"role": "user", "content": "More"}]
    assert msgspec.convert(client.get(f"/v1/responses/{second['id']}", headers=mine).json(),
                           ResponseObject).previous_response_id == first["id"]
    theirs = client.get(f"/v1/responses/{second['id']}", headers={"Authorization": "Bearer x"})
    assert theirs.status_code == 404
    assert client.delete(f"/v1/responses/{first['id']}", headers=mine).json()["deleted"]
    assert client.get(f"/v1/responses/{first['id']}", headers=mine).status_code == 404


def test_openapi_documents_the_responses_routes() -> None:
    app = build_app(Service(ScriptedClient(), INFO, EngineConfig(model="/models/tiny")))
    spec = TestClient(app).get("/openapi.json").json()
    assert spec["paths"]["/v1/responses"]["post"]["requestBody"]
    assert set(spec["paths"]["/v1/responses/{response_id}"]) == {"get", "delete"}
    assert "previous_response_id" in spec["components"]["schemas"]["ResponsesRequest"][
        "properties"]
