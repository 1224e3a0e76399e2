"""Speculative decoding samples from the target distribution: a goodness-of-fit test of the engine end to end.

Oracle: the exact distribution of the generated tokens, computed from the model's own cache-free logits
(``Model.logits``, a causal forward from position 0) by enumerating the earlier tokens: P(t1 | prompt),
P(t2 | prompt, t1) for every t1 and P(t3 | prompt, t1, t2) for every pair (V^2 sequences in one batch), each
processed in numpy as the sampler does (temperature, then top-k keeping the values >= the k-th largest), then
marginalised to P(t2), P(t3) and P(t2, t3). It is never compared with the engine's non-speculative output.

Samples: thousands of seeded requests (seed = base + i) of one prompt through ``jaxinfer.LLM`` with MTP drafts
(K = 2) on a tiny random DeepSeek-V3 (vocabulary 16, one dense layer, an MoE MTP layer), max_tokens 5: the step
after the prefill verifies two drafts, so t2 is decided at the verification's first column and t3 at its second
(accepted draft, recovered token after a rejection), or, after an early rejection, by the step's second
draft-verify round on device (LLM's default num_scheduler_steps on CPU is 8; the step reserves 4 positions, so a
second round of 3 runs exactly when the first accepted nothing; step_program.py ``verify_rounds``). Pearson's
chi-square with cells merged to expected counts >= 5 (tests/chi_square.py, scipy's p-value)
at significance 1e-3 per distribution; the seeds are fixed, so the test is deterministic. The same samples must
reject the exact distribution of a wrong temperature (0.8 for samples at 1; 1 without top-k for samples at 0.7
with top-k 3) with p < 1e-6, so the test has power.

The checkpoint's MTP module is random, but its eh_proj mostly passes the embedding of its input token (0.8 I + 0.2
random; the hidden-state half scaled by 0.2), whose logits through the shared head resemble the main model's at that
token: drafts are accepted at both positions (measured: 44% of the drafts at temperature 1, 69% at 0.7 with top-k
3; a fully random MTP module's chained second draft was almost never among the top 3). Acceptance and rejection at
both draft positions are asserted from the engine's counters, so acceptance, recovery and bonus are exercised.
"""

from __future__ import annotations

import hf_oracle as O
import numpy as np
import pytest
import torch

from jaxinfer import LLM, SamplingParams
from chi_square import chi_square_pvalue

V, HIDDEN = 16, 32
CFG = dict(model_type="deepseek_v3", vocab_size=V, hidden_size=HIDDEN, intermediate_size=48, moe_intermediate_size=16,
           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=16,
           qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=2, n_shared_experts=1,
           num_experts_per_tok=1, n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
           routed_scaling_factor=1.0, rms_norm_eps=1e-6, max_position_embeddings=256,
           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, num_mtp_layers=0)
PROMPT = [2, 13, 10, 14]
N = 2000  # requests per setting
ALPHA = 1e-3
POWER_ALPHA = 1e-6
SETTINGS = {"t1.0": (1.0, 0, 0), "t0.7_topk3": (0.7, 3, 10**6)}  # temperature, top_k, seed base
# Power checks: each setting's samples against a wrong (temperature, top_k), one with the same support.
WRONG = {"t1.0": (0.8, 0), "t0.7_topk3": (1.0, 0)}


def _build_checkpoint(tmp_path_factory):
    model = O.build_hf_model(CFG, seed=0, head_std=2.0)
    path = O.save_checkpoint(model, tmp_path_factory.mktemp("spec_sampling") / "ckpt")
    oracle = O.build_mtp_oracle(model, seed=100)
    eh = oracle.tensors[f"model.layers.{CFG['num_hidden_layers']}.eh_proj.weight"]  # [D, 2D]: [embed | hidden]
    with torch.no_grad():
        eh[:, :HIDDEN] = 0.8 * torch.eye(HIDDEN) + 0.2 * eh[:, :HIDDEN]
        eh[:, HIDDEN:] *= 0.2
    O.add_mtp_to_checkpoint(path, oracle)
    return path


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    """(LLM with K = 2 MTP drafts, float32 [V, V, 3, V] logits of PROMPT + [t1, t2] at the columns deciding t1,
    t2 and t3)."""
    path = O.cached("spec_sampling", lambda: _build_checkpoint(tmp_path_factory))
    llm = LLM(str(path), dtype="float32", mesh="1x1", max_num_seqs=N, num_kv_pages=N + 8,
              max_num_batched_tokens=8 * 1024, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    pairs = np.stack(np.meshgrid(np.arange(V), np.arange(V), indexing="ij"), -1).reshape(V * V, 2)  # (t1, t2)
    seqs = np.concatenate([np.tile(PROMPT, (V * V, 1)), pairs], axis=1).astype(np.int32)
    logits = llm.engine.model.logits(seqs)  # [V^2, L + 2, V]
    L = len(PROMPT)
    return llm, logits[:, L - 1:L + 2].reshape(V, V, 3, V)


def processed(logits: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
    """The sampler's distribution (float64 [..., V]) of float32 logits: / temperature (in float32), top-k keeps
    values >= the k-th largest (0: off)."""
    scaled = (logits.astype(np.float32) / np.float32(temperature)).astype(np.float64)
    if top_k:
        kth = np.sort(scaled, axis=-1)[..., -top_k][..., None]
        scaled = np.where(scaled >= kth, scaled, -np.inf)
    p = np.exp(scaled - scaled.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def exact(logits: np.ndarray, temperature: float, top_k: int) -> dict[str, np.ndarray]:
    """Exact P(t1), P(t2), P(t3) [V] and P(t2, t3) [V, V] by enumeration."""
    p = processed(logits, temperature, top_k)  # [V, V, 3, V]
    p1 = p[0, 0, 0]  # [t1] (the first column does not depend on t1, t2)
    p2 = p[:, 0, 1]  # [t1, t2] (the second column does not depend on t2)
    p3 = p[:, :, 2]  # [t1, t2, t3]
    joint = p1[:, None, None] * p2[:, :, None] * p3  # [t1, t2, t3]
    return {"t1": p1, "t2": joint.sum((0, 2)), "t3": joint.sum((0, 1)), "t2_t3": joint.sum(0)}


def empirical(tokens: np.ndarray) -> dict[str, np.ndarray]:
    """Counts of t1, t2, t3 [V] and of (t2, t3) [V, V] of tokens int [N, >= 3]."""
    count = lambda x, n: np.bincount(x, minlength=n)  # noqa: E731
    return {"t1": count(tokens[:, 0], V), "t2": count(tokens[:, 1], V), "t3": count(tokens[:, 2], V),
            "t2_t3": count(tokens[:, 1] * V + tokens[:, 2], V * V).reshape(V, V)}


def generate(llm: LLM, temperature: float, top_k: int, seed_base: int) -> np.ndarray:
    params = [SamplingParams(temperature=temperature, top_k=top_k, seed=seed_base + i, max_tokens=5,
                             ignore_eos=True) for i in range(N)]
    outs = llm.generate([PROMPT] * N, params, use_tqdm=False)
    tokens = np.array([o.outputs[0].token_ids for o in outs])
    assert tokens.shape == (N, 5)
    return tokens


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_speculative_tokens_follow_the_exact_target_distribution(spec, setting):
    """t1, t2, t3 and (t2, t3) of 2000 seeded requests fit the enumerated target (module doc)."""
    llm, logits = spec
    temperature, top_k, seed_base = SETTINGS[setting]
    tokens = generate(llm, temperature, top_k, seed_base)
    stats = llm.stats
    assert stats.num_draft_tokens > 0
    rate = stats.num_accepted_tokens / stats.num_draft_tokens
    print(f"\n[{setting}] drafts {stats.num_draft_tokens}, accepted {stats.num_accepted_tokens} ({rate:.2f}), "
          f"per position {stats.accepted_per_position}")
    assert 0.05 < rate < 0.95, f"acceptance {rate:.3f}: both acceptance and recovery must happen"
    # Both draft positions are accepted and rejected often: draft 1 in some of the rounds, draft 2 (verified only
    # after draft 1 was accepted) in some of those.
    first, second = stats.accepted_per_position
    assert 0.05 * stats.num_drafts < first < 0.95 * stats.num_drafts, (stats.num_drafts, first)
    assert 0.05 * first < second < 0.95 * first, (first, second)

    ref = exact(logits, temperature, top_k)
    counts = empirical(tokens)
    for name in ref:
        p, stat, df = chi_square_pvalue(counts[name].ravel(), ref[name].ravel())
        print(f"[{setting}] {name}: chi-square {stat:.1f}, df {df}, p = {p:.3f}")
        assert p > ALPHA, f"{setting} {name}: chi-square {stat:.1f} (df {df}), p = {p:.2e}"

    # Power: the same samples reject the exact distribution of a wrong temperature / top-k.
    wrong = exact(logits, *WRONG[setting])
    for name in ("t2", "t3"):
        p, stat, df = chi_square_pvalue(counts[name], wrong[name])
        print(f"[{setting}] {name} against temperature, top_k = {WRONG[setting]}: chi-square {stat:.1f}, "
              f"df {df}, p = {p:.1e}")
        assert p < POWER_ALPHA, f"{setting} {name} against {WRONG[setting]}: p = {p:.2e} (the test has no power)"
