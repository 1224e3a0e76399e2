"""Expert load from the running engine and EPLB rebalancing applied on the mesh (LLM.expert_load,
LLM.rebalance_experts, jaxinfer/rebalance.py), on a tiny random V3 model in float32.

References: the expert choices of transformers' own router (HF ``DeepseekV3TopkRouter`` topk indices, recorded with
forward hooks on each MoE layer's ``mlp.gate``) over exactly the tokens the engine computed (prompt + all generated
tokens but the last); the engine's own greedy outputs before rebalancing; EPLB's balance model
(eplb.balancedness) and the tokens actually dispatched to each expert rank (parallel/comm.tokens_sent).
"""

import numpy as np
import pytest
import torch

import hf_oracle as O
from compile_counter import CompileCounter
from jaxinfer import rebalance
from jaxinfer.engine.llm import LLM
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.parallel.comm import tokens_sent
from jaxinfer.parallel.eplb import balancedness
from jaxinfer.parallel.placement import placement_tables

CASE = "v3_qlora_yarn"  # 8 routed experts in 4 groups, top-2, MoE layers 1 and 2
LENGTHS = (5, 37, 64, 70, 130, 3, 17, 90, 1, 45)
MAX_TOKENS = (8, 3, 6, 1, 5, 8, 2, 7, 4, 6)


@torch.no_grad()
def _hf_generate(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    """The case, prompts, greedy SamplingParams and transformers' greedy outputs."""
    case = O.build_case(CASE, tmp_path_factory)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, case.cfg["vocab_size"], n).tolist() for n in LENGTHS]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    return case, prompts, params, [_hf_generate(case.model, p, m) for p, m in zip(prompts, MAX_TOKENS)]


def _llm(case, mesh, **kw):
    # Prefix caching off: a rerun of the same prompts must compute (and count) the same tokens.
    return LLM(case.path, mesh=mesh, dtype="float32", num_kv_pages=24, max_num_batched_tokens=96,
               enable_prefix_caching=False, **kw)


@torch.no_grad()
def hf_choices(model, seq: list[int]) -> np.ndarray:
    """Transformers' router choices for one causal forward over seq: int [num_moe_layers, T, top_k]."""
    chosen = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, args, out, i=i: chosen.__setitem__(i, out[2]))
             for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    try:
        model(input_ids=torch.tensor([seq]), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return np.stack([chosen[i].numpy() for i in sorted(chosen)])


def hf_expert_load(model, seqs, num_experts: int) -> np.ndarray:
    """int64 [num_moe_layers, E]: (token, choice) pairs per expert over every position of every sequence."""
    return sum(np.stack([np.bincount(layer.reshape(-1), minlength=num_experts) for layer in hf_choices(model, s)])
               for s in seqs).astype(np.int64)


def _computed(prompts, outs):
    """The tokens the engine ran through the model: each prompt and its outputs but the last (never fed back)."""
    return [p + o.outputs[0].token_ids[:-1] for p, o in zip(prompts, outs)]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _check_load_equals_transformers(llm, case, prompts, outs):
    load = llm.expert_load()
    num_experts = case.cfg["n_routed_experts"]
    assert load.dtype == np.int64 and load.shape == (2, num_experts)
    ref = hf_expert_load(case.model, _computed(prompts, outs), num_experts)
    np.testing.assert_array_equal(load, ref)  # padding rows and columns (most of every step) not counted
    assert load.sum() == 2 * case.cfg["num_experts_per_tok"] * sum(len(s) for s in _computed(prompts, outs))


def test_expert_load_equals_transformers_routing(workload):
    """Mesh 2x4 with 4 redundant slots (12 slots, 3 per expert rank): routing per DP rank inside shard_map."""
    case, prompts, params, reference = workload
    llm = _llm(case, "2x4", num_redundant_experts=4)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert _ids(outs) == reference
    _check_load_equals_transformers(llm, case, prompts, outs)


def test_expert_load_window_is_the_last_steps(workload):
    """Window of 1 step: after a generate, the load is the last decode step's single token (one decode
    iteration per step, so that a step is one token)."""
    case, prompts, _, _ = workload
    llm = _llm(case, "2x4", num_redundant_experts=4, expert_load_window=1, num_scheduler_steps=1)
    out = llm.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    last = hf_choices(case.model, _computed([prompts[1]], out)[0])[:, -1]  # [layers, top_k] of the last position
    ref = np.stack([np.bincount(layer, minlength=case.cfg["n_routed_experts"]) for layer in last])
    np.testing.assert_array_equal(llm.expert_load(), ref)


def _rank_loads(model, seqs) -> np.ndarray:
    """Tokens dispatched to each expert rank (DeepEP rule: once per token and rank) by a forward over the tokens
    of seqs in 8 equal rows (one per DP rank, no padding), summed over MoE layers and DP ranks: int [R]."""
    flat = np.concatenate(seqs)
    ids = flat[: len(flat) // 8 * 8].reshape(8, -1)
    return sum(s.sum(0) for s in tokens_sent(model, ids))


def test_rebalance_keeps_outputs_and_evens_the_expert_ranks(workload):
    case, prompts, params, reference = workload
    llm = _llm(case, "2x4", num_redundant_experts=4)
    before = llm.generate(prompts, params, use_tqdm=False)
    assert _ids(before) == reference
    load = llm.expert_load()
    config, ranks = llm.model.config, 4
    old_phy2log = rebalance.current_phy2log(llm.model.state, config)
    old_logcnt = np.stack([np.bincount(row, minlength=8) for row in old_phy2log])
    sent_before = _rank_loads(llm.model, _computed(prompts, before))

    phy2log, _, logcnt = llm.rebalance_experts()
    np.testing.assert_array_equal(rebalance.current_phy2log(llm.model.state, config), phy2log)
    assert (phy2log != old_phy2log).any()
    for layer, path in enumerate(rebalance.moe_experts_paths(config)):
        state = rebalance.experts_state(llm.model.state, path)
        np.testing.assert_array_equal(np.asarray(state["logcnt"].get_value()), logcnt[layer])
        tables = placement_tables(phy2log[layer], 8, 5)
        np.testing.assert_array_equal(np.asarray(state["log2phy"].get_value()), tables["log2phy"])
    # EPLB's balance model on the measured loads: busiest expert rank / mean, per MoE layer.
    ratio_before = balancedness(load, old_phy2log, old_logcnt, ranks)
    ratio_after = balancedness(load, phy2log, logcnt, ranks)
    print(f"\nmax/mean expert-rank load per layer: before {ratio_before.round(3)}, after {ratio_after.round(3)}")
    assert (ratio_after < ratio_before).all() and ratio_after.max() < 1.1
    # The tokens the MoE really dispatches to each expert rank, over the same sequences.
    sent_after = _rank_loads(llm.model, _computed(prompts, before))
    print(f"tokens received per expert rank: before {sent_before}, after {sent_after}")
    assert sent_after.max() / sent_after.mean() < sent_before.max() / sent_before.mean()

    after = []
    llm.wait_for_compilations()  # the prefill block counts the first calls started compiling in the background
    with CompileCounter() as counter:  # same shapes: the compiled steps are reused
        compiles = counter.measure(lambda: after.extend(llm.generate(prompts, params, use_tqdm=False)))
    assert compiles == 0
    assert _ids(after) == _ids(before)
    np.testing.assert_array_equal(llm.expert_load(), 2 * load)  # logical experts: placement-independent


def test_automatic_rebalancing_between_steps(workload):
    case, prompts, params, reference = workload
    # One decode iteration per step: the workload then runs enough steps for several rebalances.
    llm = _llm(case, "2x4", num_redundant_experts=4, rebalance_every_n_steps=3, num_scheduler_steps=1)
    initial = rebalance.current_phy2log(llm.model.state, llm.model.config)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert _ids(outs) == reference
    assert (rebalance.current_phy2log(llm.model.state, llm.model.config) != initial).any()
    assert llm.stats.steps > 3


def test_single_device(workload):
    """Mesh 1x1 without redundant slots: the same counts; rebalancing only permutes the slots."""
    case, prompts, params, reference = workload
    llm = _llm(case, "1x1")
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert _ids(outs) == reference
    _check_load_equals_transformers(llm, case, prompts, outs)
    phy2log, _, logcnt = llm.rebalance_experts()
    assert (logcnt == 1).all() and (np.sort(phy2log, -1) == np.arange(8)).all()  # no spare slots: a permutation
    assert (phy2log != np.arange(8)).any()
    assert _ids(llm.generate(prompts[:4], params[:4], use_tqdm=False)) == reference[:4]


@pytest.mark.parametrize("bad", [dict(expert_load_window=0), dict(rebalance_every_n_steps=0),
                                 dict(num_redundant_experts=-1)])
def test_invalid_options(workload, bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        _llm(workload[0], "1x1", **bad)


def test_fp8_weights_and_scales_move_with_their_experts():
    """The embedded model kept in FP8 (e4m3 expert weights + block scales, both split over `expert`): logits
    unchanged by a rebalance that moves and replicates experts."""
    import jaxinfer
    from jaxinfer import default_model

    model = jaxinfer.load_model(default_model.path(), mesh="2x4", dtype="float32", keep_fp8=True,
                                num_redundant_experts=4)
    experts = rebalance.experts_state(model.state, rebalance.moe_experts_paths(model.config)[0])
    assert {"gate_proj_scale_inv", "down_proj_scale_inv"} <= set(experts)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (8, 16))
    before = model.logits(ids)
    skewed = np.tile(np.arange(1, 17) ** 3, (model.config.num_moe_layers, 1))  # [L, 16]
    _, _, logcnt = rebalance.rebalance_model(model, skewed)
    assert logcnt[:, -1].min() > 1  # the hottest expert got copies
    assert O.rel_err(model.logits(ids), before) <= 1e-6


def test_cli_writes_expert_load_json(tmp_path, capsys):
    """`jaxinfer generate --expert-load-json` on the embedded model (3 MoE layers x 16 experts, top-2): every
    computed token's choices, per layer."""
    import json

    from jaxinfer.cli import main

    path = tmp_path / "load.json"
    assert main(["generate", "The with statement is used to", "Return a new dictionary", "--max-tokens", "5",
                 "--temperature", "0", "--mesh", "1x1", "--dtype", "float32", "--expert-load-json", str(path)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    written = json.loads(path.read_text())
    load = np.asarray(written["expert_load"])
    computed = sum(line["metrics"]["num_prompt_tokens"] + len(line["token_ids"]) - 1 for line in lines)
    assert written["moe_layers"] == [1, 2, 3] and load.shape == (3, 16)
    np.testing.assert_array_equal(load.sum(1), 2 * computed)
