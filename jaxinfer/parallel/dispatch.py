"""Expert-parallel MoE: dispatch tokens to the expert ranks that hold their experts, compute, combine back.

Runs inside ``jax.shard_map`` over the mesh: the batch is split over all devices (DP ranks), routed-expert slots
over the ``expert`` axis. DeepEP's rule: a token goes at most once to each expert rank that holds one of its
chosen experts, whatever the number of its experts there; the receiver applies all of them and sends back one
weighted sum. Buffers are worst case, [R peers, N local tokens, D]: fixed shapes, nothing ever dropped.

FP8 dispatch quantizes each token per 128 channels (e4m3 + float32 scales, DeepEP's low-latency format); the
combine is sent in the model dtype (BF16 in deployment).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kernels_pallas.fp8.quant import dequantize_per_token, per_token_cast_to_fp8

EXPERT_AXIS = "expert"
BATCH_AXES = ("data", "expert")
QUANT_GROUP = 128  # DeepEP / DeepGEMM activation scaling granularity: per token per 128 channels


def slot_counts(slots: jax.Array, num_slots: int, mask: jax.Array | None = None) -> jax.Array:
    """Physical slots [N, K] (mask [N] bool: tokens to count, None = all) -> int32 [S]: choices per slot."""
    if mask is not None:
        slots = jnp.where(mask[:, None], slots, num_slots)  # not counted: the extra bin
    return jnp.bincount(slots.reshape(-1), length=num_slots + 1)[:num_slots].astype(jnp.int32)


def dispatch_combine(x: jax.Array, weights: jax.Array, slots: jax.Array, expert_params: dict,
                     expert_fn: Callable, *, slots_per_rank: int, fp8: bool) -> tuple[jax.Array, jax.Array]:
    """Per device (inside shard_map). x [N, D] local tokens, weights/slots [N, K] (physical slot ids),
    expert_params: this rank's slots [S_loc, ...]; expert_fn(params, x [M, D], w [M, K], local ids [M, K] with
    -1 = not here) -> float32 [M, D]. Returns (float32 [N, D]: sum_k weights * expert(x), int32 [R]: the number
    of tokens sent to each expert rank, for communication accounting)."""
    ranks = jax.lax.axis_size(EXPERT_AXIS)
    n, d = x.shape
    dest = slots // slots_per_rank  # [N, K] expert rank of each choice
    peer = jnp.arange(ranks)[:, None, None]  # [R, 1, 1]
    mine = dest[None] == peer  # [R, N, K]
    send_ids = jnp.where(mine, (slots % slots_per_rank)[None], -1)  # [R, N, K]
    send_w = jnp.where(mine, weights[None], 0.0)  # [R, N, K]
    needed = mine.any(-1)[..., None]  # [R, N, 1]: send the token to this peer at all?

    a2a = functools.partial(jax.lax.all_to_all, axis_name=EXPERT_AXIS, split_axis=0, concat_axis=0, tiled=True)
    if fp8:
        q, scale = per_token_cast_to_fp8(x, group=QUANT_GROUP)  # [N, D] e4m3, [N, G]
        recv_q = a2a(jnp.where(needed, q[None], jnp.zeros((), q.dtype)))  # [R, N, D]
        recv_s = a2a(jnp.where(needed, scale[None], 0.0))  # [R, N, G]
        recv_x = dequantize_per_token(recv_q.reshape(ranks * n, d), recv_s.reshape(ranks * n, -1),
                                      group=QUANT_GROUP).astype(x.dtype)
    else:
        recv_x = a2a(jnp.where(needed, x[None], jnp.zeros((), x.dtype))).reshape(ranks * n, d)
    recv_ids = a2a(send_ids).reshape(ranks * n, -1)  # [R*N, K]
    recv_w = a2a(send_w).reshape(ranks * n, -1)
    y = expert_fn(expert_params, recv_x, recv_w, recv_ids)  # [R*N, D] float32, zero where nothing is mine
    back = a2a(y.astype(x.dtype).reshape(ranks, n, d))  # combine in the model dtype: [R, N, D]
    return back.astype(jnp.float32).sum(0), needed[..., 0].sum(1).astype(jnp.int32)


def expert_parallel(mesh, x: jax.Array, route_params: dict, expert_params: dict, route_fn: Callable,
                    expert_fn: Callable, *, fp8: bool, mask: jax.Array | None = None
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Global view: x [B, T, D] with the batch split over all devices. Each device routes its own tokens
    (route_fn(route_params, x [N, D]) -> weights, slots [N, K]; route_params replicated), then dispatches and
    combines over `expert`. expert_params: slots on axis 0, split over `expert`. mask [B, T] bool: the tokens to
    send, compute and count in the slot loads (None = all; masked tokens get zeros). Returns (float32 [B, T, D],
    int32 [devices, R]: tokens each DP rank sent to each expert rank, int32 [devices, S]: (token, choice) pairs of
    each DP rank's unmasked tokens per physical slot; per device, so nothing is reduced across devices here)."""
    num_slots = next(iter(expert_params.values())).shape[0]
    slots_per_rank = num_slots // mesh.shape[EXPERT_AXIS]
    batch = P(BATCH_AXES)
    if mask is None:
        mask = jnp.ones(x.shape[:2], bool)

    def local(x, mask, route_params, expert_params):
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        weights, slots = route_fn(route_params, flat)
        slots = jnp.where(mask.reshape(b * t)[:, None], slots, -1)  # masked tokens: sent nowhere, not computed
        out, sent = dispatch_combine(flat, weights, slots, expert_params, expert_fn,
                                     slots_per_rank=slots_per_rank, fp8=fp8)
        load = slot_counts(slots, num_slots, mask.reshape(b * t))  # [S]
        return out.reshape(b, t, d), sent[None], load[None]

    in_specs = (batch, batch, jax.tree.map(lambda _: P(), route_params),
                jax.tree.map(lambda _: P(EXPERT_AXIS), expert_params))
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=(batch, batch, batch))(
        x, mask, route_params, expert_params)
