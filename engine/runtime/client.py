"""The frontend's asyncio client of the tokenizer workers.

Each request gets a queue of ``RequestOutput``s; one receive task routes outputs to queues.
A request whose consumer goes away (a client disconnect cancels the stream) is aborted, so its
pages are released within one scheduler step. ``fail_all`` ends every pending stream with an
error when the process group dies: no request waits forever. The scheduler's latest
``SchedulerStats`` (forwarded by the tokenizer workers) is kept in ``stats`` for metrics.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from engine.contracts.engine_config import Endpoints
from engine.contracts.protocol import (
    AbortRequest,
    DetokenizeRequest,
    GenerateRequest,
    LoraUpdate,
    LoraUpdated,
    RequestOutput,
    SchedulerStats,
    SessionClose,
    SessionOpen,
    TokenizeRequest,
    TokenizerReply,
    decode,
    encode,
)


class EngineDead(RuntimeError):
    """The engine's process group stopped; the message says why."""


class EngineClient:
    def __init__(self, endpoints: Endpoints, num_pages: int = 0) -> None:
        self.ctx = zmq.asyncio.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(endpoints.frontend_in)
        self.tokenizers = []
        for address in endpoints.tokenizer_in:
            sock = self.ctx.socket(zmq.PUSH)
            sock.connect(address)
            self.tokenizers.append(sock)
        self._next = itertools.cycle(range(len(self.tokenizers)))
        self._homes: dict[str, int] = {}  # a forked session's tokenizer worker (its parent's)
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._lora_updates: dict[str, asyncio.Future[LoraUpdated]] = {}
        self._tokenize_calls: dict[str, asyncio.Future[TokenizerReply]] = {}
        self._receiver: asyncio.Task | None = None
        self.dead: str | None = None
        # The scheduler reports only once it has worked; until then its pool is whole and free.
        self.stats = SchedulerStats(kv_pages_total=num_pages)

    @property
    def num_pending(self) -> int:
        return len(self._queues)

    def start(self) -> None:
        self._receiver = asyncio.get_running_loop().create_task(self._receive())

    async def _receive(self) -> None:
        while True:
            msg = decode(await self.inbox.recv())
            if isinstance(msg, SchedulerStats):
                self.stats = msg
                continue
            if isinstance(msg, LoraUpdated | TokenizerReply):
                calls = self._lora_updates if isinstance(msg, LoraUpdated) else \
                    self._tokenize_calls
                waiting = calls.pop(msg.rid, None)
                if waiting is not None and not waiting.done():
                    waiting.set_result(msg)
                continue
            queue = self._queues.get(msg.rid) if isinstance(msg, RequestOutput) else None
            if queue is not None:
                queue.put_nowait(msg)

    def _route(self, session_id: str | None) -> int:
        if session_id is not None:
            # A session's history lives in one tokenizer worker; a forked one's in its parent's.
            home = self._homes.get(session_id)
            return hash(session_id) % len(self.tokenizers) if home is None else home
        return next(self._next)

    async def send_session(self, msg: SessionOpen | SessionClose) -> None:
        """Open or close a session in the tokenizer worker (and scheduler) that owns it."""
        if self.dead is not None:
            raise EngineDead(self.dead)
        if isinstance(msg, SessionOpen) and msg.parent is not None:
            self._homes[msg.session_id] = self._route(msg.parent)
        route = self._route(msg.session_id)
        if isinstance(msg, SessionClose):
            self._homes.pop(msg.session_id, None)
        await self.tokenizers[route].send(encode(msg))

    async def update_lora(self, msg: LoraUpdate) -> LoraUpdated:
        """Load or unload a LoRA adapter in the engine; its answer once the worker has."""
        if self.dead is not None:
            raise EngineDead(self.dead)
        answer = asyncio.get_running_loop().create_future()
        self._lora_updates[msg.rid] = answer
        try:
            await self.tokenizers[0].send(encode(msg))
            return await answer
        finally:
            self._lora_updates.pop(msg.rid, None)

    async def tokenize(self, msg: TokenizeRequest | DetokenizeRequest) -> TokenizerReply:
        """A prompt's ids, or ids' text, from a tokenizer worker (``/tokenize``,
        ``/detokenize``)."""
        if self.dead is not None:
            raise EngineDead(self.dead)
        answer = asyncio.get_running_loop().create_future()
        self._tokenize_calls[msg.rid] = answer
        try:
            await self.tokenizers[self._route(None)].send(encode(msg))
            return await answer
        finally:
            self._tokenize_calls.pop(msg.rid, None)

    async def stream(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until every sample has finished."""
        if self.dead is not None:
            raise EngineDead(self.dead)
        if req.rid in self._queues:
            raise ValueError(f"request id {req.rid!r} is already in use")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[req.rid] = queue
        route = self._route(req.session_id)
        width = req.params.n
        finished = 0
        try:
            await self.tokenizers[route].send(encode(req))
            while finished < width:
                out = await queue.get()
                if self.dead is not None:
                    raise EngineDead(self.dead)
                if out.finish_reason == "error":
                    finished = width  # an error ends every sample of the request
                elif out.finish_reason is not None:
                    finished += 1
                yield out
        finally:
            self._queues.pop(req.rid, None)
            if finished < width and self.dead is None:
                await self.tokenizers[route].send(encode(AbortRequest(req.rid)))

    def fail_all(self, reason: str) -> None:
        """Called on the event loop when the process group died."""
        self.dead = reason
        for answer in [*self._lora_updates.values(), *self._tokenize_calls.values()]:
            if not answer.done():
                answer.set_exception(EngineDead(reason))
        for rid, queue in self._queues.items():
            queue.put_nowait(RequestOutput(rid=rid, finish_reason="error", error=reason, status=500))

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
        self.ctx.destroy(linger=0)


def new_request_id() -> str:
    return uuid.uuid4().hex
