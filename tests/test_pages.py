"""The page allocator (radix/pages.py): references, evictable references and the checks that
make misuse loud."""

from __future__ import annotations

from array import array

import pytest

from radix import OutOfPages, PageAllocator, PageError


def test_alloc_and_free_roundtrip():
    alloc = PageAllocator(8, 16)
    pages = alloc.alloc(3)
    assert sorted(pages) == [0, 1, 2]
    assert alloc.num_free_pages == 5 and alloc.num_pinned_pages == 3
    alloc.incref(pages[:1])
    assert alloc.decref(pages) == 2
    assert alloc.decref(pages[:1]) == 1
    assert alloc.num_free_pages == 8
    alloc.check()


def test_alloc_more_than_free_raises():
    alloc = PageAllocator(4, 1)
    alloc.alloc(3)
    with pytest.raises(OutOfPages, match="asked for 2 pages but only 1"):
        alloc.alloc(2)


def test_misuse_is_loud():
    alloc = PageAllocator(4, 1)
    pages = alloc.alloc(1)
    alloc.decref(pages)
    with pytest.raises(PageError, match="below zero"):
        alloc.decref(pages)
    with pytest.raises(PageError, match="free page"):
        alloc.incref([2])
    with pytest.raises(ValueError):
        PageAllocator(0, 16)


def test_misuse_of_long_page_lists_is_loud_and_changes_nothing():
    """Lists of VECTOR_MIN_PAGES or more take the numpy path: the same checks and messages,
    all before any write; repeats count once per occurrence there too."""
    alloc = PageAllocator(200, 1)
    pages = alloc.alloc(100)
    alloc.decref(pages[50:])
    before = (alloc.refcount.copy(), alloc.evictable_refs.copy(), alloc.num_free_pages)
    with pytest.raises(PageError, match="page 50 dropped below zero"):
        alloc.decref(pages)  # the first 50 could go; page 50 on are free already
    with pytest.raises(PageError, match="use of free page 99"):
        alloc.incref(pages[::-1])
    with pytest.raises(PageError, match="cannot move an evictable reference"):
        alloc.set_evictable(pages[:50], False)  # no evictable references to take back
    with pytest.raises(PageError, match="dropped below zero"):
        alloc.decref(pages[:50] * 2)  # repeated: two references each, one held
    assert (alloc.refcount == before[0]).all() and (alloc.evictable_refs == before[1]).all()
    assert alloc.num_free_pages == before[2]
    alloc.incref(pages[:50] * 2, evictable=True)
    assert (alloc.refcount[pages[:50]] == 3).all() and alloc.num_evictable_pages == 0
    alloc.set_evictable(pages[:50], True)  # the third reference too: all evictable now
    assert alloc.num_evictable_pages == 50
    alloc.check()
    assert alloc.decref(pages[:50] * 3, evictable=True) == 50
    assert alloc.num_free_pages == 200 and alloc.num_evictable_pages == 0
    alloc.check()


def test_evictions_distinct_drop_is_checked_and_frees_only_last_references():
    """The tree's page-1 eviction path (``decref(..., distinct=True)``, no duplicate check):
    a page still held by a sequence is not freed, and dropping references that are not evictable
    raises before any write."""
    alloc = PageAllocator(100, 1)
    pages = array("q", alloc.alloc(40))
    alloc.incref(pages, evictable=True)  # the tree's reference
    alloc.decref(pages[:30])  # the sequence lets go of 30; keeps 10
    assert alloc.num_evictable_pages == 30
    held = array("q", alloc.alloc(1))  # a sequence's page: no evictable reference on it
    before = (alloc.refcount.copy(), alloc.evictable_refs.copy(), alloc.num_free_pages)
    with pytest.raises(PageError, match="dropped below zero"):
        alloc.decref(pages + held, evictable=True, distinct=True)
    assert (alloc.refcount == before[0]).all() and (alloc.evictable_refs == before[1]).all()
    assert alloc.decref(pages, evictable=True, distinct=True) == 30
    assert alloc.num_free_pages == 100 - 11 and alloc.num_evictable_pages == 0
    assert (alloc.refcount[pages[30:]] == 1).all()  # the sequence's pages stay
    alloc.check()


def test_a_page_list_longer_than_the_pool_is_counted_per_occurrence():
    """Eviction at page size > 1 lists a page shared by split nodes once per node: a list can
    outgrow the pool (it once failed with a numpy shape mismatch)."""
    alloc = PageAllocator(40, 4)
    pages = alloc.alloc(40)
    alloc.incref(pages * 2, evictable=True)
    alloc.decref(pages)
    assert alloc.decref(pages * 2, evictable=True) == 40
    alloc.check()


def test_repeated_page_in_one_call_counts_twice():
    alloc = PageAllocator(4, 1)
    page = alloc.alloc(1)
    alloc.incref([page[0], page[0]])
    assert alloc.refcount[page[0]] == 3
    assert alloc.decref([page[0], page[0], page[0]]) == 1
    alloc.check()
