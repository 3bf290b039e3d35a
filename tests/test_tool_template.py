"""Tools and tool messages through the chat template (tokenizer_worker/template.py): the tools
and each call's arguments reach it as objects, malformed tool messages are clear errors, and
tools that spell a special token are refused."""

from __future__ import annotations

import copy
import json

import pytest

from tests.tokenizer_fixtures import byte_level_tokenizer
from tests.tool_fixtures import CONVERSATION, TOOLS, USER
from tokenizer_worker.template import render_chat, render_chat_text

TOOL_TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}"
    "CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}{% if m.tool_call_id is defined %} FOR {{ m.tool_call_id }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


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
