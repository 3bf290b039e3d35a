"""OpenAI tool calls as engine/server/tools.py reads a request and an output, no processes: the
grammars of named and "required" tool_choice, the hermes, array and named readers over streamed
pieces, the request's refusals and the exact message and delta shapes."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import msgspec
import pytest

from engine.checkpoints.demo_model import build_demo_model
from engine.contracts import structured
from engine.contracts.tokenizer import load_tokenizer
from engine.server.errors import APIError, from_validation
from engine.server.sampling import chat_params
from engine.server.schemas import ChatCompletionRequest, ChatDelta, ChatMessage
from engine.server.tools import ArrayReader, HermesReader, NamedReader, ToolStreams, resolve
from tests.test_server_app import INFO
from tests.tool_fixtures import NOTE, SCHEMAS, TOOLS, USER, named


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
