"""The traffic drivers (closed-loop lanes, open-loop arrivals) against a scripted client on
virtual time, and a flood against real node runtimes with fake engines (no Ray)."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import random
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from actors.node import NodeRuntime
from cluster.traffic import (
    Answer,
    Backoff,
    ClosedLoop,
    Counts,
    LoopThread,
    OpenLoop,
    TrafficError,
    in_background,
    prompt_ids,
)
from edgefleet.config import parse_config
from edgefleet.errors import Cancelled, EngineError, Evicted, Rejected
from edgefleet.messages import Reply
from edgefleet.request import InferRequest
from sim.workload import Arrival, parse_workload
from tests.fakes import FakeLoader, LocalFleet, x


@dataclass(frozen=True)
class Sent:
    request_id: str
    model: str
    inputs: Any
    priority: str | int
    deadline_s: float | None
    key: str | None
    at: float  # on the test's clock


class ScriptedClient:
    """Submits into futures the test answers; a cancel answers the request Cancelled
    (unless ``cancel_answers`` is off: a fleet that never answers)."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.clock = clock
        self.sent: list[Sent] = []
        self.pending: dict[str, cf.Future[Reply]] = {}
        self.cancelled: list[str] = []
        self.cancel_answers = True
        self.auto: Any = None  # a reply for every request at once: (request_id) -> Reply
        self.fail_on: int | None = None  # the submit with this index raises
        self._lock = threading.Lock()

    def submit(
        self,
        model: str,
        inputs: Any,
        *,
        priority: str | int = "foreground",
        deadline_s: float | None = None,
        key: str | None = None,
        request_id: str | None = None,
    ) -> cf.Future[Reply]:
        assert request_id is not None
        return self.send(Sent(request_id, model, inputs, priority, deadline_s, key, self.clock()))

    def send(self, sent: Sent) -> cf.Future[Reply]:
        if self.fail_on is not None and len(self.sent) == self.fail_on:
            raise ConnectionError("the fleet went away")
        future: cf.Future[Reply] = cf.Future()
        with self._lock:
            self.sent.append(sent)
            if self.auto is not None:
                future.set_result(self.auto(sent.request_id))
            else:
                self.pending[sent.request_id] = future
        return future

    def answer(self, request_id: str, error: Exception | None = None, **kw: Any) -> None:
        with self._lock:
            future = self.pending.pop(request_id)
        future.set_result(reply(request_id, error, **kw))

    def cancel(self, request_id: str, timeout_s: float = 10.0) -> bool:
        with self._lock:
            self.cancelled.append(request_id)
        if self.cancel_answers and request_id in self.pending:
            self.answer(request_id, Cancelled("cancelled"))
            return True
        return False


def reply(request_id: str, error: Exception | None = None, **kw: Any) -> Reply:
    outputs = None if error is not None else {"y": np.zeros((1, 4), np.float32)}
    return Reply(request_id, "n0", outputs, error, **kw)  # type: ignore[arg-type]


class VirtualTime:
    """A clock that moves only when a driver sleeps (or the test moves it)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


async def until(cond: Any, timeout_s: float = 10.0) -> None:
    """Let the loop run until ``cond()`` holds (bounded by a generous real timeout)."""
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        await asyncio.sleep(0.001)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


ONE = x(1.0)


# ------------------------------------------------------------------- closed loop


def test_lanes_keep_exactly_n_requests_outstanding():
    async def main() -> None:
        vt = VirtualTime()
        client = ScriptedClient(vt.clock)
        flood = ClosedLoop(client, "m", ONE, lanes=4, priority=3, clock=vt.clock, sleep=vt.sleep)
        await flood.start()
        await until(lambda: len(client.pending) == 4)
        rng = random.Random(7)
        want = Counts(submitted=4)
        for i in range(40):
            error = rng.choice([None, None, Evicted("out"), EngineError("bad"), Rejected("full")])
            client.answer(rng.choice(sorted(client.pending)), error, service_s=0.02, batch_size=2)
            want.add(reply("r", error, service_s=0.02, batch_size=2))
            want.submitted += 1
            await until(lambda i=i: len(client.sent) == 5 + i)
            assert len(client.pending) == 4 and flood.in_flight == 4
        assert all(s.priority == 3 and s.model == "m" and s.inputs is ONE for s in client.sent)
        assert len({s.request_id for s in client.sent}) == len(client.sent)  # a new id each
        live = set(client.pending)
        counts = await flood.stop(5.0)
        assert set(client.cancelled) == live and flood.in_flight == 0
        assert counts == want  # the cancelled replies after the stop are not counted
        assert counts.engine_s == pytest.approx(0.01 * counts.completed)
        assert counts.calls == pytest.approx(0.5 * counts.completed)

    run(main())


@pytest.mark.parametrize(
    ("backoff", "hints", "waits"),
    [
        (Backoff(min_retry_s=0.002, max_retry_s=0.05), [0.03, 5.0, 0.0], [0.03, 0.05, 0.002]),
        (Backoff(min_retry_s=0.0, max_retry_s=None), [0.03, 5.0, 0.0], [0.03, 5.0, 0.0]),
    ],
    ids=["capped", "uncapped"],
)
def test_a_refusal_waits_its_hint_clamped_then_sends_again(backoff, hints, waits):
    async def main() -> None:
        vt = VirtualTime(10.0)
        client = ScriptedClient(vt.clock)
        answers: list[Answer] = []
        flood = ClosedLoop(
            client,
            "m",
            ONE,
            lanes=1,
            backoff=backoff,
            on_answer=answers.append,
            clock=vt.clock,
            sleep=vt.sleep,
        )
        await flood.start()
        await until(lambda: len(client.pending) == 1)
        for n, (hint, wait) in enumerate(zip(hints, waits, strict=True), start=2):
            refused_at = vt.now
            client.answer(next(iter(client.pending)), Rejected("full", retry_after_s=hint))
            await until(lambda n=n: len(client.sent) == n)
            assert client.sent[-1].at - refused_at == pytest.approx(wait)
        assert vt.slept == pytest.approx([w for w in waits if w > 0])
        assert [a.final for a in answers] == [False] * len(hints)
        assert flood.counts.rejected == len(hints) and flood.counts.submitted == len(hints) + 1
        await flood.stop(5.0)

    run(main())


def test_after_an_eviction_or_an_error_a_lane_pauses_then_sends_a_new_request():
    async def main() -> None:
        vt = VirtualTime()
        client = ScriptedClient(vt.clock)
        flood = ClosedLoop(
            client,
            "m",
            ONE,
            lanes=1,
            backoff=Backoff(error_pause_s=0.005),
            clock=vt.clock,
            sleep=vt.sleep,
        )
        await flood.start()
        await until(lambda: len(client.pending) == 1)
        for n, error in enumerate([Evicted("out"), EngineError("bad"), None], start=2):
            client.answer(next(iter(client.pending)), error)
            await until(lambda n=n: len(client.sent) == n)
        assert vt.slept == pytest.approx([0.005, 0.005])  # none after a completion
        counts = await flood.stop(5.0)
        assert (counts.evicted, counts.other_errors, counts.completed) == (1, 1, 1)

    run(main())


def test_a_set_number_of_requests_one_lane_with_think_time_and_a_give_up():
    """The shape of a benchmark's foreground client: one request at a time, a pause after
    each, refusals retried for a while and the latency counted from the first attempt."""

    async def main() -> None:
        vt = VirtualTime()
        client = ScriptedClient(vt.clock)
        answers: list[Answer] = []
        fg = ClosedLoop(
            client,
            "m",
            ONE,
            lanes=1,
            priority=10,
            requests=3,
            think_s=0.1,
            backoff=Backoff(min_retry_s=0.001, max_retry_s=0.05, error_pause_s=0.1),
            give_up_s=1.0,
            on_answer=answers.append,
            clock=vt.clock,
            sleep=vt.sleep,
        )
        running = asyncio.ensure_future(fg.run())
        await until(lambda: len(client.sent) == 1)
        client.answer(client.sent[0].request_id)  # 1st: completes
        await until(lambda: len(client.sent) == 2)
        vt.now += 0.2
        client.answer(client.sent[1].request_id, Rejected("full", retry_after_s=0.02))
        await until(lambda: len(client.sent) == 3)
        vt.now += 0.01
        client.answer(client.sent[2].request_id)  # 2nd: completes on its second attempt
        await until(lambda: len(client.sent) == 4)
        vt.now += 2.0  # past give_up_s: this refusal is the 3rd request's answer
        client.answer(client.sent[3].request_id, Rejected("full", retry_after_s=0.02))
        counts = await running
        assert len(client.sent) == 4 and not client.pending
        assert [a.final for a in answers] == [True, False, True, True]
        assert answers[2].total_s == pytest.approx(0.2 + 0.02 + 0.01)
        assert answers[2].latency_s == pytest.approx(0.01)
        assert vt.slept == pytest.approx([0.1, 0.02, 0.1, 0.1])  # think, retry, think, error
        assert (counts.completed, counts.rejected, counts.submitted) == (2, 2, 4)

    run(main())


def test_stop_cancels_what_is_in_flight_and_ends_a_lane_waiting_out_a_refusal():
    async def main() -> None:
        client = ScriptedClient()
        flood = ClosedLoop(client, "m", ONE, lanes=3)
        await flood.start()
        await until(lambda: len(client.pending) == 3)
        # One lane waits out a long hint (real time): the stop must not wait for it.
        client.answer(sorted(client.pending)[0], Rejected("full", retry_after_s=1000.0))
        await until(lambda: len(client.pending) == 2 and flood.in_flight == 2)
        live = set(client.pending)
        t0 = time.monotonic()
        counts = await flood.stop(30.0)
        assert time.monotonic() - t0 < 20  # bounded by the cancels' answers, not the hint
        assert set(client.cancelled) == live and not client.pending
        assert flood.in_flight == 0 and counts.other_errors == 0 and counts.rejected == 1
        assert len(client.sent) == 3  # nothing sent after the stop

    run(main())


def test_stop_is_bounded_when_the_fleet_answers_nothing():
    async def main() -> None:
        client = ScriptedClient()
        client.cancel_answers = False
        flood = ClosedLoop(client, "m", ONE, lanes=5)
        await flood.start()
        await until(lambda: len(client.pending) == 5)
        t0 = time.monotonic()
        await flood.stop(0.2)
        assert time.monotonic() - t0 < 20  # the stop's own bound, with slack for a busy machine
        assert flood.in_flight == 0
        await until(lambda: len(client.cancelled) == 5)
        flood.check()  # lanes cancelled by the stop are not failures

    run(main())


def test_a_draining_stop_counts_the_replies_in_flight_and_cancels_the_late_ones():
    async def main() -> None:
        client = ScriptedClient()
        answers: list[Answer] = []
        flood = ClosedLoop(client, "m", ONE, lanes=3, on_answer=answers.append)
        await flood.start()
        await until(lambda: len(client.pending) == 3)
        first, second, late = sorted(client.pending)
        stopping = asyncio.ensure_future(flood.stop(0.5, drain=True))
        await asyncio.sleep(0.01)
        client.answer(first)
        client.answer(second, Rejected("full", retry_after_s=0.01))
        counts = await stopping
        assert (counts.completed, counts.rejected, counts.submitted) == (1, 1, 3)
        assert [a.final for a in answers] == [True, True]  # no retry while stopping
        assert flood.in_flight == 0
        await until(lambda: client.cancelled == [late])  # asked without waiting for it

    run(main())


def test_a_lane_whose_send_fails_ends_and_the_loop_reports_it():
    async def main() -> None:
        client = ScriptedClient()
        client.fail_on = 3
        flood = ClosedLoop(client, "m", ONE, lanes=3)
        await flood.start()
        await until(lambda: len(client.pending) == 3)
        client.answer(sorted(client.pending)[0])  # that lane's next send fails
        await until(lambda: flood.error is not None)
        client.fail_on = None
        client.answer(sorted(client.pending)[0])  # the other lanes go on
        await until(lambda: len(client.sent) == 4)
        assert len(client.pending) == 2
        await flood.stop(5.0)
        with pytest.raises(TrafficError, match="closed loop failed: ConnectionError"):
            flood.check()

    run(main())


def test_a_reply_that_does_not_come_in_time_fails_the_request():
    async def main() -> None:
        client = ScriptedClient()
        fg = ClosedLoop(client, "m", ONE, lanes=1, requests=1, reply_timeout_s=0.05)
        with pytest.raises(TrafficError, match="no reply to request"):
            await fg.run()
        assert fg.in_flight == 0

    run(main())


def test_a_driver_runs_once_and_checks_its_arguments():
    async def main() -> None:
        flood = ClosedLoop(ScriptedClient(), "m", ONE, lanes=1)
        await flood.start()
        with pytest.raises(TrafficError, match="started already"):
            await flood.start()
        await flood.stop(1.0)

    run(main())
    with pytest.raises(ValueError, match="lanes"):
        ClosedLoop(ScriptedClient(), "m", ONE, lanes=0)
    with pytest.raises(ValueError, match="max_retry_s"):
        Backoff(min_retry_s=0.1, max_retry_s=0.01)


# --------------------------------------------------------------------- open loop


def test_the_open_loop_sends_each_arrival_once_at_its_time():
    arrivals = [
        Arrival(0.0, "a", 10),
        Arrival(0.5, "b", 3, rows=2, deadline_s=0.25, key="k0"),
        Arrival(0.5, "a", 0),
        Arrival(2.0, "a", 7),
    ]

    async def main() -> None:
        vt = VirtualTime(100.0)
        client = ScriptedClient(vt.clock)
        answers: list[Answer] = []
        driver = OpenLoop(
            client,
            arrivals,
            {"a": x(1.0), "b": x(2.0)},
            on_answer=answers.append,
            clock=vt.clock,
            sleep=vt.sleep,
        )
        running = asyncio.ensure_future(driver.run())
        await until(lambda: len(client.sent) == 4)  # none waits for a reply
        sent = client.sent
        assert [s.at for s in sent] == [100.0, 100.5, 100.5, 102.0]
        assert [(s.model, s.priority, s.deadline_s, s.key) for s in sent] == [
            (a.model, a.priority, a.deadline_s, a.key) for a in arrivals
        ]
        assert sent[1].inputs["x"].shape == (2, 4) and sent[0].inputs["x"].shape == (1, 4)
        client.answer(sent[1].request_id, Rejected("full", retry_after_s=0.1))
        for s in (sent[0], sent[2], sent[3]):
            client.answer(s.request_id)
        counts = await running
        assert len(client.sent) == 4  # a refusal is an answer: no retry
        assert (counts.submitted, counts.completed, counts.rejected) == (4, 3, 1)
        assert sorted(arrivals.index(a.arrival) for a in answers) == [0, 1, 2, 3]
        assert all(a.due == a.sent for a in answers) and driver.max_lag_s == 0.0

    run(main())


def test_an_open_loop_that_falls_behind_sends_late_and_says_how_late():
    async def main() -> None:
        vt = VirtualTime()
        client = ScriptedClient(vt.clock)
        client.auto = reply
        slow = client.send

        def send(sent: Sent) -> cf.Future[Reply]:
            vt.now += 0.3  # each send takes 0.3 s
            return slow(sent)

        client.send = send  # type: ignore[method-assign]
        arrivals = [Arrival(0.1 * i, "a", 3) for i in range(4)]
        driver = OpenLoop(client, arrivals, {"a": ONE}, clock=vt.clock, sleep=vt.sleep)
        counts = await driver.run()
        assert counts.submitted == 4 and vt.slept == []
        assert driver.max_lag_s == pytest.approx(0.9 - 0.3)  # the last: sent at 0.9, due 0.3

    run(main())


async def open_loop(
    client: ScriptedClient, arrivals: Iterable[Arrival], inputs: Any
) -> tuple[Counts, list[Answer]]:
    """Run an open loop of ``arrivals`` on virtual time, every request answered at once;
    its counts and answers."""
    vt = VirtualTime()
    client.clock, client.auto = vt.clock, reply
    answers: list[Answer] = []
    driver = OpenLoop(
        client, arrivals, inputs, on_answer=answers.append, clock=vt.clock, sleep=vt.sleep
    )
    return await driver.run(), answers


def test_the_open_loop_replays_a_workloads_arrivals():
    workload = parse_workload(
        {
            "seed": 3,
            "requests": 60,
            "arrivals": {"process": "poisson", "rate": 50},
            "mix": [
                {"model": "a", "priority": "foreground", "weight": 1, "deadline_ms": 200},
                {"model": "b", "priority": "background", "weight": 2, "keys": 2},
            ],
        }
    )
    arrivals = list(workload.arrivals(random.Random(workload.seed), nodes=1))

    async def main() -> None:
        client = ScriptedClient()
        counts, answers = await open_loop(client, iter(arrivals), lambda a: x(float(a.priority)))
        assert counts.completed == len(arrivals) == len(client.sent) == 60
        for s, a in zip(client.sent, arrivals, strict=True):
            assert s.at == pytest.approx(a.at)
            assert (s.model, s.priority, s.deadline_s, s.key) == (
                a.model,
                a.priority,
                a.deadline_s,
                a.key,
            )
            assert s.inputs["x"][0, 0] == a.priority
        assert {a.arrival for a in answers} == set(arrivals)

    run(main())


class GeneratingClient(ScriptedClient):
    """Also sends generations: each is recorded (its inputs: the prompt and what else
    it was sent with) and answered like an inference."""

    def submit_generation(
        self, model: str, prompt_ids: tuple[int, ...], **kw: Any
    ) -> cf.Future[Reply]:
        rid = kw.pop("request_id")
        at = self.clock()
        return self.send(
            Sent(rid, model, (prompt_ids, kw), kw["priority"], kw["deadline_s"], None, at)
        )


def test_the_open_loop_sends_generations_to_a_client_that_takes_them():
    arrivals = [
        Arrival(0.0, "a", 3),
        Arrival(0.5, "lm", 10, deadline_s=2.0, session="s1", prompt_tokens=70, max_new_tokens=5),
        Arrival(1.0, "lm", 3, prompt_tokens=3, max_new_tokens=9),
    ]

    async def main() -> None:
        client = GeneratingClient()
        counts, answers = await open_loop(client, arrivals, {"a": ONE})
        assert counts.completed == counts.submitted == 3 and len(answers) == 3
        inference, chat, summary = client.sent
        assert inference.inputs is ONE and chat.at == pytest.approx(0.5)
        prompt, kw = chat.inputs
        assert prompt == prompt_ids(70) and len(prompt) == 70 and max(prompt) <= 64
        assert kw == {"max_new_tokens": 5, "priority": 10, "deadline_s": 2.0, "session": "s1"}
        assert summary.inputs == (prompt_ids(3), {"max_new_tokens": 9, "priority": 3} | {
            "deadline_s": None, "session": None})  # fmt: skip
        assert {a.arrival for a in answers} == set(arrivals)

    run(main())


def test_the_open_loop_refuses_what_it_cannot_send():
    cases = [
        (
            Arrival(0.0, "lm", 3, prompt_tokens=8, max_new_tokens=4),
            {"lm": ONE},
            "is a generation; this client sends inferences only",
        ),
        (Arrival(0.0, "z", 3), {"a": ONE}, "no inputs for model 'z'; inputs for: a"),
        (Arrival(0.0, "a", 3, rows=4), {"a": {"x": np.zeros(4, np.float32)}}, "asks for 4 rows"),
    ]
    for arrival, inputs, message in cases:
        client = ScriptedClient()
        driver = OpenLoop(client, [arrival], inputs)
        with pytest.raises(TrafficError, match=message):
            run(driver.run())
        assert client.sent == []


def test_stopping_the_open_loop_sends_no_more_and_cancels_what_is_in_flight():
    async def main() -> None:
        client = ScriptedClient()
        arrivals = [Arrival(0.0, "a", 3), Arrival(0.0, "a", 3), Arrival(3600.0, "a", 3)]
        driver = OpenLoop(client, arrivals, {"a": ONE})
        await driver.start()
        await until(lambda: len(client.pending) == 2)
        t0 = time.monotonic()
        counts = await driver.stop(30.0)
        assert time.monotonic() - t0 < 20
        assert len(client.sent) == 2 and sorted(client.cancelled) == sorted(
            s.request_id for s in client.sent
        )
        assert counts.submitted == 2 and counts.other_errors == 0 and driver.in_flight == 0

    run(main())


# ----------------------------------------------------- from synchronous code, no Ray


def test_the_loop_thread_runs_calls_and_closes_what_is_left():
    with LoopThread("test-traffic") as thread:
        assert thread.run(asyncio.sleep(0, "done"), 5) == "done"
        assert thread.call(threading.current_thread) is thread._thread
        forever = thread.spawn(asyncio.sleep(3600))
        with pytest.raises(TrafficError, match="not done"):
            thread.run(asyncio.sleep(3600), 0.05)
    assert forever.cancelled() and thread.loop.is_closed()
    with pytest.raises(TrafficError, match="closed"):
        thread.spawn(asyncio.sleep(0))


class LocalClient(ScriptedClient):
    """Sends to a LocalFleet (placement in the caller, real node runtimes, fake engines)."""

    def __init__(self, fleet: LocalFleet) -> None:
        super().__init__()
        self.fleet = fleet

    def send(self, sent: Sent) -> cf.Future[Reply]:
        assert isinstance(sent.priority, int)
        request = InferRequest(
            model=sent.model,
            inputs=sent.inputs,
            priority=sent.priority,
            id=sent.request_id,
            deadline_unix=InferRequest.deadline_from_timeout(sent.deadline_s),
            key=sent.key,
        )
        return self.fleet.dispatcher.submit(request)

    def cancel(self, request_id: str, timeout_s: float = 10.0) -> bool:
        return bool(self.fleet.run(self.fleet.router.cancel(request_id), timeout_s))


def test_a_background_flood_on_a_fleet_of_real_node_runtimes():
    config = parse_config(
        {
            "fleet": {"name": "t"},
            "models": {"m": {"path": "m.onnx", "warmup": False, "memory_mb": 1}},
            "node_defaults": {"queue": {"capacity": 4}},
            "nodes": [{"name": "a"}],
            "router": {"placement": {"shed": {}}, "report_interval_s": 0.05},
        },
        Path("/nonexistent"),
    )
    fleet = LocalFleet(
        config, lambda spec: NodeRuntime(spec, loader=FakeLoader(m={"cost_s": 0.01}))
    )
    try:
        client = LocalClient(fleet)
        flood = ClosedLoop(client, "m", ONE, lanes=8, priority=3, backoff=Backoff(max_retry_s=0.02))
        with in_background(flood, 10.0) as running:
            assert running is flood
            end = time.monotonic() + 30
            while flood.counts.completed < 10 or flood.counts.rejected < 3:
                assert time.monotonic() < end, flood.counts
                time.sleep(0.01)
            assert flood.in_flight <= 8
        counts = flood.counts
        assert counts.other_errors == 0 and counts.evicted == 0
        assert counts.submitted >= counts.completed + counts.rejected
        node = fleet.node("a")
        end = time.monotonic() + 30  # the stop cancelled the rest: the node goes idle
        while node.status().queue_length or node.status().running is not None:
            assert time.monotonic() < end, node.status()
            time.sleep(0.01)
    finally:
        fleet.close()
