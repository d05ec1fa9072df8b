"""Batch formation: which queued requests share an engine call, and when to flush."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from policies.views import QueuedView


@dataclass(frozen=True)
class BatchParams:
    window_s: float = 0.0  # 0: never wait for more requests
    max_rows: int = 1  # rows per engine call


@dataclass(frozen=True)
class BatchPlan:
    """Run the requests ``ids`` now, or (no ids) look again at ``wait_until``."""

    ids: tuple[str, ...] = ()
    wait_until: float | None = None


def plan_batch(candidates: Sequence[QueuedView], now: float, params: BatchParams) -> BatchPlan:
    """Form a batch led by ``candidates[0]``.

    ``candidates`` MUST be the queued requests that may share the leader's engine call
    (same model, same non-batch shapes), in service order, leader first. The window
    opens at the earliest arrival among the chosen requests, so requests of lower
    priority can only bring the flush forward, never delay the leader. Rows are capped
    at ``max_rows``; a leader larger than that still runs, alone. Requests marked
    ``isolate`` (their last batch failed) only ever run alone.
    """
    if not candidates:
        return BatchPlan()
    leader = candidates[0]
    if leader.isolate or params.max_rows <= 1:
        return BatchPlan((leader.id,))
    chosen: list[QueuedView] = []
    rows = 0
    for c in candidates:
        if chosen and c.isolate:
            continue
        if chosen and rows + c.rows > params.max_rows:
            break
        chosen.append(c)
        rows += c.rows
        if rows >= params.max_rows:
            return BatchPlan(tuple(r.id for r in chosen))
    if params.window_s > 0:
        flush_at = min(c.arrival for c in chosen) + params.window_s
        if leader.deadline is not None:
            flush_at = min(flush_at, leader.deadline)
        if now < flush_at:
            return BatchPlan(wait_until=flush_at)
    return BatchPlan(tuple(r.id for r in chosen))


def batch_limit(costs: Mapping[int, float], max_rows: int, min_gain: float) -> int:
    """The batch size (rows) worth waiting for, from measured cost per call by size.

    Returns the size with the lowest cost per row among measured sizes up to
    ``max_rows``, provided it beats batch 1 per row by at least ``min_gain``;
    otherwise 1: batching would not raise throughput, so requests are never held.
    """
    if max_rows <= 1:
        return 1
    if 1 not in costs:  # nothing measured: trust the configuration
        return max_rows
    base = costs[1]
    best, best_cost = 1, base
    for size, cost in sorted(costs.items()):
        if 1 < size <= max_rows and cost / size < best_cost:
            best, best_cost = size, cost / size
    return best if best_cost <= base * (1.0 - min_gain) else 1
