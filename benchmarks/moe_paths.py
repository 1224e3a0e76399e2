"""The XLA compute paths of the routed experts (jaxinfer/models/moe.py expert_ffn) by batch size, and the
calibration of their cost model (jaxinfer/models/moe_cost.py).

    python benchmarks/moe_paths.py [--hidden 512] [--inter 256] [--experts 16] [--top-k 4] [--dtype float32]
        [--skew 0.0] [--rows 1,2,4,...] [--transformers]
    python benchmarks/moe_paths.py --calibrate [--dtypes float32,bfloat16] [--save-measurements F | --measurements F]
        [--remeasure PATHS] [--write-table]

Without --calibrate: times one jitted expert_ffn call per path for M tokens (median of --repeats after a warm-up,
the paths interleaved), with what the cost model predicts and which path it picks for each M. The defaults are the
routed experts of bench_model.py's "bench" model. Routing: each token's top-k distinct experts drawn with
probability proportional to rank^-skew (0: uniform; 1: Zipf-like); "busiest" is the busiest expert's count over
the mean. --transformers adds a column: transformers' own DeepseekV3Experts (torch, --threads) on the same weights
and routing.

--calibrate: measures every path on a grid of expert shapes (the routed experts of bench_model.SHAPES, issue 33's
grid, plus V3's 256 narrow experts and a few wide ones) and row counts (1 to 1024) under uniform routing, fits each
path's seconds per unit of work (moe_cost.FEATURES) by non-negative least squares on relative error, and prints how
well the fit chooses: for every shape held out of the fit in turn, the measured time of the path the fit on the
other shapes chooses over the fastest measured path ("regret"), next to the earlier fixed rule's, then in sample
how the table's shipped entry and a fit on all shapes choose (on a machine other than the entry's: whether its prices
carry over). --write-table stores the fit on all shapes as this backend's entry of jaxinfer/models/moe_costs.json,
its "source" naming the date, JAX and CPU (also saved with --save-measurements). Points whose work is far
beyond the others' (dense and ragged, which compute every row against every expert on CPU, at many rows) are not
timed: they are counted as never the fastest.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

from calibration import (fit_prices, last_level_cache, load_measurements, machine, median_seconds, regret_summary,
                         save_measurements, source)

CALIBRATION_SHAPES = {  # name -> (slots, top_k, hidden, moe_intermediate)
    "bench": (16, 4, 512, 256),
    "v2lite": (64, 6, 2048, 1408),
    "h1024_e64k8": (64, 8, 1024, 512),
    "h64_e8k2": (8, 2, 64, 32),
    "h512_v32k_e32k2": (32, 2, 512, 512),
    "h256_e16k4": (16, 4, 256, 128),
    "v3_narrow": (256, 8, 256, 64),  # V3's expert count and top-k at a small width
    "few_wide": (4, 2, 1024, 2048),
}
CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
MAX_FLOPS = 6e10  # points of more work than this are not timed (dense / ragged at many rows: seconds each)
# The engine's step programs on CPU compile without while-loop-invariant code motion (engine/step_program.py: the
# pass hoists the conversion of every weight out of a loop), and so does expert_ffn here: with it, the gather
# path's loop over bf16 weights takes 130 instead of 4.5 ms (64 experts of [512, 1024], 16 assignments).
ENGINE_OPTIONS = {"cpu": {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}}
MAX_WEIGHT_BYTES = 1.2e10


def old_rule(rows: int, top_k: int, num_slots: int) -> str:
    """The fixed thresholds moe_cost replaced (fitted on the "bench" shape): gather up to two assignments per slot
    and at most 32, grouped (then "tiled") from 64 assignments per slot, capacity between (CPU)."""
    a = rows * top_k
    if a <= min(2 * num_slots, 32):
        return "gather"
    return "grouped" if a >= 64 * num_slots else "capacity"


def _inputs(rows, s, k, d, skew, dtype, rng):
    import jax.numpy as jnp
    import numpy as np

    popularity = np.arange(1, s + 1, dtype=np.float64) ** -skew
    ids = np.stack([rng.choice(s, k, replace=False, p=popularity / popularity.sum()) for _ in range(rows)])
    x = jnp.asarray(rng.normal(size=(rows, d)), dtype)
    return x, jnp.asarray(rng.random((rows, k)), jnp.float32), jnp.asarray(ids, jnp.int32), ids


def _params(s, d, i, dtype, seed=0):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(seed), 3)
    make = jax.jit(lambda key, shape: (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(dtype),
                   static_argnums=1)
    return {"gate_proj": make(keys[0], (s, i, d)), "up_proj": make(keys[1], (s, i, d)),
            "down_proj": make(keys[2], (s, d, i))}


def measure(dtypes, rows_list, shapes, log=print, paths=None, points=None) -> list[dict]:
    """Times every path (or those of ``paths``) on every (shape, rows, dtype) of the grid within MAX_FLOPS /
    MAX_WEIGHT_BYTES; given earlier ``points``, their other paths' times are kept."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.models import moe_cost

    backend = jax.default_backend()
    out = []
    for dtype_name in dtypes:
        dtype = jnp.dtype(dtype_name)
        for name in shapes:
            s, k, d, i = CALIBRATION_SHAPES[name]
            params = _params(s, d, i, dtype)
            rng = np.random.default_rng(0)
            for rows in rows_list:
                x, w, ids, _ = _inputs(rows, s, k, d, 0.0, dtype, rng)
                shape = moe_cost.ExpertShape(rows, k, s, d, i, dtype.itemsize)
                earlier = [p for p in points or () if (p["shape"], p["dtype"], p["rows"]) == (name, dtype_name, rows)]
                times = {p: t for p, t in (earlier[0]["times"] if earlier else {}).items() if p not in (paths or ())}
                for path in paths or moe_cost.PATHS:
                    work = moe_cost.work(path, shape, backend)
                    if work["flops"] > MAX_FLOPS or work["weight_bytes"] > MAX_WEIGHT_BYTES:
                        continue
                    fn = jax.jit(_calibrated(path, dtype), compiler_options=ENGINE_OPTIONS.get(backend))
                    times[path] = median_seconds(fn, (params, x, w, ids))
                out.append(dict(shape=name, dtype=dtype_name, rows=rows, slots=s, top_k=k, hidden=d, inter=i,
                                itemsize=dtype.itemsize, times=times))
                log(f"{dtype_name:>8} {name:>16} M={rows:>5} " + " ".join(
                    f"{p}={1e3 * t:.3f}" for p, t in times.items()) + " ms", flush=True)
            del params
    return out


def _calibrated(path: str, dtype):
    """What the calibration times for ``path``: expert_ffn on it; for "capacity" its batched products alone, in the
    bucket that holds the busiest slot (what moe_cost.work counts: the assignments past a smaller bucket are priced
    at the gather path's prices, moe_cost.capacity_plan)."""
    import jax.numpy as jnp

    from jaxinfer.models import moe

    if path != "capacity":
        return functools.partial(moe.expert_ffn, dtype=dtype, path=path)

    def batched(params, x, weights, ids):
        slots = params["gate_proj"].shape[0]
        flat_ids = jnp.where(ids < 0, slots, ids).reshape(-1)
        return moe._capacity_forward(params, x.astype(dtype), weights, flat_ids, slots, dtype, None)

    return batched


def fit(points: list[dict], backend: str, cache: int) -> dict:
    """path -> feature -> seconds per unit (calibration.fit_prices: NNLS on relative error); cache: the machine's
    last-level cache bytes (moe_cost.work)."""
    from jaxinfer.models import moe_cost

    coeffs = {}
    for path in moe_cost.PATHS:
        timed = [p for p in points if path in p["times"]]
        work = [[moe_cost.work(path, _shape(p), backend, cache)[f] for f in moe_cost.FEATURES] for p in timed]
        prices = fit_prices(work, [p["times"][path] for p in timed])
        coeffs[path] = dict(zip(moe_cost.FEATURES, prices))
    return coeffs


def _shape(p):
    from jaxinfer.models import moe_cost

    return moe_cost.ExpertShape(p["rows"], p["top_k"], p["slots"], p["hidden"], p["inter"], p["itemsize"])


def _choice(coeffs, p, backend, cache):
    """moe_cost.cheapest at these coefficients, priced as a prefill step (sequence_tokens > 1: the mean over its
    routing scenarios)."""
    from jaxinfer.models import moe_cost

    return moe_cost.cheapest(_shape(p), backend, coeffs, sequence_tokens=2, cache=cache)


def _regret(p, path):
    """Measured time of `path` over the fastest measured; inf where `path` was not timed (far more work)."""
    return p["times"].get(path, float("inf")) / min(p["times"].values())


def calibrate(args) -> None:
    import jax
    import numpy as np

    backend = jax.default_backend()
    rows, dtypes = [int(r) for r in args.rows.split(",")], args.dtypes.split(",")
    if args.measurements:
        points, measured_on = load_measurements(args.measurements)
        if args.remeasure:
            points = measure(dtypes, rows, list(CALIBRATION_SHAPES), paths=args.remeasure.split(","), points=points)
            measured_on = machine()
    else:
        points, measured_on = measure(dtypes, rows, list(CALIBRATION_SHAPES)), machine()
    if args.save_measurements:
        save_measurements(args.save_measurements, measured_on, points)
    points = [p for p in points if len(p["times"]) > 1]  # the others past MAX_FLOPS: nothing to compare
    cache = measured_on.get("last_level_cache", last_level_cache())  # measured before it was recorded: here
    print(f"\nleave-one-shape-out: measured time of the chosen path / the fastest path's, {backend}")
    print(f"{'dtype':>8} {'held out':>16} {'fit median':>10} {'fit max':>8} {'old median':>10} {'old max':>8}")
    summary = {}
    for dtype in sorted({p["dtype"] for p in points}):
        ours, olds = [], []
        for name in CALIBRATION_SHAPES:
            held = [p for p in points if p["dtype"] == dtype and p["shape"] == name]
            rest = [p for p in points if p["dtype"] == dtype and p["shape"] != name]
            if not held:
                continue
            coeffs = fit(rest, backend, cache)
            r = [_regret(p, _choice(coeffs, p, backend, cache)) for p in held]
            o = [_regret(p, old_rule(p["rows"], p["top_k"], p["slots"])) for p in held]
            ours += r
            olds += o
            print(f"{dtype:>8} {name:>16} {np.median(r):>10.3f} {max(r):>8.3f} {np.median(o):>10.3f} {max(o):>8.3f}")
        summary[dtype] = (np.median(ours), max(ours), np.mean(ours), np.median(olds), max(olds), np.mean(olds))
        print(f"{dtype:>8} {'all':>16} {summary[dtype][0]:>10.3f} {summary[dtype][1]:>8.3f} "
              f"{summary[dtype][3]:>10.3f} {summary[dtype][4]:>8.3f}   (means {summary[dtype][2]:.3f} vs "
              f"{summary[dtype][5]:.3f})")
    from jaxinfer.models import moe_cost

    print("\nin sample: the table's entry (as shipped) and the refit on every shape, decode steps (balanced routing) "
          "and prefill steps (moe_cost.ROUTING_SKEWS)")
    for dtype in sorted({p["dtype"] for p in points}):
        held = [p for p in points if p["dtype"] == dtype]
        fastest = [min(p["times"].values()) for p in held]
        for name, coeffs, with_cache in (
                ("shipped", moe_cost.coefficients(backend, dtype), moe_cost.cache_bytes(backend, dtype)),
                ("refit", fit(held, backend, cache), cache)):
            for label, tokens in (("decode", 1), ("prefill", 2)):
                chosen = [p["times"].get(moe_cost.cheapest(_shape(p), backend, coeffs, tokens, with_cache),
                                         float("inf")) for p in held]
                print(f"{dtype:>8} {name:>8} {label:>8}: {regret_summary(chosen, fastest)}")
    if args.write_table:
        table = json.loads(moe_cost.TABLE.read_text())
        entry = table["backends"].setdefault(backend, {})
        for dtype in sorted({p["dtype"] for p in points}):
            entry[dtype] = dict(
                source=source(measured_on),
                grid=f"{len(CALIBRATION_SHAPES)} shapes, rows {min(p['rows'] for p in points)}-"
                     f"{max(p['rows'] for p in points)}",
                held_out=f"chosen / fastest: median {summary[dtype][0]:.3f}, mean {summary[dtype][2]:.3f}, "
                         f"max {summary[dtype][1]:.3f}",
                cache_bytes=cache,
                paths=fit([p for p in points if p["dtype"] == dtype], backend, cache))
        moe_cost.TABLE.write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {moe_cost.TABLE}")


def compare(args) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.models import moe_cost
    from jaxinfer.models.moe import expert_ffn

    dtype = jnp.dtype(args.dtype)
    backend = jax.default_backend()
    s, d, i, k = args.experts, args.hidden, args.inter, args.top_k
    params = _params(s, d, i, dtype)
    rng = np.random.default_rng(0)
    print(f"expert_ffn, {s} experts top-{k}, hidden {d}, moe_intermediate {i}, {args.dtype}, skew {args.skew}; "
          f"ms per call, measured (cost model's prediction)")
    reference = transformers_experts(params, args.threads) if args.transformers else None
    print(f"{'M':>6} {'busiest':>8} " + " ".join(f"{path:>17}" for path in moe_cost.PATHS)
          + (f" {'transformers':>12}" if reference else "") + "  chosen")
    for m in (int(r) for r in args.rows.split(",")):
        x, w, ids, ids_np = _inputs(m, s, k, d, args.skew, dtype, rng)
        busiest = np.bincount(ids_np.ravel(), minlength=s).max() / (m * k / s)
        shape = moe_cost.ExpertShape(m, k, s, d, i, dtype.itemsize)
        cells = []
        for path in moe_cost.PATHS:
            predicted = moe_cost.predict(path, shape, dtype.name, backend) * 1e3
            work = moe_cost.work(path, shape, backend, moe_cost.cache_bytes(backend, dtype.name))
            if work["flops"] > MAX_FLOPS or work["weight_bytes"] > MAX_WEIGHT_BYTES:
                cells.append(f"{'-':>8} ({predicted:>6.2f})")
                continue
            fn = jax.jit(functools.partial(expert_ffn, dtype=dtype, path=path),
                         compiler_options=ENGINE_OPTIONS.get(backend))
            cells.append(f"{median_seconds(fn, (params, x, w, ids), least=args.repeats) * 1e3:>8.2f} "
                         f"({predicted:>6.2f})")
        if reference is not None:
            cells.append(f"{reference(x, w, ids, least=args.repeats) * 1e3:>12.2f}")
        print(f"{m:>6} {busiest:>7.2f}x " + " ".join(cells) + f"  {moe_cost.choose(shape, dtype.name, backend)}",
              flush=True)


def transformers_experts(params, threads: int):
    """transformers' own routed experts (DeepseekV3Experts: a loop over the experts hit, each on its tokens, gate
    and up as one product of its fused [2I, D] weight) on the same weights, torch with ``threads`` threads ->
    timer(x, weights, ids, least) -> median seconds of a call."""
    import numpy as np
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    torch.set_num_threads(threads)
    s, i, d = params["gate_proj"].shape
    as_torch = {"float32": torch.float32, "bfloat16": torch.bfloat16}[str(params["gate_proj"].dtype)]
    experts = DeepseekV3Experts(DeepseekV3Config(n_routed_experts=s, hidden_size=d, moe_intermediate_size=i))
    weight = {n: torch.from_numpy(np.asarray(v, np.float32)).to(as_torch) for n, v in params.items()}
    experts.gate_up_proj.data = torch.cat([weight["gate_proj"], weight["up_proj"]], dim=1)  # [S, 2I, D]
    experts.down_proj.data = weight["down_proj"]

    def timer(x, w, ids, least):
        args = (torch.from_numpy(np.asarray(x, np.float32)).to(as_torch), torch.from_numpy(np.asarray(ids)).long(),
                torch.from_numpy(np.asarray(w)).to(as_torch))
        with torch.no_grad():
            return median_seconds(lambda: (experts(*args), None)[1], (), least=least)  # None: nothing to wait on

    return timer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=256)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rows", default=None, help="comma-separated row counts")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--skew", type=float, default=0.0, help="expert popularity ~ rank^-skew")
    p.add_argument("--transformers", action="store_true",
                   help="also time transformers' DeepseekV3Experts on the same weights and routing (torch)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads for --transformers")
    p.add_argument("--calibrate", action="store_true")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--measurements", help="--calibrate: fit these saved measurements instead of measuring")
    p.add_argument("--save-measurements", help="--calibrate: save the measurements (JSON) here")
    p.add_argument("--remeasure", help="--calibrate --measurements F: time these paths again (comma-separated), "
                                       "keep F's times of the others")
    p.add_argument("--write-table", action="store_true", help="--calibrate: write jaxinfer/models/moe_costs.json")
    args = p.parse_args()
    if args.calibrate:
        args.rows = args.rows or ",".join(map(str, CALIBRATION_ROWS))
        calibrate(args)
    else:
        args.rows = args.rows or "1,2,4,8,16,32,64,128,256,1024"
        compare(args)


if __name__ == "__main__":
    sys.exit(main())
