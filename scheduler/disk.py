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
and waits for their load (scheduler/loads.py) while the tree keeps serving the prefix below;
a block that was missing or failed its checks ends the load there and is computed.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from engine.contracts.disk_blocks import DiskView, block_hashes
from engine.contracts.protocol import pack_ids
from engine.contracts.worker_messages import DiskLoad, DiskSave
from scheduler.loads import PendingLoads
from scheduler.request import Seq


class DiskTier:
    """``ready``: the worker's store is set up (until then no lookups: nothing could be read;
    saves are still offered, and the worker sets the store up again when it writes)."""

    def __init__(self, store: DiskView, block_tokens: int, page_size: int,
                 pending: PendingLoads, ready: bool) -> None:
        self.store = store
        self.ready = ready
        self.block = block_tokens
        self.pages_per_block = block_tokens // page_size
        self.page_size = page_size
        self.pending = pending
        self.saves: list[DiskSave] = []
        self.loads: list[DiskLoad] = []
        self.hit_tokens = self.blocks_saved = self.blocks_loaded = self.load_failures = 0

    @property
    def on(self) -> bool:
        """Serving: the worker's store is set up and its directory there."""
        return self.ready and self.store.enabled

    @property
    def busy(self) -> bool:
        """Saves or loads to send."""
        return bool(self.saves or self.loads)

    def lookup(self, tokens: Sequence[int], namespace: Hashable, cached: int,
               limit: int) -> list[str]:
        """The blocks to load after the tree's ``cached`` tokens: from the block holding
        ``cached`` on, as many as the directory holds one after another within ``limit``
        tokens; empty unless they reach past ``cached``."""
        first, last = cached // self.block, limit // self.block
        if last * self.block <= cached or not self.on:
            return []
        names = block_hashes(self.store.fingerprint, namespace, tokens[: last * self.block],
                             self.block, first)
        found = self.store.present(names)
        return names[:found] if (first + found) * self.block > cached else []

    def plan_load(self, seq: Seq, start: int, names: list[str]) -> None:
        """Load ``names`` into ``seq``'s pages from token ``start`` (a block boundary) on."""
        load_id = self.pending.register(seq, start, self.block, len(names), "disk")
        first = start // self.page_size
        pages = seq.pages[first : first + len(names) * self.pages_per_block]
        self.loads.append(DiskLoad(load_id, names, pack_ids(pages)))

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

    def loaded(self, arrived: int, asked: int) -> None:
        """A disk load ended with ``arrived`` of its ``asked`` blocks."""
        self.blocks_loaded += arrived
        self.load_failures += arrived < asked
        self.hit_tokens += arrived * self.block

    def stats(self) -> dict[str, int]:
        return {"disk_block_tokens": self.block, "disk_on": int(self.on),
                "disk_hit_tokens": self.hit_tokens,
                "disk_blocks_saved": self.blocks_saved, "disk_blocks_loaded": self.blocks_loaded,
                "disk_load_failures": self.load_failures}
