"""layers.matmul_nt (x @ W^T in the form XLA:CPU runs fastest for the row count) against float64 numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.models.layers import TRANSPOSED_PRODUCT_ROWS, matmul_nt


@pytest.mark.parametrize("lead", [(1,), (2,), (1, 7), (4, 8), (64,), (65,), (2, 64)])
@pytest.mark.parametrize("jit", [False, True])
def test_matches_float64(lead, jit):
    rng = np.random.default_rng(sum(lead))
    x = rng.standard_normal((*lead, 96)).astype(np.float32)
    w = rng.standard_normal((40, 96)).astype(np.float32)
    fn = jax.jit(matmul_nt) if jit else matmul_nt
    y = fn(jnp.asarray(x), jnp.asarray(w))
    assert y.shape == (*lead, 40) and y.dtype == jnp.float32
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, TRANSPOSED_PRODUCT_ROWS[0], TRANSPOSED_PRODUCT_ROWS[1], 128])
def test_bfloat16_operands_accumulate_in_float32(rows):
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((24, 256)), jnp.bfloat16)
    y = jax.jit(matmul_nt)(x, w)
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T  # exact products of the bf16 values
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("lead", [(1,), (1, 1), (3,)])
def test_float32_rows_on_bfloat16_weights(lead):
    """Mixed operands (the one-row path converts both to float32): products of the exact values."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((*lead, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((24, 256)), jnp.bfloat16)
    y = jax.jit(matmul_nt)(x, w)
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    assert y.shape == (*lead, 24) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-4)


def test_gradients_match_the_plain_product():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
    g = jax.grad(lambda x, w: jnp.sum(jnp.sin(matmul_nt(x, w))), argnums=(0, 1))(x, w)
    xd, wd = np.asarray(x, np.float64), np.asarray(w, np.float64)
    c = np.cos(xd @ wd.T)  # d sum(sin(x W^T)) = cos(x W^T) (d x W^T + x d W^T)
    np.testing.assert_allclose(np.asarray(g[0]), c @ wd, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(g[1]), c.T @ xd, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 16, 64, 65])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_batched_matches_float64(rows, dtype):
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((3, rows, 64)), dtype)
    w = jnp.asarray(rng.standard_normal((3, 24, 64)), dtype)
    y = jax.jit(matmul_nt)(x, w)
    ref = np.einsum("smk,snk->smn", np.asarray(x, np.float64), np.asarray(w, np.float64))
    assert y.shape == (3, rows, 24) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-4)


def test_batched_shape_mismatch_raises():
    with pytest.raises(ValueError, match="S, M, K"):
        matmul_nt(jnp.zeros((2, 4, 8)), jnp.zeros((3, 5, 8)))
