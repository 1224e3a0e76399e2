"""Step shapes come in powers of two (bounded compilation): shared by the scheduler, which plans prefill grids
within them, and the runner, which pads each step to them."""

MIN_PREFILL_T = 16  # default prefill columns at least: fewer shapes, and 16 tokens cost about what 1 does
# Columns of a query block (EngineConfig.prefill_layout="blocks"): the one page of 64 a prefix hit leaves to compute
# fits one block; narrower blocks cost up to 2-4x the grid's attention on long chunks (docs/benchmarks.md "Prefill
# layouts (CPU)").
PREFILL_BLOCK = 64


def bucket(n: int, minimum: int = 1) -> int:
    """The next power of two >= max(n, minimum)."""
    return 1 << (max(n, minimum) - 1).bit_length()
