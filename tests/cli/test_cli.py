"""The `jaxinfer` command: score and convert, and one-line errors for bad input."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import jaxinfer
from jaxinfer import LLM
from jaxinfer.cli import compilation_cache_dir, main
from jaxinfer.compile_cache import enable_compilation_cache


def test_quickstart_command_in_a_fresh_process(tmp_path):
    """A CLI command in a fresh process with its own 8 simulated CPU devices; its compiled programs land in the
    --compilation-cache directory."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # cache every program, however fast it compiled
    proc = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "score", "--preset", "tiny", "--cpu-devices", "8",
                           "--mesh", "1x8", "--token-ids", "1", "5", "9", "42", "7",
                           "--compilation-cache", str(tmp_path / "xla")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["token_ids"] == [1, 5, 9, 42, 7] and len(result["token_logprobs"]) == 5
    assert "mesh 1x8" in proc.stderr
    assert any((tmp_path / "xla").iterdir())


def test_compilation_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compilation_cache_dir(None) == str(tmp_path / "jaxinfer" / "jax")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/somewhere")
    assert compilation_cache_dir(None) == "/somewhere"
    assert compilation_cache_dir("/flag") == "/flag"
    assert compilation_cache_dir("off") is None


def test_llm_compilation_cache_option(monkeypatch, tmp_path):
    """LLM(compilation_cache=...): None keeps JAX's directory or sets the default one, a path sets it, "off" leaves
    JAX alone; a bad value is a ValueError before anything loads."""
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", "/already")
        assert enable_compilation_cache(None) == "/already" and enable_compilation_cache("off") == "/already"
        jax.config.update("jax_compilation_cache_dir", None)
        assert enable_compilation_cache("off") is None and jax.config.jax_compilation_cache_dir is None
        assert enable_compilation_cache(None) == str(tmp_path / "jaxinfer" / "jax")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "jaxinfer" / "jax")
        assert enable_compilation_cache(str(tmp_path / "mine")) == str(tmp_path / "mine")
        for bad in (3, ""):
            with pytest.raises(ValueError, match="compilation_cache"):
                LLM(compilation_cache=bad)
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_score_matches_model_logits(capsys):
    ids = [3, 1, 4, 1, 5, 9]
    assert main(["score", "--preset", "tiny", "--mesh", "1x1", "--dtype", "float32", "--token-ids",
                 *map(str, ids)]) == 0
    result = json.loads(capsys.readouterr().out)
    # Independent of the CLI's arithmetic: log-softmax of the model's own logits, computed here.
    logits = jaxinfer.Model.random(jaxinfer.ModelConfig.tiny(), mesh="1x1", dtype="float32").logits([ids])[0]
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    np.testing.assert_allclose(result["token_logprobs"][1:], [logp[t - 1, ids[t]] for t in range(1, 6)], rtol=1e-5)
    assert result["next_token_id"] == int(logits[-1].argmax())


@pytest.mark.parametrize("argv, message", [
    (["score", "--preset", "tiny", "--mesh", "1x1", "--token-ids", "1", "999"], "outside the vocabulary"),
    (["score", "--preset", "nope", "--token-ids", "1"], "unknown preset"),
    (["score", "--preset", "tiny", "--mesh", "3x3", "--token-ids", "1"], "needs 9 devices"),
    (["score", "--preset", "tiny", "--mesh", "1x1", "some text"], "tokenizer.json"),
])
def test_bad_input_prints_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith("jaxinfer score: error:")


def test_convert_then_score_orbax(tmp_path, capsys):
    model = jaxinfer.Model.random(jaxinfer.ModelConfig.tiny(num_hidden_layers=2), mesh="1x1", dtype="float32")
    model.save(tmp_path / "a")  # an orbax dir is also a valid `convert` input
    assert main(["convert", str(tmp_path / "a"), str(tmp_path / "b"), "--mesh", "1x1", "--dtype", "float32"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip().endswith("b") and "fp8 kept: as saved" in captured.err
    for flag in ("--keep-fp8", "--no-keep-fp8"):  # the orbax dir's own layout: the flags have nothing to choose
        assert main(["convert", str(tmp_path / "a"), str(tmp_path / "c"), "--mesh", "1x1", flag]) == 2
        assert "is a jaxinfer orbax directory, which keeps the layout it was saved with" in capsys.readouterr().err
    ids = [[2, 7, 1, 8]]
    np.testing.assert_array_equal(jaxinfer.load_model(tmp_path / "b", mesh="1x1", dtype="float32").logits(ids),
                                  model.logits(ids))
