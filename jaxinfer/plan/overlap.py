"""Dual-microbatch overlap, stage by stage: how long two microbatches take to run a stack of MoE layers when one
microbatch's expert all-to-all runs while the other computes (DeepSeek's two-microbatch overlap; docs/plan.md).

DeepSeek describes the schedules in words and pictures (open-infra-index day 6: prefill alternates two
microbatches; decode subdivides attention into two steps and runs a 5-stage pipeline; profile-data: decode's
all-to-all holds no SMs, the system waits for it after the computation has finished). SGLang reproduced them as
lists of operations cut into stages at yield points (python/sglang/srt/operations_strategy.py,
``_compute_moe_deepseek_blog_decode`` and ``_compute_moe_deepseek_blog_prefill``): ``DECODE`` and ``PREFILL``
below are those lists, with the operations that cost time here. A stage ends at a yield; the layers' lists are
concatenated, so a layer's last stage and the next layer's first are one. The two microbatches alternate stages,
the second ``delta`` stages behind the first (SGLang's ``execute_overlapped_operations``).

Timing (``timeline``): one compute stream runs the stages in that order (the GPU computes one microbatch at a
time); "issue" starts a transfer on one communication stream (transfers run in the order issued, each after the
previous one); "wait" holds the compute stream until that microbatch's transfer of that layer has arrived. So a
transfer is hidden only by the compute that the schedule places between its issue and its wait, not by the whole
step's: where a stage's transfer outlasts the compute beside it, the step waits, even if the step's compute
exceeds its communication in total.
"""

from __future__ import annotations

import dataclasses

COMPUTE, ISSUE, WAIT, YIELD = "compute", "issue", "wait", "yield"
# Names of a layer's ops: compute (attention before its core: q / kv projections; the core with what follows it
# up to the router; the shared experts; the routed experts) and the two transfers.
OPS = ("prepare", "core", "shared", "experts", "dispatch", "combine")


@dataclasses.dataclass(frozen=True)
class Program:
    """One microbatch's operations for one MoE layer, (kind, op name) with YIELD ends of stages, and the stages the
    second microbatch runs behind the first."""

    ops: tuple[tuple[str, str], ...]
    delta: int


_Y = (YIELD, "")
# Decode, 5 stages a layer (SGLang: op_comm_prepare_attn, self_attn.op_prepare | self_attn.op_core,
# op_comm_prepare_mlp, op_gate, op_select_experts | op_dispatch_a, op_shared_experts | op_dispatch_b, op_experts,
# op_combine_a | op_combine_b | op_output; tbo_delta_stages=2).
DECODE = Program(((COMPUTE, "prepare"), _Y, (COMPUTE, "core"), _Y, (ISSUE, "dispatch"), (COMPUTE, "shared"), _Y,
                  (WAIT, "dispatch"), (COMPUTE, "experts"), (ISSUE, "combine"), _Y, (WAIT, "combine"), _Y), delta=2)
# Prefill, 2 stages a layer (SGLang: ..., self_attn.op_prepare, self_attn.op_core, op_gate, op_select_experts,
# op_dispatch_a | op_dispatch_b, op_experts, op_combine_a | op_shared_experts, op_combine_b, op_output;
# tbo_delta_stages=0).
PREFILL = Program(((COMPUTE, "prepare"), (COMPUTE, "core"), (ISSUE, "dispatch"), _Y, (WAIT, "dispatch"),
                   (COMPUTE, "experts"), (ISSUE, "combine"), _Y, (COMPUTE, "shared"), (WAIT, "combine")), delta=0)
PROGRAMS = {"decode": DECODE, "prefill": PREFILL}


def stages(program: Program, num_layers: int) -> list[list[tuple[str, str, int]]]:
    """One microbatch's stages over ``num_layers`` layers: lists of (kind, op, layer), the layers' operations
    concatenated and cut at the yields."""
    out: list[list[tuple[str, str, int]]] = [[]]
    for layer in range(num_layers):
        for kind, op in program.ops:
            if kind == YIELD:
                out.append([])
            else:
                out[-1].append((kind, op, layer))
    return out


def timeline(program: Program, layers: list[dict[str, float]]) -> float:
    """Seconds for two microbatches to run ``layers`` (each: one microbatch's seconds per op of OPS in that
    layer) under ``program`` (see the module doc). Both microbatches take the same seconds per op."""
    own = stages(program, len(layers))
    delta = min(program.delta, len(own))
    order = ([("a", s) for s in own[:delta]]
             + [x for pair in zip((("a", s) for s in own[delta:]), (("b", s) for s in own)) for x in pair]
             + [("b", s) for s in own[len(own) - delta:]])
    t = link_free = 0.0
    arrives: dict[tuple[str, str, int], float] = {}
    for microbatch, stage in order:
        for kind, op, layer in stage:
            seconds = layers[layer][op]
            if kind == COMPUTE:
                t += seconds
            elif kind == ISSUE:
                link_free = max(t, link_free) + seconds
                arrives[microbatch, op, layer] = link_free
            else:
                t = max(t, arrives[microbatch, op, layer])
    return t
