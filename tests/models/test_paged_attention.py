"""The engine's paged attention backends (models/attention.py; the XLA backend's read-only
cached_and_new_attention) against
kernels_pallas.mla_decode_reference (FlashMLA's causal contract, itself tested against fp32 math) on a cache with
the step's latents written. Every cache slot no sequence owns holds NaN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.kv.paged_cache import write
from jaxinfer.models import attention
from jaxinfer.models.attention import BACKENDS, AttentionMetadata
from kernels_pallas import mla_decode_reference as _reference

PS = 64  # page size
_STATIC = ("head_dim_v", "softmax_scale")
cached_and_new_attention = jax.jit(attention.cached_and_new_attention, static_argnames=_STATIC + ("chunk_tokens",))


@jax.jit
def both_backends(q, new, cache, table, seqlens, slots):
    """(XLA backend's output and cache, Pallas backend's output) over the same inputs (no mesh)."""
    md = AttentionMetadata(jnp.zeros_like(slots), table, seqlens, slots)  # positions: unused by attention
    kw = {"head_dim_v": 32, "softmax_scale": 0.2}
    out, kept = BACKENDS["xla"](None, q, new, cache, md, None, **kw)
    ref, _ = BACKENDS["pallas"](None, q, new, cache, md, None, **kw)
    return out, kept, ref



mla_decode_reference = jax.jit(_reference, static_argnames=_STATIC + ("causal",))


def _case(seed, ends, counts, t, heads, d, num_pages, dtype):
    """Rows with ends[b] tokens of which the last counts[b] are this step's (right-aligned in T, slots -1 to the
    left); counts[b] = 0 is a padding row (seqlen 0). Returns the inputs and the cache with the latents written."""
    rng = np.random.default_rng(seed)
    b = len(ends)
    p = max(1, max(-(-e // PS) for e in ends))
    ids = rng.permutation(np.arange(1, num_pages))[: b * p].reshape(b, p)  # distinct pages; page 0 never owned
    cache = np.full((num_pages, PS, 1, d), np.nan, np.float32)
    block_table = np.zeros((b, p), np.int32)
    slots = np.full((b, t), -1, np.int32)
    seqlens = np.zeros((b,), np.int32)
    for row, (end, n) in enumerate(zip(ends, counts)):
        if n == 0:
            continue
        block_table[row] = ids[row]
        seqlens[row] = end
        for pos in range(end - n):  # the cached prefix
            cache[ids[row, pos // PS], pos % PS, 0] = rng.standard_normal(d)
        pos = np.arange(end - n, end)
        slots[row, t - n:] = ids[row, pos // PS] * PS + pos % PS
    q = rng.standard_normal((b, t, heads, d)).astype(np.float32)
    new = rng.standard_normal((b, t, d)).astype(np.float32)
    args = [jnp.asarray(q, dtype), jnp.asarray(new, dtype), jnp.asarray(cache, dtype), jnp.asarray(block_table),
            jnp.asarray(seqlens), jnp.asarray(slots)]
    written = jax.jit(write)(args[2], args[1].reshape(-1, d), args[5].reshape(-1))
    return args, written


# (ends, counts, t): decode, MTP verification, left-padded prefill chunks, padding rows, fresh prompts (no cached
# keys: every page chunk skipped), page chunks past every row's cached keys (skipped)
CASES = [
    ([1, 63, 64, 65, 200], [1, 1, 1, 1, 1], 1),
    ([2, 64, 130], [2, 2, 2], 2),
    ([5, 70, 129, 300], [5, 3, 64, 1], 64),
    ([100, 0, 64], [7, 0, 1], 8),
    ([5, 40, 64], [5, 40, 64], 64),
    ([130, 20], [100, 20], 128),
]


@pytest.mark.parametrize("ends,counts,t", CASES)
@pytest.mark.parametrize("chunk_tokens", [64, 256])
def test_matches_reference_on_written_cache(ends, counts, t, chunk_tokens):
    heads, d, v = 4, 40, 32
    (q, new, cache, table, seqlens, slots), written = _case(0, ends, counts, t, heads, d, 40, jnp.float32)
    out = np.asarray(cached_and_new_attention(q, new, cache, table, seqlens, slots, head_dim_v=v,
                                              softmax_scale=0.3, chunk_tokens=chunk_tokens))
    ref, _ = mla_decode_reference(q, written, table, seqlens, head_dim_v=v, softmax_scale=0.3, causal=True)
    ref = np.asarray(ref)
    assert out.shape == (len(ends), t, heads, v)
    for row, n in enumerate(counts):  # only the real queries: padding queries' outputs are never read
        np.testing.assert_allclose(out[row, t - n:], ref[row, t - n:], rtol=2e-5, atol=2e-5)
    assert np.isfinite(out).all()


def test_xla_backend_leaves_cache_and_matches_the_writing_backend():
    ends, counts, t = [3, 66, 190], [1, 1, 1], 1
    (q, new, cache, table, seqlens, slots), _ = _case(1, ends, counts, t, 4, 40, 16, jnp.float32)
    out, kept, ref = both_backends(q, new, cache, table, seqlens, slots)
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(cache))  # NaNs included
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("as_bits", [False, True])
def test_bfloat16_cache(as_bits):
    """bf16 latents in a bf16 cache or in its bit patterns (uint16; the engine's XLA path, paged_cache doc)."""
    ends, counts, t = [10, 80], [1, 2], 2
    (q, new, cache, table, seqlens, slots), written = _case(2, ends, counts, t, 4, 40, 8, jnp.bfloat16)
    stored = jax.lax.bitcast_convert_type(cache, jnp.uint16) if as_bits else cache
    out = cached_and_new_attention(q, new, stored, table, seqlens, slots, head_dim_v=32, softmax_scale=0.3)
    ref, _ = mla_decode_reference(q, written, table, seqlens, head_dim_v=32, softmax_scale=0.3, causal=True)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out[0, 1:], np.float32), np.asarray(ref[0, 1:], np.float32), atol=2e-2)
    np.testing.assert_allclose(np.asarray(out[1], np.float32), np.asarray(ref[1], np.float32), atol=2e-2)


def test_rejects_multi_head_cache():
    q = jnp.zeros((1, 1, 4, 8))
    with pytest.raises(ValueError, match="h_kv=2"):
        cached_and_new_attention(q, jnp.zeros((1, 1, 8)), jnp.zeros((2, PS, 2, 8)), jnp.zeros((1, 1), jnp.int32),
                                 jnp.ones((1,), jnp.int32), jnp.zeros((1, 1), jnp.int32), head_dim_v=8,
                                 softmax_scale=1.0)


@pytest.mark.parametrize("length", [0, 1, 5])
@pytest.mark.parametrize("chunk_tokens", [64, 256])
def test_window_reads_like_the_written_cache(length, chunk_tokens):
    """A multi-step decode iteration (engine/step_program.py) reads its earlier iterations' latents from a DecodeWindow;
    the result must be bit-identical to reading them from the cache, and the cache slots it stands in for (NaN
    here) and the window's entries past ``length`` (NaN too) must not leak in."""
    ends, w = [7, 66, 130, 200], 8  # windows across page (64) and chunk boundaries
    (q, new, cache, table, seqlens, slots), written = _case(3, ends, [1] * 4, 1, 4, 40, 24, jnp.float32)
    kw = {"head_dim_v": 32, "softmax_scale": 0.3, "chunk_tokens": chunk_tokens}
    start = np.array(ends) - 1 - length  # the window: positions start .. start + length - 1, before the query
    table_np, cache_np = np.asarray(table), np.array(cache)
    latents = np.full((len(ends), w, 40), np.nan, np.float32)
    for row, s in enumerate(start):
        for i in range(length):
            page, offset = table_np[row, (s + i) // PS], (s + i) % PS
            latents[row, i] = cache_np[page, offset, 0]
            cache_np[page, offset, 0] = np.nan  # not written yet
    window = attention.DecodeWindow(jnp.asarray(latents), jnp.asarray(start, jnp.int32), jnp.int32(length))
    out = cached_and_new_attention(q, new, jnp.asarray(cache_np), table, seqlens, slots, window=window, **kw)
    same = cached_and_new_attention(q, new, cache, table, seqlens, slots, **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(same))
    ref, _ = mla_decode_reference(q, written, table, seqlens, head_dim_v=32, softmax_scale=0.3, causal=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)


def test_window_is_for_the_read_only_backend():
    (q, new, cache, table, seqlens, slots), _ = _case(4, [5], [1], 1, 4, 40, 4, jnp.float32)
    window = attention.DecodeWindow(jnp.zeros((1, 2, 40)), jnp.zeros((1,), jnp.int32), jnp.int32(0))
    md = AttentionMetadata(jnp.zeros_like(slots), table, seqlens, slots)
    with pytest.raises(ValueError, match="reads no DecodeWindow"):
        BACKENDS["pallas"](None, q, new, cache, md, window, head_dim_v=32, softmax_scale=0.3)
