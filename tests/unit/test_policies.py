"""Table-driven tests of the pure policies."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import get_args

import pytest

from policies import (
    QUEUE_ORDERS,
    Admit,
    ArrivalView,
    BatchParams,
    Candidate,
    ClassBound,
    PreemptionParams,
    QueueLimits,
    QueueLoad,
    Refuse,
    StarvationParams,
    batch_limit,
    call_cost,
    decide_admission,
    plan_batch,
    promote,
    should_preempt,
)
from policies.batching import preemptible_rows
from policies.budget import TokenBudgets, token_limit
from policies.kv import CacheView, KVAction, plan_kv_release
from policies.ordering import QueueOrderName


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
    # The YAML takes exactly the registered names.
    assert set(get_args(QueueOrderName)) == set(QUEUE_ORDERS)
    assert all(order.name == name for name, order in QUEUE_ORDERS.items())


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


LINEAR = ((1, 1.0), (2, 1.95), (4, 3.8))  # batch 4 costs 3.8x batch 1
CHEAP = ((1, 1.0), (2, 1.05), (4, 1.2))  # rows nearly free
B = BatchParams(0.0, 4, lower_cost_bound=0.1)


@pytest.mark.parametrize(
    ("costs", "rows", "expected"),
    [
        (CHEAP, 1, 1.0),
        (CHEAP, 2, 1.05),
        (CHEAP, 3, 1.125),  # linear between measured sizes
        (CHEAP, 8, 2.4),  # beyond the largest: its cost per row, no further gain
        (((2, 2.0), (4, 3.0)), 1, 1.0),  # below the smallest: its cost per row
        ((), 3, 3.0),  # nothing measured: proportional to rows
    ],
)
def test_call_cost_table(costs, rows, expected):
    assert call_cost(costs, rows) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("candidates", "params", "ids"),
    [
        # near-linear rows: one background row would lengthen the call by 95 %
        (
            [Q("fg", priority=10)] + [Q(f"bg{i}") for i in range(3)],
            replace(B, costs=LINEAR),
            ("fg",),
        ),
        # cheap rows: the first lower row adds 5 %, a second would add 12.5 %
        (
            [Q("fg", priority=10)] + [Q(f"bg{i}") for i in range(3)],
            replace(B, costs=CHEAP),
            ("fg", "bg0"),
        ),
        # the bound is on the cost of the leader's own rows: two of them allow more
        (
            [Q("fg", priority=10), Q("fg2", priority=10), Q("bg0"), Q("bg1")],
            replace(B, costs=CHEAP),
            ("fg", "fg2", "bg0"),
        ),
        # a lower row of several rows is priced as a whole
        ([Q("fg", priority=10), Q("bg", rows=2)], replace(B, costs=CHEAP), ("fg",)),
        # nothing measured: cost taken as proportional to rows, lower rows stay out...
        ([Q("fg", priority=10), Q("bg")], B, ("fg",)),
        # ...unless the call is already large enough that one row is within the bound
        ([Q("fg", priority=10, rows=10), Q("bg")], replace(B, max_rows=16), ("fg", "bg")),
        # rows of the leader's priority or higher ignore the bound
        ([Q("a"), Q("b"), Q("c")], replace(B, costs=LINEAR), ("a", "b", "c")),
        ([Q("off", priority=0), Q("fg", priority=10)], replace(B, costs=LINEAR), ("off", "fg")),
        # no bound: lower rows fill free slots (the rule without a cost table)
        ([Q("fg", priority=10), Q("bg0"), Q("bg1")], BatchParams(0.0, 4), ("fg", "bg0", "bg1")),
    ],
)
def test_lower_priority_rows_join_within_the_cost_bound(candidates, params, ids):
    assert plan_batch(candidates, 0.0, params).ids == ids


A = BatchParams(window_s=0.010, max_rows=4, lower_cost_bound=0.1, adaptive=True)
V = ArrivalView


@pytest.mark.parametrize(
    ("candidates", "now", "params", "arrivals", "ids", "wait_until"),
    [
        # nothing known of arrivals: a lone request does not wait
        ([Q("a", arrival=1.0)], 1.0, A, {}, ("a",), None),
        # one arrival per 20 ms: the next is due after the 10 ms window, flush now
        ([Q("a", arrival=1.0)], 1.0, A, {3: V(1.0, 0.020)}, ("a",), None),
        # one per 2.5 ms: due in time; look again once it is a whole gap late
        ([Q("a", arrival=1.0)], 1.0, A, {3: V(1.0, 0.0025)}, (), 1.005),
        # due exactly as the window closes still counts
        ([Q("a", arrival=1.0)], 1.0, A, {3: V(1.0, 0.010)}, (), 1.010),
        # late, but by less than a gap: still expected
        ([Q("a", arrival=1.0)], 1.005, A, {3: V(1.0, 0.003)}, (), 1.006),
        # a gap late: the stream has stopped
        ([Q("a", arrival=1.0)], 1.006, A, {3: V(1.0, 0.003)}, ("a",), None),
        # once a companion has joined, the window runs its course
        ([Q("a", arrival=1.0), Q("b", arrival=1.004)], 1.008, A, {}, (), 1.010),
        # a flood of lower-priority arrivals that could not join does not hold the leader
        (
            [Q("fg", priority=10, arrival=1.0)],
            1.0,
            replace(A, costs=LINEAR),
            {3: V(1.0, 1e-4)},
            ("fg",),
            None,
        ),
        # ... but it does when their rows are cheap enough to join
        (
            [Q("fg", priority=10, arrival=1.0)],
            1.0,
            replace(A, costs=CHEAP),
            {3: V(1.0, 1e-4)},
            (),
            1.0002,
        ),
        # arrivals of higher priority always count
        ([Q("bg", arrival=1.0)], 1.0, A, {10: V(1.0, 0.0025)}, (), 1.005),
        # of several streams, any one due in time holds the window
        ([Q("a", arrival=1.0)], 1.0, A, {3: V(0.995, 0.012), 7: V(0.999, 0.02)}, (), 1.010),
        # the leader's deadline still caps the wait
        ([Q("a", arrival=1.0, deadline=1.004)], 1.0, A, {3: V(1.0, 0.001)}, (), 1.002),
        # a fixed window waits whatever the arrivals
        ([Q("a", arrival=1.0)], 1.0, replace(A, adaptive=False), {}, (), 1.010),
        # a full batch goes at once
        ([Q(c, arrival=1.0) for c in "abcd"], 1.0, A, {3: V(1.0, 1e-4)}, tuple("abcd"), None),
    ],
)
def test_adaptive_window_table(candidates, now, params, arrivals, ids, wait_until):
    plan = plan_batch(candidates, now, params, arrivals)
    assert plan.ids == ids
    if wait_until is None:
        assert plan.wait_until is None
    else:
        assert plan.wait_until == pytest.approx(wait_until)


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
        # the default threshold: batch 4 at 3.5x batch 1 (12.5 % per row) does not pay
        ({1: 1.0, 2: 1.9, 4: 3.5}, 4, 0.25, 1),
        ({1: 1.0, 2: 1.6, 4: 3.0}, 4, 0.25, 4),  # 25 % per row at batch 4: it does
    ],
)
def test_batch_limit_table(costs, max_rows, min_gain, expected):
    assert batch_limit(costs, max_rows, min_gain) == expected


NEAR_LINEAR = ((1, 0.014), (2, 0.0254), (4, 0.050))  # batch 4 costs 3.6x batch 1


@pytest.mark.parametrize(
    ("costs", "rate", "expected"),
    [
        (NEAR_LINEAR, 0.0, 4),  # nothing preempts: the configured size
        (NEAR_LINEAR, 1.0, 4),  # one abort a second: a 50 ms call almost always ends
        (NEAR_LINEAR, 20.0, 1),  # an abort every 50 ms: a batch of 4 rarely ends
        (((1, 0.010), (4, 0.012)), 20.0, 4),  # batching pays so much it still wins
        ((), 20.0, 4),  # nothing measured: the configured size
    ],
)
def test_preemptible_rows_complete_the_most_rows_per_second(costs, rate, expected):
    assert preemptible_rows(costs, 4, rate) == expected


# ------------------------------------------------------------------ starvation

OFF_SHARE = StarvationParams({0: ClassBound(min_share=0.05)}, frozenset({10}))
OFF_WAIT = StarvationParams({0: ClassBound(max_wait_s=2.0)}, frozenset({10}))
BOTH = StarvationParams(
    {0: ClassBound(min_share=0.05), 3: ClassBound(max_wait_s=1.0)}, frozenset({10})
)


@pytest.mark.parametrize(
    ("heads", "served", "now", "params", "promoted"),
    [
        # nothing configured, or nothing to go ahead of
        ([Q("bg"), Q("off", priority=0)], {}, 0.0, StarvationParams(), None),
        ([Q("off", priority=0)], {}, 0.0, OFF_SHARE, None),
        # below its share (nothing served yet counts as 0): offline goes first
        ([Q("bg"), Q("off", priority=0)], {}, 0.0, OFF_SHARE, "off"),
        ([Q("bg"), Q("off", priority=0)], {3: 0.96, 0: 0.04}, 0.0, OFF_SHARE, "off"),
        # at its share: the service order holds
        ([Q("bg"), Q("off", priority=0)], {3: 0.95, 0: 0.05}, 0.0, OFF_SHARE, None),
        # a priority between classes belongs to the class below it
        ([Q("bg"), Q("two", priority=2)], {3: 1.0, 2: 0.01}, 0.0, OFF_SHARE, "two"),
        # a protected class queued above: nothing below it is promoted
        ([Q("fg", priority=10), Q("off", priority=0)], {10: 1.0}, 0.0, OFF_SHARE, None),
        (
            [Q("fg", priority=10), Q("bg"), Q("off", priority=0)],
            {10: 1.0},
            0.0,
            StarvationParams({0: ClassBound(min_share=0.05)}, frozenset({7})),
            "off",
        ),
        (
            [Q("fg", priority=10), Q("in", priority=7), Q("off", priority=0)],
            {10: 1.0},
            0.0,
            StarvationParams({0: ClassBound(min_share=0.05)}, frozenset({7})),
            None,
        ),
        # aging: waited its class's maximum
        ([Q("bg"), Q("off", priority=0, arrival=1.0)], {3: 1.0}, 2.999, OFF_WAIT, None),
        ([Q("bg"), Q("off", priority=0, arrival=1.0)], {3: 1.0}, 3.0, OFF_WAIT, "off"),
        # overdue goes before starved, whatever the priorities
        (
            [Q("in", priority=7), Q("bg", arrival=0.0), Q("off", priority=0)],
            {7: 1.0},
            1.5,
            BOTH,
            "bg",
        ),
        (
            [Q("in", priority=7), Q("bg", arrival=1.0), Q("off", priority=0)],
            {7: 1.0},
            1.5,
            BOTH,
            "off",
        ),
        # the head itself is the one owed: it runs anyway
        ([Q("bg", arrival=0.0), Q("off", priority=0)], {0: 1.0}, 1.5, BOTH, None),
    ],
)
def test_promote_table(heads, served, now, params, promoted):
    # one request per lane: each lane is its head
    assert promote([[head] for head in heads], served, now, params) == promoted


@pytest.mark.parametrize(
    ("lane", "now", "promoted"),
    [
        # one 10 ms call from now, plus three to spare, would take it past its 2 s
        ([Q("off", priority=0, arrival=1.0)], 2.965, None),
        ([Q("off", priority=0, arrival=1.0)], 2.975, "off"),
        # the third of three that came together starts two calls after the head
        ([Q(f"off{i}", priority=0, arrival=1.0) for i in range(3)], 2.945, None),
        ([Q(f"off{i}", priority=0, arrival=1.0) for i in range(3)], 2.955, "off0"),
    ],
)
def test_max_wait_looks_calls_ahead(lane, now, promoted):
    assert promote([[Q("bg")], lane], {3: 1.0}, now, OFF_WAIT, call_s=0.010) == promoted


def test_starvation_classes_of_priorities():
    params = StarvationParams({0: ClassBound(0.1)}, frozenset({10}), classes=(0, 3, 7, 10))
    assert [params.class_of(p) for p in (0, 2, 3, 6, 7, 9, 10)] == [0, 0, 3, 3, 7, 7, 10]
    assert params.is_protected(10) and not params.is_protected(9)
    assert StarvationParams(classes=(3, 10)).class_of(1) == 3  # below every class: the lowest


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


def test_the_guaranteed_priorities_are_those_of_the_bounded_classes():
    assert OFF_SHARE.guaranteed() == {0: 0, 1: 0, 2: 0}
    inline = StarvationParams({7: ClassBound(max_wait_s=1.0)})
    assert inline.guaranteed() == {7: 7, 8: 7, 9: 7}
    assert StarvationParams().guaranteed() == {}
