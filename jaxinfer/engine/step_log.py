"""The step log: one record per dispatched step with each DP rank's load, and the imbalance of a field over steps
(DeepSeek's prefill and decode load balancers even these; docs/architecture.md "Load balance and the step log").

A record is a dict (``llm.stats.step_log``): kind ("prefill" | "decode"), engine ("prefill" | "decode" |
"colocated"), t_dispatch (``time.perf_counter()`` as the step was dispatched, s), and per DP rank of that engine
(lists of ints): rank_tokens (tokens computed; a multi-step decode chunk counts its iterations, a chunk of
several draft-verify rounds its reserved positions), rank_attention
(sum over its chunks of new x total tokens: the chunk's core-attention work, new queries over the keys up to its
last), rank_kv_pages (pages held by sequences once the step's pages are allocated, before sequences that end as
it commits release theirs: prefix-cache pages nobody holds are free to evict and not counted), rank_requests
(running requests, likewise).
"""

from __future__ import annotations

from collections.abc import Iterable

from jaxinfer.engine.scheduler_output import SchedulerOutput

RANK_FIELDS = ("rank_tokens", "rank_attention", "rank_kv_pages", "rank_requests")


def step_record(out: SchedulerOutput, scheduler, engine: str, t_dispatch: float) -> dict:
    """The record of the committed step ``out`` of ``scheduler`` (engine/scheduler.py, its ``step_load``)."""
    ranks = range(len(out.requests))
    return dict(
        kind=out.kind.value, engine=engine, t_dispatch=t_dispatch,
        rank_tokens=[out.num_tokens(r) for r in ranks],
        rank_attention=[sum(c.num_tokens * (c.start + c.num_tokens) for c in out.requests[r]) for r in ranks],
        rank_kv_pages=[pages for pages, _ in scheduler.step_load],
        rank_requests=[requests for _, requests in scheduler.step_load])


def imbalance(step_log: Iterable[dict], field: str, kind: str | None = None, engine: str | None = None) -> float:
    """Sum over steps of the max over ranks / sum over steps of the mean over ranks of ``field`` (one of
    RANK_FIELDS), over the records of ``kind`` and ``engine`` (None: any). 1.0 is perfect balance; a field that
    is 0 on every step counts as balanced (1.0).

    Raises ValueError for an unknown field, kind or engine."""
    if field not in RANK_FIELDS:
        raise ValueError(f"field must be one of {RANK_FIELDS}, got {field!r}")
    if kind not in (None, "prefill", "decode"):
        raise ValueError(f"kind must be None, 'prefill' or 'decode', got {kind!r}")
    if engine not in (None, "prefill", "decode", "colocated"):
        raise ValueError(f"engine must be None, 'prefill', 'decode' or 'colocated', got {engine!r}")
    most = mean = 0.0
    for record in step_log:
        if (kind is None or record["kind"] == kind) and (engine is None or record["engine"] == engine):
            values = record[field]
            most += max(values)
            mean += sum(values) / len(values)
    return most / mean if mean else 1.0
