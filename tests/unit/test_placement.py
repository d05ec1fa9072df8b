"""Placement policies: table-driven cases and one conformance suite over every policy."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from policies.costs import UNTIMED_ROW_COST
from policies.placement import (
    PICKERS,
    POLICIES,
    SCORERS,
    NodeView,
    PlacementParams,
    PlacementRequest,
    ShedBelowPriority,
    drain,
    make_placement,
    placement_policies,
)
from policies.placement.filters import Healthy, ServesModel
from policies.placement.pickers import Best, NearBest, PowerOfTwo, RoundRobin
from policies.placement.scorers import ExpectedCompletion, ModelLoad, SessionAffinity

FG, BG, OFF = 10, 3, 0
OFFLINE_CLASS = {0: 0, 1: 0, 2: 0}  # guaranteed: priority -> its class


def node(name, work=None, **kw):
    """A view whose queued work is all of model ``m`` (10 ms a row unless given)."""
    kw.setdefault("models", frozenset({"m"}))
    kw.setdefault("loaded", frozenset({"m"}))
    kw.setdefault("row_cost_s", {"m": 0.010})
    work = work or {}
    per_row = kw["row_cost_s"].get("m", UNTIMED_ROW_COST.caller_s)
    kw.setdefault("backlog_s", {p: n * per_row for p, n in work.items()})
    return NodeView(name=name, work=work, **kw)


def names(nodes):
    return [n.name for n in nodes]


def test_foreground_goes_where_least_higher_priority_work_waits():
    # a: 12 background requests queued (a longer queue); b: 5 foreground requests.
    a = node("a", {BG: 12})
    b = node("b", {FG: 5})
    policy = make_placement("expected_completion")
    assert names(policy.rank([a, b], PlacementRequest("m", FG), random.Random(0))) == ["a", "b"]
    # ...while background work goes where less work of its priority or above waits.
    assert names(policy.rank([a, b], PlacementRequest("m", BG), random.Random(0)))[0] == "b"
    # A long enough background queue is worth avoiding: foreground delays all of it.
    a = node("a", {BG: 30})
    assert names(policy.rank([a, b], PlacementRequest("m", FG), random.Random(0)))[0] == "b"
    blind = make_placement(PlacementParams(lower_share=0.0))
    assert names(blind.rank([a, b], PlacementRequest("m", FG), random.Random(0)))[0] == "a"


@pytest.mark.parametrize(
    ("view", "request_", "expected"),
    [
        (node("a", {BG: 2}), PlacementRequest("m", FG), 0.010),
        (node("a", {BG: 2}), PlacementRequest("m", BG), 0.030),
        # 4 ms left + 10 ahead + half a background call it cannot preempt (gap 4) + 10
        (node("a", {FG: 1, BG: 2}, running_left_s=0.004), PlacementRequest("m", 7), 0.029),
        (node("a", {}, row_cost_s={}), PlacementRequest("m", FG, rows=2), 0.010),  # default cost
        (node("a", {}, row_cost_s={"x": 0.002}), PlacementRequest("m", FG), 0.002),  # other model
        # queued work priced at its own model: 2 x 50 ms rows ahead, 10 ms for this one
        (node("a", {FG: 2}, backlog_s={FG: 0.100}), PlacementRequest("m", FG), 0.110),
    ],
)
def test_expected_completion_table(view, request_, expected):
    assert ExpectedCompletion(lower_share=0.0).cost(view, request_) == pytest.approx(expected)


def test_expected_completion_prices_what_it_cannot_preempt_and_what_overtakes_it():
    ec = ExpectedCompletion(lower_share=0.0)
    fg = PlacementRequest("m", FG)
    # priority 7 work may be running and cannot be preempted by foreground (gap 3 < 5)
    inline = node("a", {7: 2})
    assert ec.cost(inline, fg) == pytest.approx(0.010 + 0.5 * 0.010)
    assert ec.cost(node("a", {BG: 2}), fg) == pytest.approx(0.010)  # preemptible: free
    assert ec.cost(node("a", {BG: 2}, preempt_gap=None), fg) == pytest.approx(0.015)
    # higher work keeps b busy 60 % of the time: background waits 1 / (1 - 0.6) as long
    bg = PlacementRequest("m", BG)
    assert ec.cost(node("b", busy={FG: 0.6}), bg) == pytest.approx(0.010 / 0.4)
    assert ec.cost(node("b", busy={BG: 0.6, OFF: 0.3}), bg) == pytest.approx(0.010)
    assert ec.cost(node("b", busy={FG: 5.0}), bg) == pytest.approx(0.010 / 0.1)  # capped
    # lower_share: the delay this request adds to the lower work it overtakes
    assert ExpectedCompletion(0.5).cost(node("a", {BG: 4}), fg) == pytest.approx(0.030)


def test_expected_completion_knows_which_call_it_would_wait_for():
    ec = ExpectedCompletion(lower_share=0.0)
    fg = PlacementRequest("m", FG)
    # a background call with 8 ms left: foreground preempts it and does not wait
    running_bg = node("a", {BG: 1}, running_left_s=0.008, running_priority=BG)
    assert ec.cost(running_bg, fg) == pytest.approx(0.010)
    # an inline call (gap 3 < 5) with 8 ms left: foreground waits for the rest of it,
    # not for half a call as when it is only known that such work is queued
    running_inline = node("a", {7: 1}, running_left_s=0.008, running_priority=7)
    assert ec.cost(running_inline, fg) == pytest.approx(0.018)
    assert ec.cost(node("a", {7: 1}), fg) == pytest.approx(0.015)
    # the call's priority unknown (an old report): its rest counts, as before
    assert ec.cost(node("a", {BG: 1}, running_left_s=0.008), fg) == pytest.approx(0.018)
    # work of its own priority is never preempted
    running_fg = node("a", {FG: 1}, running_left_s=0.008, running_priority=FG)
    assert ec.cost(running_fg, fg) == pytest.approx(0.008 + 0.010 + 0.010)


@pytest.mark.parametrize(
    ("view", "request_", "expected"),
    [
        (node("a"), PlacementRequest("m", FG), 0.0),
        (node("a", loaded=frozenset(), load_cost_s={"m": 0.3}), PlacementRequest("m", FG), 0.3),
        (node("a", loaded=frozenset()), PlacementRequest("m", FG), 1.0),
    ],
)
def test_model_load_table(view, request_, expected):
    assert ModelLoad().cost(view, request_) == expected
    assert ModelLoad(2.0).cost(node("a", loaded=frozenset()), PlacementRequest("m", FG)) == 2.0


@pytest.mark.parametrize(
    ("sessions", "session", "expected"),
    [(frozenset({"s1"}), "s1", 0.0), (frozenset({"s1"}), "s2", 0.5), (frozenset(), None, 0.0)],
)
def test_session_affinity_table(sessions, session, expected):
    view = node("a", sessions=sessions)
    assert SessionAffinity(0.5).cost(view, PlacementRequest("m", FG, session=session)) == expected


@pytest.mark.parametrize(
    ("flt", "view", "priority", "keep"),
    [
        (ServesModel(), node("a"), FG, True),
        (ServesModel(), node("a", models=frozenset({"x"})), FG, False),
        (Healthy(), node("a", healthy=False), FG, False),
        (Healthy(), node("a", draining=True), FG, False),
        # shedding: background may fill 3/4 of a queue, offline half, foreground all
        (ShedBelowPriority({3: 0.75, 0: 0.5}), node("a", {BG: 2}, capacity=4), BG, True),
        (ShedBelowPriority({3: 0.75, 0: 0.5}), node("a", {BG: 3}, capacity=4), BG, False),
        (ShedBelowPriority({3: 0.75, 0: 0.5}), node("a", {BG: 1}, capacity=4), OFF, True),
        (ShedBelowPriority({3: 0.75, 0: 0.5}), node("a", {BG: 2}, capacity=4), OFF, False),
        (ShedBelowPriority({3: 0.75, 0: 0.5}), node("a", {BG: 3}, capacity=4), FG, True),
        # what the other callers likely sent since the report counts (2 + 0.5 + 1 > 3)
        (ShedBelowPriority({3: 0.75}), node("a", {BG: 2}, capacity=4, unseen=0.5), BG, False),
        (ShedBelowPriority({3: 0.75}), node("a", {BG: 1}, capacity=4, unseen=1.0), BG, True),
        (ShedBelowPriority({3: 0.75, 0: 0.5}), node("a", {BG: 3}, capacity=4), 5, True),
        # a class with a starvation bound on the node (offline: priorities 0-2) may always
        # send one request past its limit to a node that holds none of it...
        (
            ShedBelowPriority({3: 0.75, 0: 0.5}),
            node("a", {BG: 3}, capacity=4, guaranteed=OFFLINE_CLASS),
            OFF,
            True,
        ),
        (
            ShedBelowPriority({3: 0.75, 0: 0.5}),
            node("a", {BG: 2, 1: 1}, capacity=4, guaranteed=OFFLINE_CLASS),
            OFF,
            False,
        ),
        # ...and only that class
        (
            ShedBelowPriority({3: 0.75, 0: 0.5}),
            node("a", {BG: 3}, capacity=4, guaranteed=OFFLINE_CLASS),
            BG,
            False,
        ),
        # no limit for foreground: even a node the router counts as full is left to decide
        (ShedBelowPriority({3: 0.75}), node("a", {FG: 9}, capacity=4), FG, True),
    ],
)
def test_filters_table(flt, view, priority, keep):
    assert flt.keep(view, PlacementRequest("m", priority)) is keep


def test_pickers():
    scored = [(node("c"), 3.0), (node("a"), 1.0), (node("b"), 1.0)]
    assert names(Best().order(scored, random.Random(0))) == ["a", "b", "c"]
    rr = RoundRobin()
    firsts = [rr.order(scored, random.Random(0))[0].name for _ in range(4)]
    assert firsts == ["a", "b", "c", "a"]
    p2 = PowerOfTwo()
    big = [(node(f"n{i}"), float(i)) for i in range(10)]
    order = names(p2.order(big, random.Random(3)))
    assert sorted(order) == sorted(names(n for n, _ in big))
    first_two = order[:2]
    assert [n for n in order[2:]] == sorted(order[2:], key=lambda s: int(s[1:]))
    assert int(first_two[0][1:]) < int(first_two[1][1:])
    assert names(p2.order(big, random.Random(3))) == order  # seeded: reproducible


def test_near_best_picks_at_random_within_the_tie_band_only():
    scored = [(node("a"), 0.0100), (node("b"), 0.0105), (node("c"), 0.0109), (node("d"), 0.05)]
    picker = NearBest(tie_s=0.0, tie_ratio=0.1)  # within 1 ms of the 10 ms best
    firsts = Counter(picker.order(scored, random.Random(i))[0].name for i in range(200))
    assert set(firsts) == {"a", "b", "c"} and min(firsts.values()) > 30
    for i in range(20):
        order = names(picker.order(scored, random.Random(i)))
        assert sorted(order) == ["a", "b", "c", "d"] and order[-1] == "d"
    assert names(NearBest(tie_s=0.0, tie_ratio=0.0).order(scored, random.Random(0)))[0] == "a"


def test_near_best_widens_its_band_with_the_share_of_placements_made_elsewhere():
    scored = [(node("a"), 0.010), (node("b"), 0.012), (node("c"), 0.013), (node("d"), 0.05)]
    picker = NearBest(tie_s=0.0, tie_ratio=0.05, crowd_ratio=0.3)

    def firsts(crowd: float) -> Counter[str]:
        return Counter(picker.order(scored, random.Random(i), crowd)[0].name for i in range(300))

    assert firsts(0.0) == {"a": 300}  # alone: within 5 % of the best only
    half = firsts(0.5)  # a band of 5 + 15 % of the best
    assert set(half) == {"a", "b"} and min(half.values()) > 100
    crowded = firsts(1.0)  # 5 + 30 %
    assert set(crowded) == {"a", "b", "c"} and min(crowded.values()) > 60


@pytest.mark.parametrize(
    ("elapsed", "work", "backlog", "running", "expected"),
    [
        (
            0.0,
            {FG: 2, BG: 4},
            {FG: 0.02, BG: 0.04},
            0.005,
            ({FG: 2, BG: 4}, {FG: 0.02, BG: 0.04}, 0.005),
        ),
        # the running call first, then foreground, then half of background
        (0.045, {FG: 2, BG: 4}, {FG: 0.02, BG: 0.04}, 0.005, ({BG: 2}, {BG: 0.02}, 0.0)),
        (1.0, {FG: 2, BG: 4}, {FG: 0.02, BG: 0.04}, 0.005, ({}, {}, 0.0)),
        # work of no known cost is not drained by time
        (1.0, {FG: 2}, {}, 0.0, ({FG: 2}, {}, 0.0)),
    ],
)
def test_drain_ages_a_report_highest_priority_first(elapsed, work, backlog, running, expected):
    counts, seconds, left = drain(work, backlog, running, elapsed)
    assert counts == expected[0]
    assert seconds == pytest.approx(expected[1])
    assert left == pytest.approx(expected[2])


def test_pipelines_are_built_from_named_plugins():
    p = make_placement(PlacementParams(scorers={"expected_completion": 1.0}, picker="best"))
    assert [type(s).__name__ for s, _ in p.scorers] == ["ExpectedCompletion"]
    assert isinstance(p.picker, Best)
    assert isinstance(make_placement("expected_completion").picker, NearBest)
    with pytest.raises(ValueError, match="known: expected_completion, model_load"):
        PlacementParams(scorers={"latency": 1.0})
    with pytest.raises(ValueError, match="unknown picker 'first'; known: best, near_best"):
        PlacementParams(picker="first")


def test_the_policy_names_come_from_the_registry():
    assert placement_policies() == tuple(POLICIES)
    assert placement_policies()[0] == PlacementParams().policy  # the default first
    described = PlacementParams.model_fields["policy"].description or ""
    assert all(name in described for name in placement_policies())


CONFORMANCE = (
    [PlacementParams(policy=name) for name in sorted(placement_policies())]
    + [PlacementParams(picker=picker) for picker in sorted(PICKERS)]
    + [PlacementParams(scorers={name: 1.0}) for name in sorted(SCORERS)]
)


@pytest.mark.parametrize("params", CONFORMANCE, ids=lambda p: f"{p.policy}-{p.picker}-{p.scorers}")
def test_conformance_every_policy_picker_and_scorer(params):
    """Every registered policy, picker and scorer: returns only eligible nodes, each
    once; honours filters; is deterministic for a seed; handles an empty fleet."""
    rng_nodes = random.Random(42)
    fleet = [
        node(
            f"n{i}",
            {p: rng_nodes.randint(0, 10) for p in (FG, BG, OFF)},
            capacity=64,
            healthy=i != 3,
            draining=i == 4,
            models=frozenset({"m"} if i != 5 else {"x"}),
            loaded=frozenset({"m"} if i % 2 else set()),
        )
        for i in range(8)
    ]
    eligible = {n.name for n in fleet if n.healthy and not n.draining and "m" in n.models}
    for priority in (FG, 7, BG, OFF):
        req = PlacementRequest("m", priority, session="s")
        a = make_placement(params).rank(fleet, req, random.Random(9))
        b = make_placement(params).rank(fleet, req, random.Random(9))
        assert names(a) == names(b)
        assert len(names(a)) == len(set(names(a)))
        assert set(names(a)) <= eligible
        if priority == FG:
            assert set(names(a)) == eligible  # nothing is shed for foreground
    assert make_placement(params).rank([], PlacementRequest("m", FG), random.Random(0)) == []


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(ValueError, match="expected_completion"):
        make_placement("fastest")
