"""The chat protocol (engine/chat_protocol.py, engine/chat_output.py, LLM.chat) on real artifacts: vLLM's
DeepSeek-V3 tool template and a tokenizer carrying DeepSeek's tool and reasoning tokens (tests/chat_tokenizer.py).

Rendering is compared with transformers' apply_chat_template(..., tools=...) given the conversation as
transformers expects it (arguments as dicts, text as strings); parsing with completions built from the template's
own format (its rendering of history calls); tool_choice "required" / a named function on a random model with
jsonschema as the judge of the arguments.
"""

import dataclasses
import json
import re

import chat_tokenizer
import hf_oracle
import jsonschema
import pytest

from jaxinfer.default_model import path as default_model_path
from jaxinfer.engine.chat_output import (DeepSeekToolCalls, DeepSeekV31ToolCalls, HermesToolCalls, parse_completion,
                                         reasoning_format, tool_call_format, tool_call_grammar)
from jaxinfer.engine.chat_protocol import normalize_messages, tool_choice_name, validate_tools
from jaxinfer.engine.llm import LLM
from jaxinfer.engine.outputs import CompletionOutput, RequestOutput
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.engine.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather forecast of a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now", "description": "The time.",
                                           "parameters": {"type": "object", "properties": {},
                                                          "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _call(i, name, arguments):
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}


# (OpenAI's shapes, as transformers expects them: arguments as dicts, text parts joined)
CONVERSATIONS = {
    "system_and_tools": (
        [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Weather in Paris?"}],
        None),
    "one_call_and_its_output": (
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": None, "tool_calls": [_call(1, "get_weather", '{"city": "Paris"}')]},
         {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
         {"role": "assistant", "content": "It is 21 degrees."},
         {"role": "user", "content": "Thanks"}],
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": None, "tool_calls": [_call(1, "get_weather", {"city": "Paris"})]},
         {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
         {"role": "assistant", "content": "It is 21 degrees."},
         {"role": "user", "content": "Thanks"}]),
    "several_calls_and_parts": (
        [{"role": "system", "content": [{"type": "text", "text": "Be exact."}, {"type": "text", "text": "Be kind."}]},
         {"role": "user", "content": [{"type": "text", "text": "Weather in Tokyo and Lima, and the time?"}]},
         {"role": "assistant", "content": "Checking.",
          "tool_calls": [_call(1, "get_weather", {"city": "Tokyo", "days": 2}),
                         _call(2, "get_weather", '{"city": "Lima"}'), _call(3, "now", "{}")]},
         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
         {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
         {"role": "tool", "tool_call_id": "call_3", "content": "09:00"}],
        [{"role": "system", "content": "Be exact.\nBe kind."},
         {"role": "user", "content": "Weather in Tokyo and Lima, and the time?"},
         {"role": "assistant", "content": "Checking.",
          "tool_calls": [_call(1, "get_weather", {"city": "Tokyo", "days": 2}),
                         _call(2, "get_weather", {"city": "Lima"}), _call(3, "now", {})]},
         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
         {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
         {"role": "tool", "tool_call_id": "call_3", "content": "09:00"}]),
    "a_call_without_content": (  # OpenAI's API lets an assistant message of calls leave content out: None
        [{"role": "user", "content": "Time?"}, {"role": "assistant", "tool_calls": [_call(1, "now", "{}")]},
         {"role": "tool", "tool_call_id": "call_1", "content": "09:00"}],
        [{"role": "user", "content": "Time?"}, {"role": "assistant", "tool_calls": [_call(1, "now", {})],
                                                "content": None},
         {"role": "tool", "tool_call_id": "call_1", "content": "09:00"}]),
}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return chat_tokenizer.save(tmp_path_factory.mktemp("chat_tokenizer"))


@pytest.fixture(scope="module")
def ours(tok_dir):
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def hf(tok_dir):
    return transformers.AutoTokenizer.from_pretrained(str(tok_dir), add_bos_token=True)  # test_tokenizer.py's


def _for_hf(messages):
    """transformers drops None-valued keys, after which DeepSeek's templates (which test `content is none`) fail on
    an assistant message of calls only; its content "" renders the same text through the template's other branch."""
    return [{**m, "content": ""} if m.get("content", "") is None else m for m in messages]


def _hf_ids(hf, messages, tools, **kwargs):
    out = hf.apply_chat_template(_for_hf(messages), tools=tools, add_generation_prompt=True, tokenize=True, **kwargs)
    return list(out if isinstance(out, list) else out["input_ids"])


@pytest.fixture(scope="module")
def v31(tmp_path_factory):
    """(ours, transformers') tokenizers with DeepSeek-V3.1's tool template."""
    d = chat_tokenizer.save(tmp_path_factory.mktemp("chat_tokenizer_v31"), chat_tokenizer.TEMPLATE_V31)
    return Tokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(str(d), add_bos_token=True)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_conversations_with_tools_render_as_transformers(ours, hf, name):
    messages, as_hf = CONVERSATIONS[name]
    as_hf = as_hf or messages
    assert ours.apply_chat_template(messages, tools=TOOLS) == _hf_ids(hf, as_hf, TOOLS)
    assert ours.render_chat(messages, tools=TOOLS) == hf.apply_chat_template(
        _for_hf(as_hf), tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert normalize_messages(messages) == as_hf


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_v31_template_renders_as_transformers_with_its_thinking_switch(v31, name, thinking):
    ours, hf = v31
    messages, as_hf = CONVERSATIONS[name]
    ids = ours.apply_chat_template(messages, tools=TOOLS, template_kwargs={"thinking": thinking})
    assert ids == _hf_ids(hf, as_hf or messages, TOOLS, thinking=thinking)
    if name == "system_and_tools":  # ends with the generation prompt: thinking opens the reasoning
        text = ours.decode(ids, skip_special_tokens=False).rstrip()
        assert text.endswith("<think>" if thinking else "</think>") and "<｜Assistant｜>" in text[-30:]


def test_the_template_decides_the_tool_call_format(ours, v31):
    assert isinstance(tool_call_format(ours), DeepSeekToolCalls)
    assert isinstance(tool_call_format(v31[0]), DeepSeekV31ToolCalls)


def test_special_token_strings_in_messages_and_tools_stay_text(ours):
    """Text holding the markers renders to the same special ids (those the template writes) as text without."""
    specials = {ours.token_to_id(t) for t in chat_tokenizer.TOOL_TOKENS + [chat_tokenizer.EOS]}

    def rendered(marker):
        tools = [{"type": "function", "function": {**TOOLS[0]["function"], "description": f"see {marker}"}}]
        messages = [{"role": "user", "content": f"{marker}x"},
                    {"role": "assistant", "content": None, "tool_calls": [_call(1, "get_weather", {"city": marker})]},
                    {"role": "tool", "tool_call_id": "call_1", "content": marker}]
        return ours.apply_chat_template(messages, tools=tools), ours.render_chat(messages, tools=tools)

    clean_ids, _ = rendered("plain")
    for marker in chat_tokenizer.TOOL_TOKENS[:2] + [chat_tokenizer.EOS]:
        ids, text = rendered(marker)
        assert [i for i in ids if i in specials] == [i for i in clean_ids if i in specials]
        assert ours.decode(ids, skip_special_tokens=False) == text and marker in text


@pytest.mark.parametrize(("messages", "match"), [
    ([{"role": "robot", "content": "x"}], r"messages\[0\]\['role'\] must be one of"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "call_1", "content": "y"}],
     r"messages\[1\]: a tool message must follow an assistant message with tool_calls"),
    ([{"role": "assistant", "content": None, "tool_calls": [_call(1, "now", {})]},
      {"role": "tool", "tool_call_id": "call_9", "content": "y"}],
     r"messages\[1\]\['tool_call_id'\] 'call_9' names none of the calls"),
    ([{"role": "user", "content": None}], r"messages\[0\]\['content'\] must be a string or text parts"),
    ([{"role": "user"}], r"messages\[0\]\['content'\] is missing"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     r"messages\[0\]\['content'\]\[0\] must be .*'image_url'"),
    ([{"role": "assistant", "content": None, "tool_calls": [_call(1, "now", "{oops")]}],
     r"messages\[0\]\['tool_calls'\]\[0\]\['function'\]\['arguments'\] must be a JSON object"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "now"}}]}],
     r"messages\[0\]\['tool_calls'\]\[0\]\['id'\]"),
    ([{"role": "user", "content": "x", "tool_calls": [_call(1, "now", {})]}], r"messages\[0\]: only assistant"),
])
def test_bad_messages(ours, messages, match):
    with pytest.raises(ValueError, match=match):
        ours.apply_chat_template(messages)


def test_what_a_template_cannot_render_is_a_value_error(ours):
    """The embedded model's template writes '<｜Assistant｜>' + content: content None (calls only) is a TypeError in
    the template, raised as a ValueError that says so; chat_template_kwargs that are not a dict are named."""
    plain = Tokenizer.from_dir(default_model_path())
    calls = [{"role": "user", "content": "Time?"}, {"role": "assistant", "tool_calls": [_call(1, "now", {})]}]
    with pytest.raises(ValueError, match=r"chat template failed on the messages \(TypeError: .*content None"):
        plain.apply_chat_template(calls)
    with pytest.raises(ValueError, match="chat_template_kwargs must be a dict, got str"):
        ours.apply_chat_template([{"role": "user", "content": "x"}], template_kwargs="thinking")


@pytest.mark.parametrize(("tools", "match"), [
    ({"type": "function"}, r"tools must be a list"),
    ([{"type": "retrieval"}], r"tools\[0\] must be \{'type': 'function'"),
    ([{"type": "function", "function": {"name": "get weather"}}], r"tools\[0\]\['function'\]\['name'\] must be"),
    ([TOOLS[0], TOOLS[0]], r"tools\[1\]\['function'\]\['name'\] 'get_weather' is defined twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
     r"tools\[0\]\['function'\]\['parameters'\] is not a valid JSON Schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], r"must be a JSON Schema object"),
])
def test_bad_tools(tools, match):
    with pytest.raises(ValueError, match=match):
        validate_tools(tools)


def test_tool_choice():
    assert [tool_choice_name(c, TOOLS) for c in ("auto", "none", "required")] == ["auto", "none", "required"]
    assert tool_choice_name({"type": "function", "function": {"name": "now"}}, TOOLS) == "now"
    for choice, match in [({"type": "function", "function": {"name": "fly"}}, "'fly', which is not among"),
                          ("always", "tool_choice must be one of"), ({"name": "now"}, "tool_choice must be one of")]:
        with pytest.raises(ValueError, match=match):
            tool_choice_name(choice, TOOLS)
    with pytest.raises(ValueError, match="needs tools"):
        tool_choice_name("required", None)


def _completion(ours, ids):
    """A finished completion as the engine returns it: the ids (EOS last) and their text."""
    ids = list(ids)
    text = ours.decode(ids[:-1] if ids and ids[-1] == ours.eos_token_id else ids)
    return CompletionOutput(0, ids, text, "stop")


def _history_turn(ours, content, calls):
    """(prompt ids, completion ids): the template's rendering of a user turn then an assistant turn with ``calls``,
    split after the last <｜Assistant｜> (and V3.1's </think> after it); the completion (what a model trained on it
    outputs) without the template's indentation before it and its newline after the turn's EOS."""
    user = [{"role": "user", "content": "Weather?"}]
    full = ours.apply_chat_template(user + [{"role": "assistant", "content": content, "tool_calls": calls}],
                                    add_generation_prompt=False, tools=TOOLS)
    k = len(full) - full[::-1].index(ours.token_to_id(chat_tokenizer.ASSISTANT))
    if full[k] == ours.token_to_id("</think>"):  # V3.1's template closes the reasoning in the prompt
        k += 1
    turn = ours.decode(full[k:full.index(ours.eos_token_id, k) + 1], skip_special_tokens=False).lstrip()
    markers = chat_tokenizer.TOOL_TOKENS + [chat_tokenizer.EOS]
    pieces = re.split("(" + "|".join(map(re.escape, markers)) + ")", turn)  # text, marker, text, ...
    ids = [i for j, piece in enumerate(pieces) for i in (
        [ours.token_to_id(piece)] if j % 2 else ours.encode(piece, add_special_tokens=False))]
    return full[:k], ids


@pytest.mark.parametrize("content", [None, "Let me check."])
@pytest.mark.parametrize("calls", [[_call(1, "get_weather", {"city": "Paris", "days": 3})],
                                   [_call(1, "get_weather", {"city": "Lima"}), _call(2, "now", {})]])
def test_tool_calls_parse_from_the_templates_own_format(ours, content, calls):
    fmt, reasoning = tool_call_format(ours), reasoning_format(ours)
    prompt, ids = _history_turn(ours, content, calls)
    got = parse_completion(_completion(ours, ids), prompt, ours, fmt, reasoning)
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got.tool_calls] == [
        ("function", c["function"]["name"], c["function"]["arguments"]) for c in calls]
    ids = [c["id"] for c in got.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(calls)
    assert got.text == (content or "") and got.reasoning_content is None


def test_v31_tool_calls_and_reasoning_parse(v31):
    ours = v31[0]
    calls = [_call(1, "get_weather", {"city": "Lima", "days": 2}), _call(2, "now", {})]
    prompt, ids = _history_turn(ours, "Checking.", calls)
    got = parse_completion(_completion(ours, ids), prompt, ours, tool_call_format(ours), reasoning_format(ours))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got.tool_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert got.text == "Checking." and got.reasoning_content is None
    thinking = ours.apply_chat_template([{"role": "user", "content": "Weather?"}], template_kwargs={"thinking": True})
    reply = ours.encode("Lima it is.</think>", add_special_tokens=False) + ids
    got = parse_completion(_completion(ours, reply), thinking, ours, tool_call_format(ours), reasoning_format(ours))
    assert got.reasoning_content == "Lima it is." and got.text == "Checking." and len(got.tool_calls) == 2


def test_malformed_calls_stay_text(ours):
    fmt = tool_call_format(ours)
    prompt, ids = _history_turn(ours, None, [_call(1, "get_weather", {"city": "Paris"})])
    cut = _completion(ours, ids[:-3])  # before <｜tool▁calls▁end｜>: max_tokens ran out
    assert parse_completion(cut, prompt, ours, fmt, None) == cut
    mark = ours.token_to_id
    bad = ([mark("<｜tool▁calls▁begin｜>"), mark("<｜tool▁call▁begin｜>")] + ours.encode("function")
           + [mark("<｜tool▁sep｜>")] + ours.encode('now\n```json\n{"a": \n```')
           + [mark("<｜tool▁call▁end｜>"), mark("<｜tool▁calls▁end｜>")])
    bad = _completion(ours, bad)
    assert parse_completion(bad, prompt, ours, fmt, None) == bad
    plain = _completion(ours, ours.encode("No call here.") + [ours.eos_token_id])
    assert parse_completion(plain, prompt, ours, fmt, None) == dataclasses.replace(plain, tool_calls=None)


def _hermes_reply(calls):
    """Calls as Qwen2.5 / Qwen3's templates write history calls (tojson of {"name", "arguments"})."""
    return "\n".join("<tool_call>\n" + json.dumps({"name": n, "arguments": a}) + "\n</tool_call>" for n, a in calls)


def test_hermes_tool_calls_parse():
    fmt = HermesToolCalls()
    calls = [("get_weather", {"city": "Lima", "days": 2}), ("now", {})]
    got = fmt.parse(_hermes_reply(calls))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    for bad in [_hermes_reply(calls)[:-3], "<tool_call>\n{\"name\": \"now\", \"arguments\": [1]}\n</tool_call>",
                "<tool_call>\n{\"arguments\": {}}\n</tool_call>", _hermes_reply(calls) + " trailing"]:
        assert fmt.parse(bad) is None


@pytest.mark.parametrize("fmt", ["deepseek", "deepseek_v31", "hermes"])
def test_tool_call_grammars_accept_calls_of_the_tools_only(ours, fmt):
    import llguidance

    formats = {"deepseek": DeepSeekToolCalls(), "deepseek_v31": DeepSeekV31ToolCalls(), "hermes": HermesToolCalls()}
    fmt_obj = formats[fmt]
    llg = llguidance.LLTokenizer(ours.to_json(), n_vocab=ours.vocab_size, eos_token=ours.eos_token_id)

    def accepts(ids, name=None):
        grammar = tool_call_grammar(fmt_obj, TOOLS, name, ours)
        matcher = llguidance.LLMatcher(llg, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
        return all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()

    def reply(calls):
        if fmt == "hermes":
            return ours.encode(_hermes_reply(calls), add_special_tokens=False)
        mark, text = ours.token_to_id, lambda t: ours.encode(t, add_special_tokens=False)  # noqa: E731
        ids = [mark("<｜tool▁calls▁begin｜>")]  # the templates' layouts without vLLM's V3 example's indentation
        for i, (n, a) in enumerate(calls):
            if fmt == "deepseek_v31":
                ids += [mark("<｜tool▁call▁begin｜>")] + text(n) + [mark("<｜tool▁sep｜>")] + text(json.dumps(a)) + [
                    mark("<｜tool▁call▁end｜>")]
                continue
            ids += (text("\n") if i else []) + [mark("<｜tool▁call▁begin｜>")] + text("function") + [
                mark("<｜tool▁sep｜>")] + text(f"{n}\n```json\n{json.dumps(a)}\n```") + [mark("<｜tool▁call▁end｜>")]
        return ids + [mark("<｜tool▁calls▁end｜>")]

    two = [("get_weather", {"city": "Lima", "days": 2}), ("now", {})]
    assert accepts(reply(two)) and accepts(reply(two[:1]), "get_weather")
    assert not accepts(reply(two), "get_weather")                           # a named function: one call of it
    assert not accepts(reply([("get_weather", {"city": "Rome"})]))          # not in the schema's enum
    assert not accepts(reply([("get_weather", {"days": 2})]))               # "city" is required
    assert not accepts(reply([("fly", {})]))                                # not a tool


def test_reasoning_splits_at_r1s_markers(ours):
    fmt = reasoning_format(ours)
    prompt = ours.apply_chat_template([{"role": "user", "content": "Capital of France?"}])
    thinking = prompt + ours.encode("<think>\n")  # R1's template opens the reasoning in the prompt
    got = parse_completion(_completion(ours, ours.encode("It is Paris.</think>Paris.") + [ours.eos_token_id]),
                           thinking, ours, None, fmt)
    assert (got.reasoning_content, got.text) == ("It is Paris.", "Paris.")
    got = parse_completion(_completion(ours, ours.encode("<think>Hmm.</think>Paris.")), prompt, ours, None, fmt)
    assert (got.reasoning_content, got.text) == ("Hmm.", "Paris.")
    got = parse_completion(_completion(ours, ours.encode("Still thinking")), thinking, ours, None, fmt)
    assert (got.reasoning_content, got.text) == ("Still thinking", "")  # cut by max_tokens inside the reasoning
    got = parse_completion(_completion(ours, ours.encode("Paris.")), prompt, ours, None, fmt)
    assert (got.reasoning_content, got.text) == (None, "Paris.")


@pytest.fixture(scope="module")
def llm(tok_dir, tmp_path_factory):
    """A random V3-shaped model over the chat tokenizer's vocabulary."""
    vocab = Tokenizer.from_dir(tok_dir).vocab_size
    model = hf_oracle.build_hf_model(dict(hf_oracle.CONFIGS["v3_noqlora_default"], vocab_size=vocab), seed=3)
    path = hf_oracle.save_checkpoint(model, tmp_path_factory.mktemp("chat_model"))
    chat_tokenizer.save(path)
    return LLM(path, mesh="1x1", dtype="float32")  # what `jaxinfer generate` builds: the CLI test shares its programs


def test_forced_tool_choice_outputs_are_calls_of_the_tools(llm):
    """tool_choice "required" (a named function: the command-line test below)."""
    conversation = [{"role": "user", "content": "Weather in Lima, and the time?"}]
    sampled = SamplingParams(temperature=1.0, seed=11, n=8, max_tokens=160)
    (out,) = llm.chat(conversation, sampled, use_tqdm=False, tools=TOOLS, tool_choice="required")
    for c in out.outputs:
        assert c.finish_reason == "stop" and c.tool_calls, (c.text, c.token_ids)
        for call in c.tool_calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def test_auto_and_none(llm, monkeypatch):
    """What LLM.chat does around generate (outputs faked: the forced test above runs the model): "auto" parses
    calls out of replies and leaves a reply without one as it is; "none" renders no tools and parses nothing."""
    tok = llm.tokenizer
    conversation = [{"role": "user", "content": "Hello"}]
    _, call = _history_turn(tok, None, [_call(1, "now", {})])
    replies = {"plain": tok.encode("Hi there.") + [tok.eos_token_id], "call": call}
    seen = []

    def generate(prompts, params, use_tqdm):
        seen.append(prompts)
        return [RequestOutput(str(i), None, p, [_completion(tok, replies[kind])], {}, True)
                for i, (p, kind) in enumerate(zip(prompts, ["plain", "call"]))]

    monkeypatch.setattr(llm, "generate", generate)
    plain, called = llm.chat([conversation] * 2, use_tqdm=False, tools=TOOLS)
    assert seen[-1] == [tok.apply_chat_template(conversation, tools=TOOLS)] * 2
    assert (plain.outputs[0].tool_calls, plain.outputs[0].text) == (None, "Hi there.")
    assert [c["function"]["name"] for c in called.outputs[0].tool_calls] == ["now"] and called.outputs[0].text == ""
    plain, called = llm.chat([conversation] * 2, use_tqdm=False, tools=TOOLS, tool_choice="none")
    assert seen[-1] == [tok.apply_chat_template(conversation)] * 2  # no tools rendered
    assert called.outputs[0].tool_calls is None and called.outputs[0].text == tok.decode(call[:-1])
    with pytest.raises(ValueError, match="not both"):
        llm.chat(conversation, use_tqdm=False, tools=TOOLS, tool_choice="required",
                 response_format={"type": "json_object"})


def test_generate_chat_with_tools_from_the_command_line(llm, tmp_path, capsys):
    """`jaxinfer generate --chat --tools FILE --tool-choice NAME`: the line's completion is a call of NAME; a JSONL
    line's own tool_choice wins ("none": no tools rendered, no tool_calls key)."""
    from jaxinfer.cli import main

    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    (tmp_path / "p.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "Weather in Tokyo?"}]}) + "\n"
        + json.dumps({"prompt": "Hello", "tool_choice": "none", "max_tokens": 4}) + "\n")
    assert main(["generate", "--model", str(llm.model_path), "--prompts", str(tmp_path / "p.jsonl"), "--chat",
                 "--tools", str(tmp_path / "tools.json"), "--tool-choice", "get_weather", "--mesh", "1x1",
                 "--dtype", "float32", "--temperature", "1", "--seed", "5", "--max-tokens", "160"]) == 0
    called, plain = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [c["function"]["name"] for c in called["tool_calls"]] == ["get_weather"]
    jsonschema.validate(json.loads(called["tool_calls"][0]["function"]["arguments"]), WEATHER)
    assert "tool_calls" not in plain and len(plain["token_ids"]) == 4
    assert main(["generate", "--model", str(llm.model_path), "--chat", "--tool-choice", "required", "Hi", "--mesh",
                 "1x1"]) == 2
    assert "request 1: tool_choice='required' needs tools" in capsys.readouterr().err


def test_chat_template_kwargs_from_the_command_line(llm, tmp_path, capsys):
    """`--chat-template-kwargs '{"thinking": true}'` reaches DeepSeek-V3.1's template (its generation prompt then
    opens <think>: the reply is reasoning); a JSONL line's own "chat_template_kwargs" wins; bad JSON -> exit 2."""
    import shutil

    from jaxinfer.cli import main

    v31 = tmp_path / "v31"
    shutil.copytree(llm.model_path, v31)
    chat_tokenizer.save(v31, chat_tokenizer.TEMPLATE_V31)  # the same vocabulary: the programs are shared
    (tmp_path / "p.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"thinking": False}})
        + "\n")
    flags = ["generate", "--model", str(v31), "--prompts", str(tmp_path / "p.jsonl"), "--mesh", "1x1", "--dtype",
             "float32", "--temperature", "0", "--max-tokens", "1"]  # the prefill step samples it: no decode programs
    assert main(flags + ["--chat-template-kwargs", '{"thinking": true}']) == 0
    thinking, plain = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert "reasoning_content" in thinking and "reasoning_content" not in plain, (thinking, plain)
    for bad in ("{thinking", "[1]"):
        assert main(flags + ["--chat-template-kwargs", bad]) == 2
        assert "--chat-template-kwargs must be a JSON object" in capsys.readouterr().err
