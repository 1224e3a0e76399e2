"""page_hashes and PrefixCache: unit tests and a hypothesis state machine of sequences sharing prefixes.

The state machine plays the engine: sequences start (match, allocate, write, insert), grow (write the last partial
page, insert pages as they fill) and finish (free), with random evictions; an independent model of references,
cached hashes, page contents and LRU order is checked after every step.
"""

import collections

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxinfer.kv import OutOfPages, PageAllocator, PrefixCache, page_hashes


# ---- page_hashes ------------------------------------------------------------------------------------------------
def test_page_hashes_basic():
    toks = list(range(200))
    h = page_hashes(toks)
    assert len(h) == 3                                        # 200 // 64; the partial last page is not hashed
    assert page_hashes(toks[:192]) == h and page_hashes(toks[:191]) == h[:2]
    assert page_hashes(np.array(toks, np.int32)) == h         # dtype of the input does not matter
    assert page_hashes(toks[:63]) == []
    assert len(set(h)) == 3 and all(0 <= x < 2**128 for x in h)
    assert page_hashes(toks, extra_key="model-b")[0] != h[0]  # extra_key separates models / adapters
    assert page_hashes(toks, extra_key="a") == page_hashes(toks, extra_key="a")
    assert page_hashes(toks, page_size=100) != h[:2]
    # Stable across processes and releases (blake2b, never the salted hash()): a golden value.
    assert page_hashes([1, 2, 3, 4], page_size=4)[0] == 0xd61e71197cf4ca9e9f41eb43d63d07ec


def test_identical_pages_at_different_positions_differ():
    h = page_hashes([7] * 256)
    assert len(set(h)) == 4


@settings(max_examples=200, deadline=None)
@given(toks=st.lists(st.integers(0, 50_000), min_size=1, max_size=40), page_size=st.integers(1, 8), data=st.data())
def test_page_hashes_chain_property(toks, page_size, data):
    j = data.draw(st.integers(0, len(toks) - 1))
    other = toks.copy()
    other[j] += 1
    a, b = page_hashes(toks, page_size), page_hashes(other, page_size)
    assert len(a) == len(b) == len(toks) // page_size
    k = j // page_size
    assert a[:k] == b[:k]                                     # same prefix -> same hashes
    assert all(x != y for x, y in zip(a[k:], b[k:]))          # a changed page changes it and every later page
    assert page_hashes(toks + [1, 2], page_size)[: len(a)] == a


def test_extra_key_type_checked():
    with pytest.raises(TypeError, match="extra_key"):
        page_hashes([1], extra_key=1.5)


# ---- PrefixCache units ----------------------------------------------------------------------------------------
def _seq(pc, tokens, page_size=4):
    """Engine-like start of a sequence: match, allocate the rest, insert its full pages. Returns its pages."""
    h = page_hashes(tokens, page_size)
    pages = pc.match(h[: (len(tokens) - 1) // page_size], num_tokens=len(tokens))
    pages += pc.allocate(-(-len(tokens) // page_size) - len(pages))
    pc.insert(h, pages[: len(h)])
    return pages


def test_match_insert_free_evict():
    a = PageAllocator(10)
    pc = PrefixCache(a, page_size=4)
    s1 = _seq(pc, list(range(10)))                            # 2 full pages + 1 partial
    assert s1 == [1, 2, 3] and pc.num_cached == 2 and a.refcount(1) == 2 and a.refcount(3) == 1
    s2 = _seq(pc, list(range(8)) + [99])                      # shares both full pages
    assert s2[:2] == [1, 2] and a.refcount(1) == 3
    assert (pc.stats.queries, pc.stats.query_tokens, pc.stats.hit_tokens) == (2, 19, 8)
    assert pc.stats.hit_rate == pytest.approx(8 / 19)
    pc.free(s1)
    assert pc.num_evictable == 0                              # s2 still uses pages 1, 2
    pc.free(s2)
    assert pc.num_evictable == 2 and a.num_used == 2
    assert pc.evict(1) == [2]                                 # the tail of the chain goes first
    assert pc.lookup(page_hashes(list(range(8)), 4)) == 1
    assert pc.clear() == 1 and a.num_used == 0 and pc.num_cached == 0


def test_full_prompt_match_leaves_last_page_to_compute():
    pc = PrefixCache(PageAllocator(10), page_size=4)
    s1 = _seq(pc, list(range(8)))
    s2 = _seq(pc, list(range(8)))
    assert s2[0] == s1[0] and s2[1] != s1[1]                  # page 2 recomputed into a fresh page
    assert pc.stats.hit_tokens == 4


def test_allocate_evicts_only_when_needed():
    a = PageAllocator(6)                                      # 5 usable
    pc = PrefixCache(a, page_size=4)
    pc.free(_seq(pc, list(range(12))))                        # 3 cached, evictable pages
    assert (a.num_free, pc.num_evictable, pc.num_available) == (2, 3, 5)
    assert pc.allocate(2) == [4, 5] and pc.num_cached == 3    # free pages suffice: nothing evicted
    with pytest.raises(OutOfPages, match=r"requested 4 pages, only 0 free \+ 3 evictable of 5") as e:
        pc.allocate(4)
    assert e.value.num_evictable == 3 and pc.num_cached == 3  # nothing evicted on failure
    assert pc.allocate(2) == [2, 3] and pc.num_cached == 1    # evicts the two last pages of the chain
    assert pc.stats.evicted_pages == 2


def test_insert_duplicates_and_errors():
    a = PageAllocator(10)
    pc = PrefixCache(a, page_size=4)
    h = page_hashes(list(range(4)), 4)
    p, q = a.allocate(2)
    assert pc.insert(h, [p]) == [p]
    assert pc.insert(h, [q]) == [p] and pc.page_hash(q) is None and a.refcount(q) == 1  # duplicate kept out
    assert pc.insert(h, [p]) == [p] and a.refcount(p) == 2                               # idempotent
    with pytest.raises(ValueError, match="cached under another hash"):
        pc.insert(page_hashes(list(range(1, 5)), 4), [p])
    with pytest.raises(ValueError, match="listed twice"):
        pc.insert(page_hashes(list(range(8)), 4), [q, q])
    with pytest.raises(ValueError, match="len"):
        pc.insert(h, [])
    (r,) = a.allocate(1)
    a.free([r])
    with pytest.raises(ValueError, match="free page"):
        pc.insert(h, [r])


# ---- state machine --------------------------------------------------------------------------------------------
S = 4           # page size
NUM_PAGES = 14  # 13 usable
CHUNKS = [(0, 0, 0, 0), (1, 2, 3, 4), (0, 0, 0, 1)]  # few distinct pages -> many shared prefixes


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.alloc = PageAllocator(NUM_PAGES)
        self.pc = PrefixCache(self.alloc, page_size=S)
        self.seqs = {}                                   # id -> [tokens, pages]
        self.next_id = 0
        self.cached = {}                                 # model: hash -> page
        self.lru = collections.OrderedDict()             # model: evictable cached pages, oldest first
        self.content = {}                                # model of device memory: page -> what was written
        self.hit_tokens = self.query_tokens = 0

    # -- model helpers
    def held(self):
        return collections.Counter(p for _, pages in self.seqs.values() for p in pages)

    def expected_refcount(self, p):
        return self.held()[p] + (p in self.cached.values())

    def write(self, pages, tokens, first_page):
        """Writes the tokens of pages[first_page:]; a written page must be private and uncached."""
        for i in range(first_page, len(pages)):
            p = pages[i]
            assert self.alloc.refcount(p) == 1 and self.pc.page_hash(p) is None, f"writing shared page {p}"
            chunk = tokens[i * S:(i + 1) * S]
            self.content[p] = page_hashes(tokens[:(i + 1) * S], S)[i] if len(chunk) == S else tuple(chunk)

    def model_allocate(self, n):
        """Expected eviction of PrefixCache.allocate(n), mirrored on the model; False if it must fail."""
        num_free = self.alloc.capacity - len(set(self.held()) | set(self.cached.values()))
        short = n - num_free
        if short > len(self.lru):
            return False
        for _ in range(max(short, 0)):
            p, _ = self.lru.popitem(last=False)
            del self.cached[next(h for h, q in self.cached.items() if q == p)]
        return True

    def insert(self, tokens, pages, first_page):
        h = page_hashes(tokens, S)
        got = self.pc.insert(h[first_page:], pages[first_page:len(h)])
        for hh, p, g in zip(h[first_page:], pages[first_page:len(h)], got):
            self.cached.setdefault(hh, p)
            assert g == self.cached[hh]

    # -- rules
    @rule(chunks=st.lists(st.sampled_from(CHUNKS), max_size=4), tail=st.lists(st.integers(0, 2), max_size=3))
    def start(self, chunks, tail):
        tokens = [t for c in chunks for t in c] + tail
        if not tokens:
            return
        h = page_hashes(tokens, S)
        usable = h[: (len(tokens) - 1) // S]
        matched = self.pc.match(usable, num_tokens=len(tokens))
        expect = 0
        while expect < len(usable) and usable[expect] in self.cached:
            expect += 1
        assert len(matched) == expect                    # the longest cached run
        for i, p in enumerate(matched):                  # only pages whose hash chain equals the prompt's
            assert self.content[p] == h[i] == self.pc.page_hash(p) and self.cached[h[i]] == p
            self.lru.pop(p, None)
        self.hit_tokens += len(matched) * S
        self.query_tokens += len(tokens)
        need = -(-len(tokens) // S) - len(matched)
        if not self.model_allocate(need):
            with pytest.raises(OutOfPages):
                self.pc.allocate(need)
            self.pc.free(matched)                        # give the matched references back
            self.model_free(matched)
            return
        pages = matched + self.pc.allocate(need)
        self.seqs[self.next_id] = [tokens, pages]
        self.next_id += 1
        self.write(pages, tokens, len(matched))
        self.insert(tokens, pages, len(matched))

    def model_free(self, pages):
        held = self.held()
        for p in reversed(pages):
            if p in self.cached.values() and held[p] == 0:
                self.lru[p] = None
                self.lru.move_to_end(p)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def extend(self, data, extra):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        tokens, pages = self.seqs[sid]
        old_full = len(tokens) // S
        new_tokens = tokens + extra
        need = -(-len(new_tokens) // S) - len(pages)
        if not self.model_allocate(need):
            with pytest.raises(OutOfPages):
                self.pc.allocate(need)
            return
        pages = pages + self.pc.allocate(need)
        self.seqs[sid] = [new_tokens, pages]
        self.write(pages, new_tokens, old_full)          # the partial last page and the new ones
        self.insert(new_tokens, pages, old_full)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        _, pages = self.seqs.pop(sid)
        self.pc.free(pages)
        self.model_free(pages)

    @rule(n=st.integers(0, 5))
    def evict(self, n):
        before = {p: self.alloc.refcount(p) for p in range(1, NUM_PAGES)}
        evicted = self.pc.evict(n)
        expected = list(self.lru)[:n]
        assert evicted == expected                       # LRU order
        for p in evicted:
            assert before[p] == 1 and self.alloc.refcount(p) == 0
            del self.lru[p]
            del self.cached[next(h for h, q in self.cached.items() if q == p)]

    @invariant()
    def consistent(self):
        a, pc = self.alloc, self.pc
        assert a.num_free + a.num_used == a.capacity
        for p in range(1, NUM_PAGES):
            assert a.refcount(p) == self.expected_refcount(p)
        assert pc.num_cached == len(self.cached)
        for h, p in self.cached.items():
            assert pc.page_hash(p) == h == self.content[p]
        assert pc.num_evictable == len(self.lru) == sum(a.refcount(p) == 1 for p in self.cached.values())
        assert (pc.stats.hit_tokens, pc.stats.query_tokens) == (self.hit_tokens, self.query_tokens)


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
