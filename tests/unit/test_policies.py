"""Table-driven tests of the pure policies."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from policies import (
    QUEUE_ORDERS,
    Admit,
    BatchParams,
    Candidate,
    PreemptionParams,
    QueueLimits,
    QueueLoad,
    Refuse,
    batch_limit,
    decide_admission,
    plan_batch,
    should_preempt,
)
from policies.budget import TokenBudgets, token_limit
from policies.kv import CacheView, KVAction, plan_kv_release


@dataclass(frozen=True)
class Q:
    id: str
    priority: int = 3
    arrival: float = 0.0
    deadline: float | None = None
    nbytes: int = 10
    rows: int = 1
    group: str = "g"
    isolate: bool = False


LIMITS = QueueLimits(capacity=3, max_bytes=100)


@pytest.mark.parametrize(
    ("rank", "nbytes", "load", "victims", "expected"),
    [
        (5, 10, QueueLoad(0, 0), [], Admit()),
        (5, 10, QueueLoad(2, 20), [], Admit()),
        # full by items: evict the lowest strictly lower rank
        (5, 10, QueueLoad(3, 30), [Candidate("a", 0, 10), Candidate("b", 3, 10)], Admit(("a",))),
        # full, victim of equal rank: refuse
        (5, 10, QueueLoad(3, 30), [Candidate("a", 5, 10)], Refuse("")),
        # full, victim of higher rank: refuse
        (0, 10, QueueLoad(3, 30), [Candidate("a", 3, 10)], Refuse("")),
        # full by bytes: evict as many low ones as needed
        (
            10,
            60,
            QueueLoad(3, 80),
            [Candidate("a", 0, 20), Candidate("b", 0, 20), Candidate("c", 7, 40)],
            Admit(("a", "b")),
        ),
        # bytes cannot be freed without evicting equal rank: refuse, evict nothing
        (
            3,
            60,
            QueueLoad(2, 90),
            [Candidate("a", 0, 20), Candidate("b", 3, 70)],
            Refuse(""),
        ),
        # larger than the whole queue
        (10, 101, QueueLoad(0, 0), [], Refuse("")),
    ],
)
def test_admission_table(rank, nbytes, load, victims, expected):
    decision = decide_admission(rank, nbytes, load, LIMITS, iter(victims))
    assert type(decision) is type(expected)
    if isinstance(expected, Admit):
        assert decision == expected
    else:
        assert decision.reason


@pytest.mark.parametrize(
    ("running", "arrival", "params", "expected"),
    [
        (3, 10, PreemptionParams(True, 5), True),
        (5, 10, PreemptionParams(True, 5), True),
        (6, 10, PreemptionParams(True, 5), False),
        (3, 10, PreemptionParams(False, 5), False),
        (3, 4, PreemptionParams(True, 1), True),
        (10, 0, PreemptionParams(True, 1), False),
    ],
)
def test_preemption_gap(running, arrival, params, expected):
    assert should_preempt(running, arrival, params) is expected


def test_orders():
    assert QUEUE_ORDERS["priority"]().rank(7) == 7
    assert QUEUE_ORDERS["fifo"]().rank(7) == QUEUE_ORDERS["fifo"]().rank(0)


W = BatchParams(window_s=0.010, max_rows=4)


@pytest.mark.parametrize(
    ("candidates", "now", "params", "ids", "wait_until"),
    [
        ([], 0.0, W, (), None),
        # one request, window open: wait until arrival + window
        ([Q("a", arrival=1.0)], 1.002, W, (), 1.010),
        # window expired: flush what is there
        ([Q("a", arrival=1.0), Q("b", arrival=1.004)], 1.010, W, ("a", "b"), None),
        # max rows reached: flush at once
        ([Q(c, arrival=1.0) for c in "abcd"], 1.0, W, tuple("abcd"), None),
        # more than max: the first four in service order
        ([Q(c, arrival=1.0) for c in "abcdef"], 1.0, W, tuple("abcd"), None),
        # window 0: never wait, take what is queued
        ([Q("a"), Q("b")], 0.0, BatchParams(0.0, 4), ("a", "b"), None),
        # max_rows 1: alone
        ([Q("a"), Q("b")], 0.0, BatchParams(0.5, 1), ("a",), None),
        # window opens at the earliest arrival: an older low-priority filler brings
        # the flush forward, it never delays the leader
        ([Q("fg", priority=10, arrival=1.008), Q("bg", arrival=1.0)], 1.009, W, (), 1.010),
        ([Q("fg", priority=10, arrival=1.008), Q("bg", arrival=1.0)], 1.010, W, ("fg", "bg"), None),
        # leader deadline caps the wait
        ([Q("a", arrival=1.0, deadline=1.004)], 1.001, W, (), 1.004),
        # isolated leader runs alone; isolated followers are skipped
        ([Q("a", isolate=True), Q("b")], 0.0, W, ("a",), None),
        ([Q("a"), Q("b", isolate=True), Q("c")], 0.0, BatchParams(0, 4), ("a", "c"), None),
        # rows: a 3-row request fills a 4-row batch with one more single row only
        ([Q("a", rows=3), Q("b", rows=2), Q("c")], 0.0, BatchParams(0, 4), ("a",), None),
        ([Q("a", rows=3), Q("c"), Q("b", rows=2)], 0.0, BatchParams(0, 4), ("a", "c"), None),
        # a leader larger than max_rows still runs, alone
        ([Q("a", rows=9), Q("b")], 0.0, W, ("a",), None),
    ],
)
def test_plan_batch_table(candidates, now, params, ids, wait_until):
    plan = plan_batch(candidates, now, params)
    assert plan.ids == ids
    assert plan.wait_until == pytest.approx(wait_until) if wait_until else plan.wait_until is None


@pytest.mark.parametrize(
    ("costs", "max_rows", "min_gain", "expected"),
    [
        ({1: 1.0, 2: 1.2, 4: 1.5, 8: 2.0}, 8, 0.05, 8),  # pays more at every size
        ({1: 1.0, 2: 1.2, 4: 1.5, 8: 2.0}, 4, 0.05, 4),  # capped by config
        ({1: 1.0, 2: 2.1, 4: 4.3, 8: 9.0}, 8, 0.05, 1),  # per-row cost grows: never batch
        ({1: 1.0, 2: 1.98, 4: 3.9}, 4, 0.05, 1),  # gain below threshold
        ({1: 1.0, 2: 1.5, 4: 3.9}, 8, 0.05, 2),  # best per-row size
        ({}, 8, 0.05, 8),  # nothing measured: trust the config
        ({1: 1.0, 8: 2.0}, 1, 0.05, 1),
    ],
)
def test_batch_limit_table(costs, max_rows, min_gain, expected):
    assert batch_limit(costs, max_rows, min_gain) == expected


# ------------------------------------------------------------------ token budgets

BUDGETS = TokenBudgets({"background": {3: 0.25, 0: 0.25}})


@pytest.mark.parametrize(
    ("state", "priority", "limit"),
    [
        ("foreground", 3, 64),  # foreground state: every class gets its full budget
        ("background", 10, 64),  # the foreground class is not listed: full budget
        ("background", 7, 64),  # nor inline
        ("background", 5, 16),  # 5 belongs to the class at or below it: background (3)
        ("background", 3, 16),
        ("background", 0, 16),
        ("unknown", 0, 64),
    ],
)
def test_token_limit_by_lifecycle_state_and_class(state, priority, limit):
    assert token_limit(64, priority, state, BUDGETS) == limit


def test_token_limit_rounds_down_and_may_be_zero():
    budgets = TokenBudgets({"background": {0: 0.25}})
    assert token_limit(7, 0, "background", budgets) == 1
    assert token_limit(3, 0, "background", budgets) == 0
    assert token_limit(3, 0, "background", TokenBudgets({"background": {0: 0.0}})) == 0


# ------------------------------------------------------------------ KV release


def _cache(cid, nbytes, *, keep=0, paused=True, priority=0, last_used=0.0, seq=0):
    return CacheView(cid, nbytes, keep, paused, priority, last_used, seq)


def test_kv_under_budget_releases_nothing():
    assert plan_kv_release([_cache("a", 10), _cache("b", 10, paused=False)], 20) == []


def test_kv_release_order_idle_then_trim_then_drop():
    caches = [
        _cache("s-old", 10, paused=False, last_used=1.0),
        _cache("s-new", 10, paused=False, last_used=2.0),
        _cache("p-high", 100, keep=20, priority=5, seq=1),
        _cache("p-low-old", 100, keep=20, priority=0, seq=2),
        _cache("p-low-new", 100, keep=20, priority=0, seq=3),
    ]
    assert plan_kv_release(caches, 315) == [("s-old", KVAction.DROP)]
    assert plan_kv_release(caches, 300) == [("s-old", KVAction.DROP), ("s-new", KVAction.DROP)]
    assert plan_kv_release(caches, 220) == [
        ("s-old", KVAction.DROP),
        ("s-new", KVAction.DROP),
        ("p-low-new", KVAction.TRIM),
    ]
    everything = plan_kv_release(caches, 50)
    assert everything[-1] == ("p-low-new", KVAction.DROP)  # 3 prefixes of 20 > 50
    assert [a for _, a in everything].count(KVAction.TRIM) == 3
    assert plan_kv_release(caches, 0)[-1] == ("p-high", KVAction.DROP)


def test_kv_release_skips_trims_that_free_nothing():
    caches = [_cache("full-prefix", 50, keep=50), _cache("other", 50, keep=10, seq=1)]
    assert plan_kv_release(caches, 70) == [("other", KVAction.TRIM)]
    assert plan_kv_release(caches, 55) == [("other", KVAction.TRIM), ("other", KVAction.DROP)]
