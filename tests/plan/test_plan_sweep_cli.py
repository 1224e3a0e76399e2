"""``jaxinfer.plan.sweep`` (rows, CSV, plot) and ``jaxinfer plan`` (plan/cli.py), against facts outside their code:
each row is ``predict`` called directly for its ep (the plumbing adds and drops nothing), nodes are ep / 8 on
8-GPU nodes, DeepSeek-V3's 256 routed experts + 32 redundant ones (288 slots) split over ep = 144 but not 64, a CSV
reads back to the same values, a PNG starts with PNG's signature, and nothing here imports JAX.
"""

import csv
import subprocess
import sys

import pytest

from jaxinfer import cli
from jaxinfer.plan import predict
from jaxinfer.plan.sweep import COLUMNS, plot, sweep, write_csv

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# small enough to fit in an H800's 80 GB from 64 GPUs up, with no redundant experts (256 slots)
DECODE = dict(requests_per_gpu=32, context_len=2048)
PREFILL = dict(tokens_per_gpu=8192, prompt_len=4096, cache_hit_rate=0.5)
DECODE_FLAGS = ["--requests-per-gpu", "32", "--context-len", "2048"]


def _same_as_predict(row, phase, kwargs):
    r = predict(phase=phase, ep=row["ep"], **kwargs)
    latency = "tpot_s" if phase == "decode" else "ttft_s"
    assert row["error"] is None and row["phase"] == phase
    for key in ("tok_s_per_gpu", "tok_s_per_node", "step_s", latency, "bound"):
        assert row[key] == r[key], key
    assert ("ttft_s" if phase == "decode" else "tpot_s") not in row  # a row carries its phase's latency only
    assert row["memory_per_gpu_gb"] == r["memory_per_gpu_bytes"] / 1e9
    assert row["headroom_gb"] == r["memory"]["headroom_bytes"] / 1e9
    for key, value in r["inputs"].items():
        if key in row and key not in ("model", "hardware"):
            assert row[key] == value, key


def test_sweep_rows_are_predict_per_ep():
    eps = [64, 128, 256]
    rows = sweep(eps, "decode", **DECODE)
    assert [r["ep"] for r in rows] == eps
    assert [r["nodes"] for r in rows] == [8, 16, 32]  # H800 nodes hold 8 GPUs
    assert {(r["model"], r["hardware"]) for r in rows} == {("deepseek-v3", "h800")}
    for row in rows:
        _same_as_predict(row, "decode", DECODE)
        assert set(row) == set(COLUMNS) - {"ttft_s"}


def test_an_ep_that_does_not_divide_the_slots_gives_an_error_row_and_the_others_stand():
    kwargs = dict(PREFILL, num_redundant_experts=32)  # 288 slots: 144 and 288 divide them, 64 does not
    rows = sweep([144, 64, 288], "prefill", **kwargs)
    assert [r["ep"] for r in rows] == [144, 64, 288]
    bad = rows[1]
    assert bad["error"].split(":")[0] == "ep" and "288" in bad["error"]
    assert bad["nodes"] == 8 and bad["num_redundant_experts"] == 32 and bad["tokens_per_gpu"] == 8192
    for key in ("tok_s_per_gpu", "tok_s_per_node", "step_s", "ttft_s", "bound", "memory_per_gpu_gb", "headroom_gb"):
        assert bad[key] is None, key
    assert set(bad) == set(rows[0])  # the same columns: a table of the sweep lines up
    _same_as_predict(rows[0], "prefill", kwargs)
    _same_as_predict(rows[2], "prefill", kwargs)


def test_a_bad_model_or_hardware_raises_instead_of_failing_every_row():
    with pytest.raises(ValueError, match="hardware"):
        sweep([64], "decode", hardware="no-such-gpu", **DECODE)
    with pytest.raises(ValueError, match="model"):
        sweep([64], "decode", model="no-such-model", **DECODE)


def test_csv_round_trips(tmp_path):
    rows = sweep([64, 100], "decode", **DECODE) + sweep([64], "prefill", **PREFILL)  # 100 does not divide 256
    path = write_csv(rows, tmp_path / "plan.csv")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames
        back = list(reader)
    assert header == [c for c in COLUMNS if c in {k for r in rows for k in r}]
    assert "tpot_s" in header and "ttft_s" in header
    assert len(back) == len(rows)
    for row, read in zip(rows, back):
        for key in header:
            value = row.get(key)
            if value is None:
                assert read[key] == "", key
            elif isinstance(value, (bool, str)):
                assert read[key] == str(value), key
            else:
                assert float(read[key]) == value, key  # repr-exact floats
    assert back[1]["error"].startswith("ep:") and back[1]["tok_s_per_gpu"] == ""


def test_plot_writes_a_png(tmp_path):
    rows = sweep([64, 128], "decode", **DECODE) + sweep([64, 100, 128], "prefill", **PREFILL)
    path = plot(rows, tmp_path / "plan.png")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    only_errors = sweep([100], "decode", **DECODE)
    assert plot(only_errors, tmp_path / "none.png").read_bytes()[:8] == PNG_SIGNATURE


def test_cli_sweep_prints_a_line_per_ep(capsys, monkeypatch):
    def no_jax(args):
        raise AssertionError("jaxinfer plan started JAX")

    monkeypatch.setattr(cli, "_start_jax", no_jax)
    eps = [64, 128, 256]
    assert cli.main(["plan", "--ep", ",".join(map(str, eps)), *DECODE_FLAGS]) == 0
    out, err = capsys.readouterr()
    header, *lines = out.strip().splitlines()
    assert header.split()[:2] == ["ep", "nodes"] and "TPOT" in header
    assert len(lines) == len(eps)
    for ep, line in zip(eps, lines):
        cells = line.split()
        assert cells[:2] == [str(ep), str(ep // 8)]
        assert cells[2] == f"{predict(ep=ep, **DECODE)['tok_s_per_gpu']:.0f}"
    assert "error" not in err


def test_cli_sweep_keeps_going_past_an_ep_that_cannot_run(capsys):
    assert cli.main(["plan", "--phase", "prefill", "--ep", "144,64", "--redundant-experts", "32", "--tokens-per-gpu",
                     "8192", "--prompt-len", "4096", "--cache-hit-rate", "0.5"]) == 0
    header, good, bad = capsys.readouterr().out.strip().splitlines()
    assert "TTFT" in header
    assert good.split()[:2] == ["144", "18"] and "error" not in good
    assert bad.split()[:2] == ["64", "8"] and "error: --ep:" in bad


def test_cli_one_deployment_prints_its_parts(capsys):
    assert cli.main(["plan", "--ep", "64", *DECODE_FLAGS]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[1].split()[:2] == ["64", "8"]
    breakdown = "\n".join(lines[2:])
    for part in predict(ep=64, **DECODE)["parts"]:
        assert part in breakdown


def test_cli_plans_deepseek_v4_flash_on_an_nvl72_rack(capsys):
    """The README's V4 command: one NVLink domain of 72 GPUs holds EP64 (one "node"), and the line is predict's."""
    argv = ["--model", "deepseek-v4-flash", "--hardware", "gb200", "--ep", "64", "--requests-per-gpu", "256",
            "--context-len", "131072", "--mtp-acceptance", "0.75", "--mtp-drafts", "3", "--redundant-experts", "64"]
    assert cli.main(["plan", *argv]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    expected = predict(model="deepseek-v4-flash", hardware="gb200", ep=64, requests_per_gpu=256, context_len=131072,
                       mtp_acceptance=0.75, mtp_drafts=3, num_redundant_experts=64)
    assert lines[1].split()[:3] == ["64", "1", f"{expected['tok_s_per_gpu']:.0f}"]
    assert "indexer" in "\n".join(lines[2:])


@pytest.mark.parametrize("argv, flag", [
    (["--ep", "64", "--redundant-experts", "32", *DECODE_FLAGS], "--ep"),     # 64 does not divide 288 slots
    (["--ep", "8,x", *DECODE_FLAGS], "--ep"),
    (["--ep", "0", *DECODE_FLAGS], "--ep"),
    (["--ep", "64"], "--requests-per-gpu"),                                    # decode needs the requests
    (["--ep", "64", "--phase", "prefill"], "--tokens-per-gpu"),
    (["--ep", "64", "--hardware", "no-such-gpu", *DECODE_FLAGS], "--hardware"),
    (["--ep", "64", "--model", "no-such-model", *DECODE_FLAGS], "--model"),
    (["--ep", "64", "--cache-hit-rate", "1.5", "--phase", "prefill", "--tokens-per-gpu", "8192"], "--cache-hit-rate"),
    (["--ep", "64", *DECODE_FLAGS, "--tokens-per-gpu", "8192"], "--tokens-per-gpu"),  # a prefill flag in decode
    (["--ep", "64", "--phase", "prefill", "--tokens-per-gpu", "8192", *DECODE_FLAGS], "--requests-per-gpu"),
    (["--ep", "64", *DECODE_FLAGS, "--mtp-drafts", "2"], "--mtp-drafts"),           # drafts without acceptance
    (["--ep", "64", *DECODE_FLAGS, "--gpus-per-node", "0"], "--gpus-per-node"),
])
def test_cli_errors_name_the_flag(argv, flag, capsys):
    assert cli.main(["plan", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"jaxinfer plan: error: {flag}:")


def test_cli_out_writes_the_csv_and_the_plot(tmp_path, capsys):
    out = tmp_path / "plan"
    assert cli.main(["plan", "--ep", "64,100,128", *DECODE_FLAGS, "--out", str(out)]) == 0
    with open(out / "plan.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["ep"] for r in rows] == ["64", "100", "128"]
    assert rows[1]["error"].startswith("ep:") and not rows[0]["error"]
    assert (out / "plan.png").read_bytes()[:8] == PNG_SIGNATURE


def test_a_sweep_none_of_which_can_run_exits_1(capsys):
    assert cli.main(["plan", "--ep", "100,200", *DECODE_FLAGS]) == 1
    out, err = capsys.readouterr()
    assert len(out.strip().splitlines()) == 3 and "no deployment" in err


def test_plan_imports_no_jax():
    code = "import sys, jaxinfer.plan.sweep, jaxinfer.plan.cli; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
