"""Logits parity with HF transformers (the reference implementation, docs/architecture.md "Reference semantics")
on tiny random checkpoints.

The configurations (hf_oracle.CONFIGS) together vary: q_lora_rank null / int; n_group and topk_group (1/1, 3/2,
4/2); norm_topk_prob true / false; YaRN (mscale = mscale_all_dim, mscale != mscale_all_dim, no mscale) vs default
RoPE, rope_theta 10000 / 20000 / 50000; first_k_dense_replace 0, 1, 2; v_head_dim != qk_nope_head_dim; 3, 4 and 5
heads; 0, 1 and 2 shared experts; vocab 97, 101, 113, 131; non-zero e_score_correction_bias; hidden / intermediate /
projection dims above 128; the V2 family (softmax router, greedy and group_limited_greedy); a sharded checkpoint
with an index; a config.json in the legacy rope_theta + rope_scaling form.

Metrics: f32 -- max|jaxinfer - HF| / max|HF| <= 1e-4 over the whole [B, T, vocab] logits; bf16 -- greedy (argmax)
agreement with the f32 HF logits on >= 99% of the positions whose reference margin is resolvable in bf16 (see
BF16_MARGIN) and >= 99% of all positions, and a mean error no larger than transformers' own bf16 forward; the
relative error is printed (``pytest -s`` shows it).
"""

from __future__ import annotations

import numpy as np
import pytest

import hf_oracle as O

# v2_group_limited sets norm_topk_prob true, which the V2 family ignores (jaxinfer says so in a warning).
pytestmark = pytest.mark.filterwarnings("ignore:.*norm_topk_prob.*:UserWarning")

F32_TOL = 1e-4
PARITY = ["v3_qlora_yarn", "v3_noqlora_default", "v3_dense2_attnfactor", "v2_greedy", "v2_group_limited"]
V3_CASES = [n for n in O.CONFIGS if O.CONFIGS[n]["model_type"] == "deepseek_v3"]


def _describe(got: np.ndarray, ref: np.ndarray) -> str:
    diff = np.abs(got.astype(np.float64) - ref)
    b, t, v = np.unravel_index(np.argmax(diff), diff.shape)
    per_pos = diff.max(-1) / np.abs(ref).max()
    return (f"rel err {O.rel_err(got, ref):.3e} (max |diff| {diff.max():.4g} at b={b} t={t} v={v}, "
            f"max |ref| {np.abs(ref).max():.4g}); first position over tolerance: "
            f"{np.argwhere(per_pos > F32_TOL)[:1].tolist()}")


def _check_f32(case: O.Case, batch: int, length: int, seed: int, ref_model=None) -> None:
    ids = O.random_ids(case.cfg["vocab_size"], batch, length, seed)
    ref = O.reference_logits(ref_model or case.model, ids)
    model = O.load_jax_model(case.path, "float32")
    got = model.logits(ids)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32, (type(got), getattr(got, "dtype", None))
    assert got.shape == ref.shape, (got.shape, ref.shape)
    err = O.rel_err(got, ref)
    print(f"\n[{case.name} f32 B={batch} T={length}] max|diff|/max|ref| = {err:.3e}")
    assert err <= F32_TOL, f"{case.name}: {_describe(got, ref)}"


# ---- oracle sanity (torch only): the references are able to catch what they are meant to catch -----------------


@pytest.mark.parametrize("name", V3_CASES)
def test_oracle_correction_bias_changes_routing(name, tmp_path_factory):
    """The non-zero e_score_correction_bias changes the chosen experts of some tokens, so an implementation that
    ignores it (or adds it to the weights) cannot pass the parity tests."""
    case = O.build_case(name, tmp_path_factory)
    stats = O.routing_stats(case.model, O.random_ids(case.cfg["vocab_size"], 2, 11, 0))
    print(f"\n[{name}] bias changes the expert set of {stats['changed']}/{stats['total']} (token, layer) pairs")
    assert 0 < stats["changed"] < stats["total"]


def test_oracle_checkpoint_is_what_hf_reloads(tmp_path_factory):
    """save_pretrained -> from_pretrained reproduces the in-memory model exactly (including the router biases),
    and the file uses DeepSeek's per-expert tensor names."""
    case = O.build_case("v3_qlora_yarn", tmp_path_factory)
    names = set(O.read_tensors(case.path))
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in names
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    assert not any("gate_up_proj" in n for n in names)
    ids = O.random_ids(case.cfg["vocab_size"], 2, 11, 0)
    np.testing.assert_array_equal(O.reference_logits(O.load_hf_model(case.path), ids),
                                  O.reference_logits(case.model, ids))


# ---- float32 ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", PARITY)
def test_f32_logits_match_hf(name, tmp_path_factory):
    _check_f32(O.build_case(name, tmp_path_factory), batch=2, length=11, seed=1)


@pytest.mark.parametrize("name", ["v3_qlora_yarn", "v2_group_limited"])
def test_f32_logits_match_hf_batch_of_three(name, tmp_path_factory):
    _check_f32(O.build_case(name, tmp_path_factory), batch=3, length=7, seed=2)


def test_sharded_checkpoint_is_sharded(tmp_path_factory):
    """Oracle side of the sharded case: save_pretrained wrote several files and an index (the parity test on
    v2_group_limited then proves the loader reads them)."""
    case = O.build_case("v2_group_limited", tmp_path_factory)
    assert len(O.checkpoint_files(case.path)) > 1
    assert (case.path / O.INDEX_NAME).exists()


def test_legacy_rope_scaling_config(tmp_path_factory):
    """A config.json in the pre-transformers-5 form (rope_theta + rope_scaling {"type": "yarn", ...}): HF reads it
    back to the same rope parameters and logits, and jaxinfer agrees with HF."""
    case = O.build_case("v3_legacy_rope", tmp_path_factory)
    on_disk = O.read_config(case.path)
    assert "rope_parameters" not in on_disk and on_disk["rope_scaling"]["type"] == "yarn"
    assert on_disk["rope_theta"] == case.cfg["rope_parameters"]["rope_theta"]
    hf = O.load_hf_model(case.path)
    want = case.cfg["rope_parameters"]
    got = hf.config.rope_parameters
    assert {k: got.get(k) for k in want} == want, (got, want)
    ids = O.random_ids(case.cfg["vocab_size"], 2, 11, 1)
    np.testing.assert_allclose(O.reference_logits(hf, ids), O.reference_logits(case.model, ids), rtol=0, atol=1e-6)
    _check_f32(case, batch=2, length=11, seed=1, ref_model=hf)


# ---- bfloat16 ---------------------------------------------------------------------------------------------------


# Greedy agreement is counted where the f32 reference's top-1 / top-2 margin exceeds BF16_MARGIN * max|ref|
# (about 0.25 logits here, 4 bf16 ulps at the magnitude of the top logits): below that the f32 ranking is within
# the rounding of bf16 logits themselves, and it is not the implementation that decides it. This is a stated
# filter, not a silent one: on these batches it keeps ~80% of the 256 positions, and HF transformers' OWN bf16
# forward of the same checkpoint (from_pretrained(dtype=bfloat16), printed below for calibration) flips 1-4
# unfiltered positions, all with margins < 0.15. Larger init std does not help: it scales margins and bf16
# errors alike. Unfiltered agreement is asserted too, at the 99% (HF's own bf16 reaches 98.8% on
# v3_qlora_yarn; jaxinfer keeps its residual stream in float32 and reaches 99.2%).
BF16_MARGIN = 0.02
BF16_MIN_AGREEMENT = 0.99
BF16_MIN_AGREEMENT_UNFILTERED = 0.99


@pytest.mark.parametrize("name", ["v3_qlora_yarn", "v2_greedy"])
def test_bf16_greedy_agreement(name, tmp_path_factory):
    """bf16 weights and activations vs the f32 HF logits on B=8, T=32 (256 positions)."""
    import torch

    case = O.build_case(name, tmp_path_factory)
    ids = O.random_ids(case.cfg["vocab_size"], 8, 32, 3)
    ref = O.reference_logits(case.model, ids)
    got = O.load_jax_model(case.path, "bfloat16").logits(ids)
    assert got.dtype == np.float32 and got.shape == ref.shape
    top2 = np.sort(ref, -1)[..., -2:]
    decided = (top2[..., 1] - top2[..., 0]) > BF16_MARGIN * np.abs(ref).max()
    agree = got.argmax(-1) == ref.argmax(-1)
    hf_bf16 = O.reference_logits(O.load_hf_model(case.path, torch.bfloat16), ids)
    hf_agree = hf_bf16.argmax(-1) == ref.argmax(-1)
    mean_err, hf_mean_err = (float(np.abs(x - ref).mean() / np.abs(ref).max()) for x in (got, hf_bf16))
    print(f"\n[{name} bf16 B=8 T=32] max|diff|/max|ref| = {O.rel_err(got, ref):.3e}; greedy agreement "
          f"{agree[decided].mean():.4f} on {decided.sum()} positions with margin > {BF16_MARGIN} max|ref|, "
          f"{agree.mean():.4f} on all {agree.size} (HF's own bf16: {hf_agree[decided].mean():.4f} / "
          f"{hf_agree.mean():.4f}); mean |diff|/max|ref| {mean_err:.2e} (HF's own bf16: {hf_mean_err:.2e})")
    assert decided.mean() > 0.5, "the margin filter would drop most positions: the oracle model is too flat"
    assert agree[decided].mean() >= BF16_MIN_AGREEMENT, f"{name}: {_describe(got, ref)}"
    assert agree.mean() >= BF16_MIN_AGREEMENT_UNFILTERED, f"{name}: {_describe(got, ref)}"
    assert mean_err <= hf_mean_err, f"{name}: bf16 mean error {mean_err:.2e} > transformers' bf16 {hf_mean_err:.2e}"
