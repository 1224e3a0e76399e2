"""Speculative decoding settings (vLLM's ``speculative_config`` shape) and DSpark's confidence rule.

``SpeculativeConfig.parse`` validates the user's dict; the engine then drafts with the checkpoint's MTP module
(engine/drafter.py) and verifies the drafts in the next decode step (engine/rejection_sampler.py).

verify="confidence" (DeepInfer's DSpark, "confidence-scheduled verification"): each draft token comes with the
MTP module's probability of it, c_j. The chance that the first j drafts are all accepted is estimated by the
cumulative product S_j = c_1 ... c_j (DSpark's prefix survival), so verifying draft j is worth S_j expected
tokens. DSpark verifies a different prefix per sequence because its steps are ragged (a step costs its positions).
Ours are not: a verification step is a [rows, T] grid per rank (engine/inputs.py), every row computes T columns
whatever it verifies, so a shorter prefix on one row saves nothing. The rule therefore picks one width for the
step: a draft-verify round of T in {2, 4, ..., K + 1} columns (every sequence verifies T - 1 drafts), or a plain
multi-step decode step (width 0), whichever makes the most expected tokens per unit of time (``verify_width``).

Times come from a per-platform cost model (``StepCost``, ``STEP_COSTS``): a model pass over N positions per rank
costs ``knee + N`` position-times; a round also pays the MTP module's passes (over its T columns, then K - 1
chained positions) and a fixed cost a plain multi-step step does not: its program's launch and the host's work,
which the round waits for (the next step needs its drafts) where plain steps overlap it and spread it over
their iterations. A step of several rounds on device (``num_scheduler_steps``, step_program.py
``verify_rounds``) pays that fixed cost once: each of its rounds a share. The constants are fixed per platform,
so the rule, and with it a seeded request's tokens, are deterministic for a configuration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

METHODS = ("mtp", "deepseek_mtp")
VERIFY_MODES = ("all", "confidence")
MAX_SPECULATIVE_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """method: "mtp" (alias "deepseek_mtp": the checkpoint's MTP module, chained); num_speculative_tokens: drafts
    per round, K in [1, 16]; verify: "all" (every draft) or "confidence" (DSpark: the prefix worth its cost)."""

    method: str
    num_speculative_tokens: int
    verify: str = "all"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens must be an int in [1, "
                             f"{MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"speculative_config verify must be one of {VERIFY_MODES}, got {self.verify!r}")

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig, or vLLM's dict {"method", "num_speculative_tokens", "verify"?}."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be None or a dict, got {type(value).__name__}")
        unknown = sorted(set(value) - {"method", "num_speculative_tokens", "verify"})
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; it takes method, "
                             f"num_speculative_tokens and verify")
        missing = [key for key in ("method", "num_speculative_tokens") if key not in value]
        if missing:
            raise ValueError(f"speculative_config needs {missing}")
        return cls(value["method"], value["num_speculative_tokens"], value.get("verify", "all"))


def survival(confidences: Sequence[float]) -> list[float]:
    """S_j = c_1 ... c_j: the estimated chance that the first j drafts are all accepted."""
    out, s = [], 1.0
    for c in confidences:
        s *= float(c)
        out.append(s)
    return out


def widths(num_drafts: int) -> list[int]:
    """The verification step's T candidates for K drafts: the powers of two below K + 1, then K + 1 (the runner
    buckets T so, engine/inputs.py)."""
    out = [1]
    while out[-1] * 2 < num_drafts + 1:
        out.append(out[-1] * 2)
    return out + [num_drafts + 1] if num_drafts else out


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Decode step times in position-times (the cost of one more position in a model pass).

    knee: a model pass's fixed cost (the weights' bytes, per-layer launches); fixed: what a draft-verify round pays
    on top that a plain multi-step iteration does not (its program's launch, the host's synchronous work); mtp: the
    MTP module's pass relative to the main model's (one decoder layer and the head)."""

    knee: float
    fixed: float
    mtp: float

    def plain(self, rows: int) -> float:
        """One iteration of a plain multi-step decode step of ``rows`` rows per rank."""
        return self.knee + rows

    def round(self, rows: int, t: int, num_drafts: int, rounds: int = 1) -> float:
        """A draft-verify round: the main model and the MTP module over [rows, t], then K - 1 chained MTP
        positions per row; in a step of ``rounds`` rounds, a share of the step's fixed cost."""
        return (self.fixed / rounds + (1 + self.mtp) * (self.knee + rows * t)
                + (num_drafts - 1) * self.mtp * (self.knee + rows))


# Per platform (JAX's backend name). "cpu": the embedded model (bfloat16, 1x1) on 2 cores, fitted by
# ``python benchmarks/speculative.py --costs`` (docs/benchmarks.md "Speculative decoding (CPU)") from decode wall
# times of LLM's default steps (rounds in steps of 8 on device): a position costs ~0.14 ms, a pass ~4 positions
# more; a round's cost beyond its positions does not grow with them (the fit's mtp is 0: the MTP module's chained
# one-row passes and the round's small ops cost the same at 1 and 32 rows) and comes to ~11 positions per round
# of a step of 8 (fixed 87, which the form fixed / rounds cannot split into the step's launch and host work and
# each round's own overhead: a one-round step costs less than it says). There a round pays at 1 row only with
# near-certain drafts (4 tokens per 18.8 position-times against a plain iteration's 1 per 4.9: +4%); measured
# drafts (71%, 51%, 37% accepted) make 2.6 tokens per round. "gpu": not measured yet (no device; the kernel
# issue's next GPU run measures it); a roofline estimate for DeepSeek-V3 on an H200: a decode pass reads every
# weight once, so positions are nearly free below the machine balance (989 dense bf16 TFLOP/s / 4.8 TB/s ~ 206
# FLOP per byte; a token does 2 FLOP per 2-byte weight, so ~200 tokens per rank for dense layers and more for
# routed experts, which each see their share of the tokens: knee 128 errs low), the MTP module is 1 of 62 layers
# plus the head (mtp ~ 1/30), and the launch and the host's work are a small fraction of a ~20 ms pass (fixed 16).
STEP_COSTS = {"cpu": StepCost(knee=3.9, fixed=87.0, mtp=0.0), "gpu": StepCost(knee=128.0, fixed=16.0, mtp=1 / 30)}


def step_cost(platform: str) -> StepCost:
    """The cost model of a platform ("cpu", "gpu"; "cuda" and "rocm" are GPUs; others use the GPU's)."""
    return STEP_COSTS["cpu" if platform == "cpu" else "gpu"]


# Plain steps draft nothing, so after a plain step the rule knows the drafts only by the moving mean of earlier ones
# (engine/scheduler.py), and an estimate that once said "plain" (e.g. from the uncertain drafts of prompts' last
# tokens) would never be revised. After this many consecutive plain steps, when one round of perfect drafts would
# pay at the step's load (a step of one round: the probe's own), the scheduler takes the narrowest round (one draft
# verified) to draft afresh: a deterministic probe, never taken where a lone round cannot pay (the CPU's costs).
PROBE_AFTER_PLAIN_STEPS = 4


def verify_width(confidences: Sequence[Sequence[float]], rows: int, num_drafts: int, cost: StepCost,
                 rounds: int = 1) -> int:
    """Drafts every sequence of one decode step verifies (the module doc): 0 (a plain step) or the T - 1 >= 1 of
    the round with the most expected tokens, sum over sequences of 1 + S_1 + ... + S_{T-1}, per unit of time,
    ``cost.round(rows, T, K, rounds)``, when that beats a plain iteration's len(confidences) tokens per
    ``cost.plain(rows)``.

    confidences: each decoding sequence's draft probabilities (all ranks; [] for a sequence without drafts);
    rows: the step's rows per rank (the largest rank's, bucketed); num_drafts: K; rounds: the rounds a step runs
    on device at most (num_scheduler_steps). Ties go to the narrower step."""
    curves = [survival(c) for c in confidences]
    most = max(map(len, curves), default=0)
    best, best_rate = 0, len(curves) / cost.plain(rows)
    for t in widths(most)[1:]:
        rate = sum(1 + sum(s[:t - 1]) for s in curves) / cost.round(rows, t, num_drafts, rounds)
        if rate > best_rate + 1e-12:
            best, best_rate = t - 1, rate
    return best
