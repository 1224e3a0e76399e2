"""EPLB on DeepSeek-V3-shaped synthetic expert loads: max/mean GPU load before and after rebalancing.

    python benchmarks/eplb_balance.py [--layers 58] [--tokens 1000000] [--seed 0]

Shape (DeepSeek-V3 technical report, sec. 3.4 and config.json): 256 routed experts in 8 groups, top-8 routing,
58 MoE layers; 32 redundant experts -> 288 slots; EP32 over 4 nodes of 8 GPUs (9 slots per GPU).
Loads are token counts drawn per layer (multinomial over the experts, tokens x 8 picks) from a skewed popularity:
Zipf (expert of rank k gets ~ k^-s, ranks shuffled per layer) or lognormal. "before" is the engine's identity
placement (placement.py: slot s holds expert s mod 256, so experts 0..31 have two copies); "after" is
jaxinfer.parallel.eplb.rebalance_experts. Each copy of an expert carries load / copies (DeepSeek's EPLB model).
max/mean is the busiest GPU's load over the average GPU's load in one layer (1.0 = perfect; the MoE step runs at
the pace of the busiest GPU, so 1 / (max/mean) is the dispatch efficiency).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from jaxinfer.parallel.eplb import balancedness, identity_placement, rebalance_experts

NUM_EXPERTS, NUM_GROUPS, TOP_K = 256, 8, 8  # DeepSeek-V3 n_routed_experts, n_group, num_experts_per_tok
NUM_SLOTS, NUM_NODES, NUM_GPUS = 288, 4, 32  # 32 redundant experts, EP32 over 4 nodes of 8


def synthetic_loads(kind: str, num_layers: int, tokens: int, rng: np.random.Generator) -> np.ndarray:
    """[L, E] int64 token counts per expert."""
    rows = []
    for _ in range(num_layers):
        if kind.startswith("zipf"):
            s = float(kind.split("-")[1])
            popularity = np.arange(1, NUM_EXPERTS + 1, dtype=np.float64) ** -s
            popularity = popularity[rng.permutation(NUM_EXPERTS)]
        else:
            sigma = float(kind.split("-")[1])
            popularity = rng.lognormal(0.0, sigma, NUM_EXPERTS)
        rows.append(rng.multinomial(tokens * TOP_K, popularity / popularity.sum()))
    return np.stack(rows).astype(np.int64)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=58)
    p.add_argument("--tokens", type=int, default=1_000_000, help="tokens per layer (each picks 8 experts)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    rng = np.random.default_rng(args.seed)
    print(f"{NUM_EXPERTS} experts / {NUM_GROUPS} groups, {NUM_SLOTS} slots, EP{NUM_GPUS} over {NUM_NODES} nodes, "
          f"{args.layers} layers, {args.tokens} tokens x top-{TOP_K} per layer, seed {args.seed}")
    print(f"{'load':<15}{'placement':<34}{'max/mean mean':>14}{'worst layer':>12}{'efficiency':>11}{'time s':>8}")
    identity = identity_placement(args.layers, NUM_EXPERTS, NUM_SLOTS)
    for kind in ("zipf-0.6", "zipf-1.0", "lognormal-0.5", "lognormal-1.0"):
        weight = synthetic_loads(kind, args.layers, args.tokens, rng)  # [L, E]
        rows = [("identity (s mod 256)", balancedness(weight, *identity, NUM_GPUS), 0.0)]
        for label, groups, nodes in (("EPLB hierarchical (8 grp, 4 nodes)", NUM_GROUPS, NUM_NODES),
                                     ("EPLB global (num_groups=1)", 1, NUM_NODES)):
            start = time.perf_counter()
            phy2log, _, logcnt = rebalance_experts(weight, NUM_SLOTS, groups, nodes, NUM_GPUS)
            seconds = time.perf_counter() - start
            rows.append((label, balancedness(weight, phy2log, logcnt, NUM_GPUS), seconds))
        for label, ratio, seconds in rows:  # ratio: [L] max/mean GPU load per layer
            print(f"{kind:<15}{label:<34}{ratio.mean():>14.3f}{ratio.max():>12.3f}{1 / ratio.mean():>11.1%}"
                  f"{seconds:>8.3f}")


if __name__ == "__main__":
    main()
