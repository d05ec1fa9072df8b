"""The simulation runner and the garbage collector: a run collects less often and leaves
the fleet out of the collector's scans, changes nothing that is simulated, and leaves
the collector's settings as it found them."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml

from edgefleet.config import load_config
from sim.fleet import Network
from sim.report import RunResult
from sim.run import simulate
from sim.workload import parse_workload

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / "configs" / "local.yaml"
STEADY = REPO / "configs" / "sim" / "steady.yaml"


@pytest.fixture
def collector() -> Iterator[None]:
    """Whatever a test does to the collector is undone after it."""
    threshold, enabled = gc.get_threshold(), gc.isenabled()
    yield
    gc.set_threshold(*threshold)
    gc.unfreeze()
    if enabled:
        gc.enable()
    else:
        gc.disable()


def failing_run() -> RunResult:
    data = yaml.safe_load(STEADY.read_text())
    data["events"] = {"node_failures": {"per_minute": 60, "down_s": 0.2}}
    workload = parse_workload(data, source="failing")
    return simulate(load_config(LOCAL), workload, requests=500, nodes=6)


def same_run(a: RunResult, b: RunResult) -> bool:
    x, y = a.recorder.columns(), b.recorder.columns()
    return (
        all(
            np.array_equal(getattr(x, name), getattr(y, name))
            for name in ("priority", "outcome", "latency_s", "node", "t", "queued", "in_flight")
        )
        and a.recorder.busy_s == b.recorder.busy_s
        and a.recorder.counters == b.recorder.counters
        and a.events == b.events
        and a.simulated_s == b.simulated_s
    )


def test_a_run_leaves_the_collector_as_it_found_it(collector):
    gc.set_threshold(900, 11, 12)
    result = failing_run()
    assert result.recorder.answers == 500
    assert gc.get_threshold() == (900, 11, 12)
    assert gc.get_freeze_count() == 0
    assert gc.isenabled()


def test_objects_frozen_before_a_run_stay_frozen(collector):
    gc.freeze()
    failing_run()
    assert gc.get_freeze_count() > 0  # the run did not unfreeze what it had not frozen


def test_the_collector_changes_nothing_that_is_simulated(collector):
    usual = failing_run()
    assert usual.counts()["node_failures"] >= 2
    gc.disable()
    never = failing_run()
    gc.enable()
    gc.set_threshold(1, 1, 1)
    always = failing_run()
    assert same_run(usual, never) and same_run(usual, always)


def test_a_draw_seed_changes_the_fleets_draws_not_the_arrivals():
    workload = parse_workload(yaml.safe_load(STEADY.read_text()), source="steady")
    network = Network(0.0005, round_trip_s=(0.001, 0.002, 0.004, 0.030))  # drawn per answer

    def run(**kw: int) -> RunResult:
        return simulate(load_config(LOCAL), workload, requests=500, network=network, **kw)

    def classes(r: RunResult) -> list[int]:
        return sorted(r.recorder.columns().priority.tolist())

    first, again, other = run(draw_seed=1), run(draw_seed=1), run(draw_seed=2)
    assert same_run(first, again)
    assert classes(other) == classes(first)  # the same requests...
    latencies = other.recorder.columns().latency_s, first.recorder.columns().latency_s
    assert not np.array_equal(*latencies)
    assert classes(run(seed=2)) != classes(first)  # ...where another seed changes them
