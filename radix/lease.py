"""The one way to drive the tree: a lease is a holder's use of its longest cached prefix.

Every user of the tree (the scheduler, the profiler's replay, the tests' simulator) goes
through these steps, in this order::

    lease = tree.lease(tokens, namespace, max_len)   # match the longest prefix and lock it
    table, copy = lease.acquire(num_tokens)          # share its full pages, allocate the rest;
                                                     # a match ending inside a page plans the
                                                     # copy of that page's matched slots
    ... run ``copy`` (if any), then drop its source reference ...
    ... compute KV for positions [lease.length, num_tokens) into ``table`` ...
    lease.release(table, tokens)                     # insert, unlock, drop the table's references

**Matched pages are valid only while the match is locked.** ``lease.match.pages`` may be
evicted and reused once the lease is unlocked; ``acquire`` refuses to run on an unlocked lease.
The table ``acquire`` returns holds its own references (one per page), so it stays valid after
``unlock``: a holder that lets its lock go early (a sequence swapped out to host) keeps what it
shares. The copy's source page carries one more reference, the holder's, until the copy has run
(``allocator.decref([copy.src])``): a freed source could be reused before the copy reads it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from radix.tree import PrefixMatch, RadixTree


@dataclass(frozen=True)
class PageCopy:
    """Copy the first ``num_slots`` slots of page ``src`` into page ``dst`` before writing it."""

    src: int
    dst: int
    num_slots: int


class Lease:
    """A locked match in ``tree``, and the steps that turn it into a page table and back."""

    __slots__ = ("tree", "match", "namespace", "_locked")

    def __init__(self, tree: RadixTree, match: PrefixMatch, namespace: Hashable) -> None:
        self.tree = tree
        self.match = match
        self.namespace = namespace
        tree.lock(match.node)
        self._locked = True

    @property
    def length(self) -> int:
        """Tokens of the prefix found in the cache."""
        return self.match.length

    @property
    def locked(self) -> bool:
        return self._locked

    def pages_to_acquire(self, num_tokens: int) -> int:
        """Fresh pages ``acquire(num_tokens)`` allocates (the match's full pages are shared)."""
        return self.tree.allocator.pages_for(num_tokens) - len(self.match.full_pages)

    def acquire(self, num_tokens: int) -> tuple[list[int], PageCopy | None]:
        """A page table for positions ``[0, num_tokens)``: the match's full pages (a new reference
        each), then fresh pages, evicting unlocked leaves when short. When the match ends inside
        a page, the first fresh page is to receive that page's matched slots: the returned copy,
        whose source holds one more reference for the holder. Raises ``OutOfPages`` having
        changed nothing."""
        if not self._locked:
            raise RuntimeError("acquire on an unlocked lease: its matched pages may be gone")
        if num_tokens < self.match.length:
            raise ValueError(f"a table for {num_tokens} tokens cannot hold the "
                             f"{self.match.length}-token match")
        full = self.match.full_pages
        fresh = self.tree.alloc_pages(self.pages_to_acquire(num_tokens))
        alloc = self.tree.allocator
        alloc.incref(full)
        copy = None
        if self.match.partial_len:
            copy = PageCopy(self.match.partial_page, fresh[0], self.match.partial_len)
            alloc.incref([copy.src])
        return full.tolist() + fresh, copy

    def unlock(self) -> None:
        """Let the matched path be evicted again (idempotent). The table stays valid."""
        if self._locked:
            self.tree.unlock(self.match.node)
            self._locked = False

    def fork(self) -> Lease:
        """A lease for another holder of the same prefix (a parallel sample, a beam): it locks
        the same path, so either may release first."""
        if not self._locked:
            return Lease(self.tree, self.tree.match_prefix((), self.namespace, count=False),
                         self.namespace)
        return Lease(self.tree, self.match, self.namespace)

    def release(self, table: Sequence[int] | np.ndarray,
                tokens: Sequence[int] | np.ndarray | None = None) -> int:
        """End the lease: with ``tokens``, first cache them (their KV sits in ``table``, from
        position 0); then unlock and drop the table's references. Returns how many of
        ``tokens`` were cached already."""
        cached = 0
        if tokens is not None and len(tokens):
            cached = self.tree.insert(tokens, table, self.namespace)
        self.unlock()
        self.tree.allocator.decref(table)
        return cached
