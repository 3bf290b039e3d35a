"""OpenAI tool calls through the server: the HTTP app over a scripted engine client streams and
answers in OpenAI's chunk and message shapes (no processes); then a live server with the demo
model through the official openai client (e2e)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from starlette.testclient import TestClient

from engine.contracts.engine_config import EngineConfig
from engine.contracts.protocol import GenerateRequest, RequestOutput, pack_ids
from engine.server.app import build_app
from engine.server.options import ServeOptions
from engine.server.service import Service
from tests.server_process import API_KEY, AUTH, serve_module
from tests.test_server_app import INFO, ScriptedClient
from tests.tool_fixtures import CONVERSATION, SCHEMAS, TOOLS, USER, named


# ------------------------------------------------------------- the app, scripted engine
class ToolScriptedClient(ScriptedClient):
    """Answers every request with ``script`` in pieces (each sample the same), stopping."""

    def __init__(self, script: list[str]) -> None:
        super().__init__()
        self.script = script
        self.requests: list[GenerateRequest] = []

    async def stream(self, req: GenerateRequest):
        self.requests.append(req)
        for index in range(req.params.n):
            for i, text in enumerate(self.script):
                last = i == len(self.script) - 1
                yield RequestOutput(rid=req.rid, index=index, text=text,
                                    token_ids=pack_ids([5]), prompt_tokens=4,
                                    finish_reason="stop" if last else None)


def tool_app(script: list[str], parser: str | None = "hermes") -> tuple[TestClient,
                                                                       ToolScriptedClient]:
    engine = ToolScriptedClient(script)
    service = Service(engine, INFO, EngineConfig(model="/models/tiny"),
                      ServeOptions(tool_call_parser=parser))
    return TestClient(build_app(service)), engine


def sse(response) -> list[dict]:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_the_app_streams_hermes_calls_in_openais_delta_shapes() -> None:
    script = ["Checking", " now.", "\n<tool_", 'call>{"name": "get_weather", ',
              '"arguments": {"city": "Rome"}}</tool_call>']
    client, engine = tool_app(script)
    body = {"messages": CONVERSATION, "tools": TOOLS, "stream": True, "n": 2}
    chunks = sse(client.post("/v1/chat/completions", json=body))
    assert engine.requests[0].tools == TOOLS and engine.requests[0].messages == CONVERSATION
    for index in (0, 1):
        deltas = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert deltas[0]["delta"] == {"role": "assistant", "content": ""}
        content = "".join(d["delta"].get("content") or "" for d in deltas)
        calls = [d["delta"]["tool_calls"] for d in deltas if "tool_calls" in d["delta"]]
        assert content == "Checking now."
        assert calls == [[{"index": 0, "id": calls[0][0]["id"], "type": "function",
                           "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]]
        assert [d["finish_reason"] for d in deltas][-1] == "tool_calls"
        assert deltas[-1]["delta"] == {}
    whole = client.post("/v1/chat/completions", json={**body, "stream": False}).json()
    for choice in whole["choices"]:
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == "Checking now."
        assert choice["message"]["tool_calls"][0]["function"] == {
            "name": "get_weather", "arguments": '{"city": "Rome"}'}


def test_the_app_refuses_auto_without_a_parser_and_keeps_plain_chat_plain() -> None:
    client, engine = tool_app(["Hi", " there"], parser=None)
    refused = client.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "tool_choice"
    assert "--tool-call-parser hermes" in refused.json()["error"]["message"]
    plain = client.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS,
                                                      "tool_choice": "none"}).json()
    assert plain["choices"][0]["message"] == {"content": "Hi there", "role": "assistant"}
    assert plain["choices"][0]["finish_reason"] == "stop"
    assert engine.requests[-1].params.structured_outputs is None


def test_the_app_constrains_and_reads_a_required_choice() -> None:
    script = ['[{"name":"add_note","parameters":{"text":"a"}}', ',{"name":"add_note",',
              '"parameters":{"text":"b"}}]']
    client, engine = tool_app(script, parser=None)
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required", "stream": True}
    chunks = sse(client.post("/v1/chat/completions", json=body))
    assert json.loads(engine.requests[0].params.structured_outputs.json)["minItems"] == 1
    calls = [c["choices"][0]["delta"]["tool_calls"] for c in chunks
             if "tool_calls" in c["choices"][0]["delta"]]
    assert [[(d["index"], d["function"]["arguments"]) for d in call] for call in calls] == \
        [[(0, '{"text": "a"}')], [(1, '{"text": "b"}')]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# --------------------------------------------------------------------- a live server (e2e)
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_module(tmp_path_factory.mktemp("tools"), "--api-key", API_KEY,
                            "--tool-call-parser", "hermes", "--num-pages", "1024")


def streamed(stream) -> dict[int, dict]:
    """Each choice of a stream, assembled: content, calls (id, name, arguments), finish."""
    choices: dict[int, dict] = {}
    for chunk in stream:
        for choice in chunk.choices:
            got = choices.setdefault(choice.index, {"content": "", "calls": {}, "finish": None})
            got["content"] += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = got["calls"].setdefault(delta.index, {"id": None, "name": "",
                                                             "arguments": ""})
                call["id"] = call["id"] or delta.id
                call["name"] += (delta.function.name or "") if delta.function else ""
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
            got["finish"] = choice.finish_reason or got["finish"]
    return choices


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.e2e
def test_a_named_tool_choice_returns_a_valid_call(oai, model) -> None:
    options = dict(model=model, messages=USER, tools=TOOLS, max_tokens=64, temperature=0,
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = oai.chat.completions.create(**options)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    check_call(call.function.name, call.function.arguments)
    stream = streamed(oai.chat.completions.create(**options, stream=True))
    assert stream[0]["finish"] == "tool_calls" and stream[0]["content"] == ""
    assert [(c["name"], c["arguments"]) for c in stream[0]["calls"].values()] == \
        calls_of(choice.message)


@pytest.mark.e2e
def test_required_returns_valid_calls_per_choice_streamed_the_same(oai, model) -> None:
    options = dict(model=model, messages=USER, tools=TOOLS, tool_choice="required",
                   max_tokens=160, temperature=1.0, seed=11, n=2)
    whole = oai.chat.completions.create(**options)
    stream = streamed(oai.chat.completions.create(**options, stream=True))
    for choice in whole.choices:
        calls = calls_of(choice.message)
        assert calls and choice.message.content is None
        for name, arguments in calls:
            check_call(name, arguments)
        assert choice.finish_reason in ("tool_calls", "length")  # the array may run long
        got = stream[choice.index]
        assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == calls
        assert got["finish"] == choice.finish_reason
    single = oai.chat.completions.create(**{**options, "n": 1}, parallel_tool_calls=False)
    assert len(single.choices[0].message.tool_calls) == 1
    assert single.choices[0].finish_reason == "tool_calls"


@pytest.mark.e2e
def test_hermes_reads_a_tool_call_block_out_of_the_text(oai, model) -> None:
    # The demo model has random weights: a regex makes it write a block, which auto reads.
    block = (r'Checking\. <tool_call>\{"name": "get_weather", '
             r'"arguments": \{"city": "(Paris|Rome)"\}\}</tool_call>')
    options = dict(model=model, messages=USER, tools=TOOLS, max_tokens=64, temperature=0,
                   extra_body={"structured_outputs": {"regex": block}})
    whole = oai.chat.completions.create(**options)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    ((name, arguments),) = calls_of(choice.message)
    assert name == "get_weather" and json.loads(arguments)["city"] in ("Paris", "Rome")
    stream = streamed(oai.chat.completions.create(**options, stream=True))
    assert stream[0]["content"] == "Checking." and stream[0]["finish"] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in stream[0]["calls"].values()] == [(name,
                                                                                     arguments)]


@pytest.mark.e2e
def test_tool_messages_are_accepted_and_none_chats_plainly(oai, model) -> None:
    reply = oai.chat.completions.create(model=model, messages=CONVERSATION, tools=TOOLS,
                                        tool_choice="none", max_tokens=4, temperature=0)
    assert reply.choices[0].message.tool_calls is None
    assert isinstance(reply.choices[0].message.content, str)
    assert reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.e2e
@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": TOOLS, "tool_choice": named("send_mail")}, "tool_choice.function.name"),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools[2].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "fn", "function": {"name": "a"}}]}, "tools[0].type"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"messages": [*USER, {"role": "tool", "tool_call_id": ["c"], "content": "x"}],
      "tools": TOOLS, "tool_choice": "none"}, "messages"),
])
def test_refusals_are_400s_naming_the_field(server, fields, param) -> None:
    body = {"messages": USER, "max_tokens": 4, **fields}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=AUTH,
                          timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
