"""The radix tree's records: a node (a run of tokens and the pages under it, on the device, in
host memory or both), a prefix match, the hit-rate counters, the listener interface. Pages are
held as ``array('q')`` (see ``page_array``)."""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


def page_array(pages: Sequence[int] | np.ndarray) -> array:
    """Page indices as ``array('q')``: how nodes and matches hold them. Python code indexes,
    slices and iterates it like a list, and numpy reads it without a copy (the allocator's
    vectorised path, where a page-1 node holds one page per token)."""
    if isinstance(pages, np.ndarray):
        out = array("q")
        out.frombytes(np.ascontiguousarray(pages, dtype=np.int64).tobytes())
        return out
    return array("q", pages)


class Node:
    """A run of tokens at positions ``[start, end)`` and where its KV lives: ``pages`` (device
    pages, the pool the model reads) and ``host_pages`` (the host tier, radix/host.py), each
    listing the page indices ``start // P .. (end - 1) // P`` or empty where the node is not in
    that tier; a node is in at least one. A node on the device has its parent on the device too
    (the root counts as everywhere), so a path is device pages first, then host pages.

    With sliding-window layers (radix/sliding.py), ``swa_pages`` lists beside each of ``pages``
    the sliding page whose KV the node keeps for it, or -1 where it keeps none; empty without
    them. ``swa_lock`` counts the locks on it that also hold its windows (radix/windows.py).
    ``host_swa_pages`` is the same beside ``host_pages``: the host tier's copy of the windows
    it keeps (host sliding pages, -1 where none), empty where the node has no host copy."""

    __slots__ = ("key", "start", "num_tokens", "pages", "host_pages", "parent", "children",
                 "lock_ref", "eviction_key", "evicted", "hits", "swa_pages", "swa_lock",
                 "host_swa_pages")

    def __init__(self, key: bytes, start: int, pages: array, parent: Node | None,
                 host_pages: array | None = None) -> None:
        self.key = key  # int32 token ids, packed
        self.start = start
        self.num_tokens = len(key) // 4
        self.pages = pages
        self.host_pages = array("q") if host_pages is None else host_pages
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.lock_ref = 0
        self.eviction_key = 0  # see radix/eviction.py
        self.evicted = False  # unlinked from the tree
        self.hits = 0  # matches that reached it (the host tier's write_through_selective)
        self.swa_pages = array("q")
        self.swa_lock = 0
        self.host_swa_pages = array("q")

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def on_device(self) -> bool:
        return self.parent is None or bool(self.pages)

    def __repr__(self) -> str:
        host = f", host={self.host_pages.tolist()}" if self.host_pages else ""
        return (f"Node([{self.start}, {self.end}), pages={self.pages.tolist()}{host}, "
                f"lock={self.lock_ref})")


@dataclass
class PrefixMatch:
    """The longest cached prefix of a query.

    ``pages`` (an ``array('q')``) covers positions ``[0, length)``: the fully shared pages, then,
    when the match ends inside a page, that page (``partial_page``) whose first ``partial_len``
    slots the caller copies into a fresh page of its own before writing (copy-on-write).

    Its last ``host_length`` tokens were found only in the host tier: until the lease loads them
    (``Lease.acquire``), ``pages`` lists only the device pages below them, and afterwards every
    page of the match.
    """

    length: int
    pages: array
    node: Node
    page_size: int
    host_length: int = 0

    @property
    def full_pages(self) -> array:
        return self.pages[: self.length // self.page_size]

    @property
    def partial_len(self) -> int:
        return self.length % self.page_size

    @property
    def partial_page(self) -> int | None:
        return self.pages[self.length // self.page_size] if self.partial_len else None


@dataclass
class CacheStats:
    queries: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    inserted_tokens: int = 0
    evicted_pages: int = 0
    # the host tier (radix/host.py)
    host_hit_tokens: int = 0  # of hit_tokens, those found only in host memory
    pages_written: int = 0  # device pages copied down to the host tier
    pages_loaded: int = 0  # host pages loaded back onto the device
    # sliding-window layers (radix/sliding.py): kept windows' pages evicted
    sliding_evicted_pages: int = 0
    sliding_loaded_pages: int = 0  # windows of device nodes loaded back from the host tier

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


DEVICE, HOST = "device", "host"  # the tiers ``TreeListener.moved`` names


class TreeListener(Protocol):
    """Told what the tree caches and drops (scheduler/kv_events.py publishes it to gateways;
    scheduler/suffix_index.py indexes it for speculative drafts).

    ``inserted``: ``leaf`` now ends a path of ``key`` (int32 token ids, packed) in ``namespace``,
    whose tokens from ``cached`` on were not in the tree before (on the device). ``evicted``:
    ``node`` (a leaf) was unlinked; its ``parent`` chain still leads to its root, and its
    ``pages`` / ``host_pages`` still say which tiers it leaves. ``moved``: ``node`` stays in the
    tree but its KV was stored in (``stored``) or dropped from the device (``DEVICE``) or the
    host tier (``HOST``). ``windows``: with sliding-window layers, ``node`` now keeps
    (``kept``) or no longer keeps the sliding KV of its pages at ``index`` (positions in
    ``node.pages``; radix/windows.py) on the device, or (``tier`` ``HOST``) in its host copy
    (positions in ``node.host_pages``). ``cleared``: a reset left the tree empty."""

    def inserted(self, leaf: Node, key: bytes, cached: int, namespace: Hashable) -> None: ...

    def evicted(self, node: Node) -> None: ...

    def moved(self, node: Node, tier: str, stored: bool) -> None: ...

    def windows(self, node: Node, index: np.ndarray, kept: bool, tier: str = DEVICE) -> None: ...

    def cleared(self) -> None: ...
