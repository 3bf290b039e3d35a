"""The HTTP front door: starlette routes over the ``Service``.

    POST /v1/completions  /v1/chat/completions  /generate   (SSE with "stream": true)
    GET  /v1/models  /health  /metrics  /openapi.json
    POST /v1/sessions   DELETE /v1/sessions/{id}
    POST /v1/messages  /v1/messages/count_tokens   (Anthropic's: x-api-key, its error body)
    POST /v1/responses   GET|DELETE /v1/responses/{id}   POST /v1/responses/{id}/cancel
    POST /tokenize  /detokenize   (vLLM's: a prompt or messages to ids, ids to text)
    POST /v1/load_lora_adapter  /v1/unload_lora_adapter   (--enable-runtime-lora-updating)

Every route checks the API key (except ``/health``, ``/openapi.json`` and, with
``metrics_open``, ``/metrics``), reads
the body up to ``max_request_bytes`` (413 past it) and decodes it strictly (400 naming the
field). A client that goes away, mid-stream or while waiting for a whole response, cancels its
engine requests (they are aborted and their pages freed within one scheduler step).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from engine.server import anthropic
from engine.server.anthropic_schemas import CountTokensRequest, MessagesRequest
from engine.server.errors import APIError
from engine.server.openapi import openapi_document
from engine.server.pipeline import Pipeline
from engine.server.responses_schemas import ResponsesRequest
from engine.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeBody,
    GenerateBody,
    LoadLoraAdapterBody,
    SessionBody,
    TokenizeBody,
    UnloadLoraAdapterBody,
)
from engine.server.service import Service

logger = logging.getLogger("radixserve.server")

T = TypeVar("T")
BODY_IDLE_TIMEOUT = 5.0  # seconds a request body may pause before the request gets 408
OPEN_PATHS = frozenset({"/health", "/openapi.json"})
ENDPOINTS = {CompletionRequest: "completions", ChatCompletionRequest: "chat",
             GenerateBody: "generate"}  # a body's schema -> its endpoint label in /metrics
_encoder = msgspec.json.Encoder()


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


def json_response(body: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(body), status, media_type="application/json")


def error_response(exc: APIError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return Response(_encoder.encode(exc.body()), exc.status, headers=headers,
                    media_type="application/json")


@dataclass(frozen=True)
class Door:
    """What differs between the HTTP APIs: how a request carries the key, and the error body."""

    key: Callable[[Headers], str | None]
    how: str  # the 401's advice
    error: Callable[[APIError], Response]


OPENAI = Door(lambda headers: Pipeline.bearer(headers.get("authorization")),
              "send 'Authorization: Bearer <key>'", error_response)
ANTHROPIC = Door(lambda headers: Pipeline.anthropic_key(headers.get("x-api-key"),
                                                        headers.get("authorization")),
                 "send 'x-api-key: <key>' (or 'Authorization: Bearer <key>')",
                 lambda exc: json_response(anthropic.error_body(exc), exc.status))


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """``work``'s result, or ClientGone (with ``work`` cancelled) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()


class EventStream(StreamingResponse):
    """Server-sent events from an async iterator of ready lines; on a disconnect the iterator is
    closed at once (not at its next send), which aborts the engine requests under it."""

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"cache-control": "no-cache"})
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200,
                        "headers": self.raw_headers})
            async for data in self.events:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await unless_disconnected(receive, pump())
        except (ClientGone, OSError):
            pass
        finally:
            await self.events.aclose()


def _event(body: Any) -> bytes:
    return b"data: " + _encoder.encode(body) + b"\n\n"


async def _sse(first: Any, chunks: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    async with aclosing(chunks):
        yield _event(first)
        try:
            async for chunk in chunks:
                yield _event(chunk)
        except APIError as exc:
            yield _event(exc.body())
        except Exception:
            logger.exception("a stream failed")
            yield _event(APIError(500, "the server failed while streaming; see its log").body())
        yield b"data: [DONE]\n\n"


async def _framed(first: bytes, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Events an API frames itself, errors included (Anthropic's), the first one read."""
    async with aclosing(events):
        yield first
        async for data in events:
            yield data


async def stream_response(request: Request, chunks: AsyncIterator[Any],
                          frame: Callable[[Any, AsyncIterator[Any]], AsyncIterator[bytes]] = _sse
                          ) -> Response:
    """Wait for the first chunk (so an engine refusal is still a plain error response), then
    stream it and the rest as server-sent events (``frame``: OpenAI's ``data:`` lines)."""
    try:
        first = await unless_disconnected(request.receive, anext(chunks, None))
    except BaseException:
        await chunks.aclose()
        raise
    if first is None:  # every stream yields at least its final chunk; this guards the shape
        raise APIError(500, "the request produced no output")
    return EventStream(frame(first, chunks))


def build_app(service: Service) -> Starlette:
    """The routes, each through the door pipeline (engine/server/pipeline.py)."""
    pipeline = Pipeline(service)
    metrics = service.metrics
    # Metrics tell who is busy and how well prefixes hit: behind the key unless asked otherwise.
    open_paths = (OPEN_PATHS | {"/metrics"}) if service.options.metrics_open else OPEN_PATHS

    def route(path: str, endpoint: str, handler: Callable[[Request], Awaitable[Response]],
              methods: list[str], door: Door = OPENAI) -> Route:
        async def wrapped(request: Request) -> Response:
            try:
                if path not in open_paths:
                    with pipeline.counted(endpoint):
                        pipeline.authorize(door.key(request.headers), door.how)
                return await handler(request)
            except APIError as exc:
                return door.error(exc)
            except ClientGone:
                return Response(status_code=499)
            except Exception:
                return door.error(pipeline.failed(endpoint, f"{request.method} {path}"))

        return Route(path, wrapped, methods=methods)

    async def generation(request: Request, schema: type) -> Response:
        with pipeline.counted(ENDPOINTS[schema]):
            body = await read_body(request, pipeline, schema)
        opened = pipeline.open(body)
        if opened.streaming:
            return await stream_response(request, opened.stream())
        return json_response(await unless_disconnected(request.receive, opened.whole()))

    async def messages(request: Request) -> Response:
        with pipeline.counted("messages"):
            body = await read_body(request, pipeline, MessagesRequest)
        opened = pipeline.open_messages(body)
        if opened.streaming:
            return await stream_response(request, opened.stream(), _framed)
        return json_response(await unless_disconnected(request.receive, opened.whole()))

    async def count_tokens(request: Request) -> Response:
        with pipeline.counted("messages"):
            body = await read_body(request, pipeline, CountTokensRequest)
        return json_response(await pipeline.count_message_tokens(body))

    async def create_response(request: Request) -> Response:
        with pipeline.counted("responses"):
            body = await read_body(request, pipeline, ResponsesRequest)
        opened = await pipeline.open_response(body, OPENAI.key(request.headers))
        if opened.streaming:
            return await stream_response(request, opened.stream(), _framed)
        return json_response(await unless_disconnected(request.receive, opened.whole()))

    async def stored_response(request: Request) -> Response:
        response_id, key = request.path_params["response_id"], OPENAI.key(request.headers)
        if request.method == "DELETE":
            return json_response(await pipeline.delete_response(response_id, key))
        return json_response(pipeline.get_response(response_id, key))

    async def cancel_response(request: Request) -> Response:
        return json_response(pipeline.cancel_response(request.path_params["response_id"],
                                                      OPENAI.key(request.headers)))

    async def open_session(request: Request) -> Response:
        with pipeline.counted("sessions"):
            body = await read_body(request, pipeline, SessionBody, empty_ok=True)
        return json_response(await pipeline.open_session(body.model))

    async def close_session(request: Request) -> Response:
        return json_response(await pipeline.close_session(request.path_params["session_id"]))

    async def tokenize(request: Request) -> Response:
        with pipeline.counted("tokenize"):
            body = await read_body(request, pipeline, TokenizeBody)
        return json_response(await pipeline.tokenize(body))

    async def detokenize(request: Request) -> Response:
        with pipeline.counted("detokenize"):
            body = await read_body(request, pipeline, DetokenizeBody)
        return json_response(await pipeline.detokenize(body))

    async def models(request: Request) -> Response:
        return json_response(service.models())

    async def update_lora(request: Request, schema: type) -> Response:
        with pipeline.counted("lora_adapters"):
            body = await read_body(request, pipeline, schema)
            text = await service.update_lora(body)
        return Response(text, media_type="text/plain; charset=utf-8")

    async def health(request: Request) -> Response:
        problem = service.unhealthy()
        if problem is not None:
            raise APIError(503, problem)
        return json_response({"status": "ok"})

    async def metrics_page(request: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    document = _encoder.encode(openapi_document(
        service.model_name, service.options.enable_runtime_lora_updating))

    async def openapi(request: Request) -> Response:
        return Response(document, media_type="application/json")

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        message = (f"{request.method} {request.url.path} is not a route of this server"
                   if status in (404, 405) else str(getattr(exc, "detail", "bad request")))
        metrics.requests.labels("unknown", str(status)).inc()
        return error_response(APIError(status, message))

    routes = [
        route("/v1/completions", "completions",
              lambda r: generation(r, CompletionRequest), ["POST"]),
        route("/v1/chat/completions", "chat", lambda r: generation(r, ChatCompletionRequest),
              ["POST"]),
        route("/generate", "generate", lambda r: generation(r, GenerateBody), ["POST"]),
        route("/v1/messages", "messages", messages, ["POST"], ANTHROPIC),
        route("/v1/messages/count_tokens", "messages", count_tokens, ["POST"], ANTHROPIC),
        route("/v1/responses", "responses", create_response, ["POST"]),
        route("/v1/responses/{response_id}", "responses", stored_response, ["GET", "DELETE"]),
        route("/v1/responses/{response_id}/cancel", "responses", cancel_response, ["POST"]),
        route("/tokenize", "tokenize", tokenize, ["POST"]),
        route("/detokenize", "detokenize", detokenize, ["POST"]),
        route("/v1/models", "models", models, ["GET"]),
        route("/v1/sessions", "sessions", open_session, ["POST"]),
        route("/v1/sessions/{session_id}", "sessions", close_session, ["DELETE"]),
        route("/health", "health", health, ["GET"]),
        route("/metrics", "metrics", metrics_page, ["GET"]),
        route("/openapi.json", "openapi", openapi, ["GET"]),
    ]
    if service.options.enable_runtime_lora_updating:
        routes += [
            route("/v1/load_lora_adapter", "lora_adapters",
                  lambda r: update_lora(r, LoadLoraAdapterBody), ["POST"]),
            route("/v1/unload_lora_adapter", "lora_adapters",
                  lambda r: update_lora(r, UnloadLoraAdapterBody), ["POST"]),
        ]
    return Starlette(routes=routes, exception_handlers={HTTPException: not_found})


async def read_body(request: Request, pipeline: Pipeline, schema: type[T], *,
                    empty_ok: bool = False) -> T:
    """The body, read up to the size limit (413 past it, 408 if it stops arriving), decoded
    strictly into ``schema`` (400 naming the field)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit():
        pipeline.check_size(int(length))
    chunks, size = [], 0
    stream = request.stream()
    while True:
        try:
            # A body shorter than its Content-Length would otherwise hold the connection for
            # as long as the client likes: uvicorn times out idle connections only between
            # requests.
            chunk = await asyncio.wait_for(anext(stream, None), BODY_IDLE_TIMEOUT)
        except TimeoutError:
            raise APIError(408, f"the request body stopped arriving (nothing for "
                           f"{BODY_IDLE_TIMEOUT:g} seconds); is Content-Length larger than "
                           "the body?") from None
        if chunk is None:
            break
        size += len(chunk)
        pipeline.check_size(size)
        chunks.append(chunk)
    body = b"".join(chunks)
    if empty_ok and not body.strip():
        body = b"{}"
    return pipeline.decode(lambda data: msgspec.json.decode(data, type=schema), body)
