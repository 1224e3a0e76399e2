"""Scheduler and Sequence (host side, no JAX): unit tests and a hypothesis property test of random workloads.

A fake "model" samples token ``fake_token(seq_id, position)`` for the token at ``position`` (a function of nothing
else), so a request's outputs are known in advance (``expected_outputs``) whatever the batch, the page budget or
the preemptions: recomputation must give the same tokens. Pages are 4 tokens so that small prompts cross pages.
"""

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.engine.scheduler import Scheduler, bucket
from jaxinfer.engine.sequence import Sequence, SequenceStatus

S = 4          # page size of these tests
VOCAB = 50
EOS = 7


def fake_token(seq_id: int, position: int) -> int:
    """The token the fake model samples for position ``position`` of sequence ``seq_id``."""
    return (seq_id * 1_000_003 + position * 7_919 + (seq_id * position) % 13) % VOCAB


def expected_outputs(seq: Sequence, max_model_len: int, eos=EOS) -> tuple[list[int], str]:
    """Outputs and finish reason of ``seq`` under the fake model, computed without any scheduler."""
    out, p = [], seq.params
    n = seq.num_prompt_tokens
    while True:
        t = fake_token(seq.seq_id, n + len(out))
        out.append(t)
        if (not p.ignore_eos and t == eos) or t in p.stop_token_ids:
            return out, "stop"
        if len(out) >= p.max_tokens or n + len(out) >= max_model_len:
            return out, "length"


def step(sched: Scheduler, check=None):
    """One schedule + fake model + update; returns (plan, finished) or (None, [])."""
    plan = sched.schedule()
    if plan is None:
        return None, []
    if check is not None:
        check(sched, plan)
    return plan, sched.update(plan, fake_sampled(plan))


def run_all(sched: Scheduler, check=None, max_steps=20_000) -> list:
    plans = []
    for _ in range(max_steps):
        plan, _ = step(sched, check)
        if plan is None:
            assert not sched.has_unfinished()
            return plans
        plans.append(plan)
    raise AssertionError(f"no termination within {max_steps} steps")


def make(num_ranks=1, num_pages=64, **kw):
    kw = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256, enable_prefix_caching=True,
              page_size=S, eos_token_id=EOS, min_prefill_t=1) | kw
    return Scheduler(num_ranks, num_pages, **kw)


def seq(i, n, max_tokens=4, ignore_eos=True, prompt=None):
    prompt = prompt if prompt is not None else [(i * 31 + j) % VOCAB for j in range(n)]
    return Sequence(i, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos))


# ---- construction and add ---------------------------------------------------------------------------------------
def test_invalid_arguments():
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        make(max_num_seqs=0)
    with pytest.raises(ValueError, match="num_pages_per_rank=1"):
        make(num_pages=1)
    with pytest.raises(ValueError, match="num_scheduler_steps=0"):
        make(num_scheduler_steps=0)
    sched = make()
    s = sched.add(seq(0, 3))
    with pytest.raises(ValueError, match="already added"):
        sched.add(s)
    with pytest.raises(ValueError, match="already in use"):
        sched.add(seq(0, 3))


def test_bad_requests_finish_with_error_at_add():
    sched = make(num_pages=4, max_model_len=10)        # capacity 3 pages = 12 tokens
    empty = sched.add(Sequence(1, []))
    long_ = sched.add(seq(2, 11))
    assert empty.finish_reason == "error" and "empty" in empty.error
    assert long_.finish_reason == "error" and "max_model_len=10" in long_.error
    sched2 = make(num_pages=3, max_model_len=100)      # capacity 2 pages = 8 tokens
    big = sched2.add(seq(3, 9))
    assert big.finish_reason == "error" and "needs 3 KV pages" in big.error
    ok = sched2.add(seq(4, 5, max_tokens=2))
    assert sched2.has_unfinished() and not ok.is_finished and sched2.num_unfinished() == 1
    run_all(sched2)
    assert ok.output_token_ids == expected_outputs(ok, 100)[0]


def test_load_balancer():
    sched = make(num_ranks=3)
    a = sched.add(seq(0, 10))                          # 3 pages promised
    b = sched.add(seq(1, 2))                           # 1
    c = sched.add(seq(2, 5))                           # 2
    d = sched.add(seq(3, 1))                           # ranks hold 3, 1, 2 pages -> rank 1
    e = sched.add(seq(4, 4))                           # 3, 2, 2 pages; 1, 2, 1 requests -> rank 2
    assert [s.rank for s in (a, b, c, d)] == [0, 1, 2, 1]
    assert e.rank == 2                                 # pages tie 2 vs 2; rank 2 has 1 request, rank 1 has 2
    assert sched.rank_load(0) == (3, 1, 0)
    # Pages in use count once the requests run (allocator pages instead of promises).
    step(sched)
    assert sched.stats(0).num_pages_used == 3 and sched.stats(0).num_running == 1
    assert sched.rank_load(0)[0] == 3


def test_load_balancer_counts_requests_on_page_ties():
    sched = make(num_ranks=2)
    a, b, c = sched.add(seq(0, 4)), sched.add(seq(1, 4)), sched.add(seq(2, 4))
    assert [a.rank, b.rank, c.rank] == [0, 1, 0]


# ---- chunked prefill ----------------------------------------------------------------------------------------------
def test_chunked_prefill_splits_long_prompt():
    sched = make(max_num_batched_tokens=4)
    s = sched.add(seq(0, 10, max_tokens=3))
    plans = run_all(sched)
    kinds = [(p.kind, [(c.start, c.num_tokens, c.sample) for c in p.all_chunks()]) for p in plans]
    assert kinds == [("prefill", [(0, 4, False)]), ("prefill", [(4, 4, False)]), ("prefill", [(8, 2, True)]),
                     ("decode", [(10, 1, True)]), ("decode", [(11, 1, True)])]
    assert s.output_token_ids == expected_outputs(s, 256)[0] and s.finish_reason == "length"
    assert sched.stats(0).num_pages_used == sched.stats(0).num_pages_cached == 3   # pages of 12 computed tokens


def test_prefill_budget_shared_fifo_and_max_num_seqs():
    sched = make(max_num_batched_tokens=6, max_num_seqs=2)
    a, b, c = sched.add(seq(0, 4)), sched.add(seq(1, 4)), sched.add(seq(2, 4))
    plan = sched.schedule()
    assert plan.kind == "prefill" and [(c_.seq.seq_id, c_.start, c_.num_tokens) for c_ in plan.chunks[0]] == \
        [(0, 0, 4), (1, 0, 2)]
    assert c.status is SequenceStatus.WAITING           # max_num_seqs=2
    sched.update(plan, {0: 1})
    plan = sched.schedule()                              # b's prefill continues before any decode
    assert plan.kind == "prefill" and [(x.seq.seq_id, x.start, x.num_tokens) for x in plan.chunks[0]] == [(1, 2, 2)]


# ---- prefix caching -----------------------------------------------------------------------------------------------
def test_prefix_cache_reuse_at_admission():
    sched = make()
    base = [(3 * j + 1) % VOCAB for j in range(9)]
    a = sched.add(seq(0, 0, max_tokens=1, prompt=base))
    run_all(sched)
    cache = sched.caches[0]
    assert a.is_finished and cache.num_cached == 2      # 9 computed tokens: 2 full pages registered
    b = sched.add(seq(1, 0, max_tokens=3, prompt=base[:8] + [40, 41]))
    plan = sched.schedule()
    (chunk,) = plan.chunks[0]
    assert b.num_cached_tokens == 8 and (chunk.start, chunk.num_tokens) == (8, 2)
    assert [cache.allocator.refcount(p) for p in b.pages[:2]] == [2, 2]   # the cache's + b's
    assert all(cache.page_hash(p) is None and cache.allocator.refcount(p) == 1 for p in b.pages[2:])
    # The last prompt token is always computed: a prompt of exactly 2 pages reuses only the first.
    c = sched.add(seq(2, 0, max_tokens=1, prompt=base[:8]))
    sched.update(plan, {1: fake_token(1, 10)})
    plan = sched.schedule()
    assert c.num_cached_tokens == 4 and [(x.start, x.num_tokens) for x in plan.chunks[0]] == [(4, 4)]
    run_all(sched)
    assert b.output_token_ids == expected_outputs(b, 256)[0]
    assert cache.allocator.num_used == cache.num_cached == cache.num_evictable


def test_prefix_caching_disabled_never_matches():
    sched = make(enable_prefix_caching=False)
    p = list(range(12))
    sched.add(seq(0, 0, max_tokens=1, prompt=p))
    run_all(sched)
    b = sched.add(seq(1, 0, max_tokens=1, prompt=p))
    run_all(sched)
    assert b.num_cached_tokens == 0 and sched.caches[0].num_cached == 0 and sched.stats(0).num_pages_used == 0


# ---- preemption ---------------------------------------------------------------------------------------------------
def test_preemption_newest_first_outputs_kept():
    # capacity 4 pages = 16 slots; two sequences of 4 + 8 tokens need up to 3 pages each.
    sched = make(num_pages=5, enable_prefix_caching=False)
    a, b = sched.add(seq(0, 4, max_tokens=8)), sched.add(seq(1, 4, max_tokens=8))
    seen = []

    def check(sched_, plan):
        for v in plan.preempted:
            seen.append((v.seq_id, v.num_output_tokens))
            assert v.status is SequenceStatus.WAITING and v.pages == [] and v.num_computed_tokens == 0
            assert sched_.waiting[0][0] is v
    run_all(sched, check)
    assert seen and all(i == 1 for i, _ in seen)        # b is the newest: only it is preempted
    assert seen[0][1] > 0 and b.num_preemptions == len(seen) and a.num_preemptions == 0
    for s in (a, b):
        assert s.output_token_ids == expected_outputs(s, 256)[0] and s.finish_reason == "length"
    assert sched.stats(0).num_pages_used == 0


def test_sequence_that_can_never_fit_finishes_with_error():
    sched = make(num_pages=3)                           # capacity 2 pages = 8 slots
    s = sched.add(seq(0, 4, max_tokens=10))
    ok = sched.add(seq(1, 2, max_tokens=2))
    plans = run_all(sched)
    assert s.finish_reason == "error" and "needs 3 KV pages" in s.error
    assert len(s.output_token_ids) == 5                 # positions 0..7 computed, 8 tokens of outputs + prompt + 1
    assert any(s in p.finished for p in plans)
    assert ok.finish_reason == "length" and ok.output_token_ids == expected_outputs(ok, 256)[0]
    assert sched.stats(0).num_pages_used == sched.stats(0).num_pages_cached


# ---- stop checks --------------------------------------------------------------------------------------------------
def test_stop_checks():
    sched = make(max_model_len=9)
    # Find seq ids whose first output is EOS, to test ignore_eos and stop_token_ids deterministically.
    sid = next(i for i in range(10_000) if fake_token(i, 5) == EOS)
    eos = sched.add(Sequence(sid, [1] * 5, SamplingParams(max_tokens=5)))
    run_all(sched)
    assert eos.output_token_ids == [EOS] and eos.finish_reason == "stop"
    ign = sched.add(Sequence(sid, [1] * 5, SamplingParams(max_tokens=5, ignore_eos=True)))
    run_all(sched)
    assert ign.finish_reason == "length" and ign.num_tokens == 9   # max_model_len caps before max_tokens
    tok = fake_token(sid + 1, 5)
    st_ = sched.add(Sequence(sid + 1, [2] * 5, SamplingParams(max_tokens=5, stop_token_ids=[tok])))
    run_all(sched)
    assert st_.output_token_ids == [tok] and st_.finish_reason == "stop"


def test_engine_finish_for_stop_strings_and_stale_chunks():
    sched = make()
    a, b = sched.add(seq(0, 3, max_tokens=10)), sched.add(seq(1, 3, max_tokens=10))
    plan, _ = step(sched)
    plan = sched.schedule()
    sched.finish(a, "stop")                              # e.g. a stop string seen by the detokenizer
    done = sched.update(plan, {0: 1, 1: 2})              # a's chunk is skipped
    assert done == [] and a.output_token_ids == [fake_token(0, 3)] and b.num_output_tokens == 2
    assert a.pages == [] and a.is_finished
    with pytest.raises(ValueError, match="not an unfinished"):
        sched.finish(a, "stop")
    with pytest.raises(ValueError, match="no sampled token"):
        sched.update(sched.schedule(), {})


def test_multi_step_decode_chunks():
    """num_scheduler_steps = 4: a decode chunk covers the last token and the tokens the step samples, within
    max_tokens, max_model_len and the pages it can get; tokens after a stop token are dropped."""
    sched = make(num_pages=4, num_scheduler_steps=4, max_model_len=12)  # 3 usable pages of 4 tokens
    a = sched.add(seq(0, 5, max_tokens=10))
    b = sched.add(seq(1, 2, max_tokens=3))
    plan, _ = step(sched)                                           # prefill: a gets 2 pages, b 1; 1 token each
    assert plan.kind == "prefill" and a.num_output_tokens == b.num_output_tokens == 1
    plan = sched.schedule()                                         # a: 4 tokens need page 3; b: 2 left (max 3)
    assert plan.kind == "decode" and [(c.seq.seq_id, c.start, c.num_tokens) for c in plan.chunks[0]] == [
        (0, 5, 3), (1, 2, 2)]                                       # a: 3 granted (its pages hold 12 positions)
    sched.update(plan, fake_sampled(plan))
    assert b.is_finished and b.finish_reason == "length" and b.num_output_tokens == 3
    assert a.num_output_tokens == 4 and a.num_computed_tokens == 8
    plan = sched.schedule()                                         # max_model_len 12: 3 more tokens at most
    assert [(c.start, c.num_tokens) for c in plan.chunks[0]] == [(8, 3)]
    tokens = [EOS if j == 1 else 3 for j in range(3)]
    a.params = SamplingParams(max_tokens=10, ignore_eos=False)
    sched.update(plan, {0: tokens})
    assert a.is_finished and a.finish_reason == "stop" and a.output_token_ids[-2:] == [3, EOS]
    assert a.num_output_tokens == 6


# ---- property test ------------------------------------------------------------------------------------------------
def _check_plan(sched: Scheduler, plan):
    """Invariants of every step: limits, prefill grid, page ownership, refcounts, shared pages never written."""
    if plan.kind == "prefill":
        t = bucket(max(c.num_tokens for c in plan.all_chunks()), sched.min_prefill_t)
        assert max(map(len, plan.chunks)) * t <= sched.prefill_capacity
    for rank in range(sched.num_ranks):
        cache = sched.caches[rank]
        alloc = cache.allocator
        assert len(sched.running[rank]) <= sched.max_num_seqs
        chunks = plan.chunks[rank]
        assert len({id(c.seq) for c in chunks}) == len(chunks)
        if plan.kind == "prefill":
            assert plan.num_tokens(rank) <= sched.max_num_batched_tokens
        for c in chunks:
            s = c.seq
            assert s.rank == rank and s.status is SequenceStatus.RUNNING and c.num_tokens >= 1
            assert c.start == s.num_computed_tokens
            if plan.kind == "prefill":
                assert c.start + c.num_tokens <= s.num_tokens
                assert c.sample == (c.start + c.num_tokens == s.num_tokens)
            else:  # the last token, then up to k - 1 it samples itself, within max_tokens and max_model_len
                assert c.sample and c.start == s.num_tokens - 1
                assert c.num_tokens <= min(sched.num_scheduler_steps, s.params.max_tokens - s.num_output_tokens,
                                           sched.max_model_len - s.num_tokens)
            assert len(s.pages) * sched.page_size >= c.start + c.num_tokens
            for p in s.pages[c.start // sched.page_size:(c.start + c.num_tokens - 1) // sched.page_size + 1]:
                assert cache.page_hash(p) is None and alloc.refcount(p) == 1, "a shared/cached page is written"
        for s in sched.waiting[rank]:
            assert s.pages == [] and s.num_computed_tokens == 0 and s.status is SequenceStatus.WAITING
        holders = {}
        for s in sched.running[rank]:
            assert len(set(s.pages)) == len(s.pages)
            for p in s.pages:
                holders[p] = holders.get(p, 0) + 1
        for p in range(1, alloc.num_pages):
            expect = holders.get(p, 0) + (cache.page_hash(p) is not None)
            assert alloc.refcount(p) == expect, (p, alloc.refcount(p), expect)
        assert alloc.num_used == sum(1 for p in range(1, alloc.num_pages) if alloc.refcount(p))


PREFIXES = [[], [5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 1, 2, 3], [20] * 9]


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 10))
    reqs = []
    for i in range(n):
        prefix = draw(st.sampled_from(PREFIXES))
        suffix = draw(st.lists(st.integers(0, VOCAB - 1), min_size=0 if prefix else 1, max_size=10))
        params = SamplingParams(max_tokens=draw(st.integers(1, 12)), ignore_eos=draw(st.booleans()),
                                stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=2)))
        reqs.append((draw(st.integers(0, 6)), prefix + suffix, params))    # (arrival step, prompt, params)
    return dict(reqs=reqs, num_ranks=draw(st.integers(1, 3)), extra_pages=draw(st.integers(0, 6)),
                max_num_seqs=draw(st.integers(1, 4)), max_num_batched_tokens=draw(st.integers(1, 16)),
                max_model_len=draw(st.integers(8, 40)), prefix=draw(st.booleans()),
                min_prefill_t=draw(st.sampled_from([1, 2, 8])), steps=draw(st.sampled_from([1, 2, 4])))


def fake_sampled(plan) -> dict[int, int | list[int]]:
    """The fake model's tokens for a plan: one per sampling chunk; for a multi-step decode chunk, one per
    iteration (iteration j computes position start + j and samples the token at start + j + 1)."""
    out = {}
    for c in plan.all_chunks():
        if c.sample and plan.kind == "decode" and c.num_tokens > 1:
            out[c.seq.seq_id] = [fake_token(c.seq.seq_id, c.start + 1 + j) for j in range(c.num_tokens)]
        elif c.sample:
            out[c.seq.seq_id] = fake_token(c.seq.seq_id, c.start + c.num_tokens)
    return out


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads())
def test_random_workloads(w, overlap):
    """sync: schedule, update. async (the engine's loop): schedule n+1 and commit it before step n's tokens are
    resolved, so sequences carry placeholders while being scheduled."""
    L = w["max_model_len"]
    # Every admissible request fits alone: pages for min(prompt + max_tokens - 1, max_model_len) positions.
    need = max(-(-min(len(p) + sp.max_tokens - 1, L) // S) for _, p, sp in w["reqs"])
    sched = Scheduler(w["num_ranks"], 1 + need + w["extra_pages"], max_num_seqs=w["max_num_seqs"],
                      max_num_batched_tokens=w["max_num_batched_tokens"], max_model_len=L,
                      enable_prefix_caching=w["prefix"], page_size=S, eos_token_id=EOS,
                      min_prefill_t=w["min_prefill_t"], num_scheduler_steps=w["steps"])
    seqs, in_flight = [], None
    pending = sorted(enumerate(w["reqs"]), key=lambda x: x[1][0])
    for t in range(20_000):
        while pending and pending[0][1][0] <= t:
            i, (_, prompt, params) = pending.pop(0)
            seqs.append(sched.add(Sequence(i, prompt, params)))
        if overlap:
            plan = sched.schedule()
            if plan is not None:
                _check_plan(sched, plan)
                sched.commit(plan)
            if in_flight is not None:
                sched.resolve(*in_flight)
            in_flight = None if plan is None else (plan, fake_sampled(plan))
        else:
            plan, _ = step(sched, _check_plan)
        if plan is None and not pending and in_flight is None:
            break
    else:
        raise AssertionError("workload did not finish")
    assert not sched.has_unfinished()
    for s in seqs:
        assert s.is_finished
        if len(s.prompt_token_ids) > L:
            assert s.finish_reason == "error" and s.output_token_ids == []
            continue
        assert (s.output_token_ids, s.finish_reason) == expected_outputs(s, L), s
    for cache in sched.caches:                           # no leaks: only prefix-cache pages remain, held by it alone
        assert cache.allocator.num_used == cache.num_cached == cache.num_evictable
        assert all(cache.allocator.refcount(p) == (cache.page_hash(p) is not None)
                   for p in range(1, cache.allocator.num_pages))
