"""A tiny scheduler stand-in for radix tests: drives the tree only through leases, as the
scheduler does (admit: match, lock, allocate, copy-on-write of a partial page; commit a
prefix mid-life; grow; fork; release), and keeps a shadow of slot contents, on the device and,
with a host tier, in host memory: the tier's planned moves run as the worker runs them
(write-downs, then loads, then the step's copy), after each operation. With a sliding window
(``window``), the sliding-window layers' pages too (radix/sliding.py): each written slot's
sliding KV, copied with its page, and checked wherever a holder, a node's kept window or a
match relies on it."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from radix import HostTier, Lease, Node, PageAllocator, PageCopy, PrefixMatch, RadixTree
from radix.sliding import SlidingKV
from radix.tree import _as_key


@dataclass
class SimSeq:
    tokens: list[int]
    pages: list[int]
    lease: Lease
    namespace: Hashable
    locked_len: int  # tokens its lock keeps in the tree: the match, then what it committed
    shares_last_page: bool = False  # a fork's partial last page, not yet copied


class Sim:
    def __init__(self, num_pages: int, page_size: int, host_pages: int = 0,
                 policy: str = "write_back", window: int = 0, sliding_pages: int = 0,
                 host_sliding_pages: int = 0) -> None:
        self.alloc = PageAllocator(num_pages, page_size)
        self.host = (HostTier(host_pages, page_size, policy, num_sliding_pages=host_sliding_pages)
                     if host_pages else None)
        self.sliding = (SlidingKV(sliding_pages, num_pages, page_size, window) if window
                        else None)
        self.tree = RadixTree(self.alloc, host=self.host, sliding=self.sliding)
        self.page_size = page_size
        # shadow[slot] = (token id, position) the slot's KV was computed for; -1 = never written
        self.shadow = np.full((num_pages * page_size, 2), -1, dtype=np.int64)
        self.swa_shadow = np.full((sliding_pages * page_size, 2), -1, dtype=np.int64)
        self.host_shadow = np.full((host_pages * page_size, 2), -1, dtype=np.int64)
        self.host_swa_shadow = np.full((host_sliding_pages * page_size, 2), -1, dtype=np.int64)
        self.running: list[SimSeq] = []
        self.moved = [0, 0]  # pages written down, loaded

    def slot(self, pages: list[int], pos: int) -> int:
        return pages[pos // self.page_size] * self.page_size + pos % self.page_size

    def verify_match(self, tokens: list[int], match: PrefixMatch) -> None:
        """Each matched position's KV holds its token: on the device, or in the host tier for
        the part a lease has not loaded yet."""
        on_device = min(match.length, len(match.pages) * self.page_size)
        for pos in range(on_device):
            got = tuple(self.shadow[self.slot(match.pages, pos)])
            assert got == (tokens[pos], pos), f"slot for position {pos} holds {got}"
        for pos in range(on_device, match.length):
            got = tuple(self.host_shadow[self._host_slot(match.node, pos)])
            assert got == (tokens[pos], pos), f"host slot for position {pos} holds {got}"
        if self.sliding is not None:  # the window before the first computed token is live
            for pos in range(max(0, match.length + 1 - self.sliding.window), match.length):
                if pos < on_device and self.sliding.of[match.pages[pos // self.page_size]] >= 0:
                    got = tuple(self.swa_shadow[self.swa_slot(match.pages, pos)])
                else:  # the host tier's copy of the window (acquire loads it)
                    got = tuple(self.host_swa_shadow[self._host_slot(match.node, pos, True)])
                assert got == (tokens[pos], pos), f"sliding slot for position {pos} holds {got}"

    def swa_slot(self, pages: list[int], pos: int) -> int:
        sliding = int(self.sliding.of[pages[pos // self.page_size]])
        assert sliding >= 0, f"the sliding KV of position {pos} is gone"
        return sliding * self.page_size + pos % self.page_size

    def _host_slot(self, node: Node, pos: int, window: bool = False) -> int:
        """The host slot of ``pos`` on the path to ``node``: the deepest node covering it
        (``window``: of its window's host copy)."""
        index = pos // self.page_size
        while node.start // self.page_size > index:
            node = node.parent
        pages = node.host_swa_pages if window else node.host_pages
        page = pages[index - node.start // self.page_size]
        assert page >= 0, f"the host tier keeps no window for position {pos}"
        return page * self.page_size + pos % self.page_size

    def run_moves(self) -> None:
        """The host tier's planned moves, as the worker runs a step's: write-downs, then loads."""
        if self.host is None:
            return
        downs, loads = self.host.take_moves()
        swa_downs, swa_loads = self.host.take_window_moves()
        size = self.page_size
        for (device, host), (src, dst) in [(pair, (self.shadow, self.host_shadow))
                                           for pair in downs] + [
                (pair, (self.swa_shadow, self.host_swa_shadow)) for pair in swa_downs]:
            dst[host * size : (host + 1) * size] = src[device * size : (device + 1) * size]
        for (host, device), (src, dst) in [(pair, (self.host_shadow, self.shadow))
                                           for pair in loads] + [
                (pair, (self.host_swa_shadow, self.swa_shadow)) for pair in swa_loads]:
            dst[device * size : (device + 1) * size] = src[host * size : (host + 1) * size]
        self.moved[0] += len(downs)
        self.moved[1] += len(loads)

    def _run_copy(self, copy: PageCopy) -> None:
        """What the worker does before a step's forward (after the moves); then the source
        reference goes."""
        base_src, base_dst = copy.src * self.page_size, copy.dst * self.page_size
        self.shadow[base_dst : base_dst + copy.num_slots] = (
            self.shadow[base_src : base_src + copy.num_slots]
        )
        if self.sliding is not None:
            src, dst = (int(self.sliding.of[p]) * self.page_size for p in (copy.src, copy.dst))
            self.swa_shadow[dst : dst + copy.num_slots] = (
                self.swa_shadow[src : src + copy.num_slots])
            self.sliding.decref([copy.src])
        self.alloc.decref([copy.src])

    def _write(self, seq: SimSeq, start: int) -> None:
        for pos in range(start, len(seq.tokens)):
            self.shadow[self.slot(seq.pages, pos)] = (seq.tokens[pos], pos)
            if self.sliding is not None:
                self.swa_shadow[self.swa_slot(seq.pages, pos)] = (seq.tokens[pos], pos)

    def slide(self, seq: SimSeq, retain_end: int | None = None) -> None:
        """``seq``'s next query is at its end: the sliding KV before that window goes (but
        the window ending at ``retain_end``, a prompt not committed whole yet)."""
        seq.lease.slide(seq.pages, len(seq.tokens), retain_end)

    def admit(self, tokens: list[int], namespace=None) -> SimSeq:
        """Lease at most len - 1 tokens, acquire the table, run the copy, write the rest."""
        return self.take(self.match(tokens, namespace), tokens, namespace)

    def match(self, tokens: list[int], namespace=None) -> Lease:
        """A lease on at most len - 1 tokens (``take`` turns it into a running sequence)."""
        lease = Lease(self.tree, tokens, namespace, max_len=len(tokens) - 1)
        self.run_moves()  # write_through_selective copies down what a match made hot
        self.verify_match(tokens, lease.match)
        return lease

    def take(self, lease: Lease, tokens: list[int], namespace=None) -> SimSeq:
        """Acquire ``lease``'s table for ``tokens``, run the moves and the copy, write the rest."""
        try:
            pages, copy = lease.acquire(len(tokens))
        except Exception:
            lease.unlock()
            self.run_moves()
            raise
        self.run_moves()
        if copy is not None:
            self._run_copy(copy)
        seq = SimSeq(list(tokens), pages, lease, namespace, lease.length)
        self._write(seq, lease.length)
        self.running.append(seq)
        return seq

    def take_unloaded(self, lease: Lease, tokens: list[int], namespace=None) -> SimSeq:
        """As ``take``, loading the match's host part into the sequence's own pages (the
        scheduler's loader thread: ``Lease.acquire_unloaded``), then committing it."""
        got = lease.acquire_unloaded(len(tokens))
        if got is None:
            return self.take(lease, tokens, namespace)
        pages, pairs = got
        size = self.page_size
        for host, device in pairs:
            self.shadow[device * size : (device + 1) * size] = (
                self.host_shadow[host * size : (host + 1) * size])
        self.moved[1] += len(pairs)
        seq = SimSeq(list(tokens), pages, lease, namespace, lease.length)
        self.commit(seq, lease.length)
        self._write(seq, lease.length)
        self.running.append(seq)
        return seq

    def commit(self, seq: SimSeq, upto: int, keep: bool = False) -> int:
        """Cache ``seq``'s first ``upto`` tokens mid-life (a prefilled chunk; ``keep``: a
        whole prompt, whose last window the tree keeps)."""
        cached = seq.lease.commit(seq.pages, seq.tokens[:upto], keep=keep)
        self.run_moves()
        if seq.lease.locked:
            seq.locked_len = max(seq.locked_len, upto)
        return cached

    def grow(self, seq: SimSeq, tokens: list[int]) -> None:
        """Append ``tokens`` to ``seq`` (decoding), first copying a shared last page."""
        start = len(seq.tokens)
        try:
            copy = seq.lease.grow(seq.pages, start + len(tokens),
                                  unshare_at=start if seq.shares_last_page else None)
        finally:
            self.run_moves()
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
        cached = seq.lease.release(seq.pages, seq.tokens if cache else None)
        self.run_moves()
        return cached

    def fork(self, seq: SimSeq) -> SimSeq:
        """Another holder of ``seq``'s pages (a parallel sample), with its own lease; it copies
        the partial last page they share before writing into it."""
        lease, pages = seq.lease.fork(seq.pages)
        child = SimSeq(list(seq.tokens), pages, lease, seq.namespace, seq.locked_len,
                       shares_last_page=len(seq.tokens) % self.page_size != 0)
        self.running.append(child)
        return child

    def available_pages(self) -> int:
        """Fresh pages an allocation could get now (with sliding windows, in both pools)."""
        pages = self.tree.num_available_pages
        return pages if self.sliding is None else min(pages, self.sliding.num_available_pages)

    def external_refs(self) -> np.ndarray:
        refs = np.zeros(self.alloc.num_pages, dtype=np.int64)
        for seq in self.running:
            np.add.at(refs, seq.pages, 1)
        return refs

    def external_swa_refs(self, others: list[tuple[Lease, list[int]]] = ()) -> np.ndarray | None:
        """References on each sliding page: every holder's window (``others``: leases that
        hold pages outside ``running``)."""
        if self.sliding is None:
            return None
        refs = np.zeros(self.sliding.allocator.num_pages, dtype=np.int64)
        for lease, pages in [(seq.lease, seq.pages) for seq in self.running] + list(others):
            np.add.at(refs, self.sliding.live(pages[lease.swa_from :]), 1)
        return refs

    def check(self) -> None:
        """The accounting invariant, and what every holder and node relies on."""
        self.tree.check(self.external_refs(), self.external_swa_refs())
        self.check_holders()
        self.check_nodes()

    def check_nodes(self) -> None:
        """Every node's KV holds its tokens in each tier it is in."""
        size = self.page_size
        for node in self.tree.iter_nodes():
            positions = np.arange(node.start, node.end)
            expected = np.stack([np.frombuffer(node.key, dtype=np.int32), positions], axis=1)
            index = positions // size - node.start // size
            for pages, shadow, tier in ((node.pages, self.shadow, "device"),
                                        (node.host_pages, self.host_shadow, "host")):
                if pages:
                    slots = np.asarray(pages)[index] * size + positions % size
                    bad = np.flatnonzero((shadow[slots] != expected).any(axis=1))
                    assert bad.size == 0, (f"{node!r}: {tier} slot of position "
                                           f"{positions[bad[0]]} holds {shadow[slots[bad[0]]]}")
            if node.swa_pages:  # what it keeps of a window holds its tokens
                kept = np.asarray(node.swa_pages)[index]
                slots = kept * size + positions % size
                bad = np.flatnonzero((kept >= 0)
                                     & (self.swa_shadow[slots] != expected).any(axis=1))
                assert bad.size == 0, f"{node!r}: a kept sliding slot holds another token"
            kept = np.asarray(node.host_swa_pages, dtype=np.int64)[index] if (
                node.host_swa_pages) else np.full(0, -1)
            mine = np.flatnonzero(kept >= 0)  # so does the host tier's copy of its windows
            slots = kept[mine] * size + positions[mine] % size
            bad = np.flatnonzero((self.host_swa_shadow[slots] != expected[mine]).any(axis=1))
            assert bad.size == 0, f"{node!r}: a host window's slot holds another token"

    def check_holders(self) -> None:
        """Every running sequence's table holds its own tokens' KV, and its locked path is
        still in the tree, to its last token."""
        for seq in self.running:
            for pos, token in enumerate(seq.tokens):
                got = tuple(self.shadow[self.slot(seq.pages, pos)])
                assert got == (token, pos), f"a table's slot for position {pos} holds {got}"
                if self.sliding is not None and pos >= min(
                        seq.lease.swa_from * self.page_size,
                        len(seq.tokens) + 1 - self.sliding.window):  # what its next query sees
                    got = tuple(self.swa_shadow[self.swa_slot(seq.pages, pos)])
                    assert got == (token, pos), f"a window's slot for position {pos} holds {got}"
            locked = seq.tokens[: seq.locked_len]
            assert self.cached_len(locked, seq.namespace) == len(locked), (
                f"a locked path of {len(locked)} tokens lost its tail")

    def cached_len(self, tokens: list[int], namespace=None) -> int:
        """Tokens of ``tokens`` whose full KV the tree holds (a match may stop short of it
        where the sliding window's KV is gone)."""
        root = self.tree._roots.get(namespace)
        if root is None:
            return 0
        return self.tree._walk(root, _as_key(tokens), len(tokens), collect=False,
                               split=False)[1]
