"""orbax save/restore of sharded pytrees: bit-exact onto the same, a replicated and a different sharding."""

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.checkpoint.errors import CheckpointError
from jaxinfer.checkpoint.orbax_io import is_orbax_dir, restore_pytree, save_pytree
from jaxinfer.checkpoint.safetensors_io import write_safetensors

# name: (shape, dtype, spec at save on 1x8, spec on 2x4 for the re-partitioned restore)
LEAVES = {
    "attn/w_f32": ((16, 64), np.float32, P(None, "expert"), P("expert", "data")),
    "attn/w_bf16": ((8, 32), ml_dtypes.bfloat16, P(None, "expert"), P("data", None)),
    "ids": ((64,), np.int32, P("expert"), P(("data", "expert"))),
    "moe/experts_fp8": ((8, 4, 16), ml_dtypes.float8_e4m3fn, P("expert"), P(None, "data", "expert")),
}


def mesh(data, expert):
    return jax.make_mesh((data, expert), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)


def nest(flat):
    """{'a/b': x} -> {'a': {'b': x}}."""
    out = {}
    for key, value in flat.items():
        *parents, leaf = key.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def host_values():
    """Random bit patterns (NaN payloads included) so restores are compared bit for bit."""
    rng = np.random.default_rng(0)
    out = {}
    for key, (shape, dtype, _, _) in LEAVES.items():
        itemsize = np.dtype(dtype).itemsize
        out[key] = rng.integers(0, 256, (*shape, itemsize), dtype=np.uint8).view(dtype).reshape(shape)
    return out


def abstract(spec_index, m):
    return nest({k: jax.ShapeDtypeStruct(v[0], v[1], sharding=NamedSharding(m, v[spec_index] if spec_index else P()))
                 for k, v in LEAVES.items()})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    m = mesh(1, 8)
    values = host_values()
    tree = nest({k: jax.device_put(values[k], NamedSharding(m, LEAVES[k][2])) for k in LEAVES})
    path = tmp_path_factory.mktemp("orbax") / "ckpt"
    save_pytree(path, tree)
    return path, nest(values)


def assert_restored(restored, expected, abstract_tree):
    for got, want, spec in zip(jax.tree.leaves(restored), jax.tree.leaves(expected), jax.tree.leaves(abstract_tree)):
        assert isinstance(got, jax.Array) and got.sharding == spec.sharding
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.asarray(got).tobytes() == want.tobytes()


@pytest.mark.parametrize("target", ["same", "replicated", "2x4"])
def test_restore_bit_exact(saved, target):
    path, expected = saved
    abstract_tree = {"same": lambda: abstract(2, mesh(1, 8)), "replicated": lambda: abstract(None, mesh(1, 8)),
                     "2x4": lambda: abstract(3, mesh(2, 4))}[target]()
    assert_restored(restore_pytree(path, abstract_tree), expected, abstract_tree)


def test_restore_with_dtype_cast(saved):
    path, expected = saved
    tree = abstract(2, mesh(1, 8))
    tree["attn"]["w_bf16"] = jax.ShapeDtypeStruct((8, 32), np.float32, sharding=tree["attn"]["w_bf16"].sharding)
    restored = restore_pytree(path, tree, allow_dtype_cast=True)
    got, want = np.asarray(restored["attn"]["w_bf16"]), expected["attn"]["w_bf16"].astype(np.float32)
    assert got.dtype == np.float32 and np.array_equal(got, want, equal_nan=True)  # bf16 -> f32 is exact


def test_is_orbax_dir(saved, tmp_path):
    path, _ = saved
    write_safetensors(tmp_path / "model.safetensors", {"w": np.zeros(2, np.float32)})
    assert is_orbax_dir(path)
    assert not is_orbax_dir(tmp_path)  # an HF-style directory
    assert not is_orbax_dir(tmp_path / "model.safetensors")
    assert not is_orbax_dir(tmp_path / "missing")


def test_errors(saved, tmp_path):
    path, _ = saved
    m = mesh(1, 8)
    with pytest.raises(CheckpointError, match=r"missing does not exist"):
        restore_pytree(tmp_path / "missing", abstract(2, m))
    with pytest.raises(CheckpointError, match=r"is not an orbax checkpoint"):
        restore_pytree(tmp_path, abstract(2, m))
    with pytest.raises(CheckpointError, match=r"already exists"):
        save_pytree(path, {"x": jax.numpy.zeros(2)})

    tree = abstract(2, m)
    del tree["ids"]
    tree["attn"]["extra"] = tree["attn"]["w_f32"]
    with pytest.raises(CheckpointError, match=r"(?s)2 differences.*attn/extra: requested but not in the checkpoint"
                                              r".*ids: in the checkpoint but not requested"):
        restore_pytree(path, tree)

    tree = abstract(2, m)
    tree["attn"]["w_f32"] = jax.ShapeDtypeStruct((16, 64), np.float16, sharding=NamedSharding(m, P()))
    with pytest.raises(CheckpointError, match=r"attn/w_f32: requested float16\[16, 64\], saved float32\[16, 64\]"):
        restore_pytree(path, tree)

    tree = abstract(2, m)
    tree["ids"] = jax.ShapeDtypeStruct((64,), np.int32)
    with pytest.raises(CheckpointError, match=r"abstract leaf 'ids' must be a jax.ShapeDtypeStruct with a sharding"):
        restore_pytree(path, tree)
