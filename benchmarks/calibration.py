"""What the offline cost-model calibrations share (moe_paths.py for the routed-expert paths, gemm_forms.py for the
dense product forms): a robust time per call, and per-unit prices fitted to measured times."""

from __future__ import annotations

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
