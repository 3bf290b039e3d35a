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

Sliding-window layers in pages of their own (``--sliding-kv-ratio``): the events' group 1
(engine/contracts/kv_events.py) names the blocks whose sliding KV the replica keeps, and its
window. A match then ends where the replica's would: at the most leading cached blocks ``k``
whose window, blocks ``(k x size + 1 - W) // size`` to ``k - 1``, is kept (radix/windows.py's
``usable_length`` rule, over blocks, which are the replica's pages; the tests hold the two to
the same answers). A block's window counts where the replica reads it: the device's
(medium ``GPU``) while the block is on the device, else its host copy's (``CPU``: a match
through host-only nodes loads their windows with them). A prompt on its way keeps the window
where it ends::

    prompt's blocks    h0  h1  h2  h3  h4  h5        window 2 blocks
    held               h0  h1  h2  h3  h4  h5
    windows kept                   h3  h4            → match 5 blocks (the window before h5's
                                                       end lacks h5: 6 is not usable)
"""

from __future__ import annotations

from collections import Counter

import msgspec

from engine.contracts.kv_events import (
    HOST_MEDIUM,
    MEDIUM,
    SLIDING_GROUP,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

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
        # sliding-window layers: the blocks whose sliding KV is kept on the device, in the
        # host tier, or will be (a prompt on its way), and the window (None: the replica has
        # no such layers' pages)
        self.windows: set[int] = set()
        self.host_windows: set[int] = set()
        self.coming_windows: Counter[int] = Counter()
        self.window: int | None = None
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
                if event.group_idx == SLIDING_GROUP:
                    self.window = event.kv_cache_spec_sliding_window
                    self._windows(event.medium).update(event.block_hashes)
                    continue
                tier = self.media.setdefault(event.medium, set())
                new = [h for h in dict.fromkeys(event.block_hashes) if h not in tier]
                tier.update(new)
                self.held.update(new)
            elif isinstance(event, BlockRemoved):
                if event.group_idx == SLIDING_GROUP:
                    self._windows(event.medium).difference_update(event.block_hashes)
                    continue
                tier = self.media.get(event.medium, set())
                for h in event.block_hashes:
                    if h in tier:
                        tier.remove(h)
                        self.held[h] -= 1
                        if not self.held[h]:
                            del self.held[h]
            elif isinstance(event, AllBlocksCleared):
                self._clear()

    def _windows(self, medium: str | None) -> set[int]:
        return self.host_windows if medium == HOST_MEDIUM else self.windows

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
        self.windows.clear()
        self.host_windows.clear()

    def match(self, hashes: list[int]) -> int:
        """Leading blocks of a prompt (its chained hashes) cached here or coming, up to where
        the replica's match would end (a kept window before it)."""
        held, coming = self.held, self.coming
        found = len(hashes)
        for k, h in enumerate(hashes):
            if h not in coming and h not in held:
                found = k
                break
        if self.window is None:
            return found
        windows, coming, size = self.windows, self.coming_windows, self.block_size
        device, host = self.media.get(MEDIUM, ()), self.host_windows
        usable = run = 0  # run: kept blocks ending at block k - 1
        for k, h in enumerate(hashes[:found], 1):
            # a block on the device keeps its window there or in its host copy (a match
            # loads that back), a host-only one in its host copy
            kept = h in host or h in device and h in windows
            run = run + 1 if kept or h in coming else 0
            if run >= k - max(0, k * size + 1 - self.window) // size:
                usable = k
        return usable

    def add_coming(self, hashes: list[int], prompt_len: int) -> list[int]:
        """A prompt of ``prompt_len`` tokens (its block ``hashes``) on its way here; returns the
        blocks of the window it will keep, for ``drop_coming``."""
        self.coming.update(hashes)
        windows = ([] if self.window is None
                   else hashes[max(0, prompt_len - self.window) // self.block_size :])
        self.coming_windows.update(windows)
        return windows

    def drop_coming(self, hashes: list[int], windows: list[int]) -> None:
        for counts, dropped in ((self.coming, hashes), (self.coming_windows, windows)):
            for h in dropped:
                counts[h] -= 1
                if counts[h] <= 0:
                    del counts[h]

    def drop_all_coming(self) -> None:
        self.coming.clear()
        self.coming_windows.clear()
