"""Full-sequence forward (prefill logits) of jaxinfer vs transformers on the same random checkpoint, on CPU.

    python benchmarks/forward_vs_transformers.py [--batch 4] [--seq 128] [--dtype float32] [--mesh 1x1]

Builds a V3-shaped model (q_lora, grouped sigmoid router, dense + MoE layers, YaRN) with transformers, saves it
in DeepSeek's checkpoint format, loads it with jaxinfer, then times both forwards (median of --repeats, after one
warm-up that includes jaxinfer's compilation) and checks that the logits agree. Prints tokens/s for each.
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
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--mesh", default="1x1")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (the CPU machines have 2 cores)")
    p.add_argument("--cpu-devices", type=int, default=None,
                   help="simulated CPU devices (default: the mesh's; more slow a 1x1 step down: docs/benchmarks.md)")
    args = p.parse_args()

    import jax

    from jaxinfer.parallel.mesh import mesh_shape

    jax.config.update("jax_num_cpu_devices", args.cpu_devices or math.prod(mesh_shape(args.mesh, 1)))

    import numpy as np
    import torch

    import jaxinfer

    from bench_model import build_reference

    cfg, ref = build_reference(args.threads)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, args.seq))
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref.save_pretrained(tmp)
        with torch.no_grad():
            f32_logits = ref(torch.as_tensor(ids)).logits.numpy()  # the float32 reference
        ref = ref.to(torch_dtype)
        model = jaxinfer.load_model(tmp, mesh=args.mesh, dtype=args.dtype)

    def hf():
        with torch.no_grad():
            return ref(torch.as_tensor(ids)).logits.float().numpy()

    def timed(fn):
        out = fn()  # warm-up (jaxinfer: compilation)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return out, statistics.median(times)

    hf_out, hf_s = timed(hf)
    jx_out, jx_s = timed(lambda: model.logits(ids))
    tokens = args.batch * args.seq
    def err(x):
        d = np.abs(x - f32_logits) / np.abs(f32_logits).max()
        agree = (x.argmax(-1) == f32_logits.argmax(-1)).mean()
        return f"max {d.max():.1e}, mean {d.mean():.1e}, argmax agreement {agree:.4f}"

    print(f"prefill forward, B={args.batch} T={args.seq} dtype={args.dtype} mesh={args.mesh} "
          f"(hidden 512, 4 layers, 16 experts top-4)")
    print(f"  transformers: {hf_s * 1e3:8.1f} ms  {tokens / hf_s:9.0f} tok/s")
    print(f"  jaxinfer:     {jx_s * 1e3:8.1f} ms  {tokens / jx_s:9.0f} tok/s  ({hf_s / jx_s:.2f}x)")
    print(f"  error vs transformers float32, |diff|/max|ref|: transformers {args.dtype}: {err(hf_out)}")
    print(f"  {' ' * 46}jaxinfer {args.dtype}: {err(jx_out)}")


if __name__ == "__main__":
    main()
