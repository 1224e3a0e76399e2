"""Prefix caching over full KV pages, keyed by chained page hashes (host side, pure Python).

Hashes. Page i of a token sequence (tokens [i*S, (i+1)*S), S = page_size = 64) is identified by
``h_i = blake2b_128(h_{i-1} || tokens of page i as int64 little-endian)``, with h_{-1} derived from ``extra_key``
(model / adapter identity). A page's hash therefore names its whole prefix, as in vLLM's automatic prefix caching
and SGLang's radix cache: equal hashes mean equal token prefixes (collision probability ~ n^2 / 2^129). The hash is
stable across processes and runs (no salted ``hash()``), so a storage tier could key pages by it as well.
Only full pages are hashed; a trailing partial page never is.

Ownership. The cache holds one reference on every page it has registered (``insert``). A cached page whose only
reference is the cache's (refcount 1) is *evictable*; evictable pages form an LRU list ordered by the time they
became evictable. ``match`` hands out extra references (the page stops being evictable); ``free`` returns them.

Engine invariants (the cache relies on them, it cannot check the device):
- Shared pages are never written. Only the last, partial page of a sequence is written, and it is never shared:
  it is owned by one sequence and not cached. A page is ``insert``-ed only once it is full and fully written.
- ``match`` must never cover the whole prompt: the last prompt token must be computed to get its logits, and it
  would be written into a shared page. Pass the hashes of the first ``(len(prompt) - 1) // page_size`` pages.
- With a PrefixCache, allocate and release pages through it (``allocate`` / ``free``), never through the
  allocator directly, so that pages becoming evictable are noticed. With prefix caching disabled the engine
  still uses ``allocate``/``free`` and simply never calls ``match``/``insert``.

Eviction interplay. ``allocate(n)`` evicts least-recently-released evictable pages only when the allocator has
fewer than n free pages, and only if free + evictable >= n; otherwise it raises OutOfPages without evicting
anything. A sequence's pages are released last-page-first (see ``free``), so a chain's tail is evicted before its
head: a later page is useless without its predecessors.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

from jaxinfer.kv.page_allocator import PAGE_SIZE, OutOfPages, PageAllocator

_DIGEST_BYTES = 16


def _key_bytes(extra_key) -> bytes:
    if extra_key is None:
        return b""
    if isinstance(extra_key, bytes):
        return b"b" + extra_key
    if isinstance(extra_key, (str, int, tuple)):  # repr of str / int / tuples of them is stable across runs
        return b"r" + repr(extra_key).encode()
    raise TypeError(f"extra_key must be None, bytes, str, int or a tuple of them, got {type(extra_key).__name__}")


def page_hashes(token_ids: Sequence[int] | np.ndarray, page_size: int = PAGE_SIZE, extra_key=None) -> list[int]:
    """Chained hashes of the full pages of ``token_ids`` [T]: a list of T // page_size 128-bit ints.

    hash_i = blake2b(hash_{i-1} || int64 tokens of page i); hash_{-1} = blake2b(b"jaxinfer-kv" || extra_key).
    Same prefix -> same hashes; a change in page j changes the hashes of pages j, j+1, ...; different
    ``extra_key`` (model id, adapter, ...) -> disjoint hashes.
    """
    if page_size < 1:
        raise ValueError(f"{page_size=} must be >= 1")
    tokens = np.asarray(token_ids, dtype=np.int64).reshape(-1)        # [T]
    num_full = tokens.shape[0] // page_size
    data = tokens[: num_full * page_size].astype("<i8").tobytes()      # [num_full * S * 8] bytes
    page_bytes = page_size * 8
    prev = hashlib.blake2b(b"jaxinfer-kv" + _key_bytes(extra_key), digest_size=_DIGEST_BYTES).digest()
    out = []
    for i in range(num_full):
        prev = hashlib.blake2b(prev + data[i * page_bytes:(i + 1) * page_bytes], digest_size=_DIGEST_BYTES).digest()
        out.append(int.from_bytes(prev, "little"))
    return out


@dataclasses.dataclass
class PrefixCacheStats:
    """Counters for the "prefill tokens computed drop" report (DeepSeek reports hit tokens / input tokens)."""

    queries: int = 0            # match calls
    query_tokens: int = 0       # prompt tokens of those queries (the caller's num_tokens)
    hit_tokens: int = 0         # tokens served from cache (hit pages * page_size)
    inserted_pages: int = 0     # pages newly registered
    evicted_pages: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class PrefixCache:
    """Maps chained page hashes to pages of one DP rank's allocator; LRU eviction of pages only it references."""

    def __init__(self, allocator: PageAllocator, page_size: int = PAGE_SIZE):
        self.allocator = allocator
        self.page_size = page_size
        self._page_of: dict[int, int] = {}          # hash -> page
        self._hash_of: dict[int, int] = {}          # page -> hash
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
        self.stats = PrefixCacheStats()

    # ---- queries ---------------------------------------------------------------------------------------
    @property
    def num_cached(self) -> int:
        return len(self._hash_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Pages an ``allocate`` could return now: free + evictable (what admission control should look at)."""
        return self.allocator.num_free + len(self._evictable)

    def page_hash(self, page: int) -> int | None:
        """The hash a page is cached under, or None."""
        return self._hash_of.get(page)

    def lookup(self, hashes: Sequence[int]) -> int:
        """Number of leading hashes cached (no references taken, no stats): for scheduling decisions."""
        n = 0
        while n < len(hashes) and hashes[n] in self._page_of:
            n += 1
        return n

    # ---- operations -------------------------------------------------------------------------------------
    def match(self, hashes: Sequence[int], num_tokens: int | None = None) -> list[int]:
        """Pages of the longest cached run ``hashes[:k]``; takes one reference on each for the caller.

        ``hashes``: ``page_hashes`` of the prompt, cut so that the last prompt token is not covered (module doc).
        ``num_tokens``: prompt length for the stats (default len(hashes) * page_size). The caller releases the
        pages with ``free`` when its sequence ends.
        """
        pages = [self._page_of[h] for h in hashes[: self.lookup(hashes)]]
        self.allocator.incref(pages)
        for p in pages:
            self._evictable.pop(p, None)
        self.stats.queries += 1
        self.stats.query_tokens += len(hashes) * self.page_size if num_tokens is None else num_tokens
        self.stats.hit_tokens += len(pages) * self.page_size
        return pages

    def insert(self, hashes: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Registers full, fully written pages: ``pages[i]`` holds the tokens hashed as ``hashes[i]``.

        Returns the cached page of each hash. Where a hash is already cached under another page, the cached one is
        kept and returned; the caller's duplicate stays an ordinary page of its sequence (freed with it), or the
        caller may swap it for the returned one. Re-inserting a page under its own hash is a no-op. The cache takes
        one reference per newly cached page. Raises ValueError (changing nothing) for length mismatch, a free page,
        or a page already cached under a different hash (it would have been written while shared).
        """
        if len(hashes) != len(pages):
            raise ValueError(f"{len(hashes)=} != {len(pages)=}")
        if len(set(pages)) != len(pages):
            raise ValueError(f"a page is listed twice in {list(pages)}")
        for h, p in zip(hashes, pages):
            if self.allocator.refcount(p) == 0:
                raise ValueError(f"cannot cache free page {p}")
            old = self._hash_of.get(p)
            if old is not None and old != h:
                raise ValueError(f"page {p} is cached under another hash: it must not be rewritten while cached")
        canonical, new = [], []
        for h, p in zip(hashes, pages):
            q = self._page_of.get(h)
            if q is None:
                self._page_of[h], self._hash_of[p] = p, h
                new.append(p)
                q = p
            canonical.append(q)
        self.allocator.incref(new)
        self.stats.inserted_pages += len(new)
        return canonical

    def free(self, pages: Iterable[int]) -> list[int]:
        """Releases one reference per listed page (a sequence's block table, in order); returns the freed pages.

        Cached pages left with only the cache's reference become evictable, walked last-to-first so that within one
        sequence the tail of the chain is evicted before its head. Raises ValueError like ``PageAllocator.free``.
        """
        pages = list(pages)
        freed = self.allocator.free(pages)
        for p in reversed(pages):
            if p in self._hash_of and self.allocator.refcount(p) == 1:
                self._evictable[p] = None
                self._evictable.move_to_end(p)
        return freed

    def evict(self, n: int) -> list[int]:
        """Uncaches and frees up to ``n`` evictable pages (refcount 1), least recently released first."""
        out = []
        while len(out) < n and self._evictable:
            p, _ = self._evictable.popitem(last=False)
            del self._page_of[self._hash_of.pop(p)]
            out.extend(self.allocator.free([p]))
        self.stats.evicted_pages += len(out)
        return out

    def allocate(self, n: int) -> list[int]:
        """``allocator.allocate(n)``, evicting just enough pages first; OutOfPages (nothing evicted) if impossible."""
        short = n - self.allocator.num_free
        if short > len(self._evictable):
            raise OutOfPages(n, self.allocator.num_free, self.allocator.capacity, len(self._evictable))
        if short > 0:
            self.evict(short)
        return self.allocator.allocate(n)

    def clear(self) -> int:
        """Evicts every evictable page; returns how many. Pages still in use by sequences stay cached."""
        return len(self.evict(len(self._evictable)))

    def __repr__(self) -> str:
        return (f"PrefixCache(cached={self.num_cached}, evictable={self.num_evictable}, "
                f"hit_rate={self.stats.hit_rate:.3f}, {self.allocator!r})")
