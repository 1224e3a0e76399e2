"""The arithmetic of one DeepSeek-family model: parameters, FLOPs and bytes per token and per layer (pure Python).

Counts follow the model's layers (jaxinfer/models, DeepSeek-V3's modeling code): MLA with a low-rank query
(q_lora_rank, or a full query projection without it), the joint latent kv_a (kv_lora_rank + rope) and its
up-projection kv_b, the output projection; dense MLPs (gate, up, down) in the first ``first_k_dense_replace``
layers, then routed experts (top ``num_experts_per_tok`` of ``n_routed_experts``) and shared experts. A product of
an [m, k] activation with a [k, n] weight is 2 m k n FLOPs. Attention as DeepSeek serves it: decoding in the
absorbed form over the latent cache (FlashMLA: each query head scores (kv_lora + rope) wide keys and sums kv_lora
wide values), prefill in the expanded (MHA) form over decompressed keys and values (qk_nope + rope wide scores,
v_head wide values). The kernels between the products (norms, FP8 quantization, rotary embeddings, SiLU, moving
rows to and from the experts, residual adds) do no FLOPs worth counting, but move every token's activations through
HBM several times a layer: ``elementwise_bytes`` counts those bytes, as ``activation_bytes`` counts the products'
own inputs and outputs (in prefill, at thousands of tokens per GPU, both exceed the weights read).
"""

from __future__ import annotations

import dataclasses

from jaxinfer.config import ModelConfig

QUANT_GROUP = 128  # FP8 activations carry one float32 scale per 128 channels (DeepEP / DeepGEMM; parallel/dispatch.py)


def dispatch_payload_bytes(hidden: int, fp8: bool) -> int:
    """Bytes of one token sent to one expert rank: e4m3 values + float32 scales per QUANT_GROUP channels (DeepEP's
    FP8 dispatch), or bfloat16 values (BF16 dispatch and every combine)."""
    return hidden + 4 * -(-hidden // QUANT_GROUP) if fp8 else 2 * hidden


def quantize_bytes(width: float, quantized: bool) -> float:
    """A vector quantized for an FP8 product: bf16 read, e4m3 + scales written (nothing without FP8 products)."""
    return 2 * width + dispatch_payload_bytes(width, True) if quantized else 0


def silu_mul_bytes(width: float, quantized: bool) -> float:
    """SiLU-and-mul: gate and up read, the product written (e4m3 + scales for an FP8 product, or bf16)."""
    return 2 * 2 * width + (dispatch_payload_bytes(width, True) if quantized else 2 * width)


class MoEShapes:
    """What the families' arithmetic shares (``Shapes`` here, v4.py's ``V4Shapes``): the attention's totals from
    each family's ``attention_products``, the experts, the embedding and head, the MTP module's projection, and the
    bytes around the products. ``config`` has hidden_size, moe_intermediate_size, intermediate_size,
    n_shared_experts, vocab_size and tie_word_embeddings."""

    @property
    def attention_params(self) -> int:
        """One layer's attention weights (attention_products' weights)."""
        return sum(self.attention_params_split(absorbed=False))

    def attention_params_split(self, absorbed: bool) -> tuple[int, int]:
        """attention_params before the attention core and after it (attention_products' stages)."""
        products = self.attention_products(absorbed)
        return tuple(sum(g * k * n for _, g, k, n, stage in products if stage == want)
                     for want in ("prepare", "core"))

    def activation_bytes(self, absorbed: bool, in_bytes: int) -> dict[str, int]:
        """Bytes one token's products read and write besides their weights, per layer: inputs of ``in_bytes`` each
        (FP8 products take quantized activations) and bfloat16 outputs. Keys: the attention's "prepare" and
        "core" stages, "expert" (one routed or shared expert: gate and up, then down), "dense_mlp"."""
        out = {"prepare": 0, "core": 0}
        for _, groups, k, n, stage in self.attention_products(absorbed):
            out[stage] += groups * (k * in_bytes + 2 * n)
        out["expert"] = self.mlp_activation_bytes(self.config.moe_intermediate_size, in_bytes)
        out["dense_mlp"] = self.mlp_activation_bytes(self.config.intermediate_size, in_bytes)
        return out

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

    def mlp_activation_bytes(self, width: int, in_bytes: int) -> int:
        """Bytes a token's SwiGLU MLP of ``width`` reads and writes besides its weights: gate + up (hidden -> 2
        width), then down, inputs of ``in_bytes``, bf16 outputs."""
        h = self.config.hidden_size
        return h * in_bytes + 2 * 2 * width + width * in_bytes + 2 * h

    def moe_elementwise_bytes(self, quantized: bool, fp8_dispatch: bool, permute: bool) -> dict[str, float]:
        """elementwise_bytes' "route", "expert_pair" and "shared" (``Shapes.elementwise_bytes`` says what each
        counts)."""
        c = self.config
        h = c.hidden_size
        row = dispatch_payload_bytes(h, fp8_dispatch)
        return {
            "route": 2 * h + (2 * h + row if fp8_dispatch else 0),
            "expert_pair": silu_mul_bytes(c.moe_intermediate_size, quantized) + (2 * row + 2 * 2 * h if permute else 0),
            "shared": c.n_shared_experts * silu_mul_bytes(c.moe_intermediate_size, quantized) + 3 * 2 * h,
        }


@dataclasses.dataclass(frozen=True)
class Shapes(MoEShapes):
    """Per-layer parameter counts and per-token costs of a ModelConfig."""

    config: ModelConfig

    # ---- parameters -------------------------------------------------------------------------------------
    def attention_products(self, absorbed: bool) -> tuple[tuple[str, int, int, int, str], ...]:
        """One layer's attention products as (name, groups, k, n, stage): ``groups`` products of an [m, k] activation
        with a [k, n] weight, before the core (stage "prepare") or after it ("core"). q_a and kv_a read the same
        input and run as one product (DeepSeek's and SGLang's fused q_a / kv_a GEMM). Absorbed (decode): kv_b's
        key half is applied per head to the queries before the core and its value half per head to the core's
        output after it; expanded (prefill): kv_b decompresses keys and values before the core."""
        c = self.config
        h, heads, latent = c.hidden_size, c.num_attention_heads, c.kv_lora_rank
        if c.q_lora_rank:
            out = [("q_a_kv_a", 1, h, c.q_lora_rank + self.latent_width, "prepare"),
                   ("q_b", 1, c.q_lora_rank, heads * c.qk_head_dim, "prepare")]
        else:
            out = [("q_kv_a", 1, h, heads * c.qk_head_dim + self.latent_width, "prepare")]
        if absorbed:
            out += [("kv_b_key", heads, c.qk_nope_head_dim, latent, "prepare"),
                    ("kv_b_value", heads, latent, c.v_head_dim, "core")]
        else:
            out += [("kv_b", 1, latent, heads * (c.qk_nope_head_dim + c.v_head_dim), "prepare")]
        return tuple(out) + (("o", 1, heads * c.v_head_dim, h, "core"),)

    def elementwise_bytes(self, absorbed: bool, quantized: bool, fp8_dispatch: bool, permute: bool) -> dict[str, int]:
        """Bytes the kernels between the products read and write for one token, per layer, as DeepSeek-style
        engines run them (DeepSeek-V3's modeling code's operations; SGLang's kernels: fused residual add + RMSNorm,
        per-token-group FP8 quantization before each FP8 product, SiLU-and-mul with the quantization fused,
        DeepEP's FP8 dispatch). bfloat16 activations, e4m3 with a float32 scale per QUANT_GROUP when
        ``quantized`` (FP8 products). Keys (per token unless said):

        - "prepare": residual add + RMSNorm (two vectors read, two written), the input's quantization, the q_a
          and kv_a norms, the q_a output's quantization, RoPE on the queries' and the key's rotary parts, the
          latent written to the cache; absorbed: the query assembled from its latent and rotary parts (read and
          written); expanded: the latent's quantization for kv_b and the keys assembled from kv_b's output and
          the shared rotary key.
        - "core": the attention output's quantization for o, the next residual add + RMSNorm.
        - "route": MoE layers: the router reading the normed input, the dispatch's quantization.
        - "expert_pair": per (token, routed expert) pair on the expert's GPU: SiLU-and-mul (+ quantization);
          ``permute`` (DeepEP's normal kernels, prefill): received rows copied into the experts' contiguous
          layout, and the experts' outputs read back and weighted into the rows to combine (the low-latency
          kernels read and write the experts' masked layout themselves).
        - "shared": the shared experts' SiLU-and-mul (+ quantization), their output added to the routed one.
        - "dense_mlp": a dense layer's MLP input quantization and SiLU-and-mul (+ quantization)."""
        c = self.config
        h, heads, latent, rope = c.hidden_size, c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim

        def quant(width: int) -> float:
            return quantize_bytes(width, quantized)

        add_norm = 4 * 2 * h
        q_lora = c.q_lora_rank or 0
        prepare = (add_norm + quant(h) + 2 * 2 * (q_lora + latent) + quant(q_lora)
                   + 2 * 2 * rope * (heads + 1) + 2 * self.latent_width)
        if absorbed:
            prepare += 2 * 2 * heads * self.latent_width
        else:
            prepare += quant(latent) + 2 * heads * c.qk_nope_head_dim + 2 * rope + 2 * heads * c.qk_head_dim
        return {
            "prepare": prepare,
            "core": quant(heads * c.v_head_dim) + add_norm,
            **self.moe_elementwise_bytes(quantized, fp8_dispatch, permute),
            "dense_mlp": quant(h) + silu_mul_bytes(c.intermediate_size, quantized),
        }

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.config.hidden_size * self.config.intermediate_size

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

    def decode_core(self, context: float, kv_dtype_bytes: int = 2) -> dict[str, float]:
        """One layer's attention core in a decode step for a query token of a request with ``context`` cached
        tokens (the keys predict.py reads; v4.py's V4Shapes fills the indexer's): flops_per_token, bytes_per_request
        (the latent cache, read once a step for all of a request's query tokens: FlashMLA), bytes_per_token (none
        here), index_flops_per_token and index_bytes_per_request (no indexer here)."""
        return dict(flops_per_token=self.decode_attention_flops(context),
                    bytes_per_request=context * self.latent_width * kv_dtype_bytes, bytes_per_token=0.0,
                    index_flops_per_token=0.0, index_bytes_per_request=0.0)

    def prefill_core(self, new: float, cached: float) -> tuple[float, float]:
        """(attention FLOPs, indexer FLOPs: none here) of one layer for a chunk of one request."""
        return self.prefill_attention_flops(new, cached), 0.0

    def kv_bytes_per_request(self, context: float, kv_dtype_bytes: int = 2) -> float:
        """The latent cache of a request with ``context`` tokens over the main model's layers."""
        return context * self.kv_bytes_per_token(kv_dtype_bytes)

    def core_kernel(self, phase: str) -> str:
        """The attention kernel whose calibrated rate prices the core (predict.py ``_Rates.mla``): FlashMLA's dense
        MLA kernel."""
        return "dense"

    def expert_bytes(self, weight_bytes: float) -> float:
        """Bytes per routed-expert weight when the other products take ``weight_bytes``: the same here."""
        return weight_bytes

    def decompress_flops(self, tokens: float) -> float:
        """kv_b applied to ``tokens`` cached latents (the expanded form's keys and values of a prefix), one layer."""
        c = self.config
        return 2.0 * tokens * c.kv_lora_rank * c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim)
