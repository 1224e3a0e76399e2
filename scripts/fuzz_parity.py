"""Differential fuzz of model configurations against transformers (not part of the test suite: minutes per run).

tests/models/test_parity_hf.py checks six fixed configurations; this draws random ones. Each iteration draws a
DeepSeek V2 or V3 configuration within what jaxinfer supports (heads, q_lora on / off, head dims, routed and shared
experts, groups and top-k, dense layers, the router family, norm_topk_prob, the scaling factor, default RoPE or
YaRN with and without mscales, rope_interleave, tied embeddings, norm eps, vocabulary), builds a random float32
transformers model of it (tests/hf_oracle.py, the suite's oracle), saves it (with --mtp's chance an MTP layer is
added, V3 only, and with --fp8's chance the checkpoint is rewritten in DeepSeek's FP8 release format, the oracle then
holding the exactly dequantized weights: tests/fp8_oracle.py), and checks jaxinfer against it:
  logits  ``Model.logits`` of a random batch (FP8 weights kept or dequantized at load), and ``Model.mtp_logits``
          against transformers' MtpLayer (tests/models/test_parity_hf.py and test_mtp.py's oracles; float32):
          max|diff| / max|ref| <= F32_TOL;
  engine  ``LLM.generate`` of greedy and seeded sampling requests (random lengths, shared prefixes, temperature,
          top_k, top_p; random mesh, moe_path, page budget, chunk size, prefill layout, scheduler steps, async
          scheduling, attention backend, redundant experts re-placed by EPLB as it runs, MTP speculative decoding
          with K drafts verified "all" or "confidence" where the checkpoint has the layer, prefill/decode
          disaggregation in one process, the KV storage tier with the workload run again on a fresh engine): each
          greedy token must be the argmax of transformers' logits for the sequence so far (teacher-forced over the
          engine's own tokens, so one tie flipped by rounding does not derail the rest: a token within TIE_GAP of
          the maximum passes and is counted), each sampled token inside what top_k and top_p keep of them, and
          every token's logprob must equal transformers' log-softmax within LOGPROB_TOL.
Failures print the configuration and the engine's options; the exit status is 1 if there was any.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/fuzz_parity.py --iters 10
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import random
import sys
import tempfile
import traceback
import warnings

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

F32_TOL = 1e-4  # max|diff| / max|ref| of float32 logits (tests/models/test_parity_hf.py)
TIE_GAP = 1e-3  # logits: a generated token this close to transformers' maximum is a tie, not a mismatch
LOGPROB_TOL = 1e-3
# --dtype bfloat16: the bounds are BF16_SLACK x the error of transformers' own bfloat16 forward (the f32 model cast
# to bfloat16) on the same input. Logits: the median over positions of max|diff| / max|ref| (one expert choice that
# rounding flips moves a position's logits by up to ~0.1 of their range, in either implementation: the maximum
# measures the flips); the engine: its sequence's largest row error bounds each gap and logprob.
BF16_SLACK = 2.0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def draw_config(rng: random.Random) -> dict:
    """A config.json-style dict (transformers 5 form) that jaxinfer and transformers both accept."""
    v3 = rng.random() < 0.65
    layers = rng.randint(1, 3)
    # transformers' V3 router takes the top 2 of every group, even of one expert (one routed expert: test_engine.py)
    experts = rng.choice([2, 3, 4, 6, 8, 12, 16] if v3 else [1, 2, 3, 4, 6, 8, 12, 16])
    top_k = rng.randint(1, min(experts, 6))
    if v3:
        groups = [g for g in _divisors(experts) if experts // g >= 2 or g == 1]  # noaux_tc: top-2 per group
        method = "noaux_tc"
    else:
        groups = _divisors(experts)
        method = rng.choice(["greedy", "group_limited_greedy"])
    n_group = rng.choice(groups) if method != "greedy" else None
    topk_group = None
    if n_group is not None:
        per_group = experts // n_group
        topk_group = rng.choice([t for t in range(1, n_group + 1) if t * per_group >= top_k])
    if rng.random() < 0.4:
        rope = {"rope_type": "default", "rope_theta": rng.choice([10000.0, 50000.0])}
    else:
        rope = {"rope_type": "yarn", "rope_theta": rng.choice([10000.0, 20000.0]),
                "factor": rng.choice([1.5, 4.0, 16.0, 40.0]),
                "original_max_position_embeddings": rng.choice([256, 4096]),
                "beta_fast": rng.choice([32, 16]), "beta_slow": 1}
        mscale = rng.choice(["none", "equal", "differ"])
        if mscale == "equal":
            rope["mscale"] = rope["mscale_all_dim"] = rng.choice([0.707, 1.0])
        elif mscale == "differ":
            rope["mscale"], rope["mscale_all_dim"] = 1.0, rng.choice([0.8, 0.707])
    # transformers warns unless max_position_embeddings = factor x original_max_position_embeddings
    max_pos = int(rope.get("factor", 1) * rope.get("original_max_position_embeddings", 16384))
    hidden = rng.choice([32, 36, 48, 64, 72, 80, 96, 100, 136, 160])
    heads = rng.choice([h for h in range(1, 7) if hidden % h == 0])  # transformers' config insists
    vocab = rng.randint(2, 39) if rng.random() < 0.15 else rng.randint(40, 400)
    cfg = dict(
        model_type="deepseek_v3" if v3 else "deepseek_v2", vocab_size=vocab,
        hidden_size=hidden, intermediate_size=rng.choice([40, 64, 96, 136]),
        moe_intermediate_size=rng.choice([16, 24, 32, 72]), num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, q_lora_rank=rng.choice([None, 16, 48, 96]),
        kv_lora_rank=rng.choice([8, 16, 24, 32, 40, 64, 96]), qk_nope_head_dim=rng.choice([8, 12, 16, 24, 32]),
        qk_rope_head_dim=rng.choice([2, 4, 8, 16]), v_head_dim=rng.choice([8, 12, 16, 24, 40]),
        n_routed_experts=experts, n_shared_experts=rng.choice([0, 1, 2]), num_experts_per_tok=top_k,
        n_group=n_group, topk_group=topk_group, first_k_dense_replace=rng.randint(0, layers),
        norm_topk_prob=rng.random() < 0.5, routed_scaling_factor=rng.choice([1.0, 1.5, 2.5]),
        rms_norm_eps=rng.choice([1e-6, 1e-2]), max_position_embeddings=max_pos, rope_parameters=rope,
        tie_word_embeddings=rng.random() < 0.2)
    if v3:
        cfg.update(rope_interleave=rng.random() < 0.7, num_mtp_layers=0)
    else:
        cfg.update(topk_method=method)
    return cfg


def add_features(rng: random.Random, args, cfg: dict, ref_model, path):
    """Maybe an MTP layer (V3) and DeepSeek's FP8 release format for the checkpoint at ``path``. Returns the oracle
    of the main logits (with FP8, a copy of ``ref_model`` holding the exactly dequantized weights), the MTP layer's
    oracle (hf_oracle.MtpOracle, likewise) or None, and what was added."""
    import hf_oracle as O
    from fp8_oracle import dequantize_checkpoint

    features, mtp = {}, None
    if cfg["model_type"] == "deepseek_v3" and rng.random() < args.mtp:
        mtp = O.build_mtp_oracle(ref_model, seed=rng.randrange(2**31))
        O.add_mtp_to_checkpoint(path, mtp)
        features["mtp"] = True
    if not cfg["tie_word_embeddings"] and rng.random() < args.fp8:  # the release format has a head of its own
        features["fp8"] = rng.choice([None, "ue8m0"])
        O.convert_to_fp8(path, scale_fmt=features["fp8"], shards=rng.choice([1, 2]))
        values = dequantize_checkpoint(O.read_tensors(path))
        mtp_layer = f"model.layers.{cfg['num_hidden_layers']}."
        ref_model = copy.deepcopy(ref_model)
        O.load_state_into_hf(ref_model, {k: v for k, v in values.items() if not k.startswith(mtp_layer)})
        if mtp is not None:
            mtp = O.MtpOracle(main=ref_model, layer=copy.deepcopy(mtp.layer))
            O.load_mtp_tensors(mtp, {k: v for k, v in values.items() if k.startswith(mtp_layer)})
    return ref_model, mtp, features


def draw_engine_options(rng: random.Random, cfg: dict, features: dict, dtype: str, tmp: str) -> dict:
    """``LLM`` options that promise the same outputs; meshes whose expert axis divides the experts."""
    main_moe = cfg["first_k_dense_replace"] < cfg["num_hidden_layers"]
    moe = main_moe or features.get("mtp")  # the MTP block is MoE
    experts = cfg["n_routed_experts"]
    meshes = [f"{d}x{e}" for d in (1, 2) for e in (1, 2, 4) if not moe or experts % e == 0]
    opts = dict(mesh=rng.choice(meshes), dtype=dtype, num_kv_pages=rng.choice([6, 8, 16]),
                max_num_batched_tokens=rng.choice([16, 48, 2048]), prefill_layout=rng.choice(["blocks", "grid"]),
                num_scheduler_steps=rng.choice([None, 1, 3]), async_scheduling=rng.random() < 0.5,
                greedy_screening=rng.choice([None, True, False]), max_num_seqs=rng.choice([2, 8, 64]))
    if main_moe:  # EPLB counts the main model's MoE layers
        opts["moe_path"] = rng.choice([None, "gather", "dense", "capacity", "grouped", "ragged"])
        if rng.random() < 0.3:  # EPLB: redundant slots (a multiple of the expert axis), re-placed as it runs
            ep = int(opts["mesh"].split("x")[1])
            opts["num_redundant_experts"] = ep * rng.randint(1, 2)
            opts["rebalance_every_n_steps"] = rng.choice([None, 1, 3])
    if rng.random() < 0.2:
        opts["attention_backend"] = "pallas"
    if rng.random() < 0.15:  # prefill/decode disaggregation in one process, on disjoint devices
        for name in ("mesh", "num_redundant_experts", "rebalance_every_n_steps"):  # the slots follow one mesh
            opts.pop(name, None)
        ep = [e for e in (1, 2) if not moe or experts % e == 0]
        opts.update(prefill_mesh=f"1x{rng.choice(ep)}", decode_mesh=f"{rng.choice([1, 2])}x{rng.choice(ep)}")
    if rng.random() < 0.15:  # the KV storage tier: check_engine runs the workload again on a fresh engine
        opts["kv_cache_dir"] = tempfile.mkdtemp(dir=tmp)
    if features.get("mtp") and rng.random() < 0.7:
        opts["speculative_config"] = {"method": "mtp", "num_speculative_tokens": rng.randint(1, 3),
                                      "verify": rng.choice(["all", "confidence"])}
    return opts


def check_logits(model, ref_model, ref_bf16, mtp, cfg, rng: random.Random) -> list[str]:
    """The main logits against ``ref_model``'s (and against ``mtp``'s, the MTP layer's logits, float32 only)."""
    import hf_oracle as O

    batch, length = rng.randint(1, 3), rng.randint(1, 40)
    ids = O.random_ids(cfg["vocab_size"], batch, length, rng.randrange(2**31))
    ref = O.reference_logits(ref_model, ids)
    got = model.logits(ids)
    if ref_bf16 is None:
        err, bound, what = O.rel_err(got, ref), F32_TOL, "max|diff|/max|ref|"
    else:
        def median_error(x):
            return float(np.median(np.abs(x - ref).max(-1)) / np.abs(ref).max())

        err, what = median_error(got), "median over positions of max|diff|/max|ref|"
        bound = BF16_SLACK * median_error(O.reference_logits(ref_bf16, ids))
    bad = [] if err <= bound else [f"logits {ids.shape}: {what} = {err:.3e} (bound {bound:.3e})"]
    if mtp is not None and ref_bf16 is None:
        next_ids = O.random_ids(cfg["vocab_size"], batch, length, rng.randrange(2**31))
        err = O.rel_err(model.mtp_logits(ids, next_ids), mtp.logits(ids, next_ids))
        bad += [] if err <= F32_TOL else [f"MTP logits {ids.shape}: max|diff|/max|ref| = {err:.3e}"]
    return bad


def draw_prompts(rng: random.Random, vocab: int) -> list[list[int]]:
    shared = [rng.randrange(vocab) for _ in range(rng.choice([0, 64, 70]))]
    prompts = []
    for _ in range(rng.randint(1, 8)):
        own = [rng.randrange(vocab) for _ in range(rng.choice([1, 2, 7, 30, 63, 64, 65, 100, 150]))]
        prompts.append((shared if rng.random() < 0.5 else []) + own)
    return prompts


def outside_filters(row: np.ndarray, tok: int, sp, tol: float) -> str | None:
    """Why ``tok`` cannot come from transformers' logits ``row`` under ``sp``, or None; a token ahead of ``tok`` by
    ``tol`` or less counts as a tie. Greedy: the maximum. Sampled: among the top_k, and inside the top_p nucleus of
    what top_k keeps, renormalised at the temperature (vLLM's order): the tokens ahead hold less than top_p."""
    if sp.temperature == 0:
        gap = row.max() - row[tok]
        return None if gap <= tol else f"{gap:.3g} below transformers' argmax {int(row.argmax())}"
    ahead = row > row[tok] + tol
    if sp.top_k > 0 and ahead.sum() >= sp.top_k:
        return f"{int(ahead.sum())} tokens ahead, top_k={sp.top_k}"
    if sp.top_p < 1:
        kept = row >= np.sort(row)[-sp.top_k] - tol if 0 < sp.top_k < len(row) else np.ones(len(row), bool)
        prob = np.where(kept, np.exp((row - row.max()) / sp.temperature), 0)
        mass = prob[ahead].sum() / prob.sum()
        if mass >= sp.top_p + 1e-3:
            return f"the tokens ahead hold {mass:.4f}, top_p={sp.top_p}"
    return None


def draw_params(rng: random.Random, SamplingParams):
    """Greedy, or (a third of the requests) seeded sampling with random temperature, top_k and top_p."""
    common = dict(max_tokens=rng.randint(1, 12), ignore_eos=True, logprobs=1)
    if rng.random() < 2 / 3:
        return SamplingParams(temperature=0, **common)
    return SamplingParams(temperature=rng.choice([0.6, 1.0, 1.5]), top_k=rng.choice([0, 1, 3, 5]),
                          top_p=rng.choice([1.0, 0.9, 0.5]), seed=rng.randrange(2**31), **common)


def check_engine(path, ref_model, ref_bf16, cfg, opts: dict, rng: random.Random) -> tuple[list[str], int]:
    """Mismatches of the engine's tokens and logprobs against transformers' teacher-forced logits, and the number
    of ties passed."""
    import hf_oracle as O

    from jaxinfer import LLM, SamplingParams

    prompts = draw_prompts(rng, cfg["vocab_size"])
    params = [draw_params(rng, SamplingParams) for _ in prompts]
    outs = LLM(str(path), **opts).generate(prompts, params, use_tqdm=False)
    runs = [outs]
    if "kv_cache_dir" in opts:  # the prompts' full pages now come from the storage tier
        runs.append(LLM(str(path), **opts).generate(prompts, params, use_tqdm=False))
    bad, ties = [], 0
    for i, (p, sp, out) in enumerate((p, sp, out) for outs in runs for p, sp, out in zip(prompts, params, outs)):
        o = out.outputs[0]
        if o.finish_reason != "length" or len(o.token_ids) != sp.max_tokens:
            bad.append(f"request {i} (prompt {len(p)}): finish {o.finish_reason!r} {o.error or ''}, "
                       f"{len(o.token_ids)} of {sp.max_tokens} tokens")
            continue
        seq = [p + list(o.token_ids)]
        logits = O.reference_logits(ref_model, seq)[0].astype(np.float64)  # [len(seq), V], teacher-forced
        slack = 0.0 if ref_bf16 is None else BF16_SLACK * np.abs(O.reference_logits(ref_bf16, seq)[0] - logits).max()
        for t, tok in enumerate(o.token_ids):
            row = logits[len(p) - 1 + t]
            logprob = row[tok] - row.max() - np.log(np.exp(row - row.max()).sum())
            why = outside_filters(row, tok, sp, max(TIE_GAP, slack))
            if why is not None:
                bad.append(f"request {i} (prompt {len(p)}, {sp}) token {t}: {tok}: {why}")
                break
            ties += int(sp.temperature == 0 and row[tok] < row.max())
            if abs(o.logprobs[t][tok] - logprob) > max(LOGPROB_TOL, 2 * slack):
                bad.append(f"request {i} token {t}: logprob {o.logprobs[t][tok]:.6f}, transformers {logprob:.6f}")
                break
    return bad, ties


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=10, help="configurations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engines", type=int, default=1, help="engines of random options per configuration")
    ap.add_argument("--mtp", type=float, default=0.4, help="the chance of an MTP layer (V3 configurations)")
    ap.add_argument("--fp8", type=float, default=0.3, help="the chance of DeepSeek's FP8 release format")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="jaxinfer's dtype")
    args = ap.parse_args(argv)

    import hf_oracle as O
    import torch

    import jaxinfer

    warnings.filterwarnings("ignore", message=".*norm_topk_prob.*")
    rng = random.Random(args.seed)
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for it in range(args.iters):
            cfg = draw_config(rng)
            label = f"[config {it}] {cfg}"
            path, features, keep_fp8, ref_bf16 = None, {}, False, None
            try:
                ref_model = O.build_hf_model(cfg, seed=rng.randrange(2**31))
                path = O.save_checkpoint(ref_model, pathlib.Path(tmp) / f"m{it}")
                ref_model, mtp, features = add_features(rng, args, cfg, ref_model, path)
                label += f" {features}"
                keep_fp8 = "fp8" in features and rng.random() < 0.5
                ref_bf16 = copy.deepcopy(ref_model).to(torch.bfloat16) if args.dtype == "bfloat16" else None
                model = jaxinfer.load_model(str(path), mesh="1x1", dtype=args.dtype, keep_fp8=keep_fp8)
                bad = check_logits(model, ref_model, ref_bf16, mtp, cfg, rng)
                del model
            except Exception:
                bad = ["exception:\n" + traceback.format_exc()]
            print(f"{label}\n  logits{' (keep_fp8)' if keep_fp8 else ''}: {'ok' if not bad else bad}", flush=True)
            failures += bool(bad)
            if path is None:
                continue
            for _ in range(args.engines):
                opts = draw_engine_options(rng, cfg, features, args.dtype, tmp)
                try:
                    bad, ties = check_engine(path, ref_model, ref_bf16, cfg, opts, rng)
                except Exception:
                    bad, ties = ["exception:\n" + traceback.format_exc()], 0
                print(f"  engine {opts}: {'ok' if not bad else 'MISMATCH'}, {ties} ties", flush=True)
                for b in bad:
                    print(f"    {b}", flush=True)
                failures += bool(bad)
    print(f"{failures} failing checks in {args.iters} configurations")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
