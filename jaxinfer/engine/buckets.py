"""Step shapes come in powers of two (bounded compilation): shared by the scheduler, which plans prefill grids
within them, and the runner, which pads each step to them."""

MIN_PREFILL_T = 16  # default prefill columns at least: fewer shapes, and 16 tokens cost about what 1 does


def bucket(n: int, minimum: int = 1) -> int:
    """The next power of two >= max(n, minimum)."""
    return 1 << (max(n, minimum) - 1).bit_length()
