"""jaxinfer's orbax form of a whole model: save -> load_model restores the same bits, also onto another mesh."""

import jax
import numpy as np
import pytest
from flax import nnx

import jaxinfer
from jaxinfer.checkpoint import CheckpointError
from jaxinfer.checkpoint.tree import flatten_tree


def _leaves(model):
    return {p: np.asarray(jax.device_get(v)) for p, v in flatten_tree(nnx.to_pure_dict(model.state))}


@pytest.mark.parametrize("dtype, save_mesh, load_mesh", [("float32", "1x8", "2x4"), ("bfloat16", "1x1", "4x2")])
def test_orbax_round_trip_bit_exact(tmp_path, dtype, save_mesh, load_mesh):
    config = jaxinfer.ModelConfig.tiny(num_hidden_layers=2)
    model = jaxinfer.Model.random(config, mesh=save_mesh, dtype=dtype, seed=1)
    model.save(tmp_path / "ckpt")
    restored = jaxinfer.load_model(tmp_path / "ckpt", mesh=load_mesh, dtype=dtype)
    assert restored.config == config
    assert restored.has_mtp and restored.mesh.devices.shape == tuple(int(s) for s in load_mesh.split("x"))
    before, after = _leaves(model), _leaves(restored)
    assert before.keys() == after.keys()
    for path in before:
        assert before[path].dtype == after[path].dtype, path
        np.testing.assert_array_equal(before[path].view(np.uint8), after[path].view(np.uint8), err_msg=str(path))
    leaf = next(iter(jax.tree.leaves(restored.state)))
    assert leaf.sharding.mesh.devices.shape == restored.mesh.devices.shape
    ids = np.arange(12).reshape(2, 6) % config.vocab_size
    ref = model.logits(ids)
    # Restored onto the mesh it was saved from: the same program on the same bits, so bit-equal logits.
    same_mesh = jaxinfer.load_model(tmp_path / "ckpt", mesh=save_mesh, dtype=dtype)
    np.testing.assert_array_equal(ref, same_mesh.logits(ids))
    # On another mesh each device holds other row counts, and the routed experts' compute path is chosen by
    # shape (models/moe.py moe_path): equal up to float rounding.
    err = np.abs(restored.logits(ids) - ref).max() / np.abs(ref).max()
    assert err <= (1e-5 if dtype == "float32" else 2e-2), err


def test_save_refuses_non_empty_dir(tmp_path):
    model = jaxinfer.Model.random(jaxinfer.ModelConfig.tiny(num_hidden_layers=1), mesh="1x1")
    (tmp_path / "x").write_text("keep me")
    with pytest.raises(CheckpointError, match="not empty"):
        model.save(tmp_path)
    assert (tmp_path / "x").read_text() == "keep me"
