"""DeepSeekMoE: router (V3 sigmoid + correction bias + group-limited top-k; V2 softmax), routed experts as a
grouped matmul over tokens sorted by expert, and shared experts.

Router semantics follow HF ``DeepseekV3TopkRouter`` / ``DeepseekV2TopkRouter`` (DESIGN.md "Router").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.checkpoint.fp8 import scale_shape
from jaxinfer.models.grouped_matmul import grouped_matmul, tile_plan
from jaxinfer.models.layers import FP8_DTYPE, MLP, _normal, dense_weight


def route(config: ModelConfig, logits: jax.Array, bias: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Router logits [N, E] (float32) -> (weights [N, K] float32, expert ids [N, K] int32)."""
    c = config
    n, e = logits.shape
    g = c.n_group
    if c.scoring_func == "sigmoid":  # V3 "noaux_tc"
        scores = jax.nn.sigmoid(logits)
        choice = scores + bias[None, :]
        # group score = sum of the top-2 biased scores per group; keep topk_group groups
        group_scores = jax.lax.top_k(choice.reshape(n, g, e // g), 2)[0].sum(-1)  # [N, G]
        fill = -jnp.inf
    else:  # V2 softmax scores; group_limited_greedy uses the group max
        scores = jax.nn.softmax(logits, axis=-1)
        choice = scores
        group_scores = choice.reshape(n, g, e // g).max(-1)
        fill = 0.0  # HF DeepseekV2TopkRouter masks dropped groups with 0.0
    if c.topk_method != "greedy" and c.topk_group < g:
        top_groups = jax.lax.top_k(group_scores, c.topk_group)[1]  # [N, topk_group]
        keep = jnp.zeros((n, g), bool).at[jnp.arange(n)[:, None], top_groups].set(True)
        choice = jnp.where(jnp.repeat(keep, e // g, axis=1), choice, fill)
    ids = jax.lax.top_k(choice, c.num_experts_per_tok)[1]  # [N, K]
    weights = jnp.take_along_axis(scores, ids, axis=1)
    if c.scoring_func == "sigmoid" and c.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * c.routed_scaling_factor, ids.astype(jnp.int32)


class Router(nnx.Module):
    """gate.weight [E, D] and (V3) e_score_correction_bias [E], both kept in float32 as HF does."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.weight = nnx.Param(_normal(rngs, (config.n_routed_experts, config.hidden_size), jnp.float32))
        if config.scoring_func == "sigmoid":
            self.e_score_correction_bias = nnx.Param(jnp.zeros((config.n_routed_experts,), jnp.float32))

    def __call__(self, x: jax.Array):
        logits = jnp.einsum("nd,ed->ne", x.astype(jnp.float32), self.weight[...],
                            precision=jax.lax.Precision.HIGHEST)  # [N, E]
        bias = self.e_score_correction_bias[...] if self.config.scoring_func == "sigmoid" else None
        return route(self.config, logits, bias)


class Experts(nnx.Module):
    """Routed experts stacked: gate_proj/up_proj [E, I, D], down_proj [E, D, I] (+ FP8 block scales)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, quantized=False):
        e, d, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.dtype = dtype
        self.quantized = quantized
        for name, shape in (("gate_proj", (e, i, d)), ("up_proj", (e, i, d)), ("down_proj", (e, d, i))):
            w = _normal(rngs, shape, jnp.float32)
            setattr(self, name, nnx.Param(w.astype(FP8_DTYPE if quantized else dtype)))
            if quantized:
                setattr(self, name + "_scale_inv", nnx.Param(jnp.ones(scale_shape(shape), jnp.float32)))

    def weight(self, name: str) -> jax.Array:
        scale = getattr(self, name + "_scale_inv")[...] if self.quantized else None
        return dense_weight(getattr(self, name)[...], scale, self.dtype)

    def __call__(self, x: jax.Array, weights: jax.Array, ids: jax.Array) -> jax.Array:
        """x [N, D], weights/ids [N, K] -> sum_k weights[n, k] * expert_{ids[n, k]}(x[n])  [N, D].

        Assignments are sorted by expert so each expert's rows are contiguous, then one grouped matmul per
        projection (grouped_matmul.py; no Python loop over experts)."""
        n, k = ids.shape
        num_experts = self.gate_proj.shape[0]
        flat_ids = ids.reshape(-1)  # [N*K]
        order = jnp.argsort(flat_ids, stable=True)  # [N*K]
        token = order // k  # source token of each sorted row
        group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)  # [E]
        plan = tile_plan(group_sizes, n * k)
        xs = x.astype(self.dtype)[token]  # [N*K, D]

        def mm(a, name):
            return grouped_matmul(a, self.weight(name), group_sizes, plan=plan).astype(self.dtype)

        act = jax.nn.silu(mm(xs, "gate_proj")) * mm(xs, "up_proj")  # [N*K, I]
        out = mm(act, "down_proj").astype(jnp.float32) * weights.reshape(-1)[order][:, None]  # [N*K, D]
        return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token].add(out)


class MoE(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, quantized=False):
        self.dtype = dtype
        self.gate = Router(config, rngs=rngs)
        self.experts = Experts(config, rngs=rngs, dtype=dtype, quantized=quantized)
        shared = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = nnx.data(
            MLP(config.hidden_size, shared, rngs=rngs, dtype=dtype, quantized=quantized) if shared else None)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [B, T, D] -> [B, T, D]."""
        flat = x.reshape(-1, x.shape[-1])  # [N, D]
        weights, ids = self.gate(flat)
        y = self.experts(flat, weights, ids).astype(self.dtype).reshape(x.shape)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y
