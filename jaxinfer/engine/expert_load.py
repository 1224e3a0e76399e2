"""Expert load over a sliding window of engine steps, kept on device (the input of EPLB, jaxinfer/rebalance.py).

Every step returns its per-DP-rank expert counts (int32 [ranks, moe layers, experts], padding excluded;
DeepseekForCausalLM.paged_hidden_states). The window adds them on device to a running total over the last
``window`` steps and subtracts, in the same step, the counts of step n - window (kept as device arrays): no host
transfer and no cross-device reduction per step. ``read`` sums the ranks when the total is read.
"""

from __future__ import annotations

import collections

import jax
import numpy as np

from jaxinfer.parallel.multihost import global_array, to_host


class ExpertLoadWindow:
    """Running expert-load total over the last ``window`` steps (a multi-step decode step is one)."""

    def __init__(self, shape: tuple[int, int, int], sharding, window: int):
        self.window = window
        self._sharding = sharding
        self._zero = global_array(np.zeros(shape, np.int32), sharding)  # subtracted while the window fills up
        self.total = global_array(np.zeros(shape, np.int32), sharding)  # [ranks, L, E]
        self._steps: collections.deque = collections.deque()           # per-step counts, oldest first

    @property
    def shape(self) -> tuple[int, ...]:
        return self.total.shape

    def evicted(self) -> jax.Array:
        """The counts the next step subtracts: those of the step leaving the window (zeros while it fills)."""
        return self._steps.popleft() if len(self._steps) >= self.window else self._zero

    def push(self, total: jax.Array, load: jax.Array) -> None:
        """The next step's new running total and its own counts."""
        if not total.size:  # no MoE layer: XLA gives empty outputs no sharding, and compiled steps want theirs
            total, load = jax.device_put((total, load), self._sharding)
        self.total = total
        self._steps.append(load)

    def read(self) -> np.ndarray:
        """np.int64 [moe layers, experts]: (token, choice) pairs routed to each logical expert over the window,
        real tokens only, summed over DP ranks (waits for the dispatched steps)."""
        return to_host(self.total).astype(np.int64).sum(0)
