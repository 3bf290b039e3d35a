"""A tiny scheduler stand-in for radix tests: drives the tree only through leases, as the
scheduler does (admit: match, lock, allocate, copy-on-write of a partial page; commit a
prefix mid-life; grow; fork; release), and keeps a shadow of slot contents."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from radix import Lease, PageAllocator, PageCopy, PrefixMatch, RadixTree


@dataclass
class SimSeq:
    tokens: list[int]
    pages: list[int]
    lease: Lease
    namespace: Hashable
    locked_len: int  # tokens its lock keeps in the tree: the match, then what it committed
    shares_last_page: bool = False  # a fork's partial last page, not yet copied


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

    def _run_copy(self, copy: PageCopy) -> None:
        """What the worker does before a step's forward; then the source reference goes."""
        base_src, base_dst = copy.src * self.page_size, copy.dst * self.page_size
        self.shadow[base_dst : base_dst + copy.num_slots] = (
            self.shadow[base_src : base_src + copy.num_slots]
        )
        self.alloc.decref([copy.src])

    def _write(self, seq: SimSeq, start: int) -> None:
        for pos in range(start, len(seq.tokens)):
            self.shadow[self.slot(seq.pages, pos)] = (seq.tokens[pos], pos)

    def admit(self, tokens: list[int], namespace=None) -> SimSeq:
        """Lease at most len - 1 tokens, acquire the table, run the copy, write the rest."""
        lease = Lease(self.tree, tokens, namespace, max_len=len(tokens) - 1)
        self.verify_match(tokens, lease.match)
        try:
            pages, copy = lease.acquire(len(tokens))
        except Exception:
            lease.unlock()
            raise
        if copy is not None:
            self._run_copy(copy)
        seq = SimSeq(list(tokens), pages, lease, namespace, lease.length)
        self._write(seq, lease.length)
        self.running.append(seq)
        return seq

    def commit(self, seq: SimSeq, upto: int) -> int:
        """Cache ``seq``'s first ``upto`` tokens mid-life (a prefilled chunk)."""
        cached = seq.lease.commit(seq.pages, seq.tokens[:upto])
        if seq.lease.locked:
            seq.locked_len = max(seq.locked_len, upto)
        return cached

    def grow(self, seq: SimSeq, tokens: list[int]) -> None:
        """Append ``tokens`` to ``seq`` (decoding), first copying a shared last page."""
        start = len(seq.tokens)
        copy = seq.lease.grow(seq.pages, start + len(tokens),
                              unshare_at=start if seq.shares_last_page else None)
        if copy is not None:
            self._run_copy(copy)
        seq.shares_last_page = False
        seq.tokens += tokens
        self._write(seq, start)

    def unlock(self, seq: SimSeq) -> None:
        """``seq`` lets its lock go early (a swap-out); its table stays valid."""
        seq.lease.unlock()
        seq.locked_len = 0

    def finish(self, seq: SimSeq, *, cache: bool = True) -> int:
        """Release ``seq``: with ``cache``, its tokens go into the tree first."""
        self.running.remove(seq)
        return seq.lease.release(seq.pages, seq.tokens if cache else None)

    def fork(self, seq: SimSeq) -> SimSeq:
        """Another holder of ``seq``'s pages (a parallel sample), with its own lease; it copies
        the partial last page they share before writing into it."""
        lease, pages = seq.lease.fork(seq.pages)
        child = SimSeq(list(seq.tokens), pages, lease, seq.namespace, seq.locked_len,
                       shares_last_page=len(seq.tokens) % self.page_size != 0)
        self.running.append(child)
        return child

    def external_refs(self) -> np.ndarray:
        refs = np.zeros(self.alloc.num_pages, dtype=np.int64)
        for seq in self.running:
            np.add.at(refs, seq.pages, 1)
        return refs

    def check(self) -> None:
        """The accounting invariant, and what every holder relies on (``check_holders``)."""
        self.tree.check(self.external_refs())
        self.check_holders()

    def check_holders(self) -> None:
        """Every running sequence's table holds its own tokens' KV, and its locked path is
        still in the tree, to its last token."""
        for seq in self.running:
            for pos, token in enumerate(seq.tokens):
                got = tuple(self.shadow[self.slot(seq.pages, pos)])
                assert got == (token, pos), f"a table's slot for position {pos} holds {got}"
            locked = seq.tokens[: seq.locked_len]
            assert self.tree.peek_prefix(locked, seq.namespace) == len(locked), (
                f"a locked path of {len(locked)} tokens lost its tail")
