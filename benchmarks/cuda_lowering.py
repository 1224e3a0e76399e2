"""The engine's decode step lowered for CUDA on a machine without a GPU: StableHLO ops per layer (issue 33 item 5).

    python benchmarks/cuda_lowering.py [--shapes bench,v2lite,...] [--batch-sizes 1,32] [--dtype bfloat16]
        [--num-scheduler-steps 1]

Why: a GPU decode step at small batch is launch-bound (the H200 took 5.5 ms for a batch-1 step of the embedded
model on 2026-11-30, docs/benchmarks.md), and launches follow the program's ops. XLA:GPU's own compile (its
fusions, hence the kernels it launches) needs a CUDA client, so what is measurable here is the program XLA:GPU
would start from: the jitted step (engine/step_program.py) lowered with ``lowering_platforms=("cuda",)``.

How: for each shape of bench_model.SHAPES, two random checkpoints that differ by one MoE layer are served by an
engine (this machine's CPU), a decode step (T = 1, B rows) is captured from a short greedy generate and lowered
for cuda; one layer's ops are the difference of the two programs' op counts (exact: everything outside the layers
is the same). The routed-expert path is the one the cost model picks on a GPU for that step (models/moe_cost.py
``choose(..., "gpu")``; its GPU prices are nominal), forced with ``moe_path``. Printed per shape and batch: the
ops of the whole step, of one MoE layer, and of one MoE layer by kind (dot_general, gather / scatter, custom_call:
Pallas kernels, while: loops), the elementwise ops XLA would fuse included, and the step's while loops (a
multi-step decode step runs its iterations in one). An upper bound on a layer's kernels before fusion, not a
launch count: record, do not tune from it. The attention backend is "xla" (the cache read inside the step, written
by a second program): on a CPU host ``mla_decode`` takes its XLA implementation, so the "pallas" backend's program
would hold the kernel's XLA twin, not its Mosaic GPU custom call.
"""

from __future__ import annotations

import argparse
import collections
import re
import tempfile
import warnings

KINDS = {"dot_general": ("stablehlo.dot_general", "stablehlo.dot"), "gather/scatter": ("stablehlo.gather",
         "stablehlo.scatter", "stablehlo.dynamic_slice", "stablehlo.dynamic_update_slice"),
         "custom_call": ("stablehlo.custom_call",), "while": ("stablehlo.while",)}
FREE = {"stablehlo.constant", "func.return", "stablehlo.return", "func.call"}  # no kernel of their own


def op_counts(text: str) -> collections.Counter:
    """Ops of a StableHLO module's text by name (every function: the step's callees are its layers' parts)."""
    ops = collections.Counter(re.findall(r"^\s*(?:%[^=]+=\s*)?\"?([a-z_]+\.[a-z_.]+)", text, re.M))
    for name in FREE | {"func.func", "module"}:
        ops.pop(name, None)
    return ops


def lowered_decode_step(checkpoint: str, batch: int, dtype: str, steps: int, moe_path: str) -> str:
    """StableHLO text of the engine's first decode step (T = 1) of ``batch`` greedy sequences, lowered for cuda
    (``steps`` iterations: num_scheduler_steps)."""
    import numpy as np

    from jaxinfer import LLM, SamplingParams

    llm = LLM(checkpoint, mesh="1x1", dtype=dtype, max_num_seqs=batch, enable_prefix_caching=False,
              attention_backend="xla", num_scheduler_steps=steps, moe_path=moe_path)
    runner = llm.runner
    run, captured = runner._run, []

    def capture(packed, layout, *blocks):  # layout.columns[0]: the token ids [rows, T]
        if not captured and layout.columns[0][2] == (1,):
            captured.append((packed, layout))
        return run(packed, layout, *blocks)

    runner._run = capture
    try:
        prompts = np.random.default_rng(0).integers(0, llm.model.config.vocab_size, (batch, 8)).tolist()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True), use_tqdm=False)
    finally:
        del runner._run
    packed, layout = captured[0]
    args = (runner._state_leaves[0], runner.layers, runner.tokens, runner.load.total, runner.load.evicted(),
            packed, layout, runner.head_screen)
    return runner.program.step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def gpu_moe_path(cfg, batch: int, dtype: str) -> str:
    """The routed-expert path the cost model picks for a decode step of ``batch`` rows on a GPU."""
    from jaxinfer.models.moe_cost import ExpertShape, choose

    itemsize = {"bfloat16": 2, "float32": 4}[dtype]
    shape = ExpertShape(rows=batch, top_k=cfg.num_experts_per_tok, num_slots=cfg.n_routed_experts,
                        hidden=cfg.hidden_size, inter=cfg.moe_intermediate_size, weight_itemsize=itemsize)
    return choose(shape, dtype, "gpu")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="bench", help="bench_model.SHAPES names, comma-separated, or 'all'")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--num-scheduler-steps", type=int, default=1, help="the GPU engine's default is 1")
    args = p.parse_args()

    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    import torch

    from bench_model import BASE, SHAPES, describe

    shapes = list(SHAPES) if args.shapes == "all" else args.shapes.split(",")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    print(f"decode step (T = 1) lowered for cuda: dtype {args.dtype}, attention backend xla, "
          f"num_scheduler_steps {args.num_scheduler_steps}; ops per MoE layer = ops(layers + 1) - ops(layers)")
    for shape in shapes:
        counts = {}
        for extra in (0, 1):
            values = BASE | SHAPES[shape]
            cfg = DeepseekV3Config(**(values | {"num_hidden_layers": values["num_hidden_layers"] + extra}))
            torch.manual_seed(0)
            with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                DeepseekV3ForCausalLM(cfg).save_pretrained(tmp)
                for b in batches:
                    path = gpu_moe_path(cfg, b, args.dtype)
                    text = lowered_decode_step(tmp, b, args.dtype, args.num_scheduler_steps, path)
                    counts[extra, b] = (op_counts(text), path)
        print(f"{shape} ({describe(shape)})")
        for b in batches:
            (whole, path), (more, _) = counts[0, b], counts[1, b]
            layer = more - whole  # Counter subtraction keeps the positive counts: one MoE layer's ops
            kinds = ", ".join(f"{k} {sum(layer[n] for n in names)}" for k, names in KINDS.items())
            print(f"  B={b:3d}  moe_path {path:8s}  step {sum(whole.values()):5d} ops "
                  f"({whole['stablehlo.while']} while); one MoE layer "
                  f"{sum(layer.values()):4d} ops ({kinds})", flush=True)


if __name__ == "__main__":
    main()
