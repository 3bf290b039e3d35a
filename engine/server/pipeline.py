"""What every front door does with a call, written once: HTTP (app.py), ZMQ (zmq_frontend.py)
and gRPC (grpc_frontend.py) keep only their transport and hand each call through here.

    door: bytes / frames / RPC ─▶ authorize ─▶ decode ─▶ open (Service: validate, limits,
                                  (401)         (400)     engine requests) ─▶ chunks / whole
                                                          errors before the engine are counted
    anything unexpected ─▶ failed(): logged with its traceback, a 500 that says "see its log"

The doors differ only in how they carry the key (an ``Authorization: Bearer`` header, the ZMQ
call's ``api_key`` field, gRPC ``authorization: Bearer`` metadata) and the body (JSON, msgpack,
protobuf); the rule and the answer are the same.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from engine.server import anthropic, responses
from engine.server.anthropic_schemas import CountTokensRequest, MessagesRequest, TokenCount
from engine.server.errors import APIError, from_validation
from engine.server.response_store import StoredResponse, owner_of
from engine.server.responses_schemas import (
    OutputFunctionCall,
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
)
from engine.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeBody,
    DetokenizeResponse,
    GenerateBody,
    SessionDeleted,
    SessionObject,
    TokenizeBody,
    TokenizeResponse,
)
from engine.server.service import Service

logger = logging.getLogger("radixserve.server")

T = TypeVar("T")
DOOR_STOP_GRACE = 2.0  # seconds a door's running calls get when the server stops
KEY_REQUIRED = "a valid API key is required"


@dataclass
class Opened:
    """A call the engine accepted: its chunks as a stream, or its whole response."""

    stream: Callable[[], AsyncIterator[Any]]
    whole: Callable[[], Awaitable[Any]]
    streaming: bool  # the body asked for a stream (HTTP; the other doors always stream)


class Pipeline:
    def __init__(self, service: Service) -> None:
        self.service = service
        self.api_key = service.options.api_key
        self.max_request_bytes = service.options.max_request_bytes

    # ------------------------------------------------------------------ auth
    def authorize(self, key: str | None, how: str) -> None:
        """401 unless ``key`` is the server's API key (any key passes on a server without
        one); ``how`` tells the client how this door carries it."""
        if self.api_key is None:
            return
        if key is None or not hmac.compare_digest(key.encode(), self.api_key.encode()):
            raise APIError(401, f"{KEY_REQUIRED}: {how}")

    @staticmethod
    def bearer(header: str | None) -> str | None:
        """The key of an ``Authorization: Bearer KEY`` value (HTTP header, gRPC metadata)."""
        scheme, _, token = (header or "").partition(" ")
        return token.strip() if scheme.lower() == "bearer" else None

    @staticmethod
    def anthropic_key(x_api_key: str | None, authorization: str | None) -> str | None:
        """Anthropic's door: the key as ``x-api-key`` (its SDK's), else as a bearer token."""
        return x_api_key if x_api_key is not None else Pipeline.bearer(authorization)

    # ---------------------------------------------------------------- bodies
    def check_size(self, size: int) -> None:
        if size > self.max_request_bytes:
            raise APIError(413, f"the request body has {size:,} bytes, over the limit of "
                           f"{self.max_request_bytes:,} bytes")

    @staticmethod
    def decode(decode: Callable[[bytes], T], data: bytes, what: str = "") -> T:
        """``decode(data)``, its failures as 400s: a body that does not fit its schema names the
        field; ``what`` prefixes a message that is about the whole message, not a field."""
        try:
            return decode(data)
        except msgspec.MsgspecError as exc:
            raise (APIError(400, f"{what}{exc}") if what else from_validation(exc)) from None
        except RecursionError:
            # msgspec stops at the interpreter's recursion limit (about 1,000 levels).
            raise APIError(400, "the request body is nested too deeply to decode (arrays or "
                           "objects in each other)") from None

    # ----------------------------------------------------------------- calls
    @contextmanager
    def counted(self, endpoint: str) -> Iterator[None]:
        """Count an APIError raised before a request reaches the engine (later ones are
        counted by the request's timer)."""
        try:
            yield
        except APIError as exc:
            self.service.metrics.requests.labels(endpoint, str(exc.status)).inc()
            raise

    def open(self, body: CompletionRequest | ChatCompletionRequest | GenerateBody) -> Opened:
        """Validate a generation call and admit its engine requests."""
        service = self.service
        if isinstance(body, CompletionRequest):
            with self.counted("completions"):
                call = service.completion_call(body)
            top, usage = bool(body.logprobs), _include_usage(body)
            return Opened(lambda: service.completion_stream(call, usage, top),
                          lambda: service.completion(call, top), body.stream)
        if isinstance(body, ChatCompletionRequest):
            with self.counted("chat"):
                call = service.chat_call(body)
            usage = _include_usage(body)
            return Opened(lambda: service.chat_stream(call, usage),
                          lambda: service.chat(call), body.stream)
        with self.counted("generate"):
            call = service.generate_call(body)
        return Opened(lambda: service.generate_stream(call), lambda: service.generate(call),
                      body.stream)

    def open_messages(self, body: MessagesRequest) -> Opened:
        """Anthropic's Messages API: the chat call it means, answered in its shapes."""
        service = self.service
        with self.counted("messages"):
            try:
                call = service.chat_call(anthropic.to_chat(body), "messages", "msg")
            except APIError as exc:
                raise anthropic.renamed(exc) from None

        async def whole() -> Any:
            response = await service.chat(call)
            choice = response.choices[0]
            return anthropic.message(call, choice.message, choice.finish_reason)

        return Opened(lambda: anthropic.events(call, service.chat_stream(call, True)), whole,
                      body.stream)

    async def count_message_tokens(self, body: CountTokensRequest) -> TokenCount:
        with self.counted("messages"):
            try:
                count = await self.service.count_chat_tokens(anthropic.count_request(body))
            except APIError as exc:
                raise anthropic.renamed(exc) from None
        return TokenCount(count)

    async def open_response(self, body: ResponsesRequest, key: str | None) -> Opened:
        """OpenAI's Responses API: the chat call it means, as a turn of a session forked from
        the previous response's when it continues one, of a new session when it is stored."""
        service, store, owner = self.service, self.service.stored, owner_of(key)
        with self.counted("responses"):
            previous = None if body.previous_response_id is None else store.get(
                body.previous_response_id, owner, "previous_response_id")
            if previous is not None and previous.response.status not in ("completed",
                                                                           "incomplete"):
                raise APIError(400, f"response {body.previous_response_id!r} is "
                               f"{previous.response.status}; only a finished response can be "
                               "continued", param="previous_response_id")
            earlier = set() if previous is None else {
                item.call_id for item in previous.response.output
                if isinstance(item, OutputFunctionCall)}
            messages = responses.input_messages(body, earlier)
            session_id = None
            if body.store or previous is not None:
                service.check_model(body.model)
                session_id = (await service.open_session(
                    previous.session_id if previous is not None else None)).id
            try:
                call = service.chat_call(responses.to_chat(body, messages, session_id),
                                         "responses", "resp")
            except APIError as exc:
                if session_id is not None:
                    await service.close_session(session_id)
                raise responses.renamed(exc) from None
        response = responses.new_response(body, call.model, call.created,
                                          call.id.replace("-", "_", 1))
        stored = None
        if body.store:
            stored = StoredResponse(response, owner, session_id or "")
            store.put(stored)
        assembly = responses.Assembly(response, stored)

        async def events() -> AsyncIterator[dict[str, Any]]:
            run = responses.run(call, service.chat_stream(call, False), assembly)
            try:
                async with aclosing(run):
                    async for event in run:
                        yield event
            finally:
                if response.status == "in_progress":
                    response.status = "failed"
                if not body.store and session_id is not None:
                    await service.close_session(session_id)

        async def stream() -> AsyncIterator[bytes]:
            started = False
            try:
                async for event in events():
                    started = True
                    yield responses.sse(event)
            except APIError as exc:
                if not started:
                    raise
                error = exc.body().error
                yield responses.sse({"type": "error", "code": error.code, "message":
                                     error.message, "param": error.param,
                                     "sequence_number": assembly.sequence})

        async def whole() -> ResponseObject:
            async for _ in events():
                pass
            return response

        return Opened(stream, whole, body.stream)

    def get_response(self, response_id: str, key: str | None) -> ResponseObject:
        with self.counted("responses"):
            return self.service.stored.get(response_id, owner_of(key)).response

    async def delete_response(self, response_id: str, key: str | None) -> ResponseDeleted:
        """Forget a stored response and unpin its KV (one still running stops first)."""
        with self.counted("responses"):
            stored = self.service.stored.get(response_id, owner_of(key))
            stored.cancelled = True
            self.service.stored.remove(response_id)
            if stored.session_id in self.service.sessions.sessions:
                await self.service.close_session(stored.session_id)
            return ResponseDeleted(response_id)

    def cancel_response(self, response_id: str, key: str | None) -> ResponseObject:
        """Stop a stored response still running (at its next output); a finished one is
        answered as it is."""
        with self.counted("responses"):
            stored = self.service.stored.get(response_id, owner_of(key))
            if stored.response.status == "in_progress":
                stored.cancelled = True
                stored.response.status = "cancelled"
            return stored.response

    async def open_session(self, model: str | None = None) -> SessionObject:
        with self.counted("sessions"):
            self.service.check_model(model)
            return await self.service.open_session()

    async def close_session(self, session_id: str) -> SessionDeleted:
        with self.counted("sessions"):
            return await self.service.close_session(session_id)

    async def tokenize(self, body: TokenizeBody) -> TokenizeResponse:
        with self.counted("tokenize"):
            return await self.service.tokenize(body)

    async def detokenize(self, body: DetokenizeBody) -> DetokenizeResponse:
        with self.counted("detokenize"):
            return await self.service.detokenize(body)

    # ---------------------------------------------------------------- errors
    def failed(self, endpoint: str, where: str) -> APIError:
        """The answer to an exception no rule expected (call from an ``except`` block): the
        traceback goes to the log, the client gets a sentence."""
        logger.exception("%s failed", where)
        self.service.metrics.requests.labels(endpoint, "500").inc()
        return APIError(500, "the server failed on this request; see its log")


def _include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)
