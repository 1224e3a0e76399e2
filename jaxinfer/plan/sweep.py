"""``jaxinfer.plan.sweep``: ``predict`` over expert-parallel sizes -> flat rows, a CSV and a plot (no JAX).

    rows = sweep([64, 144, 288], "decode", requests_per_gpu=128, context_len=4989, num_redundant_experts=32)
    write_csv(rows, "plan.csv"); plot(rows, "plan.png")

A row per ep, in the order given (``COLUMNS``: what the deployment delivers, then the inputs). An ep at which
``predict`` raises ValueError (an ep that does not divide the expert slots, memory that does not fit) keeps its row:
``error`` holds the message and the figures are None. ``jaxinfer plan`` (plan/cli.py) prints these rows.
"""

from __future__ import annotations

import csv
import inspect
import pathlib

from jaxinfer.config import ModelConfig
from jaxinfer.plan.hardware import Hardware, hardware as get_hardware
from jaxinfer.plan.predict import model_config, predict

GB = 1e9
# What a deployment delivers (None in an error row); the latency is tpot_s for decode, ttft_s for prefill.
FIGURES = ("tok_s_per_gpu", "tok_s_per_node", "step_s", "tpot_s", "ttft_s", "bound", "memory_per_gpu_gb",
           "headroom_gb")
# The inputs as predict used them (error rows: as given, else predict's defaults, None where it would derive one).
INPUTS = ("dp", "requests_per_gpu", "tokens_per_gpu", "context_len", "prompt_len", "gpus_per_node",
          "num_redundant_experts", "fp8_dispatch", "dbo", "mtp_acceptance", "mtp_drafts", "cache_hit_rate",
          "expert_imbalance")
DEFAULTS = {k: p.default for k, p in inspect.signature(predict).parameters.items()}
COLUMNS = ("model", "hardware", "phase", "ep", "nodes", *FIGURES, *INPUTS, "error")


def model_name(model) -> str:
    """A label for a model argument: the preset name, a checkpoint's directory name, or "custom" (a ModelConfig)."""
    if isinstance(model, ModelConfig):
        return "custom"
    path = pathlib.Path(model)
    if path.name == "config.json":
        path = path.parent
    return path.name or str(model)


def sweep(ep_sizes, phase: str, **predict_kwargs) -> list[dict]:
    """``predict(phase=phase, ep=ep, **predict_kwargs)`` for each ep in ``ep_sizes`` -> one flat row each, in order.

    Rows hold ``COLUMNS`` but one latency: decode rows ``tpot_s``, prefill rows ``ttft_s`` (seconds);
    tok_s_per_gpu / tok_s_per_node in tokens per second, step_s in seconds, memory_per_gpu_gb and headroom_gb in
    GB (1e9 bytes) per GPU; nodes = ep // gpus_per_node, at least 1; error None. An ep at which predict raises
    ValueError gives a row with ``error`` = its message and the figures None. The model and the hardware are
    resolved once, first: a bad model or hardware raises ValueError (it would fail every row alike)."""
    model = predict_kwargs.pop("model", DEFAULTS["model"])
    hw: Hardware = get_hardware(predict_kwargs.pop("hardware", DEFAULTS["hardware"]))
    cfg = model_config(model)
    gpn = predict_kwargs.get("gpus_per_node")
    gpn = hw.gpus_per_node if gpn is None else gpn
    latency = "tpot_s" if phase == "decode" else "ttft_s"
    figures = [k for k in FIGURES if k not in ("tpot_s", "ttft_s") or k == latency]
    rows = []
    for ep in ep_sizes:
        nodes = max(1, ep // gpn) if isinstance(ep, int) and ep >= 1 and isinstance(gpn, int) and gpn >= 1 else None
        row = dict(model=model_name(model), hardware=hw.name, phase=phase, ep=ep, nodes=nodes)
        try:
            r = predict(cfg, hw, phase=phase, ep=ep, **predict_kwargs)
        except ValueError as e:
            given = {**DEFAULTS, **predict_kwargs, "gpus_per_node": gpn}
            rows.append({**row, **dict.fromkeys(figures), **{k: given[k] for k in INPUTS}, "error": str(e)})
            continue
        got = dict(r, memory_per_gpu_gb=r["memory_per_gpu_bytes"] / GB, headroom_gb=r["memory"]["headroom_bytes"] / GB)
        rows.append({**row, **{k: got[k] for k in figures}, **{k: r["inputs"][k] for k in INPUTS}, "error": None})
    return rows


def columns(rows: list[dict]) -> list[str]:
    """The union of the rows' keys: ``COLUMNS``' order first, then any others in the order they first appear."""
    present = dict.fromkeys(k for r in rows for k in r)
    return [c for c in COLUMNS if c in present] + [k for k in present if k not in COLUMNS]


def write_csv(rows: list[dict], path) -> pathlib.Path:
    """The rows as a CSV (header: ``columns(rows)``; None and a row's missing keys as empty cells); returns path."""
    path = pathlib.Path(path)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns(rows), restval="")
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in r.items()} for r in rows)
    return path


def plot(rows: list[dict], path) -> pathlib.Path:
    """A PNG of tok/s per GPU against ep (log scale, the rows' ep values as ticks), one line per phase (per model,
    hardware and phase when the rows hold several); error rows are left out. Returns path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # the Agg backend: no pyplot, no GUI, no global state
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    path = pathlib.Path(path)
    good = [r for r in rows if not r.get("error") and r.get("tok_s_per_gpu") is not None]
    setups = list(dict.fromkeys((r["model"], r["hardware"]) for r in rows))
    fig = Figure(figsize=(6.5, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    what = {"decode": "decode (output tokens)", "prefill": "prefill (input tokens)"}
    keys = dict.fromkeys((r["model"], r["hardware"], r["phase"]) for r in good)
    for key in sorted(keys, key=lambda k: (setups.index(k[:2]), list(what).index(k[2]) if k[2] in what else 2)):
        points = sorted((r["ep"], r["tok_s_per_gpu"]) for r in good if (r["model"], r["hardware"], r["phase"]) == key)
        label = what.get(key[2], key[2]) + (f", {key[0]} on {key[1]}" if len(setups) > 1 else "")
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    eps = sorted({r["ep"] for r in good})
    if eps:
        ax.set_xscale("log")
        crowded = any(b / a < 1.3 for a, b in zip(eps, eps[1:]))  # e.g. 128 and 144: slant the labels
        ax.set_xticks(eps, [str(e) for e in eps], rotation=45 if crowded else 0)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_ylim(bottom=0)
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no deployment to plot: every row has an error", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_xlabel("expert-parallel GPUs (ep)")
    ax.set_ylabel("tokens/s per GPU")
    ax.grid(True, which="major", alpha=0.3)
    ax.set_title("jaxinfer plan: " + "; ".join(f"{m} on {h}" for m, h in setups) + " (predicted)")
    fig.savefig(path, dpi=100)
    return path
