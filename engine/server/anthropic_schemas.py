"""Anthropic's Messages API bodies (``POST /v1/messages``, ``/v1/messages/count_tokens``) as
msgspec Structs, strict like the OpenAI ones (``schemas.py``): an unknown field, a block type
other than ``text``, ``tool_use`` and ``tool_result``, or a wrong type is a 400 naming it.

``cache_control`` is accepted wherever Anthropic takes it and changes nothing: the prefix cache
keeps every prefix without being asked.
"""

from __future__ import annotations

from typing import Any, Literal

from msgspec import Struct

from engine.server.schemas import _Body


class _Block(_Body, tag_field="type"):
    pass


class TextBlock(_Block, tag="text"):
    text: str
    cache_control: dict[str, Any] | None = None


class ToolUseBlock(_Block, tag="tool_use"):
    """A call the assistant made (in an assistant message of the history)."""

    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(_Block, tag="tool_result"):
    """What a call returned (in a user message), answering an earlier ``tool_use`` by id."""

    tool_use_id: str
    content: str | list[TextBlock] = ""
    cache_control: dict[str, Any] | None = None


ContentBlock = TextBlock | ToolUseBlock | ToolResultBlock


class InputMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Body):
    name: str
    input_schema: dict[str, Any]  # a JSON schema of the input object
    description: str | None = None
    cache_control: dict[str, Any] | None = None


class _Choice(_Body, tag_field="type"):
    pass


class ToolChoiceAuto(_Choice, tag="auto"):
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(_Choice, tag="any"):
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(_Choice, tag="tool"):
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(_Choice, tag="none"):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class CountTokensRequest(_Body):
    """``/v1/messages/count_tokens``: what a message's prompt is made of."""

    model: str
    messages: list[InputMessage]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    """``/v1/messages``."""

    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False


# ------------------------------------------------------------------------------ responses
class _Content(Struct, tag_field="type"):
    pass


class TextContent(_Content, tag="text"):
    text: str


class ToolUseContent(_Content, tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(Struct):
    """``input_tokens`` are the prompt tokens the prefix cache did not hold;
    ``cache_read_input_tokens`` those it did (their sum is the prompt)."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class Message(Struct):
    id: str
    model: str
    content: list[TextContent | ToolUseContent]
    stop_reason: str | None  # end_turn, max_tokens, stop_sequence, tool_use
    stop_sequence: str | None
    usage: MessageUsage
    type: str = "message"
    role: str = "assistant"


class TokenCount(Struct):
    input_tokens: int


class AnthropicErrorBody(Struct):
    type: str
    message: str


class AnthropicError(Struct):
    error: AnthropicErrorBody
    type: str = "error"
