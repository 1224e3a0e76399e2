"""DeepSeekMoE: router (V3 sigmoid + correction bias + group-limited top-k; V2 softmax), routed experts as a
grouped matmul over tokens sorted by expert, and shared experts.

Router semantics follow HF ``DeepseekV3TopkRouter`` / ``DeepseekV2TopkRouter`` (docs/architecture.md
"Reference semantics").
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.checkpoint.fp8 import scale_shape
from jaxinfer.config import ModelConfig
from jaxinfer.models import moe_cost
from jaxinfer.models.grouped_matmul import chunk_sizes, ladder_counts
from jaxinfer.models.layers import FP8_DTYPE, MLP, dense_weight, matmul_nt, matmul_nt_many, normal_init
from jaxinfer.parallel.dispatch import expert_parallel, slot_counts
from jaxinfer.parallel.placement import default_tables
from jaxinfer.parallel.plan import ParallelPlan, batch_shards
from jaxinfer.platform import current as current_platform
from kernels_pallas import fp8_grouped_gemm_contiguous, per_token_cast_to_fp8


def route(config: ModelConfig, logits: jax.Array, bias: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Router logits [N, E] (float32) -> (weights [N, K] float32, expert ids [N, K] int32)."""
    c = config
    n, e = logits.shape
    g = c.n_group
    if c.scoring_func == "sigmoid":  # V3 "noaux_tc"
        scores = jax.nn.sigmoid(logits)
        choice = scores + bias[None, :]
        fill = -jnp.inf
    else:  # V2 softmax scores
        scores = jax.nn.softmax(logits, axis=-1)
        choice = scores
        fill = 0.0  # HF DeepseekV2TopkRouter masks dropped groups with 0.0
    # Groups matter only when some are dropped (DeepSeek's Gate skips them for n_groups == 1, where a group of one
    # expert has no top 2; transformers' router computes them anyway and fails there).
    if c.topk_method != "greedy" and c.topk_group < g:
        grouped = choice.reshape(n, g, e // g)
        # V3: a group's score is the sum of its top-2 biased scores; V2's group_limited_greedy: its max
        group_scores = (jax.lax.top_k(grouped, 2)[0].sum(-1) if c.scoring_func == "sigmoid"
                        else grouped.max(-1))  # [N, G]
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
        self.weight = nnx.Param(normal_init(rngs, (config.n_routed_experts, config.hidden_size), jnp.float32))
        if config.scoring_func == "sigmoid":
            self.e_score_correction_bias = nnx.Param(jnp.zeros((config.n_routed_experts,), jnp.float32))

    def params(self) -> dict:
        out = {"weight": self.weight[...]}
        if self.config.scoring_func == "sigmoid":
            out["e_score_correction_bias"] = self.e_score_correction_bias[...]
        return out


def router_logits(params: dict, x: jax.Array) -> jax.Array:
    """x [N, D] -> float32 logits [N, E] (the router runs in float32, as in HF)."""
    return jnp.einsum("nd,ed->ne", x.astype(jnp.float32), params["weight"], precision=jax.lax.Precision.HIGHEST)


class Placement(nnx.Variable):
    """Expert placement tables (integers, not trained): filled by EPLB, identity by default."""


MoEPath = Literal["auto", "gather", "dense", "capacity", "grouped", "ragged"]
GATHER_UNROLL = 8  # the gather path unrolls up to this many assignments, and loops over more (compile time)


def expert_ffn(params: dict, x: jax.Array, weights: jax.Array, ids: jax.Array, dtype,
               fp8_compute: bool = False, path: MoEPath = "auto", sequence_tokens: int = 1) -> jax.Array:
    """x [M, D], weights/ids [M, K] (ids: slot in ``params``, -1 = not here) -> float32 [M, D]:
    sum_k weights[m, k] * expert_{ids[m, k]}(x[m]).

    params: gate_proj/up_proj [S, I, D], down_proj [S, D, I] (+ ``*_scale_inv`` block scales for FP8).
    path ("auto": the cheapest for this shape, dtype and backend by models/moe_cost.py; all compute the same
    per-token products, each expert output rounded to ``dtype``, so a token's result does not depend on the batch
    it is in or the path beyond the float rounding of the weighted sum):
      gather: per assignment, a matvec with its expert's weight matrices, indexed in place (in slot order).
      dense: every token through every slot, masked by the combine weights: [M, S, I].
      capacity: each slot's assignments scattered into a [S, C, D] buffer, C one of ``moe_cost.capacity_buckets``
        (lax.switch over the buckets), three batched matmuls with the weights as they are (no gather or copy of
        weights), results gathered back; the bucket of least predicted time for the step's routing, where the few
        assignments past it are computed one by one as the gather path does (moe_cost.capacity_plan).
      grouped: assignments sorted by slot, a loop over the slots in use, each slot's rows multiplied by its
        weights (indexed once) in chunks of a power-of-two ladder (grouped_matmul.chunk_sizes); ids -1 sort last
        and are never computed.
      ragged: assignments sorted by slot, three ``lax.ragged_dot_general`` grouped matmuls (a grouped GEMM
        kernel where the backend has one; XLA:CPU computes every row against every slot).
    fp8_compute: activations quantized per token per 128 channels and FP8 grouped GEMMs in DeepGEMM's contiguous
    layout (params hold e4m3 weights + block scales), whatever the path. sequence_tokens: x's rows come this many
    at a time from one sequence (the step's T; "auto" prices skewed routing too when > 1, moe_cost.choose)."""
    m, k = ids.shape
    num_slots, inter, hidden = params["gate_proj"].shape
    shape = moe_cost.ExpertShape(m, k, num_slots, hidden, inter, jnp.dtype(params["gate_proj"].dtype).itemsize)
    backend = current_platform().name
    if path == "auto":
        path = moe_cost.choose(shape, jnp.dtype(dtype).name, backend, sequence_tokens)
    if path not in moe_cost.PATHS:
        raise ValueError(f"path must be 'auto' or one of {moe_cost.PATHS}, got {path!r}")
    flat_ids = jnp.where(ids < 0, num_slots, ids).reshape(-1)  # [M*K]; num_slots: not on this rank
    if fp8_compute:
        return _fp8_ffn(params, x.astype(dtype), weights, flat_ids, num_slots, dtype)

    weight = functools.partial(_weight, params, dtype=dtype)  # name -> [S, out, in] in the compute dtype
    f32 = dict(preferred_element_type=jnp.float32)
    xd = x.astype(dtype)
    if path == "gather":
        # One matvec per assignment on its slot's weights taken with dynamic_index_in_dim, unrolled, written as
        # x @ w.T: XLA:CPU then fuses index and matvec into one loop that reads the weights in place (as
        # einsum("d,id->i") it copies each indexed slice first; a gather w[ids] copies [M*K, I, D] of weights).
        # Up to GATHER_UNROLL assignments the matvecs are unrolled; beyond, a scan over the assignments runs the
        # same body: compile time stays flat for somewhat more run time than unrolled (docs/benchmarks.md
        # "Routed-expert paths (CPU)"). The loop wants XLA's while-loop-invariant code motion off, as the engine's
        # CPU step programs compile (engine/step_program.py): with it, the conversion of every slot's bf16 weights
        # is hoisted out of the loop and runs in full each call (130 vs 4.5 ms for 16 assignments on 64 slots of
        # [512, 1024]).
        # Several rows: the assignments in slot order, so that one expert's run one after another (reading its
        # weights while the caches still hold them) and the slots' weights are read in ascending order (decode
        # steps of 8-32 rows: 21-29% less time per token on h1024_e64k8 at 8 rows, docs/benchmarks.md
        # "Routed-expert paths (CPU)"). Each assignment's products are the same either way.
        w = jnp.where(ids < 0, 0.0, weights).reshape(-1)  # [M*K]
        safe = jnp.minimum(flat_ids, num_slots - 1)  # [M*K]; other ranks' assignments get weight 0 below
        order = jnp.argsort(flat_ids, stable=True) if m > 1 else None  # [M*K]
        if order is not None:
            safe = safe[order]

        def row_of(n):  # [D]: the row of the n-th assignment computed
            return xd[n // k] if order is None else xd[order[n] // k]

        def assignment(n):  # [D]: expert safe[n] on its row
            return _expert_on_row(params, row_of(n), safe[n], dtype)

        # float32 weights: an assignment's gate and up products run as one matvec over their concatenation
        # (matmul_nt_many; the slices are still read in place). Not all 2 * top_k of a row's: over more operands
        # XLA:CPU's fused concatenation stops being memory-bound (V2-Lite's 6 experts of [1408, 2048]: 110 vs 7 ms),
        # and not for bf16 weights, where the per-element operand choice sits next to the convert
        # (docs/benchmarks.md "GEMM forms (CPU)", "Routed-expert paths (CPU)").
        if m * k <= GATHER_UNROLL and params["gate_proj"].dtype == jnp.float32 and dtype == jnp.float32:
            out = []
            for n in range(m * k):
                ws = [_slot_weight(params, name, safe[n], dtype) for name in ("gate_proj", "up_proj")]
                gate, up = matmul_nt_many(row_of(n)[None], ws)  # 2 x [1, I] float32
                out.append(_expert_down(params, gate[0], up[0], safe[n], dtype))
            out = jnp.stack(out)  # [M*K, D]
        elif m * k <= GATHER_UNROLL:
            out = jnp.stack([assignment(n) for n in range(m * k)])  # [M*K, D]
        else:
            out = jax.lax.scan(lambda c, n: (c, assignment(n)), None, jnp.arange(m * k))[1]  # [M*K, D]
        if order is not None:
            out = jnp.zeros_like(out).at[order].set(out)  # [M*K, D] in assignment order
        out = out.astype(dtype).astype(jnp.float32)  # rounded like the other paths' expert outputs
        return (out * w[:, None]).reshape(m, k, -1).sum(1)
    if path == "dense":
        combine = jnp.zeros((m, num_slots + 1), jnp.float32).at[
            jnp.arange(m)[:, None], jnp.where(ids < 0, num_slots, ids)].add(weights)[:, :num_slots]  # [M, S]
        s_, i_, d_ = params["gate_proj"].shape
        # As one [M, D] x [S*I, D]^T matmul (the Linear layers' form): written as "md,sid->msi", XLA:CPU first
        # transposes the [S, I, D] weights, every step.
        gate = matmul_nt(xd, weight("gate_proj").reshape(s_ * i_, d_)).reshape(m, s_, i_)
        up = matmul_nt(xd, weight("up_proj").reshape(s_ * i_, d_)).reshape(m, s_, i_)
        act = jax.nn.silu(gate.astype(dtype)) * up.astype(dtype)  # [M, S, I]
        out = jnp.einsum("msi,sdi->msd", act, weight("down_proj"), **f32)  # [M, S, D]
        out = out.astype(dtype).astype(jnp.float32)  # rounded like the grouped path's expert outputs
        return jnp.einsum("msd,ms->md", out, combine, precision=jax.lax.Precision.HIGHEST)

    if path == "capacity":
        plan = moe_cost.capacity_plan(shape, moe_cost.coefficients(backend, jnp.dtype(dtype).name))
        return _capacity_ffn(params, xd, weights, flat_ids, num_slots, dtype, plan)
    if path == "ragged":
        return _ragged_ffn(weight, xd, weights, flat_ids, num_slots, dtype)
    return _grouped_ffn(params, xd, weights, flat_ids, num_slots, dtype)


def _weight(params: dict, name: str, dtype) -> jax.Array:
    """[S, out, in] of ``params[name]`` in the compute dtype (FP8 weights dequantized)."""
    return dense_weight(params[name], params.get(name + "_scale_inv"), dtype)


def _expert_down(params: dict, gate: jax.Array, up: jax.Array, slot: jax.Array, dtype) -> jax.Array:
    """gate, up [I] (float32 products) -> float32 [D]: expert ``slot``'s down projection of silu(gate) * up."""
    act = jax.nn.silu(gate.astype(dtype)) * up.astype(dtype)  # [I]
    return jnp.dot(act, _slot_weight(params, "down_proj", slot, dtype).T, preferred_element_type=jnp.float32)


def _expert_on_row(params: dict, row: jax.Array, slot: jax.Array, dtype) -> jax.Array:
    """row [D] -> float32 [D]: expert ``slot`` on one row as three matrix-vector products on its weights indexed in
    place (the gather path's, and the capacity path's for assignments past its bucket)."""
    f32 = dict(preferred_element_type=jnp.float32)
    gate = jnp.dot(row, _slot_weight(params, "gate_proj", slot, dtype).T, **f32)  # [I]
    up = jnp.dot(row, _slot_weight(params, "up_proj", slot, dtype).T, **f32)
    return _expert_down(params, gate, up, slot, dtype)


def _slot_weight(params: dict, name: str, slot: jax.Array, dtype) -> jax.Array:
    """[out, in] of one slot of ``params[name]`` in the compute dtype, taken with dynamic_index_in_dim (read in
    place) and dequantized after indexing (FP8 weights: only that slot's blocks)."""
    scale = params.get(name + "_scale_inv")
    pick = functools.partial(jax.lax.dynamic_index_in_dim, index=slot, keepdims=False)
    return dense_weight(pick(params[name]), None if scale is None else pick(scale), dtype)


def _sorted_by_slot(flat_ids: jax.Array, k: int, num_slots: int):
    """flat_ids [M*K] (num_slots = not here) -> (order [M*K]: assignments sorted by slot, other ranks' last;
    token [M*K]: the source row of each sorted assignment; group_sizes [S] int32)."""
    order = jnp.argsort(flat_ids, stable=True)
    group_sizes = jnp.bincount(flat_ids, length=num_slots + 1)[:num_slots].astype(jnp.int32)
    return order, order // k, group_sizes


def _grouped_forward(params: dict, xd: jax.Array, weights: jax.Array, flat_ids: jax.Array, num_slots: int,
                     dtype) -> jax.Array:
    """The "grouped" path of expert_ffn: xd [M, D], weights [M, K], flat_ids [M*K] -> float32 [M, D].

    Assignments sorted by slot; a loop over the slots in use takes each slot's three weight matrices once (indexed,
    so copied once per slot and step) and multiplies its rows in chunks of grouped_matmul's ladder: power-of-two
    sizes, largest first, each a loop over as many chunks as fit (traced trip counts). Work follows the real
    per-slot counts plus fewer rows than the slot's last chunk. The chunks read and write the sorted rows in
    place, not a padded copy: the last chunk of a slot runs past its rows into the next slots' (or the zero pad at
    the end), whose results the later slots then overwrite, as the loops go in sorted order; rows of other ranks
    (sorted last) are never computed and are masked out. The rows and the slot's weights stay in the compute dtype
    where the platform multiplies bf16 natively (bf16 weights read as stored, bf16 products at about twice the
    float32 rate); on a CPU without bf16 instructions they are held in float32 (values of the compute dtype, so the
    same products), whose products run faster there than bf16's (platform.NATIVE_BF16_CPU_FLAGS). On CPU the
    results are held in float32 either way: into a bf16 buffer XLA:CPU's update copied the whole buffer for every
    chunk. One size of tile for every row, padded per slot, with the weights indexed per tile, was
    1.2-1.6x slower on the grid's prefill shapes; batching the tiles into one matmul, as grouped GEMM kernels do,
    makes XLA:CPU gather a copy of the weights for every tile (docs/benchmarks.md "Routed-expert paths (CPU)").
    The loops have traced trip counts, so the path has no reverse-mode derivative of its own: _grouped_ffn gives it
    the capacity path's."""
    m, k = weights.shape
    order, token, group_sizes = _sorted_by_slot(flat_ids, k, num_slots)
    sizes = chunk_sizes(m)
    d = xd.shape[1]
    here = current_platform()
    held = jnp.float32 if here.is_cpu else dtype  # the results' buffer (above)
    ops = dtype if here.native_bf16 else held  # the products' operands (above)
    # [M*K + top, D]: the pad holds the last slot's overhang, less than a chunk (dynamic_slice would clamp it back)
    rows = jnp.concatenate([xd[token], jnp.zeros((sizes[0], d), dtype)]).astype(ops)
    start = jnp.cumsum(group_sizes) - group_sizes  # [S] first sorted row of each slot
    active = jnp.nonzero(group_sizes, size=num_slots, fill_value=0)[0]  # [S] the slots in use, ascending

    def one_slot(j, out):  # out [M*K + top, D]: the rows of active[j] computed
        slot = active[j]
        w = {name: _slot_weight(params, name, slot, dtype).astype(ops)  # [I, D], [I, D], [D, I]
             for name in Experts.PROJ}

        def chunks(size, first):
            def chunk(c, out):  # rows first + c * size ... + size
                r = first + c * size
                x = jax.lax.dynamic_slice_in_dim(rows, r, size)  # [size, D]
                gate = matmul_nt(x, w["gate_proj"])  # [size, I]
                up = matmul_nt(x, w["up_proj"])
                act = jax.nn.silu(gate.astype(dtype)) * up.astype(dtype)  # [size, I]
                y = matmul_nt(act.astype(ops), w["down_proj"]).astype(dtype)  # [size, D]
                return jax.lax.dynamic_update_slice_in_dim(out, y.astype(held), r, 0)
            return chunk

        first = start[slot]
        for size, n in zip(sizes, ladder_counts(group_sizes[slot], sizes)):
            out = jax.lax.fori_loop(0, n, chunks(size, first), out)
            first = first + n * size
        return out

    out = jax.lax.fori_loop(0, jnp.count_nonzero(group_sizes), one_slot, jnp.zeros_like(rows, held))[:m * k]
    valid = flat_ids[order] < num_slots  # [M*K]
    out = jnp.where(valid[:, None], out.astype(jnp.float32), 0.0)
    w = jnp.where(valid, weights.reshape(-1)[order], 0.0)  # [M*K]
    return jnp.zeros((m, d), jnp.float32).at[token].add(out * w[:, None])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _grouped_ffn(params: dict, xd: jax.Array, weights: jax.Array, flat_ids: jax.Array, num_slots: int,
                 dtype) -> jax.Array:
    """_grouped_forward, differentiable (jaxinfer/train): the derivative is the capacity path's with nothing past
    its bucket (_capacity_bwd), which computes the same function with loops of fixed length."""
    return _grouped_forward(params, xd, weights, flat_ids, num_slots, dtype)


def _grouped_fwd(params, xd, weights, flat_ids, num_slots, dtype):
    return _grouped_forward(params, xd, weights, flat_ids, num_slots, dtype), (params, xd, weights, flat_ids)


def _capacity_bwd(num_slots, dtype, residuals, g):
    """The derivative of the grouped and capacity paths: _capacity_forward's with no plan (a bucket that holds the
    busiest slot; no loop of traced length, so reverse mode differentiates it)."""
    params, xd, weights, flat_ids = residuals

    def capacity(params, xd, weights):
        return _capacity_forward(params, xd, weights, flat_ids, num_slots, dtype, None)

    return (*jax.vjp(capacity, params, xd, weights)[1](g), None)


_grouped_ffn.defvjp(_grouped_fwd, _capacity_bwd)


def _fp8_ffn(params: dict, xd: jax.Array, weights: jax.Array, flat_ids: jax.Array, num_slots: int,
             dtype) -> jax.Array:
    """expert_ffn with fp8_compute: assignments sorted by slot, activations quantized per token per 128 channels,
    three FP8 grouped GEMMs in DeepGEMM's contiguous layout (kernels_pallas; -1 rows: other ranks)."""
    m, k = weights.shape
    order, token, _ = _sorted_by_slot(flat_ids, k, num_slots)
    group_ids = jnp.where(flat_ids[order] < num_slots, flat_ids[order], -1)  # [M*K], -1 = not here

    def mm(a, name):
        q, q_scale = per_token_cast_to_fp8(a)
        return fp8_grouped_gemm_contiguous(q, q_scale, params[name], params[name + "_scale_inv"], group_ids,
                                           out_dtype=dtype)

    xs = xd[token]  # [M*K, D]
    act = jax.nn.silu(mm(xs, "gate_proj")) * mm(xs, "up_proj")  # [M*K, I]
    out = mm(act, "down_proj").astype(jnp.float32) * weights.reshape(-1)[order][:, None]  # [M*K, D]
    return jnp.zeros((m, xd.shape[-1]), jnp.float32).at[token].add(out)


def _ragged_ffn(weight, xd: jax.Array, weights: jax.Array, flat_ids: jax.Array, num_slots: int,
                dtype) -> jax.Array:
    """The "ragged" path of expert_ffn: xd [M, D], weights [M, K], flat_ids [M*K] (num_slots = not here) ->
    float32 [M, D]. Assignments sorted by slot (other ranks' last: past sum(group_sizes), so never computed), three
    grouped matmuls that contract the weights' last axis as they are stored ([S, I, D], [S, D, I]: no transposed
    copy), results scattered back to their rows."""
    m, k = weights.shape
    order, token, group_sizes = _sorted_by_slot(flat_ids, k, num_slots)
    numbers = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                                lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])

    def mm(a, name):  # a [M*K, in] sorted by slot -> float32 [M*K, out]
        return jax.lax.ragged_dot_general(a, weight(name), group_sizes, numbers,
                                          preferred_element_type=jnp.float32)

    xs = xd[token]  # [M*K, D]
    act = jax.nn.silu(mm(xs, "gate_proj").astype(dtype)) * mm(xs, "up_proj").astype(dtype)  # [M*K, I]
    out = mm(act, "down_proj").astype(dtype).astype(jnp.float32)  # [M*K, D]
    w = jnp.where(flat_ids[order] < num_slots, weights.reshape(-1)[order], 0.0)  # [M*K]
    return jnp.zeros((m, xd.shape[-1]), jnp.float32).at[token].add(out * w[:, None])


def _capacity_forward(params: dict, xd: jax.Array, weights: jax.Array, flat_ids: jax.Array, num_slots: int, dtype,
                      plan: tuple | None) -> jax.Array:
    """The "capacity" path of expert_ffn: xd [M, D], weights [M, K], flat_ids [M*K] (num_slots = not here) ->
    float32 [M, D]. The batched matmuls (matmul_nt: the weights as left operand for up to 64 rows per slot) read
    each slot's weights in place; measured on CPU faster than the dense path past the gather path's batches and
    than the grouped path while a balanced slot holds under 64 rows (decode batches; docs/benchmarks.md
    "Routed-expert paths (CPU)").

    plan (moe_cost.capacity_plan: buckets, seconds of each bucket's batched products, seconds of one assignment on
    its own): the bucket of least predicted seconds for this step's routing, its batched products plus the
    assignments past it, which a loop then computes one by one in slot order (_expert_on_row; a traced trip
    count). None: the smallest bucket that holds the busiest slot, nothing past it (the derivative's form)."""
    m, k = weights.shape
    weight = functools.partial(_weight, params, dtype=dtype)  # name -> [S, out, in] in the compute dtype
    order = jnp.argsort(flat_ids, stable=True)  # [M*K]
    counts = jnp.bincount(flat_ids, length=num_slots + 1)  # [S + 1]; the last: assignments on other ranks
    starts = jnp.cumsum(counts) - counts  # [S + 1]
    pos = jnp.zeros_like(flat_ids).at[order].set(jnp.arange(m * k) - starts[flat_ids[order]])  # [M*K] rank in slot
    token = jnp.arange(m * k) // k  # [M*K] source row of each assignment

    def run(capacity, xd):
        buf = jnp.zeros((num_slots, capacity, xd.shape[1]), dtype).at[flat_ids, pos].set(
            xd[token], mode="drop")  # [S, C, D]; other ranks' assignments (slot S) and those past C dropped
        gate = matmul_nt(buf, weight("gate_proj"))  # [S, C, I]
        up = matmul_nt(buf, weight("up_proj"))
        act = jax.nn.silu(gate.astype(dtype)) * up.astype(dtype)  # [S, C, I]
        out = matmul_nt(act, weight("down_proj")).astype(dtype)  # [S, C, D]
        return out.at[flat_ids, pos].get(mode="fill", fill_value=0).astype(jnp.float32)  # [M*K, D]

    buckets = moe_cost.capacity_buckets(m, k, num_slots) if plan is None else plan[0]
    caps = jnp.asarray(buckets, jnp.int32)  # [B]
    if plan is None:
        branch = jnp.searchsorted(caps, jnp.max(counts[:num_slots]))  # the first bucket >= busiest
    else:
        _, batched, per_assignment = plan
        past = jnp.maximum(counts[None, :num_slots] - caps[:, None], 0).sum(1)  # [B] assignments past each bucket
        branch = jnp.argmin(jnp.asarray(batched, jnp.float32) + past * jnp.float32(per_assignment))  # ties: smaller
    out = jax.lax.switch(branch, [functools.partial(run, c) for c in buckets], xd)  # [M*K, D]
    if plan is not None:  # the assignments past the bucket, in slot order (a slot's weights stay in the caches)
        beyond = (pos >= caps[branch]) & (flat_ids < num_slots)  # [M*K]
        todo = order[jnp.nonzero(beyond[order], size=m * k, fill_value=0)[0]]  # [M*K], the first past[branch] used

        def one(j, out):  # out [M*K, D]: assignment todo[j] computed
            a = todo[j]
            y = _expert_on_row(params, xd[a // k], flat_ids[a], dtype).astype(dtype).astype(jnp.float32)  # [D]
            return jax.lax.dynamic_update_slice_in_dim(out, y[None], a, 0)

        out = jax.lax.fori_loop(0, past[branch], one, out)
    w = jnp.where(flat_ids < num_slots, weights.reshape(-1), 0.0)  # [M*K]
    return (out * w[:, None]).reshape(m, k, -1).sum(1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _capacity_ffn(params: dict, xd: jax.Array, weights: jax.Array, flat_ids: jax.Array, num_slots: int, dtype,
                  plan: tuple) -> jax.Array:
    """_capacity_forward with a plan, differentiable: its loop over the assignments past the bucket has a traced
    trip count, so the derivative is that of the same function with no plan (_capacity_bwd)."""
    return _capacity_forward(params, xd, weights, flat_ids, num_slots, dtype, plan)


def _capacity_fwd(params, xd, weights, flat_ids, num_slots, dtype, plan):
    out = _capacity_forward(params, xd, weights, flat_ids, num_slots, dtype, plan)
    return out, (params, xd, weights, flat_ids)


def _capacity_ffn_bwd(num_slots, dtype, plan, residuals, g):
    del plan  # the derivative is the bucket-that-holds-all form's whatever bucket the forward took
    return _capacity_bwd(num_slots, dtype, residuals, g)


_capacity_ffn.defvjp(_capacity_fwd, _capacity_ffn_bwd)


class Experts(nnx.Module):
    """Routed experts in physical slots: gate_proj/up_proj [S, I, D], down_proj [S, D, I] (+ FP8 block scales),
    S = n_routed_experts + redundant slots, with the placement tables that map experts to slots."""

    PROJ = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, fp8: str = "off",
                 num_redundant: int = 0):
        e, d, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        s = e + num_redundant
        self.dtype = dtype
        self.fp8 = fp8
        for name, shape in zip(self.PROJ, ((s, i, d), (s, i, d), (s, d, i))):
            w = normal_init(rngs, shape, jnp.float32)
            setattr(self, name, nnx.Param(w.astype(FP8_DTYPE if fp8 != "off" else dtype)))
            if fp8 != "off":
                setattr(self, name + "_scale_inv", nnx.Param(jnp.ones(scale_shape(shape), jnp.float32)))
        placement = default_tables(e, s)
        self.phy2log = Placement(jnp.asarray(placement["phy2log"]))  # [S]
        self.log2phy = Placement(jnp.asarray(placement["log2phy"]))  # [E, max_replicas], -1 padded
        self.logcnt = Placement(jnp.asarray(placement["logcnt"]))  # [E]

    def params(self) -> dict:
        names = self.PROJ + (tuple(p + "_scale_inv" for p in self.PROJ) if self.fp8 != "off" else ())
        return {name: getattr(self, name)[...] for name in names}

    def placement(self) -> dict:
        return {"log2phy": self.log2phy[...], "logcnt": self.logcnt[...]}


def physical_slots(placement: dict, ids: jax.Array) -> jax.Array:
    """Logical expert ids [N, K] -> physical slots [N, K]: replica (n + k) mod copies of the expert, with n the
    token's index on its DP rank: deterministic, and spread over the copies of a hot expert."""
    n, k = ids.shape
    replica = (jnp.arange(n)[:, None] + jnp.arange(k)[None, :]) % placement["logcnt"][ids]
    return placement["log2phy"][ids, replica]


def logical_load(slot_load: jax.Array, log2phy: jax.Array) -> jax.Array:
    """Per-slot counts [P, S] -> per-expert counts [P, E]: the sum over each expert's copies (log2phy [E, W],
    -1 padded). A gather along the slot axis: rows (DP ranks) stay where they are."""
    copies = jnp.take(slot_load, jnp.maximum(log2phy, 0), axis=1)  # [P, E, W]
    return jnp.where(log2phy[None] >= 0, copies, 0).sum(-1).astype(jnp.int32)


class MoE(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, fp8: str = "off",
                 plan: ParallelPlan | None = None):
        self.dtype = dtype
        self.plan = plan
        self.gate = Router(config, rngs=rngs)
        self.experts = Experts(config, rngs=rngs, dtype=dtype, fp8=fp8,
                               num_redundant=plan.num_redundant_experts if plan else 0)
        shared = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = nnx.data(
            MLP(config.hidden_size, shared, rngs=rngs, dtype=dtype, fp8=fp8,
                row_shards=batch_shards(plan)) if shared else None)  # on the whole batch

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [B, T, D] -> [B, T, D]."""
        return self.forward(x)[0]

    def forward(self, x: jax.Array, token_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """x [B, T, D], token_mask [B, T] bool (False: padding, which the routed experts neither compute nor count;
        None: every token counts) -> (y [B, T, D], load int32 [P, E]): the (token, choice) pairs routed to each
        logical expert, per DP rank (P = mesh devices; 1 without a mesh). Per rank so that the step adds no
        collective: callers sum over P when they read it. Unused results cost nothing under jit (XLA drops them)."""
        config = self.gate.config

        def route_fn(params, flat):  # [N, D] -> weights, physical slots [N, K]
            weights, ids = route(config, router_logits(params["router"], flat),
                                 params["router"].get("e_score_correction_bias"))
            return weights, physical_slots(params["placement"], ids)

        route_params = {"router": self.gate.params(), "placement": self.experts.placement()}
        ffn = functools.partial(expert_ffn, dtype=self.dtype, fp8_compute=self.experts.fp8 == "compute",
                                path=self.plan.moe_path if self.plan else "auto", sequence_tokens=x.shape[1])
        if self.plan is None:  # one device: route all tokens, every slot is local
            b, t, d = x.shape
            flat = x.reshape(b * t, d)
            weights, slots = route_fn(route_params, flat)
            mask = None if token_mask is None else token_mask.reshape(b * t)
            if mask is not None:  # padding computes nothing (and cannot inflate the capacity path's buckets)
                slots = jnp.where(mask[:, None], slots, -1)
            y = ffn(self.experts.params(), flat, weights, slots).reshape(x.shape)
            slot_load = slot_counts(slots, self.experts.phy2log[...].shape[0], mask)[None]  # [1, S]
            load = logical_load(slot_load, self.experts.log2phy[...])  # [1, E]
            if hasattr(self, "__captures__"):  # only under nnx.capture (jaxinfer/train); no-op otherwise
                self.sow(nnx.Intermediate, "expert_load", load[0])  # [E]
        else:
            y, sent, slot_load = expert_parallel(self.plan.mesh, x, route_params, self.experts.params(), route_fn,
                                                 ffn, fp8=self.plan.fp8_dispatch, mask=token_mask)
            load = logical_load(slot_load, self.experts.log2phy[...])  # [P, E], rows stay on their devices
            if hasattr(self, "__captures__"):  # only under nnx.capture (parallel/comm.py); no-op otherwise
                self.sow(nnx.Intermediate, "tokens_sent", sent)  # [devices, R]
        y = y.astype(self.dtype)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y, load
