"""jaxinfer.LLM end to end: greedy tokens equal transformers' generate (its own cache, eos_token_id=None), alone
and batched, on one device and with 8 DP ranks, prefill steps as grids and in query blocks; bad requests come back
as errors while the others finish."""

import numpy as np
import pytest
import torch

from jaxinfer.engine.llm import LLM
from jaxinfer.engine.sampling_params import SamplingParams

LENGTHS = (1, 63, 64, 65, 130)  # around the 64-token page, and a prompt chunked over several prefill steps
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _reference(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def case(v3_case):
    case = v3_case
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, case.cfg["vocab_size"], n).tolist() for n in LENGTHS]
    return case, prompts, [_reference(case.model, p, GREEDY.max_tokens) for p in prompts]


@pytest.mark.parametrize("mesh,layout", [("1x1", "grid"), ("2x4", "grid"), ("1x1", "blocks"), ("2x4", "blocks")])
def test_greedy_matches_transformers_generate(case, mesh, layout):
    model_case, prompts, refs = case
    llm = LLM(model_case.path, mesh=mesh, dtype="float32", num_kv_pages=16, max_num_batched_tokens=96,
              prefill_layout=layout)
    together = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] == refs
    assert all(o.outputs[0].finish_reason == "length" for o in together)
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[:2]]
    assert alone == refs[:2]


def test_prefill_limits_cut_a_long_prompt_and_keep_its_greedy_tokens(case):
    """8 DP ranks, prefill in blocks of 64, 96 tokens per step: a 200-token prompt alone on its rank (the others
    short) takes 96, 96, 8 tokens as it comes, in steps whose shapes hold 2, 2 and 1 blocks per rank
    (engine/prefill_plan.py). Within them, the least attention cap (new x total) with the full quota is 10240: 96
    (9216), then 64 cut to whole blocks (64 x 160), then 40 (8000); 96 x 192 would be 18432. The least token quota q
    under that cap: a first chunk of q, then 64 (q + q needs 2q^2 <= 10240, leaving over 51 for the last step,
    whose 200 keys allow 51), then 136 - q <= 51: q = 85, chunks 85, 64, 51 (7225, 9536, 10200). Greedy tokens
    still equal transformers'."""
    model_case = case[0]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, model_case.cfg["vocab_size"], n).tolist() for n in (200, 10, 12, 14, 16, 18, 20, 22)]
    llm = LLM(model_case.path, mesh="2x4", dtype="float32", num_kv_pages=16, max_num_batched_tokens=96,
              prefill_layout="blocks")
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [_reference(model_case.model, p, GREEDY.max_tokens)
                                                      for p in prompts]
    prefill = [r["rank_tokens"] for r in llm.stats.step_log if r["kind"] == "prefill"]
    assert sorted(zip(*prefill))[-1] == (85, 64, 51)


def test_bad_requests_do_not_stop_the_others(case):
    model_case, prompts, refs = case
    llm = LLM(model_case.path, mesh="1x1", dtype="float32", num_kv_pages=16)
    vocab = model_case.cfg["vocab_size"]
    outs = llm.generate([prompts[0], [], [vocab + 5], prompts[1]], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == refs[0] and outs[3].outputs[0].token_ids == refs[1]
    for bad in outs[1:3]:
        assert bad.outputs[0].finish_reason == "error" and bad.outputs[0].error
