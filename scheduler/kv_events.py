"""KV cache events in vLLM's wire format, so gateways can route by what each engine caches.

The radix tree caches token runs at any length; gateways think in fixed blocks of
``block_size`` tokens chained by hash (vLLM's prefix cache). A block of a cached path is
*stored* once the tree holds all its tokens, and *removed* when an eviction drops its last
one::

    path in the tree    [0 ................................ 41)        block_size 16
    blocks              [ block 0 ][ block 1 ][ 32..41: not a block yet ]
    insert to 50                              [ block 2 stored (ends at 48) ]
    evict a leaf [20, 50)        block 1 and block 2 removed; block 0 stays (ends at 16 <= 20)

Block hashes chain like vLLM's: each depends on its parent's hash, so equal hashes mean equal
whole prefixes. The hash (64 bits, stable across runs and machines)::

    seed(namespace) = blake2b(b"radixserve-kv\\x00")                      namespace None
                      blake2b(b"radixserve-kv\\x01" + namespace as UTF-8)  otherwise
    hash(block k)   = blake2b(hash(block k-1) or seed, as 8 bytes little-endian
                              + the block's token ids as int32 little-endian)
    blake2b with digest_size=8, read as an unsigned little-endian integer.

Wire format (vLLM's ``KVEventBatch`` as vLLM 0.26 publishes it): one ZMQ multipart message per
scheduler step that changed the tree, ``[topic, sequence number (8 bytes big-endian, from 0),
msgpack payload]``; the payload is the array ``[ts, events, data_parallel_rank]`` and each
event a map tagged ``"type"`` (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``). A
non-empty namespace (cache salt) rides in ``extra_keys`` of the path's first block, as vLLM
sends its cache salt. ``medium`` is ``"GPU"``: vLLM's name for the device tier, on any device.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from hashlib import blake2b
from typing import Any

import msgspec
import numpy as np
import zmq

from radix.tree import Node, RadixTree

MEDIUM = "GPU"


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


def namespace_seed(namespace: Hashable) -> int:
    """The parent hash of a path's first block."""
    head = b"radixserve-kv\x00" if namespace is None else (
        b"radixserve-kv\x01" + str(namespace).encode())
    return int.from_bytes(blake2b(head, digest_size=8).digest(), "little")


def chain_hashes(namespace: Hashable, tokens: np.ndarray, block_size: int) -> list[int]:
    """Hashes of the whole blocks of ``tokens`` (a path from position 0)."""
    data = np.ascontiguousarray(tokens, dtype="<i4").tobytes()
    step = 4 * block_size
    parent = namespace_seed(namespace)
    hashes = []
    for at in range(0, len(data) - step + 1, step):
        digest = blake2b(parent.to_bytes(8, "little"), digest_size=8)
        digest.update(data[at : at + step])
        parent = int.from_bytes(digest.digest(), "little")
        hashes.append(parent)
    return hashes


class BlockEvents:
    """The tree's listener: turns cached and evicted token runs into block events.

    Events wait in ``pending`` until ``take`` (once per scheduler step). Recovering an evicted
    leaf's path walks its parents; each root's namespace is learned when something is inserted
    under it and forgotten when the root goes empty, so nothing outlives the tree's own nodes.
    Cost: one hash per block of the touched path, only while attached.
    """

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"the KV event block size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.pending: list[KVEvent] = []
        self._namespaces: dict[Node, Hashable] = {}  # root → namespace

    def attach(self, tree: RadixTree) -> None:
        if tree.num_nodes:
            raise RuntimeError("attach KV events to an empty tree: its blocks so far were never "
                               "published")
        tree.listener = self

    def take(self) -> list[KVEvent]:
        events, self.pending = self.pending, []
        return events

    def _blocks(self, cached: int, total: int) -> range:
        """Blocks that end inside ``(cached, total]``."""
        return range(cached // self.block_size, total // self.block_size)

    def inserted(self, leaf: Node, key: bytes, cached: int, namespace: Hashable) -> None:
        root = leaf
        while root.parent is not None:
            root = root.parent
        self._namespaces[root] = namespace
        blocks = self._blocks(cached, len(key) // 4)
        if not blocks:
            return
        size = self.block_size
        tokens = np.frombuffer(key, dtype=np.int32, count=blocks.stop * size)
        hashes = chain_hashes(namespace, tokens, size)
        first = blocks.start
        extra = None
        if namespace is not None:
            extra = [(str(namespace),) if k == 0 else None for k in blocks]
        self.pending.append(BlockStored(
            block_hashes=hashes[first:], parent_block_hash=hashes[first - 1] if first else None,
            token_ids=tokens[first * size :].tolist(), block_size=size, lora_id=None,
            medium=MEDIUM, lora_name=None, extra_keys=extra))

    def evicted(self, node: Node) -> None:
        parts = []
        root = node
        while root.parent is not None:
            parts.append(root.key)
            root = root.parent
        namespace = self._namespaces[root]
        if not root.children:
            del self._namespaces[root]
        blocks = self._blocks(node.start, node.end)
        if not blocks:
            return
        parts.reverse()
        tokens = np.frombuffer(b"".join(parts), dtype=np.int32, count=blocks.stop * self.block_size)
        hashes = chain_hashes(namespace, tokens, self.block_size)[blocks.start :]
        last = self.pending[-1] if self.pending else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.extend(hashes)  # one event for a step's evictions
        else:
            self.pending.append(BlockRemoved(block_hashes=hashes, medium=MEDIUM))

    def cleared(self) -> None:
        self._namespaces.clear()
        self.pending.append(AllBlocksCleared())


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address or a local transport binds; a named host is dialled."""
    return ("*" in endpoint or "::" in endpoint
            or endpoint.startswith(("ipc://", "inproc://")))


class KVEventPublisher:
    """A ZMQ PUB socket sending one ``KVEventBatch`` per call that has events.

    Subscribers that connect late miss what was published before (PUB/SUB keeps no history);
    the sequence number lets them see gaps and restarts (it starts from 0 again)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, *, topic: str = "",
                 data_parallel_rank: int = 0) -> None:
        self.socket = ctx.socket(zmq.PUB)
        self.socket.setsockopt(zmq.SNDHWM, 100_000)
        self.socket.setsockopt(zmq.LINGER, 100)
        try:
            if binds(endpoint):
                self.socket.bind(endpoint)
            else:
                self.socket.connect(endpoint)
        except zmq.ZMQError as exc:
            self.socket.close(0)
            raise RuntimeError(f"--kv-events-endpoint {endpoint}: {exc}") from exc
        self.topic = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self.sequence = 0
        self._encoder = msgspec.msgpack.Encoder()

    def publish(self, events: list[KVEvent], ts: float | None = None) -> None:
        if not events:
            return
        batch = KVEventBatch(time.time() if ts is None else ts, events, self.data_parallel_rank)
        self.socket.send_multipart(
            (self.topic, self.sequence.to_bytes(8, "big"), self._encoder.encode(batch)))
        self.sequence += 1

    def close(self) -> None:
        self.socket.close()
