"""`SamplingParams`: per-request sampling settings, validated at construction (vLLM's names and ranges).

The public contract: docs/architecture.md "Public contract". Ranges follow vLLM's `SamplingParams._verify_args`
(vllm/sampling_params.py): temperature >= 0, 0 < top_p <= 1, top_k -1 or 0 (off) or >= 1, 0 <= min_p <= 1,
max_tokens >= 1, n >= 1, presence_penalty and frequency_penalty in [-2, 2], repetition_penalty > 0,
logprobs None or >= 0. Every violation raises ValueError naming the field and the value.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable, Sequence

from jaxinfer.engine.structured_output import StructuredOutputsParams

# Temperatures below this are greedy, as vLLM's `_SAMPLING_EPS` (vllm/sampling_params.py and the v1 sampler):
# dividing logits by a temperature this small would overflow float32 and argmax is what it tends to anyway.
SAMPLING_EPS = 1e-5


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _real(name: str, value, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> float:
    """`value` as a float in [lo, hi] (ends open where asked), else ValueError naming `name` and `value`."""
    if not _is_real(value) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number")
    ok_lo = value > lo if lo_open else value >= lo
    ok_hi = value < hi if hi_open else value <= hi
    if not (ok_lo and ok_hi):
        left, right = "(" if lo_open else "[", ")" if hi_open else "]"
        raise ValueError(f"{name}={value!r} must be in {left}{lo}, {hi}{right}")
    return float(value)


def _int(name: str, value, lo: int) -> int:
    if not _is_int(value):
        raise ValueError(f"{name}={value!r} must be an int")
    if value < lo:
        raise ValueError(f"{name}={value!r} must be >= {lo}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request (frozen: hashable, safe to share between requests).

    Attributes (defaults as vLLM's; docs/architecture.md "Public contract"):
      temperature: >= 0; below 1e-5 (0 in practice) means greedy argmax, as vLLM.
      top_p: in (0, 1]; keep the smallest set of most likely tokens whose probability reaches top_p.
      top_k: -1 or 0 = off, else keep the k most likely tokens (ties with the k-th are kept).
      min_p: in [0, 1]; drop tokens whose probability is below min_p times the most likely token's.
      max_tokens: >= 1 generated tokens at most.
      seed: None (engine randomness) or an int; the same seed gives the same tokens whatever the batch (up to
        ties that the batch's rounding flips: docs/architecture.md "Reference semantics").
      stop: None, a string or a list of strings -> tuple of non-empty strings (trimmed from the text).
      stop_token_ids: None or a list of token ids -> tuple of ints >= 0.
      ignore_eos: only "do not stop at EOS" (EOS is not masked).
      n: >= 1 samples per prompt.
      logprobs: None, or N >= 0: the top-N logprobs per generated token plus the sampled token's (a vocabulary of
        fewer than N tokens: all of them).
      presence_penalty, frequency_penalty: in [-2, 2] (OpenAI API, as vLLM), on generated tokens.
      repetition_penalty: > 0 (1 = off), on tokens of the prompt or the output (vLLM, CTRL paper).
      structured_outputs: None, or a StructuredOutputsParams (or its fields as a dict): the output follows a JSON
        Schema, regex, choice or Lark grammar (engine/structured_output.py).

    Raises:
      ValueError naming the field and its value for anything outside these ranges or of the wrong type.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        set_("temperature", _real("temperature", self.temperature, 0.0, math.inf, hi_open=True))
        set_("top_p", _real("top_p", self.top_p, 0.0, 1.0, lo_open=True))
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} must be -1 or 0 (off) or an int >= 1")
        set_("top_k", int(self.top_k))
        set_("min_p", _real("min_p", self.min_p, 0.0, 1.0))
        set_("max_tokens", _int("max_tokens", self.max_tokens, 1))
        set_("n", _int("n", self.n, 1))
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed={self.seed!r} must be None or an int")
        if self.seed is not None:
            set_("seed", int(self.seed))
        if self.logprobs is not None:
            set_("logprobs", _int("logprobs", self.logprobs, 0))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r} must be a bool")
        set_("presence_penalty", _real("presence_penalty", self.presence_penalty, -2.0, 2.0))
        set_("frequency_penalty", _real("frequency_penalty", self.frequency_penalty, -2.0, 2.0))
        set_("repetition_penalty", _real("repetition_penalty", self.repetition_penalty, 0.0, math.inf,
                                         lo_open=True, hi_open=True))
        set_("stop", _stop_strings(self.stop))
        set_("stop_token_ids", _stop_token_ids(self.stop_token_ids))
        try:
            set_("structured_outputs", StructuredOutputsParams.parse(self.structured_outputs))
        except ValueError as e:
            raise ValueError(f"structured_outputs={self.structured_outputs!r}: {e}") from None

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax: temperature 0 (below 1e-5, vLLM's `_SAMPLING_EPS`)."""
        return self.temperature < SAMPLING_EPS

    @property
    def uses_penalties(self) -> bool:
        """True when any of presence, frequency or repetition penalty is active."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def stop_tokens(self, eos_token_id: int | None) -> tuple[int, ...]:
        """The tokens that finish this request with "stop": the model's EOS (unless ignore_eos or None), then
        stop_token_ids."""
        eos = () if self.ignore_eos or eos_token_id is None else (eos_token_id,)
        return eos + tuple(t for t in self.stop_token_ids if t not in eos)


def _stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"stop={stop!r} must be None, a string or a list of strings")
    for s in items:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop={stop!r}: every stop string must be a non-empty str, got {s!r}")
    return tuple(items)


def _stop_token_ids(ids) -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise ValueError(f"stop_token_ids={ids!r} must be None or a list of ints")
    items = tuple(ids)
    for t in items:
        if not _is_int(t) or t < 0:
            raise ValueError(f"stop_token_ids={ids!r}: every id must be an int >= 0, got {t!r}")
    return tuple(int(t) for t in items)
