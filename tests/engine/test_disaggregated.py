"""Prefill/decode disaggregation in one process (engine/disaggregated.py) and the step log (engine/step_log.py):
a prefill engine on a 1x1 mesh hands requests to a decode engine on a 2x2 mesh (expert parallelism 1 and 2; the
prefill engine's programs are the co-located 1x1 engine's, compiled once). Greedy tokens equal transformers'
generate; seeded samples (n > 1, logprobs, stops at and after the first token) equal a co-located 1x1 engine's; the
bytes handed over are the prompts' latents rounded up to pages, counted from the model's shape. (Unseeded samples
are keyed on the engine's sequence ids, which the decode engine takes from the prefill engine; comparing them
would need two engines with the same request history.)"""

import re

import jax
import numpy as np
import hf_oracle
import pytest
import torch
from jax.sharding import Mesh

from jaxinfer.engine.disaggregated import split_meshes
from jaxinfer.engine.llm import LLM
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.engine.step_log import imbalance
from jaxinfer.parallel.mesh import AXES

LENGTHS = (1, 63, 64, 65, 130)  # around the 64-token page, and a prompt chunked over several prefill steps
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
OPTIONS = dict(dtype="float32", num_kv_pages=16, max_num_batched_tokens=96)  # test_llm.py's 1x1 engine's


@pytest.fixture(scope="module")
def case(v3_case):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, v3_case.cfg["vocab_size"], n).tolist() for n in LENGTHS]
    return v3_case, prompts, [hf_oracle.greedy_tokens(v3_case.model, p, GREEDY.max_tokens) for p in prompts]


@pytest.fixture(scope="module")
def pd(case):
    return LLM(case[0].path, prefill_mesh="1x1", decode_mesh="2x2", **OPTIONS)


@pytest.fixture(scope="module")
def colocated(case):
    return LLM(case[0].path, mesh="1x1", **OPTIONS)


def test_tokens_equal_transformers_and_a_colocated_engine(case, pd, colocated):
    """One batch: greedy requests (= transformers' generate) and sampled ones (= the co-located engine's: seeded,
    n > 1, logprobs, ending at the first or the third token)."""
    model_case, prompts, refs = case
    sampled = [SamplingParams(temperature=1.0, seed=11, max_tokens=7, ignore_eos=True),
               SamplingParams(temperature=0.7, top_k=5, max_tokens=6, n=2, logprobs=2, seed=5, ignore_eos=True),
               SamplingParams(temperature=0, max_tokens=1),                              # ends at its first token
               SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[refs[3][2]]),  # stops at its third
               SamplingParams(temperature=1.0, max_tokens=9, n=3, seed=2, ignore_eos=True)]
    params = [GREEDY] * len(prompts) + sampled
    got = pd.generate(prompts + prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got[:len(prompts)]] == refs
    assert got[len(prompts) + 3].outputs[0].token_ids == refs[3][:3]
    want = colocated.generate(prompts + prompts, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert [(c.token_ids, c.finish_reason) for c in g.outputs] == [(c.token_ids, c.finish_reason)
                                                                         for c in w.outputs]
        for cw, cg in zip(w.outputs, g.outputs):
            if cw.logprobs is not None:
                assert [sorted(e) for e in cg.logprobs] == [sorted(e) for e in cw.logprobs]
                np.testing.assert_allclose([v for e in cg.logprobs for v in e.values()],
                                           [v for e in cw.logprobs for v in e.values()], rtol=1e-5, atol=1e-5)
        assert g.metrics["ttft_s"] is not None and g.metrics["num_output_tokens"] == w.metrics["num_output_tokens"]
    # Handed over: every sample's prompt pages, but the request that ended at its first token (it never left the
    # prefill engine). A page: layers x 64 tokens x (kv_lora_rank + qk_rope_head_dim) float32 values.
    cfg = model_case.cfg
    page_bytes = cfg["num_hidden_layers"] * 64 * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4
    handed = sum(p.n * -(-n // 64) for p, n in zip(params, LENGTHS + LENGTHS) if p.max_tokens > 1)
    assert pd.stats.kv_transfer_bytes == handed * page_bytes
    log = pd.stats.step_log
    assert {(r["kind"], r["engine"]) for r in log} == {("prefill", "prefill"), ("decode", "decode")}
    assert [len(r["rank_tokens"]) for r in log] == [1 if r["engine"] == "prefill" else 4 for r in log]
    assert [r["t_dispatch"] for r in log] == sorted(r["t_dispatch"] for r in log)
    assert {r["engine"] for r in colocated.stats.step_log} == {"colocated"}


def test_streamed_deltas_continue_across_the_hand_over(case, pd):
    _, prompts, refs = case
    engine = pd.engine
    for i in (1, 4):
        engine.add_request(f"s{i}", prompts[i], GREEDY, output_kind="delta")
    tokens = {"s1": [], "s4": []}
    finished = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids
            if out.finished:
                finished.add(out.request_id)
    assert finished == {"s1", "s4"} and tokens == {"s1": refs[1], "s4": refs[4]}


def test_abort_on_either_engine_frees_everything(case, pd):
    _, prompts, refs = case
    engine = pd.engine
    for i in (0, 2, 4):
        engine.add_request(f"a{i}", prompts[i], GREEDY, output_kind="final_only")
    engine.abort_request("a4")                           # still on the prefill engine
    while "a0" not in engine.decode.unfinished_request_ids():
        engine.step()
    engine.abort_request("a0")                           # on the decode engine
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [(o.request_id, o.outputs[0].token_ids) for o in outs] == [("a2", refs[2])]
    for sched in (engine.prefill.scheduler, engine.decode.scheduler):
        assert not sched.has_unfinished() and all(sched.held_pages(r) == 0 for r in range(sched.num_ranks))


def test_speculative_and_constrained_requests_across_the_hand_over():
    """The embedded model (it has an MTP module and a tokenizer): with MTP speculative decoding the MTP module's
    pages travel too (a fifth layer) and greedy tokens equal transformers'; the prefill step's drafts travel with
    them, so the decode engine verifies and accepts exactly what a co-located engine does; a regex-constrained
    request's first token is masked by the prefill engine, the rest by the decode engine."""
    import transformers

    from jaxinfer.default_model import path as default_model_path
    from jaxinfer.engine.structured_output import StructuredOutputsParams

    options = dict(dtype="float32", num_kv_pages=16, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    pd = LLM(prefill_mesh="1x1", decode_mesh="1x2", **options)
    prompt, n = pd.tokenizer.encode("def fib(n):"), 12
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=n, structured_outputs=StructuredOutputsParams(
                  regex=r"[0-9]{3}-[a-z]{4}"))]
    got = pd.generate([prompt, prompt], params, use_tqdm=False)
    hf = hf_oracle.cached("default_model:hf", lambda: transformers.AutoModelForCausalLM.from_pretrained(
        str(default_model_path()), dtype=torch.float32, attn_implementation="eager",
        experts_implementation="eager").eval())  # test_llm_engine.py's
    assert got[0].outputs[0].token_ids == hf_oracle.greedy_tokens(hf, prompt, n)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{4}", got[1].outputs[0].text) and got[1].outputs[0].finish_reason == "stop"
    colocated = LLM(mesh="1x1", **options)
    assert [o.outputs[0].token_ids for o in colocated.generate([prompt, prompt], params, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in got]
    drafts = lambda s: (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.accepted_per_position)  # noqa
    assert drafts(pd.stats) == drafts(colocated.stats) and pd.stats.num_draft_tokens > 0
    cfg = pd.model.config  # (layers + the MTP module) x 64 tokens x (kv_lora_rank + qk_rope_head_dim) float32
    page_bytes = (cfg.num_hidden_layers + 1) * 64 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    assert pd.stats.kv_transfer_bytes == 2 * -(-len(prompt) // 64) * page_bytes


def test_step_log_of_a_colocated_engine(colocated):
    llm = colocated
    assert llm.config.num_scheduler_steps == 8   # the CPU's multi-step decode
    prompt = list(range(3, 93))  # 90 tokens: one prefill chunk (max_num_batched_tokens 96), 2 pages
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), use_tqdm=False)
    prefill, decode = llm.stats.step_log
    assert (prefill["kind"], prefill["rank_tokens"], prefill["rank_attention"]) == ("prefill", [90], [90 * 90])
    assert (prefill["rank_kv_pages"], prefill["rank_requests"]) == ([2], [1])
    # One multi-step decode step: 8 tokens from position 90 on, 8 new over 98 keys; 98 tokens fill 2 pages.
    assert (decode["kind"], decode["rank_tokens"], decode["rank_attention"]) == ("decode", [8], [8 * 98])
    assert (decode["rank_kv_pages"], decode["rank_requests"]) == ([2], [1])
    llm.generate([prompt[:5]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert len(llm.stats.step_log) == 1   # each generate call logs its own steps


def test_imbalance_definition():
    log = [dict(kind="prefill", engine="colocated", rank_tokens=[4, 2]),
           dict(kind="prefill", engine="colocated", rank_tokens=[3, 3]),
           dict(kind="decode", engine="colocated", rank_tokens=[1, 0])]
    assert imbalance(log, "rank_tokens", "prefill") == pytest.approx((4 + 3) / (3 + 3))
    assert imbalance(log, "rank_tokens") == pytest.approx((4 + 3 + 1) / (3 + 3 + 0.5))
    assert imbalance(log, "rank_tokens", engine="decode") == 1.0   # no such records: balanced
    with pytest.raises(ValueError, match="field"):
        imbalance(log, "tokens")


def test_bad_meshes():
    with pytest.raises(ValueError, match="go together"):
        LLM(prefill_mesh="1x2")
    with pytest.raises(ValueError, match="each engine has its own mesh"):
        split_meshes("1x1", "1x2", "1x2")
    with pytest.raises(ValueError, match=r"prefill_mesh '4x1' \(4 devices\) and decode_mesh '1x8' \(8\) need 12"):
        split_meshes(None, "4x1", "1x8")
    devices = np.array(jax.devices()[:4])
    with pytest.raises(ValueError, match=r"share devices \[2, 3\]"):
        split_meshes(None, Mesh(devices.reshape(2, 2), AXES), Mesh(devices[2:].reshape(1, 2), AXES))
    prefill, decode = split_meshes(None, "1x3", "2x2")
    assert [d.id for d in prefill.devices.flat] == [0, 1, 2] and [d.id for d in decode.devices.flat] == [3, 4, 5, 6]


def test_a_decode_mesh_whose_expert_axis_does_not_split_the_experts(case):
    with pytest.raises(ValueError, match="decode_mesh '1x3'"):
        LLM(case[0].path, prefill_mesh="1x1", decode_mesh="1x3", dtype="float32", num_kv_pages=4)
