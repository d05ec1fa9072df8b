"""Batch formation: which queued requests share an engine call, and when to flush."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from policies.views import ArrivalView, QueuedView

# An arrival stream whose next request is this many gaps late is taken to have stopped:
# one gap of lateness is the jitter of a steady stream, two are a pause.
STOPPED_AFTER_GAPS = 2.0


@dataclass(frozen=True)
class BatchParams:
    window_s: float = 0.0  # 0: never wait for more requests
    max_rows: int = 1  # rows per engine call
    # Engine seconds per call by batch rows, as measured (rows, seconds) pairs; empty:
    # nothing measured. Prices what lower-priority rows add to a call.
    costs: tuple[tuple[int, float], ...] = ()
    # Rows of lower priority than the call's leader may lengthen the call by at most
    # this fraction of its cost (by ``costs``); None: no bound, they fill free slots.
    lower_cost_bound: float | None = None
    # A request alone does not wait when recent arrivals say no companion will come in
    # time.
    adaptive: bool = False


@dataclass(frozen=True)
class BatchPlan:
    """Run the requests ``ids`` now, or (no ids) look again at ``wait_until``."""

    ids: tuple[str, ...] = ()
    wait_until: float | None = None


def call_cost(costs: Sequence[tuple[int, float]], rows: int) -> float:
    """Engine seconds of a call of ``rows`` rows, estimated from measured ``costs``.

    Linear between measured sizes; outside them, at the cost per row of the nearest
    measured size (beyond the largest, no further gain is assumed). With nothing
    measured the cost is ``rows`` (proportional to rows, unit-less): the conservative
    guess, under which an added row lengthens a call by its full share.
    """
    if not costs:
        return float(rows)
    below: tuple[int, float] | None = None
    for size, cost in sorted(costs):
        if size == rows:
            return cost
        if size > rows:
            if below is None:
                return cost * rows / size
            size0, cost0 = below
            return cost0 + (cost - cost0) * (rows - size0) / (size - size0)
        below = (size, cost)
    assert below is not None
    size, cost = below
    return cost * rows / size


def _lower_fits(params: BatchParams, own_rows: int, rows: int) -> bool:
    """Whether a call of ``rows`` rows, ``own_rows`` of them at the leader's priority or
    higher, costs at most the bound more than those rows would alone."""
    bound = params.lower_cost_bound
    if bound is None:
        return True
    return call_cost(params.costs, rows) <= (1.0 + bound) * call_cost(params.costs, own_rows)


def plan_batch(
    candidates: Sequence[QueuedView],
    now: float,
    params: BatchParams,
    arrivals: Mapping[int, ArrivalView] | None = None,
) -> BatchPlan:
    """Form a batch led by ``candidates[0]``.

    ``candidates`` MUST be the queued requests that may share the leader's engine call
    (same model, same non-batch shapes), leader first, then in service order. Rows of
    the leader's priority or higher join while there is room; rows of lower priority
    only while ``params.lower_cost_bound`` allows what they add to the call. The window
    opens at the earliest arrival among the chosen requests, so requests of lower
    priority can only bring the flush forward, never delay the leader. Rows are capped
    at ``max_rows``; a leader larger than that still runs, alone. Requests marked
    ``isolate`` (their last batch failed) only ever run alone.

    ``arrivals`` are the recent arrivals of this model by priority. With
    ``params.adaptive`` a leader without companions waits only while a request that
    could join it is due (the latest arrival of its priority plus the gap between
    arrivals) before the window closes, that is while at least one companion is
    expected in time; a stream ``STOPPED_AFTER_GAPS`` gaps late no longer counts, and
    ``wait_until`` is then when to look again.
    """
    if not candidates:
        return BatchPlan()
    leader = candidates[0]
    if leader.isolate or params.max_rows <= 1:
        return BatchPlan((leader.id,))
    chosen: list[QueuedView] = []
    rows = own_rows = 0
    for c in candidates:
        if chosen and c.isolate:
            continue
        if chosen and rows + c.rows > params.max_rows:
            break
        lower = c.priority < leader.priority
        if lower and not _lower_fits(params, own_rows, rows + c.rows):
            break
        chosen.append(c)
        rows += c.rows
        own_rows += 0 if lower else c.rows
        if rows >= params.max_rows:
            return BatchPlan(tuple(r.id for r in chosen))
    if params.window_s > 0:
        flush_at = min(c.arrival for c in chosen) + params.window_s
        if leader.deadline is not None:
            flush_at = min(flush_at, leader.deadline)
        if now < flush_at:
            # Once a companion has joined, the window runs its course: what arrives then
            # is what lets batches grow under load.
            if not params.adaptive or len(chosen) > 1:
                return BatchPlan(wait_until=flush_at)
            lower_joins = _lower_fits(params, own_rows, rows + 1)
            due = [
                a
                for p, a in (arrivals or {}).items()
                if (p >= leader.priority or lower_joins)
                and a.last + a.gap <= flush_at
                and now < a.last + STOPPED_AFTER_GAPS * a.gap
            ]
            if due:
                give_up = min(a.last + STOPPED_AFTER_GAPS * a.gap for a in due)
                return BatchPlan(wait_until=min(flush_at, give_up))
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


def preemptible_rows(costs: Sequence[tuple[int, float]], max_rows: int, rate: float) -> int:
    """The batch size that completes the most rows per engine second when more urgent
    arrivals, ``rate`` a second, abort the call and its time is lost.

    A call of cost ``c`` then completes with probability ``exp(-rate c)`` and holds the
    engine ``(1 - exp(-rate c)) / rate`` on average, so its rows complete at
    ``r rate / (exp(rate c) - 1)`` a second: a large batch that is usually aborted
    completes less than a small one that usually finishes. Sizes considered: 1, the
    measured ones and ``max_rows``; a tie goes to the smaller (it delays no one).
    """
    if rate <= 0 or max_rows <= 1 or not costs:
        return max_rows
    best, best_goodput = 1, -1.0
    for rows in sorted({1, max_rows, *(s for s, _ in costs if s < max_rows)}):
        x = rate * call_cost(costs, rows)
        goodput = rows * rate / math.expm1(x) if x > 0 else math.inf
        if goodput > best_goodput:
            best, best_goodput = rows, goodput
    return best
