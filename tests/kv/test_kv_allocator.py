"""PageAllocator: unit tests and a hypothesis state machine checked against an independent refcount model."""

import collections

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxinfer.kv import NULL_PAGE, OutOfPages, PageAllocator


def test_lowest_free_first_and_null_page_reserved():
    a = PageAllocator(8)
    assert (a.capacity, a.num_free, a.num_used) == (7, 7, 0)
    assert a.allocate(3) == [1, 2, 3]
    assert a.allocate(2) == [4, 5]
    a.free([4, 2])
    assert a.allocate(3) == [2, 4, 6]          # depends on the free set only, not on the free order
    assert (a.num_free, a.num_used) == (1, 6)
    for bad in (NULL_PAGE, 8, -1):
        with pytest.raises(ValueError, match="reserved null page|out of range"):
            a.free([bad])


def test_without_null_page():
    a = PageAllocator(3, reserve_null_page=False)
    assert a.allocate(3) == [0, 1, 2]
    with pytest.raises(ValueError, match="must exceed"):
        PageAllocator(1)


def test_out_of_pages_allocates_nothing():
    a = PageAllocator(5)
    a.allocate(2)
    with pytest.raises(OutOfPages, match="requested 3 pages, only 2 free of 4") as e:
        a.allocate(3)
    assert (e.value.requested, e.value.num_free, e.value.capacity) == (3, 2, 4)
    assert (a.num_free, a.num_used) == (2, 2)
    assert a.allocate(0) == []


def test_refcounts_and_double_free():
    a = PageAllocator(4)
    (p,) = a.allocate(1)
    a.incref([p, p])
    assert a.refcount(p) == 3
    assert a.free([p]) == []
    with pytest.raises(ValueError, match="refcount is 2"):
        a.free([p, p, p])                        # atomic: nothing changed
    assert a.refcount(p) == 2
    assert a.free([p, p]) == [p]
    with pytest.raises(ValueError, match="refcount is 0"):
        a.free([p])
    with pytest.raises(ValueError, match="incref of free page"):
        a.incref([p])
    assert (a.num_free, a.num_used) == (3, 0)


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate / incref / free, including invalid frees, against a dict of expected refcounts."""

    def __init__(self):
        super().__init__()
        self.alloc = PageAllocator(12)
        self.model = collections.Counter()        # page -> refcount (only pages in use)
        self.refs = []                            # references held by "users", one entry per reference

    def free_model(self):
        return sorted(set(range(1, 12)) - set(self.model))

    @rule(n=st.integers(0, 6))
    def allocate(self, n):
        free = self.free_model()
        if n > len(free):
            with pytest.raises(OutOfPages):
                self.alloc.allocate(n)
            return
        pages = self.alloc.allocate(n)
        assert pages == free[:n]
        for p in pages:
            self.model[p] = 1
        self.refs += pages

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def incref(self, data):
        pages = data.draw(st.lists(st.sampled_from(self.refs), max_size=3))
        self.alloc.incref(pages)
        for p in pages:
            self.model[p] += 1
        self.refs += pages

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def free(self, data):
        idx = data.draw(st.lists(st.integers(0, len(self.refs) - 1), unique=True, max_size=4))
        pages = [self.refs[i] for i in idx]
        released = self.alloc.free(pages)
        for i in sorted(idx, reverse=True):
            del self.refs[i]
        expected = []
        for p in pages:
            self.model[p] -= 1
            if self.model[p] == 0:
                del self.model[p]
                expected.append(p)
        assert released == expected

    @rule(page=st.integers(0, 11), extra=st.integers(1, 2))
    def free_too_often(self, page, extra):
        with pytest.raises(ValueError):
            self.alloc.free([page] * (self.model[page] + extra))

    @invariant()
    def consistent(self):
        a = self.alloc
        assert a.num_free + a.num_used == a.capacity == 11
        assert a.num_used == len(self.model)
        for p in range(1, 12):
            assert a.refcount(p) == self.model[p]
        assert sum(self.model.values()) == len(self.refs)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
