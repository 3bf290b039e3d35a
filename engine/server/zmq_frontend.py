"""The ZMQ front door: a ROUTER socket on the server's event loop, serving the same requests
as HTTP through the same ``Service`` (``engine/server/zmq_messages.py`` has the messages).

Each call runs as a task keyed by (client identity, call id); ``AbortCall`` cancels it, which
aborts its engine requests. A message that does not decode gets an ``ErrorReply`` with id ""
(its id could not be read), never a dropped connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from engine.server.errors import APIError
from engine.server.service import Service
from engine.server.zmq_messages import (
    AbortCall,
    Call,
    ChatCall,
    ChatChunkReply,
    CloseSessionCall,
    CompletionCall,
    CompletionChunkReply,
    Done,
    ErrorReply,
    GenerateCall,
    GenerateChunkReply,
    OpenSessionCall,
    Reply,
    SessionReply,
    call_decoder,
    encoder,
)

logger = logging.getLogger("radixserve.zmq")


class ZmqFrontend:
    """Binds at construction (so a taken port fails before the engine starts); serves once
    ``start`` gives it the service, on the running event loop."""

    def __init__(self, address: str, max_message_bytes: int = 8 << 20) -> None:
        self.service: Service | None = None
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)  # bigger: the peer is dropped
        self.sock.bind(address)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.tasks: dict[tuple[bytes, str], asyncio.Task] = {}
        self._receiver: asyncio.Task | None = None

    def start(self, service: Service) -> None:
        self.service = service
        self._receiver = asyncio.get_running_loop().create_task(self._receive())

    async def _receive(self) -> None:
        while True:
            identity, payload = await self.sock.recv_multipart()
            try:
                call = call_decoder.decode(payload)
            except msgspec.MsgspecError as exc:
                await self._send(identity, ErrorReply("", 400, APIError(
                    400, f"the message does not decode as a call: {exc}").body().error))
                continue
            key = (identity, call.id)
            if isinstance(call, AbortCall):
                task = self.tasks.get(key)
                if task is not None:
                    task.cancel()
            elif key in self.tasks:
                await self._send(identity, ErrorReply(call.id, 400, APIError(
                    400, f"call id {call.id!r} is already in use").body().error))
            else:
                self.tasks[key] = asyncio.create_task(self._run(identity, call))

    async def _send(self, identity: bytes, reply: Reply) -> None:
        await self.sock.send_multipart([identity, encoder.encode(reply)])

    async def _run(self, identity: bytes, call: Call) -> None:
        try:
            if isinstance(call, OpenSessionCall):
                opened = await self.service.open_session()
                await self._send(identity, SessionReply(call.id, opened=opened))
            elif isinstance(call, CloseSessionCall):
                deleted = await self.service.close_session(call.session_id)
                await self._send(identity, SessionReply(call.id, deleted=deleted))
            else:
                async with aclosing(self._chunks(call)) as replies:
                    async for reply in replies:
                        await self._send(identity, reply)
                await self._send(identity, Done(call.id))
        except APIError as exc:
            await self._send(identity, ErrorReply(call.id, exc.status, exc.body().error))
        except asyncio.CancelledError:
            pass  # aborted by the client: closing the stream aborted the engine requests
        except Exception:
            logger.exception("ZMQ call %s failed", call.id)
            await self._send(identity, ErrorReply(call.id, 500, APIError(
                500, "the server failed on this call; see its log").body().error))
        finally:
            self.tasks.pop((identity, call.id), None)

    def _chunks(self, call: CompletionCall | ChatCall | GenerateCall) -> AsyncIterator[Any]:
        service, body = self.service, call.body
        endpoint = {CompletionCall: "completions", ChatCall: "chat"}.get(type(call), "generate")
        try:
            if isinstance(call, CompletionCall):
                prepared = service.completion_call(call.body)
            elif isinstance(call, ChatCall):
                prepared = service.chat_call(call.body)
            else:
                prepared = service.generate_call(call.body)
        except APIError as exc:
            service.metrics.requests.labels(endpoint, str(exc.status)).inc()
            raise
        if isinstance(call, GenerateCall):
            return _wrap(call.id, GenerateChunkReply, service.generate_stream(prepared))
        usage = bool(body.stream_options and body.stream_options.include_usage)
        if isinstance(call, CompletionCall):
            return _wrap(call.id, CompletionChunkReply,
                         service.completion_stream(prepared, usage, bool(body.logprobs)))
        return _wrap(call.id, ChatChunkReply, service.chat_stream(prepared, usage))

    def stop(self) -> None:
        """Stop serving (on the loop): cancel every call, which aborts its engine requests."""
        if self._receiver is not None:
            self._receiver.cancel()
        for task in self.tasks.values():
            task.cancel()

    def close(self) -> None:
        self.ctx.destroy(linger=0)


async def _wrap(call_id: str, reply: type, chunks: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async with aclosing(chunks):
        async for chunk in chunks:
            yield reply(call_id, chunk)
