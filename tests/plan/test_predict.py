"""jaxinfer.plan's arithmetic against hand-worked cases (DeepSeek-V3's published shapes and sizes), its
calibration against the published kernel figures it was not fitted on, monotonicity, and bad input.

Hand-worked numbers are written out with their derivation from DeepSeek-V3's config.json (hidden 7168, 61 layers of
which 3 dense, 128 heads, q_lora 1536, kv_lora 512, qk_nope 128, rope 64, v_head 128, 256 routed experts of width
2048 + 1 shared, top-8, dense width 18432, vocab 129280).
"""

import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.config import ModelConfig
from jaxinfer.plan import CALIBRATION, Hardware, Shapes, dispatch_payload_bytes, hardware, predict
from jaxinfer.plan.calibration import ANCHORS

V3 = Shapes(ModelConfig.deepseek_v3())


def test_parameter_counts_are_deepseek_v3s():
    # q_a 7168 x 1536 + q_b 1536 x 128 x 192 + kv_a 7168 x 576 + kv_b 512 x 128 x 256 + o 128 x 128 x 7168
    assert V3.attention_params == 11_010_048 + 37_748_736 + 4_128_768 + 16_777_216 + 117_440_512
    assert V3.expert_params == 3 * 7168 * 2048 == 44_040_192
    assert V3.dense_mlp_params == 3 * 7168 * 18432
    # embeddings + 61 attention + 3 dense MLPs + 58 x 257 experts (+ router and norms, not counted): "671B"
    total = (V3.embedding_params + 61 * V3.attention_params + 3 * V3.dense_mlp_params + 58 * 257 * V3.expert_params)
    assert total == 1_853_358_080 + 11_413_422_080 + 1_189_085_184 + 656_463_101_952 == 670_918_967_296
    assert abs(total + 58 * 256 * 7168 - 671e9) / 671e9 < 1e-3


def test_attention_params_before_and_after_the_core():
    # absorbed (decode): q_a + q_b + kv_a + kv_b's key half 512 x 128 x 128 before; its value half + o after
    assert V3.attention_params_split(absorbed=True) == (11_010_048 + 37_748_736 + 4_128_768 + 8_388_608,
                                                        8_388_608 + 117_440_512)
    # expanded (prefill): kv_b decompresses keys and values before the core; o after
    assert V3.attention_params_split(absorbed=False) == (V3.attention_params - 117_440_512, 117_440_512)


def test_bytes_per_token():
    assert V3.kv_bytes_per_token() == 61 * (512 + 64) * 2 == 70_272          # the bf16 latent cache
    assert dispatch_payload_bytes(7168, fp8=True) == 7168 + 56 * 4 == 7392   # e4m3 + a float32 scale per 128
    assert dispatch_payload_bytes(7168, fp8=False) == 2 * 7168 == 14_336     # bf16 (combine)


def test_dispatch_payload_is_the_engines():
    """The FP8 payload per token and rank is what the engine's dispatch sends (bench.dispatch_bytes' formula, over
    parallel/dispatch.py's QUANT_GROUP)."""
    from jaxinfer.parallel.dispatch import QUANT_GROUP

    for h in (7168, 2048, 512, 100):
        assert dispatch_payload_bytes(h, fp8=True) == h + 4 * -(-h // QUANT_GROUP)


def test_flops_per_layer():
    # absorbed decode, one token over 4096 cached: 2 x 128 heads x 4096 x (576-wide scores + 512-wide values)
    assert V3.decode_attention_flops(4096) == 2 * 128 * 4096 * 1088 == 1_140_850_688
    # expanded prefill of 4096 fresh tokens, causal: 4096 x 4097 / 2 pairs x 2 x 128 x (192 + 128)
    assert V3.prefill_attention_flops(4096, 0) == 687_362_539_520
    # 1000 new after 3000 cached: 1000 x 3000 + 1000 x 1001 / 2 pairs
    assert V3.prefill_attention_flops(1000, 3000) == (3_000_000 + 500_500) * 2 * 128 * 320
    assert V3.decompress_flops(10) == 2 * 10 * 512 * 128 * 256


def test_memory_per_gpu_at_ep144():
    """DeepSeek's decode unit: EP144 with 32 redundant experts = 2 routed + 1 shared expert per GPU."""
    r = predict(phase="decode", ep=144, num_redundant_experts=32, requests_per_gpu=100, context_len=4096)
    weights = (3 * (187_105_280 + 396_361_728)                  # dense layers: attention + MLP
               + 58 * (187_105_280 + 3 * 44_040_192)            # MoE layers: attention + 2 routed + 1 shared
               + 2 * 129_280 * 7168 * 2)                        # bf16 embedding and head
    assert weights == 23_972_216_832
    assert r["memory"]["weights"] == weights
    assert r["memory"]["kv_cache"] == 100 * 4096 * 70_272
    assert r["memory_per_gpu_bytes"] == sum(v for k, v in r["memory"].items() if k != "headroom_bytes")
    assert r["memory"]["headroom_bytes"] == 80e9 - r["memory_per_gpu_bytes"]
    # EP32 prefill: 288 / 32 = 9 routed experts per GPU
    p = predict(phase="prefill", ep=32, num_redundant_experts=32, tokens_per_gpu=4096)
    assert p["memory"]["weights"] - weights == 58 * 7 * 44_040_192


def test_products_activation_bytes_by_hand():
    """Each product reads its input (FP8 here: 1 byte a value) and writes a bf16 output, one token, one layer."""
    absorbed = V3.activation_bytes(absorbed=True, in_bytes=1)
    # q_a + kv_a fused 7168 -> 1536 + 576; q_b 1536 -> 128 x 192; kv_b's key half per head 128 -> 512
    assert absorbed["prepare"] == (7168 + 2 * 2112) + (1536 + 2 * 24_576) + 128 * (128 + 2 * 512) == 209_536
    # kv_b's value half per head 512 -> 128; o 128 x 128 -> 7168
    assert absorbed["core"] == 128 * (512 + 2 * 128) + (16_384 + 2 * 7168) == 129_024
    # expanded: kv_b 512 -> 128 x (128 + 128) instead of the key half
    assert V3.activation_bytes(absorbed=False, in_bytes=1)["prepare"] == 11_392 + 50_688 + 512 + 2 * 32_768
    # an expert: 7168 in, gate and up 2 x 2048 out (bf16), 2048 in, 7168 out (bf16); the dense MLP alike
    assert absorbed["expert"] == 7168 + 2 * 4096 + 2048 + 2 * 7168 == 31_744
    assert absorbed["dense_mlp"] == 7168 + 2 * 36_864 + 18_432 + 2 * 7168 == 113_664
    assert V3.activation_bytes(absorbed=True, in_bytes=2)["expert"] == 2 * 7168 + 2 * 4096 + 2 * 2048 + 2 * 7168


def test_elementwise_bytes_by_hand():
    """The kernels between the products, one token, one layer, FP8 products and dispatch (e4m3 + one float32
    scale per 128 values: quantizing w bf16 values reads 2w bytes and writes w + 4w / 128)."""
    decode = V3.elementwise_bytes(absorbed=True, quantized=True, fp8_dispatch=True, permute=False)
    add_norm = 4 * 2 * 7168                       # residual and input read, residual and normed output written
    quant_h = 2 * 7168 + 7168 + 56 * 4            # 21_728
    assert decode["prepare"] == (add_norm + quant_h
                                 + 2 * 2 * (1536 + 512)          # q_a and kv_a norms
                                 + 2 * 1536 + 1536 + 12 * 4      # q_a's quantization for q_b
                                 + 2 * 2 * 64 * (128 + 1)        # RoPE on 128 query heads and the key
                                 + 2 * 576                       # the latent written to the cache
                                 + 2 * 2 * 128 * 576) == 421_008  # absorbed query [128, 576] assembled
    assert decode["core"] == (2 * 16_384 + 16_384 + 128 * 4) + add_norm == 107_008
    assert decode["route"] == 2 * 7168 + quant_h == 36_064        # router input, dispatch quantization
    assert decode["expert_pair"] == 2 * 2 * 2048 + 2048 + 16 * 4 == 10_304   # SiLU-and-mul + quantization
    assert decode["shared"] == 10_304 + 3 * 2 * 7168 == 53_312    # + shared output added to the routed one
    assert decode["dense_mlp"] == quant_h + 2 * 2 * 18_432 + 18_432 + 144 * 4 == 114_464
    prefill = V3.elementwise_bytes(absorbed=False, quantized=True, fp8_dispatch=True, permute=True)
    # expanded: the latent quantized for kv_b, keys [128, 192] assembled from k_nope [128, 128] and k_pe [64]
    assert prefill["prepare"] == (421_008 - 2 * 2 * 128 * 576 + (2 * 512 + 512 + 4 * 4)
                                  + 2 * 128 * 128 + 2 * 64 + 2 * 128 * 192) == 209_696
    # normal kernels: a received FP8 row copied into the contiguous layout, the bf16 output read and written back
    assert prefill["expert_pair"] == 10_304 + 2 * 7392 + 2 * 2 * 7168 == 53_760
    # bf16 products (CPU): no quantization kernels, bf16 SiLU outputs
    bf16 = V3.elementwise_bytes(absorbed=True, quantized=False, fp8_dispatch=False, permute=False)
    assert bf16["route"] == 2 * 7168 and bf16["expert_pair"] == 2 * 2 * 2048 + 2 * 2048
    # predict prices them at FlashMLA's 3000 GB/s (on H800's 3350 GB/s: any GPU reaches the same fraction): a
    # one-GPU prefill of 1024 tokens, the busiest GPU's pairs scaled by the expert imbalance
    big = Hardware("big", bf16_tflops=989.4, fp8_tflops=1978.9, hbm_gb=2000, hbm_gb_s=3350, nvlink_gb_s=200,
                   net_gb_s=50, sms=132)
    r = predict(hardware=big, phase="prefill", ep=1, tokens_per_gpu=1024, dbo=False, expert_imbalance=1.25)
    layers = 61 * (209_696 + 107_008) + 58 * (36_064 + 8 * 1.25 * 53_760 + 53_312) + 3 * 114_464
    assert r["parts"]["elementwise"] == pytest.approx(1024 * layers / 3000e9, rel=1e-12)


def test_a_weight_bound_step_by_hand():
    """One request, no cache, no overlap, one GPU: every product reads its weights once at DeepGEMM's bandwidth
    (2668 GB/s, FP8; the bf16 head twice the bytes) with its input and output (test above) and computes 2 FLOPs
    per weight it uses at 1358 TFLOPS; the kernels between the products move their bytes (test above) at
    FlashMLA's 3000 GB/s; nothing else costs."""
    big = Hardware("big", bf16_tflops=989.4, fp8_tflops=1978.9, hbm_gb=2000, hbm_gb_s=3350, nvlink_gb_s=200,
                   net_gb_s=50, sms=132)
    r = predict(hardware=big, phase="decode", ep=1, requests_per_gpu=1, context_len=0, dbo=False,
                expert_imbalance=1.0)
    weight_bytes = 61 * 187_105_280 + 58 * (256 + 1) * 44_040_192 + 3 * 396_361_728 + 129_280 * 7168 * 2
    used = 61 * 187_105_280 + 58 * (8 + 1) * 44_040_192 + 3 * 396_361_728 + 129_280 * 7168  # top-8 + shared
    activations = (61 * (209_536 + 129_024) + 58 * (8 + 1) * 31_744 + 3 * 113_664
                   + 2 * (7168 + 129_280))                                   # the head: bf16 in, bf16 logits out
    between = 61 * (421_008 + 107_008) + 58 * (36_064 + 8 * 10_304 + 53_312) + 3 * 114_464
    assert r["step_s"] == pytest.approx((weight_bytes + activations) / 2668e9 + 2 * used / 1358e12
                                        + between / 3000e9, rel=1e-9)
    assert r["parts"]["elementwise"] == pytest.approx(between / 3000e9, rel=1e-9)
    assert r["bound"] == "weights" and r["communication_s"] == 0 and r["tok_s_per_gpu"] == 1 / r["step_s"]


def test_gemm_time_against_deepgemms_published_shapes():
    """The GEMM model (FLOPs at 1358 TFLOPS plus bytes at 2668 GB/s, the README's two maxima) against the README's
    18 dense shapes, bytes = FP8 weights and input + bf16 output: within -25% / +50% of each published time, 8% high
    on their geometric mean (a roofline, the larger of the two, would be up to 2.2x fast)."""
    ratios = []
    for m, rows in ANCHORS["deepgemm_dense"].items():
        for n, k, tflops in rows:
            flops, nbytes = 2 * m * n * k, n * k + m * k + 2 * m * n
            model = flops / (1978.9e12 * CALIBRATION.gemm_flops) + nbytes / (3350e9 * CALIBRATION.gemm_memory)
            ratios.append(model / (flops / (tflops * 1e12)))
    assert all(0.75 <= x <= 1.5 for x in ratios), ratios
    assert math.exp(sum(map(math.log, ratios)) / len(ratios)) == pytest.approx(1.078, abs=0.01)


def test_low_latency_kernels_rows_it_was_not_fitted_on():
    """The calibration takes DeepEP's low-latency rates from its EP8 and EP256 rows; the model then predicts the
    EP16-128 rows (128 tokens per rank, top-8) within 16%."""
    from jaxinfer.plan.predict import _comm_seconds

    h800, v3 = hardware("h800"), ModelConfig.deepseek_v3()   # hidden 7168, top-8, as DeepEP's test
    for ep, published in ANCHORS["deepep_ll_us"].items():
        for k, kind in enumerate(("dispatch", "combine")):
            t = _comm_seconds(True, kind, 128, v3, ep, 8, h800, CALIBRATION, fp8=kind == "dispatch")
            assert t * 1e6 == pytest.approx(published[k], rel=0.16), (ep, kind)


def test_calibration_is_the_published_fractions():
    assert CALIBRATION.gemm_flops == pytest.approx(1358 / 1978.9)
    assert CALIBRATION.mla_memory == pytest.approx(3000 / 3350)
    assert CALIBRATION.normal_nvlink == pytest.approx(155.5 / 200)


def _scaled(hw: Hardware, **factors) -> Hardware:
    return Hardware(**{**{f: getattr(hw, f) for f in hw.__dataclass_fields__}, "name": "scaled",
                       **{k: getattr(hw, k) * v for k, v in factors.items()}})


DEPLOYMENTS = st.sampled_from([
    dict(phase="decode", ep=144, num_redundant_experts=32, requests_per_gpu=64, context_len=4096),
    dict(phase="decode", ep=16, num_redundant_experts=32, requests_per_gpu=32, context_len=2048, mtp_acceptance=0.8),
    dict(phase="prefill", ep=32, num_redundant_experts=32, tokens_per_gpu=8192, prompt_len=2048),
    dict(phase="prefill", ep=64, tokens_per_gpu=4096, prompt_len=4096, cache_hit_rate=0.5, dbo=False),
    dict(model="deepseek-v4-flash", phase="decode", ep=64, num_redundant_experts=64, requests_per_gpu=32,
         context_len=32768, mtp_acceptance=0.7, mtp_drafts=3),
    dict(model="deepseek-v4-flash", phase="prefill", ep=8, num_redundant_experts=32, tokens_per_gpu=8192,
         prompt_len=8192),
])


@settings(max_examples=40, deadline=None)
@given(DEPLOYMENTS, st.sampled_from(["hbm_gb_s", "nvlink_gb_s", "net_gb_s", "fp8_tflops", "bf16_tflops"]),
       st.floats(1.0, 8.0), st.sampled_from(["h800", "h200", "b200"]))
def test_more_of_a_resource_is_never_slower(deployment, resource, factor, gpu):
    hw = hardware(gpu)
    assert (predict(hardware=_scaled(hw, **{resource: factor}), **deployment)["step_s"]
            <= predict(hardware=hw, **deployment)["step_s"] * (1 + 1e-12))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 160), st.integers(1, 160), st.sampled_from([32, 64, 144]), st.booleans())
def test_a_larger_decode_batch_never_yields_fewer_tokens_per_gpu(a, b, ep, dbo):
    small, large = sorted((a, b))
    kw = dict(phase="decode", ep=ep, num_redundant_experts=32 if 288 % ep == 0 else 0, context_len=2048, dbo=dbo)
    assert (predict(requests_per_gpu=large, **kw)["tok_s_per_gpu"]
            >= predict(requests_per_gpu=small, **kw)["tok_s_per_gpu"] * (1 - 1e-12))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 16), st.integers(1, 16), st.booleans())
def test_a_larger_prefill_batch_never_yields_fewer_tokens_per_gpu(a, b, dbo):
    small, large = sorted((a, b))
    kw = dict(phase="prefill", ep=32, num_redundant_experts=32, prompt_len=1024, dbo=dbo)
    assert (predict(tokens_per_gpu=1024 * large, **kw)["tok_s_per_gpu"]
            >= predict(tokens_per_gpu=1024 * small, **kw)["tok_s_per_gpu"] * (1 - 1e-12))


@pytest.mark.parametrize("kwargs, match", [
    (dict(ep=144, requests_per_gpu=8), r"ep: ep=144 does not divide the 256 routed experts \+ 0 redundant"),
    (dict(ep=100, num_redundant_experts=44, requests_per_gpu=8), "gpus_per_node: ep=100"),
    (dict(ep=144, num_redundant_experts=32, requests_per_gpu=400, context_len=4096), "memory: the deployment needs"),
    (dict(ep=8, requests_per_gpu=8), r"memory: .*\(weights 100.6 GB"),              # 32 experts per GPU
    (dict(ep=144, num_redundant_experts=32), "requests_per_gpu: decode needs"),
    (dict(phase="prefill", ep=32, num_redundant_experts=32), "tokens_per_gpu: prefill needs"),
    (dict(phase="train", ep=8), "phase: 'train'"),
    (dict(ep=144, dp=7, num_redundant_experts=32, requests_per_gpu=8), "dp: 7 must divide ep=144"),
    (dict(ep=144, num_redundant_experts=32, requests_per_gpu=8, cache_hit_rate=1.0), "cache_hit_rate"),
    (dict(ep=144, num_redundant_experts=32, requests_per_gpu=8, mtp_acceptance=1.5), "mtp_acceptance"),
    (dict(model=ModelConfig.deepseek_v3().replace(num_nextn_predict_layers=0), ep=144, num_redundant_experts=32,
          requests_per_gpu=8, mtp_acceptance=0.8), "mtp_acceptance: the model has no MTP module"),
    (dict(ep=144, num_redundant_experts=32, requests_per_gpu=8, gpus_per_node=-1), "gpus_per_node: must be a pos"),
    (dict(ep=144, num_redundant_experts=32, requests_per_gpu=8, mtp_drafts=3), "mtp_drafts: drafts need mtp_acc"),
    (dict(hardware="tpu", ep=8), "hardware 'tpu': not a preset"),
    (dict(model="no-such-model", ep=8), "model 'no-such-model'"),
])
def test_bad_deployments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        predict(**{"phase": "decode", **kwargs})


def test_hardware_files(tmp_path):
    good = tmp_path / "mygpu.toml"
    good.write_text("bf16_tflops = 100\nfp8_tflops = 200\nhbm_gb = 1000\nhbm_gb_s = 1000\nnvlink_gb_s = 100\n"
                    "net_gb_s = 25\nsms = 100\n")
    hw = hardware(good)
    assert (hw.name, hw.hbm_bw, hw.gpus_per_node) == ("mygpu", 1e12, 8)
    assert predict(hardware=good, ep=8, requests_per_gpu=4)["tok_s_per_gpu"] > 0
    bad = tmp_path / "bad.toml"
    bad.write_text("bf16_tflops = 100\nfp8 = 200\n")
    with pytest.raises(ValueError, match=r"unknown fields \['fp8'\]; missing fields \['fp8_tflops'"):
        hardware(bad)
    bad.write_text(good.read_text().replace("sms = 100", "sms = -1"))
    with pytest.raises(ValueError, match="sms must be a positive number"):
        hardware(bad)


def test_the_package_and_the_plan_command_need_no_jax():
    code = "import sys, jaxinfer.plan; jaxinfer.plan.predict(ep=144, num_redundant_experts=32, requests_per_gpu=8)\n" \
           "from jaxinfer.cli import main\n" \
           "assert main(['plan', '--ep', '144', '--requests-per-gpu', '8', '--redundant-experts', '32']) == 0\n" \
           "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('jax'))"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


@pytest.mark.parametrize("phase, kw", [
    ("prefill", dict(tokens_per_gpu=16384, prompt_len=4096, cache_hit_rate=0.5)),
    ("decode", dict(requests_per_gpu=8, context_len=4096, mtp_acceptance=0.8)),
])
def test_attention_tensor_parallelism_moves_weights_and_latents_not_flops(phase, kw):
    """dp < ep: a TP group of ep / dp GPUs computes its GPUs' tokens over 1 / tp of the heads each. Per GPU the
    FLOPs stay, the attention weights shrink by tp and (decode) each GPU reads the latents of the whole group."""
    def parts(dp):
        big = Hardware("big", bf16_tflops=989.4, fp8_tflops=1978.9, hbm_gb=1000, hbm_gb_s=1e12, nvlink_gb_s=200,
                       net_gb_s=50, sms=132)  # bandwidth without limit: only FLOPs cost
        return predict(hardware=big, phase=phase, ep=64, dp=dp, **kw)["parts"]
    dp64, dp8 = parts(64), parts(8)
    for part in ("attention_projections", "attention_core", "prefix_decompression", "mtp_drafts"):
        if part in dp64:
            assert dp8[part] == pytest.approx(dp64[part], rel=1e-6), part
    if phase == "decode":  # with bandwidth limited, the group's latents cost tp = 8 times the reads
        t = {dp: predict(phase=phase, ep=64, dp=dp, expert_imbalance=1.0, **kw) for dp in (64, 8)}
        assert t[8]["memory"]["kv_cache"] == 8 * t[64]["memory"]["kv_cache"]


def test_the_cpu_preset_is_measured_rates_without_calibration():
    """The "cpu" description holds this machine's measured rates: predict applies no calibration to it. The
    embedded model's head (4096 x 128, bf16) for one token: its bytes (weights, the hidden state in, the logits
    out) at 32.5 GB/s plus its FLOPs at 196.6 GFLOP/s."""
    from jaxinfer import default_model
    from jaxinfer.plan.calibration import calibrate

    kw = dict(model=default_model.path(), hardware="cpu", phase="decode", ep=1, requests_per_gpu=1,
              context_len=64, weight_bytes=2, dbo=False)
    r = predict(**kw)
    head = 4096 * 128
    assert r["parts"]["head"] == pytest.approx((2 * head + 2 * (128 + 4096)) / 32.5e9 + 2 * head / 0.1966e12,
                                               rel=1e-12)
    other = calibrate(dict(ANCHORS, deepgemm_peak_tflops=1.0, flashmla_gb_s=1.0))
    assert predict(**kw, calibration=other)["step_s"] == r["step_s"]
    prefill = predict(**dict(kw, phase="prefill", requests_per_gpu=None, tokens_per_gpu=256))  # no SMs to hold
    assert prefill["tok_s_per_gpu"] > 0


def test_the_busiest_expert_gpu_sets_the_transfers_too():
    """expert_imbalance scales the busiest GPU's expert work and the rows it receives and sends back."""
    kw = dict(phase="decode", ep=144, num_redundant_experts=32, requests_per_gpu=64, context_len=2048, dbo=False)
    even, busy = predict(**kw, expert_imbalance=1.0), predict(**kw, expert_imbalance=1.3)
    for part in ("dispatch", "combine"):
        assert busy["parts"][part] == pytest.approx(1.3 * even["parts"][part], rel=1e-12)
    assert busy["parts"]["attention_core"] == even["parts"]["attention_core"]
