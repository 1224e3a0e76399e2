"""models/moe_cost.py: the expected work of the capacity and grouped paths against Monte Carlo routing, the work
counts against the layouts the paths build, and the choice as a pure function of the shape over a valid table."""

import dataclasses

import numpy as np
import pytest

from jaxinfer.models import moe_cost
from jaxinfer.models.grouped_matmul import CHUNK_ROWS, chunk_sizes


def _routing(rng, trials, rows, k, s):
    """[trials, s] slot counts of `rows` tokens, each with k distinct uniformly random slots."""
    picks = np.argsort(rng.random((trials, rows, s)), axis=-1)[..., :k]  # [trials, rows, k]
    return np.stack([np.bincount(p.ravel(), minlength=s) for p in picks])


@pytest.mark.parametrize("rows, k, s", [(5, 2, 8), (32, 4, 16), (200, 6, 64), (64, 8, 256)])
def test_expected_capacity_and_chunks_match_monte_carlo(rows, k, s):
    counts = _routing(np.random.default_rng(rows), 400, rows, k, s)  # [400, s]
    shape = moe_cost.ExpertShape(rows, k, s, 64, 32)
    buckets = np.asarray(moe_cost.capacity_buckets(rows, k, s))
    chosen = buckets[np.searchsorted(buckets, counts.max(1))]  # the first bucket holding the busiest slot
    # independent slot counts (moe_cost's assumption) overestimate the busiest slot a little where slots are many
    assert moe_cost.expected_capacity(shape) == pytest.approx(chosen.mean(), rel=0.08)
    past = np.maximum(counts[:, None, :] - buckets[None, :, None], 0).sum(-1).mean(0)  # [buckets] past each
    np.testing.assert_allclose(moe_cost.expected_overflow(shape), past, rtol=0.1, atol=0.05 * rows * k / s)
    chunks, computed, used = moe_cost.expected_chunks(shape)
    sizes = chunk_sizes(rows)
    # each slot's count covered chunk by chunk: for every floor size, whole chunks of each size while they fit and
    # the floor's rounded up; the cover of least rows + CHUNK_ROWS per chunk
    def cover(count):
        options = []
        for f in range(len(sizes)):
            chunks, left = [], count
            for size in sizes[:f]:
                chunks += [size] * (left // size)
                left -= size * (left // size)
            options.append(chunks + [sizes[f]] * -(-left // sizes[f]))
        return min(reversed(options), key=lambda c: sum(c) + CHUNK_ROWS * len(c))

    covers = {c: cover(c) for c in np.unique(counts)}
    drawn_chunks = np.vectorize(lambda c: len(covers[c]))(counts)  # [400, s]
    drawn_rows = np.vectorize(lambda c: sum(covers[c]))(counts)
    assert chunks == pytest.approx(drawn_chunks.sum(1).mean(), rel=0.05)
    assert computed == pytest.approx(drawn_rows.sum(1).mean(), rel=0.05)
    assert (drawn_rows >= counts).all() and (drawn_rows < counts + sizes[0]).all()
    assert used == pytest.approx((counts > 0).sum(1).mean(), rel=0.05)


def test_work_counts():
    shape = moe_cost.ExpertShape(rows=3, top_k=2, num_slots=8, hidden=64, inter=32, weight_itemsize=2)
    expert_bytes = 3 * 64 * 32 * 2
    gather = moe_cost.work("gather", shape, "cpu")
    assert (gather["matrices"], gather["weight_bytes"]) == (18, 6 * expert_bytes)
    # in slot order a slot's weights come from memory once where they fit in the cache, else once per assignment
    used = moe_cost.expected_slots_in_use(shape)
    assert used == pytest.approx(8 * (1 - (1 - 2 / 8) ** 3))  # Binomial(3 rows, 2 / 8): P(slot unused) = (3/4)^3
    assert moe_cost.work("gather", shape, "cpu", cache=expert_bytes)["weight_bytes"] == pytest.approx(
        used * expert_bytes)
    assert moe_cost.work("gather", shape, "cpu", cache=expert_bytes - 1)["weight_bytes"] == 6 * expert_bytes
    assert moe_cost.work("gather", shape, "cpu", cache=expert_bytes)["flops"] == gather["flops"]
    dense = moe_cost.work("dense", shape, "cpu")
    assert dense["weight_bytes"] == 8 * expert_bytes and dense["flops"] == 2 * 3 * 8 * 3 * 64 * 32
    # XLA's ragged dot computes every assignment against every group off TPUs
    assert moe_cost.work("ragged", shape, "cpu")["flops"] == 8 * moe_cost.work("ragged", shape, "tpu")["flops"]
    with pytest.raises(ValueError, match="unknown routed-expert path"):
        moe_cost.work("tiled", shape, "cpu")


def test_table_covers_every_path_and_feature():
    table = moe_cost._table()["backends"]
    assert {"cpu", "gpu"} <= set(table)
    for backend, entry in table.items():
        for dtype in ("float32", "bfloat16"):
            paths = entry[dtype]["paths"]
            assert entry[dtype]["source"]
            assert set(paths) == set(moe_cost.PATHS), (backend, dtype)
            for path, price in paths.items():
                assert set(price) == set(moe_cost.FEATURES) and min(price.values()) >= 0, (backend, dtype, path)


@pytest.mark.parametrize("backend", ["cpu", "gpu", "some-new-backend"])
@pytest.mark.parametrize("sequence_tokens", [1, 64])
def test_choice_is_a_pure_function_of_the_shape(backend, sequence_tokens):
    # decode steps (one token per sequence) priced under balanced routing, prefill chunks over ROUTING_SKEWS too
    skews = moe_cost.ROUTING_SKEWS if sequence_tokens > 1 else (0.0,)
    for rows in (1, 7, 64, 1024):
        shape = moe_cost.ExpertShape(rows, 6, 64, 2048, 1408)
        first = moe_cost.choose(shape, "bfloat16", backend, sequence_tokens)
        moe_cost.choose.cache_clear()
        assert first in moe_cost.PATHS and moe_cost.choose(shape, "bfloat16", backend, sequence_tokens) == first
        scenarios = [dataclasses.replace(shape, skew=skew) for skew in skews]
        costs = {p: sum(moe_cost.predict(p, s, "bfloat16", backend) for s in scenarios) for p in moe_cost.PATHS}
        assert costs[first] == min(costs.values())
