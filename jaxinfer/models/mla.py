"""Multi-head Latent Attention (DeepSeek-V2 paper, sec. 2.1; HF DeepseekV3Attention).

Per token: ``c = rms(kv_a(x)[:C])`` (the latent, C = kv_lora_rank) and ``k_pe = rope(kv_a(x)[C:])`` (R dims, one
head shared by all heads) are all that is cached: C + R values (576 for V3). Two ways to attend over them:

- expanded (``__call__``, the cache-free forward of Model.logits and training): K_nope = c @ W_UK, V = c @ W_UV per
  head, then ordinary attention;
- absorbed (``paged``, the engine's steps that read the cache): q_lat = q_nope @ W_UK (per head, into latent
  space), scores = q_lat . c + q_pe . k_pe, o_lat = P @ c, out = o_lat @ W_UV. Same math, re-associated; the cache
  is never expanded. Engine steps of fresh prompts (no cached keys) expand their own latents (``paged``). The
  engine's steps are checked against the expanded forward (test_paged_forward.py), which is checked against
  transformers (test_parity_hf.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.kv.paged_cache import value_dtype
from jaxinfer.models.attention import AttentionBackend, AttentionMetadata, has_cached_keys, new_key_attention
from jaxinfer.models.layers import Linear, RMSNorm, matmul_nt_many
from jaxinfer.models.rope import apply_rope

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the default eps in HF and DeepSeek's code
SLICE_ROWS = 64  # rows per step from which the absorbed products slice W_UK / W_UV out of kv_b_proj (``paged``)
EXPANDED_T = 32  # columns per step from which a step without cached keys attends in the expanded form
# ... where the absorbed form's columns per head and key, 2C + R, are at least this many times the expanded form's,
# N + R + V: the decompression of the step's latents costs what the absorbed products cost (C (N + V) per head and
# token either way), so the columns are all it saves (docs/benchmarks.md "MLA prefill forms (CPU)").
EXPANDED_GAIN = 1.5


class MLA(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, fp8: str = "off",
                 row_shards: int = 1):
        c = config
        self.config = c
        self.dtype = dtype
        kw = dict(rngs=rngs, dtype=dtype, fp8=fp8, row_shards=row_shards)
        h, dqk = c.num_attention_heads, c.qk_head_dim
        if c.q_lora_rank is None:
            self.q_proj = Linear(c.hidden_size, h * dqk, **kw)
        else:
            self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, **kw)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS, dtype=dtype)
            self.q_b_proj = Linear(c.q_lora_rank, h * dqk, **kw)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, **kw)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, LATENT_NORM_EPS, dtype=dtype)
        self.kv_b_proj = Linear(c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim), **kw)
        self.o_proj = Linear(h * c.v_head_dim, c.hidden_size, **kw)

    # ---- projections ---------------------------------------------------------------------------------
    def queries(self, x, cos, sin, q_a=None):
        """x [B, T, D] -> q_nope [B, T, H, N], q_pe [B, T, H, R] (roped). q_a: q_a_proj(x) when already computed
        (``a_projections``)."""
        c = self.config
        if c.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x) if q_a is None else q_a))
        q = q.reshape(*x.shape[:2], c.num_attention_heads, c.qk_head_dim)  # [B, T, H, N+R]
        q_nope, q_pe = q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:]
        return q_nope, apply_rope(q_pe, cos, sin, c.rope_interleave)

    def latents(self, x, cos, sin, kv=None):
        """x [B, T, D] -> the cache entries [B, T, C + R]: [rms(c_kv) | rope(k_pe)]. kv: kv_a_proj_with_mqa(x)
        when already computed (``a_projections``)."""
        c = self.config
        kv = self.kv_a_proj_with_mqa(x) if kv is None else kv  # [B, T, C+R]
        c_kv = self.kv_a_layernorm(kv[..., : c.kv_lora_rank])
        k_pe = apply_rope(kv[..., c.kv_lora_rank:], cos, sin, c.rope_interleave)
        return jnp.concatenate([c_kv, k_pe], axis=-1)

    def a_projections(self, x):
        """x [B, T, D] -> (q_a_proj(x), kv_a_proj_with_mqa(x)) as one matmul_nt_many: the two products that read
        the hidden state (one matrix-vector product on CPU for one row, like an MLP's gate and up). (None, None)
        where they stay separate: no q_lora, or FP8 compute (its own GEMMs)."""
        if self.config.q_lora_rank is None or self.q_a_proj.fp8 == "compute":
            return None, None
        ws = [self.q_a_proj.kernel(), self.kv_a_proj_with_mqa.kernel()]
        q_a, kv = matmul_nt_many(x.astype(self.dtype), ws, self.kv_a_proj_with_mqa.row_shards)
        return q_a.astype(self.dtype), kv.astype(self.dtype)

    def w_uk_uv(self):
        """kv_b_proj split per head: W_UK [H, N, C], W_UV [H, V, C]."""
        c = self.config
        w = self.kv_b_proj.kernel().reshape(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim,
                                            c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]

    # ---- attention -----------------------------------------------------------------------------------
    def __call__(self, x, cos, sin, mask: jax.Array):
        """Attention over the T tokens of x [B, T, D] themselves, in the expanded form (K_nope = c @ W_UK and
        V = c @ W_UV per head); mask [B, T, T] bool (True = attend). Returns [B, T, D]."""
        c = self.config
        q_nope, q_pe = self.queries(x, cos, sin)
        kv = self.latents(x, cos, sin)  # [B, T, C+R]
        c_kv, k_pe = kv[..., : c.kv_lora_rank], kv[..., c.kv_lora_rank:]
        w_uk, w_uv = self.w_uk_uv()
        f32 = dict(preferred_element_type=jnp.float32)
        k_nope = jnp.einsum("bsc,hnc->bshn", c_kv, w_uk, **f32).astype(self.dtype)
        v = jnp.einsum("bsc,hvc->bshv", c_kv, w_uv, **f32).astype(self.dtype)
        scores = (jnp.einsum("bthn,bshn->bhts", q_nope, k_nope, **f32)
                  + jnp.einsum("bthr,bsr->bhts", q_pe, k_pe, **f32))
        scores = jnp.where(mask[:, None], scores * c.softmax_scale, -jnp.inf)  # [B, H, T, S]
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        out = jnp.einsum("bhts,bshv->bthv", probs, v, **f32)
        out = out.astype(self.dtype).reshape(*x.shape[:2], c.num_attention_heads * c.v_head_dim)
        return self.o_proj(out)

    def paged(self, x, cos, sin, cache, md: AttentionMetadata, backend: AttentionBackend, window=None,
              plan=None):
        """Attention over the paged latent cache (decode, MTP verification, chunked prefill). x [B, T, D]: the last T
        tokens of each sequence; cache [pages, 64, 1, C+R]; md: the step's metadata; backend: how the cache is read
        and written (models/attention.py); window: this layer's DecodeWindow or None. Returns ([B, T, D], the cache
        (updated when the backend writes in the step), this step's latents [B, T, C+R]).

        Absorbed (``_absorbed``) but for steps of fresh prompts, which have no cached keys to read: those attend to
        their own keys in the expanded form (``_expanded``; DeepSeek's and vLLM's prefill form), whose scores and
        values take N + R + V columns per head instead of 2C + R (160 vs 288 on the benchmark model, 320 vs 1088 on
        V3). A lax.cond picks the form at run time, so that a step's shape, not its prefix hits, sets its program;
        steps of fewer than EXPANDED_T columns (decode, verification) and shapes whose columns gain too little
        (EXPANDED_GAIN) compile the absorbed form alone."""
        q_a, kv = self.a_projections(x)
        q_nope, q_pe = self.queries(x, cos, sin, q_a)
        new = self.latents(x, cos, sin, kv).astype(value_dtype(cache, self.dtype))  # [B, T, C+R]
        absorbed = functools.partial(self._absorbed, q_nope, q_pe, new, cache, md, backend, window, plan)
        if x.shape[1] < EXPANDED_T or window is not None or backend.writes_in_step or not self.expands_fresh_steps:
            out, cache = absorbed()
        else:  # the cache is only read (the backend returns it as given)
            out = jax.lax.cond(has_cached_keys(plan, md), lambda: absorbed()[0],
                               lambda: self._expanded(q_nope, q_pe, new, md, plan))
        return self.o_proj(out), cache, new

    @property
    def expands_fresh_steps(self) -> bool:
        """Whether steps without cached keys take the expanded form (EXPANDED_GAIN)."""
        c = self.config
        return (2 * c.kv_lora_rank + c.qk_rope_head_dim
                >= EXPANDED_GAIN * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim))

    def _absorbed(self, q_nope, q_pe, new, cache, md, backend, window, plan):
        """The absorbed form (module doc) -> ([B, T, H * V] in the model dtype, the cache)."""
        c = self.config
        n = c.qk_nope_head_dim
        # Both absorbed products use kv_b_proj whole, [H, N+V, C] (a reshape): slicing W_UK and W_UV out of it
        # costs XLA:CPU a copy of each per layer and step; zero-padding q_nope to N+V and dropping the first N
        # outputs costs a few flops instead. Heads lead both operands ("hmk,hkc->hmc", M = B*T): XLA:CPU then
        # runs the products as YNNPACK batched dots on the model-dtype operands (float32 accumulation). With heads
        # in the middle ("bthk,hkc->bthc") they become Eigen dots on float32 copies of the weights, which are
        # slower (docs/benchmarks.md "GEMM forms (CPU)").
        # Steps of many rows slice them after all: the padding doubles both products' flops (N = V), which costs
        # more than the copies from about SLICE_ROWS rows on (docs/benchmarks.md "GEMM forms (CPU)").
        h, b, t = c.num_attention_heads, q_nope.shape[0], q_nope.shape[1]
        w_ukv = self.kv_b_proj.kernel().reshape(h, n + c.v_head_dim, c.kv_lora_rank)  # [H, N+V, C]
        sliced = b * t >= SLICE_ROWS
        if sliced:
            w_uk, w_uv = w_ukv[:, :n], w_ukv[:, n:]  # [H, N, C], [H, V, C]
            q_in = q_nope.reshape(b * t, h, n).transpose(1, 0, 2)  # [H, M, N]
        else:
            w_uk = w_uv = w_ukv
            q_in = jnp.pad(q_nope, [(0, 0)] * 3 + [(0, c.v_head_dim)])  # [B, T, H, N+V]
            q_in = q_in.reshape(b * t, h, n + c.v_head_dim).transpose(1, 0, 2)  # [H, M, N+V]
        q_lat = jnp.einsum("hmk,hkc->hmc", q_in, w_uk, preferred_element_type=jnp.float32)  # = q_nope @ W_UK
        q_lat = q_lat.transpose(1, 0, 2).reshape(b, t, h, c.kv_lora_rank)  # [B, T, H, C]
        q = jnp.concatenate([q_lat.astype(self.dtype), q_pe], axis=-1)  # [B, T, H, C+R]
        o_lat, cache = backend(plan, q, new, cache, md, window, head_dim_v=c.kv_lora_rank,
                               softmax_scale=c.softmax_scale)  # [B, T, H, C]
        o_lat = o_lat.reshape(b * t, h, c.kv_lora_rank).transpose(1, 0, 2)  # [H, M, C]
        out = jnp.einsum("hmc,hkc->hmk", o_lat, w_uv, preferred_element_type=jnp.float32)  # [H, M, N+V] or [H, M, V]
        out = out if sliced else out[..., n:]  # [H, M, V] = o_lat @ W_UV^T
        out = out.transpose(1, 0, 2)  # [M, H, V]
        return out.astype(self.dtype).reshape(b, t, h * c.v_head_dim), cache

    def _expanded(self, q_nope, q_pe, new, md, plan):
        """The expanded form over the step's own keys (a step without cached keys) -> [B, T, H * V] in the model
        dtype: K_nope and V from kv_b_proj over the step's latents (rounded to the cache's dtype, as the absorbed
        form reads them), k_pe shared by the heads."""
        c = self.config
        n, r, h = c.qk_nope_head_dim, c.qk_rope_head_dim, c.num_attention_heads
        b, t = q_nope.shape[:2]
        latent = new.astype(self.dtype)
        kv = self.kv_b_proj(latent[..., : c.kv_lora_rank]).reshape(b, t, h, n + c.v_head_dim)  # [B, T, H, N+V]
        k_pe = jnp.broadcast_to(latent[:, :, None, c.kv_lora_rank:], (b, t, h, r))  # [B, T, H, R]
        heads_first = functools.partial(jnp.transpose, axes=(0, 2, 1, 3))  # [B, T, H, X] -> [B, H, T, X]
        q = heads_first(jnp.concatenate([q_nope, q_pe], axis=-1))  # [B, H, T, N+R]
        k = heads_first(jnp.concatenate([kv[..., :n], k_pe], axis=-1))  # [B, H, T, N+R]
        out = new_key_attention(plan, q, k, heads_first(kv[..., n:]), md, softmax_scale=c.softmax_scale)
        return heads_first(out).astype(self.dtype).reshape(b, t, h * c.v_head_dim)  # [B, T, H * V]
