"""Greedy tokens from the LM head, exactly, while reading about a quarter of its float32 bytes.

Why: a batch-1 decode step on CPU is bound by streaming the weights from memory, and the head is the largest
single weight (8192 x 512 float32 in the benchmark model; its share of a token's bytes and time: docs/benchmarks.md
"Greedy screening (CPU)"). A greedy row needs only the index of its largest logit, not the logits.

Method (branch and bound on the argmax). Each head row w_r [D] has an int8 copy q_r with a per-row scale s_r
(symmetric absmax quantization, w_r ~ s_r q_r) and a radius coefficient c_r (``build_head_screen``) such that,
for every input x [D],

    |L_r - Z_r| <= ||x|| c_r + 2u |Z_r|,    Z_r = fl(s_r * fl(x . q_r)),

where L_r is ANY float32 evaluation of x . w_r (the head's own matmul, whatever its summation order) and u = 2^-24.
The terms of c_r (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., eq. 3.5 and Lemma 3.1: a
float32 dot product of length D is within gamma_D sum |x_i y_i| of the exact one, gamma_D = D u / (1 - D u);
Cauchy-Schwarz bounds that sum by ||x|| ||y||):

    ||w_r - s_r q_r||                       the quantization residual (exact reals),
    gamma_D * s_r ||q_r||                   the rounding of the int8 product,
    gamma_D * ||w_r||                       the rounding of the head's own product,

each computed in float32 and enlarged by relative margins that cover the rounding of computing them.
Then with b_r the right-hand side, t = max_r (Z_r - b_r) <= max_r L_r, and a row with Z_r + b_r < t cannot hold the
largest logit. The rows left ("candidates"; more of them where logits lie close together, as in the random
benchmark model) are found without a sort: the head's rows are cut into blocks of BLOCK, the blocks that hold a
candidate are listed (at most CANDIDATE_BLOCKS of them, at most two candidates each), and the logits of those
rows are recomputed in float32 from the head's own rows. The first index of the largest wins, jnp.argmax's tie
rule.

What comes out is the argmax of float32 logits of the same weights and input; it can differ from the argmax of the
full product only where two logits are equal up to float32 rounding, as between any two summation orders (the
dense layers' forms already differ that way between batch sizes: layers.matmul_nt). When the proof fails
(candidates in more blocks than that, three in one block, e.g. an all-zero head, or a non-finite value),
``screened_argmax`` says so and the caller computes the full logits.

Cost on CPU: the one-row int8 product reads the int8 copy in place (layers.matmul_nt's matrix-vector form
converts in registers); it and the search with the recomputed rows take less than the float32 head's product
(per-token figures from a trace of the captured decode step: docs/benchmarks.md "Greedy screening (CPU)"). A bf16 head
gains nothing: its own matrix-vector product costs what the int8 one does.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxinfer.models.layers import matmul_nt

BLOCK = 32  # head rows per block of the candidate search (the largest power of two dividing V, at most this)
CANDIDATE_BLOCKS = 16  # blocks holding candidates per greedy row at most; two rows of each are recomputed
_U = 2.0 ** -24  # float32 unit roundoff


@dataclasses.dataclass(frozen=True)
class HeadScreen:
    """The int8 screen of a head [V, D] (a pytree): q int8 [V, D], scale float32 [V] (w_r ~ scale_r q_r), radius
    float32 [V] (c_r of the module doc: |any float32 x . w_r - scale_r x . q_r| <= ||x|| radius_r + 2u|..|)."""

    q: jax.Array
    scale: jax.Array
    radius: jax.Array


jax.tree_util.register_dataclass(HeadScreen, data_fields=["q", "scale", "radius"], meta_fields=[])


def _gamma(d: int) -> float:
    """gamma_d = d u / (1 - d u): the relative error bound of a float32 sum of d products (Higham, Lemma 3.1)."""
    if d * _U >= 0.5:
        raise ValueError(f"head width {d} is too large for a float32 error bound")
    return d * _U / (1 - d * _U)


@jax.jit
def build_head_screen(w: jax.Array) -> HeadScreen:
    """The screen of head weights w [V, D] (any float dtype; the model's lm_head or tied embedding)."""
    d = w.shape[1]
    g = _gamma(d)
    w32 = w.astype(jnp.float32)  # exact for bf16 / float16
    amax = jnp.max(jnp.abs(w32), axis=1)  # [V]
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)  # any positive scale is sound: the residual is measured
    q = jnp.clip(jnp.round(w32 / scale[:, None]), -127, 127).astype(jnp.int8)  # [V, D]
    qf = q.astype(jnp.float32)
    resid = w32 - scale[:, None] * qf  # [V, D] float32; within u(|w| + 2|r|)(1 + u) of the real residual r

    def norm(a):  # float32 Euclidean norm of each row; relative error below gamma_d (d squares, a sum, a sqrt)
        return jnp.sqrt(jnp.sum(a * a, axis=1))

    margin = 1 + 4 * g + 8 * _U  # covers the norms' own rounding and the products below
    resid_norm = (norm(resid) + 2 * _U * norm(w32)) / (1 - 3 * _U)
    radius = (resid_norm + g * (scale * norm(qf) + norm(w32))) * margin
    return HeadScreen(q=q, scale=scale, radius=radius)


def _first_true(mask: jax.Array, k: int) -> jax.Array:
    """int32 [R, k]: the indices of the first k True values of each row of mask [R, N] in ascending order (N where a
    row has fewer). Sort-free: the j-th is the number of positions whose inclusive count of Trues is <= j."""
    count = jnp.cumsum(mask, axis=1, dtype=jnp.int32)  # [R, N]
    return jnp.sum(count[:, None, :] <= jnp.arange(k, dtype=jnp.int32)[None, :, None], axis=2, dtype=jnp.int32)


def screened_argmax(x: jax.Array, w: jax.Array, screen: HeadScreen, row_shards: int = 1,
                    blocks: int = CANDIDATE_BLOCKS) -> tuple[jax.Array, jax.Array]:
    """(ids int32 [R], proven bool []) for x [R, D] against the head w [V, D] and its screen.

    ids[r] is the first index of the largest float32 logit x[r] . w[v] (see the module doc) for every row when
    ``proven``; when not, ids are meaningless and the caller takes the full product's argmax. Not proven: the
    candidates of some row lie in more than ``blocks`` blocks of BLOCK head rows, or three share a block, or a
    value is not finite. x is used in float32 (the head's operand, in the model dtype, converts exactly).
    row_shards: as in layers.matmul_nt."""
    r, d = x.shape
    v = w.shape[0]
    blk = math.gcd(v, BLOCK)
    nb = v // blk
    blocks = min(blocks, nb)
    g = _gamma(d)
    xf = x.astype(jnp.float32)  # [R, D]
    nx = jnp.sqrt(jnp.sum(xf * xf, axis=1)) * (1 + 2 * g + 4 * _U)  # [R] an upper bound of ||x||
    z = matmul_nt(xf, screen.q, row_shards) * screen.scale  # [R, V]: fl(s_r fl(x . q_r))
    b = nx[:, None] * screen.radius * (1 + 8 * _U) + 4 * _U * jnp.abs(z)  # [R, V]
    # Per block of blk rows (columns of [R, nb, blk]), reduced lane by lane with elementwise ops that XLA:CPU
    # fuses into loops over [R, nb]: max, min and argmax reduces over the minor blk run as YNNPACK fusions or scalar
    # loops, each about the cost of all the rest of the search (docs/benchmarks.md "Greedy screening (CPU)").
    lower = (z - b).reshape(r, nb, blk)
    upper = (z + b).reshape(r, nb, blk)  # a row with upper < t cannot hold the largest logit
    t = jnp.max(functools.reduce(jnp.maximum, [lower[:, :, i] for i in range(blk)]), axis=1)  # [R] <= max logit
    reach = [upper[:, :, i] >= t[:, None] for i in range(blk)]  # blk x [R, nb]
    in_reach = functools.reduce(jnp.add, [m.astype(jnp.int32) for m in reach])  # [R, nb] (at most two allowed)
    first = functools.reduce(jnp.minimum, [jnp.where(m, i, blk - 1) for i, m in enumerate(reach)])  # [R, nb]
    second = functools.reduce(jnp.maximum, [jnp.where(m, i, 0) for i, m in enumerate(reach)])  # [R, nb]
    picked = _first_true(in_reach > 0, blocks)  # [R, blocks]: the blocks holding candidates (nb: none)
    covered = jnp.all(jnp.sum(in_reach > 0, axis=1) <= blocks) & jnp.all(in_reach <= 2)  # every candidate taken
    proven = covered & jnp.all(jnp.isfinite(z)) & jnp.all(jnp.isfinite(nx))
    # The candidates' rows; extra rows (a block's second when it has one candidate, block nb clamped to the last)
    # are real head rows too, whose logits cannot exceed the largest, so they change nothing.
    picked = jnp.minimum(picked, nb - 1)
    idx = jnp.concatenate([picked * blk + jnp.take_along_axis(first, picked, axis=1),
                           picked * blk + jnp.take_along_axis(second, picked, axis=1)], axis=1)  # [R, 2 blocks]
    rows = jnp.take(w, idx, axis=0, mode="clip")  # [R, C, D]
    if r == 1:  # the one-row matrix-vector product
        logits = matmul_nt(xf, rows[0])  # [1, C]
    else:
        logits = jnp.einsum("rcd,rd->rc", rows, xf, preferred_element_type=jnp.float32)  # [R, C]
    best = jnp.max(logits, axis=1, keepdims=True)  # [R, 1]
    ids = jnp.min(jnp.where(logits == best, idx, v), axis=1)  # [R]: the first index among equal maxima
    return ids.astype(jnp.int32), proven
