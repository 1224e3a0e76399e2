"""MLA decode, kernel="recompute_scores" (the default) and kernel="pingpong": every compute warpgroup computes the
page's scores itself.

Each compute warpgroup owns block_dv output columns and computes the page's 64 x 64 scores S = Q K^T itself, so with
V3's dv = 512, block_dv = 256 the QK wgmma runs twice per page; one producer warpgroup streams q and the item's pages
through the SMEM ring (pallas_common.py).

kernel="pingpong" is the same body with FlashAttention-3's warpgroup ping-pong (Shah et al. 2024, section 3.1,
"pingpong scheduling"): the compute warpgroups take turns at the tensor cores, one wgmma phase each: QK^T of
warpgroup 0, QK^T of warpgroup 1, ..., then P V of 0, P V of 1, ..., page after page; a warpgroup waits for its turn
(turn_bars[w]) before it issues a phase and hands the turn on (turn_bars[w + 1]) as soon as the phase is issued, so
the next one's wgmma queues behind it while this one runs its softmax. Without it, the warpgroups issue the same
phase together and the tensor cores idle through their softmax.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
from jax import lax

from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.mla.pallas_common import (RING, Program, Ring, accumulate_pv, check_smem, compute_registers,
                                              init_carry, launch, online_softmax, produce, program, rescale,
                                              ring_scratch, score_mask, scores, smem_bytes, store_lse, store_out,
                                              wait_page, wait_q, zero_rows_past)


class Compute(NamedTuple):
    """What one compute warpgroup's page steps read besides their carry: the program, q in SMEM, the score mask
    (``score_mask``: cols, limit), its V columns [col0, col0 + block_dv), sync_bar (every compute warpgroup's QK read
    of a partial page is done before any zeroes its V rows), the turn-taking of kernel="pingpong" (my_turn, pass_turn:
    no-ops otherwise), the softmax scale and whether the kernel is interpreted."""

    prog: Program
    q_smem: jax.Array
    cols: jax.Array
    limit: jax.Array
    col0: jax.Array
    block_dv: int
    sync_bar: jax.Array
    my_turn: Callable
    pass_turn: Callable
    scale: float
    interpret: bool


def attend_page(c: Compute, carry, page_start, k_page):
    """One page of attention for a compute warpgroup: carry (acc [64, block_dv] f32, m_i, l_i [64]) -> carry.
    k_page [S, D] (SMEM, landed) holds keys page_start .. page_start + S - 1."""
    acc, m_i, l_i = carry
    ps = k_page.shape[0]
    c.my_turn()
    s = scores(c.q_smem, k_page, c.interpret, c.pass_turn)  # [64, S] f32

    @pl.when(c.prog.seqlen - page_start < ps)  # the sequence's last, partial page: zero V rows past seqlen
    def _():
        plgpu.barrier_arrive(c.sync_bar)  # every warpgroup's QK read of this slot is done
        plgpu.barrier_wait(c.sync_bar)
        for col in range(0, c.block_dv, 64):  # 64 columns at a time: 16 registers, not 64 for all of them
            zero_rows_past(k_page.at[:, pl.ds(c.col0 + col, 64)], c.prog.seqlen - page_start)
        plgpu.commit_smem()  # order the stores before the tensor cores read them

    p, alpha, m_new, l_i = online_softmax(s, c.cols + page_start < c.limit, m_i, l_i, c.scale)
    acc = rescale(acc, alpha)
    p16 = p.astype(k_page.dtype)
    v_page = k_page.at[:, pl.ds(c.col0, c.block_dv)]
    c.my_turn()
    acc = accumulate_pv(acc, p16, v_page, c.interpret, c.pass_turn)
    return acc, m_new, l_i


def decode_kernel(seqlens_ref, items_ref, table_ref, q_ref, kv_ref, o_ref, lse_ref, q_smem, k_smem, q_bar, k_bars,
                  consumed_bars, sync_bar, turn_bars=None, *, s_q, m, block_dv, num_wg, num_stages, scale, causal,
                  interpret, ring: Ring = RING, attend: Callable = attend_page):
    """One program = one (64-row block of one kv head's R = Q * M query rows, work item: a page range of one
    sequence).

    Warpgroups 0..num_wg-1 compute (each owns V columns [w * block_dv, (w + 1) * block_dv) of the output and
    recomputes the 64 x 64 scores of each page); warpgroup num_wg is the producer (``produce``). turn_bars
    (kernel="pingpong"; None otherwise): one barrier per compute warpgroup, its turn at the tensor cores.

    seqlens_ref [B] i32, items_ref [4, N] i32 (schedule.py), table_ref [B, P] i32, q_ref [B, G, R_pad, D],
    kv_ref [pages, 64, G, D] (all GMEM); o_ref [N, G, R_pad, V] f32 and lse_ref [N, G, R_pad] f32 (log2 units)
    receive this item's partial (normalised) output and log-sum-exp in its output row.

    ring (the page ring's protocol) and attend (one page's step, ``attend_page``): static hooks, which
    benchmarks/kernels_mla.py's probes replace to take half of the kernel's work out.
    """
    ps = kv_ref.shape[1]
    prog = program(seqlens_ref, items_ref, q_ref)
    wg = lax.axis_index("wg")
    compute_regs = compute_registers(num_wg)

    @pl.when(wg == num_wg)
    def _producer():
        produce(prog, table_ref, q_ref, kv_ref, q_smem, k_smem, q_bar, k_bars, consumed_bars, num_stages, ring)

    # One code path for every compute warpgroup, its V columns offset by its (traced) index: as a static branch per
    # warpgroup, LLVM hoists both branches' wgmma descriptors above the split and ptxas spills them (reloaded every
    # page).
    def compute(w):
        col0 = pl.multiple_of(w * block_dv, 64)
        plgpu.set_max_registers(compute_regs, action="increase")
        if turn_bars is not None:   # the last warpgroup gives warpgroup 0 the first turn
            pl.when(w == num_wg - 1)(lambda: plgpu.barrier_arrive(turn_bars.at[0]))

        def my_turn():
            if turn_bars is not None:
                plgpu.barrier_wait(turn_bars.at[w])

        def pass_turn():
            if turn_bars is not None:
                plgpu.barrier_arrive(turn_bars.at[lax.rem(w + 1, num_wg)])

        wait_q(prog, q_bar)
        cols, limit = score_mask(prog, ps, s_q, m, causal)
        c = Compute(prog, q_smem, cols, limit, col0, block_dv, sync_bar, my_turn, pass_turn, scale, interpret)

        def step(t, carry):
            slot, page_start, k_page = wait_page(prog, k_smem, k_bars, t, num_stages, ps, ring)
            carry = attend(c, carry, page_start, k_page)
            ring.release(consumed_bars, slot)
            return carry

        acc, m_i, l_i = lax.fori_loop(0, prog.n_steps, step, init_carry(block_dv))
        if turn_bars is not None:   # warpgroup 0 observes the last turn handed to it (the first one, for no page)
            pl.when(w == 0)(lambda: plgpu.barrier_wait(turn_bars.at[0]))
        store_out(o_ref, prog, pl.ds(col0, block_dv), acc, l_i)
        pl.when(w == 0)(lambda: store_lse(lse_ref, prog, m_i, l_i))

    pl.when(wg < num_wg)(lambda: compute(wg))


def recompute_scores_pallas(q_rows, kv_cache, seqlens, items, table, *, s_q, m, head_dim_v, scale, causal, block_dv,
                            num_stages, interpret, pingpong=False, ring: Ring = RING,
                            attend: Callable = attend_page):
    """``plgpu.kernel`` wrapper of ``decode_kernel``: q_rows [B, G, R_pad, D], items [4, N] -> (o_part
    [N, G, R_pad, V] f32, lse_part [N, G, R_pad] f32 log2). pingpong: the compute warpgroups take turns at the tensor
    cores (kernel="pingpong"); ring, attend: ``decode_kernel``'s hooks. Raises ValueError naming num_stages if the
    SMEM does not fit in 227 KB."""
    num_wg = head_dim_v // block_dv
    buffers, barriers = ring_scratch(q_rows, kv_cache, num_stages, num_wg)
    sync_bar = plgpu.Barrier(num_arrivals=num_wg)  # before zeroing a partial page's V rows
    turn = (plgpu.Barrier(num_arrivals=1, num_barriers=num_wg),) if pingpong else ()  # turn_bars: one per warpgroup
    params = plgpu.CompilerParams(approx_math=True)
    n_barriers = 2 + 2 * num_stages + len(turn) * num_wg  # q_bar, sync_bar, k_bars and consumed_bars per slot, turns
    kind = "pingpong" if pingpong else "recompute_scores"
    check_smem(smem_bytes(buffers, n_barriers, params.reduction_scratch_bytes), kind, num_stages, q_rows.shape[-1])
    kernel = functools.partial(decode_kernel, s_q=s_q, m=m, block_dv=block_dv, num_wg=num_wg, num_stages=num_stages,
                               scale=scale, causal=causal, interpret=interpret is not None, ring=ring, attend=attend)
    return launch(kernel, q_rows, kv_cache, seqlens, items, table, head_dim_v=head_dim_v, num_wg=num_wg,
                  scratch=buffers + barriers + (sync_bar,) + turn, params=params, interpret=interpret)
