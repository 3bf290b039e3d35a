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

With sliding-window layers in pages of their own (radix/sliding.py), a block holds the full
layers' KV only, and a *window file* beside it (``window_name``) the sliding layers' KV of its
pages, written where a window the tree keeps covers it (the window before the last block end
of a prompt, of a finished sequence; not of every prefilled chunk) and its sliding KV is
live. A load ends only where the sliding KV of the window before its end is there: the
tree's (live, up to the load's start) and the window files of the blocks after it; only
those pages take sliding pages, and the load reads their window files into them. A load
that ends early is dropped whole (the request is admitted again, its lookups ending where
that load stopped: a file that fails every read is not loaded again): the window before where
it stopped was not read::

    blocks      [ tree ...... start | block | block | block | block | block ]
    windows                                        [ file  | file  | file  ]
    load        ends at a block end whose window (W tokens before it) has files or is the tree's
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from engine.contracts.disk_blocks import DiskView, block_hashes, window_name
from engine.contracts.protocol import pack_ids
from engine.contracts.worker_messages import DiskLoad, DiskSave
from radix.sliding import SlidingKV
from scheduler.loads import PendingLoads
from scheduler.request import Seq


class DiskTier:
    """``ready``: the worker's store is set up (until then no lookups: nothing could be read;
    saves are still offered, and the worker sets the store up again when it writes).
    ``sliding``: the sliding-window layers' pages, when they are held apart (window files)."""

    def __init__(self, store: DiskView, block_tokens: int, page_size: int,
                 pending: PendingLoads, ready: bool, sliding: SlidingKV | None = None) -> None:
        self.store = store
        self.sliding = sliding
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
               limit: int, start: int | None = None) -> list[str]:
        """The blocks to load after the tree's ``cached`` tokens: from the block holding
        ``cached`` (or from ``start``, a block boundary at or below it where the tree's match
        may end) on, as many as the directory holds one after another within ``limit``
        tokens; empty unless they reach past ``cached``. With window files, they end at the
        last block whose window is there (``_window_end``)."""
        start = cached - cached % self.block if start is None else start
        first, last = start // self.block, limit // self.block
        if last * self.block <= cached or not self.on:
            return []
        names = block_hashes(self.store.fingerprint, namespace, tokens[: last * self.block],
                             self.block, first)
        found = self.store.present(names)
        if self.sliding is not None:
            found = self._window_end(names[:found], first, cached)
        return names[:found] if (first + found) * self.block > cached else []

    def _window_end(self, names: list[str], first: int, cached: int) -> int:
        """How many of ``names`` (blocks from block ``first`` on, each present) a load may
        take: the most whose end's window lies in the tree (before block ``first``, whose
        match holds it live) or in blocks whose window file is there."""
        has: dict[int, bool] = {}
        for count in range(len(names), 0, -1):
            end = (first + count) * self.block
            if end <= cached:
                break
            lo = max(self.sliding.window_start(end) * self.page_size // self.block, first)
            for k in range(lo, first + count):
                if k not in has:
                    has[k] = self.store.contains(window_name(names[k - first]))
                if not has[k]:
                    break
            else:
                return count
        return 0

    def plan_load(self, seq: Seq, start: int, names: list[str]) -> None:
        """Load ``names`` into ``seq``'s pages from token ``start`` (a block boundary) on (and
        their windows' files into the sliding pages those pages have: the window before the
        load's end, ``Lease.acquire(..., reads_from=...)``)."""
        load_id = self.pending.register(seq, start, self.block, len(names), "disk")
        first = start // self.page_size
        pages = seq.pages[first : first + len(names) * self.pages_per_block]
        swa = pack_ids(self.sliding.live(pages)) if self.sliding is not None else b""
        self.loads.append(DiskLoad(load_id, names, pack_ids(pages), swa))

    def plan_saves(self, namespace: Hashable, tokens: Sequence[int], table: Sequence[int],
                   start: int, end: int, windows: bool = False) -> None:
        """Save the whole blocks of ``tokens[:end]`` from the one holding ``start`` on (their
        KV in ``table``) that the directory lacks (a ``stat`` each: files another server wrote,
        or the capacity trimmed, are seen as they are now). ``windows`` (where the tree keeps
        a window: a prompt's end, a finished sequence's): with window files, also the window
        files it lacks of the blocks of the window before the last block's end whose sliding
        KV is live, saved earlier or not."""
        whole = end - end % self.block
        fresh = start // self.block  # the first block not saved before
        windows = windows and self.sliding is not None
        window = (self.sliding.window_start(whole) * self.page_size // self.block if windows
                  else fresh)
        first = min(fresh, window)
        if whole // self.block <= first or not self.store.enabled:
            return
        names = block_hashes(self.store.fingerprint, namespace, tokens[:whole], self.block,
                             first)
        per, contains = self.pages_per_block, self.store.contains
        for k, name in enumerate(names, first):
            pages = table[k * per : (k + 1) * per]
            swa = b""
            if windows and k >= window:
                live = self.sliding.live(pages)
                if (live >= 0).all() and not contains(window_name(name)):
                    swa = pack_ids(live)
            full = k >= fresh and not contains(name)
            if full or swa:
                self.saves.append(DiskSave(name, pack_ids(pages) if full else b"", swa))
                self.blocks_saved += full

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
