"""Expert-parallel load balancer: DeepSeek's EPLB in numpy.

Semantics follow deepseek-ai/EPLB ``eplb.py`` (``balanced_packing``, ``replicate_experts``,
``rebalance_experts_hierarchical``, ``rebalance_experts``); the code is our own, pure numpy, no torch.

Given per-layer expert loads (token counts) it chooses which experts get redundant copies and where every copy
(physical slot) lives, so that each GPU (expert rank) receives about the same load. Slot s lives on GPU
s // (R / num_gpus) and on node s // (R / num_nodes), as in ``placement.py``. Loads of an expert with c copies
are assumed to split evenly over its copies (weight / c each).

Policies (as in the reference):
- hierarchical, when num_groups % num_nodes == 0: pack expert groups onto nodes (balanced, groups_per_node
  each), replicate experts within each node, pack the node's replicas onto its GPUs. Every copy of an expert
  of a group stays on the node that holds the group (group-limited routing keeps its traffic there).
- global otherwise: the same procedure with one group and one node (replicate over all experts, pack all
  replicas onto all GPUs).

Determinism: every sort is a stable descending sort and every arg-max / arg-min takes the lowest index, so ties
go to the lowest expert, replica or pack index. torch differs in one place: the reference sorts with
``torch.sort(descending=True)``, which on CPU is stable only for rows of <= 16 items; on longer rows with tied
loads torch's order among the ties is unspecified, so our output equals the reference run with
``torch.sort(..., stable=True)``. ``argmax``/``min`` tie-breaking is the same (first index). Arithmetic is
float32 like the reference (``weight.float()``): integer loads are exact below 2**24 per group.

Dims: L layers (MoE layers), E logical experts, R physical slots (num_replicas), G expert groups, N nodes,
X rows of a batched sub-problem.
"""

from __future__ import annotations

import numpy as np

from jaxinfer.parallel.placement import identity_phy2log


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy balanced packing of n weighted items into num_packs packs of exactly n / num_packs items each.

    Items are taken heaviest first (stable: equal weights in index order); each goes to the lightest pack that
    still has room (ties: lowest pack index).

    weight: [X, n] float. Returns pack_index [X, n] int64 (pack of each item) and rank_in_pack [X, n] int64
    (the item's position in its pack, in order of placement).
    """
    num_rows, n = weight.shape
    if n % num_packs:
        raise ValueError(f"{n=} items must be divisible by {num_packs=}")
    per_pack = n // num_packs
    if per_pack == 1:
        pack_index = np.broadcast_to(np.arange(n, dtype=np.int64), (num_rows, n)).copy()
        return pack_index, np.zeros((num_rows, n), np.int64)
    order = np.argsort(-weight, axis=-1, kind="stable")  # [X, n] heaviest first
    pack_index = np.full((num_rows, n), -1, np.int64)
    rank_in_pack = np.full((num_rows, n), -1, np.int64)
    for row in range(num_rows):
        loads = np.zeros(num_packs, weight.dtype)  # [num_packs], accumulated in the weight's dtype
        counts = np.zeros(num_packs, np.int64)  # [num_packs]
        for item in order[row]:
            pack = int(np.argmin(np.where(counts < per_pack, loads, np.inf)))
            pack_index[row, item] = pack
            rank_in_pack[row, item] = counts[pack]
            loads[pack] += weight[row, item]
            counts[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replicate num_log experts into num_phy replicas, minimising the largest per-replica load greedily.

    Replicas 0..num_log-1 are the experts themselves; each further replica copies the expert with the largest
    load per copy (weight / count; ties: lowest expert index).

    weight: [X, num_log] float. Returns phy2log [X, num_phy] int64 (expert of each replica), rank [X, num_phy]
    int64 (which copy of its expert the replica is, 0-based) and logcnt [X, num_log] int64 (copies per expert).
    """
    num_rows, num_log = weight.shape
    if num_phy < num_log:
        raise ValueError(f"{num_phy=} replicas must be >= {num_log=} experts")
    rows = np.arange(num_rows)
    phy2log = np.broadcast_to(np.arange(num_phy, dtype=np.int64), (num_rows, num_phy)).copy()
    rank = np.zeros((num_rows, num_phy), np.int64)
    logcnt = np.ones((num_rows, num_log), np.int64)
    for phy in range(num_log, num_phy):
        hottest = np.argmax(weight / logcnt.astype(weight.dtype), axis=-1)  # [X]
        phy2log[:, phy] = hottest
        rank[:, phy] = logcnt[rows, hottest]
        logcnt[rows, hottest] += 1
    return phy2log, rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    """Row-wise inverse permutation: inv[x, perm[x, i]] = i. perm: [X, n] -> [X, n]."""
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=-1)
    return inv


def _hierarchical(weight: np.ndarray, num_phy: int, num_groups: int, num_nodes: int, num_gpus: int):
    """weight [L, E] float32 -> (phy2log [L, R], phyrank [L, R], logcnt [L, E]); arguments already checked."""
    num_layers, num_log = weight.shape
    group_size = num_log // num_groups
    groups_per_node = num_groups // num_nodes
    log_per_node = num_log // num_nodes
    phy_per_gpu = num_phy // num_gpus

    # Step 1: pack groups onto nodes. "mlog" numbers experts node by node: node n holds mlog
    # [n * log_per_node, (n + 1) * log_per_node), its groups in pack order, experts in order within a group.
    group_load = weight.reshape(num_layers, num_groups, group_size).sum(-1)  # [L, G]
    group_node, group_rank = balanced_packing(group_load, num_nodes)  # [L, G] each
    group_start = (group_node * groups_per_node + group_rank) * group_size  # [L, G]
    log2mlog = (group_start[:, :, None] + np.arange(group_size)).reshape(num_layers, num_log)  # [L, E]
    mlog2log = _inverse(log2mlog)  # [L, E]

    # Step 2: replicate experts within each node; rows are (layer, node) pairs.
    mlog_load = np.take_along_axis(weight, mlog2log, -1).reshape(num_layers * num_nodes, log_per_node)
    phy2mlog, phyrank, mlogcnt = replicate_experts(mlog_load, num_phy // num_nodes)  # [L*N, R/N] x2, [L*N, E/N]

    # Step 3: pack each node's replicas onto its GPUs; "pphy" is the final slot order within the node.
    phy_load = np.take_along_axis(mlog_load / mlogcnt.astype(weight.dtype), phy2mlog, -1)  # [L*N, R/N]
    gpu, rank_in_gpu = balanced_packing(phy_load, num_gpus // num_nodes)  # [L*N, R/N] each
    pphy2phy = _inverse(gpu * phy_per_gpu + rank_in_gpu)  # [L*N, R/N]

    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, -1)  # [L*N, R/N], node-local mlog ids
    node_offset = (np.arange(num_nodes) * log_per_node)[None, :, None]  # [1, N, 1]
    pphy2mlog = (pphy2mlog.reshape(num_layers, num_nodes, -1) + node_offset).reshape(num_layers, num_phy)
    phy2log = np.take_along_axis(mlog2log, pphy2mlog, -1)  # [L, R]
    phyrank = np.take_along_axis(phyrank, pphy2phy, -1).reshape(num_layers, num_phy)  # [L, R]
    logcnt = np.take_along_axis(mlogcnt.reshape(num_layers, num_log), log2mlog, -1)  # [L, E]
    return phy2log, phyrank, logcnt


def _check_weight(weight) -> np.ndarray:
    weight = np.asarray(weight)
    if weight.ndim != 2:
        raise ValueError(f"weight must be [num_layers, num_experts], got shape {weight.shape}")
    if weight.size == 0:
        raise ValueError(f"weight must not be empty, got shape {weight.shape}")
    if not np.issubdtype(weight.dtype, np.number) or np.iscomplexobj(weight):
        raise ValueError(f"weight must hold real numbers, got dtype {weight.dtype}")
    if not np.isfinite(weight).all() or (weight < 0).any():
        raise ValueError("weight (expert loads) must be finite and >= 0")
    return weight.astype(np.float32)  # the reference computes in float32 (weight.float())


def rebalance_experts(weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """EPLB placement of E logical experts on R = num_replicas physical slots, per MoE layer.

    weight: [L, E] loads of each logical expert (e.g. token counts), finite and >= 0.
    num_replicas: R, number of physical slots (E + redundant); a multiple of num_gpus and >= E.
    num_groups: G, expert groups of the router (n_group); E must be a multiple of G for the hierarchical policy.
    num_nodes: N, number of hosts (intra-node links are faster); num_gpus must be a multiple of N.
    num_gpus: size of the `expert` mesh axis; slot s lives on GPU s // (R / num_gpus).

    Hierarchical policy when G % N == 0, global policy (G = N = 1) otherwise.

    Returns numpy int64 arrays:
      phy2log [L, R]: logical expert held by each slot;
      log2phy [L, E, max_replicas]: slots of each expert in replica order, padded with -1
        (max_replicas = logcnt.max() over all layers);
      logcnt [L, E]: number of slots (copies) of each expert, >= 1, summing to R per layer.
    """
    weight = _check_weight(weight)
    num_layers, num_log = weight.shape
    for name, value in (("num_replicas", num_replicas), ("num_groups", num_groups),
                        ("num_nodes", num_nodes), ("num_gpus", num_gpus)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if num_replicas % num_gpus:
        raise ValueError(f"{num_replicas=} must be divisible by {num_gpus=}")
    if num_gpus % num_nodes:
        raise ValueError(f"{num_gpus=} must be divisible by {num_nodes=}")
    if num_replicas < num_log:
        raise ValueError(f"{num_replicas=} must be >= the number of experts {num_log}")
    if num_groups % num_nodes == 0:
        if num_log % num_groups:
            raise ValueError(f"number of experts {num_log} must be divisible by {num_groups=}")
        phy2log, phyrank, logcnt = _hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, phyrank, logcnt = _hierarchical(weight, num_replicas, 1, 1, num_gpus)

    max_replicas = int(logcnt.max())
    log2phy = np.full((num_layers, num_log * max_replicas), -1, np.int64)  # [L, E * max_replicas]
    np.put_along_axis(log2phy, phy2log * max_replicas + phyrank,
                      np.broadcast_to(np.arange(num_replicas, dtype=np.int64), phy2log.shape), axis=-1)
    return phy2log, log2phy.reshape(num_layers, num_log, max_replicas), logcnt


def gpu_loads(weight, phy2log, logcnt, num_gpus: int) -> np.ndarray:
    """Load of each GPU: weight [L, E], phy2log [L, R], logcnt [L, E] -> [L, num_gpus] float64.

    Each slot holding expert e carries weight[e] / logcnt[e] (the router spreads an expert's tokens evenly over
    its copies); GPU g sums slots [g * R / num_gpus, (g + 1) * R / num_gpus).
    """
    weight = np.atleast_2d(np.asarray(weight, np.float64))
    phy2log = np.atleast_2d(np.asarray(phy2log, np.int64))
    logcnt = np.atleast_2d(np.asarray(logcnt, np.int64))
    num_layers, num_slots = phy2log.shape
    if num_slots % num_gpus:
        raise ValueError(f"{num_slots=} must be divisible by {num_gpus=}")
    per_copy = weight / logcnt  # [L, E]
    slot_load = np.take_along_axis(per_copy, phy2log, -1)  # [L, R]
    return slot_load.reshape(num_layers, num_gpus, num_slots // num_gpus).sum(-1)  # [L, num_gpus]


def balancedness(weight, phy2log, logcnt, num_gpus: int) -> np.ndarray:
    """max / mean GPU load per layer ([L] float64; 1.0 is perfect balance). Shapes as in ``gpu_loads``."""
    loads = gpu_loads(weight, phy2log, logcnt, num_gpus)  # [L, num_gpus]
    mean = loads.mean(-1)
    return np.divide(loads.max(-1), mean, out=np.ones_like(mean), where=mean > 0)


def identity_placement(num_layers: int, num_experts: int, num_replicas: int) -> tuple[np.ndarray, np.ndarray]:
    """The engine's default placement (placement.py: slot s holds expert s mod E) as (phy2log [L, R],
    logcnt [L, E]), for comparing loads before and after rebalancing."""
    phy2log = identity_phy2log(num_experts, num_replicas)  # [R]
    logcnt = np.bincount(phy2log, minlength=num_experts)  # [E]
    return np.tile(phy2log, (num_layers, 1)), np.tile(logcnt, (num_layers, 1))
