"""The random DeepSeek-shaped models the CPU benchmarks compare against transformers (forward_vs_transformers.py,
generate_vs_transformers.py). "bench", the model the engine was tuned on: hidden 512, 4 layers of which 3 MoE, 16
routed experts top-4 in 4 groups, q_lora 192, kv_lora 128, YaRN. The other ``SHAPES`` form the grid of issue 33
(speed that holds on any shape): the same 4 layers, vocab and YaRN, other widths, expert counts, top-k and
attention forms. transformers' default init, seeded."""

from __future__ import annotations

BASE = dict(
    vocab_size=8192, hidden_size=512, intermediate_size=1408, moe_intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1, n_routed_experts=16, kv_lora_rank=128,
    q_lora_rank=192, qk_rope_head_dim=32, v_head_dim=64, qk_nope_head_dim=64, n_group=4, topk_group=2,
    num_experts_per_tok=4, first_k_dense_replace=1, num_mtp_layers=0, max_position_embeddings=4096,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                     "original_max_position_embeddings": 1024, "mscale": 1.0, "mscale_all_dim": 1.0},
)

# Name -> what differs from BASE.
SHAPES = {
    "bench": {},
    # DeepSeek-V2-Lite's layer (its config.json): 64 routed experts top-6 of width 1408, 2 shared, no q_lora,
    # kv_lora 512, 16 heads of 128 + 64; ungrouped routing.
    "v2lite": dict(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_attention_heads=16,
                   num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6,
                   n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64,
                   qk_nope_head_dim=128, v_head_dim=128),
    # Issue 33's: hidden 1024 with 64 experts top-8 (V3's routing: 8 groups, 4 of them).
    "h1024_e64k8": dict(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
                        num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64,
                        num_experts_per_tok=8, n_group=8, topk_group=4, q_lora_rank=384, kv_lora_rank=256),
    # Issue 33's smallest: hidden 64 with 8 experts top-2.
    "h64_e8k2": dict(hidden_size=64, intermediate_size=176, moe_intermediate_size=32, num_attention_heads=4,
                     num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                     q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16),
    # A larger vocabulary (the head's share of a token grows), no q_lora, 32 experts top-2 of width 512.
    "h512_v32k_e32k2": dict(vocab_size=32000, moe_intermediate_size=512, n_routed_experts=32, num_experts_per_tok=2,
                            n_group=1, topk_group=1, q_lora_rank=None),
    # The shape the issue was found on: smaller than "bench", 3 layers.
    "h256_e16k4": dict(hidden_size=256, intermediate_size=704, moe_intermediate_size=128, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=64),
}


def describe(name: str) -> str:
    """One line: the shape's name and what sets its cost."""
    c = BASE | SHAPES[name]
    q = f"q_lora {c['q_lora_rank']}" if c["q_lora_rank"] else "no q_lora"
    return (f"{name}: hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, {c['n_routed_experts']} experts "
            f"top-{c['num_experts_per_tok']} of width {c['moe_intermediate_size']}, {c['n_shared_experts']} "
            f"shared, {q}, kv_lora {c['kv_lora_rank']}, {c['num_attention_heads']} heads")


def build_reference(threads: int, seed: int = 0, shape: str = "bench"):
    """(transformers DeepseekV3Config, float32 DeepseekV3ForCausalLM in eval mode) of ``SHAPES[shape]``; sets
    torch's seed and threads."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    cfg = DeepseekV3Config(**(BASE | SHAPES[shape]))
    return cfg, DeepseekV3ForCausalLM(cfg).eval()
