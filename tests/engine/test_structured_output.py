"""Structured output (engine/structured_output.py): outputs sampled at temperature 1 under JSON Schema, regex, choice
and Lark constraints are all valid and finish with "stop"; unconstrained rows batched with constrained ones are
unchanged; bad constraints are refused or end their request with "error".

Oracles are independent of llguidance: ``jsonschema`` validates the JSON, ``re.fullmatch`` the regexes, the
``lark`` package parses the grammar's outputs, and llguidance's own numpy reference (``apply_token_bitmask_inplace``)
checks the device-side mask unpacking. One float32 engine serves every test (its step programs compile once).
"""

import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import lark
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams, StructuredOutputsParams
from jaxinfer.engine.sampler import unpack_allowed

from masked_argmax import assert_masked_argmax_chain

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
                                                     "city": {"type": "string", "maxLength": 6}},
                    "required": ["zip", "city"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "active", "tags", "address"],
    "additionalProperties": False,
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
SUM = r"""
start: "(" NUM ("+" NUM){0,3} ")"
NUM: /[1-9][0-9]?/
"""
COLORS = ["red", "green", "blue", "dark magenta"]
LARK_SUM = lark.Lark(r"""
start: "(" NUM ("+" NUM)* ")"
NUM: /[1-9][0-9]?/
""")  # lark's own parser; llguidance's {0,3} bound is checked separately


@pytest.fixture(scope="module")
def llm():
    """32 sequences of up to ~2 pages of 64 each on 40 pages: long outputs preempt others (recomputed, with their
    matchers kept)."""
    return LLM(dtype="float32", mesh="1x1", max_num_seqs=32, num_kv_pages=40)


def check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "regex":
        assert re.fullmatch(PHONE, text), text
    elif kind == "choice":
        assert text in COLORS, text
    else:
        LARK_SUM.parse(text)
        assert text.count("+") <= 3, text


def test_sampled_outputs_are_valid_and_stop(llm):
    """Temperature 1 (the embedded model's least obedient setting), 50 samples per constraint in one batch (seeded
    and unseeded requests, n = 2, preemptions): every output is valid by the independent checker and finishes with
    "stop"."""
    constraints = {"json": StructuredOutputsParams(json=PERSON, disable_any_whitespace=True),
                   "regex": StructuredOutputsParams(regex=PHONE),
                   "choice": StructuredOutputsParams(choice=COLORS),
                   "lark": StructuredOutputsParams(grammar=SUM)}
    prompts, params, kinds = [], [], []
    for kind, c in constraints.items():
        for i in range(25):
            prompts.append(f"Record {i}:")
            params.append(SamplingParams(temperature=1.0, max_tokens=120, n=2, structured_outputs=c,
                                         seed=i if i % 2 else None))
            kinds.append(kind)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats.preemptions > 0
    texts = {kind: [] for kind in constraints}
    for kind, out in zip(kinds, outs):
        for c in out.outputs:
            assert c.finish_reason == "stop", (kind, c.text, c.finish_reason)
            check(kind, c.text)
            texts[kind].append(c.text)
    assert all(len(set(t)) > 1 for kind, t in texts.items()), texts  # sampled, not one fixed answer


def test_greedy_outputs_are_the_masked_argmax_chain(llm):
    """Greedy constrained outputs, with the grammar's forced tokens appended without sampling and computed in
    chunks (engine.py ``_fast_forward``): every output token is the argmax of the cache-free logits
    (``Model.logits``) over the tokens llguidance allows after the earlier ones (masks recomputed here token by
    token), so a forced token is what sampling would have given; the batch took fewer steps than its longest
    output has tokens. A request with repetition and presence penalties is valid too (its step carries both the
    masks and the penalties' counts). A choice of one option is forced whole: "stop" before any step."""
    constraints = [StructuredOutputsParams(json=PERSON, disable_any_whitespace=True),
                   StructuredOutputsParams(regex=PHONE), StructuredOutputsParams(choice=COLORS),
                   StructuredOutputsParams(grammar=SUM)]
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=c) for c in constraints]
    params.append(SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.5, presence_penalty=0.5,
                                 structured_outputs=constraints[1]))
    outs = llm.generate([f"Record {i}:" for i in range(5)], params, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["stop"] * 5
    assert re.fullmatch(PHONE, outs[4].outputs[0].text), outs[4].outputs[0].text
    assert llm.stats.steps < max(len(o.outputs[0].token_ids) for o in outs)
    assert_masked_argmax_chain(llm, constraints, outs[:4])
    for c, o in zip(constraints, outs):
        check(c.kind if c.kind != "grammar" else "lark", o.outputs[0].text)
    (one,) = llm.generate(["x"], SamplingParams(structured_outputs={"choice": ["dark magenta"]}), use_tqdm=False)
    assert (one.outputs[0].text, one.outputs[0].finish_reason, llm.stats.steps) == ("dark magenta", "stop", 0)


@pytest.mark.parametrize(("regex", "stop"), [("ab é😀éx done", "😀"), ("ab é😀éx done", "x"),
                                           ("(yes|no) xyz done", "x")])
def test_stop_strings_inside_forced_tokens(llm, regex, stop):
    """A stop string ends the output inside tokens the grammar forces, whether forced from the start (appended with
    the prompt, before any step: the first two cases, one regex of one string) or after a sampled token, as if each
    token had been sampled: the outputs up to the first whose decoded prefix holds the stop string (computed here
    with the tokenizer from the output without the stop string), the text cut before it."""
    tok, constraint = llm.tokenizer, StructuredOutputsParams(regex=regex)
    (full,) = llm.generate(["def f():"], SamplingParams(temperature=0, max_tokens=40, structured_outputs=constraint),
                           use_tqdm=False)
    ids = full.outputs[0].token_ids
    text = tok.decode(ids)
    assert re.fullmatch(regex, text), text
    n = next(i for i in range(1, len(ids) + 1) if stop in tok.decode(ids[:i]))
    (cut,) = llm.generate(["def f():"], SamplingParams(temperature=0, max_tokens=40, stop=[stop],
                                                       structured_outputs=constraint), use_tqdm=False)
    out = cut.outputs[0]
    assert (out.token_ids, out.text, out.finish_reason) == (ids[:n], text[:text.index(stop)], "stop")


def test_constrained_rows_on_a_dp_mesh(llm):
    """A 2x4 mesh (DP attention: each rank samples its own rows, masks sharded with the step's packed inputs): the
    outputs are valid and stop, and a seeded request gives the tokens it gives on one device."""
    small = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                              "ok": {"type": "boolean"}},
             "required": ["n", "ok"], "additionalProperties": False}
    constraint = StructuredOutputsParams(json=small, disable_any_whitespace=True)
    params = [SamplingParams(temperature=1.0, max_tokens=40, seed=i, structured_outputs=constraint) for i in range(6)]
    prompts = [f"Item {i}:" for i in range(6)]
    outs = LLM(dtype="float32", mesh="2x4", max_num_seqs=4).generate(prompts, params, use_tqdm=False)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), small)
    one = llm.generate(prompts[:1], params[:1], use_tqdm=False)  # the module's 1x1 engine
    assert one[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_unconstrained_rows_are_unchanged_by_constrained_neighbours(llm):
    """Greedy unconstrained requests give the same tokens alone and batched with constrained ones (whose rows
    sample one token per step, some after chunks of forced tokens, while theirs run multi-step chunks)."""
    plain = ["The with statement is used to", "def fibonacci(n):"]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(plain, greedy, use_tqdm=False)
    constrained = SamplingParams(temperature=1.0, max_tokens=60, structured_outputs={"regex": PHONE}, seed=3)
    mixed = llm.generate(plain + ["Call me at"] * 3, [greedy, greedy] + [constrained] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    for o in mixed[2:]:
        assert re.fullmatch(PHONE, o.outputs[0].text) and o.outputs[0].finish_reason == "stop"


def test_bad_constraints(llm):
    """Two constraints, none, an empty choice list, a schema that is not JSON, unknown keys: ValueError when the
    params are built. A regex llguidance cannot compile and a grammar no text satisfies (an empty character class:
    llguidance allows only EOS before the grammar is complete) end their own requests with "error" and a message,
    never a hang; the batch's other request is unaffected."""
    for kwargs, match in [(dict(regex="a", choice=["a"]), "exactly one of"), ({}, "got none"),
                          (dict(choice=[]), "empty"), (dict(json="{not json"), "not JSON"),
                          (dict(json_object=True, json={"type": "object"}), "exactly one of"),
                          (dict(grammar=""), "non-empty")]:
        with pytest.raises(ValueError, match=match):
            StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError, match="unknown keys"):
        SamplingParams(structured_outputs={"regex": "a", "schema": {}})
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(["def fibonacci(n):"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate(["x", "y", "def fibonacci(n):"],
                        [SamplingParams(max_tokens=8, structured_outputs={"regex": "a(b"}),
                         SamplingParams(max_tokens=8, structured_outputs={"grammar": r"start: /[^\x00-\x{10FFFF}]/"}),
                         greedy], use_tqdm=False)
    (bad_regex,), (unspellable,), (good,) = (o.outputs for o in outs)
    assert bad_regex.finish_reason == "error" and "unclosed group" in bad_regex.error
    assert unspellable.finish_reason == "error" and unspellable.error.startswith("structured_outputs")
    assert good.finish_reason == "length" and good.token_ids == alone


def test_params_are_canonical_and_hashable():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    b = StructuredOutputsParams(json='{"type": "object",  "properties": {"a": {"type": "integer"}}}')
    assert a == b and hash(a) == hash(b) and a.kind == "json"
    assert StructuredOutputsParams(json={"properties": {}, "type": "object"}) != StructuredOutputsParams(
        json={"type": "object", "properties": {}})  # key order is the output's property order: kept
    assert StructuredOutputsParams(choice=["x", "y"]).choice == ("x", "y")
    assert SamplingParams(structured_outputs={"choice": ["x"]}).structured_outputs == StructuredOutputsParams(
        choice=["x"])


@pytest.mark.parametrize("vocab", [64, 100, 4096])
def test_unpack_allowed_matches_llguidance(vocab):
    """The device unpacking of bitmask words equals llguidance's numpy reference, which sets disallowed logits
    to -inf, on random words (sign bits included)."""
    import llguidance.numpy as llg_numpy

    rng = np.random.default_rng(vocab)
    words = rng.integers(-2**31, 2**31, (3, -(-vocab // 32)), dtype=np.int64).astype(np.int32)
    logits = np.zeros((3, vocab), np.float32)
    llg_numpy.apply_token_bitmask_inplace(logits, words)
    got = jax.jit(unpack_allowed, static_argnums=1)(jnp.asarray(words), vocab)
    np.testing.assert_array_equal(np.asarray(got), logits == 0)


def test_masks_of_a_verification_step_with_and_without_drafts():
    """One speculative step's masks for two constrained sequences, one verifying drafts and one verifying none
    (a sequence one token from max_tokens: llguidance's fill with drafts refuses an empty draft list): each row
    is what llguidance's plain fill gives a fresh matcher fed the sequence's tokens before that row."""
    import llguidance
    import llguidance.numpy as llg_numpy

    from jaxinfer import default_model
    from jaxinfer.engine.structured_output import Grammars, grammar_text
    from jaxinfer.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(default_model.path())
    constraint = StructuredOutputsParams(regex=PHONE)
    grammars = Grammars(tokenizer.to_json(), 4096, tokenizer.eos_token_id)
    assert grammars.add([1, 2], constraint) is None
    drafts = tokenizer.encode("(555) 12", add_special_tokens=False)
    got = grammars.masks([1, 2], {1: drafts, 2: []})
    assert [m.shape[0] for m in (got[1], got[2])] == [1 + len(drafts), 1]

    def plain_mask(consumed):
        matcher = llguidance.LLMatcher(grammars._tokenizer, grammar_text(constraint), log_level=0)
        assert matcher.consume_tokens(consumed)
        words = np.full((1, grammars.words), -1, np.int32)
        llg_numpy.fill_next_token_bitmask(matcher, words, 0)
        return words[0]

    for j in range(len(drafts) + 1):
        np.testing.assert_array_equal(got[1][j], plain_mask(drafts[:j]), err_msg=f"row {j}")
    np.testing.assert_array_equal(got[2][0], plain_mask([]))


def test_chat_response_format(llm, monkeypatch):
    """LLM.chat(response_format=...): OpenAI's json_schema and json_object formats become each request's
    structured_outputs (what that does to outputs is tested above; free JSON whitespace lets this untuned model
    ramble, so no outputs here); "text" is no constraint; response_format with structured_outputs as well, or an
    unknown format -> ValueError."""
    calls = []
    monkeypatch.setattr(llm, "generate", lambda prompts, params, use_tqdm: calls.append((prompts, params)) or [])
    conversation = [{"role": "user", "content": "Describe a person."}]
    seeded = SamplingParams(temperature=1.0, seed=5)
    llm.chat([conversation] * 2, [seeded, None], use_tqdm=False,
             response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    llm.chat(conversation, seeded, use_tqdm=False, response_format={"type": "json_object"})
    llm.chat(conversation, seeded, use_tqdm=False, response_format={"type": "text"})
    (prompts, params), (_, one), (_, text) = calls
    assert prompts == [llm.tokenizer.apply_chat_template(conversation, add_generation_prompt=True)] * 2
    person = StructuredOutputsParams(json=PERSON)
    assert params == [SamplingParams(temperature=1.0, seed=5, structured_outputs=person),
                      SamplingParams(structured_outputs=person)]
    assert one == [SamplingParams(temperature=1.0, seed=5, structured_outputs={"json_object": True})]
    assert text == [seeded]
    with pytest.raises(ValueError, match="not both"):
        llm.chat(conversation, SamplingParams(structured_outputs={"regex": "a"}), use_tqdm=False,
                 response_format={"type": "json_object"})
    for bad in ({"type": "xml"}, {"type": "json_schema"}, "json"):
        with pytest.raises(ValueError, match="response_format"):
            llm.chat(conversation, use_tqdm=False, response_format=bad)
