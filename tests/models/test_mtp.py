"""MTP (num_nextn_predict_layers) logits against an independent reference.

Reference: transformers' ``MtpLayer`` (enorm, hnorm, eh_proj on concat[enorm(embed(next)), hnorm(h)], a
DeepseekV3DecoderLayer at layer index num_hidden_layers -- MoE, since that index is >= first_k_dense_replace --,
post_norm = DeepSeek's shared_head.norm), run in torch on the HF main model's last hidden state (after the final
norm), RoPE positions 0..T-1, a causal mask, then lm_head (hf_oracle.MtpOracle). Its random weights are saved
under DeepSeek's names (model.layers.N.{enorm,hnorm,eh_proj,shared_head.{norm,head},embed_tokens}.weight and the
block's own tensors) in an extra safetensors file with an index, num_nextn_predict_layers = 1.
Metric: float32 max|jaxinfer - reference| / max|reference| <= 1e-4.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch

import hf_oracle as O
from fp8_oracle import dequantize_checkpoint

F32_TOL = 1e-4


def mtp_case(name, tmp_path_factory):
    """(checkpoint dir with MTP tensors, MtpOracle) for CONFIGS[name], once per session."""

    def build():
        base = O.build_case(name, tmp_path_factory)
        path = O.copy_checkpoint(base.path, tmp_path_factory.mktemp(f"mtp_{name}") / "ckpt")
        oracle = O.build_mtp_oracle(base.model, seed=100 + O.SEEDS[name])
        O.add_mtp_to_checkpoint(path, oracle)
        return path, oracle

    return O.cached(f"mtp:{name}", build)


def fp8_mtp_case(tmp_path_factory, quantize_eh_proj: bool):
    """The v3_qlora_yarn MTP checkpoint in DeepSeek's FP8 format, eh_proj FP8 (with a weight_scale_inv sibling) or
    BF16; and an oracle holding the exactly dequantized (numpy) weights of main model and MTP layer."""

    def build():
        src, oracle = mtp_case("v3_qlora_yarn", tmp_path_factory)
        path = O.copy_checkpoint(src, tmp_path_factory.mktemp(f"mtp_fp8_{quantize_eh_proj}") / "ckpt")
        O.convert_to_fp8(path, quantize_eh_proj=quantize_eh_proj)
        values = dequantize_checkpoint(O.read_tensors(path))
        pre = f"model.layers.{oracle.main.config.num_hidden_layers}."
        main = copy.deepcopy(oracle.main)
        O.load_state_into_hf(main, {k: v for k, v in values.items() if not k.startswith(pre)})
        ref = O.MtpOracle(main=main, layer=copy.deepcopy(oracle.layer))
        O.load_mtp_tensors(ref, {k: v for k, v in values.items() if k.startswith(pre)})
        return path, ref

    return O.cached(f"mtp_fp8:{quantize_eh_proj}", build)


def _ids(vocab, seed):
    return O.random_ids(vocab, 2, 11, seed), O.random_ids(vocab, 2, 11, seed + 1)


def _check(path, oracle: O.MtpOracle, label: str) -> None:
    vocab = oracle.main.config.vocab_size
    ids, next_ids = _ids(vocab, 5)
    model = O.load_jax_model(path, "float32")
    assert model.has_mtp is True
    ref = oracle.logits(ids, next_ids)
    got = model.mtp_logits(ids, next_ids)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == ref.shape, getattr(got, "shape", 0)
    err = O.rel_err(got, ref)
    main_err = O.rel_err(model.logits(ids), O.reference_logits(oracle.main, ids))
    print(f"\n[{label} f32 B=2 T=11] MTP max|diff|/max|ref| = {err:.3e}; main logits {main_err:.3e}")
    assert err <= F32_TOL, f"{label}: MTP rel err {err:.3e}"
    assert main_err <= F32_TOL, f"{label}: main-model rel err {main_err:.3e} with MTP tensors present"


# ---- oracle sanity ----------------------------------------------------------------------------------------------


def test_oracle_mtp_checkpoint_layout(tmp_path_factory):
    path, oracle = mtp_case("v3_qlora_yarn", tmp_path_factory)
    n = O.CONFIGS["v3_qlora_yarn"]["num_hidden_layers"]
    index = __import__("json").loads((path / O.INDEX_NAME).read_text())["weight_map"]
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "shared_head.head.weight", "embed_tokens.weight", "self_attn.q_a_proj.weight",
                 "self_attn.kv_a_layernorm.weight", "mlp.gate.weight", "mlp.gate.e_score_correction_bias",
                 "mlp.experts.7.down_proj.weight", "mlp.shared_experts.up_proj.weight", "input_layernorm.weight",
                 "post_attention_layernorm.weight"):
        assert index[f"model.layers.{n}.{name}"] == "model-mtp.safetensors", name
    assert index["model.embed_tokens.weight"] == "model.safetensors"
    assert O.read_config(path)["num_nextn_predict_layers"] == 1
    assert tuple(oracle.tensors[f"model.layers.{n}.eh_proj.weight"].shape) == (160, 320)


def test_oracle_mtp_reference_uses_its_inputs(tmp_path_factory):
    """The reference row t depends on next_ids[:, t] and on the main hidden state at t, and is causal."""
    _, oracle = mtp_case("v3_qlora_yarn", tmp_path_factory)
    ids, nxt = _ids(oracle.main.config.vocab_size, 5)
    base = oracle.logits(ids, nxt)
    nxt2 = nxt.copy()
    nxt2[:, 6] = (nxt2[:, 6] + 1) % oracle.main.config.vocab_size
    changed = np.abs(oracle.logits(ids, nxt2) - base).max(-1) > 1e-3
    assert not changed[:, :6].any() and changed[:, 6].all()
    ids2 = ids.copy()
    ids2[:, 3] = (ids2[:, 3] + 1) % oracle.main.config.vocab_size
    changed = np.abs(oracle.logits(ids2, nxt) - base).max(-1) > 1e-3
    assert not changed[:, :3].any() and changed[:, 3].all()


def test_oracle_fp8_eh_proj_per_tensor(tmp_path_factory):
    n = O.CONFIGS["v3_qlora_yarn"]["num_hidden_layers"]
    for quantized in (True, False):
        path, _ = fp8_mtp_case(tmp_path_factory, quantized)
        tensors = O.read_tensors(path)
        eh = f"model.layers.{n}.eh_proj.weight"
        assert (eh + "_scale_inv" in tensors) == quantized
        assert tensors[eh].dtype == (torch.float8_e4m3fn if quantized else torch.bfloat16)
        assert tensors[f"model.layers.{n}.self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn


# ---- jaxinfer ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["v3_qlora_yarn", "v3_noqlora_default"])
def test_mtp_logits_match_reference(name, tmp_path_factory):
    path, oracle = mtp_case(name, tmp_path_factory)
    _check(path, oracle, f"mtp {name}")


@pytest.mark.parametrize("quantize_eh_proj", [True, False], ids=["eh_proj_fp8", "eh_proj_bf16"])
def test_mtp_fp8_checkpoint(quantize_eh_proj, tmp_path_factory):
    """FP8 release format; eh_proj FP8 or BF16 is decided per tensor by its weight_scale_inv sibling."""
    path, ref = fp8_mtp_case(tmp_path_factory, quantize_eh_proj)
    _check(path, ref, f"mtp fp8 eh_proj {'fp8' if quantize_eh_proj else 'bf16'}")


def test_mtp_bad_token_ids(tmp_path_factory):
    path, oracle = mtp_case("v3_qlora_yarn", tmp_path_factory)
    model = O.load_jax_model(path, "float32")
    vocab = oracle.main.config.vocab_size
    ids, nxt = _ids(vocab, 5)
    bad = nxt.copy()
    bad[1, 4] = vocab
    with pytest.raises(ValueError):
        model.mtp_logits(ids, bad)
    with pytest.raises(ValueError):
        model.mtp_logits(ids, nxt[:, :-1])  # next_ids must have the shape of token_ids
    with pytest.raises(ValueError, match="token_ids must be a 2-D integer array .*rows have different lengths"):
        model.logits([[1, 2], [3]])


def test_config_announces_mtp_without_tensors(tmp_path_factory):
    """num_nextn_predict_layers = 1 but no layer-N tensors: loads with MTP disabled and a warning; mtp_logits
    raises an error that says so; the main model still loads."""
    import jaxinfer

    base = O.build_case("v3_qlora_yarn", tmp_path_factory)
    path = O.copy_checkpoint(base.path, tmp_path_factory.mktemp("mtp_missing") / "ckpt")
    cfg = O.read_config(path)
    cfg["num_nextn_predict_layers"] = 1
    O.write_config(path, cfg)
    with pytest.warns(UserWarning, match="(?i)mtp|nextn"):
        model = jaxinfer.load_model(str(path), mesh="1x1", dtype="float32")
    assert model.has_mtp is False
    ids, nxt = _ids(O.CONFIGS["v3_qlora_yarn"]["vocab_size"], 5)
    with pytest.raises(Exception) as err:
        model.mtp_logits(ids, nxt)
    assert any(w in str(err.value).lower() for w in ("mtp", "nextn")), str(err.value)


def test_no_mtp_in_plain_checkpoint(tmp_path_factory):
    """A checkpoint whose config has num_nextn_predict_layers = 0 loads without MTP and without MTP warnings."""
    import jaxinfer

    base = O.build_case("v3_qlora_yarn", tmp_path_factory)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        model = jaxinfer.load_model(str(base.path), mesh="1x1", dtype="float32")
    assert model.has_mtp is False
    assert not [w for w in rec if "mtp" in str(w.message).lower()], [str(w.message) for w in rec]
