"""EPLB (jaxinfer/parallel/eplb.py) against DeepSeek's published example, hand-worked ties, invariants and balance."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.parallel import placement
from jaxinfer.parallel.eplb import (balanced_packing, balancedness, gpu_loads, identity_placement,
                                    rebalance_experts, replicate_experts)

# deepseek-ai/EPLB README example: 2 MoE layers x 12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs.
README_WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                 [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
# The phy2log the README prints (its "# Output:" block).
README_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                  [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
# Not printed in the README: log2phy and logcnt of the same call as returned by the reference eplb.py run with
# torch 2.13 (CPU). Every sort there has <= 16 items, where torch's sort is stable, so no tie order is in doubt.
README_LOGCNT = [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1], [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]
README_LOG2PHY = [[[12, -1], [15, 13], [11, -1], [6, -1], [7, 5], [0, 2], [1, -1], [3, -1], [4, -1], [9, -1],
                   [8, 10], [14, -1]],
                  [[13, -1], [15, 11], [8, -1], [14, -1], [9, -1], [10, 12], [2, 4], [0, -1], [6, 3], [7, -1],
                   [1, -1], [5, -1]]]


def test_readme_example_exact():
    phy2log, log2phy, logcnt = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    assert phy2log.dtype == log2phy.dtype == logcnt.dtype == np.int64
    np.testing.assert_array_equal(phy2log, README_PHY2LOG)
    np.testing.assert_array_equal(logcnt, README_LOGCNT)
    np.testing.assert_array_equal(log2phy, README_LOG2PHY)
    # Integer, float32 and float64 loads with the same values give the same placement.
    for dtype in (np.int32, np.float32, np.float64):
        out = rebalance_experts(np.asarray(README_WEIGHT, dtype), 16, 4, 2, 8)
        np.testing.assert_array_equal(out[0], README_PHY2LOG)


def test_ties_go_to_lowest_index():
    # Hand-worked: 4 equal experts, 2 GPUs. Packing order 0,1,2,3 (stable); packs alternate 0,1,0,1 since a tie
    # between pack loads goes to pack 0. GPU 0 gets experts 0, 2 and GPU 1 gets 1, 3.
    phy2log, log2phy, logcnt = rebalance_experts([[1, 1, 1, 1]], 4, 1, 1, 2)
    np.testing.assert_array_equal(phy2log, [[0, 2, 1, 3]])
    np.testing.assert_array_equal(log2phy, [[[0], [2], [1], [3]]])
    # Two equal experts, 2 spare slots: the first spare copies expert 0 (tie), the second expert 1.
    phy2log, log2phy, logcnt = rebalance_experts([[2, 2]], 4, 1, 1, 2)
    np.testing.assert_array_equal(logcnt, [[2, 2]])
    np.testing.assert_array_equal(phy2log, [[0, 0, 1, 1]])
    np.testing.assert_array_equal(log2phy, [[[0, 1], [2, 3]]])
    # All-zero loads (a layer no token reached) are all ties: still a valid, deterministic placement.
    phy2log, _, logcnt = rebalance_experts(np.zeros((1, 8)), 12, 2, 2, 4)
    np.testing.assert_array_equal(logcnt.sum(-1), [12])
    np.testing.assert_array_equal(phy2log, rebalance_experts(np.zeros((1, 8)), 12, 2, 2, 4)[0])


def test_building_blocks():
    pack, rank = balanced_packing(np.array([[5., 4., 3., 2., 1., 1.]]), 2)  # LPT with 3 items per pack
    np.testing.assert_array_equal(pack, [[0, 1, 1, 0, 0, 1]])  # loads 5+2+1 = 8 and 4+3+1 = 8
    np.testing.assert_array_equal(rank, [[0, 0, 1, 1, 2, 2]])
    phy2log, rank, logcnt = replicate_experts(np.array([[9., 3., 4.]]), 6)
    # Per-copy loads: 9 -> 4.5 -> 3 (copies of 0), then 4 beats 3 (expert 2), then 3 vs 3 vs 2 -> expert 0.
    np.testing.assert_array_equal(phy2log, [[0, 1, 2, 0, 0, 2]])
    np.testing.assert_array_equal(rank, [[0, 0, 0, 1, 2, 1]])
    np.testing.assert_array_equal(logcnt, [[3, 1, 2]])


def test_global_policy_when_groups_do_not_split_over_nodes():
    rng = np.random.default_rng(0)
    weight = rng.integers(0, 1000, (3, 24))
    out = rebalance_experts(weight, 32, 3, 2, 8)  # 3 groups on 2 nodes: global
    ref = rebalance_experts(weight, 32, 1, 1, 8)
    for a, b in zip(out, ref):
        np.testing.assert_array_equal(a, b)


@st.composite
def problems(draw):
    num_nodes = draw(st.sampled_from([1, 2, 4]))
    num_gpus = num_nodes * draw(st.sampled_from([1, 2, 4]))
    num_groups = draw(st.sampled_from([num_nodes, 2 * num_nodes, 3, 5]))
    num_experts = num_groups * draw(st.integers(1, 4))
    num_replicas = num_gpus * (-(-num_experts // num_gpus) + draw(st.integers(0, 2)))
    num_layers = draw(st.integers(1, 3))
    skew = draw(st.sampled_from(["uniform", "lognormal", "ties"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if skew == "uniform":
        weight = rng.integers(0, 1000, (num_layers, num_experts))
    elif skew == "lognormal":
        weight = rng.lognormal(0.0, 2.0, (num_layers, num_experts))
    else:
        weight = rng.integers(0, 3, (num_layers, num_experts))
    return weight, num_replicas, num_groups, num_nodes, num_gpus


@settings(max_examples=150, deadline=None)
@given(problems())
def test_invariants(problem):
    weight, num_replicas, num_groups, num_nodes, num_gpus = problem
    num_layers, num_experts = weight.shape
    phy2log, log2phy, logcnt = rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    assert phy2log.shape == (num_layers, num_replicas) and logcnt.shape == (num_layers, num_experts)
    assert log2phy.shape == (num_layers, num_experts, logcnt.max())
    assert (logcnt >= 1).all() and (logcnt.sum(-1) == num_replicas).all()
    for layer in range(num_layers):
        np.testing.assert_array_equal(np.bincount(phy2log[layer], minlength=num_experts), logcnt[layer])
        for e in range(num_experts):
            slots = log2phy[layer, e]
            assert (slots[: logcnt[layer, e]] >= 0).all() and (slots[logcnt[layer, e]:] == -1).all()
            assert (phy2log[layer, slots[: logcnt[layer, e]]] == e).all()
        # The same slots as placement.tables, which lists each expert's slots in ascending order (and pads to
        # this layer's max_replicas, ours to that of all layers).
        ref_log2phy, ref_logcnt = placement.tables(phy2log[layer], num_experts)
        ours = log2phy[layer, :, : ref_log2phy.shape[1]]
        np.testing.assert_array_equal(np.sort(np.where(ours < 0, num_replicas, ours)),
                                      np.where(ref_log2phy < 0, num_replicas, ref_log2phy))
        np.testing.assert_array_equal(ref_logcnt, logcnt[layer])
    # Every GPU holds num_replicas / num_gpus slots by construction of the slot index; its load is a sum of them.
    loads = gpu_loads(weight, phy2log, logcnt, num_gpus)
    np.testing.assert_allclose(loads.sum(-1), np.asarray(weight, np.float64).sum(-1), rtol=1e-9)
    if num_groups % num_nodes == 0:  # hierarchical: all copies of a group's experts on one node
        slot_node = np.arange(num_replicas) // (num_replicas // num_nodes)  # [R]
        group_of_slot = phy2log // (num_experts // num_groups)  # [L, R]
        for layer in range(num_layers):
            for g in range(num_groups):
                assert len(np.unique(slot_node[group_of_slot[layer] == g])) == 1
    # Deterministic.
    again = rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    for a, b in zip((phy2log, log2phy, logcnt), again):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("config", [(64, 96, 8, 2, 8), (256, 288, 8, 4, 32), (256, 288, 8, 3, 24),
                                    (256, 256, 8, 1, 8)])
@pytest.mark.parametrize("skew", ["zipf", "lognormal"])
def test_rebalance_lowers_max_over_mean_load(config, skew):
    num_experts, num_replicas, num_groups, num_nodes, num_gpus = config
    rng = np.random.default_rng(7)
    num_layers = 4
    if skew == "zipf":  # expert of popularity rank k gets ~ 1/k^1.1 of the tokens, ranks shuffled per layer
        weight = np.stack([(1e5 / np.arange(1, num_experts + 1) ** 1.1)[rng.permutation(num_experts)]
                           for _ in range(num_layers)]).round()
    else:
        weight = (1000 * rng.lognormal(0.0, 1.0, (num_layers, num_experts))).round()
    before = balancedness(weight, *identity_placement(num_layers, num_experts, num_replicas), num_gpus)
    phy2log, _, logcnt = rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    after = balancedness(weight, phy2log, logcnt, num_gpus)  # [L] max/mean GPU load
    assert (after <= before).all(), (before, after)
    assert after.mean() < 0.9 * before.mean(), (before, after)


def test_identity_placement_is_the_engines_default():
    phy2log, logcnt = identity_placement(2, 256, 288)
    default = placement.default_tables(256, 288)
    np.testing.assert_array_equal(phy2log[1], default["phy2log"])
    np.testing.assert_array_equal(logcnt[0], default["logcnt"])
    # Uniform load over 256 experts on the identity: GPU 0 holds 9 slots of the 32 doubled experts 0..31
    # (half load each), GPUs 4.. hold 9 single experts: max/mean = 9 / (256 / 32).
    np.testing.assert_allclose(balancedness(np.ones((2, 256)), phy2log, logcnt, 32), [9 / 8, 9 / 8])


@pytest.mark.parametrize("args, message", [
    (([[1, 2, 3, 4]], 6, 1, 1, 4), "num_replicas=6 must be divisible by num_gpus=4"),
    (([[1, 2, 3, 4]], 8, 1, 3, 4), "num_gpus=4 must be divisible by num_nodes=3"),
    (([[1, 2, 3, 4, 5, 6]], 8, 4, 2, 4), "number of experts 6 must be divisible by num_groups=4"),
    (([[1, 2, 3, 4]], 2, 1, 1, 2), "num_replicas=2 must be >= the number of experts 4"),
    (([1, 2, 3, 4], 4, 1, 1, 2), "weight must be"),
    (([[1, -2, 3, 4]], 4, 1, 1, 2), "finite and >= 0"),
    (([[1, np.nan, 3, 4]], 4, 1, 1, 2), "finite and >= 0"),
    (([[1, 2, 3, 4]], 4, 0, 1, 2), "num_groups=0 must be a positive integer"),
    (([[1, 2, 3, 4]], 4.0, 1, 1, 2), "num_replicas=4.0 must be a positive integer"),
])
def test_errors(args, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        rebalance_experts(*args)
