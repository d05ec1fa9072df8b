"""A short chaos soak (bench/chaos.py): node processes, the router and a whole raylet
are killed and a node process is frozen under mixed load, and every request still ends
with exactly one answer, within max(deadline_s, timeout_s) + 1 s."""

from __future__ import annotations

import pytest
import ray

from bench import chaos

pytestmark = pytest.mark.integration

KINDS = ("node", "router", "raylet", "node-freeze")  # head restarts: the 10-minute soak


@pytest.mark.timeout(420)
def test_every_request_gets_exactly_one_answer_in_time_under_kills_and_freezes(tmp_path):
    if ray.is_initialized():
        ray.shutdown()  # the soak runs its own multi-raylet cluster
    out = tmp_path / "chaos.md"
    figures = chaos.run(
        ["--minutes", "1", "--seed", "7", "--kill-every", "4", "--out", str(out)]
        + ["--kinds", *KINDS]
    )
    report = out.read_text()
    assert figures.error is None, report
    assert figures.sent > 1000, report
    kinds = figures.event_kinds
    assert all(kinds[kind] >= 1 for kind in KINDS), (kinds, report)  # each kind once (the
    # first events are one of each, about 4 s apart; a minute leaves a busy machine time)
    assert figures.no_answer == 0, report
    assert figures.two_answers == 0, report
    assert not figures.untyped and figures.control["untyped"] == 0, report
    assert figures.late == 0, report  # within max(deadline_s, timeout_s) + 1 s
    assert figures.wrong_outputs == 0, report
    assert figures.gen_token_errors == 0 and figures.gen_partial_errors == 0, report
    assert figures.after_end == 0, report
    assert sum(figures.gen_completed.values()) > 0 and figures.gen_exact > 0, report
    assert figures.success_without_run == 0, report
    assert figures.reran_unexplained == 0, report
    assert figures.trace_lines > 0, report
    assert not figures.leaked, report
    assert not figures.still_running and not figures.not_serving, report
    assert figures.passed, report
