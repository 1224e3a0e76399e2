"""Which compute path the routed experts of a step take (models/moe.py ``expert_ffn``): the cheapest by a cost
model of the step's shape.

Each path's work is counted from the static shape (``work``): its weight-matrix products ("matrices": each has a
fixed cost, a library call on XLA:CPU, a kernel launch on a GPU), the weight bytes it reads from memory (a table
entry records the last-level cache of the machine it was measured on, ``cache_bytes``), its flops, and the
activation bytes its buffers move. A path's cost on a backend and compute dtype is that work priced by the path's
own seconds per unit of work (``coefficients``), fitted offline by non-negative least squares on measurements over
a grid of expert shapes and row counts (``python benchmarks/moe_paths.py --calibrate`` rewrites moe_costs.json;
docs/benchmarks.md "Routed-expert paths (CPU)"). The choice is a pure function of (rows, top_k, slots, hidden,
moe_intermediate, weight bytes, dtype, backend): no start-up timing, so every process and every rank of a mesh
picks the same path for the same step, and a test can name the path a shape gets.

The capacity path picks its bucket per step from the routing, by the same prices (``capacity_plan``: each bucket's
batched products plus the assignments past it, computed one by one at the gather path's prices); it is priced by the
bucket of least expected cost, and the grouped path by its expected chunks, under a routing scenario (a slot's count
Binomial(rows, top_k x its popularity share)). Tokens of different sequences are routed about independently: their
steps (decode) are priced under balanced routing, what EPLB aims at and what the calibration measures. Tokens of one
sequence share experts: steps with several tokens per sequence (prefill chunks) are priced by the mean cost over
balanced routing and a skewed scenario (ROUTING_SKEWS). A backend or dtype without measurements is priced by the
nominal figures the table gives for it (its "source" says which).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib

import numpy as np

from jaxinfer.models.grouped_matmul import chunk_sizes, ladder_counts
from jaxinfer.parallel.plan import MOE_PATHS

PATHS = MOE_PATHS  # ("gather", "dense", "capacity", "grouped", "ragged")
FEATURES = ("matrices", "weight_bytes", "flops", "moved_bytes", "calls")
TABLE = pathlib.Path(__file__).with_name("moe_costs.json")

CAPACITY_FACTORS = (1.25, 1.6, 2.5, 4.0)  # "capacity" buckets in units of the balanced load
# Routing scenarios of steps with several tokens per sequence (mean predicted time): balanced, and slot popularity
# ~ rank^-0.5. One 64-token prompt's busiest expert carried 2.4-4.5x the mean load on the grid's random models
# (1.3-2.1x for 32 prompts); rank^-0.5 puts 4.6x on the busiest of 64 slots at top-8. Balanced pricing alone picked
# the capacity path for V2-Lite's 64-token prefill, whose busiest slot then overflowed every bucket but the last
# (all rows): 1124 ms for the step vs 736 ms on the grouped path. Applied to decode steps too, it sent V2-Lite's
# 32-sequence decode to the gather path: 578 vs 354 ms per token (docs/benchmarks.md "Routed-expert paths (CPU)").
ROUTING_SKEWS = (0.0, 0.5)


@dataclasses.dataclass(frozen=True)
class ExpertShape:
    """One call of expert_ffn: rows tokens [M, D] with top_k assignments each over num_slots local slots of
    experts [I, D] (gate, up) and [D, I] (down) whose weights take weight_itemsize bytes per element."""

    rows: int
    top_k: int
    num_slots: int
    hidden: int
    inter: int
    weight_itemsize: int = 4
    skew: float = 0.0  # routing: slot j's popularity ~ (j + 1) ** -skew (0: balanced)

    @property
    def assignments(self) -> int:
        return self.rows * self.top_k

    @property
    def expert_elements(self) -> int:  # the three matrices of one expert
        return 3 * self.hidden * self.inter


def capacity_buckets(rows: int, top_k: int, num_slots: int) -> tuple[int, ...]:
    """Static capacities of the "capacity" path: CAPACITY_FACTORS times the balanced load per slot (rows * top_k /
    num_slots; EPLB keeps real loads near it), rounded up to multiples of 8 (below 8: to powers of two), and
    ``rows`` itself, which always fits (a slot holds each token at most once: a token's top-k experts are distinct,
    and so are their physical slots). Which bucket a step takes is capacity_plan's: with the assignments past it
    computed one by one, a bucket near the balanced load usually wins (V2-Lite's 32-row decode, 3 per slot
    balanced: 4 rows per slot 78 ms against 8 rows 85; docs/benchmarks.md "Routed-expert paths (CPU)"). Five
    branches compile in about the time of the grouped path; more branches cost more compile time."""
    balanced = rows * top_k / num_slots

    def round_up(c: int) -> int:
        return 1 << (c - 1).bit_length() if c <= 8 else -(-c // 8) * 8

    caps = {min(rows, round_up(math.ceil(f * balanced))) for f in CAPACITY_FACTORS}
    return tuple(sorted(caps | {rows}))


def _slot_count_pmfs(shape: ExpertShape) -> np.ndarray:
    """[slots, rows + 1]: P(slot j holds c assignments), Binomial(rows, p_j) with p_j = top_k x slot j's share of
    the popularity (capped at 1: a token picks a slot at most once); balanced routing: p_j = top_k / slots."""
    n = shape.rows
    popularity = np.arange(1, shape.num_slots + 1, dtype=np.float64) ** -shape.skew
    c = np.arange(n + 1)
    log_fact = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, n + 1)))])  # log(c!) for c in [0, rows]
    pmfs = []
    for p in np.minimum(shape.top_k * popularity / popularity.sum(), 1.0):
        if p >= 1.0:
            pmfs.append((c == n).astype(np.float64))
            continue
        pmf = np.exp(log_fact[n] - log_fact - log_fact[::-1] + c * math.log(p) + (n - c) * math.log1p(-p))
        pmfs.append(pmf / pmf.sum())
    return np.stack(pmfs)


def expected_overflow(shape: ExpertShape) -> np.ndarray:
    """[buckets]: for each of capacity_buckets, the expected assignments past it, sum_j E[max(count_j - C, 0)]
    (the capacity path computes them one by one: models/moe.py _capacity_ffn)."""
    total = _slot_count_pmfs(shape).sum(0)  # [rows + 1]: expected slots holding c assignments
    c = np.arange(total.shape[0])
    return np.asarray([total @ np.maximum(c - b, 0) for b in capacity_buckets(shape.rows, shape.top_k,
                                                                                shape.num_slots)])


def _batched_work(shape: ExpertShape, capacity: float) -> dict[str, float]:
    """The capacity path's batched products over [S, C, D] buffers, C = ``capacity``."""
    s, e, wb = shape.num_slots, shape.expert_elements, shape.weight_itemsize
    return dict(matrices=3 * s, weight_bytes=s * e * wb, flops=2 * s * capacity * e,
                moved_bytes=s * capacity * (shape.inter + shape.hidden) * 4, calls=1)


def _assignment_work(shape: ExpertShape) -> dict[str, float]:
    """One assignment computed on its own (the gather path's matvecs), its slot's weights read from memory."""
    e, wb = shape.expert_elements, shape.weight_itemsize
    return dict(matrices=3, weight_bytes=e * wb, flops=2 * e, moved_bytes=shape.hidden * 4, calls=0)


def _cost(work_: dict[str, float], prices: dict[str, float]) -> float:
    return sum(prices[f] * v for f, v in work_.items())


def capacity_plan(shape: ExpertShape,
                  prices: dict[str, dict[str, float]]) -> tuple[tuple[int, ...], tuple[float, ...], float]:
    """What the capacity path weighs when it picks its bucket from a step's routing: (capacity_buckets, seconds of
    each bucket's batched products at the capacity path's prices, seconds of one assignment past the bucket at the
    gather path's, which computes it). The path takes the bucket of least seconds + its overflow x that: a bucket
    that leaves a few assignments of the busiest slots to one-by-one products can beat one that holds them all
    (h1024_e64k8's 32-row decode: 8 rows per slot and ~2 assignments past them, 21 ms per layer, vs 16 rows per
    slot, 30 ms; docs/benchmarks.md "Routed-expert paths (CPU)")."""
    buckets = capacity_buckets(shape.rows, shape.top_k, shape.num_slots)
    batched = tuple(_cost(_batched_work(shape, c), prices["capacity"]) for c in buckets)
    return buckets, batched, _cost(_assignment_work(shape), prices["gather"])


def expected_capacity(shape: ExpertShape) -> float:
    """The capacity path's expected bucket with nothing past it (the bucket of its derivative, and of the
    measurements that price its batched products): the smallest of capacity_buckets holding the busiest slot count,
    the counts taken as independent (P(busiest <= c) = prod_j F_j(c)). The counts share a fixed total, so they are
    slightly negatively correlated and this overestimates a little: 5% with 256 balanced slots, 64 rows, top-8
    (tests/models/test_moe_cost.py draws the routing)."""
    cdf_max = np.prod(np.cumsum(_slot_count_pmfs(shape), axis=1), axis=0)  # [rows + 1]
    total, below = 0.0, 0.0
    for b in capacity_buckets(shape.rows, shape.top_k, shape.num_slots):
        at_most = float(cdf_max[min(b, shape.rows)])
        total += b * (at_most - below)
        below = at_most
    return total


def expected_slots_in_use(shape: ExpertShape, pmfs: np.ndarray | None = None) -> float:
    """Expected slots holding at least one assignment under the shape's routing scenario (pmfs: its
    _slot_count_pmfs, where the caller has them)."""
    pmfs = _slot_count_pmfs(shape) if pmfs is None else pmfs
    return float((1.0 - pmfs[:, 0]).sum())


def expected_chunks(shape: ExpertShape) -> tuple[float, float, float]:
    """The grouped path's (expected chunks, rows computed, slots in use) under the shape's routing scenario: each
    slot's count covered by grouped_matmul's ladder (ladder_counts), summed over the slots."""
    sizes = chunk_sizes(shape.rows)
    pmfs = _slot_count_pmfs(shape)  # [S, rows + 1]
    count = np.arange(pmfs.shape[1])
    per_size = ladder_counts(count, sizes)  # [rows + 1] chunks of each size per count
    chunks = float((pmfs @ sum(per_size)).sum())
    rows = float((pmfs @ sum(n * size for n, size in zip(per_size, sizes))).sum())
    return chunks, rows, expected_slots_in_use(shape, pmfs)


def work(path: str, shape: ExpertShape, backend: str, cache: int = 0) -> dict[str, float]:
    """The work of ``path`` on ``shape``, per FEATURES (what each path computes: models/moe.py expert_ffn).
    cache: bytes of the last-level cache of the machine the prices are for (its table entry's; 0: none counted)."""
    s, a, e, wb = shape.num_slots, shape.assignments, shape.expert_elements, shape.weight_itemsize
    d, i = shape.hidden, shape.inter
    if path == "gather":  # one matvec triple per assignment, on its slot's weights read in place, the assignments
        # in slot order: a slot's weights come from memory once per call where they fit in the last-level cache
        # (its later assignments read them from there), once per assignment where they do not (V2-Lite's 34.6 MB
        # float32 experts against h1024_e64k8's 6.3 MB: docs/benchmarks.md "Routed-expert paths (CPU)")
        reads = expected_slots_in_use(shape) if e * wb <= cache else a
        return dict(matrices=3 * a, weight_bytes=reads * e * wb, flops=2 * a * e, moved_bytes=a * d * 4, calls=1)
    if path == "dense":  # every row through every slot
        return dict(matrices=3, weight_bytes=s * e * wb, flops=2 * shape.rows * s * e,
                    moved_bytes=shape.rows * s * (i + d) * 4, calls=1)
    if path == "capacity":  # [S, C, D] buffers, C the bucket of the busiest slot: the batched products as the
        # calibration times them (moe_paths.py), with nothing past the bucket; ``price`` adds the overflow
        return _batched_work(shape, expected_capacity(shape))
    if path == "grouped":  # a loop over the slots in use (their weights copied once), each slot's rows in chunks
        chunks, rows, slots = expected_chunks(shape)
        return dict(matrices=3 * chunks, weight_bytes=slots * e * wb, flops=2 * rows * e,
                    moved_bytes=rows * (i + d) * 4, calls=1)
    if path == "ragged":  # lax.ragged_dot over the sorted assignments. XLA's ragged-dot expander computes every
        # row against every group: measured on XLA:CPU (docs/architecture.md "Platform facts"), assumed on XLA:GPU
        # (unmeasured); TPUs have a grouped kernel
        rows_times_groups = a if backend == "tpu" else a * s
        return dict(matrices=3, weight_bytes=s * e * wb, flops=2 * rows_times_groups * e,
                    moved_bytes=a * (i + d) * 4, calls=1)
    raise ValueError(f"unknown routed-expert path {path!r}; known: {', '.join(PATHS)}")


@functools.cache
def _table() -> dict:
    return json.loads(TABLE.read_text())


def _entry(backend: str, dtype: str) -> dict:
    """The table entry for ``backend`` and compute ``dtype`` ("float32", "bfloat16"): the measured one, else the
    backend's nominal one (the table's "nominal" entries), else the CPU's; its float32 one for another dtype."""
    table = _table()["backends"]
    entry = table.get(backend, table["cpu"])
    return entry.get(dtype, entry.get("float32"))


def coefficients(backend: str, dtype: str) -> dict[str, dict[str, float]]:
    """path -> feature -> seconds per unit, for ``backend`` and compute ``dtype`` (``_entry``)."""
    return _entry(backend, dtype)["paths"]


def cache_bytes(backend: str, dtype: str) -> int:
    """The last-level cache the entry of ``backend`` and ``dtype`` was measured with (0: not recorded)."""
    return int(_entry(backend, dtype).get("cache_bytes", 0))


def price(path: str, shape: ExpertShape, backend: str, prices: dict[str, dict[str, float]],
          cache: int = 0) -> float:
    """Seconds of ``path`` on ``shape`` at ``prices`` (path -> feature -> seconds per unit). The capacity path:
    the least over its buckets of the batched products plus the expected assignments past the bucket
    (capacity_plan; the expected least cost is at most this, as the path picks per step). cache: as in ``work``."""
    if path == "capacity":
        _, batched, per_assignment = capacity_plan(shape, prices)
        return float(min(np.asarray(batched) + expected_overflow(shape) * per_assignment))
    return _cost(work(path, shape, backend, cache), prices[path])


def predict(path: str, shape: ExpertShape, dtype: str, backend: str) -> float:
    """Seconds the cost model gives ``path`` on ``shape``."""
    return price(path, shape, backend, coefficients(backend, dtype), cache_bytes(backend, dtype))


def cheapest(shape: ExpertShape, backend: str, prices: dict[str, dict[str, float]], sequence_tokens: int = 1,
             cache: int = 0) -> str:
    """The path of least cost at ``prices`` (ties: PATHS order) for ``shape`` whose rows come sequence_tokens at a
    time from one sequence (a step's T): under balanced routing for 1 (decode), the mean over ROUTING_SKEWS
    above. cache: as in ``work``."""
    skews = ROUTING_SKEWS if sequence_tokens > 1 else (0.0,)
    scenarios = [dataclasses.replace(shape, skew=skew) for skew in skews]
    return min(PATHS, key=lambda p: sum(price(p, s, backend, prices, cache) for s in scenarios))


@functools.cache
def choose(shape: ExpertShape, dtype: str, backend: str, sequence_tokens: int = 1) -> str:
    """``cheapest`` at the table's prices for ``backend`` and ``dtype``."""
    return cheapest(shape, backend, coefficients(backend, dtype), sequence_tokens, cache_bytes(backend, dtype))
