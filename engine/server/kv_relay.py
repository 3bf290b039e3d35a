"""The KV event relay behind the gRPC door's ``SubscribeKvEvents``: one ZMQ SUB socket on the
engine's KV event publisher (``scheduler/kv_events.py``), each batch converted once into smg's
``KvEventBatch`` proto and handed to every subscribed stream.

    scheduler ──PUB──▶ KvEventRelay (SUB) ──▶ history (last HISTORY_BATCHES batches)
                                          └──▶ one queue per SubscribeKvEvents stream

A subscriber names the last sequence number it applied (0: none); it gets the history from there,
then live batches, in publisher order and numbered as the publisher numbered them, so smg's gap
detection sees what the engine sent. The relay subscribes when the server starts, before any
request can reach the engine, so the history covers the engine's whole life until it wraps.

Conversion: block hashes travel as int64 (smg's proto), the same 64 bits reinterpreted; a
namespaced path's first event carries its namespace as the first block's extra key, as vLLM
carries a cache salt, so smg never matches it with an unsalted request. smg hashes the blocks'
``token_ids`` itself; our hash is only each block's identity (parent links, removals).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from engine.contracts.kv_events import (
    HOST_MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

logger = logging.getLogger("radixserve.grpc")

HISTORY_BATCHES = 65_536


def subscriber_address(endpoint: str) -> str:
    """Where a local subscriber reaches a publisher that binds ``endpoint``."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        if endpoint.startswith(wildcard):
            return "tcp://127.0.0.1:" + endpoint[len(wildcard):]
    if endpoint.startswith("tcp://[::]:"):
        return "tcp://[::1]:" + endpoint[len("tcp://[::]:"):]
    return endpoint


def signed64(value: int) -> int:
    """An unsigned 64-bit hash as the int64 smg's proto carries."""
    return value - (1 << 64) if value >= 1 << 63 else value


class KvEventRelay:
    """Subscribes on construction; ``start`` runs the receive loop on the running event loop.
    ``common_pb2`` is smg-grpc-proto's module of shared messages (imported by the caller, so
    this module loads without the optional dependency)."""

    CLOSED = object()  # ends the streams when the relay closes

    def __init__(self, endpoint: str, common_pb2: Any) -> None:
        self.pb = common_pb2
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        if endpoint.startswith("tcp://["):
            self.sock.setsockopt(zmq.IPV6, 1)
        self.sock.connect(subscriber_address(endpoint))
        self.history: deque[Any] = deque(maxlen=HISTORY_BATCHES)
        self.streams: set[asyncio.Queue] = set()
        self.next_event_id = 1
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._receiver: asyncio.Task | None = None

    def start(self) -> None:
        self._receiver = asyncio.get_running_loop().create_task(self._receive())

    async def _receive(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            try:
                batch = self.convert(int.from_bytes(frames[1], "big"),
                                     self.decoder.decode(frames[2]))
            except (IndexError, msgspec.MsgspecError):
                logger.exception("the KV event relay could not read a batch; skipped")
                continue
            self.history.append(batch)
            for queue in self.streams:
                queue.put_nowait(batch)

    async def subscribe(self, after: int, idle: float) -> AsyncIterator[Any]:
        """The batches numbered ``after`` and later that the history holds (all of it for 0),
        then every live one, until the caller stops iterating. None in between: at once when
        the history has nothing to send, then after each ``idle`` seconds without a batch (the
        caller's cue for a heartbeat)."""
        queue: asyncio.Queue = asyncio.Queue()
        for batch in self.history:
            if batch.sequence_number >= after:
                queue.put_nowait(batch)
        if queue.empty():
            yield None
        self.streams.add(queue)
        try:
            while True:
                try:
                    batch = await asyncio.wait_for(queue.get(), idle)
                except asyncio.TimeoutError:
                    yield None
                    continue
                if batch is self.CLOSED:
                    return
                yield batch
        finally:
            self.streams.discard(queue)

    def convert(self, sequence: int, batch: KVEventBatch) -> Any:
        pb = self.pb
        events = []
        for event in batch.events:
            if isinstance(event, BlockStored):
                data = {"stored": self._stored(event)}
            elif isinstance(event, BlockRemoved):
                data = {"removed": pb.KvBlocksRemoved(
                    block_hashes=[signed64(h) for h in event.block_hashes],
                    medium=event.medium, tier=self._tier(event.medium))}
            elif isinstance(event, AllBlocksCleared):
                data = {"cleared": pb.KvCacheCleared()}
            else:
                continue
            events.append(pb.KvCacheEvent(event_id=self.next_event_id, **data))
            self.next_event_id += 1
        return pb.KvEventBatch(sequence_number=sequence, timestamp=batch.ts, events=events,
                               dp_rank=batch.data_parallel_rank or 0)

    def _tier(self, medium: str | None) -> int:
        """smg's tier for a vLLM medium: host memory for "CPU", else the device."""
        pb = self.pb
        return pb.KV_CACHE_TIER_HOST if medium == HOST_MEDIUM else pb.KV_CACHE_TIER_DEVICE

    def _stored(self, event: BlockStored) -> Any:
        pb, size = self.pb, event.block_size
        blocks = []
        for i, block_hash in enumerate(event.block_hashes):
            keys = (event.extra_keys[i] if event.extra_keys and i < len(event.extra_keys)
                    else None)
            blocks.append(pb.KvBlock(
                block_hash=signed64(block_hash), token_ids=event.token_ids[i * size:(i + 1) * size],
                block_size=size,
                extra_keys=[pb.KvBlockExtraKey(text=str(key)) for key in keys or ()]))
        stored = pb.KvBlocksStored(blocks=blocks, medium=event.medium,
                                   tier=self._tier(event.medium),
                                   locality=pb.KV_CACHE_LOCALITY_LOCAL)
        if event.parent_block_hash is not None:
            stored.parent_block_hash = signed64(event.parent_block_hash)
        return stored

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
        for queue in self.streams:
            queue.put_nowait(self.CLOSED)
        self.ctx.destroy(linger=0)
