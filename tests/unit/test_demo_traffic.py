"""The demo's traffic: the open-loop arrivals (a camera at a fixed pace, Poisson streams
beside it) and the batch jobs' share of the fleet's queues, without Ray."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import cluster.demo as demo
from edgefleet.config import load_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def config():
    return load_config(REPO / "configs" / "local.yaml")


def test_the_camera_sends_a_frame_every_fifteenth_of_a_second(config):
    arrivals = list(demo._open_loop_arrivals(demo.OPEN_LOOP, config, 60))
    assert all(x.at <= y.at for x, y in zip(arrivals, arrivals[1:], strict=False))
    frames = [a for a in arrivals if a.model == "detector"]
    gaps = np.diff([a.at for a in frames])
    jitter = demo.PERIODIC["jitter"] / 15
    assert gaps.min() >= 1 / 15 - jitter and gaps.max() <= 1 / 15 + jitter
    assert len(frames) in (899, 900)
    assert {(a.key, a.deadline_s, a.priority) for a in frames} == {("k0", 0.25, 7)}


def test_the_other_streams_arrive_at_their_rates(config):
    arrivals = list(demo._open_loop_arrivals(demo.OPEN_LOOP, config, 60))
    counts = Counter(a.model for a in arrivals)
    for c in demo.OPEN_LOOP:
        if c.get("process", "poisson") == "poisson":
            expected = c["weight"] * 60
            assert counts[c["model"]] == pytest.approx(expected, abs=5 * expected**0.5)
    gaps = np.diff([a.at for a in arrivals if a.model == "classifier"])
    assert gaps.std() / gaps.mean() > 0.8  # Poisson: exponential gaps, not a fixed pace
    # seeded: the same arrivals every run
    assert arrivals == list(demo._open_loop_arrivals(demo.OPEN_LOOP, config, 60))


def test_the_open_loop_takes_only_the_models_the_fleet_serves(config):
    mix = [c for c in demo.OPEN_LOOP if c["model"] != "detector"]
    arrivals = list(demo._open_loop_arrivals(mix, config, 5))
    assert {a.model for a in arrivals} == {"classifier", "stateful"}


def test_the_batch_jobs_fill_no_more_than_offline_work_may(config):
    # local.yaml: 2 nodes with queues of 64, offline may fill half: 64 in flight
    assert demo.batch_jobs_in_flight(config, "heavy") == 64
    shed = config.router.placement.params(config.priorities).shed
    room = sum(s.queue.capacity for s in config.node_specs())
    assert demo.batch_jobs_in_flight(config, "heavy") <= min(shed.values()) * room


def test_the_batch_jobs_follow_the_shed_share_and_the_queues(config):
    placement = config.router.placement.model_copy(update={"shed": {"offline": 0.25}})
    router = config.router.model_copy(update={"placement": placement})
    assert demo.batch_jobs_in_flight(config.model_copy(update={"router": router}), "heavy") == 32
    # no share for offline: the lowest share that covers it (background's) applies
    placement = config.router.placement.model_copy(update={"shed": {"background": 0.75}})
    router = config.router.model_copy(update={"placement": placement})
    assert demo.batch_jobs_in_flight(config.model_copy(update={"router": router}), "heavy") == 96
    assert demo.batch_jobs_in_flight(config, "not-served") == 1
