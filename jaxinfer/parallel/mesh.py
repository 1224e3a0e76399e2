"""Mesh construction from the ``mesh=`` argument: None, "DxE", a ``meshes/*.toml`` path, or a Mesh.

Axes are ``('data', 'expert')``; device (d, e) is DP rank d*E + e (docs/architecture.md "Mesh semantics").
Devices are taken in (process_index, id) order, so in a multi-process run each process's local devices are
consecutive DP ranks (process p of P, each with L devices, holds DP ranks p*L ... p*L + L - 1). JAX is imported
where a mesh is built, so reading mesh files (``jaxinfer sweep``'s parent process) starts no backend.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import tomllib
from typing import TYPE_CHECKING, Union

import numpy as np

if TYPE_CHECKING:
    from jax.sharding import Mesh

AXES = ("data", "expert")
PLATFORMS = ("cpu", "gpu")
MESH_FILE_KEYS = ("name", "platform", "data", "expert", "num_processes", "notes")
_GPU_NAMES = ("cuda", "rocm")  # jax reports "gpu" for both; map them too, in case a backend reports its own name
MeshSpec = Union[None, str, pathlib.Path, "Mesh"]


@dataclasses.dataclass(frozen=True)
class MeshFile:
    """A ``meshes/*.toml`` description. platform None: any platform (the key is optional)."""

    name: str
    data: int
    expert: int
    num_processes: int = 1
    platform: str | None = None
    notes: str = ""

    @property
    def shape(self) -> tuple[int, int]:
        return self.data, self.expert


def _positive_int(path: pathlib.Path, spec: dict, key: str, default: int | None = None) -> int:
    value = spec.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"mesh file {path}: {key!r} must be a positive integer, got {spec.get(key)!r}")
    return value


def _string(path: pathlib.Path, spec: dict, key: str, default: str | None) -> str | None:
    value = spec.get(key, default)
    if value is not default and not isinstance(value, str):
        raise ValueError(f"mesh file {path}: {key!r} must be a string, got {value!r}")
    return value


def read_mesh_file(path) -> MeshFile:
    """Parses and validates a mesh description (keys: name, platform, data, expert, num_processes, notes).

    Only reads the file: no devices are needed, so GPU descriptions can be checked anywhere."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"mesh file {path} does not exist")
    try:
        spec = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"mesh file {path} is not valid TOML: {e}") from None
    unknown = sorted(set(spec) - set(MESH_FILE_KEYS))
    if unknown:
        raise ValueError(f"mesh file {path}: unknown key {unknown[0]!r} (known keys: {', '.join(MESH_FILE_KEYS)})")
    platform = _string(path, spec, "platform", None)
    if platform is not None and platform not in PLATFORMS:
        raise ValueError(f"mesh file {path}: 'platform' must be one of {PLATFORMS}, got {platform!r}")
    return MeshFile(name=_string(path, spec, "name", path.stem), data=_positive_int(path, spec, "data"),
                    expert=_positive_int(path, spec, "expert"),
                    num_processes=_positive_int(path, spec, "num_processes", 1), platform=platform,
                    notes=_string(path, spec, "notes", ""))


def check_mesh_file(mesh_file: MeshFile, platform: str, num_processes: int) -> None:
    """Raises ValueError when the description was written for another platform or process count than this run's."""
    if mesh_file.platform is not None and mesh_file.platform != platform:
        raise ValueError(f"mesh {mesh_file.name!r} is for platform {mesh_file.platform!r}, but this run's devices "
                         f"are {platform!r}")
    if mesh_file.num_processes != num_processes:
        raise ValueError(f"mesh {mesh_file.name!r} needs num_processes = {mesh_file.num_processes}, but this run has "
                         f"{num_processes} process(es) (jax.process_count(); multi-process: --coordinator, "
                         "--num-processes, --process-id)")


def _is_toml(spec: MeshSpec) -> bool:
    return isinstance(spec, (str, pathlib.Path)) and str(spec).endswith(".toml")


def mesh_shape(spec: MeshSpec, num_devices: int) -> tuple[int, int]:
    """(data, expert) sizes named by a mesh spec; None means all devices as 1xN."""
    if spec is None:
        return 1, num_devices
    if isinstance(spec, str) and re.fullmatch(r"\d+x\d+", spec):
        d, e = (int(v) for v in spec.split("x"))
        if d < 1 or e < 1:
            raise ValueError(f"mesh {spec!r}: both sizes must be >= 1")
        return d, e
    if _is_toml(spec):
        return read_mesh_file(spec).shape
    raise ValueError(f"mesh must be None, 'DxE' (e.g. '2x4'), a .toml path or a jax.sharding.Mesh; got {spec!r}")


def ordered_devices(devices=None) -> list:
    """Devices in DP-rank order: sorted by (process_index, id), so each process's local devices are contiguous."""
    import jax

    devices = jax.devices() if devices is None else devices
    return sorted(devices, key=lambda d: (d.process_index, d.id))


def make_mesh(spec: MeshSpec = None, devices=None) -> Mesh:
    """Builds the ('data', 'expert') mesh over ``devices`` (default: all devices of all processes).

    Raises ValueError when it does not fit the devices, when a mesh file names another platform or process count
    than this run's, or when a multi-process mesh over the default devices leaves some out (every process runs
    the same program, so every process must hold part of the mesh; pass ``devices`` to build a sub-mesh).
    """
    import jax
    from jax.sharding import AxisType, Mesh

    if isinstance(spec, Mesh):
        if tuple(spec.axis_names) != AXES:
            raise ValueError(f"mesh axes must be {AXES}, got {tuple(spec.axis_names)}")
        return spec
    use_all = devices is None
    devices = ordered_devices(devices)
    if _is_toml(spec):
        mesh_file = read_mesh_file(spec)
        platform = "gpu" if devices[0].platform in _GPU_NAMES else devices[0].platform
        check_mesh_file(mesh_file, platform, jax.process_count())
        d, e = mesh_file.shape
    else:
        d, e = mesh_shape(spec, len(devices))
    if d * e > len(devices):
        raise ValueError(f"mesh {d}x{e} needs {d * e} devices, but only {len(devices)} are available "
                         "(CPU: set --cpu-devices / XLA_FLAGS=--xla_force_host_platform_device_count)")
    if use_all and jax.process_count() > 1 and d * e != len(devices):
        raise ValueError(f"mesh {d}x{e} uses {d * e} of the {len(devices)} devices of this {jax.process_count()}-"
                         "process run; a multi-process mesh must use them all")
    grid = np.array(devices[: d * e]).reshape(d, e)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 2)
