"""Work items of the MLA decode kernels: which pages of which sequence each program reads, and the split combine.

FlashMLA computes such a schedule once per decode step (``get_mla_metadata``, csrc/kernels/get_mla_metadata.cu:
the pages of all sequences, plus a fixed overhead per sequence, are cut into ``num_sm_parts`` equal shares, so a
batch of mixed lengths keeps every SM busy to the end). Our kernels are not persistent (one program per work item,
not one per SM), so the same balance comes from the work items' sizes and their launch order instead:

- a work item is a contiguous page range of one sequence; its program (one per 64-row block of a kv head) writes
  that range's normalised partial output and log-sum-exp into the item's own row of the split outputs;
- ``balanced_schedule`` (``num_splits=None``): items of at most chunk = cdiv(total pages + 5 B, slots) pages,
  ``slots`` the programs one wave of the SMs holds divided by the programs per item (FlashMLA's num_sm_parts);
  the 5 pages per sequence are FlashMLA's fixed overhead of a split (``FIXED_OVERHEAD_NUM_BLOCKS``,
  csrc/kernels/config.h; its payload per SM part is cdiv(sum of pages + 5 B, parts) + 5, of which a split reads
  at most the payload less 5), so a batch of equal lengths that already fills a wave is not cut. Sequence i gets
  max(1, cdiv(pages_i, chunk)) items of equal size: at most ``slots + B`` items, and at most B * P with P the
  block table's width (one item per page at most), the lesser being the grid's static size (the rest are empty);
- ``even_schedule`` (``num_splits=S``): every sequence cut into S equal ranges (flash-decoding's fixed split);
- both launch the items longest first: the GPU hands thread blocks to SMs in block-index order as SMs free up
  (observed behaviour, not a CUDA guarantee; the kernels' grid makes the item the slow index), which is list
  scheduling, and longest-first list scheduling ends within 4/3 of the best possible time (Graham 1969,
  "Bounds on multiprocessing timing anomalies"); rows stay sequence-major, so each sequence's items are adjacent
  rows and ``combine`` merges them with sorted segment reductions.

Arrays (letters as in common.py; N work items): ``items`` [4, N] int32, column j = the j-th program launched:
(sequence, first page, pages, output row); ``row_seq`` [N] int32, the sequence of each output row (sorted).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels_pallas._mosaic import HOPPER_SMS
from kernels_pallas.common import cdiv
from kernels_pallas.mla.common import LOG2E

OVERHEAD_PAGES = 5  # a split's fixed cost in pages (FlashMLA csrc/kernels/config.h FIXED_OVERHEAD_NUM_BLOCKS)


class Schedule(NamedTuple):
    """items [4, N] int32 in launch order: (sequence, first page, pages, output row); row_seq [N] int32 sorted."""

    items: jax.Array
    row_seq: jax.Array


def _ranges(pages, seq, k, n):
    """Page range [start, start + count) of item k of n of sequence ``seq``: equal ranges of cdiv(p, n) pages."""
    p = pages[seq]
    per = cdiv(p, n)
    start = jnp.minimum(k * per, p)
    return start, jnp.minimum(start + per, p) - start


def _longest_first(seq, start, count):
    """Schedule whose launch order sorts the rows by page count, longest first (stable: ties keep row order)."""
    order = jnp.argsort(-count, stable=True)  # [N]
    items = jnp.stack([seq[order], start[order], count[order], order.astype(jnp.int32)])  # [4, N]
    return Schedule(items.astype(jnp.int32), seq.astype(jnp.int32))


def num_slots(programs_per_item: int, num_sms: int = HOPPER_SMS) -> int:
    """Work items one wave holds: one program per SM (the kernels' SMEM ring allows one CTA per SM)."""
    return max(1, num_sms // programs_per_item)


def balanced_schedule(cache_seqlens, *, page_size: int, programs_per_item: int, num_sms: int = HOPPER_SMS,
                      max_pages: int | None = None) -> Schedule:
    """FlashMLA-style balanced split of a batch of mixed lengths (module docstring); cache_seqlens [B] int32 (traced,
    each at most max_pages * page_size when max_pages, the block table's width, is given).

    Row layout: sequence i owns rows [off_i, off_i + n_i), n_i = max(1, cdiv(pages_i, chunk)); the rows past
    sum(n) are empty items of the last sequence (0 pages: no output, lse -inf, so they weigh nothing)."""
    b = cache_seqlens.shape[0]
    slots = num_slots(programs_per_item, num_sms)
    n_rows = slots + b  # sum_i max(1, cdiv(p_i, chunk)) <= sum_i (p_i / chunk + 1) <= slots + b
    if max_pages is not None:  # and n_i <= max(1, p_i) <= max(1, P): small batches of short sequences
        n_rows = min(n_rows, b * max(1, max_pages))
    pages = cdiv(cache_seqlens.astype(jnp.int32), page_size)  # [B]
    chunk = jnp.maximum(1, cdiv(jnp.sum(pages) + OVERHEAD_PAGES * b, slots))
    n = jnp.maximum(1, cdiv(pages, chunk))  # [B] items per sequence
    ends = jnp.cumsum(n)  # [B] one past each sequence's last row
    rows = jnp.arange(n_rows, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), b - 1).astype(jnp.int32)  # [N]
    k = rows - (ends[seq] - n[seq])
    start, count = _ranges(pages, seq, k, n[seq])
    count = jnp.where(rows < ends[-1], count, 0)
    return _longest_first(seq, jnp.where(rows < ends[-1], start, 0), count)


def even_schedule(cache_seqlens, *, page_size: int, num_splits: int) -> Schedule:
    """Every sequence cut into ``num_splits`` equal page ranges (rows i * num_splits .. + num_splits - 1)."""
    b = cache_seqlens.shape[0]
    pages = cdiv(cache_seqlens.astype(jnp.int32), page_size)  # [B]
    rows = jnp.arange(b * num_splits, dtype=jnp.int32)
    seq, k = rows // num_splits, rows % num_splits
    start, count = _ranges(pages, seq, k, num_splits)
    return _longest_first(seq, start, count)


def combine(o_part, lse_part, row_seq, *, batch: int, rows: int):
    """Merge each sequence's items (flash-decoding): weights 2^(lse_j - lse), lse = log2 sum_j 2^lse_j.

    o_part [N, G, R_pad, V] f32 (each item normalised; rows of items that saw no key are never read, the kernels
    leave those of empty items unwritten), lse_part [N, G, R_pad] f32 (log2 units), row_seq [N] ->
    out [B, G, R, V] f32, lse [B, G, R] (natural log; -inf where no item saw a key: out 0 there)."""
    lse_part = lse_part[..., :rows]  # [N, G, R]
    seg = dict(segment_ids=row_seq, num_segments=batch, indices_are_sorted=True)
    mx = jax.ops.segment_max(lse_part, **seg)  # [B, G, R]
    mx = jnp.where(mx == -jnp.inf, 0.0, mx)
    wts = jnp.exp2(lse_part - mx[row_seq])  # [N, G, R]; 0 for an item that saw no key
    tot = jax.ops.segment_sum(wts, **seg)  # [B, G, R]
    # where(): an item's weight is 0 exactly when it saw no key, and its o_part row may be unwritten memory.
    weighted = jnp.where(wts[..., None] > 0, wts[..., None] * o_part[..., :rows, :], 0.0)  # [N, G, R, V]
    out = jax.ops.segment_sum(weighted, **seg) / jnp.where(tot > 0, tot, 1.0)[..., None]
    lse = (jnp.log2(tot) + mx) / LOG2E  # [B, G, R]
    return out, lse
