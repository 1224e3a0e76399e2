"""One engine step as data: what the scheduler decided (``SchedulerOutput``) and what the runner computed
(``RunnerOutput``), vLLM v1's ``SchedulerOutput`` / ``ModelRunnerOutput`` shape (docs/architecture.md "The engine
step").

The plan is one-way: the scheduler builds a frozen ``SchedulerOutput``, the runner executes it from its own
per-request state (it never sees a ``Sequence``), and ``Scheduler.update_from_output`` applies the runner's
``RunnerOutput``. Request ids here are the engine's internal sequence ids (ints; one per sample of an n > 1
request).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from jaxinfer.engine.sampling_params import SamplingParams

# A token sampled (or a draft proposed) on device whose value the host does not know yet: a step in flight computes
# it (Scheduler.schedule; the runner reads it from the device's buffers).
PLACEHOLDER = -1


class StepKind(str, enum.Enum):
    """Every step is either a prefill step or a decode step over all DP ranks (DeepSeek's two phases)."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclasses.dataclass(frozen=True)
class NewRequest:
    """A request the runner (re)registers before the step: admitted for the first time, or again after a
    preemption (its block table then starts over from ``ScheduledRequest.new_page_ids``).

    output_token_ids: its outputs so far (a request resumed after preemption recomputes prompt + outputs); all
    known values, since a preempted request is re-admitted only after its last step's tokens were applied.
    """

    req_id: int
    rank: int
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    params: SamplingParams
    child_index: int


@dataclasses.dataclass(frozen=True)
class ScheduledRequest:
    """Compute positions [start, start + num_tokens) of request ``req_id`` this step.

    start: the request's computed tokens before the step (its KV lives in positions [0, start)); for a chunk
      following its speculative step in flight (``draft_token_ids`` placeholders, or a verification whose last
      token that step samples), as if that step computed every position it reserved: the device moves the chunk
      back by the positions it did not, and may then sample as many more (scheduler.py "Speculative steps in
      flight").
    num_sampled: tokens the step samples for it: 0 for a prefill chunk short of the request's last token; 1 for
      a prefill chunk reaching it; for a decode step without drafts, one per iteration (multi-step decode: the
      chunk computes its last token, then each token it samples itself, ``num_tokens`` iterations); with drafts,
      at most 1 + len(draft_token_ids) (``RunnerOutput`` may hold fewer: the rejected ones are rolled back); in a
      step of several draft-verify rounds (``SchedulerOutput.rounds``) a chunk longer than 1 + len(drafts)
      reserves the positions of later rounds too and samples at most ``num_tokens`` (rolled back likewise);
      for a decode chunk of tokens the host appended (``new_token_ids``, now or in an earlier step), 1 when it
      reaches the request's last token, else 0: such a chunk computes known tokens, like a prefill chunk.
    new_page_ids: pages appended to the request's block table by this step (rank-local ids; its whole table for
      a ``NewRequest``).
    draft_token_ids: speculative tokens verified in this step (the inputs at positions start + 1 ...);
      ``PLACEHOLDER`` for drafts the step in flight proposes on device.
    new_token_ids: outputs the host appended since the runner last heard of the request (structured output's
      forced tokens, Scheduler.append_outputs); the runner appends them to its own copy before the step.
    """

    req_id: int
    start: int
    num_tokens: int
    num_sampled: int
    new_page_ids: tuple[int, ...] = ()
    draft_token_ids: tuple[int, ...] = ()
    new_token_ids: tuple[int, ...] = ()

    def num_input_tokens(self, kind: StepKind) -> int:
        """Positions whose input token exists before the step: the whole chunk of a prefill step, of a draft
        verification or of known tokens; the last token of a (multi-step) decode chunk (its later inputs are
        sampled in the step)."""
        if kind is StepKind.PREFILL or self.num_sampled < self.num_tokens:
            return self.num_tokens
        return 1 + len(self.draft_token_ids)

    @property
    def first_sampled(self) -> int:
        """Position of the first token the step samples (with drafts: the first it verifies): a chunk samples
        after its known tokens, or from its first position on (multi-step decode, verification)."""
        return self.start + self.num_tokens - self.num_sampled + 1


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    """One step. ``requests[rank]``: the scheduled requests of each DP rank, in row order (possibly empty).

    new_requests: requests the runner registers before this step (see ``NewRequest``).
    finished_req_ids: requests finished since the previous SchedulerOutput was built (the runner drops their
      state); requests finishing by length as this step is committed follow in the next one.
    preempted_req_ids: requests preempted while building this step (their pages are freed; they wait again).
    speculative: a step of speculative decoding (the runner's ``spec_step``: one draft-verify round, every
      sampling request gets new drafts); False: a plain step (a multi-step decode step: no drafts).
    rounds: draft-verify rounds a verification step runs on device at most (step_program.py ``verify_rounds``);
      verify_columns: a verification step's T columns (1 + the drafts a round verifies at most), else 0.
    page_loads: pages read from the KV storage tier at admission, per rank (rank-local page id, the page's data
      [layers, page_size, width] in the cache's value dtype): the runner writes them into the cache before the
      step, which reads them as cached keys.
    kv_transfers: latents handed over by a prefill engine (prefill/decode disaggregation), each (rank, rank-local
      pages, the latents of every layer [pages, layers, page_size, width] on this engine's devices): the runner
      writes them into those pages before the step.
    """

    kind: StepKind
    requests: tuple[tuple[ScheduledRequest, ...], ...]
    new_requests: tuple[NewRequest, ...] = ()
    finished_req_ids: tuple[int, ...] = ()
    preempted_req_ids: tuple[int, ...] = ()
    speculative: bool = False
    page_loads: tuple[tuple[tuple[int, Any], ...], ...] = ()
    kv_transfers: tuple[tuple[int, tuple[int, ...], Any], ...] = ()
    rounds: int = 1
    verify_columns: int = 0

    def all_requests(self) -> list[ScheduledRequest]:
        return [r for rank in self.requests for r in rank]

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_tokens for r in self.all_requests())

    def num_tokens(self, rank: int) -> int:
        return sum(r.num_tokens for r in self.requests[rank])

    @property
    def is_empty(self) -> bool:
        return not any(self.requests)


@dataclasses.dataclass(frozen=True)
class RunnerOutput:
    """The runner's results of one step, by request id.

    sampled: the tokens the step sampled for each request with ``num_sampled`` > 0, in order (a multi-step decode
      chunk: one per iteration; after a stop token the rest are garbage and ignored).
    logprobs: for requests that asked, per sampled token {token: logprob} (the sampled token included).
    draft_token_ids: tokens proposed for the next step (speculative decoding); verified when scheduled.
    draft_probs: the drafter's probability of each draft (DSpark's confidence, engine/speculative.py).
    verified: for a verification step, (drafts verified, drafts accepted) of each round a request took part in;
      absent, a step's one round counts as ``sampled`` and its drafts say.
    """

    sampled: dict[int, list[int]]
    logprobs: dict[int, list[dict[int, float]]] = dataclasses.field(default_factory=dict)
    draft_token_ids: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    draft_probs: dict[int, list[float]] = dataclasses.field(default_factory=dict)
    verified: dict[int, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)
