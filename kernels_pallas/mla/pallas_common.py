"""Pieces both MLA decode kernel bodies share (recompute_scores.py, shared_scores.py): the program's indices and
pages, the producer warpgroup and its SMEM page ring, the tensor-core steps, the score mask, the online softmax step,
the item's stores, the shared memory accounting and the launch.

Every kernel runs on grid (work items, G * row blocks), a work item being a page range of one sequence (schedule.py),
with one producer warpgroup streaming q and the item's pages through a ring of SMEM slots (``produce``) and num_wg
compute warpgroups, and writes per-item outputs that ``schedule.combine`` merges. Letters as in common.py.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import _mosaic
from kernels_pallas.common import SMEM_BYTES, round_up
from kernels_pallas.mla.common import LOG2E

BLOCK_M = 64  # rows per program: the wgmma M of one warpgroup
MAX_GRID_Y = 65535  # gridDim.y limit (CUDA C Programming Guide, "Technical Specifications per Compute Capability")


# The two tensor-core steps. Natively they are wgmmas (sm90). GPU interpret mode runs the QK^T wgmma itself (both
# operands in SMEM, K transposed) from jax 0.11.2 on; on older releases (``_mosaic.substitute_wgmma``) its product is
# taken from the same SMEM tiles with dot_general. No release interprets the P V wgmma (A in registers, through
# ``pl.run_state``), which stays value-level when interpreting: interpret mode checks the data movement, paging,
# masking and softmax of the kernels (and on 0.11.2 the score wgmma); the P V wgmma is checked by lowering for cuda
# (and on a GPU).
def scores(q_smem, k_page, interpret, after_issue=None):
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


def accumulate_pv(acc, p16, v_page, interpret, after_issue=None):
    """acc + P V: acc [64, Vb] f32, p16 [64, S] (registers), v_page [S, Vb] (SMEM) -> [64, Vb] f32. after_issue: as
    ``scores``'."""
    after_issue = after_issue or (lambda: None)
    if interpret:
        acc = acc + lax.dot_general(p16, v_page[...], (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        after_issue()
        return acc

    def pv(o_ref):
        plgpu.wgmma(o_ref, p16, v_page)
        after_issue()

    return pl.run_state(pv)(plgpu.ACC.init(acc))


class Program(NamedTuple):
    """One program's sequence ``bi``, kv head ``kvh``, 64-row block ``rb`` and output ``row`` (traced scalars), the
    sequence length and the work item's pages ``[start, start + n_steps)`` (``n_steps`` may be 0)."""

    bi: jax.Array
    kvh: jax.Array
    rb: jax.Array
    row: jax.Array
    seqlen: jax.Array
    start: jax.Array
    n_steps: jax.Array


def program(seqlens_ref, items_ref, q_ref):
    """Read the grid position (item, hb) and the item's column of items_ref [4, N] (schedule.py: sequence,
    first page, pages, output row); q_ref [B, G, R_pad, D] gives the row blocks per kv head."""
    hb = lax.axis_index("hb")  # kv head * row blocks + row block
    j = lax.axis_index("item")  # launch order
    n_rb = q_ref.shape[2] // BLOCK_M
    kvh, rb = lax.div(hb, n_rb), lax.rem(hb, n_rb)
    bi = items_ref[0, j]
    return Program(bi, kvh, rb, items_ref[3, j], seqlens_ref[bi], items_ref[1, j], items_ref[2, j])


def compute_registers(num_wg):
    """Register budget (65536 per SM): the producer drops to 40 per thread, compute warpgroups take the rest
    (232 each with two of them, as in JAX's attention_mgpu; setmaxnreg wants multiples of 8 in [24, 256])."""
    return min(240, (65536 - 40 * 128) // (128 * num_wg) // 8 * 8)


class Ring(NamedTuple):
    """The SMEM page ring's protocol as static callables: the kernels take it as ``ring=`` (``RING``, theirs), so a
    benchmark can change it without a branch in them (benchmarks/kernels_mla.py's "compute" probe fills each slot
    once).

    fetches(n_steps, num_stages) -> the pages the producer loads; wait(k_bars, slot, t, num_stages): a compute
    warpgroup waits for the item's t-th page; release(consumed_bars, slot): a compute warpgroup is done with the
    slot; drain(consumed_bars, n_steps, num_stages): the producer observes the last releases, so every phase of
    consumed_bars is seen by its waiter."""

    fetches: Callable
    wait: Callable
    release: Callable
    drain: Callable


def _drain_releases(consumed_bars, n_steps, num_stages):
    @pl.loop(jnp.maximum(n_steps - num_stages, 0), n_steps)
    def _(t):
        plgpu.barrier_wait(consumed_bars.at[lax.rem(t, num_stages)])


# Every page streamed once: the producer refills a slot only after every compute warpgroup released it.
RING = Ring(fetches=lambda n_steps, num_stages: n_steps,
            wait=lambda k_bars, slot, t, num_stages: plgpu.barrier_wait(k_bars.at[slot]),
            release=lambda consumed_bars, slot: plgpu.barrier_arrive(consumed_bars.at[slot]),
            drain=_drain_releases)


def produce(prog, table_ref, q_ref, kv_ref, q_smem, k_smem, q_bar, k_bars, consumed_bars, num_stages,
            ring: Ring = RING):
    """Producer warpgroup: TMA q once (q_bar; not for an empty item, whose compute warpgroups skip ``wait_q``), then
    the item's pages, looked up in the block table, into the ring of ``num_stages`` SMEM slots (k_bars[slot]: page
    landed); a slot is refilled only after every compute warpgroup released it (consumed_bars[slot])."""
    plgpu.set_max_registers(40, action="decrease")
    n_fetch = ring.fetches(prog.n_steps, num_stages)

    @pl.when(prog.n_steps > 0)
    def _():
        plgpu.copy_gmem_to_smem(q_ref.at[prog.bi, prog.kvh, pl.ds(prog.rb * BLOCK_M, BLOCK_M)], q_smem, q_bar)

    @pl.loop(0, n_fetch)
    def _(t):
        slot = lax.rem(t, num_stages)
        # The page id first: its global load is in flight while the producer waits for the slot, instead of
        # delaying every refill's TMA by a load's latency after the wait.
        page = table_ref[prog.bi, prog.start + t]

        @pl.when(t >= num_stages)
        def _():
            plgpu.barrier_wait(consumed_bars.at[slot])  # every compute warpgroup is done with this slot

        plgpu.copy_gmem_to_smem(kv_ref.at[page, :, prog.kvh], k_smem.at[slot], k_bars.at[slot])

    ring.drain(consumed_bars, prog.n_steps, num_stages)


def wait_q(prog, q_bar):
    """A compute warpgroup waits for q, which the producer loads only for an item that holds pages."""
    pl.when(prog.n_steps > 0)(lambda: plgpu.barrier_wait(q_bar))


def wait_page(prog, k_smem, k_bars, t, num_stages, ps, ring: Ring = RING):
    """The item's t-th page, once it has landed: (ring slot, position of its first key, its SMEM ref [S, D])."""
    slot = lax.rem(t, num_stages)
    page_start = (prog.start + t) * ps
    k_page = k_smem.at[slot]
    ring.wait(k_bars, slot, t, num_stages)
    return slot, page_start, k_page


def score_mask(prog, ps, s_q, m, causal):
    """(cols [64, S] i32, limit): key ``page_start + col`` is visible to row r iff it is < limit ([64, S] or scalar).
    Row r of the block is query (rb * 64 + r) // M (causal); padding rows are clamped to seqlen."""
    rows = plgpu.broadcasted_iota(jnp.int32, (BLOCK_M, ps), 0, layout=plgpu.Layout.WGMMA)
    cols = plgpu.broadcasted_iota(jnp.int32, (BLOCK_M, ps), 1, layout=plgpu.Layout.WGMMA)
    if causal:
        limit = jnp.minimum(prog.seqlen - s_q + 1 + lax.div(rows + prog.rb * BLOCK_M, m), prog.seqlen)
    else:
        limit = prog.seqlen
    return cols, limit


def init_carry(block_dv):
    """Online-softmax state: acc [64, block_dv] f32 = 0, m_i [64] = -inf (running max, log2 units), l_i [64] = 0."""
    m_i = plgpu.layout_cast(jnp.full((BLOCK_M,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.full((BLOCK_M,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    acc = plgpu.layout_cast(jnp.full((BLOCK_M, block_dv), 0.0, jnp.float32), plgpu.Layout.WGMMA)
    return acc, m_i, l_i


def online_softmax(s, visible, m_i, l_i, scale):
    """One page of the online softmax in log2 units: s [64, S] raw scores, visible [64, S] bool, m_i / l_i [64].

    Returns p [64, S] f32 (0 where not visible), alpha [64] (the factor that rescales the previous accumulator),
    m_new, l_new [64]. A row that has seen no key keeps m = -inf; it uses 0 as its max so that p = alpha = 0, not NaN.
    """
    s = jnp.where(visible, s * (scale * LOG2E), -jnp.inf)
    m_new = jnp.maximum(m_i, s.max(axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_i - m_use)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [0]))
    l_new = l_i * alpha + p.sum(axis=1)
    return p, alpha, m_new, l_new


def rescale(acc, alpha):
    """acc [64, Vb] * alpha [64] per row."""
    return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])


def zero_rows_past(v_ref, n_valid):
    """v_ref [S, Vb] (SMEM) rows >= n_valid = 0, so that P V never sees the NaN a cache slot past seqlen may hold."""
    v = v_ref[...]  # [S, Vb], WGMMA layout
    vrows = plgpu.broadcasted_iota(jnp.int32, v.shape, 0, layout=plgpu.Layout.WGMMA)
    v_ref[...] = jnp.where(vrows < n_valid, v, jnp.zeros_like(v))


def store_out(o_ref, prog, vcols, acc, l_i):
    """This item's normalised output rows: o_ref[row, kvh, rows, vcols] = acc / l (0 where l == 0). An empty item
    (the schedule's padding) stores nothing: its lse is -inf, so ``combine`` gives its row weight 0 and masks it."""
    l_safe = jnp.where(l_i == 0.0, 1.0, l_i)

    @pl.when(prog.n_steps > 0)
    def _():
        o_ref.at[prog.row, prog.kvh, pl.ds(prog.rb * BLOCK_M, BLOCK_M), vcols][...] = (
            acc / lax.broadcast_in_dim(l_safe, acc.shape, [0]))


def store_lse(lse_ref, prog, m_i, l_i):
    """This item's lse in log2 units: m + log2(l); -inf where this item saw no key."""
    lse_ref.at[prog.row, prog.kvh, pl.ds(prog.rb * BLOCK_M, BLOCK_M)][...] = (
        jnp.where(m_i == -jnp.inf, 0.0, m_i) + jnp.log2(l_i))


def tiled():
    """SMEM transforms of every wgmma operand tile: (8, 64) tiles with the 128-byte swizzle (64 bf16 per row)."""
    return plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)


def smem_bytes(buffers, num_barriers, reduction_bytes):
    """Shared memory one CTA allocates: every ``plgpu.SMEM`` scratch buffer rounded up to Pallas' 1024-byte
    alignment (jax/_src/pallas/mosaic_gpu/core.py SMEM_ALIGNMENT), the reduction scratch
    (``CompilerParams.reduction_scratch_bytes``) and 8 bytes per mbarrier."""
    total = sum(round_up(math.prod(b.shape) * jnp.dtype(b.dtype).itemsize, 1024) for b in buffers)
    return total + round_up(reduction_bytes, 1024) + 8 * num_barriers


def check_smem(total, kernel, num_stages, d):
    """ValueError naming num_stages when a CTA's shared memory (``smem_bytes``) exceeds Hopper's limit."""
    if total > SMEM_BYTES:
        raise ValueError(f"kernel={kernel!r} with {num_stages=} and d={d} needs {total} bytes of shared memory per "
                         f"CTA (> {SMEM_BYTES}, the Hopper limit): lower num_stages")


def ring_scratch(q_rows, kv_cache, num_stages, num_wg):
    """The SMEM both kernels share: (buffers, barriers) = ((q_smem [64, D], k_smem [num_stages, S, D]: the ring of
    pages), (q_bar, k_bars: page landed, consumed_bars: slot free, released by every compute warpgroup))."""
    d, ps, dt = q_rows.shape[-1], kv_cache.shape[1], kv_cache.dtype
    buffers = (
        plgpu.SMEM((BLOCK_M, d), dt, transforms=tiled()),  # q_smem
        plgpu.SMEM((num_stages, ps, d), dt, transforms=tiled()),  # k_smem: ring of pages
    )
    barriers = (
        plgpu.Barrier(num_arrivals=1),  # q_bar
        plgpu.Barrier(num_arrivals=1, num_barriers=num_stages),  # k_bars: page landed
        plgpu.Barrier(num_arrivals=num_wg, num_barriers=num_stages),  # consumed_bars: slot free
    )
    return buffers, barriers


def launch(body, q_rows, kv_cache, seqlens, items, table, *, head_dim_v, num_wg, scratch, params, interpret):
    """Run a kernel body on grid (N work items, G * row blocks) with num_wg compute + 1 producer warpgroups:
    q_rows [B, G, R_pad, D], items [4, N] -> (o_part [N, G, R_pad, V] f32, lse_part [N, G, R_pad] f32 log2).

    Pallas Mosaic GPU reverses the grid onto CUDA's (jax/_src/pallas/mosaic_gpu/lowering.py: "Pallas prefers
    row-major iteration while the CUDA runtime prefers column-major"), so the last axis, the row blocks, is
    blockIdx.x, which the GPU launches fastest: the programs that read the same pages (one per 64-row block: 2 for
    h_q = 128) run side by side and share them through L2, as in FlashMLA's grid (m blocks, h_kv, SM parts); the
    items follow in launch (longest-first) order on blockIdx.y."""
    _, h_kv, r_pad, _ = q_rows.shape
    n = items.shape[1]
    if n > MAX_GRID_Y:
        raise ValueError(f"{n} work items exceed CUDA's grid limit of {MAX_GRID_Y} blocks along y (the items' "
                         f"axis): lower num_splits (or pass None) or split the batch")
    return plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((n, h_kv, r_pad, head_dim_v), jnp.float32),
                  jax.ShapeDtypeStruct((n, h_kv, r_pad), jnp.float32)),
        grid=(n, h_kv * (r_pad // BLOCK_M)),
        grid_names=("item", "hb"),
        num_threads=num_wg + 1,
        thread_name="wg",
        scratch_types=scratch,
        compiler_params=params,
        interpret=interpret,
    )(seqlens, items, table, q_rows, kv_cache)

