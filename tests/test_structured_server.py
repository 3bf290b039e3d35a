"""Structured output through a real ``radixserve serve`` (demo model) with the official openai
client: response_format json_schema / json_object on chat, vLLM's structured_outputs on
completions and /generate, streaming, n > 1, logprobs and stop strings, the refusals, and the
metrics."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from tests.server_process import API_KEY, AUTH, metric_values, serve_module
from tests.test_structured_output import PERSON, SCHEMAS

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_module(tmp_path_factory.mktemp("structured"), "--api-key", API_KEY)


def chat(oai, model, content: str, **options):
    return oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}],
        **{"max_tokens": 200, "temperature": 0.0, **options})


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(oai, model, name) -> None:
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                  "strict": True}}
    reply = chat(oai, model, "Answer in JSON.", response_format=fmt, n=3, temperature=1.0,
                 seed=7)
    assert len(reply.choices) == 3
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_streaming_and_logprobs_give_the_same_valid_output(oai, model) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    whole = chat(oai, model, "A person.", response_format=fmt)
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    stream = chat(oai, model, "A person.", response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    # Rows that report logprobs take no forced tokens: the same text, one step a token.
    logged = chat(oai, model, "A person.", response_format=fmt, logprobs=True, top_logprobs=2)
    assert logged.choices[0].message.content == text
    assert len(logged.choices[0].logprobs.content) > 0


def test_json_object_and_a_stop_string_inside_it(oai, model) -> None:
    # Any object: the demo model's random weights close one here (elsewhere its strings may
    # run to max_tokens, a "length" finish).
    reply = oai.completions.create(model=model, prompt="Tell me about a person:", max_tokens=50,
                                   temperature=0.0,
                                   extra_body={"response_format": {"type": "json_object"}})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].text), dict)
    # A stop string ends the output wherever it appears, grammar or not.
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    whole = chat(oai, model, "A person.", response_format=fmt).choices[0].message.content
    stopped = chat(oai, model, "A person.", response_format=fmt, stop=[","]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.message.content == whole.split(",")[0]


def test_completions_and_generate_take_vllms_structured_outputs(oai, model, server) -> None:
    phone = r"[0-9]{3}-[0-9]{4}"
    completion = oai.completions.create(model=model, prompt="Call me at", max_tokens=20,
                                        temperature=1.0, seed=2,
                                        extra_body={"structured_outputs": {"regex": phone}})
    assert re.fullmatch(phone, completion.choices[0].text)
    body = {"text": "Pick one:", "sampling_params": {
        "max_tokens": 10, "temperature": 1.0, "seed": 4,
        "structured_outputs": {"choice": ["red", "green", "blue"]}}}
    answer = httpx.post(f"{server.url}/generate", json=body, headers=AUTH, timeout=60).json()
    assert answer["choices"][0]["text"] in ("red", "green", "blue")


@pytest.mark.parametrize("options,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "objekt"}}}}, "response_format", "Invalid type"),
    ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "structured_outputs",
     "unclosed group"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}},
     "structured_outputs", "exactly one of"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"response_format": {"type": "json_object"}, "extra_body": {
        "structured_outputs": {"regex": "a"}}}, "response_format", "not both"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"use_beam_search": True},
      "n": 2}, "structured_outputs", "beam search"),
])
def test_bad_constraints_are_400s_naming_the_problem(oai, model, options, param,
                                                    words) -> None:
    import openai  # here, not above: every test process collects this module (a 0.4 s import)

    with pytest.raises(openai.BadRequestError) as caught:
        chat(oai, model, "hi", **options)
    error = caught.value.body
    assert words in error["message"], error
    if param is not None:
        assert error["param"] == param


def test_metrics_count_constrained_requests_and_forced_tokens(oai, model, server) -> None:
    before = metric_values(server)
    chat(oai, model, "JSON please.", response_format={"type": "json_object"})
    after = metric_values(server)
    assert (after["radixserve_structured_output_requests_total"]
            == before["radixserve_structured_output_requests_total"] + 1)
    assert after["radixserve_structured_output_mask_seconds_total"] > 0
    assert after["radixserve_structured_output_forced_tokens_total"] >= 0
