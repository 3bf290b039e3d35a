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

With sliding-window layers in pages of their own (radix/sliding.py) every event names its KV
cache group (engine/contracts/kv_events.py): group 0's blocks follow the tree's nodes as above,
group 1's the windows the nodes keep (``TreeListener.windows``), a block for each page whose
sliding KV a node keeps (the node that holds the block's last token: the one a match through it
reads). Blocks are then pages (``--kv-events-block-size`` equal to ``--page-size``), so the
windows a consumer sees are the tree's exactly; the windows a node's host copy keeps are group
1's blocks on ``"CPU"`` (a match through a host-only node reads those)::

    path        [ p0 ][ p1 ][ p2 ][ p3 ][ p4 ][ p5 ]       window 2 pages
    group 0     [ b0 ][ b1 ][ b2 ][ b3 ][ b4 ][ b5 ]       stored by the insert
    group 1                       [ b3 ][ b4 ][ b5 ]       kept where a prompt and its turn end
    b3's sliding KV dropped             [ b4 ][ b5 ]       group 1 removes b3: a match may end
                                                           after b5 (b4 and b5 before it), no
                                                           longer after b4
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import msgspec
import numpy as np
import zmq

from engine.contracts.kv_events import (
    FULL_ATTENTION,
    FULL_GROUP,
    HOST_MEDIUM,
    MEDIUM,
    SLIDING_GROUP,
    SLIDING_WINDOW,
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
        self.window: int | None = None  # the sliding-window layers', once attached to them

    def attach(self, tree: RadixTree) -> None:
        if tree.num_nodes:
            raise RuntimeError("attach KV events to an empty tree: its blocks so far were never "
                               "published")
        if tree.sliding is not None:
            if self.block_size != tree.page_size:
                raise ValueError(f"with sliding-window layers' own pages, KV event blocks are "
                                 f"pages: --kv-events-block-size must be --page-size "
                                 f"({tree.page_size}), got {self.block_size}")
            self.window = tree.sliding.window
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

    def _stored(self, tokens: np.ndarray, first: int, namespace: Hashable, medium: str,
                group: int = FULL_GROUP) -> None:
        """Blocks ``first`` on of a path (its ``tokens`` from position 0), of KV cache
        ``group`` (with sliding-window layers)."""
        size = self.block_size
        hashes = chain_hashes(namespace, tokens, size)
        extra = adapter = None
        if namespace is not None:
            extra = [(str(namespace),) if k == 0 else None for k in range(first, len(hashes))]
            adapter = self.loras(namespace) if self.loras is not None else None
        event = BlockStored(
            block_hashes=hashes[first:], parent_block_hash=hashes[first - 1] if first else None,
            token_ids=tokens[first * size :].tolist(), block_size=size,
            lora_id=adapter.lora_id if adapter else None, medium=medium,
            lora_name=adapter.name if adapter else None, extra_keys=extra)
        if self.window is not None:
            event.group_idx = group
            event.kv_cache_spec_kind = SLIDING_WINDOW if group == SLIDING_GROUP else FULL_ATTENTION
            if group == SLIDING_GROUP:
                event.kv_cache_spec_sliding_window = self.window
        self.pending.append(event)

    def windows(self, node: Node, index: np.ndarray, kept: bool, tier: str = DEVICE) -> None:
        """The sliding KV ``node`` keeps for its pages at ``index`` (on the device, or in its
        host copy): group 1's blocks on that tier's medium, those whose last token the node
        holds (blocks are pages here), stored in contiguous runs. An evicted node's host
        windows went with its eviction's events."""
        if not node.evicted:
            self._window_blocks(node, index, kept, MEDIUM if tier == DEVICE else HOST_MEDIUM,
                                self._namespaces[self._root(node)])

    def _window_blocks(self, node: Node, index: np.ndarray, kept: bool, medium: str,
                       namespace: Hashable) -> None:
        first = node.start // self.block_size
        blocks = first + index[first + index < node.end // self.block_size]
        if not len(blocks):
            return
        tokens = self._path_tokens(node, int(blocks[-1]) + 1)
        if not kept:
            hashes = chain_hashes(namespace, tokens, self.block_size)
            self._append_removed([hashes[k] for k in blocks.tolist()], medium, SLIDING_GROUP)
            return
        for run in np.split(blocks, np.flatnonzero(np.diff(blocks) != 1) + 1):
            end = (int(run[-1]) + 1) * self.block_size
            self._stored(tokens[:end], int(run[0]), namespace, medium, SLIDING_GROUP)

    def evicted(self, node: Node) -> None:
        root = self._root(node)
        namespace = self._namespaces[root]
        if not root.children:
            del self._namespaces[root]  # its last node went
        for medium, held in ((MEDIUM, node.pages), (HOST_MEDIUM, node.host_pages)):
            if held:
                self._removed(node, namespace, medium)
        host = np.flatnonzero(np.frombuffer(node.host_swa_pages, dtype=np.int64) >= 0)
        if len(host):  # the windows of its host copy go with it
            self._window_blocks(node, host, False, HOST_MEDIUM, namespace)

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
        self._append_removed(hashes, medium, FULL_GROUP)

    def _append_removed(self, hashes: list[int], medium: str, group: int) -> None:
        group_idx = group if self.window is not None else None
        last = self.pending[-1] if self.pending else None
        if (isinstance(last, BlockRemoved) and last.medium == medium
                and last.group_idx == group_idx):
            last.block_hashes.extend(hashes)  # one event for a step's evictions
        else:
            self.pending.append(BlockRemoved(block_hashes=hashes, medium=medium,
                                             group_idx=group_idx))

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
