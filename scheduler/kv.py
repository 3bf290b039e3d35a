"""Sequences' pages over the radix cache: admission, growth, forks, swaps and release.

Who holds what: a sequence holds one reference per page in its table and one per pending
copy source (until the batch that runs the copy has come back). The tree holds its own. A
sequence pins (locks) the tree path it matched at admission until it is released. Copies and
swaps are only *planned* here: they go into the next batch, and the worker runs them before
that batch's forward, so a page freed in this step can be reused by this step's writes.
"""

from __future__ import annotations

import numpy as np

from radix import OutOfPages, PrefixMatch, RadixTree
from scheduler.request import Seq


class StepWork:
    """Page copies and swaps collected while planning one step."""

    def __init__(self) -> None:
        self.copies: list[tuple[int, int, int]] = []
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []


class SeqMemory:
    def __init__(self, tree: RadixTree, num_host_pages: int = 0) -> None:
        self.tree = tree
        self.alloc = tree.allocator
        self.page_size = tree.page_size
        self.host_free = list(range(num_host_pages - 1, -1, -1))
        self.num_host_pages = num_host_pages

    # ------------------------------------------------------------- admission
    def match(self, seq: Seq) -> PrefixMatch:
        """Longest cached prefix (at most len - 1: the last token's logits are needed), pinned."""
        req = seq.req
        match = self.tree.match_prefix(seq.tokens, req.namespace, max_len=len(seq.tokens) - 1)
        self.tree.lock(match.node)
        seq.lock_node = match.node
        return match

    def pages_to_admit(self, match: PrefixMatch, upto: int) -> int:
        """Fresh pages a sequence needs to hold ``upto`` tokens on top of the match's full pages."""
        return self.alloc.pages_for(upto) - len(match.full_pages)

    def take_match(self, seq: Seq, match: PrefixMatch, upto: int, work: StepWork) -> None:
        """Give ``seq`` the match's full pages plus fresh ones up to ``upto`` tokens; a match
        ending inside a page copies that page's matched slots into the first fresh page."""
        full = match.full_pages
        fresh = self.tree.alloc_pages(self.alloc.pages_for(upto) - len(full))
        self.alloc.incref(full)
        seq.pages = full + fresh
        seq.computed = match.length
        if match.partial_len:
            self._plan_copy(seq, match.partial_page, fresh[0], match.partial_len, work)

    def unpin(self, seq: Seq) -> None:
        if seq.lock_node is not None:
            self.tree.unlock(seq.lock_node)
            seq.lock_node = None

    # ---------------------------------------------------------------- growth
    def grow(self, seq: Seq, upto: int) -> None:
        """Make ``seq``'s table cover ``upto`` tokens (raises OutOfPages, changing nothing)."""
        need = self.alloc.pages_for(upto) - len(seq.pages)
        if need > 0:
            seq.pages.extend(self.tree.alloc_pages(need))

    def fork(self, parent: Seq, child: Seq, work: StepWork) -> None:
        """``child`` shares ``parent``'s KV: full pages by reference, the partial last page by
        copy (both will write their own next tokens into it)."""
        computed = parent.computed
        shared = computed // self.page_size
        child.pages = list(parent.pages[:shared])
        self.alloc.incref(child.pages)
        if computed % self.page_size:
            page = self.tree.alloc_pages(1)[0]
            child.pages.append(page)
            self._plan_copy(child, parent.pages[shared], page, computed % self.page_size, work)
        child.computed = computed

    def _plan_copy(self, seq: Seq, src: int, dst: int, num_slots: int, work: StepWork) -> None:
        self.alloc.incref([src])
        seq.pending_refs.append(src)
        work.copies.append((src, dst, num_slots))

    def copies_done(self, seq: Seq) -> None:
        if seq.pending_refs:
            self.alloc.decref(seq.pending_refs)
            seq.pending_refs = []

    # --------------------------------------------------------------- release
    def release(self, seq: Seq, *, cache: bool) -> None:
        """Drop everything ``seq`` holds; with ``cache``, its computed KV goes into the tree
        first (so a preempted or finished sequence's prefix stays a cache hit)."""
        # A sequence whose copy-on-write has not run yet has no valid KV in that page.
        if cache and seq.computed and not seq.host_pages and not seq.pending_refs:
            self.tree.insert(seq.tokens[: seq.computed], seq.pages, seq.req.namespace)
        self.unpin(seq)
        self.copies_done(seq)
        self.alloc.decref([p for p in seq.pages if p >= 0])
        self.host_free.extend(host for _, host in seq.host_pages)
        seq.pages, seq.host_pages, seq.computed = [], [], 0

    # ----------------------------------------------------------------- swaps
    def swap_out(self, seq: Seq, work: StepWork) -> bool:
        """Move ``seq``'s private pages to the host pool; shared ones stay on device. False when
        the host pool is too small (the caller recomputes instead)."""
        private = [i for i, p in enumerate(seq.pages) if self.alloc.refcount[p] == 1]
        if len(private) > len(self.host_free):
            return False
        self.unpin(seq)
        self.copies_done(seq)
        for i in private:
            host = self.host_free.pop()
            work.swap_out.append((seq.pages[i], host))
            seq.host_pages.append((i, host))
            self.alloc.decref([seq.pages[i]])
            seq.pages[i] = -1
        return True

    def pages_to_swap_in(self, seq: Seq) -> int:
        return len(seq.host_pages)

    def swap_in(self, seq: Seq, work: StepWork) -> None:
        fresh = self.tree.alloc_pages(len(seq.host_pages))
        for (i, host), page in zip(seq.host_pages, fresh, strict=True):
            seq.pages[i] = page
            work.swap_in.append((host, page))
            self.host_free.append(host)
        seq.host_pages = []

    # -------------------------------------------------------------- checking
    def check(self, seqs: list[Seq]) -> None:
        """The accounting invariant with every running sequence's references accounted for."""
        refs = np.zeros(self.alloc.num_pages, dtype=np.int64)
        for seq in seqs:
            np.add.at(refs, [p for p in seq.pages if p >= 0], 1)
            np.add.at(refs, seq.pending_refs, 1)
        self.tree.check(refs)
        held = sum(len(s.host_pages) for s in seqs)
        assert held + len(self.host_free) == self.num_host_pages, "host pages leaked"


__all__ = ["OutOfPages", "SeqMemory", "StepWork"]
