"""jaxinfer.LLMEngine (add_request / step / abort_request / has_unfinished_requests) and EngineConfig, on the
embedded default model in float32, against independent references: transformers' greedy generate on the same
checkpoint, and the tokenizer's own decode of the returned tokens.

- requests added while others decode get transformers' tokens; cumulative outputs only ever grow, and each
  request comes back finished exactly once;
- an abort in the middle of decoding frees the request's pages at once and changes no other request's tokens;
- DELTA outputs concatenated, and CUMULATIVE outputs (text held back before stop strings), end where
  LLM.generate ends for the same requests (sampling included: same seeds, same internal ids);
- bad request content comes back as an "error" output; bad arguments raise ValueError;
- EngineConfig carries exactly LLM's options, validated once.
"""

import dataclasses
import inspect
import os

import numpy as np
import pytest
import torch
import transformers

import hf_oracle as O
from jaxinfer import EngineConfig, LLM, LLMEngine, RequestOutputKind, SamplingParams
from jaxinfer.default_model import path as default_model_path

KW = dict(dtype="float32", mesh="1x1", num_kv_pages=16)
PROMPTS = ["The with statement is used to", "Return a new dictionary", "def fib(n):", "class Foo:"]


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(**KW)


def _hf_greedy(ids, n):
    def build():
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(default_model_path()), dtype=torch.float32, attn_implementation="eager",
            experts_implementation="eager").eval()

    model = O.cached("default_model:hf", build)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None)
    return out[0, len(ids):].tolist()


def _run(engine, max_steps=500):
    """Steps until every request is returned finished; {request_id: [its outputs in order]}."""
    seen = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return seen
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    raise AssertionError("requests did not finish")


def _check_cumulative(outs):
    """Each output extends the previous one; the request is finished in the last output only."""
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    for before, after in zip(outs, outs[1:]):
        for b, a in zip(before.outputs, after.outputs):
            assert a.token_ids[:len(b.token_ids)] == b.token_ids and a.text.startswith(b.text)


def test_interleaved_add_request_and_step_match_transformers(engine):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], greedy)
    outputs = {}
    for _ in range(2):  # "a" is prefilled and decodes while "b" arrives
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    engine.add_request("b", PROMPTS[1], greedy)
    assert engine.has_unfinished_requests()
    for rid, outs in _run(engine).items():
        outputs.setdefault(rid, []).extend(outs)
    assert sorted(outputs) == ["a", "b"] and engine.step() == [] and not engine.has_unfinished_requests()
    for rid, prompt in zip("ab", PROMPTS):
        outs = outputs[rid]
        _check_cumulative(outs)
        final = outs[-1]
        ids = engine.tokenizer.encode(prompt)
        assert final.prompt_token_ids == ids and final.prompt == prompt
        assert final.outputs[0].token_ids == _hf_greedy(ids, 12)
        assert final.outputs[0].text == engine.tokenizer.decode(final.outputs[0].token_ids)
        assert final.outputs[0].finish_reason == "length"
        m = final.metrics
        assert m["num_output_tokens"] == 12 and m["num_prompt_tokens"] == len(ids) and 0 < m["ttft_s"]
        assert m["tpot_s"] > 0
        assert outs[0].metrics["ttft_s"] is not None or outs[0].outputs[0].token_ids == []
    engine.add_request("a", PROMPTS[2], greedy)  # a finished id may be used again
    _run(engine)


def test_abort_mid_decode_frees_pages_and_leaves_others_unchanged(engine):
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for rid, prompt in zip("xyz", PROMPTS):
        engine.add_request(rid, prompt, greedy)
    progressed = set()
    while "y" not in progressed:  # until "y" has tokens: it is decoding
        progressed |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
    seq_y = next(s for s in engine.scheduler.running[0] if s.prompt_token_ids == engine.tokenizer.encode(PROMPTS[1]))
    assert seq_y.pages
    held = engine.scheduler.caches[0].allocator.refcount
    own = [p for p in seq_y.pages if held(p) == 1]  # pages only "y" holds (not shared with the prefix cache)
    engine.abort_request(["y", "unknown id"])
    assert seq_y.is_finished and seq_y.finish_reason == "abort" and seq_y.pages == []
    assert all(held(p) == 0 for p in own)  # freed at once, not when the step in flight comes back
    engine.abort_request("y")  # again: ignored
    outputs = _run(engine)
    assert "y" not in outputs  # nothing after the abort
    for rid, prompt in zip("xz", [PROMPTS[0], PROMPTS[2]]):
        ids = engine.tokenizer.encode(prompt)
        assert outputs[rid][-1].outputs[0].token_ids == _hf_greedy(ids, 10)


def test_step_outputs_accumulate_to_what_generate_returns():
    """Fresh engines, the same requests in the same order: DELTA pieces concatenated and the CUMULATIVE outputs
    end at LLM.generate's outputs, for seeded and unseeded sampling, n = 2, logprobs and stop strings (whose text
    is held back while the request runs: no intermediate text shows what the stop string later cuts)."""
    params = [SamplingParams(temperature=0.8, seed=7, max_tokens=20, logprobs=2),
              SamplingParams(temperature=1.0, n=2, max_tokens=14),
              SamplingParams(temperature=0, max_tokens=24, stop=["\n\n", "the"]),
              SamplingParams(temperature=0, max_tokens=24, stop=["()"], ignore_eos=True)]
    reference = LLM(**KW).generate(PROMPTS, params, use_tqdm=False)
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        engine = LLMEngine(**KW)
        for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
            engine.add_request(str(i), prompt, p, output_kind=kind)
        outputs = _run(engine)
        for i, ref in enumerate(reference):
            outs = outputs[str(i)]
            assert [o.finished for o in outs][-1] and sum(o.finished for o in outs) == 1
            for j, ref_c in enumerate(ref.outputs):
                if kind is RequestOutputKind.DELTA:
                    tokens = [t for o in outs for t in o.outputs[j].token_ids]
                    text = "".join(o.outputs[j].text for o in outs)
                    logprobs = None if ref_c.logprobs is None else [x for o in outs for x in o.outputs[j].logprobs]
                else:
                    _check_cumulative(outs)
                    tokens, text, logprobs = (outs[-1].outputs[j].token_ids, outs[-1].outputs[j].text,
                                              outs[-1].outputs[j].logprobs)
                    assert all(ref_c.text.startswith(o.outputs[j].text) for o in outs)  # nothing later cut
                assert (tokens, text, logprobs) == (ref_c.token_ids, ref_c.text, ref_c.logprobs)
                assert outs[-1].outputs[j].finish_reason == ref_c.finish_reason
    assert reference[2].outputs[0].finish_reason == "stop" or reference[3].outputs[0].finish_reason == "stop"


def test_stop_strings_end_the_tokens_where_one_token_per_step_would(engine):
    """A decode step of several iterations (LLM's CPU default) brings several tokens at once: a stop string
    completed by one of them ends the output's tokens at that token, as steps of one token would (transformers'
    greedy tokens up to the first whose decoded prefix contains the stop string), its logprobs with them, and
    its text before the stop string."""
    ids = engine.tokenizer.encode(PROMPTS[0])
    ref = _hf_greedy(ids, 24)
    stop = engine.tokenizer.decode(ref[9:11])  # completed inside the second decode step (outputs 9-16)
    n = next(j + 1 for j in range(len(ref)) if stop in engine.tokenizer.decode(ref[:j + 1]))
    engine.add_request("s", PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                       logprobs=0))
    out = _run(engine)["s"][-1].outputs[0]
    assert n < 24 and out.finish_reason == "stop"
    assert out.token_ids == ref[:n] and len(out.logprobs) == n
    text = engine.tokenizer.decode(ref)
    assert out.text == text[:text.index(stop)]


def test_request_errors(engine):
    with pytest.raises(ValueError, match="request_id must be a str"):
        engine.add_request(3, [1, 2])
    with pytest.raises(ValueError, match="sampling_params must be SamplingParams"):
        engine.add_request("p", [1, 2], {"max_tokens": 3})
    with pytest.raises(ValueError, match="output_kind must be one of"):
        engine.add_request("p", [1, 2], output_kind="streaming")
    with pytest.raises(ValueError, match="prompt must be a str or a list of token ids"):
        engine.add_request("p", [[1, 2]])
    for bad in ({"prompt": "text only"}, {"prompt_token_ids": [1], "extra": 1}):
        with pytest.raises(ValueError, match="a dict prompt has 'prompt_token_ids' and optionally 'prompt'"):
            engine.add_request("p", bad)
    with pytest.raises(ValueError, match=r"prompt\['prompt'\] must be a str"):
        engine.add_request("p", {"prompt_token_ids": [1], "prompt": 3})
    vocab = engine.model.config.vocab_size
    engine.add_request("ok", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3))
    with pytest.raises(ValueError, match="unfinished request"):
        engine.add_request("ok", [5, 6, 7])
    engine.add_request("empty", [])
    engine.add_request("vocab", [1, vocab], SamplingParams(n=2))
    engine.add_request("negative", [1, -1])  # ids the tokenizer cannot even decode (it takes u32)
    engine.add_request("huge", [2**40])
    engine.add_request("logprobs", [1], SamplingParams(logprobs=engine.config.max_logprobs + 1))
    engine.add_request("long", [1] * (engine.config.max_model_len + 1))
    first = {o.request_id: o for o in engine.step()}
    assert {"empty", "vocab", "negative", "huge", "logprobs", "long"} <= set(first)  # errors: with the next step
    for rid, what in [("empty", "empty prompt"), ("vocab", f"token id {vocab}"), ("negative", "token id -1"),
                      ("huge", f"token id {2**40}"), ("logprobs", "max_logprobs"), ("long", "max_model_len")]:
        out = first[rid]
        assert out.finished and all(c.finish_reason == "error" and what in c.error for c in out.outputs)
        assert out.metrics["ttft_s"] is None and out.metrics["num_output_tokens"] == 0
    assert len(first["vocab"].outputs) == 2
    final = _run(engine)["ok"][-1]
    assert final.outputs[0].finish_reason == "length" and len(final.outputs[0].token_ids) == 3


def test_engine_config_is_llm_options():
    """EngineConfig's fields are LLM's options with LLM's documented defaults; invalid values raise ValueError
    naming the field; the resolved config fills the platform's defaults."""
    fields = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    documented = dict(model=None, mesh=None, dtype=None, num_kv_pages=None, max_num_seqs=64,
                      max_num_batched_tokens=2048, max_model_len=None, enable_prefix_caching=True, fp8_compute=None,
                      seed=0, max_logprobs=20, num_redundant_experts=None, expert_load_window=1000,
                      rebalance_every_n_steps=None, num_scheduler_steps=None, greedy_screening=None,
                      compilation_cache=None, attention_backend=None, moe_path=None, speculative_config=None,
                      prefill_layout="blocks", compile_ahead=None, kv_cache_dir=None, kv_cache_max_bytes=None,
                      async_scheduling=True)
    assert fields == documented
    assert list(inspect.signature(LLM).parameters)[:3] == ["model", "mesh", "dtype"]
    for name, bad in [("max_num_seqs", 0), ("num_kv_pages", 1), ("max_logprobs", -1), ("num_scheduler_steps", 2.0),
                      ("expert_load_window", True), ("enable_prefix_caching", None), ("greedy_screening", "yes"),
                      ("dtype", "float16"), ("attention_backend", "triton"), ("moe_path", "tiled"),
                      ("compilation_cache", ""), ("prefill_layout", "ragged"), ("compile_ahead", 1),
                      ("num_redundant_experts", -1), ("rebalance_every_n_steps", 0), ("seed", 1.5),
                      ("speculative_config", {"method": "mtp"}), ("speculative_config", "mtp"),
                      ("kv_cache_dir", ""), ("kv_cache_dir", 3), ("kv_cache_max_bytes", 10 ** 9),
                      ("async_scheduling", None)]:
        with pytest.raises(ValueError, match=name):
            EngineConfig(**{name: bad})
        with pytest.raises(ValueError, match=name):
            LLM(**{name: bad})
    with pytest.raises(TypeError):
        EngineConfig(num_kv_page=8)
    for build, name, meant in [(LLM, "max_num_batch_tokens", "max_num_batched_tokens"),
                               (LLM, "prefil_mesh", "prefill_mesh"), (LLMEngine, "num_kv_page", "num_kv_pages")]:
        with pytest.raises(TypeError, match=f"unknown option '{name}' \\(did you mean '{meant}'\\?\\)"):
            build(**{name: 8})
    with pytest.raises(TypeError, match="unknown option 'colour'; the engine options are EngineConfig's fields"):
        LLM(colour=1)
    config = EngineConfig(**KW)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 1
    engine = LLMEngine.from_config(config)
    resolved = engine.config
    assert resolved.num_kv_pages == 16 and resolved.num_scheduler_steps == 8 and resolved.greedy_screening
    assert resolved.attention_backend == "xla" and resolved.model == str(default_model_path())
    assert resolved.max_model_len == engine.model.config.max_position_embeddings
    assert resolved.compile_ahead is (os.environ.get("JAXINFER_COMPILE_AHEAD", "1") != "0")  # conftest: "0"
    assert np.dtype(engine.model.dtype) == np.float32
