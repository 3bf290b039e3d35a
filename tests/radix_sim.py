"""A tiny scheduler stand-in for radix tests: admits sequences through a lease, as the scheduler
does (match, lock, allocate, copy-on-write of a partial page), and keeps a shadow of slot contents."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from radix import Lease, PageAllocator, PrefixMatch, RadixTree


@dataclass
class SimSeq:
    tokens: list[int]
    pages: list[int]
    lease: Lease


class Sim:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.alloc = PageAllocator(num_pages, page_size)
        self.tree = RadixTree(self.alloc)
        self.page_size = page_size
        # shadow[slot] = (token id, position) the slot's KV was computed for; -1 = never written
        self.shadow = np.full((num_pages * page_size, 2), -1, dtype=np.int64)
        self.running: list[SimSeq] = []

    def slot(self, pages: list[int], pos: int) -> int:
        return pages[pos // self.page_size] * self.page_size + pos % self.page_size

    def verify_match(self, tokens: list[int], match: PrefixMatch) -> None:
        for pos in range(match.length):
            got = tuple(self.shadow[self.slot(match.pages, pos)])
            assert got == (tokens[pos], pos), f"slot for position {pos} holds {got}"

    def admit(self, tokens: list[int], namespace=None) -> SimSeq:
        """Lease at most len - 1 tokens, acquire the table, run the copy, write the rest."""
        lease = self.tree.lease(tokens, namespace, max_len=len(tokens) - 1)
        self.verify_match(tokens, lease.match)
        try:
            pages, copy = lease.acquire(len(tokens))
        except Exception:
            lease.unlock()
            raise
        if copy is not None:
            base_src, base_dst = copy.src * self.page_size, copy.dst * self.page_size
            self.shadow[base_dst : base_dst + copy.num_slots] = (
                self.shadow[base_src : base_src + copy.num_slots]
            )
            self.alloc.decref([copy.src])
        for pos in range(lease.length, len(tokens)):
            self.shadow[self.slot(pages, pos)] = (tokens[pos], pos)
        seq = SimSeq(list(tokens), pages, lease)
        self.running.append(seq)
        return seq

    def finish(self, seq: SimSeq, *, cache: bool = True) -> int:
        """Release ``seq``: with ``cache``, its tokens go into the tree first."""
        self.running.remove(seq)
        return seq.lease.release(seq.pages, seq.tokens if cache else None)

    def fork(self, seq: SimSeq) -> SimSeq:
        """Another holder of ``seq``'s pages (a parallel sample), with its own lease."""
        self.alloc.incref(seq.pages)
        child = SimSeq(list(seq.tokens), list(seq.pages), seq.lease.fork())
        self.running.append(child)
        return child

    def external_refs(self) -> np.ndarray:
        refs = np.zeros(self.alloc.num_pages, dtype=np.int64)
        for seq in self.running:
            np.add.at(refs, seq.pages, 1)
        return refs

    def check(self) -> None:
        self.tree.check(self.external_refs())
