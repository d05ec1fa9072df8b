"""The simulation's results container and report (sim/report.py): figures computed from
known answers, the Markdown and PNGs written from them, and a million answers."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from edgefleet.priorities import DEFAULT_PRIORITIES
from sim.report import (
    LATENCY_PNG,
    OUTCOMES,
    QUEUE_PNG,
    Recorder,
    RunResult,
    cdf_points,
    fmt_share,
    md_table,
    series_points,
    write_report,
)

NODES = ["edge-0", "edge-1", "edge-2", "edge-3"]
FG, INLINE, BG = (DEFAULT_PRIORITIES[c] for c in ("foreground", "inline", "background"))


def known_run(label: str = "power_of_two", *, fg_shift_ms: float = 0.0) -> RunResult:
    """Foreground: 100 completed at 1..100 ms (+ shift) and 2 rejected; inline: 1 rejected
    only; background: 2 completed (10, 20 ms), 1 evicted, 1 lost. Nodes busy 10/20/30/40 s
    of 100 s; queue sampled every second."""
    rec = Recorder(NODES, DEFAULT_PRIORITIES)
    for ms in range(1, 101):
        rec.answer(FG, "completed", (ms + fg_shift_ms) / 1000, ms % len(NODES))
    rec.answer(FG, "rejected", 0.0005, -1)
    rec.answer(FG, "rejected", 0.0005, 2)
    rec.answer(INLINE, "rejected", 0.001, 1)
    rec.answer(BG, "completed", 0.010, 3)
    rec.answer(BG, "completed", 0.020, 3)
    rec.answer(BG, "evicted", 0.5, 3)
    rec.answer(BG, "lost", 2.0, -1)
    for node, seconds in enumerate([10.0, 20.0, 30.0, 40.0]):
        rec.busy(node, seconds / 2)
        rec.busy(node, seconds / 2)
    for t in range(101):
        rec.sample(float(t), queued=t % 7, in_flight=t % 11)
    rec.counter("spilled", 3)
    rec.counter("node_failures")
    rec.counter("spilled")
    return RunResult(label, rec, simulated_s=100.0, wall_s=2.0, events=5000)


def test_latency_table_per_class_highest_first_then_all():
    rows = known_run().latency_table()
    assert [(r["name"], r["priority"]) for r in rows] == [
        ("foreground", FG),
        ("inline", INLINE),
        ("background", BG),
        ("all", None),
    ]
    fg, inline, bg, every = rows
    assert (fg["answered"], fg["completed"]) == (102, 100)
    assert fg["p50_ms"] == pytest.approx(50.5)
    assert fg["p99_ms"] == pytest.approx(99.01)
    assert fg["max_ms"] == pytest.approx(100.0)
    assert (inline["answered"], inline["completed"]) == (1, 0)
    assert inline["p50_ms"] is None and inline["p99_ms"] is None and inline["max_ms"] is None
    assert (bg["answered"], bg["completed"]) == (4, 2)
    assert bg["p50_ms"] == pytest.approx(15.0)
    assert bg["max_ms"] == pytest.approx(20.0)
    assert (every["answered"], every["completed"]) == (107, 102)
    both = np.concatenate([np.arange(1, 101), [10, 20]]).astype(float)
    assert every["p99_ms"] == pytest.approx(np.percentile(both, 99))
    assert every["max_ms"] == pytest.approx(100.0)


def test_counts_every_outcome_with_zeros_then_counters():
    counts = known_run().counts()
    assert list(counts)[: len(OUTCOMES)] == list(OUTCOMES)
    assert counts == {
        "completed": 102,
        "rejected": 3,
        "evicted": 1,
        "expired": 0,
        "superseded": 0,
        "cancelled": 0,
        "failed": 0,
        "lost": 1,
        "spilled": 4,
        "node_failures": 1,
    }


def test_utilisation_across_nodes():
    util = known_run().utilisation()
    assert util["mean"] == pytest.approx(0.25)
    assert util["p50"] == pytest.approx(0.25)
    assert util["p99"] == pytest.approx(np.percentile([0.1, 0.2, 0.3, 0.4], 99))
    assert util["max"] == pytest.approx(0.4)
    empty = RunResult("none", Recorder([], DEFAULT_PRIORITIES), 10.0, 1.0, 0)
    assert all(math.isnan(v) for v in empty.utilisation().values())


def test_priorities_without_a_class_are_named_by_number():
    rec = Recorder(NODES, DEFAULT_PRIORITIES)
    rec.answer(5, "completed", 0.002, 0)
    rows = RunResult("x", rec, 1.0, 1.0, 1).latency_table()
    assert [(r["name"], r["priority"]) for r in rows] == [("5", 5), ("all", None)]


def test_recorder_refuses_what_it_cannot_store_or_would_confuse():
    rec = Recorder(NODES, DEFAULT_PRIORITIES)
    with pytest.raises(ValueError, match="outcome"):
        rec.answer(FG, "deadlineexceeded", 0.1, 0)
    with pytest.raises(ValueError, match="node index"):
        rec.answer(FG, "completed", 0.1, len(NODES))
    with pytest.raises(ValueError, match="priority"):
        rec.answer(1000, "completed", 0.1, 0)
    with pytest.raises(ValueError, match="outcome"):
        rec.counter("rejected")
    with pytest.raises(ValueError, match="node index"):
        rec.busy(-1, 1.0)
    assert rec.answers == 0  # nothing half-recorded
    assert len(rec.columns().priority) == 0


def test_columns_are_snapshots_refreshed_after_appending():
    rec = Recorder(NODES, DEFAULT_PRIORITIES)
    rec.answer(FG, "completed", 0.1, 0)
    first = rec.columns()
    assert rec.columns() is first
    rec.answer(BG, "evicted", 0.2, -1)
    second = rec.columns()
    assert second is not first
    assert second.priority.tolist() == [FG, BG]
    assert [OUTCOMES[c] for c in second.outcome] == ["completed", "evicted"]
    assert second.node.tolist() == [0, -1]
    assert len(first.priority) == 1


def report_text(tmp_path: Path, results: list[RunResult], **kwargs: object) -> str:
    path = write_report(tmp_path / "out", results, title="Fleet simulation", **kwargs)  # type: ignore[arg-type]
    assert path == tmp_path / "out" / "report.md"
    for png in (LATENCY_PNG, QUEUE_PNG):
        assert (tmp_path / "out" / png).stat().st_size > 1000
        assert f"]({png})" in path.read_text()
    return path.read_text()


def table_row(text: str, first_cell: str) -> list[str]:
    """The cells of the first table row of ``text`` whose first cell is ``first_cell``."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no table row {first_cell!r}")


def test_report_of_one_run(tmp_path):
    description = ["Config: configs/fleet.yaml", "Workload: bursty, 107 requests, seed 7"]
    text = report_text(tmp_path, [known_run()], description=description)
    assert text.startswith("# Fleet simulation\n")
    assert "- Config: configs/fleet.yaml" in text
    assert "- Workload: bursty, 107 requests, seed 7" in text
    assert "Interrupted" not in text
    assert "## Comparison" not in text
    assert "## Run: power_of_two" in text
    # class, priority, p50, p99, max, completed, answered
    assert table_row(text, "foreground") == [
        "foreground",
        "10",
        "50.5",
        "99.0",
        "100.0",
        "100",
        "102",
    ]
    assert table_row(text, "inline") == ["inline", "7", "-", "-", "-", "0", "1"]
    assert table_row(text, "background") == ["background", "3", "15.0", "19.9", "20.0", "2", "4"]
    assert table_row(text, "all")[-2:] == ["102", "107"]
    assert table_row(text, "expired") == ["expired", "0", "0.0%"]
    assert table_row(text, "lost") == ["lost", "1", "0.9%"]
    assert table_row(text, "completed") == ["completed", "102", "95.3%"]
    assert table_row(text, "spilled") == ["spilled", "4"]
    assert table_row(text, "node_failures") == ["node_failures", "1"]
    assert table_row(text, "25.0%") == ["25.0%", "25.0%", "39.7%", "40.0%"]
    assert "Busiest node: edge-3, 40.0% busy, 28 answers." in text
    assert "Simulated 100.0 s in 2.0 s of wall time (50x real time); 5000 events, " in text
    assert "2,500 events/s; 107 answers." in text
    assert "at most 6; in flight" in text


def test_compare_marks_the_best_of_each_column(tmp_path):
    fast = known_run("power_of_two")
    slow = known_run("round_robin", fg_shift_ms=5.0)
    slow.recorder.answer(BG, "rejected", 0.001, -1)
    slow.recorder.answer(FG, "completed", 0.003, 0)
    text = report_text(tmp_path, [fast, slow])
    assert "## Comparison" in text
    header = table_row(text, "run")
    assert header == ["run", "foreground p99 ms", "all p99 ms", "completed", "rejected", "evicted"]
    assert table_row(text, "power_of_two") == [
        "power_of_two",
        "**99.0**",
        "**99.0**",
        "102",
        "**3**",
        "**1**",
    ]
    assert table_row(text, "round_robin") == [
        "round_robin",
        "104.0",
        "104.0",
        "**103**",
        "4",
        "**1**",
    ]
    assert text.count("## Run: ") == 2


def test_an_interrupted_run_says_so(tmp_path):
    done = known_run("a")
    cut = known_run("b")
    cut.interrupted = True
    text = report_text(tmp_path, [done, cut])
    assert "Interrupted: results so far" in text
    assert table_row(text, "b (interrupted)")[0] == "b (interrupted)"
    assert text.count("Interrupted: results so far") == 2  # the top and run b's section


def test_a_run_without_answers_or_samples_still_reports(tmp_path):
    empty = RunResult("idle", Recorder(NODES, DEFAULT_PRIORITIES), 0.0, 0.0, 0)
    text = report_text(tmp_path, [empty])
    assert table_row(text, "all") == ["all", "-", "-", "-", "-", "0", "0"]
    assert "no samples recorded" in text
    text = report_text(tmp_path, [empty, known_run()])
    assert table_row(text, "idle") == ["idle", "-", "-", "0", "**0**", "**0**"]


def test_no_runs_make_a_report_that_says_so(tmp_path):
    path = write_report(tmp_path, [], title="Fleet simulation", description=["Seed: 1"])
    assert path.read_text() == "# Fleet simulation\n\n- Seed: 1\n\nNo run produced results.\n"


def test_md_table_aligns_numbers_right_including_bold():
    table = md_table(["run", "p99 ms"], [["a", "**9.5**"], ["bb", "10.5"], ["c", None]])
    assert table.splitlines() == [
        "| run |  p99 ms |",
        "| --- | ------: |",
        "| a   | **9.5** |",
        "| bb  |    10.5 |",
        "| c   |       - |",
    ]


def test_shares_neither_vanish_nor_round_up_to_everything():
    assert [fmt_share(p, 20_000) for p in (0, 3, 200, 19_997, 20_000)] == [
        *("0.0%", "<0.1%", "1.0%", ">99.9%", "100.0%")
    ]
    assert fmt_share(0, 0) == "-"


def test_plot_points_are_bounded():
    lat = np.random.default_rng(0).exponential(0.01, 1_000_000)
    x, y = cdf_points(lat)
    assert len(x) <= 501
    assert np.all(np.diff(x) >= 0) and np.all(np.diff(y) > 0)
    assert y[-1] == 1.0 and x[-1] == pytest.approx(1000 * lat.max())
    t = np.arange(10_000, dtype=float)
    values = np.arange(10_000) % 100
    ts, vs = series_points(t, values, limit=1000)
    assert len(ts) <= 1000 and vs.max() == 99 and ts[0] == 0.0
    assert series_points(t[:10], values[:10])[1].tolist() == list(range(10))


def test_a_million_answers_fit_and_report(tmp_path):
    n = 1_000_000
    rec = Recorder(NODES, DEFAULT_PRIORITIES)
    rng = np.random.default_rng(1)
    priorities = rng.choice([FG, INLINE, BG], n).tolist()
    latencies = rng.exponential(0.02, n).tolist()
    answer = rec.answer
    for i in range(n):
        answer(priorities[i], "completed" if i % 10 else "rejected", latencies[i], i % 4)
    for t in range(36_000):
        rec.sample(t / 10, t % 50, t % 80)
    for node in range(len(NODES)):
        rec.busy(node, 1800.0)
    assert rec.answers == n
    assert rec.nbytes < 100 * 2**20
    cols = rec.columns()
    assert sum(a.nbytes for a in vars(cols).values()) < 100 * 2**20
    result = RunResult("big", rec, simulated_s=3600.0, wall_s=10.0, events=3 * n)
    assert result.counts()["rejected"] == n // 10
    text = report_text(tmp_path, [result])
    assert table_row(text, "all")[-2:] == [str(n - n // 10), str(n)]
