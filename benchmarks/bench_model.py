"""The V3-shaped random model the CPU benchmarks compare against transformers (forward_vs_transformers.py,
generate_vs_transformers.py): hidden 512, 4 layers of which 3 MoE, 16 routed experts top-4 in 4 groups, q_lora 192,
kv_lora 128, YaRN; transformers' default init, seeded."""

from __future__ import annotations


def build_reference(threads: int, seed: int = 0):
    """(transformers DeepseekV3Config, float32 DeepseekV3ForCausalLM in eval mode); sets torch's seed and threads."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    cfg = DeepseekV3Config(
        vocab_size=8192, hidden_size=512, intermediate_size=1408, moe_intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1, n_routed_experts=16, kv_lora_rank=128,
        q_lora_rank=192, qk_rope_head_dim=32, v_head_dim=64, qk_nope_head_dim=64, n_group=4, topk_group=2,
        num_experts_per_tok=4, first_k_dense_replace=1, num_mtp_layers=0, max_position_embeddings=4096,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 1024, "mscale": 1.0, "mscale_all_dim": 1.0},
    )
    return cfg, DeepseekV3ForCausalLM(cfg).eval()
