"""Placement in the caller (spill, shed, re-placement, failover, stale views, herding)
and the router's membership, over real node runtimes with fake engines (no Ray)."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import random
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import cluster.client as client_module
from actors.node import NodeRuntime
from cluster.dispatch import Dispatcher, FleetView, FutureCalls, NodeGone, NodeReport
from cluster.router import CALLER_SEEN_S, Router
from edgefleet.clock import FakeClock
from edgefleet.config import parse_config
from edgefleet.errors import Cancelled, EngineTimeout, Evicted, ModelNotFound, NodeLost, Rejected
from edgefleet.messages import ModelStatus, NodeStatus, Reply, RunningStatus
from edgefleet.request import InferRequest
from policies.placement import PlacementRequest
from tests.fakes import HANG, FakeLoader, LocalFleet, x


def make_config(nodes, *, shed=None, capacity=8, placement=None):
    return parse_config(
        {
            "fleet": {"name": "t"},
            "models": {"m": {"path": "m.onnx", "warmup": False, "memory_mb": 1}},
            "node_defaults": {"queue": {"capacity": capacity}},
            "nodes": [{"name": n, **extra} for n, extra in nodes.items()],
            "router": {
                "placement": {
                    "shed": shed if shed is not None else {"background": 0.75},
                    **(placement or {}),
                },
                "report_interval_s": 0.05,
                "lost_after_s": 0.5,
            },
        },
        Path("/nonexistent"),
    )


@pytest.fixture
def fleet():
    made = []

    def make(nodes, *, cost_s=0.0, **kw):
        f = LocalFleet(
            make_config(nodes, **kw),
            lambda spec: NodeRuntime(spec, loader=FakeLoader(m={"cost_s": cost_s})),
        )
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def req(priority=10, rid=None, value=1.0):
    kw = {"id": rid} if rid else {}
    return InferRequest(model="m", inputs=x(value), priority=priority, **kw)


def wait_for(cond, timeout=30.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.005)


def test_spills_to_the_next_node_when_one_refuses(fleet):
    f = fleet({"a": {}, "b": {"queue": {"capacity": 1}}}, cost_s=0.2)
    # Fill b (one running, one queued) behind the dispatcher's back, and make a refuse.
    blockers = [f.spawn(f.node("b").infer(req(10)))]
    wait_for(lambda: f.node("b").status().running is not None)
    blockers.append(f.spawn(f.node("b").infer(req(10))))
    wait_for(lambda: f.node("b").status().queue_length == 1)
    f.node("a")._sched.draining = True
    reply = f.infer(req(10))
    assert isinstance(reply.error, Rejected)
    assert "every node refused" in str(reply.error) and reply.error.retry_after_s > 0
    f.node("a")._sched.draining = False
    reply = f.infer(req(10, value=3.0))
    assert reply.error is None and reply.node == "a"
    np.testing.assert_array_equal(reply.outputs["y"], x(6.0)["x"])
    assert f.counters()["spilled"] >= 2
    for b in blockers:
        b.result(30)


def test_a_request_out_when_the_client_closes_ends_cancelled(fleet):
    f = fleet({"a": {}, "b": {}})
    f.node("a")._sched.draining = True  # behind the dispatcher's back: a refuses...
    f.node("b")._sched.draining = True
    f.dispatcher.close()  # ...and the next attempt would come after the close
    reply = f.dispatcher.submit(req(10)).result(30)
    assert isinstance(reply.error, Cancelled) and "client was closed" in str(reply.error)


def reported(f, at=None, **queued_rows):
    """A report of node ``name`` with ``queued_rows`` as {priority: rows of m}, made at
    ``at`` on the node's clock (default: now)."""
    idle = replace(f.node("a").status(), queued={}, queued_rows={}, running=None)
    if at is not None:
        idle = replace(idle, at=at)
    return {
        name: NodeReport(
            replace(
                idle, name=name, queued=dict(q), queued_rows={p: {"m": n} for p, n in q.items()}
            ),
            True,
            0.0,
        )
        for name, q in queued_rows.items()
    }


def test_an_idle_nodes_view_is_kept_until_a_report_or_a_request_changes_it(fleet):
    f = fleet({"a": {}, "b": {}}, cost_s=0.05, capacity=64)
    d = f.dispatcher
    d.update(FleetView(reported(f, a={}, b={3: 4})))
    idle, busy = d.views()
    time.sleep(0.01)  # past the reuse window of a view that ages
    again, aged = d.views()
    assert again is idle and aged is not busy  # only a node with work ages
    d.update(FleetView(reported(f, a={10: 3}, b={})))  # a report: a view anew
    (a, _) = d.views()
    assert a is not idle and a.work == {10: 3}
    d.update(FleetView(reported(f, a={}, b={})))
    before = {v.name: v for v in d.views()}
    reply = d.submit(req(10)).result(30)
    assert reply.error is None
    after = {v.name: v for v in d.views()}  # a send and its answer changed its node's
    assert after[reply.node] is not before[reply.node] and not after[reply.node].work


def test_foreground_goes_to_the_node_with_least_higher_priority_work(fleet):
    f = fleet({"a": {}, "b": {}}, cost_s=0.05, capacity=64, placement={"picker": "best"})
    # a reports 12 background requests queued (a longer queue), b 5 foreground ones.
    f.dispatcher.update(FleetView(reported(f, a={3: 12}, b={10: 5})))
    assert f.dispatcher.rank(PlacementRequest("m", 10))[0] == "a"  # background is not ahead
    assert f.dispatcher.rank(PlacementRequest("m", 3))[0] == "b"


def test_queued_work_is_priced_at_its_own_model_and_aged_by_the_report(fleet):
    f = fleet({"a": {}, "b": {}}, capacity=64, placement={"picker": "best"})
    base = replace(f.node("a").status(), queued={}, queued_rows={}, running=None)
    models = tuple(replace(m, row_ms=1.0) for m in base.models) + (
        replace(base.models[0], name="big", row_ms=50.0),
    )
    # a: 10 rows of a 1 ms model; b: 2 rows of a 50 ms model. Counting requests
    # alone, b looks emptier; priced by model, a finishes sooner.
    a = replace(base, name="a", models=models, queued={10: 10}, queued_rows={10: {"m": 10}})
    b = replace(base, name="b", models=models, queued={10: 2}, queued_rows={10: {"big": 2}})
    f.dispatcher.update(FleetView({"a": NodeReport(a, True, 0.0), "b": NodeReport(b, True, 0.0)}))
    assert f.dispatcher.rank(PlacementRequest("m", 10))[0] == "a"
    # The same reports 0.2 s old, to another caller: b has worked off its 100 ms since,
    # a its 10 ms.
    other = Dispatcher(f.config, f.handles)
    other.update(FleetView({"a": NodeReport(a, True, 0.2), "b": NodeReport(b, True, 0.2)}))
    views = {v.name: v for v in other.views()}
    assert views["a"].backlog_s == {} and views["b"].backlog_s == {}
    other.close()


def test_an_older_view_does_not_replace_a_fresher_report(fleet):
    f = fleet({"a": {}, "b": {}}, placement={"picker": "best"})
    f.dispatcher.update(FleetView(reported(f, at=1e6, a={10: 30}, b={})))  # a is busy
    # A view that was in transit meanwhile: its reports were made before, however young
    # its age says they are on arrival.
    f.dispatcher.update(FleetView(reported(f, at=1e6 - 1, a={}, b={})))
    views = {v.name: v for v in f.dispatcher.views()}
    # The fresher report's 30 rows, aged by the moments since it came (the older view
    # has none).
    assert set(views["a"].work) == {10} and 25 <= views["a"].work[10] <= 30, views["a"].work
    assert f.dispatcher.rank(PlacementRequest("m", 10))[0] == "b"


def test_work_sent_since_the_report_counts_until_it_is_answered(fleet):
    f = fleet({"a": {}, "b": {}}, cost_s=0.3, capacity=64, placement={"picker": "best"})
    first = [f.dispatcher.submit(req(10, rid=f"r{i}")) for i in range(6)]
    # One stale view of two idle nodes: without local accounting all six go to a. A
    # node's view counts what it was sent and has not answered (on a busy machine a
    # node may have answered some by the time the views are read).

    def counted(node: str) -> tuple[int, int]:
        answered = sum(1 for r in first if r.done() and r.result().node == node)
        pending = {v.name: v for v in f.dispatcher.views()}[node].work.get(10, 0)
        return pending, answered

    def split() -> bool:
        return all(p >= 1 and p + a == 3 for p, a in map(counted, "ab"))

    wait_for(split)
    replies = [r.result(30) for r in first]
    assert Counter(r.node for r in replies) == {"a": 3, "b": 3}
    assert all(not v.work for v in f.dispatcher.views())  # answered: no longer counted


def test_background_is_shed_before_foreground(fleet):
    f = fleet({"a": {}}, cost_s=0.3, capacity=4, shed={"background": 0.5})
    first = [f.dispatcher.submit(req(3)) for _ in range(2)]
    shed = f.infer(req(3))
    assert isinstance(shed.error, Rejected) and "shed" in str(shed.error)
    assert shed.error.retry_after_s > 0
    fg = f.infer(req(10))
    assert fg.error is None
    assert f.counters()["shed"] == 1
    for r in first:
        assert r.result(30).error is None


@pytest.mark.parametrize("bound", [True, False])
def test_a_guaranteed_class_is_not_shed_from_a_node_holding_none_of_it(fleet, bound):
    starvation = {"starvation": {"classes": {"offline": {"max_wait_ms": 100}}}}
    f = fleet(
        {"a": starvation if bound else {}},
        cost_s=0.2,
        capacity=4,
        shed={"background": 0.75, "offline": 0.5},
    )
    flood = [f.dispatcher.submit(req(3)) for _ in range(3)]  # past offline's half
    first = f.dispatcher.submit(req(0))
    second = f.infer(req(0))
    assert isinstance(second.error, Rejected) and "shed" in str(second.error)
    if bound:  # one offline request at a time reaches the node, which serves it in time
        assert first.result(30).error is None
        assert f.counters()["shed"] == 1
    else:  # no guarantee: offline is shed while the queue is past its share
        assert isinstance(first.result(30).error, Rejected)
        assert f.counters()["shed"] == 2
    assert all(r.result(30).error is None for r in flood)


def _busy_until_cancelled(f: LocalFleet, node: str) -> Any:
    """Keep ``node`` busy with a call that runs until it is cancelled (or its time
    limit ends it): a test has all the time a busy machine needs to queue behind it."""
    running = f.spawn(f.node(node).infer(req(10, rid="busy", value=HANG)))
    wait_for(lambda: f.node(node).status().running is not None)
    return running


def _release(f: LocalFleet, node: str, running: Any) -> None:
    f.loop.call_soon_threadsafe(f.node(node).cancel, "busy")
    assert isinstance(running.result(60).error, (Cancelled, EngineTimeout))


def test_evicted_request_is_placed_again_on_another_node(fleet):
    f = fleet({"a": {"queue": {"capacity": 1}}, "b": {}}, shed={})
    running = _busy_until_cancelled(f, "a")
    f.dispatcher.update(FleetView(reported(f, a={}, b={10: 50})))  # ...b looks worse
    victim = f.dispatcher.submit(req(3, rid="victim"))
    wait_for(lambda: f.node("a").status().queue_length == 1)
    evicting = f.spawn(f.node("a").infer(req(10)))  # evicts the victim from a's one slot
    reply = victim.result(30)
    assert reply.error is None and reply.node == "b"
    assert f.counters()["replaced"] == 1
    _release(f, "a", running)
    assert evicting.result(30).error is None


def test_evicted_fails_only_when_no_node_has_room(fleet):
    f = fleet({"a": {"queue": {"capacity": 1}}}, shed={})
    running = _busy_until_cancelled(f, "a")
    victim = f.dispatcher.submit(req(3))
    wait_for(lambda: f.node("a").status().queue_length == 1)
    evicting = f.spawn(f.node("a").infer(req(10)))
    assert isinstance(victim.result(30).error, Evicted)
    _release(f, "a", running)
    assert evicting.result(30).error is None


def test_requests_on_a_dying_node_are_placed_again_and_answered_once(fleet):
    f = fleet({"a": {}, "b": {}}, cost_s=0.05, capacity=64, shed={})
    futures = [f.dispatcher.submit(req(10, rid=f"r{i}")) for i in range(40)]
    wait_for(lambda: f.node("a").status().queue_length > 0)
    f.handles["a"].dead = True
    replies = [r.result(60) for r in futures]
    assert sorted(r.request_id for r in replies) == sorted(f"r{i}" for i in range(40))
    assert all(r.error is None for r in replies), [r.error for r in replies if r.error]
    counters = f.counters()
    assert counters["nodes_lost"] == 1 and counters["replaced"] >= 1
    assert not f.router.status_now().healthy["a"] and not f.dispatcher.healthy()["a"]
    late = f.infer(req(10))
    assert late.node == "b"
    f.handles["a"].dead = False  # the node comes back: the next poll lets it rejoin
    f.refresh()
    assert f.router.status_now().healthy["a"] and f.router.status_now().router["rejoined"] == 1
    assert f.dispatcher.healthy()["a"]


def test_a_pipeline_answers_each_request_once_with_at_most_in_flight_unanswered(fleet):
    f = fleet({"a": {}, "b": {}}, cost_s=0.002, capacity=64, shed={})
    drawn = 0

    def requests():
        nonlocal drawn
        for i in range(60):
            drawn += 1
            yield req(10, rid=f"p{i}"), None

    seen: dict[int, str] = {}
    most = 0
    for i, reply in f.dispatcher.pipeline(requests(), 5):
        most = max(most, drawn - len(seen))
        assert i not in seen and reply.error is None, reply
        seen[i] = reply.request_id
    assert seen == {i: f"p{i}" for i in range(60)}
    assert most == 5  # never more than in_flight drawn and unanswered
    runs = sum(f.node(n).status().counters["completed"] for n in f.handles)
    assert runs == 60
    assert {e.name: len(e.inflight) for e in f.dispatcher._nodes.values()} == {"a": 0, "b": 0}


def test_a_pipeline_places_the_requests_of_a_dying_node_again(fleet):
    f = fleet({"a": {}, "b": {}}, cost_s=0.05, capacity=64, shed={})
    replies: dict[int, object] = {}
    items = ((req(10, rid=f"d{i}"), None) for i in range(40))
    for i, reply in f.dispatcher.pipeline(items, 40):
        if not replies:  # the first answer: everything else is out, a has some of it
            f.handles["a"].dead = True
        replies[i] = reply
    assert sorted(replies) == list(range(40))
    assert all(r.error is None for r in replies.values())  # type: ignore[attr-defined]
    assert f.counters()["replaced"] >= 1
    assert {r.node for r in list(replies.values())[-5:]} == {"b"}  # type: ignore[attr-defined]


def test_a_pipeline_stopped_early_stops_counting_what_it_sent(fleet):
    f = fleet({"a": {}, "b": {}}, cost_s=0.5, capacity=64, shed={})
    it = f.dispatcher.pipeline(((req(10), None) for _ in range(100)), 8)
    next(it)  # the first answer: the others are still out (each node runs one at a time)
    assert 1 <= sum(len(e.inflight) for e in f.dispatcher._nodes.values()) <= 7
    it.close()
    assert sum(len(e.inflight) for e in f.dispatcher._nodes.values()) == 0
    with pytest.raises(ValueError, match="in_flight"):
        next(f.dispatcher.pipeline([], 0))


def test_at_most_once_requests_on_a_dying_node_end_node_lost_and_run_nowhere_else(fleet):
    f = fleet({"a": {}, "b": {}}, cost_s=0.05, capacity=64, shed={}, placement={"picker": "best"})
    futures = [
        f.dispatcher.submit(replace(req(10, rid=f"r{i}"), at_most_once=True)) for i in range(20)
    ]
    wait_for(lambda: f.node("a").status().queue_length > 0)
    f.handles["a"].dead = True
    replies = [r.result(60) for r in futures]
    assert sorted(r.request_id for r in replies) == sorted(f"r{i}" for i in range(20))
    on_a = [r for r in replies if r.error is not None]
    assert on_a and all(isinstance(r.error, NodeLost) for r in on_a)
    assert "may have run" in str(on_a[0].error)
    # None of them went to b: b ran only those placed there in the first place (a may
    # have answered some before it died, when the machine is slow to notice its queue).
    ran_on_b = f.node("b").status().counters.get("completed", 0)
    assert ran_on_b == sum(r.error is None and r.node == "b" for r in replies)


@pytest.mark.parametrize("path", ["submit", "call"])
def test_an_at_most_once_request_is_not_asked_again_when_its_node_is_out_of_reach(fleet, path):
    f = fleet({"a": {}, "b": {}}, cost_s=0.05, shed={}, placement={"picker": "best"})
    for h in f.handles.values():
        h.unreachable = 1  # the node runs it; the caller only hears "unavailable"
    request = replace(req(10, rid=f"amo-{path}"), at_most_once=True)
    reply = (
        f.dispatcher.submit(request).result(30) if path == "submit" else f.dispatcher.call(request)
    )
    assert isinstance(reply.error, NodeLost), reply

    def runs():
        return sum(f.node(n).status().counters.get("completed", 0) for n in f.handles)

    wait_for(lambda: runs() >= 1)  # it ran where it was sent, and only there
    time.sleep(0.2)
    assert runs() == 1


def test_every_node_lost_or_unknown_model(fleet):
    f = fleet({"a": {}})
    f.handles["a"].dead = True
    reply = f.infer(req(10))
    assert isinstance(reply.error, NodeLost)
    unknown = f.infer(InferRequest(model="zzz", inputs=x(1.0)))
    assert isinstance(unknown.error, ModelNotFound)
    assert "the fleet serves: m" in str(unknown.error)
    # The client asks the same question before it builds a request.
    assert f.dispatcher.unknown_model("m") is None
    asked = f.dispatcher.unknown_model("zzz")
    assert str(asked) == str(unknown.error) and asked.request_id is None


def test_shed_clients_are_told_to_come_back_in_turn(fleet):
    f = fleet({"a": {}}, cost_s=0.3, capacity=4, shed={"background": 0.5})
    first = [f.dispatcher.submit(req(3)) for _ in range(2)]
    # The caller's clock stands still while it sheds five: on a busy machine the real
    # one could pass a waiter's turn between two of them (that waiter then no longer
    # waits, and the next is rightly told a shorter time).
    f.dispatcher._clock = FakeClock(f.dispatcher._clock.now())
    hints = [f.infer(req(3)).error.retry_after_s for _ in range(5)]
    assert hints == sorted(hints) and hints[-1] > hints[0]  # later waiters wait longer
    for r in first:
        r.result(30)


def test_a_caller_keeps_its_own_counts_after_handing_them_to_the_router(fleet):
    f = fleet({"a": {}}, cost_s=0.0)
    for _ in range(3):
        assert f.infer(req(10)).error is None
    assert f.counters()["completed"] == 3  # handed over to the router...
    assert f.counters()["completed"] == 3  # (each time: counted once)
    counted = f.dispatcher.counted()  # ...and still this caller's own
    assert counted["received"] == 3 and counted["completed"] == 3


def test_shed_requests_come_back_in_turn_across_callers(fleet):
    """A second caller's shed requests queue behind the first caller's, through the
    router's view: two callers do not each tell theirs to come back first."""
    f = fleet({"a": {}}, cost_s=0.3, capacity=4, shed={"background": 0.5})
    assert f.infer(req(3)).error is None  # the node measures its cost: reports drain slowly
    first = [f.dispatcher.submit(req(3)) for _ in range(2)]  # the node is at the limit
    other = Dispatcher(f.config, f.handles)
    try:
        deadline = time.monotonic() + 30
        while sum(f.node("a").status().queued.values()) + 1 < 2:  # one may be running
            assert time.monotonic() < deadline
            time.sleep(0.01)
        f.refresh()
        other.update(f.router.fleet_view("other"))
        hints = [other.submit(req(3)).result(30).error.retry_after_s for _ in range(3)]
        assert other.shed_waiting() == 3
        f.router.fleet_view("other", None, other.shed_waiting())  # its view feed reports them
        f.refresh()
        f.dispatcher.update(FleetView({}))  # fresh reports without it (status()) keep it
        mine = f.infer(req(3)).error.retry_after_s
        assert mine > hints[-1]  # after the other caller's three, not alongside its first
        f.refresh()
        assert f.router.fleet_view("other", None, 3).shed_waiting == 1  # what "test" has out
    finally:
        other.close()
    for r in first:
        r.result(30)


def test_a_failing_node_handle_gives_a_typed_answer_not_a_hang(fleet):
    f = fleet({"a": {}})

    def broken(request, inputs=None):
        raise RuntimeError("handle bug")

    f.handles["a"].infer = broken  # type: ignore[method-assign]
    reply = f.infer(req(10))
    assert isinstance(reply.error, NodeLost) and "handle bug" in str(reply.error)


@pytest.mark.parametrize(("picker", "herd"), [("best", True), ("near_best", False)])
def test_four_callers_on_one_stale_view_do_not_herd(fleet, picker, herd):
    """Four callers see the same view of four idle nodes (a report that will not change
    while they place). Each places 8 slow requests at once. With the near-best picker
    and each caller's own in-flight accounting they spread over the nodes; the best
    picker sends every caller's first request to the same node."""
    f = fleet(
        {n: {} for n in "abcd"}, cost_s=0.5, capacity=64, shed={}, placement={"picker": picker}
    )
    view = FleetView(reported(f, a={}, b={}, c={}, d={}))
    callers = []
    for i in range(4):
        d = Dispatcher(f.config, f.handles, rng=random.Random(i))
        d.update(view)
        callers.append(d)
    firsts = [d.submit(req(3, rid=f"c{i}-0")) for i, d in enumerate(callers)]
    rest = [d.submit(req(3, rid=f"c{i}-{k}")) for k in range(1, 8) for i, d in enumerate(callers)]
    replies = [r.result(60) for r in firsts + rest]
    assert all(r.error is None for r in replies)
    first_nodes = {r.node for r in replies[:4]}
    per_node = Counter(r.node for r in replies)
    if herd:
        assert first_nodes == {"a"}
    else:
        assert len(first_nodes) >= 2, first_nodes
        assert max(per_node.values()) <= 12, per_node  # 8 each when even
    for d in callers:
        d.close()


def test_a_caller_counts_its_placements_by_priority_until_it_hands_them_over(fleet):
    f = fleet({"a": {}}, cost_s=0.0)
    for priority in (10, 10, 10, 3):
        assert f.infer(req(priority)).error is None
    assert f.dispatcher.take_placed() == {10: 3, 3: 1}
    assert f.dispatcher.take_placed() == {}  # handed over: counted from zero again


def test_the_router_hands_each_caller_the_placements_the_others_made():
    clock = FakeClock()
    config = make_config({"a": {}})  # reports every 0.05 s: callers count for 0.2 s
    router = Router(config, {"a": object()}, clock=clock)  # type: ignore[dict-item]
    router.fleet_view("one", None, 0, {10: 3, 3: 1})
    assert router.fleet_view("two", None, 0, {10: 5}).placed == {10: 3, 3: 1}
    assert router.fleet_view("one", None, 0, {}).placed == {10: 5}  # not its own
    clock.advance(0.25)  # "two" has not asked for 4 report intervals: stale
    assert router.fleet_view("one", None, 0, {}).placed == {}


def test_the_router_forgets_callers_that_stopped_asking():
    clock = FakeClock()
    router = Router(make_config({"a": {}}), {"a": object()}, clock=clock)  # type: ignore[dict-item]
    for i in range(100):  # short-lived clients: one view each
        router.fleet_view(f"c{i}", None, 1, {10: 1})
    assert router.fleet_view("c0", None, 1, {}).placed == {10: 99}
    clock.advance(CALLER_SEEN_S + 1)
    view = router.fleet_view("late", None, 0, {})
    assert view.shed_waiting == 0 and view.placed == {}
    assert router.status_now().callers == 1
    assert len(router._callers) == len(router._shed_waiting) == len(router._placed) == 1


def test_a_caller_among_busy_callers_spreads_over_more_near_best_nodes(fleet):
    """Alone, a caller sends foreground to the best node. When the fleet's other callers
    made the recent foreground placements (sends its view cannot hold), it picks among
    the nodes near the best. Their background placements, which foreground overtakes,
    change nothing. (A clock that stands still: the reports do not age.)"""
    f = fleet({"a": {}, "b": {}, "c": {}}, capacity=64)
    d = Dispatcher(f.config, f.handles, clock=FakeClock(), rng=random.Random(0))
    d.update(FleetView(reported(f, a={10: 10}, b={10: 12}, c={10: 30})))

    def firsts() -> Counter[str]:
        return Counter(d.rank(PlacementRequest("m", 10))[0] for _ in range(200))

    assert firsts() == {"a": 200}
    d.update(FleetView({}, placed={3: 500}))
    assert firsts() == {"a": 200}
    d.update(FleetView({}, placed={10: 9, 3: 500}))
    spread = firsts()
    assert set(spread) == {"a", "b"} and min(spread.values()) > 50, spread
    for _ in range(81):  # this caller placing most foreground itself narrows it again
        assert d.submit(req(10)).result(30).error is None
    assert d.take_placed() == {10: 81}
    assert d.crowd(10) == pytest.approx(9 / 90)
    assert d.crowd(11) == 0.0
    d.close()


def test_a_view_counts_what_the_other_callers_likely_sent_since_its_report(fleet):
    """A caller's view holds its own sends since a report, not the other callers'; each
    filling a queue to the shed limit on its own view, they filled it past the limit
    together. While a node is busy with the work it reported, a view counts the others'
    recent placements per node for the report's age (for shedding), up to two report
    intervals' worth; an idle node serves them as they come."""
    f = fleet({"a": {}, "b": {}}, capacity=64)
    clock = FakeClock()
    d = Dispatcher(f.config, f.handles, clock=clock, rng=random.Random(0))
    busy = reported(f, a={3: 40}, b={})["a"]
    d.update(FleetView({"a": replace(busy, status=replace(busy.status, running=None))}))
    d.update(FleetView(reported(f, b={})))
    clock.advance(0.02)
    assert [v.unseen for v in d.views()] == [0.0, 0.0]  # alone
    # 6 placed by the others in the last report interval (0.05 s): 60 per node and second
    d.update(FleetView({}, placed={3: 6}))
    clock.advance(0.01)
    a, b = d.views()
    assert (a.unseen, b.unseen) == (pytest.approx(60 * 0.03), 0.0)
    clock.advance(0.1)  # a late report: at most two intervals' worth while a is busy
    assert d.views()[0].unseen == pytest.approx(60 * 0.1)
    d.close()


def test_a_view_carries_each_reported_figure_in_its_own_field(fleet):
    """A view is built with positional arguments (it is built for every candidate of
    every request): each figure of the report lands in the field of its name."""
    f = fleet({"a": {"preemption": {"min_priority_gap": 4}}}, capacity=7)
    clock = FakeClock()
    d = Dispatcher(f.config, f.handles, clock=clock, rng=random.Random(0))
    report = reported(f, a={3: 2})["a"]
    (model,) = report.status.models
    status = replace(
        report.status,
        models=(replace(model, loaded=False, row_ms=4.0, load_ms=900.0),),
        sessions=("s1",),
        busy={3: 0.25},
        running=RunningStatus("m", ("r1", "r2"), 9, elapsed_s=0.001),
    )
    d.update(FleetView({"a": replace(report, status=status)}))
    (v,) = d.views()
    assert (v.name, v.models, v.loaded, v.sessions) == ("a", {"m"}, frozenset(), {"s1"})
    assert (v.healthy, v.draining, v.capacity, v.unseen) == (True, False, 7, 0.0)
    assert v.row_cost_s == {"m": pytest.approx(0.004)}
    assert v.load_cost_s == {"m": pytest.approx(0.9)}
    assert v.work == {3: 2, 9: 2} and v.backlog_s == {3: pytest.approx(0.008)}
    assert v.running_left_s == pytest.approx(0.007) and v.running_priority == 9
    assert v.busy == {3: 0.25} and v.preempt_gap == 4
    (spec,) = f.config.node_specs()
    assert v.guaranteed == spec.starvation.params(f.config.priorities).guaranteed()
    d.close()


def test_nodes_report_measured_load_times_that_placement_prices(fleet):
    f = fleet({"a": {}, "b": {}})
    status = f.node("a").status()
    (model,) = status.models
    assert model.loaded and model.load_ms is not None and model.load_ms >= 0
    f.refresh()
    views = {v.name: v for v in f.dispatcher.views()}
    assert views["a"].load_cost_s == {"m": pytest.approx(model.load_ms / 1000)}


@pytest.mark.parametrize("path", ["submit", "call"])
def test_a_node_out_of_reach_is_asked_again_and_runs_the_request_once(fleet, path):
    """ "Unavailable" (a restarting actor) may mean the request ran: asking another node
    would run it twice. The same node is asked again under the same id and answers it
    once."""
    f = fleet({"a": {}, "b": {}}, cost_s=0.05, shed={}, placement={"picker": "best"})
    for h in f.handles.values():
        h.unreachable = 1
    request = req(10, rid=f"once-{path}")
    reply = (
        f.dispatcher.submit(request).result(30) if path == "submit" else f.dispatcher.call(request)
    )
    assert reply.error is None and reply.request_id == request.id
    runs = sum(f.node(n).status().counters.get("completed", 0) for n in f.handles)
    assert runs == 1, runs
    assert f.handles[reply.node].calls == 2  # asked twice, ran once


def test_a_node_out_of_reach_for_too_long_is_given_up_for_another(fleet):
    f = fleet({"a": {}, "b": {}}, shed={}, placement={"picker": "best"})
    f.handles["a"].unreachable = 10_000  # never answers within router.lost_after_s
    reply = f.infer(req(10))
    assert reply.error is None and reply.node == "b"


def test_the_nodes_holding_a_session_are_weighed_in_name_order(fleet):
    # The picker may choose by position: an order that changed with the process (a
    # set's, by string hashing) made seeded simulations differ from run to run.
    names = [f"n{i:02d}" for i in range(16)]
    f = fleet({n: {} for n in names}, placement={"candidates": 2})
    idle = f.node("n00").status()
    holders = set(names[1::2])
    f.dispatcher.update(
        FleetView(
            {
                n: NodeReport(
                    replace(idle, name=n, sessions=("s",) if n in holders else ()), True, 0.0
                )
                for n in names
            }
        )
    )
    considered = [
        e.spec.name for e in f.dispatcher._considered(PlacementRequest("m", 10, session="s"), set())
    ]
    sampled, added = considered[:2], considered[2:]
    assert added == sorted(added)
    assert set(added) == holders - set(sampled)


class HeldNode(FutureCalls):
    """A node handle that keeps each request it is sent, with its inputs, and answers
    only when the test resolves the call's future."""

    def __init__(self) -> None:
        self.sent: list[tuple[InferRequest, object, cf.Future[Reply]]] = []

    def infer(self, request: InferRequest, inputs: object = None) -> cf.Future[Reply]:
        fut: cf.Future[Reply] = cf.Future()
        self.sent.append((request, inputs, fut))
        return fut


def one_node_report(batchable: bool = True, row_ms: float = 2.0) -> FleetView:
    model = ModelStatus("m", True, batchable, 8, {1: row_ms}, None, 1)
    status = NodeStatus("a", "serving", {}, 0, None, (model,))
    return FleetView({"a": NodeReport(status, True, 0.0)})


def test_inputs_sent_apart_are_priced_by_their_rows_and_not_sent_twice():
    """Large inputs travel as an object reference (``inputs``): the request is priced
    by the rows of its inputs, and sent without them."""
    node = HeldNode()
    d = Dispatcher(make_config({"a": {}}), {"a": node}, clock=FakeClock())
    d.update(one_node_report(row_ms=2.0))
    request = InferRequest(model="m", inputs=x(1.0, rows=5), priority=10)
    reply = d.submit(request, "inputs-ref")
    ((sent, inputs, fut),) = node.sent
    assert sent.id == request.id and dict(sent.inputs) == {} and inputs == "inputs-ref"
    (view,) = d.views()
    assert view.work == {10: 1} and view.backlog_s == {10: pytest.approx(5 * 0.002)}
    fut.set_result(Reply(request.id, "a"))
    assert reply.result(30).error is None
    d.close()


def test_when_every_node_serving_the_model_drains_callers_hear_so_and_nothing_is_shed(fleet):
    f = fleet({"a": {}, "b": {}})
    for name in ("a", "b"):
        f.run(f.node(name).drain())
    f.refresh()
    reply = f.infer(req(10))
    assert isinstance(reply.error, Rejected)
    assert "every node serving 'm' is draining, starting or moving it" in str(reply.error)
    assert reply.error.retry_after_s >= 1.0
    counted = f.dispatcher.counted()
    assert counted["shed"] == 0 and counted["rejected"] == 1
    assert f.dispatcher.shed_waiting() == 0


class ScriptedControl:
    """A node as the router talks to it: answers with ``report`` (which the test sets),
    and holds the request ids in ``holds``."""

    def __init__(self, report: NodeStatus, holds: set[str] | None = None) -> None:
        self.report = report
        self.holds = holds or set()
        self.starts = 0

    async def status(self) -> NodeStatus:
        return self.report

    async def start(self) -> NodeStatus:
        self.starts += 1
        return self.report

    async def cancel(self, request_id: str) -> bool:
        return request_id in self.holds

    async def set_lifecycle(self, state: str) -> NodeStatus:
        self.report = replace(self.report, lifecycle=state)
        return self.report


def node_status(name: str, state: str = "serving", queued: int = 0) -> NodeStatus:
    return NodeStatus(name, state, {10: queued} if queued else {}, 0, None, ())


def test_every_report_the_router_keeps_is_dated_when_it_came():
    """A report's age tells callers how much of its work is done by now: a report the
    router keeps must be dated when it came, whatever the node's state or the call."""
    clock = FakeClock()
    node = ScriptedControl(node_status("a"))
    router = Router(make_config({"a": {}}), {"a": node}, clock=clock)

    async def main() -> None:
        await router.status()
        clock.advance(5.0)
        node.report = node_status("a", "starting", queued=3)  # restarted by Ray
        await router.status()
        view = router.fleet_view("c").nodes["a"]
        assert view.status is not None and view.status.state == "starting"
        assert view.age_s == 0.0
        clock.advance(5.0)
        await router.set_lifecycle("a", "background")
        view = router.fleet_view("c").nodes["a"]
        assert view.status is not None and view.status.lifecycle == "background"
        assert view.age_s == 0.0
        await router.stop()

    asyncio.run(asyncio.wait_for(main(), 30))


class SilentControl(ScriptedControl):
    """A node alive but silent: its calls never end."""

    async def cancel(self, request_id: str) -> bool:
        await asyncio.Event().wait()
        return True


class GoneControl(ScriptedControl):
    async def cancel(self, request_id: str) -> bool:
        raise NodeGone("gone")


def test_cancel_asks_every_node_and_a_silent_or_dead_one_holds_nobody_up():
    """A node out of service (silent, say) may still hold the request: every node is
    asked, each for a bounded time, and failures count as 'not here'."""
    nodes = {
        "a": SilentControl(node_status("a")),
        "b": ScriptedControl(node_status("b"), holds={"r1"}),
        "c": GoneControl(node_status("c")),
    }
    router = Router(make_config(dict.fromkeys(nodes, {})), nodes, clock=FakeClock())
    assert not any(router.status_now().healthy.values())  # none has reported yet

    async def main() -> tuple[bool, bool]:
        return await router.cancel("r1"), await router.cancel("r2")

    assert asyncio.run(asyncio.wait_for(main(), 30)) == (True, False)


LOST = object()  # a call whose reply never came back


class RouterHandle:
    """The router as a client's view feed reaches it (a Ray actor handle, without Ray):
    ``lose`` makes the next calls reach the router and lose their reply."""

    def __init__(self, fleet: LocalFleet) -> None:
        self.fleet = fleet
        self.lose = 0
        self.fleet_view = SimpleNamespace(remote=self._fleet_view)

    def _fleet_view(self, *args):
        async def call():  # on the router's loop, as its actor would
            return self.fleet.router.fleet_view(*args)

        view = self.fleet.run(call())
        if self.lose:
            self.lose -= 1
            return LOST
        return view


def test_counts_whose_delivery_reached_the_router_are_counted_once(fleet, monkeypatch):
    """A view fetch that hands the router this caller's counts and times out on the way
    back is sent again: the router counts what it carries once."""

    def get(refs, timeout_s, what, who="a node"):
        if refs[0] is LOST:
            raise NodeLost(f"{what}: a node did not answer within {timeout_s:.0f} s")
        return refs

    monkeypatch.setattr(client_module, "_get", get)
    f = fleet({"a": {}})
    slow = f.config.router.model_copy(update={"report_interval_s": 60.0})  # fetched by hand
    router = RouterHandle(f)
    feed = client_module._ViewFeed(
        router, f.dispatcher, f.config.model_copy(update={"router": slow}), "feed"
    )
    try:
        for _ in range(3):
            assert f.infer(req(10)).error is None
        router.lose = 2
        for _ in range(2):
            with pytest.raises(NodeLost):
                feed._fetch()
        feed._fetch()
        assert f.router.status_now().router["completed"] == 3
        assert f.infer(req(10)).error is None
        feed._fetch()
        feed._fetch()
        assert f.router.status_now().router["completed"] == 4
    finally:
        feed.stop()
    assert f.router.status_now().router["completed"] == 4
    assert f.dispatcher.counted()["completed"] == 4  # the caller's own, as ever


def test_a_fast_and_a_slow_node_split_the_load_by_their_measured_speed():
    # Devices that differ: each node's cost table is measured on its own device at
    # warm-up, and placement prices a request on each node by that node's table.
    costs = {"fast": 0.01, "slow": 0.05}
    config = parse_config(
        {
            "fleet": {"name": "t"},
            "models": {"m": {"path": "m.onnx", "memory_mb": 1}},
            "nodes": [{"name": n} for n in costs],
            "router": {"report_interval_s": 0.05},
        },
        Path("/nonexistent"),
    )
    f = LocalFleet(
        config, lambda spec: NodeRuntime(spec, loader=FakeLoader(m={"cost_s": costs[spec.name]}))
    )
    try:
        measured = {n: f.node(n).status().models[0].cost_ms[1] for n in costs}
        assert measured["slow"] > 2 * measured["fast"], measured
        served: Counter[str] = Counter()
        for _ in range(20):  # waves of 6 at once: both nodes have work queued
            futures = [f.dispatcher.submit(req(10)) for _ in range(6)]
            for future in futures:
                reply = future.result(60)
                assert reply.error is None, reply.error
                served[reply.node] += 1
            f.refresh()
        # By speed about 5:1; sleeps overshoot on a busy machine, which evens it out.
        assert served["fast"] > 1.5 * served["slow"], served
        assert sum(served.values()) == 120, served
    finally:
        f.close()


def test_a_request_for_model_at_version_goes_only_to_nodes_serving_that_version(fleet, tmp_path):
    from actors.cache import ModelCache, file_source
    from edgefleet.artifacts import describe_files

    versions = {}
    for node, version in (("a", "v1"), ("b", "v2")):
        path = tmp_path / version / "m.onnx"
        path.parent.mkdir()
        path.write_bytes(version.encode())  # the fake engine reads no file
        artifact, files = describe_files("m", path, {}, "tensor", version)
        source = file_source({f.sha256: files[f.name] for f in artifact.files})
        ModelCache(tmp_path / f"cache-{node}", 1 << 20).ensure(artifact, source)
        versions[node] = artifact

    def node_with_its_version(spec):
        spec = spec.model_copy(
            update={
                "artifacts": {"m": versions[spec.name]},
                "store": "none: every file is cached",
                "model_cache": tmp_path / f"cache-{spec.name}",
            }
        )
        return NodeRuntime(spec, loader=FakeLoader())

    f = LocalFleet(make_config({"a": {}, "b": {}}), node_with_its_version)
    try:
        served = [m.version for n in ("a", "b") for m in f.node(n).status().models]
        assert served == ["v1", "v2"]
        for version, node in (("v1", "a"), ("v2", "b")):
            replies = [f.infer(replace(req(), model=f"m@{version}")) for _ in range(6)]
            assert {(r.node, r.error) for r in replies} == {(node, None)}
        unknown = f.infer(replace(req(), model="m@v3"))
        assert isinstance(unknown.error, ModelNotFound)
        assert "at version 'v3'; it serves: v1, v2" in str(unknown.error)
        # A node refuses a version it does not serve: another node may.
        wrong = f.run(f.node("a").infer(replace(req(), version="v2")))
        assert isinstance(wrong.error, Rejected) and "serves m@v1, not @v2" in str(wrong.error)
    finally:
        f.close()


def test_a_node_moving_the_model_to_another_version_is_passed_over(fleet):
    f = fleet({"a": {}, "b": {}})

    def moving(name: str) -> NodeReport:
        s = f.node(name).status()
        return NodeReport(
            replace(s, models=tuple(replace(m, moving=True) for m in s.models)), True, 0.0
        )

    f.dispatcher.update(FleetView({"a": moving("a")}))
    replies = [f.infer(req(10)) for _ in range(6)]
    assert {r.node for r in replies} == {"b"} and f.dispatcher.counted()["spilled"] == 0
    f.dispatcher.update(FleetView({"a": moving("a"), "b": moving("b")}))
    reply = f.infer(req(10))
    assert isinstance(reply.error, Rejected) and "moving it to another version" in str(reply.error)
