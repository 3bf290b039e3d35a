"""The ZMQ front door: a ROUTER socket on the server's event loop, serving the same requests
as HTTP through the same door pipeline (engine/server/pipeline.py: key, validation, limits,
errors); ``engine/server/zmq_messages.py`` has the messages.

Each call runs as a task keyed by (client identity, call id); ``AbortCall`` cancels it, which
aborts its engine requests. The receive loop survives any input: a message of the wrong number
of frames, or one that does not decode (garbage, nesting past the decoder's depth), is logged
and gets an ``ErrorReply`` with id "" (its id could not be read); a call without the server's
API key gets a 401 ``ErrorReply``. Should the loop stop anyway, ``Service.door_failure`` says
why and ``/health`` fails.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing

import zmq
import zmq.asyncio

from engine.server.errors import APIError
from engine.server.pipeline import DOOR_STOP_GRACE, Pipeline
from engine.server.service import Service
from engine.server.zmq_messages import (
    AbortCall,
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
    SessionReply,
    ZmqCall,
    ZmqReply,
    call_decoder,
    encoder,
)

logger = logging.getLogger("radixserve.zmq")
CHUNK_REPLIES = {CompletionCall: CompletionChunkReply, ChatCall: ChatChunkReply,
                 GenerateCall: GenerateChunkReply}


class ZmqFrontend:
    """Binds at construction (so a taken port fails before the engine starts); serves once
    ``start`` gives it the service, on the running event loop."""

    def __init__(self, address: str, max_message_bytes: int) -> None:
        self.service: Service | None = None
        self.pipeline: Pipeline | None = None
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
        self.pipeline = Pipeline(service)
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
                failure = self.pipeline.failed("unknown", f"a ZMQ message from peer "
                                               f"{identity.hex()}")
                refusal = ErrorReply("", failure.status, failure.body().error)
            if refusal is not None:
                await self._send(identity, refusal)

    def _accept(self, identity: bytes, frames: list[bytes]) -> ErrorReply | None:
        """Start, abort or refuse the call in one message; the refusal to send back, if any."""
        if len(frames) != 1:
            return self._malformed(identity, f"a call is one frame, this message had "
                                             f"{len(frames)}")
        try:
            call = self.pipeline.decode(call_decoder.decode, frames[0],
                                        "the message does not decode as a call: ")
        except APIError as exc:
            return self._malformed(identity, exc.message)
        try:
            self.pipeline.authorize(call.api_key, "set api_key in each call")
        except APIError as exc:
            logger.warning("ZMQ peer %s sent a call without the right API key", identity.hex())
            return ErrorReply(call.id, exc.status, exc.body().error)
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

    async def _send(self, identity: bytes, reply: ZmqReply) -> None:
        await self.sock.send_multipart([identity, encoder.encode(reply)])

    async def _run(self, identity: bytes, call: ZmqCall) -> None:
        try:
            if isinstance(call, OpenSessionCall):
                opened = await self.pipeline.open_session()
                await self._send(identity, SessionReply(call.id, opened=opened))
            elif isinstance(call, CloseSessionCall):
                deleted = await self.pipeline.close_session(call.session_id)
                await self._send(identity, SessionReply(call.id, deleted=deleted))
            else:
                reply = CHUNK_REPLIES[type(call)]
                async with aclosing(self.pipeline.open(call.body).stream()) as chunks:
                    async for chunk in chunks:
                        await self._send(identity, reply(call.id, chunk))
                await self._send(identity, Done(call.id))
        except APIError as exc:
            await self._send(identity, ErrorReply(call.id, exc.status, exc.body().error))
        except asyncio.CancelledError:
            pass  # aborted by the client: closing the stream aborted the engine requests
        except Exception:
            failure = self.pipeline.failed("unknown", f"ZMQ call {call.id}")
            await self._send(identity, ErrorReply(call.id, failure.status, failure.body().error))
        finally:
            self.tasks.pop((identity, call.id), None)

    async def stop(self, grace: float = DOOR_STOP_GRACE) -> None:
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
