"""OpenAI tool calls on ``/v1/chat/completions``: what ``tools`` and ``tool_choice`` ask of a
request, and how the text it generates becomes ``tool_calls``.

    tool_choice          generation                                  the text becomes
    "none", no tools     plain                                       content
    {"function": NAME}   constrained to NAME's parameters schema     one call's arguments
    "required"           constrained to [{"name", "parameters"}, ..] one call per element
    "auto" (the default  plain; needs --tool-call-parser hermes      <tool_call>{...}</tool_call>
    with tools)                                                      blocks → calls, rest content

``tools`` reach the chat template in every case, "none" included (vLLM's default). A reader per
choice turns text into calls as it arrives, so a stream and a whole response are the same
reading: ``feed`` each text delta, then ``finish``; each returns a ``Piece`` (new content, new
call deltas) that becomes one ``ChatDelta``. A choice that made calls and stopped by itself
ends with ``finish_reason: "tool_calls"``; one cut by ``max_tokens`` keeps ``"length"``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.contracts.structured import StructuredOutputs
from engine.server.errors import APIError
from engine.server.schemas import (
    ChatCompletionRequest,
    ChatDelta,
    ChatMessage,
    FunctionCall,
    FunctionCallDelta,
    NamedToolChoice,
    ToolCall,
    ToolCallDelta,
)

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function names
# A function without parameters takes an empty object (OpenAI: "an empty parameter list").
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                  "additionalProperties": False}
START, END = "<tool_call>", "</tool_call>"
Mode = Literal["named", "required", "hermes"]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Piece:
    """What one reading step adds to a choice: content text and tool call deltas."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def delta(self) -> ChatDelta | None:
        if not self.content and not self.calls:
            return None
        return ChatDelta(content=self.content or None, tool_calls=self.calls or None)


@dataclass(frozen=True)
class ToolPlan:
    """How a request's output is read into tool calls (None for plain chat)."""

    mode: Mode
    parameters: dict[str, dict[str, Any]]  # each tool's arguments schema, by name
    name: str | None = None  # the function a named tool_choice calls
    parallel: bool = True  # parallel_tool_calls

    @property
    def constraint(self) -> StructuredOutputs | None:
        """The grammar that makes the output readable (none for hermes: it reads free text)."""
        if self.mode == "named":
            return StructuredOutputs(json=json.dumps(self.parameters[self.name]))
        if self.mode == "hermes":
            return None
        calls = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [name]},
                                 "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in self.parameters.items()]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputs(json=json.dumps(array))

    def reader(self) -> NamedReader | ArrayReader | HermesReader:
        """A fresh reader for one choice."""
        if self.mode == "named":
            return NamedReader(self.name)
        if self.mode == "required":
            return ArrayReader(set(self.parameters))
        return HermesReader(set(self.parameters), self.parallel)

    def message(self, text: str, finish_reason: str | None) -> tuple[ChatMessage, str | None]:
        """A whole choice's message and finish reason, read the way a stream reads it."""
        reader = self.reader()
        first, last = reader.feed(text), reader.finish()
        content = first.content + last.content
        if not reader.calls:
            return ChatMessage(content), finish_reason
        return (ChatMessage(content or None, tool_calls=list(reader.calls)),
                finish_with_calls(reader, finish_reason))


def finish_with_calls(reader: NamedReader | ArrayReader | HermesReader,
                      finish_reason: str | None) -> str | None:
    return "tool_calls" if reader.calls and finish_reason == "stop" else finish_reason


class ToolStreams:
    """The readers of one streamed call's choices, each turning text deltas into ChatDeltas."""

    def __init__(self, plan: ToolPlan, num_choices: int) -> None:
        self.readers = [plan.reader() for _ in range(num_choices)]

    def delta(self, index: int, text: str, final: bool) -> ChatDelta | None:
        reader = self.readers[index]
        piece = reader.feed(text)
        if final:
            last = reader.finish()
            piece = Piece(piece.content + last.content, piece.calls + last.calls)
        return piece.delta()

    def finish_reason(self, index: int, finish_reason: str) -> str | None:
        return finish_with_calls(self.readers[index], finish_reason)


# ---------------------------------------------------------------------------- requests
def resolve(req: ChatCompletionRequest,
            parser: str | None) -> tuple[list[dict[str, Any]] | None, ToolPlan | None]:
    """The tools for the chat template and the plan for the output, or a 400 naming the field.

    ``parser`` is the server's --tool-call-parser, which ``tool_choice: "auto"`` needs."""
    tools = req.tools
    choice = req.tool_choice
    if tools is None:
        if choice is not None and choice != "none":
            raise APIError(400, "tool_choice needs tools: give the functions the model may "
                           "call in tools", param="tool_choice")
        return None, None
    if not tools:
        raise APIError(400, "tools must hold at least one tool; leave it out for none",
                       param="tools")
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"at most {MAX_TOOLS} tools are allowed, got {len(tools):,}",
                       param="tools")
    parameters: dict[str, dict[str, Any]] = {}
    for index, tool in enumerate(tools):
        name = tool.function.name
        where = f"tools[{index}].function.name"
        if not _NAME.fullmatch(name):
            raise APIError(400, f"{where} must be 1 to 64 letters, digits, underscores or "
                           f"dashes, got {name[:80]!r}", param=where)
        if name in parameters:
            raise APIError(400, f"{where} repeats the name {name!r}; each tool needs its own",
                           param=where)
        schema = tool.function.parameters
        parameters[name] = _NO_PARAMETERS if schema is None else schema
    template_tools = [{"type": "function", "function": {
        k: v for k, v in (("name", t.function.name), ("description", t.function.description),
                          ("parameters", t.function.parameters), ("strict", t.function.strict))
        if v is not None}} for t in tools]
    if choice is None:
        choice = "auto"
    if choice == "none":
        return template_tools, None
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in parameters:
            raise APIError(400, f"tool_choice names the function {choice.function.name[:80]!r}, "
                           f"which is not in tools ({', '.join(parameters)})",
                           param="tool_choice.function.name")
        plan = ToolPlan("named", parameters, choice.function.name, req.parallel_tool_calls)
    elif choice == "required":
        plan = ToolPlan("required", parameters, parallel=req.parallel_tool_calls)
    elif parser is None:
        raise APIError(400, '"auto" tool choice requires --tool-call-parser to be set: start the '
                       'server with --tool-call-parser hermes, or send tool_choice "none", '
                       '"required" or a named function', param="tool_choice")
    else:
        plan = ToolPlan("hermes", parameters, parallel=req.parallel_tool_calls)
    if plan.constraint is not None and (
            req.structured_outputs is not None
            or (req.response_format is not None and req.response_format.type != "text")):
        field_name = "structured_outputs" if req.structured_outputs is not None \
            else "response_format"
        raise APIError(400, f"tool_choice {plan.mode!r} constrains the output to tool calls "
                       f"itself; leave out {field_name} or use tool_choice \"auto\" or \"none\"",
                       param=field_name)
    if req.use_beam_search:
        raise APIError(400, "beam search cannot be combined with tool calls", param="tools")
    return template_tools, plan


# ----------------------------------------------------------------------------- readers
class NamedReader:
    """``tool_choice`` named: the whole output is the arguments of one call, streamed as is."""

    def __init__(self, name: str | None) -> None:
        self.name = name or ""
        self.id = new_call_id()
        self.arguments: str | None = None  # None until the call's first delta went out

    @property
    def calls(self) -> list[ToolCall]:
        if self.arguments is None:
            return []
        return [ToolCall(self.id, FunctionCall(self.name, self.arguments))]

    def feed(self, text: str) -> Piece:
        if not text:
            return Piece()
        if self.arguments is None:
            self.arguments = text
            return Piece(calls=[ToolCallDelta(0, self.id, "function",
                                              FunctionCallDelta(self.name, text))])
        self.arguments += text
        return Piece(calls=[ToolCallDelta(0, function=FunctionCallDelta(arguments=text))])

    def finish(self) -> Piece:
        if self.arguments is not None:
            return Piece()
        self.arguments = ""  # no text at all: the call still names its function
        return Piece(calls=[ToolCallDelta(0, self.id, "function",
                                          FunctionCallDelta(self.name, ""))])


class ArrayReader:
    """``tool_choice: "required"``: a JSON array of ``{"name", "parameters"}`` objects; each
    element becomes a call (name and arguments in one delta) once it parses."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.text = ""
        self.position = 0  # where the next element (or the array's start) begins
        self.calls: list[ToolCall] = []
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> Piece:
        self.text += text
        if "}" not in text:  # an element ends with "}", so nothing new can parse
            return Piece()
        deltas = []
        while True:
            start = self._skip(self.position)
            try:
                element, end = self._decoder.raw_decode(self.text, start)
            except json.JSONDecodeError:
                break
            call = self._call(element)
            if call is None:
                break
            self.position = end
            deltas.append(ToolCallDelta(len(self.calls), call.id, "function",
                                        FunctionCallDelta(call.function.name,
                                                          call.function.arguments)))
            self.calls.append(call)
        return Piece(calls=deltas)

    def finish(self) -> Piece:
        # Nothing parsed (cut by max_tokens inside the first call): the text is all there is.
        return Piece() if self.calls else Piece(content=self.text)

    def _skip(self, position: int) -> int:
        """Past the array's "[" or the "," between elements, and any whitespace."""
        while position < len(self.text) and self.text[position] in " \t\r\n[,":
            position += 1
        return position

    def _call(self, element: Any) -> ToolCall | None:
        if not (isinstance(element, dict) and element.get("name") in self.names
                and isinstance(element.get("parameters"), dict)):
            return None
        return ToolCall(new_call_id(), FunctionCall(
            element["name"], json.dumps(element["parameters"], ensure_ascii=False)))


class HermesReader:
    """``--tool-call-parser hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    blocks in free text (Hermes, Qwen 2.5 and later).

    A block naming one of the tools, with an object (or no) ``arguments``, is a call; any other
    block, and one never closed, stays in the content as written. Whitespace before a call, and
    after the last one, is dropped; text after a call keeps the whitespace before it when text
    came before the call too ("A <call> B" reads "A B"). Content streams as it comes, except
    what could still turn out to be a block (trailing whitespace, a partial ``<tool_call>``); a
    call goes out whole when its block closes. With ``parallel_tool_calls: false`` only the
    first block is a call."""

    def __init__(self, names: set[str], parallel: bool) -> None:
        self.names = names
        self.parallel = parallel
        self.pending = ""  # text read and not yet given out
        self.in_block = False
        self.after_call = False  # whitespace right after a call is dropped
        self.space_before = ""  # whitespace before the open block, dropped if it is a call
        self.wrote = False  # some content has been given out
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> Piece:
        self.pending += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if self.in_block:
                end = self.pending.find(END)
                if end < 0:
                    break
                body, self.pending = self.pending[:end], self.pending[end + len(END):]
                self.in_block = False
                call = self._call(body)
                if call is None:
                    content.append(self.space_before + START + body + END)
                else:
                    deltas.append(ToolCallDelta(len(self.calls), call.id, "function",
                                                FunctionCallDelta(call.function.name,
                                                                  call.function.arguments)))
                    self.calls.append(call)
                self.after_call = call is not None
                self.space_before = ""
                continue
            if self.after_call:
                text = self.pending.lstrip()
                if not text:
                    break  # only whitespace so far: what follows decides
                space = self.pending[:len(self.pending) - len(text)]
                self.pending = space + text if self.wrote or any(content) else text
                self.after_call = False
            start = self.pending.find(START)
            if start >= 0:
                before = self.pending[:start]
                kept = before.rstrip()
                content.append(kept)
                self.space_before = before[len(kept):]
                self.pending = self.pending[start + len(START):]
                self.in_block = True
                continue
            sure = len(self.pending) - _partial_tag(self.pending, START)
            kept = self.pending[:sure].rstrip()
            content.append(kept)
            self.pending = self.pending[len(kept):]
            break
        text = "".join(content)
        self.wrote = self.wrote or bool(text)
        return Piece(text, deltas)

    def finish(self) -> Piece:
        if self.in_block:  # never closed (cut by max_tokens, or a stop): stays text
            rest = self.space_before + START + self.pending
        else:
            rest = "" if self.after_call else self.pending
        self.pending = self.space_before = ""
        self.in_block = self.after_call = False
        return Piece(rest)

    def _call(self, body: str) -> ToolCall | None:
        if self.calls and not self.parallel:
            return None
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.names:
            return None
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some models write the object as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ToolCall(new_call_id(), FunctionCall(value["name"],
                                                    json.dumps(arguments, ensure_ascii=False)))


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ``text`` ends with."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
