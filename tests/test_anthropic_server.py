"""Anthropic's Messages API on a live demo-model server, through the official anthropic SDK
(e2e): a message and its stream give the same text, usage reports the prefix cache, stop
sequences and named tool calls end as Anthropic says, count_tokens counts the prompt, and
refusals are Anthropic's errors."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.server_process import API_KEY, serve_module
from tests.tool_fixtures import SCHEMAS

TOOLS = [{"name": name, "description": f"the {name} tool", "input_schema": schema}
         for name, schema in SCHEMAS.items()]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
# The SDK's newest versions leave sampling fields out of create()'s arguments; the API takes them.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_module(tmp_path_factory.mktemp("anthropic"), "--api-key", API_KEY,
                            "--tool-call-parser", "hermes", "--num-pages", "1024")


@pytest.fixture(scope="module")
def claude(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)


def streamed(claude, **options) -> tuple[list, object]:
    """The stream's content blocks (text, or name and input) and its final message."""
    with claude.messages.stream(**options) as stream:
        final = stream.get_final_message()
    return final.content, final


@pytest.mark.e2e
def test_a_message_and_its_stream_agree_and_usage_shows_the_cache(claude, model) -> None:
    options = dict(model=model, max_tokens=24, extra_body=GREEDY, system="Be brief.",
                   messages=USER)
    first = claude.messages.create(**options)
    (block,) = first.content
    assert block.type == "text" and block.text
    assert first.stop_reason in ("end_turn", "max_tokens") and first.role == "assistant"
    assert first.usage.output_tokens > 0
    again = claude.messages.create(**options)
    assert again.content[0].text == block.text
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == total
    assert again.usage.cache_read_input_tokens >= total - 1
    content, final = streamed(claude, **options)
    assert [c.text for c in content] == [block.text]
    assert final.stop_reason == first.stop_reason
    assert final.usage.output_tokens == first.usage.output_tokens
    count = claude.messages.count_tokens(model=model, system="Be brief.", messages=USER)
    assert count.input_tokens == total


@pytest.mark.e2e
def test_a_stop_sequence_ends_the_message(claude, model) -> None:
    options = dict(model=model, max_tokens=24, extra_body=GREEDY, messages=USER)
    text = claude.messages.create(**options).content[0].text
    assert len(text) > 8
    sequence = text[len(text) // 2:len(text) // 2 + 3]
    stopped = claude.messages.create(**options, stop_sequences=[sequence])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", sequence)
    assert text.startswith(stopped.content[0].text if stopped.content else "")


@pytest.mark.e2e
def test_a_named_tool_returns_valid_input_streamed_the_same(claude, model) -> None:
    options = dict(model=model, max_tokens=64, extra_body=GREEDY, messages=USER, tools=TOOLS,
                   tool_choice={"type": "tool", "name": "get_weather"})
    whole = claude.messages.create(**options)
    (use,) = whole.content
    assert use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, SCHEMAS["get_weather"])
    assert whole.stop_reason == "tool_use"
    content, final = streamed(claude, **options)
    assert [(c.type, c.name, c.input) for c in content] == [("tool_use", use.name, use.input)]
    assert final.stop_reason == "tool_use"
    # The call and its result continue the conversation.
    reply = claude.messages.create(
        model=model, max_tokens=4, extra_body=GREEDY, tools=TOOLS, tool_choice={"type": "none"},
        messages=[*USER, {"role": "assistant", "content": whole.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": json.dumps({"sky": "clear"})}]}])
    assert reply.stop_reason in ("end_turn", "max_tokens")


@pytest.mark.e2e
def test_refusals_are_anthropics_errors(claude, server, model) -> None:
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as bad_block:
        claude.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])
    assert bad_block.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0]" in bad_block.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as orphan:
        claude.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}])
    assert "messages[0].content[0].tool_use_id" in orphan.value.body["error"]["message"]
    wrong = anthropic.Anthropic(base_url=server.url, api_key="not-the-key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as unauthorized:
        wrong.messages.create(model=model, max_tokens=4, messages=USER)
    assert unauthorized.value.body["error"]["type"] == "authentication_error"
