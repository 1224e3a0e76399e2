"""Mesh construction from the ``mesh=`` argument: None, "DxE", a ``meshes/*.toml`` path, or a Mesh.

Axes are ``('data', 'expert')``; device (d, e) is DP rank d*E + e (DESIGN.md "Mesh semantics").
"""

from __future__ import annotations

import pathlib
import re
import tomllib
from typing import Union

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "expert")
MeshSpec = Union[None, str, pathlib.Path, Mesh]


def _shape_from_toml(path: pathlib.Path) -> tuple[int, int]:
    if not path.is_file():
        raise ValueError(f"mesh file {path} does not exist")
    try:
        spec = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"mesh file {path} is not valid TOML: {e}") from None
    for key in ("data", "expert"):
        if not isinstance(spec.get(key), int) or spec[key] < 1:
            raise ValueError(f"mesh file {path}: {key!r} must be a positive integer, got {spec.get(key)!r}")
    return spec["data"], spec["expert"]


def mesh_shape(spec: MeshSpec, num_devices: int) -> tuple[int, int]:
    """(data, expert) sizes named by a mesh spec; None means all devices as 1xN."""
    if spec is None:
        return 1, num_devices
    if isinstance(spec, str) and re.fullmatch(r"\d+x\d+", spec):
        d, e = (int(v) for v in spec.split("x"))
        if d < 1 or e < 1:
            raise ValueError(f"mesh {spec!r}: both sizes must be >= 1")
        return d, e
    if isinstance(spec, (str, pathlib.Path)) and str(spec).endswith(".toml"):
        return _shape_from_toml(pathlib.Path(spec))
    raise ValueError(f"mesh must be None, 'DxE' (e.g. '2x4'), a .toml path or a jax.sharding.Mesh; got {spec!r}")


def make_mesh(spec: MeshSpec = None, devices=None) -> Mesh:
    """Builds the ('data', 'expert') mesh. Raises ValueError when it does not fit the devices."""
    if isinstance(spec, Mesh):
        if tuple(spec.axis_names) != AXES:
            raise ValueError(f"mesh axes must be {AXES}, got {tuple(spec.axis_names)}")
        return spec
    devices = list(jax.devices() if devices is None else devices)
    d, e = mesh_shape(spec, len(devices))
    if d * e > len(devices):
        raise ValueError(f"mesh {d}x{e} needs {d * e} devices, but only {len(devices)} are available "
                         "(CPU: set --cpu-devices / XLA_FLAGS=--xla_force_host_platform_device_count)")
    grid = np.array(devices[: d * e]).reshape(d, e)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 2)
