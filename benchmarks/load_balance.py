"""DP-rank load balance of prefill and decode steps (issue: prefill/decode disaggregation and DeepSeek's load
balancers; docs/benchmarks.md "Load balance (CPU)").

    python benchmarks/load_balance.py [--modes colocated,pd] [--max-tokens equal,mixed] [--seeds 0]
        [--simulate] [--dtype float32] [--bounds]

Workload: 64 prompts of random tokens, lengths log-uniform in [8, 1500] (seeded), greedy, ignore_eos; max_tokens
128 each ("equal") or uniform in [16, 256] ("mixed"). Modes: "colocated", the embedded default model on a 1x8 mesh
(8 simulated CPU devices); "pd", a prefill engine on 1x4 and a decode engine on 1x4. Printed per run: the imbalance
(engine/step_log.py: sum over steps of the max over ranks / sum over steps of the mean) of prefill tokens and
attention over the prefill steps and of KV pages and running requests over the decode steps, per engine; the mean
running requests per rank over the decode steps (the requests goal is 1 + 1 / that mean: whole requests cannot
split); the busiest rank's attention summed over the prefill steps (what the steps' attention costs, in millions
of new x total tokens); step counts, and the wall time, TTFT and TPOT medians of a second run of the workload (the
first, of other tokens of the same lengths, compiles every step shape). --simulate runs the engine's Scheduler
alone with a fake model (every sampled token 11; the ranks, steps and step records are the engine's), seconds
instead of minutes. On the 2-core machine the simulated devices share the cores: times show overheads, not
speed-ups.

--bounds prints, per workload, what the decode steps' KV pages imbalance can be at best on the decode engine's
ranks (8 co-located, 4 with PD), for the requests decoding together from one step on (8 tokens a step): "whole
requests" is a lower bound for any placement, moves included (the busiest rank holds at least the mean and at
least the largest request); "repacked" packs every step anew (largest first on the least loaded rank: moving
requests between ranks at no cost); "one placement" is the best single placement for the whole run a local search
finds (no moves: what any balancer placing requests once can reach at best, up to the search).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402

NUM_PROMPTS = 64
FIELDS = (("prefill", "rank_tokens"), ("prefill", "rank_attention"), ("decode", "rank_kv_pages"),
          ("decode", "rank_requests"))


def workload(seed: int, max_tokens: str, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(8), np.log(1500), NUM_PROMPTS)).astype(int)
    prompts = [rng.integers(10, vocab, n).tolist() for n in lengths]
    limits = rng.integers(16, 257, NUM_PROMPTS) if max_tokens == "mixed" else np.full(NUM_PROMPTS, 128)
    return prompts, [int(m) for m in limits]


def simulate(prompts, limits, mode: str) -> list[dict]:
    """The step log of the engine's Scheduler(s) over the workload with a fake model (LLM's CPU defaults:
    max_num_seqs 64, max_num_batched_tokens 2048, 8 decode iterations per step, prefill in 64-column blocks)."""
    from jaxinfer.engine.sampling_params import SamplingParams
    from jaxinfer.engine.scheduler import Scheduler
    from jaxinfer.engine.scheduler_output import RunnerOutput
    from jaxinfer.engine.sequence import Sequence
    from jaxinfer.engine.step_log import step_record

    options = dict(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=2048, page_size=64,
                   num_scheduler_steps=8, prefill_block=64)
    engines = {"colocated": Scheduler(8, 2049, **options)} if mode == "colocated" else {
        "prefill": Scheduler(4, 2049, role="prefill", **options), "decode": Scheduler(4, 2049, role="decode",
                                                                                       **options)}
    first = engines.get("prefill") or engines["colocated"]
    for i, (prompt, m) in enumerate(zip(prompts, limits)):
        first.add(Sequence(i, prompt, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)))
    log, t = [], 0.0
    while any(s.has_unfinished() for s in engines.values()):
        for name, sched in engines.items():
            out = sched.schedule()
            if out is None or out.is_empty:
                continue
            t += 1.0
            log.append(step_record(out, sched, name, t))
            sched.update_from_output(out, RunnerOutput({r.req_id: [11] * r.num_sampled for r in out.all_requests()
                                                        if r.num_sampled}))
            if name == "prefill":  # hand over what finished its prefill (engine.py's rule, without latents)
                for rank in sched.running:
                    for seq in [s for s in rank if not s.is_prefilling and not s.num_placeholders]:
                        from jaxinfer.engine.sequence import Sequence as Seq

                        new = Seq(seq.seq_id, seq.prompt_token_ids, seq.params)
                        new.output_token_ids = list(seq.output_token_ids)
                        n = seq.num_computed_tokens
                        sched.finish(seq, "handover")
                        engines["decode"].add_prefilled(new, None, n)
    return log


def decode_bounds(prompts, limits, ranks: int, per_step: int = 8, page_size: int = 64, seed: int = 0
                  ) -> dict[str, float]:
    """The --bounds figures (module doc) of one workload on ``ranks`` decode ranks."""
    lengths, limits = np.array([len(p) for p in prompts]), np.array(limits)
    steps = np.arange(int(np.ceil(limits.max() / per_step)))                        # [H]
    alive = steps[None, :] < np.ceil(limits / per_step)[:, None]                   # [n, H]
    pages = np.where(alive, np.ceil((lengths[:, None] + 1 + per_step * steps[None, :]) / page_size), 0)  # [n, H]
    mean = pages.sum(axis=0) / ranks                                                # [H]
    repacked = []
    for column in pages.T:
        loads = np.zeros(ranks)
        for x in sorted(column, reverse=True):
            loads[np.argmin(loads)] += x
        repacked.append(loads.max())

    def imbalance_of(placement: np.ndarray) -> float:
        loads = np.zeros((ranks, len(steps)))
        np.add.at(loads, placement, pages)
        return loads.max(axis=0).sum() / mean.sum()

    rng = np.random.default_rng(seed)
    best = np.inf
    for _ in range(4):  # restarts of a local search: move one request, or exchange two, keep what is no worse
        placement = rng.integers(0, ranks, len(prompts))
        value = imbalance_of(placement)
        for _ in range(15000):
            trial = placement.copy()
            i, j = rng.integers(len(prompts), size=2)
            if rng.random() < 0.5:
                trial[i] = rng.integers(ranks)
            else:
                trial[i], trial[j] = placement[j], placement[i]
            v = imbalance_of(trial)
            if v <= value:
                placement, value = trial, v
        best = min(best, value)
    return {"whole requests": np.maximum(mean, pages.max(axis=0)).sum() / mean.sum(),
            "repacked": sum(repacked) / mean.sum(), "one placement": best}


def run_engine(prompts, limits, mode: str, dtype: str, vocab: int) -> tuple[list[dict], dict]:
    from jaxinfer import LLM, SamplingParams

    meshes = dict(mesh="1x8") if mode == "colocated" else dict(prefill_mesh="1x4", decode_mesh="1x4")
    llm = LLM(dtype=dtype, **meshes)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in limits]
    # Warm-up: every step shape of the run compiles here; other tokens, so the timed run has no prefix-cache hits.
    llm.generate([[10 + (t - 9) % (vocab - 10) for t in p] for p in prompts], params, use_tqdm=False)
    llm.wait_for_compilations()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    times = dict(wall_s=wall, ttft_s=statistics.median(o.metrics["ttft_s"] for o in outs),
                 tpot_s=statistics.median(o.metrics["tpot_s"] for o in outs),
                 kv_transfer_mb=llm.stats.kv_transfer_bytes / 1e6)
    return llm.stats.step_log, times


def report(label: str, log: list[dict], times: dict | None) -> None:
    from jaxinfer.engine.step_log import imbalance

    engines = sorted({r["engine"] for r in log})
    for engine in engines:
        own = [r for r in log if r["engine"] == engine]
        figures = {f"{kind[0]}:{field[5:]}": imbalance(own, field, kind) for kind, field in FIELDS
                   if any(r["kind"] == kind for r in own)}
        decode = [r for r in own if r["kind"] == "decode"]
        mean_requests = (statistics.mean(sum(r["rank_requests"]) / len(r["rank_requests"]) for r in decode)
                         if decode else 0.0)
        steps = {k: sum(r["kind"] == k for r in own) for k in ("prefill", "decode")}
        busiest = sum(max(r["rank_attention"]) for r in own if r["kind"] == "prefill") / 1e6
        print(f"{label} [{engine}] " + " ".join(f"{k} {v:.3f}" for k, v in figures.items())
              + (f" | busiest attention {busiest:.2f}M" if steps["prefill"] else "")
              + (f" | requests goal {1 + 1 / mean_requests:.3f} (mean {mean_requests:.2f}/rank)" if decode else "")
              + f" | steps {steps['prefill']} prefill, {steps['decode']} decode")
    if times:
        print(f"{label} wall {times['wall_s']:.1f} s, TTFT median {times['ttft_s'] * 1e3:.0f} ms, TPOT median "
              f"{times['tpot_s'] * 1e3:.1f} ms, handed over {times['kv_transfer_mb']:.1f} MB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="colocated,pd")
    p.add_argument("--max-tokens", default="equal,mixed")
    p.add_argument("--seeds", default="0")
    p.add_argument("--simulate", action="store_true")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--bounds", action="store_true", help="print the decode KV pages' best imbalances (module doc)")
    args = p.parse_args()
    from jaxinfer.config import ModelConfig
    from jaxinfer import default_model

    vocab = ModelConfig.from_hf_config(default_model.path()).vocab_size
    for mode in args.modes.split(","):
        for max_tokens in args.max_tokens.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                prompts, limits = workload(seed, max_tokens, vocab)
                label = f"{mode} {max_tokens} seed={seed} ({sum(map(len, prompts))} prompt tokens)"
                if args.bounds:
                    bounds = decode_bounds(prompts, limits, 8 if mode == "colocated" else 4)
                    print(f"{label} decode KV pages at best: " + ", ".join(f"{k} {v:.3f}" for k, v in bounds.items()))
                if args.simulate:
                    report(label, simulate(prompts, limits, mode), None)
                else:
                    report(label, *run_engine(prompts, limits, mode, args.dtype, vocab))


if __name__ == "__main__":
    main()
