"""jaxinfer.plan's predictions beside the published production figures of DeepSeek-style deployments (the table of
docs/plan.md), one calibration for all (jaxinfer/plan/calibration.py).

    python benchmarks/plan_published.py

Each row: the published figure, its source, the inputs given to ``predict`` (what the source states; where it
states nothing, the assumption is named in the row), the prediction with dual-microbatch overlap (the deployments
use it; ``predict``'s default) and without it (compute and communication in series), each over the published
figure. Pure Python.
"""

from __future__ import annotations

from jaxinfer.plan import predict

# (what, published value, unit key, source, predict kwargs, assumption)
DEEPSEEK_DECODE = dict(model="deepseek-v3", hardware="h800", phase="decode", ep=144, num_redundant_experts=32,
                       context_len=4989)
DEEPSEEK_PREFILL = dict(model="deepseek-v3", hardware="h800", phase="prefill", ep=32, num_redundant_experts=32,
                        cache_hit_rate=0.563, tokens_per_gpu=16384, prompt_len=4096)
SGLANG_PREFILL = dict(model="deepseek-v3", hardware="h100", phase="prefill", ep=32, num_redundant_experts=32,
                      tokens_per_gpu=16384)
SGLANG_DECODE = dict(model="deepseek-v3", hardware="h100", phase="decode", ep=72, num_redundant_experts=32,
                     requests_per_gpu=256, context_len=2000)
# DeepSeek's day averages: 14.8k output tok/s per node at 20-22 tok/s per user: 14,800 / 8 / 21 = 88 requests per
# GPU on average (whatever the step time: both figures are averages of the same requests).
DEEPSEEK_USERS = 14_800 / 8 / 21

ROWS = [
    ("DeepSeek V3/R1 decode, output tok/s per node (day average)", 14_800, "tok_s_per_node",
     "DeepSeek open-infra-index, day 6 (2025-03-01)", dict(DEEPSEEK_DECODE, requests_per_gpu=DEEPSEEK_USERS),
     "88 requests per GPU (from the two averages), no MTP"),
    ("the same, with MTP", 14_800, "tok_s_per_node", "the same",
     dict(DEEPSEEK_DECODE, requests_per_gpu=DEEPSEEK_USERS, mtp_acceptance=0.85),
     "88 requests per GPU, one MTP draft accepted at 85% (V3 report: 85-90%)"),
    ("DeepSeek decode, tok/s per user (day average)", 21, "tok_s_per_user", "the same",
     dict(DEEPSEEK_DECODE, requests_per_gpu=DEEPSEEK_USERS, mtp_acceptance=0.85), "as above, with MTP"),
    ("DeepSeek V3/R1 prefill, input tok/s per node incl. cache hits (day average)", 73_700, "tok_s_per_node",
     "the same", DEEPSEEK_PREFILL, "16K tokens per GPU in 4K prompts (DeepSeek's profile-data setting)"),
    ("SGLang prefill EP32, 1K prompts, input tok/s per node", 57_700, "tok_s_per_node",
     "SGLang blog, 96 H100 with PD + EP (2025-05)", dict(SGLANG_PREFILL, prompt_len=1024),
     "16K tokens per GPU (not stated), no cache hits"),
    ("SGLang prefill EP32, 2K prompts", 54_500, "tok_s_per_node", "the same", dict(SGLANG_PREFILL, prompt_len=2048),
     "the same"),
    ("SGLang prefill EP32, 4K prompts", 50_300, "tok_s_per_node", "the same", dict(SGLANG_PREFILL, prompt_len=4096),
     "the same"),
    ("SGLang decode EP72, 2K KV, output tok/s per node", 22_300, "tok_s_per_node", "the same", SGLANG_DECODE,
     "256 requests per GPU, no MTP"),
]


def value(result: dict, key: str) -> float:
    return 1.0 / result["tpot_s"] if key == "tok_s_per_user" else result[key]


def main() -> None:
    print("| published figure | published | predicted (overlapped) | / published | bound | serial (no overlap) | "
          "/ published | inputs (assumptions) | source |")
    print("|---|---|---|---|---|---|---|---|---|")
    for what, published, key, source, kwargs, assumption in ROWS:
        r, serial = predict(**kwargs), predict(**{**kwargs, "dbo": False})
        got, low = value(r, key), value(serial, key)
        shown = {k: v for k, v in kwargs.items() if k not in ("model",)}
        print(f"| {what} | {published:,.0f} | {got:,.0f} | {got / published:.2f} | {r['bound']} | {low:,.0f} | "
              f"{low / published:.2f} | "
              f"{', '.join(f'{k}={v:g}' if isinstance(v, float) else f'{k}={v}' for k, v in shown.items())} "
              f"({assumption}) | {source} |")


if __name__ == "__main__":
    main()
