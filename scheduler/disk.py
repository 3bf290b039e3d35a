"""The scheduler's side of the disk tier (``--disk-cache-dir``, engine/contracts/disk_cache.py):
which blocks to save, which to load, and who waits for a load.

The disk tier sits beside the radix tree, not in it: it holds whole blocks of
``block_tokens`` tokens, named by the chained hash of their prefix, written through as the
tree caches them (a prefilled chunk, a finished sequence) so that they survive a restart or a
crash, and read back when a request's prompt continues past what the tree holds::

    prompt      [ tree: device (+ host) ...... cached | .......................... ]
    disk        [ block | block | block | block ][ block | block ]   <- present files
    load        from the block holding ``cached`` (page-aligned) to the last present one

A request whose prompt the disk continues is admitted with pages up to the end of those blocks
and waits (``Status.LOADING``) while the worker's I/O thread reads them into the pages; the
tree keeps serving the prefix below. When a later step's result reports the blocks that
arrived, they are committed to the tree like a prefilled chunk and the request prefills the
rest; a block that was missing or failed its checks is simply computed. A request that ends
while its load runs leaves its pages here (``orphans``) until the load has ended: the I/O thread
may still be writing them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from engine.contracts.disk_cache import DiskStore, block_hashes
from engine.contracts.protocol import DiskLoad, DiskSave, pack_ids
from scheduler.request import Seq


class DiskTier:
    def __init__(self, store: DiskStore, block_tokens: int, page_size: int) -> None:
        self.store = store
        self.block = block_tokens
        self.pages_per_block = block_tokens // page_size
        self.page_size = page_size
        self.saves: list[DiskSave] = []
        self.loads: list[DiskLoad] = []
        # load id -> (the sequence, the first token it loads, blocks asked for); a sequence that
        # ended while its load ran leaves its pages in ``orphans`` instead
        self.loading: dict[int, tuple[Seq, int, int]] = {}
        self.orphans: dict[int, list[int]] = {}
        self._next_id = 0
        self.hit_tokens = self.blocks_saved = self.blocks_loaded = self.load_failures = 0

    @property
    def busy(self) -> bool:
        """Work to send, or loads the worker has not reported yet."""
        return bool(self.saves or self.loads or self.loading or self.orphans)

    def lookup(self, tokens: Sequence[int], namespace: Hashable, cached: int,
               limit: int) -> list[str]:
        """The blocks to load after the tree's ``cached`` tokens: from the block holding
        ``cached`` on, as many as the directory holds one after another within ``limit``
        tokens; empty unless they reach past ``cached``."""
        first, last = cached // self.block, limit // self.block
        if last * self.block <= cached or not self.store.enabled:
            return []
        names = block_hashes(self.store.fingerprint, namespace, tokens[: last * self.block],
                             self.block, first)
        found = self.store.present(names)
        return names[:found] if (first + found) * self.block > cached else []

    def plan_load(self, seq: Seq, start: int, names: list[str]) -> None:
        """Load ``names`` into ``seq``'s pages from token ``start`` (a block boundary) on."""
        load_id = self._next_id
        self._next_id += 1
        first = start // self.page_size
        pages = seq.pages[first : first + len(names) * self.pages_per_block]
        self.loads.append(DiskLoad(load_id, names, pack_ids(pages)))
        self.loading[load_id] = (seq, start, len(names))
        seq.disk_load = load_id

    def plan_saves(self, namespace: Hashable, tokens: Sequence[int], table: Sequence[int],
                   start: int, end: int) -> None:
        """Save the whole blocks of ``tokens[:end]`` from the one holding ``start`` on (their
        KV in ``table``) that the directory lacks (a ``stat`` each: files another server wrote,
        or the capacity trimmed, are seen as they are now)."""
        first = start // self.block
        count = end // self.block - first
        if count <= 0 or not self.store.enabled:
            return
        names = block_hashes(self.store.fingerprint, namespace, tokens[: end - end % self.block],
                             self.block, first)
        per = self.pages_per_block
        for k, name in enumerate(names, first):
            if not self.store.contains(name):
                self.saves.append(DiskSave(name, pack_ids(table[k * per : (k + 1) * per])))
                self.blocks_saved += 1

    def take(self) -> tuple[list[DiskSave], list[DiskLoad]]:
        """The saves and loads planned since the last batch, for the next one."""
        saves, loads, self.saves, self.loads = self.saves, self.loads, [], []
        return saves, loads

    def abandon(self, seq: Seq) -> list[int]:
        """``seq`` ends while its load runs: its pages stay here until the load ends (returned
        empty: the caller drops nothing)."""
        self.orphans[seq.disk_load] = seq.pages
        self.loading.pop(seq.disk_load)
        seq.disk_load = -1
        return []

    def loaded(self, load_id: int, blocks: int) -> tuple[Seq | None, int, list[int]]:
        """A load ended with ``blocks`` in the pages: its sequence (None if it ended meanwhile),
        the tokens it now holds, and pages to drop (an ended sequence's)."""
        orphan = self.orphans.pop(load_id, None)
        if orphan is not None:
            return None, 0, orphan
        seq, start, asked = self.loading.pop(load_id)
        seq.disk_load = -1
        self.blocks_loaded += blocks
        self.load_failures += blocks < asked
        self.hit_tokens += blocks * self.block
        return seq, start + blocks * self.block, []

    def stats(self) -> dict[str, int]:
        return {"disk_block_tokens": self.block, "disk_hit_tokens": self.hit_tokens,
                "disk_blocks_saved": self.blocks_saved, "disk_blocks_loaded": self.blocks_loaded,
                "disk_load_failures": self.load_failures}
