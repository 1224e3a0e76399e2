"""jaxinfer.plan's DeepSeek-V4 arithmetic (plan/v4.py) against published totals and hand-worked cases, its config
parsing, and what its predictions must do (test_predict.py's resource monotonicity covers V4 deployments too).

Independent references: DeepSeek-V4-Flash's model card (284B parameters, 13B active per token) and its repository's
safetensors (~160 GB). Hand-worked numbers are derived from its config.json: hidden 4096, 43 layers (compress
ratios 0, 0, then 4 and 128 alternating, 4 last: 2 window-only, 21 CSA, 20 HCA layers), 64 heads of 512 (64
rotary), one key-value head, q_lora 1024, o_lora 1024 in 8 groups, 256 routed experts of width 2048 + 1 shared,
top-6, indexer 64 heads of 128 selecting 512, window 128, hyper-connections of 4, vocab 129280, one MTP layer.
"""

import json

import pytest

from jaxinfer.plan import V4_FLASH, V4Config, V4Shapes, predict
from jaxinfer.plan.predict import model_config
from jaxinfer.plan.v4 import EXPERT_WEIGHT_BYTES, index_entry_bytes, kv_entry_bytes

V4 = V4Shapes(V4_FLASH)
CONFIG_JSON = dict(  # the fields of V4-Flash's config.json the planner reads, as published (46 ratios: MTP tail)
    model_type="deepseek_v4", hidden_size=4096, num_hidden_layers=43, num_attention_heads=64, num_key_value_heads=1,
    head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_lora_rank=1024, o_groups=8, vocab_size=129280,
    n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=6, moe_intermediate_size=2048, index_n_heads=64,
    index_head_dim=128, index_topk=512, sliding_window=128, compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0, 0, 0],
    hc_mult=4, hc_sinkhorn_iters=20, num_hash_layers=3, num_nextn_predict_layers=1, tie_word_embeddings=False)


def test_layer_types():
    ratios = V4_FLASH.compress_ratios
    assert (ratios.count(0), ratios.count(4), ratios.count(128)) == (2, 21, 20)


def test_parameters_match_the_model_card():
    # q_a, q_b, kv, o_a (8 groups of 8 heads x 512 -> 1024), o_b
    attention = 4096 * 1024 + 1024 * 64 * 512 + 4096 * 512 + 8 * (8 * 512) * 1024 + 8 * 1024 * 4096
    compressors = 21 * 4096 * 2 * 1024 + 20 * 4096 * 2 * 512   # wkv + wgate, 2 x 512 wide where windows overlap
    indexer = 21 * (1024 * 64 * 128 + 4096 * 64 + 4096 * 2 * 256)  # query, head weights, its compressor
    expert = 3 * 4096 * 2048
    hyper = 2 * (2 + 4) * 4 * 4096
    total = (43 * (attention + 257 * expert + 256 * 4096 + hyper) + compressors + indexer + 2 * 129280 * 4096)
    assert V4.total_params() == pytest.approx(total, rel=1e-12)
    assert abs(total - 284e9) / 284e9 < 0.005                                   # "284B"
    active = 43 * (attention + 7 * expert + 256 * 4096) + compressors + indexer + 129280 * 4096
    assert V4.active_params() == pytest.approx(active, rel=1e-12)
    assert abs(active - 13e9) / 13e9 < 0.05                                     # "13B active"


def test_checkpoint_bytes_match_the_repository():
    """MXFP4 routed experts (0.5 byte + an 8-bit scale per 32), bf16 embedding and head, FP8 else; with the MTP
    layer (attention, experts, the [embedding; hidden] projection) the ~160 GB the repository holds."""
    assert EXPERT_WEIGHT_BYTES == 0.5 + 1 / 32
    expert = 3 * 4096 * 2048
    mtp = (256 * expert * EXPERT_WEIGHT_BYTES + (V4.attention_params + expert + 256 * 4096 + 2 * 4096 ** 2))
    assert abs(V4.checkpoint_bytes() + mtp - 160e9) / 160e9 < 0.03


def test_cache_entries():
    assert kv_entry_bytes(V4_FLASH) == 448 + 4 * 4 + 64 * 2 == 592   # e4m3 non-rotary + 4 scales + bf16 rotary
    assert index_entry_bytes(V4_FLASH) == 128 + 4
    # a 131,072-token request: every layer's window, CSA entries and indexer keys per 4, HCA entries per 128
    assert V4.kv_bytes_per_request(131072) == 43 * 128 * 592 + 21 * 32768 * (592 + 132) + 20 * 1024 * 592


def test_decode_core_hand_worked():
    core = V4.decode_core(131072)
    per_entry = 2 * 64 * (512 + 512)            # scores and values, head_dim wide, every head
    swa, csa, hca = 128, 128 + 512, 128 + 131072 / 128
    assert core["flops_per_token"] * 43 == pytest.approx((2 * swa + 21 * csa + 20 * hca) * per_entry)
    assert core["bytes_per_request"] * 43 == pytest.approx((2 * 128 + 21 * 128 + 20 * hca) * 592)
    assert core["bytes_per_token"] * 43 == pytest.approx(21 * 512 * 592)   # each query's own selection
    assert core["index_flops_per_token"] * 43 == pytest.approx(21 * 2 * 64 * 128 * 32768)
    assert core["index_bytes_per_request"] * 43 == pytest.approx(21 * 32768 * 132)
    # short contexts read what exists: 100 tokens, no selection beyond them
    assert V4.decode_core(100)["bytes_per_token"] * 43 == pytest.approx(21 * 25 * 592)


@pytest.mark.parametrize("new,cached", [(4096, 0), (1000, 3000), (64, 200_000)])
def test_prefill_core_is_the_sum_over_positions(new, cached):
    attention, index = V4.prefill_core(new, cached)
    rows = index_rows = 0.0
    for t in range(cached + 1, cached + new + 1):    # the query seeing t tokens
        window = min(128, t)
        rows += 2 * window + 21 * (window + min(512, t / 4)) + 20 * (window + t / 128)
        index_rows += 21 * t / 4
    assert attention * 43 == pytest.approx(rows * 2 * 64 * 1024, rel=2e-3)
    assert index * 43 == pytest.approx(index_rows * 2 * 64 * 128, rel=2e-3)


def test_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG_JSON))
    assert V4Config.from_hf_config(tmp_path) == V4_FLASH          # the MTP tail of compress_ratios dropped
    assert model_config(tmp_path) == V4_FLASH                      # predict's model argument, by model_type
    assert model_config("deepseek-v4-flash") == V4_FLASH
    with pytest.raises(ValueError, match="lacks index_topk"):
        V4Config.from_hf_config({k: v for k, v in CONFIG_JSON.items() if k != "index_topk"})
    with pytest.raises(ValueError, match=r"\[8\] not among"):
        V4Config.from_hf_config({**CONFIG_JSON, "compress_ratios": [8] * 43})
    with pytest.raises(ValueError, match="num_key_value_heads=8"):
        V4Config.from_hf_config({**CONFIG_JSON, "num_key_value_heads": 8})
    with pytest.raises(ValueError, match="o_groups=7"):
        V4Config.from_hf_config({**CONFIG_JSON, "o_groups": 7})


DECODE = dict(model="deepseek-v4-flash", hardware="gb200", phase="decode", ep=64, num_redundant_experts=64,
              requests_per_gpu=128, context_len=65536)


def test_longer_context_is_never_faster_and_holds_more_cache():
    runs = [predict(**{**DECODE, "context_len": c}) for c in (4096, 32768, 131072, 262144)]
    rates = [r["tok_s_per_gpu"] for r in runs]
    assert rates == sorted(rates, reverse=True)
    caches = [r["memory"]["kv_cache"] for r in runs]
    assert caches == sorted(caches)
    assert runs[-1]["parts"]["indexer"] > 4 * runs[1]["parts"]["indexer"]   # scores every compressed entry


def test_mxfp4_experts_halve_the_expert_weights_read():
    fp8 = predict(**{**DECODE, "requests_per_gpu": 1, "context_len": 1024}, weight_bytes=1)
    bf16 = predict(**{**DECODE, "requests_per_gpu": 1, "context_len": 1024}, weight_bytes=2)
    # batch 1: reading the weights bounds the experts; MXFP4 against bf16 weights: a quarter of the bytes
    assert fp8["parts"]["routed_experts"] < 0.35 * bf16["parts"]["routed_experts"]


def test_a_deployment_that_does_not_fit_says_so():
    with pytest.raises(ValueError, match="memory"):
        predict(**{**DECODE, "requests_per_gpu": 512, "context_len": 1_048_576})
    with pytest.raises(ValueError, match="does not divide"):
        predict(**{**DECODE, "num_redundant_experts": 32})   # 288 slots on 64 GPUs
