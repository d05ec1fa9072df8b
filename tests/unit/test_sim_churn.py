"""Device churn in the fleet simulator: devices that leave stop serving at once, what
they held is placed again (or answered NodeLost) only once the head declares them dead,
they come back as new pool members, and the report shows capacity over time."""

from __future__ import annotations

import concurrent.futures as cf
import random
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from cluster.cli import main
from edgefleet.config import FleetConfig, load_config
from edgefleet.errors import NodeLost
from edgefleet.request import InferRequest
from sim.fleet import ModelCost, SimFleet
from sim.report import CAPACITY_PNG, OUTCOMES, RunResult, _run_section, write_report
from sim.run import simulate
from sim.workload import Workload, parse_workload
from tests.fakes import x

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / "configs" / "local.yaml"
STEADY = REPO / "configs" / "sim" / "steady.yaml"
BG = 3
COSTS = {"heavy": ModelCost({1: 200.0}), "classifier": ModelCost({1: 1.0})}


def config() -> FleetConfig:
    return load_config(LOCAL)  # two nodes, edge-0 and edge-1, reports every 0.5 s


class Calls:
    """Requests submitted to a SimFleet at simulated times, and every answer each got."""

    def __init__(self, fleet: SimFleet) -> None:
        self.fleet = fleet
        self.answers: dict[str, list[tuple[float, Any]]] = {}

    def at(self, t: float, request: InferRequest) -> None:
        self.fleet.loop.at(t, self.submit, request)

    def submit(self, request: InferRequest) -> None:
        fut = self.fleet.submit(request)
        fut.add_done_callback(lambda f: self._answered(request.id, f))

    def _answered(self, rid: str, fut: cf.Future[Any]) -> None:
        self.answers.setdefault(rid, []).append((self.fleet.loop.t, fut.result()))

    def one(self, rid: str) -> tuple[float, Any]:
        (answer,) = self.answers[rid]
        return answer


def heavy(rid: str, **kw: Any) -> InferRequest:
    return InferRequest("heavy", x(1.0), BG, rid, **kw)


def churn_fleet(**kw: Any) -> tuple[SimFleet, list[tuple[float, int]], list[float]]:
    capacity: list[tuple[float, int]] = []
    firsts: list[float] = []
    fleet = SimFleet(
        config(),
        COSTS,
        seed=3,
        members=True,
        on_capacity=lambda t, n: capacity.append((t, n)),
        on_first_served=firsts.append,
        **kw,
    )
    return fleet, capacity, firsts


def test_what_a_departed_device_held_is_answered_once_only_after_it_is_declared_dead():
    fleet, capacity, _ = churn_fleet()
    calls = Calls(fleet)
    ids = [f"r{i}" for i in range(8)]
    for i, rid in enumerate(ids):  # every other one at most once
        calls.at(0.0, heavy(rid, at_most_once=i % 2 == 0))
    held: dict[str, int] = {}

    def leave() -> None:
        held.update(fleet._where)
        fleet.leave(0, declared_dead_after_s=5.0)

    fleet.loop.at(0.010, leave)
    calls.at(1.0, heavy("late"))  # the callers still take edge-0 to be serving
    fleet.loop.run(until=lambda: len(calls.answers) == len(ids) + 1)
    lost = {rid for rid, i in held.items() if i == 0}
    once = {rid for rid in lost if int(rid[1:]) % 2 == 0}
    assert once and lost - once, "edge-0 held requests of both kinds when it left"
    assert all(len(a) == 1 for a in calls.answers.values())
    for rid in ids:
        t, answer = calls.one(rid)
        if rid in once:
            assert isinstance(answer.error, NodeLost)
        else:
            assert answer.error is None and answer.node == "edge-1"
        if rid in lost:  # nobody knew before the head declared edge-0 dead
            assert t > 5.010
    counted = fleet.dispatcher.counted()
    assert counted["nodelost"] == len(once)
    assert counted["replaced"] >= len(lost - once)
    assert fleet.churned["stranded"] >= len(lost)
    assert fleet.churned["declared_dead"] == 1
    assert capacity == [(0.0, 2), (0.010, 1)]
    fleet.loop.run(until=lambda: fleet.loop.t > 5.6)  # the next view: edge-0 is not in it
    assert "edge-0" not in fleet.dispatcher.healthy()


def test_a_device_that_comes_back_is_a_new_member_and_serves_again():
    fleet, capacity, firsts = churn_fleet()
    calls = Calls(fleet)
    fleet.loop.at(0.010, fleet.leave, 0, 1.0)
    fleet.loop.at(2.0, fleet.join, 0, 0.2)  # serving at 2.2, in the callers' view at 2.5
    for i in range(6):  # 1.2 s of work: some of it goes to edge-0 once it is back
        calls.at(2.6, heavy(f"after{i}"))
    fleet.loop.run(until=lambda: len(calls.answers) == 6)
    assert capacity == [(0.0, 2), (0.010, 1), (2.2, 2)]
    assert fleet.nodes[0].spec.ray_node == "edge-0@1"  # a new Ray node, the same name
    assert fleet.dispatcher._nodes["edge-0"].spec.ray_node == "edge-0@1"
    nodes = Counter(calls.one(f"after{i}")[1].node for i in range(6))
    assert nodes["edge-0"] >= 1 and nodes["edge-1"] >= 1
    assert all(calls.one(f"after{i}")[1].error is None for i in range(6))
    assert len(firsts) == 1 and 0.4 < firsts[0] < 1.0  # from 2.2 to its first answer


def test_a_device_back_before_it_was_declared_dead_ends_its_old_self_then():
    fleet, capacity, _ = churn_fleet()
    calls = Calls(fleet)
    calls.at(0.0, heavy("a"))
    calls.at(0.0, heavy("b"))  # one on each node
    fleet.loop.at(0.010, fleet.leave, 0, 10.0)
    fleet.loop.at(1.0, fleet.join, 0, 0.0)
    fleet.loop.run(until=lambda: len(calls.answers) == 2)
    times = sorted(t for rid in "ab" for t, _ in calls.answers[rid])
    assert times[-1] < 2.0  # placed again at 1.0, not at 10.01
    assert fleet.churned["declared_dead"] == 1
    assert capacity == [(0.0, 2), (0.010, 1), (1.0, 2)]


def test_only_a_fleet_of_pool_members_has_devices_leave():
    fleet = SimFleet(config(), COSTS)
    with pytest.raises(ValueError, match="members"):
        fleet.leave(0, 1.0)


# ------------------------------------------------------------------- runs and the report


def churn_workload(seed: int = 2) -> Workload:
    data = yaml.safe_load(STEADY.read_text())
    data.update(seed=seed, duration_s=3)
    data["arrivals"]["rate_per_node"] = 40
    data["mix"][1]["at_most_once"] = True
    data["churn"] = {
        "leave_per_device_per_hour": 1800,  # one every 2 s per device
        "declared_dead_after_s": 0.4,
        "rejoin_after_s": 0.5,
    }
    return parse_workload(data, source="churn")


def churn_run(seed: int = 2) -> RunResult:
    return simulate(load_config(LOCAL), churn_workload(seed), nodes=6)


@pytest.fixture(scope="module")
def churned() -> RunResult:
    return churn_run()


def test_under_churn_every_request_is_answered_once_and_requests_are_placed_again(churned):
    workload = churn_workload()
    arrivals = len(list(workload.arrivals(random.Random(workload.seed), nodes=6)))
    result = churned
    counts = result.counts()
    assert result.recorder.answers == sum(counts[o] for o in OUTCOMES) == arrivals
    assert "unanswered" not in counts
    assert counts["leaves"] >= 3 and counts["rejoins"] >= 2
    assert counts["replaced"] >= 1 and counts["lost"] >= 1  # at_least_once, at_most_once
    assert counts["stranded"] >= counts["lost"]
    assert counts["failed"] == counts["cancelled"] == 0
    summary = result.churn_summary()
    assert summary["served_again"] >= 1
    assert summary["first_served_p50_s"] is not None


def test_capacity_dips_when_devices_leave_and_recovers_when_they_come_back(churned, tmp_path):
    result = churned
    t, serving = result.recorder.capacity_series()
    assert serving[0] == 6 and t[0] == 0.0
    assert np.all(np.diff(t) >= 0) and np.all(np.abs(np.diff(serving)) == 1)
    low = int(np.argmin(serving))
    assert serving[low] < 6 and serving[low:].max() > serving[low]  # back up after the dip
    rows = result.capacity_table()
    assert len(rows) == 12 and rows[0]["start_s"] == 0.0
    assert rows[-1]["end_s"] == pytest.approx(result.simulated_s)
    assert min(r["fewest"] for r in rows) == serving.min()
    assert all(r["fewest"] <= r["mean"] <= 6 for r in rows)
    text = write_report(tmp_path, [result], title="churn").read_text()
    assert "**Churn** (devices leaving and coming back):" in text
    assert "**Capacity over time** (devices serving):" in text
    assert re.search(rf"\| fewest devices serving +\| +{serving.min()} \|", text)
    assert f"![Devices serving over simulated time]({CAPACITY_PNG})" in text
    assert (tmp_path / CAPACITY_PNG).stat().st_size > 0


def test_the_same_seed_gives_the_same_churn_and_the_same_report(churned):
    first, again = churned, churn_run()
    a, b = first.recorder.columns(), again.recorder.columns()
    for name in ("priority", "outcome", "latency_s", "node", "t", "queued", "in_flight"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert first.recorder.counters == again.recorder.counters
    assert all(
        np.array_equal(p, q)
        for p, q in zip(
            first.recorder.capacity_series(), again.recorder.capacity_series(), strict=True
        )
    )
    assert np.array_equal(first.recorder.first_served_s(), again.recorder.first_served_s())

    def report(result: RunResult) -> list[str]:  # the run's section, without its wall time
        return [line for line in _run_section(result) if "wall time" not in line]

    assert report(first) == report(again)
    assert "**Capacity over time** (devices serving):" in report(first)


def test_the_simulate_command_reports_the_churn(tmp_path, capsys):
    path = tmp_path / "churn.yaml"
    path.write_text(yaml.safe_dump(churn_workload().model_dump(mode="json", by_alias=True)))
    out = tmp_path / "report"
    args = ["simulate", str(LOCAL), "--workload", str(path), "--nodes", "6", "--out", str(out)]
    assert main(args) == 0
    said = capsys.readouterr().out
    assert "churn: " in said and "devices left" in said and "NodeLost" in said
    report = (out / "report.md").read_text()
    assert "**Capacity over time** (devices serving):" in report
    assert (out / CAPACITY_PNG).read_bytes()[:4] == b"\x89PNG"
