"""kernels_pallas.mla.xla.chunked_attention, the one XLA path of paged MLA attention, in both of its forms: the
engine's (cached keys, then the step's own keys, not written yet, causal among themselves) against mla_decode's
(causal over a cache that holds the step's keys), out and lse; and its checks. Each form is also checked against
mla_decode_reference (test_mla_decode.py; tests/test_paged_attention.py). Every cache slot no sequence owns holds
NaN."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.mla import DecodeWindow, chunked_attention

PS = 64  # page size
attention = jax.jit(chunked_attention, static_argnames=("head_dim_v", "softmax_scale", "chunk_pages", "causal",
                                                        "value_dtype"))


def _case(seed, ends, t, heads, d):
    """Rows of ends[b] tokens, the last t of them this step's: (q, cache without them, cache with them, block table,
    their keys [B, t, D])."""
    rng = np.random.default_rng(seed)
    b, p = len(ends), max(-(-e // PS) for e in ends)
    table = rng.permutation(np.arange(1, b * p + 1)).reshape(b, p).astype(np.int32)
    cache = np.full((b * p + 1, PS, 1, d), np.nan, np.float32)
    new = rng.standard_normal((b, t, d)).astype(np.float32)
    for row, end in enumerate(ends):
        for pos in range(end - t):
            cache[table[row, pos // PS], pos % PS, 0] = rng.standard_normal(d)
    written = cache.copy()
    for row, end in enumerate(ends):
        for i, pos in enumerate(range(end - t, end)):
            written[table[row, pos // PS], pos % PS, 0] = new[row, i]
    q = rng.standard_normal((b, t, heads, d)).astype(np.float32)
    return (jnp.asarray(q), jnp.asarray(cache), jnp.asarray(written), jnp.asarray(table), jnp.asarray(new))


@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("chunk_pages", [1, 4])
def test_new_keys_match_causal_attention_over_the_written_cache(t, chunk_pages):
    ends = np.array([5, 70, 130], np.int32)
    q, cache, written, table, new = _case(t, ends, t, 4, 40)
    kw = dict(head_dim_v=32, softmax_scale=0.3, chunk_pages=chunk_pages)
    out, lse = attention(q, cache, table, jnp.asarray(ends - t), new_keys=new,
                         new_valid=jnp.ones(new.shape[:2], bool), **kw)
    ref_out, ref_lse = attention(q, written, table, jnp.asarray(ends), causal=True, **kw)
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(lse)).all()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=2e-5, atol=2e-5)


def test_checks():
    q, cache, _, table, new = _case(0, np.array([70]), 1, 4, 40)
    lens, valid = jnp.asarray([69]), jnp.ones((1, 1), bool)
    run = functools.partial(chunked_attention, head_dim_v=32, softmax_scale=0.3, chunk_pages=1)
    with pytest.raises(ValueError, match="pass one or the other"):
        run(q, cache, table, lens, causal=True, new_keys=new, new_valid=valid)
    bits = jax.lax.bitcast_convert_type(cache, jnp.uint32)
    with pytest.raises(ValueError, match="pass value_dtype"):
        run(q, bits, table, lens)
    with pytest.raises(ValueError, match="uint32 bit-pattern cache cannot hold bfloat16 values"):
        run(q, bits, table, lens, value_dtype=jnp.bfloat16)
    two_heads = jnp.concatenate([cache, cache], axis=2)  # [pages, S, 2, D]
    window = DecodeWindow(jnp.zeros((1, 2, 40)), jnp.zeros((1,), jnp.int32), jnp.int32(0))
    with pytest.raises(ValueError, match="h_kv=2"):
        run(q, two_heads, table, lens, window=window)
