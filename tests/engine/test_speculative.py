"""MTP speculative decoding in the engine (engine/drafter.py, engine/rejection_sampler.py): greedy outputs with
speculation are greedy decoding's, token for token (float32), whatever the drafts are worth; every round's first
draft is the MTP module's argmax; bad settings raise ValueError.

Oracle: the cache-free forward (``Model.logits``, ``Model.mtp_logits``) over each final sequence: greedy decoding
without speculation is exactly the chain of its argmaxes, so one forward checks every token. Compiling the
engine's steps is most of the cost: one batch of prompts and one speculative engine are shared by the tests, and
the checks on stops and lengths derive their expected outputs from the checked greedy tokens.
"""

import dataclasses

import jax
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.speculative import (STEP_COSTS, SpeculativeConfig, StepCost, step_cost, survival,
                                         verify_width, widths)

# Few pages: sequences of 160-163 prompt tokens sharing their first page grow from 3 to 4 pages of 64 while they
# decode; a rank has 6 (5 usable), so two growing sequences preempt each other. Block tables stay in the 4-page
# bucket and steps have at most 2 rows: few step shapes to compile.
KW = dict(dtype="float32", num_kv_pages=6, max_num_seqs=2, mesh="1x1")
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
POSITIONS_ONLY = StepCost(knee=8, fixed=0, mtp=0)  # a step costs knee + its positions; drafting is free


def spec(k: int = 3, verify: str = "all") -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, "verify": verify}


def prompts(n: int = 4, length: int = 160, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(2, 4096, 66).tolist()  # one full page shared by all: the prefix cache serves it
    return [shared + rng.integers(2, 4096, length - 66 + i).tolist() for i in range(n)]


BATCH = prompts()


def token_ids(outs) -> list[list[int]]:
    return [list(c.token_ids) for o in outs for c in o.outputs]


@pytest.fixture(scope="module")
def speculative():
    """K = 3 drafts, recording the drafts every step proposed for a running sequence: (its tokens up to the
    step's last, the drafts, their probabilities) in ``llm.drafts`` (a later step in flight verifies them on
    device: its placeholders are not the sequence's tokens yet)."""
    llm = LLM(**KW, speculative_config=spec(3))
    scheduler, llm.drafts = llm.engine.scheduler, []
    update = scheduler.update_from_output

    def recording(output, result):
        updates = update(output, result)
        for u in updates:
            drafts, seq = result.draft_token_ids.get(u.seq.seq_id), u.seq
            if drafts and not seq.is_finished:
                known = seq.output_token_ids[:seq.num_output_tokens - seq.num_placeholders]
                llm.drafts.append((tuple(seq.prompt_token_ids + known), tuple(drafts),
                                   tuple(result.draft_probs[seq.seq_id])))
        return updates

    scheduler.update_from_output = recording
    return llm


@pytest.fixture(scope="module")
def greedy(speculative):
    """BATCH decoded greedily with K = 3 drafts: (outputs, the call's stats, the drafts it recorded, float64
    cache-free logits [B, T, V] of each final sequence (right-padded), the MTP module's cache-free logits)."""
    speculative.drafts.clear()
    outs = speculative.generate(BATCH, GREEDY, use_tqdm=False)
    stats, drafts = speculative.stats, list(speculative.drafts)
    final = [p + c for p, c in zip(BATCH, token_ids(outs))]
    width = max(map(len, final))
    seqs = np.array([s + [0] * (width - len(s)) for s in final])  # right padding: causal rows are unaffected
    nxt = np.concatenate([seqs[:, 1:], seqs[:, -1:]], axis=1)
    model = speculative.engine.model
    return outs, stats, drafts, model.logits(seqs), model.mtp_logits(seqs, nxt)


def test_greedy_is_the_argmax_chain_under_preemption_and_prefix_caching(speculative, greedy):
    """K = 3 drafts, four sequences on too few pages (preempted and recomputed) sharing a cached prefix page:
    every output token is the argmax of the cache-free forward (``Model.logits``, checked against transformers
    in tests/models) over the tokens before it, i.e. exactly greedy decoding without speculation; drafts are
    verified and some accepted; the counters add up; a second call served from the prefix cache agrees."""
    outs, stats, _, logits, _ = greedy
    for i, (prompt, got) in enumerate(zip(BATCH, token_ids(outs))):
        assert len(got) == GREEDY.max_tokens
        want = logits[i, len(prompt) - 1:len(prompt) - 1 + len(got)].argmax(-1)
        assert got == want.tolist(), i
    assert stats.preemptions > 0
    assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_draft_tokens == sum(o.metrics["num_draft_tokens"] for o in outs)
    assert stats.num_accepted_tokens == sum(o.metrics["num_accepted_tokens"] for o in outs)
    assert isinstance(stats.accepted_per_position, list) and len(stats.accepted_per_position) == 3
    assert stats.accepted_per_position[0] >= stats.accepted_per_position[1]
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    assert stats.mean_acceptance_length == pytest.approx(1 + stats.num_accepted_tokens / stats.num_drafts)
    again = speculative.generate(BATCH[:1], GREEDY, use_tqdm=False)  # its pages are cached now
    assert again[0].metrics["num_cached_prompt_tokens"] >= 64
    assert token_ids(again) == token_ids(outs)[:1]


def test_first_drafts_are_the_mtp_modules(greedy):
    """Every stored draft 1 (after prefills, recomputed prefills and verifications) is the argmax of the MTP
    module at the sequence's second-to-last token, computed by the cache-free ``Model.mtp_logits`` over the final
    sequence (true hidden states, true next tokens), and its probability is that logit's softmax. A step runs up to 8
    rounds on device (LLM's default num_scheduler_steps on CPU), so these are each step's last round's drafts; the
    drafts of its earlier rounds are checked against one-round steps' by the next test."""
    outs, _, drafts, _, mtp = greedy
    final = [p + c for p, c in zip(BATCH, token_ids(outs))]
    mtp = mtp.astype(np.float64)  # [B, T, V]: row t predicts token t + 2
    probs = np.exp(mtp - mtp.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    assert len(drafts) > 4 * 3
    for tokens, draft, draft_probs in drafts:
        (i,) = [i for i, s in enumerate(final) if tuple(s[:len(tokens)]) == tokens]
        n = len(tokens)  # draft 1 proposes token n, from h at n - 2 and token n - 1
        assert draft[0] == int(mtp[i, n - 2].argmax()), (i, n)
        assert draft_probs[0] == pytest.approx(probs[i, n - 2, draft[0]], rel=1e-4, abs=1e-6)
        assert len(draft) == len(draft_probs) == 3 and all(0 < p <= 1 for p in draft_probs)


def test_rounds_on_device_verify_what_one_round_steps_verify(speculative, greedy):
    """Several draft-verify rounds per step (num_scheduler_steps = 8, step_program.py ``verify_rounds``) against
    one round per step (1), on the same engine, one sequence (no preemption; its prompt's pages cached in both):
    the same greedy tokens (the checked ones), and the same drafts verified and accepted at every position, so the
    rounds on device proposed the drafts one-round steps propose (the MTP module's latents of earlier rounds read
    from its window, not the cache), in fewer steps."""
    ref = token_ids(greedy[0])[:1]
    scheduler = speculative.engine.scheduler
    runs = {}
    try:
        for k in (8, 1):
            scheduler.num_scheduler_steps = k
            got = speculative.generate(BATCH[:1], GREEDY, use_tqdm=False)
            assert token_ids(got) == ref, k
            runs[k] = speculative.stats
    finally:
        scheduler.num_scheduler_steps = 8
    many, one = runs[8], runs[1]
    assert one.num_draft_tokens > 0 and one.num_accepted_tokens > 0
    assert (many.num_drafts, many.num_draft_tokens, many.accepted_per_position) == (
        one.num_drafts, one.num_draft_tokens, one.accepted_per_position)
    assert many.steps < one.steps


def test_async_steps_sample_what_applied_steps_sample(speculative, greedy):
    """Async scheduling (each verification dispatched before the step in flight is applied, following its drafts
    and rollback on device: step_program.py ``follow_in_flight``) against every step applied before the next
    (``async_scheduling=False``), on the same engine, with steps of 8 rounds and of one: two seeded samples at
    temperature 0.8 (rows with different accepted counts, so each row's positions and sampling keys move by its
    own rollback) get the same tokens, and the same drafts are verified and accepted at every position (their
    pages fit: no preemption, which async steps' earlier reservations could cause where applied steps' do not)."""
    engine, scheduler = speculative.engine, speculative.engine.scheduler
    config = engine.config
    params = SamplingParams(n=2, temperature=0.8, top_k=50, seed=7, max_tokens=24, ignore_eos=True)
    runs = {}
    try:
        for k in (8, 1):
            scheduler.num_scheduler_steps = k
            for overlap in (True, False):
                engine.config = dataclasses.replace(config, async_scheduling=overlap)
                got = speculative.generate(BATCH[:1], params, use_tqdm=False)
                s = speculative.stats
                assert s.preemptions == 0
                runs[k, overlap] = token_ids(got), (s.num_drafts, s.num_draft_tokens, s.accepted_per_position)
    finally:
        scheduler.num_scheduler_steps, engine.config = 8, config
    for k in (8, 1):
        assert runs[k, True] == runs[k, False], k
        tokens, (_, verified, accepted) = runs[k, True]
        assert tokens[0] != tokens[1] and 0 < sum(accepted) < verified


def test_penalties_and_logprobs_across_rounds(speculative, greedy):
    """Greedy with frequency, presence and repetition penalties and logprobs=2, K = 3 drafts in steps of several
    rounds on device (the rounds' outputs counted before the next round's columns): every token is the argmax of
    the cache-free logits (``Model.logits`` over the final sequence, float64) after vLLM's penalties over the
    prompt and the earlier outputs (tests/engine/test_rejection_sampler.py ``ref_penalties``), and its logprobs
    are the raw logits' log-softmax (the chosen token's and the top 2)."""
    from test_rejection_sampler import ref_penalties

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=0.5,
                            presence_penalty=0.3, repetition_penalty=1.2, logprobs=2)
    (out,) = speculative.generate(BATCH[:1], params, use_tqdm=False)
    got = list(out.outputs[0].token_ids)
    assert len(got) == 24 and speculative.stats.num_accepted_tokens > 0
    assert speculative.stats.num_drafts > speculative.stats.steps  # several rounds per step
    prompt = BATCH[0]
    logits = speculative.engine.model.logits(np.array([prompt + got]))[0].astype(np.float64)  # [L, V]
    vocab = logits.shape[-1]
    in_prompt = np.bincount(prompt, minlength=vocab) > 0
    for o, token in enumerate(got):
        row = logits[len(prompt) - 1 + o]
        counts = np.bincount(np.array(got[:o], int), minlength=vocab)
        assert token == int(np.argmax(ref_penalties(row, counts, in_prompt, params))), o
        logp = row - row.max() - np.log(np.exp(row - row.max()).sum())
        entry = out.outputs[0].logprobs[o]
        top = np.argsort(-logp)[:2]
        assert set(entry) == {token, *map(int, top)}, o
        for t, value in entry.items():
            assert value == pytest.approx(logp[t], abs=2e-4), (o, t)


def test_stops_and_lengths_inside_an_accepted_run(speculative, greedy):
    """One call, one setting per prompt: stop tokens, max_tokens, n = 2 and a stop string that fall inside
    verified runs of drafts end the output where greedy decoding ends it (the greedy tokens cut at the first
    stop token or at max_tokens; the text before the stop string, the tokens up to the one completing it); n = 2
    samples both get the greedy tokens."""
    ref = token_ids(greedy[0])
    stops = [ref[0][5], ref[0][9]]
    cut = next((ref[0][:j + 1] for j, t in enumerate(ref[0]) if t in stops), ref[0])
    text = speculative.tokenizer.decode(ref[3])
    stop = speculative.tokenizer.decode(ref[3][12:14])
    params = [dataclasses.replace(GREEDY, stop_token_ids=stops), dataclasses.replace(GREEDY, max_tokens=7),
              dataclasses.replace(GREEDY, max_tokens=2, n=2), dataclasses.replace(GREEDY, stop=[stop])]
    got = speculative.generate(BATCH, params, use_tqdm=False)
    assert [list(c.token_ids) for o in got[:3] for c in o.outputs] == [cut, ref[1][:7], ref[2][:2], ref[2][:2]]
    assert [c.finish_reason for o in got for c in o.outputs] == ["stop", "length", "length", "length", "stop"]
    assert got[3].outputs[0].text == text[:text.index(stop)]
    # its tokens end at the one that completes the stop string, not at the end of that token's accepted run
    n = next(j + 1 for j in range(len(ref[3])) if stop in speculative.tokenizer.decode(ref[3][:j + 1]))
    assert list(got[3].outputs[0].token_ids) == ref[3][:n]


def test_broken_mtp_changes_acceptance_not_outputs(speculative, greedy):
    """Scrambled MTP weights (every MTP array rolled along its first axis): drafts are garbage, greedy outputs are
    still exactly the greedy tokens (the checked run of ``greedy``, whose steps' shapes this run mostly reuses)."""
    outs, stats = greedy[:2]
    model = speculative.engine.model
    saved = model.state

    def scramble(path, x):
        keys = [str(getattr(k, "key", k)) for k in path]
        if "mtp" in keys and hasattr(x, "dtype") and np.issubdtype(x.dtype, np.floating) and x.ndim:
            return jax.device_put(np.roll(np.asarray(x), 1, axis=0), x.sharding)
        return x

    try:
        model.state = jax.tree_util.tree_map_with_path(scramble, saved)
        speculative.engine.runner.refresh_state()
        got = speculative.generate(BATCH[:2], GREEDY, use_tqdm=False)
        bad = speculative.stats
    finally:
        model.state = saved
        speculative.engine.runner.refresh_state()
    assert token_ids(got) == token_ids(outs)[:2]
    assert bad.num_accepted_tokens / bad.num_draft_tokens < stats.num_accepted_tokens / stats.num_draft_tokens


def test_confidence_verification_is_greedy_on_a_mesh(greedy):
    """verify="confidence" on a 2x4 mesh (DP attention: each rank verifies its own sequence; the MoE of the
    verification step sees (K + 1) x rows), with a cost model under which rounds pay (the CPU's says they never
    do; a pass costs 256 + positions, drafting free: a round of one draft pays from a first confidence of 1 / 257,
    all three once the second and third drafts are worth 2 more columns): the same greedy tokens, with fewer
    drafts verified than proposed. Then, the same engine verifying every draft (verify="all": each verification
    dispatched before the step in flight is applied, each rank's rows following it on device): the same tokens."""
    ref = token_ids(greedy[0])
    llm = LLM(**{**KW, "mesh": "2x4"}, speculative_config=spec(3, "confidence"))
    assert llm.engine.scheduler.step_cost == STEP_COSTS["cpu"]  # where rounds hardly pay: a cost model that verifies
    llm.engine.scheduler.step_cost = StepCost(knee=256, fixed=0, mtp=0)
    got = llm.generate(BATCH[:2], dataclasses.replace(GREEDY, max_tokens=16), use_tqdm=False)
    assert token_ids(got) == [r[:16] for r in ref[:2]]
    assert 0 < llm.stats.num_draft_tokens < 3 * llm.stats.num_drafts
    llm.engine.scheduler.confidence_verify = False
    got = llm.generate(BATCH[:2], dataclasses.replace(GREEDY, max_tokens=16), use_tqdm=False)
    assert token_ids(got) == [r[:16] for r in ref[:2]] and llm.stats.num_accepted_tokens > 0


def test_rounds_with_the_cache_written_in_the_step(greedy):
    """attention_backend="pallas" (every round's latents written into the cache inside the step and read back by
    mla_decode; off a GPU its XLA implementation of the same contract), several rounds per step: the same greedy
    tokens."""
    ref = token_ids(greedy[0])
    llm = LLM(**KW, attention_backend="pallas", speculative_config=spec(3))
    got = llm.generate(BATCH[:1], dataclasses.replace(GREEDY, max_tokens=24), use_tqdm=False)
    assert token_ids(got) == [ref[0][:24]]
    assert llm.stats.num_accepted_tokens > 0 and llm.stats.num_drafts > llm.stats.steps


def test_confidence_rule():
    """DSpark's prefix survival S_j = c_1 ... c_j, and one width per step: the round (T in the runner's buckets up
    to K + 1) with the most expected tokens per unit of time, or a plain step (0) when a plain iteration's one token
    per sequence per (knee + rows) makes more. Expected values worked out by hand below."""
    assert survival([0.5, 0.5, 1.0]) == [0.5, 0.25, 0.25]
    assert [widths(k) for k in (0, 1, 3, 4, 16)] == [[1], [1, 2], [1, 2, 4], [1, 2, 4, 5], [1, 2, 4, 8, 16, 17]]
    draft = [0.9, 0.7, 0.4]  # S = 0.9, 0.63, 0.252
    # rows 1: plain 1 / 9 = 0.111; T = 2, 4 make 1.9 / 10 = 0.19, 2.782 / 12 = 0.232 tokens per unit
    assert verify_width([draft], 1, 3, POSITIONS_ONLY) == 3
    # rows 32: plain 32 / 40 = 0.8, T = 2: 60.8 / 72 = 0.844, T = 4: 89.0 / 136 = 0.655
    assert verify_width([draft] * 32, 32, 3, POSITIONS_ONLY) == 1
    # rows 2: T = 5 (2 + 4.85 + 0.05) / 18 = 0.331 beats T = 4 (2 + 2.94 + 0.05) / 16 = 0.312
    assert verify_width([[0.99] * 4, [0.05] * 4], 2, 4, POSITIONS_ONLY) == 4
    assert verify_width([[0.3] * 4, [0.05] * 4], 2, 4, POSITIONS_ONLY) == 0  # 2 / 10 = 0.2 > 2.35 / 12 = 0.196
    assert verify_width([], 1, 3, POSITIONS_ONLY) == 0 and verify_width([[], []], 2, 3, POSITIONS_ONLY) == 0
    # A round's fixed cost: T = 4 makes 2.782 / (30 + 12) = 0.066 < 0.111
    assert verify_width([draft], 1, 3, StepCost(knee=8, fixed=30, mtp=0)) == 0
    # ... shared by a step's rounds on device: 10 rounds pay 3 each, T = 2: 1.9 / 13 = 0.146, T = 4: 2.782 / 15
    # = 0.185 > 0.111.
    assert StepCost(knee=8, fixed=30, mtp=0).round(1, 4, 3, rounds=10) == 3 + 12
    assert verify_width([draft], 1, 3, StepCost(knee=8, fixed=30, mtp=0), rounds=10) == 3
    # The MTP passes, mtp x (knee + rows T) + (K - 1) mtp (knee + rows): at mtp 0.25, T = 4 costs 15 + 4.5 = 19.5
    # (2.782 / 19.5 = 0.143 > 0.111); at mtp 0.5, 18 + 9 = 27 (0.103 < 0.111).
    assert verify_width([draft], 1, 3, StepCost(knee=8, fixed=0, mtp=0.25)) == 3
    assert verify_width([draft], 1, 3, StepCost(knee=8, fixed=0, mtp=0.5)) == 0
    assert StepCost(knee=8, fixed=1, mtp=0.5).round(2, 4, 3) == 1 + 1.5 * 16 + 2 * 0.5 * 10
    # The platforms' constants: on a CPU near-certain drafts do not pay in a step of one round (plain 1 / 4.9 =
    # 0.204 against 3.94 / (87 + 7.9) = 0.042), barely in a step of 8 (3.94 / (87 / 8 + 7.9) = 0.210); on a GPU a
    # lone sequence verifies all of them (1 / 129 against 3.94 / 161).
    assert step_cost("cpu") == STEP_COSTS["cpu"] and step_cost("cuda") == step_cost("gpu") == STEP_COSTS["gpu"]
    assert verify_width([[0.99] * 3], 1, 3, step_cost("cpu")) == 0
    assert verify_width([[0.99] * 3], 1, 3, step_cost("cpu"), rounds=8) == 3
    assert verify_width([[0.9, 0.7, 0.4]], 1, 3, step_cost("cpu"), rounds=8) == 0  # 2.78 / 18.8 = 0.148
    assert verify_width([[0.99] * 3], 1, 3, step_cost("gpu")) == 3


def test_bad_settings_raise(tmp_path):
    """Unknown keys, methods or verify modes, K outside [1, 16], and a model without MTP tensors: ValueError
    naming the problem."""
    for bad, match in [({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                       ({"method": "mtp", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"method": "mtp", "num_speculative_tokens": 17}, "num_speculative_tokens"),
                       ({"method": "mtp", "num_speculative_tokens": True}, "num_speculative_tokens"),
                       ({"method": "mtp", "num_speculative_tokens": 2, "verify": "some"}, "verify"),
                       ({"method": "mtp", "num_speculative_tokens": 2, "draft_model": "x"}, "unknown keys"),
                       ({"num_speculative_tokens": 2}, "method"), ([2], "dict")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(speculative_config=bad)
    assert EngineConfig(speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 16}
                        ).speculative_config == SpeculativeConfig("deepseek_mtp", 16, "all")
    from jaxinfer import default_model
    import hf_oracle

    no_mtp = hf_oracle.copy_checkpoint(default_model.path(), tmp_path / "no_mtp")
    cfg = hf_oracle.read_config(no_mtp)
    hf_oracle.write_config(no_mtp, {**cfg, "num_nextn_predict_layers": 0})
    with pytest.raises(ValueError, match="MTP"):
        LLM(no_mtp, **KW, speculative_config=spec(2))


def test_structured_output_with_drafts(speculative):
    """Constrained requests with K = 3 drafts (engine/structured_output.py masks per verified column), one batch:
    greedy, every output token is the argmax of the cache-free logits (``Model.logits``) over the tokens the
    grammar allows after the earlier ones (llguidance masks recomputed here, token by token), drafts were accepted,
    the outputs stop and are valid; a sampled JSON request (temperature 1) stops with valid JSON too."""
    import json
    import re

    import jsonschema
    from masked_argmax import assert_masked_argmax_chain

    from jaxinfer import StructuredOutputsParams

    small = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                              "ok": {"type": "boolean"}, "tag": {"enum": ["ab", "cd"]}},
             "required": ["n", "ok", "tag"], "additionalProperties": False}
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    constraints = [StructuredOutputsParams(json=small, disable_any_whitespace=True),
                   StructuredOutputsParams(regex=phone), StructuredOutputsParams(choice=["red", "green", "blue"])]
    prompts = [p[-40:] for p in BATCH]
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=c) for c in constraints]
    params.append(SamplingParams(temperature=1.0, max_tokens=40, seed=7, structured_outputs=constraints[0]))
    outs = speculative.generate(prompts, params, use_tqdm=False)
    assert speculative.stats.num_accepted_tokens > 0
    texts = [o.outputs[0].text for o in outs]
    assert [o.outputs[0].finish_reason for o in outs] == ["stop"] * 4, texts
    jsonschema.validate(json.loads(texts[0]), small)
    jsonschema.validate(json.loads(texts[3]), small)
    assert re.fullmatch(phone, texts[1]) and texts[2] in ("red", "green", "blue")
    assert_masked_argmax_chain(speculative, constraints, outs[:3])
