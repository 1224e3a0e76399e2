"""MLA decode, kernel="shared_scores": one score computation per page, shared through SMEM (FlashMLA's structure).

FlashMLA's Hopper decode kernel (csrc/flash_fwd_mla_kernel.h, ``compute_attn_1rowblock_splitkv_mla``, Feb 2025:
two warpgroups, kBlockM = kBlockN = 64) computes S = Q K^T only in warpgroup 0, which runs the online softmax,
writes P (bf16) to ``sP`` and the per-row rescale factor to ``sScale_o`` and signals ``NamedBarriers::SReady``;
warpgroup 1 waits, rescales its accumulator and both do O += P V for their half of the 512 V columns; at the end
warpgroup 0 hands over the row sums (``sRow_sum``, ``SoftmaxReady``). This kernel does the same on the grid, the
producer warpgroup and the SMEM page ring of recompute_scores.py's ``decode_kernel`` (pallas_common.py):

- warpgroup 0, the scorer (``_score_wg``), per page: S = Q K^T (one wgmma), on the sequence's partial last page
  zero the V rows past seqlen for all V columns, mask, online softmax; P -> ``p_smem`` [64, S] (cache dtype, the
  wgmma tile layout of q_smem), alpha -> ``alpha_smem`` [64] f32; then acc = acc * alpha + P V[:, own columns]
  with P from registers. After the loop: l -> ``l_smem`` [64] f32; it writes lse.
- warpgroups 1..num_wg-1 (``_pv_wg``), per page: acc = acc * alpha + P V[:, own columns], P read by the wgmma
  from ``p_smem``. They never read q or K's rope columns and never compute scores.

Barriers (every barrier is waited on by each of its waiters once per phase, so parities stay in step):
- ``p_full`` (1 arrival: the scorer, once per page): P and alpha of the page are in SMEM (and the page's V rows past
  seqlen are zeroed). Waited by each other compute warpgroup before its P V.
- ``p_free`` (num_wg - 1 arrivals, once per page): that warpgroup's P V wgmma of the page completed, so P and alpha
  may be overwritten. The scorer waits before writing the next page's P (pages 1..n-1) and once after the loop.
- ``l_bar`` (1 arrival: the scorer, after the loop): l is in ``l_smem``; each other compute warpgroup waits once.
- q_bar, k_bars, consumed_bars as in ``decode_kernel`` (consumed_bars: num_wg arrivals per page; every compute
  warpgroup waits on k_bars, the scorer alone on q_bar).
With num_wg == 1 none of the sharing state is allocated: the scorer is the only compute warpgroup. GPU interpret
mode raises at the end of a kernel whose waiter missed a phase ("did not observe all phases").

Shared memory for V3 (d = 576 bf16, num_stages = 2), each buffer at Pallas' 1024-byte alignment: q 73728 + ring
147456 + P 8192 + alpha 1024 + l 1024 + 8 barriers x 8 = 231488 of the 232448 bytes a CTA may use; hence no
reduction scratch (``_REDUCTION_SCRATCH``) and num_stages = 3 does not fit (FlashMLA: q + 2 K pages + sP + sScale_o).

GPU interpret mode cannot run a wgmma with a register A nor ``pl.run_state``, so there the P V products are
``dot_general`` of the same SMEM contents (the P V of warpgroups 1.. reads ``p_smem[...]``). Before jax 0.11.2
(``_mosaic.substitute_wgmma``) it cannot run the transposed-B score wgmma nor ``plgpu.load`` with a layout either:
there the scores are a ``dot_general`` too and alpha / l plain reads. Barriers, SMEM traffic, masking and the P
hand-off are the same code in every mode.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import _mosaic
from kernels_pallas.mla.pallas_common import (BLOCK_M, accumulate_pv, check_smem, compute_registers, init_carry,
                                              launch, online_softmax, produce, program, rescale, ring_scratch,
                                              score_mask, scores, smem_bytes, store_lse, store_out, tiled, wait_page,
                                              wait_q, zero_rows_past)

# The only reductions here (row max and row sum of a WGMMA-layout [64, S] tile) stay inside each warp, so they need
# no reduction scratch; the default 2048 bytes would push the V3 configuration (d = 576, num_stages = 2) past 227 KB.
_REDUCTION_SCRATCH = 0


def _accumulate_pv_smem(acc, p_smem, v_page, interpret):
    """acc + P V: acc [64, Vb] f32, p_smem [64, S] and v_page [S, Vb] (both SMEM) -> [64, Vb] f32."""
    if interpret:
        return acc + lax.dot_general(p_smem[...], v_page[...], (((1,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)
    return pl.run_state(lambda o_ref: plgpu.wgmma(o_ref, p_smem, v_page))(plgpu.ACC.init(acc))


def _load_rows(row_smem, interpret):
    """A [64] f32 per-row vector from SMEM, in the row layout of the WGMMA accumulator."""
    if _mosaic.substitute_wgmma(interpret):
        return row_smem[...]
    return _mosaic.load(row_smem, plgpu.Layout.WGMMA.reduce(1))


def _score_wg(prog, refs, sharing, *, ps, s_q, m, dv, block_dv, num_wg, num_stages, scale, causal, interpret):
    """Compute warpgroup 0: scores, softmax and the P hand-off (module docstring); its own columns [0, block_dv)."""
    q_smem, k_smem, q_bar, k_bars, consumed_bars, o_ref, lse_ref = refs
    vcols = pl.ds(0, block_dv)
    wait_q(prog, q_bar)
    cols, limit = score_mask(prog, ps, s_q, m, causal)

    def step(t, carry):
        acc, m_i, l_i = carry
        slot, page_start, k_page = wait_page(prog, k_smem, k_bars, t, num_stages, ps)
        s = scores(q_smem, k_page, interpret)  # [64, S] f32; the QK wgmma has completed

        @pl.when(prog.seqlen - page_start < ps)  # the sequence's last, partial page: zero V rows past seqlen
        def _():  # all V columns: the other warpgroups read them only after p_full
            for c in range(0, dv, 64):
                zero_rows_past(k_page.at[:, pl.ds(c, 64)], prog.seqlen - page_start)
            plgpu.commit_smem()  # order the stores before the tensor cores read them

        p, alpha, m_new, l_i = online_softmax(s, cols + page_start < limit, m_i, l_i, scale)
        acc = rescale(acc, alpha)
        p16 = p.astype(k_smem.dtype)  # [64, S]
        if num_wg > 1:
            p_smem, alpha_smem, _, p_full, p_free, _ = sharing

            @pl.when(t > 0)
            def _():
                plgpu.barrier_wait(p_free)  # the others' P V of the previous page has read P and alpha

            p_smem[...] = p16
            alpha_smem[...] = alpha
            plgpu.commit_smem()  # P is read by the other warpgroups' wgmmas
            plgpu.barrier_arrive(p_full)
        acc = accumulate_pv(acc, p16, k_page.at[:, vcols], interpret)
        plgpu.barrier_arrive(consumed_bars.at[slot])
        return acc, m_new, l_i

    acc, m_i, l_i = lax.fori_loop(0, prog.n_steps, step, init_carry(block_dv))
    if num_wg > 1:
        _, _, l_smem, _, p_free, l_bar = sharing

        @pl.when(prog.n_steps > 0)
        def _():
            plgpu.barrier_wait(p_free)  # observe the last page's release too (one wait per phase)

        l_smem[...] = l_i
        plgpu.barrier_arrive(l_bar)
    store_out(o_ref, prog, vcols, acc, l_i)
    store_lse(lse_ref, prog, m_i, l_i)


def _pv_wg(w, prog, refs, sharing, *, block_dv, num_stages, interpret):
    """Compute warpgroup w >= 1: acc = acc * alpha + P V[:, its columns] per page, P and alpha from the scorer."""
    _, k_smem, _, k_bars, consumed_bars, o_ref, _ = refs
    p_smem, alpha_smem, l_smem, p_full, p_free, l_bar = sharing
    vcols = pl.ds(w * block_dv, block_dv)

    def step(t, acc):
        slot = lax.rem(t, num_stages)
        plgpu.barrier_wait(k_bars.at[slot])  # the page landed (already seen by the scorer)
        plgpu.barrier_wait(p_full)  # P, alpha and the zeroed V rows of this page are in SMEM
        acc = rescale(acc, _load_rows(alpha_smem, interpret))
        acc = _accumulate_pv_smem(acc, p_smem, k_smem.at[slot, :, vcols], interpret)  # wgmma completed
        plgpu.barrier_arrive(p_free)
        plgpu.barrier_arrive(consumed_bars.at[slot])
        return acc

    acc, _, _ = init_carry(block_dv)
    acc = lax.fori_loop(0, prog.n_steps, step, acc)
    plgpu.barrier_wait(l_bar)
    store_out(o_ref, prog, vcols, acc, _load_rows(l_smem, interpret))


def _shared_kernel(seqlens_ref, items_ref, table_ref, q_ref, kv_ref, o_ref, lse_ref, q_smem, k_smem, q_bar,
                   k_bars, consumed_bars, sharing, *, s_q, m, block_dv, num_wg, num_stages, scale, causal,
                   interpret):
    """One program = one (64-row block of one kv head's R = Q * M query rows, work item), as
    ``decode_kernel``: warpgroup 0 scores (``_score_wg``), 1..num_wg-1 accumulate (``_pv_wg``), num_wg produces.

    Refs as ``decode_kernel``'s; sharing = (p_smem [64, S], alpha_smem [64] f32, l_smem [64] f32, p_full, p_free,
    l_bar) when num_wg > 1, else ().
    """
    wg = lax.axis_index("wg")
    ps = kv_ref.shape[1]
    prog = program(seqlens_ref, items_ref, q_ref)
    compute_regs = compute_registers(num_wg)
    refs = (q_smem, k_smem, q_bar, k_bars, consumed_bars, o_ref, lse_ref)

    @pl.when(wg == num_wg)
    def _producer():
        produce(prog, table_ref, q_ref, kv_ref, q_smem, k_smem, q_bar, k_bars, consumed_bars, num_stages)

    @pl.when(wg == 0)
    def _scorer():
        plgpu.set_max_registers(compute_regs, action="increase")
        _score_wg(prog, refs, sharing, ps=ps, s_q=s_q, m=m, dv=num_wg * block_dv, block_dv=block_dv, num_wg=num_wg,
                  num_stages=num_stages, scale=scale, causal=causal, interpret=interpret)

    def pv(w):
        plgpu.set_max_registers(compute_regs, action="increase")
        _pv_wg(w, prog, refs, sharing, block_dv=block_dv, num_stages=num_stages, interpret=interpret)

    for w in range(1, num_wg):
        pl.when(wg == w)(functools.partial(pv, w))


def shared_scores_pallas(q_rows, kv_cache, seqlens, items, table, *, s_q, m, head_dim_v, scale, causal, block_dv,
                         num_stages, interpret):
    """``plgpu.kernel`` wrapper of ``_shared_kernel``, same operands and results as recompute_scores.py's
    ``recompute_scores_pallas``: q_rows [B, G, R_pad, D], items [4, N] -> (o_part [N, G, R_pad, V] f32, lse_part
    [N, G, R_pad] f32 log2). Raises ValueError naming num_stages if the SMEM does not fit in 227 KB."""
    ps, dt = kv_cache.shape[1], kv_cache.dtype
    num_wg = head_dim_v // block_dv
    buffers, barriers = ring_scratch(q_rows, kv_cache, num_stages, num_wg)
    sharing, shared_buffers, n_barriers = (), (), 1 + 2 * num_stages  # q_bar, k_bars and consumed_bars per slot
    if num_wg > 1:
        shared_buffers = (
            plgpu.SMEM((BLOCK_M, ps), dt, transforms=tiled()),  # p_smem: P of the page (wgmma A operand)
            plgpu.SMEM((BLOCK_M,), jnp.float32),  # alpha_smem: the page's per-row rescale factor
            plgpu.SMEM((BLOCK_M,), jnp.float32),  # l_smem: the final row sums
        )
        sharing = shared_buffers + (
            plgpu.Barrier(num_arrivals=1),  # p_full: P and alpha written
            plgpu.Barrier(num_arrivals=num_wg - 1),  # p_free: P and alpha read
            plgpu.Barrier(num_arrivals=1),  # l_bar: l written
        )
        n_barriers += 3
    check_smem(smem_bytes(buffers + shared_buffers, n_barriers, _REDUCTION_SCRATCH), "shared_scores", num_stages,
               q_rows.shape[-1])
    kernel = functools.partial(_shared_kernel, s_q=s_q, m=m, block_dv=block_dv, num_wg=num_wg,
                               num_stages=num_stages, scale=scale, causal=causal, interpret=interpret is not None)
    params = plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=_REDUCTION_SCRATCH)
    return launch(kernel, q_rows, kv_cache, seqlens, items, table, head_dim_v=head_dim_v, num_wg=num_wg,
                   scratch=buffers + barriers + (sharing,), params=params, interpret=interpret)
