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
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

import numpy as np

BLOCK_SIZE = 16


class BlockHashCache:
    """``num_blocks`` blocks of ``block_size`` tokens, LRU-evicted; ``None`` = unlimited."""

    def __init__(self, num_blocks: int | None, block_size: int = BLOCK_SIZE) -> None:
        if num_blocks is not None and num_blocks < 1:
            raise ValueError(f"a block cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.evicted_blocks = 0
        self.peak_blocks = 0
        # Cached, evictable blocks by hash, least recently used first.
        self._lru: OrderedDict[int, None] = OrderedDict()

    @property
    def num_cached_blocks(self) -> int:
        return len(self._lru)

    def _chain(self, tokens: np.ndarray, namespace: Hashable) -> list[int]:
        data = np.ascontiguousarray(tokens, dtype=np.int32).tobytes()
        step = 4 * self.block_size
        parent = hash(("block-hash-root", namespace))
        chain = []
        for start in range(0, len(data) - step + 1, step):
            parent = hash((parent, data[start : start + step]))
            chain.append(parent)
        return chain

    def serve(self, prompt: np.ndarray, output: np.ndarray, namespace: Hashable = None) -> int:
        """Run one request to completion; returns its prompt tokens served from cache."""
        lru, size = self._lru, self.block_size
        chain = self._chain(np.concatenate([prompt, output]), namespace)
        limit = min(len(chain), (len(prompt) - 1) // size)
        hits = 0
        while hits < limit and chain[hits] in lru:
            hits += 1
        for h in chain[:hits]:  # in use by this request: not evictable while it runs
            del lru[h]
        needed = -(-(len(prompt) + len(output)) // size) - hits
        if self.num_blocks is not None:
            while lru and len(lru) + hits + needed > self.num_blocks:
                lru.popitem(last=False)
                self.evicted_blocks += 1
        self.peak_blocks = max(self.peak_blocks, len(lru) + hits + needed)
        for h in reversed(chain):
            lru[h] = None
            lru.move_to_end(h)
        if self.num_blocks is not None:
            while len(lru) > self.num_blocks:  # a request larger than the whole cache
                lru.popitem(last=False)
                self.evicted_blocks += 1
        return hits * size


def run_block_hash(requests: Iterable[tuple[np.ndarray, np.ndarray]], num_blocks: int | None,
                   block_size: int = BLOCK_SIZE) -> int:
    """Total hit tokens of ``(prompt, prompt + output)`` pairs replayed in order."""
    cache = BlockHashCache(num_blocks, block_size)
    return sum(cache.serve(prompt, full[len(prompt):]) for prompt, full in requests)
