"""A tiny scheduler stand-in for radix tests: admits sequences the way the scheduler does
(match, lock, copy-on-write of a partial page, allocate) and keeps a shadow of slot contents."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from radix import PageAllocator, PrefixMatch, RadixTree


@dataclass
class SimSeq:
    tokens: list[int]
    pages: list[int]
    match: PrefixMatch


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
        """Match at most len - 1 tokens, lock, copy the partial page, allocate the rest."""
        tree, P = self.tree, self.page_size
        match = tree.match_prefix(tokens, namespace, max_len=len(tokens) - 1)
        self.verify_match(tokens, match)
        tree.lock(match.node)
        full = match.full_pages
        need = self.alloc.pages_for(len(tokens)) - len(full)
        try:
            fresh = tree.alloc_pages(need)
        except Exception:
            tree.unlock(match.node)
            raise
        self.alloc.incref(full)
        pages = full + [int(p) for p in fresh]
        if match.partial_len:
            src, dst = match.partial_page, pages[len(full)]
            base_src, base_dst = src * P, dst * P
            self.shadow[base_dst : base_dst + match.partial_len] = (
                self.shadow[base_src : base_src + match.partial_len]
            )
        for pos in range(match.length, len(tokens)):
            self.shadow[self.slot(pages, pos)] = (tokens[pos], pos)
        seq = SimSeq(list(tokens), pages, match)
        self.running.append(seq)
        return seq

    def finish(self, seq: SimSeq, namespace=None) -> int:
        cached = self.tree.insert(seq.tokens, seq.pages, namespace)
        self.tree.unlock(seq.match.node)
        self.alloc.decref(seq.pages)
        self.running.remove(seq)
        return cached

    def external_refs(self) -> np.ndarray:
        refs = np.zeros(self.alloc.num_pages, dtype=np.int64)
        for seq in self.running:
            np.add.at(refs, seq.pages, 1)
        return refs

    def check(self) -> None:
        self.tree.check(self.external_refs())
