"""The embedded default model's recipe: its architecture and training hyperparameters, in one place.

Architecture: DeepSeek-V3 at toy scale with every feature on: MLA with q_lora, YaRN (V3's mscale =
mscale_all_dim = 1), one dense layer then MoE layers, sigmoid routing with 4 groups of 4 experts keeping 2 groups
(noaux_tc), 2 of 16 routed experts + 1 shared expert per token, one MTP module.

FP8 block alignment: every projection that DeepSeek's release stores in FP8 (attention q_a/q_b/kv_a/kv_b/o,
dense MLP, shared and routed experts, MTP eh_proj) has both dims a multiple of 128, so 128x128 blocks are never
partial and transformers' FP8 loading (wrong on partial blocks, docs/architecture.md "Reference semantics") is
exact. kv_a_proj_with_mqa's output is kv_lora_rank + qk_rope_head_dim and kv_b_proj's input is kv_lora_rank, so
both multiples of 128 force qk_rope_head_dim = 128 (V3: 512 + 64 = 576, whose last block is partial). The latent
cache width is 256, a multiple of 64 as the Pallas MLA decode kernel needs (its head_dim_v, kv_lora_rank = 128,
too).
"""

from __future__ import annotations

from jaxinfer.config import ModelConfig, QuantConfig, RopeConfig
from jaxinfer.train.step import TrainConfig

VOCAB_SIZE = 4096
MAX_POSITION_EMBEDDINGS = 2048


def model_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=2, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64,
        qk_rope_head_dim=128, v_head_dim=64, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=2,
        n_group=4, topk_group=2, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        rms_norm_eps=1e-6, max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rope=RopeConfig(rope_type="yarn", theta=10000.0, factor=4.0, original_max_position_embeddings=512,
                        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        num_nextn_predict_layers=1, quantization=QuantConfig(), bos_token_id=0, eos_token_id=1,
    )


def train_config() -> TrainConfig:
    # Budget: about 20 minutes on 2 shared CPU cores: 400 steps of 4096 tokens, 1.6M tokens (about 2.3 passes over
    # the 0.71M-token train split); the measured step time: TRAINING.md, docs/benchmarks.md "Test suite and
    # compile times".
    # bias_gamma: the V3 report (sec. 4.2) uses 0.001 over ~14.3T tokens, i.e. ~10^5 steps of ~60M-token batches;
    # with 400 steps a bias could then move by at most 0.4 in the whole run, so gamma is 10x larger to let the
    # biases reach the O(0.1) score differences between experts within the first few dozen steps.
    return TrainConfig(steps=400, batch=16, seq_len=256, peak_lr=3e-3, warmup_steps=30, bias_gamma=0.01, seed=0)
