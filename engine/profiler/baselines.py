"""Whole-block hash prefix caching (vLLM's scheme), the baseline the radix tree is compared with.

A block of ``block_size`` tokens is found by a hash chained over its parent block's hash and
its own tokens, so a block hits only if every block before it hit too, and only whole blocks
hit: a 103-token shared prefix with 16-token blocks reuses 96 tokens. Like vLLM:

- at least one prompt token is computed, so at most ``(len(prompt) - 1) // block_size`` blocks
  hit;
- the full blocks of prompt + output are cached when the request finishes; its partial last
  block is not;
- a running request's blocks cannot be evicted; a finished request's blocks return to the LRU
  queue tail first, so the tail of a sequence is evicted before its head (evicting a head block
  first would strand every block after it).

Hashing is vectorised, with no Python step per block: a block's content hash ``c`` is a keyed
sum of its tokens, scrambled (splitmix64), and the chain is a polynomial over the blocks, in
uint64 arithmetic (mod 2^64)::

    H_k = H_{k-1} * M + c_k,   H_{-1} = the namespace's root
        = M^k * (M * H_{-1} + sum_{j <= k} c_j * M^-j)      one cumulative sum per sequence

(M is odd, so M^-1 exists mod 2^64). Two blocks get one hash exactly when they and every block
before them are equal, up to 64-bit collisions (vLLM's own chain of Python ``hash`` calls has
the same odds). A trace's hashes are numbered densely once (``BlockChains``) and replayed at
every capacity; the LRU is then arrays over those numbers (``BlockHashCache``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from engine.profiler.trace import ReplayRequest

BLOCK_SIZE = 16

_MOD = 1 << 64
_M = 0x9E3779B97F4A7C15  # odd: invertible mod 2^64
_M_INV = pow(_M, -1, _MOD)
_KEYS = np.random.default_rng(0x5EED).integers(0, _MOD, 4096, dtype=np.uint64, endpoint=False)


def _powers(base: int, n: int) -> np.ndarray:
    """``base**k mod 2^64`` for ``k < n`` (numpy's uint64 products wrap mod 2^64)."""
    powers = np.full(n, base, dtype=np.uint64)
    powers[:1] = 1
    return np.cumprod(powers, out=powers)


class _Powers:
    """``M^k`` and ``M^-k`` for every block position seen so far, grown by doubling."""

    def __init__(self) -> None:
        self.up = self.down = np.ones(0, dtype=np.uint64)

    def get(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if n > len(self.up):
            size = max(n, 2 * len(self.up), 1024)
            self.up, self.down = _powers(_M, size), _powers(_M_INV, size)
        return self.up[:n], self.down[:n]


_POWERS = _Powers()


def _scramble(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, in place: a keyed sum is linear, its scramble is not."""
    x += np.uint64(0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def _root(namespace: Hashable) -> int:
    digest = hashlib.blake2b(repr(namespace).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def chain_hashes(tokens: np.ndarray, namespace: Hashable = None,
                 block_size: int = BLOCK_SIZE) -> np.ndarray:
    """The chained hash (uint64) of every full block of ``tokens``."""
    if block_size > len(_KEYS):
        raise ValueError(f"block hashing takes blocks of at most {len(_KEYS)} tokens")
    n = len(tokens) // block_size
    blocks = np.asarray(tokens[: n * block_size]).reshape(n, block_size).astype(np.uint64)
    content = _scramble(blocks @ _KEYS[:block_size])
    up, down = _POWERS.get(n)
    content *= down
    chain = np.cumsum(content, out=content)
    chain += np.uint64(_M * _root(namespace) % _MOD)
    chain *= up
    return chain


@dataclass
class BlockChains:
    """Every request's chain of block hashes, numbered densely (equal number: equal block
    and prefix), computed once per trace and replayed at any capacity.

    Request ``i``'s chain (the full blocks of prompt + output) is
    ``ids[starts[i]:starts[i + 1]]``; it may hit at most ``limits[i]`` blocks and occupies
    ``blocks[i]`` while it runs (its partial last block too)."""

    ids: np.ndarray  # int32
    starts: np.ndarray  # int64, len(requests) + 1
    limits: np.ndarray  # int64
    blocks: np.ndarray  # int64
    num_ids: int
    block_size: int

    @classmethod
    def of(cls, requests: Sequence[ReplayRequest], block_size: int = BLOCK_SIZE) -> BlockChains:
        prompt = np.array([len(r.prompt) for r in requests], dtype=np.int64)
        total = prompt + np.array([len(r.output) for r in requests], dtype=np.int64)
        starts = np.zeros(len(requests) + 1, dtype=np.int64)
        np.cumsum(total // block_size, out=starts[1:])
        hashes = np.empty(starts[-1], dtype=np.uint64)
        for r, start, end in zip(requests, starts[:-1], starts[1:], strict=True):
            hashes[start:end] = chain_hashes(np.concatenate([r.prompt, r.output]), r.namespace,
                                             block_size)
        unique, ids = np.unique(hashes, return_inverse=True)
        del hashes
        limits = np.clip((prompt - 1) // block_size, 0, np.diff(starts))
        return cls(ids.astype(np.int32), starts, limits, -(-total // block_size), len(unique),
                   block_size)


class BlockHashCache:
    """``num_blocks`` blocks of ``block_size`` tokens, LRU-evicted; ``None`` = unlimited.

    State, over dense block numbers: ``stamp[b]`` is when cached block ``b`` was last queued
    (-1: not cached, or in use by the running request), and ``queue[s]`` the block queued at
    stamp ``s``; an entry whose block was queued again since (or dropped) is stale. Every cached
    block's entry lies at or after ``head``: eviction walks from there, skipping stale entries.
    """

    def __init__(self, num_blocks: int | None, block_size: int = BLOCK_SIZE) -> None:
        if num_blocks is not None and num_blocks < 1:
            raise ValueError(f"a block cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.evicted_blocks = 0
        self.peak_blocks = 0
        self.num_cached_blocks = 0
        self._stamp = np.full(0, -1, dtype=np.int64)
        self._queue = np.zeros(0, dtype=np.int32)
        self._next_stamp = 0
        self._head = 0
        self._number: dict[int, int] = {}  # hash -> dense number, for ``serve``

    def serve(self, prompt: np.ndarray, output: np.ndarray, namespace: Hashable = None) -> int:
        """Run one request to completion; returns its prompt tokens served from cache."""
        size = self.block_size
        hashes = chain_hashes(np.concatenate([prompt, output]), namespace, size)
        number = self._number
        ids = np.array([number.setdefault(h, len(number)) for h in hashes.tolist()],
                       dtype=np.int64)
        limit = max(0, min(len(ids), (len(prompt) - 1) // size))
        blocks = -(-(len(prompt) + len(output)) // size)
        return self._serve(ids, limit, blocks, len(number)) * size

    def serve_chain(self, chains: BlockChains, index: int) -> int:
        """Run request ``index`` of ``chains``; returns its prompt tokens served from cache."""
        start, end = int(chains.starts[index]), int(chains.starts[index + 1])
        hits = self._serve(chains.ids[start:end], int(chains.limits[index]),
                           int(chains.blocks[index]), chains.num_ids)
        return hits * chains.block_size

    def _serve(self, ids: np.ndarray, limit: int, blocks: int, num_ids: int) -> int:
        self._reserve(num_ids, len(ids))
        stamp = self._stamp
        present = stamp[ids[:limit]] >= 0
        hits = limit if present.all() else int(present.argmin())
        stamp[ids[:hits]] = -1  # in use by this request: not evictable while it runs
        self.num_cached_blocks -= hits
        needed = blocks - hits
        if self.num_blocks is not None:
            self._evict(self.num_cached_blocks + hits + needed - self.num_blocks)
        self.peak_blocks = max(self.peak_blocks, self.num_cached_blocks + hits + needed)
        # Queued tail first, so the head of the sequence is the most recently used.
        queued = ids[::-1]
        was_free = stamp[queued] < 0
        stamps = np.arange(self._next_stamp, self._next_stamp + len(ids))
        stamp[queued] = stamps
        self._queue[self._next_stamp : self._next_stamp + len(ids)] = queued
        self._next_stamp += len(ids)
        # A block twice in one chain (a hash collision) is cached once, like a dict key.
        self.num_cached_blocks += int(np.count_nonzero(was_free & (stamp[queued] == stamps)))
        if self.num_blocks is not None:
            self._evict(self.num_cached_blocks - self.num_blocks)  # larger than the cache
        return hits

    def _evict(self, count: int) -> None:
        """Drop the ``count`` least recently queued cached blocks (all, if fewer)."""
        count = min(count, self.num_cached_blocks)
        stamp, queue = self._stamp, self._queue
        while count > 0:
            end = min(self._next_stamp, self._head + 2 * count + 64)
            chunk = queue[self._head : end]
            live = np.flatnonzero(stamp[chunk] == np.arange(self._head, end))[:count]
            stamp[chunk[live]] = -1
            self.num_cached_blocks -= len(live)
            self.evicted_blocks += len(live)
            count -= len(live)
            self._head = self._head + int(live[-1]) + 1 if count == 0 else end

    def _reserve(self, num_ids: int, num_stamps: int) -> None:
        if num_ids > len(self._stamp):
            grown = np.full(max(num_ids, 2 * len(self._stamp)), -1, dtype=np.int64)
            grown[: len(self._stamp)] = self._stamp
            self._stamp = grown
        if self._next_stamp + num_stamps > len(self._queue):
            grown = np.zeros(max(self._next_stamp + num_stamps, 2 * len(self._queue)),
                             dtype=np.int32)
            grown[: self._next_stamp] = self._queue[: self._next_stamp]
            self._queue = grown


def run_block_hash(requests: Iterable[tuple[np.ndarray, np.ndarray]], num_blocks: int | None,
                   block_size: int = BLOCK_SIZE) -> int:
    """Total hit tokens of ``(prompt, prompt + output)`` pairs replayed in order."""
    cache = BlockHashCache(num_blocks, block_size)
    return sum(cache.serve(prompt, full[len(prompt):]) for prompt, full in requests)
