"""KV cache events in vLLM's wire format (the schema and the block hashes), so gateways can
route by what each engine caches; the scheduler publishes them (scheduler/kv_events.py), the
dispatcher and the gRPC relay read them.

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
sends its cache salt. ``medium`` is ``"GPU"``, vLLM's name for the device tier, on any device,
or ``"CPU"`` for the host tier, the name vLLM's KV offloading gives its CPU blocks.

Sliding-window layers in pages of their own (``--sliding-kv-ratio``): as vLLM's hybrid KV
cache publishes each KV cache group apart, the events then carry ``group_idx`` (0: the full
attention layers, ``kv_cache_spec_kind`` ``"full_attention"``; 1: the sliding-window layers,
``"sliding_window"`` with ``kv_cache_spec_sliding_window`` W) over the same block hashes. A
block of group 0 is stored when the tree caches it and removed when it leaves; a block of group
1 is stored when the tree keeps its sliding KV (a window where a prompt or a request ended) and
removed when that window is dropped while the full KV may stay. A match of ``m`` tokens is
usable only where the window before it is held in group 1 (radix/windows.py,
``usable_length``), so a consumer that keeps both groups computes the engine's match exactly
(tokenizer_worker/replica_cache.py does). One that ignores ``group_idx`` (the gRPC relay to
smg passes the events on as they are) holds the cached blocks less those whose window was
dropped: a match it counts may end where no window is kept, longer than the engine's. Without
sliding pages the three fields are absent.
"""

from __future__ import annotations

from collections.abc import Hashable
from hashlib import blake2b
from typing import Any

import msgspec
import numpy as np

MEDIUM = "GPU"
HOST_MEDIUM = "CPU"
# KV cache groups under --sliding-kv-ratio, with vLLM's kinds
FULL_GROUP, SLIDING_GROUP = 0, 1
FULL_ATTENTION, SLIDING_WINDOW = "full_attention", "sliding_window"


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


def chain_hashes(namespace: Hashable, tokens: np.ndarray, block_size: int) -> list[int]:
    """Hashes of the whole blocks of ``tokens`` (a path from position 0)."""
    data = np.ascontiguousarray(tokens, dtype="<i4").tobytes()
    step = 4 * block_size
    head = b"radixserve-kv\x00" if namespace is None else (
        b"radixserve-kv\x01" + str(namespace).encode())
    parent = int.from_bytes(blake2b(head, digest_size=8).digest(), "little")  # seed(namespace)
    hashes = []
    for at in range(0, len(data) - step + 1, step):
        digest = blake2b(parent.to_bytes(8, "little"), digest_size=8)
        digest.update(data[at : at + step])
        parent = int.from_bytes(digest.digest(), "little")
        hashes.append(parent)
    return hashes


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address or a local transport binds; a named host is dialled."""
    return ("*" in endpoint or "::" in endpoint
            or endpoint.startswith(("ipc://", "inproc://")))
