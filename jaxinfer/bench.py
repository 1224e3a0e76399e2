"""``jaxinfer bench``: latency and throughput of ``jaxinfer.LLM`` on random token ids, in the vocabulary of the
benchmarks users already read.

- ``--mode one-batch`` (SGLang's ``bench_one_batch``): one batch of ``--batch-size`` requests of ``--input-len``
  prompt tokens, each generating ``--output-len`` tokens. Prefill latency = the time until every request has its
  first token (the largest TTFT: the whole batch is prefilled in one step), prefill throughput = batch *
  input_len / prefill latency; median decode latency = the median over requests of TPOT (time per output token
  after the first), median decode throughput = batch / median decode latency; total latency = the whole
  ``generate`` call, overall throughput = batch * (input_len + output_len) / total latency. Several batch sizes
  (``--batch-size 1 8 32``) give one result each. The engine is sized for the batch (``max_num_seqs`` = the
  batch's requests per DP rank, one prefill step for all of them; batch sizes with as many requests per rank
  share one engine) and prefix caching is off.
- ``--mode throughput`` (vLLM's ``benchmark_throughput``, SGLang's ``bench_offline_throughput``): ``--num-prompts``
  requests submitted at once with the engine's default options; requests/s and input / output / total tok/s over
  the wall time, TTFT and TPOT percentiles. Lengths: ``--input-len`` / ``--output-len``, or with
  ``--random-range-ratio r`` uniform integers in [L * (1 - r), L * (1 + r)] (vLLM's random dataset).

Every request samples greedily with ``ignore_eos=True``, so it generates exactly its output length. Each workload
runs once untimed first with other random ids (compilation: every step shape of the timed run is compiled
then). ``--json`` prints one JSON object per result on stdout (keys in ``ONE_BATCH_KEYS`` / ``THROUGHPUT_KEYS``);
otherwise SGLang / vLLM-style lines. ``--dispatch-bytes`` adds the expert-parallel dispatch bytes per token of
the prompts' routing on the mesh (jaxinfer/parallel/comm.py; keys ``DISPATCH_KEYS``), as ``jaxinfer sweep``
records them.

``--kv-cache-dir DIR`` (``--kv-cache-max-bytes N``) turns on the KV storage tier (and prefix caching, which it
works through): a later run of the same prompts (the same ``--seed``) reads their pages; the last result gets
``LLM.cache_stats()``'s keys, counted since its engine was built (untimed runs included).

``--prefill-mesh P --decode-mesh D`` runs prefill/decode disaggregation in one process (engine/disaggregated.py):
the prefill engine on P, the decode engine on D (devices in order, prefill first); results name the mesh "P:D".

``--speculative-tokens K`` (0 = off, the default) runs MTP speculative decoding (``speculative_config`` {"method":
"mtp", "num_speculative_tokens": K, "verify": ``--speculative-verify``}); ``jaxinfer generate`` takes the same
flags. Every result has ``SPECULATIVE_KEYS``: the settings and the timed run's counts in vLLM's spec-decode
vocabulary (``speculative_metrics``); with speculation off they are speculative_tokens 0, speculative_verify "off",
zero counts, draft_acceptance_rate 0.0, mean_acceptance_length 1.0 and accepted_per_position [].
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np

from jaxinfer.engine.buckets import PREFILL_BLOCK
from jaxinfer.engine.speculative import VERIFY_MODES

MODES = ("one-batch", "throughput")
# Speculative decoding's settings and the timed run's counts (speculative_metrics), in every result.
SPECULATIVE_KEYS = ("speculative_tokens", "speculative_verify", "num_drafts", "num_draft_tokens",
                    "num_accepted_tokens", "draft_acceptance_rate", "mean_acceptance_length",
                    "accepted_per_position")
# Where it ran: prefill_devices / decode_devices are the two engines' with --prefill-mesh / --decode-mesh (mesh
# "P:D"; data and expert the decode mesh's), both all devices when co-located; kv_transfer_bytes, the latents
# the timed run handed from prefill to decode (0 co-located).
MESH_KEYS = ("mode", "mesh", "devices", "data", "expert", "prefill_devices", "decode_devices", "platform", "dtype")
ONE_BATCH_KEYS = MESH_KEYS + (
    "batch_size", "input_len", "output_len", "prefill_latency_s", "prefill_throughput_tok_s",
    "median_decode_latency_s", "median_decode_throughput_tok_s", "total_latency_s", "overall_throughput_tok_s",
    "ttft_s", "tpot_s", "kv_transfer_bytes") + SPECULATIVE_KEYS
THROUGHPUT_KEYS = MESH_KEYS + (
    "num_prompts", "random_range_ratio", "total_input_tokens", "total_output_tokens", "elapsed_s",
    "requests_per_s", "input_tok_s", "output_tok_s", "total_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
    "tpot_p99_s", "kv_transfer_bytes") + SPECULATIVE_KEYS
DISPATCH_KEYS = ("dispatch_bytes_per_token", "dispatch_bytes_per_token_fp8")


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="one-batch latency or offline throughput on random prompts (SGLang / vLLM)")
    p.add_argument("--mode", choices=MODES, default="one-batch")
    p.add_argument("--model", default=None,
                   help="HF checkpoint directory or jaxinfer orbax directory (default: the embedded model)")
    p.add_argument("--batch-size", nargs="+", default=["1"], metavar="B",
                   help="one-batch: requests in the batch; several values run one after the other")
    p.add_argument("--num-prompts", type=int, default=64, metavar="N", help="throughput: number of requests")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=32, help="generated tokens per request")
    p.add_argument("--random-range-ratio", type=float, default=0.0, metavar="R",
                   help="throughput: lengths uniform in [L(1-R), L(1+R)] (vLLM's random dataset); 0 = fixed")
    p.add_argument("--max-num-seqs", type=int, default=None, help="throughput: running sequences per DP rank")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="throughput: tokens per DP rank per prefill step")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="run each workload once untimed first (compilation)")
    p.add_argument("--dispatch-bytes", action="store_true",
                   help="add dispatch bytes per token of the prompts' routing (parallel/comm.py)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--json", action="store_true", help="one JSON object per result on stdout")
    add_speculative_flags(p)
    add_kv_cache_flags(p)
    pd = p.add_argument_group("prefill/decode disaggregation in one process (engine/disaggregated.py)")
    pd.add_argument("--prefill-mesh", metavar="SPEC", default=None,
                    help="the prefill engine's mesh ('DxE' or a mesh file; devices in order, prefill first)")
    pd.add_argument("--decode-mesh", metavar="SPEC", default=None, help="the decode engine's mesh (after it)")


def add_speculative_flags(p: argparse.ArgumentParser) -> None:
    """--speculative-tokens K and --speculative-verify, on ``jaxinfer generate`` and ``jaxinfer bench``; the
    parsed args carry the subcommand's parser (``speculative_parser``) for usage errors."""
    p.set_defaults(speculative_parser=p)
    spec = p.add_argument_group("speculative decoding (the checkpoint's MTP module drafts, the model verifies)")
    spec.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                      help="draft K tokens per decode step with the MTP module (speculative_config "
                           "num_speculative_tokens, 1 to 16); 0 = off (default)")
    spec.add_argument("--speculative-verify", choices=VERIFY_MODES, default="all",
                      help="which drafts a step verifies: all (default), or confidence (the prefix worth its cost, "
                           "DSpark); needs --speculative-tokens K >= 1")


def add_kv_cache_flags(p: argparse.ArgumentParser) -> None:
    """--kv-cache-dir and --kv-cache-max-bytes (the KV storage tier, EngineConfig.kv_cache_dir), on ``jaxinfer
    generate`` and ``jaxinfer bench``."""
    kv = p.add_argument_group("KV storage tier (prompt pages kept in a directory for later runs)")
    kv.add_argument("--kv-cache-dir", metavar="DIR", default=None,
                    help="write full prompt pages to DIR and read them back on a prefix hit in any later run "
                         "(created if missing; several processes may share it)")
    kv.add_argument("--kv-cache-max-bytes", metavar="N", type=int, default=None,
                    help="bound DIR to N bytes (least recently used pages removed); default: unbounded")


def kv_cache_options(args) -> dict:
    """The engine options of the KV storage tier flags (none when they are not given)."""
    return {k: v for k, v in (("kv_cache_dir", args.kv_cache_dir), ("kv_cache_max_bytes", args.kv_cache_max_bytes))
            if v is not None}


def format_cache_stats(c: dict) -> str:
    """``LLM.cache_stats()`` as one line in DeepSeek's vocabulary (cache hit tokens over input tokens)."""
    return (f"prefix cache: prompt tokens {c['prompt_tokens']}, hits on device {c['device_hit_tokens']}, from "
            f"storage {c['storage_hit_tokens']} (hit rate {c['hit_rate'] * 100:.1f}%); storage read "
            f"{c['storage_bytes_read'] / 1e6:.1f} MB, written {c['storage_bytes_written'] / 1e6:.1f} MB, rejected "
            f"files {c['storage_rejected_files']}, directory {c['storage_bytes'] / 1e6:.1f} MB")


def speculative_usage_error(args) -> str | None:
    """The argparse error for speculative flags that contradict each other, or None."""
    if args.speculative_tokens == 0 and args.speculative_verify != "all":
        return (f"--speculative-verify {args.speculative_verify} needs --speculative-tokens K >= 1 "
                "(0, the default, turns speculative decoding off)")
    return None


def speculative_config(args) -> dict | None:
    """The engine's speculative_config from the flags: None for --speculative-tokens 0; any other K is passed on
    as given (the engine's ValueError names the valid range)."""
    if args.speculative_tokens == 0:
        return None
    return {"method": "mtp", "num_speculative_tokens": args.speculative_tokens, "verify": args.speculative_verify}


def speculative_metrics(stats, spec) -> dict:
    """``SPECULATIVE_KEYS`` of an EngineStats (one generate call) under ``spec``, the engine's SpeculativeConfig
    (``llm.config.speculative_config``; None when off). draft_acceptance_rate = accepted / draft tokens (vLLM's
    "draft acceptance rate"; 0.0 without drafts); mean_acceptance_length = 1 + accepted / drafts (tokens per
    verification round, vLLM's definition); accepted_per_position[j] = rounds whose draft j + 1 was accepted."""
    k = spec.num_speculative_tokens if spec else 0
    return dict(speculative_tokens=k, speculative_verify=spec.verify if spec else "off",
                num_drafts=stats.num_drafts, num_draft_tokens=stats.num_draft_tokens,
                num_accepted_tokens=stats.num_accepted_tokens,
                draft_acceptance_rate=(stats.num_accepted_tokens / stats.num_draft_tokens
                                       if stats.num_draft_tokens else 0.0),
                mean_acceptance_length=stats.mean_acceptance_length,
                accepted_per_position=list(stats.accepted_per_position) or [0] * k)


def format_speculative(m: dict, label: str = "speculative decoding") -> str:
    """``speculative_metrics`` as one line in vLLM's spec-decode vocabulary (its per-position acceptance rate is
    accepted_per_position / drafts)."""
    drafts = m["num_drafts"]
    rates = ", ".join(f"{a / drafts if drafts else 0:.3f}" for a in m["accepted_per_position"])
    return (f"{label} (mtp, K {m['speculative_tokens']}, verify {m['speculative_verify']}): drafts {drafts}, "
            f"draft tokens {m['num_draft_tokens']}, accepted {m['num_accepted_tokens']} "
            f"({m['draft_acceptance_rate'] * 100:.1f}%), mean acceptance length {m['mean_acceptance_length']:.2f}, "
            f"accepted per position {m['accepted_per_position']} (rate {rates})")


def positive_ints(values, flag: str) -> list[int]:
    """["1", "8"] or "1,8" -> [1, 8]; ValueError naming ``flag`` for anything but positive integers."""
    items = values.split(",") if isinstance(values, str) else [v for value in values for v in str(value).split(",")]
    try:
        numbers = [int(v) for v in items]
    except ValueError:
        numbers = []
    if not numbers or min(numbers) < 1:
        shown = values if isinstance(values, str) else ",".join(map(str, values))
        raise ValueError(f"{flag} must be positive integers (e.g. 1,8,32), got {shown!r}")
    return numbers


def _check(args) -> list[int]:
    """Validates the numbers; returns the batch sizes."""
    batch_sizes = positive_ints(args.batch_size, "--batch-size")
    for flag, value in (("--input-len", args.input_len), ("--output-len", args.output_len),
                        ("--num-prompts", args.num_prompts), ("--max-num-seqs", args.max_num_seqs),
                        ("--max-num-batched-tokens", args.max_num_batched_tokens)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.mode == "one-batch" and args.output_len < 2:
        raise ValueError(f"one-batch mode needs --output-len >= 2 (a prefill token, then decode steps), "
                         f"got {args.output_len}")
    if not 0 <= args.random_range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if (args.prefill_mesh is None) != (args.decode_mesh is None):
        raise ValueError("--prefill-mesh and --decode-mesh go together")
    if args.prefill_mesh is not None and args.mesh is not None:
        raise ValueError("--mesh with --prefill-mesh / --decode-mesh: each engine has its own mesh")
    return batch_sizes


def random_lengths(rng: np.random.Generator, n: int, length: int, ratio: float) -> np.ndarray:
    """n lengths uniform in [int(L (1 - r)), int(L (1 + r))], at least 1 (vLLM's random dataset)."""
    low = max(1, int(length * (1 - ratio)))
    return rng.integers(low, max(low, int(length * (1 + ratio))) + 1, n)


def _generate(llm, prompts: list[list[int]], output_lens) -> tuple[list, float]:
    """Greedy generation of exactly ``output_lens[i]`` tokens per prompt; (outputs, seconds). RuntimeError when a
    request fails (e.g. prompt + output longer than the model allows)."""
    from jaxinfer import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=int(n), ignore_eos=True) for n in output_lens]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    for out in outs:
        if out.outputs[0].finish_reason == "error":
            raise RuntimeError(f"a benchmark request failed: {out.outputs[0].error}")
    return outs, elapsed


def _prompts(rng: np.random.Generator, vocab: int, lengths) -> list[list[int]]:
    return [rng.integers(0, vocab, int(n)).tolist() for n in lengths]


def mesh_info(llm, mesh_spec, prefill_spec=None) -> dict:
    """mesh (the mesh file's name, or "DxE"; "P:D" for prefill/decode disaggregation, ``prefill_spec`` given:
    data and expert are then the decode mesh's), devices, data, expert, platform, prefill_devices and
    decode_devices (the engines' devices; both all of them when co-located)."""
    from jaxinfer.parallel.mesh import read_mesh_file

    def name(spec, mesh):
        return read_mesh_file(spec).name if str(spec).endswith(".toml") else "{}x{}".format(*mesh.devices.shape)

    mesh = llm.model.mesh
    d, e = mesh.shape["data"], mesh.shape["expert"]
    if prefill_spec is None:
        return dict(mesh=name(mesh_spec, mesh), devices=d * e, data=d, expert=e, prefill_devices=d * e,
                    decode_devices=d * e, platform=mesh.devices.flat[0].platform)
    prefill = llm.engine.prefill.model.mesh
    return dict(mesh=f"{name(prefill_spec, prefill)}:{name(mesh_spec, mesh)}", devices=prefill.size + mesh.size,
                data=d, expert=e, prefill_devices=prefill.size, decode_devices=mesh.size,
                platform=mesh.devices.flat[0].platform)


def one_batch(llm, batch_size: int, input_len: int, output_len: int, *, seed: int = 0, warmup: bool = True) -> dict:
    """SGLang bench_one_batch figures of one batch (module docstring)."""
    rng = np.random.default_rng(seed)
    vocab = llm.model.config.vocab_size
    lens, outs_len = [input_len] * batch_size, [output_len] * batch_size
    if warmup:
        _generate(llm, _prompts(rng, vocab, lens), outs_len)
        llm.wait_for_compilations()
    outs, total = _generate(llm, _prompts(rng, vocab, lens), outs_len)
    spec = speculative_metrics(llm.stats, llm.config.speculative_config)
    ttft = [o.metrics["ttft_s"] for o in outs]
    tpot = [o.metrics["tpot_s"] for o in outs]
    prefill, decode = max(ttft), float(np.median(tpot))
    return dict(batch_size=batch_size, input_len=input_len, output_len=output_len, prefill_latency_s=prefill,
                prefill_throughput_tok_s=batch_size * input_len / prefill, median_decode_latency_s=decode,
                median_decode_throughput_tok_s=batch_size / decode, total_latency_s=total,
                overall_throughput_tok_s=batch_size * (input_len + output_len) / total,
                ttft_s=float(np.median(ttft)), tpot_s=decode, kv_transfer_bytes=llm.stats.kv_transfer_bytes, **spec)


def throughput(llm, num_prompts: int, input_len: int, output_len: int, *, random_range_ratio: float = 0.0,
               seed: int = 0, warmup: bool = True) -> dict:
    """Offline throughput of ``num_prompts`` requests submitted at once (module docstring)."""
    rng = np.random.default_rng(seed)
    vocab = llm.model.config.vocab_size
    in_lens = random_lengths(rng, num_prompts, input_len, random_range_ratio)
    out_lens = random_lengths(rng, num_prompts, output_len, random_range_ratio)
    if warmup:
        _generate(llm, _prompts(rng, vocab, in_lens), out_lens)
        llm.wait_for_compilations()
    outs, elapsed = _generate(llm, _prompts(rng, vocab, in_lens), out_lens)
    spec = speculative_metrics(llm.stats, llm.config.speculative_config)
    n_in = sum(o.metrics["num_prompt_tokens"] for o in outs)
    n_out = sum(o.metrics["num_output_tokens"] for o in outs)
    ttft = [o.metrics["ttft_s"] for o in outs]
    tpot = [o.metrics["tpot_s"] for o in outs if o.metrics["num_output_tokens"] > 1] or [0.0]
    return dict(num_prompts=num_prompts, input_len=input_len, output_len=output_len,
                random_range_ratio=random_range_ratio, total_input_tokens=n_in, total_output_tokens=n_out,
                elapsed_s=elapsed, requests_per_s=num_prompts / elapsed, input_tok_s=n_in / elapsed,
                output_tok_s=n_out / elapsed, total_tok_s=(n_in + n_out) / elapsed,
                ttft_p50_s=float(np.percentile(ttft, 50)), ttft_p99_s=float(np.percentile(ttft, 99)),
                tpot_p50_s=float(np.percentile(tpot, 50)), tpot_p99_s=float(np.percentile(tpot, 99)),
                steps=llm.stats.steps, preemptions=llm.stats.preemptions,
                kv_transfer_bytes=llm.stats.kv_transfer_bytes, **spec)


def dispatch_bytes(model, rows: int, input_len: int, seed: int = 0) -> dict:
    """Dispatch payload bytes per token (summed over the MoE layers) of a [rows, input_len] random batch's routing
    on the model's mesh (parallel/comm.py: each token once to each other expert rank holding one of its experts):
    as configured (model dtype, or FP8 with fp8_dispatch) and in DeepEP's FP8 format (H + 4 ceil(H/128) bytes
    per send). 0 on meshes with one expert rank. rows are rounded up to a multiple of the DP size."""
    from jaxinfer.parallel.comm import comm_stats
    from jaxinfer.parallel.dispatch import QUANT_GROUP

    rows = -(-rows // model.dp_size) * model.dp_size
    ids = np.random.default_rng(seed).integers(0, model.config.vocab_size, (rows, input_len))
    stats = comm_stats(model, ids)
    h = model.config.hidden_size
    return dict(dispatch_bytes_per_token=stats.dispatch_payload_bytes / stats.tokens,
                dispatch_bytes_per_token_fp8=stats.remote_token_sends * (h + 4 * -(-h // QUANT_GROUP)) / stats.tokens)


def _llm(args, mesh, max_model_len: int, **options):
    """The engine under test (prefix caching off: every prompt is computed, unless --kv-cache-dir asks for the
    storage tier, which works through it); ValueError when the longest request does not fit the model's
    positions."""
    import jaxinfer

    kv = kv_cache_options(args)
    meshes = (dict(mesh=mesh) if args.prefill_mesh is None
              else dict(prefill_mesh=args.prefill_mesh, decode_mesh=args.decode_mesh))
    # compilation_cache="off": the CLI has configured JAX's cache from --compilation-cache (cli._start_jax).
    llm = jaxinfer.LLM(args.model, dtype=args.dtype, enable_prefix_caching="kv_cache_dir" in kv,
                       max_model_len=max_model_len, compilation_cache="off",
                       speculative_config=speculative_config(args), **meshes, **kv, **options)
    if llm.max_model_len < max_model_len:
        raise ValueError(f"requests of up to {max_model_len} tokens (input + output) exceed the model's "
                         f"max_position_embeddings={llm.max_model_len}")
    return llm


def run(args) -> None:
    from jaxinfer.engine.disaggregated import split_meshes
    from jaxinfer.parallel import multihost
    from jaxinfer.parallel.mesh import make_mesh

    batch_sizes = _check(args)
    if args.model is not None and not pathlib.Path(args.model).is_dir():
        raise ValueError(f"--model {args.model} is not a directory")
    if args.prefill_mesh is None:
        mesh = make_mesh(args.mesh)
        dp = mesh.size
    else:  # sized so that both engines take the whole batch at once
        mesh = None
        dp = min(m.size for m in split_meshes(None, args.prefill_mesh, args.decode_mesh))
    where = (args.decode_mesh, args.prefill_mesh) if args.prefill_mesh is not None else (args.mesh, None)
    results, llm = [], None
    if args.mode == "one-batch":
        sized_for = None  # requests per DP rank of the current engine
        for b in batch_sizes:
            per_rank = -(-b // dp)
            if per_rank != sized_for:  # batch sizes with the same requests per rank share an engine (and programs)
                sized_for = per_rank
                llm = None  # frees the previous engine's cache first
                # Sized for the batch: every request runs at once and the whole batch is prefilled in one step.
                llm = _llm(args, mesh, max_num_seqs=per_rank, max_model_len=args.input_len + args.output_len,
                           max_num_batched_tokens=per_rank * max(PREFILL_BLOCK, 1 << (args.input_len - 1).bit_length()))
            results.append(dict(mode=args.mode, **mesh_info(llm, *where), dtype=args.dtype,
                                **one_batch(llm, b, args.input_len, args.output_len, seed=args.seed,
                                            warmup=args.warmup)))
    else:
        options = {k: v for k, v in (("max_num_seqs", args.max_num_seqs),
                                     ("max_num_batched_tokens", args.max_num_batched_tokens)) if v is not None}
        max_len = int(args.input_len * (1 + args.random_range_ratio)) + int(args.output_len *
                                                                            (1 + args.random_range_ratio))
        llm = _llm(args, mesh, max_model_len=max_len, **options)
        results.append(dict(mode=args.mode, **mesh_info(llm, *where), dtype=args.dtype,
                            **throughput(llm, args.num_prompts, args.input_len, args.output_len,
                                         random_range_ratio=args.random_range_ratio, seed=args.seed,
                                         warmup=args.warmup)))
    if args.dispatch_bytes:
        rows = max(batch_sizes) if args.mode == "one-batch" else args.num_prompts
        extra = dispatch_bytes(llm.model, rows, args.input_len, args.seed)
        for r in results:
            r.update(extra)
    if args.kv_cache_dir is not None:  # the last engine's counts, its untimed runs included
        results[-1].update(llm.cache_stats())
    if not multihost.is_primary():  # all processes compute, process 0 prints
        return
    for r in results:
        print(json.dumps(r) if args.json else format_result(r), flush=True)


def format_result(r: dict) -> str:
    """SGLang bench_one_batch / vLLM benchmark_throughput-style lines."""
    head = f"[{r['mode']}] mesh {r['mesh']} ({r['devices']} {r['platform']} devices), {r['dtype']}"
    if r["mode"] == "one-batch":
        lines = [f"{head}, batch {r['batch_size']}, input {r['input_len']}, output {r['output_len']}",
                 f"Prefill. latency: {r['prefill_latency_s']:6.5f} s, throughput: "
                 f"{r['prefill_throughput_tok_s']:9.2f} token/s",
                 f"Decode.  median latency: {r['median_decode_latency_s']:6.5f} s, median throughput: "
                 f"{r['median_decode_throughput_tok_s']:9.2f} token/s",
                 f"Total. latency: {r['total_latency_s']:6.3f} s, throughput: {r['overall_throughput_tok_s']:9.2f} "
                 "token/s"]
    else:
        lines = [f"{head}, {r['num_prompts']} requests, input {r['input_len']}, output {r['output_len']}, "
                 f"range ratio {r['random_range_ratio']}",
                 f"Throughput: {r['requests_per_s']:.2f} requests/s, {r['total_tok_s']:.2f} total tokens/s, "
                 f"{r['output_tok_s']:.2f} output tokens/s, {r['input_tok_s']:.2f} input tokens/s",
                 f"Total input tokens: {r['total_input_tokens']}, total output tokens: {r['total_output_tokens']}, "
                 f"duration {r['elapsed_s']:.3f} s",
                 f"TTFT p50 {r['ttft_p50_s'] * 1e3:.2f} ms p99 {r['ttft_p99_s'] * 1e3:.2f} ms, "
                 f"TPOT p50 {r['tpot_p50_s'] * 1e3:.2f} ms p99 {r['tpot_p99_s'] * 1e3:.2f} ms"]
    if r.get("speculative_tokens"):
        lines.append(format_speculative(r, "Speculative decoding"))
    if "storage_hit_tokens" in r:
        lines.append(format_cache_stats(r))
    if "dispatch_bytes_per_token" in r:
        lines.append(f"Dispatch: {r['dispatch_bytes_per_token']:.0f} B/token as run, "
                     f"{r['dispatch_bytes_per_token_fp8']:.0f} B/token in FP8 (all MoE layers)")
    return "\n".join(lines)

