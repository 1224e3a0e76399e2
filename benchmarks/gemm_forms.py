"""x [M, K] @ W [N, K]^T on XLA:CPU: the plain product vs the transposed one ((W @ x^T)^T) vs layers.matmul_nt.

    python benchmarks/gemm_forms.py [--rows 1,2,8,32,64,128] [--shapes 4096x512,8192x512,...] [--repeats 5]
        [--dtype float32 | bfloat16]

The shapes (N x K) default to the benchmark model's decode GEMMs (forward_vs_transformers.py): routed experts'
gate/up as one matrix (16 x 256 rows), the LM head, the dense MLP, attention projections; S x N x K shapes are
batched (x [S, M, K] @ W [S, N, K]^T per s: the capacity path's per-expert matmuls, M rows per expert). Each call
gets the next of several weight copies (over 32 MB in all), so weights come from memory as in a decode step, not from
cache. Prints the minimum over --repeats passes in ms, the speedup of the transposed form and matmul_nt as shipped
(the form gemm_cost's model prices lowest; one row: possibly a float32 matrix-vector product). --dtype is the
operands' dtype (float32 accumulation and output in every form).

    python benchmarks/gemm_forms.py --calibrate [--dtypes float32,bfloat16] [--write-table]

--calibrate: times both forms (models/gemm_cost.py FORMS; one unbatched row is always a matvec) of the dense
products of the grid's models (bench_model.SHAPES: attention projections, dense and shared-expert MLPs, the LM head,
one routed expert's matrices (the grouped path's tiles) and the capacity path's per-expert batched products) at 1 to
1024 rows, weights cold as above, fits each form's seconds per unit of work (gemm_cost.FEATURES) by non-negative
least squares on relative error, and prints how well the fit chooses: for every model's products held out of the fit
in turn, the measured time of the form the fit on the others chooses over the fastest measured form ("regret"), next
to the earlier fixed rule's (the transposed form for 2-64 rows), then in sample how the table's shipped entry and a
fit on all products choose (on a machine other than the entry's: whether its prices carry over). --write-table stores
the fit on all products as jaxinfer/models/gemm_costs.json, its "source" naming the date, JAX and CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import time

from calibration import (fit_prices, load_measurements, machine, median_seconds, regret_summary,
                         save_measurements, source)

OLD_TRANSPOSED_ROWS = (2, 64)  # the fixed rule before the cost model, batched or not
MAX_FLOPS = 4e9  # products of more work are not timed (the LM head at 1024 rows: their form is the plain one)
CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)


def grid_products() -> dict[str, list[tuple[int, int, int]]]:
    """model name -> its dense products (S, N, K) (S = 0: unbatched), from bench_model.SHAPES's configs."""
    from bench_model import BASE, SHAPES

    out = {}
    for name, diff in SHAPES.items():
        c = BASE | diff
        d, h, r = c["hidden_size"], c["num_attention_heads"], c["qk_rope_head_dim"]
        qk = c["qk_nope_head_dim"] + r
        q = [(0, c["q_lora_rank"], d), (0, h * qk, c["q_lora_rank"])] if c["q_lora_rank"] else [(0, h * qk, d)]
        shared = c["n_shared_experts"] * c["moe_intermediate_size"]
        s, i = c["n_routed_experts"], c["moe_intermediate_size"]
        out[name] = sorted(set(q + [(0, c["kv_lora_rank"] + r, d), (0, d, h * c["v_head_dim"]),
                                    (0, c["intermediate_size"], d), (0, d, c["intermediate_size"]),
                                    (0, shared, d), (0, d, shared), (0, c["vocab_size"], d),
                                    (0, i, d), (0, d, i), (s, i, d), (s, d, i)]))
    return out


def measure(dtypes, rows_list, log=print) -> list[dict]:
    """Times every form of every grid product at every row count (within MAX_FLOPS), weights cold."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.models import gemm_cost

    f32 = {"preferred_element_type": jnp.float32}
    fns = {"plain": jax.jit(lambda x, w: jnp.einsum("...mk,...nk->...mn", x, w, **f32)),
           "transposed": jax.jit(lambda x, w: jnp.swapaxes(
               jax.lax.optimization_barrier(jnp.einsum("...nk,...mk->...nm", w, x, **f32)), -1, -2))}
    rng = np.random.default_rng(0)
    points, seen = [], set()
    for dtype_name in dtypes:
        dtype = jnp.dtype(dtype_name)
        for model, products in grid_products().items():
            for s, n, k in products:
                lead = (s,) if s else ()
                copies = min(64, max(2, -(-32 * 2**20 // (max(s, 1) * n * k * dtype.itemsize))))
                ws = None
                for m in rows_list:
                    shape = gemm_cost.GemmShape(m, n, k, dtype.itemsize, s)
                    key = (dtype_name, shape)
                    if key in seen or (m == 1 and not s) or 2 * max(s, 1) * m * n * k > MAX_FLOPS:
                        continue
                    seen.add(key)
                    if ws is None:
                        ws = [jnp.asarray(rng.standard_normal((*lead, n, k)), dtype) for _ in range(copies)]
                    x = jnp.asarray(rng.standard_normal((*lead, m, k)), dtype)
                    times = {form: median_seconds(fns[form], *[(x, w) for w in ws], budget_s=0.2, least=len(ws),
                                                  most=200) for form in gemm_cost.FORMS}
                    points.append(dict(model=model, dtype=dtype_name, batch=s, rows=m, n=n, k=k,
                                       itemsize=dtype.itemsize, times=times))
                    log(f"{dtype_name:>8} {model:>16} S={s:<3} N={n:<6} K={k:<6} M={m:<5} " + " ".join(
                        f"{f}={1e3 * t:.3f}" for f, t in times.items()) + " ms", flush=True)
    return points


def _shape(p):
    from jaxinfer.models import gemm_cost

    return gemm_cost.GemmShape(p["rows"], p["n"], p["k"], p["itemsize"], p["batch"])


def fit(points: list[dict]) -> dict:
    """form -> feature -> seconds per unit (calibration.fit_prices)."""
    from jaxinfer.models import gemm_cost

    coeffs = {}
    for form in gemm_cost.FORMS:
        timed = [p for p in points if form in p["times"]]
        work = [[gemm_cost.work(form, _shape(p))[f] for f in gemm_cost.FEATURES] for p in timed]
        coeffs[form] = dict(zip(gemm_cost.FEATURES, fit_prices(work, [p["times"][form] for p in timed])))
    return coeffs


def old_rule(p) -> str:
    return "transposed" if OLD_TRANSPOSED_ROWS[0] <= p["rows"] <= OLD_TRANSPOSED_ROWS[1] else "plain"


def calibrate(args) -> None:
    import numpy as np

    from jaxinfer.models import gemm_cost

    if args.measurements:
        points, measured_on = load_measurements(args.measurements)
    else:
        points, measured_on = measure(args.dtypes.split(","), CALIBRATION_ROWS), machine()
        if args.save_measurements:
            save_measurements(args.save_measurements, measured_on, points)
    regret = lambda p, form: p["times"][form] / min(p["times"].values())  # noqa: E731
    print("\nleave-one-model-out: measured time of the chosen form / the fastest form's")
    print(f"{'dtype':>8} {'held out':>16} {'fit median':>10} {'fit max':>8} {'old median':>10} {'old max':>8}")
    summary = {}
    for dtype in sorted({p["dtype"] for p in points}):
        ours, olds, times = [], [], [0.0, 0.0, 0.0]  # time-weighted: chosen, old rule's, fastest
        for model in grid_products():
            held = [p for p in points if p["dtype"] == dtype and p["model"] == model]
            rest = [p for p in points if p["dtype"] == dtype and p["model"] != model]
            if not held:
                continue
            coeffs = fit(rest)
            chosen = [gemm_cost.cheapest(_shape(p), coeffs) for p in held]
            r = [regret(p, form) for p, form in zip(held, chosen)]
            o = [regret(p, old_rule(p)) for p in held]
            ours, olds = ours + r, olds + o
            for p, form in zip(held, chosen):
                times[0] += p["times"][form]
                times[1] += p["times"][old_rule(p)]
                times[2] += min(p["times"].values())
            print(f"{dtype:>8} {model:>16} {np.median(r):>10.3f} {max(r):>8.3f} {np.median(o):>10.3f} {max(o):>8.3f}")
        summary[dtype] = (np.median(ours), np.mean(ours), max(ours), times[0] / times[2], np.median(olds),
                          np.mean(olds), max(olds), times[1] / times[2])
        print(f"{dtype:>8} {'all':>16} {summary[dtype][0]:>10.3f} {summary[dtype][2]:>8.3f} {summary[dtype][4]:>10.3f} "
              f"{summary[dtype][6]:>8.3f}   (means {summary[dtype][1]:.3f} vs {summary[dtype][5]:.3f}; weighted by "
              f"time {summary[dtype][3]:.3f} vs {summary[dtype][7]:.3f})")
    print("\nin sample: the table's entry (as shipped) and the refit on every model's products")
    for dtype in summary:
        held = [p for p in points if p["dtype"] == dtype]
        fastest = [min(p["times"].values()) for p in held]
        for name, coeffs in (("shipped", gemm_cost.coefficients(dtype)), ("refit", fit(held))):
            chosen = [p["times"][gemm_cost.cheapest(_shape(p), coeffs)] for p in held]
            print(f"{dtype:>8} {name:>8}: {regret_summary(chosen, fastest)}")
    if args.write_table:
        # The dtypes measured replace their entries; the others' stay (a refit of one dtype keeps the rest).
        kept = json.loads(gemm_cost.TABLE.read_text())["cpu"] if gemm_cost.TABLE.exists() else {}
        table = {"comment": ["Seconds per unit of work (models/gemm_cost.py FEATURES) of each dense product form on",
                             "XLA:CPU, per weight dtype: python benchmarks/gemm_forms.py --calibrate --write-table."],
                 "cpu": kept}
        for dtype, (med, mean, worst, weighted, *_) in summary.items():
            table["cpu"][dtype] = dict(
                source=source(measured_on),
                grid=f"{len(grid_products())} models' products, rows {min(CALIBRATION_ROWS)}-{max(CALIBRATION_ROWS)}",
                held_out=f"chosen / fastest: median {med:.3f}, mean {mean:.3f}, max {worst:.3f}, weighted by time "
                         f"{weighted:.3f}",
                forms=fit([p for p in points if p["dtype"] == dtype]))
        gemm_cost.TABLE.write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {gemm_cost.TABLE}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,8,32,64,128")
    p.add_argument("--shapes", default="4096x512,8192x512,1408x512,512x1408,768x192,512x512,16x256x512,16x512x256")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--calibrate", action="store_true")
    p.add_argument("--dtypes", default="float32,bfloat16", help="--calibrate: weight dtypes")
    p.add_argument("--measurements", help="--calibrate: fit these saved measurements instead of measuring")
    p.add_argument("--save-measurements", help="--calibrate: save the measurements (JSON) here")
    p.add_argument("--write-table", action="store_true", help="--calibrate: write jaxinfer/models/gemm_costs.json")
    args = p.parse_args()
    if args.calibrate:
        calibrate(args)
        return

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.models.layers import matmul_nt

    rng = np.random.default_rng(0)
    dtype = jnp.dtype(args.dtype)
    f32 = {"preferred_element_type": jnp.float32}
    plain = jax.jit(lambda x, w: jnp.einsum("...mk,...nk->...mn", x, w, **f32))
    # The transposed form as layers.matmul_nt writes it, whatever the row count.
    transposed = jax.jit(lambda x, w: jnp.swapaxes(
        jax.lax.optimization_barrier(jnp.einsum("...nk,...mk->...nm", w, x, **f32)), -1, -2))
    forms = {"plain": plain, "transposed": transposed, "matmul_nt": jax.jit(matmul_nt)}

    print(f"x [M, K] @ W [N, K]^T, {dtype.name}, {jax.devices()[0].platform}; min ms over {args.repeats} passes")
    print(f"{'[S x] N x K':>12} {'M':>5} {'plain':>8} {'transposed':>11} {'speedup':>8} {'matmul_nt':>10}")
    for shape in args.shapes.split(","):
        *batch, n, k = (int(v) for v in shape.split("x"))
        copies = max(2, -(-32 * 2**20 // (math.prod(batch) * n * k * 4)))
        ws = [jnp.asarray(rng.standard_normal((*batch, n, k)), dtype) for _ in range(copies)]
        for m in (int(r) for r in args.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((*batch, m, k)), dtype)
            for fn in (transposed, forms["matmul_nt"]):
                np.testing.assert_allclose(np.asarray(fn(x, ws[0])), np.asarray(plain(x, ws[0])), rtol=1e-4,
                                           atol=1e-3)
            best = {}
            for name, fn in forms.items():
                times = []
                for _ in range(args.repeats):
                    for w in ws:
                        t0 = time.perf_counter()
                        fn(x, w).block_until_ready()
                        times.append(time.perf_counter() - t0)
                best[name] = min(times) * 1e3
            print(f"{shape:>12} {m:5d} {best['plain']:8.3f} {best['transposed']:11.3f} "
                  f"{best['plain'] / best['transposed']:7.2f}x {best['matmul_nt']:10.3f}", flush=True)


if __name__ == "__main__":
    main()
