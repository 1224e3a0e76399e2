"""How a model is laid out on its mesh: passed explicitly to the modules that need it (no global context)."""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh

# The routed experts' compute paths (models/moe_cost.py PATHS; named here because parallel sits below models).
MOE_PATHS = ("gather", "dense", "capacity", "grouped", "ragged")


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
    """mesh: ('data', 'expert') mesh; routed-expert slots split over 'expert', the batch over all devices.
    fp8_dispatch: send tokens to expert ranks in e4m3 with per-token-per-128 scales (combine stays in the model
    dtype). num_redundant_experts: extra physical expert slots holding copies of hot experts (EPLB).
    moe_path: the routed experts' compute path on each expert rank (models/moe.py expert_ffn): "auto" (the
    cheapest for each step's shape by models/moe_cost.py) or one of MOE_PATHS, forced (tests, benchmarks)."""

    mesh: Mesh
    fp8_dispatch: bool = False
    num_redundant_experts: int = 0
    moe_path: str = "auto"

    def __post_init__(self):
        if self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be >= 0, got {self.num_redundant_experts}")
        if self.moe_path != "auto" and self.moe_path not in MOE_PATHS:
            raise ValueError(f"moe_path must be 'auto' or one of {MOE_PATHS}, got {self.moe_path!r}")

    @property
    def expert_ranks(self) -> int:
        return self.mesh.shape["expert"]


def batch_shards(plan: ParallelPlan | None) -> int:
    """The devices the batch is split over under ``plan`` (all of them: each is a DP rank); 1 without one."""
    return 1 if plan is None else plan.mesh.size
