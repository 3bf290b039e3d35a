"""``/openapi.json``: an OpenAPI 3.1 document whose schemas are generated from the same msgspec
Structs that decode the requests and encode the responses, so it cannot drift from them."""

from __future__ import annotations

from typing import Any

import msgspec

from engine.server.anthropic_schemas import (
    AnthropicError,
    CountTokensRequest,
    Message,
    MessagesRequest,
    TokenCount,
)
from engine.server.responses_schemas import ResponseDeleted, ResponseObject, ResponsesRequest
from engine.server.schemas import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DetokenizeBody,
    DetokenizeResponse,
    ErrorResponse,
    GenerateBody,
    GenerateResponse,
    LoadLoraAdapterBody,
    ModelList,
    SessionBody,
    SessionDeleted,
    SessionObject,
    TokenizeBody,
    TokenizeResponse,
    UnloadLoraAdapterBody,
)

_REF = "#/components/schemas/{name}"
_ERRORS = {
    "400": "bad parameters, an unknown field, or a prompt too long for the context",
    "401": "a missing or wrong API key (with --api-key)",
    "404": "an unknown model, session or route",
    "413": "a body over --max-request-bytes",
    "503": "the queue is full, the engine stopped, or the server is shutting down",
}


def _ref(kind: type) -> dict[str, str]:
    return {"$ref": _REF.format(name=kind.__name__)}


def _json(kind: type, stream: type | None = None) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": _ref(kind)}}
    if stream is not None:
        # Each event is "data: <chunk JSON>", the last one "data: [DONE]".
        content["text/event-stream"] = {"schema": _ref(stream)}
    return content


def _operation(summary: str, response: type, body: type | None = None,
               stream: type | None = None, error: type = ErrorResponse) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": summary,
        "responses": {"200": {"description": "OK", "content": _json(response, stream)}} | {
            status: {"description": text, "content": _json(error)}
            for status, text in _ERRORS.items()
        },
    }
    if body is not None:
        op["requestBody"] = {"required": True, "content": _json(body)}
    return op


_response_id = {"parameters": [{"name": "response_id", "in": "path", "required": True,
                                "schema": {"type": "string"}}]}


def openapi_document(model_name: str, lora_updates: bool = False) -> dict[str, Any]:
    """The document; ``lora_updates``: with the LoRA load and unload routes
    (--enable-runtime-lora-updating)."""
    kinds = [CompletionRequest, CompletionResponse, CompletionChunk, ChatCompletionRequest,
             ChatCompletionResponse, ChatCompletionChunk, GenerateBody, GenerateResponse,
             ModelList, SessionBody, SessionObject, SessionDeleted, ErrorResponse,
             LoadLoraAdapterBody, UnloadLoraAdapterBody, TokenizeBody, TokenizeResponse,
             DetokenizeBody, DetokenizeResponse, MessagesRequest, Message, CountTokensRequest,
             TokenCount, AnthropicError, ResponsesRequest, ResponseObject, ResponseDeleted]
    _, components = msgspec.json.schema_components(kinds, ref_template=_REF)
    text = {"200": {"description": "OK", "content": {"text/plain": {"schema": {
        "type": "string"}}}}}
    document = {
        "openapi": "3.1.0",
        "info": {"title": "radixserve", "version": "0.1.0",
                 "description": f"OpenAI-compatible serving of {model_name} with a "
                                "token-granular prefix cache."},
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                           "x-api-key": {"type": "apiKey", "in": "header",
                                                         "name": "x-api-key"}}},
        "security": [{"bearer": []}],
        "paths": {
            "/v1/completions": {"post": _operation(
                "Text completion", CompletionResponse, CompletionRequest, CompletionChunk)},
            "/v1/chat/completions": {"post": _operation(
                "Chat completion (with session_id: one turn of a session)",
                ChatCompletionResponse, ChatCompletionRequest, ChatCompletionChunk)},
            "/generate": {"post": _operation(
                "Native generation: token ids in, token ids out", GenerateResponse,
                GenerateBody, GenerateResponse)},
            "/v1/messages": {"post": _operation(
                "Anthropic's Messages API (a stream is Anthropic's named events)", Message,
                MessagesRequest, error=AnthropicError)
                | {"security": [{"bearer": []}, {"x-api-key": []}]}},
            "/v1/messages/count_tokens": {"post": _operation(
                "Anthropic's: the prompt tokens of a message's body", TokenCount,
                CountTokensRequest, error=AnthropicError)
                | {"security": [{"bearer": []}, {"x-api-key": []}]}},
            "/v1/responses": {"post": _operation(
                "OpenAI's Responses API (stored: a session turn; a stream is its named "
                "events)", ResponseObject, ResponsesRequest)},
            "/v1/responses/{response_id}": {
                "get": {**_operation("A stored response", ResponseObject), **_response_id},
                "delete": {**_operation("Forget a stored response and unpin its KV",
                                        ResponseDeleted), **_response_id}},
            "/v1/responses/{response_id}/cancel": {"post": {**_operation(
                "Stop a stored response still running", ResponseObject), **_response_id}},
            "/tokenize": {"post": _operation(
                "A prompt or chat messages to the token ids a completion or chat request "
                "would run on", TokenizeResponse, TokenizeBody)},
            "/detokenize": {"post": _operation("Token ids to text", DetokenizeResponse,
                                               DetokenizeBody)},
            "/v1/models": {"get": _operation("The served model", ModelList)},
            "/v1/sessions": {"post": _operation(
                "Open a multi-turn chat session", SessionObject, SessionBody)},
            "/v1/sessions/{session_id}": {"delete": {
                **_operation("Close a session", SessionDeleted),
                "parameters": [{"name": "session_id", "in": "path", "required": True,
                                "schema": {"type": "string"}}]}},
            "/health": {"get": {"summary": "200 while the server serves; 503 once an engine "
                                           "process died, a shutdown began or the ZMQ door "
                                           "stopped",
                                "security": [], "responses": {"200": {"description": "OK"}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics (with --metrics-open, no key "
                                            "needed)", "responses": text}},
        },
    }
    if lora_updates:
        for path, summary, body in (
                ("/v1/load_lora_adapter", "Load a LoRA adapter (vLLM's body)",
                 LoadLoraAdapterBody),
                ("/v1/unload_lora_adapter", "Unload a LoRA adapter no request runs under",
                 UnloadLoraAdapterBody)):
            operation = _operation(summary, ErrorResponse, body)
            operation["responses"]["200"] = text["200"]
            document["paths"][path] = {"post": operation}
    return document
