"""``SeqMemory``'s fork contract: a fork allocates nothing; its copy of the shared partial page
is planned by the next ``grow``, which may run out of pages (changing nothing) and be taken
back when the sequence is preempted before the copy ran."""

from __future__ import annotations

import numpy as np
import pytest

from engine.contracts.sampling_params import SamplingParams
from radix import OutOfPages, PageAllocator, RadixTree
from scheduler.kv import SeqMemory, StepWork
from scheduler.request import Request, Seq


def make(num_pages: int = 6, page_size: int = 4) -> tuple[SeqMemory, Request]:
    mem = SeqMemory(RadixTree(PageAllocator(num_pages, page_size)))
    req = Request("r", np.arange(6, dtype=np.int32), SamplingParams(n=2), 0, None, 0.0)
    return mem, req


def test_fork_on_a_full_pool_allocates_nothing_and_grow_plans_the_copy():
    mem, req = make()
    parent = Seq(req, 0, list(range(6)))
    mem.match(parent)
    mem.take_match(parent, 6, StepWork())  # two pages, the second holds slots 0-1 of 4-5
    parent.computed = 6
    hog = Seq(req, 9, list(range(100, 116)))
    mem.match(hog)
    mem.take_match(hog, 16, StepWork())  # the other four pages: nothing free, nothing evictable
    child = Seq(req, 1, parent.tokens + [7])
    mem.fork(parent, child)
    assert child.pages == parent.pages and child.copy_last_page
    mem.check([parent, child, hog])

    with pytest.raises(OutOfPages):
        mem.grow(child, 7, StepWork())
    assert child.pages == parent.pages and child.copy_last_page  # unchanged
    mem.release(hog, cache=False)

    work = StepWork()
    mem.grow(child, 7, work)
    assert child.pages[0] == parent.pages[0] and child.pages[1] != parent.pages[1]
    assert work.copies == [(parent.pages[1], child.pages[1], 2)]
    assert child.pending_refs == [parent.pages[1]] and not child.copy_last_page
    mem.check([parent, child])

    # Preempted before the copy ran: the table points at the shared page again.
    mem.unplan_copies(child, work)
    assert work.copies == [] and child.pages == parent.pages and child.copy_last_page
    mem.check([parent, child])
    mem.release(child, cache=True)  # its prefix is valid KV in the shared page: cached
    mem.release(parent, cache=True)
    mem.check([])
    assert mem.alloc.num_pinned_pages == 0


def test_the_check_counts_every_sequences_references():
    """``check`` holds each page's refcount to the tree's references and the live sequences':
    a page that no sequence and no node holds fails it, as do a sequence's pages left out."""
    mem, req = make(num_pages=8)
    seq = Seq(req, 0, list(range(6)))
    mem.match(seq)
    mem.take_match(seq, 6, StepWork())
    mem.check([seq])
    leaked = mem.alloc.alloc(1)
    with pytest.raises(AssertionError, match="differ from their holders"):
        mem.check([seq])
    mem.alloc.decref(leaked)
    with pytest.raises(AssertionError, match="differ from their holders"):
        mem.check([])
    mem.check([seq])
