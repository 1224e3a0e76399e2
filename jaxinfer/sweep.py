"""``jaxinfer sweep``: ``jaxinfer bench --mode one-batch`` over mesh shapes x batch sizes -> a CSV, plots, a table.

    jaxinfer sweep --meshes meshes/cpu-1x1.toml meshes/cpu-1x8.toml --batch-sizes 1,8 --input-len 64 \
        --output-len 16 --out sweep-cpu [--model DIR] [--dtype bfloat16]

Each mesh runs in a fresh process (``python -m jaxinfer.cli bench --mode one-batch --json --dispatch-bytes ...``,
all batch sizes in it), since JAX fixes the device count when its backend starts. A CPU mesh file gets
``--cpu-devices`` = its devices per process and ``JAX_PLATFORMS=cpu``; a GPU mesh file runs on the GPUs the
process sees with nothing forced (a mesh file without a platform gets ``--cpu-devices``, which GPU backends
ignore). Multi-process meshes: on CPU the sweep starts the mesh's ``num_processes`` local processes, joined by
jax.distributed on 127.0.0.1; across GPU hosts run the same sweep on every host with ``--coordinator HOST:PORT
--num-processes N --process-id I`` (mesh k of the list uses port PORT + k; process 0 writes the results).

``--pd-meshes P.toml:D.toml ...`` adds prefill/decode disaggregation pairs (``bench --prefill-mesh P --decode-mesh
D``, one process simulating both meshes' CPU devices): rows named "P:D" with each engine's devices and the
latent bytes handed over.

Results in ``--out DIR``: ``sweep.csv`` (``CSV_COLUMNS``: the engines' devices, prefill / decode throughput from
SGLang's one-batch figures, decode tok/s per device, median TTFT and TPOT in seconds, the KV bytes handed from
prefill to decode, dispatch payload bytes per token over all MoE layers as run and in DeepEP's FP8 format),
``throughput.png`` (prefill and decode tok/s vs mesh, one line per batch size) and ``throughput_per_device.png``;
the table goes to stdout, progress to stderr.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

from jaxinfer.bench import positive_ints
from jaxinfer.parallel.mesh import MeshFile, read_mesh_file

CSV_COLUMNS = ("mesh", "devices", "data", "expert", "prefill_devices", "decode_devices", "batch", "prefill_tok_s",
               "decode_tok_s", "decode_tok_s_per_device", "ttft_s", "tpot_s", "kv_transfer_bytes",
               "dispatch_bytes_per_token", "dispatch_bytes_per_token_fp8")
PLOTS = ("throughput.png", "throughput_per_device.png")


def add_parser(sub) -> None:
    p = sub.add_parser("sweep", help="one-batch benchmarks over meshes x batch sizes -> CSV + plots")
    p.add_argument("--meshes", nargs="+", default=[], metavar="FILE.toml", help="mesh files (meshes/*.toml)")
    p.add_argument("--pd-meshes", nargs="+", default=[], metavar="P.toml:D.toml",
                   help="prefill/decode disaggregation pairs: the prefill engine on P, the decode engine on D (one "
                        "process, devices in order, prefill first; single-process CPU or GPU mesh files)")
    p.add_argument("--batch-sizes", default="1,8,32", help="comma-separated, e.g. 1,8,32")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--out", required=True, metavar="DIR", help="directory for sweep.csv and the plots")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    multi = p.add_argument_group("multi-host meshes (run the same sweep on every host)")
    multi.add_argument("--coordinator", dest="sweep_coordinator", metavar="HOST:PORT", default=None,
                       help="process 0's address; mesh k of --meshes uses port PORT + k")
    multi.add_argument("--num-processes", dest="sweep_num_processes", type=int, metavar="N", default=None)
    multi.add_argument("--process-id", dest="sweep_process_id", type=int, metavar="I", default=None)
    # the sweep itself never starts JAX: cli._start_jax finds nothing to do (its bench processes use the cache)
    p.set_defaults(cpu_devices=None, coordinator=None, num_processes=None, process_id=None, compilation_cache="off")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(mesh: MeshFile) -> dict:
    import jaxinfer

    env = dict(os.environ)
    root = str(pathlib.Path(jaxinfer.__file__).resolve().parents[1])  # the child imports this very jaxinfer
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    if mesh.platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    return env


def pd_pair(spec: str) -> tuple[str, str]:
    """"P.toml:D.toml" -> (P, D); ValueError for anything else."""
    prefill, sep, decode = str(spec).rpartition(":")
    if not sep or not prefill.endswith(".toml") or not decode.endswith(".toml"):
        raise ValueError(f"--pd-meshes takes PREFILL.toml:DECODE.toml pairs, got {spec!r}")
    return prefill, decode


def bench_commands(path, mesh: MeshFile, batch_sizes: list[int], input_len: int, output_len: int, *,
                   model=None, dtype: str = "bfloat16", index: int = 0, multi_host: tuple | None = None
                   ) -> list[list[str]]:
    """The ``bench`` command line of each process this host starts for one mesh (several for a multi-process
    CPU mesh). multi_host: (coordinator "HOST:PORT", num_processes, process_id) of a sweep across hosts.
    path: a mesh file, or a "P.toml:D.toml" pair (``mesh``: both files' devices as one single-process mesh)."""
    if ":" in str(path):
        prefill, decode = (str(pathlib.Path(p).resolve()) for p in pd_pair(path))
        where = ["--prefill-mesh", prefill, "--decode-mesh", decode]
    else:
        where = ["--mesh", str(pathlib.Path(path).resolve())]
    cmd = [sys.executable, "-m", "jaxinfer.cli", "bench", "--mode", "one-batch", "--json", "--dispatch-bytes",
           *where, "--batch-size", *map(str, batch_sizes), "--input-len", str(input_len), "--output-len",
           str(output_len), "--dtype", dtype]
    if model is not None:
        cmd += ["--model", str(model)]
    procs = mesh.num_processes
    if mesh.platform != "gpu":
        cmd += ["--cpu-devices", str(mesh.data * mesh.expert // procs)]
    if procs == 1:
        return [cmd]
    if multi_host is not None:
        host, port = multi_host[0].rsplit(":", 1)
        return [cmd + ["--coordinator", f"{host}:{int(port) + index}", "--num-processes", str(procs),
                       "--process-id", str(multi_host[2])]]
    coordinator = f"127.0.0.1:{_free_port()}"
    return [cmd + ["--coordinator", coordinator, "--num-processes", str(procs), "--process-id", str(i)]
            for i in range(procs)]


def run_mesh(path, batch_sizes: list[int], input_len: int, output_len: int, *, model=None,
             dtype: str = "bfloat16", index: int = 0, multi_host: tuple | None = None,
             timeout_s: float | None = None) -> list[dict]:
    """Runs ``bench`` for one mesh (or a "P.toml:D.toml" pair) in fresh process(es); returns its JSON results (one
    per batch size; [] in a multi-host process other than 0). RuntimeError with the failing process's last error
    line."""
    mesh = read_mesh(path)
    env = child_env(mesh)
    cmds = bench_commands(path, mesh, batch_sizes, input_len, output_len, model=model, dtype=dtype, index=index,
                          multi_host=multi_host)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as files:
        # files, not pipes: the processes of a multi-process mesh must never block on a full pipe
        outs = [files.enter_context(open(pathlib.Path(tmp) / f"{i}.out", "w+")) for i in range(len(cmds))]
        errs = [files.enter_context(open(pathlib.Path(tmp) / f"{i}.err", "w+")) for i in range(len(cmds))]
        procs = [subprocess.Popen(c, stdout=o, stderr=e, text=True, env=env) for c, o, e in zip(cmds, outs, errs)]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):  # a failed process stops the others (they would wait for it)
            late = deadline is not None and time.monotonic() > deadline
            if late or any(p.returncode for p in procs):
                for p in procs:
                    p.kill()
                    p.wait()
                if late:
                    raise RuntimeError(f"mesh {mesh.name}: bench did not finish within {timeout_s} s")
                break
            time.sleep(0.2)
        for p, err in sorted(zip(procs, errs), key=lambda pe: pe[0].returncode < 0):  # ours killed: report last
            err.seek(0)
            lines = [line.strip() for line in err.read().splitlines() if line.strip()]
            if p.returncode != 0:
                raise RuntimeError(f"mesh {mesh.name}: bench exited with {p.returncode}: "
                                   f"{lines[-1] if lines else 'no error output'}")
        outs[0].seek(0)
        results = outs[0].read()
    return [json.loads(line) for line in results.splitlines() if line.startswith("{")]


def read_mesh(path) -> MeshFile:
    """A mesh file, or for a "P.toml:D.toml" pair one MeshFile of both meshes' devices (name "P:D"; its shape
    1 x devices: what the bench process must simulate). ValueError for a pair of multi-process or different
    platforms' meshes."""
    if ":" not in str(path):
        return read_mesh_file(path)
    prefill, decode = (read_mesh_file(p) for p in pd_pair(path))
    if prefill.num_processes != 1 or decode.num_processes != 1:
        raise ValueError(f"--pd-meshes {path}: both meshes must be single-process (both engines run in one)")
    if prefill.platform != decode.platform:
        raise ValueError(f"--pd-meshes {path}: the meshes are for different platforms ({prefill.platform}, "
                         f"{decode.platform})")
    return MeshFile(name=f"{prefill.name}:{decode.name}", data=1, expert=prefill.data * prefill.expert
                    + decode.data * decode.expert, platform=prefill.platform)


def to_row(result: dict) -> dict:
    """A bench one-batch JSON result -> a sweep.csv row."""
    r = result
    return dict(mesh=r["mesh"], devices=r["devices"], data=r["data"], expert=r["expert"],
                prefill_devices=r["prefill_devices"], decode_devices=r["decode_devices"], batch=r["batch_size"],
                prefill_tok_s=r["prefill_throughput_tok_s"], decode_tok_s=r["median_decode_throughput_tok_s"],
                decode_tok_s_per_device=r["median_decode_throughput_tok_s"] / r["devices"], ttft_s=r["ttft_s"],
                tpot_s=r["tpot_s"], kv_transfer_bytes=r["kv_transfer_bytes"],
                dispatch_bytes_per_token=r["dispatch_bytes_per_token"],
                dispatch_bytes_per_token_fp8=r["dispatch_bytes_per_token_fp8"])


def check_args(meshes, batch_sizes, input_len: int, output_len: int, model=None,
               multi_host: tuple | None = None) -> tuple[list[MeshFile], list[int]]:
    """Validates everything before any mesh runs; returns (mesh files, batch sizes). ValueError naming the
    problem."""
    if not meshes:
        raise ValueError("--meshes or --pd-meshes needs at least one mesh file")
    mesh_files = [read_mesh(m) for m in meshes]
    sizes = positive_ints(batch_sizes, "--batch-sizes")
    if input_len < 1:
        raise ValueError(f"--input-len must be >= 1, got {input_len}")
    if output_len < 2:
        raise ValueError(f"--output-len must be >= 2 (a prefill token, then decode steps), got {output_len}")
    if model is not None and not pathlib.Path(model).is_dir():
        raise ValueError(f"--model {model} is not a directory")
    for path, m in zip(meshes, mesh_files):
        if m.data * m.expert % m.num_processes:
            raise ValueError(f"mesh file {path}: {m.data}x{m.expert} devices do not split over "
                             f"{m.num_processes} processes")
        if multi_host is not None and m.num_processes != multi_host[1]:
            raise ValueError(f"mesh file {path} needs {m.num_processes} process(es), but this sweep runs on "
                             f"--num-processes {multi_host[1]}; sweep multi-host meshes separately")
        if multi_host is None and m.num_processes > 1 and m.platform == "gpu":
            raise ValueError(f"mesh file {path} spans {m.num_processes} processes (hosts): run the same sweep on "
                             "every host with --coordinator HOST:PORT --num-processes N --process-id I")
    return mesh_files, sizes


def run_sweep(meshes, batch_sizes, input_len: int, output_len: int, out_dir, *, model=None,
              dtype: str = "bfloat16", multi_host: tuple | None = None, timeout_s: float | None = None,
              log=sys.stderr) -> list[dict]:
    """Runs every mesh (in order) and writes ``out_dir``/sweep.csv and the plots; returns the rows.

    meshes: mesh file paths, or "P.toml:D.toml" prefill/decode pairs; batch_sizes: "1,8,32" or a list of ints.
    multi_host: (coordinator, num_processes, process_id) when the same sweep runs on every host; only process 0
    writes (others return [])."""
    mesh_files, sizes = check_args(meshes, batch_sizes, input_len, output_len, model, multi_host)
    out = pathlib.Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    rows = []
    for index, (path, mesh) in enumerate(zip(meshes, mesh_files)):
        t0 = time.perf_counter()
        print(f"[jaxinfer] sweep: mesh {mesh.name} ({mesh.data}x{mesh.expert}, {mesh.platform or 'any'}), "
              f"batch sizes {sizes} ...", file=log, flush=True)
        results = run_mesh(path, sizes, input_len, output_len, model=model, dtype=dtype, index=index,
                           multi_host=multi_host, timeout_s=timeout_s)
        rows += [to_row(r) for r in results]
        print(f"[jaxinfer] sweep: mesh {mesh.name} done in {time.perf_counter() - t0:.1f} s", file=log, flush=True)
    if multi_host is not None and multi_host[2] != 0:
        return []
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out / "sweep.csv")
    try:
        plot(rows, out, title=f"jaxinfer sweep: input {input_len}, output {output_len} tokens, {dtype}")
    except ImportError as e:  # e.g. an offline GPU machine without matplotlib: keep the measurements
        print(f"[jaxinfer] sweep: no plots ({e}); sweep.csv is written", file=log)
    return rows


def write_csv(rows: list[dict], path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path) -> list[dict]:
    """sweep.csv -> rows with numbers as int / float."""
    def number(v: str):
        return int(v) if v.lstrip("-").isdigit() else float(v)

    with open(path, newline="") as f:
        return [{k: v if k == "mesh" else number(v) for k, v in row.items()} for row in csv.DictReader(f)]


def format_table(rows: list[dict]) -> str:
    """The rows as an aligned text table (4 significant digits)."""
    cells = [list(CSV_COLUMNS)] + [[f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in CSV_COLUMNS]
                                   for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(CSV_COLUMNS))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in cells)


def plot(rows: list[dict], out_dir, title: str = "") -> list[pathlib.Path]:
    """throughput.png (prefill and decode tok/s vs mesh, a line per batch size, log scale) and
    throughput_per_device.png (decode tok/s per device); returns their paths."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend

    meshes = list(dict.fromkeys(r["mesh"] for r in rows))
    shape = {r["mesh"]: f"{r['data']}x{r['expert']} ({r['devices']} dev)" for r in rows}
    labels = [f"{m}\n{shape[m]}" for m in meshes]
    batches = sorted({r["batch"] for r in rows})

    def lines(ax, column, ylabel):
        for b in batches:
            points = {r["mesh"]: r[column] for r in rows if r["batch"] == b}
            xs = [i for i, m in enumerate(meshes) if m in points]
            ax.plot(xs, [points[meshes[i]] for i in xs], marker="o", label=f"batch {b}")
        ax.set_xticks(range(len(meshes)), labels, fontsize=8)
        ax.set_xlim(-0.5, len(meshes) - 0.5)
        ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)

    paths = [pathlib.Path(out_dir) / name for name in PLOTS]
    fig = Figure(figsize=(10, 4), layout="constrained")
    ax_prefill, ax_decode = fig.subplots(1, 2)
    lines(ax_prefill, "prefill_tok_s", "prefill tok/s")
    ax_prefill.set_title("prefill throughput")
    lines(ax_decode, "decode_tok_s", "decode tok/s")
    ax_decode.set_title("decode throughput (batch / median TPOT)")
    fig.suptitle(title)
    fig.savefig(paths[0], dpi=100)
    fig = Figure(figsize=(5.5, 4), layout="constrained")
    ax = fig.subplots()
    lines(ax, "decode_tok_s_per_device", "decode tok/s per device")
    ax.set_title("decode throughput per device")
    fig.suptitle(title, fontsize=9)
    fig.savefig(paths[1], dpi=100)
    return paths


def run(args) -> None:
    multi = (args.sweep_coordinator, args.sweep_num_processes, args.sweep_process_id)
    if any(v is not None for v in multi) and any(v is None for v in multi):
        raise ValueError("multi-host sweeps need all of --coordinator, --num-processes and --process-id")
    if multi[0] is not None:
        from jaxinfer.parallel import multihost

        multihost.check_coordinator(multi[0])
        multihost.check_process_layout(multi[1], multi[2])
    for pair in args.pd_meshes:
        pd_pair(pair)  # a pair, not one mesh file
    rows = run_sweep(args.meshes + args.pd_meshes, args.batch_sizes, args.input_len, args.output_len, args.out,
                     model=args.model, dtype=args.dtype, multi_host=multi if multi[0] is not None else None)
    if rows:
        print(format_table(rows))
        written = [pathlib.Path(args.out) / name for name in ("sweep.csv", *PLOTS)]
        print(f"[jaxinfer] sweep: wrote {', '.join(str(p) for p in written if p.is_file())}", file=sys.stderr)

