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
busiest rank now, doubles every rank's rows, a cost the sum of squares does not see. Each rank then queues its new
requests in arrival order (FIFO). Pure numpy, no JAX.
"""

from __future__ import annotations

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

    def delta(i: int, placed: dict[int, set[int]], sibling: bool = False) -> list[np.ndarray]:
        """Arrival i's load per rank, [R] for the prefill parts (less the pages it finds there: those of the
        arrivals ``placed`` there, or with ``sibling`` its whole prompt), else [H]."""
        tok, att = on_rank[0][i], on_rank[1][i]
        chain = prefixes[i] if prefixes else ()
        if chain and (placed or sibling) and todo[i, 0] > 0:
            shared = page_size * np.array([len(chain) if sibling else _leading(chain, placed, r)
                                           for r in range(num_ranks)], np.float64)  # [R]
            if shared.any():
                k = np.maximum(todo[i, 0] - np.maximum(hits[i], shared), 0.0) / todo[i, 0]  # [R]
                tok, att = todo[i, 0] * k, new[1][i] * k
        return [tok, att, new[2][i], new[3][i]]

    sizes = sum(weights[p] * (new[p] / units[p]).reshape(len(arrivals), -1).sum(axis=1) / spans[p]
                for p in range(4)) if arrivals else np.zeros(0)
    ranks = [0] * len(arrivals)
    # An even share of the requests at the busiest coming step, and the decode rows it pads to (the module doc: no
    # rank goes past them, or past the busiest rank's, while another has room).
    share = int(np.ceil((loads[2].sum(axis=0) + new[2].sum(axis=0)).max(initial=0) / max(num_ranks, 1)))
    cap = bucket(share)
    placed: dict[int, set[int]] = {}  # page hash -> ranks of the arrivals placed so far whose prompts hold it
    for unit in _units(prefixes, len(arrivals), max(share, 1) if weights[2] else len(arrivals), sizes):
        # A unit's load: its first arrival's, the others' beyond the prompt it computes (engine/scheduler.py
        # "Prefill": they wait for its pages).
        d = delta(unit[0], placed)
        for i in unit[1:]:
            d = [a + b for a, b in zip(d, delta(i, placed, sibling=True))]
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
    return ranks


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


def _leading(chain: list[int], placed: dict[int, set[int]], rank: int) -> int:
    """How many leading hashes of ``chain`` the arrivals placed on ``rank`` hold (``placed``: hash -> ranks)."""
    n = 0
    while n < len(chain) and rank in placed.get(chain[n], ()):
        n += 1
    return n
