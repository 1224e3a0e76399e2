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


# The columns T of a decode step that computes known tokens (structured output's forced tokens,
# Scheduler.append_outputs): one width whatever the longest run, so such steps compile once per row count and page
# bucket (a width per run length multiplied the programs a constrained workload compiles: 19 step shapes for 8
# tool-call samples of one conversation, docs/benchmarks.md "Structured output (CPU)"). A longer run takes more
# steps; a wider grid costs every row the columns of the longest.
MAX_KNOWN_COLUMNS = 8


def known_columns(rows: int, capacity: int) -> int:
    """T of a decode step of known tokens with ``rows`` rows per rank: ``MAX_KNOWN_COLUMNS``, or the largest power
    of two within ``capacity`` tokens per rank (at least 1)."""
    room = 1 << max(0, (capacity // rows).bit_length() - 1)  # rows * T <= capacity
    return max(1, min(MAX_KNOWN_COLUMNS, room))
