"""DeepSeek FP8 release-format checkpoints with dims that are not multiples of 128.

Checkpoint: the v3_qlora_yarn model (hidden 160, intermediate 136, q_b out 240, kv_b out 280, experts 72 x 160)
converted by hf_oracle.convert_to_fp8: projection weights e4m3 + ``weight_scale_inv`` [ceil(out/128),
ceil(in/128)] (partial AND multiple blocks), everything else BF16 (router bias F32), sharded in two files so
that weights and their scales sit in different files.

Oracle: the checkpoint's bytes read back with the official safetensors reader, dequantized HERE in numpy
(w = fp8 * scale_inv per zero-padded 128x128 block, written independently of jaxinfer's fp8 module), written
into the HF model, HF forward. Not transformers' own FP8 loading: it dequantizes partial blocks wrongly
(docs/architecture.md "Reference semantics"; ``test_oracle_detects_wrong_partial_blocks`` shows such a
dequantization would fail this test).
Metric: float32 max|jaxinfer - HF| / max|HF| <= 1e-4.
"""

from __future__ import annotations

import copy

import ml_dtypes
import numpy as np
import pytest
import torch

import hf_oracle as O
from fp8_oracle import dequantize_checkpoint, dequantize_exact, fp8_bits_to_f32

F32_TOL = 1e-4
BASE = "v3_qlora_yarn"


def fp8_case(tmp_path_factory, scale_fmt):
    """(checkpoint dir, its tensors, HF model holding the exactly dequantized weights), once per session."""

    def build():
        base = O.build_case(BASE, tmp_path_factory)
        path = O.copy_checkpoint(base.path, tmp_path_factory.mktemp(f"fp8_{scale_fmt}") / "ckpt")
        O.convert_to_fp8(path, scale_fmt=scale_fmt, shards=2)
        tensors = O.read_tensors(path)
        ref_model = copy.deepcopy(base.model)
        O.load_state_into_hf(ref_model, dequantize_checkpoint(tensors))
        return path, tensors, ref_model

    return O.cached(f"fp8:{scale_fmt}", build)


# ---- oracle sanity (no jaxinfer) ------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_oracle_checkpoint_is_deepseek_fp8_format(scale_fmt, tmp_path_factory):
    path, tensors, _ = fp8_case(tmp_path_factory, scale_fmt)
    cfg = O.read_config(path)
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    assert cfg["quantization_config"].get("scale_fmt") == scale_fmt
    fp8 = {n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn}
    for n in ("model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight",
              "model.layers.0.mlp.down_proj.weight", "model.layers.2.mlp.experts.5.up_proj.weight",
              "model.layers.1.mlp.shared_experts.gate_proj.weight", "model.layers.2.self_attn.o_proj.weight"):
        assert n in fp8 and tensors[n + "_scale_inv"].dtype == torch.float32, n
    for n in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.1.mlp.gate.weight",
              "model.layers.0.self_attn.kv_a_layernorm.weight"):
        assert tensors[n].dtype == torch.bfloat16, n
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    shapes = {n: tuple(tensors[n].shape) for n in fp8}
    assert any(r % 128 and r > 128 for r, _ in shapes.values()), "need a partial block after a full one (rows)"
    assert any(c % 128 and c > 128 for _, c in shapes.values()), "need a partial block after a full one (cols)"
    assert all(tuple(tensors[n + "_scale_inv"].shape) == (-(-r // 128), -(-c // 128)) for n, (r, c) in shapes.items())
    # Weight and scale in different files, as a loader must handle in sharded releases.
    index = __import__("json").loads((path / O.INDEX_NAME).read_text())["weight_map"]
    assert any(index[n] != index[n + "_scale_inv"] for n in fp8)
    if scale_fmt == "ue8m0":
        for n in fp8:
            s = tensors[n + "_scale_inv"].numpy()
            np.testing.assert_array_equal(np.exp2(np.round(np.log2(s))), s)


def test_oracle_fp8_changes_the_model(tmp_path_factory):
    """The quantization moves the logits by much more than the tolerance, so passing means reading the scales."""
    _, _, ref_model = fp8_case(tmp_path_factory, None)
    base = O.build_case(BASE, tmp_path_factory)
    ids = O.random_ids(base.cfg["vocab_size"], 2, 11, 1)
    assert O.rel_err(O.reference_logits(ref_model, ids), O.reference_logits(base.model, ids)) > 30 * F32_TOL


def test_oracle_detects_wrong_partial_blocks(tmp_path_factory):
    """Dequantizing with the block size taken as rows // scale_rows (what transformers does on CPU) gives
    logits that differ from the exact dequantization by far more than the tolerance."""
    _, tensors, ref_model = fp8_case(tmp_path_factory, None)
    wrong = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = tensors[name + "_scale_inv"].numpy()
            w = fp8_bits_to_f32(t)
            br, bc = w.shape[0] // s.shape[0], w.shape[1] // s.shape[1]
            sr = np.repeat(np.repeat(s, br, 0), bc, 1)
            sr = np.pad(sr, ((0, w.shape[0] - sr.shape[0]), (0, w.shape[1] - sr.shape[1])), mode="edge")
            wrong[name] = w * sr[: w.shape[0], : w.shape[1]]
        else:
            wrong[name] = t.float().numpy()
    wrong_model = copy.deepcopy(ref_model)
    O.load_state_into_hf(wrong_model, wrong)
    ids = O.random_ids(O.CONFIGS[BASE]["vocab_size"], 2, 11, 1)
    assert O.rel_err(O.reference_logits(wrong_model, ids), O.reference_logits(ref_model, ids)) > 30 * F32_TOL


# ---- jaxinfer ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_fp8_logits_match_exact_dequantization(scale_fmt, tmp_path_factory):
    path, _, ref_model = fp8_case(tmp_path_factory, scale_fmt)
    ids = O.random_ids(O.CONFIGS[BASE]["vocab_size"], 2, 11, 1)
    ref = O.reference_logits(ref_model, ids)
    model = O.load_jax_model(path, "float32")
    assert model.config.quantization is not None
    got = model.logits(ids)
    err = O.rel_err(got, ref)
    print(f"\n[fp8 scale_fmt={scale_fmt} f32 B=2 T=11] max|diff|/max|ref| = {err:.3e}")
    assert got.shape == ref.shape and err <= F32_TOL, f"rel err {err:.3e}"


def test_fp8_dequantizing_load_reuses_its_staging_buffers(tmp_path_factory, monkeypatch):
    """A dequantizing load reads the FP8 bytes into staging buffers taken back once their product is done: two
    rotate (one read by the product in flight, the next tensor read into the other), so the largest FP8 tensors (the
    stacked experts, three per MoE layer) are read into fresh mappings twice however many layers follow (fresh pages,
    not the copy, bound a read: docs/benchmarks.md "Checkpoint loading"); the logits still match the oracle (no
    buffer reused while a product reads it)."""
    import mmap

    import jaxinfer
    from jaxinfer.checkpoint import safetensors_io

    takes, maps = [], []
    take = safetensors_io.StagingBuffers.take

    def counting_take(self, shape, dtype):
        out = take(self, shape, dtype)
        base = out
        while base is not None and not isinstance(base, mmap.mmap):
            base = base.obj if isinstance(base, memoryview) else base.base
        if base is not None:
            takes.append((out.nbytes, not any(base is m for m in maps)))
            maps.append(base)
        return out

    monkeypatch.setattr(safetensors_io.StagingBuffers, "take", counting_take)
    path, _, ref_model = fp8_case(tmp_path_factory, None)
    model = jaxinfer.load_model(path, mesh="1x1", dtype="float32")
    largest = max(nbytes for nbytes, _ in takes)
    fresh = [is_fresh for nbytes, is_fresh in takes if nbytes == largest]
    assert len(fresh) == 3 * (O.CONFIGS[BASE]["num_hidden_layers"] - O.CONFIGS[BASE]["first_k_dense_replace"])
    assert sum(fresh) == 2, takes
    ids = O.random_ids(O.CONFIGS[BASE]["vocab_size"], 2, 11, 1)
    err = O.rel_err(model.logits(ids), O.reference_logits(ref_model, ids))
    assert err <= F32_TOL, f"rel err {err:.3e}"


def test_fp8_kept_in_e4m3_matches_exact_dequantization(tmp_path_factory):
    """keep_fp8=True: weights stay e4m3 + block scales on device (dequantized on the fly), same oracle; the
    orbax form written by `jaxinfer convert` keeps them that way and gives the same logits."""
    import jax
    from flax import nnx

    import jaxinfer
    from jaxinfer.cli import main

    path, _, ref_model = fp8_case(tmp_path_factory, None)
    ids = O.random_ids(O.CONFIGS[BASE]["vocab_size"], 2, 11, 1)
    ref = O.reference_logits(ref_model, ids)
    model = jaxinfer.load_model(path, mesh="1x1", dtype="float32", keep_fp8=True)
    dtypes = {str(v.dtype) for v in jax.tree.leaves(nnx.to_pure_dict(model.state))}
    assert "float8_e4m3fn" in dtypes
    got = model.logits(ids)
    assert O.rel_err(got, ref) <= F32_TOL, f"rel err {O.rel_err(got, ref):.3e}"
    out = tmp_path_factory.mktemp("fp8_orbax") / "ckpt"
    assert main(["convert", str(path), str(out), "--mesh", "1x1", "--dtype", "float32"]) == 0
    np.testing.assert_array_equal(jaxinfer.load_model(out, mesh="1x1", dtype="float32").logits(ids), got)


def test_fp8_compute_within_stated_tolerance(tmp_path_factory):
    """fp8_compute (DeepSeek's deployment path: activations quantized per token per 128 channels, FP8 GEMMs with
    fp32 accumulation) against the exact dequantization run by transformers. e4m3 keeps 3 mantissa bits, so
    every projection's input carries up to 2^-4 relative rounding; stated tolerance on the logits: DeepGEMM's
    calc_diff (1 - cosine-like similarity) <= 1e-3 and greedy agreement >= 90%."""
    import jaxinfer

    path, _, ref_model = fp8_case(tmp_path_factory, None)
    ids = O.random_ids(O.CONFIGS[BASE]["vocab_size"], 4, 16, 2)
    ref = O.reference_logits(ref_model, ids)
    got = jaxinfer.load_model(path, mesh="1x1", dtype="float32", fp8_compute=True).logits(ids)
    x, y = got.astype(np.float64), ref.astype(np.float64)
    calc_diff = 1 - 2 * (x * y).sum() / (x * x + y * y).sum()
    agree = (got.argmax(-1) == ref.argmax(-1)).mean()
    print(f"\n[fp8_compute] calc_diff {calc_diff:.2e}, max|diff|/max|ref| {O.rel_err(got, ref):.2e}, "
          f"greedy agreement {agree:.3f}")
    assert calc_diff <= 1e-3 and agree >= 0.9
    assert O.rel_err(got, ref) > 1e-5  # the activations really went through FP8


def test_jaxinfer_dequantize_equals_exact_dequantization(tmp_path_factory):
    """jaxinfer.checkpoint.fp8.dequantize_blockwise on every quantized tensor of the checkpoint equals the numpy
    dequantization above (a single f32 multiply per element: exact)."""
    from jaxinfer.checkpoint import fp8

    _, tensors, _ = fp8_case(tmp_path_factory, None)
    for name, t in tensors.items():
        if t.dtype != torch.float8_e4m3fn:
            continue
        q = t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
        s = tensors[name + "_scale_inv"].numpy()
        got = np.asarray(fp8.dequantize_blockwise(q, s))
        assert got.dtype == np.float32 and got.shape == q.shape, name
        np.testing.assert_array_equal(got, dequantize_exact(t, s), err_msg=name)


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_jaxinfer_quantize_contract(scale_fmt):
    """quantize_blockwise: e4m3 values, float32 scales [ceil(out/128), ceil(in/128)], and the exact dequantization
    of its output is within e4m3 precision of the input: |w - deq| <= 2^-4 |w| + 2^-9 s per block (3 mantissa
    bits, round to nearest; subnormal spacing 2^-9 s). UE8M0: power-of-two scales."""
    from jaxinfer.checkpoint import fp8

    w = np.random.default_rng(0).standard_normal((200, 136)).astype(np.float32)
    w[130:, :] *= 50.0  # blocks with different ranges
    q, s = fp8.quantize_blockwise(w, scale_fmt=scale_fmt)
    assert q.dtype == ml_dtypes.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == np.float32 and s.shape == (2, 2)
    deq = dequantize_exact(torch.from_numpy(np.asarray(q).view(np.uint8)).view(torch.float8_e4m3fn), s)
    s_full = np.repeat(np.repeat(s, 128, 0), 128, 1)[:200, :136]
    assert np.all(np.abs(w - deq) <= 2.0**-4 * np.abs(w) + 2.0**-9 * s_full)
    if scale_fmt == "ue8m0":
        np.testing.assert_array_equal(np.exp2(np.round(np.log2(s))), s)
