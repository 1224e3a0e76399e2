"""`jaxinfer generate`: prompts from arguments and JSONL, completions equal LLM.generate's, one-line errors."""

import json

import pytest

import hf_oracle as O
from jaxinfer.cli import main


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return O.build_case("v3_qlora_yarn", tmp_path_factory)


def test_generate_jsonl_prompts_greedy(case, tmp_path, capsys):
    # The tiny oracle checkpoint has no tokenizer: JSONL lines carry token ids through the LLM API instead, so
    # here the CLI must refuse text prompts with a clear error, and the greedy run below uses the LLM directly.
    (tmp_path / "p.jsonl").write_text('{"prompt": "hello", "max_tokens": 3}\n')
    assert main(["generate", "--model", str(case.path), "--prompts", str(tmp_path / "p.jsonl"), "--mesh", "1x1",
                 "--dtype", "float32"]) == 2
    assert "tokenizer.json" in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    ("{not json}\n", "p.jsonl:1: not valid JSON"),
    ('{"prompt": "a", "messages": []}\n', "p.jsonl:1: expected an object with exactly one"),
    ('{"prompt": "a", "temperature": -1}\n', "request 1: "),
    ('{"prompt": "a", "colour": 3}\n', "unknown field"),
])
def test_bad_prompt_files(case, tmp_path, capsys, content, message):
    (tmp_path / "p.jsonl").write_text(content)
    assert main(["generate", "--model", str(case.path), "--prompts", str(tmp_path / "p.jsonl"), "--mesh", "1x1",
                 "--dtype", "float32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_missing_prompt_file(case, capsys):
    """Also what a vLLM habit gives: ``--prompt TEXT`` abbreviates --prompts, so the text is read as a file name."""
    assert main(["generate", "--model", str(case.path), "--prompt", "Hello there", "--mesh", "1x1"]) == 2
    err = capsys.readouterr().err
    assert "cannot read prompts file Hello there" in err and 'jaxinfer generate "TEXT"' in err


@pytest.mark.parametrize("flag", ["--output", "--expert-load-json"])
def test_an_unwritable_output_fails_before_the_model_loads(tmp_path, capsys, flag):
    """The path is checked first: with a model directory that does not exist, the error still names the flag."""
    bad = tmp_path / "missing_dir" / "out.json"
    assert main(["generate", "hello", "--model", str(tmp_path / "no_model"), flag, str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{flag} {bad}: cannot write it (No such file or directory)" in err[0], err


def test_generate_embedded_model_end_to_end(tmp_path, capsys):
    """No --model: the embedded default model; text prompts from arguments and JSONL (messages + overrides);
    JSONL output; completions equal LLM.generate's / LLM.chat's (the first run with the KV storage tier on); the
    vLLM-style summary on stderr."""
    from jaxinfer import LLM, SamplingParams

    out = tmp_path / "out.jsonl"
    assert main(["generate", "The with statement is used to", "Return a new dictionary", "--max-tokens", "5",
                 "--temperature", "0", "--mesh", "1x1", "--dtype", "float32", "--output", str(out),
                 "--kv-cache-dir", str(tmp_path / "kv")]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    err = capsys.readouterr().err
    assert "requests 2" in err and "TTFT" in err and "TPOT" in err
    assert "prefix cache: prompt tokens" in err and (tmp_path / "kv").is_dir()  # the storage tier's line
    llm = LLM(mesh="1x1", dtype="float32")
    ref = llm.generate(["The with statement is used to", "Return a new dictionary"],
                       SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert [line["token_ids"] for line in lines] == [r.outputs[0].token_ids for r in ref]
    assert [line["text"] for line in lines] == [r.outputs[0].text for r in ref]
    assert {"prompt", "text", "token_ids", "finish_reason", "metrics"} <= set(lines[0])

    messages = [{"role": "user", "content": "What is a dict?"}]
    (tmp_path / "p.jsonl").write_text(json.dumps({"messages": messages, "max_tokens": 3, "temperature": 0}) + "\n")
    assert main(["generate", "--prompts", str(tmp_path / "p.jsonl"), "--mesh", "1x1", "--dtype", "float32"]) == 0
    chat_line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    chat_ref = llm.chat(messages, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert chat_line["token_ids"] == chat_ref.outputs[0].token_ids
