"""Checkpoint loading speed: a DeepSeek-V3-shaped FP8 checkpoint in DeepSeek's release format (e4m3 projections
with 128x128 block scales, bf16 embeddings and norms), loaded with ``keep_fp8=True`` and dequantized to bfloat16.

    python benchmarks/load_checkpoint.py [--dir DIR] [--rounds 3] [--modes fp8 bf16] [--layers 4]

The checkpoint (hidden 2048, --layers layers of which the first dense and the others MoE, 64 routed experts of width
1024, vocab 32000: ~1.58 GB in 4 shards at the default 4 layers, ~0.39 GB more per layer) is written once into DIR
with random values (finite e4m3 bytes, scales 2**-12..2**-6). Its files are read once before timing, so the figures
are the loader's, not the disk's (a cold page cache adds the disk's time). Each load runs in a fresh process:
``load_model(DIR, mesh="1x1", dtype="bfloat16", keep_fp8=...)`` until every array is ready, timed after jaxinfer's
model module and JAX are imported (``import_s``, printed apart: a fixed cost of the process, not of the checkpoint's
bytes). Printed per mode: seconds (median of rounds), checkpoint bytes / s (the safetensors files' size,
the FP8 bytes included), the loaded arrays' bytes, and the process's anonymous memory (RssAnon, sampled every
2 ms) at its peak during the load, above what it held before, against the loaded arrays' bytes. For bfloat16 also
the limit measured in the same run: XLA:CPU writing the loaded arrays' bytes into fresh memory (``fresh_write_floor``,
fresh processes, median of rounds), and the load's time over it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import threading
import time

CONFIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, moe_intermediate_size=1024,
              num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=16, q_lora_rank=768,
              kv_lora_rank=256, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
              n_shared_experts=1, num_experts_per_tok=6, n_group=8, topk_group=4, max_position_embeddings=4096)


def write_checkpoint(directory: pathlib.Path, layers: int) -> None:
    """config.json and sharded safetensors of CONFIG in DeepSeek's FP8 release format (train/export.py's dtypes)."""
    import ml_dtypes
    import numpy as np
    from flax import nnx

    from jaxinfer.checkpoint.fp8 import scale_shape
    from jaxinfer.checkpoint.hf_loader import source_for
    from jaxinfer.checkpoint.safetensors_io import write_sharded_safetensors
    from jaxinfer.checkpoint.tree import flatten_tree
    from jaxinfer.config import ModelConfig, QuantConfig
    from jaxinfer.model import _build
    from jaxinfer.parallel.mesh import make_mesh
    from jaxinfer.parallel.placement import PLACEMENT_LEAVES
    from jaxinfer.parallel.plan import ParallelPlan
    from jaxinfer.train.export import FP8_WEIGHT, hf_config

    config = ModelConfig(**(CONFIG | {"num_hidden_layers": layers}), quantization=QuantConfig())
    _, state = _build(config, ml_dtypes.bfloat16, ParallelPlan(make_mesh("1x1")), fp8="off", num_mtp_layers=0,
                      mtp_eh_proj_fp8="off")
    rng = np.random.default_rng(0)
    tensors = {}
    for path, leaf in flatten_tree(nnx.to_pure_dict(state)):
        if path[-1] in PLACEMENT_LEAVES:
            continue
        src = source_for(config, path, set())
        shape = tuple(leaf.shape[1:] if src.stacked else leaf.shape)
        for name in src.names:
            if FP8_WEIGHT.match(name):
                raw = rng.integers(0, 256, shape, dtype=np.uint8)
                raw[(raw & 0x7F) == 0x7F] = 0  # e4m3fn's NaN codes
                tensors[name] = raw.view(ml_dtypes.float8_e4m3fn)
                tensors[name + "_scale_inv"] = 2.0 ** rng.integers(-12, -5, scale_shape(shape)).astype(np.float32)
            elif name.endswith("e_score_correction_bias"):
                tensors[name] = rng.standard_normal(shape, np.float32) * 0.01
            else:
                tensors[name] = (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    write_sharded_safetensors(directory, tensors, max_shard_bytes=500 << 20, metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(hf_config(config), indent=2) + "\n")


def rss_anon() -> int:
    """This process's anonymous resident memory in bytes (/proc/self/status RssAnon)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def child(directory: str, mode: str) -> None:
    """One load in this process; prints its JSON line."""
    t_import = time.perf_counter()
    import jax

    from jaxinfer.model import load_model  # the library's imports (~1-2 s here) are not the loader's time

    imports = time.perf_counter() - t_import
    peak = {"bytes": 0}
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak["bytes"] = max(peak["bytes"], rss_anon())
            time.sleep(0.002)

    base = rss_anon()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    model = load_model(directory, mesh="1x1", dtype="bfloat16", keep_fp8=mode == "fp8")
    jax.block_until_ready(model.state)
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    arrays = sum(x.nbytes for x in jax.tree.leaves(model.state))
    print(json.dumps({"seconds": seconds, "arrays_bytes": arrays, "anon_peak_bytes": peak["bytes"] - base,
                      "import_seconds": imports}))


def fresh_write_floor(nbytes: int) -> None:
    """XLA:CPU writing ``nbytes`` of bfloat16 into fresh memory, as a dequantizing load's outputs are written: one
    program computing 128 MiB chunks (compiled and run once first), every output kept. Prints its JSON line. On
    these VMs the first touches of fresh pages bound it, not the arithmetic (docs/benchmarks.md "Checkpoint
    loading"), so it is a floor for a bfloat16 load of a checkpoint whose arrays take ``nbytes``."""
    import jax
    import jax.numpy as jnp

    import jaxinfer  # noqa: F401  (its malloc settings, as in a load)

    n = 64 << 20  # bfloat16 elements per chunk: bit patterns, as cheap to compute as can be (a float conversion
    chunk = jax.jit(lambda k: jax.lax.bitcast_convert_type(  # would cost more than the writes)
        (jnp.arange(n, dtype=jnp.uint32) ^ k).astype(jnp.uint16), jnp.bfloat16))
    kept = [chunk(jnp.uint32(0)).block_until_ready()]  # compiled; kept, so no later chunk reuses its pages
    t0 = time.perf_counter()
    kept += [chunk(jnp.uint32(k + 1)) for k in range(-(-nbytes // (2 * n)))]
    jax.block_until_ready(kept)
    print(json.dumps({"seconds": time.perf_counter() - t0}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=pathlib.Path, help="default /tmp/jaxinfer_load_bench (4 layers), "
                        "/tmp/jaxinfer_load_bench_L{layers} otherwise")
    parser.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"],
                        help="the checkpoint's layers (its size: fixed costs of a load, such as the model's build and "
                        "the dequantizing programs' compiles, weigh less in a larger one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=["fp8", "bf16"], default=["fp8", "bf16"])
    parser.add_argument("--child", nargs=2, metavar=("DIR", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--floor", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    if args.floor:
        fresh_write_floor(args.floor)
        return
    if args.layers < 2:
        parser.error("--layers must be at least 2 (one dense layer, then MoE layers)")
    if args.dir is None:
        suffix = "" if args.layers == CONFIG["num_hidden_layers"] else f"_L{args.layers}"
        args.dir = pathlib.Path(f"/tmp/jaxinfer_load_bench{suffix}")
    if not (args.dir / "config.json").exists():
        t0 = time.perf_counter()
        write_checkpoint(args.dir, args.layers)
        print(f"wrote {args.dir} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    files = sorted(args.dir.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    for f in files:  # into the page cache
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    for mode in args.modes:
        runs = []
        for _ in range(args.rounds):
            out = subprocess.run([sys.executable, __file__, "--child", str(args.dir), mode], check=True,
                                 capture_output=True, text=True).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
        seconds = statistics.median(r["seconds"] for r in runs)
        arrays = runs[0]["arrays_bytes"]
        peak = max(r["anon_peak_bytes"] for r in runs)
        line = {"mode": "keep_fp8" if mode == "fp8" else "bfloat16", "checkpoint_gb": round(size / 1e9, 3),
                "seconds": round(seconds, 2), "rounds_s": [round(r["seconds"], 2) for r in runs],
                "gb_per_s": round(size / seconds / 1e9, 3), "arrays_gb": round(arrays / 1e9, 3),
                "anon_peak_gb": round(peak / 1e9, 3), "anon_peak_over_arrays": round(peak / arrays, 3),
                "import_s": round(statistics.median(r["import_seconds"] for r in runs), 2)}
        if mode == "bf16":  # the limit: XLA:CPU writing the loaded arrays' bytes into fresh memory
            floors = [json.loads(subprocess.run([sys.executable, __file__, "--floor", str(arrays)], check=True,
                                                capture_output=True, text=True).stdout.strip().splitlines()[-1])
                      ["seconds"] for _ in range(args.rounds)]
            line["fresh_write_floor_s"] = round(statistics.median(floors), 2)
            line["seconds_over_floor"] = round(seconds / statistics.median(floors), 2)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
