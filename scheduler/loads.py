"""Loads that run beside the steps: KV copied into a sequence's own fresh pages by the worker's
I/O thread (engine/worker/tier_io.py), from the disk tier's files (scheduler/disk.py) or from
the host tier's pages (``Lease.acquire_unloaded``: the tree is left as it is until the load
has ended). The sequence waits (``Status.LOADING``, in no batch) while other requests step;
a later ``BatchResult.loads_ended`` says how much arrived, which is then committed to the tree
like a prefilled chunk, and the sequence computes the rest::

    table     [ shared device pages | own pages: the load's ........ | own pages: to compute ]
    tokens    0 ................. start ......... start + arrived ........... len(tokens)

A sequence that ends while its load runs leaves its pages here (``orphans``) until the load
has ended: the I/O thread may still be writing them.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.contracts.worker_messages import HostLoad
from scheduler.request import Seq


@dataclass
class Pending:
    seq: Seq
    start: int  # the first token the load writes (a page boundary)
    unit: int  # tokens per unit the worker counts (a disk block; a host load is one unit)
    asked: int  # units asked for
    kind: str  # "disk" or "host"


class PendingLoads:
    def __init__(self) -> None:
        self.waiting: dict[int, Pending] = {}
        self.orphans: dict[int, list[int]] = {}
        # of an orphan's pages, those whose sliding KV it holds (with sliding-window layers)
        self.orphan_windows: dict[int, list[int]] = {}
        self.host: list[HostLoad] = []  # host loads planned since the last batch
        self._next_id = 0

    @property
    def busy(self) -> bool:
        """Loads to send, or loads the worker has not reported ended."""
        return bool(self.waiting or self.orphans or self.host)

    def register(self, seq: Seq, start: int, unit: int, asked: int, kind: str) -> int:
        load_id = self._next_id
        self._next_id += 1
        self.waiting[load_id] = Pending(seq, start, unit, asked, kind)
        seq.load_id = load_id
        return load_id

    def take_host(self) -> list[HostLoad]:
        loads, self.host = self.host, []
        return loads

    def abandon(self, seq: Seq, windows: list[int] | None = None) -> None:
        """``seq`` ends while its load runs: its pages stay here until the load has ended (and
        the sliding KV it holds of ``windows``, its pages from its window on)."""
        self.orphans[seq.load_id] = seq.pages
        if windows:
            self.orphan_windows[seq.load_id] = windows
        self.waiting.pop(seq.load_id)
        seq.load_id = -1

    def ended(self, load_id: int, arrived: int
              ) -> tuple[Pending | None, list[int], list[int]]:
        """A load ended with ``arrived`` units in the pages: what it was (None if its sequence
        ended meanwhile), the pages to drop (that sequence's) and those whose sliding KV to
        drop."""
        orphan = self.orphans.pop(load_id, None)
        if orphan is not None:
            return None, orphan, self.orphan_windows.pop(load_id, [])
        pending = self.waiting.pop(load_id)
        pending.seq.load_id = -1
        return pending, [], []
