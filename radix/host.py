"""The host tier (L2): host memory under the radix tree, for KV the device pool lets go.

The tree decides where each node's KV lives (``Node.pages`` on the device, ``Node.host_pages``
here, or both: radix/tree.py); this tier holds what that needs beside the tree:

- **Pages.** Its own ``PageAllocator`` over ``num_pages`` host pages, with the device pool's
  rules: one reference per node that lists a page (a node split inside a page shares that host
  page), evictable while the node is unlocked, so ``free + evictable + pinned == total`` holds
  here too and ``RadixTree.check`` asserts it. The worker keeps one host tensor: swap
  preemption's pages (``SeqMemory``, private to a sequence, never refcounted) first, then these,
  so host page ``p`` of this tier is the worker's ``first_page + p``. Two budgets, not one pool
  for both users: a swap-out must never wait for the cache to make room, and a cache that
  could take swap's pages would make preemption fail under exactly the load that needs it.
- **Moves.** Copies the tree planned and no step has carried yet: write-downs (device page to
  host page) and loads (host page to device page). The scheduler takes them into the next step
  it sends (``take_moves``: ``BatchInput.swap_out`` / ``swap_in``), where the worker runs every
  write-down, then every load, then the step's copy-on-writes, then the forward. So a device page
  written down and freed while a step is planned may take that step's load or new tokens: it is
  read before it is written. A host page a load reads belongs to a node its loading lease keeps
  locked while the step is planned, so no write-down of that step reuses it; a host page freed
  while its write-down is still planned drops that write-down (``drop_write_downs``).
- **Windows.** With sliding-window layers (radix/sliding.py), ``swa``: host pages for the
  sliding layers' KV of the windows a node keeps (``Node.host_swa_pages``, beside its
  ``host_pages``), refcounted and evictable as the node's host pages are, with write-downs and
  loads of their own (``take_window_moves``: ``BatchInput.swa_swap_out`` / ``swa_swap_in``,
  run beside the full pages'). The worker's sliding host pages are laid out as its full ones:
  swap's first, then these (``first_page`` on). ``--host-cache-gb`` pays for both kinds: a
  host page and its ``--sliding-kv-ratio`` share of a sliding one (engine/worker/runner.py).
- **Policy** (SGLang's names). ``write_back``: a node is copied down when the device evicts it.
  ``write_through``: as soon as it is cached. ``write_through_selective``: once
  ``selective_hits`` matches reached it. Under the write-through policies a node evicted from
  the device without a host copy is dropped, as SGLang does: what was never hot enough to be
  copied is not worth a copy at eviction either.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from radix.pages import PageAllocator

WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
SELECTIVE_HITS = 2  # SGLang's write-through threshold for write_through_selective


class HostTier:
    def __init__(self, num_pages: int, page_size: int, policy: str = "write_back",
                 first_page: int = 0, selective_hits: int = SELECTIVE_HITS,
                 num_sliding_pages: int = 0) -> None:
        if policy not in WRITE_POLICIES:
            raise ValueError(f"the host tier's write policy must be one of "
                             f"{', '.join(WRITE_POLICIES)}, got {policy!r}")
        self.allocator = PageAllocator(num_pages, page_size)
        self.policy = policy
        self.first_page = first_page
        self.selective_hits = selective_hits
        self._write_downs: dict[int, int] = {}  # host page -> the device page copied into it
        self._loads: list[tuple[int, int]] = []  # (host page, device page)
        # the windows' pages and moves (sliding pages, host and device)
        self.swa = PageAllocator(num_sliding_pages, page_size) if num_sliding_pages else None
        self._swa_write_downs: dict[int, int] = {}
        self._swa_loads: list[tuple[int, int]] = []

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def write_back(self) -> bool:
        return self.policy == "write_back"

    # ------------------------------------------------------------------ moves
    def plan_write_down(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        self._write_downs.update(zip(host_pages, device_pages, strict=True))

    def plan_loads(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> None:
        self._loads.extend(zip(host_pages, device_pages, strict=True))

    def plan_window_write_down(self, sliding_pages: Sequence[int],
                               host_pages: Sequence[int]) -> None:
        self._swa_write_downs.update(zip(host_pages, sliding_pages, strict=True))

    def plan_window_loads(self, host_pages: Sequence[int], sliding_pages: Sequence[int]) -> None:
        self._swa_loads.extend(zip(host_pages, sliding_pages, strict=True))

    def drop_window_write_downs(self, freed: Sequence[int]) -> None:
        """``drop_write_downs`` for freed sliding host pages."""
        for page in freed:
            self._swa_write_downs.pop(page, None)

    def take_window_moves(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """``take_moves`` for the windows' sliding pages."""
        base = self.first_page
        downs = [(device, base + host) for host, device in self._swa_write_downs.items()]
        loads = [(base + host, device) for host, device in self._swa_loads]
        self._swa_write_downs, self._swa_loads = {}, []
        return downs, loads

    def drop_write_downs(self, freed: Sequence[int]) -> None:
        """Host pages that went free before their write-down was sent: nothing reads them, and
        a page written twice in one step would be written in no defined order."""
        if self._write_downs:
            for page in freed:
                self._write_downs.pop(page, None)

    def take_moves(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The planned moves in the worker's page numbers, and forget them: write-downs as
        ``(device, host)`` pairs, loads as ``(host, device)`` pairs."""
        base = self.first_page
        downs = [(device, base + host) for host, device in self._write_downs.items()]
        loads = [(base + host, device) for host, device in self._loads]
        self._write_downs, self._loads = {}, []
        return downs, loads

    @property
    def has_moves(self) -> bool:
        return bool(self._write_downs or self._loads)

    def check(self, device_refcount: np.ndarray,
              sliding_refcount: np.ndarray | None = None) -> None:
        """Every planned move names pages in use: a write-down's host page, a load's both (and
        so for the windows' sliding pages)."""
        rc = self.allocator.refcount
        assert all(rc[h] > 0 for h in self._write_downs), "a write-down into a free host page"
        assert all(rc[h] > 0 and device_refcount[d] > 0 for h, d in self._loads), (
            "a load from or into a free page")
        if self.swa is not None and sliding_refcount is not None:
            rc = self.swa.refcount
            assert all(rc[h] > 0 for h in self._swa_write_downs), (
                "a window's write-down into a free host page")
            assert all(rc[h] > 0 and sliding_refcount[d] > 0 for h, d in self._swa_loads), (
                "a window's load from or into a free page")
