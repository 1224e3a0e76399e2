"""DP-rank load balancing (DeepSeek's prefill and decode load balancers; docs/architecture.md "Load balance and the
step log"): the rank of each newly arrived request, chosen for all the requests that arrived since the last step
at once.

A request's demand on its rank has four parts, each a load the balancer evens over the ranks:

- tokens: the prompt tokens its prefill computes (the prefill balancer's first objective: tokens per step);
- attention: its prefill's core-attention work, new x total tokens (the prefill balancer's second objective);
- requests: 1 on every decode step it will run, a profile over the coming decode steps (the decode balancer's);
- pages: its KV pages on each of those steps (the decode balancer's first objective), as its tokens grow.

The profiles look ``HORIZON`` decode steps ahead: a request that may generate m more tokens, k per step
(multi-step decode), runs ceil(m / k) steps (an upper bound: a stop token may end it earlier).

A rank whose prefix cache already holds the start of a prompt (``assign``'s ``cached``) takes its prefill for
fewer tokens, so the same rule prefers it as far as the other parts allow (SGLang's cache-aware routing, as a cost
rather than a threshold): a conversation's next turn goes back to the rank holding its history unless that rank is
loaded out of proportion. Arrivals placed together count each other's prompts the same way (``assign``'s
``prefixes``): once one is placed, a later one sharing its leading pages computes them on that rank for free (the
scheduler's admission waits for them: engine/scheduler.py "Prefill"), so the n samples of a prompt, or prompts
behind one system prompt, share a rank unless requests and pages outweigh the recomputation.

Each part is measured in its mean per rank (per decode step for the profiles, then averaged over the steps any
request runs), and a rank's cost is the sum of squares of its parts so measured, weighted by the engine's role
(``WEIGHTS``). Requests are placed largest first (LPT, longest processing time first: the last, small ones even
out what the large ones left), each on the rank whose cost grows least, among the ranks it would not take past
the rows of the decode steps (where the role evens requests): an SPMD step runs every rank at the padded rows of
the busiest, the power of two >= its requests (buckets.py), so a rank one request past an even share, or past the
busiest rank now, doubles every rank's rows, a cost the sum of squares does not see. Where the role evens the
decode objectives, pairs of arrivals on two ranks are then exchanged while that lowers the total cost (a local
search: largest first leaves the last ranks uneven where the sizes do not fit, e.g. 3, 3, 2, 2, 2 on two ranks as
7 / 5 instead of 6 / 6; an exchange keeps every rank's requests, hence its decode rows). Each rank then queues its
new requests (in the order engine/scheduler.py "Ranks" gives). Pure numpy, no JAX.

Even so, requests of unequal lengths leave their ranks uneven as they finish: with whole requests a rank holds at
least the largest one, and one placement for a request's life cannot follow the lengths the others leave
(``benchmarks/load_balance.py --bounds`` measures both limits; docs/benchmarks.md "Load balance (CPU)").
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from jaxinfer.engine.buckets import bucket

# Decode steps the request and page profiles look ahead (a request running longer counts on all of them).
HORIZON = 64

# Weights of (tokens, attention, requests, pages) by engine role. Co-located: a request's rank is fixed for its
# life, and decode steps outnumber prefill steps (a 128-token answer is 16 multi-step decode steps, a prompt 1-2
# prefill steps), so it evens prefill tokens and the decode objectives and leaves attention out: attention grows
# with the square of the prompt, one long prompt can exceed a rank's mean on its own, and evening it would leave
# the ranks' requests and pages uneven for the whole decode phase. A prefill engine (prefill/decode
# disaggregation) keeps a request for its prefill only: tokens and attention. A decode engine: requests and pages.
WEIGHTS = {"colocated": (1.0, 0.0, 1.0, 1.0), "prefill": (1.0, 1.0, 0.0, 0.0), "decode": (0.0, 0.0, 1.0, 1.0)}
ROLES = tuple(WEIGHTS)

# Exchange rounds after the greedy pass (``_exchange``) at most. A round compares the costliest rank with every
# other, so its host time grows with the ranks; 16 rounds take 8 ranks' placements of 64-512 arrivals most of the
# way (docs/benchmarks.md "Load balance (CPU)").
EXCHANGE_ROUNDS = 16


@dataclasses.dataclass(frozen=True)
class Demand:
    """What one request asks of a rank (see the module doc): prefill tokens and attention work still to compute,
    the tokens it holds, the tokens it may still generate and how many it computes per decode step."""

    prefill_tokens: int
    prefill_attention: float
    num_tokens: int
    max_new_tokens: int
    tokens_per_step: int


def parts(demands: list[Demand], page_size: int) -> list[np.ndarray]:
    """The four parts of each demand: tokens [n], attention [n], requests [n, HORIZON], pages [n, HORIZON]."""
    if not demands:
        return [np.zeros(0), np.zeros(0), np.zeros((0, HORIZON)), np.zeros((0, HORIZON))]
    field = lambda name: np.array([getattr(d, name) for d in demands], np.float64)  # noqa: E731
    per_step = field("tokens_per_step")[:, None]                                   # [n, 1]
    steps = np.arange(HORIZON)[None, :]                                             # [1, H]
    alive = steps < np.ceil(np.maximum(field("max_new_tokens"), 0)[:, None] / per_step)  # [n, H]
    pages = np.ceil((field("num_tokens")[:, None] + per_step * steps) / page_size)  # [n, H]
    return [field("prefill_tokens"), field("prefill_attention"), alive.astype(np.float64), np.where(alive, pages, 0)]


def assign(current: list[list[Demand]], arrivals: list[Demand], page_size: int, role: str = "colocated",
           cached: list[list[int]] | None = None, prefixes: list[list[int]] | None = None) -> list[int]:
    """The rank of each of ``arrivals`` (in arrival order) given each rank's ``current`` demands (its waiting and
    running requests). See the module doc. cached: per arrival, the leading prompt tokens each rank's prefix cache
    holds ([arrivals][ranks]; None: none): on a rank holding c of them an arrival computes c fewer prefill tokens
    (its attention work shrinks alike: the new tokens still attend to the cached ones), so it costs that rank less.
    prefixes: per arrival, the chained hashes of its prompt's pages (kv/prefix_cache.py ``page_hashes``; None:
    none): an arrival placed after another with the same leading hashes finds those pages cached on that one's
    rank."""
    weights = WEIGHTS[role]
    num_ranks = len(current)
    loads = [np.stack([p.sum(axis=0) for p in part]) for part in
             zip(*(parts(rank, page_size) for rank in current))]                   # per part: [R] or [R, H]
    new = parts(arrivals, page_size)
    # Prefill tokens and attention of arrival i on each rank: [n, R]
    hits = np.zeros((len(arrivals), num_ranks)) if cached is None else np.asarray(cached, np.float64)
    todo = new[0][:, None]                                                          # [n, 1]
    kept = np.where(todo > 0, np.maximum(todo - hits, 0.0) / np.maximum(todo, 1.0), 1.0)  # [n, R]
    on_rank = [todo * kept, new[1][:, None] * kept]
    units, spans = [], []
    for load, x in zip(loads, new):
        total = load.sum(axis=0) + x.sum(axis=0)       # [] or [H]
        units.append(np.where(total > 0, total / num_ranks, 1.0))
        spans.append(max(1, int(np.count_nonzero(total))) if load.ndim == 2 else 1)

    def cost(part: int, value) -> np.ndarray:
        """Per rank (or for one rank's row): the weighted sum of squares of a part's load in its unit."""
        v = (value / units[part]) ** 2
        return weights[part] * (v.sum(axis=-1) if loads[part].ndim == 2 else v) / spans[part]

    def delta(i: int, placed: dict[int, set[int]], sibling: bool = False) -> tuple[list[np.ndarray], bool]:
        """Arrival i's load per rank, [R] for the prefill parts (less the pages it finds there: those of the
        arrivals ``placed`` there, or with ``sibling`` its whole prompt), else [H]; and whether it found any."""
        tok, att = on_rank[0][i], on_rank[1][i]
        chain = prefixes[i] if prefixes else ()
        if chain and (placed or sibling) and todo[i, 0] > 0:
            shared = page_size * np.array([len(chain) if sibling else _leading(chain, placed, r)
                                           for r in range(num_ranks)], np.float64)  # [R]
            if shared.any():
                k = np.maximum(todo[i, 0] - np.maximum(hits[i], shared), 0.0) / todo[i, 0]  # [R]
                return [todo[i, 0] * k, new[1][i] * k, new[2][i], new[3][i]], True
        return [tok, att, new[2][i], new[3][i]], False

    sizes = sum(weights[p] * (new[p] / units[p]).reshape(len(arrivals), -1).sum(axis=1) / spans[p]
                for p in range(4)) if arrivals else np.zeros(0)
    ranks = [0] * len(arrivals)
    # An even share of the requests at the busiest coming step, and the decode rows it pads to (the module doc: no
    # rank goes past them, or past the busiest rank's, while another has room).
    share = int(np.ceil((loads[2].sum(axis=0) + new[2].sum(axis=0)).max(initial=0) / max(num_ranks, 1)))
    cap = bucket(share)
    placed: dict[int, set[int]] = {}  # page hash -> ranks of the arrivals placed so far whose prompts hold it
    alone: list[tuple[int, list[np.ndarray]]] = []  # (arrival, its load per rank): placed alone, sharing nothing
    firsts = collections.Counter(_first(prefixes, i) for i in range(len(arrivals)))  # arrivals per first page
    for unit in _units(prefixes, len(arrivals), max(share, 1) if weights[2] else len(arrivals), sizes):
        # A unit's load: its first arrival's, the others' beyond the prompt it computes (engine/scheduler.py
        # "Prefill": they wait for its pages).
        d, shares = delta(unit[0], placed)
        first = _first(prefixes, unit[0])
        if len(unit) == 1 and not shares and (first is None or firsts[first] < 2):
            alone.append((unit[0], d))
        for i in unit[1:]:
            d = [a + b for a, b in zip(d, delta(i, placed, sibling=True)[0])]
        growth = sum(cost(p, loads[p] + d[p]) - cost(p, loads[p]) for p in range(4) if weights[p])
        if weights[2]:
            over = (loads[2] + d[2]).max(axis=1) > max(cap, bucket(int(loads[2].max(initial=0))))  # [R]
            if not over.all():
                growth = np.where(over, np.inf, growth)
        r = int(np.argmin(growth))
        for p in range(4):
            loads[p][r] += d[p][r] if p < 2 else d[p]
        for i in unit:
            ranks[i] = r
            for h in (prefixes[i] if prefixes else ()):
                placed.setdefault(h, set()).add(r)
    if weights[3]:  # the decode objectives (a prefill engine's steps depend on its queues' order more than on totals)
        _exchange(alone, ranks, loads, cost, weights, units, spans)
    return ranks


def _exchange(alone, ranks: list[int], loads: list[np.ndarray], cost, weights, units, spans) -> None:
    """Improves a placement by exchanging arrivals between ranks (local search after the greedy pass: largest first
    leaves the last ranks' sums of squares uneven where the sizes do not fit). alone: (arrival, its load per rank:
    [R] prefill parts, [H] profiles) of the arrivals whose load does not depend on the others' ranks (placed alone,
    sharing no prompt pages); an exchange keeps every rank's requests, so the decode rows too. Each round exchanges
    the pair that lowers the total cost most, between the costliest rank and another, until none does (at most
    ``EXCHANGE_ROUNDS`` rounds). ``ranks`` and ``loads`` are updated in place."""
    if len(alone) < 2:
        return
    num_ranks = len(loads[0])
    parts = [p for p in range(4) if weights[p]]
    ids = np.array([i for i, _ in alone])
    own = {p: np.stack([d[p] for _, d in alone]) for p in parts}    # [n, R] (prefill parts) or [n, H] (profiles)
    where = np.array([ranks[i] for i in ids])                                        # [n]
    for _ in range(EXCHANGE_ROUNDS):
        a = int(np.argmax(sum(cost(p, loads[p]) for p in parts)))
        on_a = np.flatnonzero(where == a)
        if not len(on_a):  # the costliest rank holds no arrival to exchange
            return
        best, pick = -1e-9, None
        for b in range(num_ranks):
            on_b = np.flatnonzero(where == b)
            if b == a or not len(on_b):
                continue
            change = 0.0
            for p in parts:
                if p < 2:  # prefill parts: the arrival's load on a and on b
                    out_a, in_a = own[p][on_a, a][:, None], own[p][on_b, a][None, :]   # [n_a, 1], [1, n_b]
                    out_b, in_b = own[p][on_b, b][None, :], own[p][on_a, b][:, None]
                    new_a, new_b = loads[p][a] - out_a + in_a, loads[p][b] - out_b + in_b
                    change = change + cost(p, new_a) + cost(p, new_b) - cost(p, loads[p][a]) - cost(p, loads[p][b])
                else:      # profiles [H], the same on every rank: a's load changes by z = y - x, b's by -z, and the
                    # sum of squares by 2 (L_a - L_b) z + 2 z^2 (in units, per step): matrix products, not [n_a, n_b, H]
                    inv = 1.0 / units[p] ** 2                                             # [H]
                    x, y = own[p][on_a], own[p][on_b]                                     # [n_a, H], [n_b, H]
                    gap = (loads[p][a] - loads[p][b]) * inv                               # [H]
                    sq_x, sq_y = (x * x) @ inv, (y * y) @ inv                             # [n_a], [n_b]
                    cross = (x * inv) @ y.T                                               # [n_a, n_b]
                    change = change + 2 * weights[p] / spans[p] * (
                        (y @ gap)[None, :] - (x @ gap)[:, None] + sq_x[:, None] + sq_y[None, :] - 2 * cross)
            c, d = np.unravel_index(np.argmin(change), change.shape)
            if change[c, d] < best:
                best, pick = change[c, d], (on_a[c], on_b[d], b)
        if pick is None:
            return
        u, v, b = pick
        for p in parts:
            if p < 2:
                loads[p][a] += own[p][v, a] - own[p][u, a]
                loads[p][b] += own[p][u, b] - own[p][v, b]
            else:
                loads[p][a] += own[p][v] - own[p][u]
                loads[p][b] -= own[p][v] - own[p][u]
        where[u], where[v] = b, a
        ranks[ids[u]], ranks[ids[v]] = b, a


def _units(prefixes: list[list[int]] | None, n: int, share: int, sizes: np.ndarray) -> list[list[int]]:
    """The arrivals in the order and groups ``assign`` places them: identical prompts (the n samples of a
    request) together, in units of at most ``share`` (a rank's even share of the requests where the role evens
    them, else all n), largest first. Placed one at a time, the second sample would cost a rank a request more
    while spreading it costs a prompt, and while the ranks are empty the requests win, though samples of two
    prompts a rank would even both; a unit larger than a rank's share would leave the requests uneven whatever the
    rest does."""
    groups: dict[tuple, list[int]] = {}
    for i in range(n):
        groups.setdefault(tuple(prefixes[i]) if prefixes and prefixes[i] else ("alone", i), []).append(i)
    units = [g[k:k + share] for g in groups.values() for k in range(0, len(g), share)]
    return sorted(units, key=lambda u: (-sum(sizes[i] for i in u), u[0]))


def _first(prefixes: list[list[int]] | None, i: int):
    """The hash of arrival i's first page (None without one): arrivals share prompt pages only if they share it."""
    return prefixes[i][0] if prefixes and prefixes[i] else None


def _leading(chain: list[int], placed: dict[int, set[int]], rank: int) -> int:
    """How many leading hashes of ``chain`` the arrivals placed on ``rank`` hold (``placed``: hash -> ranks)."""
    n = 0
    while n < len(chain) and rank in placed.get(chain[n], ()):
        n += 1
    return n
