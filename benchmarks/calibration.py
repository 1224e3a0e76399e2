"""What the offline cost-model calibrations share (moe_paths.py for the routed-expert paths, gemm_forms.py for the
dense product forms): a robust time per call, and per-unit prices fitted to measured times."""

from __future__ import annotations

import json
import pathlib
import statistics
import time


def median_seconds(fn, *arg_sets, budget_s: float = 0.3, least: int = 3, most: int = 15) -> float:
    """Median seconds of a call of fn after a warm-up, each call on the next of arg_sets in turn (several copies of
    the weights: read cold, as in a step over many layers): at least `least` calls, more while under budget_s."""
    import jax

    jax.block_until_ready(fn(*arg_sets[0]))
    samples = []
    while len(samples) < least or (sum(samples) < budget_s and len(samples) < most):
        args = arg_sets[len(samples) % len(arg_sets)]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def fit_prices(work: list[list[float]], seconds: list[float]) -> list[float]:
    """Seconds per unit of each work column: non-negative least squares of measured time on work, each point
    weighted by 1 / its time (relative error), columns scaled to unit size for the solver."""
    import numpy as np
    from scipy.optimize import nnls

    a, y = np.asarray(work, np.float64), np.asarray(seconds, np.float64)
    scale = np.maximum(np.abs(a).max(0), 1e-30)
    c, _ = nnls(a / scale / y[:, None], np.ones(len(y)), maxiter=10000)
    return [float(f"{v:.4g}") for v in c / scale]


def last_level_cache() -> int:
    """Bytes of this machine's last-level cache (Linux sysfs, cpu0's cache of the highest level; 0 where it does not
    say), which the routed experts' gather path's work counts (jaxinfer/models/moe_cost.py ``work``) and a
    calibrated entry records."""
    levels = {}
    for index in pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            size = (index / "size").read_text().strip()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
            levels[int((index / "level").read_text())] = int(size.rstrip("KMG")) * scale
        except (OSError, ValueError):
            continue
    return levels[max(levels)] if levels else 0


def machine() -> dict:
    """What measurements depend on besides the shapes: JAX's version, the backend, and on CPU its model and whether
    its bf16 products are native (platform.Platform.native_bf16). Saved with the measurements and named in the
    table entry's "source": a table fitted on one machine prices another's only as far as their rates agree."""
    import jax

    from jaxinfer import platform

    here = platform.current()
    try:
        cpuinfo = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    models = [line.partition(":")[2].strip() for line in cpuinfo.splitlines() if line.startswith("model name")]
    return dict(jax=jax.__version__, backend=here.name, native_bf16=here.native_bf16,
                cpu=models[0] if models else "unknown CPU", last_level_cache=last_level_cache())


def source(measured_on: dict) -> str:
    """A table entry's "source": when, with which JAX, on which CPU (``machine()``; measurements saved before it
    recorded the CPU name none)."""
    import datetime

    import jax

    cpu = ""
    if measured_on.get("backend", "cpu") == "cpu" and "cpu" in measured_on:
        kind = "native" if measured_on.get("native_bf16") else "no native"
        cpu = f", {measured_on['cpu']} ({kind} bf16 products)"
    return f"measured {datetime.date.today().isoformat()}, jax {measured_on.get('jax', jax.__version__)}{cpu}"


def save_measurements(path: str, measured_on: dict, points: list[dict]) -> None:
    """Writes a calibration's points with the machine they were measured on (``machine()``) as JSON."""
    pathlib.Path(path).write_text(json.dumps(dict(**measured_on, points=points), indent=1))


def load_measurements(path: str) -> tuple[list[dict], dict]:
    """(points, the machine they were measured on) from ``save_measurements``' file (older files: what they hold
    besides the points)."""
    saved = json.loads(pathlib.Path(path).read_text())
    return saved["points"], {k: v for k, v in saved.items() if k != "points"}


def regret_summary(chosen: list[float], fastest: list[float]) -> str:
    """How well a choice did on measured points: the chosen paths' (forms') summed time over the fastest's, and the
    mean / max of their ratios per point."""
    import numpy as np

    r = np.asarray(chosen) / np.asarray(fastest)
    return f"sum chosen / sum fastest {sum(chosen) / sum(fastest):.3f}, mean {r.mean():.3f}, max {r.max():.2f}"
