"""Every call a caller has out has a limit: a frozen node never holds a request, a busy
one keeps its requests, a request's timeout_s ends it TimedOut; the router marks a
silent or stuck node unresponsive and restarts it (real node runtimes, fake engines,
no Ray)."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from actors.node import NodeRuntime
from cluster.limits import TIMED_OUT, UNRESPONSIVE, CallWatch
from cluster.router import Router
from edgefleet.clock import FakeClock, MonotonicClock
from edgefleet.config import parse_config
from edgefleet.errors import NodeLost, TimedOut
from edgefleet.messages import NodeStatus
from edgefleet.request import InferRequest
from tests.fakes import FakeLoader, LocalFleet, x

GRACE_S = 0.3  # each call's limit past its expected completion, kept short here


def make_config(nodes=("a", "b"), **router):
    return parse_config(
        {
            "fleet": {"name": "t"},
            "models": {"m": {"path": "m.onnx", "warmup": False, "memory_mb": 1}},
            "node_defaults": {"queue": {"capacity": 64}},
            "nodes": [{"name": n} for n in nodes],
            "router": {
                "placement": {"shed": {}},
                "report_interval_s": 0.05,
                "lost_after_s": 0.5,
                "probe_timeout_s": 0.2,
                "call_limit_factor": 2.0,
                "call_grace_s": GRACE_S,
                **router,
            },
        },
        Path("/nonexistent"),
    )


@pytest.fixture
def fleet():
    made = []

    def make(cost_s=0.0, **router):
        f = LocalFleet(
            make_config(**router),
            lambda spec: NodeRuntime(spec, loader=FakeLoader(m={"cost_s": cost_s})),
        )
        made.append(f)
        return f

    yield make
    for f in made:
        for h in f.handles.values():
            h.frozen = False
        f.close()


def req(rid, **kw):
    return InferRequest(model="m", inputs=x(1.0), priority=10, id=rid, **kw)


def test_requests_held_by_a_frozen_node_are_placed_again_and_answered_once(fleet):
    f = fleet(cost_s=0.02)
    futures = [f.dispatcher.submit(req(f"r{i}")) for i in range(30)]
    frozen = f.handles["a"]
    frozen.frozen = True  # a stopped process: nothing it holds is answered
    started = time.monotonic()
    replies = [fut.result(60) for fut in futures]
    took = time.monotonic() - started
    assert sorted(r.request_id for r in replies) == sorted(f"r{i}" for i in range(30))
    assert all(r.error is None for r in replies), [r.error for r in replies if r.error]
    assert any(r.node == "b" for r in replies)
    assert f.dispatcher.counted()["replaced"] >= 1  # a held some: they went to b
    assert frozen.forgotten  # and a was told to drop them, for when it wakes
    assert took < 30  # bounded by the limits, not by the node waking up
    # Nothing more goes to the frozen node while it is out of service.
    later = [f.dispatcher.submit(req(f"late{i}")).result(60) for i in range(5)]
    assert {r.node for r in later} == {"b"}


def test_a_busy_node_that_answers_probes_keeps_its_requests(fleet):
    # Each call takes far longer than its limit: the node is probed, says it holds the
    # request, and the request is neither placed again nor run twice.
    f = fleet(cost_s=0.6, call_grace_s=0.1, call_limit_factor=1.0)
    futures = [f.dispatcher.submit(req(f"s{i}")) for i in range(4)]
    replies = [fut.result(60) for fut in futures]
    assert all(r.error is None for r in replies)
    assert f.dispatcher.counted().get("replaced", 0) == 0
    runs = sum(f.node(n).status().counters["completed"] for n in f.handles)
    assert runs == 4
    assert any(h.probes for h in f.handles.values())  # they were overdue, and asked about


def test_at_most_once_requests_on_a_frozen_node_end_node_lost(fleet):
    f = fleet(cost_s=0.05, placement={"picker": "best", "shed": {}})
    futures = [f.dispatcher.submit(req(f"o{i}", at_most_once=True)) for i in range(10)]
    f.handles["a"].frozen = True
    replies = [fut.result(60) for fut in futures]
    assert sorted(r.request_id for r in replies) == sorted(f"o{i}" for i in range(10))
    lost = [r for r in replies if r.error is not None]
    assert lost and all(isinstance(r.error, NodeLost) for r in lost)
    assert "did not answer" in str(lost[0].error) and "may have run" in str(lost[0].error)


def test_a_pipeline_gets_every_answer_once_when_a_node_freezes(fleet):
    f = fleet(cost_s=0.02)
    seen: dict[int, object] = {}
    items = ((req(f"p{i}"), None) for i in range(40))
    for i, reply in f.dispatcher.pipeline(items, 16):
        if not seen:
            f.handles["a"].frozen = True
        assert i not in seen
        seen[i] = reply
    assert sorted(seen) == list(range(40))
    assert all(r.error is None for r in seen.values())  # type: ignore[attr-defined]
    assert {e.name: len(e.inflight) for e in f.dispatcher._nodes.values()} == {"a": 0, "b": 0}


@pytest.mark.parametrize("path", ["submit", "call", "pipeline"])
def test_a_request_past_its_timeout_ends_timed_out_and_is_dropped_where_it_was(fleet, path):
    f = fleet(cost_s=0.02, call_grace_s=30.0)  # the limits would wait long: the timeout acts
    for h in f.handles.values():
        h.frozen = True
    r = req("t1")
    started = time.monotonic()
    if path == "submit":
        reply = f.dispatcher.submit(r, timeout_s=0.3).result(60)
    elif path == "call":
        reply = f.dispatcher.call(r, timeout_s=0.3)
    else:
        ((_, reply),) = list(f.dispatcher.pipeline([(r, None)], 1, timeout_s=0.3))
    assert isinstance(reply.error, TimedOut), reply
    assert time.monotonic() - started < 0.8  # when the timeout passes, not a wait later
    assert "timeout_s=0.3" in str(reply.error)
    assert sum(h.forgotten.count("t1") for h in f.handles.values()) == 1
    assert f.dispatcher.counted()["timedout"] == 1


class Probed:
    """A node as the watch sees it, whose probes take ``delay_s`` (None past the
    probe's timeout)."""

    def __init__(self, name: str, delay_s: float) -> None:
        self.name = name
        self.healthy = True
        self.handle = self
        self.delay_s = delay_s
        self.heard_at = -math.inf  # never heard from otherwise

    def probe(self, request_ids, timeout_s):
        time.sleep(min(self.delay_s, timeout_s))
        return None if self.delay_s >= timeout_s else {r: True for r in request_ids}


def test_a_node_slow_to_answer_a_probe_delays_no_timeout():
    watch = CallWatch(probe_timeout_s=1.0, quiet_s=1.0, clock=MonotonicClock())
    frozen, fine = Probed("a", 5.0), Probed("b", 0.0)
    given: dict[str, tuple[str, float]] = {}
    done = threading.Event()
    t0 = time.monotonic()

    def on(rid):
        def overdue(why):
            given[rid] = (why, time.monotonic() - t0)
            if len(given) == 3:
                done.set()

        return overdue

    watch.add(frozen, "a1", t0 + 0.1, 10.0, math.inf, on("a1"))  # its probe hangs 1 s
    watch.add(frozen, "a2", t0 + 0.1, 10.0, t0 + 0.4, on("a2"))  # times out meanwhile
    watch.add(fine, "b1", t0 + 0.3, 10.0, t0 + 0.4, on("b1"))  # another node's
    assert done.wait(5)
    watch.close()
    # The two timeouts act while a's probe still waits (it waits 1 s for nothing).
    assert given["a2"][0] == TIMED_OUT and given["b1"][0] == TIMED_OUT, given
    assert given["a1"][0] == UNRESPONSIVE and given["a1"][1] >= 1.0, given
    assert given["a2"][1] < given["a1"][1] and given["b1"][1] < given["a1"][1], given


# ---------------------------------------------------------------------- the router


class Silent:
    """A node control that answers its status, or not (``silent``), or reports stuck."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.silent = False
        self.stuck = False
        self.busy = False  # too busy to report, but its process answers probes
        self.restarts = 0

    async def status(self) -> NodeStatus:
        if self.silent or self.busy:
            await asyncio.sleep(3600)
        state = "stuck" if self.stuck else "serving"
        failure = "engine call hangs" if self.stuck else ""
        return NodeStatus(self.name, state, {}, 0, None, (), failure=failure)

    async def start(self) -> NodeStatus:
        return await self.status()

    async def cancel(self, request_id: str) -> bool:
        return False

    async def set_lifecycle(self, state: str) -> NodeStatus:
        return await self.status()

    async def restart(self) -> None:
        self.restarts += 1
        self.silent = self.stuck = False

    async def alive(self, timeout_s: float) -> bool:
        return not self.silent


@pytest.mark.parametrize("how", ["silent", "stuck"])
def test_the_router_marks_a_node_unresponsive_and_restarts_it_after_a_while(how):
    config = make_config(("a", "b"), restart_after_s=10.0)
    clock = FakeClock()
    handles = {n: Silent(n) for n in ("a", "b")}
    router = Router(config, handles, clock=clock)

    async def main() -> None:
        await router.status()
        setattr(handles["a"], how, True)
        clock.advance(0.6)  # past lost_after_s (0.5) since its last report
        await router.status()
        status = router.status_now()
        assert not status.healthy["a"] and status.healthy["b"]
        assert "a" in status.unresponsive and "b" not in status.unresponsive
        assert router.fleet_view().nodes["a"].healthy is False
        assert status.router["unresponsive"] == 1 and handles["a"].restarts == 0
        clock.advance(10.0)  # restart_after_s later
        await router.status()
        for _ in range(100):  # the kill runs on its own task
            if handles["a"].restarts:
                break
            await asyncio.sleep(0.01)
        assert handles["a"].restarts == 1
        assert router.status_now().router["restarted"] == 1
        await router.status()  # it answers again: back in service
        status = router.status_now()
        assert status.healthy["a"] and not status.unresponsive
        await router.stop()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_timeout_s_must_be_a_positive_number():
    from cluster.client import _timeout
    from edgefleet.errors import InvalidInput

    assert _timeout(None) is None and _timeout(2) == 2.0
    for bad in (0, -1, float("inf"), float("nan"), "1", True):
        with pytest.raises(InvalidInput, match="timeout_s"):
            _timeout(bad)  # type: ignore[arg-type]


def test_an_answer_that_comes_after_the_call_was_given_up_is_dropped(fleet):
    f = fleet(cost_s=0.02, placement={"picker": "best", "shed": {}})
    frozen = f.handles["a"]
    frozen.frozen = True
    reply = f.dispatcher.submit(replace(req("late"))).result(60)
    assert reply.error is None and reply.node == "b"
    frozen.frozen = False  # a wakes and answers too: nobody hears it twice
    time.sleep(0.3)
    assert f.dispatcher.counted()["completed"] == 1


def test_the_router_keeps_a_node_too_busy_to_report_whose_process_answers():
    config = make_config(("a",), restart_after_s=1.0)
    clock = FakeClock()
    node = Silent("a")
    router = Router(config, {"a": node}, clock=clock)

    async def main() -> None:
        await router.status()
        node.busy = True  # its loop is flooded: no report, but its process answers
        clock.advance(5.0)  # past lost_after_s and restart_after_s
        await router.status()
        await router.status()
        status = router.status_now()
        assert status.healthy["a"] and not status.unresponsive, status
        assert node.restarts == 0 and "unresponsive" not in status.router
        await router.stop()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_node_that_answers_calls_but_not_probes_in_time_keeps_its_requests(fleet):
    # A node flooded with calls answers probes late, but its answers keep coming: that
    # is enough to know it lives (a frozen node answers nothing).
    f = fleet(cost_s=0.1, call_grace_s=0.05, call_limit_factor=1.0)
    for h in f.handles.values():
        h.probe = lambda ids, timeout_s: None  # type: ignore[method-assign]
    futures = [f.dispatcher.submit(req(f"q{i}")) for i in range(12)]
    replies = [fut.result(60) for fut in futures]
    assert all(r.error is None for r in replies), [r.error for r in replies if r.error]
    assert f.dispatcher.counted().get("replaced", 0) == 0
    assert sum(f.node(n).status().counters["completed"] for n in f.handles) == 12


def test_status_shows_unresponsive_and_stuck_nodes_and_why():
    from cluster.cli.tables import status_dict, status_table
    from edgefleet.messages import FleetStatus

    nodes = (
        NodeStatus("a", "serving", {}, 0, None, ()),
        NodeStatus("b", "stuck", {}, 0, None, (), failure="an engine call did not stop"),
    )
    status = FleetStatus("t", nodes, {"a": True, "b": False, "c": False}, unresponsive={"b": 12.0})
    table = status_table(status)
    rows = {cells[0]: cells[1:3] for cells in map(str.split, table.splitlines()) if cells}
    assert rows["a"] == ["ok", "serving"] and rows["b"] == ["UNRESP", "stuck"], table
    assert rows["c"] == ["LOST"], table
    assert "stuck: an engine call did not stop" in table
    assert "unresponsive for 12 s" in table
    assert status_dict(status)["unresponsive"] == {"b": 12.0}


def test_a_caller_keeps_a_node_it_hears_from_whatever_a_restarted_or_slow_router_says(fleet):
    from cluster.dispatch import FleetView, NodeReport

    f = fleet(cost_s=0.0)
    d = f.dispatcher
    # A router just restarted knows nothing of its nodes yet: that says nothing of them.
    d.update(FleetView({"a": NodeReport(None, False, 0.0), "b": NodeReport(None, False, 0.0)}))
    assert d.healthy() == {"a": True, "b": True}
    # The router stopped hearing from a, but this caller got an answer from it just now.
    replies = [d.submit(req(f"h{i}")).result(30) for i in range(50)]
    assert all(r.error is None for r in replies) and any(r.node == "a" for r in replies)
    status = f.node("a").status()
    d.update(FleetView({"a": NodeReport(status, False, 5.0)}))
    assert d.healthy()["a"]
    # Quiet to this caller too, for lost_after_s: the router's word stands.
    time.sleep(f.config.router.lost_after_s)
    d.update(FleetView({"a": NodeReport(status, False, 5.0)}))
    assert not d.healthy()["a"]


def test_a_caller_takes_back_a_lost_node_that_answers_when_no_router_can_say_so(fleet):
    f = fleet(cost_s=0.02, placement={"picker": "best", "shed": {}})
    f.handles["a"].frozen = True
    replies = [f.dispatcher.submit(req(f"v{i}")).result(60) for i in range(4)]
    assert all(r.error is None for r in replies)
    assert not f.dispatcher.healthy()["a"]  # it missed a probe: out of this caller's service
    assert f.dispatcher.revive() == []  # still frozen: it stays out
    f.handles["a"].frozen = False
    assert f.dispatcher.revive() == ["a"]  # it answers: back, with no router report
    assert f.dispatcher.healthy()["a"]
