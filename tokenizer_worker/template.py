"""Prompts to token ids: chat messages through the model's chat template, and plain text."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
from transformers import PreTrainedTokenizerBase

CHAT_ROLES = ("system", "user", "assistant", "tool")


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template.

    Content may be a string or OpenAI's list of text parts (``[{"type": "text", "text": ...}]``),
    whose texts are joined with newlines as vLLM does. Raises ValueError with a sentence a user
    can act on when the tokenizer has no chat template or a message is malformed.
    """
    text = render_chat_text(tokenizer, messages, add_generation_prompt)
    # The template writes BOS and every other special token itself; letting encode add its own
    # would start the prompt with two BOS tokens.
    return tokenizer.encode(text, add_special_tokens=False)


def render_chat_text(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
) -> str:
    """``messages`` rendered by the chat template as text (see ``render_chat``)."""
    if not tokenizer.chat_template:
        raise ValueError(
            "this model's tokenizer has no chat template, so chat messages cannot be turned into "
            "a prompt; send a plain-text completion prompt instead"
        )
    conversation = _normalize_messages(messages)
    try:
        return tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except jinja2.TemplateError as error:
        # Templates reject conversations themselves (e.g. "roles must alternate").
        raise ValueError(f"the model's chat template rejected the messages: {error}") from error


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of a plain-text prompt, with BOS added the way the tokenizer is configured.

    A prompt that already spells out the BOS token (text rendered by a chat template on the
    client side) keeps a single BOS, not two.
    """
    if not isinstance(text, str):
        raise ValueError(f"the prompt must be a string, got {type(text).__name__}")
    token_ids = tokenizer.encode(text, add_special_tokens=True)
    bos_id, bos_token = tokenizer.bos_token_id, tokenizer.bos_token
    if (
        bos_id is not None
        and bos_token
        and text.startswith(bos_token)
        and token_ids[:2] == [bos_id, bos_id]
    ):
        token_ids = token_ids[1:]
    if not token_ids:
        raise ValueError("the prompt is empty; give at least one character of text")
    return token_ids


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} objects")
    if not messages:
        raise ValueError("messages must contain at least one message")
    return [_normalize_message(index, message) for index, message in enumerate(messages)]


def _normalize_message(index: int, message: Mapping[str, Any]) -> dict[str, Any]:
    """The message with its content as one string; other fields pass through for the template."""
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise ValueError(f"{where} must be an object with 'role' and 'content'")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise ValueError(f"{where}.role must be one of {', '.join(CHAT_ROLES)}; got {role!r}")
    if "content" not in message:
        raise ValueError(f"{where} has no 'content'")
    return {**message, "content": _content_text(where, message["content"])}


def _content_text(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(
            f"{where}.content must be a string or a list of text parts, "
            f"got {type(content).__name__}"
        )
    texts = []
    for index, part in enumerate(content):
        part_where = f"{where}.content[{index}]"
        if not isinstance(part, Mapping):
            raise ValueError(f"{part_where} must be an object like {{'type': 'text', 'text': ...}}")
        if part.get("type") != "text":
            raise ValueError(
                f"{part_where} has type {part.get('type')!r}; only 'text' parts are supported"
            )
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{part_where}.text must be a string")
        texts.append(part["text"])
    return "\n".join(texts)
