"""`jaxinfer sweep` (meshes x batch sizes -> CSV, plots, table) and `jaxinfer bench` (one-batch and throughput JSON).

Checks: the sweep on two CPU meshes writes a row per mesh and batch with positive figures and the plots; dispatch
bytes follow DeepEP's formats (FP8 / BF16 = (H + 4H/128) / 2H per send) and stay within top-k remote sends per
token and MoE layer; the bench figures obey SGLang's / vLLM's definitions among themselves; bad arguments print
one line and exit 2; each mesh file gets the process layout its platform needs (CPU: simulated devices; GPU:
nothing forced). Timings are measured, never asserted.
"""

import csv
import json
import os
import pathlib
import subprocess
import sys

import matplotlib.image
import pytest

import jaxinfer
from jaxinfer import bench, default_model, sweep
from jaxinfer.cli import main
from jaxinfer.parallel.mesh import read_mesh_file

MESHES = pathlib.Path(__file__).resolve().parents[2] / "meshes"
CPU_1X1, CPU_1X8 = str(MESHES / "cpu-1x1.toml"), str(MESHES / "cpu-1x8.toml")

ONE_BATCH_FIGURES = ("prefill_latency_s", "prefill_throughput_tok_s", "median_decode_latency_s",
                     "median_decode_throughput_tok_s", "total_latency_s", "overall_throughput_tok_s", "ttft_s",
                     "tpot_s")
THROUGHPUT_KEYS_POSITIVE = ("total_input_tokens", "total_output_tokens", "elapsed_s", "requests_per_s",
                            "input_tok_s", "output_tok_s", "total_tok_s", "ttft_p50_s", "tpot_p50_s")


def test_sweep_on_a_cpu_mesh_and_a_prefill_decode_pair(tmp_path, capsys, monkeypatch):
    """The sweep end to end (a 1x8 mesh, and prefill/decode disaggregation on 1x1 + 1x1); its bench processes' JSON
    (`jaxinfer bench --mode one-batch --json`) is checked too."""
    bench_results, run_mesh = [], sweep.run_mesh

    def recording_run_mesh(*args, **kwargs):
        results = run_mesh(*args, **kwargs)
        bench_results.extend(results)
        return results

    monkeypatch.setattr(sweep, "run_mesh", recording_run_mesh)
    out = tmp_path / "sweep"
    assert main(["sweep", "--meshes", CPU_1X8, "--pd-meshes", f"{CPU_1X1}:{CPU_1X1}", "--batch-sizes", "1,2",
                 "--input-len", "8", "--output-len", "4", "--out", str(out)]) == 0
    table = capsys.readouterr().out.strip().splitlines()
    assert table[0].split() == list(sweep.CSV_COLUMNS) and len(table) == 5

    with open(out / "sweep.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == sweep.CSV_COLUMNS
        rows = list(reader)
    pd = "cpu-1x1:cpu-1x1"
    assert [(r["mesh"], r["batch"]) for r in rows] == [("cpu-1x8", "1"), ("cpu-1x8", "2"), (pd, "1"), (pd, "2")]
    config = jaxinfer.ModelConfig.from_hf_config(default_model.path())
    h = config.hidden_size
    # A bfloat16 page of latents: layers x 64 tokens x (kv_lora_rank + qk_rope_head_dim) x 2 bytes.
    page_bytes = config.num_hidden_layers * 64 * (config.kv_lora_rank + config.qk_rope_head_dim) * 2
    for r in rows:
        # devices, data, expert (the decode mesh's), prefill_devices, decode_devices; latents handed over
        devices = {pd: (2, 1, 1, 1, 1), "cpu-1x8": (8, 1, 8, 8, 8)}[r["mesh"]]
        assert tuple(int(r[c]) for c in ("devices", "data", "expert", "prefill_devices", "decode_devices")) == devices
        assert int(r["kv_transfer_bytes"]) == (int(r["batch"]) * page_bytes if r["mesh"] == pd else 0)
        for column in ("prefill_tok_s", "decode_tok_s", "decode_tok_s_per_device", "ttft_s", "tpot_s"):
            assert float(r[column]) > 0, (r["mesh"], r["batch"], column)
        assert float(r["decode_tok_s_per_device"]) * devices[0] == pytest.approx(float(r["decode_tok_s"]))
        bf16, fp8 = float(r["dispatch_bytes_per_token"]), float(r["dispatch_bytes_per_token_fp8"])
        if r["mesh"] == pd:
            assert bf16 == fp8 == 0  # every expert is on the decode engine's one device: nothing is sent
        else:
            # at most min(top-k, other ranks) sends of 2H bytes per token and MoE layer (DeepEP: once per rank)
            assert 0 < bf16 <= config.num_moe_layers * min(config.num_experts_per_tok, 7) * 2 * h
            assert fp8 / bf16 == pytest.approx((h + 4 * h / 128) / (2 * h))

    for name in sweep.PLOTS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        height, width, _ = matplotlib.image.imread(out / name).shape
        assert height >= 300 and width >= 400
    assert sweep.read_csv(out / "sweep.csv")[3]["batch"] == 2

    assert [(r["mesh"], r["batch_size"]) for r in bench_results] == [(r["mesh"], int(r["batch"])) for r in rows]
    for r in bench_results:
        assert set(bench.ONE_BATCH_KEYS + bench.DISPATCH_KEYS) <= set(r)
        assert r["mode"] == "one-batch" and r["platform"] == "cpu"
        for key in ONE_BATCH_FIGURES:
            assert r[key] > 0, key
        b = r["batch_size"]
        # SGLang bench_one_batch's definitions
        assert r["prefill_throughput_tok_s"] == pytest.approx(b * 8 / r["prefill_latency_s"])
        assert r["median_decode_throughput_tok_s"] == pytest.approx(b / r["median_decode_latency_s"])
        assert r["overall_throughput_tok_s"] == pytest.approx(b * 12 / r["total_latency_s"])
        assert r["ttft_s"] <= r["prefill_latency_s"] < r["total_latency_s"]
        assert "Prefill. latency:" in bench.format_result(r) and "median throughput" in bench.format_result(r)


def test_bench_throughput_json():
    """In a fresh process on one CPU device, like the sweep's: the programs are those the sweep compiled (one
    sequence at a time, one prefill of 16 columns) and come from the persistent compilation cache."""
    n = 5
    proc = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "bench", "--mode", "throughput", "--mesh", CPU_1X1,
                           "--cpu-devices", "1", "--num-prompts", str(n), "--input-len", "8", "--output-len", "4",
                           "--random-range-ratio", "0.5", "--max-num-seqs", "1", "--max-num-batched-tokens", "16",
                           "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert set(bench.THROUGHPUT_KEYS) <= set(r) and r["mode"] == "throughput" and r["mesh"] == "cpu-1x1"
    for key in THROUGHPUT_KEYS_POSITIVE:
        assert r[key] > 0, key
    # vLLM's random lengths: uniform in [L(1 - r), L(1 + r)]; ignore_eos: every request makes its full output
    assert n * 4 <= r["total_input_tokens"] <= n * 12 and n * 2 <= r["total_output_tokens"] <= n * 6
    assert r["requests_per_s"] == pytest.approx(n / r["elapsed_s"])
    assert r["total_tok_s"] == pytest.approx(r["input_tok_s"] + r["output_tok_s"])
    assert r["output_tok_s"] == pytest.approx(r["total_output_tokens"] / r["elapsed_s"])
    assert r["ttft_p50_s"] <= r["ttft_p99_s"] and r["tpot_p50_s"] <= r["tpot_p99_s"]
    assert "requests/s" in bench.format_result(r)


@pytest.mark.parametrize("argv, message", [
    (["sweep", "--meshes", "meshes/nope.toml"], "mesh file meshes/nope.toml does not exist"),
    (["sweep", "--meshes", CPU_1X1, "--batch-sizes", "1,,8"], "--batch-sizes must be positive integers"),
    (["sweep", "--meshes", CPU_1X1, "--batch-sizes", "8,0"], "got '8,0'"),
    (["sweep", "--meshes", CPU_1X1, "--output-len", "1"], "--output-len must be >= 2"),
    (["sweep", "--meshes", str(MESHES / "gpu-2x8.toml")], "run the same sweep on every host"),
    (["sweep", "--meshes", CPU_1X1, "--coordinator", "10.0.0.1:1234"], "need all of --coordinator"),
    (["sweep", "--meshes", CPU_1X1, "--model", "no/such/dir"], "--model no/such/dir is not a directory"),
    (["bench", "--mesh", "1x1", "--batch-size", "2", "x"], "--batch-size must be positive integers"),
    (["bench", "--mesh", "1x1", "--mode", "throughput", "--random-range-ratio", "1"], "--random-range-ratio"),
    (["bench", "--mesh", "1x1", "--mode", "throughput", "--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["bench", "--mesh", "meshes/nope.toml"], "does not exist"),
    (["bench", "--mesh", "3x3"], "needs 9 devices"),
    (["sweep"], "--meshes or --pd-meshes needs at least one mesh file"),
    (["sweep", "--pd-meshes", CPU_1X1], "--pd-meshes takes PREFILL.toml:DECODE.toml pairs"),
    (["sweep", "--pd-meshes", f"{CPU_1X1}:{MESHES / 'cpu-2proc-2x4.toml'}"], "must be single-process"),
    (["bench", "--prefill-mesh", "1x1"], "--prefill-mesh and --decode-mesh go together"),
    (["bench", "--mesh", "1x1", "--prefill-mesh", "1x1", "--decode-mesh", "1x1"], "each engine has its own mesh"),
    (["bench", "--prefill-mesh", "1x4", "--decode-mesh", "1x8"], "need 12 devices"),
    (["generate", "--role", "decode"], "--role and --pd-address go together"),
    (["generate", "--role", "decode", "--pd-address", "127.0.0.1:1", "a prompt"], "takes no prompts"),
    (["generate", "--role", "decode", "--pd-address", "127.0.0.1:1", "--coordinator", "127.0.0.1:2",
      "--num-processes", "2", "--process-id", "0"], "a prefill or decode unit spanning processes"),
    (["generate", "--role", "prefill", "--pd-address", "no-port", "a prompt"], "pd_address must be HOST:PORT"),
    (["generate", "--role", "prefill", "--pd-address", "127.0.0.1:1", "--pd-connect-timeout", "0", "a prompt"],
     "pd_connect_timeout must be a number of seconds > 0, got 0.0"),
])
def test_bad_arguments_print_one_line(argv, message, capsys, tmp_path):
    if argv[0] == "sweep":
        argv = argv + ["--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"jaxinfer {argv[0]}: error:") and message in err[0], err
    assert not (tmp_path / "out").exists()


def test_bad_arguments_exit_code_of_the_command(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "sweep", "--meshes", CPU_1X1, "--batch-sizes",
                           "one", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "jaxinfer sweep: error: --batch-sizes must be positive integers (e.g. 1,8,32), got 'one'"]


def test_out_must_be_a_directory(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(["sweep", "--meshes", CPU_1X1, "--out", str(tmp_path / "file")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_each_mesh_file_gets_its_process_layout(monkeypatch):
    """CPU meshes: simulated devices per process and the CPU platform; GPU meshes: nothing forced; multi-process
    meshes: local processes on CPU, one process per host (port PORT + mesh index) across GPU hosts."""
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")

    def commands(name, **kw):
        path = MESHES / name
        return sweep.bench_commands(path, read_mesh_file(path), [1, 8], 16, 4, **kw)

    def flag(cmd, name):
        return cmd[cmd.index(name) + 1] if name in cmd else None

    [cpu] = commands("cpu-1x8.toml")
    assert cpu[:4] == [sys.executable, "-m", "jaxinfer.cli", "bench"] and flag(cpu, "--cpu-devices") == "8"
    assert cpu[cpu.index("--batch-size") + 1: cpu.index("--batch-size") + 3] == ["1", "8"]
    assert sweep.child_env(read_mesh_file(MESHES / "cpu-1x8.toml"))["JAX_PLATFORMS"] == "cpu"

    [gpu] = commands("gpu-1x8.toml", model="/ckpt", dtype="float32")
    assert flag(gpu, "--cpu-devices") is None and flag(gpu, "--coordinator") is None
    assert flag(gpu, "--model") == "/ckpt" and flag(gpu, "--dtype") == "float32"
    assert sweep.child_env(read_mesh_file(MESHES / "gpu-1x8.toml"))["JAX_PLATFORMS"] == "cuda"

    two = commands("cpu-2proc-2x4.toml")
    assert [flag(c, "--process-id") for c in two] == ["0", "1"] and {flag(c, "--cpu-devices") for c in two} == {"4"}
    assert flag(two[0], "--coordinator") == flag(two[1], "--coordinator")
    assert flag(two[0], "--coordinator").startswith("127.0.0.1:")

    [host1] = commands("gpu-2x8.toml", index=3, multi_host=("10.0.0.1:1234", 2, 1))
    assert flag(host1, "--coordinator") == "10.0.0.1:1237" and flag(host1, "--process-id") == "1"
    assert flag(host1, "--num-processes") == "2" and flag(host1, "--cpu-devices") is None
    assert os.environ["JAX_PLATFORMS"] == "cuda"
