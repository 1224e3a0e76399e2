"""jaxinfer.plan's predictions beside the published figures of DeepSeek-style deployments (the table of
docs/plan.md), one calibration for all (jaxinfer/plan/calibration.py).

    python benchmarks/plan_published.py

Each row: the published figure, its source, the inputs given to ``predict`` (what the source states; where it
states nothing, the assumption is named in the row), the prediction under the schedule the figure was measured
with (dual-microbatch overlap unless the row says "without overlap") over the published figure, and the prediction
under the other schedule. Two kinds of figures: capacities (a deployment kept full: DeepSeek's profile-data as
SGLang converts it to throughput, SGLang's own runs, DeepInfer's V4.1-Flash) and DeepSeek's day averages (a service
whose load varies).
Pure Python.
"""

from __future__ import annotations

from jaxinfer.plan import predict

DEEPSEEK_DAY = "DeepSeek open-infra-index, day 6 (2025-03-01)"
SGLANG = "SGLang blog, 96 H100 with PD + EP (2025-05-05)"
SGLANG_PROFILE = "SGLang blog, \"Profile Results\" (DeepSeek's profile-data converted by SGLang)"
# DeepSeek's profile-data: "an absolutely balanced MoE routing strategy" (its README) -> expert_imbalance 1.0.
DEEPSEEK_PROFILE_PREFILL = dict(hardware="h800", phase="prefill", ep=32, num_redundant_experts=32,
                                tokens_per_gpu=16384, prompt_len=4096, expert_imbalance=1.0)
DEEPSEEK_PROFILE_DECODE = dict(hardware="h800", phase="decode", ep=128, requests_per_gpu=128, context_len=4096,
                               mtp_acceptance=0.6, expert_imbalance=1.0)
SGLANG_PREFILL = dict(hardware="h100", phase="prefill", ep=32, num_redundant_experts=32, tokens_per_gpu=16384)
SGLANG_DECODE = dict(hardware="h100", phase="decode", ep=72, num_redundant_experts=32, requests_per_gpu=256,
                     context_len=2000)
SGLANG_MTP = dict(SGLANG_DECODE, requests_per_gpu=128, context_len=4000, mtp_acceptance=0.6)
DEEPSEEK_DECODE = dict(hardware="h800", phase="decode", ep=144, num_redundant_experts=32, context_len=4989)
DEEPSEEK_PREFILL = dict(hardware="h800", phase="prefill", ep=32, num_redundant_experts=32, cache_hit_rate=0.563,
                        tokens_per_gpu=16384, prompt_len=4096)
# DeepSeek's day averages: 14.8k output tok/s per node at 20-22 tok/s per user: 14,800 / 8 / 21 = 88 requests per
# GPU on average (whatever the step time: both figures are averages of the same requests).
DEEPSEEK_USERS = 14_800 / 8 / 21

# (what, published value, unit key, source, predict kwargs (dbo=False: measured without overlap), assumption)
CAPACITY = [
    ("DeepSeek profile, prefill EP32, input tok/s per node", 62_713, "tok_s_per_node", SGLANG_PROFILE,
     DEEPSEEK_PROFILE_PREFILL, "16K tokens per GPU in 4K prompts, balanced routing"),
    ("DeepSeek profile, decode EP128, output tok/s per node", 18_598, "tok_s_per_node", SGLANG_PROFILE,
     DEEPSEEK_PROFILE_DECODE, "128 requests per GPU, 4K KV, balanced routing, 2 experts per GPU; one MTP draft "
     "accepted at 60% (SGLang's assumption for its MTP runs; the conversion's acceptance is not stated)"),
    ("SGLang prefill, 2000-token inputs, input tok/s per node (the blog's headline)", 52_300, "tok_s_per_node",
     SGLANG, dict(SGLANG_PREFILL, prompt_len=2000), "its mesh not stated: EP32 and the rest as the blog's prefill runs "
     "below"),
    ("SGLang prefill EP32, 1K prompts, input tok/s per node", 57_674, "tok_s_per_node", SGLANG,
     dict(SGLANG_PREFILL, prompt_len=1024), "16K tokens per GPU (the blog's profile setting), EPLB on the "
     "serving distribution (expert imbalance not stated: 1.05 assumed)"),
    ("SGLang prefill EP32, 2K prompts", 54_543, "tok_s_per_node", SGLANG, dict(SGLANG_PREFILL, prompt_len=2048),
     "the same"),
    ("SGLang prefill EP32, 4K prompts", 50_302, "tok_s_per_node", SGLANG, dict(SGLANG_PREFILL, prompt_len=4096),
     "the same"),
    ("SGLang prefill EP32, 4K prompts, simulated perfect EPLB", 59_337, "tok_s_per_node", SGLANG,
     dict(SGLANG_PREFILL, prompt_len=4096, expert_imbalance=1.0), "random experts under group-limited routing"),
    ("SGLang decode EP72, 2K KV, output tok/s per node", 22_282, "tok_s_per_node", SGLANG, SGLANG_DECODE,
     "256 requests per GPU, no MTP"),
    ("the same without overlap", 17_777, "tok_s_per_node", SGLANG + ", TBO ablation",
     dict(SGLANG_DECODE, dbo=False), "derived: TBO's +25.5% at 256 requests, 22,310 / 1.255"),
    ("SGLang decode EP72, simulated MTP, output tok/s per node", 17_373, "tok_s_per_node", SGLANG, SGLANG_MTP,
     "128 requests per GPU, 4K KV, 60% acceptance (the blog's simulation: 256 requests at 2K KV, attention slowed "
     "to DeepSeek's profile)"),
    ("the same without overlap", 12_929, "tok_s_per_node", SGLANG + ", TBO ablation", dict(SGLANG_MTP, dbo=False),
     "the same"),
]
DAY_AVERAGE = [
    ("DeepSeek V3/R1 decode, output tok/s per node", 14_800, "tok_s_per_node", DEEPSEEK_DAY,
     dict(DEEPSEEK_DECODE, requests_per_gpu=DEEPSEEK_USERS), "88 requests per GPU (from the two averages), no MTP"),
    ("the same, with MTP", 14_800, "tok_s_per_node", DEEPSEEK_DAY,
     dict(DEEPSEEK_DECODE, requests_per_gpu=DEEPSEEK_USERS, mtp_acceptance=0.85),
     "88 requests per GPU, one MTP draft accepted at 85% (V3 report: 85-90%)"),
    ("DeepSeek decode, tok/s per user", 21, "tok_s_per_user", DEEPSEEK_DAY,
     dict(DEEPSEEK_DECODE, requests_per_gpu=DEEPSEEK_USERS, mtp_acceptance=0.85), "as above, with MTP"),
    ("DeepSeek V3/R1 prefill, input tok/s per node incl. cache hits", 73_700, "tok_s_per_node", DEEPSEEK_DAY,
     DEEPSEEK_PREFILL, "16K tokens per GPU in 4K prompts (the profile's setting), 56.3% cache hits"),
]
# DeepInfer (DeepSeek's V4.1-Flash engine on SM100), as issue 37 quotes its figures. V4.1-Flash is taken to have
# V4-Flash's published geometry (jaxinfer/plan/v4.py); its SM100 system to be a GB200 NVL72 rack (EP64 inside one
# NVLink domain: on 8-GPU B200 nodes the same deployment is bound by RDMA, see docs/plan.md); EPLB's redundant
# experts as DeepSeek deploys them (decode: one per GPU, the least multiple of 64 from V3's 32; prefill: V3's 32).
DEEPINFER = "DeepInfer (V4.1-Flash, SM100), as issue 37 quotes it"
DEEPINFER_DECODE = dict(model="deepseek-v4-flash", hardware="gb200", phase="decode", ep=64,
                        num_redundant_experts=64, requests_per_gpu=256, context_len=131072, mtp_acceptance=0.75,
                        mtp_drafts=3)
DEEPINFER_PREFILL = dict(model="deepseek-v4-flash", hardware="gb200", phase="prefill", ep=4,
                         num_redundant_experts=32, tokens_per_gpu=4096, prompt_len=4096)
V4 = [
    ("DeepInfer decode EP64, output tok/s per GPU (published: more than 25k)", 25_000, "tok_s_per_gpu", DEEPINFER,
     DEEPINFER_DECODE, "256 requests per rank, 131k context, 3 MTP drafts each accepted with probability 0.75 "
     "given the ones before (2.73 tokens a step; read as vLLM's accepted / drafted, 3.25, and the prediction "
     "rises 19%)"),
    ("DeepInfer prefill EP4, uncached input tok/s per GPU", 60_000, "tok_s_per_gpu", DEEPINFER, DEEPINFER_PREFILL,
     "4,096 tokens per rank as one 4,096-token prompt (prompt length not stated)"),
]
ROWS = CAPACITY + DAY_AVERAGE + V4


def value(result: dict, key: str) -> float:
    return 1.0 / result["tpot_s"] if key == "tok_s_per_user" else result[key]


def table(rows: list) -> list[str]:
    out = ["| published figure | published | predicted | / published | bound | other schedule (/ published) | "
           "inputs (assumptions) | source |", "|---|---|---|---|---|---|---|---|"]
    for what, published, key, source, kwargs, assumption in rows:
        dbo = kwargs.get("dbo", True)
        kwargs = {"model": "deepseek-v3", **kwargs}
        r, other = predict(**kwargs), predict(**{**kwargs, "dbo": not dbo})
        got, alt = value(r, key), value(other, key)
        shown = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in kwargs.items()
                          if k != "model" or v != "deepseek-v3")
        out.append(f"| {what} | {published:,.0f} | {got:,.0f} | {got / published:.2f} | {r['bound']} | "
                   f"{'serial' if dbo else 'overlapped'} {alt:,.0f} ({alt / published:.2f}) | {shown} "
                   f"({assumption}) | {source} |")
    return out


def main() -> None:
    print("Capacities (deployments kept full)\n")
    print("\n".join(table(CAPACITY)))
    print("\nDeepSeek's day averages (a service whose load varies through the day)\n")
    print("\n".join(table(DAY_AVERAGE)))
    print("\nDeepSeek-V4: DeepInfer's capacities\n")
    print("\n".join(table(V4)))


if __name__ == "__main__":
    main()
