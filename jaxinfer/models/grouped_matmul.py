"""The chunk ladder of grouped matmuls for routed experts (moe.py's "grouped" path): rows sorted by group
(expert), each group's rows multiplied in chunks whose sizes are powers of two, the largest first.

XLA compiles static shapes, so a group of c rows (c known only at run time) is covered by whole chunks of fixed
sizes. One size for all (the row tiles of grouped-GEMM kernels: MegaBlocks, DeepGEMM's contiguous layout) pads
each group to a multiple of it: up to size - 1 rows per group, 46% of the rows computed for 64 experts holding ~128
rows each at tiles of 128, while small tiles run at a fraction of the GEMM rate on CPU (docs/benchmarks.md
"Routed-expert paths (CPU)"). The ladder takes as many chunks of the top size as fit, then the binary digits of
the remainder (at most one chunk of each smaller power of two), and only the last chunk, at the floor size, runs
past the group's rows: fewer than ``floor`` rows of waste per group, most rows in large chunks. A chunk costs more
than its rows (a GEMM call that reads the weights again), so where the last digits would take several small chunks
the ladder stops higher and rounds up (``ladder_counts``).
``jax.lax.ragged_dot`` has the semantics of a grouped matmul, but XLA:CPU computes it as if every row met every
group (docs/architecture.md "Platform facts").
"""

from __future__ import annotations

MAX_CHUNK = 512  # the top rung: larger chunks gained nothing measurable on CPU (docs/benchmarks.md)
RUNGS = 7  # chunk sizes top, top / 2, ..., top / 64: the floor, and the waste per group below it
MIN_CHUNK = 8  # nor below 8 rows: chunks of 1-4 rows cost about as much as one of 8 (decode-sized steps)
# What one more chunk costs beyond its rows, in rows: a fit of XLA:CPU float32 chunks of 64-256 rows of the grid's
# expert shapes ([128, 256] to V2-Lite's [1408, 2048]) gives 20-40 rows (a GEMM call, the weights read again); with
# the measured per-size costs the expected cover of prefill-sized steps costs least at 16-24 (docs/benchmarks.md
# "Routed-expert paths (CPU)").
CHUNK_ROWS = 16


def chunk_sizes(rows: int) -> tuple[int, ...]:
    """The ladder for a step of ``rows`` tokens, largest first: powers of two from min(MAX_CHUNK, the largest power
    of two <= rows) over at most RUNGS rungs, none below MIN_CHUNK (unless the top is). A group holds at most
    ``rows`` rows (a token's top-k slots are distinct), so a larger top chunk would never fill."""
    top = min(MAX_CHUNK, 1 << (max(rows, 1).bit_length() - 1))
    return tuple(top >> j for j in range(RUNGS) if top >> j >= min(MIN_CHUNK, top))


def _digits(count, sizes: tuple[int, ...]) -> list:
    """The ladder down to sizes[-1]: count // top of the top size, then each smaller size while it fits in what is
    left (at most once: the binary digits of the remainder), and ceil(rest / floor) of the last size."""
    counts = []
    for j, size in enumerate(sizes):
        n = count // size if j < len(sizes) - 1 else -(-count // size)
        counts.append(n)
        count = count - n * size
    return counts


def ladder_counts(count, sizes: tuple[int, ...], chunk_rows: int = CHUNK_ROWS) -> list:
    """count (an int, a numpy array or a traced jax scalar) -> the number of chunks of each of ``sizes`` that cover
    it: the ladder down to the floor size that costs least, a chunk costing ``chunk_rows`` rows more than its own
    (ties: the lower floor). With the floor at sizes[-1] that is the binary digits of the remainder and fewer than
    sizes[-1] rows computed past the group's; a higher floor ends on one or two chunks of its size, which run past
    the group by fewer than that size, where the digits below it would take more chunks than the rows saved."""
    best = _digits(count, sizes)
    best_cost = sum(n * (size + chunk_rows) for n, size in zip(best, sizes))
    for floor in range(len(sizes) - 2, -1, -1):
        option = _digits(count, sizes[:floor + 1]) + [0] * (len(sizes) - floor - 1)
        cost = sum(n * (size + chunk_rows) for n, size in zip(option, sizes))
        better = (cost < best_cost) * 1  # 0 / 1 as an int, a numpy array or a traced scalar alike
        best = [b + better * (o - b) for b, o in zip(best, option)]
        best_cost = best_cost + better * (cost - best_cost)
    return best
