"""expert_ffn's four XLA compute paths (gather / dense / capacity / tiled, moe_path picks one by shape) against a
float64 numpy reference of sum_k w[m, k] * down(silu(gate(x[m])) * up(x[m])) for expert ids[m, k] (-1 = not here)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.models.moe import capacity_buckets, expert_ffn, moe_path


def _case(m, k=3, s=6, d=32, i=16, seed=0):
    rng = np.random.default_rng(seed)
    params = {"gate_proj": rng.normal(size=(s, i, d)).astype(np.float32) / d ** 0.5,
              "up_proj": rng.normal(size=(s, i, d)).astype(np.float32) / d ** 0.5,
              "down_proj": rng.normal(size=(s, d, i)).astype(np.float32) / i ** 0.5}
    x = rng.normal(size=(m, d)).astype(np.float32)
    ids = np.stack([rng.permutation(s)[:k] for _ in range(m)]).astype(np.int32)
    ids[rng.random((m, k)) < 0.2] = -1  # some assignments live on other ranks
    weights = rng.random((m, k)).astype(np.float32)
    return params, x, weights, ids


def _reference(params, x, weights, ids):
    p = {n: v.astype(np.float64) for n, v in params.items()}
    out = np.zeros(x.shape, np.float64)
    for r in range(x.shape[0]):
        for w, e in zip(weights[r], ids[r]):
            if e < 0:
                continue
            g, u = p["gate_proj"][e] @ x[r], p["up_proj"][e] @ x[r]
            out[r] += w * (p["down_proj"][e] @ (g / (1 + np.exp(-g)) * u))
    return out


# 300 rows: every path but gather (one unrolled matvec per assignment; moe_path picks it for a few rows only)
@pytest.mark.parametrize("m, path", [(m, p) for m in (1, 2, 7, 80, 300)
                                     for p in ("gather", "dense", "capacity", "tiled", "auto")
                                     if not (m == 300 and p == "gather")])
def test_paths_match_reference(m, path):
    params, x, weights, ids = _case(m)
    got = expert_ffn({n: jnp.asarray(v) for n, v in params.items()}, jnp.asarray(x), jnp.asarray(weights),
                     jnp.asarray(ids), jnp.float32, path=path)
    ref = _reference(params, x, weights, ids)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["capacity", "tiled"])
@pytest.mark.parametrize("hot", [0, 1, 3, 6])
def test_skewed_routing(hot, path):
    # `hot` of the 6 slots take almost every assignment: the capacity path's busiest slot picks a larger bucket,
    # up to every row (the last bucket); the tiled path gives the hot slots many tiles and the others none; ids -1
    # (other ranks) never count
    m, k, s = 40, 3, 6
    params, x, weights, ids = _case(m, k=k, s=s, seed=hot)
    if hot:
        rng = np.random.default_rng(hot)
        ids = np.stack([rng.permutation(hot)[:k] if hot >= k else
                        np.concatenate([rng.permutation(hot), hot + rng.permutation(s - hot)[:k - hot]])
                        for _ in range(m)]).astype(np.int32)
        ids[rng.random((m, k)) < 0.1] = -1
    got = expert_ffn({n: jnp.asarray(v) for n, v in params.items()}, jnp.asarray(x), jnp.asarray(weights),
                     jnp.asarray(ids), jnp.float32, path=path)
    np.testing.assert_allclose(np.asarray(got), _reference(params, x, weights, ids), rtol=1e-5, atol=1e-5)


def test_capacity_buckets():
    # 1.25x, 1.6x, 2.5x and 4x the balanced load rows * top_k / slots, up to multiples of 8, then every row
    assert capacity_buckets(1024, 4, 16) == (320, 416, 640, 1024)  # balanced 256: 320, 409.6, 640, 1024
    assert capacity_buckets(100, 3, 6) == (64, 80, 100)  # balanced 50: 62.5, 80, 125 and 200 capped at 100
    assert capacity_buckets(40, 3, 6) == (32, 40)  # balanced 20: 25, 32, 50 and 80 capped at 40
    assert capacity_buckets(1, 1, 1) == (1,)


def test_auto_choice_and_bad_path():
    # gather up to two assignments per slot and at most 32 assignments; capacity above; tiled from a balanced load
    # of 64 assignments per slot (rows * top_k >= 64 * slots)
    assert [moe_path(m, 4, 16) for m in (1, 8, 9, 64, 255, 256, 4096)] == (
        ["gather"] * 2 + ["capacity"] * 3 + ["tiled"] * 2)
    assert moe_path(4, 8, 256) == "gather" and moe_path(5, 8, 256) == "capacity" and moe_path(2, 2, 1) == "capacity"
    assert moe_path(2047, 8, 256) == "capacity" and moe_path(2048, 8, 256) == "tiled"
    assert moe_path(4096, 4, 16, platform="gpu") == "capacity"  # the tiled loop: CPU only
    params, x, weights, ids = _case(2)
    with pytest.raises(ValueError, match="path must be"):
        expert_ffn(params, x, weights, ids, jnp.float32, path="ragged")
