"""Host-side scheduler: DP-rank assignment, prefill / decode steps, paged KV budget, preemption (pure Python).

``schedule()`` returns the next step as a frozen ``SchedulerOutput`` (scheduler_output.py) and commits it at once:
the step's requests advance ``num_computed_tokens`` and get a ``PLACEHOLDER`` output per token the step samples
(the token exists on device; the runner feeds it to the next step from there), so step n + 1 can be scheduled
before step n's tokens reach the host (vLLM v1's async scheduling). ``update_from_output(output, result)`` applies
the tokens when they arrive, rolling back the positions of rejected draft tokens. docs/architecture.md "The
engine step" follows one step through the scheduler, the runner and the engine.

Policies (DeepSeek's two phases; vLLM v0 / nano-vllm's prefill-first order): a step is a PREFILL step whenever some
rank has prefill work that fits, else a DECODE step over all ranks.

- Ranks. A sequence gets its DP rank for its whole life at the first ``schedule()`` after it was added, together
  with every sequence added since (engine/balance.py ``assign``: largest first, each on the rank it unbalances
  least): the load balancer evens prefill tokens and attention work, and requests and KV pages over the coming
  decode steps, weighted by the engine's ``role`` (a co-located engine: tokens, requests and pages; see
  balance.py ``WEIGHTS`` for why not attention), a prompt's tokens on each rank less those its prefix cache
  holds or its prefills are computing there (a conversation's next turn returns to its history's rank unless that
  rank is loaded out of proportion), and less those of a sequence placed with it on that rank whose prompt starts
  the same (the n samples of a prompt). Each rank queues its new sequences in arrival order; on a prefill engine
  (``role`` "prefill", whose balancer evens attention as well as tokens) longest first: placement evens each
  rank's totals, and in that order every rank computes its long prompts in the same steps and its short ones
  together later, where arrival order put one rank's long prompt, whose attention grows with its square, beside
  another rank's short ones; handed over in that order, the decode engine's balancer also places the largest
  first (docs/benchmarks.md "Load balance (CPU)": shortest first evened the prefill steps as well, the decode
  engine's KV pages worse, for a lower median time to first token). Where the prefill steps are balanced (see
  "Prefill balance") a co-located engine queues them shortest first: short prompts finish in the first steps
  while the long ones' chunks spread over the steps under the attention cap.
- Prefill (per rank, at most ``max_num_batched_tokens`` computed tokens): running sequences whose prefill is
  unfinished continue, oldest first; then waiting sequences are admitted in queue order (FIFO but for the
  "Ranks" order of sequences placed together and the skips of "Prefill balance") while fewer than ``max_num_seqs``
  run. At admission the prefix cache ``match``es the full pages of the tokens but the last (always computed:
  ``(num_tokens - 1) // page_size`` hashes) and the pages of the whole prefill are allocated, so an admitted
  prefill never needs pages and prefill steps never preempt; a waiting sequence whose pages are not available
  blocks the queue (FIFO). A waiting sequence whose first page the cache lacks is one an unfinished prefill of
  its rank is computing (a sibling sample, a shared system prompt) waits, and the sequences behind it go first:
  the page is registered when the step computing it is committed, so a later step matches it instead of
  computing it again (SGLang's in-batch prefix caching deprioritizes such requests the same way).
- Prefill balance (several ranks, prefill in query blocks; engine/prefill_plan.py). Where the ranks' prefill work
  spans several steps, a step's chunks are cut where a rank's attention (new x total tokens), tokens or blocks
  would pass limits common to all ranks: the least attention and tokens with which every rank still finishes in
  the steps and padded shapes the work needs taken as it comes, and the step's shape as planned (planned over the
  sequences within ``PLAN_STEPS`` steps of work, in queue order). A cut chunk is whole blocks; the rank then takes
  later sequences whose chunks fit, skipping those that do not.
- Prefill shapes. The runner lays a prefill step out as a [rows, T] grid per rank, T the power of two >= the
  longest chunk (at least ``min_prefill_t``), rows the power of two >= the most chunks of a rank, within
  ``prefill_capacity`` (the power of two >= ``max_num_batched_tokens``) tokens per rank: a prefill step has one of
  a few shapes and pads at most 2x per axis. Chunks are admitted (and cut) only while every rank's chunk count
  times T stays within that capacity (all ranks run one program). With ``prefill_block`` = Q the runner lays it
  out in query blocks instead: a chunk of n tokens takes ceil(n / Q) rows of Q columns
  (kernels_pallas/mla/query_blocks.py), and chunks are admitted (and cut to whole blocks) while a rank's blocks
  fit in ``prefill_capacity`` // Q: the step's shape is then its block count alone.
- Decode: each running sequence computes its last token and samples the next; with ``num_scheduler_steps`` = k
  (vLLM's multi-step scheduling) a decode chunk covers its last token and up to k - 1 tokens it samples itself
  (``num_tokens`` <= k positions and samples), within ``max_tokens``, ``max_model_len`` and the pages it can get.
  A sequence with draft tokens (``RunnerOutput.draft_token_ids``) instead verifies them: its chunk covers its last
  token and the drafts, and it samples up to 1 + drafts tokens. With ``speculative`` (the runner drafts) a
  decode step is a draft-verify round (``SchedulerOutput.speculative``): a sequence without drafts computes
  one token and gets drafts. With k > 1 the step runs up to k rounds on device (``SchedulerOutput.rounds``,
  step_program.py ``verify_rounds``; one program per shape, whatever the chunks reserve): a chunk then reserves
  the positions of its first round (its last token and drafts) and of k - 1 rounds of T columns
  (``SchedulerOutput.verify_columns``: 1 + the drafts a round verifies), within what it may still sample, and the
  update rolls back the positions the rounds did not accept. A constrained sequence reserves one round (its
  masks are the host's). With ``verify="confidence"`` every sequence verifies the number of drafts worth the
  step's cost (engine/speculative.py ``verify_width``, over all ranks; a sequence without drafts counts with the
  mean confidences of recent drafts); when that number is 0 the step is a plain multi-step decode step instead
  (no drafting, drafts dropped): the rule's cost model (``step_cost``, engine/speculative.py ``STEP_COSTS``)
  found that a round costs more than the tokens it returns. After ``PROBE_AFTER_PLAIN_STEPS`` plain steps in a
  row, where one round of perfect drafts would pay, one round verifying one draft refreshes every sequence's
  drafts (a stale estimate is never final; a probe runs one round, not k).
- Speculative steps in flight (async scheduling). A sequence whose speculative step is in flight is scheduled
  again before that step is applied (verify="confidence" weighs its drafts, not known yet, with the mean
  confidence of recent drafts, as a sequence without drafts; a plain step waits for it): its chunk verifies
  the drafts that step proposes on
  device (``PLACEHOLDER`` drafts) at the positions it would have if that step computed all it reserved, within
  the tokens it may still sample counted so (at least one position). The device lays the chunk out again as
  this scheduler would have with the step applied (step_program.py ``follow_in_flight``): it starts as many
  positions earlier as that step left unused, and may sample as many more tokens (its pages cover them). The
  update places the chunk's outputs that many positions earlier (``Sequence.rollbacks_at_commit``) and takes
  up to that many more tokens; "length" is decided at each update on the known outputs.
- Known tokens. Outputs the host appends without sampling (structured output's forced tokens, ``append_outputs``)
  are computed by the sequence's next step as one chunk, which then samples the token after them (a decode
  sequence's chunk covers its last token and the appended ones; a waiting sequence computes them in its prefill).
  A decode step with such chunks lays every row out in T columns (the chunks right aligned, as in prefill; T is
  buckets.py ``known_columns``: ``MAX_KNOWN_COLUMNS`` whatever the longest run, fewer only where the rows would
  exceed ``prefill_capacity`` per rank), and every row samples at most one token in it: no multi-step iterations.
  Not with ``speculative`` (a round verifies drafts).
- Constrained sequences (structured output) sample one token per step (their mask needs the previous token) and
  are not scheduled while a step of theirs is in flight (``num_placeholders``), so the engine schedules the next
  step before applying one that carries them. Where a rank has ``SPLIT_CONSTRAINED_ROWS`` or more of them and none
  in flight, a step takes the first half: the two halves then alternate, one computed on the device while the
  host applies the other's tokens and builds its masks.
- Storage tier (``storage``: kv/page_store.py, EngineConfig.kv_cache_dir). At admission, after the device prefix
  cache's hits, the pages the tier holds for the next hashes are read (verified) up to the first it does not have;
  they take the first of the sequence's new pages, are registered in the prefix cache at once and counted as
  cached, and ride in the step's ``page_loads`` (the runner writes them into the cache before the step). Pages
  registered as computed are queued for the tier (``take_stores``; the engine has the runner copy them).
- Hand-over (prefill/decode disaggregation, engine/disaggregated.py). A "prefill" scheduler plans prefill steps
  only: a sequence whose prefill is done stays RUNNING, holding its pages, until its engine hands it over (the
  engine finishes it here once its latents are gathered). A "decode" scheduler takes such sequences with
  ``add_prefilled``: they get ranks as added sequences do (see "Ranks"); each rank admits them FIFO, ahead of
  its waiting queue, once it has the pages of their latents and room to run them; admitted, a sequence is
  RUNNING and decoding (its KV is in place), and its latents ride in the step's ``kv_transfers`` with those
  pages.
- Out of pages. A running sequence that cannot make progress preempts the newest running sequence (by arrival) of
  its rank, itself included: the victim frees its pages and goes to the FRONT of the rank's waiting queue with
  ``num_computed_tokens = 0``, keeping its outputs (it recomputes prompt + outputs as its next prefill; with
  prefix caching its full pages usually stay cached). The oldest running sequence therefore always progresses;
  if it cannot run even alone it finishes with reason "error". Requests are never dropped.
- Stops. At commit: ``max_tokens`` outputs or ``max_model_len`` tokens -> "length" (for a draft verification:
  at update, once the accepted count is known). At update: EOS (unless ``ignore_eos``) / ``stop_token_ids`` ->
  "stop", which wins over "length" (vLLM's order); outputs after a stop token are dropped. Stop strings need
  detokenization: the engine calls ``finish``.

Invariants kept for ``PrefixCache`` (see its module doc): pages only go through the cache's ``allocate`` / ``free``;
a step only writes positions ``>= num_computed_tokens``, which lie in pages that are neither cached nor shared
(cached pages are full and computed); only full pages of computed, known tokens are ``insert``-ed.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses

from jaxinfer.engine.balance import ROLES, WEIGHTS, Demand, assign
from jaxinfer.engine.buckets import MIN_PREFILL_T, bucket, known_columns
from jaxinfer.engine.prefill_plan import PLAN_STEPS, StepLimits, step_limits, take
from jaxinfer.engine.scheduler_output import (NewRequest, RunnerOutput, ScheduledRequest, SchedulerOutput,
                                              StepKind)
from jaxinfer.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from jaxinfer.engine.speculative import PROBE_AFTER_PLAIN_STEPS, STEP_COSTS, StepCost, verify_width
from jaxinfer.kv.page_allocator import PAGE_SIZE, PageAllocator
from jaxinfer.kv.page_store import PageStore, page_key
from jaxinfer.kv.prefix_cache import PrefixCache

# A rank with at least this many constrained decoding sequences, none of them in a step in flight, schedules the
# first half of them; the other half go in the next step, scheduled while this one runs (see "Constrained
# sequences"). Below it a step of half the rows costs about as much as one of all of them on CPU (docs/benchmarks.md
# "Structured output (CPU)"); unmeasured on GPU.
SPLIT_CONSTRAINED_ROWS = 16


@dataclasses.dataclass
class _PrefillShape:
    """The [rows, T] grid a prefill step has so far (shared by all ranks)."""

    capacity: int
    min_t: int
    rows: int = 0
    t: int = 0

    def fit(self, out: list[_Chunk], n: int) -> int:
        """Tokens (<= n) a rank's next chunk may have when the rank already has the chunks ``out``; 0 if none."""
        rows = max(self.rows, len(out) + 1)
        room = 1 << ((self.capacity // rows).bit_length() - 1)  # largest power of two T with rows * T <= capacity
        if room < max(self.t, self.min_t):
            return 0
        return min(n, room)

    def add(self, out: list[_Chunk], n: int) -> None:
        self.rows = max(self.rows, len(out) + 1)
        self.t = max(self.t, bucket(n, self.min_t))


@dataclasses.dataclass
class _PrefillBlocks:
    """The query blocks of a prefill step in the block layout: a chunk of n tokens takes ceil(n / q) rows of q
    columns, and a rank at most capacity // q of them (the ranks' counts are independent: the step's row count is
    the power of two >= the most any rank has)."""

    capacity: int
    q: int

    def fit(self, out: list[_Chunk], n: int) -> int:
        room = self.capacity // self.q - sum(-(-c.num_tokens // self.q) for c in out)  # blocks left on the rank
        return min(n, room * self.q) if room > 0 else 0

    def add(self, out: list[_Chunk], n: int) -> None:
        pass  # fit counts the rank's chunks


@dataclasses.dataclass
class _Chunk:
    """A chunk while its step is being built (``SchedulerOutput`` holds the frozen ``ScheduledRequest``)."""

    seq: Sequence
    num_tokens: int
    num_sampled: int
    drafts: tuple[int, ...] = ()
    rounds: bool = False  # reserves later draft-verify rounds (see "Decode")


@dataclasses.dataclass
class _Plan:
    kind: StepKind
    chunks: list[list[_Chunk]]
    preempted: list[Sequence] = dataclasses.field(default_factory=list)
    speculative: bool = False
    verify_columns: int = 0  # T of a verification step: 1 + the drafts a round verifies (see "Decode")
    rounds: int = 1  # draft-verify rounds of a verification step at most

    def empty(self) -> bool:
        return not any(self.chunks)


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


@dataclasses.dataclass(frozen=True)
class TokenUpdate:
    """What ``update_from_output`` did to one sequence: outputs [first, first + num) got their values; it verified
    ``num_drafts`` drafts and accepted ``num_accepted`` of them (speculative decoding), per round ``rounds``
    ((drafts, accepted) of each draft-verify round)."""

    seq: Sequence
    first: int
    num: int
    num_drafts: int = 0
    num_accepted: int = 0
    rounds: tuple[tuple[int, int], ...] = ()


class Scheduler:
    """Continuous-batching scheduler over ``num_ranks`` DP ranks, each with its own paged KV pool and prefix cache.

    Args:
      num_ranks: DP ranks (>= 1).
      num_pages_per_rank: KV pages per rank, the null page included (``PageAllocator(num_pages)``).
      max_num_seqs: running sequences per rank at most.
      max_num_batched_tokens: tokens computed per rank per prefill step at most (chunked prefill).
      max_model_len: prompt + output tokens at most; longer prompts finish at ``add`` with reason "error".
      enable_prefix_caching: ``match`` prompts at admission and ``insert`` full pages.
      page_size: tokens per page (64 = FlashMLA's block size).
      eos_token_id: None or the EOS id for the stop check.
      cache_key: ``extra_key`` of the page hashes (model identity).
      min_prefill_t: the fewest columns of a prefill step's grid (a power of two; see "Prefill shapes").
      prefill_block: None (prefill steps are [rows, T] grids), or Q: prefill steps are laid out in query blocks of
        Q columns (a power of two; see "Prefill shapes").
      num_scheduler_steps: decode iterations per decode step (see "Decode").
      speculative: the runner drafts (speculative decoding): decode steps are draft-verify rounds (see "Decode").
      confidence_verify: verify only as many drafts as are worth the step's cost (DSpark; see "Decode").
      num_drafts: K, the drafts the runner proposes per sequence (speculative decoding).
      step_cost: the confidence rule's cost model (engine/speculative.py StepCost; default: the CPU's).
      storage: the KV storage tier (kv/page_store.py PageStore) or None; see "Storage tier".
      role: the engine's role: "colocated", or a side of prefill/decode disaggregation: "prefill" (no decode
        steps; a sequence whose prefill is done waits until the engine hands it over, see "Hand-over") or
        "decode". It also weighs the load balancer's objectives (engine/balance.py WEIGHTS).

    Raises ValueError (naming the value) for invalid arguments.
    """

    def __init__(self, num_ranks: int, num_pages_per_rank: int, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_prefix_caching: bool = True, page_size: int = PAGE_SIZE,
                 eos_token_id: int | None = None, cache_key=None, min_prefill_t: int = MIN_PREFILL_T,
                 num_scheduler_steps: int = 1, speculative: bool = False, confidence_verify: bool = False,
                 num_drafts: int = 0, step_cost: StepCost | None = None, prefill_block: int | None = None,
                 storage: PageStore | None = None, role: str = "colocated"):
        for name, value in [("num_ranks", num_ranks), ("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens), ("max_model_len", max_model_len),
                            ("page_size", page_size), ("num_scheduler_steps", num_scheduler_steps)]:
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if not isinstance(num_pages_per_rank, int) or num_pages_per_rank < 2:
            raise ValueError(f"{num_pages_per_rank=} must be an int >= 2 (page 0 is the reserved null page)")
        if not isinstance(min_prefill_t, int) or min_prefill_t < 1 or min_prefill_t & (min_prefill_t - 1):
            raise ValueError(f"{min_prefill_t=} must be a power of two >= 1")
        if prefill_block is not None and (isinstance(prefill_block, bool) or not isinstance(prefill_block, int)
                                          or prefill_block < 1 or prefill_block & (prefill_block - 1)):
            raise ValueError(f"{prefill_block=} must be None or a power of two >= 1")
        self.num_ranks = num_ranks
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.num_scheduler_steps = num_scheduler_steps
        self.speculative = bool(speculative)
        self.confidence_verify = bool(confidence_verify)
        self.num_drafts = num_drafts
        self.step_cost = step_cost or STEP_COSTS["cpu"]
        self._confidence: list[float] = []  # per draft position: moving mean of recent drafts' probabilities
        self._plain_steps = 0               # consecutive plain decode steps chosen by the confidence rule
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.eos_token_id = eos_token_id
        self.cache_key = cache_key
        self.min_prefill_t = min_prefill_t
        self.prefill_block = prefill_block
        self.prefill_capacity = bucket(max_num_batched_tokens, max(min_prefill_t, prefill_block or 1))
        self.caches = [PrefixCache(PageAllocator(num_pages_per_rank), page_size) for _ in range(num_ranks)]
        self.waiting: list[collections.deque[Sequence]] = [collections.deque() for _ in range(num_ranks)]
        self.running: list[list[Sequence]] = [[] for _ in range(num_ranks)]   # sorted by arrival
        self._seqs: dict[int, Sequence] = {}   # added sequences until finished and holding no placeholder
        self._finished_ids: list[int] = []     # finished since the last SchedulerOutput
        self._next_arrival = 0
        self.storage = storage
        self.storage_hit_tokens = 0            # prompt tokens read from the storage tier at admissions
        self._loads: list[list[tuple[int, object]]] = [[] for _ in range(num_ranks)]  # for the next output
        self._stores: list[tuple[int, int, int]] = []  # (rank, page, hash) registered since take_stores()
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role = role
        # Sequences added since the last schedule(), without a rank yet: (seq, latents, tokens they cover), the
        # last None for a sequence to prefill (``add``), see "Ranks".
        self._arrivals: list[tuple[Sequence, object, int | None]] = []
        self.step_load: list[tuple[int, int]] = []  # per rank (held pages, running requests) of the last step
        # Handed-over sequences waiting for their pages (see "Hand-over"): (seq, latents, tokens they cover).
        self._transfers: list[collections.deque[tuple[Sequence, object, int]]] = [
            collections.deque() for _ in range(num_ranks)]
        self._kv_in: list[tuple[int, tuple[int, ...], object]] = []  # for the next output: (rank, pages, latents)

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Allocatable pages per rank."""
        return self.caches[0].allocator.capacity

    def has_unfinished(self) -> bool:
        return bool(self._arrivals) or any(self.waiting) or any(self.running) or any(self._transfers)

    def num_unfinished(self) -> int:
        return (len(self._arrivals) + sum(map(len, self.waiting)) + sum(map(len, self.running))
                + sum(map(len, self._transfers)))

    def stats(self, rank: int) -> RankStats:
        c = self.caches[rank]
        return RankStats(rank, c.allocator.num_used, c.num_cached, c.num_evictable, c.allocator.num_free,
                         len(self.running[rank]), len(self.waiting[rank]))

    def held_pages(self, rank: int) -> int:
        """Pages of ``rank`` held by sequences (allocator ``num_used`` minus prefix-cache pages nobody else holds)."""
        c = self.caches[rank]
        return c.allocator.num_used - c.num_evictable

    # ---- requests ------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> Sequence:
        """Queues ``seq``; the next ``schedule()`` gives it a rank (see "Ranks"). Returns it.

        A request that can never run (empty prompt, prompt longer than ``max_model_len``, or needing more pages
        than a rank has) is finished at once with reason "error" and a message; the caller checks
        ``seq.is_finished``. Raises ValueError for a sequence that is not fresh or a seq_id already in use.
        """
        return self._arrive(seq, seq.num_prompt_tokens, "prompt")

    def _arrive(self, seq: Sequence, n: int, what: str, latents=None, num_kv_tokens: int | None = None
                ) -> Sequence:
        """Gives a fresh sequence its arrival order and queues it for a rank (``_arrivals``), or finishes it with
        "error" when needing ``n`` tokens' pages it can never run (on any rank: they have the same pages)."""
        error = self._arrival_error(seq, n, what)
        if error is not None:
            self._set_finished(seq, "error", error)
        else:
            self._seqs[seq.seq_id] = seq
            self._arrivals.append((seq, latents, num_kv_tokens))
        return seq

    def _arrival_error(self, seq: Sequence, n: int, what: str) -> str | None:
        if seq.status is not SequenceStatus.WAITING or seq.arrival is not None:
            raise ValueError(f"sequence {seq.seq_id} was already added ({seq.status.value})")
        if seq.seq_id in self._seqs:
            raise ValueError(f"seq_id {seq.seq_id!r} is already in use by an unfinished sequence")
        seq.arrival = self._next_arrival
        self._next_arrival += 1
        need = -(-n // self.page_size)
        if n == 0:
            return f"empty {what}"
        if seq.num_tokens > self.max_model_len:
            return f"{what} of {seq.num_tokens} tokens exceeds max_model_len={self.max_model_len}"
        if need > self.capacity:
            return f"{what} of {n} tokens needs {need} KV pages of {self.page_size}, a rank has {self.capacity}"
        return None

    def _place_arrivals(self) -> None:
        """Gives the sequences added since the last step their ranks, all at once (engine/balance.py ``assign``,
        weighted by the engine's role), and queues them there (in arrival order, or by length: see "Ranks")."""
        if not self._arrivals:
            return
        arrivals, self._arrivals = self._arrivals, []
        ranks = [0] * len(arrivals)
        if self.num_ranks > 1:
            current = [[self._demand(s) for s in (*self.running[r], *self.waiting[r])]
                       + [self._demand(s, n) for s, _, n in self._transfers[r]] for r in range(self.num_ranks)]
            pending = [self._pending_hashes(r) for r in range(self.num_ranks)]
            cached = [self._cached_tokens(s, pending) if n is None else [0] * self.num_ranks for s, _, n in arrivals]
            prefixes = [self._prompt_hashes(s) if n is None and self.enable_prefix_caching else []
                        for s, _, n in arrivals]
            ranks = assign(current, [self._demand(s, n) for s, _, n in arrivals], self.page_size, self.role, cached,
                           prefixes)
        order = range(len(arrivals))
        if WEIGHTS[self.role][1]:  # a prefill engine: longest first (see "Ranks")
            order = sorted(order, key=lambda i: -arrivals[i][0].num_tokens)
        elif self.num_ranks > 1 and self.prefill_block:  # shortest first (see "Prefill balance")
            order = sorted(order, key=lambda i: arrivals[i][0].num_tokens)
        for i in order:
            (seq, latents, n), rank = arrivals[i], ranks[i]
            seq.rank = rank
            if n is None:
                self.waiting[rank].append(seq)
            else:
                self._transfers[rank].append((seq, latents, n))

    def _cached_tokens(self, seq: Sequence, pending: list[set[int]]) -> list[int]:
        """Per rank, the leading tokens of ``seq`` its prefix cache holds now or its unfinished prefills are
        computing (``pending``: ``_pending_hashes`` of each rank), what admission there would match at once or
        after waiting (see "Prefill"); the balancer weighs them (see "Ranks")."""
        if not self.enable_prefix_caching:
            return [0] * self.num_ranks
        hashes = self._prompt_hashes(seq)
        held = []
        for cache, computing in zip(self.caches, pending):
            k = cache.lookup(hashes)
            while k < len(hashes) and hashes[k] in computing:
                k += 1
            held.append(k * self.page_size)
        return held

    def _prompt_hashes(self, seq: Sequence) -> list[int]:
        """The hashes of ``seq``'s full pages but the one holding its last token (always computed): what the
        prefix cache can hold of it."""
        return seq.page_hashes((seq.num_tokens - 1) // self.page_size, self.page_size, self.cache_key)

    def _demand(self, seq: Sequence, num_kv_tokens: int | None = None) -> Demand:
        """What ``seq`` asks of its rank (engine/balance.py): a handed-over sequence (``num_kv_tokens`` given)
        computes no prefill; a waiting one its tokens; a running one the rest of its prefill."""
        if num_kv_tokens is not None:
            todo, total = 0, seq.num_tokens
        elif seq.status is SequenceStatus.RUNNING:
            todo, total = max(seq.num_prefill_tokens - seq.num_computed_tokens, 0), seq.num_prefill_tokens
        else:
            todo, total = seq.num_tokens, seq.num_tokens
        left = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
        return Demand(todo, todo * total, seq.num_tokens, left, 1 if self.speculative else self.num_scheduler_steps)

    def add_prefilled(self, seq: Sequence, latents, num_kv_tokens: int) -> Sequence:
        """Queues a sequence prefilled elsewhere (a prefill engine's hand-over): ``latents`` (opaque here; the
        runner writes them into the pages this scheduler gives it) hold positions [0, num_kv_tokens) of its
        tokens, and its outputs (at least one, all known) follow. The next ``schedule()`` gives it a rank, and it
        runs as a decoding sequence once its rank has the pages (see "Hand-over"). A sequence that can never fit
        is finished with "error" (the caller checks ``seq.is_finished``).

        Raises ValueError for a sequence that is not fresh, a seq_id in use, no outputs, unknown outputs, or a
        num_kv_tokens that is not in [1, num_tokens)."""
        if not seq.output_token_ids or PLACEHOLDER in seq.output_token_ids:
            raise ValueError(f"a prefilled sequence needs its outputs known, seq {seq.seq_id} has "
                             f"{seq.output_token_ids}")
        if not 1 <= num_kv_tokens < seq.num_tokens:
            raise ValueError(f"{num_kv_tokens=} must be in [1, {seq.num_tokens}) for seq {seq.seq_id}")
        return self._arrive(seq, num_kv_tokens, "prefilled sequence", latents, num_kv_tokens)

    def _admit_transfers(self, rank: int, admitted: list[Sequence]) -> None:
        """Admits the rank's handed-over sequences, FIFO, while it has their pages and room to run them."""
        queue, cache = self._transfers[rank], self.caches[rank]
        while queue and len(self.running[rank]) < self.max_num_seqs:
            seq, latents, n = queue[0]
            need = -(-n // self.page_size)
            if need > cache.num_available:
                break
            queue.popleft()
            seq.pages = cache.allocate(need)
            seq.num_computed_tokens = seq.num_prefill_tokens = n
            seq.num_pages_sent = seq.num_registered_pages = 0
            seq.unsent_token_ids = []
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running[rank], seq, key=lambda s: s.arrival)
            admitted.append(seq)
            self._kv_in.append((rank, tuple(seq.pages), latents))

    def finish(self, seq: Sequence, reason: str, error: str | None = None, *, keep_pending: bool = False) -> None:
        """Finishes an unfinished sequence now (stop strings, aborts): frees its pages, drops it from its queue and
        (unless ``keep_pending``) its trailing placeholder outputs: tokens of steps in flight are not output.

        Raises ValueError if ``seq`` is not an unfinished sequence of this scheduler.
        """
        if seq.is_finished or self._seqs.get(seq.seq_id) is not seq:
            raise ValueError(f"sequence {seq.seq_id} is not an unfinished sequence of this scheduler")
        rank = seq.rank
        if rank is None:  # no rank yet
            self._arrivals = [a for a in self._arrivals if a[0] is not seq]
        elif seq.status is SequenceStatus.RUNNING:
            self.running[rank].remove(seq)
        elif seq in self.waiting[rank]:
            self.waiting[rank].remove(seq)
        else:  # handed over, waiting for its pages
            self._transfers[rank] = collections.deque(t for t in self._transfers[rank] if t[0] is not seq)
        self._release(seq)
        self._set_finished(seq, reason, error)
        if not keep_pending:
            del seq.output_token_ids[seq.num_output_tokens - seq.num_placeholders:]  # tokens of steps in flight
        self._drop_if_complete(seq)

    def append_outputs(self, seq: Sequence, token_ids: list[int]) -> int:
        """Appends outputs the host knows without sampling (structured output's forced tokens) to an unfinished
        sequence whose outputs are all known; its next step computes them before it samples (see "Known tokens").
        Tokens past ``max_tokens`` or ``max_model_len`` are not appended, and a sequence that reaches either
        finishes with "length"; a stop token (EOS, ``stop_token_ids``) is appended and finishes it with "stop", as
        a sampled one would. Returns the number appended.

        Raises ValueError for a sequence that is not an unfinished one of this scheduler, one with outputs of a
        step in flight (placeholders), or a speculative scheduler (its rounds verify drafts, not known tokens)."""
        if seq.is_finished or self._seqs.get(seq.seq_id) is not seq:
            raise ValueError(f"sequence {seq.seq_id} is not an unfinished sequence of this scheduler")
        if seq.num_placeholders:
            raise ValueError(f"sequence {seq.seq_id} has {seq.num_placeholders} outputs of a step in flight")
        if self.speculative:
            raise ValueError("a speculative scheduler does not take appended outputs")
        room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
        tokens = [int(t) for t in token_ids[:max(room, 0)]]
        stops = seq.params.stop_tokens(self.eos_token_id)
        stop = next((j for j, t in enumerate(tokens) if t in stops), None)
        if stop is not None:
            tokens = tokens[:stop + 1]
        seq.output_token_ids.extend(tokens)
        if seq.status is SequenceStatus.RUNNING:
            seq.unsent_token_ids.extend(tokens)
        if stop is not None:
            self.finish(seq, "stop")
        elif self._at_length_limit(seq):
            self.finish(seq, "length")
        return len(tokens)

    # ---- scheduling ----------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput | None:
        """The next step, committed (see the module doc): a prefill step if any rank has prefill work that fits,
        else a decode step. None when there is nothing to do or report."""
        plan = _Plan(StepKind.PREFILL, [[] for _ in range(self.num_ranks)], speculative=self.speculative)
        shape = (_PrefillBlocks(self.prefill_capacity, self.prefill_block) if self.prefill_block
                 else _PrefillShape(self.prefill_capacity, self.min_prefill_t))
        admitted: list[Sequence] = []
        self._place_arrivals()
        limits = self._prefill_limits()
        if limits is not None:                         # each rank's blocks within the step's shape as planned
            shape.capacity = min(shape.capacity, limits.blocks * self.prefill_block)
        for rank in range(self.num_ranks):
            self._admit_transfers(rank, admitted)
            self._schedule_prefill(rank, plan, shape, admitted, limits)
        if plan.empty() and self.role != "prefill":
            plan.kind = StepKind.DECODE
            width, probe = self._verify_width()
            plan.speculative = self.speculative and width != 0
            if plan.speculative:  # a round's columns; several rounds on device (see "Decode")
                plan.verify_columns = 1 + (self.num_drafts if width is None else width)
                plan.rounds = self.num_scheduler_steps if self.num_scheduler_steps > 1 and not probe else 1
            columns = self._known_columns()
            for rank in range(self.num_ranks):
                self._schedule_decode(rank, plan, width, columns)
        if plan.empty() and not self._finished_ids and not plan.preempted:
            return None
        return self._commit(plan, admitted)

    def _prefill_limits(self) -> StepLimits | None:
        """The limits of each rank's next prefill step, or None (see "Prefill balance")."""
        if self.num_ranks == 1 or not self.prefill_block:
            return None
        horizon = self.max_num_batched_tokens * PLAN_STEPS
        work = []
        for rank in range(self.num_ranks):
            items = [(s.num_computed_tokens, s.num_prefill_tokens - s.num_computed_tokens)
                     for s in self.running[rank] if s.is_prefilling]
            total = sum(m for _, m in items)
            for seq in self.waiting[rank]:             # those within the plan's horizon
                if total >= horizon:
                    break
                hit = self._held_tokens(seq, rank)
                items.append((hit, seq.num_tokens - hit))
                total += seq.num_tokens - hit
            work.append(items)
        return step_limits(work, self.max_num_batched_tokens, self.prefill_block,
                           self.prefill_capacity // self.prefill_block)

    def _held_tokens(self, seq: Sequence, rank: int) -> int:
        """The leading prompt tokens of the waiting ``seq`` that ``rank``'s prefix cache holds now (a lookup: no
        references, no stats), what its admission would not compute (the storage tier's pages, read at admission,
        are not counted)."""
        if not self.enable_prefix_caching:
            return 0
        return self.caches[rank].lookup(self._prompt_hashes(seq)) * self.page_size

    def _schedule_prefill(self, rank: int, plan: _Plan, shape: _PrefillShape | _PrefillBlocks,
                          admitted: list[Sequence], limits: StepLimits | None = None) -> None:
        budget, cap = self.max_num_batched_tokens, None
        if limits is not None:
            budget, cap = min(budget, limits.tokens), limits.attention
        block = self.prefill_block
        out = plan.chunks[rank]
        for seq in list(self.running[rank]):        # unfinished prefills first, oldest first
            if budget == 0:
                break
            if not seq.is_prefilling:                  # decoding, or preempted / finished by an older one above
                continue
            n = shape.fit(out, min(budget, seq.num_prefill_tokens - seq.num_computed_tokens))
            if n == 0:
                break                                  # the step's grid is full
            if cap is not None:
                n = take(seq.num_computed_tokens, n, n, cap, block)
                if n == 0:
                    continue
            n = self._grow(seq, n, plan)
            if n:
                shape.add(out, n)
                out.append(self._prefill_chunk(seq, n))
                budget -= n
                if cap is not None:
                    cap -= n * (seq.num_computed_tokens + n)
        queue = self.waiting[rank]
        pending = self._pending_hashes(rank) if queue else set()  # not at every decode-phase step
        i = 0                                          # the queue's head, past the sequences waiting for pending pages
        while i < len(queue) and budget > 0 and len(self.running[rank]) < self.max_num_seqs:
            seq = queue[i]
            need = -(-seq.num_tokens // self.page_size)
            if need > self.capacity:                   # a preempted sequence one token past the rank's pages
                self.finish(seq, "error", f"sequence of {seq.num_tokens} tokens needs {need} KV pages of "
                                          f"{self.page_size}, rank {rank} has {self.capacity}")
                continue
            if pending and self._waits_for_pending(seq, pending):
                i += 1                                 # its next page is being computed: a later step matches it
                continue
            room = shape.fit(out, budget)
            if room and cap is not None:
                hit = self._held_tokens(seq, rank)
                room = take(hit, seq.num_tokens - hit, room, cap, block)
                if room == 0:
                    i += 1                             # over the step's attention cap: a later step takes it
                    continue
            n = self._admit(seq, room) if room else 0
            if n == 0:
                break                                  # FIFO: the head blocks the queue until pages free up
            del queue[i]
            if self.enable_prefix_caching:
                pending.update(self._prompt_hashes(seq))
            bisect.insort(self.running[rank], seq, key=lambda s: s.arrival)
            admitted.append(seq)
            shape.add(out, n)
            out.append(self._prefill_chunk(seq, n))
            budget -= n
            if cap is not None:
                cap -= n * (seq.num_computed_tokens + n)

    def _pending_hashes(self, rank: int) -> set[int]:
        """The page hashes of the prompts ``rank``'s unfinished prefills compute (empty without prefix caching)."""
        if not self.enable_prefix_caching:
            return set()
        return {h for seq in self.running[rank] if seq.is_prefilling for h in self._prompt_hashes(seq)}

    def _waits_for_pending(self, seq: Sequence, pending: set[int]) -> bool:
        """Whether the first page of ``seq`` its rank's prefix cache lacks is one a prefill there is computing
        (see "Prefill": such a sequence waits for it)."""
        hashes = self._prompt_hashes(seq)
        k = self.caches[seq.rank].lookup(hashes)
        return k < len(hashes) and hashes[k] in pending

    def _verify_width(self) -> tuple[int | None, bool]:
        """Drafts each sequence verifies in the next decode step: all (None), or with ``confidence_verify`` the
        width worth its cost over the whole step (engine/speculative.py ``verify_width``); and whether the step is
        a probe (one round, see "Decode")."""
        if not self.confidence_verify:
            return None, False
        decoding = self._decoding()
        rows = bucket(max(map(len, decoding)) or 1)
        seqs = [s for rank in decoding for s in rank]
        width = verify_width([s.draft_probs[:len(s.draft_token_ids)] if s.draft_token_ids else self._confidence
                              for s in seqs], rows, self.num_drafts, self.step_cost, self.num_scheduler_steps)
        if not seqs:
            return width, False
        if width:
            self._plain_steps = 0
            return width, False
        self._plain_steps += 1
        if self._plain_steps > PROBE_AFTER_PLAIN_STEPS and verify_width(
                [[1.0] * self.num_drafts] * len(seqs), rows, self.num_drafts, self.step_cost):
            self._plain_steps = 0
            return 1, True  # a probe (engine/speculative.py PROBE_AFTER_PLAIN_STEPS): draft afresh
        return 0, False

    def _decoding(self) -> list[list[Sequence]]:
        return [[s for s in running if s.status is SequenceStatus.RUNNING and not s.is_prefilling]
                for running in self.running]

    def _known_columns(self) -> int:
        """0 when no decoding sequence has appended tokens to compute; else the most tokens a row computes in the
        next decode step (see "Known tokens"), for the rows of every decoding sequence (the step may take fewer:
        the runner's T for them is at least this)."""
        decoding = self._decoding()
        most = max((s.num_tokens - s.num_computed_tokens for rank in decoding for s in rank), default=0)
        if most <= 1:
            return 0
        return known_columns(bucket(max(map(len, decoding))), self.prefill_capacity)

    def _schedule_decode(self, rank: int, plan: _Plan, width: int | None = None, columns: int = 0) -> None:
        out = plan.chunks[rank]
        constrained = [s for s in self.running[rank] if s.status is SequenceStatus.RUNNING and not s.is_prefilling
                       and s.params.structured_outputs is not None]
        ready = [s for s in constrained if not s.num_placeholders]
        if len(ready) == len(constrained) >= SPLIT_CONSTRAINED_ROWS:  # see "Constrained sequences"
            ready = ready[:(len(ready) + 1) // 2]
        ready_ids = {s.seq_id for s in ready}
        for seq in list(self.running[rank]):
            if seq.status is not SequenceStatus.RUNNING or seq.is_prefilling:
                continue
            if seq.params.structured_outputs is not None and seq.seq_id not in ready_ids:
                continue
            if columns:  # a step of known tokens: each row computes what it can of its own and samples after them
                n = self._grow(seq, min(seq.num_tokens - seq.num_computed_tokens, columns), plan)
                if n:
                    out.append(_Chunk(seq, n, int(seq.num_computed_tokens + n == seq.num_tokens)))
                continue
            if seq.rollbacks_at_commit and not plan.speculative:
                continue  # a plain step needs the exact positions of its speculative step in flight: after it
            # Tokens it may still sample (>= 1: commit finishes a sequence that reaches either limit, but for one
            # following its step in flight, which the device lays out again: see "Speculative steps in flight").
            left = max(1, min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens))
            known = seq.draft_token_ids or (PLACEHOLDER,) * seq.num_device_drafts  # or proposed in flight
            drafts = known[:left - 1 if width is None else min(left - 1, width)]
            if width == 0:  # a plain step: the drafts are dropped (the next speculative step drafts again)
                seq.draft_token_ids, seq.draft_probs = (), ()
            # A round drafts after 1 token; a constrained sequence's next token needs a mask from its last one.
            masked = seq.params.structured_outputs is not None
            one = plan.speculative or masked
            want = 1 + len(drafts) if drafts else (1 if one else min(left, self.num_scheduler_steps))
            rounds = plan.rounds > 1 and not masked
            if rounds:  # later rounds of T positions, within what it may sample
                want = min(want + (self.num_scheduler_steps - 1) * plan.verify_columns, left)
            n = self._grow(seq, want, plan)
            if n:
                first_round = min(n, 1 + len(drafts))
                later = rounds and n > first_round
                out.append(_Chunk(seq, n, n, drafts[:first_round - 1], rounds=later))

    def _prefill_chunk(self, seq: Sequence, n: int) -> _Chunk:
        return _Chunk(seq, n, int(seq.num_computed_tokens + n == seq.num_tokens))

    def _room(self, seq: Sequence) -> int:
        """Tokens ``seq`` could compute now: room in its pages plus every page the rank could allocate."""
        cache = self.caches[seq.rank]
        return (len(seq.pages) + cache.num_available) * self.page_size - seq.num_computed_tokens

    def _take_pages(self, seq: Sequence, n: int) -> None:
        """Allocates the pages positions [num_computed, num_computed + n) need beyond ``seq.pages``."""
        need = -(-(seq.num_computed_tokens + n) // self.page_size) - len(seq.pages)
        if need > 0:
            seq.pages.extend(self.caches[seq.rank].allocate(need))

    def _grow(self, seq: Sequence, n: int, plan: _Plan) -> int:
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
        cached, hashes = [], []
        if self.enable_prefix_caching:
            hashes = self._prompt_hashes(seq)
            cached = cache.match(hashes, num_tokens=seq.num_tokens)
        need = -(-seq.num_tokens // self.page_size) - len(cached)
        if need > cache.num_available:
            cache.free(cached)
            cache.stats = stats                        # an admission that did not happen is not a query
            return 0
        seq.pages = cached + cache.allocate(need)
        stored = self._read_stored(hashes[len(cached):])
        if stored:  # pages of the storage tier: written into the cache before this step (page_loads), cached now
            pages = seq.pages[len(cached):len(cached) + len(stored)]
            cache.insert(hashes[len(cached):len(cached) + len(stored)], pages)
            self._loads[seq.rank].extend(zip(pages, stored))
            self.storage_hit_tokens += len(stored) * self.page_size
        hit = len(cached) + len(stored)
        seq.num_pages_sent = 0
        seq.unsent_token_ids = []  # its NewRequest carries all its outputs
        seq.num_computed_tokens = hit * self.page_size
        seq.status = SequenceStatus.RUNNING
        seq.num_prefill_tokens = seq.num_tokens
        seq.num_registered_pages = hit
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = hit * self.page_size
            seq.num_storage_cached_tokens = len(stored) * self.page_size
        return min(budget, seq.num_tokens - seq.num_computed_tokens)

    def _read_stored(self, hashes: list[int]) -> list:
        """The pages of the storage tier that continue a prefix (``hashes``: the pages after the device cache's
        hits), verified, up to the first one it does not have (or rejects)."""
        pages = []
        if self.storage is not None:
            for h in hashes:
                page = self.storage.get(page_key(h))
                if page is None:
                    break
                pages.append(page)
        return pages

    def take_stores(self) -> list[tuple[int, int, bytes]]:
        """(rank, page, storage key) of the pages registered in the prefix cache since the last call, computed by
        dispatched steps: the engine has the runner copy them to the storage tier (their data as the device holds
        it once the steps that wrote them have run; they are never written again, and a copy taken before the next
        step is dispatched precedes any reuse of the page)."""
        stores, self._stores = self._stores, []
        return [(rank, page, page_key(h)) for rank, page, h in stores]

    def _preempt(self, seq: Sequence) -> None:
        self.running[seq.rank].remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_prefill_tokens = 0
        seq.num_preemptions += 1
        seq.draft_token_ids = ()
        seq.draft_probs = ()
        seq.num_device_drafts = 0
        seq.unsent_token_ids = []
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
        self._finished_ids.append(seq.seq_id)

    def _drop_if_complete(self, seq: Sequence) -> None:
        if seq.is_finished and not seq.num_placeholders:
            self._seqs.pop(seq.seq_id, None)

    def _commit(self, plan: _Plan, admitted: list[Sequence]) -> SchedulerOutput:
        """Applies the planned step (advances ``num_computed_tokens``, appends a PLACEHOLDER per sampled token,
        finishes sequences at ``max_tokens`` / ``max_model_len`` with "length") and freezes it."""
        new = tuple(NewRequest(s.seq_id, s.rank, tuple(s.prompt_token_ids), tuple(s.output_token_ids), s.params,
                               s.child_index) for s in admitted)
        if any(PLACEHOLDER in r.output_token_ids for r in new):
            raise RuntimeError("a request was re-admitted before its last step's tokens were applied")
        finished, self._finished_ids = tuple(self._finished_ids), []  # before this step's "length" finishes
        # The step's load per rank, its pages allocated and before any sequence finishes as it commits.
        self.step_load = [(self.held_pages(r), len(self.running[r])) for r in range(self.num_ranks)]
        requests = []
        for chunks in plan.chunks:
            rank_requests = []
            for c in chunks:
                seq = c.seq
                rank_requests.append(ScheduledRequest(seq.seq_id, seq.num_computed_tokens, c.num_tokens,
                                                      c.num_sampled, tuple(seq.pages[seq.num_pages_sent:]),
                                                      c.drafts, tuple(seq.unsent_token_ids)))
                seq.num_pages_sent = len(seq.pages)
                seq.unsent_token_ids = []
                seq.num_computed_tokens += c.num_tokens
                self._register_full_pages(seq)
                seq.output_token_ids.extend([PLACEHOLDER] * c.num_sampled)
                in_flight = bool(seq.rollbacks_at_commit)  # a step of its own whose update may roll back
                if self.speculative and c.num_sampled:  # (see "Speculative steps in flight")
                    seq.rollbacks_at_commit.append((seq.num_rolled_back, in_flight and plan.speculative))
                    seq.num_device_drafts = self.num_drafts if plan.speculative else 0
                if c.drafts or c.rounds:
                    seq.draft_token_ids = ()           # verified by this step; the length check waits for update
                elif c.num_sampled and not in_flight and self._at_length_limit(seq):
                    self.finish(seq, "length", keep_pending=True)  # update still fills its last tokens
            requests.append(tuple(rank_requests))
        # One entry per page, the last: a page loaded, released and evicted in this same step could be loaded again.
        loads = tuple(tuple(dict(rank).items()) for rank in self._loads) if any(self._loads) else ()
        self._loads = [[] for _ in range(self.num_ranks)]
        kv_in, self._kv_in = tuple(self._kv_in), []
        return SchedulerOutput(plan.kind, tuple(requests), new, finished, tuple(s.seq_id for s in plan.preempted),
                               plan.speculative, loads, kv_in, rounds=plan.rounds, verify_columns=plan.verify_columns)

    def _at_length_limit(self, seq: Sequence, known: bool = False) -> bool:
        """Whether its outputs reach max_tokens or its tokens max_model_len, placeholders counted (unless
        ``known``: the tokens of steps in flight not counted)."""
        pending = seq.num_placeholders if known else 0
        return (seq.num_output_tokens - pending >= seq.params.max_tokens
                or seq.num_tokens - pending >= self.max_model_len)

    # ---- results ------------------------------------------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput, result: RunnerOutput) -> list[TokenUpdate]:
        """Applies the runner's results of a committed step: fills the step's placeholders with
        ``result.sampled[req_id]`` (in order), applies EOS / stop_token_ids ("stop"; later outputs dropped), rolls
        back rejected draft tokens (a request that verified drafts may get fewer tokens than it had placeholders:
        ``num_computed_tokens`` goes back by as many), registers pages that became full of known tokens, and
        stores the next drafts. Requests finished since the step was scheduled are skipped. Returns one
        TokenUpdate per sequence whose outputs changed.

        Raises ValueError for a missing token (fewer than the step sampled, without drafts) or a rollback that a
        later step in flight does not follow (one scheduled by a scheduler that is not ``speculative``).
        """
        updates = []
        for r in output.all_requests():
            seq = self._seqs.get(r.req_id)
            if seq is None or r.num_sampled == 0:
                continue
            # Its first placeholder: the output after the chunk's last known token (drafts are not outputs yet),
            # as many earlier as positions of its steps before were rolled back since it was committed. A chunk that
            # followed its step in flight was laid out again on device: it samples up to that many more (or fewer).
            base, follows = seq.rollbacks_at_commit.popleft() if seq.rollbacks_at_commit else (0, False)
            shift = seq.num_rolled_back - base if follows else 0
            first = r.first_sampled - shift - seq.num_prompt_tokens
            outputs = seq.output_token_ids
            if first >= len(outputs) or outputs[first] != PLACEHOLDER:
                continue                               # dropped: the sequence stopped at an earlier token
            tokens = result.sampled.get(r.req_id, ())
            verifies = bool(r.draft_token_ids) or r.num_sampled > 1 and output.rounds > 1 or follows  # rolls back
            most = r.num_sampled + max(shift, 0)
            if len(tokens) < r.num_sampled and not verifies or len(tokens) > most:
                raise ValueError(f"{len(tokens)} sampled tokens for seq {r.req_id}, its step samples "
                                 f"{r.num_sampled if most == r.num_sampled else f'up to {most}'}")
            if not tokens and not follows:  # (a following one finds its sequence ended by length or a stop)
                raise ValueError(f"no sampled token for seq {r.req_id}")
            rejected = r.num_sampled - len(tokens)  # < 0: positions it took from those the step before left
            if rejected:  # its placeholders now (a later speculative step's follow them on device)
                end = first + r.num_sampled
                if end != len(outputs) and not seq.rollbacks_at_commit:
                    raise ValueError(f"seq {r.req_id}: drafts rolled back after a later step was scheduled that "
                                     f"does not follow them (a plain step)")
                if any(t != PLACEHOLDER for t in outputs[first:end]):
                    raise ValueError(f"seq {r.req_id}: outputs {first} .. {end - 1} are not this step's placeholders")
                outputs[first + min(len(tokens), r.num_sampled):end] = [PLACEHOLDER] * max(0, -rejected)
                seq.num_rolled_back += rejected
                if seq.status is SequenceStatus.RUNNING:  # (a preempted one computes again from 0)
                    seq.num_computed_tokens -= rejected
            num = 0
            for j, token in enumerate(tokens):
                if first + j >= len(outputs):
                    break                              # outputs dropped after a stop token
                outputs[first + j] = int(token)
                num += 1
                if int(token) in seq.params.stop_tokens(self.eos_token_id):
                    del outputs[first + j + 1:]
                    if seq.is_finished:                # finished by length at commit: "stop" wins
                        seq.finish_reason = "stop"
                    else:
                        self.finish(seq, "stop")
                    break
            rounds = result.verified.get(r.req_id)  # (drafts, accepted) per round; else one round
            if rounds is None:  # the recovered or bonus token is no draft
                rounds = [(len(r.draft_token_ids), len(tokens) - 1 if r.draft_token_ids else 0)]
            drafts, accepted = sum(d for d, _ in rounds), sum(a for _, a in rounds)
            seq.num_draft_tokens += drafts
            seq.num_accepted_tokens += accepted
            later = bool(seq.rollbacks_at_commit)  # a later step of its own, in flight, verifies the drafts
            if seq.status is SequenceStatus.RUNNING:
                if self._at_length_limit(seq, known=True):  # a verification's (later steps' tokens dropped)
                    self.finish(seq, "length")
                else:
                    self._register_full_pages(seq)
                    probs = tuple(result.draft_probs.get(r.req_id, ()))
                    self._observe(probs)
                    if not later:
                        seq.num_device_drafts = 0
                        seq.draft_token_ids = tuple(result.draft_token_ids.get(r.req_id, ()))
                        seq.draft_probs = probs
            updates.append(TokenUpdate(seq, first, num, drafts, accepted, tuple(rounds)))
            self._drop_if_complete(seq)
        return updates

    def _observe(self, probs: tuple[float, ...]) -> None:
        """Folds one sequence's draft probabilities into ``_confidence`` (a moving mean, weight 1/16 per draft):
        the confidence assumed for sequences without drafts after plain steps (deterministic: it depends on the
        drafts only)."""
        if not self.confidence_verify or not probs:
            return
        if len(self._confidence) != len(probs):
            self._confidence = list(probs)
        self._confidence = [c + (p - c) / 16 for c, p in zip(self._confidence, probs)]

    def _register_full_pages(self, seq: Sequence) -> None:
        """Offers the pages that are full of computed, known (not placeholder) tokens to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        real = seq.num_tokens - seq.num_placeholders
        full = min(seq.num_computed_tokens, real) // self.page_size
        if full > seq.num_registered_pages:
            hashes = seq.page_hashes(full, self.page_size, self.cache_key)
            lo = seq.num_registered_pages
            self.caches[seq.rank].insert(hashes[lo:full], seq.pages[lo:full])
            if self.storage is not None:
                self._stores.extend((seq.rank, page, h) for page, h in zip(seq.pages[lo:full], hashes[lo:full]))
            seq.num_registered_pages = full
