"""`Sequence`: one request's host-side state as the scheduler sees it (pure Python, no JAX).

Token accounting (vLLM / nano-vllm): the sequence's tokens are ``prompt_token_ids + output_token_ids``
(``num_tokens`` of them). ``num_computed_tokens`` of them have their latent KV written in the rank's paged cache, in
positions ``[0, num_computed_tokens)``; their slots are the pages of ``pages`` (the block table: position t lives
in page ``pages[t // page_size]``, slot ``t % page_size``).

Life cycle: WAITING (queued on its DP rank, holds no pages) -> RUNNING -> FINISHED. A RUNNING sequence is first
*prefilling*: it computes the tokens it had at admission (``num_prefill_tokens``: the prompt, or prompt + outputs
after a preemption) in one or more chunks; the chunk that reaches ``num_tokens`` yields the logits of the next token.
Then it *decodes*: a step computes its last token (``num_computed_tokens == num_tokens - 1`` before the step) and
samples the next (a multi-step decode step also computes the tokens it samples; a verification step computes
the draft tokens after it; tokens the host appended, structured output's forced ones, are computed as one chunk
before the next sample: see scheduler.py). A preempted sequence goes back to WAITING with no pages and
``num_computed_tokens = 0``, keeping its outputs; it recomputes them as its next prefill.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Sequence as _Seq

from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.engine.scheduler_output import PLACEHOLDER
from jaxinfer.kv.prefix_cache import page_hashes


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Host-side state of one request (one sample: an ``n > 1`` request is ``n`` sequences).

    Set by the caller: ``seq_id`` (unique among the scheduler's unfinished sequences), ``prompt_token_ids``,
    ``params``, ``child_index`` (which of an n > 1 request's samples). Set by the scheduler: ``rank`` (DP rank,
    fixed on arrival), ``arrival`` (arrival order on that scheduler), ``status``, ``output_token_ids``,
    ``num_computed_tokens``, ``num_prefill_tokens`` (tokens to compute in the current prefill), ``pages``,
    ``num_cached_tokens`` (prompt tokens served by the prefix cache at the first admission; later re-admissions
    after preemption do not change it), ``num_storage_cached_tokens`` (those of them read from the KV storage
    tier), ``num_preemptions``, ``finish_reason`` ("stop" | "length" | "error" |
    engine-defined) and ``error`` (message for "error").
    """

    def __init__(self, seq_id: int, prompt_token_ids: _Seq[int], params: SamplingParams | None = None,
                 child_index: int = 0):
        self.seq_id = seq_id
        self.child_index = child_index  # which of the request's n samples (the sampler's seed offset)
        self.prompt_token_ids: list[int] = [int(t) for t in prompt_token_ids]
        self.params = params if params is not None else SamplingParams()
        self.rank: int | None = None
        self.arrival: int | None = None
        self.status = SequenceStatus.WAITING
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_prefill_tokens = 0
        self.pages: list[int] = []
        self.num_cached_tokens = 0
        self.num_storage_cached_tokens = 0
        self.num_preemptions = 0
        self.num_registered_pages = 0   # leading pages of ``pages`` already offered to the prefix cache
        self.num_pages_sent = 0         # leading pages of ``pages`` the runner was told about (new_page_ids)
        self.unsent_token_ids: list[int] = []  # outputs appended by the host, not told to the runner yet
        self.draft_token_ids: tuple[int, ...] = ()  # proposed by the runner, verified by the next decode step
        self.draft_probs: tuple[float, ...] = ()    # the drafter's probability of each draft (DSpark)
        self.num_draft_tokens = 0       # drafts verified (speculative decoding)
        self.num_accepted_tokens = 0    # drafts accepted
        # Async speculative steps (scheduler.py "Speculative steps in flight"): drafts the step in flight proposes
        # on device, positions rolled back so far (net), and per step in flight (oldest first) that count at its
        # commit and whether it follows the step before it on device: its placeholders sit as many positions
        # earlier as were rolled back since.
        self.num_device_drafts = 0
        self.num_rolled_back = 0
        self.rollbacks_at_commit: collections.deque[tuple[int, bool]] = collections.deque()
        self.finish_reason: str | None = None
        self.error: str | None = None
        self._hashes: list[int] = []     # chained page hashes of the leading full pages of all_token_ids
        self._hash_key = None

    # ---- sizes -----------------------------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_placeholders(self) -> int:
        """Trailing PLACEHOLDER outputs (tokens of steps still in flight)."""
        n = 0
        for token in reversed(self.output_token_ids):
            if token != PLACEHOLDER:
                break
            n += 1
        return n

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens at positions [start, stop) of prompt + outputs (what a ScheduledChunk feeds the model)."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise ValueError(f"positions [{start}, {stop}) outside the {self.num_tokens} tokens of seq {self.seq_id}")
        p = self.num_prompt_tokens
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:  # a decode step: O(stop - start), not O(sequence length)
            return self.output_token_ids[start - p:stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - p]

    # ---- states ----------------------------------------------------------------------------------------------
    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        """RUNNING and still computing the tokens it had at admission (prompt, or prompt + outputs)."""
        return self.status is SequenceStatus.RUNNING and self.num_computed_tokens < self.num_prefill_tokens

    def page_hashes(self, num_pages: int, page_size: int, extra_key=None) -> list[int]:
        """Chained hashes (``kv.prefix_cache.page_hashes``) of the first ``num_pages`` full pages of the tokens.

        Tokens are only ever appended, so hashes once computed stay valid; they are cached and extended in O(new).
        """
        if num_pages * page_size > self.num_tokens:
            raise ValueError(f"{num_pages=} full pages of {page_size} exceed the {self.num_tokens} tokens of seq "
                             f"{self.seq_id}")
        if self._hash_key != (page_size, extra_key):
            self._hashes, self._hash_key = [], (page_size, extra_key)
        if len(self._hashes) < num_pages:
            self._hashes = page_hashes(self.all_token_ids[: num_pages * page_size], page_size, extra_key)
        return self._hashes[:num_pages]

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, rank={self.rank}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, pages={self.pages}, "
                f"finish={self.finish_reason})")
