"""`jaxinfer generate` and `jaxinfer bench` with MTP speculative decoding (--speculative-tokens K, 0 = off;
--speculative-verify all | confidence).

Checks: the flags build the engine's speculative_config; contradicting flags are an argparse usage error naming
both, a K outside [1, 16] the engine's ValueError as one line; generation prints one line of vLLM-style
spec-decode counts that agree with the completions' metrics; bench results carry SPECULATIVE_KEYS (zeros when off) and the same line. Counts are checked against each other,
never timings.
"""

import json
import re
import types

import pytest

from jaxinfer import EngineStats, bench
from jaxinfer.cli import _parser, main
from jaxinfer.engine.speculative import SpeculativeConfig

# notebooks/05_speculative_decoding.ipynb's engine (float32, 1x1, K = 3, the defaults otherwise) and its prompt:
# the same step programs, compiled once for both through the shared compilation cache (tests/conftest.py).
PROMPT = "The with statement is used to"
GREEDY = ["--max-tokens", "5", "--temperature", "0", "--mesh", "1x1", "--dtype", "float32"]
LINE = re.compile(r"[Ss]peculative decoding \(mtp, K (\d+), verify (\w+)\): drafts (\d+), draft tokens (\d+), "
                  r"accepted (\d+) \(([\d.]+)%\), mean acceptance length ([\d.]+), "
                  r"accepted per position \[([\d, ]*)\] \(rate ([\d., ]*)\)")


def parse_line(text: str) -> dict:
    """The one speculative-decoding line of ``text`` -> its numbers."""
    found = [m for m in map(LINE.search, text.splitlines()) if m]
    assert len(found) == 1, text
    k, verify, drafts, draft_tokens, accepted, percent, mean, per, rates = found[0].groups()
    return dict(k=int(k), verify=verify, drafts=int(drafts), draft_tokens=int(draft_tokens), accepted=int(accepted),
                percent=float(percent), mean=float(mean), per=[int(x) for x in per.split(",")],
                rates=[float(x) for x in rates.split(",")])


def check_counts(m: dict, k: int) -> None:
    """vLLM's spec-decode definitions among the line's numbers."""
    assert m["k"] == k and len(m["per"]) == len(m["rates"]) == k
    assert 0 < m["drafts"] and m["drafts"] <= m["draft_tokens"] <= k * m["drafts"]
    assert sum(m["per"]) == m["accepted"] <= m["draft_tokens"]
    assert all(a >= b for a, b in zip(m["per"], m["per"][1:])) and m["per"][0] <= m["drafts"]
    assert m["percent"] == pytest.approx(100 * m["accepted"] / m["draft_tokens"], abs=0.05)
    assert m["mean"] == pytest.approx(1 + m["accepted"] / m["drafts"], abs=0.005)
    assert m["rates"] == pytest.approx([a / m["drafts"] for a in m["per"]], abs=5e-4)


@pytest.mark.parametrize("command", [["generate", "p"], ["bench"]])
def test_flags_build_speculative_config(command):
    parse = _parser().parse_args
    assert bench.speculative_config(parse(command)) is None  # off by default
    assert bench.speculative_config(parse(command + ["--speculative-tokens", "0"])) is None
    assert bench.speculative_config(parse(command + ["--speculative-tokens", "3"])) == {
        "method": "mtp", "num_speculative_tokens": 3, "verify": "all"}
    config = bench.speculative_config(parse(command + ["--speculative-tokens", "2", "--speculative-verify",
                                                       "confidence"]))
    assert config == {"method": "mtp", "num_speculative_tokens": 2, "verify": "confidence"}
    assert SpeculativeConfig.parse(config) == SpeculativeConfig("mtp", 2, "confidence")  # the engine takes it


@pytest.mark.parametrize("command", [["generate", "p"], ["bench"]])
def test_verify_without_tokens_is_a_usage_error(command, capsys):
    for extra in ([], ["--speculative-tokens", "0"]):
        with pytest.raises(SystemExit) as exit_:
            main(command + ["--speculative-verify", "confidence", *extra])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"usage: jaxinfer {command[0]} ")
        assert err.strip().splitlines()[-1] == (f"jaxinfer {command[0]}: error: --speculative-verify confidence needs "
                                                "--speculative-tokens K >= 1 (0, the default, turns speculative "
                                                "decoding off)")
    with pytest.raises(SystemExit) as exit_:
        main(command + ["--speculative-tokens", "2", "--speculative-verify", "some"])
    assert exit_.value.code == 2 and "invalid choice: 'some'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, k", [
    (["generate", "p", "--mesh", "1x1", "--speculative-tokens", "17"], 17),
    (["generate", "p", "--mesh", "1x1", "--speculative-tokens", "-1", "--speculative-verify", "confidence"], -1),
    (["bench", "--mesh", "1x1", "--speculative-tokens", "17"], 17),
])
def test_speculative_tokens_out_of_range_prints_one_line(argv, k, capsys):
    """The engine's ValueError (raised by EngineConfig before any weights load), as the CLI prints others."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"jaxinfer {argv[0]}: error: speculative_config num_speculative_tokens must be an int in [1, 16], "
                   f"got {k}"]


def test_generate_speculative_prints_its_counts(capsys):
    """generate --speculative-tokens 3: the usual completion and summary, plus one line of spec-decode counts
    equal to the completion's metrics. (Greedy outputs with and without speculation are compared in
    tests/engine/test_speculative.py.)"""
    assert main(["generate", PROMPT, *GREEDY, "--speculative-tokens", "3"]) == 0
    captured = capsys.readouterr()
    spec = [json.loads(line) for line in captured.out.splitlines()]
    assert [len(line["token_ids"]) for line in spec] == [5]
    assert "requests 1" in captured.err  # the usual summary stays
    m = parse_line(captured.err)
    assert m["verify"] == "all"
    check_counts(m, 3)
    assert m["draft_tokens"] == sum(line["metrics"]["num_draft_tokens"] for line in spec)
    assert m["accepted"] == sum(line["metrics"]["num_accepted_tokens"] for line in spec)


class _FakeLLM:
    """What bench.one_batch reads of an LLM: generate (finished outputs with timing metrics), stats, config, model
    (the engine's counts themselves are tested in tests/engine/test_speculative.py)."""

    def __init__(self, stats):
        self.stats = stats
        self.config = types.SimpleNamespace(speculative_config=SpeculativeConfig("mtp", 2, "all"))
        self.model = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=64))

    def generate(self, prompts, params, use_tqdm=False):
        completion = types.SimpleNamespace(finish_reason="length", error=None)
        return [types.SimpleNamespace(outputs=[completion], metrics={"ttft_s": 0.01, "tpot_s": 0.002})
                for _ in prompts]


def test_bench_speculative_keys():
    """bench's one-batch result carries SPECULATIVE_KEYS of the timed call's stats in vLLM's definitions; the text
    form has the same line."""
    stats = EngineStats(num_drafts=5, num_draft_tokens=10, num_accepted_tokens=7, accepted_per_position=[4, 3])
    r = bench.one_batch(_FakeLLM(stats), 2, 8, 6, warmup=False)
    assert set(bench.SPECULATIVE_KEYS) <= set(r)
    assert (r["speculative_tokens"], r["speculative_verify"]) == (2, "all")
    assert (r["num_drafts"], r["num_draft_tokens"], r["num_accepted_tokens"], r["accepted_per_position"]) == (
        5, 10, 7, [4, 3])
    assert r["draft_acceptance_rate"] == pytest.approx(0.7) and r["mean_acceptance_length"] == pytest.approx(2.4)
    m = parse_line(bench.format_speculative(r, "Speculative decoding"))
    check_counts(m, 2)
    assert (m["drafts"], m["draft_tokens"], m["accepted"], m["per"]) == (5, 10, 7, [4, 3])


def test_bench_speculative_keys_when_off():
    """Speculation off: the same keys, no None (a stable schema), and no speculative line in the text form."""
    off = bench.speculative_metrics(EngineStats(), None)
    assert tuple(off) == bench.SPECULATIVE_KEYS
    assert off == dict(speculative_tokens=0, speculative_verify="off", num_drafts=0, num_draft_tokens=0,
                       num_accepted_tokens=0, draft_acceptance_rate=0.0, mean_acceptance_length=1.0,
                       accepted_per_position=[])
    on_idle = bench.speculative_metrics(EngineStats(), SpeculativeConfig("mtp", 3, "confidence"))
    assert on_idle["accepted_per_position"] == [0, 0, 0] and on_idle["draft_acceptance_rate"] == 0.0
    assert bench.format_speculative(on_idle).endswith("accepted per position [0, 0, 0] (rate 0.000, 0.000, 0.000)")
