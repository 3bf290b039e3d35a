"""render_chat and encode_prompt: the template's text as ids, one BOS, clear errors."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

from tests.tokenizer_fixtures import TOKENIZERS, byte_level_tokenizer, metaspace_tokenizer
from tokenizer_worker.template import encode_prompt, render_chat, render_chat_text

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Bonjour, ça va? 你好 😀"},
    {"role": "assistant", "content": "Oui."},
    {"role": "tool", "content": '{"temperature": 21}'},
    {"role": "user", "content": "And now?"},
]
CHATML_TEXT = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n"
    "<|im_start|>user\nBonjour, ça va? 你好 😀<|im_end|>\n"
    "<|im_start|>assistant\nOui.<|im_end|>\n"
    '<|im_start|>tool\n{"temperature": 21}<|im_end|>\n'
    "<|im_start|>user\nAnd now?<|im_end|>\n"
)
GENERATION_PROMPT = "<|im_start|>assistant\n"


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_render_chat_encodes_the_template_text(name: str) -> None:
    tokenizer = TOKENIZERS[name]()
    ids = render_chat(tokenizer, CONVERSATION)
    bos = tokenizer.bos_token if name == "metaspace" else ""
    assert tokenizer.decode(ids) == bos + CHATML_TEXT + GENERATION_PROMPT
    # Special tokens are single ids, not spelled out piece by piece.
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_start) == len(CONVERSATION) + 1


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_render_chat_text_is_what_render_chat_encodes(name: str) -> None:
    tokenizer = TOKENIZERS[name]()
    text = render_chat_text(tokenizer, CONVERSATION, add_generation_prompt=False)
    assert text.endswith(CHATML_TEXT)
    ids = render_chat(tokenizer, CONVERSATION, add_generation_prompt=False)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    with pytest.raises(ValueError, match="got 'bot'"):
        render_chat_text(tokenizer, [{"role": "bot", "content": "hi"}])


def test_template_bos_is_not_doubled() -> None:
    tokenizer = metaspace_tokenizer()
    ids = render_chat(tokenizer, CONVERSATION)
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 1


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_without_generation_prompt(name: str) -> None:
    tokenizer = TOKENIZERS[name]()
    ids = render_chat(tokenizer, CONVERSATION, add_generation_prompt=False)
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("And now?<|im_end|>\n")


def test_text_parts_are_joined_with_newlines() -> None:
    tokenizer = byte_level_tokenizer()
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    as_parts = render_chat(tokenizer, [{"role": "user", "content": parts}])
    as_string = render_chat(tokenizer, [{"role": "user", "content": "first\nsecond"}])
    assert as_parts == as_string


def test_extra_message_fields_reach_the_template() -> None:
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=byte_level_tokenizer().backend_tokenizer,
        chat_template="{% for m in messages %}{{ m['name'] }}: {{ m['content'] }}\n{% endfor %}",
    )
    ids = render_chat(tokenizer, [{"role": "user", "name": "ada", "content": "hi"}])
    assert tokenizer.decode(ids) == "ada: hi\n"


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([], "at least one message"),
        ("hello", "must be a list"),
        ({"role": "user", "content": "hi"}, "must be a list"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"content": "hi"}], r"messages\[0\]\.role must be one of system, user, assistant, tool"),
        ([{"role": "bot", "content": "hi"}], "got 'bot'"),
        ([{"role": "user"}], r"messages\[0\] has no 'content'"),
        ([{"role": "user", "content": None}], "must be a string or a list of text parts"),
        ([{"role": "user", "content": {"text": "hi"}}], "got dict"),
        (
            [{"role": "user", "content": "ok"}, {"role": "user", "content": ["hi"]}],
            r"messages\[1\]\.content\[0\] must be an object",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "has type 'image_url'; only 'text' parts are supported",
        ),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}], r"\.text must be a string"),
    ],
)
def test_malformed_messages_are_a_clear_error(messages: Any, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        render_chat(byte_level_tokenizer(), messages)


def test_no_chat_template_is_a_clear_error() -> None:
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer().backend_tokenizer)
    with pytest.raises(ValueError, match="has no chat template"):
        render_chat(tokenizer, [{"role": "user", "content": "hi"}])


def test_template_that_rejects_the_conversation_is_a_clear_error() -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Conversation must start with a user message') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=byte_level_tokenizer().backend_tokenizer, chat_template=template
    )
    with pytest.raises(ValueError, match="rejected the messages: Conversation must start"):
        render_chat(tokenizer, [{"role": "assistant", "content": "hi"}])


def test_encode_prompt_adds_bos_as_configured() -> None:
    metaspace, byte_level = metaspace_tokenizer(), byte_level_tokenizer()
    assert encode_prompt(metaspace, "Hello")[0] == metaspace.bos_token_id
    assert encode_prompt(metaspace, "Hello") == metaspace.encode("Hello")
    # GPT-2 style tokenizers add no BOS.
    assert encode_prompt(byte_level, "Hello") == byte_level.encode(
        "Hello", add_special_tokens=False
    )


def test_encode_prompt_keeps_a_spelled_out_bos_single() -> None:
    tokenizer = metaspace_tokenizer()
    ids = encode_prompt(tokenizer, "<s>Hello")
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids) == "<s>Hello"


def test_encode_prompt_errors() -> None:
    with pytest.raises(ValueError, match="the prompt is empty"):
        encode_prompt(byte_level_tokenizer(), "")
    with pytest.raises(ValueError, match="must be a string, got list"):
        encode_prompt(byte_level_tokenizer(), [1, 2])  # type: ignore[arg-type]
    # With a BOS the empty prompt is still one token to start from.
    assert encode_prompt(metaspace_tokenizer(), "") == [metaspace_tokenizer().bos_token_id]


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=60, deadline=None)
@given(
    contents=st.lists(
        st.text(alphabet=st.characters(exclude_characters="<>", exclude_categories=["Cs"])),
        min_size=1,
        max_size=4,
    )
)
def test_any_text_content_round_trips(name: str, contents: list[str]) -> None:
    tokenizer = TOKENIZERS[name]()
    messages = [
        {"role": "user" if index % 2 == 0 else "assistant", "content": content}
        for index, content in enumerate(contents)
    ]
    ids = render_chat(tokenizer, messages)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    for content in contents:
        assert content in text
