"""Paged MLA latent cache on device: per layer [P, S, 1, W] pages, write by slot, gather by block table.

Layout = FlashMLA's KV cache ``[num_pages, page_size=64, h_kv=1, W]`` with W = kv_lora_rank + qk_rope_head_dim
(576 for V3: [c_kv (512, normed) | k_pe (64, roped)], docs/architecture.md "Reference semantics"), so
``kernels_pallas.mla_decode(q, cache.layers[l], block_table, seqlens)`` reads a layer directly. dtype = model dtype.

Bit-pattern storage (``init_paged_cache(..., as_bits=True)``; the engine's XLA path): the arrays hold the values' bit
patterns as unsigned integers of the same width (bf16 -> uint16). jaxlib 0.10.2's XLA:CPU has no bf16 scatter or
gather: it upcasts both by converting the WHOLE operand to float32 and back, so every cache write and every page
gather of a bf16 cache would convert the full cache, and a step would cost in proportion to the cache, not the batch
(docs/benchmarks.md "Paged attention, XLA path (CPU)"). jaxlib 0.11.2's XLA:CPU scatters and gathers bf16 in place;
the bit patterns cost nothing there and keep the older release fast. Integer scatters and gathers run in place.
``write`` encodes the latents, ``take_pages`` decodes what it gathers (``lax.bitcast_convert_type``: exact); a
bitcast of the whole array is not free on XLA:CPU (it is a copy), hence the integer arrays themselves rather than a
view of float ones.

Addressing: token slot = page * S + offset. Page ids come from the rank's ``PageAllocator``; page 0 is the null
page that pads block tables; slot -1 marks a padded token whose write is dropped.

Data parallelism. Every DP rank (device) owns its own pages: on a mesh of R = data * expert devices the array of a
layer is [R * P, S, 1, W], sharded on its first axis over ("data", "expert") (``cache_sharding``), so rank r holds
global pages [r * P, (r + 1) * P). Page ids (allocator, block tables, slot mappings) are RANK-LOCAL in [0, P).
The runner is expected to run attention and cache writes inside ``jax.shard_map`` over ("data", "expert"), where
each rank sees its local [P, S, 1, W] block and uses its local ids unchanged (no cross-device gather, and the same
kernels as on one device). Code outside shard_map that indexes the global array must add r * P itself.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer.config import ModelConfig
from jaxinfer.kv.page_allocator import PAGE_SIZE


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedLatentCache:
    """One [P, S, 1, W] array per layer (a pytree: pass it through jit, donate it, shard it)."""

    layers: tuple[jax.Array, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_pages(self) -> int:
        """Pages in the (global) array: DP ranks * pages per rank."""
        return self.layers[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.layers[0].shape[1]

    @property
    def width(self) -> int:
        return self.layers[0].shape[3]

    @property
    def dtype(self):
        return self.layers[0].dtype


def latent_width(config: ModelConfig) -> int:
    """W = kv_lora_rank + qk_rope_head_dim (576 for DeepSeek-V3)."""
    return config.kv_lora_rank + config.qk_rope_head_dim


def cache_sharding(mesh: Mesh) -> NamedSharding:
    """First (page) axis split over all devices, DP rank order (d * E + e); other axes replicated."""
    return NamedSharding(mesh, PartitionSpec(("data", "expert")))


def init_paged_cache(config: ModelConfig, num_pages: int, dtype, num_layers: int | None = None, *,
                     page_size: int = PAGE_SIZE, mesh: Mesh | None = None, as_bits: bool = False) -> PagedLatentCache:
    """Zero cache of ``num_layers`` (default config.num_hidden_layers) arrays [R * num_pages, S, 1, W].

    ``num_pages`` is per DP rank (the engine option num_kv_pages); R = mesh.size with a mesh (array sharded with
    ``cache_sharding``), else 1. Pass num_layers = num_hidden_layers + num_nextn_predict_layers to include MTP.
    as_bits: hold values of ``dtype`` as their bit patterns (``bits_dtype``; see the module doc).
    """
    num_layers = config.num_hidden_layers if num_layers is None else num_layers
    if num_pages < 1 or num_layers < 1 or page_size < 1:
        raise ValueError(f"{num_pages=}, {num_layers=} and {page_size=} must be >= 1")
    ranks = 1 if mesh is None else mesh.size
    shape = (ranks * num_pages, page_size, 1, latent_width(config))   # [P, S, 1, W]
    device = None if mesh is None else cache_sharding(mesh)
    storage = bits_dtype(dtype) if as_bits else dtype
    return PagedLatentCache(tuple(jnp.zeros(shape, storage, device=device) for _ in range(num_layers)))


def bits_dtype(dtype) -> jnp.dtype:
    """The unsigned integer dtype a bit-pattern cache stores values of ``dtype`` in (bf16 -> uint16)."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"a latent cache holds floating-point values, got {dtype}")
    return jnp.dtype(f"uint{8 * dtype.itemsize}")


def holds_bits(cache_layer: jax.Array) -> bool:
    """True for a bit-pattern cache (``init_paged_cache(..., as_bits=True)``)."""
    return jnp.issubdtype(cache_layer.dtype, jnp.unsignedinteger)


def value_dtype(cache_layer: jax.Array, dtype) -> jnp.dtype:
    """The dtype of the values a cache layer holds: its own, or ``dtype`` (the model's) for a bit-pattern cache."""
    return jnp.dtype(dtype) if holds_bits(cache_layer) else cache_layer.dtype


def take_pages(cache_layer: jax.Array, pages: jax.Array, dtype) -> jax.Array:
    """cache_layer[pages] as values of ``value_dtype(cache_layer, dtype)``: [P, S, 1, W] indexed by int32 pages
    [...] -> [..., S, 1, W] (a bit-pattern cache is gathered as integers and decoded after the gather)."""
    pages_of = cache_layer[pages]
    if not holds_bits(cache_layer):
        return pages_of
    if bits_dtype(dtype) != cache_layer.dtype:
        raise ValueError(f"a {cache_layer.dtype} bit-pattern cache cannot hold {jnp.dtype(dtype)} values")
    return jax.lax.bitcast_convert_type(pages_of, dtype)


def write(cache_layer: jax.Array, latents: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatters token latents into their slots; jittable, pure (donate ``cache_layer`` to update in place).

    cache_layer [P, S, 1, W]; latents [N, W] (cast to the cache dtype; for a bit-pattern cache, stored as they
    are: a float dtype of the cache's width); slot_mapping [N] int32 with slot = page * S + offset, or -1 for a
    padding token (dropped). Slots other than -1 must be distinct (duplicates: an unspecified one wins). Returns
    the updated [P, S, 1, W].
    """
    p, s, h, w = cache_layer.shape
    if latents.ndim != 2 or latents.shape[1] != w or slot_mapping.shape != latents.shape[:1]:
        raise ValueError(f"latents {latents.shape} must be [N, {w}] and slot_mapping {slot_mapping.shape} [N]")
    if holds_bits(cache_layer):
        if bits_dtype(latents.dtype) != cache_layer.dtype:
            raise ValueError(f"a {cache_layer.dtype} bit-pattern cache cannot hold {latents.dtype} latents")
        values = jax.lax.bitcast_convert_type(latents, cache_layer.dtype)               # [N, W]
    else:
        values = latents.astype(cache_layer.dtype)
    # Indexed as [page, offset] on the array itself: scattering into a reshaped [P*S] view makes XLA:CPU copy
    # the whole (donated) cache. jnp normalises negative indices, so padding goes to an out-of-range page and is
    # dropped.
    page = jnp.where(slot_mapping < 0, p, slot_mapping // s)                          # [N]
    return cache_layer.at[page, slot_mapping % s, 0].set(values, mode="drop")


def bytes_per_page(config: ModelConfig, dtype, num_layers: int | None = None, page_size: int = PAGE_SIZE) -> int:
    """Device bytes of one page over all layers: layers * S * W * itemsize (V3, bf16: 61*64*576*2 = 4.5 MB)."""
    num_layers = config.num_hidden_layers if num_layers is None else num_layers
    return num_layers * page_size * latent_width(config) * np.dtype(dtype).itemsize


def default_num_pages(config: ModelConfig, dtype, free_bytes: int, fraction: float = 0.9,
                      num_layers: int | None = None, page_size: int = PAGE_SIZE) -> int:
    """Pages per DP rank fitting in ``fraction`` of one device's ``free_bytes`` (default of num_kv_pages).

    Raises ValueError when fewer than 2 pages fit (the null page plus one usable page).
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"{fraction=} must be in (0, 1]")
    per_page = bytes_per_page(config, dtype, num_layers, page_size)
    n = int(free_bytes * fraction) // per_page
    if n < 2:
        raise ValueError(f"{fraction} * {free_bytes} free bytes hold {n} pages of {per_page} bytes; need >= 2")
    return n
