"""Dispatch / combine bytes per token of the expert-parallel MoE, FP8 vs BF16 dispatch (DeepEP's formats).

    python benchmarks/dispatch_bytes.py [--mesh 1x8] [--hidden 1024] [--batch 8] [--seq 64]

Counts come from the routing of a real batch through a random V3-shaped model (jaxinfer/parallel/comm.py);
expected FP8/BF16 ratio per token send: (H + 4H/128) / 2H (DeepEP: e4m3 values + one fp32 scale per 128).
"""

from __future__ import annotations

import argparse


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mesh", default="1x8")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--cpu-devices", type=int, default=8)
    args = p.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    import numpy as np

    import jaxinfer
    from jaxinfer.parallel.comm import comm_stats

    config = jaxinfer.ModelConfig.tiny(hidden_size=args.hidden, num_hidden_layers=3, n_routed_experts=32,
                                       num_experts_per_tok=8, n_group=8, topk_group=4, vocab_size=1024)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (args.batch, args.seq))
    stats = {}
    for fp8 in (False, True):
        model = jaxinfer.Model.random(config, mesh=args.mesh, dtype="bfloat16", fp8_dispatch=fp8)
        stats[fp8] = comm_stats(model, ids)
        print(stats[fp8].summary())
    h = args.hidden
    ratio = stats[True].dispatch_bytes_per_send / stats[False].dispatch_bytes_per_send
    print(f"FP8 / BF16 dispatch bytes per token send: {ratio:.4f} (expected (H + 4H/128) / 2H = "
          f"{(h + 4 * h / 128) / (2 * h):.4f}); combine stays BF16: "
          f"{stats[True].combine_payload_bytes / max(stats[True].remote_token_sends, 1):.0f} B per send")


if __name__ == "__main__":
    main()
