"""Accelerators a deployment is planned on: peak rates, memory and links per GPU (presets and TOML files).

Figures are dense (no structured sparsity) per-GPU peaks from the vendors' datasheets; link bandwidths are per GPU
and per direction. Sources: NVIDIA H100/H800 SXM5 datasheets (H800: the H100 with NVLink cut to 400 GB/s, both
directions together), the H200 SXM datasheet, the DGX/HGX B200 datasheet (8 GPUs: 1,440 GB and 64 TB/s of HBM3e,
NVLink 5 at 1.8 TB/s per GPU), the GB200 NVL72 datasheet (72 GPUs: 720 / 360 PFLOPS FP8 / BF16 with sparsity,
13.4 TB and 576 TB/s of HBM3e, 130 TB/s of NVLink); scale-out: one ConnectX-7 400 Gb/s NIC per GPU (DeepSeek's H800
nodes, DeepEP's test machines, DGX H100/B200). Achieved fractions of these peaks live in calibration.py, not here;
a ``measured`` description (the "cpu" preset) holds achieved rates, to which no calibration applies.
"""

from __future__ import annotations

import dataclasses
import pathlib
import tomllib

TERA, GIGA = 1e12, 1e9


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One GPU of a node. Units as a TOML file writes them: TFLOP/s, GB (1e9 bytes), GB/s per direction."""

    name: str
    bf16_tflops: float
    fp8_tflops: float
    hbm_gb: float
    hbm_gb_s: float
    nvlink_gb_s: float      # to the other GPUs of its node, per direction
    net_gb_s: float         # scale-out (RDMA) per GPU, per direction
    sms: int
    gpus_per_node: int = 8
    measured: bool = False  # rates that programs reach (measured), not peaks: no calibration applies

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "measured":
                if not isinstance(value, bool):
                    raise ValueError(f"hardware {self.name!r}: measured must be true or false, got {value!r}")
            elif field.name != "name" and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"hardware {self.name!r}: {field.name} must be a positive number, got {value!r}")

    # SI rates for the model's arithmetic
    @property
    def bf16_flops(self) -> float:
        return self.bf16_tflops * TERA

    @property
    def fp8_flops(self) -> float:
        return self.fp8_tflops * TERA

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gb * GIGA

    @property
    def hbm_bw(self) -> float:
        return self.hbm_gb_s * GIGA

    @property
    def nvlink_bw(self) -> float:
        return self.nvlink_gb_s * GIGA

    @property
    def net_bw(self) -> float:
        return self.net_gb_s * GIGA


PRESETS = {
    "h800": Hardware("h800", bf16_tflops=989.4, fp8_tflops=1978.9, hbm_gb=80, hbm_gb_s=3350, nvlink_gb_s=200,
                     net_gb_s=50, sms=132),
    "h100": Hardware("h100", bf16_tflops=989.4, fp8_tflops=1978.9, hbm_gb=80, hbm_gb_s=3350, nvlink_gb_s=450,
                     net_gb_s=50, sms=132),
    "h200": Hardware("h200", bf16_tflops=989.4, fp8_tflops=1978.9, hbm_gb=141, hbm_gb_s=4800, nvlink_gb_s=450,
                     net_gb_s=50, sms=132),
    "b200": Hardware("b200", bf16_tflops=2250, fp8_tflops=4500, hbm_gb=180, hbm_gb_s=8000, nvlink_gb_s=900,
                     net_gb_s=50, sms=148),
    # One GPU of a GB200 NVL72 rack: 72 GPUs in one NVLink domain (its "node" here, so that expert parallelism
    # up to 72 stays on NVLink).
    "gb200": Hardware("gb200", bf16_tflops=2500, fp8_tflops=5000, hbm_gb=186, hbm_gb_s=8000, nvlink_gb_s=900,
                      net_gb_s=50, sms=148, gpus_per_node=72),
    # This project's development machine (2 cores, 24 GB) as jaxinfer's programs reach it: a bf16 [2048, 2048]
    # matmul and a one-row product over 512 MB (benchmarks/plan_cpu.py, 2026-12-05; no FP8 units: the bf16 rate).
    # Its simulated devices (XLA_FLAGS=--xla_force_host_platform_device_count) share it and exchange through
    # memory: give each 1 / devices of these rates, as benchmarks/plan_cpu.py does (docs/plan.md "The CPU check").
    "cpu": Hardware("cpu", bf16_tflops=0.1966, fp8_tflops=0.1966, hbm_gb=24, hbm_gb_s=32.5, nvlink_gb_s=32.5,
                    net_gb_s=32.5, sms=2, gpus_per_node=8, measured=True),
}


def hardware(spec: str | pathlib.Path | Hardware) -> Hardware:
    """A preset name (``PRESETS``), a TOML file with the fields of ``Hardware`` (``name`` defaults to the file's
    stem), or a Hardware. Raises ValueError naming what is wrong."""
    if isinstance(spec, Hardware):
        return spec
    key = str(spec).lower()
    if key in PRESETS:
        return PRESETS[key]
    path = pathlib.Path(spec)
    if path.suffix != ".toml":
        raise ValueError(f"hardware {str(spec)!r}: not a preset ({', '.join(PRESETS)}) nor a .toml file")
    try:
        table = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"hardware file {path}: {e}") from None
    fields = {f.name for f in dataclasses.fields(Hardware)}
    unknown = sorted(set(table) - fields)
    missing = sorted(fields - set(table) - {"name", "gpus_per_node", "measured"})
    if unknown or missing:
        raise ValueError(f"hardware file {path}: " + "; ".join(
            ([f"unknown fields {unknown}"] if unknown else []) + ([f"missing fields {missing}"] if missing else [])))
    return Hardware(**{"name": path.stem, **table})
