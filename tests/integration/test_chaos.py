"""A one-minute chaos soak (bench/chaos.py): node processes, the router and a whole
raylet are killed under mixed load, and every request still ends with exactly one
answer."""

from __future__ import annotations

import pytest
import ray

from bench import chaos

pytestmark = pytest.mark.integration


@pytest.mark.timeout(420)
def test_every_request_gets_exactly_one_answer_under_kills(tmp_path):
    if ray.is_initialized():
        ray.shutdown()  # the soak runs its own multi-raylet cluster
    out = tmp_path / "chaos.md"
    figures = chaos.run(["--minutes", "1", "--seed", "7", "--out", str(out)])
    report = out.read_text()
    assert figures.error is None, report
    assert figures.sent > 1000, report
    kinds = figures.kill_kinds
    assert all(kinds[kind] >= 1 for kind in chaos.KINDS), (kinds, report)  # each kind once
    assert figures.no_answer == 0, report
    assert figures.two_answers == 0, report
    assert not figures.untyped and figures.control["untyped"] == 0, report
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
