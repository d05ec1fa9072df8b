"""The rollout simulator: step size against dip, bake time against finish time, a bad
version's rollback, on times known by hand where the draws are made exact (no spread,
no calls held: a node is out for load + warm-up, 3 s)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cluster.cli import main
from sim.rollout import Params, _shares, simulate, sweep

EXACT = Params(nodes=100, spread=0.0, queued_calls=0.0, store_mib_s=200.0)  # out 3 s each


def run(step: str, bake_s: float, *, params: Params = EXACT, fail_at: int | None = None):
    return simulate(params, step, bake_s, "1", fail_at=fail_at, rng=np.random.default_rng(0))


def test_a_rollout_takes_the_time_known_by_hand():
    # The canary fetches alone at its own 50 MiB/s: 4 s; a step of 10 nodes shares the
    # store's 200 MiB/s, 20 MiB/s each: 10 s (the last, of 9: 9 s). Then 3 s out, then
    # the bake.
    r = run("10", 60)
    assert r.steps == 11  # 1 canary node, then 99 nodes 10 at a time
    assert r.finish_s == pytest.approx((4 + 3 + 60) + 9 * (10 + 3 + 60) + (9 + 3 + 60))
    assert r.peak_out == pytest.approx(0.10)  # a step's nodes end their fetch together
    assert r.lost_s == pytest.approx(3.0)  # each node out 3 s, once
    assert (r.failed_at, r.rolled_back, r.rollback_s, r.rollback_peak) == (None, 0, None, None)


def test_bigger_steps_finish_sooner_but_dip_deeper():
    steps = ("1%", "5%", "10%", "25%")
    results = sweep(nodes=1000, steps=steps, bakes=(0, 60), seed=0)
    for bake in (0, 60):
        row = [r for r in results if r.bake_s == bake]
        assert [r.step for r in row] == list(steps)
        finish = [r.finish_s for r in row]
        peak = [r.peak_out for r in row]
        assert finish == sorted(finish, reverse=True) and len(set(finish)) == len(finish)
        assert peak == sorted(peak) and len(set(peak)) == len(peak)
        for r, share in zip(row, (0.01, 0.05, 0.10, 0.25), strict=True):
            assert r.peak_out <= share  # steps never overlap
        # 250 nodes fetching at once share the store's 1 GiB/s, 4 MiB/s each, far below
        # their own bandwidths: they end together, and are all out at once.
        assert row[-1].peak_out == pytest.approx(0.25)
    # Every node is out once whatever the step: the capacity lost hardly moves.
    lost = [r.lost_s for r in results]
    assert max(lost) - min(lost) < 0.1 * min(lost)
    assert 3.0 < min(lost) < 4.5  # drain 0.5 s + load 2 s + warm-up 1 s, with spread


def test_bake_time_adds_bake_times_the_steps():
    short, long = sweep(nodes=1000, steps=("5%",), bakes=(0, 300), seed=1)
    assert long.steps == short.steps == 21  # 10 canary nodes, then 50 at a time
    assert long.finish_s - short.finish_s == pytest.approx(300 * 21)
    assert long.peak_out == short.peak_out
    assert long.lost_s == pytest.approx(short.lost_s)  # the same outages, later


def test_a_bad_version_rolls_back_only_the_nodes_moved():
    r = run("10", 60, fail_at=2)  # the canary and two steps of 10 moved: 21 nodes
    assert (r.failed_at, r.rolled_back) == (2, 21)
    assert r.rollback_s == pytest.approx(3.0)  # all at once, each out 3 s
    assert r.finish_s == pytest.approx((4 + 3 + 60) + 2 * (10 + 3 + 60) + 3)
    assert r.rollback_peak == r.peak_out == pytest.approx(0.21)
    assert r.lost_s == pytest.approx(2 * 21 * 3 / 100)  # out once forward, once back

    canary = run("10", 60, fail_at=0)
    assert (canary.rolled_back, canary.rollback_peak) == (1, pytest.approx(0.01))
    assert canary.finish_s == pytest.approx(4 + 3 + 60 + 3)

    past_the_end = run("50%", 0, fail_at=99)  # 1 + 50 + 49: the last step's gate fails
    assert (past_the_end.failed_at, past_the_end.rolled_back) == (2, 100)
    assert past_the_end.rollback_peak == pytest.approx(1.0)


def test_a_bad_version_at_the_default_figures_rolls_back_in_seconds():
    (r,) = sweep(nodes=1000, steps=("10%",), bakes=(60,), fail_at=3, seed=0)
    assert r.rolled_back == 10 + 3 * 100
    assert r.rollback_peak == pytest.approx(0.31) and r.peak_out == pytest.approx(0.31)
    assert r.rollback_s is not None and 3.0 < r.rollback_s < 15.0
    assert r.finish_s > 4 * 60 + r.rollback_s  # four bakes, then the rollback


def test_results_are_deterministic_for_a_seed():
    one = sweep(nodes=300, steps=("2%", "20%"), bakes=(0, 30), seed=7, fail_at=2)
    assert one == sweep(nodes=300, steps=("2%", "20%"), bakes=(0, 30), seed=7, fail_at=2)
    other = sweep(nodes=300, steps=("2%", "20%"), bakes=(0, 30), seed=8, fail_at=2)
    assert [r.finish_s for r in one] != [r.finish_s for r in other]
    assert all(math.isfinite(r.finish_s) and r.finish_s > 0 for r in one)


def test_the_store_is_shared_max_min_fairly():
    # A node slower than its share leaves the rest to the others.
    assert _shares(np.array([10.0, 100.0, 100.0]), 150.0).tolist() == [10.0, 70.0, 70.0]
    assert _shares(np.array([10.0, 20.0]), 1000.0).tolist() == [10.0, 20.0]


def test_the_command_prints_a_table(capsys):
    argv = ["simulate-rollout", "--nodes", "200", "--steps", "5%,25%", "--bakes", "0,60"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "200 nodes" in out
    rows = [line for line in out.splitlines() if line.startswith("|")]
    assert rows[0].split("|")[1:4] == [" step ", " bake s ", " steps "]
    body = [[c.strip() for c in row.split("|")[1:-1]] for row in rows[2:]]
    assert [(b[0], b[1], b[2]) for b in body] == [
        ("5%", "0", "21"),  # 2 canary nodes, then 10 at a time
        ("5%", "60", "21"),
        ("25%", "0", "5"),
        ("25%", "60", "5"),
    ]
    assert body[2][4] == "25.0%"  # 50 nodes share the store: out at once

    assert main([*argv, "--fail-at-step", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("|")]
    headers = [c.strip() for c in rows[0].split("|")[1:-1]]
    first = dict(zip(headers, (c.strip() for c in rows[2].split("|")[1:-1]), strict=True))
    assert (first["failed at step"], first["rolled back"]) == ("1", "12")  # 2 + 10


def test_the_command_names_a_bad_step(capsys):
    assert main(["simulate-rollout", "--steps", "5%,0%"]) == 2
    assert "--steps '0%'" in capsys.readouterr().err
