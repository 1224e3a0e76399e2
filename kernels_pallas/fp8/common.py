"""Operand checks every FP8 GEMM path shares (reference, XLA, Pallas), after DeepGEMM's contract
(docs/architecture.md "DeepGEMM FP8 contract"): A [m, k] e4m3 with per-token-per-128 scales [m, ceil(k/128)];
B [n, k] e4m3 with 128x128 block scales [ceil(n/128), ceil(k/128)]; grouped layouts add a group dimension."""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.common import cdiv
from kernels_pallas.fp8.tiling import BLOCK_K

FP8 = jnp.float8_e4m3fn


def check_operands(a, a_scale, b, b_scale, *, a_batch: tuple[int, ...] = (), b_batch: tuple[int, ...] = ()):
    """Validate A [*a_batch, m, k] / B [*b_batch, n, k] and their scales; returns (m, n, k). Raises ValueError."""
    for name, x, want in (("a", a, FP8), ("b", b, FP8), ("a_scale", a_scale, jnp.float32),
                          ("b_scale", b_scale, jnp.float32)):
        if jnp.dtype(x.dtype) != jnp.dtype(want):
            raise ValueError(f"{name} must be {jnp.dtype(want).name}, got {jnp.dtype(x.dtype).name}")
    if a.ndim != len(a_batch) + 2 or b.ndim != len(b_batch) + 2:
        raise ValueError(f"a must have {len(a_batch) + 2} dims and b {len(b_batch) + 2}, got {a.shape=} {b.shape=}")
    *ab, m, k = a.shape
    *bb, n, k2 = b.shape
    if tuple(ab) != tuple(a_batch) or tuple(bb) != tuple(b_batch):
        raise ValueError(f"batch dims: expected a {a_batch} and b {b_batch}, got {a.shape=} {b.shape=}")
    if k != k2:
        raise ValueError(f"contraction dims differ: a has k={k}, b has k={k2}")
    kb, nb = cdiv(k, BLOCK_K), cdiv(n, BLOCK_K)
    if a_scale.shape != (*a_batch, m, kb):
        raise ValueError(f"a_scale must be {(*a_batch, m, kb)} (ceil(k/128) = {kb}), got {a_scale.shape}")
    if b_scale.shape != (*b_batch, nb, kb):
        raise ValueError(f"b_scale must be {(*b_batch, nb, kb)} (ceil(n/128) = {nb}), got {b_scale.shape}")
    return m, n, k


def _check_ids(ids, name: str, length: int):
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array, got {ids.dtype}")
    if ids.shape != (length,):
        raise ValueError(f"{name} must have shape ({length},), got {ids.shape}")


def check_contiguous(a, a_scale, b, b_scale, group_ids):
    """The contiguous layout: a [m, k], b [G, n, k], group_ids [m] int; returns (m, n, k, G)."""
    g = b.shape[0] if b.ndim == 3 else 0
    m, n, k = check_operands(a, a_scale, b, b_scale, b_batch=(g,))
    _check_ids(group_ids, "group_ids", m)
    return m, n, k, g


def check_masked(a, a_scale, b, b_scale, masked_m):
    """The masked layout: a [G, m_max, k], b [G, n, k], masked_m [G] int; returns (G, m_max, n, k)."""
    g = b.shape[0] if b.ndim == 3 else 0
    m_max, n, k = check_operands(a, a_scale, b, b_scale, a_batch=(g,), b_batch=(g,))
    _check_ids(masked_m, "masked_m", g)
    return g, m_max, n, k


def row_mask(masked_m, m_max):
    """[G, m_max] bool: rows below each group's masked_m."""
    return jnp.arange(m_max)[None, :] < masked_m[:, None]


def sort_by_group(group_ids, num_groups: int):
    """group_ids [m] -> (valid [m]: id in [0, G); key [m] int32: the id, G for the others; order [m]: a stable sort of
    the rows by key (sorted position -> row); sizes [G] int32: rows per group)."""
    valid = (group_ids >= 0) & (group_ids < num_groups)                                        # (m,)
    key = jnp.where(valid, group_ids, num_groups).astype(jnp.int32)                            # (m,)
    order = jnp.argsort(key, stable=True)                                                      # (m,) sorted -> row
    sizes = jnp.bincount(key, length=num_groups + 1)[:num_groups].astype(jnp.int32)            # (G,)
    return valid, key, order, sizes
