"""Sequences' pages over the radix cache: admission, growth, forks, swaps and release, each
through the sequence's lease (radix/lease.py).

Who holds what: a sequence holds one reference per page in its table and one per pending
copy source (until the batch that runs the copy has come back). The tree holds its own (on the
device, and in its host tier when there is one: its write-downs and loads go into the next batch
the scheduler sends, with the swaps). Swaps use host pages of their own (``host_free``), apart
from the tier's. A
sequence pins (locks) the tree path it matched at admission, and each prefilled chunk it
commits, until it is released or swapped out. Copies and swaps are only *planned* here: they
go into the next batch, and the worker runs them before that batch's forward, so a page freed
in this step can be reused by this step's writes.

With sliding-window layers (radix/sliding.py), a sequence also holds the sliding KV of its
pages from ``lease.swa_from`` on and of its copy sources; before each step it lets go of what
its next query no longer sees (``Lease.slide``), keeping the window where its prompt ends
until that window is committed to the tree::

    positions   0 ........ computed+1-W ........ computed | new tokens
    full pages  [ held ...................................................... ]
    sliding     [ gone (or kept by the tree) ][ held: the window ............ ]
"""

from __future__ import annotations

import numpy as np

from engine.contracts.protocol import pack_ids
from engine.contracts.worker_messages import HostLoad, ModelInfo
from radix import Lease, PageCopy, RadixTree
from radix.sliding import SlidingKV
from scheduler.disk import DiskTier
from scheduler.loads import Pending, PendingLoads
from scheduler.request import Seq


def sliding_pages(info: ModelInfo) -> SlidingKV | None:
    """The sliding-window layers' pages the worker made, if it made them (with a disk tier,
    kept windows cover the window before a prompt's last disk block's end too)."""
    if not info.num_sliding_pages:
        return None
    return SlidingKV(info.num_sliding_pages, info.num_pages, info.page_size, info.sliding_window,
                     align=max(info.disk_block_tokens, 1))


def sliding_stats(tree: RadixTree) -> dict[str, int]:
    """The sliding-window layers' pages for /metrics (none without them)."""
    if tree.sliding is None:
        return {}
    alloc = tree.sliding.allocator
    return {"sliding_pages_total": alloc.num_pages, "sliding_pages_used": alloc.num_pinned_pages,
            "sliding_pages_cached": alloc.num_evictable_pages,
            "sliding_evicted_pages": tree.stats.sliding_evicted_pages,
            "sliding_loaded_pages": tree.stats.sliding_loaded_pages}


class StepWork:
    """Page copies and swaps collected while planning one step."""

    def __init__(self) -> None:
        self.copies: list[PageCopy] = []
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        # the sliding pages that go with swapped pages: (sliding, host) out, (host, sliding) in
        self.swa_swap_out: list[tuple[int, int]] = []
        self.swa_swap_in: list[tuple[int, int]] = []


class SeqMemory:
    def __init__(self, tree: RadixTree, num_host_pages: int = 0,
                 disk: DiskTier | None = None, loads: PendingLoads | None = None,
                 host_loads_aside: bool = False, saves_at_release: bool = False) -> None:
        self.tree = tree
        self.disk = disk
        # A draft model computes its KV of a prompt once the sequence drafts, after the
        # prefilled chunks were cached: its blocks then go to disk when the sequence is
        # released, with the draft's KV beside the model's (engine/worker/draft_tiers.py).
        self.saves_at_release = saves_at_release
        self.loads = loads if loads is not None else PendingLoads()
        # the host tier loads into waiting sequences' own pages on the worker's I/O thread
        # (one worker: under tensor parallel every rank must copy its share in the step)
        # (not with sliding-window layers: a load there gives the tree's nodes the windows)
        self.host_loads_aside = (host_loads_aside and tree.host is not None
                                 and tree.sliding is None)
        self.alloc = tree.allocator
        self.sliding = tree.sliding
        self.page_size = tree.page_size
        self.host_free = list(range(num_host_pages - 1, -1, -1))
        self.num_host_pages = num_host_pages

    # ------------------------------------------------------------- admission
    def match(self, seq: Seq, *, disk: bool = False) -> Lease:
        """Longest cached prefix (at most len - 1: the last token's logits are needed; for a
        request that wants prompt logprobs, no further than the positions whose logits it has),
        pinned by the sequence's lease until it is released (or swapped out). With ``disk``,
        blocks of the disk tier that continue it are looked up too (``seq.disk_names``): the
        lease then ends where the first of them begins, and ``take_match`` plans their load."""
        limit = len(seq.tokens) - 1
        if seq.req.wants_prompt_logprobs:
            limit = min(limit, seq.req.prompt_logits_done)
        seq.disk_names = []
        if disk and self.disk is not None:
            cached = self.tree.peek_prefix(seq.tokens, seq.req.namespace, limit)
            start = self._disk_start(seq, cached)
            reach = limit if seq.disk_reach is None else min(limit, seq.disk_reach)
            seq.disk_names = self.disk.lookup(seq.tokens, seq.req.namespace, cached, reach,
                                              start)
            if seq.disk_names:
                limit = start
        seq.lease = Lease(self.tree, seq.tokens, seq.req.namespace, max_len=limit)
        return seq.lease

    def _disk_start(self, seq: Seq, cached: int) -> int:
        """Where a disk load after the tree's ``cached`` tokens starts: the block boundary at or
        below it, or with sliding-window layers the last one where the tree's match may end
        (the window before it live)."""
        block, tokens, namespace = self.disk.block, seq.tokens, seq.req.namespace
        start = cached - cached % block
        while self.sliding is not None and start and (
                usable := self.tree.peek_prefix(tokens, namespace, start)) < start:
            start = usable - usable % block
        return start

    def disk_tokens(self, seq: Seq) -> int:
        """Tokens the disk tier found for ``seq`` past its lease (0 when none)."""
        return len(seq.disk_names) * self.disk.block if seq.disk_names else 0

    def reads_from(self, seq: Seq) -> int | None:
        """Where ``seq``'s first query is when its disk blocks have loaded (None: at its
        lease's end)."""
        return seq.lease.length + self.disk_tokens(seq) if seq.disk_names else None

    def loads_host_part(self, seq: Seq) -> bool:
        """Whether ``seq`` (matched, one sequence of its request) loads its match's host part
        into pages of its own on the worker's loader thread, waiting for it, rather than in
        the next step's page work: the tree's host tier exists and no disk blocks follow."""
        return (self.host_loads_aside and not seq.disk_names
                and seq.lease.match.host_length > 0)

    def take_match(self, seq: Seq, upto: int, work: StepWork, *, wait: bool = False) -> None:
        """Give ``seq`` its lease's full pages plus fresh ones up to ``upto`` tokens; a match
        ending inside a page copies that page's matched slots into the first fresh page. With
        ``wait``, the disk blocks found (``match``) or the match's host part
        (``loads_host_part``) are loaded into its own pages while it waits."""
        # Its first commit checks every block from the start: what the tree holds may have
        # left the disk since it was written (trimmed by some server), and is written again.
        seq.disk_saved = 0
        if wait and not seq.disk_names and self._take_unloaded(seq, upto):
            return
        seq.pages, copy = seq.lease.acquire(upto, reads_from=self.reads_from(seq))
        seq.computed = seq.settled = seq.lease.length
        if copy is not None:
            seq.pending_refs.append(copy.src)
            work.copies.append(copy)
        if seq.disk_names:
            self.disk.plan_load(seq, seq.lease.length, seq.disk_names)
            seq.disk_names = []

    def _take_unloaded(self, seq: Seq, upto: int) -> bool:
        """The match's host part into ``seq``'s own pages, on the loader thread; False when
        nothing of it is in the host tier only any more (another sequence loaded it)."""
        got = seq.lease.acquire_unloaded(upto)
        if got is None:
            return False
        seq.pages, pairs = got
        start = seq.pages.index(pairs[0][1]) * self.page_size
        seq.computed = seq.settled = start
        load_id = self.loads.register(seq, start, seq.lease.length - start, 1, "host")
        host = self.tree.host
        self.loads.host.append(HostLoad(load_id, pack_ids([host.first_page + h for h, _ in pairs]),
                                        pack_ids([d for _, d in pairs])))
        return True

    def load_ended(self, load_id: int, arrived: int) -> Pending | None:
        """A load ended with ``arrived`` units in the pages: they are cached like a prefilled
        chunk, and its sequence computes on from there. None if it ended meanwhile. With
        sliding-window layers a disk load that ended early caches nothing (the window before
        where it stopped was not read; a failed load, counted): the caller admits its request
        again (``StepPlanner.admit_again``)."""
        pending, dropped, windows = self.loads.ended(load_id, arrived)
        if dropped:
            if windows:
                self.sliding.decref(windows)
            self.alloc.decref(dropped)
        if pending is not None:
            seq = pending.seq
            if self.loads_again(pending, arrived):
                self.disk.loaded(0, pending.asked)
                seq.disk_reach = pending.start + arrived * pending.unit
                return pending
            seq.computed = seq.settled = upto = pending.start + arrived * pending.unit
            if arrived:
                self.commit(seq, upto)
        return pending

    def loads_again(self, pending: Pending, arrived: int) -> bool:
        """Whether the load ``pending`` ended too early to be used (``load_ended``)."""
        return self.sliding is not None and pending.kind == "disk" and arrived < pending.asked

    def commit(self, seq: Seq, upto: int) -> None:
        """Cache ``seq``'s first ``upto`` tokens, whose batch came back (a prefilled chunk):
        waiting requests that share them hit them from the next step on, long before ``seq``
        finishes, and its lock holds them until then."""
        keep = upto >= seq.req.prompt_len
        seq.lease.commit(seq.pages, seq.tokens[:upto], keep=keep)
        if not self.saves_at_release:
            self._save(seq, upto, windows=keep)

    def _save(self, seq: Seq, upto: int, windows: bool = True) -> None:
        """Write ``seq``'s blocks up to ``upto`` tokens through to the disk tier (``windows``:
        with the window files of the window before them, where the tree keeps it)."""
        if self.disk is not None and upto > seq.disk_saved:
            self.disk.plan_saves(seq.req.namespace, seq.tokens, seq.pages, seq.disk_saved, upto,
                                 windows)
            seq.disk_saved = upto

    def unpin(self, seq: Seq) -> None:
        """Let the matched path go; the sequence keeps its own references."""
        if seq.lease is not None:
            seq.lease.unlock()

    # ---------------------------------------------------------------- growth
    def grow(self, seq: Seq, upto: int, work: StepWork) -> None:
        """Make ``seq``'s table cover ``upto`` tokens, first giving a fork its own copy of the
        partial page it still shares (raises OutOfPages, changing nothing)."""
        if self.sliding is not None:
            prompt_end = seq.req.prompt_len
            seq.lease.slide(seq.pages, seq.computed,
                            prompt_end if seq.settled < prompt_end else None)
        copy = seq.lease.grow(seq.pages, upto,
                              unshare_at=seq.computed if seq.copy_last_page else None)
        if copy is not None:
            seq.pending_refs.append(copy.src)  # the shared page's reference, until the copy ran
            work.copies.append(copy)
            seq.copy_last_page = False

    def trim(self, seq: Seq, upto: int) -> None:
        """Drop ``seq``'s pages past its first ``upto`` tokens: pages it grew for draft tokens
        that verification rejected. Only this sequence ever held them (drafts never reach the
        tree), so they return to the free list, with their sliding-window pages."""
        keep = self.alloc.pages_for(upto)
        if len(seq.pages) > keep:
            if self.sliding is not None:
                self.sliding.decref(seq.pages[max(keep, seq.lease.swa_from) :])
            self.alloc.decref(seq.pages[keep:])
            del seq.pages[keep:]

    def fork(self, parent: Seq, child: Seq) -> None:
        """``child`` shares ``parent``'s KV by reference, its partial last page too: the copy
        that both need before writing their own next tokens there is planned by ``grow``, in
        the next step's planning, where running out of pages can preempt (a fork allocates
        nothing, so it never fails)."""
        computed = parent.computed
        shared = parent.pages[: self.alloc.pages_for(computed)]
        child.lease, child.pages = parent.lease.fork(shared)
        child.computed = child.settled = computed
        child.copy_last_page = computed % self.page_size != 0

    def unplan_copies(self, seq: Seq, work: StepWork) -> None:
        """Take back the copies planned into ``seq``'s pages in this step (it is being
        preempted before they ran): its table points at the shared sources again, to be copied
        before its next write."""
        index = {page: i for i, page in enumerate(seq.pages)}
        kept = []
        for copy in work.copies:
            if copy.dst in index and copy.src in seq.pending_refs:
                seq.pages[index[copy.dst]] = copy.src
                seq.pending_refs.remove(copy.src)
                if self.sliding is not None:
                    self.sliding.decref([copy.dst])
                self.alloc.decref([copy.dst])
                seq.copy_last_page = True
            else:
                kept.append(copy)
        work.copies = kept

    def copies_done(self, seq: Seq) -> None:
        if seq.pending_refs:
            if self.sliding is not None:
                self.sliding.decref(seq.pending_refs)
            self.alloc.decref(seq.pending_refs)
            seq.pending_refs = []

    # --------------------------------------------------------------- release
    def release(self, seq: Seq, *, cache: bool) -> None:
        """Drop everything ``seq`` holds; with ``cache``, its settled KV goes into the tree
        first (so a preempted or finished sequence's prefix stays a cache hit). The tree only
        ever gets KV whose batch came back: what a batch in flight computes is not cached."""
        # A sequence whose copy-on-write has not run yet has no valid KV in that page.
        cache = cache and seq.settled and not seq.host_pages and not seq.pending_refs
        self.copies_done(seq)
        if seq.load_id >= 0:
            # Its load may still be writing its pages: they wait for the load to end.
            self.loads.abandon(seq, seq.pages[seq.lease.swa_from :]
                               if self.sliding is not None else None)
            seq.pages = []
            cache = False
        elif cache:
            self._save(seq, seq.settled)
        if seq.lease is not None:
            if seq.host_pages and self.sliding is not None:
                # its window's place in the table without the swapped-out pages
                seq.lease.swa_from = sum(p >= 0 for p in seq.pages[: seq.lease.swa_from])
            seq.lease.release([p for p in seq.pages if p >= 0],
                              seq.tokens[: seq.settled] if cache else None)
            seq.lease = None
        elif seq.pages:
            raise RuntimeError(f"sequence {seq.req.rid}/{seq.index} holds pages without a lease")
        self.host_free.extend(host for _, host in seq.host_pages)
        seq.pages, seq.host_pages, seq.computed, seq.settled = [], [], 0, 0
        seq.copy_last_page = False

    # ----------------------------------------------------------------- swaps
    def swap_out(self, seq: Seq, work: StepWork) -> bool:
        """Move ``seq``'s private pages to the host pool; shared ones stay on device. False when
        the host pool is too small, or when no page is private (every one is cached or another
        sequence's too): then the caller releases it into the tree and recomputes, which hits.
        With sliding-window layers, a private page of its window takes its sliding page along
        (to the same host page's sliding part); before the window there is none."""
        if seq.load_id >= 0:
            return False  # a load may still be writing its pages
        private = [i for i, p in enumerate(seq.pages) if self.alloc.refcount[p] == 1]
        if not private or len(private) > len(self.host_free):
            return False
        self.unpin(seq)
        self.copies_done(seq)
        for i in private:
            host = self.host_free.pop()
            work.swap_out.append((seq.pages[i], host))
            seq.host_pages.append((i, host))
            if self.sliding is not None and i >= seq.lease.swa_from:
                work.swa_swap_out.append((int(self.sliding.of[seq.pages[i]]), host))
                self.sliding.decref([seq.pages[i]])
            self.alloc.decref([seq.pages[i]])
            seq.pages[i] = -1
        return True

    def pages_to_resume(self, seq: Seq) -> int:
        """Fresh pages a swapped-out sequence needs to run its next step: its host pages back,
        growth to its tokens, and the copy of a partial page it still shares."""
        growth = max(self.alloc.pages_for(len(seq.tokens)) - len(seq.pages), 0)
        return len(seq.host_pages) + growth + seq.copy_last_page

    def sliding_to_resume(self, seq: Seq) -> int:
        """``pages_to_resume``'s pages that take sliding pages: its window's back, growth and
        the copy."""
        windows = sum(i >= seq.lease.swa_from for i, _ in seq.host_pages)
        return self.pages_to_resume(seq) - len(seq.host_pages) + windows

    def swap_in(self, seq: Seq, work: StepWork) -> None:
        swa_from = seq.lease.swa_from  # host pages are in table order: its window's last
        windows = sum(i >= swa_from for i, _ in seq.host_pages)
        fresh = seq.lease.alloc_pages(len(seq.host_pages), windows)
        for (i, host), page in zip(seq.host_pages, fresh, strict=True):
            seq.pages[i] = page
            work.swap_in.append((host, page))
            if self.sliding is not None and i >= swa_from:
                work.swa_swap_in.append((host, int(self.sliding.of[page])))
            self.host_free.append(host)
        seq.host_pages = []

    # -------------------------------------------------------------- checking
    def _sliding_refs(self, seqs: list[Seq]) -> np.ndarray | None:
        """References running sequences hold on each sliding page: their windows' and their
        copy sources'."""
        if self.sliding is None:
            return None
        refs = np.zeros(self.sliding.allocator.num_pages, dtype=np.int64)
        for seq in seqs:
            if seq.lease is not None and seq.pages:
                window = [p for p in seq.pages[seq.lease.swa_from :] if p >= 0]  # not swapped
                held = self.sliding.live(window + seq.pending_refs)
                assert (held >= 0).all(), f"sequence {seq.req.rid} lost its window's KV"
                np.add.at(refs, held, 1)
        for pages in self.loads.orphan_windows.values():
            np.add.at(refs, self.sliding.live(pages), 1)
        return refs

    def check(self, seqs: list[Seq]) -> None:
        """The accounting invariant with every running sequence's references accounted for."""
        refs = np.zeros(self.alloc.num_pages, dtype=np.int64)
        for seq in seqs:
            np.add.at(refs, [p for p in seq.pages if p >= 0], 1)
            np.add.at(refs, seq.pending_refs, 1)
        for pages in self.loads.orphans.values():
            np.add.at(refs, pages, 1)
        self.tree.check(refs, self._sliding_refs(seqs))
        held = sum(len(s.host_pages) for s in seqs)
        assert held + len(self.host_free) == self.num_host_pages, "host pages leaked"
