"""The fleet simulator (sim/fleet.py, sim/run.py, `edgefleet simulate`): a simulated node
answers as the live node does, and the simulated fleet behaves as the real dispatcher
and node scheduler make it, in exact simulated time."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

import sim.run
from actors.node import NodeRuntime
from cluster import dispatch
from cluster.cli import main
from edgefleet.config import FleetConfig, NodeSpec, QueueConfig, load_config
from edgefleet.errors import ConfigError, DeadlineExceeded, NodeLost, Rejected, Superseded
from edgefleet.messages import GenerationResult, Reply
from edgefleet.request import GenerateRequest, InferRequest
from sim.fleet import EventLoop, ModelCost, Network, SimFleet, SimNode, grow
from sim.report import LATENCY_PNG, OUTCOMES, QUEUE_PNG, write_report
from sim.run import Progress, compare, costs_from_status, outcome, recorded_costs, simulate
from sim.workload import RecordedCall, load_workload, parse_workload
from tests.fakes import CallGate, FakeLoader, fake_spec, x

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / "configs" / "local.yaml"
STEADY = REPO / "configs" / "sim" / "steady.yaml"

# ------------------------------------------------------- the simulated node and the live one

# Engine seconds of each fake model's call, whatever its rows (FakeEngine waits cost_s per
# call): the live node's fake engines and the simulator's cost tables both come from here.
FAKE_COSTS_S = {"a": 0.1, "b": 0.01, "f": 0.01, "m": 0.01}
BATCH = 4  # rows per call of "m", the one model that batches


def exact_spec() -> NodeSpec:
    batching = {"window_ms": 20, "max_batch_size": BATCH, "only_if_faster": False}
    models = {"a": {}, "b": {}, "f": {"dedup": "follow"}, "m": {"batching": batching}}
    return fake_spec(models, capacity=9)


def fake_costs() -> dict[str, ModelCost]:
    """The fake engines' costs as the simulator's tables: the same time for any rows."""
    return {
        name: ModelCost(call_ms={1: s * 1000, BATCH: s * 1000}) for name, s in FAKE_COSTS_S.items()
    }


@dataclass(frozen=True)
class Step:
    """At simulated time ``at``: a request arrives, or (``cancel``) is cancelled."""

    at: float
    id: str
    model: str = "b"
    priority: int = 3
    key: str | None = None
    deadline_s: float | None = None  # after ``at``
    cancel: bool = False


FG, INLINE, BG, OFFLINE = 10, 7, 3, 0

# What happens, with the node's queue of 9 (B, the first request, is running and not
# queued):
#   B       background on the slow model "a": runs first, and is preempted by F later
#   i1..i6  inline on "m": batched 4 then 2 once the engine is free
#   h1, h2  the same key on "f" (dedup: follow): h1 gets h2's answer when h2 has run
#   g1, g2  the same key on "b" (dedup: supersede): g1 is answered superseded at once
#   i4      fills the queue; i5 evicts o2 (lowest priority, newest); o3 (offline) finds
#           nothing lower to evict and is rejected; g3 evicts o1; g4 finds nothing lower
#           than background and is rejected
#   c1      cancelled while queued
#   D       evicts g3 (newest background), then its deadline passes while B still holds
#           the engine
#   F       foreground: B is aborted (gap 7 >= 5) and requeued at the head of
#           background, so it runs again before g2
#
# Where the two nodes differ by nature, the trace keeps out of the way:
# - Every arrival comes while B holds the engine (held by a CallGate on the live node).
#   A preemption aborts B at once in the simulator, and on the live node only when the
#   gate lets B's call go; F is the last arrival, so both then pick the next call from
#   the same queue.
# - D's deadline is a real timer on the live node: F is sent only once D is answered.
# - Batching windows (20 ms) have all passed when the engine is free (D's deadline alone
#   is 50 ms), so the batches are what is queued, whatever the live node's pace.
# - Only inline requests use "m": the simulator gives the scheduler its cost table as
#   measured costs, the live node (fake engines are not warmed up) none, and that table
#   decides whether lower-priority rows may join a call.
TRACE = [
    Step(0.0, "B", model="a", priority=BG),
    Step(0.0010, "i1", model="m", priority=INLINE),
    Step(0.00102, "h1", model="f", priority=INLINE, key="frame"),
    Step(0.00104, "h2", model="f", priority=INLINE, key="frame"),
    Step(0.0011, "o1", priority=OFFLINE),
    Step(0.0012, "i2", model="m", priority=INLINE),
    Step(0.0013, "g1", priority=BG, key="cam"),
    Step(0.0014, "o2", priority=OFFLINE),
    Step(0.0015, "g2", priority=BG, key="cam"),
    Step(0.0016, "i3", model="m", priority=INLINE),
    Step(0.0017, "c1", priority=BG),
    Step(0.0018, "i4", model="m", priority=INLINE),
    Step(0.0019, "i5", model="m", priority=INLINE),
    Step(0.0020, "o3", priority=OFFLINE),
    Step(0.0021, "g3", priority=BG),
    Step(0.0022, "g4", priority=BG),
    Step(0.0023, "c1", cancel=True),
    Step(0.0024, "i6", model="m", priority=INLINE),
    Step(0.0025, "D", priority=INLINE, deadline_s=0.05),
    Step(0.0600, "F", priority=FG),
]


def trace_request(step: Step, value: float, deadline_unix: float | None) -> InferRequest:
    return InferRequest(
        step.model, x(value), step.priority, step.id, deadline_unix=deadline_unix, key=step.key
    )


Answer = tuple[str, str, int]  # request id, outcome, requests in the call that ran it


def simulated_answers(trace: list[Step]) -> list[tuple[float, Answer]]:
    """Each answer a SimNode gives, in order, with its simulated time."""
    loop = EventLoop()
    answers: list[tuple[float, Answer]] = []

    def answered(rid: str, answer: Reply | GenerationResult, outside_s: float | None) -> None:
        assert isinstance(answer, Reply)
        answers.append((loop.t, (rid, outcome(answer.error), answer.batch_size)))

    node = SimNode(loop, exact_spec(), fake_costs(), answered)
    for i, step in enumerate(trace):
        if step.cancel:
            loop.at(step.at, node.cancel, step.id)
        else:
            deadline = None if step.deadline_s is None else step.at + step.deadline_s
            loop.at(step.at, node.receive, trace_request(step, i + 1.0, deadline))
    loop.run()
    return answers


async def until(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.002)


async def live_answers(trace: list[Step], simulated: list[tuple[float, Answer]]) -> list[Answer]:
    """Each answer a live NodeRuntime with fake engines gives, in the order its callers
    receive them.

    The first request's call is held on the engine thread until every other step is
    done. Before each step the test waits until the live node has given as many answers
    as the simulated one had by that step's time (the deadline that passes while queued
    is a real timer here), so each arrival finds the same queue in both."""
    loader = FakeLoader(**{name: {"cost_s": s} for name, s in FAKE_COSTS_S.items()})
    node = NodeRuntime(exact_spec(), loader=loader)
    await node.start()
    gate = CallGate(loader.engines[trace[0].model])
    answers: list[Answer] = []
    tasks = []

    def record(task: asyncio.Task[Reply]) -> None:
        reply = task.result()
        answers.append((reply.request_id, outcome(reply.error), reply.batch_size))

    sent = 0
    for i, step in enumerate(trace):
        due = sum(t < step.at for t, _ in simulated)
        await until(lambda due=due: len(answers) >= due, f"{due} answers before {step.id}")
        if step.cancel:
            assert node.cancel(step.id)
            continue
        deadline = InferRequest.deadline_from_timeout(step.deadline_s)
        task = asyncio.create_task(node.infer(trace_request(step, i + 1.0, deadline)))
        task.add_done_callback(record)
        tasks.append(task)
        sent += 1
        await until(lambda n=sent: node.status().counters["received"] == n, f"{step.id} admitted")
        if i == 0:
            await gate.entered()  # the first call holds the engine from now on
    gate.open()
    await asyncio.gather(*tasks)
    await node.stop()
    return answers


def test_the_simulated_node_and_the_live_node_give_the_same_answers_in_the_same_order():
    simulated = simulated_answers(TRACE)
    live = asyncio.run(asyncio.wait_for(live_answers(TRACE, simulated), 60))
    assert [answer for _, answer in simulated] == live
    # The trace exercises what it is meant to.
    assert live == [
        ("g1", "superseded", 0),
        ("o2", "evicted", 0),
        ("o3", "rejected", 0),
        ("o1", "evicted", 0),
        ("g4", "rejected", 0),
        ("c1", "cancelled", 0),
        ("g3", "evicted", 0),
        ("D", "expired", 0),
        ("F", "completed", 1),
        ("i1", "completed", BATCH),
        ("i2", "completed", BATCH),
        ("i3", "completed", BATCH),
        ("i4", "completed", BATCH),
        ("h2", "completed", 1),
        ("h1", "completed", 1),
        ("i5", "completed", 2),
        ("i6", "completed", 2),
        ("B", "completed", 1),
        ("g2", "completed", 1),
    ]


# ------------------------------------------------------------------ one simulated node

Answered = list[tuple[float, str, Reply | GenerationResult]]


def sim_node(
    spec: NodeSpec, costs: dict[str, ModelCost], **kw: Any
) -> tuple[EventLoop, SimNode, Answered]:
    """A SimNode on its own event loop, and the list its answers go to, with their
    simulated times."""
    loop = EventLoop()
    answers: Answered = []
    node = SimNode(loop, spec, costs, lambda rid, a, _: answers.append((loop.t, rid, a)), **kw)
    return loop, node, answers


def infer(rid: str, model: str = "a", priority: int = BG, **kw: Any) -> InferRequest:
    return InferRequest(model, x(1.0), priority, rid, **kw)


def generate(
    rid: str, max_new: int, priority: int, prompt: int = 10, model: str = "lm"
) -> GenerateRequest:
    return GenerateRequest(model, tuple(range(prompt)), max_new, priority, rid)


def when(answers: Answered) -> list[tuple[Any, str]]:
    """(time, request id) of each answer, the times compared to a nanosecond."""
    return [(pytest.approx(t, abs=1e-9), rid) for t, rid, _ in answers]


def test_queued_work_runs_highest_priority_first_on_one_node():
    # the running call is inline: a foreground arrival (gap 3) does not preempt it
    loop, node, answers = sim_node(fake_spec({"a": {}}), {"a": ModelCost({1: 1.0})})
    loop.at(0.0, node.receive, infer("first", priority=INLINE))
    for i, p in enumerate([OFFLINE, BG, INLINE, FG, OFFLINE, FG]):
        loop.at(0.0001 * (i + 1), node.receive, infer(f"p{p}-{i}", priority=p))
    loop.run()
    assert [rid for _, rid, _ in answers] == [
        "first",
        "p10-3",
        "p10-5",
        "p7-2",
        "p3-1",
        "p0-0",
        "p0-4",
    ]
    assert [t for t, _, _ in answers] == pytest.approx([0.001 * i for i in range(1, 8)])


def test_a_foreground_arrival_preempts_a_background_call_which_then_completes_once():
    busy: list[float] = []
    costs = {"a": ModelCost({1: 10.0}), "b": ModelCost({1: 2.0})}
    loop, node, answers = sim_node(fake_spec({"a": {}, "b": {}}), costs, on_busy=busy.append)
    loop.at(0.0, node.receive, infer("bg", "a", BG))
    loop.at(0.003, node.receive, infer("fg", "b", FG))
    loop.run()
    # bg is aborted at 3 ms and runs again, in full, after fg
    assert when(answers) == [(0.005, "fg"), (0.015, "bg")]
    assert all(a.error is None for _, _, a in answers)
    assert busy == pytest.approx([0.003, 0.002, 0.010])  # the aborted 3 ms count as busy


def decoder_spec(**update: Any) -> NodeSpec:
    return fake_spec({"blk": {}, "lm": {"kind": "decoder"}}).model_copy(update=update)


LM = ModelCost(prefill_ms_per_token=0.1, step_ms={1: 1.0, 2: 1.5})


def test_two_generations_of_one_decoder_decode_together_at_the_step_tables_cost():
    loop, node, answers = sim_node(decoder_spec(), {"blk": ModelCost({1: 5.0}), "lm": LM})
    loop.at(0.0, node.receive, infer("blk", "blk", INLINE))
    loop.at(0.0, node.receive, generate("g1", 10, INLINE))
    loop.at(0.0, node.receive, generate("g2", 20, INLINE))
    gens: dict[str, Any] = {}
    running: list[tuple[str, ...]] = []
    loop.at(0.001, lambda: gens.update(node._gens))
    loop.at(0.010, lambda: running.append(node.status(loop.t).running.request_ids))
    loop.run()
    assert running == [("g1", "g2")]
    # From 5 ms: both prompts prefilled (2 x 10 tokens x 0.1 ms), 10 steps of two at
    # 1.5 ms (g1 ends), 10 steps of one at 1 ms. As on a live node, the decode call
    # answers its generations when it ends.
    assert when(answers) == [(0.005, "blk"), (0.032, "g1"), (0.032, "g2")]
    assert (gens["g1"].made, gens["g2"].made) == (10, 20)
    assert [a.finish_reason for _, _, a in answers[1:]] == ["length", "length"]


def test_a_generation_spends_a_recorded_time_outside_its_node():
    # recorded for generations of 3 and 9 tokens: these make 4, nearer 3
    recorded = replace(LM, generation_outside_ms={3: (25.0, 40.0), 9: (500.0,)})
    for cost, expected in ((LM, {None}), (recorded, {0.025, 0.040})):
        loop = EventLoop()
        outside: list[float | None] = []
        node = SimNode(
            loop, decoder_spec(), {"lm": cost}, lambda rid, a, o, out=outside: out.append(o)
        )
        for i in range(20):
            loop.at(i * 1.0, node.receive, generate(f"g{i}", 4, INLINE))
        loop.run()
        assert len(outside) == 20 and set(outside) == expected


def test_a_foreground_generation_pauses_a_background_one_which_resumes_to_max_new_tokens():
    loop, node, answers = sim_node(decoder_spec(), {"lm": LM})
    loop.at(0.0, node.receive, generate("bg", 20, BG))
    loop.at(0.0055, node.receive, generate("fg", 5, FG))
    gens: dict[str, Any] = {}
    seen = []
    loop.at(0.001, lambda: gens.update(node._gens))

    def look() -> None:
        status = node.status(loop.t)
        seen.append((status.running.request_ids, status.paused, gens["bg"].made))

    loop.at(0.009, look)
    loop.run()
    # bg: prefill 1 ms, then a token a ms; fg arrives half-way through bg's 5th token,
    # which bg finishes (6 ms) before it pauses. fg: prefill 1 ms and 5 tokens (12 ms).
    # bg resumes without a second prefill: 15 tokens more (27 ms).
    assert seen == [(("fg",), {BG: 1}, 5)]
    assert when(answers) == [(0.012, "fg"), (0.027, "bg")]
    assert gens["bg"].made == 20 and answers[1][2].finish_reason == "length"
    assert all(a.error is None for _, _, a in answers)


def test_a_background_lifecycle_cuts_a_running_background_generation_at_its_budget():
    spec = local_config().node_specs()[0]  # node_defaults.token_budget: background 0.25
    assert spec.token_budget["background"]["background"] == 0.25
    lm = ModelCost(step_ms={1: 1.0})
    loop, node, answers = sim_node(spec, {"tiny_lm": lm})
    loop.at(0.0, node.receive, generate("bg", 40, BG, model="tiny_lm"))
    gens: dict[str, Any] = {}
    loop.at(0.001, lambda: gens.update(node._gens))
    loop.at(0.0055, node.set_lifecycle, "background")
    loop.run()
    # a quarter of 40 tokens: the generation ends at its 10th token, 10 ms in
    assert when(answers) == [(0.010, "bg")]
    assert gens["bg"].made == 10 and answers[0][2].finish_reason == "budget"


def test_dedup_supersede_answers_the_older_request_when_the_newer_arrives():
    costs = {"a": ModelCost({1: 10.0}), "b": ModelCost({1: 1.0})}
    loop, node, answers = sim_node(fake_spec({"a": {}, "b": {}}), costs)
    loop.at(0.0, node.receive, infer("blk", "a"))
    loop.at(0.001, node.receive, infer("old", "b", key="k"))
    loop.at(0.002, node.receive, infer("new", "b", key="k"))
    loop.run()
    assert when(answers) == [(0.002, "old"), (0.010, "blk"), (0.011, "new")]
    assert isinstance(answers[0][2].error, Superseded) and answers[2][2].error is None


def test_dedup_follow_gives_the_older_request_the_newer_ones_answer():
    costs = {"a": ModelCost({1: 10.0}), "b": ModelCost({1: 1.0})}
    loop, node, answers = sim_node(fake_spec({"a": {}, "b": {"dedup": "follow"}}), costs)
    loop.at(0.0, node.receive, infer("blk", "a"))
    loop.at(0.001, node.receive, infer("old", "b", key="k"))
    loop.at(0.002, node.receive, infer("mid", "b", key="k"))
    loop.at(0.003, node.receive, infer("new", "b", key="k"))
    loop.run()
    # each superseded caller gets the answer of the request that replaced it, under its
    # own id, once that one is answered (as a live node forwards it)
    assert when(answers) == [(0.010, "blk"), (0.011, "new"), (0.011, "mid"), (0.011, "old")]
    assert all(a.error is None and a.request_id == rid for _, rid, a in answers)
    assert not node._held


def test_a_deadline_passing_while_queued_answers_expired_at_the_deadline():
    loop, node, answers = sim_node(fake_spec({"a": {}}), {"a": ModelCost({1: 10.0})})
    loop.at(0.0, node.receive, infer("blk"))
    loop.at(0.001, node.receive, infer("late", deadline_unix=0.0042))
    loop.run()
    assert when(answers) == [(0.0042, "late"), (0.010, "blk")]
    assert isinstance(answers[0][2].error, DeadlineExceeded)


# ------------------------------------------------------------------------ a small fleet

# engine ms per call of configs/local.yaml's models on a node of speed 1
FLEET_COSTS = {
    "classifier": ModelCost({1: 1.0, 8: 6.5}),
    "detector": ModelCost({1: 11.0, 4: 42.0}),
    "heavy": ModelCost({1: 4.0, 8: 12.0}),
    "stateful": ModelCost({1: 0.2}),
    "tiny_lm": ModelCost(prefill_ms_per_token=0.05, step_ms={1: 0.15, 4: 0.3}),
}


def local_config() -> FleetConfig:
    return load_config(LOCAL)


def small_queues(config: FleetConfig, capacity: int) -> list[NodeSpec]:
    return [
        s.model_copy(update={"queue": QueueConfig(capacity=capacity)}) for s in config.node_specs()
    ]


class Calls:
    """Requests submitted to a SimFleet at simulated times, and their answers."""

    def __init__(self, fleet: SimFleet) -> None:
        self.fleet = fleet
        self.answers: dict[str, list[tuple[float, Any]]] = {}

    def at(self, t: float, request: InferRequest | GenerateRequest) -> None:
        self.fleet.loop.at(t, self.submit, request)

    def submit(self, request: InferRequest | GenerateRequest) -> None:
        fut = self.fleet.submit(request)
        fut.add_done_callback(lambda f: self._answered(request.id, f))

    def _answered(self, rid: str, fut: cf.Future[Any]) -> None:
        self.answers.setdefault(rid, []).append((self.fleet.loop.t, fut.result()))

    def one(self, rid: str) -> Any:
        (answer,) = self.answers[rid]
        return answer[1]

    def node(self, rid: str) -> str:
        return self.one(rid).node


def test_a_slower_node_reports_the_slower_cost_tables_it_would_measure():
    costs = {"classifier": ModelCost({1: 2.0, 8: 10.0})}
    fleet = SimFleet(local_config(), costs, speeds=[1.0, 0.5])
    tables = [
        next(m for m in n.status(0.0).models if m.name == "classifier").cost_ms for n in fleet.nodes
    ]
    assert tables[0][1] == pytest.approx(2.0) and tables[0][8] == pytest.approx(10.0)
    assert tables[1][1] == pytest.approx(4.0) and tables[1][8] == pytest.approx(20.0)
    calls = Calls(fleet)
    for i in range(4):  # one at a time: each goes where it ends first, the faster node
        calls.at(i * 0.1, InferRequest("classifier", x(1.0), 10, f"r{i}"))
    fleet.loop.run(until=lambda: len(calls.answers) == 4)
    assert {calls.node(f"r{i}") for i in range(4)} == {fleet.nodes[0].spec.name}


def test_a_node_failure_gives_every_request_it_held_one_answer_replaced_or_node_lost():
    config = local_config()
    fleet = SimFleet(config, FLEET_COSTS, seed=3)
    ran: Counter[str] = Counter()  # answers the nodes gave, by request id
    for node in fleet.nodes:
        give = node._answer

        def counted(rid: str, answer: Any, outside_s: Any, give: Any = give) -> None:
            ran[rid] += 1
            give(rid, answer, outside_s)

        node._answer = counted
    calls = Calls(fleet)
    ids = [f"r{i}" for i in range(16)]
    for i, rid in enumerate(ids):  # every other one at most once
        calls.at(0.0, infer(rid, "heavy", BG, at_most_once=i % 2 == 0))
    held: dict[str, int] = {}

    def fail() -> None:
        held.update(fleet._where)
        fleet.fail(0)

    fleet.loop.at(0.010, fail)
    fleet.loop.run(until=lambda: len(calls.answers) == len(ids))
    lost = {rid for rid, i in held.items() if i == 0}
    once = {rid for rid in lost if int(rid[1:]) % 2 == 0}
    assert once and lost - once, "node 0 held requests of both kinds when it failed"
    assert sorted(calls.answers) == sorted(ids)
    assert all(len(a) == 1 for a in calls.answers.values())
    for rid in ids:
        answer = calls.one(rid)
        if rid in once:
            assert isinstance(answer.error, NodeLost)
        else:
            assert answer.error is None
            assert rid not in lost or answer.node == "edge-1"  # placed again elsewhere
    # no node answered a request twice; those lost at most once ran nowhere after
    assert ran == Counter(set(ids) - once)
    counters = fleet.dispatcher.counted()
    assert counters["replaced"] == len(lost - once)
    assert counters["nodelost"] == len(once)


def test_a_rejoined_node_takes_work_again_after_its_next_report():
    config = local_config()  # reports every 0.5 s
    slow = dict(FLEET_COSTS, heavy=ModelCost({1: 200.0}))
    fleet = SimFleet(config, slow, seed=1)
    calls = Calls(fleet)
    fleet.loop.at(0.001, fleet.fail, 0)  # the report at 0.5 s says it is down
    fleet.loop.at(0.6, fleet.rejoin, 0)
    for i in range(5):  # 1 s of work, all on edge-1: edge-0 is still down as reported
        calls.at(0.7, infer(f"before{i}", "heavy", BG))
    calls.at(0.95, infer("before5", "heavy", BG))
    calls.at(1.05, infer("after", "heavy", BG))  # edge-0 reported up again at 1.0 s
    fleet.loop.run(until=lambda: len(calls.answers) == 7)
    assert {calls.node(f"before{i}") for i in range(6)} == {"edge-1"}
    assert calls.node("after") == "edge-0"
    assert all(calls.one(rid).error is None for rid in calls.answers)


def test_a_request_refused_by_a_full_node_spills_to_another():
    config = local_config()
    slow = dict(FLEET_COSTS, heavy=ModelCost({1: 100.0}))
    fleet = SimFleet(config, slow, specs=small_queues(config, 4), seed=1)
    calls = Calls(fleet)
    calls.at(0.0, infer("long", "heavy", BG))
    other: list[int] = []

    def fill() -> None:  # another caller's work, not in this caller's view until a report
        other.append(1 - fleet._where["long"])
        node = fleet.nodes[other[0]]
        for i in range(5):  # one runs, four fill the queue
            node.receive(infer(f"other{i}", "heavy", BG))

    fleet.loop.at(0.001, fill)
    calls.at(0.002, infer("r", "heavy", BG))
    fleet.loop.run(until=lambda: len(calls.answers) == 2)
    # r went first to the node that looked idle, was refused (its queue is full) and
    # was taken by the node running "long"
    assert calls.one("r").error is None
    assert calls.node("r") == calls.node("long") == fleet.nodes[1 - other[0]].spec.name
    assert fleet.dispatcher.counted()["spilled"] == 1


def test_background_work_is_shed_when_every_node_is_past_its_share_but_foreground_is_not():
    config = local_config()  # background may fill 3/4 of a queue
    slow = dict(FLEET_COSTS, heavy=ModelCost({1: 100.0}))
    fleet = SimFleet(config, slow, specs=small_queues(config, 4), seed=1)
    calls = Calls(fleet)
    for i in range(7):
        calls.at(0.0, infer(f"bg{i}", "heavy", BG))
    calls.at(0.0, infer("fg", "heavy", FG))
    fleet.loop.run(until=lambda: len(calls.answers) == 8)
    shed = [rid for rid in calls.answers if isinstance(calls.one(rid).error, Rejected)]
    assert shed == ["bg6"]  # three in flight on each node of 4: a fourth would be past 3/4
    assert "shed" in str(calls.one("bg6").error)
    assert calls.answers["bg6"][0][0] == 0.0  # refused at once, no node was asked
    assert calls.one("fg").error is None
    assert fleet.dispatcher.counted()["shed"] == 1


def test_a_deadline_passing_while_queued_reaches_the_caller_one_hop_after_it():
    config = local_config()
    slow = dict(FLEET_COSTS, heavy=ModelCost({1: 100.0}))
    one = config.node_specs()[:1]
    fleet = SimFleet(config, slow, specs=one, seed=1)
    calls = Calls(fleet)
    calls.at(0.0, infer("long", "heavy", BG))
    calls.at(0.001, infer("late", "heavy", BG, deadline_unix=0.0303))
    fleet.loop.run(until=lambda: len(calls.answers) == 2)
    ((t, answer),) = calls.answers["late"]
    assert isinstance(answer.error, DeadlineExceeded)
    assert t == pytest.approx(0.0303 + fleet.network.hop_s, abs=1e-9)


# ------------------------------------------------------------------- the runner and CLI


def test_simulate_answers_every_arrival_once_and_the_same_seed_gives_the_same_run():
    config, workload = local_config(), load_workload(STEADY)
    first = simulate(config, workload, requests=400)
    again = simulate(config, workload, requests=400)
    assert not first.interrupted
    counts = first.counts()
    assert first.recorder.answers == sum(counts[o] for o in OUTCOMES) == 400
    a, b = first.recorder.columns(), again.recorder.columns()
    assert np.array_equal(a.latency_s, b.latency_s)
    assert np.array_equal(a.outcome, b.outcome) and np.array_equal(a.node, b.node)
    other = simulate(config, workload, requests=400, seed=workload.seed + 1)
    assert not np.array_equal(other.recorder.columns().latency_s, a.latency_s)


def test_simulate_answers_every_arrival_once_while_nodes_fail_and_rejoin():
    data = yaml.safe_load(STEADY.read_text())
    data["events"] = {"node_failures": {"per_minute": 60, "down_s": 0.2}}
    workload = parse_workload(data, source="failing")
    result = simulate(local_config(), workload, requests=600, nodes=6)
    counts = result.counts()
    assert result.recorder.answers == 600
    assert counts["node_failures"] >= 2 and counts["replaced"] >= 1
    assert counts["failed"] == counts["cancelled"] == 0


def test_compare_gives_one_result_per_policy_in_order():
    policies = ["expected_completion", "round_robin", "random"]
    results = compare(local_config(), load_workload(STEADY), policies, requests=200)
    assert [r.label for r in results] == policies
    assert [r.recorder.answers for r in results] == [200, 200, 200]


def simulate_cli(*args: str) -> int:
    return main(["simulate", str(LOCAL), "--workload", str(STEADY), "--requests", "200", *args])


def test_the_simulate_command_writes_the_report_and_its_plots(tmp_path, capsys):
    assert simulate_cli("--out", str(tmp_path)) == 0
    report = (tmp_path / "report.md").read_text()
    assert "Fleet simulation" in report and "Interrupted" not in report
    for png in (LATENCY_PNG, QUEUE_PNG):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    assert "report:" in capsys.readouterr().out


def test_the_simulate_command_names_the_yaml_path_and_line_of_a_broken_workload(tmp_path, capsys):
    text = STEADY.read_text().replace(
        "  rate_per_node: 150\n", "  rate_per_node: 150\n  burst: 2\n"
    )
    broken = tmp_path / "broken.yaml"
    broken.write_text(text)
    line = text.splitlines().index("  burst: 2") + 1
    code = main(["simulate", str(LOCAL), "--workload", str(broken), "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert str(broken) in err and "arrivals.burst" in err and f"line {line}" in err
    assert not (tmp_path / "report.md").exists()


def test_the_simulate_command_refuses_an_unknown_policy_to_compare(tmp_path, capsys):
    assert simulate_cli("--out", str(tmp_path), "--compare", "round_robin,nope") == 2
    err = capsys.readouterr().err
    assert "nope" in err and "expected_completion" in err


def test_costs_measured_by_a_live_fleet_come_from_its_status_json(tmp_path, capsys):
    nodes = [
        {"name": f"edge-{i}", "models": [{"name": "classifier", "cost_ms": {"1": ms, "8": 8 * ms}}]}
        for i, ms in enumerate((1.0, 2.0, 4.0))
    ]
    status = tmp_path / "status.json"
    status.write_text(json.dumps({"fleet": "local", "nodes": nodes}))
    assert costs_from_status(status) == {"classifier": ModelCost({1: 2.0, 8: 16.0})}  # medians
    # a workload without costs for classifier runs on the measured ones
    workload = yaml.safe_load(STEADY.read_text())
    del workload["costs"]["classifier"]
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(workload))
    args = ["simulate", str(LOCAL), "--workload", str(path), "--requests", "100"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 2  # no engine time for classifier
    assert "costs.classifier" in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "b"), "--costs", str(status)]) == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"nodes": [{"models": [{"cost_ms": {}}]}]}))
    with pytest.raises(ConfigError, match="edgefleet status --json"):
        costs_from_status(bad)


# ---------------------------------------------------------- engine times of a recorded run


def test_a_call_takes_a_recorded_engine_time_of_its_batch_size():
    cost = ModelCost({1: 10.0, 4: 20.0}, samples_ms={1: (5.0, 7.0, 9.0), 4: (30.0, 40.0)})
    rng = random.Random(1)
    ones = [cost.draw_s(1, rng) for _ in range(300)]
    fours = [cost.draw_s(4, rng) for _ in range(300)]
    assert set(ones) == {0.005, 0.007, 0.009}  # every one of them, nothing else
    assert set(fours) == {0.03, 0.04}
    again = random.Random(1)
    assert [cost.draw_s(1, again) for _ in range(300)] == ones  # the seed decides
    assert [cost.draw_s(1, random.Random(2)) for _ in range(300)] != ones


def test_in_time_a_call_draws_among_the_calls_recorded_near_its_time_into_the_run():
    # the recorded machine ran slow from 1 s to 2 s into the run
    starts = tuple(i * 0.1 for i in range(30))
    ms = tuple(50.0 if 1.0 <= at < 2.0 else 5.0 for at in starts)
    cost = ModelCost({1: 5.0}, samples_ms={1: ms}, samples_at_s={1: starts}, window_s=0.25)
    rng = random.Random(1)
    assert {cost.draw_s(1, rng, 0.5) for _ in range(200)} == {0.005}
    assert {cost.draw_s(1, rng, 1.5) for _ in range(200)} == {0.05}
    assert {cost.draw_s(1, rng, 1.0) for _ in range(200)} == {0.005, 0.05}  # the edge
    # later than the recorded run: it repeats (2.9 s long)
    assert {cost.draw_s(1, rng, 2.9 + 1.5) for _ in range(200)} == {0.05}
    # without a window: any recorded call, wherever in the run
    anywhere = dataclasses.replace(cost, window_s=0.0)
    assert {anywhere.draw_s(1, rng, 0.5) for _ in range(400)} == {0.005, 0.05}


def test_a_node_draws_the_calls_its_namesake_ran_near_its_time_first():
    # edge-1 ran slow from 1 s to 2 s into the run, edge-2 did not, edge-3 ran nothing then
    calls = []
    for i in range(30):
        at = i * 0.1
        calls.append(RecordedCall(at, 50.0 if 1.0 <= at < 2.0 else 5.0, None, "edge-1"))
        calls.append(RecordedCall(at, 6.0, None, "edge-2"))
        if not 1.0 <= at < 2.0:
            calls.append(RecordedCall(at, 7.0, None, "edge-3"))
        if at < 1.0:  # edge-4 ran its last call 0.9 s into the 2.9 s run
            calls.append(RecordedCall(at, 8.0, None, "edge-4"))
    cost = recorded_costs({"m": {1: calls}}, window_s=0.25)["m"]
    rng = random.Random(1)

    def drawn(at: float, node: str | None) -> set[float]:
        return {cost.draw(1, rng, at, node)[0] for _ in range(300)}

    assert drawn(1.5, "edge-1") == {0.05}
    assert drawn(1.5, "edge-2") == {0.006}
    assert drawn(1.5, "edge-3") == {0.05, 0.006}  # none of its own there: any node's
    assert drawn(0.5, "edge-3") == {0.007}
    # the run repeats as a whole: 2.5 s and 2.9 + 0.5 s in, edge-4 ran nothing
    assert drawn(0.5, "edge-4") == drawn(2.9 + 0.5, "edge-4") == {0.008}
    assert drawn(2.5, "edge-4") == {0.005, 0.006, 0.007}
    # a node the record does not name, or none named: every node's calls of the moment
    assert drawn(0.5, "edge-9") == drawn(0.5, None) == {0.005, 0.006, 0.007, 0.008}
    # another batch size than its own calls': as any node draws it
    assert cost.draw(2, rng, 1.5, "edge-2")[0] in {0.1, 0.012}


def test_a_size_not_recorded_scales_the_nearest_by_the_cost_table():
    cost = ModelCost({1: 10.0, 4: 20.0}, samples_ms={1: (5.0,), 4: (30.0,)})
    rng = random.Random(1)
    # 2 rows: nearest recorded size 1; the table says 2 rows cost (10 + 10/3) / 10 of it
    assert cost.draw_s(2, rng) == pytest.approx(0.005 * (10 + 10 / 3) / 10)
    assert cost.draw_s(8, rng) == pytest.approx(0.030 * 2)  # the table: 40 ms at 8 rows
    tie = ModelCost({1: 10.0, 3: 30.0}, samples_ms={1: (5.0,), 3: (60.0,)})
    assert tie.draw_s(2, rng) == pytest.approx(0.005 * 2)  # the smaller at a tie
    no_table = ModelCost(samples_ms={2: (6.0,)})
    assert no_table.draw_s(4, rng) == pytest.approx(0.012)  # by rows without a table


def test_a_model_without_recorded_calls_keeps_its_table_and_draws_nothing():
    costs = recorded_costs(
        {
            "classifier": {
                1: [RecordedCall(0.0, 3.0), RecordedCall(0.1, 5.0)],
                8: [RecordedCall(0.2, 9.0)],
            },
            "new": {1: [RecordedCall(0.0, 2.0), RecordedCall(0.1, 4.0), RecordedCall(0.2, 9.0)]},
        },
        FLEET_COSTS,
    )
    heavy = costs["heavy"]
    assert heavy == FLEET_COSTS["heavy"] and not heavy.samples_ms
    rng = random.Random(1)
    state = rng.getstate()
    assert heavy.draw_s(8, rng) == heavy.call_s(8) == 0.012
    assert rng.getstate() == state
    # the recorded models keep their tables, or take the recorded medians as one
    assert costs["classifier"].call_ms == FLEET_COSTS["classifier"].call_ms
    assert costs["classifier"].samples_ms == {1: (3.0, 5.0), 8: (9.0,)}
    assert costs["new"].call_ms == {1: 4.0}
    assert costs["tiny_lm"] == FLEET_COSTS["tiny_lm"]  # decoders: step times from the table


def test_a_simulated_node_runs_each_call_for_a_recorded_engine_time():
    recorded = {1: (30.0, 50.0)}
    costs = dict(FLEET_COSTS, heavy=ModelCost({1: 4.0}, samples_ms=recorded))
    config = local_config()
    fleet = SimFleet(config, costs, specs=config.node_specs()[:1], seed=1)
    calls = Calls(fleet)
    for i in range(20):  # one at a time
        calls.at(i * 0.1, infer(f"r{i}", "heavy", BG))
    fleet.loop.run(until=lambda: len(calls.answers) == 20)
    hops = 2 * fleet.network.hop_s
    took = {round(calls.answers[f"r{i}"][0][0] - i * 0.1 - hops, 9) for i in range(20)}
    assert took == {0.03, 0.05}
    # each reply tells its call's engine time, as a live node's does
    for i in range(20):
        reply = calls.one(f"r{i}")
        assert reply.service_s == pytest.approx(calls.answers[f"r{i}"][0][0] - i * 0.1 - hops)
        assert reply.batch_size == 1
    # what the node reports and prices calls by stays the table
    status = next(m for m in fleet.nodes[0].status(0.0).models if m.name == "heavy")
    assert status.cost_ms[1] == pytest.approx(4.0)


def test_each_simulated_node_runs_the_engine_times_its_namesake_recorded():
    config = local_config()
    first, second = (spec.name for spec in config.node_specs()[:2])
    calls_of = {first: 30.0, second: 50.0}
    recorded = [RecordedCall(i * 0.01, calls_of[n], None, n) for i in range(4) for n in calls_of]
    costs = recorded_costs({"heavy": {1: recorded}}, {"heavy": ModelCost({1: 4.0})})
    fleet = SimFleet(config, dict(FLEET_COSTS, **costs), specs=config.node_specs()[:2], seed=1)
    calls = Calls(fleet)
    for i in range(40):  # one at a time
        calls.at(i * 0.1, infer(f"r{i}", "heavy", BG))
    fleet.loop.run(until=lambda: len(calls.answers) == 40)
    hops = 2 * fleet.network.hop_s
    took = {
        (calls.node(f"r{i}"), round(calls.answers[f"r{i}"][0][0] - i * 0.1 - hops, 9))
        for i in range(40)
    }
    assert took == {(first, 0.03), (second, 0.05)}


def test_a_drawn_call_brings_its_requests_time_outside_the_node():
    # engine time and the way back of one recorded request, drawn together: a call
    # slowed by a busy machine comes with the slow way back it had
    # (and the hand-off its node took to start it)
    cost = ModelCost(
        {1: 4.0},
        samples_ms={1: (3.0, 30.0, 5.0)},
        samples_outside_ms={1: (2.0, 20.0, math.nan)},
        samples_handoff_ms={1: (0.5, math.nan, 1.0)},
    )
    rng = random.Random(7)
    drawn = {cost.draw(1, rng) for _ in range(300)}
    # NaN: not recorded
    assert drawn == {(0.003, 0.002, 0.0005), (0.030, 0.020, 0.0), (0.005, None, 0.001)}
    assert ModelCost({1: 4.0}).draw(1, rng) == (0.004, None, 0.0)


def test_a_drawn_hand_off_delays_the_call_and_the_node_and_ends_its_queue_time():
    # a node takes its recorded hand-off (5 ms) to start each call: the engine runs
    # nothing meanwhile, and the requests' queue time runs to the call's start
    recorded = ModelCost(
        {1: 4.0},
        samples_ms={1: (30.0,)},
        samples_outside_ms={1: (9.0,)},
        samples_handoff_ms={1: (5.0,)},
    )
    config = local_config()
    network = Network(hop_s=0.002)
    costs = dict(FLEET_COSTS, heavy=recorded)
    fleet = SimFleet(config, costs, specs=config.node_specs()[:1], network=network, seed=1)
    calls = Calls(fleet)
    calls.at(0.0, infer("first", "heavy", BG))
    calls.at(0.0, infer("second", "heavy", BG))
    fleet.loop.run(until=lambda: len(calls.answers) == 2)
    # out 2 ms, hand-off 5, engine 30, back in what is left of the recorded 9 ms
    assert calls.answers["first"][0][0] == pytest.approx(0.002 + 0.005 + 0.030 + 0.007)
    assert calls.answers["second"][0][0] == pytest.approx(0.002 + 2 * 0.035 + 0.007)
    first, second = calls.one("first"), calls.one("second")
    assert (first.queue_s, first.handoff_s, first.service_s) == pytest.approx((0.005, 0.005, 0.03))
    assert (second.queue_s, second.handoff_s) == pytest.approx((0.040, 0.005))


@pytest.mark.parametrize("fg_at", [0.010, 0.025])
def test_an_aborted_call_runs_on_for_a_recorded_abort_wait(fg_at):
    # a live engine stops an aborted call only at its next look at the abort flag: the
    # urgent request waits the recorded 8 ms for bg's 30 ms call to stop, unless the
    # call ends by itself first (fg at 25 ms reaches the node at 27, bg ends at 32)
    recorded = ModelCost({1: 4.0}, samples_ms={1: (30.0,)}, abort_ms=(8.0,))
    config = local_config()
    costs = dict(FLEET_COSTS, heavy=recorded)
    fleet = SimFleet(
        config, costs, specs=config.node_specs()[:1], network=Network(hop_s=0.002), seed=1
    )
    calls = Calls(fleet)
    calls.at(0.0, infer("bg", "heavy", BG))
    calls.at(fg_at, infer("fg", "heavy", FG))
    fleet.loop.run(until=lambda: len(calls.answers) == 2)
    fg, bg = calls.one("fg"), calls.one("bg")
    assert fg.error is None and bg.error is None
    if fg_at < 0.02:  # aborted at 12 ms, stopped at 20; bg runs again after fg
        fg_start = 0.012 + 0.008
        assert calls.answers["bg"][0][0] == pytest.approx(fg_start + 0.030 + 0.030 + 0.002)
    else:  # bg completed before its abort took effect
        fg_start = 0.002 + 0.030
        assert calls.answers["bg"][0][0] == pytest.approx(fg_start + 0.002)
    assert calls.answers["fg"][0][0] == pytest.approx(fg_start + 0.030 + 0.002)
    assert fg.queue_s == pytest.approx(fg_start - fg_at - 0.002)


def test_an_abort_wait_is_drawn_from_the_node_s_own_when_it_recorded_any():
    own = ModelCost(abort_ms=(2.0,))
    cost = ModelCost(abort_ms=(5.0, 7.0), by_node={"edge-1": own, "edge-2": ModelCost()})
    rng = random.Random(3)
    assert {cost.abort_s(rng, "edge-1") for _ in range(50)} == {0.002}
    assert {cost.abort_s(rng, "edge-2") for _ in range(50)} == {0.005, 0.007}
    assert {cost.abort_s(rng) for _ in range(50)} == {0.005, 0.007}
    assert ModelCost().abort_s(rng, "edge-1") == 0.0  # none recorded: it stops at once


def test_a_simulated_answer_spends_its_recorded_time_outside_the_node():
    recorded = ModelCost(
        {1: 4.0}, samples_ms={1: (30.0, 50.0)}, samples_outside_ms={1: (9.0, math.nan)}
    )
    costs = dict(FLEET_COSTS, heavy=recorded)
    config = local_config()
    network = Network(hop_s=0.002, round_trip_s=(0.1,))
    fleet = SimFleet(config, costs, specs=config.node_specs()[:1], network=network, seed=1)
    calls = Calls(fleet)
    for i in range(20):  # one at a time
        calls.at(i * 1.0, infer(f"r{i}", "heavy", BG))
    fleet.loop.run(until=lambda: len(calls.answers) == 20)
    took = {round(calls.answers[f"r{i}"][0][0] - i * 1.0, 9) for i in range(20)}
    # out one hop (2 ms), on the engine, back in what is left of the call's recorded 9 ms;
    # a call recorded without it comes back after one of the network's times (100 ms)
    assert took == {0.039, 0.15}


def write_call_record(path: Path, model: str, service_ms: Sequence[float]) -> Path:
    """A call record of completed batch-1 calls of ``model`` taking ``service_ms``."""
    lines = [
        {
            "at": 1767268800.0 + i,
            "id": f"r{i}",
            "model": model,
            "priority": 5,
            "rows": 1,
            "outcome": "completed",
            "latency_s": ms / 1000 + 0.001,
            "node": "edge-0",
            "service_ms": ms,
            "queue_ms": 0.1,
            "batch": 1,
        }
        for i, ms in enumerate(service_ms)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_a_workload_draws_engine_times_from_its_call_record(tmp_path):
    record = write_call_record(tmp_path / "calls" / "calls-h-1-0.jsonl", "classifier", [2, 3])
    data = yaml.safe_load(STEADY.read_text())
    del data["costs"]["classifier"]
    data["costs_from"] = "calls"
    workload = parse_workload(data, source="recorded", base_dir=tmp_path)
    costs = sim.run.workload_costs(workload)
    assert costs["classifier"].samples_ms == {1: (2.0, 3.0)}
    assert costs["heavy"] == FLEET_COSTS["heavy"]
    first = simulate(local_config(), workload, requests=300)
    again = simulate(local_config(), workload, requests=300)
    assert first.recorder.answers == 300
    assert np.array_equal(first.recorder.columns().latency_s, again.recorder.columns().latency_s)
    tables = load_workload(STEADY)  # the same arrivals on the 1 ms table
    other = simulate(local_config(), tables, requests=300).recorder.columns()
    assert not np.array_equal(first.recorder.columns().latency_s, other.latency_s)
    assert sim.run.is_call_record(record) and sim.run.is_call_record(tmp_path / "calls")


def test_the_simulate_command_takes_a_call_record_for_costs(tmp_path, capsys):
    workload = yaml.safe_load(STEADY.read_text())
    del workload["costs"]["classifier"]
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(workload))
    args = ["simulate", str(LOCAL), "--workload", str(path), "--requests", "100"]
    record = write_call_record(tmp_path / "calls" / "calls-h-1-0.jsonl", "classifier", [1.5, 4])
    assert main([*args, "--out", str(tmp_path / "a"), "--costs", str(record)]) == 0
    assert main([*args, "--out", str(tmp_path / "b"), "--costs", str(record.parent)]) == 0
    # a call record under another name is told apart from a status file by its content
    renamed = record.rename(tmp_path / "calls.log")
    assert main([*args, "--out", str(tmp_path / "c"), "--costs", str(renamed)]) == 0
    capsys.readouterr()
    no_times = tmp_path / "old.jsonl"
    no_times.write_text(json.dumps({"at": 1.0, "model": "classifier", "priority": 5}) + "\n")
    assert main([*args, "--out", str(tmp_path / "d"), "--costs", str(no_times)]) == 2
    assert "no engine times in this call record" in capsys.readouterr().err


def interrupt_after(answers: int) -> Callable[[int], None]:
    """A progress update that is a Ctrl-C once ``answers`` requests are answered."""
    interrupted = False

    def update(n: int) -> None:
        nonlocal interrupted
        if n >= answers and not interrupted:
            interrupted = True
            raise KeyboardInterrupt

    return update


def test_ctrl_c_ends_a_run_early_with_what_it_has(monkeypatch, tmp_path):
    monkeypatch.setattr(sim.run, "PROGRESS_EVERY", 50)
    update = interrupt_after(100)
    result = simulate(
        local_config(),
        load_workload(STEADY),
        requests=400,
        progress=lambda total: Progress(update, lambda: None),
    )
    assert result.interrupted
    assert result.recorder.answers == 100
    report = write_report(tmp_path, [result], title="t").read_text()
    assert "Interrupted" in report
    # a comparison stops at the run that was interrupted
    update = interrupt_after(100)
    results = compare(
        local_config(),
        load_workload(STEADY),
        ["round_robin", "random"],
        requests=400,
        progress=lambda total: Progress(update, lambda: None),
    )
    assert [(r.label, r.interrupted) for r in results] == [("round_robin", True)]


def test_the_simulate_command_returns_130_on_ctrl_c_and_its_report_says_so(
    monkeypatch, tmp_path, capsys
):
    monkeypatch.setattr(sim.run, "PROGRESS_EVERY", 50)
    update = interrupt_after(100)

    class Bar:  # tqdm as the command uses it
        def __init__(self, **kw: Any) -> None:
            self.n = 0

        def update(self, n: int) -> None:
            self.n += n
            update(self.n)

        def close(self) -> None:
            pass

    monkeypatch.setattr("tqdm.tqdm", Bar)
    assert simulate_cli("--out", str(tmp_path)) == 130
    assert "Interrupted" in (tmp_path / "report.md").read_text()
    assert "interrupted" in capsys.readouterr().out


# --------------------------------------------------------- placement in a large fleet


def with_candidates(config: FleetConfig, k: int) -> FleetConfig:
    placement = config.router.placement.model_copy(update={"candidates": k})
    router = config.router.model_copy(update={"placement": placement})
    return config.model_copy(update={"router": router})


class Weighed:
    """Counts the nodes the dispatcher weighs per placement, and the views it builds."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.per_placement: list[int] = []
        self.views = 0
        considered, view = dispatch.Dispatcher._considered, dispatch._Entry.view

        def counted_considered(d: Any, request: Any, tried: set[str]) -> list[Any]:
            out = considered(d, request, tried)
            self.per_placement.append(len(out))
            return out

        def counted_view(entry: Any, now: float, *unseen: float) -> Any:
            self.views += 1
            return view(entry, now, *unseen)

        monkeypatch.setattr(dispatch.Dispatcher, "_considered", counted_considered)
        monkeypatch.setattr(dispatch._Entry, "view", counted_view)


def test_placement_weighs_at_most_the_configured_candidates_of_a_large_fleet(monkeypatch):
    config = with_candidates(local_config(), 8)
    fleet = SimFleet(config, FLEET_COSTS, specs=grow(config.node_specs(), 100), seed=2)
    weighed = Weighed(monkeypatch)
    calls = Calls(fleet)
    for i in range(200):
        calls.at(0.0005 * i, infer(f"r{i}", "classifier", INLINE))
    fleet.loop.run(until=lambda: len(calls.answers) == 200)
    assert len(weighed.per_placement) == 200  # one placement each, none refused
    assert set(weighed.per_placement) == {8}
    assert weighed.views == 8 * 200  # a view of each node weighed, of no other
    assert all(calls.one(f"r{i}").error is None for i in range(200))
    assert len({calls.node(f"r{i}") for i in range(200)}) > 50  # the draws cover the fleet


def test_a_session_reaches_the_node_holding_it_whether_or_not_it_was_drawn(monkeypatch):
    config = with_candidates(local_config(), 8)
    fleet = SimFleet(config, FLEET_COSTS, specs=grow(config.node_specs(), 100), seed=2)
    holders = {f"s{k}": 5 * k + 3 for k in range(20)}
    for session, i in holders.items():  # each node reports the session whose KV it holds
        status = dataclasses.replace(fleet.nodes[i].status(0.0), sessions=(session,))
        fleet.dispatcher.report(fleet.nodes[i].spec.name, status, True, 0.0)
    weighed = Weighed(monkeypatch)
    calls = Calls(fleet)
    for k, session in enumerate(holders):
        request = GenerateRequest("tiny_lm", (1, 2, 3), 4, INLINE, f"g{k}", session=session)
        calls.at(0.001 * k, request)
    fleet.loop.run(until=lambda: len(calls.answers) == len(holders))
    for k, (session, i) in enumerate(holders.items()):
        assert calls.node(f"g{k}") == fleet.nodes[i].spec.name, session
    # 8 drawn at random, plus the holder when the draw missed it (most of the time)
    assert set(weighed.per_placement) <= {8, 9} and weighed.per_placement.count(9) > 10


def test_simulated_callers_learn_the_placements_the_others_made():
    """What the router's view carries in a live fleet: each caller hears, with the next
    reports, what the other callers placed."""
    fleet = SimFleet(local_config(), FLEET_COSTS, callers=2, seed=1)
    for i in range(4):
        fleet.loop.at(0.01, fleet.submit, infer(f"fg{i}", "heavy", FG), 0)
    fleet.loop.at(0.01, fleet.submit, infer("bg", "heavy", BG), 1)
    first, second = fleet.dispatchers
    heard: list[tuple[float, ...]] = []

    def hear() -> None:
        heard.append((second.crowd(FG), first.crowd(FG), first.crowd(BG)))

    fleet.loop.at(fleet.interval + fleet.network.report_delay_s + 0.001, hear)
    fleet.loop.at(2 * fleet.interval + fleet.network.report_delay_s + 0.001, hear)
    fleet.loop.run(until=lambda: len(heard) == 2)
    # Every foreground placement was the first caller's: the second sees a crowd of 1
    # there, the first none; at or above background, the second made one of five.
    assert heard[0] == (1.0, 0.0, pytest.approx(1 / 5))
    assert heard[1] == (0.0, 0.0, 0.0)  # the interval after: nobody placed anything
