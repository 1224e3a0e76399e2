"""Multi-process runs: 2 local processes x 4 CPU devices (jax.distributed on 127.0.0.1, gloo collectives) form one
8-device mesh and give the same results as this single process on its 8 simulated devices.

Each spawned group has a deadline (SPAWN_TIMEOUT_S) and is killed on failure; the processes share this session's
persistent compilation cache (JAX_COMPILATION_CACHE_DIR, set by conftest).
"""

import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxinfer
import multihost_worker as worker
from jaxinfer.cli import main
from jaxinfer.parallel import multihost
from jaxinfer.parallel.mesh import make_mesh

ROOT = pathlib.Path(__file__).resolve().parents[2]
NUM_PROCESSES, LOCAL_DEVICES = 2, 4
SPAWN_TIMEOUT_S = 240
IDS = [3, 1, 4, 1, 5, 9, 2, 6]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env() -> dict[str, str]:
    """This environment without the simulated device count (each child sets its own with --cpu-devices)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    return env


def _run_group(argv_of, tmp_path: pathlib.Path, expected_rc: int = 0) -> list[tuple[int, str, str]]:
    """Starts one process per process id with argv_of(coordinator, process_id); waits for all of them (killing
    the rest when one exits with another code than expected_rc, or at the deadline). Returns
    [(returncode, stdout, stderr)] by process id."""
    coordinator = f"127.0.0.1:{_free_port()}"
    procs, logs = [], []
    for i in range(NUM_PROCESSES):
        out, err = open(tmp_path / f"p{i}.out", "w+"), open(tmp_path / f"p{i}.err", "w+")
        logs.append((out, err))
        procs.append(subprocess.Popen(argv_of(coordinator, i), stdout=out, stderr=err, cwd=ROOT, env=_child_env()))
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs):
            failed = any(p.poll() not in (None, expected_rc) for p in procs)
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for p, (out, err) in zip(procs, logs):
        out.seek(0), err.seek(0)
        results.append((p.returncode, out.read(), err.read()))
        out.close(), err.close()
    return results


def _describe(results) -> str:
    return "\n".join(f"--- process {i}: rc={rc}\n{err[-3000:]}" for i, (rc, _, err) in enumerate(results))


# ---- single process: global_array / to_host on the 8 simulated devices -----------------------------------------
@pytest.mark.parametrize("spec", [P(("data", "expert")), P("data"), P()])
def test_global_array_round_trip(spec):
    mesh = make_mesh("2x4")
    host = worker.host_batch()  # [16, 3]
    x = multihost.global_array(host, NamedSharding(mesh, spec))
    assert x.sharding == NamedSharding(mesh, spec)
    np.testing.assert_array_equal(multihost.to_host(x), host)
    np.testing.assert_array_equal(multihost.to_host(jax.jit(worker.batch_fn)(x)), worker.batch_fn(host))


@pytest.mark.parametrize("kwargs, message", [
    (dict(coordinator="127.0.0.1", num_processes=2, process_id=0), "--coordinator must be HOST:PORT"),
    (dict(coordinator="host:99999", num_processes=2, process_id=0), "port in"),
    (dict(coordinator="127.0.0.1:1234", num_processes=0, process_id=0), "--num-processes must be >= 1, got 0"),
    (dict(coordinator="127.0.0.1:1234", num_processes=2, process_id=2), r"--process-id must be in \[0, 2\)"),
    (dict(coordinator="127.0.0.1:1234", num_processes=2, process_id=0, local_device_count=0), "--cpu-devices"),
])
def test_initialize_validates_before_starting(kwargs, message):
    with pytest.raises(ValueError, match=message):
        multihost.initialize(**kwargs)


def test_coordinator_forms():
    for ok in ("127.0.0.1:1234", "node-0.cluster:8476", "[::1]:1234"):
        assert multihost.check_coordinator(ok) == ok
    for bad in (":1234", "host:", "host:port", "a:b:1", "host :1"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            multihost.check_coordinator(bad)


# ---- two processes ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def worker_run(tmp_path_factory):
    """Both processes' saved arrays (npz dicts, or None where a process saved nothing) and their exit status."""
    tmp = tmp_path_factory.mktemp("multihost_worker")
    results = _run_group(lambda coordinator, i: [sys.executable, str(ROOT / "tests" / "parallel" / "multihost_worker.py"),
                                                 coordinator, str(NUM_PROCESSES), str(i), str(LOCAL_DEVICES),
                                                 str(tmp / f"p{i}.npz")], tmp)
    saved = [dict(np.load(tmp / f"p{i}.npz")) if (tmp / f"p{i}.npz").is_file() else None
             for i in range(NUM_PROCESSES)]
    return saved, results


def test_two_processes_global_arrays(worker_run):
    saved, results = worker_run
    assert all(s is not None for s in saved), _describe(results)
    for s in saved:
        # DP rank r = d*E + e lives in process r // 4: each process's devices are contiguous DP ranks.
        np.testing.assert_array_equal(s["devices"][:, 0], np.repeat(np.arange(NUM_PROCESSES), LOCAL_DEVICES))
        # to_host gathered the batch split over P(('data', 'expert')) in global row order.
        assert s["batch_sharded"]
        np.testing.assert_array_equal(s["batch"], worker.batch_fn(worker.host_batch()))
        assert "mesh 1x4 uses 4 of the 8 devices of this 2-process run" in str(s.get("partial_mesh_error"))


def test_two_processes_model_logits_match_one(worker_run):
    saved, results = worker_run
    assert all(rc == 0 for rc, _, _ in results), _describe(results)
    ids = worker.token_ids()
    expected = jaxinfer.Model.random(worker.model_config(), mesh=worker.MESH, dtype="float32", seed=0).logits(ids)
    for s in saved:
        assert s["logits"].shape == (*ids.shape, worker.model_config().vocab_size)
        np.testing.assert_allclose(s["logits"], expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def _run_cli(argv: list[str], tmp_path: pathlib.Path, expected_rc: int = 0) -> list[tuple[int, str, str]]:
    """`python -m jaxinfer.cli ARGV` in each process, on the cpu-2proc-2x4 mesh (2 processes x 4 devices)."""
    return _run_group(lambda coordinator, i: [
        sys.executable, "-m", "jaxinfer.cli", *argv, "--mesh", str(ROOT / "meshes" / "cpu-2proc-2x4.toml"),
        "--cpu-devices", str(LOCAL_DEVICES), "--coordinator", coordinator, "--num-processes", str(NUM_PROCESSES),
        "--process-id", str(i)], tmp_path, expected_rc)


def test_cli_score_two_processes_match_one(tmp_path, capsys):
    argv = ["score", "--preset", "tiny", "--dtype", "float32", "--token-ids", *map(str, IDS)]
    results = _run_cli(argv, tmp_path)
    assert all(rc == 0 for rc, _, _ in results), _describe(results)
    assert all(out == "" for _, out, _ in results[1:]), "only process 0 prints results"
    assert "process 1 of 2" in results[1][2]
    got = json.loads(results[0][1])  # stdout holds the result alone (gloo's own prints went to stderr)
    assert main([*argv, "--mesh", "2x4"]) == 0
    want = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == want["token_ids"] and got["next_token_id"] == want["next_token_id"]
    np.testing.assert_allclose(got["token_logprobs"][1:], want["token_logprobs"][1:], rtol=1e-5)


def test_cli_convert_two_processes(tmp_path, capsys):
    """Each process restores and writes its own shards; the result loads in one process with the same weights."""
    model = jaxinfer.Model.random(worker.model_config(), mesh="1x1", dtype="float32", seed=1)
    model.save(tmp_path / "src")
    results = _run_cli(["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--dtype", "float32"], tmp_path)
    assert all(rc == 0 for rc, _, _ in results), _describe(results)
    assert results[0][1].strip() == str(tmp_path / "dst") and results[1][1] == ""
    ids = worker.token_ids()
    np.testing.assert_array_equal(jaxinfer.load_model(tmp_path / "dst", mesh="1x1", dtype="float32").logits(ids),
                                  model.logits(ids))


def test_cli_bad_input_two_processes_exit_promptly(tmp_path):
    """An error after jax.distributed started: each process prints one line and exits 2 (no shutdown hang)."""
    results = _run_cli(["score", "--preset", "tiny", "--token-ids", "1", "999"], tmp_path, expected_rc=2)
    for rc, out, err in results:
        errors = [line for line in err.splitlines() if line.startswith("jaxinfer score: error:")]
        assert rc == 2 and out == "" and len(errors) == 1 and "outside the vocabulary" in errors[0], err


@pytest.mark.parametrize("flags, message", [
    (["--process-id", "1"], "--process-id needs --coordinator HOST:PORT"),
    (["--num-processes", "2", "--process-id", "1"], "--num-processes and --process-id need --coordinator"),
    (["--coordinator", "127.0.0.1:1234", "--process-id", "0"], "--coordinator needs --num-processes N and"),
    (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"], "--coordinator must be HOST:PORT"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"], "--process-id must be in"),
])
def test_bad_multiprocess_flags_print_one_line(capsys, flags, message):
    assert main(["score", "--preset", "tiny", "--token-ids", "1", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and err[0].startswith("jaxinfer score: error:"), err
