"""The DeepSeek-V2/V3 causal LM (HF ``DeepseekV3ForCausalLM``) with its MTP module, in Flax NNX.

One implementation serves the engine and training: ``hidden_states`` is the cache-free forward (Model.logits, the
training step), ``paged_hidden_states`` one engine step over the paged latent cache (models/attention.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.models.attention import BACKENDS, AttentionBackend, AttentionMetadata
from jaxinfer.models.layers import MLP, Linear, RMSNorm, matmul_nt, normal_init
from jaxinfer.models.mla import MLA
from jaxinfer.models.moe import MoE
from jaxinfer.models.rope import rope_cos_sin
from jaxinfer.parallel.plan import ParallelPlan, batch_shards
from kernels_pallas.mla import DecodeWindow


class DecoderLayer(nnx.Module):
    """Pre-norm block: x += attn(norm(x)); x += ffn(norm(x)). MoE from layer first_k_dense_replace on."""

    def __init__(self, config: ModelConfig, layer: int, *, rngs: nnx.Rngs, dtype, fp8: str,
                 plan: ParallelPlan | None = None):
        kw = dict(rngs=rngs, dtype=dtype, fp8=fp8)
        rows = dict(row_shards=batch_shards(plan))  # dense layers run on the whole (sharded) batch
        self.plan = plan
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.self_attn = MLA(config, **kw, **rows)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        if config.is_moe_layer(layer):
            self.mlp = MoE(config, plan=plan, **kw)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, **kw, **rows)

    def __call__(self, x, positions, cos, sin):
        """x [B, T, D], positions [B, T]: the block over the T tokens themselves (causal). Returns x."""
        mask = positions[:, None, :] <= positions[:, :, None]  # [B, T, T] causal over positions
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def paged(self, x, cos, sin, cache, md: AttentionMetadata, backend: AttentionBackend, window=None):
        """The block over the paged latent cache (see MLA.paged). Returns (x, cache, this step's latents, expert
        load: int32 [P, E] per DP rank from the real tokens (slot >= 0), see MoE.forward; None for a dense MLP)."""
        attn, cache, new = self.self_attn.paged(self.input_layernorm(x), cos, sin, cache, md, backend, window,
                                                self.plan)
        x = x + attn
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):
            y, load = self.mlp.forward(h, md.slots >= 0)
            return x + y, cache, new, load
        return x + self.mlp(h), cache, new, None


class MTPLayer(nnx.Module):
    """DeepSeek-V3 multi-token prediction module (V3 report sec. 2.2): combines h_t with embed(t+1)."""

    def __init__(self, config: ModelConfig, layer: int, *, rngs: nnx.Rngs, dtype, fp8: str, eh_proj_fp8: str,
                 plan: ParallelPlan | None = None):
        d, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(d, eps, dtype=dtype)
        self.hnorm = RMSNorm(d, eps, dtype=dtype)
        self.eh_proj = Linear(2 * d, d, rngs=rngs, dtype=dtype, fp8=eh_proj_fp8,
                              row_shards=batch_shards(plan))
        self.block = DecoderLayer(config, layer, rngs=rngs, dtype=dtype, fp8=fp8, plan=plan)
        self.shared_head_norm = RMSNorm(d, eps, dtype=dtype)


class DeepseekForCausalLM(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, fp8: str = "off",
                 num_mtp_layers: int | None = None, mtp_eh_proj_fp8: str = "off",
                 plan: ParallelPlan | None = None):
        """fp8: projection weights "off" (compute dtype), "weights" (e4m3 + block scales, dequantized exactly on
        the fly) or "compute" (FP8 GEMMs on per-token-quantized activations); see layers.py.
        num_mtp_layers: defaults to config.num_nextn_predict_layers (0 disables MTP).
        plan: the mesh layout (expert-parallel MoE); None runs everything on one device."""
        c = config
        self.config = c
        self.dtype = dtype
        self.row_shards = batch_shards(plan)  # the devices the batch is split over (matmul_nt)
        self.embed_tokens = nnx.Param(normal_init(rngs, (c.vocab_size, c.hidden_size), dtype))
        self.layers = nnx.List([DecoderLayer(c, i, rngs=rngs, dtype=dtype, fp8=fp8, plan=plan)
                                for i in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.lm_head = nnx.data(
            None if c.tie_word_embeddings else Linear(c.hidden_size, c.vocab_size, rngs=rngs, dtype=dtype,
                                                      row_shards=self.row_shards))
        n_mtp = c.num_nextn_predict_layers if num_mtp_layers is None else num_mtp_layers
        self.mtp = nnx.List([MTPLayer(c, c.num_hidden_layers + k, rngs=rngs, dtype=dtype, fp8=fp8,
                                      eh_proj_fp8=mtp_eh_proj_fp8, plan=plan) for k in range(n_mtp)])

    def embed(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embed_tokens[...], ids, axis=0)  # [B, T, D]

    def head_weight(self) -> jax.Array:
        """The LM head [V, D] in the model dtype: lm_head, or the embedding when they are tied."""
        return self.embed_tokens[...] if self.lm_head is None else self.lm_head.kernel()

    def head(self, h: jax.Array) -> jax.Array:
        """h [B, T, D] (normed) -> float32 logits [B, T, V]."""
        w = self.head_weight()
        # h in the model dtype, as HF's final norm returns it: a float32 h against bf16 weights makes XLA:CPU convert
        # the whole [V, D] head to float32 at every step (batch 32: a 4.2 M-element convert per decode step).
        return matmul_nt(h.astype(self.dtype), w, self.row_shards)  # [B, T, V]

    def hidden_states(self, ids: jax.Array, positions: jax.Array) -> jax.Array:
        """ids, positions [B, T] -> final-normed hidden states [B, T, D] (causal over the T tokens)."""
        cos, sin = rope_cos_sin(self.config, positions)
        # The residual stream stays in float32 (sublayers still take bf16 inputs): cheap, and it keeps bf16
        # rounding from accumulating over the layers.
        x = self.embed(ids).astype(jnp.float32)
        for layer in self.layers:
            x = layer(x, positions, cos, sin)
        return self.norm(x)

    def __call__(self, ids, positions):
        """ids, positions [B, T] -> float32 logits [B, T, V]."""
        return self.head(self.hidden_states(ids, positions))

    def paged_hidden_states(self, ids, cache: tuple[jax.Array, ...], md: AttentionMetadata,
                            backend: AttentionBackend):
        """One engine step over the paged latent cache: ids [B, T] (the last T tokens of each sequence; slot -1 =
        padding), cache: per layer [pages, 64, 1, C+R], md: where the tokens sit (models/attention.py), backend:
        how the cache is read and written. Returns (final-normed hidden states [B, T, D], per layer the updated
        cache (a backend that writes in the step) or this step's latents [B, T, C+R] for the caller to write
        (attention.write_latents), expert load). Expert load: int32 [P, L, E], the real tokens' choices of each
        logical expert in each of the L MoE layers, per DP rank P (MoE.forward; sum over P to read it)."""
        cos, sin = rope_cos_sin(self.config, md.positions)
        x = self.embed(ids).astype(jnp.float32)  # float32 residual stream, as in hidden_states
        out, loads = [], []
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache, strict=True)):
            x, layer_cache, new, load = layer.paged(x, cos, sin, layer_cache, md, backend, md.window(i))
            out.append(layer_cache if backend.writes_in_step else new)
            if load is not None:
                loads.append(load)
        load = jnp.stack(loads, 1) if loads else jnp.zeros((1, 0, self.config.n_routed_experts), jnp.int32)
        return self.norm(x), tuple(out), load

    def mtp_logits(self, h: jax.Array, next_ids: jax.Array, positions: jax.Array, depth: int = 0) -> jax.Array:
        """MTP module ``depth``: h [B, T, D] (main model after its final norm), next_ids [B, T] (token t+1 for
        row t), positions [B, T] -> float32 logits [B, T, V] for token t+2 (causal over the rows)."""
        m = self.mtp[depth]
        cos, sin = rope_cos_sin(self.config, positions)
        x = m.block(self._mtp_input(m, h, next_ids), positions, cos, sin)
        return self.mtp_head(x, depth)

    def _mtp_input(self, m, h: jax.Array, next_ids: jax.Array) -> jax.Array:
        """eh_proj([enorm(embed(next_ids)); hnorm(h)]) [B, T, D], float32 (the residual stream's dtype, as in the
        main layers)."""
        x = m.eh_proj(jnp.concatenate([m.enorm(self.embed(next_ids)), m.hnorm(h.astype(self.dtype))], axis=-1))
        return x.astype(jnp.float32)

    def paged_mtp(self, h: jax.Array, next_ids: jax.Array, cache: jax.Array, md: AttentionMetadata,
                  window: DecodeWindow | None = None, depth: int = 0):
        """MTP module ``depth`` over its own paged latent cache (speculative decoding, engine/drafter.py): row t
        combines h [B, T, D] (the main model's final-normed hidden state at position t, or the module's own output
        when drafts are chained) with next_ids [B, T] (token t + 1), at md's positions and slots (the main model's:
        the module's cache shares the block tables). The cache is only read (the XLA backend's contract, on every
        platform: the engine writes the latents after the step), with ``window`` for latents not written yet.
        Returns (the module's output [B, T, D] before its shared_head norm, float32; this step's latents
        [B, T, C+R]). ``mtp_head`` turns the output into logits for token t + 2."""
        m = self.mtp[depth]
        cos, sin = rope_cos_sin(self.config, md.positions)
        x, _, new, _ = m.block.paged(self._mtp_input(m, h, next_ids), cos, sin, cache, md, BACKENDS["xla"], window)
        return x, new

    def mtp_head(self, g: jax.Array, depth: int = 0) -> jax.Array:
        """The MTP module's output g [B, T, D] (``paged_mtp``) -> float32 logits [B, T, V] (its shared head norm,
        then the LM head, shared with the main model as in DeepSeek-V3)."""
        return self.head(self.mtp[depth].shared_head_norm(g))
