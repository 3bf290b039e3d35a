"""A draft model's KV in the prefix cache's tiers (engine/worker/draft.py: its pool holds the
target's page numbers, host pages included), on the worker's I/O thread (tier_io.py).

The host tier needs nothing of its own for the moves inside a step: a write-down or a load
there is a swap, which the draft's pool and its record (``DraftSlots``) run beside the
target's. This file is the rest: the loads beside the steps and the disk tier's blocks.

A disk block's payload, with a draft model (the directory's fingerprint names the draft:
tier_io.py's ``identity``)::

    [ the target's KV of the block's pages | the draft's KV of them | tokens (int32) | ok ]
      tier_io.TierIO.payload_bytes - ...     kv_bytes                  one per slot   (uint8)

where tokens and ok are ``DraftSlots``' record of the block's slots: the token each slot's KV
is of, and whether the draft's KV there is computed (the draft computes KV only for the
sequences that draft with it, so a block may hold some, all or none of it). A block read back
gives the draft its KV and its record together, so the draft computes only what it lacked
when the block was written, and no draft forward reads KV the record does not vouch for.

Loads run on the I/O thread and write the record of the load's pages there: those pages are
the loading request's own, which no step reads or writes until the load is reported ended.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from engine.worker.draft import DraftModel

Place = Callable[[torch.Tensor, np.ndarray, torch.Tensor], "torch.cuda.Event | None"]


class DraftBlocks:
    """The draft's share of each tier move: ``copy_out`` for a disk save, ``place`` for a
    disk load, ``from_host`` for a host-tier load beside the steps."""

    def __init__(self, draft: DraftModel, pages_per_block: int) -> None:
        pool = draft.runner.pool
        self.pool, self.host, self.slots = pool.kv, pool.host, draft.slots
        self.pages_per_block = pages_per_block
        self.block_shape = (pages_per_block, self.pool.shape[0], self.pool.shape[1],
                            *self.pool.shape[3:])
        self.kv_bytes = int(np.prod(self.block_shape)) * self.pool.element_size()
        self.block_slots = pages_per_block * draft.slots.page_size
        self.payload_bytes = self.kv_bytes + 5 * self.block_slots  # KV, tokens, ok

    def copy_out(self, pages: np.ndarray, count: int) -> np.ndarray:
        """The draft's part of ``count`` blocks' payloads, [count, payload_bytes] (uint8), of
        ``pages`` (int64, block after block), in one copy; with the record as it is now (the
        step's writes come after)."""
        index = torch.from_numpy(pages).to(self.pool.device)
        kv = self.pool.index_select(2, index).movedim(2, 0).contiguous().cpu().view(torch.uint8)
        slots = self.slots.page_slots(pages)
        tokens = self.slots.tokens[slots].astype("<i4").view(np.uint8)
        ok = self.slots.ok[slots].view(np.uint8)
        return np.concatenate([kv.numpy().reshape(count, -1), tokens.reshape(count, -1),
                               ok.reshape(count, -1)], axis=1)

    def place(self, parts: list[memoryview], pages: np.ndarray,
              place: Place) -> torch.cuda.Event | None:
        """The draft's parts of blocks read back (one per block, in order) into ``pages``
        (int64, block after block): the KV through ``place`` (TierIO's), the record into
        ``DraftSlots``."""
        kv = torch.cat([torch.frombuffer(part, dtype=self.pool.dtype, count=self.kv_bytes
                                         // self.pool.element_size()).view(self.block_shape)
                        for part in parts]).movedim(0, 2)
        record = np.stack([np.frombuffer(part, np.uint8, offset=self.kv_bytes) for part in parts])
        slots = self.slots.page_slots(pages)
        tokens, ok = record[:, : 4 * self.block_slots], record[:, 4 * self.block_slots :]
        self.slots.tokens[slots] = tokens.copy().view("<i4").reshape(-1)
        self.slots.ok[slots] = ok.reshape(-1).view(bool)
        self.slots.host_of[pages] = -1  # no host page holds a copy of these
        return place(self.pool, pages, kv)

    def from_host(self, host: torch.Tensor, pages: np.ndarray,
                  place: Place) -> torch.cuda.Event | None:
        """Host pages ``host`` (the host tier's, locked while this runs) into device ``pages``:
        the draft's KV and its record of them (the record read first: the main thread's
        ``DraftSlots.written`` may refresh a host copy meanwhile, its KV first)."""
        slots = self.slots
        device_slots, host_slots = slots.page_slots(pages), slots.page_slots(host.numpy())
        slots.tokens[device_slots] = slots.host_tokens[host_slots]
        slots.ok[device_slots] = slots.host_ok[host_slots]
        slots.copy_on_host(pages, host.numpy())
        return place(self.pool, pages, self.host.index_select(2, host))
