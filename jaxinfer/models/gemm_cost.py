"""Which form a dense product x [M, K] @ W [N, K]^T of several rows takes on XLA:CPU (models/layers.py
``matmul_nt``): the cheapest by a cost model of its shape, fitted offline as the routed-expert paths' is
(moe_cost.py).

Forms (both float32 accumulation, the same products):
- "plain": ``einsum("mk,nk->mn")``, XLA:CPU's dot (a YNNPACK fusion).
- "transposed": the [N, M] product W @ x^T, then its small result transposed (layers.py says why it is kept).
One unbatched row is not priced here: matmul_nt always runs it as XLA:CPU's own float32 matrix-vector loop. Its
advantage shows inside programs more than in products timed alone, as this model's are (bf16 weights: 16 one-row
dot_generals in a program 52 ms against 2.2 ms; docs/benchmarks.md "GEMM forms (CPU)").

Each form's work is counted from the shape (``work``: one call, the bytes of the weights and of the rows it reads (a
GEMM library packs one operand or the other), its flops, counted also with the rows padded to whole tiles, the bytes
of its float32 result) and priced by the form's own seconds per unit (``coefficients``), fitted by non-negative
least squares on measurements over a grid of shapes and row counts (``python benchmarks/gemm_forms.py --calibrate
--write-table`` rewrites gemm_costs.json; docs/benchmarks.md "GEMM forms (CPU)"). The choice is a pure function of
(batch, rows per device, N, K, weight dtype): every process and every rank picks the same form. Other backends run
the plain form (their compilers choose the layout of a dot themselves; unmeasured).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

FORMS = ("plain", "transposed")
FEATURES = ("calls", "weight_bytes", "in_bytes", "flops", "tile_flops", "out_bytes")
# GEMM libraries compute a product in tiles of rows: "tile_flops" counts the rows padded to a multiple of TILE_ROWS,
# and the fit says how much of each form's time follows it (the bf16 choice improves with it; tiles of 8 or 32 rows
# do about as well: docs/benchmarks.md "GEMM forms (CPU)").
TILE_ROWS = 16
# The most rows the transposed form takes. In the engine's bf16 step programs XLA:CPU ran transposed products of 128
# and 1024 rows (the grouped path's tiles, prefill) as DotThunks, which have no BF16 x BF16 -> F32 (UNIMPLEMENTED at
# run time), where the same products alone ran as YNNPACK fusions; up to 64 rows they have always run. Beyond, the
# two forms measure within a few percent of each other (docs/benchmarks.md "GEMM forms (CPU)").
MAX_TRANSPOSED_ROWS = 64
TABLE = pathlib.Path(__file__).with_name("gemm_costs.json")


@dataclasses.dataclass(frozen=True)
class GemmShape:
    """One product: rows M per device of x [M, K] (or x [S, M, K]) against W [N, K] (or [S, N, K]: batch S > 0)
    whose elements take weight_itemsize bytes."""

    rows: int
    n: int
    k: int
    weight_itemsize: int = 4
    batch: int = 0  # 0: unbatched (2-D W)


def work(form: str, shape: GemmShape) -> dict[str, float]:
    """The work of ``form`` on ``shape`` per FEATURES (the same count for every form: what differs is its price)."""
    if form not in FORMS:
        raise ValueError(f"unknown product form {form!r}; known: {', '.join(FORMS)}")
    s = max(shape.batch, 1)
    tile_rows = -(-shape.rows // TILE_ROWS) * TILE_ROWS
    return dict(calls=1, weight_bytes=s * shape.n * shape.k * shape.weight_itemsize,
                in_bytes=s * shape.rows * shape.k * shape.weight_itemsize, flops=2 * s * shape.rows * shape.n * shape.k,
                tile_flops=2 * s * tile_rows * shape.n * shape.k, out_bytes=4 * s * shape.rows * shape.n)


@functools.cache
def _table() -> dict:
    return json.loads(TABLE.read_text())


def coefficients(dtype: str) -> dict[str, dict[str, float]]:
    """form -> feature -> seconds per unit on XLA:CPU for weights of ``dtype`` ("float32", "bfloat16")."""
    entries = _table()["cpu"]
    return entries.get(dtype, entries["float32"])["forms"]


def price(form: str, shape: GemmShape, prices: dict[str, dict[str, float]]) -> float:
    """Seconds of ``form`` on ``shape`` at ``prices`` (form -> feature -> seconds per unit)."""
    return sum(prices[form][f] * v for f, v in work(form, shape).items())


def forms(shape: GemmShape) -> tuple[str, ...]:
    """The forms ``shape`` may take: the transposed one for at most MAX_TRANSPOSED_ROWS rows."""
    return FORMS if shape.rows <= MAX_TRANSPOSED_ROWS else FORMS[:1]


def cheapest(shape: GemmShape, prices: dict[str, dict[str, float]]) -> str:
    """The form of least cost at ``prices`` among ``forms(shape)`` (ties: FORMS order)."""
    return min(forms(shape), key=lambda f: price(f, shape, prices))


@functools.cache
def choose(shape: GemmShape, dtype: str) -> str:
    """``cheapest`` at the table's prices for weights of ``dtype``."""
    return cheapest(shape, coefficients(dtype))
