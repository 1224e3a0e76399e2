"""The mesh= argument: "DxE" strings, meshes/*.toml files, Mesh objects, and errors with the numbers."""

import pathlib

import jax
import pytest

from jaxinfer.parallel.mesh import make_mesh

MESHES = pathlib.Path(__file__).parent.parent / "meshes"


@pytest.mark.parametrize("spec, shape", [(None, (1, 8)), ("1x1", (1, 1)), ("2x4", (2, 4)), ("8x1", (8, 1))])
def test_mesh_from_string(spec, shape):
    mesh = make_mesh(spec)
    assert mesh.axis_names == ("data", "expert") and mesh.devices.shape == shape


@pytest.mark.parametrize("path", sorted(MESHES.glob("cpu-*.toml")), ids=lambda p: p.stem)
def test_cpu_mesh_files(path):
    d, e = (int(v) for v in path.stem.removeprefix("cpu-").split("x"))
    assert make_mesh(path).devices.shape == (d, e)
    assert make_mesh(str(path)).devices.shape == (d, e)


def test_mesh_object_passes_through():
    mesh = make_mesh("2x4")
    assert make_mesh(mesh) is mesh
    bad = jax.make_mesh((1, 8), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with pytest.raises(ValueError, match="axes"):
        make_mesh(bad)


@pytest.mark.parametrize("spec, message", [("4x4", "needs 16 devices, but only 8"), ("0x8", ">= 1"),
                                           ("2by4", "DxE"), ("missing.toml", "does not exist")])
def test_bad_mesh(spec, message):
    with pytest.raises(ValueError, match=message):
        make_mesh(spec)


def test_bad_toml(tmp_path):
    (tmp_path / "m.toml").write_text('name = "m"\ndata = 2\nexpert = "four"\n')
    with pytest.raises(ValueError, match="'expert' must be a positive integer"):
        make_mesh(tmp_path / "m.toml")
