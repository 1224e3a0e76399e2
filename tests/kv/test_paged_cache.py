"""Paged latent cache: write / take_pages against numpy, padding slots, NaN isolation, sizing, DP sharding."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxinfer.config import ModelConfig
from jaxinfer.kv import (
    PagedLatentCache,
    bytes_per_page,
    cache_sharding,
    default_num_pages,
    holds_bits,
    init_paged_cache,
    latent_width,
    take_pages,
    value_dtype,
    write,
)
from jaxinfer.parallel.mesh import make_mesh

CFG = ModelConfig.tiny()
W = latent_width(CFG)          # 40 = 32 + 8
NP, S = 6, 64                  # pages (page 0 = null page), tokens per page

write_jit = jax.jit(write, donate_argnums=0)
# Each row's contiguous latents: the pages of its block table, one after the other ([B, M * S, W]).
gather_jit = jax.jit(lambda cache, table: take_pages(cache, table, cache.dtype).reshape(table.shape[0], -1, W))


def slot_mapping(row, positions):
    """Slots of a sequence's positions (the engine's rule, engine/inputs.py): row[pos // S] * S + pos % S."""
    pos = np.asarray(positions)
    return (np.asarray(row)[pos // S] * S + pos % S).astype(np.int32)


def np_write(cache, latents, slots):
    flat = cache.reshape(-1, W).copy()
    for x, s in zip(latents, slots):
        if s >= 0:
            flat[s] = x
    return flat.reshape(cache.shape)


def np_gather(cache, table):
    return np.stack([np.concatenate([cache[p, :, 0] for p in row]) for row in table])


def test_init_shapes():
    cache = init_paged_cache(CFG, NP, jnp.bfloat16)
    assert isinstance(cache, PagedLatentCache)
    assert (cache.num_layers, cache.num_pages, cache.page_size, cache.width, cache.dtype) == (3, NP, S, W,
                                                                                               jnp.bfloat16)
    assert cache.layers[0].shape == (NP, S, 1, W)                      # FlashMLA layout, h_kv = 1
    assert init_paged_cache(CFG, 2, jnp.float32, num_layers=4, page_size=16).layers[3].shape == (2, 16, 1, W)
    assert len(jax.tree_util.tree_leaves(cache)) == 3                  # a pytree of its layers
    assert latent_width(ModelConfig.deepseek_v3()) == 576
    with pytest.raises(ValueError, match="num_pages=0"):
        init_paged_cache(CFG, 0, jnp.float32)


@pytest.mark.parametrize("seed", range(3))
def test_write_gather_roundtrip_vs_numpy(seed):
    rng = np.random.default_rng(seed)
    cache_np = rng.standard_normal((NP, S, 1, W)).astype(np.float32)
    n = 100
    slots = rng.choice(NP * S, size=n, replace=False).astype(np.int32)
    slots[rng.random(n) < 0.2] = -1                                    # padding tokens
    latents = rng.standard_normal((n, W)).astype(np.float32)
    out = write_jit(jnp.asarray(cache_np), jnp.asarray(latents), jnp.asarray(slots))
    want = np_write(cache_np, latents, slots)
    np.testing.assert_array_equal(np.asarray(out), want)
    table = rng.integers(0, NP, size=(3, 4)).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(gather_jit(out, jnp.asarray(table))), np_gather(want, table))


def test_padding_slots_dropped_not_wrapped():
    cache = jnp.zeros((NP, S, 1, W), jnp.float32)
    out = write_jit(cache, jnp.ones((5, W)), jnp.full((5,), -1, jnp.int32))
    assert not np.asarray(out).any()                                   # -1 must not land in the last slot


def test_write_casts_to_cache_dtype():
    cache = jnp.zeros((NP, S, 1, W), jnp.bfloat16)
    out = write_jit(cache, jnp.full((1, W), 1.5, jnp.float32), jnp.array([S + 3], jnp.int32))
    assert out.dtype == jnp.bfloat16 and float(out[1, 3, 0, 0]) == 1.5
    with pytest.raises(ValueError, match="must be"):
        write(cache, jnp.zeros((2, W + 1)), jnp.zeros((2,), jnp.int32))


def _bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).view(np.uint16)


def test_bit_pattern_cache_write_and_take_pages_vs_numpy():
    """A bf16 cache held as uint16 bit patterns: writes store the latents' bits, take_pages decodes them; NaN
    payloads and signed zeros survive unchanged (the oracle compares raw bits)."""
    rng = np.random.default_rng(3)
    values = rng.standard_normal((NP, S, 1, W)).astype(ml_dtypes.bfloat16)
    values[2, 5, 0, :3] = [np.nan, -0.0, np.inf]
    cache = init_paged_cache(CFG, NP, jnp.bfloat16, num_layers=1, as_bits=True).layers[0]
    assert cache.dtype == jnp.uint16 and holds_bits(cache) and value_dtype(cache, jnp.bfloat16) == jnp.bfloat16
    cache = jnp.asarray(_bits(values))
    n = 50
    slots = rng.choice(NP * S, size=n, replace=False).astype(np.int32)
    slots[:5] = -1
    latents = rng.standard_normal((n, W)).astype(ml_dtypes.bfloat16)
    latents[7, :2] = [np.nan, -0.0]
    out = write_jit(cache, jnp.asarray(latents), jnp.asarray(slots))
    want = np_write(values, latents, slots)                            # [NP, S, 1, W] bf16
    np.testing.assert_array_equal(np.asarray(out), _bits(want))
    table = rng.integers(0, NP, size=(3, 4)).astype(np.int32)
    got = jax.jit(take_pages, static_argnums=2)(out, jnp.asarray(table), jnp.bfloat16)  # [3, 4, S, 1, W]
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_bits(got), _bits(want[table]))
    with pytest.raises(ValueError, match="cannot hold float32 latents"):
        write(out, jnp.zeros((1, W), jnp.float32), jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match="cannot hold float32 values"):
        take_pages(out, jnp.asarray(table), jnp.float32)
    with pytest.raises(ValueError, match="floating-point"):
        init_paged_cache(CFG, NP, jnp.int32, as_bits=True)


def test_bit_pattern_cache_programs_touch_only_the_written_and_read_slots():
    """Compiled write and page gather of a bf16 bit-pattern cache: no array of the cache's size in any other dtype
    (XLA:CPU upcasts bf16 scatters and gathers by converting the whole cache to float32; with a bf16 cache both
    programs hold f32[NP, S, 1, W] converts, see paged_cache's module doc)."""
    cache = init_paged_cache(CFG, NP, jnp.bfloat16, num_layers=1, as_bits=True).layers[0]
    latents, slots = jnp.zeros((4, W), jnp.bfloat16), jnp.arange(4, dtype=jnp.int32)
    full = f"[{NP},{S},1,{W}]"
    programs = {"write": write_jit.lower(cache, latents, slots),
                "take_pages": jax.jit(take_pages, static_argnums=2).lower(cache, jnp.zeros((2, 3), jnp.int32),
                                                                          jnp.bfloat16)}
    for name, lowered in programs.items():
        hlo = lowered.compile().as_text()
        assert f"u16{full}" in hlo, name
        assert not [line for line in hlo.splitlines() if full in line and f"u16{full}" not in line], name
    # control: the same line check sees a whole-cache float32 conversion where a program holds one (jaxlib 0.10.2's
    # XLA:CPU compiles the bf16 cache's own write so; 0.11.2's scatters bf16 in place, hence a program of our own)
    upcast = jax.jit(lambda c, x: write(c.astype(jnp.float32) * 2, x, slots).astype(jnp.bfloat16))
    hlo = upcast.lower(jnp.zeros((NP, S, 1, W), jnp.bfloat16), latents.astype(jnp.float32)).compile().as_text()
    assert [line for line in hlo.splitlines() if f"f32{full}" in line]


def test_nan_in_untouched_pages_does_not_leak():
    cache = jnp.full((NP, S, 1, W), jnp.nan, jnp.float32)
    row = np.array([3, 1, 0, 0])                                       # 2 pages used, null-padded
    length = 100
    rng = np.random.default_rng(0)
    latents = rng.standard_normal((length, W)).astype(np.float32)
    slots = slot_mapping(row, np.arange(length))
    out = gather_jit(write_jit(cache, jnp.asarray(latents), jnp.asarray(slots)), jnp.asarray(row[None]))
    out = np.asarray(out)[0]                                           # [M*S, W]
    np.testing.assert_array_equal(out[:length], latents)               # valid slots exact and finite
    assert np.isnan(out[length:]).all()                                # the rest is masked by length downstream


def test_default_num_pages():
    v3 = ModelConfig.deepseek_v3()
    assert bytes_per_page(v3, jnp.bfloat16) == 61 * 64 * 576 * 2
    assert default_num_pages(v3, jnp.bfloat16, 80 * 10**9) == int(72e9) // (61 * 64 * 576 * 2)   # 16009
    assert default_num_pages(v3, "float32", 80 * 10**9, fraction=0.5) == int(40e9) // (61 * 64 * 576 * 4)
    assert default_num_pages(CFG, jnp.float32, 10**6, num_layers=4) == 9 * 10**5 // (4 * 64 * W * 4)
    with pytest.raises(ValueError, match="need >= 2"):
        default_num_pages(v3, jnp.bfloat16, 10**6)
    with pytest.raises(ValueError, match="fraction"):
        default_num_pages(v3, jnp.bfloat16, 10**12, fraction=1.5)


def test_dp_sharded_cache_with_rank_local_ids():
    """R = 8 ranks of P pages each; under shard_map every rank writes with its own local page ids."""
    mesh = make_mesh("2x4")
    pages_per_rank = 3
    layer = init_paged_cache(CFG, pages_per_rank, jnp.float32, num_layers=1, mesh=mesh).layers[0]
    assert layer.shape == (8 * pages_per_rank, S, 1, W) and layer.sharding == cache_sharding(mesh)
    assert {s.data.shape for s in layer.addressable_shards} == {(pages_per_rank, S, 1, W)}
    ranks = np.arange(8, dtype=np.float32)
    latents = np.repeat(ranks[:, None, None], 2, axis=1) * np.ones((8, 2, W), np.float32) + 1   # [R, N, W]
    local_slots = np.tile(slot_mapping([2, 1], [0, 65]), (8, 1))                              # [R, N] rank-local
    spec = P(("data", "expert"))

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
    def step(cache, x, slots):                # per rank: [P, S, 1, W], [1, N, W], [1, N]
        return write(cache, x[0], slots[0])

    out = np.asarray(jax.jit(step)(layer, latents, local_slots))
    for r in range(8):
        np.testing.assert_array_equal(out[r * pages_per_rank + 2, 0, 0], latents[r, 0])
        np.testing.assert_array_equal(out[r * pages_per_rank + 1, 1, 0], latents[r, 1])
    assert np.count_nonzero(out.any(axis=(2, 3))) == 16                # nothing else written


def test_layout_is_what_mla_decode_reads():
    """A layer written here feeds kernels_pallas.mla_decode (XLA path) directly; NaN pages stay masked."""
    from kernels_pallas import mla_decode

    rng = np.random.default_rng(1)
    c, h = CFG.kv_lora_rank, 2
    cache = jnp.full((NP, S, 1, W), jnp.nan, jnp.float32)
    table = np.array([[4, 2, 0], [1, 0, 0]], np.int32)                 # null-padded block tables
    lens = np.array([100, 7], np.int32)
    kv = [rng.standard_normal((n, W)).astype(np.float32) for n in lens]
    slots = np.concatenate([slot_mapping(row, np.arange(n)) for row, n in zip(table, lens)])
    cache = write_jit(cache, jnp.asarray(np.concatenate(kv)), jnp.asarray(slots))
    q = rng.standard_normal((2, 1, h, W)).astype(np.float32)
    out, _ = mla_decode(jnp.asarray(q), cache, jnp.asarray(table), jnp.asarray(lens), head_dim_v=c,
                        implementation="xla")
    for b in range(2):                                                 # dense attention over the written latents
        s = q[b, 0] @ kv[b].T * W**-0.5                                # [h, T]
        p = np.exp(s - s.max(-1, keepdims=True))
        want = (p / p.sum(-1, keepdims=True)) @ kv[b][:, :c]           # [h, C]
        np.testing.assert_allclose(np.asarray(out[b, 0]), want, rtol=1e-5, atol=1e-5)
