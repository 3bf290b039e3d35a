"""Prompts to token ids: chat messages through the model's chat template, and plain text.

Text inside chat messages is the user's, so a special token it spells (``<|im_end|>``,
``<|im_start|>system``) is encoded as plain text, never as the control token: otherwise a user
could close their turn and forge a system turn. Only the template's own special tokens are
control tokens. The messages' strings are located in the rendered text by rendering a second
time with markers in their place (only when some string spells a special token)::

    <|im_start|>user\n{marker 0}<|im_end|>\n   →   spans of the text that are message strings
    └ template ┘      └ message ┘└ template ┘         (special tokens inside them are text)
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
from transformers import PreTrainedTokenizerBase

CHAT_ROLES = ("system", "user", "assistant", "tool")


Span = tuple[int, int]  # [start, end) character offsets into a rendered text
# chat messages, or tools: JSON objects as the client sent them
JsonObjects = Sequence[Mapping[str, Any]]


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: JsonObjects,
                add_generation_prompt: bool = True, *, tools: JsonObjects | None = None,
                special_in_content: bool = False) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template.

    Content may be a string or OpenAI's list of text parts (``[{"type": "text", "text": ...}]``),
    whose texts are joined with newlines as vLLM does. An assistant message may carry OpenAI's
    ``tool_calls`` (its content then may be null), whose arguments reach the template as objects
    (transformers' convention); a ``tool`` message answers one by ``tool_call_id``. ``tools``
    (OpenAI's function definitions) go to the template as they are. Special tokens spelled in
    message text are encoded as text unless ``special_in_content`` (the server's explicit
    opt-out); in tools they are refused. Raises ValueError with a sentence a user can act on
    when the tokenizer has no chat template or a message is malformed.
    """
    text, spans = render_chat_spans(tokenizer, messages, add_generation_prompt, tools=tools,
                                    special_in_content=special_in_content)
    return encode_rendered(tokenizer, text, spans)


def render_chat_spans(tokenizer: PreTrainedTokenizerBase, messages: JsonObjects,
                      add_generation_prompt: bool = True, *, tools: JsonObjects | None = None,
                      special_in_content: bool = False) -> tuple[str, list[Span]]:
    """The rendered text and the spans of it that are message strings spelling a special token
    (none when no string does, or with ``special_in_content``)."""
    text = render_chat_text(tokenizer, messages, add_generation_prompt, tools=tools)
    pattern = _special_pattern(tokenizer)
    if special_in_content or pattern is None:
        return text, []
    # Templates write tools as JSON, which changes strings, so they cannot be kept as text.
    spelled = pattern.search(json.dumps(tools, ensure_ascii=False)) if tools else None
    if spelled is not None:
        raise ValueError(f"tools spell the special token {spelled[0]!r}; remove it from the "
                         "function definitions")
    conversation = _normalize_messages(messages)
    found: list[str] = []
    marked = [_marked(message, pattern, found) for message in conversation]
    if not found:
        return text, []
    rendered = render_chat_text(tokenizer, marked, add_generation_prompt, tools=tools)
    pieces: list[str] = []
    spans: list[Span] = []
    length = position = 0
    for match in _MARKER.finditer(rendered):
        template_text, string = rendered[position : match.start()], found[int(match.group(1))]
        pieces += [template_text, string]
        length += len(template_text)
        spans.append((length, length + len(string)))
        length += len(string)
        position = match.end()
    pieces.append(rendered[position:])
    if "".join(pieces) != text:
        raise ValueError(f"a message spells a special token ({pattern.search(found[0])[0]!r}), "
                         "and this model's chat template changes message text, so it cannot be "
                         "kept as plain text; remove it from the message")
    return text, spans


def encode_rendered(tokenizer: PreTrainedTokenizerBase, text: str, spans: Sequence[Span],
                    start: int = 0) -> list[int]:
    """Ids of ``text[start:]``: special tokens are control tokens only outside ``spans``."""
    # The template writes BOS and every other special token itself; letting encode add its own
    # would start the prompt with two BOS tokens.
    if not spans:
        return tokenizer.encode(text[start:], add_special_tokens=False)
    pattern = _special_pattern(tokenizer)
    assert pattern is not None, "spans come only from a tokenizer with special tokens"
    ids: list[int] = []
    plain: list[str] = []  # text since the last control token, encoded as one piece

    def flush() -> None:
        if plain:
            ids.extend(tokenizer.encode("".join(plain), add_special_tokens=False,
                                        split_special_tokens=True))
            plain.clear()

    position = start
    for span_start, span_end in [*spans, (len(text), len(text))]:
        if span_end <= position:
            continue
        template_end = max(span_start, position)
        for match in pattern.finditer(text, position, template_end):
            plain.append(text[position : match.start()])
            flush()
            ids.append(tokenizer.convert_tokens_to_ids(match.group()))
            position = match.end()
        plain.append(text[position:span_end])
        position = span_end
    flush()
    return ids


def render_chat_text(tokenizer: PreTrainedTokenizerBase, messages: JsonObjects,
                     add_generation_prompt: bool = True, *,
                     tools: JsonObjects | None = None) -> str:
    """``messages`` rendered by the chat template as text (see ``render_chat``)."""
    if not tokenizer.chat_template:
        raise ValueError("this model's tokenizer has no chat template, so chat messages cannot "
                         "be turned into a prompt; send a plain-text completion prompt instead")
    conversation = _normalize_messages(messages)
    try:
        return tokenizer.apply_chat_template(conversation, tools=list(tools) if tools else None,
                                             tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
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
    if bos_token and text.startswith(bos_token) and token_ids[:2] == [bos_id, bos_id]:
        token_ids = token_ids[1:]  # (a None bos_id matches no token id)
    if not token_ids:
        raise ValueError("the prompt is empty; give at least one character of text")
    return token_ids


_MARKER = re.compile("\ue000(\\d+)\ue001")  # private-use characters: no template alters them


@functools.lru_cache(maxsize=8)  # one tokenizer per process; built once, not per request
def _special_pattern(tokenizer: PreTrainedTokenizerBase) -> re.Pattern[str] | None:
    """The tokenizer's special tokens, longest first (so the longest match wins, as in HF)."""
    tokens = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special},
                    key=len, reverse=True)
    return re.compile("|".join(map(re.escape, tokens))) if tokens else None


def _marked(value: Any, pattern: re.Pattern[str], found: list[str]) -> Any:
    """``value`` with every string that spells a special token replaced by a marker (roles and
    keys excepted: roles are checked names, and templates branch on them)."""
    if isinstance(value, str):
        if not pattern.search(value):
            return value
        found.append(value)
        return f"\ue000{len(found) - 1}\ue001"
    if isinstance(value, Mapping):
        return {k: v if k == "role" else _marked(v, pattern, found) for k, v in value.items()}
    if isinstance(value, list):
        return [_marked(v, pattern, found) for v in value]
    return value


def _normalize_messages(messages: JsonObjects) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} objects")
    if not messages:
        raise ValueError("messages must contain at least one message")
    return [_normalize_message(index, message) for index, message in enumerate(messages)]


def _normalize_message(index: int, message: Mapping[str, Any]) -> dict[str, Any]:
    """The message with its content as one string (and an assistant's tool call arguments as
    objects); other fields pass through for the template."""
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise ValueError(f"{where} must be an object with 'role' and 'content'")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise ValueError(f"{where}.role must be one of {', '.join(CHAT_ROLES)}; got {role!r}")
    calls = message.get("tool_calls")
    if role == "assistant" and calls is not None:
        normalized = {**message, "tool_calls": _tool_calls(where, calls)}
        if message.get("content") is None:  # OpenAI's null content beside tool calls
            return {**normalized, "content": ""}
        return {**normalized, "content": _content_text(where, message["content"])}
    if "content" not in message:
        raise ValueError(f"{where} has no 'content'")
    if role == "tool" and not isinstance(message.get("tool_call_id", ""), str):
        raise ValueError(f"{where}.tool_call_id must be a string naming the call it answers")
    return {**message, "content": _content_text(where, message["content"])}


def _tool_calls(where: str, calls: Any) -> list[dict[str, Any]]:
    """OpenAI's ``tool_calls`` of an assistant message, each call's arguments parsed from its
    JSON text into the object chat templates expect."""
    if not isinstance(calls, list):
        raise ValueError(f"{where}.tool_calls must be a list of calls")
    normalized = []
    for index, call in enumerate(calls):
        call_where = f"{where}.tool_calls[{index}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError(f"{call_where} must be like {{'id': ..., 'type': 'function', "
                             "'function': {'name': ..., 'arguments': '{...}'}}")
        if call.get("type", "function") != "function":
            raise ValueError(f"{call_where}.type must be 'function'")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(arguments, Mapping):
            raise ValueError(f"{call_where}.function.arguments must be a JSON object (as text)")
        normalized.append({**call, "function": {**function, "arguments": arguments}})
    return normalized


def _content_text(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of text parts, "
                         f"got {type(content).__name__}")
    texts = []
    for index, part in enumerate(content):
        part_where = f"{where}.content[{index}]"
        if not isinstance(part, Mapping):
            raise ValueError(f"{part_where} must be an object like {{'type': 'text', 'text': ...}}")
        if part.get("type") != "text":
            raise ValueError(f"{part_where} has type {part.get('type')!r}; only 'text' parts "
                             "are supported")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{part_where}.text must be a string")
        texts.append(part["text"])
    return "\n".join(texts)
