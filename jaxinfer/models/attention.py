"""Paged MLA attention: one metadata pytree for a step's tokens, and the attention backends that read it.

``AttentionMetadata`` (tpu-inference's shape) says where the step's tokens sit: their positions, each row's block
table and length, the cache slots they write, and for a multi-step decode program the window of its earlier
iterations. The model passes it, unchanged, from the engine's step to every layer's attention.

The step's T tokens are the last T of each sequence (positions seqlens - T .. seqlens - 1), so one causal call
(FlashMLA's contract: query i sees keys < seqlen - T + i + 1) serves decode (T = 1), MTP verification (T = k + 1)
and chunked prefill. On a mesh every device is a DP rank with its own pages: attention runs inside ``shard_map``
on the rank's local pages with rank-local page ids (jaxinfer/kv/paged_cache.py).

A backend is chosen once per engine (``BACKENDS``; EngineConfig.attention_backend):
- "pallas": the step's latents are written into the cache, then ``mla_decode`` reads it (the Mosaic GPU kernel on
  a GPU; elsewhere mla_decode's XLA implementation computes the same contract). The layers return the cache.
- "xla": the cache is only read: ``kernels_pallas.mla.chunked_attention`` attends to the cached keys page chunk by
  page chunk and to the step's own latents, and the layers return the latents, which the engine writes after the
  step (``write_latents``, the cache donated). When one program both scatters into a donated cache and gathers
  from it, XLA:CPU copies the whole cache (twice per layer and step), so a step would cost in proportion to
  num_kv_pages instead of the batch. A multi-step decode program computes several tokens of each sequence before
  anything is written: the latents of its earlier iterations come in a ``DecodeWindow`` and are read as if they
  were already cached (the same chunks, the same arithmetic).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxinfer.kv.paged_cache import write
from jaxinfer.parallel.dispatch import BATCH_AXES
from jaxinfer.parallel.plan import ParallelPlan
from kernels_pallas import mla_decode
from kernels_pallas.mla import DecodeWindow, chunked_attention, expanded_new_key_attention, query_block_attention

# Keys per online-softmax step of the XLA backend on CPU: a batch's chunk of V3-sized keys stays within the CPU's
# last-level cache (the chunk sizes measured: docs/benchmarks.md, "Paged attention, XLA path (CPU)").
CHUNK_TOKENS = 256


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where a step's tokens sit in the paged latent cache (a pytree; B rows of T tokens, P pages per row).

    positions: int32 [B, T], the tokens' positions (RoPE and the causal rule).
    block_table: int32 [B, P], each row's pages (rank-local ids; the null page 0 pads).
    seqlens: int32 [B], tokens in the row's cache after this step, its own included (0: a padding row).
    slots: int32 [B, T], page * page_size + offset of each token; -1: a padding token (writes nothing).
    window_latents: None, or per layer [B, W, C+R]: a multi-step decode program's earlier iterations, not yet in
      the cache (the XLA backend); window_start int32 [B]: their first position; window_length: int32 scalar,
      how many exist.
    first_block: None (every row is its own chunk), or int32 [B]: a step in query blocks (a chunk over
      consecutive rows, kernels_pallas/mla/query_blocks.py): the rank-local row of each row's chunk's first block;
      seqlens is then each block's last position + 1.
    """

    positions: jax.Array
    block_table: jax.Array
    seqlens: jax.Array
    slots: jax.Array
    window_latents: tuple[jax.Array, ...] | None = None
    window_start: jax.Array | None = None
    window_length: jax.Array | None = None
    first_block: jax.Array | None = None

    def window(self, layer: int) -> DecodeWindow | None:
        """Layer ``layer``'s DecodeWindow, or None."""
        if self.window_latents is None:
            return None
        return DecodeWindow(self.window_latents[layer], self.window_start, self.window_length)


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """How a layer attends over the paged cache (see the module doc). writes_in_step: the layer writes the step's
    latents into the cache and returns it; else the cache is only read and the layer returns the latents."""

    name: str
    writes_in_step: bool

    def __call__(self, plan: ParallelPlan | None, q: jax.Array, new_latents: jax.Array, cache: jax.Array,
                 md: AttentionMetadata, window: DecodeWindow | None, *, head_dim_v: int,
                 softmax_scale: float) -> tuple[jax.Array, jax.Array]:
        """q [B, T, H, C+R] (absorbed queries: [q_nope @ W_UK | roped q_pe]), new_latents [B, T, C+R], cache
        [pages, 64, 1, C+R] -> (o_lat [B, T, H, head_dim_v], the cache: updated when writes_in_step, else as
        given). window: this layer's DecodeWindow (the XLA backend only)."""
        if window is not None and self.writes_in_step:
            raise ValueError(f"the {self.name} backend writes every token: it reads no DecodeWindow")

        def local(q, new, cache, block_table, seqlens, slots, window, first_block):
            if self.writes_in_step:  # a block is a row whose seqlen ends at its last column: nothing else to do
                cache = write(cache, new.reshape(-1, new.shape[-1]), slots.reshape(-1))
                out, _ = mla_decode(q, cache, block_table, seqlens, head_dim_v=head_dim_v,
                                    softmax_scale=softmax_scale, causal=True)
                return out, cache
            if first_block is not None:
                out = query_block_cached_and_new(q, new, cache, block_table, seqlens, slots, first_block,
                                                 head_dim_v=head_dim_v, softmax_scale=softmax_scale)
                return out, cache
            out = cached_and_new_attention(q, new, cache, block_table, seqlens, slots, head_dim_v=head_dim_v,
                                           softmax_scale=softmax_scale, window=window)
            return out, cache

        args = (q, new_latents, cache, md.block_table, md.seqlens, md.slots, window, md.first_block)
        if plan is None:
            return local(*args)
        spec = P(BATCH_AXES)
        window_spec = None
        if window is not None:
            window_spec = DecodeWindow(spec, spec, P() if jnp.ndim(window.length) == 0 else spec)
        block_spec = None if md.first_block is None else spec
        return jax.shard_map(local, mesh=plan.mesh, in_specs=(spec,) * 6 + (window_spec, block_spec),
                             out_specs=(spec, spec))(*args)


BACKENDS = {"pallas": AttentionBackend("pallas", writes_in_step=True),
            "xla": AttentionBackend("xla", writes_in_step=False)}


def cached_lengths(seqlens: jax.Array, slots: jax.Array, first_block: jax.Array | None = None) -> jax.Array:
    """[B] int32: each row's keys in the cache before its chunk (AttentionMetadata's seqlens, slots, first_block;
    rank-local). A grid row's chunk is its real tokens (slots >= 0); a query block's, its chunk's rows first_block
    .. b. 0 for padding rows and for every row of a fresh prompt's prefill."""
    n_real = jnp.sum(slots >= 0, axis=1, dtype=seqlens.dtype)  # [B]
    if first_block is None:
        return seqlens - n_real
    through = jnp.cumsum(n_real)  # [B]: real tokens of rows 0 .. b
    return seqlens - (through - (through[first_block] - n_real[first_block]))  # minus the chunk's tokens up to b


def cached_and_new_attention(q: jax.Array, new_latents: jax.Array, cache: jax.Array, block_table: jax.Array,
                             seqlens: jax.Array, slots: jax.Array, *, head_dim_v: int, softmax_scale: float,
                             chunk_tokens: int = CHUNK_TOKENS, window: DecodeWindow | None = None) -> jax.Array:
    """The XLA backend's attention, without writing the step's latents first: kernels_pallas.mla's
    ``chunked_attention`` with the step's latents as its new keys. The cache may hold the latents' bit patterns
    (paged_cache's bit-pattern storage; their dtype is new_latents').

    Shapes as AttentionBackend; a row's real tokens are its last n (slots >= 0; the engine left-pads prefill chunks),
    at positions seqlens - n ... seqlens - 1. Keys: the cached positions < seqlens - n, read page chunk by page chunk
    (``chunk_tokens`` per chunk), and the step's own latents, causal among themselves. A real query sees exactly the
    keys of FlashMLA's causal contract (mla_decode); padding queries (slot -1) get outputs that nothing reads.
    ``window``: cached positions whose latents are not in the cache yet. Returns o_lat [B, T, H, head_dim_v] in q's
    dtype.
    """
    real = slots >= 0  # [B, T]
    cached_len = cached_lengths(seqlens, slots)  # [B]: keys before the step's tokens
    out, _ = chunked_attention(q, cache, block_table, cached_len, head_dim_v=head_dim_v, softmax_scale=softmax_scale,
                               chunk_pages=max(1, chunk_tokens // cache.shape[1]), value_dtype=new_latents.dtype,
                               new_keys=new_latents, new_valid=real, window=window)
    return out


def query_block_cached_and_new(q: jax.Array, new_latents: jax.Array, cache: jax.Array, block_table: jax.Array,
                               seqlens: jax.Array, slots: jax.Array, first_block: jax.Array, *, head_dim_v: int,
                               softmax_scale: float, chunk_tokens: int = CHUNK_TOKENS) -> jax.Array:
    """The XLA backend's attention for a step in query blocks (AttentionMetadata.first_block): kernels_pallas.mla's
    ``query_block_attention``, the cache read page chunk by page chunk and each chunk's new keys from the step's
    latents. Shapes as AttentionBackend; a block's real tokens are its slots >= 0. Returns o_lat [B, Q, H,
    head_dim_v] in q's dtype."""
    real = slots >= 0  # [B, Q]
    cached_len = cached_lengths(seqlens, slots, first_block)  # [B]: the chunk's start (0 for padding rows)
    s_q, page = q.shape[1], cache.shape[1]
    out, _ = query_block_attention(q, new_latents, real, cache, block_table, cached_len, first_block,
                                   head_dim_v=head_dim_v, softmax_scale=softmax_scale,
                                   chunk_pages=max(1, chunk_tokens // page),
                                   blocks_per_step=max(1, chunk_tokens // s_q), value_dtype=new_latents.dtype)
    return out


def has_cached_keys(plan: ParallelPlan | None, md: AttentionMetadata) -> jax.Array:
    """bool scalar: whether any row of the step reads keys from the cache (a chunk after a prefix hit or an earlier
    chunk, a decode step); False for a step of fresh prompts only, on every rank alike."""

    def local(seqlens, slots, first_block):  # -> [1]
        return jnp.max(cached_lengths(seqlens, slots, first_block), keepdims=True) > 0

    args = (md.seqlens, md.slots, md.first_block)
    if plan is None:
        return local(*args)[0]
    spec = P(BATCH_AXES)
    block_spec = None if md.first_block is None else spec
    return jnp.any(jax.shard_map(local, mesh=plan.mesh, in_specs=(spec, spec, block_spec), out_specs=spec)(*args))


def new_key_attention(plan: ParallelPlan | None, q: jax.Array, k: jax.Array, v: jax.Array, md: AttentionMetadata, *,
                      softmax_scale: float, chunk_tokens: int = CHUNK_TOKENS) -> jax.Array:
    """Attention of a step without cached keys (``has_cached_keys`` False) over its own keys, in the expanded form
    (kernels_pallas.mla.expanded_new_key_attention): q, k [B, H, T, N + R], v [B, H, T, V] per head -> out [B, H,
    T, V] float32. A row sees its own real keys causally and, in query blocks, the earlier blocks of its chunk."""

    def local(q, k, v, slots, first_block):
        return expanded_new_key_attention(q, k, v, slots >= 0, first_block, softmax_scale=softmax_scale,
                                          blocks_per_step=max(1, chunk_tokens // q.shape[2]))[0]

    args = (q, k, v, md.slots, md.first_block)
    if plan is None:
        return local(*args)
    spec = P(BATCH_AXES)
    block_spec = None if md.first_block is None else spec
    return jax.shard_map(local, mesh=plan.mesh, in_specs=(spec,) * 4 + (block_spec,), out_specs=spec)(*args)


def write_latents(mesh, cache: jax.Array, new_latents: jax.Array, slots: jax.Array) -> jax.Array:
    """Writes a step's latents [B, T, C+R] into one layer's cache at slots [B, T] (rank-local page ids on a mesh;
    -1 = padding). Donate ``cache`` to update it in place."""

    def local(cache, new, slots):
        return write(cache, new.reshape(-1, new.shape[-1]), slots.reshape(-1))

    if mesh is None:
        return local(cache, new_latents, slots)
    spec = P(BATCH_AXES)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(cache, new_latents, slots)
