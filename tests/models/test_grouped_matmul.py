"""grouped_matmul's chunk ladder (moe.py's "grouped" path) against a direct construction: every chunk of a group
listed one by one, largest size first, for every floor size, the cheapest kept; then the covering checked row by
row."""

import numpy as np
import pytest

from jaxinfer.models.grouped_matmul import CHUNK_ROWS, MAX_CHUNK, MIN_CHUNK, RUNGS, chunk_sizes, ladder_counts


def _chunks(count, sizes):
    """The ladder's chunks of one group, as a list of sizes: while a whole chunk of the current size fits in what
    is left, take it; move to the next size when it does not; the floor size covers the rest."""
    out, left = [], count
    for size in sizes[:-1]:
        while left >= size:
            out.append(size)
            left -= size
    while left > 0:
        out.append(sizes[-1])
        left -= sizes[-1]
    return out


def test_chunk_sizes():
    # powers of two from min(512, the largest power of two <= rows) over at most 7 rungs, none below 8 unless the top
    assert chunk_sizes(1) == (1,)
    assert chunk_sizes(3) == (2,)
    assert chunk_sizes(40) == (32, 16, 8)
    assert chunk_sizes(300) == (256, 128, 64, 32, 16, 8)
    assert chunk_sizes(1024) == chunk_sizes(100000) == (512, 256, 128, 64, 32, 16, 8)
    assert (MAX_CHUNK, RUNGS, MIN_CHUNK) == (512, 7, 8)


def _cheapest(count, sizes, chunk_rows):
    """The cover the ladder should pick, built directly: the ladder (_chunks) down to each floor size in turn, the
    one of least rows computed + chunk_rows per chunk, ties to the lower floor."""
    options = [_chunks(count, sizes[:f + 1]) for f in range(len(sizes))]
    return min(reversed(options), key=lambda chunks: sum(chunks) + chunk_rows * len(chunks))


@pytest.mark.parametrize("rows", [1, 3, 40, 300, 1024])
@pytest.mark.parametrize("chunk_rows", [0, CHUNK_ROWS, 40])
def test_ladder_counts_cover_every_count(rows, chunk_rows):
    sizes = chunk_sizes(rows)
    counts = np.arange(rows + 1)
    per_size = ladder_counts(counts, sizes, chunk_rows)  # vectorized over counts, as moe_cost uses it
    for c in range(rows + 1):
        expected = _cheapest(c, sizes, chunk_rows)
        assert [int(n[c]) for n in per_size] == [expected.count(size) for size in sizes]
        assert ladder_counts(c, sizes, chunk_rows) == [expected.count(size) for size in sizes]  # scalar form (moe.py)
        covered = sum(expected)
        assert c <= covered < c + (expected[-1] if expected else 1)  # only the last chunk runs past the group
        if chunk_rows == 0:  # rows alone: the binary digits of the remainder, down to the floor
            assert expected == _chunks(c, sizes)
            assert all(expected.count(size) <= 1 for size in sizes[1:-1])
