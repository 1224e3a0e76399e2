"""``jaxinfer plan``: what a DeepSeek-style deployment would deliver per GPU, predicted (plan/predict.py; no JAX).

    jaxinfer plan --phase decode --ep 144 --requests-per-gpu 128 --context-len 4989 --redundant-experts 32
    jaxinfer plan --phase prefill --ep 16,32 --tokens-per-gpu 16384 --prompt-len 4096 --cache-hit-rate 0.563 \
        --redundant-experts 32 --out plan-prefill

One ``--ep`` prints that deployment (a table row, then its parts and memory); a comma-separated list prints a
table of the sweep, one line per ep, where a deployment that cannot run shows its error and the others go on.
The table goes to stdout (throughput in tokens/s, times in ms, memory in GB per GPU), the setting to stderr;
``--out DIR`` writes plan.csv and plan.png there (plan/sweep.py). A single deployment that cannot run, or a bad
flag (a flag of the other phase too: it would be ignored), is one ``jaxinfer plan: error: --FLAG: ...`` line on
stderr and exit status 2; a sweep none of whose deployments can run exits with 1. main() starts no JAX for it.
"""

from __future__ import annotations

import pathlib
import sys

from jaxinfer.plan.hardware import PRESETS as HARDWARE_PRESETS, hardware as get_hardware
from jaxinfer.plan.predict import PHASES, model_config, predict
from jaxinfer.plan.sweep import DEFAULTS as _DEFAULTS, plot, sweep, write_csv

# predict's argument -> the flag that sets it (errors name the flag)
FLAGS = {"model": "--model", "hardware": "--hardware", "phase": "--phase", "ep": "--ep", "dp": "--dp",
         "requests_per_gpu": "--requests-per-gpu", "tokens_per_gpu": "--tokens-per-gpu",
         "context_len": "--context-len", "prompt_len": "--prompt-len", "gpus_per_node": "--gpus-per-node",
         "num_redundant_experts": "--redundant-experts", "mtp_acceptance": "--mtp-acceptance",
         "mtp_drafts": "--mtp-drafts", "cache_hit_rate": "--cache-hit-rate", "expert_imbalance": "--expert-imbalance"}
CSV_NAME, PLOT_NAME = "plan.csv", "plan.png"


def number(value: str) -> int | float:
    """"128" -> 128, "0.5" -> 0.5 (argparse names this function in its error for anything else)."""
    try:
        return int(value)
    except ValueError:
        return float(value)


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="predict a DeepSeek-style deployment's tokens/s per GPU, step time, bound and "
                                    "memory, over expert-parallel sizes (no JAX, no accelerator)")
    p.add_argument("--model", default=_DEFAULTS["model"],
                   help="preset name (jaxinfer.config PRESETS, or deepseek-v4-flash: plan/v4.py) or checkpoint "
                        "directory / config.json (default: %(default)s)")
    p.add_argument("--hardware", default=_DEFAULTS["hardware"],
                   help=f"GPU preset ({', '.join(HARDWARE_PRESETS)}) or a .toml file with the fields of "
                        "plan/hardware.py's Hardware (default: %(default)s)")
    p.add_argument("--phase", choices=PHASES, default=_DEFAULTS["phase"],
                   help="decode (output tokens) or prefill (prompt tokens); one phase per run (default: %(default)s)")
    p.add_argument("--ep", required=True, metavar="N[,N...]",
                   help="expert-parallel GPUs of the deployment, e.g. 144; several (e.g. 64,144,288) print a sweep")
    p.add_argument("--dp", type=int, default=None,
                   help="attention data-parallel groups (attention tensor-parallel over ep / dp GPUs; default: ep)")
    work = p.add_argument_group("work per GPU and step")
    work.add_argument("--requests-per-gpu", type=number, default=None, metavar="R",
                      help="decode: requests each GPU decodes per step (required for decode)")
    work.add_argument("--tokens-per-gpu", type=number, default=None, metavar="T",
                      help="prefill: prompt tokens each GPU takes per step, cached ones included (required for "
                           "prefill)")
    work.add_argument("--context-len", type=number, default=None, metavar="L",
                      help=f"decode: cached tokens per request (default: {_DEFAULTS['context_len']})")
    work.add_argument("--prompt-len", type=number, default=None, metavar="L",
                      help="prefill: tokens per prompt (default: --tokens-per-gpu, one prompt per step)")
    work.add_argument("--cache-hit-rate", type=float, default=None, metavar="P",
                      help=f"prefill: share of each prompt read from the KV cache, in [0, 1) (default: "
                           f"{_DEFAULTS['cache_hit_rate']})")
    work.add_argument("--mtp-acceptance", type=float, default=None, metavar="P",
                      help="MTP speculative decoding with this chance that a draft is accepted (decode: tokens "
                           "per step; prefill: the MTP module's cost); default: no MTP")
    work.add_argument("--mtp-drafts", type=int, default=None, metavar="K",
                      help=f"drafts per step with --mtp-acceptance (default: {_DEFAULTS['mtp_drafts']})")
    dep = p.add_argument_group("deployment")
    dep.add_argument("--gpus-per-node", type=int, default=None, metavar="G",
                     help="GPUs per node (default: the hardware's, 8 for the presets)")
    dep.add_argument("--redundant-experts", dest="num_redundant_experts", type=int,
                     default=_DEFAULTS["num_redundant_experts"], metavar="N",
                     help="EPLB's redundant expert copies; ep must divide the routed experts + these "
                          "(default: %(default)s)")
    dep.add_argument("--expert-imbalance", type=float, default=None, metavar="X",
                     help="max / mean routed-expert load per GPU (default: 1.05 with redundant experts, else 1.3)")
    dep.add_argument("--bf16-dispatch", action="store_true",
                     help="dispatch tokens to experts in bfloat16 (default: DeepEP's FP8 dispatch)")
    dep.add_argument("--no-dbo", action="store_true",
                     help="no dual-microbatch overlap: communication adds to compute instead of hiding behind it")
    p.add_argument("--out", metavar="DIR", default=None, help=f"also write {CSV_NAME} and {PLOT_NAME} there")


def ep_sizes(value: str) -> list[int]:
    """"64,144" -> [64, 144]; ValueError naming --ep for anything but comma-separated positive integers."""
    try:
        sizes = [int(v) for v in str(value).split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--ep: expected comma-separated positive integers (e.g. 64,144,288), got {value!r}")
    return sizes


# flags of one phase only: the other phase would ignore them
PHASE_FLAGS = {"decode": ("requests_per_gpu", "context_len"),
               "prefill": ("tokens_per_gpu", "prompt_len", "cache_hit_rate")}


def check_flags(args) -> None:
    """ValueError naming the flag of the other phase (predict would ignore it); predict checks the values."""
    for phase, names in PHASE_FLAGS.items():
        for name in names:
            if phase != args.phase and getattr(args, name) is not None:
                raise ValueError(f"{FLAGS[name]}: a {phase} flag (--phase {phase}), not for --phase {args.phase}")


def predict_kwargs(args) -> dict:
    """The flags as ``predict`` keyword arguments (the model and hardware as given; predict's defaults for flags not
    given)."""
    given = dict(dp=args.dp, requests_per_gpu=args.requests_per_gpu, tokens_per_gpu=args.tokens_per_gpu,
                 context_len=args.context_len, prompt_len=args.prompt_len, gpus_per_node=args.gpus_per_node,
                 mtp_acceptance=args.mtp_acceptance, cache_hit_rate=args.cache_hit_rate, mtp_drafts=args.mtp_drafts,
                 expert_imbalance=args.expert_imbalance)
    return dict(model=args.model, hardware=args.hardware, num_redundant_experts=args.num_redundant_experts,
                fp8_dispatch=not args.bf16_dispatch, dbo=not args.no_dbo,
                **{k: _DEFAULTS[k] if v is None else v for k, v in given.items()})


def flagged(message: str) -> str:
    """predict's "argument: problem" -> "--flag: problem" (messages about no flag, e.g. memory, unchanged)."""
    name, sep, rest = message.partition(":")
    return f"{FLAGS[name]}:{rest}" if sep and name in FLAGS else message


def format_table(rows: list[dict]) -> str:
    """One aligned line per row after a header: ep, nodes, tok/s per GPU and per node, step and TPOT / TTFT in ms,
    bound, memory and headroom in GB per GPU; an error row shows its error (flags named) instead of figures."""
    latency = "TTFT ms" if any(r["phase"] == "prefill" for r in rows) else "TPOT ms"
    header = ["ep", "nodes", "tok/s/GPU", "tok/s/node", "step ms", latency, "bound", "GB/GPU", "headroom GB"]

    def ms(seconds):
        return f"{seconds * 1e3:.2f}"

    cells = []
    for r in rows:
        first = [str(r["ep"]), "" if r["nodes"] is None else str(r["nodes"])]
        if r.get("error"):
            cells.append(first + [f"error: {flagged(r['error'])}"])
            continue
        late = r.get("tpot_s") if r["phase"] == "decode" else r.get("ttft_s")
        cells.append(first + [f"{r['tok_s_per_gpu']:.0f}", f"{r['tok_s_per_node']:.0f}", ms(r["step_s"]), ms(late),
                              r["bound"], f"{r['memory_per_gpu_gb']:.1f}", f"{r['headroom_gb']:.1f}"])
    aligned = [c if len(c) == len(header) else c[:-1] for c in [header, *cells]]  # an error's message runs on
    widths = [max(len(c[i]) for c in aligned if i < len(c)) for i in range(len(header))]

    def line(row):
        if len(row) == len(header):
            return "  ".join(c.rjust(w) for c, w in zip(row, widths))
        return "  ".join([c.rjust(w) for c, w in zip(row[:-1], widths)] + [row[-1]])

    return "\n".join(line(row) for row in [header, *cells])


def format_parts(result: dict) -> str:
    """predict's breakdown of one deployment: ms per step of each part, compute and communication, memory in GB."""
    parts = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in result["parts"].items())
    memory = {k: v for k, v in result["memory"].items() if k != "headroom_bytes"}
    return "\n".join([
        f"parts (ms per step): {parts}",
        f"compute {result['compute_s'] * 1e3:.2f} ms, communication {result['communication_s'] * 1e3:.2f} ms "
        f"per step, of which the computation waits {result['communication_wait_s'] * 1e3:.2f} ms; bound: "
        f"{result['bound']}",
        "memory (GB per GPU): " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in memory.items())
        + f"; headroom {result['memory']['headroom_bytes'] / 1e9:.1f}"])


def _setting(args, kw: dict) -> str:
    """The run's setting in words, for stderr (``kw``: predict_kwargs(args))."""
    if args.phase == "decode":
        work = f"{kw['requests_per_gpu']} requests per GPU, context {kw['context_len']} tokens"
    else:
        prompt = kw["prompt_len"] if kw["prompt_len"] is not None else kw["tokens_per_gpu"]
        work = f"{kw['tokens_per_gpu']} tokens per GPU, prompts of {prompt}, cache hits {kw['cache_hit_rate']}"
    if kw["mtp_acceptance"] is not None:
        work += f", MTP {kw['mtp_drafts']} draft(s) accepted at {kw['mtp_acceptance']}"
    return (f"{args.model} on {args.hardware}, {args.phase}: {work}, {kw['num_redundant_experts']} redundant "
            f"experts, {'FP8' if kw['fp8_dispatch'] else 'BF16'} dispatch, dual-microbatch overlap "
            f"{'on' if kw['dbo'] else 'off'} (predicted, not measured: docs/plan.md)")


def run(args) -> int:
    """The command: 0 when the deployment (or one of the sweep's) can run, 1 when none of the sweep's can;
    ValueError (-> exit 2 in cli.main) for bad flags or a single deployment that cannot run."""
    sizes = ep_sizes(args.ep)
    check_flags(args)
    for flag, resolve in (("--model", model_config), ("--hardware", get_hardware)):
        try:
            resolve(getattr(args, flag[2:]))
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from None
    if args.out is not None and pathlib.Path(args.out).exists() and not pathlib.Path(args.out).is_dir():
        raise ValueError(f"--out: {args.out} exists and is not a directory")
    kwargs = predict_kwargs(args)
    rows = sweep(sizes, args.phase, **kwargs)
    if len(rows) == 1 and rows[0]["error"]:
        raise ValueError(flagged(rows[0]["error"]))
    print(f"[jaxinfer] plan: {_setting(args, kwargs)}", file=sys.stderr)
    print(format_table(rows))
    if len(rows) == 1:
        print(format_parts(predict(phase=args.phase, ep=sizes[0], **kwargs)))
    if args.out is not None:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        written = [write_csv(rows, out / CSV_NAME)]
        try:
            written.append(plot(rows, out / PLOT_NAME))
        except ImportError as e:  # matplotlib missing: keep the table
            print(f"[jaxinfer] plan: no plot ({e}); {CSV_NAME} is written", file=sys.stderr)
        print(f"[jaxinfer] plan: wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    if all(r["error"] for r in rows):
        print("jaxinfer plan: no deployment of the sweep can run", file=sys.stderr)
        return 1
    return 0
