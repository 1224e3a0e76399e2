"""layers.matmul_nt (x @ W^T: one row as a matvec, more in the form gemm_cost's model prices lowest on XLA:CPU)
against float64 numpy, in every form whichever the model chooses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hlo_buffers import materialized_shapes
from jaxinfer.models import gemm_cost, layers
from jaxinfer.models.layers import materialized, matmul_nt, matmul_nt_many


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


@pytest.mark.parametrize("rows", [1, 2, 64, 128])
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


@pytest.mark.parametrize("form", gemm_cost.FORMS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_form_matches_float64(form, dtype, monkeypatch):
    """Each form the cost model may choose for several rows, forced, computes the same products (float32
    accumulation), unbatched and batched (one row per matrix too)."""
    monkeypatch.setattr(layers, "product_form", lambda rows, w: form)
    rng = np.random.default_rng(3)
    w, ws = (jnp.asarray(rng.standard_normal(shape), dtype) for shape in ((40, 96), (3, 40, 96)))
    for x, w in [(rng.standard_normal((2, 96)), w), (rng.standard_normal((2, 5, 96)), w),
                 (rng.standard_normal((3, 7, 96)), ws), (rng.standard_normal((3, 1, 96)), ws)]:
        x = jnp.asarray(x, dtype)
        y = jax.jit(matmul_nt)(x, w)
        ref = np.einsum("...mk,...nk->...mn", np.asarray(x, np.float64), np.asarray(w, np.float64))
        assert y.dtype == jnp.float32 and y.shape == ref.shape
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


@pytest.mark.parametrize("lead", [(1,), (1, 1), (3,), (2, 64)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_many_matches_float64(lead, dtype):
    """matmul_nt_many (one concatenated matvec for a single row on CPU): each output the product with its own
    weight."""
    rng = np.random.default_rng(len(lead))
    x = jnp.asarray(rng.standard_normal((*lead, 64)), dtype)
    ws = [jnp.asarray(rng.standard_normal((n, 64)), dtype) for n in (24, 40, 8)]
    ys = jax.jit(matmul_nt_many)(x, ws)
    for y, w in zip(ys, ws):
        ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
        assert y.shape == (*lead, w.shape[0]) and y.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-4)


def test_materialized_is_the_identity_for_products():
    x = jnp.asarray([1.5, -0.0, jnp.inf, -3.25, jnp.nan], jnp.float32)
    y = np.asarray(jax.jit(materialized)(x))
    np.testing.assert_array_equal(y[[0, 2, 3]], np.asarray(x)[[0, 2, 3]])
    assert y[1] == 0 and np.isnan(y[4])


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the one-row form is XLA:CPU's")
def test_one_row_matvec_reads_its_row_from_a_buffer():
    """A single row that is a slice (the decode step's o_proj input: the V half of the absorbed attention's
    [H, N+V] output): the compiled matvec loop takes the row from a buffer of its own, not the slice's source,
    which it would index again for every output element (2x slower at [512, 512]). The plain product fuses the
    slice: the check can fail."""
    a, w = jnp.zeros((8, 128, 1), jnp.float32), jnp.zeros((256, 512), jnp.float32)

    def matvec_operands(fn):
        hlo = jax.jit(lambda a, w: fn(a.reshape(8, 128)[:, 64:].reshape(1, 512), w)).lower(a, w).compile().as_text()
        return [line.split("fusion(")[1] for line in hlo.splitlines()
                if " = " in line and "dot" in line.split(" = ")[0] and "fusion(" in line]

    ours = matvec_operands(matmul_nt)
    assert ours and not [ops for ops in ours if "%a" in ops], ours
    assert [ops for ops in matvec_operands(lambda x, w: x @ w.T) if "%a" in ops]


def _rows_split_over_devices(x):
    """x with its rows split over all local devices, as the engine's batch on a mesh (8 in the test suite)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("rows",))
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows")))


@pytest.mark.parametrize("rows_per_device", [1, 2])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_row_shards_match_float64(rows_per_device, dtype):
    """Rows split over the devices (row_shards = the device count): the per-device form, the same products."""
    n = jax.device_count()
    rng = np.random.default_rng(rows_per_device)
    x = _rows_split_over_devices(jnp.asarray(rng.standard_normal((n * rows_per_device, 64)), dtype))
    ws = [jnp.asarray(rng.standard_normal((k, 64)), dtype) for k in (24, 40)]
    ref = [np.asarray(x, np.float64) @ np.asarray(w, np.float64).T for w in ws]
    y = jax.jit(lambda x, w: matmul_nt(x, w, n))(x, ws[0])
    np.testing.assert_allclose(np.asarray(y), ref[0], rtol=1e-5, atol=1e-4)
    for y, r in zip(jax.jit(lambda x, ws: matmul_nt_many(x, ws, n))(x, ws), ref):
        assert y.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(y), r, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(jax.default_backend() != "cpu" or jax.device_count() < 2, reason="XLA:CPU on a mesh")
def test_one_row_per_device_reads_bfloat16_weights_in_place():
    """One row per device (a batch-1 decode step on a 1xN CPU mesh: a row per DP rank): with row_shards the
    per-device product is the one-row matvec that converts the bf16 weight in its loop; sized by the global
    rows, XLA:CPU writes a float32 copy of the weight in every call (docs/benchmarks.md "GEMM forms (CPU)").
    Checked on the compiled program's buffers; the global-rows form fails the check."""
    n = jax.device_count()
    x = _rows_split_over_devices(jnp.ones((n, 512), jnp.bfloat16))
    w = jnp.ones((384, 512), jnp.bfloat16)

    def float32_weight_buffers(row_shards):
        hlo = jax.jit(lambda x, w: matmul_nt(x, w, row_shards)).lower(x, w).compile().as_text()
        return materialized_shapes(hlo) & {"f32[384,512]", "f32[512,384]"}

    assert not float32_weight_buffers(n)
    assert float32_weight_buffers(1)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the one-row form is XLA:CPU's")
@pytest.mark.parametrize("k", [4096, 10944])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_row_of_long_contraction_reads_weights_in_place(k, dtype):
    """From K = MATVEC_MAX_K on, XLA:CPU would copy the whole weight transposed (and converted to float32) before a
    one-row product, in every call; the product split over K chunks reads it in place. Checked on the compiled
    program's buffers (a plain one-row product of the same operands fails the check), and against float64."""
    rng = np.random.default_rng(k)
    x = jnp.asarray(rng.standard_normal((1, k)), dtype)
    w = jnp.asarray(rng.standard_normal((48, k)), dtype)

    def weight_copies(fn):
        hlo = jax.jit(fn).lower(x, w).compile().as_text()
        return materialized_shapes(hlo) & {f"f32[{k},48]", f"f32[48,{k}]", f"bf16[{k},48]"}

    assert not weight_copies(matmul_nt)
    assert weight_copies(lambda x, w: jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32).T))
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    np.testing.assert_allclose(np.asarray(jax.jit(matmul_nt)(x, w)), ref, rtol=1e-5, atol=1e-3)
