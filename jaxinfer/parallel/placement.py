"""Physical expert slots: n_routed_experts logical experts placed on num_slots = E + redundant slots.

Slot s lives on expert rank s // (num_slots / R) (docs/architecture.md "Mesh semantics"). A placement is DeepSeek EPLB's
output format (deepseek-ai/EPLB ``rebalance_experts``): phy2log [S] (the logical expert in each slot),
log2phy [E, max_replicas] (the slots of each expert, padded with -1) and logcnt [E] (its number of copies).
The default is the identity placement; redundant slots copy experts 0, 1, ... in order (slot s holds s mod E).
"""

from __future__ import annotations

import numpy as np


def identity_phy2log(num_experts: int, num_slots: int) -> np.ndarray:
    """[S] int64: slot s holds expert s mod E."""
    if num_slots < num_experts:
        raise ValueError(f"num_slots={num_slots} must be >= n_routed_experts={num_experts}")
    return np.arange(num_slots, dtype=np.int64) % num_experts


def tables(phy2log: np.ndarray, num_experts: int, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """phy2log [S] -> (log2phy [E, W] padded with -1, logcnt [E]); every expert needs a slot. Each expert's
    slots in ascending order; W = width (default: the largest copy count, logcnt.max())."""
    phy2log = np.asarray(phy2log, np.int64)
    if phy2log.ndim != 1 or phy2log.min(initial=0) < 0 or phy2log.max(initial=0) >= num_experts:
        raise ValueError(f"phy2log must be a 1-D array of expert ids in [0, {num_experts}), got {phy2log}")
    logcnt = np.bincount(phy2log, minlength=num_experts)
    if (logcnt == 0).any():
        raise ValueError(f"experts {np.flatnonzero(logcnt == 0).tolist()} have no physical slot")
    width = int(logcnt.max()) if width is None else width
    if width < logcnt.max():
        raise ValueError(f"{width=} is less than the most copies of one expert, {int(logcnt.max())}")
    log2phy = -np.ones((num_experts, width), np.int64)
    for e in range(num_experts):
        slots = np.flatnonzero(phy2log == e)
        log2phy[e, : len(slots)] = slots
    return log2phy, logcnt


def check_slots(num_slots: int, expert_ranks: int) -> int:
    """Slots per expert rank; raises when the slots do not split evenly over the `expert` axis."""
    if num_slots % expert_ranks:
        raise ValueError(f"{num_slots} expert slots (n_routed_experts + num_redundant_experts) are not divisible "
                         f"by the mesh's expert axis of size {expert_ranks}")
    return num_slots // expert_ranks


PLACEMENT_LEAVES = ("phy2log", "log2phy", "logcnt")


def max_replicas(num_experts: int, num_slots: int) -> int:
    """The width of the log2phy variables: the most copies any placement can give one expert (all redundant
    slots to it), so that rebalancing never changes a shape (which would recompile the engine's step)."""
    return num_slots - num_experts + 1


def placement_tables(phy2log: np.ndarray, num_experts: int, width: int) -> dict[str, np.ndarray]:
    """phy2log [S] -> the Experts module's placement variables as int32: phy2log [S], log2phy [E, width] (each
    expert's slots ascending, as ``moe.physical_slots`` uses them) and logcnt [E]."""
    log2phy, logcnt = tables(phy2log, num_experts, width)
    return {"phy2log": np.asarray(phy2log, np.int32), "log2phy": log2phy.astype(np.int32),
            "logcnt": logcnt.astype(np.int32)}


def default_tables(num_experts: int, num_slots: int) -> dict[str, np.ndarray]:
    """The identity placement's ``placement_tables`` (log2phy [E, max_replicas(E, S)])."""
    return placement_tables(identity_phy2log(num_experts, num_slots), num_experts, max_replicas(num_experts, num_slots))


def slot_sources(old_log2phy: np.ndarray, new_phy2log: np.ndarray) -> np.ndarray:
    """old_log2phy [E, W] (the current placement, -1 padded), new_phy2log [S] -> [S] int32: for each new slot,
    a current slot holding its expert (the expert's first copy; all copies are equal)."""
    src = np.asarray(old_log2phy)[np.asarray(new_phy2log), 0]
    if (src < 0).any():
        raise ValueError("the current placement lists no slot for some expert (log2phy[e, 0] = -1)")
    return src.astype(np.int32)


def placement_values(config, abstract: dict[tuple, object]) -> dict[tuple, np.ndarray]:
    """Default (identity) values of every placement variable in a flattened abstract parameter tree
    {path: ShapeDtypeStruct}; the slot count of each MoE comes from its sibling ``gate_proj`` [S, I, D]."""
    out = {}
    for path in abstract:
        if path[-1] in PLACEMENT_LEAVES:
            num_slots = abstract[path[:-1] + ("gate_proj",)].shape[0]
            out[path] = default_tables(config.n_routed_experts, num_slots)[path[-1]]
    return out
