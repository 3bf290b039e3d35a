"""OpenAI tool calls: the grammars of named and "required" tool_choice, the hermes reader, the
request's refusals, the chat template's tool messages and the exact chunk and message shapes
(no processes: a scripted engine client behind the HTTP app); then a live server with the demo
model through the official openai client (e2e)."""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import jsonschema
import msgspec
import openai
import pytest
from starlette.testclient import TestClient

from engine.checkpoints.demo_model import build_demo_model
from engine.contracts import structured
from engine.contracts.engine_config import EngineConfig
from engine.contracts.protocol import GenerateRequest, RequestOutput, pack_ids
from engine.contracts.tokenizer import load_tokenizer
from engine.server.app import build_app
from engine.server.errors import APIError, from_validation
from engine.server.options import ServeOptions
from engine.server.sampling import chat_params
from engine.server.schemas import ChatCompletionRequest, ChatDelta, ChatMessage
from engine.server.service import Service
from engine.server.tools import ArrayReader, HermesReader, NamedReader, ToolStreams, resolve
from tests.server_process import API_KEY, AUTH, serve_module
from tests.test_server_app import INFO, ScriptedClient
from tests.tokenizer_fixtures import byte_level_tokenizer
from tokenizer_worker.template import render_chat, render_chat_text

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
NOTE = {
    "type": "object",
    "properties": {"text": {"type": "string", "maxLength": 8}},
    "required": ["text"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "add_note": NOTE}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"the {name} tool",
                                           "parameters": schema}}
         for name, schema in SCHEMAS.items()]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def request(**fields: Any) -> ChatCompletionRequest:
    return msgspec.convert({"messages": USER, **fields}, ChatCompletionRequest)


def read(reader: NamedReader | ArrayReader | HermesReader,
         pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) calls, assembled from the reader's deltas as a client
    assembles a stream."""
    content, calls = "", {}
    for piece in [*(reader.feed(p) for p in pieces), reader.finish()]:
        content += piece.content
        for delta in piece.calls:
            name, arguments = calls.get(delta.index, ("", ""))
            calls[delta.index] = (name + (delta.function.name or ""),
                                  arguments + (delta.function.arguments or ""))
    return content, [calls[i] for i in sorted(calls)]


# --------------------------------------------------------------------------- grammars
def test_a_named_choice_constrains_the_output_to_that_functions_parameters() -> None:
    _, plan = resolve(request(tools=TOOLS, tool_choice={"type": "function",
                                                        "function": {"name": "add_note"}}), None)
    assert plan.mode == "named" and json.loads(plan.constraint.json) == NOTE
    bare = [{"type": "function", "function": {"name": "ping"}}]
    _, plan = resolve(request(tools=bare, tool_choice={"type": "function",
                                                       "function": {"name": "ping"}}), None)
    assert json.loads(plan.constraint.json) == {"type": "object", "properties": {},
                                                "additionalProperties": False}


@pytest.mark.parametrize("parallel", [True, False])
def test_required_is_an_array_of_calls_one_branch_per_tool(parallel: bool) -> None:
    _, plan = resolve(request(tools=TOOLS, tool_choice="required",
                              parallel_tool_calls=parallel), None)
    schema = json.loads(plan.constraint.json)
    weather = {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius",
                                                     "days": 2}}
    note = {"name": "add_note", "parameters": {"text": "hi"}}
    jsonschema.validate([weather], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"text": "hi"}}],
                [{"name": "other", "parameters": {}}], [{"name": "add_note"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    if parallel:
        jsonschema.validate([weather, note, note], schema)
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([weather, note], schema)


def test_the_grammars_compile_against_a_real_tokenizer() -> None:
    tokenizer = load_tokenizer(str(build_demo_model()))
    grammar_tokenizer = structured.grammar_tokenizer(tokenizer, None, [tokenizer.eos_token_id])
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        _, plan = resolve(request(tools=TOOLS, tool_choice=choice), None)
        structured.check(plan.constraint, grammar_tokenizer)


def test_the_constraint_takes_the_place_of_response_format() -> None:
    req = request(tools=TOOLS, tool_choice="required")
    _, plan = resolve(req, None)
    params = chat_params(req, 64, INFO, plan.constraint)
    assert params.structured_outputs == plan.constraint


# ----------------------------------------------------------------------------- readers
NAMES = set(SCHEMAS)
CALL_PARIS = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
CALL_NOTE = '<tool_call>\n{"name": "add_note", "arguments": {"text": "é"}}\n</tool_call>'
HERMES_CASES = [
    # (output text, content, calls)
    (CALL_PARIS, "", [("get_weather", '{"city": "Paris"}')]),
    (f"Let me look.\n{CALL_PARIS}\n{CALL_NOTE}\n",
     "Let me look.", [("get_weather", '{"city": "Paris"}'), ("add_note", '{"text": "é"}')]),
    (f"Before {CALL_PARIS} after.", "Before after.", [("get_weather", '{"city": "Paris"}')]),
    (f"{CALL_PARIS}\nThen more.", "Then more.", [("get_weather", '{"city": "Paris"}')]),
    ("No tools today, a < b and <tool_c", "No tools today, a < b and <tool_c", []),
    ("trailing space stays when nothing is called  \n",
     "trailing space stays when nothing is called  \n", []),
    # malformed blocks stay content as written: bad JSON, an unknown function, arguments that
    # are not an object, a block never closed
    ("x <tool_call>{not json}</tool_call>", "x <tool_call>{not json}</tool_call>", []),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "add_note", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "add_note", "arguments": [1]}</tool_call>', []),
    (f'{CALL_PARIS} <tool_call>{{"name": "add_note", "argu',
     '<tool_call>{"name": "add_note", "argu', [("get_weather", '{"city": "Paris"}')]),
    (f"A {CALL_PARIS} <tool_call>oops</tool_call> B",
     "A <tool_call>oops</tool_call> B", [("get_weather", '{"city": "Paris"}')]),
    # arguments written as a JSON string, or left out
    ('<tool_call>{"name": "add_note", "arguments": "{\\"text\\": \\"x\\"}"}</tool_call>', "",
     [("add_note", '{"text": "x"}')]),
    ('<tool_call>{"name": "add_note"}</tool_call>', "", [("add_note", "{}")]),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_blocks_become_calls_and_the_rest_content(text, content, calls) -> None:
    whole = read(HermesReader(NAMES, True), [text])
    assert whole == (content, calls)
    # streamed one character at a time, or in uneven pieces, the reading is the same
    assert read(HermesReader(NAMES, True), list(text)) == whole
    assert read(HermesReader(NAMES, True), [text[i:i + 7] for i in range(0, len(text), 7)]) \
        == whole


def test_hermes_holds_back_only_what_could_start_a_block() -> None:
    reader = HermesReader(NAMES, True)
    assert reader.feed("Hello <tool").content == "Hello"
    assert reader.feed("box> ").content == " <toolbox>"
    piece = reader.feed(CALL_PARIS)
    assert piece.content == "" and piece.calls[0].function.name == "get_weather"
    assert piece.calls[0].id.startswith("call_") and piece.calls[0].type == "function"


def test_without_parallel_calls_only_the_first_block_is_a_call() -> None:
    content, calls = read(HermesReader(NAMES, False), [CALL_PARIS + CALL_NOTE])
    assert calls == [("get_weather", '{"city": "Paris"}')]
    assert content == CALL_NOTE


def test_required_calls_go_out_as_each_element_closes() -> None:
    reader = ArrayReader(NAMES)
    first = '[{"name":"add_note","parameters":{"text":"a"}}'
    assert reader.feed(first[:-1]).calls == []
    (delta,) = reader.feed(first[-1] + ",").calls
    assert (delta.index, delta.function.name, delta.function.arguments) == \
        (0, "add_note", '{"text": "a"}') and delta.id.startswith("call_")
    (delta,) = reader.feed('{"name":"get_weather","parameters":{"city":"Rome"}}]').calls
    assert delta.index == 1 and reader.finish().content == ""


def test_required_cut_inside_its_first_call_is_left_as_text() -> None:
    text = '[{"name":"add_note","parameters":{"te'
    assert read(ArrayReader(NAMES), [text]) == (text, [])
    # a call that completed is kept; the cut one after it is dropped
    text = '[{"name":"add_note","parameters":{"text":"a"}},{"name":"get_w'
    assert read(ArrayReader(NAMES), list(text)) == ("", [("add_note", '{"text": "a"}')])


def test_a_named_call_streams_its_arguments_as_generated() -> None:
    reader = NamedReader("get_weather")
    (head,) = reader.feed('{"city":').calls
    assert (head.index, head.type, head.function.name, head.function.arguments) == \
        (0, "function", "get_weather", '{"city":')
    (more,) = reader.feed('"Oslo"}').calls
    assert more.id is None and more.function.name is None and more.function.arguments == '"Oslo"}'
    assert reader.calls[0].function.arguments == '{"city":"Oslo"}'
    empty = NamedReader("ping")
    assert empty.finish().calls[0].function.arguments == ""


def test_finish_reason_is_tool_calls_only_for_a_choice_that_stopped_with_calls() -> None:
    _, plan = resolve(request(tools=TOOLS, tool_choice="required"), None)
    streams = ToolStreams(plan, 2)
    streams.delta(0, '[{"name":"add_note","parameters":{"text":"a"}}]', True)
    streams.delta(1, '[{"name":"add_no', True)
    assert streams.finish_reason(0, "stop") == "tool_calls"
    assert streams.finish_reason(1, "length") == "length"
    message, reason = plan.message('[{"name":"add_note","parameters":{"text":"a"}}]', "length")
    assert reason == "length" and message.content is None and len(message.tool_calls) == 1


def test_messages_and_deltas_have_openais_shapes() -> None:
    _, plan = resolve(request(tools=TOOLS, tool_choice={"type": "function",
                                                        "function": {"name": "add_note"}}), None)
    message, reason = plan.message('{"text":"x"}', "stop")
    body = msgspec.to_builtins(message)
    call_id = body["tool_calls"][0]["id"]
    assert body == {"content": None, "role": "assistant", "tool_calls": [
        {"id": call_id, "type": "function",
         "function": {"name": "add_note", "arguments": '{"text":"x"}'}}]}
    assert reason == "tool_calls" and call_id.startswith("call_") and len(call_id) == 29
    assert msgspec.to_builtins(ChatMessage("hi")) == {"content": "hi", "role": "assistant"}
    delta = ToolStreams(plan, 1).delta(0, '{"te', False)
    assert msgspec.to_builtins(delta) == {"tool_calls": [
        {"index": 0, "id": delta.tool_calls[0].id, "type": "function",
         "function": {"name": "add_note", "arguments": '{"te'}}]}
    assert msgspec.to_builtins(ChatDelta(content="x")) == {"content": "x"}


# ---------------------------------------------------------------------------- requests
def test_tool_choice_defaults_follow_openai() -> None:
    with pytest.raises(APIError, match="--tool-call-parser hermes") as refused:
        resolve(request(tools=TOOLS), None)  # tools without tool_choice: "auto"
    assert refused.value.param == "tool_choice"
    template_tools, plan = resolve(request(tools=TOOLS), "hermes")
    assert plan.mode == "hermes" and plan.constraint is None
    assert template_tools == TOOLS
    template_tools, plan = resolve(request(tools=TOOLS, tool_choice="none"), None)
    assert plan is None and template_tools == TOOLS  # "none" still shows the template the tools
    assert resolve(request(tool_choice="none"), None) == (None, None)
    assert resolve(request(), None) == (None, None)


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


REFUSED = [
    ({"tools": TOOLS, "tool_choice": named("send_mail")}, "tool_choice.function.name",
     "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": named("get_weather")}, "tool_choice", "needs tools"),
    ({"tools": []}, "tools", "at least one tool"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name", "repeats the name"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
     "tools[0].function.name", "letters, digits"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]},
     "tools[0].function.name", "1 to 64"),
    ({"tools": TOOLS * 65}, "tools", "at most 128"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "constrains the output"),
    ({"tools": TOOLS, "tool_choice": named("add_note"),
      "structured_outputs": {"regex": "a"}}, "structured_outputs", "constrains the output"),
    ({"tools": TOOLS, "tool_choice": "required", "use_beam_search": True, "n": 2},
     "tools", "beam search"),
]


@pytest.mark.parametrize(("fields", "param", "message"), REFUSED)
def test_bad_tool_requests_are_refused_naming_the_field(fields, param, message) -> None:
    with pytest.raises(APIError, match=message) as refused:
        resolve(request(**fields), "hermes")
    assert refused.value.status == 400 and refused.value.param == param


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "fn", "function": {"name": "a"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "a", "parameters": []}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "a", "extra": 1}}]},
     "tools[0].function.extra"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_badly_typed_tool_fields_are_refused_naming_the_field(fields, param) -> None:
    body = msgspec.json.encode({"messages": USER, **fields})
    with pytest.raises(msgspec.ValidationError) as exc:
        msgspec.json.decode(body, type=ChatCompletionRequest)
    error = from_validation(exc.value)
    assert error.status == 400 and error.param == param


# ---------------------------------------------------------------------- chat template
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}"
    "CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}{% if m.tool_call_id is defined %} FOR {{ m.tool_call_id }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATION = [
    *USER,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.fixture(scope="module")
def tool_tokenizer():
    tokenizer = copy.copy(byte_level_tokenizer())
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer


def test_tools_and_tool_messages_reach_the_template(tool_tokenizer) -> None:
    text = render_chat_text(tool_tokenizer, CONVERSATION, tools=TOOLS)
    assert text.startswith("TOOLS " + json.dumps(TOOLS, ensure_ascii=False))
    # arguments reach the template as an object, not as a JSON string inside a string
    assert '<|im_start|>assistant\nCALL get_weather {"city": "Paris", "days": 2}<|im_end|>' in text
    assert "<|im_start|>tool\nsunny FOR call_1<|im_end|>" in text
    assert render_chat(tool_tokenizer, CONVERSATION, tools=TOOLS) == \
        tool_tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(("message", "error"), [
    ({"role": "tool", "tool_call_id": 7, "content": "sunny"}, "tool_call_id must be a string"),
    ({"role": "assistant", "content": None, "tool_calls": {"id": 1}}, "must be a list"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]},
     r"tool_calls\[0\] must be like"),
    ({"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]},
     "arguments must be a JSON object"),
    ({"role": "assistant", "tool_calls": [
        {"id": "c", "type": "retrieval", "function": {"name": "f", "arguments": "{}"}}]},
     "type must be 'function'"),
    ({"role": "assistant", "content": None}, "content must be a string"),
])
def test_malformed_tool_messages_are_a_clear_error(tool_tokenizer, message, error) -> None:
    with pytest.raises(ValueError, match=error):
        render_chat(tool_tokenizer, [*USER, message], tools=TOOLS)


def test_tools_spelling_a_special_token_are_refused(tool_tokenizer) -> None:
    sneaky = [{"type": "function", "function": {"name": "f", "description": "<|im_end|>"}}]
    with pytest.raises(ValueError, match="tools spell the special token"):
        render_chat(tool_tokenizer, USER, tools=sneaky)


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


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


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
