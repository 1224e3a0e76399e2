"""MLA decode over a paged latent cache (FlashMLA's contract, DESIGN.md "FlashMLA decode contract").

Four parts (DESIGN.md "Kernels"): the Mosaic GPU kernel body -> its ``plgpu.kernel`` wrapper, with the work-item
schedule and the split combine (``_decode_pallas``, mla_schedule.py) -> ``mla_decode`` (public entry,
``implementation="pallas" | "xla"``, tuning knobs) -> ``mla_decode_reference`` (plain jnp, fp32). ``_decode_xla`` is
the XLA path the engine uses on CPU.

Two kernel bodies in three variants, chosen with the static knob ``kernel=`` of ``mla_decode``; all run on grid (work
items, G * row blocks), a work item being a page range of one sequence (mla_schedule.py: balanced over the batch's
lengths, launched longest first), with one producer warpgroup streaming q and the item's pages through an SMEM
ring (``_produce``), and write the same per-item outputs that ``mla_schedule.combine`` merges:
- ``"recompute_scores"`` (default): this file's ``_decode_kernel`` (``_recompute_scores_pallas``). Each compute
  warpgroup owns block_dv output columns and computes the page's 64 x 64 scores S = Q K^T itself, so with V3's
  dv = 512, block_dv = 256 the QK wgmma runs twice per page. Measured: 1675-2094 GB/s on an H200
  (docs/benchmarks.md).
- ``"shared_scores"``: mla_decode_shared.py (``shared_scores_pallas``), FlashMLA's structure
  (csrc/flash_fwd_mla_kernel.h): warpgroup 0 computes S once per page, runs the online softmax and hands P and the
  rescale factor to the other compute warpgroups through SMEM; each does O += P V for its own columns. It lowers
  for cuda and passes in GPU interpret mode; not yet compiled, run or measured on a GPU, hence not the default.
- ``"pingpong"``: ``_decode_kernel`` with FlashAttention-3's warpgroup ping-pong (``turn_bars``): the compute
  warpgroups take turns at the tensor cores, so one's softmax runs while the other's wgmma does. Not yet run on a
  GPU either.

Shapes (letters used throughout): B batch, Q query tokens per sequence (s_q), N query heads (h_q), G kv heads
(h_kv), M = N // G query heads per kv head, D = q/k head dim (576 for V3: 512 latent + 64 rope), V = head_dim_v
(512; V = K[..., :V]), P pages per sequence (block_table width), S page size (64 in FlashMLA), R = Q * M rows of
one kv head's queries (FlashMLA packs them the same way: row r is query r // M, head r % M).

Semantics (FlashMLA tests/test_flash_mla.py): key t of sequence b lives at kv_cache[block_table[b, t // S], t % S];
query i (of Q) sees keys t < seqlen[b] (causal: t < seqlen[b] - Q + i + 1); head n uses kv head n // M;
out = softmax(q k^T * scale) v; lse = natural-log sum of exp(scores) over visible keys. A query that sees no key
gets out 0 and lse -inf. Cache slots at or past a sequence's length are never read into the result (their values
are masked, not only their scores, since 0 * NaN = NaN).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import _mosaic
from kernels_pallas.mla_schedule import LOG2E as _LOG2E
from kernels_pallas.mla_schedule import balanced_schedule, combine, even_schedule

_BLOCK_M = 64  # rows per program: the wgmma M of one warpgroup
_MAX_GRID_Y = 65535  # gridDim.y limit (CUDA C Programming Guide, "Technical Specifications per Compute Capability")
# Dynamic shared memory one CTA may opt into on sm_90 (CUDA C Programming Guide, "Technical Specifications per
# Compute Capability": 227 KB); Mosaic GPU refuses kernels above it (jax/experimental/mosaic/gpu/core.py).
SMEM_BYTES = 227 * 1024
KERNELS = ("recompute_scores", "shared_scores", "pingpong")


# ----------------------------------------------------------------------------------------------- validation
def _check_inputs(q, kv_cache, block_table, cache_seqlens, head_dim_v):
    """Validate shapes and dtypes; returns (B, Q, N, D, G, P, S)."""
    if q.ndim != 4:
        raise ValueError(f"q must be [b, s_q, h_q, d], got rank {q.ndim} shape {q.shape}")
    if kv_cache.ndim != 4:
        raise ValueError(f"kv_cache must be [num_pages, page_size, h_kv, d], got rank {kv_cache.ndim} "
                         f"shape {kv_cache.shape}")
    if block_table.ndim != 2:
        raise ValueError(f"block_table must be [b, max_pages], got rank {block_table.ndim} "
                         f"shape {block_table.shape}")
    if cache_seqlens.ndim != 1:
        raise ValueError(f"cache_seqlens must be [b], got rank {cache_seqlens.ndim} shape {cache_seqlens.shape}")
    b, s_q, h_q, d = q.shape
    _, page_size, h_kv, d_k = kv_cache.shape
    if d_k != d:
        raise ValueError(f"q head dim {d=} must equal kv_cache head dim {d_k}")
    if not 0 < head_dim_v <= d:
        raise ValueError(f"{head_dim_v=} must be in [1, d={d}]")
    if h_kv < 1 or h_q % h_kv:
        raise ValueError(f"{h_q=} must be a multiple of {h_kv=}")
    if block_table.shape[0] != b or cache_seqlens.shape[0] != b:
        raise ValueError(f"batch mismatch: q has b={b}, block_table {block_table.shape[0]}, "
                         f"cache_seqlens {cache_seqlens.shape[0]}")
    for name, x in (("block_table", block_table), ("cache_seqlens", cache_seqlens)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array (int32), got dtype {x.dtype}")
    for name, x in (("q", q), ("kv_cache", kv_cache)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating array, got dtype {x.dtype}")
    if s_q < 1 or page_size < 1:
        raise ValueError(f"{s_q=} and {page_size=} must be >= 1")
    return b, s_q, h_q, d, h_kv, block_table.shape[1], page_size


def _query_limits(cache_seqlens, s_q, causal):
    """Number of visible keys per (sequence, query): [B, Q] int32."""
    seqlens = cache_seqlens.astype(jnp.int32)[:, None]  # [B, 1]
    if not causal:
        return jnp.broadcast_to(seqlens, (seqlens.shape[0], s_q))
    return seqlens - s_q + 1 + jnp.arange(s_q, dtype=jnp.int32)[None, :]  # [B, Q]


# ----------------------------------------------------------------------------------------------- reference
def mla_decode_reference(q, kv_cache, block_table, cache_seqlens, *, head_dim_v=512, softmax_scale=None,
                         causal=False):
    """Plain-jnp fp32 MLA decode: gather every page, mask values and scores, softmax. Returns (out, lse).

    q [B, Q, N, D], kv_cache [pages, S, G, D], block_table [B, P] int32, cache_seqlens [B] int32 ->
    out [B, Q, N, V] (q's dtype), lse [B, N, Q] float32 (natural log).
    """
    b, s_q, h_q, d, h_kv, p, ps = _check_inputs(q, kv_cache, block_table, cache_seqlens, head_dim_v)
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    m = h_q // h_kv
    k = kv_cache[block_table].astype(jnp.float32).reshape(b, p * ps, h_kv, d)  # [B, T, G, D]
    pos = jnp.arange(p * ps, dtype=jnp.int32)  # [T]
    k = jnp.where((pos[None, :] < cache_seqlens[:, None])[:, :, None, None], k, 0.0)  # mask values
    visible = pos[None, None, :] < _query_limits(cache_seqlens, s_q, causal)[:, :, None]  # [B, Q, T]
    qg = q.astype(jnp.float32).reshape(b, s_q, h_kv, m, d)  # [B, Q, G, M, D]
    s = jnp.einsum("bqgmd,btgd->bgmqt", qg, k, precision="highest") * scale  # [B, G, M, Q, T]
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    mx = jnp.max(s, axis=-1, keepdims=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    pr = jnp.exp(s - mx)  # [B, G, M, Q, T]
    l = jnp.sum(pr, axis=-1, keepdims=True)  # [B, G, M, Q, 1]
    o = jnp.einsum("bgmqt,btgv->bqgmv", pr, k[..., :head_dim_v], precision="highest")  # [B, Q, G, M, V]
    l_o = jnp.moveaxis(l[..., 0], 3, 1)[..., None]  # [B, Q, G, M, 1]
    o = jnp.where(l_o > 0, o / jnp.where(l_o > 0, l_o, 1.0), 0.0)
    lse = jnp.log(l[..., 0]) + mx[..., 0]  # [B, G, M, Q]; -inf where nothing is visible
    return o.reshape(b, s_q, h_q, head_dim_v).astype(q.dtype), lse.reshape(b, h_q, s_q)


# ----------------------------------------------------------------------------------------------- XLA path
def _decode_xla(q, kv_cache, block_table, cache_seqlens, *, head_dim_v, scale, causal, block_pages):
    """XLA MLA decode: online softmax over chunks of ``block_pages`` pages (gathered per sequence), fp32 math.

    Memory stays O(B * block_pages * S * G * D) whatever the context length; static shapes throughout.
    """
    b, s_q, h_q, d = q.shape
    _, ps, h_kv, _ = kv_cache.shape
    p = block_table.shape[1]
    m = h_q // h_kv
    cp = min(block_pages, p)  # pages per chunk
    n_chunks = -(-p // cp)
    table = jnp.pad(block_table.astype(jnp.int32), ((0, 0), (0, n_chunks * cp - p)))  # padded pages are masked
    table = table.reshape(b, n_chunks, cp).transpose(1, 0, 2)  # [C, B, cp]
    seqlens = cache_seqlens.astype(jnp.int32)
    limits = _query_limits(seqlens, s_q, causal)  # [B, Q]
    qg = (q.astype(jnp.float32) * (scale * _LOG2E)).reshape(b, s_q, h_kv, m, d)  # [B, Q, G, M, D], log2 units

    def step(carry, xs):
        acc, mx, l = carry  # [B, Q, G, M, V], [B, Q, G, M], [B, Q, G, M]
        chunk, pages = xs  # scalar, [B, cp]
        pos = chunk * cp * ps + jnp.arange(cp * ps, dtype=jnp.int32)  # [T]
        k = kv_cache[pages].reshape(b, cp * ps, h_kv, d).astype(jnp.float32)  # [B, T, G, D]
        k = jnp.where((pos[None, :] < seqlens[:, None])[:, :, None, None], k, 0.0)  # mask values (NaN-safe)
        s = jnp.einsum("bqgmd,btgd->bqgmt", qg, k)  # [B, Q, G, M, T]
        s = jnp.where((pos[None, None, :] < limits[:, :, None])[:, :, None, None], s, -jnp.inf)
        mx_new = jnp.maximum(mx, jnp.max(s, axis=-1))
        mx_use = jnp.where(mx_new == -jnp.inf, 0.0, mx_new)
        alpha = jnp.exp2(mx - mx_use)
        pr = jnp.exp2(s - mx_use[..., None])
        l = l * alpha + jnp.sum(pr, axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("bqgmt,btgv->bqgmv", pr, k[..., :head_dim_v])
        return (acc, mx_new, l), None

    # Built from q so that, inside shard_map, the carry varies over the same mesh axes as the body's output.
    zero = jnp.zeros_like(qg[..., 0])  # [B, Q, G, M]
    init = (jnp.broadcast_to(zero[..., None], (b, s_q, h_kv, m, head_dim_v)), zero - jnp.inf, zero)
    if n_chunks == 1:  # no loop: a while loop reading the cache makes XLA copy the (donated) cache every step
        (acc, mx, l), _ = step(init, (jnp.int32(0), table[0]))
    else:
        (acc, mx, l), _ = lax.scan(step, init, (jnp.arange(n_chunks, dtype=jnp.int32), table))
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    lse = (jnp.where(mx == -jnp.inf, 0.0, mx) + jnp.log2(l)) / _LOG2E  # [B, Q, G, M]
    return out.reshape(b, s_q, h_q, head_dim_v).astype(q.dtype), lse.reshape(b, s_q, h_q).transpose(0, 2, 1)


# ----------------------------------------------------------------------------------------------- kernel
# The two tensor-core steps. Natively they are wgmmas (sm90). GPU interpret mode runs the QK^T wgmma itself (both
# operands in SMEM, K transposed) from jax 0.11.2 on; on older releases (``_mosaic.substitute_wgmma``) its product is
# taken from the same SMEM tiles with dot_general. No release interprets the P V wgmma (A in registers, through
# ``pl.run_state``), which stays value-level when interpreting: interpret mode checks the data movement, paging,
# masking and softmax of this kernel (and on 0.11.2 the score wgmma); the P V wgmma is checked by lowering for cuda
# (and on a GPU).
def _scores(q_smem, k_page, interpret, after_issue=None):
    """S = Q K^T: q_smem [64, D], k_page [S, D] (both SMEM) -> [64, S] f32. after_issue(): runs once the wgmma is
    issued, before it is awaited (kernel="pingpong" passes the tensor cores to the other warpgroup there)."""
    after_issue = after_issue or (lambda: None)
    if _mosaic.substitute_wgmma(interpret):
        s = lax.dot_general(q_smem[...], k_page[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        after_issue()
        return s

    def qk(s_ref):
        plgpu.wgmma(s_ref, q_smem, k_page.transpose((1, 0)))
        after_issue()
        return s_ref[...]

    return pl.run_scoped(qk, plgpu.ACC((q_smem.shape[0], k_page.shape[0]), jnp.float32))


def _accumulate_pv(acc, p16, v_page, interpret, after_issue=None):
    """acc + P V: acc [64, Vb] f32, p16 [64, S] (registers), v_page [S, Vb] (SMEM) -> [64, Vb] f32. after_issue: as
    ``_scores``'."""
    after_issue = after_issue or (lambda: None)
    if interpret:
        acc = acc + lax.dot_general(p16, v_page[...], (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        after_issue()
        return acc

    def pv(o_ref):
        plgpu.wgmma(o_ref, p16, v_page)
        after_issue()

    return pl.run_state(pv)(plgpu.ACC.init(acc))


# Pieces both kernel variants share (this file's ``_decode_kernel`` and mla_decode_shared.py's): the program's
# indices and pages, the producer warpgroup, the score mask, the online softmax step and the item's stores.
class _Program(NamedTuple):
    """One program's sequence ``bi``, kv head ``kvh``, 64-row block ``rb`` and output ``row`` (traced scalars), the
    sequence length and the work item's pages ``[start, start + n_steps)`` (``n_steps`` may be 0)."""

    bi: jax.Array
    kvh: jax.Array
    rb: jax.Array
    row: jax.Array
    seqlen: jax.Array
    start: jax.Array
    n_steps: jax.Array


def _program(seqlens_ref, items_ref, q_ref):
    """Read the grid position (item, hb) and the item's column of items_ref [4, N] (mla_schedule.py: sequence,
    first page, pages, output row); q_ref [B, G, R_pad, D] gives the row blocks per kv head."""
    hb = lax.axis_index("hb")  # kv head * row blocks + row block
    j = lax.axis_index("item")  # launch order
    n_rb = q_ref.shape[2] // _BLOCK_M
    kvh, rb = lax.div(hb, n_rb), lax.rem(hb, n_rb)
    bi = items_ref[0, j]
    return _Program(bi, kvh, rb, items_ref[3, j], seqlens_ref[bi], items_ref[1, j], items_ref[2, j])


def _compute_registers(num_wg):
    """Register budget (65536 per SM): the producer drops to 40 per thread, compute warpgroups take the rest
    (232 each with two of them, as in JAX's attention_mgpu; setmaxnreg wants multiples of 8 in [24, 256])."""
    return min(240, (65536 - 40 * 128) // (128 * num_wg) // 8 * 8)


def _produce(prog, table_ref, q_ref, kv_ref, q_smem, k_smem, q_bar, k_bars, consumed_bars, num_stages,
             probe=None):
    """Producer warpgroup: TMA q once (q_bar; not for an empty item, whose compute warpgroups skip ``_wait_q``), then
    the item's pages, looked up in the block table, into the ring of ``num_stages`` SMEM slots (k_bars[slot]: page
    landed); a slot is refilled only after every compute warpgroup released it (consumed_bars[slot]).
    probe="compute" (``_decode_kernel``'s probes): only the first ``num_stages`` pages, each slot filled once."""
    plgpu.set_max_registers(40, action="decrease")
    n_fetch = prog.n_steps if probe != "compute" else jnp.minimum(prog.n_steps, num_stages)

    @pl.when(prog.n_steps > 0)
    def _():
        plgpu.copy_gmem_to_smem(q_ref.at[prog.bi, prog.kvh, pl.ds(prog.rb * _BLOCK_M, _BLOCK_M)], q_smem, q_bar)

    @pl.loop(0, n_fetch)
    def _(t):
        slot = lax.rem(t, num_stages)
        # The page id first: its global load is in flight while the producer waits for the slot, instead of
        # delaying every refill's TMA by a load's latency after the wait (SASS: LDG after the wait, 2026-12-02).
        page = table_ref[prog.bi, prog.start + t]

        @pl.when(t >= num_stages)
        def _():
            plgpu.barrier_wait(consumed_bars.at[slot])  # every compute warpgroup is done with this slot

        plgpu.copy_gmem_to_smem(kv_ref.at[page, :, prog.kvh], k_smem.at[slot], k_bars.at[slot])

    if probe == "compute":  # its compute warpgroups release no slot
        return

    @pl.loop(jnp.maximum(prog.n_steps - num_stages, 0), prog.n_steps)
    def _(t):  # observe the last releases too, so every phase of consumed_bars is seen by its waiter
        plgpu.barrier_wait(consumed_bars.at[lax.rem(t, num_stages)])


def _wait_q(prog, q_bar):
    """A compute warpgroup waits for q, which the producer loads only for an item that holds pages."""
    pl.when(prog.n_steps > 0)(lambda: plgpu.barrier_wait(q_bar))


def _wait_page(prog, k_smem, k_bars, t, num_stages, ps, *, first_fill_only=False):
    """The item's t-th page, once it has landed: (ring slot, position of its first key, its SMEM ref [S, D]).
    first_fill_only (probe="compute"): wait only for each slot's first landing; later steps reuse its page."""
    slot = lax.rem(t, num_stages)
    page_start = (prog.start + t) * ps
    k_page = k_smem.at[slot]
    if first_fill_only:
        pl.when(t < num_stages)(lambda: plgpu.barrier_wait(k_bars.at[slot]))
    else:
        plgpu.barrier_wait(k_bars.at[slot])
    return slot, page_start, k_page


def _score_mask(prog, ps, s_q, m, causal):
    """(cols [64, S] i32, limit): key ``page_start + col`` is visible to row r iff it is < limit ([64, S] or scalar).
    Row r of the block is query (rb * 64 + r) // M (causal); padding rows are clamped to seqlen."""
    rows = plgpu.broadcasted_iota(jnp.int32, (_BLOCK_M, ps), 0, layout=plgpu.Layout.WGMMA)
    cols = plgpu.broadcasted_iota(jnp.int32, (_BLOCK_M, ps), 1, layout=plgpu.Layout.WGMMA)
    if causal:
        limit = jnp.minimum(prog.seqlen - s_q + 1 + lax.div(rows + prog.rb * _BLOCK_M, m), prog.seqlen)
    else:
        limit = prog.seqlen
    return cols, limit


def _init_carry(block_dv):
    """Online-softmax state: acc [64, block_dv] f32 = 0, m_i [64] = -inf (running max, log2 units), l_i [64] = 0."""
    m_i = plgpu.layout_cast(jnp.full((_BLOCK_M,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.full((_BLOCK_M,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    acc = plgpu.layout_cast(jnp.full((_BLOCK_M, block_dv), 0.0, jnp.float32), plgpu.Layout.WGMMA)
    return acc, m_i, l_i


def _online_softmax(s, visible, m_i, l_i, scale):
    """One page of the online softmax in log2 units: s [64, S] raw scores, visible [64, S] bool, m_i / l_i [64].

    Returns p [64, S] f32 (0 where not visible), alpha [64] (the factor that rescales the previous accumulator),
    m_new, l_new [64]. A row that has seen no key keeps m = -inf; it uses 0 as its max so that p = alpha = 0, not NaN.
    """
    s = jnp.where(visible, s * (scale * _LOG2E), -jnp.inf)
    m_new = jnp.maximum(m_i, s.max(axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_i - m_use)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [0]))
    l_new = l_i * alpha + p.sum(axis=1)
    return p, alpha, m_new, l_new


def _rescale(acc, alpha):
    """acc [64, Vb] * alpha [64] per row."""
    return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])


def _zero_rows_past(v_ref, n_valid):
    """v_ref [S, Vb] (SMEM) rows >= n_valid = 0, so that P V never sees the NaN a cache slot past seqlen may hold."""
    v = v_ref[...]  # [S, Vb], WGMMA layout
    vrows = plgpu.broadcasted_iota(jnp.int32, v.shape, 0, layout=plgpu.Layout.WGMMA)
    v_ref[...] = jnp.where(vrows < n_valid, v, jnp.zeros_like(v))


def _store_out(o_ref, prog, vcols, acc, l_i):
    """This item's normalised output rows: o_ref[row, kvh, rows, vcols] = acc / l (0 where l == 0). An empty item
    (the schedule's padding) stores nothing: its lse is -inf, so ``combine`` gives its row weight 0 and masks it."""
    l_safe = jnp.where(l_i == 0.0, 1.0, l_i)

    @pl.when(prog.n_steps > 0)
    def _():
        o_ref.at[prog.row, prog.kvh, pl.ds(prog.rb * _BLOCK_M, _BLOCK_M), vcols][...] = (
            acc / lax.broadcast_in_dim(l_safe, acc.shape, [0]))


def _store_lse(lse_ref, prog, m_i, l_i):
    """This item's lse in log2 units: m + log2(l); -inf where this item saw no key."""
    lse_ref.at[prog.row, prog.kvh, pl.ds(prog.rb * _BLOCK_M, _BLOCK_M)][...] = (
        jnp.where(m_i == -jnp.inf, 0.0, m_i) + jnp.log2(l_i))


def _decode_kernel(seqlens_ref, items_ref, table_ref, q_ref, kv_ref, o_ref, lse_ref, q_smem, k_smem, q_bar,
                   k_bars, consumed_bars, sync_bar, turn_bars=None, *, s_q, m, block_dv, num_wg, num_stages, scale,
                   causal, interpret, probe=None):
    """kernel="recompute_scores": one program = one (64-row block of one kv head's R = Q * M query rows, work item:
    a page range of one sequence).

    Warpgroups 0..num_wg-1 compute (each owns V columns [w * block_dv, (w + 1) * block_dv) of the output and
    recomputes the 64 x 64 scores of each page); warpgroup num_wg is the producer (``_produce``). sync_bar: every
    compute warpgroup's QK read of the sequence's partial last page is done before any of them zeroes its V rows.

    turn_bars (kernel="pingpong"; None otherwise): FlashAttention-3's warpgroup ping-pong (Shah et al. 2024, section
    3.1, "pingpong scheduling"). The compute warpgroups take turns at the tensor cores, one wgmma phase each: QK^T
    of warpgroup 0, QK^T of warpgroup 1, ..., then P V of 0, P V of 1, ..., page after page; a warpgroup waits for
    its turn (turn_bars[w]) before it issues a phase and hands the turn on (turn_bars[w + 1]) as soon as the phase is
    issued, so the next one's wgmma queues behind it while this one runs its softmax. Without it, the warpgroups
    issue the same phase together and the tensor cores idle through their softmax.

    seqlens_ref [B] i32, items_ref [4, N] i32 (mla_schedule.py), table_ref [B, P] i32, q_ref [B, G, R_pad, D],
    kv_ref [pages, 64, G, D] (all GMEM); o_ref [N, G, R_pad, V] f32 and lse_ref [N, G, R_pad] f32 (log2 units)
    receive this item's partial (normalised) output and log-sum-exp in its output row.

    probe (benchmarks/kernels_mla.py --breakdown; None in mla_decode): the kernel with half of its work taken out,
    to show which half bounds its time on a GPU. "stream": the producer streams every page as usual and the compute
    warpgroups only wait for each and release it (the page ring's own rate; out 0, lse -inf). "compute": the
    producer fills each ring slot once and the compute warpgroups run every step on those pages (step t reads the
    item's page t % num_stages) without waiting for memory.
    """
    ps = kv_ref.shape[1]
    prog = _program(seqlens_ref, items_ref, q_ref)
    wg = lax.axis_index("wg")
    compute_regs = _compute_registers(num_wg)

    @pl.when(wg == num_wg)
    def _producer():
        _produce(prog, table_ref, q_ref, kv_ref, q_smem, k_smem, q_bar, k_bars, consumed_bars, num_stages, probe)

    # One code path for every compute warpgroup, its V columns offset by its (traced) index: written as a static
    # branch per warpgroup, LLVM hoisted both branches' wgmma descriptors above the split and ptxas spilled them
    # (480 bytes per thread, reloaded every page); as one path, 4 bytes (h_q 16) and 20 (h_q 128, causal) outside
    # the page loop (ptxas -v, benchmarks/kernels_ptxas.py --offline, 2026-12-02).
    def compute(w):
        col0 = pl.multiple_of(w * block_dv, 64)
        vcols = pl.ds(col0, block_dv)
        plgpu.set_max_registers(compute_regs, action="increase")
        if turn_bars is not None:   # the last warpgroup gives warpgroup 0 the first turn
            pl.when(w == num_wg - 1)(lambda: plgpu.barrier_arrive(turn_bars.at[0]))

        def my_turn():
            if turn_bars is not None:
                plgpu.barrier_wait(turn_bars.at[w])

        def pass_turn():
            if turn_bars is not None:
                plgpu.barrier_arrive(turn_bars.at[lax.rem(w + 1, num_wg)])

        _wait_q(prog, q_bar)
        cols, limit = _score_mask(prog, ps, s_q, m, causal)
        carry = _init_carry(block_dv)

        def step(t, carry):
            acc, m_i, l_i = carry
            slot, page_start, k_page = _wait_page(prog, k_smem, k_bars, t, num_stages, ps,
                                                  first_fill_only=probe == "compute")
            if probe == "stream":
                plgpu.barrier_arrive(consumed_bars.at[slot])
                return carry
            my_turn()
            s = _scores(q_smem, k_page, interpret, pass_turn)  # [64, S] f32

            @pl.when(prog.seqlen - page_start < ps)  # the sequence's last, partial page: zero V rows past seqlen
            def _():
                plgpu.barrier_arrive(sync_bar)  # every warpgroup's QK read of this slot is done
                plgpu.barrier_wait(sync_bar)
                for c in range(0, block_dv, 64):  # 64 columns at a time: 16 registers, not 64 for all of them
                    _zero_rows_past(k_page.at[:, pl.ds(col0 + c, 64)], prog.seqlen - page_start)
                plgpu.commit_smem()  # order the stores before the tensor cores read them

            p, alpha, m_new, l_i = _online_softmax(s, cols + page_start < limit, m_i, l_i, scale)
            acc = _rescale(acc, alpha)
            p16 = p.astype(k_smem.dtype)
            v_page = k_page.at[:, vcols]
            my_turn()
            acc = _accumulate_pv(acc, p16, v_page, interpret, pass_turn)
            if probe != "compute":
                plgpu.barrier_arrive(consumed_bars.at[slot])
            return acc, m_new, l_i

        acc, m_i, l_i = lax.fori_loop(0, prog.n_steps, step, carry)
        if turn_bars is not None:   # warpgroup 0 observes the last turn handed to it (the first one, for no page)
            pl.when(w == 0)(lambda: plgpu.barrier_wait(turn_bars.at[0]))
        _store_out(o_ref, prog, vcols, acc, l_i)
        pl.when(w == 0)(lambda: _store_lse(lse_ref, prog, m_i, l_i))

    pl.when(wg < num_wg)(lambda: compute(wg))


def _tiled():
    """SMEM transforms of every wgmma operand tile: (8, 64) tiles with the 128-byte swizzle (64 bf16 per row)."""
    return plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)


def _smem_bytes(buffers, num_barriers, reduction_bytes):
    """Shared memory one CTA allocates: every ``plgpu.SMEM`` scratch buffer rounded up to Pallas' 1024-byte
    alignment (jax/_src/pallas/mosaic_gpu/core.py SMEM_ALIGNMENT), the reduction scratch
    (``CompilerParams.reduction_scratch_bytes``) and 8 bytes per mbarrier."""
    total = sum(-(-math.prod(b.shape) * jnp.dtype(b.dtype).itemsize // 1024) * 1024 for b in buffers)
    return total + -(-reduction_bytes // 1024) * 1024 + 8 * num_barriers


def _check_smem(total, kernel, num_stages, d):
    if total > SMEM_BYTES:
        raise ValueError(f"kernel={kernel!r} with {num_stages=} and d={d} needs {total} bytes of shared memory per "
                         f"CTA (> {SMEM_BYTES}, the Hopper limit): lower num_stages")


def _ring_scratch(q_rows, kv_cache, num_stages, num_wg):
    """The SMEM both kernels share: (buffers, barriers) = ((q_smem [64, D], k_smem [num_stages, S, D]: the ring of
    pages), (q_bar, k_bars: page landed, consumed_bars: slot free, released by every compute warpgroup))."""
    d, ps, dt = q_rows.shape[-1], kv_cache.shape[1], kv_cache.dtype
    buffers = (
        plgpu.SMEM((_BLOCK_M, d), dt, transforms=_tiled()),  # q_smem
        plgpu.SMEM((num_stages, ps, d), dt, transforms=_tiled()),  # k_smem: ring of pages
    )
    barriers = (
        plgpu.Barrier(num_arrivals=1),  # q_bar
        plgpu.Barrier(num_arrivals=1, num_barriers=num_stages),  # k_bars: page landed
        plgpu.Barrier(num_arrivals=num_wg, num_barriers=num_stages),  # consumed_bars: slot free
    )
    return buffers, barriers


def _launch(body, q_rows, kv_cache, seqlens, items, table, *, head_dim_v, num_wg, scratch, params, interpret):
    """Run a kernel body on grid (N work items, G * row blocks) with num_wg compute + 1 producer warpgroups:
    q_rows [B, G, R_pad, D], items [4, N] -> (o_part [N, G, R_pad, V] f32, lse_part [N, G, R_pad] f32 log2).

    Pallas Mosaic GPU reverses the grid onto CUDA's (jax/_src/pallas/mosaic_gpu/lowering.py: "Pallas prefers
    row-major iteration while the CUDA runtime prefers column-major"), so the last axis, the row blocks, is
    blockIdx.x, which the GPU launches fastest: the programs that read the same pages (one per 64-row block: 2 for
    h_q = 128) run side by side and share them through L2, as in FlashMLA's grid (m blocks, h_kv, SM parts); the
    items follow in launch (longest-first) order on blockIdx.y."""
    _, h_kv, r_pad, _ = q_rows.shape
    n = items.shape[1]
    if n > _MAX_GRID_Y:
        raise ValueError(f"{n} work items exceed CUDA's grid limit of {_MAX_GRID_Y} blocks along y (the items' "
                         f"axis): lower num_splits (or pass None) or split the batch")
    return plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((n, h_kv, r_pad, head_dim_v), jnp.float32),
                  jax.ShapeDtypeStruct((n, h_kv, r_pad), jnp.float32)),
        grid=(n, h_kv * (r_pad // _BLOCK_M)),
        grid_names=("item", "hb"),
        num_threads=num_wg + 1,
        thread_name="wg",
        scratch_types=scratch,
        compiler_params=params,
        interpret=interpret,
    )(seqlens, items, table, q_rows, kv_cache)


def _recompute_scores_pallas(q_rows, kv_cache, seqlens, items, table, *, s_q, m, head_dim_v, scale, causal,
                             block_dv, num_stages, interpret, probe=None, pingpong=False):
    """``plgpu.kernel`` wrapper of ``_decode_kernel``: q_rows [B, G, R_pad, D], items [4, N] -> (o_part
    [N, G, R_pad, V] f32, lse_part [N, G, R_pad] f32 log2). probe: see ``_decode_kernel`` (None: the kernel);
    pingpong: the compute warpgroups take turns at the tensor cores (kernel="pingpong")."""
    if probe not in (None, "stream", "compute") or (probe is not None and pingpong):
        raise ValueError(f"probe must be None, 'stream' or 'compute' (without pingpong), got {probe!r}")
    num_wg = head_dim_v // block_dv
    buffers, barriers = _ring_scratch(q_rows, kv_cache, num_stages, num_wg)
    sync_bar = plgpu.Barrier(num_arrivals=num_wg)  # before zeroing a partial page's V rows
    turn = (plgpu.Barrier(num_arrivals=1, num_barriers=num_wg),) if pingpong else ()  # turn_bars: one per warpgroup
    params = plgpu.CompilerParams(approx_math=True)
    n_barriers = 2 + 2 * num_stages + len(turn) * num_wg  # q_bar, sync_bar, k_bars and consumed_bars per slot, turns
    kind = "pingpong" if pingpong else "recompute_scores"
    _check_smem(_smem_bytes(buffers, n_barriers, params.reduction_scratch_bytes), kind, num_stages, q_rows.shape[-1])
    kernel = functools.partial(_decode_kernel, s_q=s_q, m=m, block_dv=block_dv, num_wg=num_wg,
                               num_stages=num_stages, scale=scale, causal=causal, interpret=interpret is not None,
                               probe=probe)
    return _launch(kernel, q_rows, kv_cache, seqlens, items, table, head_dim_v=head_dim_v, num_wg=num_wg,
                   scratch=buffers + barriers + (sync_bar,) + turn, params=params, interpret=interpret)


# The Pallas path in stages: ``_decode_pallas`` chains them; benchmarks/kernels_mla.py --breakdown times each.
def _pack_rows(q, h_kv, dtype):
    """q [B, Q, N, D] -> q_rows [B, G, R_pad, D] in ``dtype``: row r of kv head g is query r // M, head g * M + r % M
    (M = N // G, R = Q * M), rows R..R_pad are 0 (FlashMLA packs the query rows of one kv head the same way)."""
    b, s_q, h_q, d = q.shape
    m = h_q // h_kv
    r = s_q * m
    r_pad = -(-r // _BLOCK_M) * _BLOCK_M
    q_rows = q.reshape(b, s_q, h_kv, m, d).transpose(0, 2, 1, 3, 4).reshape(b, h_kv, r, d)  # [B, G, R, D]
    return jnp.pad(q_rows, ((0, 0), (0, 0), (0, r_pad - r), (0, 0))).astype(dtype)  # [B, G, R_pad, D]


def _unpack_rows(out, lse, s_q):
    """out [B, G, R, V], lse [B, G, R] (R = Q * M) -> out [B, Q, N, V], lse [B, N, Q] (FlashMLA's layouts)."""
    b, h_kv, r, dv = out.shape
    m = r // s_q
    out = out.reshape(b, h_kv, s_q, m, dv).transpose(0, 2, 1, 3, 4).reshape(b, s_q, h_kv * m, dv)
    lse = lse.reshape(b, h_kv, s_q, m).transpose(0, 1, 3, 2).reshape(b, h_kv * m, s_q)
    return out, lse


def _schedule(seqlens, q_rows, page_size, max_pages, *, num_splits, num_sms):
    """The work items (mla_schedule.py): balanced over the lengths (num_splits None; one program per 64-row block
    of each kv head; max_pages = the block table's width) or num_splits equal splits per sequence."""
    if num_splits is None:
        _, h_kv, r_pad, _ = q_rows.shape
        return balanced_schedule(seqlens, page_size=page_size, programs_per_item=h_kv * (r_pad // _BLOCK_M),
                                 num_sms=num_sms, max_pages=max_pages)
    return even_schedule(seqlens, page_size=page_size, num_splits=num_splits)


def _run_items(q_rows, kv_cache, seqlens, items, table, *, kernel, **kw):
    """Run the ``kernel`` variant: (o_part [N, G, R_pad, V] f32, lse_part [N, G, R_pad] f32 log2)."""
    # Imported here: mla_decode_shared builds on this module's kernel pieces (_scores, _produce, ...).
    from kernels_pallas.mla_decode_shared import shared_scores_pallas

    if kernel == "shared_scores":
        return shared_scores_pallas(q_rows, kv_cache, seqlens, items, table, **kw)
    return _recompute_scores_pallas(q_rows, kv_cache, seqlens, items, table, pingpong=kernel == "pingpong", **kw)


def _decode_pallas(q, kv_cache, block_table, cache_seqlens, *, head_dim_v, scale, causal, num_splits, num_sms,
                   block_dv, num_stages, kernel, interpret):
    """Pack q rows, schedule the work items (mla_schedule.py), run the ``kernel`` variant on grid (items,
    G * row blocks), merge each sequence's items in jnp."""
    b, s_q, h_q, _ = q.shape
    if b == 0:  # an empty batch: no work items (the schedule indexes sequence 0), nothing to launch
        return jnp.zeros((0, s_q, h_q, head_dim_v), q.dtype), jnp.zeros((0, h_q, s_q), jnp.float32)
    h_kv = kv_cache.shape[2]
    q_rows = _pack_rows(q, h_kv, kv_cache.dtype)  # [B, G, R_pad, D]
    seqlens = cache_seqlens.astype(jnp.int32)
    sched = _schedule(seqlens, q_rows, kv_cache.shape[1], block_table.shape[1], num_splits=num_splits,
                      num_sms=num_sms)
    o_part, lse_part = _run_items(q_rows, kv_cache, seqlens, sched.items, block_table.astype(jnp.int32),
                                  kernel=kernel, s_q=s_q, m=h_q // h_kv, head_dim_v=head_dim_v, scale=scale,
                                  causal=causal, block_dv=block_dv, num_stages=num_stages, interpret=interpret)
    out, lse = combine(o_part, lse_part, sched.row_seq, batch=b, rows=s_q * (h_q // h_kv))  # [B, G, R, V], [B, G, R]
    out, lse = _unpack_rows(out, lse, s_q)
    return out.astype(q.dtype), lse


# ----------------------------------------------------------------------------------------------- entry
def _check_pallas_knobs(num_stages, kernel):
    """The Pallas knobs' own ranges (ValueError naming the knob)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got kernel={kernel!r}")
    if num_stages < 1:
        raise ValueError(f"{num_stages=} must be >= 1")


def _pallas_unsupported(d, head_dim_v, page_size, dtype, block_dv):
    """Why the Pallas kernels cannot run this cache layout (None: they can)."""
    if page_size != 64:
        return f"implementation='pallas' needs {page_size=} == 64 (FlashMLA's page size)"
    if d % 64 or block_dv < 64 or block_dv % 64 or head_dim_v % block_dv:
        return (f"implementation='pallas' needs d={d} divisible by 64 and head_dim_v={head_dim_v} divisible by "
                f"{block_dv=}, itself a multiple of 64")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return (f"implementation='pallas' needs a bfloat16 or float16 cache (the wgmma operands; q is cast to it), "
                f"got {jnp.dtype(dtype).name}")
    return None


def choose_implementation(implementation, *, gpu: bool, unsupported: str | None) -> str:
    """implementation None: "pallas" on a CUDA GPU where the kernels support the cache layout, else "xla" (so a
    float32 model still decodes on a GPU); an explicit "pallas" the kernels cannot run raises ValueError."""
    if implementation is None:
        return "pallas" if gpu and unsupported is None else "xla"
    if implementation not in ("pallas", "xla"):
        raise ValueError(f"implementation must be None, 'pallas' or 'xla', got {implementation!r}")
    if implementation == "pallas" and unsupported is not None:
        raise ValueError(unsupported)
    return implementation


@functools.partial(jax.jit, static_argnames=("head_dim_v", "softmax_scale", "causal", "implementation",
                                             "interpret", "num_splits", "num_sms", "block_dv", "num_stages",
                                             "kernel", "block_pages"))
def _mla_decode_jit(q, kv_cache, block_table, cache_seqlens, *, head_dim_v, softmax_scale, causal,
                    implementation, interpret, num_splits, num_sms, block_dv, num_stages, kernel, block_pages):
    if implementation == "xla":
        return _decode_xla(q, kv_cache, block_table, cache_seqlens, head_dim_v=head_dim_v, scale=softmax_scale,
                           causal=causal, block_pages=block_pages)
    return _decode_pallas(q, kv_cache, block_table, cache_seqlens, head_dim_v=head_dim_v, scale=softmax_scale,
                          causal=causal, num_splits=num_splits, num_sms=num_sms, block_dv=block_dv,
                          num_stages=num_stages, kernel=kernel, interpret=interpret)


def mla_decode(q, kv_cache, block_table, cache_seqlens, *, head_dim_v=512, softmax_scale=None, causal=False,
               implementation=None, interpret=None, num_splits=None, num_sms=None, block_dv=None, num_stages=2,
               kernel="recompute_scores", block_pages=16):
    """MLA decode over a paged latent cache (FlashMLA ``flash_mla_with_kvcache`` semantics). Returns (out, lse).

    q [B, Q, N, D]; kv_cache [pages, S, G, D]; block_table [B, P] int32; cache_seqlens [B] int32 (>= Q when
    causal); V = kv_cache[..., :head_dim_v]. out [B, Q, N, head_dim_v] in q's dtype, lse [B, N, Q] float32.
    softmax_scale None = D ** -0.5. causal: query i sees keys < seqlen - Q + i + 1.

    implementation: None = "pallas" on a CUDA GPU where the kernels support the cache (page size 64, d and dv
    multiples of 64, a bfloat16 or float16 cache), "xla" elsewhere. interpret (pallas only): None = GPU interpret
    mode where the backend cannot run Mosaic GPU natively; True/False force it.
    Tuning knobs (pallas): num_splits (None: FlashMLA-style work items balanced over the batch's lengths,
    ``mla_schedule.balanced_schedule``; an int: that many equal KV splits per sequence), num_sms (the SMs the
    balanced schedule fills, e.g. fewer when communication kernels hold some, as DeepEP's do; None: the device's
    count, 132 where it has none), block_dv (output columns per compute warpgroup; None = min(256, head_dim_v)),
    num_stages (pages in flight; 2 fits D = 576 in SMEM; a configuration over the 227 KB per CTA raises
    ValueError), kernel ("recompute_scores": every compute
    warpgroup computes the page's scores itself; "pingpong": the same, the compute warpgroups taking turns at the
    tensor cores (FlashAttention-3's ping-pong); "shared_scores": warpgroup 0 computes them once and hands P to the
    others through SMEM, FlashMLA's structure, not yet measured on a GPU; see the module docstring).
    xla: block_pages (pages per online-softmax step).
    """
    b, s_q, h_q, d, h_kv, _, ps = _check_inputs(q, kv_cache, block_table, cache_seqlens, head_dim_v)
    block_dv = min(256, head_dim_v) if block_dv is None else block_dv
    _check_pallas_knobs(num_stages, kernel)  # whatever the implementation, as fp8_gemm's kernel=
    implementation = choose_implementation(
        implementation, gpu=not _mosaic.default_interpret(),
        unsupported=_pallas_unsupported(d, head_dim_v, ps, kv_cache.dtype, block_dv))
    scale = float(d ** -0.5 if softmax_scale is None else softmax_scale)
    if implementation == "pallas":
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"{num_splits=} must be None or >= 1")
        num_sms = _mosaic.device_sm_count() if num_sms is None else num_sms
        if num_sms < 1:
            raise ValueError(f"{num_sms=} must be None or >= 1")
        if interpret is None:
            interpret = _mosaic.default_interpret()
        interpret = _mosaic.interpret_params() if interpret else None
    elif block_pages < 1:
        raise ValueError(f"{block_pages=} must be >= 1")
    return _mla_decode_jit(q, kv_cache, block_table, cache_seqlens, head_dim_v=head_dim_v, softmax_scale=scale,
                           causal=bool(causal), implementation=implementation, interpret=interpret,
                           num_splits=num_splits, num_sms=num_sms, block_dv=block_dv, num_stages=num_stages,
                           kernel=kernel, block_pages=block_pages)
