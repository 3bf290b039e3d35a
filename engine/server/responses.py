"""OpenAI's Responses API as a door onto the chat path: a ``ResponsesRequest`` becomes the chat
call it means (with a session when it is stored or continues a stored one), and the chat
stream's chunks are assembled into output items, as events for a stream and as a
``ResponseObject`` for a whole response: the same reading either way.

    input (a string, message and function_call items)   chat messages (function_call:
    function_call_output                                 an assistant tool call; its output:
    instructions                                         a tool message), after a system message
    previous_response_id     the new turn of a session forked from that response's
    tools, tool_choice       chat's (named: {"type": "function", "name"}; "required")
    text.format              response_format (json_schema, json_object)

Stream events: ``response.created``, ``response.in_progress``, per output item
``response.output_item.added``, then a message's ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``, ``response.content_part.done``
(a call's ``response.function_call_arguments.delta``..., ``.done``), and
``response.output_item.done``; then ``response.completed`` (``response.incomplete`` when cut by
``max_output_tokens``, ``response.cancelled`` when cancelled). Each has a ``sequence_number``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import msgspec

from engine.server.errors import APIError, from_validation
from engine.server.response_store import StoredResponse
from engine.server.responses_schemas import (
    FunctionCallItem,
    FunctionCallOutputItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from engine.server.schemas import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatTool,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    ToolChoiceFunction,
)
from engine.server.shapes import Call

logger = logging.getLogger("radixserve.server")
ITEMS = {"message": MessageItem, "function_call": FunctionCallItem,
         "function_call_output": FunctionCallOutputItem}
_encoder = msgspec.json.Encoder()


# ---------------------------------------------------------------------------- requests
def input_messages(body: ResponsesRequest, earlier_calls: set[str]) -> list[dict[str, Any]]:
    """The new turn's chat messages; ``earlier_calls``: the call ids of the previous
    response's output, which a function_call_output may answer."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    if not body.input:
        raise APIError(400, "input must hold at least one item", param="input")
    called = set(earlier_calls)
    for i, raw in enumerate(body.input):
        item = _item(raw, i)
        if isinstance(item, MessageItem):
            content = item.content if isinstance(item.content, str) \
                else "".join(part.text for part in item.content)
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": content})
        elif isinstance(item, FunctionCallItem):
            called.add(item.call_id)
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": item.call_id, "type": "function",
                 "function": {"name": item.name, "arguments": item.arguments}}]})
        else:
            if item.call_id not in called:
                raise APIError(400, f"input[{i}].call_id {item.call_id[:80]!r} answers no "
                               "function call of this input or of the previous response",
                               param=f"input[{i}].call_id")
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.output})
    return messages


def _item(raw: dict[str, Any], index: int) -> MessageItem | FunctionCallItem | FunctionCallOutputItem:
    kind = ITEMS.get(raw.get("type", "message"))
    if kind is None:
        raise APIError(400, f"input[{index}].type must be message, function_call or "
                       f"function_call_output, got {str(raw.get('type'))[:80]!r}",
                       param=f"input[{index}].type")
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        inner = from_validation(exc)
        param = f"input[{index}]" + (f".{inner.param}" if inner.param else "")
        raise APIError(400, f"input[{index}]: {inner.message}", param=param) from None


def to_chat(body: ResponsesRequest, messages: list[dict[str, Any]],
            session_id: str | None) -> ChatCompletionRequest:
    choice: Any = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = NamedToolChoice("function", ToolChoiceFunction(choice.name))
    tools = None if body.tools is None else [
        ChatTool("function", FunctionDefinition(t.name, t.description, t.parameters, t.strict))
        for t in body.tools]
    fmt = body.text.format if body.text is not None else None
    response_format = None if fmt is None else ResponseFormat(fmt.type, JsonSchemaFormat(
        fmt.name, fmt.description, fmt.schema, fmt.strict) if fmt.type == "json_schema"
        else None)
    return ChatCompletionRequest(
        model=body.model, messages=messages, max_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, tools=tools, tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls, response_format=response_format,
        session_id=session_id, stream=body.stream)


_CHAT_PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text.format",
                "response_format.json_schema": "text.format.schema",
                "response_format.type": "text.format.type", "messages": "input"}


def renamed(exc: APIError) -> APIError:
    """A chat path error with the Responses API's names for its fields."""
    param = exc.param
    if param is None:
        return exc
    new = _CHAT_PARAMS.get(param, param.replace(".function.", ".").replace("].function", "]"))
    return APIError(exc.status, exc.message.replace(param, new), param=new, code=exc.code)


def new_response(body: ResponsesRequest, model: str, created: int,
                 response_id: str) -> ResponseObject:
    return ResponseObject(
        id=response_id, created_at=created, model=model, status="in_progress", output=[],
        previous_response_id=body.previous_response_id, instructions=body.instructions,
        max_output_tokens=body.max_output_tokens, temperature=body.temperature,
        top_p=body.top_p, tool_choice=body.tool_choice or ("auto" if body.tools else "none"),
        tools=body.tools or [], parallel_tool_calls=body.parallel_tool_calls,
        store=body.store, text=body.text)


# ---------------------------------------------------------------------------- outputs
class Assembly:
    """Chat chunks read into output items, with the events that say so (a whole response
    reads the same chunks and drops the events)."""

    def __init__(self, response: ResponseObject, stored: StoredResponse | None) -> None:
        self.response = response
        self.stored = stored
        self.sequence = 0
        self.open: OutputMessage | OutputFunctionCall | None = None
        self.finish: str | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response),
                self._event("response.in_progress", response=self.response)]

    def feed(self, chunk: ChatCompletionChunk) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for choice in chunk.choices:
            self.finish = choice.finish_reason or self.finish
            delta = choice.delta
            if delta.content:
                if not isinstance(self.open, OutputMessage):
                    events += self._close()
                    events += self._add(OutputMessage(f"msg_{uuid.uuid4().hex}", [],
                                                      "in_progress"))
                    events.append(self._event(
                        "response.content_part.added", **self._where(),
                        part=OutputText("")))
                self.open.content[0].text += delta.content
                events.append(self._event("response.output_text.delta", **self._where(),
                                          delta=delta.content))
            for call in delta.tool_calls or []:
                arguments = call.function.arguments if call.function else None
                if call.id is not None:
                    events += self._close()
                    events += self._add(OutputFunctionCall(
                        f"fc_{uuid.uuid4().hex}", call.id, call.function.name or "", "",
                        "in_progress"))
                if arguments:
                    self.open.arguments += arguments
                    events.append(self._event("response.function_call_arguments.delta",
                                              item_id=self.open.id, output_index=self._index(),
                                              delta=arguments))
        return events

    def _index(self) -> int:
        return len(self.response.output) - 1

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open.id, "output_index": self._index(), "content_index": 0}

    def _add(self, item: OutputMessage | OutputFunctionCall) -> list[dict[str, Any]]:
        self.response.output.append(item)
        event = self._event("response.output_item.added", output_index=self._index(),
                            item=msgspec.structs.replace(item))
        if isinstance(item, OutputMessage):
            item.content.append(OutputText(""))
        self.open = item
        return [event]

    def _close(self) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        item.status = "completed"
        index = self.response.output.index(item)
        if isinstance(item, OutputMessage):
            where = {"item_id": item.id, "output_index": index, "content_index": 0}
            text = item.content[0].text
            events = [self._event("response.output_text.done", **where, text=text),
                      self._event("response.content_part.done", **where, part=item.content[0])]
        else:
            events = [self._event("response.function_call_arguments.done", item_id=item.id,
                                  output_index=index, arguments=item.arguments)]
        return events + [self._event("response.output_item.done", output_index=index,
                                     item=item)]

    def end(self, call: Call, status: str | None = None) -> list[dict[str, Any]]:
        """The last events; ``status``: how it ended, if not by itself (cancelled)."""
        events = self._close()
        response = self.response
        choices = call.choices
        prompt, cached = sum(choices.prompt_tokens), sum(choices.cached_tokens)
        response.usage = ResponseUsage(prompt, choices.completion_tokens,
                                       prompt + choices.completion_tokens,
                                       InputTokensDetails(cached))
        if status is not None:
            response.status = status
        elif self.finish == "length":
            response.status = "incomplete"
            response.incomplete_details = IncompleteDetails("max_output_tokens")
        else:
            response.status = "completed"
        return events + [self._event(f"response.{response.status}", response=response)]


def sse(event: dict[str, Any]) -> bytes:
    return (b"event: " + event["type"].encode() + b"\ndata: " + _encoder.encode(event)
            + b"\n\n")


async def run(call: Call, chunks: AsyncIterator[ChatCompletionChunk],
              assembly: Assembly) -> AsyncIterator[dict[str, Any]]:
    """The response's events as the chunks come; a cancel (``stored.cancelled``) stops it
    at the next chunk, and closing the chunks aborts the engine request."""
    async with aclosing(chunks):
        started = False
        async for chunk in chunks:
            if not started:
                started = True
                for event in assembly.start():
                    yield event
            for event in assembly.feed(chunk):
                yield event
            if assembly.stored is not None and assembly.stored.cancelled:
                for event in assembly.end(call, "cancelled"):
                    yield event
                return
    for event in assembly.end(call):
        yield event
