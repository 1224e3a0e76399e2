"""``jaxinfer`` command line: ``score`` (next-token log-probs of a prompt) and ``convert`` (HF -> orbax).

Results go to stdout, progress and summaries to stderr. Errors in user input print one line and exit 2.
``generate``, ``bench`` and ``sweep`` arrive with the serving engine.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time


def _add_runtime_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", default=None, help="'DxE' (e.g. 1x8), a meshes/*.toml file; default: all devices as 1xN")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--cpu-devices", type=int, default=None,
                   help="simulate N CPU devices (set before JAX starts; CPU only)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxinfer", description="DeepSeek-V3-family inference in JAX")
    sub = parser.add_subparsers(dest="command", required=True)

    score = sub.add_parser("score", help="log-probabilities of a prompt's tokens and the greedy next token")
    src = score.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="HF checkpoint directory or jaxinfer orbax directory")
    src.add_argument("--preset", help="random weights for a preset config (e.g. tiny, deepseek-v2-lite)")
    score.add_argument("prompt", nargs="?", help="text (needs the checkpoint's tokenizer.json)")
    score.add_argument("--token-ids", type=int, nargs="+", help="the prompt as token ids")
    score.add_argument("--seed", type=int, default=0, help="weights seed for --preset")
    _add_runtime_flags(score)

    convert = sub.add_parser("convert", help="write an HF checkpoint in jaxinfer's orbax form")
    convert.add_argument("hf_dir")
    convert.add_argument("out_dir")
    convert.add_argument("--keep-fp8", action=argparse.BooleanOptionalAction, default=None,
                         help="keep FP8 weights with their block scales (default: yes for FP8 checkpoints)")
    _add_runtime_flags(convert)
    return parser


def _start_jax(cpu_devices: int | None) -> None:
    import jax

    if cpu_devices is not None:
        if cpu_devices < 1:
            raise ValueError(f"--cpu-devices must be >= 1, got {cpu_devices}")
        jax.config.update("jax_num_cpu_devices", cpu_devices)


def _prompt_ids(args, model) -> list[int]:
    if args.token_ids:
        if args.prompt:
            raise ValueError("give either a text prompt or --token-ids, not both")
        return list(args.token_ids)
    if not args.prompt:
        raise ValueError("no prompt: pass text or --token-ids")
    tok_file = model.path / "tokenizer.json" if model.path else None
    if tok_file is None or not tok_file.is_file():
        raise ValueError("a text prompt needs a tokenizer.json beside the checkpoint; pass --token-ids instead")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tok_file))
    tokenizer.encode_special_tokens = True  # special-token strings in user text stay plain text
    return tokenizer.encode(args.prompt, add_special_tokens=False).ids


def _score(args) -> None:
    import numpy as np

    import jaxinfer
    from jaxinfer.config import ModelConfig

    t0 = time.perf_counter()
    if args.preset:
        model = jaxinfer.Model.random(ModelConfig.preset(args.preset), args.mesh, args.dtype, args.seed)
    else:
        model = jaxinfer.load_model(args.model, mesh=args.mesh, dtype=args.dtype)
    ids = _prompt_ids(args, model)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    logits = model.logits(np.asarray([ids]))[0]  # [T, V]
    forward_s = time.perf_counter() - t0
    logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    token_logp = [float(logp[t - 1, ids[t]]) for t in range(1, len(ids))]
    result = {
        "token_ids": ids,
        "token_logprobs": [None] + token_logp,
        "perplexity": float(np.exp(-np.mean(token_logp))) if token_logp else None,
        "next_token_id": int(logits[-1].argmax()),
        "next_token_logprob": float(logp[-1].max()),
    }
    print(json.dumps(result))
    mesh = "x".join(str(s) for s in model.mesh.devices.shape)
    print(f"[jaxinfer] scored {len(ids)} tokens on mesh {mesh} ({model.mesh.devices.flat[0].platform}), "
          f"load {load_s:.2f}s, forward (incl. compile) {forward_s:.2f}s", file=sys.stderr)


def _convert(args) -> None:
    import jaxinfer
    from jaxinfer.checkpoint.hf_loader import checkpoint_layout
    from jaxinfer.checkpoint.safetensors_io import SafetensorsCheckpoint
    from jaxinfer.config import ModelConfig

    from jaxinfer.model import is_jaxinfer_orbax

    keep_fp8 = args.keep_fp8
    if keep_fp8 is None and is_jaxinfer_orbax(args.hf_dir):
        keep_fp8 = False  # an orbax dir keeps the layout it was saved with
    elif keep_fp8 is None:
        keep_fp8 = checkpoint_layout(ModelConfig.from_hf_config(args.hf_dir),
                                     SafetensorsCheckpoint(args.hf_dir))["has_fp8"]
    t0 = time.perf_counter()
    model = jaxinfer.load_model(args.hf_dir, mesh=args.mesh, dtype=args.dtype, keep_fp8=keep_fp8)
    out = model.save(args.out_dir)
    print(str(pathlib.Path(out).absolute()))
    print(f"[jaxinfer] converted {args.hf_dir} -> {out} (dtype {args.dtype}, fp8 kept: {keep_fp8}) in "
          f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        _start_jax(args.cpu_devices)
        {"score": _score, "convert": _convert}[args.command](args)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"jaxinfer {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
