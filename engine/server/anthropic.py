"""Anthropic's Messages API as a door onto the chat path: a ``MessagesRequest`` becomes the
``ChatCompletionRequest`` it means, runs as a chat call, and its choice comes back as a
``Message`` or as Anthropic's stream events.

    system                          a system message first
    user: text blocks               a user message
    user: tool_result blocks        tool messages (tool_call_id: the tool_use's id), before
                                    the user's text
    assistant: text, tool_use       an assistant message with content and tool_calls
    tools (input_schema)            functions (parameters)
    tool_choice auto / any / tool / none     "auto" (hermes) / "required" / named / "none"
    stop_reason  end_turn / max_tokens / stop_sequence / tool_use   ← finish stop / length /
                                    a stop string matched / tool_calls

A stream is ``message_start``, then per content block ``content_block_start``, its deltas
(``text_delta``, ``input_json_delta``) and ``content_block_stop``, then ``message_delta``
(stop_reason, usage) and ``message_stop``; an error after the first event is an ``error``
event. Errors have Anthropic's body, with the field at fault leading the message.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import msgspec

from engine.server.anthropic_schemas import (
    AnthropicError,
    AnthropicErrorBody,
    CountTokensRequest,
    InputMessage,
    Message,
    MessagesRequest,
    MessageUsage,
    TextBlock,
    TextContent,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolUseBlock,
    ToolUseContent,
)
from engine.server.errors import APIError
from engine.server.schemas import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatTool,
    FunctionDefinition,
    NamedToolChoice,
    ToolChoiceFunction,
)
from engine.server.shapes import Call

logger = logging.getLogger("radixserve.server")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_encoder = msgspec.json.Encoder()


# ---------------------------------------------------------------------------- requests
def chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """The chat messages a request means; 400 for a tool_result that answers no earlier
    tool_use."""
    system = body.system
    if isinstance(system, list):
        system = "".join(block.text for block in system)
    messages: list[dict[str, Any]] = [] if not system else [{"role": "system",
                                                            "content": system}]
    called: set[str] = set()
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            messages.append(_assistant(message, called))
        else:
            messages += _user(message, i, called)
    return messages


def _assistant(message: InputMessage, called: set[str]) -> dict[str, Any]:
    text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
    uses = [b for b in message.content if isinstance(b, ToolUseBlock)]
    called.update(use.id for use in uses)
    out: dict[str, Any] = {"role": "assistant", "content": text or (None if uses else "")}
    if uses:
        out["tool_calls"] = [{"id": use.id, "type": "function", "function": {
            "name": use.name, "arguments": json.dumps(use.input, ensure_ascii=False)}}
            for use in uses]
    return out


def _user(message: InputMessage, index: int, called: set[str]) -> list[dict[str, Any]]:
    results, text = [], []
    for j, block in enumerate(message.content):
        where = f"messages[{index}].content[{j}]"
        if isinstance(block, ToolUseBlock):
            raise APIError(400, f"{where}: a tool_use block belongs in an assistant message",
                           param=f"{where}.type")
        if isinstance(block, TextBlock):
            text.append(block.text)
            continue
        if block.tool_use_id not in called:
            raise APIError(400, f"{where}.tool_use_id: tool_result answers "
                           f"{block.tool_use_id[:80]!r}, which no earlier tool_use block "
                           "made", param=f"{where}.tool_use_id")
        content = block.content if isinstance(block.content, str) \
            else "".join(part.text for part in block.content)
        results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
    return results + ([{"role": "user", "content": "".join(text)}] if text else [])


def chat_tools(body: CountTokensRequest) -> list[ChatTool] | None:
    if body.tools is None:
        return None
    return [ChatTool("function", FunctionDefinition(t.name, t.description, t.input_schema))
            for t in body.tools]


def to_chat(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat request ``body`` means (the chat path's own checks follow: ``renamed``)."""
    choice = body.tool_choice
    parallel = not getattr(choice, "disable_parallel_tool_use", False)
    tool_choice: Any = None
    if isinstance(choice, ToolChoiceAuto):
        tool_choice = "auto"
    elif isinstance(choice, ToolChoiceAny):
        tool_choice = "required"
    elif isinstance(choice, ToolChoiceTool):
        tool_choice = NamedToolChoice("function", ToolChoiceFunction(choice.name))
    elif isinstance(choice, ToolChoiceNone):
        tool_choice = "none"
    return ChatCompletionRequest(
        model=body.model, messages=chat_messages(body), max_tokens=body.max_tokens,
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        stop=body.stop_sequences, tools=chat_tools(body), tool_choice=tool_choice,
        parallel_tool_calls=parallel, stream=body.stream)


_CHAT_PARAMS = [(re.compile(r"^tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
                (re.compile(r"^tools\[(\d+)\]\.function\.(\w+)"), r"tools[\1].\2"),
                (re.compile(r"^tool_choice\.function\.name"), "tool_choice.name"),
                (re.compile(r"^stop$"), "stop_sequences")]


def renamed(exc: APIError) -> APIError:
    """A chat path error with the Messages API's names for its fields."""
    param = exc.param
    if param is None:
        return exc
    for pattern, name in _CHAT_PARAMS:
        param = pattern.sub(name, param)
    message = exc.message.replace(exc.param, param).replace("tool_choice \"required\"",
                                                            "tool_choice \"any\"")
    return APIError(exc.status, message, param=param, code=exc.code)


def error_body(exc: APIError) -> AnthropicError:
    message = exc.message
    if exc.param and exc.param not in message:
        message = f"{exc.param}: {message}"
    return AnthropicError(AnthropicErrorBody(ERROR_TYPES.get(exc.status, "api_error"),
                                             message))


# --------------------------------------------------------------------------- responses
def message_id(call: Call) -> str:
    return "msg_" + call.id.partition("-")[2]


def usage(call: Call) -> MessageUsage:
    choices = call.choices
    prompt, cached = sum(choices.prompt_tokens), sum(choices.cached_tokens)
    return MessageUsage(prompt - cached, choices.completion_tokens, cached)


def stop(call: Call, finish_reason: str | None) -> tuple[str | None, str | None]:
    """``stop_reason`` and ``stop_sequence`` of the call's (only) choice."""
    matched = call.choices.choices[0].stop_reason
    if finish_reason == "stop" and matched is not None:
        return "stop_sequence", matched
    return STOP_REASONS.get(finish_reason or "", finish_reason), None


def message(call: Call, choice_message: Any, finish_reason: str | None) -> Message:
    """A whole response: the chat choice's content, then its tool calls."""
    content: list[TextContent | ToolUseContent] = []
    if choice_message.content:
        content.append(TextContent(choice_message.content))
    for tool_call in choice_message.tool_calls or []:
        content.append(ToolUseContent(tool_call.id, tool_call.function.name,
                                      _arguments(tool_call.function.arguments)))
    reason, sequence = stop(call, finish_reason)
    return Message(message_id(call), call.model, content, reason, sequence, usage(call))


def _arguments(text: str) -> dict[str, Any]:
    """A call's input object (a call cut by max_tokens may not parse: then it is empty)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def event(name: str, body: Any) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _encoder.encode(body) + b"\n\n"


async def events(call: Call, chunks: AsyncIterator[ChatCompletionChunk]) -> AsyncIterator[bytes]:
    """The chat stream's chunks as Anthropic's events. Nothing is yielded before the engine's
    first output (so a refusal is still a plain error response); errors after it are events."""
    open_block: str | None = None  # "text" or "tool_use": the block taking deltas
    index = -1
    finish: str | None = None
    started = False
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                if not started:
                    started = True
                    yield event("message_start", {"type": "message_start", "message": Message(
                        message_id(call), call.model, [], None, None, usage(call))})
                for choice in chunk.choices:
                    delta = choice.delta
                    finish = choice.finish_reason or finish
                    if delta.content:
                        if open_block != "text":
                            if open_block is not None:
                                yield _block_stop(index)
                            index, open_block = index + 1, "text"
                            yield event("content_block_start", {
                                "type": "content_block_start", "index": index,
                                "content_block": TextContent("")})
                        yield _delta(index, {"type": "text_delta", "text": delta.content})
                    for tool_delta in delta.tool_calls or []:
                        function = tool_delta.function
                        if tool_delta.id is not None:  # a new call
                            if open_block is not None:
                                yield _block_stop(index)
                            index, open_block = index + 1, "tool_use"
                            yield event("content_block_start", {
                                "type": "content_block_start", "index": index,
                                "content_block": ToolUseContent(
                                    tool_delta.id, function.name if function else "", {})})
                        if function is not None and function.arguments:
                            yield _delta(index, {"type": "input_json_delta",
                                                 "partial_json": function.arguments})
    except APIError as exc:
        if not started:
            raise
        yield event("error", error_body(exc))
        return
    except Exception:
        if not started:
            raise
        logger.exception("a stream failed")
        yield event("error", error_body(APIError(500, "the server failed while streaming; "
                                                 "see its log")))
        return
    if open_block is not None:
        yield _block_stop(index)
    reason, sequence = stop(call, finish)
    yield event("message_delta", {
        "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
        "usage": usage(call)})
    yield event("message_stop", {"type": "message_stop"})


def _block_stop(index: int) -> bytes:
    return event("content_block_stop", {"type": "content_block_stop", "index": index})


def _delta(index: int, delta: dict[str, Any]) -> bytes:
    return event("content_block_delta", {"type": "content_block_delta", "index": index,
                                         "delta": delta})


def count_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request whose prompt ``count_tokens`` counts (the tools are rendered whatever
    the choice)."""
    return ChatCompletionRequest(model=body.model, messages=chat_messages(body),
                                 tools=chat_tools(body), tool_choice="none")
