"""Request and response bodies of the HTTP (and ZMQ) front doors, as msgspec Structs.

Requests are strict: a field of the wrong type or a field the server does not know is a 400
naming it (``errors.from_validation``), never a silent default. Responses have exactly OpenAI's
shapes: fields that OpenAI sends as ``null`` are ``None`` here, fields it leaves out are
``UNSET`` (e.g. ``usage`` on stream chunks without ``stream_options.include_usage``).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, Struct, UnsetType


class _Body(Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(_Body):
    """Sampling fields shared by completions and chat (OpenAI's plus vLLM-style extras)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # the cache namespace with --salt-from-user; else unused
    cache_salt: str | None = None  # requests with different salts never share cached KV
    response_format: ResponseFormat | None = None
    # vLLM's: exactly one of json (a schema), json_object, regex, choice, grammar
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    """``/v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids or a
    list of token-id lists (checked in ``engine.server.sampling``)."""

    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    return_token_ids: bool = False  # vLLM's: each choice also carries its output token ids


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(_Body):
    """One entry of ``tools`` (engine/server/tools.py reads them)."""

    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call that function."""

    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """``/v1/chat/completions``. With ``session_id``, ``messages`` are the new turn's only."""

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    session_id: str | None = None
    tools: list[ChatTool] | None = None
    # None: "auto" when tools are given, else "none" (OpenAI's defaults)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class GenerateBody(_Body):
    """Native ``/generate``: token ids (or text) in, token ids out; SamplingParams fields."""

    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: dict[str, Any] = {}
    stream: bool = False
    model: str | None = None
    cache_salt: str | None = None


class SessionBody(_Body):
    model: str | None = None


class LoadLoraAdapterBody(_Body):
    """vLLM's ``/v1/load_lora_adapter`` body: a name and a PEFT adapter directory."""

    lora_name: str
    lora_path: str


class UnloadLoraAdapterBody(_Body):
    """vLLM's ``/v1/unload_lora_adapter`` body (``lora_int_id`` is accepted and unused: the
    name says which)."""

    lora_name: str
    lora_int_id: int | None = None


class TokenizeBody(_Body):
    """vLLM's ``/tokenize``: a ``prompt`` (as a completion tokenizes it) or chat ``messages``
    (as a chat completion does). ``add_special_tokens`` defaults to true for a prompt and false
    for messages (their template writes its own); ``add_generation_prompt`` is for messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    return_token_strs: bool = False


class DetokenizeBody(_Body):
    """vLLM's ``/detokenize``: token ids to text."""

    tokens: list[int]
    model: str | None = None


# ------------------------------------------------------------------------------ responses
class _Response(Struct):
    """What every response body and stream chunk starts with (then ``choices``, ``usage``)."""

    id: str
    created: int
    model: str


class PromptTokensDetails(Struct):
    cached_tokens: int = 0
    # radixserve's extension, only from an engine with a host tier (--host-cache-gb) / a disk
    # tier (--disk-cache-dir): of cached_tokens, those loaded from host memory / from disk (the
    # rest were on the device)
    cached_tokens_host: int | UnsetType = UNSET
    cached_tokens_disk: int | UnsetType = UNSET


class Usage(Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = msgspec.field(
        default_factory=PromptTokensDetails)


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: the first prompt token of an echo
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | UnsetType = UNSET  # with return_token_ids: this chunk's (or all) ids


class CompletionResponse(_Response):
    choices: list[CompletionChoice]
    usage: Usage | UnsetType = UNSET
    object: str = "text_completion"


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[TokenLogprob]


class FunctionCall(Struct):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessage(Struct):
    content: str | None  # None when the message holds only tool calls
    role: str = "assistant"
    tool_calls: list[ToolCall] | UnsetType = UNSET


class ChatChoice(Struct):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class FunctionCallDelta(Struct, omit_defaults=True):
    name: str | None = None  # in a call's first delta only
    arguments: str | None = None  # the next piece of the arguments' text


class ToolCallDelta(Struct, omit_defaults=True):
    """A piece of tool call ``index``: its first carries ``id``, ``type`` and the name."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    choices: list[ChatChunkChoice]
    usage: Usage | None | UnsetType = UNSET
    object: str = "chat.completion.chunk"


class CompletionChunk(_Response):
    choices: list[CompletionChoice]
    usage: Usage | None | UnsetType = UNSET
    object: str = "text_completion"


class TopToken(Struct):
    token_id: int
    logprob: float


class GenerateChoice(Struct):
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    # With sampling_params.logprobs = N > 0: each token's N most likely alternatives.
    top_logprobs: list[list[TopToken]] | None = None
    # With sampling_params.prompt_logprobs: each prompt token's logprob (None for the first)
    # and, for N > 0, its N most likely alternatives
    prompt_logprobs: list[float | None] | UnsetType = UNSET
    prompt_top_logprobs: list[list[TopToken]] | UnsetType = UNSET


class GenerateResponse(_Response):
    """``/generate``'s body, and (with deltas in ``choices``) each of its stream chunks."""

    choices: list[GenerateChoice]
    usage: Usage | None | UnsetType = UNSET
    object: str = "generate"


class ModelCard(Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "radixserve"
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field); None for the base


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class SessionObject(Struct):
    id: str
    created: int
    ttl: float
    object: str = "session"


class SessionDeleted(Struct):
    id: str
    deleted: bool = True
    object: str = "session"


class TokenizeResponse(Struct):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None  # with return_token_strs: each token's vocabulary entry


class DetokenizeResponse(Struct):
    prompt: str


class ErrorBody(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct):
    error: ErrorBody

