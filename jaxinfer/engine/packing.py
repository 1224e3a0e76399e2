"""One host-to-device transfer per step: a step's per-row host arrays packed into a single int32 [rows, C] array.

A decode step has ~18 small per-row inputs (token ids, positions, block table, slots, the sampler's settings).
Placing each one on the devices costs host time per array on CPU (``jax.make_array_from_callback``: shardings, a
callback, a buffer per array), and on a 2-core machine that host time is taken from the device's threads even when it
overlaps the previous step (docs/benchmarks.md "Engine steps and host overhead (CPU)"). Packed, the step places one
array; the jitted step unpacks it with slices and bitcasts that XLA fuses into their consumers (free on device). No
library packs arrays of mixed dtypes into one buffer and back inside jit, hence this module.

Packing is bit-exact: 32-bit dtypes (float32, uint32) are reinterpreted as int32 (``ndarray.view`` on the host,
``lax.bitcast_convert_type`` on device); bool is stored as 0/1 and compared back. Every leaf's first dimension is
the row dimension, so row-sharding the packed array shards every leaf the same way.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each leaf of a packed pytree lives (hashable: a static argument of the jitted step).

    columns: per leaf (first column, dtype, shape after the row dimension); treedef: the pytree's structure.
    """

    treedef: jax.tree_util.PyTreeDef
    columns: tuple[tuple[int, np.dtype, tuple[int, ...]], ...]


def _as_int32(x: np.ndarray) -> np.ndarray:
    if x.dtype == np.bool_:
        return x.astype(np.int32)
    if x.dtype.itemsize != 4:
        raise ValueError(f"cannot pack dtype {x.dtype}: 32-bit dtypes and bool only")
    return x.view(np.int32)


def pack(tree) -> tuple[np.ndarray, Layout]:
    """A pytree of numpy arrays, each [rows, ...] with the same rows -> (int32 [rows, C], Layout)."""
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        raise ValueError("nothing to pack")
    rows = (np.shape(leaves[0]) or (None,))[0]
    parts, columns, col = [], [], 0
    for leaf in leaves:
        x = np.asarray(leaf)
        if x.ndim == 0 or x.shape[0] != rows:
            raise ValueError(f"every leaf must be [rows={rows}, ...], got shape {x.shape}")
        flat = _as_int32(np.ascontiguousarray(x)).reshape(rows, -1)  # [rows, width]
        parts.append(flat)
        columns.append((col, x.dtype, x.shape[1:]))
        col += flat.shape[1]
    return np.concatenate(parts, axis=1), Layout(treedef, tuple(columns))


def unpack(packed: jax.Array, layout: Layout):
    """Inverse of ``pack`` inside jit: int32 [rows, C] -> the pytree of [rows, ...] arrays."""
    rows = packed.shape[0]
    leaves = []
    for start, dtype, shape in layout.columns:
        width = int(np.prod(shape, dtype=np.int64))
        x = packed[:, start:start + width]  # [rows, width]
        if dtype == np.bool_:
            x = x != 0
        elif dtype != np.int32:
            x = jax.lax.bitcast_convert_type(x, dtype)
        leaves.append(x.reshape(rows, *shape))
    return jax.tree.unflatten(layout.treedef, leaves)
