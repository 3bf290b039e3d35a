"""The ZMQ front door: a ROUTER socket on the server's event loop, serving the same requests
as HTTP through the same ``Service`` (``engine/server/zmq_messages.py`` has the messages).

Each call runs as a task keyed by (client identity, call id); ``AbortCall`` cancels it, which
aborts its engine requests. The receive loop survives any input: a message of the wrong number
of frames, or one that does not decode (garbage, nesting past the decoder's depth), is logged
and gets an ``ErrorReply`` with id "" (its id could not be read); a call without the server's
API key gets a 401 ``ErrorReply``. Should the loop stop anyway, ``Service.door_failure`` says
why and ``/health`` fails.
"""

from __future__ import annotations

import asyncio
import hmac
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

    def __init__(self, address: str, max_message_bytes: int = 8 << 20,
                 api_key: str | None = None) -> None:
        self.service: Service | None = None
        self.api_key = api_key
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)  # bigger: the peer is dropped
        if address.startswith("tcp://["):
            self.sock.setsockopt(zmq.IPV6, 1)
        self.sock.bind(address)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.tasks: dict[tuple[bytes, str], asyncio.Task] = {}
        self._receiver: asyncio.Task | None = None

    def start(self, service: Service) -> None:
        self.service = service
        self._receiver = asyncio.get_running_loop().create_task(self._receive())
        self._receiver.add_done_callback(self._receiver_ended)

    def _receiver_ended(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return  # stop() ended it
        exc = task.exception()
        self.service.door_failure = f"the ZMQ door stopped receiving: {exc!r}"
        logger.error("%s", self.service.door_failure, exc_info=exc)

    async def _receive(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            identity = frames[0]  # the ROUTER socket puts the peer's identity first
            try:
                refusal = self._accept(identity, frames[1:])
            except Exception:
                logger.exception("the ZMQ door failed on a message from peer %s", identity.hex())
                refusal = _error("", 500, "the server failed on this message; see its log")
            if refusal is not None:
                await self._send(identity, refusal)

    def _accept(self, identity: bytes, frames: list[bytes]) -> ErrorReply | None:
        """Start, abort or refuse the call in one message; the refusal to send back, if any."""
        if len(frames) != 1:
            return self._malformed(identity, f"a call is one frame, this message had "
                                             f"{len(frames)}")
        try:
            call = call_decoder.decode(frames[0])
        except msgspec.MsgspecError as exc:
            return self._malformed(identity, f"the message does not decode as a call: {exc}")
        except RecursionError:
            return self._malformed(identity, "the message is nested too deeply to decode")
        if self.api_key is not None and not hmac.compare_digest(
                (call.api_key or "").encode(), self.api_key.encode()):
            logger.warning("ZMQ peer %s sent a call without the right API key", identity.hex())
            return _error(call.id, 401, "a valid API key is required: set api_key in each call")
        key = (identity, call.id)
        if isinstance(call, AbortCall):
            task = self.tasks.get(key)
            if task is not None:
                task.cancel()
        elif key in self.tasks:
            return _error(call.id, 400, f"call id {call.id!r} is already in use")
        else:
            self.tasks[key] = asyncio.create_task(self._run(identity, call))
        return None

    @staticmethod
    def _malformed(identity: bytes, reason: str) -> ErrorReply:
        logger.warning("ZMQ peer %s sent a malformed message: %s", identity.hex(), reason[:200])
        return _error("", 400, reason)

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
            await self._send(identity, _error(call.id, 500,
                                              "the server failed on this call; see its log"))
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

    async def stop(self, grace: float = 2.0) -> None:
        """Stop serving: calls still running after ``grace`` seconds are cancelled, which aborts
        their engine requests. Calls the engine already failed (a shutdown) get to send their
        error replies first."""
        if self._receiver is not None:
            self._receiver.cancel()
        tasks = list(self.tasks.values())
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=grace)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)

    def close(self) -> None:
        # A moment to flush the last replies (a shutdown's 503s) before the socket goes.
        self.ctx.destroy(linger=500)


def _error(call_id: str, status: int, message: str) -> ErrorReply:
    return ErrorReply(call_id, status, APIError(status, message).body().error)


async def _wrap(call_id: str, reply: type, chunks: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async with aclosing(chunks):
        async for chunk in chunks:
            yield reply(call_id, chunk)
