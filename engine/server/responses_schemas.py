"""OpenAI's Responses API bodies (``/v1/responses``) as msgspec Structs, strict like the chat
ones (``schemas.py``). ``input`` items are read one by one (``responses.py``), so a bad item is
a 400 naming ``input[i]``."""

from __future__ import annotations

from typing import Any, Literal

from msgspec import Struct, field

from engine.server.schemas import ErrorBody, _Body


class FunctionTool(_Body):
    type: Literal["function"]
    name: str
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    description: str | None = None
    strict: bool | None = None


class FunctionChoice(_Body):
    """``tool_choice: {"type": "function", "name": ...}``: call that function."""

    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False


# ---------------------------------------------------------------------------- input items
class ContentPart(_Body):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None


class MessageItem(_Body):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Body):
    """A call the model made (an earlier response's output item, sent back)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


# ------------------------------------------------------------------------------ responses
class OutputText(Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []


class OutputMessage(Struct, tag_field="type", tag="message"):
    id: str
    content: list[OutputText]
    status: str = "completed"
    role: str = "assistant"


class OutputFunctionCall(Struct, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str  # a JSON object, as text
    status: str = "completed"


class InputTokensDetails(Struct):
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0


class ResponseUsage(Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails = field(default_factory=OutputTokensDetails)


class IncompleteDetails(Struct):
    reason: str  # max_output_tokens


class ResponseObject(Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: str  # in_progress, completed, incomplete, cancelled, failed
    output: list[OutputMessage | OutputFunctionCall]
    usage: ResponseUsage | None = None
    previous_response_id: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Any = "auto"
    tools: list[FunctionTool] = []
    parallel_tool_calls: bool = True
    store: bool = True
    text: TextConfig | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ErrorBody | None = None
    metadata: dict[str, str] = {}
    object: str = "response"


class ResponseDeleted(Struct):
    id: str
    deleted: bool = True
    object: str = "response"
