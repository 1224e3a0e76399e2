"""The limits of a prefill step: the second half of DeepSeek's prefill load balancer (placement evens the ranks'
totals, engine/balance.py; these even each step; docs/architecture.md "Load balance and the step log").

All ranks run one SPMD prefill step, so a step takes as long as its busiest rank, and its shape (query blocks per
rank, padded to a power of two) is that of the rank with the most blocks. A chunk's core attention is new x total
tokens (its queries over the keys up to its last: engine/step_log.py). Taken as it comes, a rank computes a long
prompt in one chunk of the first step, whose attention (the square of its length) can exceed what the other ranks
compute in all their steps. Split over steps, the same prompt costs less attention in all (a prompt of L tokens in
two halves: L^2 / 4 + L^2 / 2 instead of L^2) and the steps even out.

``step_limits`` plans the steps the ranks' prefill work needs anyway (S, at ``max_num_batched_tokens`` and the
blocks a rank may have per step) and each step's shape as the work taken as it comes would have it (the padded
blocks of its busiest rank). Within those S steps and shapes, each step taking a rank's items in queue order, a
chunk cut to whole blocks where a limit is reached and the step filled from the items after it (``_fits`` is
that plan), it finds by bisection the least attention cap under which every rank still finishes, then the least
token quota under that cap, and for the next step a quota no larger than the tokens the rank held back most by
the cap computes in it, where the others can still finish (else the least with which they can). So no step
computes more padded blocks than without the limits and there are no more steps; what moves is when each rank's
tokens run: a rank held back by the cap computes fewer tokens in an early step and more in a later one, and the
quota holds the others back alike where the shapes leave room (docs/benchmarks.md "Load balance (CPU)").

The plan is made again at every step from what is left, so admissions that wait for pages, sequences added in
between and the decode steps of a co-located engine only change the next plan. Pure Python, no JAX.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.engine.buckets import bucket

# Steps of work a plan looks at: a longer queue is planned by its first PLAN_STEPS steps (the rest when it comes
# closer), which bounds the host time of a plan (8 ranks of 8 prompts ~1 ms, 64 ranks of 64 ~10 ms here).
PLAN_STEPS = 4

# Bisection steps of each limit (it is then within 2^-12 of its span above the least that fits).
_BISECT = 12


@dataclasses.dataclass(frozen=True)
class StepLimits:
    """What each rank's next prefill step may compute at most: ``tokens``, ``attention`` (new x total tokens
    summed over its chunks) and query ``blocks`` (the step's padded shape as planned)."""

    tokens: int
    attention: float
    blocks: int


def take(c: int, m: int, quota: int, cap: float, block: int) -> int:
    """Tokens of an item (``c`` computed, ``m`` left) a step takes with ``quota`` tokens and ``cap`` attention
    left: all it may, else the most whole blocks within the cap (0 if not one)."""
    n = min(m, quota)
    if n * (c + n) <= cap:
        return n
    top = int((-c + (c * c + 4.0 * cap) ** 0.5) / 2)  # the largest n with n * (c + n) <= cap
    return min(n, top - top % block)


def _step(items: list[list[int]], quota: int, cap: float, block: int, blocks: int) -> tuple[int, int]:
    """Takes one step's chunks from ``items`` ([computed, left] pairs, updated in place, in the rank's order)
    within ``quota`` tokens, ``cap`` attention and ``blocks`` query blocks (a chunk of n tokens takes ceil(n /
    block)); returns its (tokens, blocks)."""
    tokens, attention, used = 0, 0.0, 0
    for item in items:
        if tokens >= quota or used == blocks:
            break
        c, m = item
        if m == 0:
            continue
        n = take(c, min(m, (blocks - used) * block), quota - tokens, cap - attention, block)
        if n:
            item[0], item[1] = c + n, m - n
            tokens += n
            attention += n * (c + n)
            used += -(-n // block)
    return tokens, used


def _fits(work: list[tuple[int, int]], limits: list[int], quotas: list[int], cap: float, block: int) -> bool:
    """Whether a rank's ``work`` ([computed, left] per item, in order) is done in len(limits) steps, step s of at
    most ``quotas[s]`` tokens, ``cap`` attention and ``limits[s]`` query blocks."""
    items = [list(w) for w in work]
    left = sum(m for _, m in work)
    for quota, blocks in zip(quotas, limits):
        if left == 0:
            return True
        left -= _step(items, quota, cap, block, blocks)[0]
    return left == 0


def _padded(work: list[list[tuple[int, int]]], steps: int, quota: int, block: int, blocks: int) -> list[int]:
    """The query blocks of each of ``steps`` steps that take the ranks' ``work`` as it comes (no cap): the most a
    rank has in the step, as the step's shape pads it (the power of two >= it)."""
    most = [0] * steps
    for rank_work in work:
        items = [list(w) for w in rank_work]
        for s in range(steps):
            most[s] = max(most[s], _step(items, quota, float("inf"), block, blocks)[1])
    return [min(bucket(m), blocks) for m in most]


def step_limits(work: list[list[tuple[int, int]]], budget: int, block: int, blocks: int | None = None
                ) -> StepLimits | None:
    """The limits of each rank's next prefill step (see the module doc), or None to take the
    work as it comes (it fits in one step, needs more than 2 x PLAN_STEPS steps, or the limits found do not fit:
    the greedy plan is not monotone in them everywhere).

    work: per rank, its prefill items in the order its step takes them, (tokens computed, tokens left) each.
    budget: tokens per rank and step at most (``max_num_batched_tokens``); block: the granularity of a cut
    (the step layout's query block); blocks: query blocks per rank and step at most (None: budget // block)."""
    blocks = budget // block if blocks is None else blocks
    horizon, clipped = budget * PLAN_STEPS, []
    for items in work:                                 # the first PLAN_STEPS steps of work of each rank
        kept, total = [], 0
        for c, m in items:
            if total >= horizon:
                break
            kept.append((c, min(m, horizon - total)))
            total += kept[-1][1]
        clipped.append(kept)
    high = float(max(sum(m * (c + m) for c, m in items) for items in clipped))  # no cap at all
    steps = max(-(-sum(m for _, m in items) // budget) for items in clipped)  # the steps the tokens need ...
    while steps <= 2 * PLAN_STEPS and not all(_fits(items, [blocks] * steps, [budget] * steps, high, block)
                                              for items in clipped):
        steps += 1                                     # ... and their chunks' blocks
    if steps <= 1 or steps > 2 * PLAN_STEPS:
        return None
    limits = _padded(clipped, steps, budget, block, blocks)
    cap = _least(lambda x, items: _fits(items, limits, [budget] * steps, x, block), clipped, high)
    quota = min(budget, int(_least(lambda x, items: _fits(items, limits, [int(x)] * steps, cap, block), clipped,
                                   float(budget))))
    # The next step's quota: no more than the rank the cap holds back most computes in it, where the others can
    # still finish (their tokens then wait with its attention), else the least with which they can.
    held = []
    for items in clipped:
        capped, free = ([list(w) for w in items] for _ in range(2))
        tokens = _step(capped, quota, cap, block, limits[0])[0]
        if tokens < _step(free, quota, high, block, limits[0])[0]:
            held.append(tokens)
    fits_first = lambda x, items: _fits(items, limits, [int(x)] + [quota] * (steps - 1), cap, block)  # noqa: E731
    first = min(quota, max(int(_least(fits_first, clipped, float(quota))), min(held, default=quota)))
    if not all(fits_first(first, items) for items in clipped):
        return None
    return StepLimits(first, cap, limits[0])


def _least(fits, work: list[list[tuple[int, int]]], high: float) -> float:
    """The least x in [0, high] (within high / 2^_BISECT above it) with ``fits(x, items)`` for every rank's items,
    by bisection rank after rank from the least found so far (``fits`` grows with x, up to the greedy plan's
    exceptions, which the caller checks)."""
    least = 0.0
    for items in work:
        if fits(least, items):
            continue
        lo, hi = least, high
        for _ in range(_BISECT):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if fits(mid, items) else (mid, hi)
        least = hi
    return least
