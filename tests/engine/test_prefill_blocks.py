"""Prefill steps laid out in query blocks (EngineConfig.prefill_layout="blocks"): greedy tokens equal transformers'
generate on both attention backends, a workload repeated with prefix hits compiles nothing once the block counts
compiled ahead are ready (jax.monitoring backend-compile events, persistent-cache reads included), and the
scheduler's block accounting."""

import itertools

from compile_counter import CompileCounter
import numpy as np
import pytest
import torch

from jaxinfer.engine.buckets import PREFILL_BLOCK
from jaxinfer.engine.inputs import step_shape
from jaxinfer.engine.llm import LLM
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.sequence import Sequence


def _prompts(vocab, lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def _hf_generate(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_repeated_workload_compiles_nothing_and_matches_transformers(v3_case):
    case = v3_case
    lengths = [150, 3, 64, 90, 1, 120, 65, 40, 260, 7, 129, 33]
    prompts = _prompts(case.cfg["vocab_size"], lengths, seed=11)
    params = [SamplingParams(temperature=0, max_tokens=2 + i % 3, ignore_eos=True) for i in range(len(prompts))]
    # 256 tokens per step (4 blocks): the long prompts are cut at block boundaries over several steps.
    llm = LLM(case.path, mesh="1x1", dtype="float32", num_kv_pages=48, max_num_batched_tokens=256,
              prefill_layout="blocks", compile_ahead=True)
    with CompileCounter() as counter:
        first = counter.measure(lambda: llm.generate(prompts, params, use_tqdm=False))
        llm.engine.runner.wait_for_compilations()
        again = counter.measure(lambda: llm.generate(prompts, params, use_tqdm=False))
    outs = llm.generate(prompts, params, use_tqdm=False)
    print(f"\ncompilations: first run {first} (the block counts compiled ahead included), repeated {again}")
    assert again == 0
    assert sum(o.metrics["num_cached_prompt_tokens"] for o in outs) >= 64 * 9  # prefix hits: other chunks
    refs = [_hf_generate(case.model, p, sp.max_tokens) for p, sp in zip(prompts, params)]
    assert [o.outputs[0].token_ids for o in outs] == refs


def test_pallas_backend_in_query_blocks_matches_transformers(v3_case):
    # The backend that writes the step's latents before attending (mla_decode's XLA implementation on CPU): a
    # block is a row whose length ends at its last column.
    case = v3_case
    prompts = _prompts(case.cfg["vocab_size"], [70, 5, 130], seed=12)
    llm = LLM(case.path, mesh="1x1", dtype="float32", num_kv_pages=16, max_num_batched_tokens=128,
              prefill_layout="blocks", attention_backend="pallas")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [_hf_generate(case.model, p, 3) for p in prompts]


def test_scheduler_fills_whole_blocks_and_the_shape_is_the_block_count():
    q, ids = PREFILL_BLOCK, itertools.count()
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    # (prompt lengths, chunks of the first step, rows of its block layout): 1024 tokens per step = 16 blocks.
    for lengths, chunks, rows in [([5], [5], 1), ([5, 20, 40], [5, 20, 40], 4), ([700, 9], [700, 9], 16),
                                  ([1000, 9, 30], [1000], 16), ([900, 200], [900, 64], 16), ([2000], [1024], 16)]:
        sched = Scheduler(1, 64, max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=4096,
                          enable_prefix_caching=False, prefill_block=q)
        seqs = [sched.add(Sequence(next(ids), [1] * n, greedy)) for n in lengths]
        out = sched.schedule()
        assert [r.num_tokens for r in out.requests[0]] == chunks, lengths
        pages = {s.seq_id: len(s.pages) for s in seqs}
        assert step_shape(out, pages, 16, sched.prefill_capacity, q, 64) == (rows, q, 64), lengths
    with pytest.raises(ValueError, match="prefill_block"):
        Scheduler(1, 64, max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=4096, prefill_block=48)

