"""Basic layers: RMSNorm, Linear (plain or DeepSeek FP8 block-quantized weights), the gated MLP.

FP8 modes (``fp8=``): "off" (weights in the compute dtype), "weights" (e4m3 + 128x128 block scales, dequantized
exactly on the fly: same logits as "off" with exactly dequantized weights), "compute" (DeepSeek's deployment path,
docs/architecture.md "Kernels": activations quantized per token per 128 channels, FP8 GEMMs with fp32 accumulation).

Weights keep the checkpoint layout ``[out, in]`` (PyTorch ``nn.Linear``, DeepGEMM's B operand), so loading is a
copy and FP8 block scales ``[ceil(out/128), ceil(in/128)]`` line up with their weight without transposes.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer import platform
from jaxinfer.checkpoint.fp8 import dequantize_blockwise_jnp, scale_shape
from jaxinfer.models import gemm_cost
from kernels_pallas import fp8_gemm, per_token_cast_to_fp8

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MODES = ("off", "weights", "compute")


def normal_init(rngs: nnx.Rngs, shape, dtype, std=0.02):
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class RMSNorm(nnx.Module):
    """RMSNorm as in HF DeepseekV3RMSNorm: normalise in float32, cast back, then scale by the weight."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


def dense_weight(weight: jax.Array, scale_inv: jax.Array | None, dtype) -> jax.Array:
    """The compute-dtype weight: exact FP8 dequantization (fp8 * scale_inv per block) when scales are given."""
    if scale_inv is None:
        return weight.astype(dtype)
    return dequantize_blockwise_jnp(weight, scale_inv, dtype=dtype)


def materialized(x: jax.Array) -> jax.Array:
    """x, computed into its own buffer before a matrix-vector product reads it (x + 0, written as a sum over a
    stacked zero: XLA:CPU fuses elementwise ops, slices and transposes into a matvec's loop but never a reduce).
    Fused, the operand's expression is evaluated again for every output element (e.g. o_proj's input, the absorbed
    attention's output, is a slice of a [H, N+V] product; docs/benchmarks.md "GEMM forms (CPU)"). Exact for a
    product: only -0.0 becomes +0.0."""
    return jnp.stack([x, jnp.zeros_like(x)]).sum(0)


def local_rows(m: int, row_shards: int) -> int:
    """The rows of an [m, K] operand that each device multiplies when its rows are split over row_shards devices
    (m when they do not divide evenly: then XLA does not split them that way either)."""
    return m // row_shards if row_shards > 1 and m % row_shards == 0 else m


# The contraction length from which XLA:CPU (jaxlib 0.10.2) no longer fuses a one-row float32 product into its own
# matrix-vector loop: K = 4095 runs at the loop's speed, 4096 copies the weights transposed first (5-10x slower,
# float32 and bf16 weights alike; docs/benchmarks.md "GEMM forms (CPU)").
MATVEC_MAX_K = 4096


def matmul_nt(x: jax.Array, w: jax.Array, row_shards: int = 1) -> jax.Array:
    """x [..., K] @ w [N, K]^T -> float32 [..., N]; or batched, x [S, M, K] @ w [S, N, K]^T -> float32 [S, M, N]
    (w of rank 3: one matrix per leading index). Both operands in their own dtype, float32 accumulation.

    On CPU one row (M = 1 per device) is a float32 matrix-vector product (see below); more rows take the cheaper
    form by gemm_cost's model of the shape (``product_form``): the plain product, or (w @ x^T)^T, the weights as
    the left operand, which XLA:CPU (YNNPACK) runs faster for few rows. The optimization barrier keeps that form:
    without it XLA's algebraic simplifier folds the transpose back into the dot and picks the slow form again.

    row_shards: the number of devices x's rows are split over when this runs under jit on a mesh outside
    shard_map (parallel.plan.batch_shards: the batch is split over every device). XLA then multiplies M /
    row_shards rows per device, and the form follows those: on a 1x8 CPU mesh a batch-1 decode step has 8 rows,
    one per device, and the 8-row form makes XLA:CPU convert bf16 weights to float32 in every step
    (docs/benchmarks.md "Meshes: jaxinfer bench / sweep")."""
    f32 = {"preferred_element_type": jnp.float32}
    fast = platform.current().is_cpu
    if w.ndim == 3:
        if x.ndim != 3 or x.shape[0] != w.shape[0] or x.shape[2] != w.shape[2]:
            raise ValueError(f"batched matmul_nt needs x [S, M, K] and w [S, N, K], got {x.shape} and {w.shape}")
        if fast and product_form(x.shape[1], w) == "transposed":
            y = jnp.einsum("snk,smk->snm", w, x, **f32)  # [S, N, M]
            # The second barrier materializes the transpose: left to fold into a consuming batched product (the
            # capacity path's down projection), it made a dot contracting the middle axis, which XLA:CPU runs as a
            # DotThunk: UNIMPLEMENTED for bf16 x bf16 -> f32 (V3's 256 slots at 128 tokens).
            return jax.lax.optimization_barrier(jax.lax.optimization_barrier(y).transpose(0, 2, 1))
        return jnp.einsum("smk,snk->smn", x, w, **f32)
    lead, k = x.shape[:-1], x.shape[-1]
    m = math.prod(lead)
    rows = local_rows(m, row_shards)  # per device
    form = ("matvec" if rows == 1 else product_form(rows, w)) if fast else "plain"
    if form == "matvec":
        # One row: x @ w^T on float32 operands, which XLA:CPU emits as its own matrix-vector loop that reads w in its
        # dtype and converts in registers ("copy_dot_fusion" in the optimized HLO): faster than a dot_general with
        # f32 output for bf16 and float32 weights alike (benchmarks/gemm_forms.py; docs/benchmarks.md "GEMM forms
        # (CPU)"). The same products (bf16 x bf16 is exact in float32), float32 accumulation.
        # The barrier on y: fused into the dot as an output fusion (the shared expert's sum with the routed
        # experts'), a consumer makes XLA copy w transposed in every step.
        # From K = MATVEC_MAX_K on, XLA:CPU stops emitting that loop and copies w transposed into a float32 buffer
        # in every call (V2-Lite's dense down projection, K = 10944: 19 ms instead of 1.8 for bf16): the product
        # runs as a sum of loops over K chunks below it, each reading its columns of w in place.
        x = materialized(x.reshape(m, k).astype(jnp.float32))
        chunks = -(-k // (MATVEC_MAX_K - 1))
        step = -(-k // chunks)
        y = None
        for i in range(0, k, step):  # one chunk below MATVEC_MAX_K: the plain matvec
            part = jax.lax.optimization_barrier(jnp.matmul(x[:, i:i + step], w[:, i:i + step].astype(jnp.float32).T))
            y = part if y is None else y + part  # [M, N]; the barrier: no output fusion
        return y.reshape(*lead, w.shape[0])
    if form == "transposed":
        y = jax.lax.optimization_barrier(jnp.einsum("nk,mk->nm", w, x.reshape(m, k), **f32))  # [N, M]
        if w.dtype != jnp.float32:
            # Materialized as well (the batched form's reason): left to fold into the next product (the grouped
            # path's down projection of bf16 activations), the transpose made a dot contracting the lhs's first
            # axis, which XLA:CPU runs as a DotThunk: UNIMPLEMENTED for BF16 x BF16 = F32.
            return jax.lax.optimization_barrier(y.T).reshape(*lead, w.shape[0])
        return y.T.reshape(*lead, w.shape[0])
    return jnp.einsum("...k,nk->...n", x, w, **f32)


def product_form(rows: int, w: jax.Array) -> str:
    """The form (gemm_cost.FORMS) in which XLA:CPU multiplies [rows, K] (per device) by w [N, K]^T or, batched,
    [S, rows, K] by w [S, N, K]^T: the cheapest by gemm_cost's model of the shape (gemm_costs.json)."""
    *batch, n, k = w.shape
    shape = gemm_cost.GemmShape(rows, n, k, w.dtype.itemsize, batch[0] if batch else 0)
    return gemm_cost.choose(shape, "bfloat16" if w.dtype == jnp.bfloat16 else "float32")


def matmul_nt_many(x: jax.Array, ws: list[jax.Array], row_shards: int = 1) -> list[jax.Array]:
    """[matmul_nt(x, w, row_shards) for w in ws] for weights [N_i, K] that share the input x [..., K] (gate and up
    of a SwiGLU MLP). On CPU one row (M = 1 per device) runs as a single matvec over the weights concatenated
    along N: XLA:CPU fuses the concatenation into the matvec's loop, so the weights are still read in place, and
    one loop replaces len(ws), each with its own fixed cost (docs/benchmarks.md "GEMM forms (CPU)")."""
    if platform.current().is_cpu and local_rows(math.prod(x.shape[:-1]), row_shards) == 1 and len(ws) > 1:
        y = matmul_nt(x, jnp.concatenate(ws), row_shards)  # [..., sum N_i]
        return jnp.split(y, list(itertools.accumulate(w.shape[0] for w in ws))[:-1], axis=-1)
    return [matmul_nt(x, w, row_shards) for w in ws]


class Linear(nnx.Module):
    """y = x @ W.T with W [out, in]; fp8 "weights" / "compute" keep W in e4m3 with 128x128 block scales.
    row_shards: the devices its input rows are split over (matmul_nt; 1 off a mesh or inside shard_map)."""

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 fp8: str = "off", row_shards: int = 1):
        if fp8 not in FP8_MODES:
            raise ValueError(f"fp8 must be one of {FP8_MODES}, got {fp8!r}")
        self.dtype = dtype
        self.fp8 = fp8
        self.row_shards = row_shards
        if fp8 != "off":
            self.weight = nnx.Param(normal_init(rngs, (out_features, in_features), jnp.float32).astype(FP8_DTYPE))
            self.weight_scale_inv = nnx.Param(jnp.ones(scale_shape((out_features, in_features)), jnp.float32))
        else:
            self.weight = nnx.Param(normal_init(rngs, (out_features, in_features), dtype))

    def kernel(self) -> jax.Array:
        scale = self.weight_scale_inv[...] if self.fp8 != "off" else None
        return dense_weight(self.weight[...], scale, self.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.fp8 == "compute":
            lead = x.shape[:-1]
            a, a_scale = per_token_cast_to_fp8(x.reshape(-1, x.shape[-1]))  # [M, K] e4m3, [M, K/128]
            y = fp8_gemm(a, a_scale, self.weight[...], self.weight_scale_inv[...], out_dtype=self.dtype)
            return y.reshape(*lead, -1)
        return matmul_nt(x.astype(self.dtype), self.kernel(), self.row_shards).astype(self.dtype)  # [..., N]


class MLP(nnx.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)) (dense layers and shared experts)."""

    def __init__(self, hidden: int, intermediate: int, *, rngs: nnx.Rngs, dtype=jnp.float32, fp8: str = "off",
                 row_shards: int = 1):
        kw = dict(rngs=rngs, dtype=dtype, fp8=fp8, row_shards=row_shards)
        self.gate_proj = Linear(hidden, intermediate, **kw)
        self.up_proj = Linear(hidden, intermediate, **kw)
        self.down_proj = Linear(intermediate, hidden, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.gate_proj.fp8 == "compute":
            return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
        dtype = self.gate_proj.dtype
        gate, up = matmul_nt_many(x.astype(dtype), [self.gate_proj.kernel(), self.up_proj.kernel()],
                                  self.gate_proj.row_shards)
        return self.down_proj(jax.nn.silu(gate.astype(dtype)) * up.astype(dtype))
