"""OpenAI's Responses API on a live demo-model server, through the official openai SDK (e2e):
a stored chain whose second turn hits the whole first turn in the prefix cache, streams that
reassemble to the whole response, named function calls, retrieval, deletion, and refusals."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.server_process import API_KEY, AUTH, serve_module
from tests.tool_fixtures import SCHEMAS

TOOLS = [{"type": "function", "name": name, "description": f"the {name} tool",
          "parameters": schema} for name, schema in SCHEMAS.items()]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_module(tmp_path_factory.mktemp("responses"), "--api-key", API_KEY,
                            "--tool-call-parser", "hermes", "--num-pages", "1024")


def streamed(oai, **options) -> tuple[list[str], object]:
    """The stream's event types and its final response (from response.completed)."""
    types, final = [], None
    for event in oai.responses.create(**options, stream=True):
        types.append(event.type)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    return types, final


@pytest.mark.e2e
def test_a_stored_chain_hits_the_whole_history(oai, model) -> None:
    first = oai.responses.create(model=model, input="Tell me about Paris.",
                                 instructions="Be brief.", max_output_tokens=16,
                                 temperature=0)
    assert first.status in ("completed", "incomplete") and first.output_text
    second = oai.responses.create(model=model, input="And Rome?", max_output_tokens=8,
                                  temperature=0, previous_response_id=first.id)
    assert second.previous_response_id == first.id
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens + first.usage.output_tokens - 1
    assert second.usage.input_tokens > cached
    fetched = oai.responses.retrieve(second.id)
    assert fetched.output_text == second.output_text and fetched.status == second.status


@pytest.mark.e2e
def test_a_stream_reassembles_to_the_whole_response(oai, model) -> None:
    options = dict(model=model, input="Hello there", max_output_tokens=24, temperature=0,
                   store=False)
    whole = oai.responses.create(**options)
    types, final = streamed(oai, **options)
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert "response.output_text.delta" in types
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    assert final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.e2e
def test_named_function_calls_are_valid_and_their_output_continues(oai, model) -> None:
    options = dict(model=model, input="Weather in Paris?", tools=TOOLS, max_output_tokens=64,
                   temperature=0, tool_choice={"type": "function", "name": "get_weather"})
    whole = oai.responses.create(**options)
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    _, final = streamed(oai, **{**options, "store": False})
    assert [(c.name, c.arguments) for c in final.output] == [(call.name, call.arguments)]
    after = oai.responses.create(model=model, previous_response_id=whole.id, tools=TOOLS,
                                 tool_choice="none", max_output_tokens=4, temperature=0,
                                 input=[{"type": "function_call_output",
                                         "call_id": call.call_id, "output": "sunny"}])
    assert after.status in ("completed", "incomplete")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    shaped = oai.responses.create(model=model, input="Answer.", max_output_tokens=32,
                                  temperature=0, store=False, text={"format": {
                                      "type": "json_schema", "name": "answer",
                                      "schema": schema}})
    jsonschema.validate(json.loads(shaped.output_text), schema)


@pytest.mark.e2e
def test_unknown_ids_deleted_ones_and_bad_items_are_4xx(oai, server, model) -> None:
    import openai

    kept = oai.responses.create(model=model, input="Hi", max_output_tokens=2, temperature=0)
    other = httpx.get(f"{server.url}/v1/responses/{kept.id}", timeout=30,
                      headers={"Authorization": "Bearer another-key"})
    assert other.status_code == 401  # one server key: any other is refused before the store
    assert oai.responses.delete(kept.id) is None
    with pytest.raises(openai.NotFoundError) as gone:
        oai.responses.retrieve(kept.id)
    assert "does not exist" in gone.value.body["message"]
    with pytest.raises(openai.NotFoundError) as unknown:
        oai.responses.create(model=model, input="x", previous_response_id="resp_nope")
    assert unknown.value.body["param"] == "previous_response_id"
    response = httpx.post(f"{server.url}/v1/responses", headers=AUTH, timeout=30, json={
        "input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == \
        "input[0].call_id"
    response = httpx.post(f"{server.url}/v1/responses", headers=AUTH, timeout=30, json={
        "input": [{"type": "image", "url": "x"}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "input[0].type"
    cancelled = httpx.post(f"{server.url}/v1/responses/{kept.id}/cancel", headers=AUTH,
                           timeout=30)
    assert cancelled.status_code == 404
