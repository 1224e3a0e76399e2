"""`jaxinfer generate --json-schema FILE | --regex RE | --choice A,B,C | --grammar FILE.lark` and JSONL lines'
"structured_outputs": the flags build the StructuredOutputsParams every request gets (a line's own wins), two
flags at once are an argparse usage error, and unreadable or invalid constraints are one-line errors. (What the
constraints do to outputs: tests/engine/test_structured_output.py.)"""

import json

import pytest

from jaxinfer import StructuredOutputsParams
from jaxinfer.cli import _parser, main
from jaxinfer.cli_generate import read_requests, sampling_params, structured_outputs


def parse(*argv):
    return _parser().parse_args(["generate", "p", *argv])


def test_flags_build_the_constraint(tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object", "required": ["a"]}')
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "x" | "y"\n')
    assert structured_outputs(parse()) is None
    assert structured_outputs(parse("--json-schema", str(schema))) == StructuredOutputsParams(
        json={"type": "object", "required": ["a"]})
    assert structured_outputs(parse("--regex", "[0-9]+")) == StructuredOutputsParams(regex="[0-9]+")
    assert structured_outputs(parse("--choice", "red,green")) == StructuredOutputsParams(choice=["red", "green"])
    assert structured_outputs(parse("--grammar", str(grammar))) == StructuredOutputsParams(grammar='start: "x" | "y"\n')


def test_jsonl_lines_carry_their_own_constraint(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a", "structured_outputs": {"choice": ["x", "y"]}}) + "\n"
                       + json.dumps({"prompt": "b"}) + "\n")
    args = _parser().parse_args(["generate", "--prompts", str(prompts), "--regex", "z+"])
    defaults = {"structured_outputs": structured_outputs(args)}
    first, second = (sampling_params(item, defaults) for item in read_requests(args))
    assert first.structured_outputs == StructuredOutputsParams(choice=["x", "y"])
    assert second.structured_outputs == StructuredOutputsParams(regex="z+")


def test_two_constraints_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "p", "--regex", "a", "--choice", "a,b"])
    assert exit_.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--json-schema", "missing.json"], "cannot read missing.json"),
    (["--choice", ","], "empty list"),
])
def test_bad_constraints_are_one_line_errors(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "p", "--mesh", "1x1", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxinfer generate: error:") and message in err[0]


def test_schema_that_is_not_json_names_the_file(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    assert main(["generate", "p", "--mesh", "1x1", "--json-schema", str(bad)]) == 2
    assert f"--json-schema {bad}: StructuredOutputsParams json is not JSON" in capsys.readouterr().err
