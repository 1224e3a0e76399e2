"""Engine properties of jaxinfer.LLM on a random tiny V3 model in float32, against independent references:
transformers' generate and logits, and each prompt generated alone.

- batch invariance under a page budget that forces preemption and chunked prefill;
- prefix caching: same outputs, and the prefill tokens computed drop by the cached part;
- bounded compilation, counted with jax.monitoring backend-compile events (reads from the persistent
  compilation cache count too, so a warm cache cannot hide one);
- logprobs equal transformers' log-softmax; stop_token_ids, repetition penalty (the engine's synchronous path)
  equal transformers' generate.
"""

import itertools
import shutil

import hf_oracle as O
from compile_counter import CompileCounter
import jax
import numpy as np
import pytest
import torch

from jaxinfer.engine.inputs import DEVICE_STOP_IDS, step_shape
from jaxinfer.engine.llm import LLM
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.sequence import Sequence

@pytest.fixture(scope="module")
def case(v3_case):
    return v3_case


def _prompts(vocab, lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def _hf_generate(model, prompt, n, **kw):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, **kw)
    return out[0, len(prompt):].tolist()


def test_batch_invariance_under_preemption_and_chunked_prefill(case):
    lengths = [150, 3, 64, 90, 1, 120, 65, 40, 100, 7]
    prompts = _prompts(case.cfg["vocab_size"], lengths, seed=1)
    params = [SamplingParams(temperature=0, max_tokens=6 + i % 5, ignore_eos=True) for i in range(len(prompts))]
    # 8 pages per rank (7 usable = 448 tokens) for ~1000 tokens of requests; 48-token prefill chunks.
    tight = LLM(case.path, mesh="1x1", dtype="float32", num_kv_pages=8, max_num_batched_tokens=48,
                max_num_seqs=8)
    together = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.stats.preemptions > 0
    roomy = LLM(case.path, mesh="1x1", dtype="float32", num_kv_pages=16)  # = the other tests' engine: shared programs
    alone = [roomy.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    assert together == alone


@pytest.mark.parametrize("moe_path", [None, "gather", "dense", "capacity", "grouped", "ragged"])
def test_every_moe_path_generates_transformers_greedy_tokens(case, moe_path):
    # The routed experts forced onto each path (None: the cost model's choice per step shape) through prefill and
    # decode steps of 3 sequences: the same greedy tokens as transformers'.
    prompts = _prompts(case.cfg["vocab_size"], [9, 70, 2], seed=5)
    llm = LLM(case.path, mesh="1x1", dtype="float32", num_kv_pages=16, moe_path=moe_path)
    got = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)]
    assert got == [_hf_generate(case.model, p, 5) for p in prompts]


def test_a_model_without_moe_layers_generates_transformers_greedy_tokens(tmp_path_factory):
    # Every layer dense (first_k_dense_replace = num_hidden_layers): the expert-load arrays are empty, [ranks, 0, E],
    # and XLA gives an empty step output no sharding; on a 1x2 mesh the step programs compiled ahead (prefill in
    # blocks, prompts in 48-token chunks) refused the next step's load total before the fix.
    base = O.CONFIGS["v3_noqlora_default"]
    cfg = dict(base, first_k_dense_replace=base["num_hidden_layers"])
    model = O.build_hf_model(cfg, seed=7)
    path = O.save_checkpoint(model, tmp_path_factory.mktemp("all_dense"))
    prompts = _prompts(cfg["vocab_size"], [89, 67, 2], seed=6)
    llm = LLM(path, mesh="1x2", dtype="float32", num_kv_pages=16, max_num_batched_tokens=48, prefill_layout="blocks")
    got = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)]
    assert got == [_hf_generate(model, p, 4) for p in prompts]
    assert llm.expert_load().shape == (0, cfg["n_routed_experts"])
    # Nothing for EPLB to place: said at once, not at the first rebalance in the middle of a generate.
    with pytest.raises(ValueError, match="no MoE layers, so no experts to rebalance"):
        LLM(path, mesh="1x2", dtype="float32", num_kv_pages=16, rebalance_every_n_steps=2)
    with pytest.raises(ValueError, match="num_redundant_experts=2: the model has no MoE layers"):
        LLM(path, mesh="1x2", dtype="float32", num_kv_pages=16, num_redundant_experts=2)
    with pytest.raises(ValueError, match="there are no experts to rebalance"):
        llm.rebalance_experts()


def test_one_routed_expert_and_a_vocabulary_of_three(tmp_path_factory):
    # The smallest shapes the config accepts. One routed expert (n_group 1: DeepSeek's Gate skips group scores, the
    # top-2 of a one-expert group does not exist) is what a two-expert transformers model computes when its second
    # expert is never chosen (router bias -1e4; top-1 weights normalised to 1 either way): the checkpoint drops it.
    # Three tokens are fewer than the 20 logprobs the engine ranks by default and than the 5 a request asks for.
    base = O.CONFIGS["v3_noqlora_default"]
    cfg = dict(base, vocab_size=3, n_routed_experts=2, num_experts_per_tok=1, norm_topk_prob=True)
    model = O.build_hf_model(cfg, seed=8)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.e_score_correction_bias[1] = -1e4
    path = O.save_checkpoint(model, tmp_path_factory.mktemp("one_expert"))
    tensors = {k: v for k, v in O.read_tensors(path).items() if ".experts.1." not in k}
    for k in [k for k in tensors if k.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias"))]:
        tensors[k] = tensors[k][:1].clone()
    O.write_tensors(path, tensors)
    O.write_config(path, dict(O.read_config(path), n_routed_experts=1))
    prompts = _prompts(3, [9, 70], seed=9)
    llm = LLM(path, mesh="1x1", dtype="float32", num_kv_pages=16)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=5),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _hf_generate(model, p, 5)
        ref = torch.log_softmax(torch.as_tensor(O.reference_logits(model, [p + o.outputs[0].token_ids])[0]), -1)
        for t, entry in enumerate(o.outputs[0].logprobs):
            assert sorted(entry) == [0, 1, 2]
            np.testing.assert_allclose([entry[v] for v in range(3)], ref[len(p) - 1 + t].numpy(), atol=1e-4)


def test_moe_path_must_be_a_known_path(case):
    with pytest.raises(ValueError, match="moe_path must be None or one of"):
        LLM(case.path, mesh="1x1", moe_path="tiled")


def test_prefix_caching_same_outputs_fewer_prefill_tokens(case):
    vocab = case.cfg["vocab_size"]
    shared = _prompts(vocab, [130], seed=2)[0]   # two full pages of 64 are shared
    suffixes = _prompts(vocab, [5, 20, 1], seed=3)
    prompts = [shared + s for s in suffixes]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    results = {}
    for caching in (False, True):
        llm = LLM(case.path, mesh="1x1", dtype="float32", num_kv_pages=16, enable_prefix_caching=caching)
        first = llm.generate([prompts[0]], greedy, use_tqdm=False)
        rest = llm.generate(prompts[1:], greedy, use_tqdm=False)
        results[caching] = ([o.outputs[0].token_ids for o in first + rest], llm.stats.prefill_tokens,
                            [o.metrics["num_cached_prompt_tokens"] for o in rest])
    (plain, plain_prefill, plain_cached), (cached, cached_prefill, cached_cached) = results[False], results[True]
    assert cached == plain
    assert plain_cached == [0, 0] and cached_cached == [128, 128]
    assert plain_prefill - cached_prefill == 2 * 128
    print(f"\nprefill tokens computed for the second call: {plain_prefill} without prefix caching, "
          f"{cached_prefill} with it")


def test_prefill_grid_is_no_larger_than_its_chunks_need(case):
    """A prefill step's [rows, T] grid: powers of two >= the chunk count and the longest chunk (T >= 16), not the
    whole max_num_batched_tokens (1024 here): one short prompt must not cost a full 1024-token step. The engine's
    own scheduler and runner plan the first step of each batch (nothing runs: no compilation)."""
    llm = LLM(case.path, mesh="1x1", dtype="float32", num_kv_pages=16, max_num_batched_tokens=1024)
    inputs = llm.runner.inputs
    assert inputs.prefill_capacity == 1024
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    ids = itertools.count()
    # [700, 9]: a 1024-column row leaves no room for a second one, the 9 tokens wait; [2000]: a 1024-token chunk.
    for lengths, grid in [([5], (1, 16)), ([5, 20, 40], (4, 64)), ([100, 3], (2, 128)), ([300, 9], (2, 512)),
                          ([700, 9], (1, 1024)), ([2000], (1, 1024))]:
        sched = Scheduler(1, 64, max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=4096,
                          enable_prefix_caching=False)
        seqs = [sched.add(Sequence(next(ids), prompt, greedy))
                for prompt in _prompts(case.cfg["vocab_size"], lengths, seed=6)]
        out = sched.schedule()
        pages = {s.seq_id: len(s.pages) for s in seqs}
        assert out.kind == "prefill", lengths
        assert step_shape(out, pages, inputs.min_prefill_t, inputs.prefill_capacity)[:2] == grid, lengths


def test_bounded_compilation(case):
    rng = np.random.default_rng(4)
    vocab = case.cfg["vocab_size"]
    prompts = [rng.integers(0, vocab, n).tolist() for n in rng.integers(1, 401, 40)]
    params = [SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True) for m in rng.integers(1, 41, 40)]
    # Prefix caching off: with it, the rerun's prompts are cached and its prefill chunks are a different workload.
    llm = LLM(case.path, mesh="1x1", dtype="float32", num_kv_pages=320, enable_prefix_caching=False)
    with CompileCounter() as counter:
        warmup = counter.measure(lambda: llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False))
        first = counter.measure(lambda: llm.generate(prompts, params, use_tqdm=False))
        first += counter.measure(llm.wait_for_compilations)  # the prefill block counts compiled in the background
        again = counter.measure(lambda: llm.generate(prompts, params, use_tqdm=False))
    print(f"\ncompilations: warm-up {warmup}, 40-request workload {first}, rerun {again}")
    assert first <= 16 and again == 0


def test_logprobs_stop_tokens_and_repetition_penalty_match_transformers(case):
    vocab = case.cfg["vocab_size"]
    prompt = _prompts(vocab, [37], seed=5)[0]
    llm = LLM(case.path, mesh="1x1", dtype="float32", num_kv_pages=16)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    ref = _hf_generate(case.model, prompt, 6)
    assert out.token_ids == ref
    ref_logprobs = torch.log_softmax(torch.tensor(O.reference_logits(case.model, np.array([prompt + ref]))),
                                     -1)[0, len(prompt) - 1:-1].numpy()  # [6, V]: position t predicts token t+1
    assert len(out.logprobs) == 6
    for step, entry in enumerate(out.logprobs):
        top = np.argsort(-ref_logprobs[step])[:3].tolist()
        assert set(entry) == set(top) | {ref[step]}
        for token, value in entry.items():
            assert abs(value - ref_logprobs[step, token]) < 1e-4

    stop_at = 3
    stop = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[ref[stop_at]]),
                        use_tqdm=False)[0].outputs[0]
    first = ref.index(ref[stop_at])
    assert stop.token_ids == ref[:first + 1] and stop.finish_reason == "stop"

    penalised = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                      repetition_penalty=1.5), use_tqdm=False)[0].outputs[0]
    assert penalised.token_ids == _hf_generate(case.model, prompt, 6, repetition_penalty=1.5)


@pytest.mark.parametrize("bad", [0, -2, 2.0])
def test_num_scheduler_steps_must_be_a_positive_integer(case, bad):
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        LLM(case.path, mesh="1x1", dtype="float32", num_kv_pages=16, num_scheduler_steps=bad)


def _outputs(llm, prompts, params):
    return [[(c.token_ids, c.finish_reason, c.logprobs) for c in o.outputs]
            for o in llm.generate(prompts, params, use_tqdm=False)]


def test_multi_step_decode_equals_single_step(case):
    """num_scheduler_steps = 4 against 1 iteration per step: the same tokens, finish reasons and logprobs for greedy,
    seeded random sampling, penalties (counted on device inside the step), n > 1, a stop token inside a step,
    max_tokens and a max_model_len that are not multiples of 4, and prompts of 1-130 tokens; on both step
    structures (latents written after the step: the XLA attention backend; inside it: the Pallas backend's, whose
    mla_decode runs its XLA implementation on CPU)."""
    vocab = case.cfg["vocab_size"]
    prompts = _prompts(vocab, [1, 63, 64, 65, 130, 7, 20], seed=6)
    params = [SamplingParams(temperature=0, max_tokens=11, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, presence_penalty=0.5,
                             frequency_penalty=0.3, repetition_penalty=1.2),
              SamplingParams(temperature=1.0, n=2, seed=5, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)]
    kw = dict(mesh="1x1", dtype="float32", num_kv_pages=16, max_model_len=45)  # the last prompt stops at 45
    one = LLM(case.path, num_scheduler_steps=1, **kw)
    ref = _outputs(one, prompts, params)
    steps_one = one.stats.steps
    greedy = ref[5][0][0]
    params[5] = SamplingParams(temperature=0, max_tokens=13, stop_token_ids=[greedy[6]])  # stops inside a step
    ref[5] = _outputs(one, [prompts[5]], [params[5]])[0]
    assert ref[5][0][1] == "stop" and ref[6][0][1] == "length" and len(ref[6][0][0]) == 45 - 20
    for backend in ("xla", "pallas"):
        four = LLM(case.path, num_scheduler_steps=4, attention_backend=backend, **kw)
        assert four.runner.backend.writes_in_step == (backend == "pallas")
        got = _outputs(four, prompts[:5] + [prompts[6]], params[:5] + [params[6]])
        assert four.stats.steps < steps_one
        got.insert(5, _outputs(four, [prompts[5]], [params[5]])[0])
        assert got == ref, backend


def test_multi_step_decode_stops_on_device_like_the_host(case, tmp_path):
    """A multi-step decode step stops iterating once every row has sampled a stop token, and a row whose input
    token (sampled by the previous step, not yet seen by the host) is a stop token computes nothing. Outputs
    equal 1 iteration per step (where the host alone decides) for: EOS inside a step and at a step's last
    iteration (the next step, dispatched before the host saw it, then starts with every row stopped), EOS as
    the first token (sampled by the prefill), ignore_eos (EOS must not stop on device), more stop_token_ids
    than the device checks, with the stopping one past them, and rows that stop while others go on."""
    vocab = case.cfg["vocab_size"]
    prompt, other = _prompts(vocab, [20, 33], seed=11)
    kw = dict(mesh="1x1", dtype="float32", num_kv_pages=16)
    free = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    greedy = LLM(case.path, num_scheduler_steps=1, **kw).generate([prompt], free, use_tqdm=False)
    greedy = greedy[0].outputs[0].token_ids
    path = tmp_path / "ckpt"
    shutil.copytree(case.path, path)
    results = {}
    for eos_index in (0, 4, 5):  # token 0 comes from the prefill; decode steps of 4 cover 1-4, 5-8, ...
        eos = greedy[eos_index]
        cfg = O.read_config(path)
        cfg["eos_token_id"] = eos
        O.write_config(path, cfg)
        stop = greedy.index(eos)  # the first time the model samples it
        fillers = [t for t in range(vocab) if t not in greedy][:DEVICE_STOP_IDS]
        params = [SamplingParams(temperature=0, max_tokens=14),
                  SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
                  SamplingParams(temperature=0, max_tokens=14, ignore_eos=True,
                                 stop_token_ids=fillers + [greedy[7]]),
                  SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)]
        prompts = [prompt, prompt, prompt, other]
        for k in (1, 4):
            llm = LLM(path, num_scheduler_steps=k, **kw)
            assert llm.runner.inputs.eos_token_id == eos
            alone = _outputs(llm, [prompt], [params[0]])  # every row stops: the loop ends early
            together = _outputs(llm, prompts, params)
            results[eos_index, k] = (alone, together)
        assert results[eos_index, 4] == results[eos_index, 1], eos_index
        alone, together = results[eos_index, 1]
        assert alone[0][0] == (greedy[: stop + 1], "stop", None)
        assert together[1][0][:2] == (greedy, "length")
        assert together[2][0][:2] == (greedy[:8], "stop")
