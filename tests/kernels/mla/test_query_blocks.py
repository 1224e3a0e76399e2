"""kernels_pallas.mla.query_blocks.query_block_attention against FlashMLA's contract: for every chunk, its new keys
written into a copy of the cache and mla_decode_reference run causally over the chunk's queries (fp32, gathers every
page); out and lse of every real query. Cache slots no sequence owns and the padding columns' latents hold NaN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.mla import mla_decode_reference
from kernels_pallas.mla.query_blocks import expanded_new_key_attention, query_block_attention

PS, HEADS, D, V = 8, 3, 24, 16
attention = jax.jit(query_block_attention, static_argnames=("head_dim_v", "softmax_scale", "chunk_pages",
                                                            "blocks_per_step", "value_dtype"))


def _layout(seed, chunks, q_width, pages):
    """chunks [(cached, new)] -> the block layout's arrays (+ a padding row) and, per chunk, its rows, the written
    cache and its block table and length for the reference."""
    rng = np.random.default_rng(seed)
    num_pages = 1 + sum(-(-(c + n) // PS) for c, n in chunks)
    cache = np.full((num_pages, PS, 1, D), np.nan, np.float32)
    order = rng.permutation(np.arange(1, num_pages))
    rows_of, q, new, valid, table, cached, first, truth = [], [], [], [], [], [], [], []
    used = 0
    for c, n in chunks:
        mine = order[used:used + -(-(c + n) // PS)]
        used += len(mine)
        tab = np.zeros(pages, np.int32)
        tab[:len(mine)] = mine
        for pos in range(c):
            cache[tab[pos // PS], pos % PS, 0] = rng.standard_normal(D)
        nb = max(1, -(-n // q_width))
        span = nb * q_width
        keys = np.full((span, D), np.nan, np.float32)
        keys[span - n:] = rng.standard_normal((n, D))
        rows_of.append(range(len(q), len(q) + nb))
        first += [len(q)] * nb
        q += list(rng.standard_normal((nb, q_width, HEADS, D)).astype(np.float32))
        new += list(keys.reshape(nb, q_width, D))
        valid += list((np.arange(span) >= span - n).reshape(nb, q_width))
        table += [tab] * nb
        cached += [c] * nb
        truth.append((keys[span - n:], tab, c + n))
    # a padding row: no keys, no cached length
    first.append(len(q))
    q.append(np.zeros((q_width, HEADS, D), np.float32))
    new.append(np.full((q_width, D), np.nan, np.float32))
    valid.append(np.zeros(q_width, bool))
    table.append(np.zeros(pages, np.int32))
    cached.append(0)
    arrays = [np.stack(x) for x in (q, new, valid)] + [cache] + [np.asarray(x, np.int32) for x in
                                                                  (np.stack(table), cached, first)]
    return arrays, rows_of, truth


@pytest.mark.parametrize("q_width,chunk_pages,blocks_per_step", [(4, 1, 1), (4, 3, 2), (8, 2, 3)])
def test_matches_causal_attention_over_the_written_cache(q_width, chunk_pages, blocks_per_step):
    # one block, several blocks (first block partly padding), a chunk of exactly two blocks, a long cached prefix
    chunks = [(0, 3), (13, 10), (0, 2 * q_width), (41, 1), (5, 3 * q_width + 1)]
    arrays, rows_of, truth = _layout(q_width, chunks, q_width, pages=8)
    q, new, valid, cache, table, cached, first = arrays
    kw = dict(head_dim_v=V, softmax_scale=0.3)
    out, lse = attention(*(jnp.asarray(x) for x in arrays), chunk_pages=chunk_pages,
                         blocks_per_step=blocks_per_step, **kw)
    out, lse = np.asarray(out), np.asarray(lse)
    for rows, (keys, tab, end) in zip(rows_of, truth):
        n = len(keys)
        written = cache.copy()
        for i, pos in enumerate(range(end - n, end)):
            written[tab[pos // PS], pos % PS, 0] = keys[i]
        chunk_q = q[rows.start:rows.stop].reshape(1, -1, HEADS, D)[:, -n:]  # [1, n, N, D]: the real queries
        ref_out, ref_lse = mla_decode_reference(jnp.asarray(chunk_q), jnp.asarray(written), jnp.asarray(tab[None]),
                                                jnp.asarray([end]), causal=True, **kw)
        got_out = out[rows.start:rows.stop].reshape(-1, HEADS, V)[-n:]
        got_lse = lse[rows.start:rows.stop].transpose(0, 2, 1).reshape(-1, HEADS)[-n:]  # [n, N]
        np.testing.assert_allclose(got_out, np.asarray(ref_out)[0], rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(got_lse, np.asarray(ref_lse)[0].T, rtol=2e-5, atol=2e-5)
    assert (out[-1] == 0).all() and (lse[-1] == -np.inf).all()  # the padding row sees no key


def test_bit_pattern_cache_and_checks():
    arrays, rows_of, _ = _layout(0, [(9, 6)], 4, pages=4)
    q, new, valid, cache, table, cached, first = (jnp.asarray(x) for x in arrays)
    kw = dict(head_dim_v=V, softmax_scale=0.3, chunk_pages=1)
    bf16 = cache.astype(jnp.bfloat16)
    out = attention(q, new.astype(jnp.bfloat16), valid, bf16, table, cached, first, **kw)[0]
    bits = jax.lax.bitcast_convert_type(bf16, jnp.uint16)
    same = attention(q, new.astype(jnp.bfloat16), valid, bits, table, cached, first, value_dtype=jnp.bfloat16, **kw)[0]
    real = np.asarray(valid)
    np.testing.assert_array_equal(np.asarray(out)[real], np.asarray(same)[real])
    with pytest.raises(ValueError, match="bit patterns"):
        query_block_attention(q, new, valid, bits, table, cached, first, **kw)
    with pytest.raises(ValueError, match="latent cache"):
        query_block_attention(q, new, valid, jnp.concatenate([cache, cache], 2), table, cached, first, **kw)
    with pytest.raises(ValueError, match="new_keys must be"):
        query_block_attention(q, new[:, :2], valid, cache, table, cached, first, **kw)


@pytest.mark.parametrize("q_width,blocks_per_step,grid", [(4, 1, False), (4, 3, False), (8, 2, True)])
def test_expanded_new_keys_match_causal_attention_per_chunk(q_width, blocks_per_step, grid):
    """expanded_new_key_attention against float64 causal softmax attention over each chunk's real tokens (its
    blocks' keys in order); padding columns hold NaN; a padding row sees no key. grid: every row its own chunk."""
    rng = np.random.default_rng(q_width)
    lengths = [q_width, 3, q_width - 1] if grid else [3, 2 * q_width, 3 * q_width + 1, q_width - 1]
    e, v_dim, heads = 6, 5, 2
    q, k, v, valid, first = [], [], [], [], []
    for n in lengths:
        blocks = -(-n // q_width)
        span = blocks * q_width
        real = np.arange(span) >= span - n
        first += [len(valid)] * blocks
        for x, width in ((q, e), (k, e), (v, v_dim)):
            block = rng.standard_normal((heads, span, width))
            block[:, ~real] = np.nan
            x += list(block.reshape(heads, blocks, q_width, width).transpose(1, 0, 2, 3))
        valid += list(real.reshape(blocks, q_width))
    for x, width in ((q, e), (k, e), (v, v_dim)):  # the padding row
        x.append(np.full((heads, q_width, width), np.nan))
    first.append(len(valid))
    valid.append(np.zeros(q_width, bool))
    q, k, v, valid = (np.stack(x) for x in (q, k, v, valid))
    scale = 0.4
    fn = jax.jit(expanded_new_key_attention, static_argnames=("softmax_scale", "blocks_per_step"))
    out, lse = fn(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), jnp.asarray(valid),
                  None if grid else jnp.asarray(first, jnp.int32), softmax_scale=scale,
                  blocks_per_step=blocks_per_step)
    out, lse = np.asarray(out), np.asarray(lse)
    row = 0
    for n in lengths:
        blocks = -(-n // q_width)
        rows = slice(row, row + blocks)
        row += blocks
        qc, kc, vc = (x[rows].transpose(1, 0, 2, 3).reshape(heads, blocks * q_width, -1)[:, -n:] for x in (q, k, v))
        s = np.einsum("hqe,hke->hqk", qc, kc) * scale
        s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
        ref_lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)  # [H, n]
        ref = np.einsum("hqk,hkv->hqv", np.exp(s - ref_lse[..., None]), vc)
        got = out[rows].transpose(1, 0, 2, 3).reshape(heads, blocks * q_width, -1)[:, -n:]
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(lse[rows].transpose(1, 0, 2).reshape(heads, -1)[:, -n:], ref_lse, rtol=2e-5,
                                   atol=2e-5)
    assert (out[-1] == 0).all() and (lse[-1] == -np.inf).all()
