"""MLA decode work items (kernels_pallas.mla.schedule): the schedules' invariants over random batches (hypothesis),
and the split combine against independent float64 attention over the whole sequence.

The kernels that read these schedules are checked against mla_decode_reference in test_mla_decode.py (GPU
interpret mode, num_splits=None with a small num_sms so a sequence spans several items).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels_pallas.mla import schedule as mla_schedule
from kernels_pallas.mla.schedule import OVERHEAD_PAGES, num_slots

PAGE = 64
# jitted once per batch size (as inside mla_decode), so the examples do not re-trace every op eagerly
balanced_schedule = functools.partial(
    jax.jit, static_argnames=("page_size", "programs_per_item", "num_sms", "max_pages"))(mla_schedule.balanced_schedule)
even_schedule = functools.partial(jax.jit, static_argnames=("page_size", "num_splits"))(mla_schedule.even_schedule)
combine = functools.partial(jax.jit, static_argnames=("batch", "rows"))(mla_schedule.combine)
seqlens_st = st.lists(st.integers(0, 40 * PAGE), min_size=1, max_size=12)


def check_partition(sched, seqlens):
    """Every sequence's pages are covered once, in adjacent rows of its own, and items launch longest first."""
    items, row_seq = np.asarray(sched.items), np.asarray(sched.row_seq)
    seq, start, count, row = items
    n = items.shape[1]
    assert sorted(row) == list(range(n))  # a permutation: every output row written once
    assert (np.diff(count) <= 0).all()  # longest first
    assert (np.diff(row_seq) >= 0).all() and (row_seq[row] == seq).all()  # sequence-major rows
    for i, s in enumerate(seqlens):
        mine = seq == i
        assert mine.any()  # every sequence has a row, so combine sees it
        covered = np.zeros(-(-s // PAGE), int)
        for a, c in zip(start[mine], count[mine]):
            covered[a:a + c] += 1
        assert (covered == 1).all(), (i, s, covered)
    return seq, start, count


@given(seqlens=seqlens_st, programs=st.sampled_from([1, 2, 4, 8]), num_sms=st.sampled_from([4, 16, 132]),
       spare_pages=st.one_of(st.none(), st.integers(0, 3)))
@settings(max_examples=60, deadline=None)
def test_balanced_schedule_partitions_and_balances(seqlens, programs, num_sms, spare_pages):
    """spare_pages: the block table is that many pages wider than the longest sequence (None: width not given)."""
    max_pages = None if spare_pages is None else max(-(-s // PAGE) for s in seqlens) + spare_pages
    sched = balanced_schedule(jnp.asarray(seqlens, jnp.int32), page_size=PAGE, programs_per_item=programs,
                              num_sms=num_sms, max_pages=max_pages)
    seq, _, count = check_partition(sched, seqlens)
    slots = num_slots(programs, num_sms)
    total = sum(-(-s // PAGE) for s in seqlens)
    rows = slots + len(seqlens)
    if max_pages is not None:
        rows = min(rows, len(seqlens) * max(1, max_pages))
    assert sched.items.shape[1] == rows
    # FlashMLA's share: no item holds more than its payload less the fixed overhead, cdiv(total + 5 B, slots).
    chunk = max(1, -(-(total + OVERHEAD_PAGES * len(seqlens)) // slots))
    assert count.max() <= chunk
    # and a sequence is only cut when it holds more than that
    for i, s in enumerate(seqlens):
        assert ((seq == i) & (count > 0)).sum() == -(-(-(-s // PAGE)) // chunk)


@given(seqlens=seqlens_st, num_splits=st.integers(1, 5))
@settings(max_examples=40, deadline=None)
def test_even_schedule_cuts_each_sequence_into_equal_ranges(seqlens, num_splits):
    sched = even_schedule(jnp.asarray(seqlens, jnp.int32), page_size=PAGE, num_splits=num_splits)
    seq, _, count = check_partition(sched, seqlens)
    assert sched.items.shape[1] == len(seqlens) * num_splits
    for i, s in enumerate(seqlens):
        assert (count[seq == i] <= -(-(-(-s // PAGE)) // num_splits)).all()


def test_balanced_schedule_worked_cases():
    """Pages (20, 1, 2) on 8 slots: chunk cdiv(23 + 15, 8) = 5, so the 20-page sequence is cut into 4 items of 5
    and launched first; 3 empty rows pad the grid to slots + B = 11. Equal lengths that fill a wave are not cut
    (128 x 64 pages on 132 slots: chunk 67), as FlashMLA's payload leaves them whole."""
    sched = balanced_schedule(jnp.asarray([1280, 1, 70], jnp.int32), page_size=PAGE, programs_per_item=1, num_sms=8)
    seq, start, count, row = np.asarray(sched.items)
    assert count.tolist() == [5, 5, 5, 5, 2, 1, 0, 0, 0, 0, 0]
    assert seq[:6].tolist() == [0, 0, 0, 0, 2, 1] and start[:4].tolist() == [0, 5, 10, 15]
    assert np.asarray(sched.row_seq).tolist() == [0, 0, 0, 0, 1, 2, 2, 2, 2, 2, 2]
    even = balanced_schedule(jnp.full((128,), 4096, jnp.int32), page_size=PAGE, programs_per_item=1)
    assert (np.asarray(even.items[2])[:128] == 64).all() and (np.asarray(even.items[2])[128:] == 0).all()
    # one sequence of 2 pages in a table 4 pages wide: 4 rows (one per page at most), not 132 + 1
    short = balanced_schedule(jnp.asarray([100], jnp.int32), page_size=PAGE, programs_per_item=1, max_pages=4)
    assert np.asarray(short.items[2]).tolist() == [1, 1, 0, 0]


def np_attention(q, k, v):
    """Float64 softmax attention of rows q [R, D] over keys k [T, D], values v [T, V] -> (out [R, V], lse [R])."""
    s = q @ k.T  # [R, T]
    mx = s.max(axis=1, keepdims=True)
    e = np.exp(s - mx)
    return e @ v / e.sum(axis=1, keepdims=True), (mx[:, 0] + np.log(e.sum(axis=1)))


@pytest.mark.parametrize("which", ["balanced", "even"])
@given(seqlens=st.lists(st.integers(1, 6 * PAGE), min_size=1, max_size=5), seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None)
def test_combine_of_item_partials_equals_whole_sequence_attention(which, seqlens, seed):
    """Each item's partial (softmax over its own pages, lse in log2 units, as the kernels store them) merged by
    ``combine`` equals attention over the whole sequence."""
    rng = np.random.default_rng(seed)
    g, r, r_pad, d, dv = 1, 3, 4, 8, 5
    lens = jnp.asarray(seqlens, jnp.int32)
    sched = (balanced_schedule(lens, page_size=PAGE, programs_per_item=1, num_sms=6) if which == "balanced"
             else even_schedule(lens, page_size=PAGE, num_splits=3))
    seq, start, count, row = np.asarray(sched.items)
    q = rng.standard_normal((len(seqlens), r, d))
    keys = [rng.standard_normal((s, d)) for s in seqlens]
    n = len(row)
    o_part = np.full((n, g, r_pad, dv), np.nan)  # padding rows of R_pad are never read
    lse_part = np.full((n, g, r_pad), np.nan)
    for i, a, c, j in zip(seq, start, count, row):
        k = keys[i][a * PAGE:(a + c) * PAGE]
        if len(k) == 0:  # an empty item: the kernels store lse -inf and leave its output rows unwritten (NaN here)
            lse_part[j, 0, :r] = -np.inf
            continue
        o, lse = np_attention(q[i], k, k[:, :dv])
        o_part[j, 0, :r], lse_part[j, 0, :r] = o, lse / np.log(2)
    out, lse = combine(jnp.asarray(o_part, jnp.float32), jnp.asarray(lse_part, jnp.float32), sched.row_seq,
                       batch=len(seqlens), rows=r)
    for i, k in enumerate(keys):
        ref_o, ref_lse = np_attention(q[i], k, k[:, :dv])
        np.testing.assert_allclose(np.asarray(out[i, 0]), ref_o, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(lse[i, 0]), ref_lse, rtol=1e-5, atol=1e-5)


def test_combine_of_a_sequence_that_saw_no_key_is_zero_and_minus_inf():
    sched = balanced_schedule(jnp.asarray([0, 64], jnp.int32), page_size=PAGE, programs_per_item=1, num_sms=2)
    n = sched.items.shape[1]
    row = np.asarray(sched.items[3])
    count = np.asarray(sched.items[2])
    o_part = np.full((n, 1, 1, 2), np.nan, np.float32)  # unwritten rows
    lse_part = np.full((n, 1, 1), -np.inf, np.float32)
    lse_part[row[count > 0]] = 1.0  # the one non-empty item (sequence 1)
    o_part[row[count > 0]] = 7.0
    out, lse = combine(jnp.asarray(o_part), jnp.asarray(lse_part), sched.row_seq, batch=2, rows=1)
    assert np.asarray(out[0]).tolist() == [[[0.0, 0.0]]] and np.asarray(lse[0]).tolist() == [[-np.inf]]
    np.testing.assert_allclose(np.asarray(out[1]), 7.0)
    np.testing.assert_allclose(np.asarray(lse[1]), np.log(2.0), rtol=1e-6)
