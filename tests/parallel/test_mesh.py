"""The mesh= argument: "DxE" strings, meshes/*.toml files (GPU and multi-process ones parsed, not built), Mesh
objects, device order, and errors with the numbers."""

import pathlib
from unittest import mock

import jax
import pytest

from jaxinfer.parallel.mesh import MeshFile, make_mesh, ordered_devices, read_mesh_file

MESHES = pathlib.Path(__file__).resolve().parents[2] / "meshes"


@pytest.mark.parametrize("spec, shape", [(None, (1, 8)), ("1x1", (1, 1)), ("2x4", (2, 4)), ("8x1", (8, 1))])
def test_mesh_from_string(spec, shape):
    mesh = make_mesh(spec)
    assert mesh.axis_names == ("data", "expert") and mesh.devices.shape == shape


def _shape_in_name(path) -> tuple[int, int]:
    """"cpu-2x4" or "cpu-2proc-2x4" -> (2, 4)."""
    d, e = path.stem.rsplit("-", 1)[1].split("x")
    return int(d), int(e)


SINGLE_PROCESS_CPU = sorted(p for p in MESHES.glob("cpu-*.toml") if "proc" not in p.stem)


def test_shipped_mesh_files():
    names = {p.stem for p in MESHES.glob("*.toml")}
    assert {"cpu-1x1", "cpu-1x8", "cpu-2x4", "cpu-4x2", "cpu-8x1", "gpu-1x1", "gpu-1x8", "gpu-2x8"} <= names


@pytest.mark.parametrize("path", SINGLE_PROCESS_CPU, ids=lambda p: p.stem)
def test_cpu_mesh_files(path):
    shape = _shape_in_name(path)
    assert make_mesh(path).devices.shape == shape
    assert make_mesh(str(path)).devices.shape == shape


@pytest.mark.parametrize("path", sorted(MESHES.glob("*.toml")), ids=lambda p: p.stem)
def test_mesh_files_parse(path):
    """Every shipped description parses, GPU ones included (nothing is built, so no GPU is needed)."""
    spec = read_mesh_file(path)
    assert spec.name == path.stem and spec.shape == _shape_in_name(path) and spec.platform == path.stem[:3]
    assert spec.num_processes == {"cpu-2proc-2x4": 2, "gpu-2x8": 2}.get(path.stem, 1)


def test_gpu_mesh_files():
    assert read_mesh_file(MESHES / "gpu-1x8.toml") == MeshFile("gpu-1x8", 1, 8, 1, "gpu", mock.ANY)
    assert read_mesh_file(MESHES / "gpu-2x8.toml") == MeshFile("gpu-2x8", 2, 8, 2, "gpu", mock.ANY)
    # one process per 8-GPU host: the 16 DP ranks are host 0's GPUs, then host 1's


@pytest.mark.parametrize("name", ["gpu-1x1", "gpu-1x8", "gpu-2x8"])
def test_gpu_mesh_on_cpu_names_the_platform(name):
    with pytest.raises(ValueError, match=f"mesh '{name}' is for platform 'gpu', but this run's devices are 'cpu'"):
        make_mesh(MESHES / f"{name}.toml")


def test_num_processes_mismatch():
    with pytest.raises(ValueError, match=r"needs num_processes = 2, but this run has 1 process"):
        make_mesh(MESHES / "cpu-2proc-2x4.toml")


def test_platform_is_optional(tmp_path):
    (tmp_path / "m.toml").write_text("data = 2\nexpert = 2\n")
    assert read_mesh_file(tmp_path / "m.toml") == MeshFile("m", 2, 2, 1, None, "")
    assert make_mesh(tmp_path / "m.toml").devices.shape == (2, 2)


def test_devices_in_dp_rank_order():
    """Device (d, e) is DP rank d*E + e, in (process_index, id) order: each process's devices are contiguous."""
    mesh = make_mesh("2x4")
    flat = list(mesh.devices.flat)
    assert flat == ordered_devices(jax.devices())
    assert [(d.process_index, d.id) for d in flat] == sorted((d.process_index, d.id) for d in flat)
    assert ordered_devices(jax.devices()[::-1]) == ordered_devices()


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


@pytest.mark.parametrize("body, message", [
    ('name = "m"\ndata = 2\nexpert = "four"\n', "'expert' must be a positive integer, got 'four'"),
    ("data = 2\nexpert = 4\nexperts = 4\n", "unknown key 'experts' \\(known keys: name, platform, data, expert"),
    ('data = 2\nexpert = 4\nplatform = "tpu"\n', "'platform' must be one of \\('cpu', 'gpu'\\), got 'tpu'"),
    ("data = 2\nexpert = 4\nnum_processes = 0\n", "'num_processes' must be a positive integer, got 0"),
    ("data = 2\nexpert = 4\nnum_processes = true\n", "'num_processes' must be a positive integer, got True"),
    ("data = 2\nexpert = 4\nnotes = 3\n", "'notes' must be a string, got 3"),
    ("data = 2\nexpert = [4]\n", "'expert' must be a positive integer"),
    ("data = 2\nexpert = \n", "not valid TOML"),
])
def test_bad_toml(tmp_path, body, message):
    (tmp_path / "m.toml").write_text(body)
    with pytest.raises(ValueError, match=message):
        make_mesh(tmp_path / "m.toml")
