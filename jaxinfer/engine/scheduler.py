"""Host-side scheduler: DP-rank assignment, prefill / decode steps, paged KV budget, preemption (pure Python).

Shape of a step (DeepSeek's two phases, vLLM v0 / nano-vllm's prefill-first policy): every step is either a PREFILL
step or a DECODE step over all DP ranks. ``schedule`` builds a prefill step whenever some rank has prefill work that
fits (a running sequence whose prefill is unfinished, or a waiting one that can be admitted), else a decode step.

- Ranks. ``add`` assigns each request a DP rank for its whole life with the decode load balancer: least KV pages
  in use (pages held by sequences, i.e. allocator ``num_used`` minus prefix-cache pages nobody else holds, plus the
  pages promised to the rank's waiting sequences), then fewest running + waiting requests, then lowest rank.
- Prefill (per rank, at most ``max_num_batched_tokens`` computed tokens): running sequences whose prefill is
  unfinished continue, oldest first; then waiting sequences are admitted FIFO while fewer than ``max_num_seqs`` run.
  At admission the prefix cache ``match``es the full pages of the tokens except that the last token is always
  computed (``(num_tokens - 1) // page_size`` hashes), and the pages of the whole prefill are allocated (chunks cut
  compute, not memory: see ``_admit``); a waiting sequence whose pages are not available blocks the queue (FIFO).
- Prefill shapes. A prefill step's rows are laid out as a [rows, T] grid per rank (runner.py) with T the
  power of two >= the longest chunk (at least ``min_prefill_t``) and rows the power of two >= the most chunks
  of a rank, within ``prefill_capacity`` (the power of two >= ``max_num_batched_tokens``) tokens per rank: so a
  prefill step has one of a few shapes (powers of two on both axes) and pads at most 2x per axis. Chunks are
  admitted (and cut) only while every rank's chunk count times T stays within that capacity (T and the count
  are shared by all ranks, since they run one program).
- Decode: each running sequence computes one token (its last sampled one) and samples the next; it takes a new page
  when its KV crosses a page boundary. With ``num_scheduler_steps`` = k > 1 (vLLM's multi-step scheduling) a
  decode step runs k iterations on device: a sequence's chunk covers its last token and the up to k - 1 tokens it
  samples in the step, so it computes ``num_tokens`` <= k positions and samples as many tokens, limited by
  ``max_tokens``, ``max_model_len`` and the pages it can get (a chunk with fewer tokens than k is masked in the
  later iterations). One dispatch, one transfer and one round of host bookkeeping then serve k tokens.
- Out of pages. A running sequence that cannot make progress preempts the newest running sequence (by arrival) of
  its rank, itself included: that one frees its pages and goes to the FRONT of the rank's waiting queue with
  ``num_computed_tokens = 0``, keeping its outputs (it recomputes prompt + outputs as its next prefill; with prefix
  caching its full pages are usually still cached). The oldest running sequence therefore always progresses. If it
  cannot even run alone (it needs more pages than the rank has) it finishes with reason "error" and a message.
  Admission never preempts, and an admitted prefill never needs pages, so only decode steps preempt. Requests are
  never dropped.
- Results come in two halves, so that the engine can schedule step n+1 while the device still runs step n
  (vLLM v1's async scheduling). ``commit(plan)`` right after the step is dispatched: advances
  ``num_computed_tokens`` and appends a ``PLACEHOLDER`` output token for every sampling chunk (the token exists,
  on device; the next step reads it from there), and applies the stop checks that need no token value:
  ``max_tokens`` outputs or ``max_model_len`` tokens -> "length". ``resolve(plan, sampled)`` when the tokens
  reach the host: fills the placeholders, applies EOS (unless ``ignore_eos``) / ``stop_token_ids`` -> "stop"
  (which wins over "length", vLLM's order) and drops any later placeholder of a stopped sequence, and registers
  pages that became full of real tokens in the prefix cache. ``update`` = commit + resolve (synchronous use).
  Stop strings need detokenization: the engine calls ``finish``. At most two steps' placeholders are outstanding
  per sequence (steps n and n+1); a sequence is complete when it is finished and holds none. A multi-step chunk
  commits one placeholder per token; tokens after a stop token are dropped (computed, never output).

Invariants kept for ``PrefixCache`` (see its module doc): pages only go through the cache's ``allocate`` / ``free``;
a chunk only writes positions ``>= num_computed_tokens``, which lie in pages that are neither cached nor shared
(cached pages are full and computed); only full computed pages are ``insert``-ed.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import numbers
from collections.abc import Mapping, Sequence as _Seq

from jaxinfer.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from jaxinfer.kv.page_allocator import PAGE_SIZE, PageAllocator
from jaxinfer.kv.prefix_cache import PrefixCache


MIN_PREFILL_T = 16  # default prefill columns at least: fewer shapes, and 16 tokens cost about what 1 does


def bucket(n: int, minimum: int = 1) -> int:
    """The next power of two >= max(n, minimum)."""
    return 1 << (max(n, minimum) - 1).bit_length()


@dataclasses.dataclass
class _PrefillShape:
    """The [rows, T] grid a prefill step has so far (shared by all ranks)."""

    capacity: int
    min_t: int
    rows: int = 0
    t: int = 0

    def fit(self, count: int, n: int) -> int:
        """Tokens (<= n) a rank's next chunk may have when the rank already has ``count`` chunks; 0 if none."""
        rows = max(self.rows, count + 1)
        room = 1 << ((self.capacity // rows).bit_length() - 1)  # largest power of two T with rows * T <= capacity
        if room < max(self.t, self.min_t):
            return 0
        return min(n, room)

    def add(self, count: int, n: int) -> None:
        self.rows = max(self.rows, count + 1)
        self.t = max(self.t, bucket(n, self.min_t))


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    """Compute the tokens at positions [start, start + num_tokens) of ``seq`` this step.

    ``sample``: this chunk reaches the sequence's last token, so its last logits are sampled (``update`` then needs
    a token for ``seq.seq_id``). The runner reads token ids (``seq.token_ids``), positions, slots (from
    ``seq.pages``) and the block table from the sequence. A decode chunk of a multi-step decode step may have
    ``num_tokens`` > 1: it computes the last token and then the tokens it samples itself, one per iteration, and
    samples ``num_tokens`` tokens.
    """

    seq: Sequence
    start: int
    num_tokens: int
    sample: bool


@dataclasses.dataclass
class StepPlan:
    """One step: ``kind`` "prefill" or "decode"; ``chunks[rank]`` the chunks of each DP rank (possibly empty).

    ``preempted``: sequences preempted while building the plan; ``finished``: sequences finished while building it
    (reason "error": they can never fit their rank's pages). Both are for the engine's bookkeeping only.
    """

    kind: str
    chunks: list[list[ScheduledChunk]]
    preempted: list[Sequence] = dataclasses.field(default_factory=list)
    finished: list[Sequence] = dataclasses.field(default_factory=list)
    pending: list[tuple[Sequence, int]] | None = None  # set by commit: (sequence, index of its placeholder)

    def num_tokens(self, rank: int) -> int:
        return sum(c.num_tokens for c in self.chunks[rank])

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(c.num_tokens for cs in self.chunks for c in cs)

    def all_chunks(self) -> list[ScheduledChunk]:
        return [c for cs in self.chunks for c in cs]

    def num_sampled(self, chunk: ScheduledChunk) -> int:
        """Tokens a sampling chunk of this plan samples: one per iteration for a decode chunk, else one."""
        return chunk.num_tokens if self.kind == "decode" else 1

    def placeholders(self):
        """(sequence, output index, j) for each placeholder of a committed plan, j counting the sequence's
        placeholders in this step (its j-th sampled token)."""
        nth = collections.Counter()
        for seq, index in self.pending:
            yield seq, index, nth[seq.seq_id]
            nth[seq.seq_id] += 1


@dataclasses.dataclass(frozen=True)
class RankStats:
    """Snapshot of one DP rank: pages (used = refcount >= 1; cached = registered in the prefix cache; evictable =
    held only by the cache; free = refcount 0) and queue lengths."""

    rank: int
    num_pages_used: int
    num_pages_cached: int
    num_pages_evictable: int
    num_pages_free: int
    num_running: int
    num_waiting: int


class Scheduler:
    """Continuous-batching scheduler over ``num_ranks`` DP ranks, each with its own paged KV pool and prefix cache.

    Args:
      num_ranks: DP ranks (>= 1).
      num_pages_per_rank: KV pages per rank, the null page included (``PageAllocator(num_pages)``).
      max_num_seqs: running sequences per rank at most.
      max_num_batched_tokens: tokens computed per rank per prefill step at most (chunked prefill).
      min_prefill_t: the fewest columns of a prefill step's grid (a power of two; see "Prefill shapes").
      max_model_len: prompt + output tokens at most; longer prompts finish at ``add`` with reason "error".
      enable_prefix_caching: ``match`` prompts at admission and ``insert`` full pages.
      page_size: tokens per page (64 = FlashMLA's block size).
      eos_token_id: None or the EOS id for the stop check.
      cache_key: ``extra_key`` of the page hashes (model identity).
      num_scheduler_steps: decode iterations per decode step (see "Decode" above).

    Raises ValueError (naming the value) for invalid arguments.
    """

    def __init__(self, num_ranks: int, num_pages_per_rank: int, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_prefix_caching: bool = True, page_size: int = PAGE_SIZE,
                 eos_token_id: int | None = None, cache_key=None, min_prefill_t: int = MIN_PREFILL_T,
                 num_scheduler_steps: int = 1):
        for name, value in [("num_ranks", num_ranks), ("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens), ("max_model_len", max_model_len),
                            ("page_size", page_size), ("num_scheduler_steps", num_scheduler_steps)]:
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if not isinstance(num_pages_per_rank, int) or num_pages_per_rank < 2:
            raise ValueError(f"{num_pages_per_rank=} must be an int >= 2 (page 0 is the reserved null page)")
        self.num_ranks = num_ranks
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.num_scheduler_steps = num_scheduler_steps
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.eos_token_id = eos_token_id
        self.cache_key = cache_key
        if not isinstance(min_prefill_t, int) or min_prefill_t < 1 or min_prefill_t & (min_prefill_t - 1):
            raise ValueError(f"{min_prefill_t=} must be a power of two >= 1")
        self.min_prefill_t = min_prefill_t
        self.prefill_capacity = bucket(max_num_batched_tokens, min_prefill_t)
        self.caches = [PrefixCache(PageAllocator(num_pages_per_rank), page_size) for _ in range(num_ranks)]
        self.waiting: list[collections.deque[Sequence]] = [collections.deque() for _ in range(num_ranks)]
        self.running: list[list[Sequence]] = [[] for _ in range(num_ranks)]   # sorted by arrival
        self._ids: set = set()                                                  # unfinished seq_ids
        self._next_arrival = 0

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Allocatable pages per rank."""
        return self.caches[0].allocator.capacity

    def has_unfinished(self) -> bool:
        return any(self.waiting) or any(self.running)

    def num_unfinished(self) -> int:
        return sum(map(len, self.waiting)) + sum(map(len, self.running))

    def stats(self, rank: int) -> RankStats:
        c = self.caches[rank]
        return RankStats(rank, c.allocator.num_used, c.num_cached, c.num_evictable, c.allocator.num_free,
                         len(self.running[rank]), len(self.waiting[rank]))

    def rank_load(self, rank: int) -> tuple[int, int, int]:
        """The load balancer's key: (pages held by sequences + pages promised to waiting ones, requests, rank)."""
        c = self.caches[rank]
        promised = sum(-(-s.num_tokens // self.page_size) for s in self.waiting[rank])
        held = c.allocator.num_used - c.num_evictable
        return held + promised, len(self.running[rank]) + len(self.waiting[rank]), rank

    # ---- requests ------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> Sequence:
        """Queues ``seq`` on the least-loaded rank (see ``rank_load``); returns it.

        A request that can never run (empty prompt, prompt longer than ``max_model_len``, or needing more pages
        than a rank has) is finished at once with reason "error" and a message; the caller checks
        ``seq.is_finished``. Raises ValueError for a sequence that is not fresh or a seq_id already in use.
        """
        if seq.status is not SequenceStatus.WAITING or seq.arrival is not None:
            raise ValueError(f"sequence {seq.seq_id} was already added ({seq.status.value})")
        if seq.seq_id in self._ids:
            raise ValueError(f"seq_id {seq.seq_id!r} is already in use by an unfinished sequence")
        seq.arrival = self._next_arrival
        self._next_arrival += 1
        seq.rank = min(range(self.num_ranks), key=self.rank_load)
        n = seq.num_prompt_tokens
        need = -(-n // self.page_size)
        if n == 0:
            self._set_finished(seq, "error", "empty prompt")
        elif n > self.max_model_len:
            self._set_finished(seq, "error", f"prompt of {n} tokens exceeds max_model_len={self.max_model_len}")
        elif need > self.capacity:
            self._set_finished(seq, "error", f"prompt of {n} tokens needs {need} KV pages of {self.page_size}, "
                                             f"a rank has {self.capacity}")
        else:
            self._ids.add(seq.seq_id)
            self.waiting[seq.rank].append(seq)
        return seq

    def finish(self, seq: Sequence, reason: str, error: str | None = None, *, keep_pending: bool = False) -> None:
        """Finishes an unfinished sequence now (stop strings, aborts): frees its pages, drops it from its queue and
        (unless ``keep_pending``) its trailing placeholder outputs: tokens of steps in flight are not output.

        Raises ValueError if ``seq`` is not an unfinished sequence of this scheduler.
        """
        if seq.is_finished or seq.seq_id not in self._ids:
            raise ValueError(f"sequence {seq.seq_id} is not an unfinished sequence of this scheduler")
        rank = seq.rank
        if seq.status is SequenceStatus.RUNNING:
            self.running[rank].remove(seq)
        else:
            self.waiting[rank].remove(seq)
        self._release(seq)
        self._ids.discard(seq.seq_id)
        self._set_finished(seq, reason, error)
        while not keep_pending and seq.output_token_ids and seq.output_token_ids[-1] == PLACEHOLDER:
            seq.output_token_ids.pop()                  # tokens of steps still in flight: not part of the output

    # ---- scheduling ----------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """The next step: a prefill step if any rank has prefill work that fits, else a decode step; None when
        nothing is left to do (no unfinished sequences)."""
        plan = StepPlan("prefill", [[] for _ in range(self.num_ranks)])
        shape = _PrefillShape(self.prefill_capacity, self.min_prefill_t)
        for rank in range(self.num_ranks):
            self._schedule_prefill(rank, plan, shape)
        if not plan.all_chunks():
            plan.kind = "decode"
            for rank in range(self.num_ranks):
                self._schedule_decode(rank, plan)
        if not plan.all_chunks() and not plan.finished:
            return None
        return plan

    def _schedule_prefill(self, rank: int, plan: StepPlan, shape: _PrefillShape) -> None:
        budget = self.max_num_batched_tokens
        out = plan.chunks[rank]
        for seq in list(self.running[rank]):        # unfinished prefills first, oldest first
            if budget == 0:
                break
            if not seq.is_prefilling:                  # decoding, or preempted / finished by an older one above
                continue
            n = shape.fit(len(out), min(budget, seq.num_prefill_tokens - seq.num_computed_tokens))
            if n == 0:
                break                                  # the step's grid is full
            n = self._grow(seq, n, plan)
            if n:
                shape.add(len(out), n)
                out.append(self._chunk(seq, n))
                budget -= n
        queue = self.waiting[rank]
        while queue and budget > 0 and len(self.running[rank]) < self.max_num_seqs:
            seq = queue[0]
            need = -(-seq.num_tokens // self.page_size)
            if need > self.capacity:                   # a preempted sequence one token past the rank's pages
                self.finish(seq, "error", f"sequence of {seq.num_tokens} tokens needs {need} KV pages of "
                                          f"{self.page_size}, rank {rank} has {self.capacity}")
                plan.finished.append(seq)
                continue
            room = shape.fit(len(out), budget)
            n = self._admit(seq, room) if room else 0
            if n == 0:
                break                                  # FIFO: the head blocks the queue until pages free up
            queue.popleft()
            bisect.insort(self.running[rank], seq, key=lambda s: s.arrival)
            shape.add(len(out), n)
            out.append(self._chunk(seq, n))
            budget -= n

    def _schedule_decode(self, rank: int, plan: StepPlan) -> None:
        out = plan.chunks[rank]
        for seq in list(self.running[rank]):
            if seq.status is not SequenceStatus.RUNNING or seq.is_prefilling:
                continue
            # Tokens it may still sample (>= 1: commit finishes a sequence that reaches either limit).
            left = min(self.num_scheduler_steps, seq.params.max_tokens - seq.num_output_tokens,
                       self.max_model_len - seq.num_tokens)
            n = self._grow(seq, max(left, 1), plan)
            if n:
                out.append(ScheduledChunk(seq, seq.num_computed_tokens, n, True))

    def _chunk(self, seq: Sequence, n: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        return ScheduledChunk(seq, start, n, start + n == seq.num_tokens)

    def _room(self, seq: Sequence) -> int:
        """Tokens ``seq`` could compute now: room in its pages plus every page the rank could allocate."""
        cache = self.caches[seq.rank]
        return (len(seq.pages) + cache.num_available) * self.page_size - seq.num_computed_tokens

    def _take_pages(self, seq: Sequence, n: int) -> None:
        """Allocates the pages positions [num_computed, num_computed + n) need beyond ``seq.pages``."""
        need = -(-(seq.num_computed_tokens + n) // self.page_size) - len(seq.pages)
        if need > 0:
            seq.pages.extend(self.caches[seq.rank].allocate(need))

    def _grow(self, seq: Sequence, n: int, plan: StepPlan) -> int:
        """Reserves pages for up to ``n`` more tokens of a running sequence, preempting the newest running
        sequences of its rank while it cannot take a single token. Returns the tokens granted (0 when ``seq`` itself
        was preempted or finished with "error")."""
        rank = seq.rank
        while True:
            room = self._room(seq)
            if room >= 1:
                n = min(n, room)
                self._take_pages(seq, n)
                return n
            if len(self.running[rank]) == 1:           # alone and still no room: it can never fit
                need = -(-(seq.num_computed_tokens + 1) // self.page_size)
                self.finish(seq, "error", f"sequence of {seq.num_tokens} tokens needs {need} KV pages of "
                                          f"{self.page_size} to continue, rank {rank} has {self.capacity}")
                plan.finished.append(seq)
                return 0
            victim = self.running[rank][-1]
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is seq:
                return 0

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Makes the waiting ``seq`` RUNNING with pages for its WHOLE prefill (all ``num_tokens`` positions) and
        returns its first chunk's tokens (up to ``budget``), or 0 (nothing changed) when those pages are not
        available. Reserving the whole prefill means a prefill never needs pages once admitted, so prefill steps
        never preempt; with per-chunk allocation, prefill-first steps can preempt and re-admit each other forever
        while the decoding sequences never get a step (found by the property test)."""
        cache = self.caches[seq.rank]
        stats = dataclasses.replace(cache.stats)
        cached = []
        if self.enable_prefix_caching:
            hashes = seq.page_hashes((seq.num_tokens - 1) // self.page_size, self.page_size, self.cache_key)
            cached = cache.match(hashes, num_tokens=seq.num_tokens)
        need = -(-seq.num_tokens // self.page_size) - len(cached)
        if need > cache.num_available:
            cache.free(cached)
            cache.stats = stats                        # an admission that did not happen is not a query
            return 0
        seq.pages = cached + cache.allocate(need)
        seq.num_computed_tokens = len(cached) * self.page_size
        seq.status = SequenceStatus.RUNNING
        seq.num_prefill_tokens = seq.num_tokens
        seq.num_registered_pages = len(cached)
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = len(cached) * self.page_size
        return min(budget, seq.num_tokens - seq.num_computed_tokens)

    def _preempt(self, seq: Sequence) -> None:
        self.running[seq.rank].remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_prefill_tokens = 0
        seq.num_preemptions += 1
        self.waiting[seq.rank].appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.pages:
            self.caches[seq.rank].free(seq.pages)
        seq.pages = []
        seq.num_registered_pages = 0

    def _set_finished(self, seq: Sequence, reason: str, error: str | None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error

    # ---- results ------------------------------------------------------------------------------------------
    def commit(self, plan: StepPlan) -> list[tuple[Sequence, int]]:
        """The step of ``plan`` is running: advances ``num_computed_tokens``, appends a PLACEHOLDER output for each
        token a sampling chunk samples (one; ``num_tokens`` for a decode chunk) and finishes sequences that reached
        ``max_tokens`` / ``max_model_len`` ("length"). Chunks of
        sequences finished since ``schedule`` are skipped. Returns (and stores in ``plan.pending``) the
        placeholders as (sequence, output index). Raises ValueError for a stale or already committed plan."""
        if plan.pending is not None:
            raise ValueError("plan already committed")
        pending = []
        for chunk in plan.all_chunks():
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if chunk.start != seq.num_computed_tokens:
                raise ValueError(f"stale plan: chunk of seq {seq.seq_id} starts at {chunk.start}, "
                                 f"but {seq.num_computed_tokens} tokens are computed")
            seq.num_computed_tokens += chunk.num_tokens
            self._register_full_pages(seq)
            if not chunk.sample:
                continue
            for _ in range(plan.num_sampled(chunk)):
                seq.output_token_ids.append(PLACEHOLDER)
                pending.append((seq, seq.num_output_tokens - 1))
            if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
                self.finish(seq, "length", keep_pending=True)  # resolve still fills its last tokens
        plan.pending = pending
        return pending

    def resolve(self, plan: StepPlan, sampled: Mapping[int, int | _Seq[int]]) -> list[Sequence]:
        """The tokens of a committed plan arrived: ``sampled[seq_id]``, the token of each placeholder (a list of
        them, in order, for a multi-token decode chunk; an int for one). Fills them, applies EOS /
        stop_token_ids ("stop") and registers full pages. Returns the sequences of the plan that are now
        complete (finished, no placeholder left), each once. Raises ValueError for an uncommitted plan or a
        missing token."""
        if plan.pending is None:
            raise ValueError("resolve needs a committed plan (commit it first)")
        done = []
        for seq, index, j in plan.placeholders():
            outputs = seq.output_token_ids
            if index >= len(outputs) or outputs[index] != PLACEHOLDER:
                continue                                   # dropped: the sequence stopped at an earlier token
            got = sampled.get(seq.seq_id, [])
            tokens = [got] if isinstance(got, numbers.Integral) else got
            if j >= len(tokens):
                raise ValueError(f"no sampled token {j} for seq {seq.seq_id} (its chunk ends at its last token)")
            token = int(tokens[j])
            outputs[index] = token
            if self._is_stop_token(seq, token):
                if seq.is_finished:                        # finished by length at commit: "stop" wins
                    del outputs[index + 1:]
                    seq.finish_reason = "stop"
                else:
                    self.finish(seq, "stop")
                    del outputs[index + 1:]
            elif seq.status is SequenceStatus.RUNNING:
                self._register_full_pages(seq)
            if seq.is_finished and PLACEHOLDER not in outputs[index:]:
                done.append(seq)
        return done

    def update(self, plan: StepPlan, sampled: Mapping[int, int]) -> list[Sequence]:
        """commit + resolve: applies a computed step whose tokens are known (synchronous use). Returns the
        sequences finished by it (the "length" ones included)."""
        self.commit(plan)
        return self.resolve(plan, sampled)

    def _register_full_pages(self, seq: Sequence) -> None:
        """Offers the pages that are full of computed, real (not placeholder) tokens to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        real = seq.num_tokens - seq.num_placeholders
        full = min(seq.num_computed_tokens, real) // self.page_size
        if full > seq.num_registered_pages:
            hashes = seq.page_hashes(full, self.page_size, self.cache_key)
            lo = seq.num_registered_pages
            self.caches[seq.rank].insert(hashes[lo:full], seq.pages[lo:full])
            seq.num_registered_pages = full

    def _is_stop_token(self, seq: Sequence, token: int) -> bool:
        return token in seq.params.stop_tokens(self.eos_token_id)
