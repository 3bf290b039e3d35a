"""Publishing the radix tree's changes as KV cache events (engine/contracts/kv_events.py has
the wire format and the block hashes).

The radix tree caches token runs at any length; gateways think in fixed blocks of
``block_size`` tokens chained by hash (vLLM's prefix cache). A block of a cached path is
*stored* once the tree holds all its tokens, and *removed* when an eviction drops its last
one::

    path in the tree    [0 ................................ 41)        block_size 16
    blocks              [ block 0 ][ block 1 ][ 32..41: not a block yet ]
    insert to 50                              [ block 2 stored (ends at 48) ]
    evict a leaf [20, 50)        block 1 and block 2 removed; block 0 stays (ends at 16 <= 20)

With a host tier (radix/host.py) the same blocks are stored in and removed from each tier as
the tree moves a node between them, with vLLM's ``medium`` names: ``"GPU"`` for the device
pool (on any device), ``"CPU"`` for host memory (vLLM's KV offloading publishes its CPU
blocks so). A node written down to the host tier stores its blocks on ``"CPU"``; dropped from
the device, it removes them from ``"GPU"``; loaded back, it stores them on ``"GPU"`` again. A
gateway that ignores ``medium`` sees a block removed from one tier after it was stored in
the other, and should keep a block while any tier holds it (tokenizer_worker/replica_cache.py
does). The disk tier (engine/contracts/disk_cache.py) publishes nothing: its files are shared
by every server on the machine, and what one trims the others cannot report.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import msgspec
import numpy as np
import zmq

from engine.contracts.kv_events import (
    HOST_MEDIUM,
    MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    binds,
    chain_hashes,
)
from engine.contracts.lora import LoraAdapterInfo
from radix.node import DEVICE
from radix.tree import Node, RadixTree


class BlockEvents:
    """The tree's listener: turns cached and evicted token runs into block events.

    Events wait in ``pending`` until ``take`` (once per scheduler step). Recovering an evicted
    leaf's path walks its parents; each root's namespace is learned when something is inserted
    under it and forgotten when the root goes empty, so nothing outlives the tree's own nodes.
    Cost: one hash per block of the touched path, only while attached.
    """

    def __init__(self, block_size: int,
                 loras: Callable[[Hashable], LoraAdapterInfo | None] | None = None) -> None:
        """``loras``: the LoRA adapter of a namespace, if any (its blocks' ``lora_id`` and
        ``lora_name``, as vLLM's events carry them)."""
        if block_size < 1:
            raise ValueError(f"the KV event block size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.loras = loras
        self.pending: list[KVEvent] = []
        self._namespaces: dict[Node, Hashable] = {}  # root → namespace

    def attach(self, tree: RadixTree) -> None:
        if tree.num_nodes:
            raise RuntimeError("attach KV events to an empty tree: its blocks so far were never "
                               "published")
        tree.listeners.append(self)

    def take(self) -> list[KVEvent]:
        events, self.pending = self.pending, []
        return events

    def _blocks(self, cached: int, total: int) -> range:
        """Blocks that end inside ``(cached, total]``."""
        return range(cached // self.block_size, total // self.block_size)

    def inserted(self, leaf: Node, key: bytes, cached: int, namespace: Hashable) -> None:
        self._namespaces[self._root(leaf)] = namespace
        blocks = self._blocks(cached, len(key) // 4)
        if not blocks:
            return
        tokens = np.frombuffer(key, dtype=np.int32, count=blocks.stop * self.block_size)
        self._stored(tokens, blocks.start, namespace, MEDIUM)

    def _stored(self, tokens: np.ndarray, first: int, namespace: Hashable, medium: str) -> None:
        """Blocks ``first`` on of a path (its ``tokens`` from position 0)."""
        size = self.block_size
        hashes = chain_hashes(namespace, tokens, size)
        extra = adapter = None
        if namespace is not None:
            extra = [(str(namespace),) if k == 0 else None for k in range(first, len(hashes))]
            adapter = self.loras(namespace) if self.loras is not None else None
        self.pending.append(BlockStored(
            block_hashes=hashes[first:], parent_block_hash=hashes[first - 1] if first else None,
            token_ids=tokens[first * size :].tolist(), block_size=size,
            lora_id=adapter.lora_id if adapter else None, medium=medium,
            lora_name=adapter.name if adapter else None, extra_keys=extra))

    def evicted(self, node: Node) -> None:
        root = self._root(node)
        namespace = self._namespaces[root]
        if not root.children:
            del self._namespaces[root]  # its last node went
        for medium, held in ((MEDIUM, node.pages), (HOST_MEDIUM, node.host_pages)):
            if held:
                self._removed(node, namespace, medium)

    def moved(self, node: Node, tier: str, stored: bool) -> None:
        medium = MEDIUM if tier == DEVICE else HOST_MEDIUM
        namespace = self._namespaces[self._root(node)]
        if not stored:
            self._removed(node, namespace, medium)
            return
        blocks = self._blocks(node.start, node.end)
        if blocks:
            self._stored(self._path_tokens(node, blocks.stop), blocks.start, namespace, medium)

    @staticmethod
    def _root(node: Node) -> Node:
        while node.parent is not None:
            node = node.parent
        return node

    def _path_tokens(self, node: Node, num_blocks: int) -> np.ndarray:
        """The first ``num_blocks`` blocks' tokens of the path to ``node``."""
        parts = []
        while node.parent is not None:
            parts.append(node.key)
            node = node.parent
        parts.reverse()
        return np.frombuffer(b"".join(parts), dtype=np.int32, count=num_blocks * self.block_size)

    def _removed(self, node: Node, namespace: Hashable, medium: str) -> None:
        blocks = self._blocks(node.start, node.end)
        if not blocks:
            return
        tokens = self._path_tokens(node, blocks.stop)
        hashes = chain_hashes(namespace, tokens, self.block_size)[blocks.start :]
        last = self.pending[-1] if self.pending else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.extend(hashes)  # one event for a step's evictions
        else:
            self.pending.append(BlockRemoved(block_hashes=hashes, medium=medium))

    def cleared(self) -> None:
        self._namespaces.clear()
        self.pending.append(AllBlocksCleared())


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
