"""Pearson's chi-square goodness-of-fit with small cells pooled: the statistical oracle of the sampling tests
(engine/test_rejection_sampler.py, engine/test_speculative_sampling.py)."""

from __future__ import annotations

import math

import numpy as np
import scipy.stats


def chi_square_pvalue(counts, probs, min_expected: float = 5.0) -> tuple[float, float, int]:
    """Pearson's goodness-of-fit of integer counts [n] against probabilities [n]: (p-value, statistic, df).

    A count in a cell of probability 0 gives p = 0. Cells of expected count < min_expected are pooled (with the
    smallest other cell too while the pool stays below it)."""
    counts = np.asarray(counts, np.float64).ravel()
    probs = np.asarray(probs, np.float64).ravel()
    probs = probs / probs.sum()
    n = counts.sum()
    if counts[probs == 0].sum() > 0:
        return 0.0, math.inf, -1
    expected, observed = n * probs[probs > 0], counts[probs > 0]
    order = np.argsort(expected, kind="stable")
    expected, observed = list(expected[order]), list(observed[order])
    pool_e = pool_o = 0.0
    while expected and (expected[0] < min_expected or pool_e < min_expected and pool_e > 0):
        pool_e += expected.pop(0)
        pool_o += observed.pop(0)
    if pool_e > 0:
        expected.append(pool_e)
        observed.append(pool_o)
    df = len(expected) - 1
    if df < 1:
        return 1.0, 0.0, 0
    e, o = np.array(expected), np.array(observed)
    stat = float(((o - e) ** 2 / e).sum())
    return float(scipy.stats.chi2.sf(stat, df)), stat, df
