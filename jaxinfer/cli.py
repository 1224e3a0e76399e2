"""``jaxinfer`` command line: ``score`` (next-token log-probs of a prompt) and ``convert`` (HF -> orbax).

Results go to stdout, progress and summaries to stderr. Errors in user input print one line and exit 2.
Multi-process runs (``--coordinator HOST:PORT --num-processes N --process-id I``, the same command in every
process): all processes compute, process 0 prints the results.
``generate`` lives in cli_generate.py, ``bench`` in bench.py, ``sweep`` in sweep.py, ``plan`` (no JAX) in
plan/cli.py.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

from jaxinfer import bench, sweep
from jaxinfer import cli_generate as generate
from jaxinfer.compile_cache import compilation_cache_dir
from jaxinfer.plan import cli as plan


def _add_runtime_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", default=None, help="'DxE' (e.g. 1x8), a meshes/*.toml file; default: all devices as 1xN")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--cpu-devices", type=int, default=None,
                   help="simulate N CPU devices (set before JAX starts; CPU only; per process in multi-process runs)")
    p.add_argument("--compilation-cache", metavar="DIR", default=None,
                   help="JAX's persistent compilation cache, so later runs skip compiling the engine's programs "
                        "(most of a cold first token's wait on CPU); default: "
                        "$JAX_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/jaxinfer/jax (~/.cache/jaxinfer/jax); "
                        "'off' disables it")
    multi = p.add_argument_group("multi-process (jax.distributed; every process runs the same command)")
    multi.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                       help="address of process 0, which serves the coordination service there")
    multi.add_argument("--num-processes", type=int, metavar="N", default=None, help="number of processes")
    multi.add_argument("--process-id", type=int, metavar="I", default=None, help="this process's id in [0, N)")


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

    generate.add_parser(sub)
    _add_runtime_flags(sub.choices["generate"])

    bench.add_parser(sub)
    _add_runtime_flags(sub.choices["bench"])
    sweep.add_parser(sub)  # starts no JAX itself: each mesh runs `bench` in fresh processes
    plan.add_parser(sub)  # pure Python: main() starts no JAX for it

    convert = sub.add_parser("convert", help="write an HF checkpoint in jaxinfer's orbax form")
    convert.add_argument("hf_dir")
    convert.add_argument("out_dir")
    convert.add_argument("--keep-fp8", action=argparse.BooleanOptionalAction, default=None,
                         help="keep FP8 weights with their block scales (default: yes for FP8 checkpoints)")
    _add_runtime_flags(convert)
    return parser


def _start_jax(args) -> None:
    """Configures JAX before its backend starts: joins a multi-process run and/or sets the CPU device count."""
    import jax

    if args.cpu_devices is not None and args.cpu_devices < 1:
        raise ValueError(f"--cpu-devices must be >= 1, got {args.cpu_devices}")
    cache = compilation_cache_dir(args.compilation_cache)
    if cache is not None:
        jax.config.update("jax_compilation_cache_dir", cache)
    if args.coordinator is None:
        given = [flag for flag, value in (("--num-processes", args.num_processes), ("--process-id", args.process_id))
                 if value is not None]
        if given:
            verb = "needs" if len(given) == 1 else "need"
            raise ValueError(f"{' and '.join(given)} {verb} --coordinator HOST:PORT (the address of process 0)")
        if args.cpu_devices is not None:
            jax.config.update("jax_num_cpu_devices", args.cpu_devices)
        return
    if args.num_processes is None or args.process_id is None:
        raise ValueError("--coordinator needs --num-processes N and --process-id I")
    from jaxinfer.parallel import multihost

    multihost.check_coordinator(args.coordinator)
    multihost.check_process_layout(args.num_processes, args.process_id)
    _native_stdout_to_stderr()
    multihost.initialize(args.coordinator, args.num_processes, args.process_id, args.cpu_devices)


def _native_stdout_to_stderr() -> None:
    """Keeps stdout for results: native code's prints (gloo writes "[Gloo] Rank i is connected to ..." to file
    descriptor 1 when the cross-process collectives start) go to stderr, while ``sys.stdout`` keeps writing to
    the original stdout. Used in multi-process runs, where main() owns the process."""
    sys.stdout.flush()
    results = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(results, "w", buffering=1)


def _where(model) -> str:
    """e.g. "mesh 2x4 (cpu)" or "mesh 2x4 (cpu, process 1 of 2)"."""
    import jax

    mesh = "x".join(str(s) for s in model.mesh.devices.shape)
    procs = f", process {jax.process_index()} of {jax.process_count()}" if jax.process_count() > 1 else ""
    return f"mesh {mesh} ({model.mesh.devices.flat[0].platform}{procs})"


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
    from jaxinfer.parallel import multihost

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
    if multihost.is_primary():  # all processes compute, process 0 prints
        print(json.dumps(result))
    print(f"[jaxinfer] scored {len(ids)} tokens on {_where(model)}, "
          f"load {load_s:.2f}s, forward (incl. compile) {forward_s:.2f}s", file=sys.stderr)


def _convert(args) -> None:
    import jaxinfer
    from jaxinfer.checkpoint.hf_loader import checkpoint_layout
    from jaxinfer.checkpoint.safetensors_io import SafetensorsCheckpoint
    from jaxinfer.config import ModelConfig
    from jaxinfer.model import is_jaxinfer_orbax
    from jaxinfer.parallel import multihost

    keep_fp8, fp8_note = args.keep_fp8, None
    if is_jaxinfer_orbax(args.hf_dir):  # an orbax dir keeps the layout it was saved with (load_model)
        if keep_fp8 is not None:
            raise ValueError(f"--keep-fp8 / --no-keep-fp8 choose how an HF checkpoint's FP8 weights load; "
                             f"{args.hf_dir} is a jaxinfer orbax directory, which keeps the layout it was saved with")
        keep_fp8, fp8_note = False, "as saved"
    elif keep_fp8 is None:
        keep_fp8 = checkpoint_layout(ModelConfig.from_hf_config(args.hf_dir),
                                     SafetensorsCheckpoint(args.hf_dir))["has_fp8"]
    t0 = time.perf_counter()
    model = jaxinfer.load_model(args.hf_dir, mesh=args.mesh, dtype=args.dtype, keep_fp8=keep_fp8)
    out = model.save(args.out_dir)
    if multihost.is_primary():
        print(str(pathlib.Path(out).absolute()))
    print(f"[jaxinfer] converted {args.hf_dir} -> {out} on {_where(model)} (dtype {args.dtype}, fp8 kept: "
          f"{fp8_note or keep_fp8}) in {time.perf_counter() - t0:.1f}s", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if hasattr(args, "speculative_parser") and (problem := bench.speculative_usage_error(args)):
        args.speculative_parser.error(problem)  # the subcommand's usage and the problem on stderr, exit 2
    try:
        if args.command == "generate":
            generate.check_pd(args)
        if args.command != "plan":
            _start_jax(args)
        status = {"score": _score, "convert": _convert, "generate": generate.run, "bench": bench.run,
                  "sweep": sweep.run, "plan": plan.run}[args.command](args)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        # Multi-process: returning (not os._exit) lets jax.distributed's exit-time shutdown barrier end the run
        # cleanly when every process fails alike; process 0 hosts the coordination service, so its abrupt exit
        # would abort the others before they print their own error.
        print(f"jaxinfer {args.command}: error: {e}", file=sys.stderr)
        return 2
    return status or 0  # a command's own exit status (generate --role decode: 1 when its peer died)


if __name__ == "__main__":
    sys.exit(main())
