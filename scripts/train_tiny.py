"""Reproduces the embedded default model end to end: corpus -> tokenizer -> training -> FP8 export -> evaluation.

    nice -n 10 python scripts/train_tiny.py --out jaxinfer/default_model

--steps overrides the recipe's step count (smoke runs); the result is then not the shipped model.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="jaxinfer/default_model", help="output directory")
    parser.add_argument("--steps", type=int, default=None, help="override the recipe's step count")
    args = parser.parse_args(argv)

    from jaxinfer.train import pipeline, recipe

    tc = recipe.train_config()
    if args.steps is not None:
        if args.steps < 1:
            parser.error(f"--steps must be >= 1, got {args.steps}")
        tc = dataclasses.replace(tc, steps=args.steps, warmup_steps=min(tc.warmup_steps, max(1, args.steps // 10)))
    pipeline.build(args.out, tc=tc, log=lambda s: print(s, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
