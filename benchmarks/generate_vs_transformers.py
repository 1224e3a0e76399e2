"""Greedy generation: jaxinfer's engine (LLM.generate) vs transformers' generate on the same random checkpoint.

    python benchmarks/generate_vs_transformers.py [--batch-sizes 1,32] [--input-len 64] [--output-len 64]
        [--dtype float32] [--mesh 1x1] [--num-scheduler-steps K] [--shapes bench,v2lite,...]

The models are bench_model.py's ``SHAPES`` (default "bench": hidden 512, 4 layers of which 3 MoE, 16 routed experts
top-4, q_lora, YaRN; the others the grid of issue 33), each saved in DeepSeek's checkpoint format in turn. For each
batch size B: B random prompts of --input-len tokens, --output-len new tokens, greedy, EOS ignored (transformers:
eos_token_id=None, min_new_tokens).
Decode throughput = B * (output_len - 1) / (time of output_len tokens - time of 1 token), so the prefill and the
first token are left out for both; the time of 1 token (prefill + first token, the TTFT of a batch) is printed on its
own line. After a warm-up (jaxinfer's compilation) the two run in alternation, --repeats rounds of (jaxinfer 1 token,
jaxinfer output_len tokens, transformers 1 token, transformers output_len tokens): the CPU machines here share memory
bandwidth with other tenants and their speed drifts within minutes (docs/benchmarks.md "How to read"), so each
round's ratio compares the two under the same conditions. Printed: the median of each side's per-round throughput and
the median and range of the per-round ratios; the first-token (prefill) and whole-generate ratios, medians of the
rounds' ratios.

Limits (once per shape, before its batches): the matmul peak ([2048, 2048] x [2048, 2048] in the model dtype) and
the memory bandwidth (a one-row product over 512 MB), as JAX reaches them in the same minutes. Per batch, jaxinfer's
fraction of each: decode flops (2 x the weights a token multiplies) per second over the peak, decode weight bytes
(what a step reads: the dense weights and the expected distinct experts of the batch) per second over the
bandwidth, and prefill flops per second (first token's time) over the peak.

Host share (jaxinfer, decode): 1 - (device time per token) / (wall time per token), where the device time is
measured by dispatching the same captured decode step back to back (no host work between them) and divided by
the tokens it computes per sequence (--num-scheduler-steps).

Goals (issue 33, at batch 1 and 32): decode >= 5x transformers at batch 1 and >= 3x at batch 32, whole generate
>= 3x at batch 32, prefill >= 1x at both. A measure's limit is its roofline time, max(flops / peak, weight bytes /
bandwidth) with the limits above: decode steps as above, prefill the prompts' flops (the head on the last tokens)
and one read of the weights their tokens use, whole generate the two. A ratio below its goal is "exempt" where
transformers already reaches 1 / goal of that limit (no engine could reach the goal there), else "missed", with
jaxinfer's fraction of the limit (near 100%: the limit bounds it; well below: overhead). The verdicts end each
batch's lines, and a markdown table of them over the shapes ends the run.

Memory floor (batch 1): a decode token reads every weight it uses once (the routed experts' top-k, one embedding
row; the head's int8 copy when greedy screening is on, jaxinfer/models/screened_head.py). The line after batch 1
gives those bytes and the time of one matrix-vector product over as many bytes, timed in alternation with the
captured decode step: what streaming the weights costs in the same minutes.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
import warnings


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--mesh", default="1x1")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-scheduler-steps", type=int, default=None,
                   help="jaxinfer's decode iterations per step (LLM's num_scheduler_steps; default: LLM's default)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (the CPU machines have 2 cores)")
    p.add_argument("--cpu-devices", type=int, default=None,
                   help="simulated CPU devices (default: the mesh's; more slow a 1x1 step down: docs/benchmarks.md)")
    p.add_argument("--greedy-screening", choices=["auto", "on", "off"], default="auto",
                   help="LLM's greedy_screening (auto: its default, on for float32 on CPU)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--shapes", default="bench", help="comma-separated bench_model.SHAPES names, or 'all'")
    args = p.parse_args()

    import jax

    from bench_model import SHAPES
    from jaxinfer.parallel.mesh import mesh_shape

    jax.config.update("jax_num_cpu_devices", args.cpu_devices or math.prod(mesh_shape(args.mesh, 1)))
    verdicts = {}  # shape -> {(measure, batch): cell}
    for shape in list(SHAPES) if args.shapes == "all" else args.shapes.split(","):
        verdicts[shape] = run_shape(args, shape)
    if not args.skip_transformers:
        print(goal_table(verdicts))


GOALS = {("decode", 1): 5.0, ("decode", 32): 3.0, ("whole generate", 32): 3.0, ("prefill", 1): 1.0,
         ("prefill", 32): 1.0}  # issue 33's: (measure, batch) -> ratio to transformers


def verdict(ratio: float, goal: float, limit_s: float, ours_s: float, theirs_s: float) -> str:
    """One goal's verdict (module doc): met / exempt / missed, with the two sides' fractions of the limit."""
    ours, theirs = limit_s / ours_s, limit_s / theirs_s
    if ratio >= goal:
        word = "met"
    elif theirs >= 1 / goal:
        word = f"exempt: transformers at {theirs:.0%} of the limit"
    else:
        word = f"missed: jaxinfer at {ours:.0%} of the limit, transformers {theirs:.0%}"
    return f"{ratio:.2f}x ({word})"


def goal_table(verdicts: dict) -> str:
    """Markdown: a row per shape, a column per goal, the cells of ``verdict``."""
    cols = [key for key in GOALS if any(key in row for row in verdicts.values())]
    lines = ["| shape | " + " | ".join(f"{m} B={b} (goal {GOALS[m, b]:g}x)" for m, b in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for shape, row in verdicts.items():
        lines.append(f"| {shape} | " + " | ".join(row.get(key, "-") for key in cols) + " |")
    return "\n".join(lines)


def run_shape(args, shape: str) -> dict:
    """The benchmark of the module doc on one of bench_model.py's SHAPES; returns its goal verdicts
    ({(measure, batch): cell}, empty with --skip-transformers)."""
    import numpy as np
    import torch

    from jaxinfer import LLM, SamplingParams

    from bench_model import build_reference, describe

    cfg, ref = build_reference(args.threads, shape=shape)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    tmp = tempfile.TemporaryDirectory()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref.save_pretrained(tmp.name)
    ref = ref.to(torch_dtype)
    options = {} if args.num_scheduler_steps is None else {"num_scheduler_steps": args.num_scheduler_steps}
    if args.greedy_screening != "auto":
        options["greedy_screening"] = args.greedy_screening == "on"
    llm = LLM(tmp.name, mesh=args.mesh, dtype=args.dtype, max_num_seqs=max(batch_sizes),
              enable_prefix_caching=False, **options)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    print(f"greedy generation, input {args.input_len}, output {args.output_len}, dtype {args.dtype}, mesh "
          f"{args.mesh} ({describe(shape)}), num_scheduler_steps "
          f"{llm.config.num_scheduler_steps}, greedy_screening {llm.config.greedy_screening}; decode tok/s exclude "
          f"prefill + first token; median of {args.repeats} alternating rounds")
    peak, bandwidth = machine_limits(llm.model.dtype)
    print(f"limits, measured now: matmul {peak / 1e9:.1f} GFLOP/s ({args.dtype} [2048, 2048] x [2048, 2048]), "
          f"memory {bandwidth / 1e9:.1f} GB/s (one-row product over 512 MB)", flush=True)
    verdicts = {}
    for b in batch_sizes:
        prompts = np.random.default_rng(b).integers(0, cfg.vocab_size, (b, args.input_len))

        def ours(n):
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            return llm.generate(prompts.tolist(), params, use_tqdm=False)

        def theirs(n):
            with torch.no_grad():
                return ref.generate(torch.as_tensor(prompts), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)

        sides = {"jaxinfer": ours} if args.skip_transformers else {"jaxinfer": ours, "transformers": theirs}
        for fn in sides.values():  # warm-up: compilation, caches
            fn(1), fn(args.output_len)
        llm.wait_for_compilations()  # the prefill block counts compiled ahead in the background
        first = {name: [] for name in sides}
        decode = {name: [] for name in sides}  # seconds of output_len - 1 decode steps, per round
        whole = {name: [] for name in sides}  # seconds of the whole generate (prefill + output_len tokens)
        for _ in range(args.repeats):
            for name, fn in sides.items():
                t1 = timed(lambda: fn(1))
                first[name].append(t1)
                whole[name].append(timed(lambda: fn(args.output_len)))
                decode[name].append(whole[name][-1] - t1)
        steps = args.output_len - 1
        host_share, device_ms, replay = decode_host_share(llm, ours, args.output_len)
        ours_decode = statistics.median(decode["jaxinfer"])
        line = (f"  B={b:3d}  jaxinfer: {b * steps / ours_decode:8.1f} tok/s ({ours_decode / steps * 1e3:6.2f} "
                f"ms/token; device {device_ms:6.2f} ms/token, host share {host_share:5.1%})")
        first_line = f"         first token (prefill): jaxinfer {statistics.median(first['jaxinfer']) * 1e3:7.1f} ms"
        if not args.skip_transformers:
            ratios = sorted(t / o for t, o in zip(decode["transformers"], decode["jaxinfer"]))
            line += (f"  transformers: {b * steps / statistics.median(decode['transformers']):8.1f} tok/s  ->  "
                     f"{statistics.median(ratios):.2f}x (rounds {ratios[0]:.2f}-{ratios[-1]:.2f}x)")
            first_ratio = statistics.median(t / o for t, o in zip(first["transformers"], first["jaxinfer"]))
            first_line += (f", transformers {statistics.median(first['transformers']) * 1e3:7.1f} ms  ->  "
                           f"{first_ratio:.2f}x")
            whole_ratio = statistics.median(t / o for t, o in zip(whole["transformers"], whole["jaxinfer"]))
            first_line += f"; whole generate {whole_ratio:.2f}x"
        flops, head_flops, step_bytes = token_work(llm, b)
        prefill_flops = b * ((flops - head_flops) * args.input_len + head_flops)  # the head: last tokens only
        first_line += (f"\n         jaxinfer vs the limits: decode {flops * b * steps / ours_decode / peak:5.1%} of "
                       f"the matmul peak, {step_bytes * steps / ours_decode / bandwidth:5.1%} of the bandwidth; "
                       f"prefill {prefill_flops / statistics.median(first['jaxinfer']) / peak:5.1%} of the peak")
        if not args.skip_transformers:
            decode_limit = steps * max(flops * b / peak, step_bytes / bandwidth)
            prefill_bytes = token_work(llm, b * args.input_len)[2]  # the experts the prompts' tokens route to
            prefill_limit = max(prefill_flops / peak, prefill_bytes / bandwidth)
            measured = {"decode": (statistics.median(ratios), decode_limit, decode),
                        "prefill": (first_ratio, prefill_limit, first),
                        "whole generate": (whole_ratio, prefill_limit + decode_limit, whole)}
            for measure, (ratio, limit, times) in measured.items():
                if (measure, b) in GOALS:
                    verdicts[measure, b] = verdict(ratio, GOALS[measure, b], limit,
                                                   statistics.median(times["jaxinfer"]),
                                                   statistics.median(times["transformers"]))
            if any(key[1] == b for key in verdicts):
                first_line += "\n         goals: " + "; ".join(f"{m} {v}" for (m, bb), v in verdicts.items() if bb == b)
        print(line + "\n" + first_line, flush=True)
        if b == 1:
            mb, floor_ms, step_ms = weight_stream_floor(llm, replay)
            print(f"         weights read per token {mb:.1f} MB; one matrix-vector product over as many bytes: "
                  f"{floor_ms:.2f} ms ({mb / floor_ms:.1f} GB/s); the decode token took {step_ms / floor_ms:.2f}x "
                  f"that (interleaved, min of 7)", flush=True)
    tmp.cleanup()
    return verdicts


def decode_host_share(llm, ours, output_len: int):
    """(host share, device ms per token, replay) of the decode steps of ``ours(output_len)`` (see the module doc);
    replay() times the captured decode step again (seconds per token)."""
    import jax

    runner = llm.runner
    run = runner._run
    captured = []

    def capture(*args):  # the first decode step's inputs (T = 1), to replay below
        packed, layout = args[:2]  # layout.columns[0]: the token ids [rows, T]; [5]: the slots [rows, iterations]
        if not captured and layout.columns[0][2] == (1,):
            captured.append(args)
        return run(*args)

    runner._run = capture
    try:
        t0 = time.perf_counter()
        ours(output_len)
        wall = time.perf_counter() - t0
        t0 = time.perf_counter()
        ours(1)
        wall_prefill = time.perf_counter() - t0
    finally:
        del runner._run
    wall_token = (wall - wall_prefill) / (output_len - 1)
    iterations = captured[0][1].columns[5][2][0]
    # Device time: the captured decode step dispatched back to back, then one wait (it rewrites the same cache
    # slots of finished sequences: harmless).
    def replay(n=20):  # seconds per token of the captured decode step, dispatched back to back
        t0 = time.perf_counter()
        for _ in range(n):
            out = run(*captured[0])
        jax.block_until_ready((out, runner.layers))
        return (time.perf_counter() - t0) / n / iterations

    jax.block_until_ready(run(*captured[0]))
    device_token = replay()
    return max(0.0, 1 - device_token / wall_token), device_token * 1e3, replay


def machine_limits(dtype) -> tuple[float, float]:
    """(FLOP/s of a [2048, 2048] x [2048, 2048] matmul in ``dtype`` with float32 accumulation, bytes/s of a
    one-row product streaming 512 MB of ``dtype`` weights): the CPU's matmul peak and memory bandwidth as JAX
    reaches them, min time of 5, in the same minutes as the benchmark."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.models.layers import matmul_nt

    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((2048, 2048)), dtype)
    mm = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    w = jnp.asarray(rng.standard_normal((512 * 2 ** 20 // (1024 * jnp.dtype(dtype).itemsize), 1024)), dtype)
    x = jnp.ones((1, 1024), dtype)
    mv = jax.jit(matmul_nt)
    times = {"mm": [], "mv": []}
    for _ in range(6):
        for name, fn, args in (("mm", mm, (a, a)), ("mv", mv, (x, w))):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t0)
    return 2 * 2048 ** 3 / min(times["mm"][1:]), w.nbytes / min(times["mv"][1:])


def _matrices(llm):
    """(path string, leaf) of the model's weight matrices a decode token multiplies: rank >= 2, the embedding
    (one row read) and the MTP module left out."""
    import jax

    for path, leaf in jax.tree_util.tree_leaves_with_path(llm.model.state):
        keys = jax.tree_util.keystr(path)
        if getattr(leaf, "ndim", 0) >= 2 and "embed_tokens" not in keys and "mtp" not in keys:
            yield keys, leaf


def token_work(llm, batch: int) -> tuple[float, float, float]:
    """(flops per token, the LM head's share of them, weight bytes per decode step of ``batch`` sequences): 2 x the
    weights a token multiplies (routed experts: top_k of each layer's slots; the embedding's row left out; attention
    over the cache left out: 128 tokens of context here), and the weights a step reads once: every dense weight,
    and per MoE layer the expected distinct slots the batch routes to, slots x (1 - (1 - top_k / slots) ^ batch),
    under uniform routing."""
    top_k = llm.model.config.num_experts_per_tok
    flops = head = step_bytes = 0.0
    for keys, leaf in _matrices(llm):
        if "scale_inv" in keys:
            continue
        if "['experts']" in keys:
            slots = leaf.shape[0]
            flops += 2 * leaf.size * top_k / slots
            step_bytes += leaf.nbytes * (1 - (1 - top_k / slots) ** batch)
        else:
            flops += 2 * leaf.size
            head += 2 * leaf.size if "lm_head" in keys else 0
            step_bytes += leaf.nbytes
    return flops, head, step_bytes


def weight_stream_floor(llm, replay) -> tuple[float, float, float]:
    """Batch-1 decode reads every weight once per token (routed experts: top_k of each layer's slots; the
    embedding: one row; the head: its int8 screen with greedy_screening, plus a few rows). Returns (those MB, ms
    of one float32-accumulating matrix-vector product over as many bytes of the model dtype (layers.matmul_nt,
    the engine's one-row product), ms of a decode token by ``replay``), both the min of 7 interleaved rounds: the
    memory-bandwidth floor of the token, measured in the same minutes (the machines here drift)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.models.layers import matmul_nt

    top_k = llm.model.config.num_experts_per_tok
    screen = llm.runner.head_screen
    total = 0
    for keys, leaf in _matrices(llm):
        share = top_k / leaf.shape[0] if "['experts']" in keys else 1.0
        if screen is not None and "lm_head" in keys:  # greedy screening reads the head's int8 copy instead
            leaf = screen.q
        total += leaf.nbytes * share
    dtype = llm.model.dtype
    k = 512
    w = jnp.asarray(np.random.default_rng(0).standard_normal((int(total) // (k * jnp.dtype(dtype).itemsize), k)),
                    dtype)
    x = jnp.ones((1, k), dtype)
    mv = jax.jit(matmul_nt)
    jax.block_until_ready(mv(x, w))
    floor, token = [], []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(10):
            y = mv(x, w)
        jax.block_until_ready(y)
        floor.append((time.perf_counter() - t0) / 10)
        token.append(replay())
    return total / 1e6, min(floor) * 1e3, min(token) * 1e3


if __name__ == "__main__":
    main()
