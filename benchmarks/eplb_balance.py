"""EPLB on measured and synthetic expert loads: max/mean expert-rank (GPU) load before and after rebalancing.

    python benchmarks/eplb_balance.py [--layers 58] [--tokens 1000000] [--seed 0] [--load FILE.json] [--engine]

1. The embedded default model's routing statistics (jaxinfer/default_model/expert_load.json, or --load FILE: the
   JSON that ``jaxinfer generate --expert-load-json FILE`` writes, same ``expert_load`` [layers][experts] key):
   16 experts in 4 groups, top-2, 3 MoE layers; 4 redundant slots -> 20 slots on 4 expert ranks (5 each), one
   node. These are the loads ``LLM.rebalance_experts()`` would use.
2. DeepSeek-V3-shaped synthetic loads (DeepSeek-V3 technical report, sec. 3.4 and config.json): 256 routed experts
   in 8 groups, top-8 routing, 58 MoE layers; 32 redundant experts -> 288 slots; EP32 over 4 nodes of 8 GPUs
   (9 slots per GPU). Loads are token counts drawn per layer (multinomial over the experts, tokens x 8 picks) from
   a skewed popularity: Zipf (expert of rank k gets ~ k^-s, ranks shuffled per layer) or lognormal.

3. --engine: the embedded model run by the engine on a CPU mesh 1x4 with 4 redundant slots: greedy generation
   of PROMPTS, ``LLM.expert_load()``, ``LLM.rebalance_experts()``, the same generation again (outputs must be
   equal). Besides EPLB's model of the loads, it reports the tokens the MoE layers really dispatched to each
   expert rank (parallel/comm.tokens_sent: once per token and rank, DeepEP's rule) on the generated sequences.

"before" is the engine's identity placement (placement.py: slot s holds expert s mod E, so the first
redundant-count experts have two copies); "after" is jaxinfer.parallel.eplb.rebalance_experts. Each copy of an
expert carries load / copies (DeepSeek's EPLB model). max/mean is the busiest GPU's load over the average GPU's
load in one layer (1.0 = perfect; the MoE step runs at the pace of the busiest GPU, so 1 / (max/mean) is the
dispatch efficiency).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np

from jaxinfer.parallel.eplb import balancedness, identity_placement, rebalance_experts

NUM_EXPERTS, NUM_GROUPS, TOP_K = 256, 8, 8  # DeepSeek-V3 n_routed_experts, n_group, num_experts_per_tok
NUM_SLOTS, NUM_NODES, NUM_GPUS = 288, 4, 32  # 32 redundant experts, EP32 over 4 nodes of 8
EMBEDDED_LOAD = pathlib.Path(__file__).resolve().parent.parent / "jaxinfer" / "default_model" / "expert_load.json"
EMBEDDED_GROUPS, EMBEDDED_REDUNDANT, EMBEDDED_GPUS = 4, 4, 4  # n_group of the embedded model; 20 slots on 4 ranks


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


def _row(label: str, placement: str, ratio: np.ndarray, seconds: float) -> str:
    """ratio: [L] max/mean GPU load per layer."""
    return (f"{label:<15}{placement:<34}{ratio.mean():>14.3f}{ratio.max():>12.3f}{1 / ratio.mean():>11.1%}"
            f"{seconds:>8.3f}")


HEADER = f"{'load':<15}{'placement':<34}{'max/mean mean':>14}{'worst layer':>12}{'efficiency':>11}{'time s':>8}"


def measured(path: pathlib.Path) -> None:
    """EPLB on a measured [layers, experts] load (section 1 of the module docstring)."""
    weight = np.asarray(json.loads(path.read_text())["expert_load"], np.int64)  # [L, E]
    num_layers, num_experts = weight.shape
    num_slots = num_experts + EMBEDDED_REDUNDANT
    per_expert = weight.max(-1) / weight.mean(-1)
    print(f"{path.name}: {num_layers} MoE layers x {num_experts} experts ({weight.sum(-1).tolist()} choices per "
          f"layer; busiest expert / mean: {np.round(per_expert, 3).tolist()}), {num_slots} slots on "
          f"{EMBEDDED_GPUS} expert ranks, 1 node")
    print(HEADER)
    rows = [("identity (s mod E)", balancedness(weight, *identity_placement(num_layers, num_experts, num_slots),
                                                EMBEDDED_GPUS), 0.0)]
    for label, groups in ((f"EPLB ({EMBEDDED_GROUPS} groups, 1 node)", EMBEDDED_GROUPS),
                          ("EPLB global (num_groups=1)", 1)):
        start = time.perf_counter()
        phy2log, _, logcnt = rebalance_experts(weight, num_slots, groups, 1, EMBEDDED_GPUS)
        rows.append((label, balancedness(weight, phy2log, logcnt, EMBEDDED_GPUS), time.perf_counter() - start))
    for label, ratio, seconds in rows:
        print(_row("measured", label, ratio, seconds))
    print()


def synthetic(num_layers: int, tokens: int, seed: int) -> None:
    """EPLB on DeepSeek-V3-shaped synthetic loads (section 2 of the module docstring)."""
    rng = np.random.default_rng(seed)
    print(f"{NUM_EXPERTS} experts / {NUM_GROUPS} groups, {NUM_SLOTS} slots, EP{NUM_GPUS} over {NUM_NODES} nodes, "
          f"{num_layers} layers, {tokens} tokens x top-{TOP_K} per layer, seed {seed}")
    print(HEADER)
    identity = identity_placement(num_layers, NUM_EXPERTS, NUM_SLOTS)
    for kind in ("zipf-0.6", "zipf-1.0", "lognormal-0.5", "lognormal-1.0"):
        weight = synthetic_loads(kind, num_layers, tokens, rng)  # [L, E]
        rows = [("identity (s mod 256)", balancedness(weight, *identity, NUM_GPUS), 0.0)]
        for label, groups, nodes in (("EPLB hierarchical (8 grp, 4 nodes)", NUM_GROUPS, NUM_NODES),
                                     ("EPLB global (num_groups=1)", 1, NUM_NODES)):
            start = time.perf_counter()
            phy2log, _, logcnt = rebalance_experts(weight, NUM_SLOTS, groups, nodes, NUM_GPUS)
            seconds = time.perf_counter() - start
            rows.append((label, balancedness(weight, phy2log, logcnt, NUM_GPUS), seconds))
        for label, ratio, seconds in rows:
            print(_row(kind, label, ratio, seconds))


PROMPTS = ["The with statement is used to", "Return a new dictionary", "A list comprehension consists of",
           "The import system", "Exceptions are raised when", "The for statement in Python differs",
           "Class definitions place yet another namespace", "The function returns"]


def engine(max_tokens: int = 64) -> None:
    """Section 3 of the module docstring."""
    import os

    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.parallel.comm import tokens_sent
    from jaxinfer.rebalance import current_phy2log

    ranks = 4
    llm = LLM(mesh="1x4", dtype="float32", num_redundant_experts=EMBEDDED_REDUNDANT)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def run():
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        seqs = [o.prompt_token_ids + o.outputs[0].token_ids[:-1] for o in outs]  # what the steps computed
        flat = np.concatenate(seqs)
        ids = flat[: len(flat) // ranks * ranks].reshape(ranks, -1)  # one row per DP rank
        received = sum(s.sum(0) for s in tokens_sent(llm.model, ids))  # [R] over MoE layers and DP ranks
        return [o.outputs[0].token_ids for o in outs], received

    out_before, received_before = run()
    load = llm.expert_load()  # [L, E]
    phy2log_before = current_phy2log(llm.model.state, llm.model.config)
    logcnt_before = np.stack([np.bincount(row, minlength=load.shape[1]) for row in phy2log_before])
    start = time.perf_counter()
    phy2log, _, logcnt = llm.rebalance_experts()
    seconds = time.perf_counter() - start
    out_after, received_after = run()
    print(f"engine: embedded model, mesh 1x4 (CPU), {phy2log.shape[1]} slots, {len(PROMPTS)} prompts x "
          f"{max_tokens} greedy tokens, {load.sum() // load.shape[0]} choices per layer; outputs after rebalancing "
          f"{'identical' if out_after == out_before else 'DIFFERENT'}; rebalance_experts {seconds:.2f} s")
    print(HEADER)
    print(_row("engine", "identity (s mod E)", balancedness(load, phy2log_before, logcnt_before, ranks), 0.0))
    print(_row("engine", "EPLB (LLM.rebalance_experts)", balancedness(load, phy2log, logcnt, ranks), seconds))
    for label, received in (("before", received_before), ("after", received_after)):
        print(f"tokens received per expert rank {label}: {received.tolist()} "
              f"(max/mean {received.max() / received.mean():.3f})")
    print()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=58)
    p.add_argument("--tokens", type=int, default=1_000_000, help="tokens per layer (each picks 8 experts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load", type=pathlib.Path, default=EMBEDDED_LOAD,
                   help="measured loads: JSON with expert_load [layers][experts] (default: the embedded model's)")
    p.add_argument("--engine", action="store_true", help="also run the embedded model through the engine")
    args = p.parse_args()
    if args.engine:
        engine()
    measured(args.load)
    synthetic(args.layers, args.tokens, args.seed)


if __name__ == "__main__":
    main()
