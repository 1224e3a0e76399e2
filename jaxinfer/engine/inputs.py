"""The runner's per-request state (a persistent batch: vLLM v1's ``CachedRequestState``) and the host arrays of one
step, built from a ``SchedulerOutput`` alone.

Layout of a step (every device is a DP rank; rank r owns rows [r * rows, (r + 1) * rows)): a chunk of n tokens
sits at the END of its row of T columns, so that mla_decode's causal rule (query i sees keys < seqlen - T + i + 1)
holds for every real token; padding columns write nothing (slot -1) and padding rows see no keys.

Bounded compilation: the step compiles once per (rows, T, pages) bucket, penalties on/off and logprobs on/off.
Decode steps: T = 1 (a multi-step decode step: slots [rows, k]), rows per rank a power of two; a decode step with
chunks of known tokens (host-appended outputs, Scheduler.append_outputs) has T = buckets.py ``known_columns`` (one
width per row count), laid out as a prefill step. Prefill steps in query blocks (the default; ``prefill_block`` =
Q): a chunk of n tokens spans ceil(n / Q) consecutive rows of Q columns, right aligned over them (padding leads its
first block), every block row with the chunk's block table (max_pages wide: the same for every prefill step) and its
own seqlen (its last position + 1); ``first_block`` [rows] gives each row its chunk's first row, rank-local. Rows
per rank: a power of two, rows * Q <= prefill_capacity: a prefill step compiles once per row count. Prefill grids
(prefill_block None; speculative decoding's): T a power of two >= the scheduler's min_prefill_t and rows per rank a
power of two, rows * T <= prefill_capacity (the scheduler keeps every rank's chunks within that). Pages per row (but
blocks'): a power of two >= MIN_PAGES. Either is no larger than its chunks need: one 64-token prompt runs one row of
64, not a full 1024-token step.

Tokens the host does not know yet: every step writes its sampled tokens into a device buffer (slot rank *
max_rows + row), and a request's input token sampled by the last dispatched step, whose value has not reached the
host, is read from that buffer (``src``), so the host can dispatch step n + 1 before step n's tokens come back.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxinfer.engine.sampler import SamplingTensors, token_counts
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.engine.buckets import bucket, known_columns
from jaxinfer.engine.scheduler_output import PLACEHOLDER, ScheduledRequest, SchedulerOutput, StepKind

# Stop ids a multi-step decode step checks on device per row (SamplingParams.stop_tokens: EOS first, then
# stop_token_ids): a row with more is checked for the first ones only, which is safe (the host's stop check
# decides; the device only stops early).
DEVICE_STOP_IDS = 8
# Pages per row at least: fewer shapes; 4 cost more per step at short contexts (docs/benchmarks.md "Paged
# attention, XLA path (CPU)").
MIN_PAGES = 2
_PAD_PARAMS = SamplingParams(temperature=0.0)  # rows that sample nothing: greedy, never read


@dataclasses.dataclass
class RequestState:
    """What the runner keeps of one request between steps: its tokens as far as the runner has fetched them
    (prompt + outputs), its sampling settings and its block table (rank-local page ids)."""

    req_id: int
    rank: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    child_index: int
    pages: list[int]


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Host arrays of one step (``arrays``: ids, src, positions, block_table, seqlens, slots, dest, stop_ids, and
    with speculative decoding next_ids, follow and left, each [rows, ...]), the sampling tensors, and the (row,
    request id, tokens sampled at most) of every sampling row. verifying: a speculative decoding step that verifies
    drafts (step_program.spec_step); its rows' real columns are their last ``tokens sampled at most`` ones, but
    for rows following their step in flight (``follow`` >= 0: the device lays them out again,
    ``StepProgram.follow_in_flight``, and may sample more or fewer). blocks: a prefill step in query blocks
    (``first_block`` the last array). rounds: draft-verify rounds at most (SchedulerOutput.rounds; with rounds > 1
    ``reserve`` [rows, rounds x T], the slots of each row's reserved positions, joins the arrays)."""

    arrays: list[np.ndarray]
    tensors: SamplingTensors
    sampled: list[tuple[int, int, int]]
    verifying: bool = False
    blocks: bool = False
    rounds: int = 1


def step_shape(out: SchedulerOutput, num_pages: dict[int, int], min_prefill_t: int, prefill_capacity: int,
               block: int | None = None, max_pages: int = 0) -> tuple[int, int, int]:
    """(rows per rank, T, pages per row) of a step's bucketed arrays; num_pages: each scheduled request's block
    table length after the step's new pages. block: the query-block width of prefill steps (None: grids), whose
    block tables are max_pages wide."""
    requests = out.all_requests()
    if block and out.kind is StepKind.PREFILL:
        rows = bucket(max(sum(-(-r.num_tokens // block) for r in rank) for rank in out.requests))
        if rows * block > prefill_capacity:
            raise RuntimeError(f"prefill step of {[[r.num_tokens for r in rank] for rank in out.requests]} tokens "
                               f"takes more than {prefill_capacity // block} blocks of {block} per rank")
        most = max((num_pages[r.req_id] for r in requests), default=1)
        if most > max_pages:
            raise RuntimeError(f"a block table of {most} pages exceeds the block layout's {max_pages}")
        return rows, block, max_pages
    pages = bucket(max((num_pages[r.req_id] for r in requests), default=1), MIN_PAGES)
    rows = bucket(max(len(rank) for rank in out.requests))
    if out.kind is StepKind.DECODE:
        # 1 (InputBatch.shape sets a verification step's T), or a step of known tokens: one width per row count
        longest = 1 if out.speculative else max((r.num_input_tokens(out.kind) for r in requests), default=1)
        if longest == 1:
            return rows, 1, pages
        t = max(bucket(longest), known_columns(rows, prefill_capacity))
    else:
        t = bucket(max((r.num_tokens for r in requests), default=1), min_prefill_t)
    if rows * t > prefill_capacity:
        raise RuntimeError(f"{out.kind.value} step of {[len(rank) for rank in out.requests]} chunks of up to {t} "
                           f"tokens exceeds {prefill_capacity} tokens per rank")
    return rows, t, pages


class InputBatch:
    """The runner's requests and the host side of its steps.

    Args:
      ranks: DP ranks; max_rows: a rank's sampling rows at most (the token buffer holds ranks * max_rows);
      page_size; min_prefill_t, prefill_capacity: the prefill grid (Scheduler's); num_scheduler_steps: decode
      iterations per decode step at most; eos_token_id: the engine's EOS (device stop checks); vocab_size;
      engine_seed: seed of unseeded requests (sampler.request_seed); max_logprobs: the logprobs width computed
      when any row asks for logprobs (one static width bounds compilations); num_drafts: K of speculative
      decoding (0: off). A speculative step (``SchedulerOutput.speculative``) lays decode rows out as verification
      rows (1 + drafts tokens, right aligned like prefill chunks), prefill chunks carry the token after them
      (next_ids: -1 = the step's sample), and block tables cover K - 1 positions past the chunk for the MTP chain
      (engine/drafter.py). prefill_block: None, or Q: prefill steps are laid out in query blocks of Q columns
      (kernels_pallas/mla/query_blocks.py; ``first_block`` joins the arrays) with block tables max_pages wide
      (the engine passes None with speculative decoding: its drafter shifts tokens within a row).
      max_model_len: the engine's (the tokens a row following its step in flight may still sample).
    """

    def __init__(self, *, ranks: int, max_rows: int, page_size: int, min_prefill_t: int, prefill_capacity: int,
                 num_scheduler_steps: int, eos_token_id: int | None, vocab_size: int, engine_seed: int,
                 max_logprobs: int, num_drafts: int = 0, prefill_block: int | None = None, max_pages: int = 0,
                 max_model_len: int = 1 << 30):
        self.ranks = ranks
        self.max_rows = max_rows
        self.page_size = page_size
        self.min_prefill_t = min_prefill_t
        self.prefill_capacity = prefill_capacity
        self.num_scheduler_steps = num_scheduler_steps
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.engine_seed = engine_seed
        self.max_logprobs = max_logprobs
        self.num_drafts = num_drafts
        self.prefill_block = prefill_block
        self.max_pages = max_pages
        self.max_model_len = max_model_len
        self.requests: dict[int, RequestState] = {}
        self._feed: dict[int, int] = {}  # req_id -> buffer slot of its token sampled by the last dispatched step
        self._feed_speculative = False  # that step was speculative: its drafts and rollback are in the buffer too

    def update_states(self, out: SchedulerOutput) -> None:
        """Applies a step's request changes: drops finished and preempted requests, registers new ones, extends
        block tables."""
        for req_id in out.finished_req_ids + out.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in out.new_requests:
            self.requests[new.req_id] = RequestState(new.req_id, new.rank, list(new.prompt_token_ids),
                                                     list(new.output_token_ids), new.params, new.child_index, [])
        for r in out.all_requests():
            state = self.requests[r.req_id]
            state.pages.extend(r.new_page_ids)
            state.output_token_ids.extend(r.new_token_ids)

    def record(self, sampled: dict[int, list[int]]) -> None:
        """Appends a fetched step's tokens to its requests (for later prefills and penalty counts)."""
        for req_id, tokens in sampled.items():
            state = self.requests.get(req_id)
            if state is not None:
                state.output_token_ids.extend(tokens)

    def shape(self, out: SchedulerOutput) -> tuple[int, int, int]:
        if not out.speculative:
            num_pages = {r.req_id: len(self.requests[r.req_id].pages) for r in out.all_requests()}
        else:  # the MTP chain reads positions up to the chunk's last + K - 1 (from its window, engine/drafter.py)
            num_pages = {r.req_id: max(len(self.requests[r.req_id].pages),
                                       -(-(r.start + r.num_tokens + self.num_drafts - 1) // self.page_size))
                         for r in out.all_requests()}
        rows, t, pages = step_shape(out, num_pages, self.min_prefill_t, self.prefill_capacity, self.prefill_block,
                                    self.max_pages)
        if out.speculative and out.kind is StepKind.DECODE:  # the last token and the most drafts a row verifies
            t = out.verify_columns or min(bucket(max(r.num_input_tokens(out.kind) for r in out.all_requests())),
                                          self.num_drafts + 1)
        return rows, t, pages

    def build(self, out: SchedulerOutput, allowed: dict[int, np.ndarray] | None = None) -> StepInputs:
        """Host arrays of one step (after ``update_states``). A multi-step decode step (chunks of more than one
        token) has slots [rows, k], column j for iteration j, and ids / positions [rows, 1] for each row's first
        token. stop_ids [rows, DEVICE_STOP_IDS]: each sampling row's stop tokens (-1: none). allowed: the allowed
        tokens of constrained requests, int32 [1 + drafts, ceil(V / 32)] bitmask words by request id (structured
        output; engine/structured_output.py ``Grammars.masks``): a verification step's rows get one mask per
        column, other steps' rows the first; None: no mask at all (an engine without constrained requests), where
        {} gives every row all tokens (one program whichever rows a constrained engine's step samples).

        Raises RuntimeError when a chunk's input token is unknown to the runner (neither fetched nor sampled by the
        last dispatched step), or a row with penalties has outputs not fetched yet (the caller applies the
        previous step first)."""
        rows, t, pages = self.shape(out)
        decode = out.kind is StepKind.DECODE
        verifying = decode and out.speculative
        multi = decode and not verifying and t == 1  # slots [rows, k]: iteration j's in column j
        rounds = out.rounds if verifying else 1
        k = t
        if decode and not verifying:
            if any(r.draft_token_ids for r in out.all_requests()):
                raise NotImplementedError("draft token verification has no step program yet")
            most = max((r.num_sampled for r in out.all_requests()), default=1)
            if most > (self.num_scheduler_steps if multi else 1):
                raise RuntimeError(f"a decode chunk samples {most} tokens in a step of {t} columns "
                                   f"(num_scheduler_steps={self.num_scheduler_steps})")
            if multi:
                k = 1 if most <= 1 else self.num_scheduler_steps  # two programs per bucket: one step or k
        n_rows = self.ranks * rows
        ids = np.zeros((n_rows, t), np.int32)
        src = np.full((n_rows, t), -1, np.int32)
        positions = np.zeros((n_rows, t), np.int32)
        slots = np.full((n_rows, k), -1, np.int32)
        block_table = np.zeros((n_rows, pages), np.int32)  # page 0: each rank's null page
        seqlens = np.zeros((n_rows,), np.int32)
        dest = np.full((n_rows,), self.ranks * self.max_rows, np.int32)  # out of range: dropped
        stop_ids = np.full((n_rows, DEVICE_STOP_IDS), -1, np.int32)  # [rows, S]: -1 matches no token
        next_ids = np.full((n_rows,), -1, np.int32)  # speculative prefill: the token after the chunk, if known
        follow = np.full((n_rows,), -1, np.int32)  # a verification after its step in flight: that step's slot
        left = np.zeros((n_rows,), np.int32)  # ... and the tokens it may still sample, as the host counts them
        reserve = np.full((n_rows, rounds * t), -1, np.int32)  # several rounds: slots of the reserved positions
        params = [_PAD_PARAMS] * n_rows
        states: list[RequestState | None] = [None] * n_rows
        steps = np.zeros((n_rows,), np.int64)
        sampled, feed = [], {}
        blocked = bool(self.prefill_block) and out.kind is StepKind.PREFILL
        first_block = np.tile(np.arange(rows, dtype=np.int32), self.ranks)  # [rows]: rank-local, padding: itself
        for rank, requests in enumerate(out.requests):
            offset = 0  # the block layout: the rank's rows used so far
            # Per row: few numpy calls on small arrays (a decode step's rows hold one token each; a numpy call per
            # token and field is host time that grows with the batch: docs/benchmarks.md "Engine steps and host
            # overhead (CPU)").
            for i, r in enumerate(requests):
                row, n, state = rank * rows + i, r.num_tokens, self.requests[r.req_id]
                n_in = r.num_input_tokens(out.kind)
                end = r.start + n_in
                if blocked:  # rows row0 .. row of the chunk's blocks, its tokens right aligned over them
                    nb = -(-n // t)
                    row0, offset = rank * rows + offset, offset + nb
                    row = row0 + nb - 1
                    flat = slice((row + 1) * t - n, (row + 1) * t)
                    ids.reshape(-1)[flat] = self._input_ids(state, r, end, src, row, t - 1)
                    positions.reshape(-1)[flat] = range(r.start, end)
                    block_table[row0:row + 1, : len(state.pages)] = state.pages
                    pos = np.arange(r.start, end)  # [n]
                    slots.reshape(-1)[flat] = (block_table[row, pos // self.page_size] * self.page_size
                                               + pos % self.page_size)
                    seqlens[row0:row + 1] = end - t * np.arange(nb - 1, -1, -1)  # each block's last position + 1
                    first_block[row0:row + 1] = row0 - rank * rows
                elif r.draft_token_ids:  # the last known token, then the drafts
                    ids[row, t - n_in:] = (self._input_ids(state, r, r.start + 1, src, row, t - n_in)
                                           + list(r.draft_token_ids))
                else:
                    ids[row, t - n_in:] = self._input_ids(state, r, end, src, row, t - 1)
                if verifying and self._follows(r, state):  # laid out again on device (step_program.py)
                    follow[row] = self._feed[r.req_id]
                    o = r.first_sampled - len(state.prompt_token_ids)  # outputs before its first sample
                    left[row] = min(state.params.max_tokens - o, self.max_model_len - r.first_sampled)
                elif PLACEHOLDER in r.draft_token_ids:
                    raise RuntimeError(f"request {r.req_id}: drafts proposed on device by a step not in flight")
                elif decode and not verifying and src[row, t - 1] >= 0 and self._feed_speculative:
                    raise RuntimeError(f"request {r.req_id}: a plain step after its speculative step in flight")
                if not blocked:
                    positions[row, t - n_in:] = range(r.start, end)
                    block_table[row, : len(state.pages)] = state.pages
                    pos = np.arange(r.start, r.start + n)  # [n] positions computed (reserved: several rounds)
                    at = block_table[row, pos // self.page_size] * self.page_size + pos % self.page_size
                    if verifying:  # the first round's columns; all reserved positions in order
                        slots[row, t - n_in:] = at[:n_in]
                        if rounds > 1:
                            reserve[row, :n] = at
                    else:
                        slots[row, slice(0, n) if multi else slice(t - n, t)] = at
                    seqlens[row] = end
                if r.num_sampled:
                    sampled.append((row, r.req_id, r.num_sampled))
                    params[row], states[row] = state.params, state
                    # outputs before this sample (the first of a verification): the key fold-in
                    steps[row] = r.first_sampled - len(state.prompt_token_ids)
                    dest[row] = rank * self.max_rows + i
                    feed[r.req_id] = int(dest[row])
                    stops = state.params.stop_tokens(self.eos_token_id)[:DEVICE_STOP_IDS]
                    stop_ids[row, : len(stops)] = stops
                elif out.speculative and not decode:  # a prefill chunk short of the end: its next token is known
                    next_ids[row] = (state.prompt_token_ids + state.output_token_ids)[end]
        self._feed, self._feed_speculative = feed, out.speculative
        words = None
        if allowed is not None:  # [rows, T or 1, W]: a verification row's columns decide its next tokens, each
            # with its mask; all-allowed rows where a row has none
            words = np.full((n_rows, t if verifying else 1, -(-self.vocab_size // 32)), -1, np.int32)
            for row, req_id, _ in sampled:
                mask = allowed.get(req_id)  # [1 + drafts, W]
                if mask is not None:
                    words[row, words.shape[1] - len(mask):] = mask if verifying else mask[:1]
        tensors = self._tensors(params, states, steps, words)
        arrays = [ids, src, positions, block_table, seqlens, slots, dest, stop_ids]
        if blocked:
            arrays.append(first_block)
        if out.speculative:
            arrays += [next_ids, follow, left, reserve] if rounds > 1 else [next_ids, follow, left]
        return StepInputs(arrays, tensors, sampled, verifying, blocked, rounds)

    def _follows(self, r: ScheduledRequest, state: RequestState) -> bool:
        """Whether the chunk of a speculative step follows its request's step in flight: that step was
        speculative and its tokens have not been fetched (the chunk's last token comes from the buffer)."""
        return (self._feed_speculative and r.req_id in self._feed
                and len(state.prompt_token_ids) + len(state.output_token_ids) <= r.start)

    def _input_ids(self, state: RequestState, r: ScheduledRequest, end: int, src: np.ndarray, row: int,
                   col: int) -> list[int]:
        """The chunk's input tokens [start, end), the last one at column ``col``. It may be the newest sample of
        the last dispatched step, not fetched yet: it is read from the token buffer on device (``src``)."""
        p = len(state.prompt_token_ids)
        known = p + len(state.output_token_ids)
        from_buffer = end > known and r.req_id in self._feed
        stop = end - 1 if from_buffer else end
        if r.start < stop and stop > known:
            raise RuntimeError(f"request {r.req_id}: tokens [{known}, {stop}) of its chunk are unknown to the runner")
        if r.start >= p:  # a decode step: O(end - start), not O(sequence length)
            chunk = state.output_token_ids[r.start - p:stop - p]
        else:
            chunk = (state.prompt_token_ids + state.output_token_ids)[r.start:stop]
        if from_buffer:
            src[row, col] = self._feed[r.req_id]
            chunk = chunk + [0]
        return chunk

    def _tensors(self, params: list[SamplingParams], states: list[RequestState | None], steps: np.ndarray,
                 words: np.ndarray | None) -> SamplingTensors:
        kwargs = {}
        if words is not None:
            kwargs["allowed_token_words"] = words.reshape(len(params), -1)  # [rows, columns x W]
        if any(p.uses_penalties for p in params):
            for state, step in zip(states, steps):
                if state is not None and state.params.uses_penalties and len(state.output_token_ids) != step:
                    raise RuntimeError(f"request {state.req_id} uses penalties: apply the previous step first")
            kwargs.update(output_token_counts=token_counts([s.output_token_ids if s else [] for s in states],
                                                           self.vocab_size),
                          prompt_token_mask=token_counts([s.prompt_token_ids if s else [] for s in states],
                                                         self.vocab_size) > 0)
        wants_logprobs = any(p.logprobs is not None for p in params)
        return SamplingTensors.build(params, self.vocab_size, steps=steps,
                                     request_ids=[s.req_id if s else 0 for s in states],
                                     child_indices=[s.child_index if s else 0 for s in states],
                                     engine_seed=self.engine_seed,
                                     max_logprobs=self.max_logprobs if wants_logprobs else None, **kwargs)
