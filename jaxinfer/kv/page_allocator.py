"""Reference-counted pool of KV page ids for one DP rank (host side, pure Python).

A page is a block of ``page_size`` (64) token slots in every layer's latent cache (see ``paged_cache``). The
allocator only hands out ids; it never touches device memory. Page ids are rank-local: ``0 <= id < num_pages``.

Policy (deterministic): ``allocate`` returns the lowest free ids, in increasing order. The result then depends only
on the *set* of free pages, not on the order in which they were freed, so block tables are reproducible across
runs and schedules that free in different orders (batch-invariance tests, readable failure dumps). LIFO reuse would
buy cache locality, which does not matter for HBM pages read through a block table. Cost: O(log P) per page.

Page 0 is reserved by default (``reserve_null_page=True``) as the null page: the runner pads block tables of
padded batch rows (and the unused tail of short rows) with it, so every block-table entry is a valid, in-bounds
page that never aliases a live request's data; padded tokens write to slot -1 (dropped), so the null page stays as
initialised (zeros). It is never allocated, freed or shared; ``num_free + num_used == capacity == num_pages - 1``.
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Iterable

NULL_PAGE = 0
PAGE_SIZE = 64  # tokens per page: FlashMLA's KV block size


class OutOfPages(RuntimeError):
    """Raised when an allocation asks for more pages than are available; nothing was allocated.

    Attributes: ``requested``, ``num_free`` (free pages), ``num_evictable`` (pages a prefix cache could have
    freed; 0 for a bare allocator), ``capacity`` (allocatable pages of the pool).
    """

    def __init__(self, requested: int, num_free: int, capacity: int, num_evictable: int = 0):
        self.requested, self.num_free, self.capacity, self.num_evictable = requested, num_free, capacity, num_evictable
        extra = f" + {num_evictable} evictable" if num_evictable else ""
        super().__init__(f"requested {requested} pages, only {num_free} free{extra} of {capacity}")


class PageAllocator:
    """Page ids 0..num_pages-1 with reference counts.

    A page is free at refcount 0 and in use at refcount >= 1; ``allocate`` sets refcount 1, ``incref`` shares a
    page (prefix caching), ``free`` drops one reference per listed occurrence and returns pages that reach 0 to the
    free pool. Invalid calls raise ValueError and change nothing (every call validates all pages first).
    """

    def __init__(self, num_pages: int, reserve_null_page: bool = True):
        reserved = 1 if reserve_null_page else 0
        if num_pages <= reserved:
            raise ValueError(f"{num_pages=} must exceed the {reserved} reserved page(s) ({reserve_null_page=})")
        self.num_pages = num_pages
        self.reserve_null_page = reserve_null_page
        self._first = reserved                          # lowest allocatable id
        self._refcount = [0] * num_pages                # [P]
        self._free_heap = list(range(reserved, num_pages))  # already a valid min-heap
        self._num_used = 0

    # ---- sizes -----------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Allocatable pages (num_pages minus the null page when reserved)."""
        return self.num_pages - self._first

    @property
    def num_free(self) -> int:
        return len(self._free_heap)

    @property
    def num_used(self) -> int:
        """Pages with refcount >= 1 (each counted once, however shared)."""
        return self._num_used

    def refcount(self, page: int) -> int:
        self._check_id(page)
        return self._refcount[page]

    # ---- operations -----------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Returns the ``n`` lowest free page ids (increasing), each with refcount 1.

        Raises ValueError for n < 0 and OutOfPages when fewer than n pages are free (nothing is allocated).
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n=} pages")
        if n > len(self._free_heap):
            raise OutOfPages(n, len(self._free_heap), self.capacity)
        pages = [heapq.heappop(self._free_heap) for _ in range(n)]
        for p in pages:
            self._refcount[p] = 1
        self._num_used += n
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Adds one reference per listed occurrence; every page must be in use (refcount >= 1)."""
        counts = collections.Counter(pages)
        for p in counts:
            self._check_id(p)
            if self._refcount[p] == 0:
                raise ValueError(f"incref of free page {p}")
        for p, c in counts.items():
            self._refcount[p] += c

    def free(self, pages: Iterable[int]) -> list[int]:
        """Drops one reference per listed occurrence; returns the pages that became free (refcount 0), in order.

        Raises ValueError (changing nothing) when a page would drop below 0, e.g. freeing a free page twice.
        """
        pages = list(pages)
        counts = collections.Counter(pages)
        for p, c in counts.items():
            self._check_id(p)
            if self._refcount[p] < c:
                raise ValueError(f"freeing page {p} {c} time(s), but its refcount is {self._refcount[p]}")
        released = []
        for p in pages:
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                heapq.heappush(self._free_heap, p)
                released.append(p)
        self._num_used -= len(released)
        return released

    def _check_id(self, page: int) -> None:
        if not self._first <= page < self.num_pages:
            what = "the reserved null page" if page == NULL_PAGE and self.reserve_null_page else "out of range"
            raise ValueError(f"page {page} is {what} (allocatable ids {self._first}..{self.num_pages - 1})")

    def __repr__(self) -> str:
        return (f"PageAllocator(num_pages={self.num_pages}, free={self.num_free}, used={self.num_used}, "
                f"reserve_null_page={self.reserve_null_page})")
