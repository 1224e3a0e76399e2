"""The arithmetic of one DeepSeek-family model: parameters, FLOPs and bytes per token and per layer (pure Python).

Counts follow the model's layers (jaxinfer/models, DeepSeek-V3's modeling code): MLA with a low-rank query
(q_lora_rank, or a full query projection without it), the joint latent kv_a (kv_lora_rank + rope) and its
up-projection kv_b, the output projection; dense MLPs (gate, up, down) in the first ``first_k_dense_replace``
layers, then routed experts (top ``num_experts_per_tok`` of ``n_routed_experts``) and shared experts. A product of
an [m, k] activation with a [k, n] weight is 2 m k n FLOPs. Attention as DeepSeek serves it: decoding in the
absorbed form over the latent cache (FlashMLA: each query head scores (kv_lora + rope) wide keys and sums kv_lora
wide values), prefill in the expanded (MHA) form over decompressed keys and values (qk_nope + rope wide scores,
v_head wide values). Norms, rotary embeddings, the router's top-k and softmax are left out (under 1% of the
FLOPs and bytes of the products above).
"""

from __future__ import annotations

import dataclasses

from jaxinfer.config import ModelConfig

QUANT_GROUP = 128  # FP8 activations carry one float32 scale per 128 channels (DeepEP / DeepGEMM; parallel/dispatch.py)


def dispatch_payload_bytes(hidden: int, fp8: bool) -> int:
    """Bytes of one token sent to one expert rank: e4m3 values + float32 scales per QUANT_GROUP channels (DeepEP's
    FP8 dispatch), or bfloat16 values (BF16 dispatch and every combine)."""
    return hidden + 4 * -(-hidden // QUANT_GROUP) if fp8 else 2 * hidden


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Per-layer parameter counts and per-token costs of a ModelConfig."""

    config: ModelConfig

    # ---- parameters -------------------------------------------------------------------------------------
    @property
    def attention_params(self) -> int:
        """q (q_a + q_b, or q_proj), kv_a, kv_b and o projections of one layer."""
        c = self.config
        heads = c.num_attention_heads
        q = (c.hidden_size * c.q_lora_rank + c.q_lora_rank * heads * c.qk_head_dim if c.q_lora_rank
             else c.hidden_size * heads * c.qk_head_dim)
        kv_a = c.hidden_size * (c.kv_lora_rank + c.qk_rope_head_dim)
        kv_b = c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
        o = heads * c.v_head_dim * c.hidden_size
        return q + kv_a + kv_b + o

    def attention_params_split(self, absorbed: bool) -> tuple[int, int]:
        """attention_params before the attention core and after it: absorbed (decode), kv_b's key half is applied
        to the queries before the core and its value half to the core's output after it; expanded (prefill), kv_b
        decompresses keys and values before the core. After the core: that and the o projection."""
        c = self.config
        heads = c.num_attention_heads
        after = heads * c.v_head_dim * c.hidden_size + (c.kv_lora_rank * heads * c.v_head_dim if absorbed else 0)
        return self.attention_params - after, after

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.config.hidden_size * self.config.intermediate_size

    @property
    def expert_params(self) -> int:
        """One routed (or shared) expert's gate, up and down projections."""
        return 3 * self.config.hidden_size * self.config.moe_intermediate_size

    @property
    def embedding_params(self) -> int:
        """Input embedding and LM head (one matrix when tied)."""
        c = self.config
        return c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)

    @property
    def mtp_extra_params(self) -> int:
        """An MTP module beyond its transformer layer: the projection of [embedding; hidden] to hidden (its norms
        are small; it shares the embedding and the head)."""
        return 2 * self.config.hidden_size ** 2

    @property
    def num_dense_layers(self) -> int:
        return self.config.first_k_dense_replace

    @property
    def num_moe_layers(self) -> int:
        return self.config.num_hidden_layers - self.config.first_k_dense_replace

    # ---- per token ---------------------------------------------------------------------------------------
    @property
    def latent_width(self) -> int:
        """Values cached per token and layer: the latent (kv_lora_rank) and the rotary key (qk_rope_head_dim)."""
        return self.config.kv_lora_rank + self.config.qk_rope_head_dim

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """The latent cache of one token over all layers (bfloat16 by default, as DeepSeek's MLA keeps it)."""
        return self.config.num_hidden_layers * self.latent_width * dtype_bytes

    def decode_attention_flops(self, context: float) -> float:
        """The absorbed MLA core of one query token against ``context`` cached tokens, one layer: every head scores
        (kv_lora + rope) wide keys and sums kv_lora wide values."""
        c = self.config
        return 2.0 * c.num_attention_heads * context * (self.latent_width + c.kv_lora_rank)

    def prefill_attention_flops(self, new: float, cached: float) -> float:
        """The expanded MLA core of a chunk of ``new`` tokens after ``cached`` ones, one layer, causal: query i sees
        cached + i + 1 keys, (qk_nope + rope) wide scores and v_head wide values per head."""
        c = self.config
        pairs = new * cached + new * (new + 1) / 2
        return 2.0 * c.num_attention_heads * pairs * (c.qk_head_dim + c.v_head_dim)

    def decompress_flops(self, tokens: float) -> float:
        """kv_b applied to ``tokens`` cached latents (the expanded form's keys and values of a prefix), one layer."""
        c = self.config
        return 2.0 * tokens * c.kv_lora_rank * c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim)
