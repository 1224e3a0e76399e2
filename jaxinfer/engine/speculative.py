"""Speculative decoding settings (vLLM's ``speculative_config`` shape) and DSpark's confidence rule.

``SpeculativeConfig.parse`` validates the user's dict; the engine then drafts with the checkpoint's MTP module
(engine/drafter.py) and verifies the drafts in the next decode step (engine/rejection_sampler.py).

verify="confidence" (DeepInfer's DSpark, "confidence-scheduled verification"): each draft token comes with the
MTP module's probability of it, c_j. The chance that the first j drafts are all accepted is estimated by the
cumulative product S_j = c_1 ... c_j (DSpark's prefix survival), so verifying draft j is worth S_j expected
tokens. DSpark verifies a different prefix per sequence because its steps are ragged (a step costs its positions).
Ours are not: a verification step is a [rows, T] grid per rank (engine/inputs.py), every row computes T columns
whatever it verifies, so a shorter prefix on one row saves nothing. The rule therefore picks one width for the
step, the T in {1, 2, 4, ..., K + 1} with the most expected tokens per unit of step cost, and every sequence
verifies T - 1 drafts (``verify_width``). A step of N positions per rank costs about ``knee + N`` position-times:
below ``knee`` positions the weights' bytes and the host's work dominate (``STEP_KNEE_TOKENS``). At batch 1 the
knee dominates and the whole draft is verified; under load a position costs nearly a token and only widths whose
drafts are likely accepted pay. Width 0 makes the step a plain multi-step decode step (engine/scheduler.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

METHODS = ("mtp", "deepseek_mtp")
VERIFY_MODES = ("all", "confidence")
MAX_SPECULATIVE_TOKENS = 16
# Positions per rank at which a decode step's cost doubles: its time is about a + b * positions with a / b ~ 8 for
# the embedded model on 2 CPU cores (the weights' bytes and the host's work dominate below). Measured with
# ``python benchmarks/speculative.py --knee``; docs/benchmarks.md "Speculative decoding (CPU)".
STEP_KNEE_TOKENS = 8


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


def verify_width(confidences: Sequence[Sequence[float]], rows: int, knee: float = STEP_KNEE_TOKENS) -> int:
    """Drafts every sequence of one decode step verifies (the module doc): the T - 1 whose step makes the most
    expected tokens, sum over sequences of 1 + S_1 + ... + S_{T-1}, per unit of cost, knee + rows * T.

    confidences: each decoding sequence's draft probabilities (all ranks; [] for a sequence without drafts);
    rows: the step's rows per rank (the largest rank's, bucketed). Ties go to the narrower step."""
    curves = [survival(c) for c in confidences]
    most = max(map(len, curves), default=0)
    best, best_rate = 0, -1.0
    for t in widths(most):
        rate = sum(1 + sum(s[:t - 1]) for s in curves) / (knee + rows * t)
        if rate > best_rate + 1e-12:
            best, best_rate = t - 1, rate
    return best
