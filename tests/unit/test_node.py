"""The node runtime (asyncio loop + engine thread) with fake engines, without Ray."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import numpy as np
import pytest

import actors.executor as executor_module
import actors.metrics as metrics
import actors.node as node_module
from actors.metrics import COUNTER_FLUSH_S, MemorySink, NodeMetrics, RaySink
from actors.node import NodeRuntime
from actors.scheduler import Outcome
from edgefleet.clock import FakeClock
from edgefleet.errors import (
    Cancelled,
    DeadlineExceeded,
    EdgeFleetError,
    EngineError,
    InvalidInput,
    ModelNotFound,
    Rejected,
    Superseded,
)
from edgefleet.messages import NODE_COUNTERS
from edgefleet.request import InferRequest, Request, RequestState
from tests.fakes import CallGate, FakeLoader, fake_spec, x


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def started(spec=None, **engines):
    loader = FakeLoader(**engines)
    node = NodeRuntime(spec or fake_spec(), loader=loader)
    await node.start()
    return node, loader


def req(model="m", value=1.0, priority=3, **kw):
    return InferRequest(model=model, inputs=x(value), priority=priority, **kw)


def test_results_and_typed_errors_reach_callers():
    async def main():
        node, _ = await started()
        good = await node.infer(req(value=2.0))
        np.testing.assert_array_equal(good.unwrap()["y"], x(4.0)["x"])
        bad = await node.infer(InferRequest(model="m", inputs={"x": np.zeros((1, 5), np.float32)}))
        assert isinstance(bad.error, InvalidInput) and "x" in str(bad.error)
        missing = await node.infer(req(model="nope"))
        assert isinstance(missing.error, ModelNotFound)
        failed = await node.infer(req(value=-1.0))
        assert isinstance(failed.error, EngineError)
        await node.stop()

    run(main())


def test_every_counter_is_reported_from_the_start_and_no_other():
    async def main():
        node, _ = await started()
        assert node.status().counters == dict.fromkeys(NODE_COUNTERS, 0)
        await node.infer(req(value=2.0))
        await node.infer(req(model="nope"))
        await node.infer(req(value=-1.0))
        counters = node.status().counters
        assert set(counters) == set(NODE_COUNTERS)
        assert (counters["completed"], counters["invalid"], counters["failed"]) == (1, 1, 1)
        await node.stop()

    run(main())


def test_batch_failure_fails_only_the_bad_request():
    batching = {"window_ms": 50, "max_batch_size": 8, "only_if_faster": False}
    spec = fake_spec({"m": {"batching": batching}})

    async def main():
        node, loader = await started(spec)
        warmup_calls = len(loader.engines["m"].calls)
        values = [1.0, 2.0, -1.0, 3.0]
        replies = await asyncio.gather(*(node.infer(req(value=v)) for v in values))
        errors = [type(r.error).__name__ if r.error else None for r in replies]
        assert errors == [None, None, "EngineError", None]
        assert loader.engines["m"].calls[warmup_calls] == 4  # they were batched first
        await node.stop()

    run(main())


def test_dedup_follow_gives_the_older_caller_the_newer_result():
    spec = fake_spec({"m": {"dedup": "follow"}, "b": {}})

    async def main():
        node, _ = await started(spec, b={"cost_s": 0.2})
        blocker = asyncio.create_task(node.infer(req(model="b")))
        await asyncio.sleep(0.05)
        old = asyncio.create_task(node.infer(req(value=1.0, key="frame", id="old")))
        await asyncio.sleep(0)
        new = asyncio.create_task(node.infer(req(value=5.0, key="frame", id="new")))
        r_old, r_new, _ = await asyncio.gather(old, new, blocker)
        assert r_old.request_id == "old" and r_new.request_id == "new"
        np.testing.assert_array_equal(r_old.unwrap()["y"], r_new.unwrap()["y"])
        assert node.status().counters["superseded"] == 1
        await node.stop()

    run(main())


def test_dedup_supersede_mode_raises_superseded():
    async def main():
        node, _ = await started(fake_spec({"m": {}, "b": {}}), b={"cost_s": 0.2})
        blocker = asyncio.create_task(node.infer(req(model="b")))
        await asyncio.sleep(0.05)
        old = asyncio.create_task(node.infer(req(key="k")))
        await asyncio.sleep(0)
        new = asyncio.create_task(node.infer(req(key="k")))
        r_old, r_new, _ = await asyncio.gather(old, new, blocker)
        assert isinstance(r_old.error, Superseded) and r_new.error is None
        await node.stop()

    run(main())


def test_preemption_aborts_and_requeues_background():
    async def main():
        node, loader = await started(m={"cost_s": 0.3})
        bg = asyncio.create_task(node.infer(req(priority=3, id="bg")))
        await asyncio.sleep(0.05)
        fg = asyncio.create_task(node.infer(req(priority=10, id="fg")))
        done, _ = await asyncio.wait({bg, fg}, return_when=asyncio.FIRST_COMPLETED)
        assert done == {fg}, "the foreground request must finish first"
        r_bg = await bg
        assert r_bg.error is None  # aborted, requeued, then completed
        counters = node.status().counters
        assert counters["preempted"] == 1 and counters["completed"] == 2
        await node.stop()

    run(main())


def test_small_priority_gap_does_not_preempt():
    async def main():
        node, _ = await started(m={"cost_s": 0.2})
        bg = asyncio.create_task(node.infer(req(priority=3)))
        await asyncio.sleep(0.05)
        inline = asyncio.create_task(node.infer(req(priority=7)))
        done, _ = await asyncio.wait({bg, inline}, return_when=asyncio.FIRST_COMPLETED)
        assert done == {bg}
        await inline
        assert node.status().counters["preempted"] == 0
        await node.stop()

    run(main())


def test_deadline_fails_while_engine_busy_without_running():
    async def main():
        node, loader = await started(fake_spec({"m": {}, "b": {}}), b={"cost_s": 0.4})
        blocker = asyncio.create_task(node.infer(req(model="b")))
        await asyncio.sleep(0.05)
        late = await node.infer(
            req(priority=3, deadline_unix=InferRequest.deadline_from_timeout(0.05))
        )
        assert isinstance(late.error, DeadlineExceeded)
        assert not blocker.done(), "the deadline fired before the engine was free"
        calls = len(loader.engines["m"].calls)
        await blocker
        assert len(loader.engines["m"].calls) == calls
        await node.stop()

    run(main())


def test_cancel_queued_and_running():
    async def main():
        node, _ = await started(m={"cost_s": 5.0})
        running = asyncio.create_task(node.infer(req(id="run")))
        await asyncio.sleep(0.05)
        queued = asyncio.create_task(node.infer(req(id="q")))
        await asyncio.sleep(0)
        assert node.cancel("q")
        assert node.cancel("run")
        r_run, r_q = await asyncio.gather(running, queued)
        assert isinstance(r_run.error, Cancelled) and isinstance(r_q.error, Cancelled)
        assert not node.cancel("nope")
        await node.stop()

    run(main())


def test_drain_finishes_queued_work_then_refuses():
    async def main():
        node, _ = await started(m={"cost_s": 0.02})
        tasks = [asyncio.create_task(node.infer(req(value=i + 1))) for i in range(5)]
        await asyncio.sleep(0)
        status = await node.drain()
        assert status.state == "drained" and status.queue_length == 0
        assert status.counters["completed"] == 5
        assert all(r.error is None for r in await asyncio.gather(*tasks))
        refused = await node.infer(req())
        assert isinstance(refused.error, Rejected) and "draining" in str(refused.error)
        await node.stop()

    run(main())


def test_model_switch_within_memory_budget():
    spec = fake_spec({"a": {"memory_mb": 60}, "b": {"memory_mb": 60}}, budget_mb=100)

    async def main():
        node, loader = await started(spec)
        assert [m.name for m in node.status().models if m.loaded] == ["a"]
        r = await node.infer(req(model="b", value=3.0))
        assert r.error is None
        assert [m.name for m in node.status().models if m.loaded] == ["b"]
        assert loader.engines["a"].closed
        status = await node.switch_model("a")
        assert [m.name for m in status.models if m.loaded] == ["a"]
        assert loader.loads == ["a", "b", "b", "a"]
        with pytest.raises(ModelNotFound):
            await node.switch_model("zzz")
        await node.stop()

    run(main())


def test_requests_arriving_during_a_switch_wait_and_succeed():
    spec = fake_spec({"a": {"memory_mb": 60}, "b": {"memory_mb": 60}}, budget_mb=100)

    async def main():
        node, _ = await started(spec)
        switch = asyncio.create_task(node.switch_model("b"))
        replies = await asyncio.gather(*(node.infer(req(model="a")) for _ in range(3)))
        await switch
        assert all(r.error is None for r in replies)
        await node.stop()

    run(main())


def test_flood_every_request_answered_exactly_once():
    async def main():
        node, _ = await started(fake_spec(capacity=16), m={"cost_s": 0.001})
        priorities = [i % 11 for i in range(2000)]
        replies = await asyncio.gather(
            *(node.infer(req(priority=p, id=f"r{i}")) for i, p in enumerate(priorities))
        )
        assert sorted(r.request_id for r in replies) == sorted(f"r{i}" for i in range(2000))
        for r in replies:
            assert (r.outputs is None) != (r.error is None)
            assert r.error is None or isinstance(r.error, EdgeFleetError)
        c = node.status().counters
        assert c["completed"] + c.get("rejected", 0) + c.get("evicted", 0) == 2000
        assert c["completed"] >= 16
        await node.stop()

    run(main())


def test_stop_cancels_queued_callers():
    async def main():
        node, _ = await started(m={"cost_s": 5.0})
        tasks = [asyncio.create_task(node.infer(req())) for _ in range(3)]
        await asyncio.sleep(0.05)
        await node.stop()
        replies = await asyncio.gather(*tasks)
        assert all(isinstance(r.error, Cancelled) for r in replies)

    run(main())


def test_retry_with_the_same_id_is_answered_once():
    async def main():
        node, loader = await started(m={"cost_s": 0.05})
        first, again = await asyncio.gather(
            node.infer(req(value=2.0, id="same")), node.infer(req(value=2.0, id="same"))
        )
        later = await node.infer(req(value=2.0, id="same"))
        assert first is again and later is first
        assert node.status().counters["completed"] == 1
        await node.stop()

    run(main())


def test_a_retry_after_a_refusal_runs_and_a_completed_answer_is_kept():
    """The idempotency contract: an answer that says the request did not run (expired,
    cancelled, rejected, evicted, superseded, invalid) is not kept; a retry under the
    same id is a new attempt. A completed answer (or an engine failure) is kept."""

    async def main():
        node, loader = await started(m={"cost_s": 0.05})
        expired = await node.infer(req(id="r1", deadline_unix=time.time() - 1))
        assert isinstance(expired.error, DeadlineExceeded)
        retried = await node.infer(req(value=2.0, id="r1"))
        assert retried.error is None and retried.outputs is not None

        running = asyncio.create_task(node.infer(req(id="r2")))
        await asyncio.sleep(0.01)
        queued = asyncio.create_task(node.infer(req(id="r3")))
        await asyncio.sleep(0.01)
        assert node.cancel("r3")
        assert isinstance((await queued).error, Cancelled)
        assert (await node.infer(req(id="r3"))).error is None
        await running

        node._sched.draining = True
        refused = await node.infer(req(id="r4"))
        assert isinstance(refused.error, Rejected)
        node._sched.draining = False
        assert (await node.infer(req(id="r4"))).error is None

        failed = await node.infer(req(value=-1.0, id="r5"))  # the fake engine fails on -1
        assert isinstance(failed.error, EngineError)
        assert await node.infer(req(value=-1.0, id="r5")) is failed  # it ran: kept
        assert node.status().counters["completed"] == 4
        await node.stop()

    run(main())


def test_a_caller_that_goes_away_does_not_cancel_a_retry_waiting_on_the_same_id():
    async def main():
        node, loader = await started(m={"cost_s": 0.2})
        first = asyncio.create_task(node.infer(req(value=3.0, id="same")))
        await asyncio.sleep(0.02)
        retry = asyncio.create_task(node.infer(req(value=3.0, id="same")))
        await asyncio.sleep(0.02)
        first.cancel()  # the first caller's connection went away
        reply = await retry
        assert reply.error is None and reply.outputs is not None
        assert node.status().counters["cancelled"] == 0

        alone = asyncio.create_task(node.infer(req(id="alone")))
        await asyncio.sleep(0.02)
        alone.cancel()  # the only caller went away: nobody is left to answer
        await asyncio.sleep(0.05)
        assert node.status().counters["cancelled"] == 1
        await node.stop()

    run(main())


def test_preemption_requested_before_the_engine_starts_is_kept():
    async def main():
        node, loader = await started(m={"cost_s": 0.5})
        bg = asyncio.create_task(node.infer(req(priority=3, id="bg")))
        for _ in range(3):  # the loop takes the plan; the engine thread may not run yet
            await asyncio.sleep(0)
        fg = asyncio.create_task(node.infer(req(priority=10, id="fg")))
        done, _ = await asyncio.wait({bg, fg}, return_when=asyncio.FIRST_COMPLETED)
        assert done == {fg}
        await bg
        assert node.status().counters["preemptions"] == 1
        await node.stop()

    run(main())


# ------------------------------------------- calls the engine thread starts itself


async def until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.002)


def test_a_call_the_engine_thread_took_itself_never_delays_an_urgent_arrival():
    """bg2 is taken by the engine thread when bg1 ends; an urgent arrival before bg2
    starts aborts it at no engine cost: the urgent request runs first."""

    async def main():
        node, loader = await started()
        gate = CallGate(loader.engines["m"])
        bg1 = asyncio.create_task(node.infer(req(value=1.0, priority=3, id="bg1")))
        assert await gate.entered() == [1.0]
        bg2 = asyncio.create_task(node.infer(req(value=2.0, priority=3, id="bg2")))
        await until(lambda: node.status().queued == {3: 1})
        gate.release()  # bg1 runs; the engine thread goes straight on to bg2
        assert await gate.entered() == [2.0]
        assert node.status().running.request_ids == ("bg2",)
        fg = asyncio.create_task(node.infer(req(value=3.0, priority=10, id="fg")))
        await until(lambda: node.status().counters["admitted"] == 3)
        gate.open()
        assert all(r.error is None for r in await asyncio.gather(bg1, bg2, fg))
        assert gate.ran == [[1.0], [3.0], [2.0]]  # bg2 did not run before fg
        counters = node.status().counters
        assert counters["preemptions"] == 1 and counters["preempted"] == 1
        await node.stop()

    run(main())


def test_an_urgent_arrival_aborts_a_call_the_engine_thread_took_before_it_began_it():
    """The window between the engine thread taking bg2 (under the lock) and beginning
    it: the abort reaches bg2 through its own stop event."""

    async def main():
        node, loader = await started()
        gate = CallGate(loader.engines["m"])
        held, go = threading.Event(), threading.Event()
        resident = node._models.resident

        def slow_resident(model):  # the engine thread looks the model up before each call
            call = node._call
            on_engine = threading.current_thread().name.startswith("engine-")
            if on_engine and call and call.plan.requests[0].id == "bg2" and not held.is_set():
                held.set()
                go.wait(10)
            return resident(model)

        node._models.resident = slow_resident
        bg1 = asyncio.create_task(node.infer(req(value=1.0, priority=3, id="bg1")))
        assert await gate.entered() == [1.0]
        bg2 = asyncio.create_task(node.infer(req(value=2.0, priority=3, id="bg2")))
        await until(lambda: node.status().queued == {3: 1})
        gate.open()
        await until(held.is_set)
        fg = asyncio.create_task(node.infer(req(value=3.0, priority=10, id="fg")))
        await until(lambda: node.status().counters["admitted"] == 3)
        go.set()
        assert all(r.error is None for r in await asyncio.gather(bg1, bg2, fg))
        assert gate.ran == [[1.0], [3.0], [2.0]]
        assert node.status().counters["preempted"] == 1
        await node.stop()

    run(main())


def test_queue_time_runs_to_the_engine_start_and_the_hand_off_is_its_last_part():
    """bg2 waits behind bg1; once bg1 ends, the engine thread spends 0.1 s before it
    starts bg2 (its lookup of the model, held here): bg2's queue time runs to its start
    and its hand-off is that time, not part of its time outside the node."""
    hold_s = 0.1

    async def main():
        node, loader = await started(m={"cost_s": 0.05})
        resident = node._models.resident

        def slow_resident(model):  # the engine thread looks the model up before each call
            call = node._call
            on_engine = threading.current_thread().name.startswith("engine-")
            if on_engine and call and call.plan.requests[0].id == "bg2":
                time.sleep(hold_s)
            return resident(model)

        node._models.resident = slow_resident
        bg1 = asyncio.create_task(node.infer(req(value=1.0, priority=3, id="bg1")))
        await until(lambda: node.status().running is not None)
        bg2 = asyncio.create_task(node.infer(req(value=2.0, priority=3, id="bg2")))
        r1, r2 = await asyncio.gather(bg1, bg2)
        assert r1.error is None and r2.error is None
        assert 0 <= r1.handoff_s <= r1.queue_s < hold_s
        assert r2.handoff_s >= hold_s  # from bg1's end to bg2's start
        assert r2.queue_s >= r2.handoff_s  # it arrived before bg1 ended
        await node.stop()

    run(main())


def test_the_call_after_an_abort_reports_how_long_the_aborted_call_took_to_stop():
    """The engine stops bg's call 0.1 s after the abort (as ONNX Runtime does at its next
    look at the terminate flag): fg, whose arrival aborted it, reports that wait within
    its queue time; bg, run again after fg, waited for no abort."""
    stop_s = 0.1

    async def main():
        node, loader = await started(m={"cost_s": 0.5, "stop_s": stop_s})
        engine = loader.engines["m"]
        entered = engine.entered
        bg = asyncio.create_task(node.infer(req(value=1.0, priority=3, id="bg")))
        await until(lambda: engine.entered > entered)  # bg's call runs
        fg = await node.infer(req(value=2.0, priority=10, id="fg"))
        assert fg.error is None and stop_s <= fg.abort_s <= fg.queue_s
        assert fg.handoff_s <= fg.queue_s - fg.abort_s
        assert (await bg).error is None and (await bg).abort_s == 0.0
        assert node.status().counters["preempted"] == 1
        await node.stop()

    run(main())


def test_an_urgent_arrival_preempts_a_call_the_engine_thread_started_itself():
    async def main():
        node, loader = await started(m={"cost_s": 0.5})
        bg1 = asyncio.create_task(node.infer(req(value=1.0, priority=3, id="bg1")))
        bg2 = asyncio.create_task(node.infer(req(value=2.0, priority=3, id="bg2")))
        await until(lambda: (r := node.status().running) is not None and r.request_ids == ("bg2",))
        r_fg = await node.infer(req(value=3.0, priority=10, id="fg"))
        assert r_fg.error is None and r_fg.queue_s < 0.25  # bg2's 0.5 s call was aborted
        assert not bg2.done()
        assert all(r.error is None for r in await asyncio.gather(bg1, bg2))
        assert node.status().counters["preempted"] == 1
        await node.stop()

    run(main())


def test_an_arrival_wakes_an_idle_engine_thread_and_stop_ends_its_wait(monkeypatch):
    """With nothing queued, the engine thread waits a moment for the next arrival (here
    a long moment) instead of handing the engine back to the loop: an arrival starts
    at once on the same engine thread run, and stopping ends the wait at once."""
    monkeypatch.setattr(node_module, "LINGER_S", 5.0)

    async def main():
        node, _ = await started()
        chains = 0
        chain = node._engine.chain

        async def counted(*args):
            nonlocal chains
            chains += 1
            return await chain(*args)

        node._engine.chain = counted
        assert (await node.infer(req(value=1.0))).error is None
        for value in (2.0, 3.0):
            reply = await asyncio.wait_for(node.infer(req(value=value)), 1.0)
            np.testing.assert_array_equal(reply.unwrap()["y"], x(2 * value)["x"])
        assert chains == 1
        await asyncio.wait_for(node.stop(), 1.0)

    run(main())


def test_every_request_is_answered_once_under_mixed_priorities_cancels_and_deadlines():
    async def main():
        node, _ = await started(fake_spec(capacity=24), m={"cost_s": 0.002})
        rng = random.Random(7)
        n = 400

        async def one(i):
            deadline = rng.choice([None, None, None, 0.001, 0.01, 0.05])
            r = req(
                value=float(i + 1),
                priority=rng.choice([0, 3, 3, 7, 10]),
                id=f"r{i}",
                deadline_unix=InferRequest.deadline_from_timeout(deadline),
                key=f"k{i % 50}" if i % 7 == 0 else None,
            )
            task = asyncio.create_task(node.infer(r))
            if rng.random() < 0.15:
                await asyncio.sleep(rng.random() * 0.01)
                node.cancel(r.id)
            return await task

        tasks = []
        for i in range(n):  # about 1000 arrivals a second at a node that serves 500
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(rng.random() * 0.002)
        replies = await asyncio.gather(*tasks)
        assert sorted(r.request_id for r in replies) == sorted(f"r{i}" for i in range(n))
        for r in replies:
            assert (r.outputs is None) != (r.error is None)
            assert r.error is None or isinstance(r.error, EdgeFleetError)
            if r.outputs is not None:
                expected = 2 * (int(r.request_id[1:]) + 1)
                assert float(r.outputs["y"][0, 0]) == expected
        c = node.status().counters
        ended = ("completed", "failed", "rejected", "evicted", "superseded", "expired")
        assert sum(c[k] for k in (*ended, "cancelled")) == c["received"] == n
        assert c["completed"] > 0 and c["preempted"] > 0 and c["expired"] > 0
        assert not node._waiters and not node._timers and not node._callers
        await node.stop()

    run(main())


# ------------------------------------------------------------------- metrics in Ray


class _RecordingRaySink(RaySink):
    """Ray's sink as the node picks its defaults by, recording into memory instead."""

    def __init__(self) -> None:
        self.memory = MemorySink()

    def record(self, metric, value, tags):
        self.memory.record(metric, value, tags)


def test_in_ray_the_node_records_its_metrics_at_most_once_a_second_and_at_each_report():
    """A Ray metric record costs microseconds (tens under contention) and a node makes
    several per request: in Ray the counters go out summed and the histogram
    observations together, at most once a second."""
    clock = FakeClock()
    sink = _RecordingRaySink()
    rec = NodeMetrics("f", "fake-0", sink=sink, clock=clock)
    memory = sink.memory
    for _ in range(3):
        rec.admitted(10, "m")
    r = Request(id="a", model="m", inputs={}, priority=10, arrival=0.0, started=0.01)
    r.state = RequestState.COMPLETED
    rec.settled(Outcome(r, RequestState.COMPLETED), 0.02, 0.01)
    assert memory.value(metrics.ADMITTED) == 0 and memory.value(metrics.REQUESTS) == 0
    assert memory.observed(metrics.LATENCY) == []
    clock.advance(COUNTER_FLUSH_S)
    rec.admitted(3, "m")  # a second later: the sums and the observations go out
    assert memory.observed(metrics.LATENCY) == [pytest.approx(0.02)]
    assert memory.observed(metrics.QUEUE_WAIT) == [pytest.approx(0.01)]
    assert memory.value(metrics.ADMITTED, priority="foreground") == 3
    assert memory.value(metrics.ADMITTED, priority="background") == 1
    assert memory.value(metrics.REQUESTS, state="completed") == 1
    rec.admitted(10, "m")
    rec.flush()  # what each status report does
    assert memory.value(metrics.ADMITTED) == 5
    assert rec.errors == 0


def test_a_call_whose_answer_fails_to_settle_fails_the_node_and_its_callers_hear_so():
    async def main():
        node, _ = await started()
        settle_call = node._settle_call

        def broken(ended):
            if any(o.request.id == "lost" for o in ended.outcomes):
                raise RuntimeError("settlement bug")
            settle_call(ended)

        node._settle_call = broken
        reply = await asyncio.wait_for(node.infer(req(id="lost")), 5)
        assert isinstance(reply.error, Cancelled) and "settlement bug" in str(reply.error)
        status = node.status()
        assert status.state == "failed" and "settlement bug" in status.failure
        await node.stop()

    run(main())


class LockedOnly:
    """Stands in for a node's scheduler and notes each use of it made without the
    node's lock held (the loop and the engine thread both drive the scheduler)."""

    def __init__(self, sched, lock) -> None:
        object.__setattr__(self, "_sched", sched)
        object.__setattr__(self, "_lock", lock)
        object.__setattr__(self, "unlocked", [])

    def __getattr__(self, name):
        if not self._lock.locked():
            self.unlocked.append(name)
        return getattr(self._sched, name)

    def __setattr__(self, name, value):
        if not self._lock.locked():
            self.unlocked.append(name)
        setattr(self._sched, name, value)


def guarded(node: NodeRuntime) -> LockedOnly:
    node._sched = LockedOnly(node._sched, node._lock)
    return node._sched


def test_every_use_of_the_scheduler_holds_the_nodes_lock():
    def cannot_load(name, config):
        raise EngineError(f"{name}: no such file")

    async def main():
        node = NodeRuntime(fake_spec(), loader=FakeLoader(m={"cost_s": 0.01}))
        sched = guarded(node)
        await node.start()
        replies = await asyncio.gather(*(node.infer(req(value=i + 1)) for i in range(4)))
        assert all(r.error is None for r in replies)
        node.cancel("nobody")
        await node.drain()
        await node.stop()
        failing = NodeRuntime(fake_spec(), loader=cannot_load)
        failed = guarded(failing)
        with pytest.raises(EngineError):
            await failing.start()
        assert failing.status().state == "failed"
        return sched.unlocked + failed.unlocked

    assert run(main()) == []


def test_a_node_whose_wake_up_writes_fail_still_answers(monkeypatch):
    """The engine thread wakes the loop to settle the calls it ended; a wake-up byte
    that cannot be written (a full pipe) must not leave the node without answers."""
    monkeypatch.setattr(executor_module, "_WRITE", lambda fd, data, n: -1)

    async def main():
        node, _ = await started()
        for i in range(3):
            reply = await asyncio.wait_for(node.infer(req(value=i + 1)), 10)
            assert reply.error is None
        await node.stop()

    run(main())
