"""The dispatcher's copy of what one data-parallel replica caches, rebuilt from that replica's
own KV events (``scheduler/kv_events.py``), plus the prompts it is about to cache.

The events name blocks of ``block_size`` tokens by chained hashes: a block's hash covers every
token before it too, so "the replica holds block k of this prompt" means it caches the
prompt's first ``(k + 1) * block_size`` tokens. The copy is therefore a set of block hashes, and
a prompt's match is how many of its leading block hashes the set holds::

    prompt's blocks    h0  h1  h2  h3  h4  [ tail shorter than a block ]
    replica holds      h0  h1  h2  ..  h4          → match 3 blocks (h3 was evicted; h4 alone
                                                     cannot be reached: it needs h3's prefix)

Why a set and not ``radix/RadixTree``: the events say which blocks were removed, by hash, in
the replica's own eviction order. A RadixTree evicts by its own LRU and has no "remove this
path", so it would drift from the replica; a set applies every event exactly, in O(1) per
block, and still answers "longest cached prefix" because the hashes chain. The cost sits on
the request path: one blake2b per prompt block (once per request, shared by every replica)
and one set lookup per block and replica.

Order: batches carry sequence numbers from 0. A gap (a batch lost) means the copy can no longer
be trusted: it is dropped and rebuilt from the batches that follow (``resets`` counts it). A
replica's copy then lacks the paths it had cached before the gap until they are stored anew;
a restarted replica (0 again) starts empty, and so does its copy.

``coming``: block hashes of prompts this dispatcher sent to the replica that have not finished.
The replica caches them as it prefills (its scheduler holds back a prompt whose head another
request is prefilling, then hits it), so a burst of one group's prompts goes where the first
went instead of spreading before the first prefill's events arrive.
"""

from __future__ import annotations

from collections import Counter

import msgspec

from engine.contracts.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

_decoder = msgspec.msgpack.Decoder(KVEventBatch)


class ReplicaCache:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # per medium (the device's "GPU", the host tier's "CPU"): a block is cached while any
        # tier holds it; ``held`` counts the tiers of each block so that lookups and the count
        # of blocks (every routed request reads it) cost no union of the tiers
        self.media: dict[str | None, set[int]] = {}
        self.held: Counter[int] = Counter()
        self.coming: Counter[int] = Counter()
        self.next_sequence = 0
        self.resets = 0

    def apply(self, sequence: int, payload: bytes) -> None:
        """Apply one published batch (its sequence number and msgpack payload)."""
        if sequence != self.next_sequence:
            self.drop()
        self.next_sequence = sequence + 1
        for event in _decoder.decode(payload).events:
            if isinstance(event, BlockStored):
                if event.block_size != self.block_size:
                    raise ValueError(f"KV events of {event.block_size}-token blocks, expected "
                                     f"{self.block_size}")
                tier = self.media.setdefault(event.medium, set())
                new = [h for h in dict.fromkeys(event.block_hashes) if h not in tier]
                tier.update(new)
                self.held.update(new)
            elif isinstance(event, BlockRemoved):
                tier = self.media.get(event.medium, set())
                for h in event.block_hashes:
                    if h in tier:
                        tier.remove(h)
                        self.held[h] -= 1
                        if not self.held[h]:
                            del self.held[h]
            elif isinstance(event, AllBlocksCleared):
                self._clear()

    @property
    def num_blocks(self) -> int:
        """Blocks some tier holds."""
        return len(self.held)

    def drop(self) -> None:
        """Forget everything cached (a gap in the events, or the replica died)."""
        self._clear()
        self.resets += 1

    def _clear(self) -> None:
        self.media.clear()
        self.held.clear()

    def match(self, hashes: list[int]) -> int:
        """Leading blocks of a prompt (its chained hashes) cached here or coming."""
        held, coming = self.held, self.coming
        for k, h in enumerate(hashes):
            if h not in coming and h not in held:
                return k
        return len(hashes)

    def add_coming(self, hashes: list[int]) -> None:
        self.coming.update(hashes)

    def drop_coming(self, hashes: list[int]) -> None:
        for h in hashes:
            self.coming[h] -= 1
            if self.coming[h] <= 0:
                del self.coming[h]
