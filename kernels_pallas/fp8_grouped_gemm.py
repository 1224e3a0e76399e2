"""MoE-grouped FP8 GEMMs with fine-grained scales (DeepGEMM's two grouped layouts; DESIGN.md).

- contiguous (prefill): a [m, k] rows of all groups, group_ids [m] (-1 = padding row, anywhere), b [G, n, k]
  -> [m, n]; row r uses b[group_ids[r]]; padding rows (and ids outside [0, G)) give zeros. DeepGEMM requires
  each group's segment to be aligned to its M tile; here segments may have any length and order.
- masked (decode): a [G, m_max, k], masked_m [G] -> [G, m_max, n]; rows at or past masked_m[g] are zero.

Both run the tile kernel of fp8_gemm.py (one group per row tile, -1 = skip; either variant, ``kernel=``), with
different row plans:
- contiguous: the wrapper gathers rows into tile-aligned segments (stable sort by group, each group padded to a
  multiple of block_m) and gathers the results back. Chosen over per-tile group boundaries inside the kernel
  because every tile then is a plain dense tile with one weight matrix (no row masks, no second pass over B for
  tiles that straddle groups), -1 rows anywhere and unaligned segments come for free, and the gathers move
  m*(k + 2n) bytes, small next to the GEMM's m*n*k flops. Tile count is static: the worst case over group
  sizes, cdiv(m + min(G, m) * (block_m - 1), block_m); unused tiles are skipped by the kernel.
- masked: grid over (G * m tiles, n tiles); tiles that start at or past masked_m[g] are skipped; rows past
  masked_m inside the last tile (and the skipped tiles, which are not written) are zeroed by one select after
  the kernel.

XLA paths: masked = dequantize + batched fp32 dot; contiguous = dequantize, sort rows by group and
``jax.lax.ragged_dot`` (fp32): exact (up to fp32 summation order), jittable, O(m*k + G*n*k) memory; on CPU
ragged_dot costs about as much as every group (DESIGN.md), which is fine for a fallback path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.fp8_gemm import (_block_product, _cdiv, _round_up, check_kernel, check_operands,
                                     dequantize_a, dequantize_b, prepare_a, prepare_b, resolve, resolve_tiling,
                                     run_tiles, BLOCK_K)


def _check_ids(ids, name: str, length: int):
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array, got {ids.dtype}")
    if ids.shape != (length,):
        raise ValueError(f"{name} must have shape ({length},), got {ids.shape}")


def _check_contiguous(a, a_scale, b, b_scale, group_ids):
    g = b.shape[0] if b.ndim == 3 else 0
    m, n, k = check_operands(a, a_scale, b, b_scale, b_batch=(g,))
    _check_ids(group_ids, "group_ids", m)
    return m, n, k, g


def _check_masked(a, a_scale, b, b_scale, masked_m):
    g = b.shape[0] if b.ndim == 3 else 0
    m_max, n, k = check_operands(a, a_scale, b, b_scale, a_batch=(g,), b_batch=(g,))
    _check_ids(masked_m, "masked_m", g)
    return g, m_max, n, k


def _row_mask(masked_m, g, m_max):
    return jnp.arange(m_max)[None, :] < masked_m[:, None]                                    # (G, m_max)


# ----------------------------------------------------------------------------------------------- references
@functools.partial(jax.jit, static_argnames=("out_dtype",))
def fp8_grouped_gemm_contiguous_reference(a, a_scale, b, b_scale, group_ids, *, out_dtype=jnp.bfloat16):
    """Plain-jnp fp32 reference: row r -> the fp8_gemm contract with b[group_ids[r]]; -1 rows zero."""
    m, n, _, _ = _check_contiguous(a, a_scale, b, b_scale, group_ids)

    def one_group(out, xs):
        g, b_g, bs_g = xs
        d = _block_product(a, a_scale, b_g, bs_g)                                                # (m, n)
        return jnp.where((group_ids == g)[:, None], d, out), None

    out, _ = lax.scan(one_group, jnp.zeros((m, n), jnp.float32), (jnp.arange(b.shape[0]), b, b_scale))
    return out.astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def fp8_grouped_gemm_masked_reference(a, a_scale, b, b_scale, masked_m, *, out_dtype=jnp.bfloat16):
    """Plain-jnp fp32 reference: group g -> the fp8_gemm contract on a[g], b[g]; rows >= masked_m[g] zero."""
    g, m_max, _, _ = _check_masked(a, a_scale, b, b_scale, masked_m)
    out = jax.vmap(_block_product)(a, a_scale, b, b_scale)                                     # (G, m_max, n)
    return jnp.where(_row_mask(masked_m, g, m_max)[..., None], out, 0.0).astype(out_dtype)


# ----------------------------------------------------------------------------------------------- xla paths
def _contiguous_xla(a, a_scale, b, b_scale, group_ids, out_dtype):
    g = b.shape[0]
    valid = (group_ids >= 0) & (group_ids < g)                                                 # (m,)
    key = jnp.where(valid, group_ids, g).astype(jnp.int32)
    order = jnp.argsort(key, stable=True)                                                      # sorted -> row
    sizes = jnp.bincount(key, length=g + 1)[:g].astype(jnp.int32)                              # (G,)
    x = dequantize_a(a, a_scale)[order]                                                        # (m, k) sorted
    w = dequantize_b(b, b_scale)                                                               # (G, n, k)
    out_sorted = lax.ragged_dot(x, w.swapaxes(1, 2), sizes, precision=lax.Precision.HIGHEST,
                                preferred_element_type=jnp.float32)                            # (m, n)
    out = jnp.zeros_like(out_sorted).at[order].set(out_sorted)                                 # (m, n) rows
    return jnp.where(valid[:, None], out, 0.0).astype(out_dtype)


def _masked_xla(a, a_scale, b, b_scale, masked_m, out_dtype):
    g, m_max = a.shape[:2]
    out = jnp.einsum("gmk,gnk->gmn", dequantize_a(a, a_scale), dequantize_b(b, b_scale),
                     precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)     # (G, m_max, n)
    return jnp.where(_row_mask(masked_m, g, m_max)[..., None], out, 0.0).astype(out_dtype)


# ----------------------------------------------------------------------------------------------- row plans
def contiguous_plan(group_ids, num_groups: int, block_m: int):
    """group_ids [m] -> (src [T*bm] row of a per tiled row (m = none), dest [m] tiled row per row, tile_group [T]).

  Rows are stably sorted by group, each group padded to a multiple of block_m; T is static (worst case)."""
    (m,) = group_ids.shape
    g = num_groups
    num_tiles = _cdiv(m + min(g, m) * (block_m - 1), block_m)
    valid = (group_ids >= 0) & (group_ids < g)
    key = jnp.where(valid, group_ids, g).astype(jnp.int32)                                     # (m,) G = padding
    order = jnp.argsort(key, stable=True)                                                      # (m,) sorted -> row
    sizes = jnp.bincount(key, length=g + 1)[:g].astype(jnp.int32)                              # (G,)
    padded = (sizes + block_m - 1) // block_m * block_m                                        # (G,)
    start, pstart = jnp.cumsum(sizes) - sizes, jnp.cumsum(padded) - padded                     # (G,)
    skey = key[order]                                                                          # (m,) sorted keys
    gk = jnp.minimum(skey, g - 1)
    dest_sorted = jnp.where(skey < g, jnp.arange(m) - start[gk] + pstart[gk], num_tiles * block_m)
    dest = jnp.zeros((m,), jnp.int32).at[order].set(dest_sorted.astype(jnp.int32))            # (m,)
    src = jnp.full((num_tiles * block_m,), m, jnp.int32).at[dest].set(jnp.arange(m, dtype=jnp.int32), mode="drop")
    tile_start = jnp.arange(num_tiles, dtype=jnp.int32) * block_m
    tile_group = jnp.searchsorted(jnp.cumsum(padded), tile_start, side="right")                # (T,)
    tile_group = jnp.where(tile_group < g, tile_group, -1).astype(jnp.int32)
    return src, dest, valid, tile_group


def _contiguous_pallas(a, a_scale, b, b_scale, group_ids, *, out_dtype, kernel, tiling, interpret):
    m, k = a.shape
    _, n, _ = b.shape
    src, dest, valid, tile_group = contiguous_plan(group_ids, b.shape[0], tiling.block_m)
    rows = src.shape[0]
    a_g = jnp.concatenate([a, jnp.zeros((1, k), a.dtype)])[src]                                # (T*bm, k)
    as_g = jnp.concatenate([a_scale, jnp.zeros((1, a_scale.shape[1]), a_scale.dtype)])[src]  # (T*bm, kb)
    a_p, as_t = prepare_a(a_g, as_g, rows)
    b_p, bs_t = prepare_b(b, b_scale, tiling.block_n)
    out = run_tiles(tile_group, a_p, as_t, b_p, bs_t, kernel=kernel, tiling=tiling, out_dtype=out_dtype,
                    interpret=interpret)                                                       # (T*bm, np)
    out = jnp.take(out[:, :n], jnp.minimum(dest, rows - 1), axis=0)                            # (m, n)
    return jnp.where(valid[:, None], out, jnp.zeros((), out_dtype))


def _masked_pallas(a, a_scale, b, b_scale, masked_m, *, out_dtype, kernel, tiling, interpret):
    g, m_max, k = a.shape
    _, n, _ = b.shape
    block_m = tiling.block_m
    mp = _round_up(m_max, block_m)
    per_g = mp // block_m
    a_p = jnp.pad(a, ((0, 0), (0, mp - m_max), (0, 0))).reshape(g * mp, k)                    # (G*mp, k)
    as_p = jnp.pad(a_scale, ((0, 0), (0, mp - m_max), (0, 0))).reshape(g * mp, -1)           # (G*mp, kb)
    a_p, as_t = prepare_a(a_p, as_p, g * mp)
    b_p, bs_t = prepare_b(b, b_scale, tiling.block_n)
    t = jnp.arange(g * per_g, dtype=jnp.int32)
    tile_group = jnp.where((t % per_g) * block_m < masked_m[t // per_g], t // per_g, -1).astype(jnp.int32)
    out = run_tiles(tile_group, a_p, as_t, b_p, bs_t, kernel=kernel, tiling=tiling, out_dtype=out_dtype,
                    interpret=interpret)                                                       # (G*mp, np)
    out = out.reshape(g, mp, -1)[:, :m_max, :n]                                                # (G, m_max, n)
    return jnp.where(_row_mask(masked_m, g, m_max)[..., None], out, jnp.zeros((), out_dtype))


# ----------------------------------------------------------------------------------------------- entries
_STATIC = ("out_dtype", "implementation", "interpret", "block_m", "block_n", "block_k", "stages", "kernel",
           "multicast")


@functools.partial(jax.jit, static_argnames=_STATIC)
def fp8_grouped_gemm_contiguous(a, a_scale, b, b_scale, group_ids, *, out_dtype=jnp.bfloat16, implementation=None,
                                interpret=None, block_m=None, block_n=None, block_k=BLOCK_K, stages=None,
                                kernel="pipelined", multicast=1):
    """a [m, k] e4m3 (+ [m, ceil(k/128)] scales), b [G, n, k] e4m3 (+ [G, ceil(n/128), ceil(k/128)]),
  group_ids [m] int (-1 = padding, anywhere; segments need not be aligned) -> [m, n], padding rows zero.
  Knobs as fp8_gemm's."""
    m, n, k, g = _check_contiguous(a, a_scale, b, b_scale, group_ids)
    check_kernel(kernel)
    implementation, interpret = resolve(implementation, interpret)
    if implementation == "xla":
        return _contiguous_xla(a, a_scale, b, b_scale, group_ids, out_dtype)
    tiling = resolve_tiling(kernel, block_m, block_n, block_k, stages, rows=m, n=n, k=k, out_dtype=out_dtype,
                            interpret=interpret, multicast=multicast)
    return _contiguous_pallas(a, a_scale, b, b_scale, group_ids, out_dtype=out_dtype, kernel=kernel,
                              tiling=tiling, interpret=interpret)


@functools.partial(jax.jit, static_argnames=_STATIC)
def fp8_grouped_gemm_masked(a, a_scale, b, b_scale, masked_m, *, out_dtype=jnp.bfloat16, implementation=None,
                            interpret=None, block_m=None, block_n=None, block_k=BLOCK_K, stages=None,
                            kernel="pipelined", multicast=1):
    """a [G, m_max, k] e4m3 (+ [G, m_max, ceil(k/128)]), b [G, n, k] (+ [G, ceil(n/128), ceil(k/128)]),
  masked_m [G] int -> [G, m_max, n]; rows at or past masked_m[g] are zero. Knobs as fp8_gemm's."""
    g, m_max, n, k = _check_masked(a, a_scale, b, b_scale, masked_m)
    check_kernel(kernel)
    implementation, interpret = resolve(implementation, interpret)
    if implementation == "xla":
        return _masked_xla(a, a_scale, b, b_scale, masked_m, out_dtype)
    tiling = resolve_tiling(kernel, block_m, block_n, block_k, stages, rows=g * m_max, n=n, k=k,
                            out_dtype=out_dtype, interpret=interpret, multicast=multicast)
    return _masked_pallas(a, a_scale, b, b_scale, masked_m, out_dtype=out_dtype, kernel=kernel, tiling=tiling,
                          interpret=interpret)
