"""Save and restore pytrees of jax.Array with orbax-checkpoint's v1 API (sharded, any mesh on restore).

orbax-checkpoint 0.12.8 ships the v1 API as ``orbax.checkpoint.experimental.v1`` (there is no
``orbax.checkpoint.v1`` yet); its ``save``/``load`` replace the deprecated ``save_pytree``/``load_pytree``.
v1 restores onto the shardings given in the abstract tree (any mesh, any partition) and stores float32,
bfloat16, int32 and float8_e4m3fn leaves natively, so no fallback to the classic ``StandardCheckpointer`` and no
uint8 bitcasts are needed. Layout written: ``path/{_CHECKPOINT_METADATA, orbax.checkpoint, state/...}``.
"""

from __future__ import annotations

import os
import pathlib

import jax
import orbax.checkpoint.experimental.v1 as ocp

from jaxinfer.checkpoint.errors import CheckpointError

_MAX_LISTED = 8  # mismatches listed in one error message
_MARKERS = ("orbax.checkpoint", "_CHECKPOINT_METADATA", "_METADATA")


def save_pytree(path: str | os.PathLike, tree) -> None:
    """Saves a pytree (nested dicts) of jax.Array to the new directory ``path``; returns once it is committed.

    Every process of a multi-process run must call this with its shards (orbax writes each shard once).
    """
    path = pathlib.Path(path).absolute()
    if path.exists():
        raise CheckpointError(f"orbax checkpoint destination {path} already exists")
    ocp.save(path, tree)  # blocking: returns after the checkpoint is finalized


def is_orbax_dir(path: str | os.PathLike) -> bool:
    """True if ``path`` is a directory holding an orbax checkpoint's marker files (three stat calls).

    Not ``ocp.is_orbax_checkpoint``: in 0.12.8 it also accepts any plain directory (its v0-layout check passes for
    an empty or HF directory), so it cannot tell an orbax checkpoint from an HF one. The markers are those of the
    v1 layout's ``matches_markers``: ``orbax.checkpoint`` (v1 indicator), ``_CHECKPOINT_METADATA`` (v1 and v0
    composite) and ``_METADATA`` (a v0 pytree saved at the root).
    """
    path = pathlib.Path(path)
    return path.is_dir() and any((path / m).is_file() for m in _MARKERS)


def _flat(tree) -> dict[str, object]:
    """{'a/b/c': leaf} of a pytree."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(keys, simple=True, separator="/"): leaf for keys, leaf in leaves}


def _mismatches(saved: dict[str, object], wanted: dict[str, object], allow_dtype_cast: bool) -> list[str]:
    """Human-readable differences between the saved metadata leaves and the requested abstract leaves."""
    problems = [f"{k}: requested but not in the checkpoint" for k in wanted if k not in saved]
    problems += [f"{k}: in the checkpoint but not requested" for k in saved if k not in wanted]
    for key in wanted.keys() & saved.keys():
        want, have = wanted[key], saved[key]
        have_shape, have_dtype = tuple(getattr(have, "shape", ())), getattr(have, "dtype", None)
        dtype_differs = have_dtype is not None and want.dtype != have_dtype and not allow_dtype_cast
        if tuple(want.shape) != have_shape or dtype_differs:
            problems.append(f"{key}: requested {want.dtype}{list(want.shape)}, saved {have_dtype}{list(have_shape)}")
    return sorted(problems)


def restore_pytree(path: str | os.PathLike, abstract_tree, *, allow_dtype_cast: bool = False):
    """Restores the pytree saved at ``path`` onto the shardings of ``abstract_tree``.

    abstract_tree: the saved tree's structure with jax.ShapeDtypeStruct leaves carrying ``sharding=`` (any
    Sharding, e.g. a NamedSharding over a different mesh or partition than at save time). Shapes and dtypes must
    equal the saved ones, unless ``allow_dtype_cast`` (then orbax casts each leaf to the requested dtype while
    restoring, e.g. bfloat16 -> float32). Returns the tree of jax.Array placed on those shardings.
    """
    path = pathlib.Path(path).absolute()
    if not path.exists():
        raise CheckpointError(f"orbax checkpoint {path} does not exist")
    if not is_orbax_dir(path):
        raise CheckpointError(f"{path} is not an orbax checkpoint directory")
    wanted = _flat(abstract_tree)
    for key, leaf in wanted.items():
        if not isinstance(leaf, jax.ShapeDtypeStruct) or leaf.sharding is None:
            raise CheckpointError(f"abstract leaf {key!r} must be a jax.ShapeDtypeStruct with a sharding, got {leaf!r}")
    try:
        saved = _flat(ocp.metadata(path).metadata)
    except (ValueError, OSError) as e:
        raise CheckpointError(f"cannot read the metadata of orbax checkpoint {path}: {e}") from e
    problems = _mismatches(saved, wanted, allow_dtype_cast)
    if problems:
        more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise CheckpointError(
            f"orbax checkpoint {path} does not match the requested tree ({len(problems)} differences):\n  "
            + "\n  ".join(problems[:_MAX_LISTED]) + more)
    try:
        return ocp.load(path, abstract_tree)
    except ValueError as e:
        raise CheckpointError(f"cannot restore orbax checkpoint {path}: {e}") from e
