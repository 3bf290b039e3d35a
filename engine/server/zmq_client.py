"""Clients of the ZMQ front door (``radixserve serve --zmq-port P``): blocking and asyncio.

    from engine.server.zmq_client import ZmqClient
    with ZmqClient("tcp://127.0.0.1:P") as client:
        for chunk in client.completion({"prompt": "Hello", "max_tokens": 8}):
            print(chunk.choices[0].text if chunk.choices else chunk.usage)

Bodies are the HTTP API's (a dict or the Struct from ``engine.server.schemas``); chunks are its
stream chunks; give ``api_key`` when the server runs with ``--api-key``. A refused call raises
``ZmqAPIError`` with the HTTP-like status. Leaving a stream early aborts the call on the server.
``ZmqClient`` runs one call at a time (it is not thread-safe); ``AsyncZmqClient`` runs any
number concurrently on one socket.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from engine.server.schemas import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionChunk,
    CompletionRequest,
    GenerateBody,
    GenerateResponse,
    SessionDeleted,
    SessionObject,
)
from engine.server.zmq_messages import (
    AbortCall,
    ChatCall,
    CloseSessionCall,
    CompletionCall,
    Done,
    ErrorReply,
    GenerateCall,
    OpenSessionCall,
    SessionReply,
    ZmqCall,
    ZmqReply,
    encoder,
    reply_decoder,
)


class ZmqAPIError(RuntimeError):
    """The server refused or failed a call."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.param = param


def _body(body: Any, kind: type) -> Any:
    return body if isinstance(body, kind) else msgspec.convert(body, kind)


def _new_id() -> str:
    return uuid.uuid4().hex


def _encode(call: ZmqCall, api_key: str | None) -> bytes:
    call.api_key = api_key
    return encoder.encode(call)


def _chunk_or_raise(reply: ZmqReply) -> Any:
    """The chunk a reply carries; None at the end of the call."""
    if isinstance(reply, ErrorReply):
        raise ZmqAPIError(reply.status, reply.error.message, reply.error.param)
    if isinstance(reply, Done):
        return None
    if isinstance(reply, SessionReply):
        return reply.opened or reply.deleted
    return reply.chunk


class ZmqClient:
    def __init__(self, address: str, timeout: float | None = 60.0,
                 api_key: str | None = None) -> None:
        self.api_key = api_key
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(address)
        self.timeout_ms = None if timeout is None else int(timeout * 1000)

    def completion(self, body: CompletionRequest | dict) -> Iterator[CompletionChunk]:
        return self._stream(CompletionCall(_new_id(), _body(body, CompletionRequest)))

    def chat(self, body: ChatCompletionRequest | dict) -> Iterator[ChatCompletionChunk]:
        return self._stream(ChatCall(_new_id(), _body(body, ChatCompletionRequest)))

    def generate(self, body: GenerateBody | dict) -> Iterator[GenerateResponse]:
        return self._stream(GenerateCall(_new_id(), _body(body, GenerateBody)))

    def open_session(self) -> SessionObject:
        call = OpenSessionCall(_new_id())
        self.sock.send(_encode(call, self.api_key))
        return _chunk_or_raise(self._recv(call.id))

    def close_session(self, session_id: str) -> SessionDeleted:
        call = CloseSessionCall(_new_id(), session_id)
        self.sock.send(_encode(call, self.api_key))
        return _chunk_or_raise(self._recv(call.id))

    def _recv(self, call_id: str) -> ZmqReply:
        while True:
            if not self.sock.poll(self.timeout_ms):
                raise TimeoutError(f"no reply from the server within {self.timeout_ms} ms")
            reply = reply_decoder.decode(self.sock.recv())
            if reply.id in (call_id, ""):
                return reply  # anything else is a late reply of a call abandoned earlier

    def _stream(self, call: ZmqCall) -> Iterator[Any]:
        self.sock.send(_encode(call, self.api_key))
        finished = False
        try:
            while (chunk := _chunk_or_raise(self._recv(call.id))) is not None:
                yield chunk
            finished = True
        except ZmqAPIError:
            finished = True
            raise
        finally:
            if not finished and not self.sock.closed:
                self.sock.send(_encode(AbortCall(call.id), self.api_key))

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def __enter__(self) -> ZmqClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncZmqClient:
    """The same calls as async generators; concurrent calls share one socket."""

    def __init__(self, address: str, api_key: str | None = None) -> None:
        self.api_key = api_key
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(address)
        self._queues: dict[str, asyncio.Queue[ZmqReply]] = {}
        self._receiver: asyncio.Task | None = None

    async def _receive(self) -> None:
        while True:
            reply = reply_decoder.decode(await self.sock.recv())
            targets = self._queues.values() if reply.id == "" else [self._queues.get(reply.id)]
            for queue in targets:
                if queue is not None:
                    queue.put_nowait(reply)

    def completion(self, body: CompletionRequest | dict) -> AsyncIterator[CompletionChunk]:
        return self._stream(CompletionCall(_new_id(), _body(body, CompletionRequest)))

    def chat(self, body: ChatCompletionRequest | dict) -> AsyncIterator[ChatCompletionChunk]:
        return self._stream(ChatCall(_new_id(), _body(body, ChatCompletionRequest)))

    def generate(self, body: GenerateBody | dict) -> AsyncIterator[GenerateResponse]:
        return self._stream(GenerateCall(_new_id(), _body(body, GenerateBody)))

    async def open_session(self) -> SessionObject:
        return _chunk_or_raise(await self._single(OpenSessionCall(_new_id())))

    async def close_session(self, session_id: str) -> SessionDeleted:
        return _chunk_or_raise(await self._single(CloseSessionCall(_new_id(), session_id)))

    def _open(self, call_id: str) -> asyncio.Queue[ZmqReply]:
        if self._receiver is None:
            self._receiver = asyncio.get_running_loop().create_task(self._receive())
        queue: asyncio.Queue[ZmqReply] = asyncio.Queue()
        self._queues[call_id] = queue
        return queue

    async def _single(self, call: ZmqCall) -> ZmqReply:
        queue = self._open(call.id)
        try:
            await self.sock.send(_encode(call, self.api_key))
            return await queue.get()
        finally:
            del self._queues[call.id]

    async def _stream(self, call: ZmqCall) -> AsyncIterator[Any]:
        queue = self._open(call.id)
        finished = False
        try:
            await self.sock.send(_encode(call, self.api_key))
            while (chunk := _chunk_or_raise(await queue.get())) is not None:
                yield chunk
            finished = True
        except ZmqAPIError:
            finished = True
            raise
        finally:
            del self._queues[call.id]
            if not finished:
                await self.sock.send(_encode(AbortCall(call.id), self.api_key))

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
        self.ctx.destroy(linger=0)
